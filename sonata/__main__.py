"""Command line: python -m sonata train | prepare | autotune | bench | generate | eval | export | import.

    python -m sonata train [--out DIR] [--resume CHECKPOINT | --init CHECKPOINT] [--nproc N] [key=value ...]
    python -m sonata prepare [--progress MODE] [key=value ...]
    python -m sonata autotune [--json] [key=value ...]
    python -m sonata bench [--steps N] [--json] [key=value ...]
    python -m sonata generate CHECKPOINT|DIR [--prompt TEXT] [--n N] [--max-new-tokens N]
    python -m sonata eval CHECKPOINT|DIR --text FILE [--json] [--device auto|cpu|cuda]
    python -m sonata eval CHECKPOINT --lengths L,L,... [--n N] [--n-long N] [--budget-s S] [--json]
    python -m sonata export CHECKPOINT --hf DIR [--force]
    python -m sonata import DIR --out CHECKPOINT [--force]

A user mistake (unknown key, bad value, missing or corrupt file, empty corpus,
unsafe checkpoint, an output or cache folder that cannot be written, a full disk)
ends with exit status 2 and one line starting `error:`.

Data parallel: `python -m sonata train --nproc N ...` starts N worker processes
(sonata.launch, torch's elastic launcher) and keeps that contract: rank
0's output only, exit 2 and one `error:` line when a worker fails. Under
`torchrun --nproc_per_node=N -m sonata train ...` the workers keep it too (rank 0
prints, the others stay silent and exit 2 on an agreed stop), but torchrun itself
then exits 1 and prints its own ChildFailedError report after the `error:` line.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from sonata.core.jsonsafe import finite_json
from sonata.core.errors import CheckpointError, SonataError, TrainingInterrupted, WorkerLost, writable_dir
from sonata.core.progress import MODES, resolve_mode

EXIT_USAGE = 2
MAX_EVAL_LENGTH = 2 ** 24   # eval --lengths: 16,777,216 tokens, 16x the longest length of the paper grid


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        raise SonataError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m sonata", description="Train and sample a tiny Mamba LM.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    tr = sub.add_parser("train", help="train a model; writes DIR/metrics.jsonl and DIR/checkpoint.pt")
    tr.add_argument("--out", help="output folder (default: runs/<time>, or the resumed run's folder)")
    tr.add_argument("--resume", help="checkpoint to continue from")
    tr.add_argument("--force", action="store_true",
                    help="start a new run in an --out folder that holds a run, removing that run's files")
    tr.add_argument("--init", metavar="CHECKPOINT",
                    help="start a new run from a checkpoint's weights (fresh optimizer, schedule and data)")
    tr.add_argument("--progress", default=None, help=" | ".join(MODES))
    tr.add_argument("--nproc", type=int, default=None,
                    help="data-parallel worker processes on this machine (the global batch is "
                         "train.effective_batch); default 1")
    tr.add_argument("--max-restarts", type=int, default=0,
                    help="with --nproc: restart the workers up to N times when one fails; they resume "
                         "from the survivors' checkpoint (default 0)")
    tr.add_argument("overrides", nargs="*", help="config overrides as section.key=value")
    pr = sub.add_parser("prepare", help="build (or reuse) the token cache of a data configuration; "
                                         "one summary line per split")
    pr.add_argument("--progress", default=None, help=" | ".join(MODES))
    pr.add_argument("overrides", nargs="*", help="config overrides as section.key=value (data.*)")
    at = sub.add_parser("autotune", help="measure the profile's candidate micro-batches, print the table")
    at.add_argument("--json", action="store_true", help="print the result as JSON")
    at.add_argument("--progress", default=None, help=" | ".join(MODES))
    at.add_argument("overrides", nargs="*", help="config overrides as section.key=value")
    be = sub.add_parser("bench", help="measure tokens/s twice with its validity checks; VALID or INVALID")
    be.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 24)")
    be.add_argument("--warmup", type=int, default=None, help="steps excluded from timing (default 3)")
    be.add_argument("--window", type=int, default=None, help="steps per timing window (default 5)")
    be.add_argument("--json", action="store_true", help="print the record as JSON")
    be.add_argument("overrides", nargs="*", help="config overrides as section.key=value")
    ge = sub.add_parser("generate", help="sample stories from a checkpoint")
    ge.add_argument("checkpoint")
    ge.add_argument("--prompt", default="Once upon a time")
    ge.add_argument("--n", type=int, default=3)
    ge.add_argument("--max-new-tokens", type=int, default=200)
    ge.add_argument("--temperature", type=float, default=0.8)
    ge.add_argument("--top-k", type=int, default=40)
    ge.add_argument("--seed", type=int, default=0)
    ev = sub.add_parser("eval", help="validation loss and bits per byte of a checkpoint on a UTF-8 text file; "
                                     "a synthetic task's checkpoint: accuracy per test length")
    ev.add_argument("checkpoint")
    ev.add_argument("--text", metavar="FILE",
                    help="UTF-8 text; stories separated by <|endoftext|> (or one story)")
    ev.add_argument("--lengths", metavar="L,L,...",
                    help="a task checkpoint: test lengths, e.g. 64,256,1024 (2^k: 64,...,1048576)")
    ev.add_argument("--n", type=int, default=256, help="sequences per test length up to 65,536 (default 256)")
    ev.add_argument("--n-long", type=int, default=32, help="sequences per test length above 65,536 (default 32)")
    ev.add_argument("--seed", type=int, default=1234, help="the test sequences' seed (default 1234)")
    ev.add_argument("--budget-s", type=float, default=0.0,
                    help="skip a length whose estimated time passes this many seconds, and the longer ones "
                         "(default 0: run every length)")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")
    ev.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    ex = sub.add_parser("export", help="write a checkpoint as a transformers MambaForCausalLM or "
                                       "Mamba2ForCausalLM folder")
    ex.add_argument("checkpoint")
    ex.add_argument("--hf", required=True, metavar="DIR", help="output folder (config.json, model.safetensors, ...); "
                                                                 "a new or empty one")
    ex.add_argument("--force", action="store_true", help="replace DIR and everything in it if it is not empty")
    im = sub.add_parser("import", help="write a transformers Mamba or Mamba-2 folder as a sonata checkpoint "
                                       "(for train --init)")
    im.add_argument("folder", metavar="DIR")
    im.add_argument("--out", required=True, metavar="CHECKPOINT", help="the checkpoint file to write")
    im.add_argument("--force", action="store_true", help="replace CHECKPOINT if it exists")
    sub.add_parser("doctor", help="which backend each kernel family runs on this machine, and why")
    return p


def _train_inputs(args):
    """Everything `train` is given, read and checked before anything is written: the option
    combinations, the --resume and --init files loaded, the overrides applied to the config they
    change (the checkpoint's on --resume) -> (cfg, state, init). Each failure a SonataError."""
    import os

    from sonata.core import checkpoint as ckpt
    from sonata.core.config import Config, apply_overrides

    if args.init and args.resume:
        raise SonataError("--init starts a new run from weights, --resume continues a run: use one")
    if args.nproc is not None:
        if args.nproc < 1:
            raise SonataError("--nproc must be >= 1")
        if args.nproc > 1 and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
            raise SonataError("--nproc cannot be used inside torchrun (the workers are already started)")
    if args.max_restarts < 0:
        raise SonataError(f"--max-restarts must be >= 0, not {args.max_restarts}")
    state = ckpt.load(args.resume) if args.resume else None
    init = ckpt.load(args.init) if args.init else None
    if init is not None and "model" not in init:
        raise CheckpointError(f"--init {args.init} holds no model weights")
    cfg = Config.from_dict(state["config"]) if state else Config()
    vocab = init["config"]["data"]["vocab_size"] if init and init.get("vocab") else None
    if vocab:                               # a run from its weights keeps its vocabulary
        cfg.data.vocab_size = vocab
    apply_overrides(cfg, args.overrides)
    if vocab and cfg.data.vocab_size != vocab:
        raise SonataError(f"--init {args.init} has the vocabulary of data.vocab_size={vocab}, which a run "
                          f"from its weights keeps: drop data.vocab_size={cfg.data.vocab_size}")
    return cfg, state, init


def _build_trainer(args, cfg, state, init, out):
    """The run's Trainer, built (data, model, the checkpoint's state) without writing a file: a
    checkpoint that does not fit is one CheckpointError."""
    from sonata.train.trainer import Trainer

    try:
        return Trainer(cfg, out, state=state, progress=args.progress, source=args.resume, init=init)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        if isinstance(e, SonataError) or not (state or init):
            raise
        raise CheckpointError(f"checkpoint {args.resume or args.init} does not fit this version of sonata "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})") from None


def cmd_train(args) -> int:
    """Every input is read and checked, and the Trainer built, before the first file is created,
    removed or replaced: a command that ends with exit 2 leaves every folder as it was. Then,
    with the run folder's lock held, the folder is claimed (--force removes another run's files;
    resuming an older copy with --force discards the later state) and the run starts."""
    import contextlib
    import os

    from sonata.core import checkpoint as ckpt
    from sonata.train import distributed

    out = args.out or (str(Path(args.resume).parent) if args.resume
                       else f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        cfg, state, init = _train_inputs(args)
        distributed.check_launch_id()
    except SonataError as e:
        e.agreed = True                      # every rank reads the same arguments and files: rank 0 says it
        raise
    rank0 = int(os.environ.get("RANK", "0") or 0) == 0
    restarted = distributed.restart_count()
    if args.nproc is not None and args.nproc > 1:
        # the launcher: its workers build the run; it checks the folder, holds its lock and starts them
        # (rank 0 claims the folder once its Trainer is built, as a single process does)
        writable_dir(out, "output folder")
        with ckpt.run_folder_lock(out):
            _check_claim(out, args, state)
            argv = ["train", "--out", out] + (["--resume", args.resume] if args.resume else []) + \
                   (["--init", args.init] if args.init else []) + (["--force"] if args.force else []) + \
                   (["--progress", args.progress] if args.progress else []) + list(args.overrides)
            from sonata.launch import launch
            os.environ[ckpt.RUN_LOCKED_ENV] = str(Path(out).resolve())   # this process holds it
            return launch(args.nproc, argv, max_restarts=args.max_restarts)
    if restarted and (Path(out) / "checkpoint.pt").exists():
        # a worker restarted by torchrun / --max-restarts continues from the run's checkpoint,
        # if this launch wrote it: a checkpoint another run left in a reused --out is not this
        # run's (its workers start over, from --resume or --init as given, or from scratch)
        path = Path(out) / "checkpoint.pt"
        mine = ckpt.load(path).get("launch_id") == distributed.launch_id()
        if mine:                             # its weights are in there
            args.resume, args.init = str(path), None
            from sonata.core.config import Config, apply_overrides
            state, init = ckpt.load(path), None
            cfg = apply_overrides(Config.from_dict(state["config"]), args.overrides)
        if rank0:
            print(f"restart {restarted}: resuming from {path}" if mine else
                  f"restart {restarted}: {path} was written by another run, not resumed", flush=True)
    try:
        trainer = _build_trainer(args, cfg, state, init, out)
        trainer.check_budget()
        if rank0:
            writable_dir(out, "output folder")   # the first write: the folder, proven writable
    except SonataError as e:
        _print_error(e, agreed=True)   # the same arguments and files on every rank: rank 0 says it
        return EXIT_USAGE
    # the folder is locked for the whole run, before --force removes anything of another's
    with ckpt.run_folder_lock(out) if rank0 else contextlib.nullcontext():
        if restarted == 0 and rank0:         # a restarted worker continues its own launch's run
            _check_claim(out, args, state)
            ckpt.claim_run_folder(out, args.resume, args.force)
            # resuming an older copy in its folder: --out branches, --force discards the later state
            note = ckpt.claim_for_resume(args.resume, state, out, args.force) if state else None
            if note:
                print(note, flush=True)
        summary = trainer.run()
    if not distributed.is_main():
        return 0
    keys = ("steps", "tokens", "val_loss", "val_bpb", "val_acc", "tok_per_s_sustained", "backend", "fallbacks",
            "train_seconds", "stopped_by")
    print(finite_json({k: summary[k] for k in keys if k in summary}))
    print(_wrote(Path(out), trainer))
    return 0


def _check_claim(out, args, state) -> None:
    """The folder's claim judged without touching it: refused (one SonataError) unless it may go on."""
    from sonata.core import checkpoint as ckpt

    if not args.force:
        ckpt.claim_run_folder(out, args.resume, force=False)
        if state is not None:
            ckpt.claim_for_resume(args.resume, state, out, force=False)


def _wrote(out: Path, trainer) -> str:
    """The line naming the run's files that exist (a model with non-finite weights is never
    checkpointed: the line says so instead of naming a file that was not written)."""
    names = [n for n in ("metrics.jsonl", "checkpoint.pt", "summary.json") if (out / n).exists()]
    line = "wrote " + ", ".join(f"{out}/{n}" for n in names)
    if not trainer.model_is_finite():
        line += ("; no checkpoint of this run: its weights are not finite"
                 if "checkpoint.pt" not in names else
                 f"; {out}/checkpoint.pt is the last one with finite weights (the final weights are not finite)")
    return line


def cmd_prepare(args) -> int:
    from sonata.core.config import make_config
    from sonata.data.token_cache import prepare

    cfg = make_config(args.overrides)
    prep = prepare(cfg.data, progress=args.progress)
    for line in prep.lines():
        print(line)
    return 0


def _single_process(command: str, instead: str) -> None:
    """autotune and bench measure one process; under torchrun every rank would run them."""
    import os
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise SonataError(f"'{command}' runs in one process, not under torchrun; {instead}")


def cmd_autotune(args) -> int:
    _single_process("autotune", "for data-parallel runs use 'train train.autotune=true' "
                                "(rank 0 tunes and broadcasts its choice)")
    from sonata.core.config import make_config
    from sonata.lab.plots import table
    from sonata.train.autotune import AutotuneResult
    from sonata.train.trainer import Trainer

    cfg = make_config(args.overrides)
    trainer = Trainer(cfg, None, progress=args.progress)
    res = trainer.apply_autotune() if not cfg.train.fixed_micro_batch else None
    if res is None:
        raise SonataError("train.fixed_micro_batch is set: there is nothing to autotune")
    if args.json:
        print(finite_json(res))
        return 0
    p = trainer.profile
    print(f"profile {p.name}: budget {p.memory_budget_mb:,} MiB ({p.budget_source}), "
          f"max micro-batch {p.max_micro_batch}, effective batch {res['effective_batch']}, "
          f"precision {trainer.plan.precision}, device {trainer.device}, threads {torch_threads()}")
    r = AutotuneResult(**res)
    print(repr(table(r.rows())))
    print(f"chosen: micro-batch {r.micro_batch} x accumulation {r.accumulation} = "
          f"{r.effective_batch} ({r.reason}); measured in {r.wall_s:.1f} s")
    return 0


def cmd_bench(args) -> int:
    _single_process("bench", "run it without torchrun")
    from sonata.lab import bench
    from sonata.lab.plots import table

    steps = bench.DEFAULT_STEPS if args.steps is None else args.steps
    warmup = bench.DEFAULT_WARMUP if args.warmup is None else args.warmup
    window = bench.DEFAULT_WINDOW if args.window is None else args.window
    if steps < 1 or warmup < 0 or window < 1:
        raise SonataError("--steps and --window must be >= 1 and --warmup >= 0")
    rec = bench.run_bench(args.overrides, steps=steps, warmup=warmup, window=window)
    if args.json:
        print(finite_json(rec.to_dict(runs=False)))
        return 0
    print(f"{rec.hardware}; device {rec.device}, {rec.threads} threads, precision {rec.precision}, "
          f"backend {rec.backend}, micro-batch {rec.micro_batch} x {rec.accumulation}")
    print(repr(table([rec.summary_row()])))
    print(f"verdict: {rec.verdict}" + "".join(f"\n  - {r}" for r in rec.reasons))
    return 0


def torch_threads() -> int:
    import torch
    return torch.get_num_threads()


def cmd_generate(args) -> int:
    from sonata.lab.generate import load_text_model, stream_text
    from sonata.model import families

    if args.n < 1 or args.max_new_tokens < 0:
        raise SonataError("--n must be >= 1 and --max-new-tokens >= 0")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise SonataError(f"--temperature must be a finite number >= 0 (0: greedy), not {args.temperature}")
    if args.top_k < 0:
        raise SonataError(f"--top-k must be >= 0 (0: the whole vocabulary), not {args.top_k}")
    model, vocab, cfg = load_text_model(args.checkpoint)
    if not families.recurrent(cfg.model):
        steppers = ", ".join(k for k, f in families.FAMILIES.items() if f.steps)
        raise SonataError(f"generation needs every layer to step one token at a time ({steppers}); this model is "
                          f"model.arch={cfg.model.arch} ({','.join(cfg.model.kinds)})")
    for i in range(args.n):             # streamed: each piece printed as soon as it is sampled
        print(f"--- sample {i + 1}\n{args.prompt}", end="", flush=True)
        for piece in stream_text(model, vocab, args.prompt, args.max_new_tokens, args.temperature,
                                 args.top_k, args.seed + i):
            print(piece, end="", flush=True)
        print(flush=True)
    return 0


def cmd_eval(args) -> int:
    from sonata.core.device import resolve_device
    from sonata.lab.generate import load_model
    from sonata.train.evaluate import evaluate_file, trained_precision

    if args.device not in ("auto", "cpu", "cuda"):
        raise SonataError(f"--device must be auto, cpu or cuda, not {args.device!r}")
    device = resolve_device(args.device)
    model, vocab, cfg = load_model(args.checkpoint, device)
    if cfg.task.name:
        return _eval_task(args, model, cfg)
    if args.text is None:
        raise SonataError("eval needs --text FILE for a language model (--lengths is for task checkpoints)")
    precision = trained_precision(args.checkpoint, device)     # the trainer's figures for int8, bf16
    r = evaluate_file(model, vocab, args.text, cfg.data.seq_len, precision=precision)
    if args.json:
        print(finite_json({"loss": r.loss, "bpb": r.bpb, "tokens": r.tokens, "bytes": r.bytes,
                          "stories": r.stories, "coverage": r.coverage, "seq_len": cfg.data.seq_len,
                          "precision": precision}))
        return 0
    print(f"{args.text}: {r.stories:,} stories, {r.tokens:,} tokens predicted, {r.bytes:,} bytes "
          f"(vocabulary of {len(vocab):,}, coverage {r.coverage:.4f}, windows of {cfg.data.seq_len}, "
          f"precision {precision})")
    print(f"validation loss: {r.loss:.4f} nats/token")
    print(f"bits per byte: {r.bpb:.4f}")
    return 0


def _eval_task(args, model, cfg) -> int:
    """Accuracy per test length of a synthetic task's checkpoint (one line per length as it is
    done, or one JSON object)."""
    from sonata.data.tasks import accuracy_by_length, make_task

    task = make_task(cfg.task)
    if args.text is not None:
        raise SonataError(f"{args.checkpoint} is a model of the task {task.name!r}: score it with --lengths, not --text")
    try:
        lengths = [int(v) for v in (args.lengths or str(cfg.data.seq_len)).split(",") if v.strip()]
    except ValueError:
        raise SonataError(f"--lengths must be comma-separated integers, not {args.lengths!r}") from None
    if not lengths or min(lengths) < task.min_length:
        raise SonataError(f"--lengths: each length must be at least {task.min_length} for the task {task.name!r}")
    if max(lengths) > MAX_EVAL_LENGTH:
        raise SonataError(f"--lengths: each length must be at most {MAX_EVAL_LENGTH:,} (2^24) tokens, "
                          f"not {max(lengths):,}")
    for length in lengths:                  # a task's own limits (mqar: a key per pair)
        try:
            task.check_length(length)
        except ValueError as e:
            raise SonataError(f"--lengths: {e}") from None
    if args.n < 1 or args.n_long < 1 or args.budget_s < 0:
        raise SonataError("--n and --n-long must be >= 1 and --budget-s >= 0")
    if not args.json:
        trained = (f"trained on the curriculum {cfg.task.curriculum}" if cfg.task.curriculum
                   else f"trained at length {cfg.data.seq_len:,}")
        print(f"{args.checkpoint}: task {task.name}, model.arch={cfg.model.arch}, {trained}; "
              f"chance {task.chance():.4f}")

    def show(r):
        if args.json:
            return
        if r["accuracy"] is None:
            print(f"length {r['length']:>9,}: {r['note']}", flush=True)
        else:
            print(f"length {r['length']:>9,}: accuracy {r['accuracy']:.4f} on {r['sequences']} sequences, "
                  f"loss {r['loss']:.4f}, {r['seconds']:.1f} s, peak resident {r['peak_rss_mib']:,} MiB",
                  flush=True)
    rows = accuracy_by_length(model, task, lengths, args.n, args.n_long, args.seed, args.budget_s, on_row=show)
    if args.json:
        print(finite_json({"task": task.name, "arch": cfg.model.arch, "train_length": cfg.data.seq_len,
                          "chance": task.chance(), "rows": rows}))
    return 0


def cmd_export(args) -> int:
    from sonata.interop.hf import HF_CLASSES, export_hf, hf_family
    from sonata.lab.generate import load_text_model

    model, vocab, cfg = load_text_model(args.checkpoint)
    if cfg.model.arch == "gpt2":
        raise SonataError("model.arch=gpt2 is transformers' own GPT-2; sonata exports mamba and mamba2 models")
    cls = HF_CLASSES[hf_family(cfg.model)]           # lti, attention, hybrids: one error line
    out = export_hf(model, vocab, args.hf, cfg, force=args.force)
    print(f"wrote {out}: config.json, model.safetensors, generation_config.json, vocab.json, README.md "
          f"({model.num_params():,} parameters; load with transformers.{cls}.from_pretrained)")
    return 0


def cmd_import(args) -> int:
    from sonata.interop.hf import import_checkpoint, train_overrides

    out, model, cfg = import_checkpoint(args.folder, args.out, force=args.force)
    print(f"wrote {out} ({model.num_params():,} parameters, model.arch={cfg.model.arch}); train from it with:\n"
          f"python -m sonata train --init {out} {' '.join(train_overrides(cfg))}")
    return 0


def cmd_doctor(args) -> int:
    from sonata.kernels.doctor import report

    for line in report():
        print(line)
    return 0


def _dist():
    """sonata.train.distributed if this process imported it (a train run), else None."""
    return sys.modules.get("sonata.train.distributed")


def _print_error(e: BaseException, agreed: bool = False) -> None:
    """One `error:` line. Data parallel: an error every rank raised (an agreed stop, bad
    input) is printed by rank 0 only; one that only this rank met names the rank (a
    lost peer always)."""
    r = _dist().rank() if _dist() else 0
    if r and (agreed or getattr(e, "agreed", False)):
        return
    named = r or isinstance(e, WorkerLost)
    _say(f"error: {f'rank {r}: ' if named else ''}{e}", r, lost_peer=isinstance(e, WorkerLost))


def _say(line: str, rank: int, lost_peer: bool = False) -> None:
    """A final `error:` line: printed, and reported to sonata's launcher when it started this
    worker (sonata.launch); a line that only says a peer was lost is left to the launcher."""
    from sonata import launch
    launch.report(rank, line, lost_peer)
    if not (lost_peer and launch.under_launcher()):
        print(line, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    together = False       # every rank leaves at this point: wait for the others (rank 0's message)
    try:
        code = _run(argv)
        together = True
        return code
    except TrainingInterrupted as e:
        _print_error(e)
        together = e.agreed
        return 128 + e.signum
    except SonataError as e:
        _print_error(e)
        together = e.agreed
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        d = _dist()
        if not (d and d.active() and d.is_comm_error(e)):
            raise
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        _say(f"error: rank {d.rank()}: lost contact with another process of the run "
             f"(it failed or stopped; its own message says why): {first}", d.rank(), lost_peer=True)
        return EXIT_USAGE
    finally:
        if _dist():
            _dist().shutdown(barrier=together)


def _run(argv=None) -> int:
    args, extra = _parser().parse_known_args(argv)
    # overrides may come after options (`--progress none train.lr=1e-3`)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        raise SonataError(f"unrecognized arguments: {' '.join(extra)}")
    if args.command in ("train", "prepare", "autotune", "bench"):
        resolve_mode(getattr(args, "progress", None))   # a bad mode stops here, before any work or worker
    return {"train": cmd_train, "prepare": cmd_prepare, "autotune": cmd_autotune, "bench": cmd_bench,
            "generate": cmd_generate, "eval": cmd_eval, "export": cmd_export,
            "import": cmd_import, "doctor": cmd_doctor}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
