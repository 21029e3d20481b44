"""The studies of notebooks 02 and 07, each returning records (the notebook writes
the sentences around them):

- `sustained_and_peak`: a training run under its profile against a fixed-batch
  micro-benchmark, three readings each;
- `measure_scaling`: 1 against N data-parallel processes at one global batch;
- `speedrun`: configurations trained under the same time budget, with their
  validation curves (notebook 07);
- `step_speed`: the seed model's bare training step (forward, loss, backward, AdamW) per
  scan backend, beside mambapy's model and the scan-free peer, in interleaved rounds
  (notebook 00 and benchmarks/train_speed.py).

A cell a run was too short to measure holds `too_few_steps`'s words; `sonata.bench.ratio`
divides two cells, or gives None for such a cell.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from sonata.config import ModelConfig, make_config
from sonata.device import sync
from sonata.errors import DataError
from sonata.kernels import cross_entropy, fallback_count, resolve_backend
from sonata.timing import saved_tensor_bytes
from sonata.memory import steady_cpu_heap, too_few_steps
from sonata.model import MambaLM
from sonata.peers import mambapy_lm
from sonata.sources import resolve_source
from sonata.summary import MEASURE_SKIP
from sonata.trainer import Trainer


def sustained_and_peak(overrides, sustained_steps: int, peak_micro: int, peak_steps: int,
                       progress: str | None = None) -> list[dict]:
    """The dossier's two figures, measured side by side on this machine:

    - *sustained*: a training run under the profile's default batch (micro-batch within
      the cap, accumulation up to the effective batch), `sustained_steps` steps with
      its validation and checkpointing as configured;
    - *peak micro-benchmark*: `train.fixed_micro_batch=peak_micro` (no cap), a few
      steps, no validation until the end and that on one window.

    Each row gives three readings: end to end (tokens / wall time of the whole run),
    steps only (the trainer's sustained figure: step time alone, warm-up excluded) and
    the single best step."""
    runs = [("sustained (profile default)", list(overrides) + [f"train.max_steps={sustained_steps}"]),
            (f"peak micro-benchmark (fixed micro-batch {peak_micro})",
             list(overrides) + [f"train.max_steps={peak_steps}", f"train.fixed_micro_batch={peak_micro}",
                                "train.eval_every=0", "train.eval_tokens=1"])]
    rows = []
    for name, ov in runs:
        cfg = make_config(ov)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)     # the fixed-batch warning: this row says it
            tr = Trainer(cfg, None, progress=progress)
        s = tr.run()
        steps = [r["tok_per_s"] for r in tr.history[MEASURE_SKIP:]] or [r["tok_per_s"] for r in tr.history]
        step_s = sum(r["step_s"] for r in tr.history)
        rows.append({"run": name, "profile": tr.profile.name,
                     "micro x accum": f"{s['micro_batch']} x {s['accumulation']}",
                     "steps": s["steps"], "tokens": s["tokens"],
                     "end-to-end tok/s": round(s["tokens"] / s["wall_s"]),
                     "steps-only tok/s": (too_few_steps(MEASURE_SKIP + 1) if s["tok_per_s_sustained"] is None
                                          else round(s["tok_per_s_sustained"])),
                     "best step tok/s": round(max(steps)),
                     "outside steps s": round(s["wall_s"] - step_s, 2)})
    return rows


def measure_scaling(overrides, nprocs=(1, 2), steps: int = 20, timeout: float = 1800,
                    use_torchrun: bool = False) -> list[dict]:
    """Data-parallel scaling on this machine at a fixed GLOBAL batch (strong scaling).

    For each n in `nprocs`, runs `python -m sonata train --nproc n` (or torchrun with
    `use_torchrun`) with `overrides` plus train.max_steps=`steps` into a temporary
    folder and reads its summary.json and metrics.jsonl. Rows: processes, global and
    per-process tokens/s (sustained: the first steps excluded), median step time
    (ms), final loss, threads per process, micro-batch x accumulation."""
    rows = []
    for n in nprocs:
        with tempfile.TemporaryDirectory(prefix=f"sonata-scaling-{n}-") as tmp:
            args = ["train", "--out", tmp, "--progress", "none", *overrides,
                    f"train.max_steps={steps}"]
            if use_torchrun and n > 1:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc_per_node={n}", "-m", "sonata", *args]
            else:
                cmd = [sys.executable, "-m", "sonata", *args] + ([] if n == 1 else ["--nproc", str(n)])
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if r.returncode != 0:
                err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
                raise RuntimeError(f"{n} process(es): exit {r.returncode}: "
                                   f"{err[0] if err else r.stderr[-500:]}")
            s = json.loads((Path(tmp) / "summary.json").read_text())
            metrics = [json.loads(ln) for ln in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        step_s = sorted(m["step_s"] for m in metrics[MEASURE_SKIP:]) or sorted(m["step_s"] for m in metrics)
        tps = s["tok_per_s_sustained"]
        few = too_few_steps(MEASURE_SKIP + 1)
        rows.append({"processes": n, "tok/s global": few if tps is None else round(tps),
                     "tok/s per process": few if tps is None else round(tps / n),
                     "step time ms": round(1000 * step_s[len(step_s) // 2], 1),
                     "final loss": round(metrics[-1]["loss"], 4),
                     "threads per process": s.get("threads"),
                     "micro x accum": f"{s['micro_batch']} x {s['accumulation']}",
                     "global batch": s["effective_batch"]})
    return rows


# Notebook 07's configurations: config overrides on top of the default configuration
# (d_model 96, 2 layers, vocabulary 512, lr 3e-3, the profile's batch, weight decay 0.1).
SPEEDRUN = {
    "default": {},
    "wider": {"model.d_model": 128},
    "deeper": {"model.n_layers": 4},
    "vocab1024": {"data.vocab_size": 1024},
    "vocab2048": {"data.vocab_size": 2048},
    "lr1e-3": {"train.lr": 1e-3},
    "lr6e-3": {"train.lr": 6e-3},
    "batch8": {"train.effective_batch": 8},
    "batch32": {"train.effective_batch": 32},
    "wd0": {"train.weight_decay": 0.0},
    "wd0.3": {"train.weight_decay": 0.3},
    "vocab2048-lr6e-3": {"data.vocab_size": 2048, "train.lr": 6e-3},   # the two best levers of a 200 s run together
}


# The ten-minute race (benchmarks/race.py, issue 29): sonata against transformers' GPT-2 at
# equal parameters (333,216 and 329,920), the same 2048-token vocabulary, data, context (128),
# global batch (16) and time budget, all through sonata's trainer (the same sampler and seed:
# the same batches). The GPT's learning rate is swept so the baseline is not a straw man;
# AdamW betas (0.9, 0.95) as GPT-2 recipes use, weight decay 0.1 on matrices (both models).
# sonata's levers: bf16 (the precision AVX-512 BF16 / AMX hosts multiply natively), a
# 256-token context at 8 sequences per step (the same 2,048 tokens per step; a Mamba's cost
# is linear in the context), and 512 at 4; weight decay 0.3 (the runs see the sample 50-80
# times). sonata's best, sonata-bf16-ctx512-wd0.3, is make train's real-text default
# (sonata.config.TRAIN_DEFAULTS, with train.precision=fast: bf16 only where it is native).
RACE_COMMON = {"data.vocab_size": 2048, "train.effective_batch": 16}
GPT2_RACE = {"model.arch": "gpt2", "model.d_model": 80, "model.n_layers": 2, "model.n_heads": 4,
             "train.beta2": 0.95}
RACE = {
    "sonata": {**RACE_COMMON, "train.lr": 6e-3},                       # the real-text defaults before issue 29
    "sonata-bf16": {**RACE_COMMON, "train.lr": 6e-3, "train.precision": "bf16"},
    "sonata-ctx256": {**RACE_COMMON, "train.lr": 6e-3, "data.seq_len": 256,
                      "train.effective_batch": 8},                     # the same tokens per step
    "sonata-bf16-ctx256": {**RACE_COMMON, "train.lr": 6e-3, "train.precision": "bf16",
                           "data.seq_len": 256, "train.effective_batch": 8},
    "sonata-bf16-ctx256-wd0.3": {**RACE_COMMON, "train.lr": 6e-3, "train.precision": "bf16",
                                 "data.seq_len": 256, "train.effective_batch": 8, "train.weight_decay": 0.3},
    "sonata-bf16-ctx512": {**RACE_COMMON, "train.lr": 6e-3, "train.precision": "bf16",
                           "data.seq_len": 512, "train.effective_batch": 4},
    "sonata-bf16-ctx512-wd0.3": {**RACE_COMMON, "train.lr": 6e-3, "train.precision": "bf16",
                                 "data.seq_len": 512, "train.effective_batch": 4, "train.weight_decay": 0.3},
    "gpt2-lr3e-3": {**RACE_COMMON, **GPT2_RACE, "train.lr": 3e-3},
    "gpt2-lr6e-3": {**RACE_COMMON, **GPT2_RACE, "train.lr": 6e-3},
    "gpt2-lr1e-2": {**RACE_COMMON, **GPT2_RACE, "train.lr": 1e-2},
    "gpt2-lr6e-3-wd0.3": {**RACE_COMMON, **GPT2_RACE, "train.lr": 6e-3, "train.weight_decay": 0.3},
}


STUDY07 = {**SPEEDRUN, **RACE}      # every configuration notebook 07 can run, by name


def race_conclusion(rows: list[dict]) -> str:
    """Who won the race, by how much, at what speed, from its measured rows."""
    ours = [r for r in rows if not r["configuration"].startswith("gpt2")]
    gpts = [r for r in rows if r["configuration"].startswith("gpt2")]
    if not ours or not gpts:
        return "the race needs a sonata row and a gpt2 row"
    a, b = min(ours, key=lambda r: r["val bpb"]), min(gpts, key=lambda r: r["val bpb"])
    who = "sonata" if a["val bpb"] < b["val bpb"] else "GPT-2"
    return (f"best sonata: {a['configuration']} {a['val bpb']:.4f} bits per byte ({a['params']:,} parameters, "
            f"{a['tokens/s']:,} tokens/s); best GPT-2: {b['configuration']} {b['val bpb']:.4f} "
            f"({b['params']:,} parameters, {b['tokens/s']:,} tokens/s): {who} wins by "
            f"{abs(a['val bpb'] - b['val bpb']):.4f} bits per byte")


def speedrun_source(data_source: str) -> tuple[str, str]:
    """The data.source for notebook 07's `data_source` and one line saying what it is:
    `tinystories` is $SONATA_TINYSTORIES or the hub, and the embedded corpus when
    neither can be read here (the line says so and why); `embedded` is the embedded corpus."""
    if data_source == "embedded":
        return "embedded", "data: the embedded corpus (data/stories.txt)"
    try:
        resolve_source("tinystories")
    except DataError as e:
        return "embedded", (f"data: TinyStories is not available here ({e}); "
                            f"using the embedded corpus instead")
    local = os.environ.get("SONATA_TINYSTORIES")
    return "tinystories", f"data: TinyStories ({local if local else 'from the Hugging Face hub'})"


@dataclass
class Speedrun:
    rows: list = field(default_factory=list)      # one per configuration (the table)
    curves: dict = field(default_factory=dict)    # name -> [(training seconds, validation bpb)]
    positions: dict = field(default_factory=dict)  # name -> validation loss (nats/token) at each window position


def speedrun(names, budget_s: float, source: str = "embedded", curve_points: int = 8, seed: int = 0,
             out_dir=None, progress: str | None = None, configs: dict | None = None) -> Speedrun:
    """Train each named configuration (`configs`, default SPEEDRUN) for `budget_s`
    seconds of training time (train.max_seconds, no step cap) on data.source `source`.

    Each run is validated on the whole validation split at `curve_points` evenly spaced
    moments of its budget (the last at its end); the curve is validation bits per byte
    against training seconds (evaluation excluded). Each row: parameters, tokens/s
    (tokens over training seconds), steps, epochs (tokens trained / tokens in the
    training stream), training bits per byte (the start of the training stream, as
    many tokens as the validation split), validation bits per byte and the gap between
    them; `positions[name]`: the final validation loss at each position of the window
    (`position_table`). With `out_dir`, each run writes its folder `out_dir/<name>` (metrics.jsonl,
    checkpoint.pt, summary.json)."""
    configs = SPEEDRUN if configs is None else configs
    result = Speedrun()
    for name in names:
        changes = configs[name]
        cfg = make_config({"data.source": source, "train.max_seconds": float(budget_s), "train.max_steps": 0,
                           "train.eval_every": 0, "train.seed": seed, **changes})
        trainer = Trainer(cfg, Path(out_dir) / name if out_dir else None, progress=progress)
        points: list = []
        every = budget_s / curve_points
        due = [every]

        def validate_on_time(tr, row, points=points, due=due):
            if row["progress"] < 1.0 and row["train_s"] >= due[0]:      # the last step validates itself
                ev = tr.evaluate()
                row.update(val_loss=ev.loss, val_bpb=ev.bpb)
                points.append((row["train_s"], ev.bpb))
                due[0] = (int(row["train_s"] / every) + 1) * every

        s = trainer.run(on_step=validate_on_time)
        points.append((s["train_seconds"], s["val_bpb"]))
        train = trainer.evaluate(max_tokens=s["val_tokens"], split="train")
        result.positions[name] = trainer.evaluate(by_position=True).position_loss
        result.curves[name] = points
        result.rows.append({
            "configuration": name,
            "changes": ", ".join(f"{k}={v}" for k, v in changes.items()) or "-",
            "params": s["params"], "tokens/s": round(s["tokens"] / s["train_seconds"]),
            "steps": s["steps"], "epochs": round(s["tokens"] / s["data"]["tokens_train"], 2),
            "train s": round(s["train_seconds"], 1),
            "train bpb": round(train.bpb, 4), "val bpb": round(s["val_bpb"], 4),
            "gap": round(s["val_bpb"] - train.bpb, 4)})
        del trainer
        gc.collect()
    return result


POSITION_SPANS = ((0, 8), (8, 32), (32, 128), (128, 256), (256, 512))


def position_table(positions: dict) -> list[dict]:
    """One row per run: its mean validation loss (nats per token) over spans of window
    positions (the first 8 tokens of a window, 8-31, 32-127, ...; a span past a run's
    window is blank), so a model that loses early in its context, late, or uniformly shows
    which. Every run's tokens are the same validation text under the same vocabulary."""
    longest = max((len(p) for p in positions.values()), default=0)
    spans = [(a, b) for a, b in POSITION_SPANS if a < longest]
    rows = []
    for name, losses in positions.items():
        row = {"configuration": name}
        for a, b in spans:
            part = losses[a:b]
            row[f"positions {a}-{b - 1}"] = round(sum(part) / len(part), 4) if len(part) == b - a else ""
        rows.append(row)
    return rows


def speedrun_conclusion(rows: list[dict], budget_s: float) -> str:
    """Notebook 07's conclusion, written from its measured rows."""
    best = min(rows, key=lambda r: r["val bpb"])
    lines = [f"best under {budget_s:g} s of training: {best['configuration']} ({best['changes']}) at "
             f"{best['val bpb']:.4f} validation bits per byte, {best['steps']:,} steps, "
             f"{best['epochs']:g} epochs"]
    default = next((r for r in rows if r["configuration"] == "default"), None)
    if default is not None and default is not best:
        lines.append(f"the default reached {default['val bpb']:.4f}: {best['configuration']} is "
                     f"{default['val bpb'] - best['val bpb']:.4f} bits per byte better")
    if len(rows) > 1:
        fast = max(rows, key=lambda r: r["tokens/s"])
        gap = max(rows, key=lambda r: r["gap"])
        lines.append(f"fastest: {fast['configuration']} at {fast['tokens/s']:,} tokens/s; "
                     f"largest train/validation gap: {gap['configuration']} ({gap['gap']:+.4f} bits per byte, "
                     f"{gap['epochs']:g} epochs)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the bare training step

STEP_SEED = dict(d_model=96, n_layers=2, d_state=16, vocab_size=512)   # the dossier's model
STEP_SEQ_LEN = 128
STEP_PEERS = ("peer-free", "mambapy")    # the columns every model is compared with


def step_model(name: str, device="cpu") -> torch.nn.Module:
    """The seed model, seeded: sonata with scan backend `name`, mambapy's model (`mambapy`), or
    mambapy's model with its scan replaced by `sonata.peers.free_scan` (`peer-free`: what its
    step costs when the scan costs nothing)."""
    torch.manual_seed(0)
    if name in STEP_PEERS:
        return mambapy_lm(STEP_SEED["d_model"], STEP_SEED["n_layers"], STEP_SEED["d_state"],
                          STEP_SEED["vocab_size"], device, scan_free=name == "peer-free")
    return MambaLM(ModelConfig(backend=name, **STEP_SEED)).to(device)


def _step_loss(model, x, y) -> torch.Tensor:
    """The forward and cross-entropy of the seed model's step: sonata's loss kernel for sonata's
    model (as its trainer runs it), PyTorch's for the peers."""
    if isinstance(model, MambaLM):
        return cross_entropy(model(x), y, model.cfg.backend)
    return F.cross_entropy(model(x).reshape(-1, STEP_SEED["vocab_size"]), y.reshape(-1))


def train_step(model, x, y):
    """-> step(): one plain training step on the fixed batch (x, y): zero_grad, forward,
    cross-entropy, backward, AdamW (PyTorch's fused kernel, as sonata's trainer runs it, for
    every model alike)."""
    dev = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=dev.type in ("cpu", "cuda"))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = _step_loss(model, x, y)
        loss.backward()
        opt.step()
        return loss
    return step


def race_step(name: str, seed: int = 0):
    """-> (step(), tokens per step): one training step of race configuration `name`
    (sonata.studies.RACE) at its global batch, context, vocabulary and precision, on a fixed
    random batch: forward under the run's autocast, sonata's loss kernel on float32 logits (as
    the trainer computes every model's loss), backward, fused AdamW with the trainer's parameter groups.
    The model is built as the trainer builds it (`sonata.model.build_model`), seeded."""
    from dataclasses import replace

    from sonata.config import resolve_profile
    from sonata.device import autocast_for
    from sonata.model import build_model, param_groups
    from sonata.plan import resolve_precision
    cfg = make_config(RACE[name])
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=cfg.data.vocab_size))
    torch.manual_seed(seed)
    model = build_model(cfg)
    t = cfg.train
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, cfg.data.vocab_size, (2, t.effective_batch, cfg.data.seq_len), generator=g)
    opt = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(0.9, t.beta2), fused=True)
    precision = resolve_precision(t.precision, resolve_profile(cfg.profile, "cpu", 1 << 30))

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast_for(precision, torch.device("cpu")):
            logits = model(x)
        loss = cross_entropy(logits.float(), y, cfg.model.backend)
        loss.backward()
        opt.step()
        return loss
    return step, x.numel()


def saved_bytes_per_token(model, x, y) -> float:
    """Bytes autograd keeps for the backward of one forward + loss, per token (parameters
    excluded)."""
    loss, n = saved_tensor_bytes(lambda: _step_loss(model, x, y), exclude=list(model.parameters()))
    loss.backward()
    model.zero_grad(set_to_none=True)
    return n / x.numel()


def step_speed(batches=(8, 32), names=("cpu", "peer-free"), rounds: int = 5, steps: int = 6,
               warmup: int = 3, device="cpu") -> list[dict]:
    """Training tokens/s of the seed model per micro-batch and model (`step_model` names), on
    fixed random batches of STEP_SEQ_LEN tokens. Every model warms up `warmup` steps, then the
    models take turns, `steps` steps each per round, for `rounds` rounds, each round starting
    one model further along (no model always runs first, or right after the same one). The
    machine's speed drifts by more than the differences measured, so a ratio is taken within
    each round (models a few seconds apart) and the median of the rounds' ratios is the figure;
    tokens/s is the median round. CPU runs keep the trainer's steady heap. One record per
    (micro-batch, model): `model` (with the backend that really ran when it fell back),
    `micro_batch`, `tok_per_s`, `range` (slowest and fastest round), `vs_peer_free` /
    `vs_mambapy` (median per-round ratios, None when that peer was not measured),
    `saved_bytes_per_token`, `fallbacks` (scans that fell back at that micro-batch)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        steady_cpu_heap()
    names = list(names)
    records = []
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        x = torch.randint(0, STEP_SEED["vocab_size"], (batch, STEP_SEQ_LEN), generator=g).to(dev)
        y = torch.randint(0, STEP_SEED["vocab_size"], (batch, STEP_SEQ_LEN), generator=g).to(dev)
        models = {n: step_model(n, dev) for n in names}
        saved = {n: saved_bytes_per_token(m, x, y) for n, m in models.items()}
        fns = {n: train_step(m, x, y) for n, m in models.items()}
        before = fallback_count()
        for n in names:                          # warm-up: compilation, allocator, caches
            for _ in range(warmup):
                fns[n]()
        per_round = {n: [] for n in names}
        for r in range(rounds):                  # interleaved rounds, rotating order
            k = r % len(names)
            for n in names[k:] + names[:k]:
                sync(dev)
                t0 = time.perf_counter()
                for _ in range(steps):
                    fns[n]()
                sync(dev)
                per_round[n].append(steps * x.numel() / (time.perf_counter() - t0))
        fallbacks = fallback_count() - before

        def ratio(n, peer):
            if peer not in per_round:
                return None
            return statistics.median(a / b for a, b in zip(per_round[n], per_round[peer]))
        for n in names:
            ran = n if n in STEP_PEERS else resolve_backend(n, x.float())[0]
            records.append({
                "model": n if ran == n else f"{n} (ran {ran})", "micro_batch": batch,
                "tok_per_s": statistics.median(per_round[n]),
                "range": (min(per_round[n]), max(per_round[n])),
                "vs_peer_free": ratio(n, "peer-free"), "vs_mambapy": ratio(n, "mambapy"),
                "saved_bytes_per_token": saved[n], "fallbacks": fallbacks})
    return records
