"""Notebook 07's study: configurations trained under one time budget (`speedrun`), the
ten-minute race against transformers' GPT-2 (`RACE`, `race_conclusion`, benchmarks/race.py), the
validation curves and the loss by position in the window. Functions return records; the
notebook writes the sentences around them."""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from pathlib import Path


from sonata.core.config import make_config
from sonata.core.errors import DataError
from sonata.data.sources import resolve_source
from sonata.train.trainer import Trainer


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
# (sonata.core.config.TRAIN_DEFAULTS, with train.precision=fast: bf16 only where it is native).
RACE_COMMON = {"data.vocab_size": 2048, "train.effective_batch": 16}
GPT2_RACE = {"model.arch": "gpt2", "model.d_model": 80, "model.n_layers": 2, "model.n_heads": 4,
             "train.beta2": 0.95}
BEST_LEVERS = {"train.lr": 6e-3, "train.precision": "fast", "data.seq_len": 512, "train.effective_batch": 4,
               "train.weight_decay": 0.3}           # sonata-bf16-ctx512-wd0.3's, bf16 only where native
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
# issue 38's rows (benchmarks/race.py --configs names them; raced at 600 s in docs/results.md,
# notebook 07 runs them by default): Mamba-2 (SSD) rows with sonata's best levers, the hybrid at
# two sizes, and the GPT with the same precision lever (bf16 where native) at context 128 and 256
RACE_MAMBA2 = {
    **{f"mamba2-n{n}-fast-ctx512-wd0.3": {**RACE_COMMON, **BEST_LEVERS, "model.arch": "mamba2", "model.d_state": n}
       for n in (16, 64, 128)},
    "hybrid-n64-fast-ctx512-wd0.3": {**RACE_COMMON, **BEST_LEVERS, "model.layers": "mamba2,attention",
                                     "model.d_state": 64},
    # the hybrid at the Mamba-1 row's size: d_model 88 (heads of 16: 176 / 32 is not whole), 333,929
    # parameters against sonata-bf16-ctx512-wd0.3's 333,216 (the d_model 96 hybrid has 377,554)
    "hybrid-n64-d88-fast-ctx512-wd0.3": {**RACE_COMMON, **BEST_LEVERS, "model.layers": "mamba2,attention",
                                         "model.d_state": 64, "model.d_model": 88, "model.headdim": 16},
    "gpt2-fast-lr6e-3-wd0.3": {**RACE_COMMON, **GPT2_RACE, "train.lr": 6e-3, "train.weight_decay": 0.3,
                               "train.precision": "fast"},
    "gpt2-fast-ctx256-lr6e-3-wd0.3": {**RACE_COMMON, **GPT2_RACE, "train.lr": 6e-3, "train.weight_decay": 0.3,
                                      "train.precision": "fast", "data.seq_len": 256, "train.effective_batch": 8},
}


# issue 53's rows: the newest families with the same levers, near the Mamba-1 row's 333,216
# parameters: Mamba-3 as released, SISO at N=64 (340,408) and MIMO of rank 4 at N=16 (342,520),
# and a Gated DeltaNet + attention hybrid at the d88 hybrid's width (325,590: 11 value heads of
# 16 sharing one key head of 16)
RACE_NEW = {
    "mamba3-n64-fast-ctx512-wd0.3": {**RACE_COMMON, **BEST_LEVERS, "model.arch": "mamba3", "model.d_state": 64},
    "mamba3-mimo4-n16-fast-ctx512-wd0.3": {**RACE_COMMON, **BEST_LEVERS, "model.arch": "mamba3",
                                           "model.d_state": 16, "model.mimo_rank": 4, "model.chunk_size": 16},
    "gdn-hybrid-d88-fast-ctx512-wd0.3": {**RACE_COMMON, **BEST_LEVERS, "model.layers": "gdn,attention",
                                         "model.d_model": 88, "model.headdim": 16, "model.d_state": 16},
}


STUDY07 = {**SPEEDRUN, **RACE, **RACE_MAMBA2, **RACE_NEW}      # every configuration notebook 07 can run, by name


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
