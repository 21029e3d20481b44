"""Notebook 08's study: the selection results of the Mamba paper (Gu and Dao 2023), induction
heads far past the training length and selective copying, for sonata's Mamba against its
time-invariant ablation (model.arch=lti) and an attention baseline (model.arch=attention),
each trained by the same trainer on the same task (sonata.data.tasks).

`RECIPES` holds each run's configuration (config overrides) and says why; `train_task`
trains one; `length_rows` scores a model per test length; `induction_table` puts the paper's
figures beside the measured ones. The library returns rows; the notebook writes sentences.

A run's length is its steps (`steps`: the curriculum's step counts and the stage after them),
the same on any host. A time cap (`cap_s`, 0: none) only ends a run early, and says so: every
run row has the steps planned and reached, the training seconds and, when the cap stopped it
short, a note (`short_note`). The cap does not change the learning rate: BASE's rate is
constant after warm-up (train.min_lr_ratio 1), so a capped run trains the same steps as an
uncapped one up to where it stops.
"""
from __future__ import annotations

import gc
from pathlib import Path

import torch

from sonata.core.config import make_config
from sonata.data.tasks import InductionHeads, accuracy_by_length, make_task
from sonata.model.lm import deltas
from sonata.train.trainer import Trainer

ARCHS = ("mamba", "lti", "attention")
NAMES = {"mamba": "Mamba (selective)", "lti": "time-invariant (lti)", "attention": "attention (RoPE)"}

# The paper's Table 2 as quoted in sonata's issue: accuracy (%) by test length, every model
# trained at length 256; attention ran out of memory past 2^14 (None: not reported).
PAPER_INDUCTION = {
    "Mamba (paper)": {k: 100.0 for k in range(6, 21)},
    "MHA-RoPE (paper)": {**{k: 100.0 for k in range(6, 9)}, 9: 83.6, 10: 31.3, 11: 18.4, 12: 8.6},
    "MHA-xPos (paper)": {**{k: 100.0 for k in range(6, 9)}, 9: 99.6, 10: 67.6, 11: 25.4, 12: 7.0},
    "MHA-Abs (paper)": {**{k: 100.0 for k in range(6, 9)}, 9: 58.6, 10: 26.6, 11: 18.8, 12: 9.8},
}
# Table 1: selective copying, 2 layers, accuracy (%).
PAPER_COPYING = {"S6 (selective), paper": "97.0-99.8", "S4 with no gate, paper": "18.3",
                 "S4 in a Mamba block, paper": "56.4"}

# Model and optimizer of every run: the paper's (2 layers, d_model 64, Adam without weight
# decay, lr 1e-3), batch 8, the loss on the answers only; the learning rate constant after
# 100 warm-up steps (min_lr_ratio 1); beta2 0.999 (Adam's default, the paper's optimizer).
BASE = {"model.d_model": 64, "model.n_layers": 2, "model.d_state": 16, "model.backend": "auto",
        "train.lr": 1e-3, "train.weight_decay": 0.0, "train.beta2": 0.999, "train.min_lr_ratio": 1.0,
        "train.warmup_steps": 100, "train.effective_batch": 8, "train.micro_batch": 8,
        "train.grad_clip": 1.0, "train.eval_every": 0, "train.checkpoint_every_s": 0.0,
        "task.eval_seqs": 256}

# Step sizes at initialization. Mamba's default draws delta in [1e-3, 0.1]: every channel
# forgets within ~10-1000 steps, and at length 64 the model learns to keep the answer only
# as long as training asks (chance by 2^14). Drawn in [1e-9, 1e-4], most
# channels start as near-perfect memories (exp(delta * A) rounds to 1 in float32 below
# about 3e-8), and what training must learn is where to write (notebook 08 measures both).
SMALL_DT = {"model.dt_min": 1e-9, "model.dt_max": 1e-4, "model.dt_init_floor": 1e-10}

# Induction heads: a curriculum of lengths, each stage a few thousand steps (the short
# lengths learn the task in about a minute; each longer stage then tightens the memory where
# the shorter ones cannot see it: the noise of 2^k tokens). data.seq_len 256 is the
# validation length (the paper's training length).
INDUCTION_CURRICULUM = "64:12000,256:3000,1024:1000,4096"
# The second phase (notebook 08's long_curriculum and long_steps): the first phase's model
# trained on from its weights on sequences of 16,384 to 131,072 tokens, 4 per step (a step of
# 4 x 131,072 tokens keeps about 2.3 GiB of activations for the backward; warm-up 10 steps).
LONG = {"train.micro_batch": 4, "train.effective_batch": 4, "train.warmup_steps": 10}
RECIPES = {
    ("induction", "mamba"): {"task.name": "induction", "data.seq_len": 256,
                             "task.curriculum": INDUCTION_CURRICULUM, **SMALL_DT},
    ("induction", "lti"): {"task.name": "induction", "data.seq_len": 256,
                           "task.curriculum": INDUCTION_CURRICULUM, **SMALL_DT},
    # attention at the paper's training length (its cost grows with the square of the length)
    ("induction", "attention"): {"task.name": "induction", "data.seq_len": 256},
    # copying: Mamba's default step sizes (measured at 300 s: 95.2% with them, 88.1% with
    # SMALL_DT, both on the curriculum below; 47.2% with the default and no curriculum)
    ("copying", "mamba"): {"task.name": "copying"},
    ("copying", "lti"): {"task.name": "copying"},
    ("copying", "attention"): {"task.name": "copying"},
}


def copy_curriculum(region: int, steps: int = 3000) -> str:
    """Selective copying's curriculum: `steps` steps each at regions of 32, 64 and 128 below
    `region`, then `region` (each length = region + 16 markers)."""
    return ",".join([f"{r + 16}:{steps}" for r in (32, 64, 128) if r < region] + [str(region + 16)])


def run_overrides(task: str, arch: str, steps: int, cap_s: float = 0.0, seed: int = 0,
                  copy_region: int = 256, curriculum: str | None = None, overrides: dict | None = None) -> dict:
    """The config overrides of one run: BASE, the recipe, `steps` optimizer steps (the run's
    length), a time cap of `cap_s` training seconds (0: none), the seed; `curriculum` replaces
    the recipe's (attention keeps its fixed length). Copying trains at copy_region + 16."""
    if steps < 1:
        raise ValueError(f"a run needs at least 1 step, not {steps}")
    o = {**BASE, **RECIPES[(task, arch)], "model.arch": arch, "train.seed": seed,
         "train.max_steps": int(steps), "train.max_seconds": float(cap_s)}
    if curriculum is not None and "task.curriculum" in o:
        o["task.curriculum"] = curriculum
    if task == "copying":
        o["data.seq_len"] = copy_region + o.get("task.n_data", 16)
        o["task.curriculum"] = copy_curriculum(copy_region) if curriculum is None else curriculum
    o.update(overrides or {})
    return o


def train_task(task: str, arch: str, steps: int, cap_s: float = 0.0, seed: int = 0,
               copy_region: int = 256, curriculum: str | None = None, init=None, name: str | None = None,
               out_dir=None, progress: str | None = None, overrides: dict | None = None):
    """Train one (task, architecture) run of `steps` steps (at most `cap_s` training seconds,
    0: no cap); -> (model in eval mode, summary dict: the trainer's, with `planned_steps`).
    `init`: a model whose weights the run starts from (a new run: fresh optimizer and
    sequences). With `out_dir`, the run's folder is out_dir/<name> (default <task>-<arch>:
    metrics.jsonl, checkpoint.pt, summary.json). `overrides`: more config overrides."""
    folder = Path(out_dir) / (name or f"{task}-{arch}") if out_dir else None
    return train_steps(run_overrides(task, arch, steps, cap_s, seed, copy_region, curriculum, overrides),
                       folder, init, progress)


def train_steps(overrides: dict, folder=None, init=None, progress: str | None = None):
    """Train the run of `overrides` (train.max_steps its length, train.max_seconds its cap) into
    `folder` (None: no files) from `init`'s weights if given; -> (model in eval mode, the
    trainer's summary with `planned_steps` and `cap_s`)."""
    cfg = make_config(overrides)
    trainer = Trainer(cfg, folder, progress=progress)
    if init is not None:
        trainer.start_from(init.state_dict())
    summary = {**trainer.run(), "planned_steps": cfg.train.max_steps, "cap_s": cfg.train.max_seconds}
    model = trainer.model.eval()
    del trainer
    gc.collect()
    return model, summary


def short_note(summary: dict) -> str:
    """'' for a run that reached its planned steps; otherwise the line that says where the
    time cap stopped it (its results are not the recipe's: rerun with a larger cap)."""
    planned, steps = summary["planned_steps"], summary["steps"]
    if steps >= planned:
        return ""
    return (f"stopped short: {steps:,} of {planned:,} steps, the {summary['cap_s']:g} s cap "
            f"({100 * steps / planned:.0f}% of the plan)")


def steps_fields(summary: dict) -> dict:
    """A run's length, as every run row shows it: steps planned and reached, training seconds,
    what ended it, and the note of a run the cap stopped short."""
    return {"steps planned": summary["planned_steps"], "steps": summary["steps"],
            "train s": round(summary["train_seconds"], 1), "stopped by": summary["stopped_by"],
            "note": short_note(summary)}


def length_rows(model, task: str, lengths, n: int, n_long: int, seed: int = 1234,
                budget_s: float = 0.0, copy_n_data: int = 16) -> list[dict]:
    """Accuracy per test length (sonata.data.tasks.accuracy_by_length) for notebook 08's tables."""
    t = make_task(make_config({"task.name": task, "task.n_data": copy_n_data}).task)
    return accuracy_by_length(model, t, lengths, n, n_long, seed, budget_s)


def _label(length: int) -> str:
    k = length.bit_length() - 1
    return f"2^{k}" if length == 1 << k else f"{length:,}"


def induction_table(measured: dict, lengths) -> list[dict]:
    """One row per model: accuracy (%) by test length, the paper's rows below sonata's.
    `measured[name]` is length_rows' output; a length not run shows '-' (its row's note says
    why); the paper's attention rows show OOM past 2^14, where it ran out of memory."""
    rows = []
    for name, res in measured.items():
        row = {"model": name}
        for r in res:
            row[_label(r["length"])] = "-" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}"
        rows.append(row)
    for name, paper in PAPER_INDUCTION.items():
        row = {"model": name}
        for length in lengths:
            k = length.bit_length() - 1
            v = paper.get(k) if length == 1 << k else None
            row[_label(length)] = (f"{v:.1f}" if v is not None else
                                   ("OOM" if "MHA" in name and length > 1 << 14 else ""))
        rows.append(row)
    return rows


def first_below(rows: list[dict], level: float = 0.99) -> int | None:
    """The shortest test length whose accuracy is under `level` (None: none measured is)."""
    return next((r["length"] for r in rows if r["accuracy"] is not None and r["accuracy"] < level), None)


def conclusion(measured: dict, level: float = 0.99) -> str:
    """Lines written from accuracy-by-length rows: how far each model holds `level`, where it
    falls, what was not run and why."""
    lines = []
    for name, rows in measured.items():
        done = [r for r in rows if r["accuracy"] is not None]
        if not done:
            lines.append(f"{name}: no length run ({rows[0]['note']})")
            continue
        below = first_below(done, level)
        held = [r["length"] for r in done if r["accuracy"] >= level and (below is None or r["length"] < below)]
        if below is None:
            lines.append(f"{name}: at least {level:.0%} at every length run, {done[0]['length']:,} to "
                         f"{done[-1]['length']:,} ({min(r['accuracy'] for r in done):.2%} the lowest)")
        else:
            r = next(r for r in done if r["length"] == below)
            lines.append(f"{name}: at least {level:.0%} up to {held[-1]:,}" if held else f"{name}: under {level:.0%} "
                         f"from the first length")
            lines[-1] += f"; {r['accuracy']:.2%} at {below:,}, {done[-1]['accuracy']:.2%} at {done[-1]['length']:,}"
        skipped = [r for r in rows if r["accuracy"] is None]
        if skipped:
            lens = ", ".join(f"{r['length']:,}" for r in skipped)
            lines.append(f"  {lens}: {skipped[0]['note']}")
    return "\n".join(lines)


def show_tasks(copy_region: int = 256, seed: int = 0) -> str:
    """One induction sequence (48 tokens) and one selective-copying sequence, as lines."""
    g = torch.Generator().manual_seed(seed)
    x, ans = InductionHeads().draw(1, 48, g)
    lines = ["induction heads (length 48; S = 15):", "  " + " ".join(map(str, x[0].tolist())),
             f"  answer at the last position: {int(ans.target[0, 0])}"]
    c = make_task(make_config({"task.name": "copying"}).task)
    x, ans = c.draw(1, copy_region + c.n_data, g)
    shown = " ".join("." if t == c.NOISE else ("M" if t == c.MARKER else str(t)) for t in x[0].tolist())
    lines += [f"selective copying (region {copy_region}, noise shown as '.', markers as 'M'):", "  " + shown,
              "  answers at the markers: " + " ".join(map(str, ans.target[0].tolist()))]
    return "\n".join(lines)


def run_row(arch: str, summary: dict, name: str | None = None) -> dict:
    """A run's line in the training table (`name`: the model column, default the arch's)."""
    return {"model": name or NAMES[arch], "params": summary["params"], **steps_fields(summary),
            "tokens/s": round(summary["tokens"] / summary["train_seconds"]) if summary["train_seconds"] else None,
            "val loss": round(summary["val_loss"], 5), "val accuracy": round(summary["val_acc"], 4)}


def short_runs(rows: list[dict]) -> str:
    """One line per run row the cap stopped short of its plan, or the line that none was."""
    short = [f"{r['model']}: {r['note']}" for r in rows if r.get("note")]
    if not short:
        return f"every run reached its planned steps ({len(rows)} run{'s' * (len(rows) != 1)})"
    return "\n".join(short + ["(a run stopped short is not the recipe's: its accuracies are lower bounds; "
                              "raise the cap, or run it on a faster host)"])


def _write_strength(model, idx) -> list[torch.Tensor]:
    """Per SSM layer, how much of each position enters the state: delta x |u| x |B| (b, di, L)."""
    import torch.nn.functional as F

    from sonata.model.mamba import MambaBlock
    h, out = model.embedding(idx), []
    with torch.no_grad():
        for layer in model.layers:
            if isinstance(layer, MambaBlock):
                mix, L = layer.mixer, idx.shape[1]
                x, _ = mix.in_proj(layer.norm(h)).transpose(1, 2).chunk(2, dim=1)
                u = F.silu(mix.conv1d(x)[..., :L])                             # (b, di, L)
                dt, B, _ = mix.ssm_inputs(u.transpose(1, 2))
                delta = F.softplus(dt + mix.delta_bias[:, None])
                out.append(delta * u.abs() * B.norm(dim=1, keepdim=True))
            h = layer(h)
    return out


def delta_panels(models: dict, seed: int = 0, length: int = 48) -> tuple[dict, list[str]]:
    """One induction sequence and, for each named SSM model and layer, delta and the write
    per channel and position: ({"delta": {"<name>, layer i": (channels, length)}, "write":
    {...}}, position labels). The labels show S, the answer A and the query S at the end."""
    task = InductionHeads()
    x, _ = task.draw(1, length, torch.Generator().manual_seed(seed))
    s = int((x[0, :-1] == task.S).nonzero()[0])
    labels = ["S" if t == task.S else ("A" if i == s + 1 else str(t)) for i, t in enumerate(x[0].tolist())]
    panels = {"delta": {}, "write": {}}
    for name, model in models.items():
        for i, (d, w) in enumerate(zip(deltas(model, x), _write_strength(model, x))):
            panels["delta"][f"{name}, layer {i + 1}"] = d[0].float().numpy()
            panels["write"][f"{name}, layer {i + 1}"] = w[0].float().numpy()
    return panels, labels


def delta_summary(models: dict, n: int = 64, length: int = 256, seed: int = 0) -> list[dict]:
    """Per model and layer, over n induction sequences of `length`: how much more the answer's
    position A is written than a noise position (past S, A and their convolution window), as
    ratios of medians: of delta alone and of the write delta x |u| x |B|, for the channel
    where it is largest and as the median over channels. Ratios far above 1 are selection; the
    delta ratio of the time-invariant model is 1 by construction."""
    task = InductionHeads()
    x, _ = task.draw(n, length, torch.Generator().manual_seed(seed))
    s = (x[:, :-1] == task.S).int().argmax(1)
    rows = []
    for name, model in models.items():
        for i, (d, w) in enumerate(zip(deltas(model, x), _write_strength(model, x))):
            row = {"model": name, "layer": i + 1}
            for what, v in (("delta", d), ("write", w)):                 # (n, di, L)
                at_a = v[torch.arange(n), :, s + 1].median(0).values     # (di,)
                noise = v[:, :, 24:-1].median(2).values.median(0).values
                ratio = at_a / noise.clamp(min=1e-38)
                row[f"{what} A/noise, best channel"] = f"{float(ratio.max()):.3g}"
                row[f"{what} A/noise, median channel"] = f"{float(ratio.median()):.3g}"
            rows.append(row)
    return rows


def precision_rows(model, lengths, n: int, seed: int = 1234) -> list[dict]:
    """The same model and sequences scored with its weights and recurrent state in float32
    (training's) and in float64 (the cpu kernels compute in float64 for a float64 model):
    whether float32's precision is what limits how far the memory holds."""
    import copy
    rows = []
    if model is None:
        return rows
    for name, m in (("float32", model), ("float64", copy.deepcopy(model).double())):
        for r in length_rows(m, "induction", lengths, n, n, seed):
            rows.append({"state precision": name, "length": r["length"], "sequences": r["sequences"],
                         "accuracy": r["accuracy"], "loss": r["loss"], "seconds": r["seconds"]})
    return rows


# Notebook 08's ablations of the Mamba induction recipe: one change each.
ABLATIONS = {
    "default-dt": ("Mamba's default step-size init (delta in [1e-3, 0.1])",
                   {"model.dt_min": 1e-3, "model.dt_max": 0.1, "model.dt_init_floor": 1e-4}),
    "fixed-64": ("no curriculum: every step at length 64", {"task.curriculum": ""}),
}


def ablation_run(name: str, steps: int, cap_s: float = 0.0, seed: int = 0, out_dir=None,
                 progress: str | None = None):
    """Train the Mamba induction recipe with ABLATIONS[name]'s change (fixed-64: data.seq_len
    64 throughout) for `steps` steps (at most `cap_s` seconds); -> (model, summary)."""
    _, changes = ABLATIONS[name]
    overrides = dict(changes)
    if name == "fixed-64":
        overrides["data.seq_len"] = 64
    return train_task("induction", "mamba", steps, cap_s, seed=seed, out_dir=out_dir,
                      name=f"induction-mamba-{name}", progress=progress, overrides=overrides)


def copy_row(arch: str, summary: dict, row: dict) -> dict:
    """A selective-copying run's line: the accuracy over the answers of the test sequences."""
    return {"model": NAMES[arch], "params": summary["params"], **steps_fields(summary),
            "sequences": row["sequences"], "accuracy (%)": f"{100 * row['accuracy']:.1f}"}


def paper_copy_rows() -> list[dict]:
    return [{"model": name, "accuracy (%)": v} for name, v in PAPER_COPYING.items()]
