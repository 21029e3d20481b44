"""The training loop: `Trainer(cfg, out_dir).run()` from config to checkpoint.

Each optimizer step draws the global batch from the device-side sampler, splits
this process's share into micro-batches, accumulates gradients, clips, and steps
AdamW at the learning rate the run's `Schedule` gives (sonata.train.schedule: warm-up and
cosine over steps or over a time budget; it also says when the run ends). The batch,
accumulation and precision come from the run's frozen `Plan` (sonata.train.plan); the
MemoryGuard wraps each step (sonata.train.memory); data parallel adds DDP and the agreements
of sonata.train.distributed (after each step a `StepAgreement`); the run's bookkeeping is one
`RunRecord` (sonata.train.record), which the summary (sonata.train.summary) and the early stops
(sonata.train.stops, through a `RunHandle`) read: neither takes the Trainer. docs/architecture.md
describes how the pieces fit.
"""
from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from sonata import kernels
from sonata.core import checkpoint as ckpt
from sonata.core import inject
from sonata.core.config import Config, resolve_profile
from sonata.core.device import check_precision, resolve_device, sync
from sonata.core.errors import CheckpointError, SonataError
from sonata.data.batches import BatchSampler, build_corpus
from sonata.train import distributed
from sonata.train import stops
from sonata.train.distributed import Ranks, StepAgreement
from sonata.train.autotune import choose_plan
from sonata.train.evaluate import EvalResult, evaluate_stream
from sonata.train.leak import InjectedLeak, LeakDetector
from sonata.train.memory import (MemoryBudgetExceeded, MemoryGuard, available_ram_bytes, current_bytes,
                                 refuse_over_budget, device_total_bytes, peak_memory_bytes, release_free_memory, steady_cpu_heap)
from sonata.core.progress import Progress
from sonata.core.rng import rng_state, seed_everything, set_rng_state
from sonata.data.tasks import TaskSampler, evaluate_task, make_task
from sonata.data.vocab import Vocab
from sonata.model import families
from sonata.model.lm import MambaLM, build_model, count_params
from sonata.model.quant import set_int8
from sonata.train.plan import Plan, plan_batch, resumed_inputs
from sonata.train.record import RunRecord
from sonata.train.schedule import Schedule, continue_in_steps
from sonata.train.summary import Throughput, int8_report, run_summary, write_summary
from sonata.train.tensorboard_log import TensorBoardLog
from sonata.train.update import Updater

def _data(cfg: Config, vocab_state: dict | None, device, budget_bytes: int, progress):
    """(task, corpus): a synthetic task's fresh sequences, or a corpus (language modeling; a
    resumed run, or one from another run's weights, keeps that checkpoint's vocabulary)."""
    if cfg.task.name:
        return make_task(cfg.task), None
    vocab = Vocab.from_state_dict(vocab_state) if vocab_state else None
    return None, build_corpus(cfg.data, device, vocab=vocab, progress=progress, budget_bytes=budget_bytes)


def _plan(t, state: dict | None, profile, world: int, device) -> Plan:
    """The run's batch plan (a resume's: the checkpoint's, but for what the user changed), its
    precision checked on `device`; a fixed micro-batch says so (and that autotuning is off)."""
    asked = resumed_inputs(t, state["config"], state.get("plan"), world) if state else t
    plan = plan_batch(asked, profile, world)
    check_precision(plan.precision, device)
    if t.fixed_micro_batch:             # stacklevel 3: the line that made the Trainer
        warnings.warn(f"sonata: micro-batch {plan.how}", UserWarning, stacklevel=3)
        if t.autotune:
            warnings.warn("sonata: train.autotune is ignored: train.fixed_micro_batch is set",
                          UserWarning, stacklevel=3)
    return plan


def check_fits(cfg: Config, micro_batch: int, budget_bytes: int, what: str) -> None:
    """Before the model is built: a MemoryBudgetExceeded when the run certainly needs more than the
    memory budget (`what` says where it comes from). The parameters are counted on the meta device
    (no memory; one block per family, `count_params`), and the bytes counted are a floor of what training holds: float32 weights,
    gradients and AdamW's two moments, plus one micro-batch's logits and their gradient. A size a
    typo made (model.d_model=960000, train.micro_batch=10^9) is one error line, not an allocation
    that fails inside PyTorch or a process the kernel kills."""
    from sonata.train.memory import fmt_mib
    try:
        params = count_params(cfg)
    except SonataError:
        raise
    except Exception as e:          # noqa: BLE001 - sizes past what PyTorch can index, say
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        raise SonataError(f"the model of these model.* settings cannot be built ({type(e).__name__}: {first})") from None
    weights = 16 * params
    logits = 8 * micro_batch * cfg.data.seq_len * cfg.model.vocab_size
    if weights + logits > budget_bytes:
        raise MemoryBudgetExceeded(
            f"this run needs at least {fmt_mib(weights + logits)} (a model of {params:,} parameters with its "
            f"gradients and AdamW's moments: {fmt_mib(weights)}; one micro-batch of {micro_batch} x "
            f"{cfg.data.seq_len} tokens' logits over {cfg.model.vocab_size:,} tokens: {fmt_mib(logits)}), "
            f"over the budget of {fmt_mib(budget_bytes)} ({what})",
            "make the model or the micro-batch smaller, or raise profile.memory_budget_mb",
            budget_bytes=budget_bytes, used_bytes=weights + logits)


def _arch_of(state: dict) -> str | None:
    """A checkpoint's model.arch (its layer list for a hybrid), or None when it holds no config."""
    m = (state.get("config") or {}).get("model") or {}
    return m.get("layers") or m.get("arch")


def weights_misfit(model: torch.nn.Module, weights: dict, arch: str | None = None, model_cfg=None) -> str | None:
    """What keeps `weights` (a state dict) from loading into `model`, in one phrase naming the first
    misfit: a key whose shape differs (the weights' shape, the model's), or the keys that one side
    lacks (with both architectures when known: `arch`, the weights' model.arch or layer list, and
    `model_cfg`, the model's ModelConfig); None when they fit."""
    own = model.state_dict()
    for k, t in own.items():
        w = weights.get(k)
        if isinstance(w, torch.Tensor) and tuple(w.shape) != tuple(t.shape):
            return (f"{k} is {_shape(w)} in the checkpoint and {_shape(t)} in this model "
                    f"(compare the model.* settings they were made with)")
    missing = [k for k in own if k not in weights]
    extra = [k for k in weights if k not in own]
    if not (missing or extra):
        return None
    mine = (model_cfg.layers or model_cfg.arch) if model_cfg is not None else None
    archs = (f" (the checkpoint's model is {arch}, this one {mine})" if arch and mine and arch != mine
             else f" (the checkpoint's model is {arch})" if arch else "")
    parts = []
    if missing:
        parts.append(f"{len(missing)} of this model's weights are not in the checkpoint, the first {missing[0]}")
    if extra:
        parts.append(f"{len(extra)} of the checkpoint's are not in this model, the first {extra[0]}")
    return "; ".join(parts) + archs


def load_initial_weights(model: torch.nn.Module, model_state: dict, model_cfg, arch: str | None = None) -> None:
    """Another run's weights into `model` (the optimizer, schedule and data start afresh).
    Weights of another architecture or shape are a CheckpointError naming the first misfit
    (`weights_misfit`; `arch`: the weights' model.arch, named when the keys differ), and so is an
    untied head loaded into a tied model (it would overwrite the embedding it shares)."""
    head, emb = model_state.get("lm_head.weight"), model_state.get("embedding.weight")
    if (model_cfg.tie_embeddings and head is not None and emb is not None and head is not emb
            and not torch.equal(head, emb)):
        raise CheckpointError("the initial weights have their own output head (untied): train with "
                              "model.tie_embeddings=false")
    misfit = weights_misfit(model, model_state, arch, model_cfg)
    if misfit:
        raise CheckpointError(f"the initial weights do not fit this model: {misfit}")
    try:
        model.load_state_dict(model_state)
    except (RuntimeError, KeyError) as e:
        raise CheckpointError(f"the initial weights do not fit this model: {str(e).splitlines()[0][:200]}") from None


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(n) for n in t.shape) + ")"


def _from_record(name: str, doc: str) -> property:
    """A read-only Trainer attribute that is the record's (`trainer.record`)."""
    return property(lambda tr: getattr(tr.record, name), doc=doc)


class Trainer:
    """trainer = Trainer(cfg, out_dir); trainer.run() -> summary dict.

    `state`: a checkpoint's dict to resume from (budgeted: in steps, `continue_in_steps`),
    `source` its file (never pruned by train.keep_checkpoints; in another folder, its metrics
    rows start this run's); `init`: a checkpoint's dict whose weights and vocabulary start a
    new run (`train --init`); `progress`: auto | bar | lines | none. `trainer.plan` is what
    the run trains with; `cfg` stays what was asked (but a resumed budgeted run's train.*).
    `trainer.record` (sonata.train.record) is the run's bookkeeping: step, tokens, history,
    timings, what it resumed from, what ended it; `trainer.ranks` this process's place in a
    data-parallel run (rank, world, is_main)."""

    step = _from_record("step", "Optimizer steps done (a resumed run's included).")
    tokens = _from_record("tokens", "Tokens trained on, over every rank.")
    history = _from_record("history", "The metrics rows of run()'s steps, one a step.")
    counters = _from_record("counters", "Skipped updates: nonfinite_steps, scaler_skipped_steps.")
    ended_by = _from_record("ended_by", 'After run(): "time" (the budget) or "steps".')
    train_seconds = property(lambda tr: tr.schedule.train_seconds, doc="Time inside optimizer steps, resumes added.")
    optimizer = property(lambda tr: tr.update.optimizer, doc="AdamW (the Updater's).")
    scaler = property(lambda tr: tr.update.scaler, doc="fp16's GradScaler, disabled otherwise (the Updater's).")

    def __init__(self, cfg: Config, out_dir=None, state: dict | None = None, progress: str | None = None,
                 source=None, init: dict | None = None):
        families.validate(cfg)             # every key's range, then what the block families need
        if state:
            cfg = replace(cfg, train=continue_in_steps(cfg.train, state)).validate()
        self.cfg = cfg
        t = cfg.train
        dctx = distributed.init_from_env(t.device)       # world 1 without torchrun: nothing
        self.ranks = ranks = Ranks(dctx.rank, dctx.world)
        self._net = None              # the DistributedDataParallel wrapper (world > 1, from run())
        self._threads = t.threads or (distributed.local_threads(dctx.local_world)
                                      if ranks.parallel and (dctx.device is None or dctx.device.type == "cpu")
                                      else 0)     # per rank on CPU: cores // processes on this machine
        if self._threads:
            torch.set_num_threads(self._threads)
        if not ranks.is_main:
            progress = "none"
        self.device = dctx.device if ranks.parallel else resolve_device(t.device)
        self.profile = resolve_profile(cfg.profile, self.device.type, available_ram_bytes(),
                                       device_total_bytes(self.device))
        self.plan: Plan = _plan(t, state, self.profile, ranks.world, self.device)
        self.guard = MemoryGuard(self.profile.memory_budget_bytes, self.device,
                                 what=("profile.memory_budget_mb" if cfg.profile.memory_budget_mb else
                                       f"profile {self.profile.name}: {self.profile.budget_source}"))
        self.leak = LeakDetector()
        self.injected_leak = InjectedLeak(cfg.debug.leak)     # debug.leak: the micro-step hook
        self.before_step: list = []                           # hooks(trainer) run before each step
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.progress_mode = progress
        self.task, self.corpus = _data(cfg, (state or init or {}).get("vocab"), self.device,
                                       self.profile.memory_budget_bytes, progress)
        vocab_size = self.task.vocab_size if self.task else len(self.corpus.vocab)
        self.cfg = cfg = replace(cfg, model=replace(cfg.model, vocab_size=vocab_size))   # the caller's stays
        check_fits(cfg, self.plan.micro_batch, self.profile.memory_budget_bytes, self.guard.what)
        seed_everything(t.seed)
        self.model = build_model(cfg).to(self.device)
        set_int8(self.model, self.plan.precision == "int8")
        if init:
            self.start_from(init["model"], _arch_of(init))
        # micro-steps, clip, the optimizer step or its skip (AdamW, fp16's GradScaler)
        self.update = Updater(self.model, cfg, self.device, self.plan.precision, self.task, self.injected_leak)
        self.sampler = (TaskSampler(self.task, cfg.data.seq_len, seed=t.seed, device=self.device,
                                    curriculum=cfg.task.curriculum) if self.task
                        else BatchSampler(self.corpus.train, cfg.data.seq_len, seed=t.seed, device=self.device))
        self.record = RunRecord.starting(state, self.update.counters, source)   # the run's bookkeeping
        self.schedule = Schedule(t)   # the learning rate, the budget, when to stop
        self._step_start_state = None   # (sampler, rng) at the start of the step in progress (DDP)
        if state:
            self.load_state_dict(state)
            if self.record.autotune:
                self.plan = self.plan.with_batch(self.plan.micro_batch,
                                                 "autotuned before step 1 (recorded in the checkpoint)")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything a resume needs: what a checkpoint holds."""
        rec = self.record
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
                "scheduler": {"kind": "warmup_cosine", "step": rec.step},
                "step": rec.step, "micro_step": rec.step * self.plan.accumulation * self.ranks.world,
                "world_size": self.ranks.world,
                "tokens": rec.tokens, **self.schedule.state_dict(), "counters": dict(rec.counters),
                "consecutive_nonfinite": self.update.consecutive_nonfinite,
                "sampler": self.sampler.state_dict(), "rng": rng_state(),
                "vocab": self.corpus.vocab.state_dict() if self.corpus else None, "config": self.cfg.to_dict(),
                "plan": self.plan.to_dict(), "last_row": rec.last_row,
                "launch_id": distributed.launch_id(),   # which launch wrote it (restarts resume only their own)
                "profile": self.profile.to_dict(), "autotune": rec.autotune}

    def load_state_dict(self, state: dict) -> None:
        """Back at `state_dict()`'s `state` (the plan is resolved in __init__); a state that does
        not fit is a CheckpointError."""
        try:
            self.model.load_state_dict(state["model"])
            self.update.load_optimizer(state["optimizer"])
            if state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            self.sampler.load_state_dict(state["sampler"])
            self.record.resume(state)
            self.schedule.load_state_dict(state)
            self.update.consecutive_nonfinite = int(state.get("consecutive_nonfinite", 0))
            set_rng_state(state["rng"])
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            raise CheckpointError(f"checkpoint {self.record.resumed_from_file or ''} does not match this "
                                  f"configuration: {str(e).splitlines()[0][:200]}") from None
        self.optimizer.zero_grad(set_to_none=True)

    def start_from(self, model_state: dict, arch: str | None = None) -> None:
        """A new run from another run's weights (`train --init`, notebook 08's second phase): the
        model's parameters, nothing else (`load_initial_weights`)."""
        load_initial_weights(self.model, model_state, self.cfg.model, arch)

    def model_is_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def save_checkpoint(self, path=None, any_rank: bool = False) -> Path | None:
        """Atomic save; a model with NaN/Inf weights is never written over a good checkpoint.
        Rank 0 writes (the state is the same on every rank) unless `any_rank` (a survivor
        of a lost peer). With train.keep_checkpoints=K the last K are also kept by step."""
        path = Path(path) if path else self.out_dir / "checkpoint.pt"
        if not (self.ranks.is_main or any_rank):
            return path
        if not self.model_is_finite():
            warnings.warn(f"sonata: model has non-finite weights at step {self.record.step}; "
                          f"checkpoint {path} left as it was", RuntimeWarning, stacklevel=2)
            return None
        t0 = time.perf_counter()
        ckpt.save(self.state_dict(), path)
        if self.cfg.train.keep_checkpoints and path.name == "checkpoint.pt":
            ckpt.keep_last(path, self.record.step, self.cfg.train.keep_checkpoints,
                           keep=(self.record.resumed_from_file,))
        self.record.checkpoint_seconds.append(time.perf_counter() - t0)
        self.record.last_checkpoint_at = time.monotonic()
        return path

    def _checkpoint_due(self, final: bool) -> bool:
        """Every train.checkpoint_every steps, and when train.checkpoint_every_s passed since
        the last checkpoint (the final one is written at the end of run())."""
        t = self.cfg.train
        if not self.out_dir or final:
            return False
        return bool((t.checkpoint_every and self.record.step % t.checkpoint_every == 0) or
                    (t.checkpoint_every_s and time.monotonic() - self.record.last_checkpoint_at >= t.checkpoint_every_s))

    # ------------------------------------------------------------------ one step
    def train_step(self, plan: Plan | None = None) -> dict:
        """One optimizer step under `plan` (default: the run's); a non-finite loss or
        gradient skips the update (counted). Returns the step's metrics row."""
        plan = plan or self.plan
        ddp = plan.world_size > 1
        net = self._net if ddp and self._net is not None else self.model
        if ddp:     # a peer lost inside this step: the survivors save the state of its start
            self._step_start_state = (self.sampler.state_dict(), rng_state())
        sync(self.device)
        t0 = time.perf_counter()
        lr = self._set_lr()
        # the global batch's offsets, this rank's shard of rows (the whole batch at world 1)
        x, y = self.sampler.draw(plan.effective_batch, shard=(self.ranks.rank, self.ranks.world) if ddp else (0, 1))
        loss, gnorm, skipped = self.update(net, x, y, plan)
        if self._threads and torch.get_num_threads() != self._threads:
            # numba's OpenMP layer resets the OpenMP thread count when its pool starts (the
            # first fused-kernel call): set ours again, so train.threads / threads per rank hold
            torch.set_num_threads(self._threads)
        sync(self.device)                       # the clock is read only once the device is done
        dt = time.perf_counter() - t0
        n_tok = plan.effective_batch * x.shape[1]          # x: this rank's rows; a task's length may vary
        rec = self.record
        rec.step_seconds = dt
        rec.step += 1
        rec.tokens += n_tok
        self._step_start_state = None
        row = {"step": rec.step, "loss": loss, "lr": lr, "tokens": rec.tokens, "step_tokens": n_tok,
               "tok_per_s": n_tok / dt, "step_s": dt, "grad_norm": gnorm,
               "skipped": skipped, "fallbacks": kernels.fallback_count()}
        if self.cfg.debug.leak != "none":
            row["debug_leak"] = self.cfg.debug.leak
        return row

    def _set_lr(self) -> float:
        lr = self.schedule.lr(self.record.step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    # ------------------------------------------------------------------ batch plan
    def apply_autotune(self, progress: str | None = None) -> dict:
        """Measure the profile's candidates (the trainer's state is restored after) and
        train with the choice (data parallel: rank 0's, broadcast). Returns the result
        as a dict; raises SonataError when no candidate is eligible."""
        with self._bar(len(self.profile.candidates), "autotune", progress) as bar:
            self.plan, self.record.autotune = choose_plan(
                self.train_step, self.state_dict, self.load_state_dict, profile=self.profile, plan=self.plan,
                device=self.device, seq_len=self.cfg.data.seq_len, is_main=self.ranks.is_main, progress=bar)
        return self.record.autotune

    def _bar(self, total: int, what: str, progress: str | None = None):
        return contextlib.closing(Progress(total, what, self.progress_mode if progress is None else progress))

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, max_tokens: int | None = None, model: MambaLM | None = None,
                 split: str = "validation", by_position: bool = False):
        """Validation loss and bits per byte (the whole split unless train.eval_tokens or
        `max_tokens` limit it); data parallel: sharded over the ranks, summed. `split`
        "train": the same figures on the start of the training stream. `by_position`: also
        the loss at each position of the window (one process). A task: loss and accuracy on
        its fixed validation sequences at the training length (TaskEval)."""
        t = self.cfg.train
        if self.task:
            k = self.cfg.task
            return evaluate_task(model or self.model, self.task, self.cfg.data.seq_len, k.eval_seqs,
                                 k.eval_seed, chunked=families.bounded_state(self.cfg.model))
        stream = {"validation": self.corpus.val, "train": self.corpus.train}[split]
        byte_len = torch.from_numpy(self.corpus.vocab.byte_lengths).to(self.device)    # UTF-8 bytes of each token
        return evaluate_stream(model or self.model, stream, byte_len, self.cfg.data.seq_len,
                               max(16, self.plan.micro_batch), t.eval_tokens if max_tokens is None else max_tokens,
                               self.plan.precision, (self.ranks.rank, self.ranks.world), by_position)

    def _timed_evaluate(self):
        t0 = time.perf_counter()
        try:
            return self.evaluate()
        finally:
            self.record.eval_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ the loop
    def run(self, on_step=None) -> dict:
        """Train until the schedule says the run is over (train.max_steps, or a time budget of
        train.max_seconds of training time: sonata.train.schedule) -> the summary. `on_step(trainer,
        row)` may add fields to each row; train.eval_every stays in steps.

        One run per folder: the run folder's lock (`checkpoint.run_folder_lock`) is held from the
        first write to the last, so a second run into the folder, from the command line, a
        notebook or a script, is refused with one line naming this one (and this one is refused
        while another holds it)."""
        self.check_budget()
        with (ckpt.run_folder_lock(self.out_dir) if self.out_dir is not None and self.ranks.is_main
              else contextlib.nullcontext()):
            return self._run(on_step)

    def check_budget(self) -> None:
        """A MemoryBudgetExceeded when this process already holds more than the memory budget, said
        before the run writes a file (`memory.refuse_over_budget`)."""
        refuse_over_budget(self.device, self.profile.memory_budget_bytes, self.guard.what)

    def _run(self, on_step) -> dict:
        t, sch, rec = self.cfg.train, self.schedule, self.record
        run = self._handle()                     # what the early stops need of this run
        t_start = time.perf_counter()
        with stops.on_lost_peer(run):            # autotuning and DDP's construction talk to the peers too
            self._prepare()
        rec.setup_seconds = time.perf_counter() - t_start       # autotuning, DDP, kernel warm-up
        metrics = (ckpt.MetricsLog.for_run(self.out_dir, self.record.step, self.record.resumed_last_row,
                                           self.record.resumed_from_file)
                   if self.out_dir and self.ranks.is_main else None)
        tboard = TensorBoardLog(self.out_dir) if metrics and t.tensorboard else None
        speed = Throughput()
        last_eval: EvalResult | None = None
        try:
            with self._bar(*sch.bar(rec.step)) as bar, stops.StopSignal() as stop, \
                    stops.on_lost_peer(run):                   # inside: signals are still only flagged
                while not sch.finished(rec.step):
                    # one optimizer step inside the memory guard (learning rate from the schedule)
                    row, agreed = self._guarded_step(stop)
                    speed.add(row, row["step_tokens"], rec.counters["nonfinite_steps"], agreed.peak_bytes)
                    # follow memory (the leak detector warns once), then the caller's hook
                    if self.leak.follow(row["mem_bytes"], row["step_tokens"]):
                        warnings.warn(f"sonata: {self.leak.message()} (step {rec.step})", RuntimeWarning,
                                      stacklevel=3)
                    if self.leak.enough:
                        row["mem_slope_bytes_per_step"] = self.leak.slope()
                    if on_step is not None:
                        on_step(self, row)
                    # evaluate when due, and after the last step
                    final = sch.finished(rec.step, row)
                    if (t.eval_every and rec.step % t.eval_every == 0) or final:
                        last_eval = self._timed_evaluate()
                        row.update(last_eval.fields())
                    # log: the row to the record, to metrics.jsonl (and TensorBoard) when due; a
                    # checkpoint carries a logged row of its step: a resume writes it when the
                    # file lacks it (rank 0 died after the step, a survivor saved)
                    due = rec.step % t.log_every == 0 or final or "val_loss" in row or row["skipped"]
                    rec.add(row, logged=due)
                    if metrics and due:
                        metrics.write(row)
                        if tboard:
                            tboard.write(row)
                    # stop on divergence; checkpoint when due; stop on a signal (after saving)
                    stops.diverged(run, self.update.consecutive_nonfinite, t.max_nonfinite)
                    if self._checkpoint_due(final):
                        self.save_checkpoint()
                    bar.update(sch.bar_units(bar), loss=row["loss"], **{"tok/s": round(row["tok_per_s"])},
                               **({"val_bpb": row["val_bpb"]} if "val_bpb" in row else {}))
                    if agreed.signum is not None:
                        stops.interrupted(run, agreed.signum)
        except MemoryBudgetExceeded as e:
            raise stops.memory_tripped(run, e, speed, metrics) from None
        except KeyboardInterrupt:
            # a second Ctrl-C mid-step: the step may be half-applied, so keep the last
            # periodic checkpoint rather than writing this state over it
            rec.emergency_reason = "KeyboardInterrupt"
            raise
        finally:
            if metrics:
                metrics.close()
            if tboard:
                tboard.close()
        rec.ended_by = sch.ended_by
        sch.warn_if_capped()
        with stops.on_lost_peer(run):            # the final evaluation and the peaks are collectives
            inject.exit_point("finish", self.ranks.rank)      # test-only; nothing when unset
            last_eval = last_eval or self._timed_evaluate()
            # the final checkpoint (rank 0), then the summary: its wall time runs from t_start to
            # after that checkpoint, so it holds every part it lists
            if self.out_dir and self.ranks.is_main:
                self.save_checkpoint()
            return self._summary(last_eval, speed, time.perf_counter() - t_start)

    def _prepare(self) -> None:
        """Before the first step: autotune when asked, the DDP wrapper, clean counters."""
        t = self.cfg.train
        kernels.reset_fallback_count()
        if self.device.type == "cpu":
            steady_cpu_heap()
        release_free_memory(self.device)
        if t.autotune and not t.fixed_micro_batch and self.record.autotune is None:
            self.apply_autotune()
        if t.max_seconds and self._net is None:        # (a DDP-wrapped model is warm already)
            self.update.warm(self.plan, self.cfg.data.seq_len)
        rank = self.ranks.rank
        if self.ranks.parallel and self._net is None:
            inject.exit_point("prepare", rank)                # test-only; nothing when unset
            self._net = distributed.wrap(self.model, self.device)
        hook = inject.trip_hook(rank) if self.ranks.parallel else None      # test-only; None when unset
        if hook is not None:
            self.before_step.append(hook)
        self.leak.warned = False
        self.record.last_checkpoint_at = time.monotonic()
        self.record.ended_by = None
        self.schedule.start()

    def _guarded_step(self, stop: stops.StopSignal | None = None) -> tuple[dict, StepAgreement]:
        """One step inside the memory guard -> (its row, the StepAgreement: peak memory so far,
        the step's peak, the signal to stop on from `stop`, run()'s flag, and the step's time).
        Data parallel: the guard's checks and the agreement are over every rank (a collective)."""
        for hook in self.before_step:
            hook(self)
        sch = self.schedule
        progress = sch.progress() if sch.budgeted else None      # what the step's rate is set from
        signum = (lambda: stop.signum) if stop is not None else (lambda: None)
        agree = (distributed.step_agreement(signum, lambda: self.record.step_seconds) if self.ranks.parallel
                 else None)
        row = None
        try:
            with self.guard.watch(self.record.step, agree) as watch:
                row = self.record.last_row = self.train_step()   # the same dict gains its fields below
        except MemoryBudgetExceeded:
            if row is not None:          # the step completed; the check after it tripped: it counts,
                row["mem_bytes"] = current_bytes(self.device)        # with its readings like any row
                row["step_peak_bytes"] = self.guard.peak_last
                sch.count(row["step_s"], row, progress)
            raise
        agreed = watch.agreed or StepAgreement(peak_memory_bytes(self.device), watch.peak, signum(),
                                               self.record.step_seconds)
        row["mem_bytes"], row["step_peak_bytes"] = watch.mem_bytes, agreed.step_peak_bytes
        sch.count(agreed.step_seconds, row, progress)     # data parallel: every rank counts the same time
        return row, agreed

    # ------------------------------------------------------------------ what run() hands over
    def _handle(self) -> stops.RunHandle:
        return stops.RunHandle(record=self.record, out_dir=self.out_dir, ranks=self.ranks, device=self.device,
                               save=self.save_checkpoint, drop_step=self._drop_step, roll_back=self._roll_back_step)

    def _drop_step(self) -> None:
        """After a memory trip: the debug leak and the failed step's gradients dropped."""
        self.injected_leak.clear()
        self.optimizer.zero_grad(set_to_none=True)

    def _roll_back_step(self) -> None:
        """A peer lost inside a step: the sampler and RNGs back at the step's start, its gradients
        dropped (the model and optimizer are untouched); between steps nothing to do."""
        if self._step_start_state is not None:
            sampler, rng = self._step_start_state
            self.sampler.load_state_dict(sampler)
            set_rng_state(rng)
            self.optimizer.zero_grad(set_to_none=True)

    def _summary(self, last_eval, speed: Throughput, wall_s: float) -> dict:
        """The run's summary (an int8 run's report added), written to summary.json by rank 0."""
        out = self.out_dir if self.ranks.is_main else None
        summary = run_summary(
            self.record, last_eval, speed, wall_s, cfg=self.cfg, plan=self.plan, profile=self.profile,
            device=self.device, world=self.ranks.world, params=self.model.num_params(), guard=self.guard,
            leak_report=self.leak.report(), train_seconds=self.schedule.train_seconds,
            data=self.corpus.summary() if self.corpus else self.task.summary(self.cfg.data.seq_len))
        if self.plan.precision == "int8":
            summary.update(int8_report(self.model, self.evaluate, self.device, out))
        return write_summary(summary, out)
