"""Notebook 10's study: what Mamba-2 and Mamba-3 are for, on a CPU. Associative recall (MQAR)
against the state size N for Mamba-1, Mamba-2, Mamba-3 and attention, beside the Mamba-2
paper's ordering (Dao and Gu 2024, section 9.1, figure 8); state tracking (parity, a modular
sum) by test length for Mamba-2, Mamba-3, Mamba-3's two ablations (rotation off, trapezoid
off) and Mamba-3 with a half-turn angle (`model.bounded_angle`, exact at 0 and pi), trained at
one length (the Mamba-3 paper's claim: a rotating state counts, a real one cannot); and the
parity runs again at other seeds (`seed_runs`: how much a result owes to its seed).

Every run is defined by its steps (`steps`, the same training on any host); `cap_s` caps its
training seconds and the run's row says when it stopped short (sonata.lab.selection's
`steps_fields`). The rate is constant after warm-up (train.min_lr_ratio 1), so a cap changes
no step it lets run. The library returns rows; the notebook writes sentences and plots.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from sonata.core.config import make_config
from sonata.data.tasks import MQAR_GRIDS, accuracy_by_length, make_task
from sonata.lab.selection import steps_fields, train_steps

# name -> (label, config overrides). Notebook 10's Mamba-3 rows are the paper form (the study's
# block; sonata.model.mamba3): its committed results were measured with it.
PAPER = {"model.mamba3_form": "paper"}
MODELS = {
    "mamba": ("Mamba-1", {"model.arch": "mamba"}),
    "mamba2": ("Mamba-2", {"model.arch": "mamba2"}),
    "mamba3": ("Mamba-3", {"model.arch": "mamba3", **PAPER}),
    "mamba3-no-rotation": ("Mamba-3, rotation off", {"model.arch": "mamba3", **PAPER, "model.rope_fraction": 0.0}),
    "mamba3-euler": ("Mamba-3, trapezoid off (Euler)", {"model.arch": "mamba3", **PAPER, "model.trapezoid": False}),
    "mamba3-half-turn": ("Mamba-3, half-turn angle", {"model.arch": "mamba3", **PAPER, "model.bounded_angle": 4.0}),
    "attention": ("attention (RoPE)", {"model.arch": "attention"}),
}
RECALL_MODELS = ("mamba", "mamba2", "mamba3", "attention")
TRACK_MODELS = ("mamba2", "mamba3", "mamba3-no-rotation", "mamba3-euler", "mamba3-half-turn")
ROTATING = ("mamba3", "mamba3-euler", "mamba3-half-turn")    # the models the Mamba-3 paper's claim is about
TRACK_TASKS = {"parity": {"task.name": "parity"}, "modsum": {"task.name": "modsum", "task.modulus": 5}}

# Every run: Adam without weight decay, lr 3e-3 constant after 50 warm-up steps, batch 32,
# gradients clipped at 1; SSD heads of 16 channels (mamba2, mamba3: d_inner / 16 heads).
BASE = {"model.backend": "auto", "model.headdim": 16, "train.lr": 3e-3, "train.weight_decay": 0.0,
        "train.beta2": 0.999, "train.min_lr_ratio": 1.0, "train.warmup_steps": 50,
        "train.effective_batch": 32, "train.micro_batch": 32, "train.grad_clip": 1.0, "train.eval_every": 0,
        "train.checkpoint_every_s": 0.0, "task.eval_seqs": 128}

# MQAR's recipe on top of BASE, the same for every model. Without it (16 pairs alone, mamba_ssm's
# 0.02 embedding tied to the head: `mqar_ablation`, the last row of notebook 10's MQAR table)
# attention stays at 1/16, answering with some value of its context; with it, 99.6% (the same
# table). It has two parts: (1) training batches with fewer pairs mixed in (task.mix_pairs: D,
# D/2, D/4, D/8; Zoology trains on mixed pair counts too): the lookup forms where it is easy and
# carries to 16; (2) unit-variance token embeddings with an untied head: at mamba_ssm's 0.02 the
# embedding is swamped in the residual stream by the first block's output, and the second layer
# cannot read which key its position holds.
MQAR_RECIPE = {"task.mix_pairs": True, "model.tie_embeddings": False, "model.embed_std": 1.0}

# The Mamba-2 paper's figure 8 (MQAR, T 256..1,024, vocabulary 8,192, 2 layers), as read from it:
# what each of the compared models does, in words (the paper plots no table).
PAPER_MQAR = [
    {"model": "Mamba-1", "N": 16, "paper (figure 8)": "mostly below 0.5"},
    {"model": "Mamba-2", "N": 16, "paper (figure 8)": "far above Mamba-1 at N=16"},
    {"model": "Mamba-2", "N": "64, 256", "paper (figure 8)": "approaches, then matches attention"},
    {"model": "attention", "N": "-", "paper (figure 8)": "the ceiling (near 1 at width 64 and up)"},
]


def label(name: str) -> str:
    return MODELS[name][0]


def recall_overrides(model: str, d_state: int, steps: int, cap_s: float = 0.0, length: int = 64,
                     d_model: int = 64, vocab: int = 1024, seed: int = 0, recipe: bool = True) -> dict:
    """One MQAR run's config overrides: the CPU grid's point (length, d_model, d_state; 2
    layers; D = length / 4 pairs) at vocabulary `vocab`, `steps` steps, a cap of `cap_s`;
    MQAR_RECIPE on top unless `recipe` is false (D pairs alone, mamba_ssm's tied 0.02 embedding)."""
    grid = replace(MQAR_GRIDS["cpu"], vocab_size=vocab)
    return {**BASE, **(MQAR_RECIPE if recipe else {}), **grid.overrides(length, d_model, d_state), **MODELS[model][1],
            "train.seed": seed,
            "train.max_steps": int(steps), "train.max_seconds": float(cap_s)}


# State tracking's curriculum: TRACK_STAGE_STEPS steps at each of 1/8, 1/4 and 1/2 of the
# trained length, then the trained length to the end: the rule is learned where it is easy, then
# carried to the trained length (notebook 10's state-tracking runs train on it).
TRACK_STAGE_STEPS = 300


def track_curriculum(length: int) -> str:
    """'L/8:300,L/4:300,L/2:300,L' (the stages shorter than 2 left out)."""
    stages = [f"{length // k}:{TRACK_STAGE_STEPS}" for k in (8, 4, 2) if length // k >= 2]
    return ",".join(stages + [str(length)])


def track_overrides(task: str, model: str, steps: int, cap_s: float = 0.0, length: int = 64,
                    d_model: int = 32, d_state: int = 16, seed: int = 0, n_layers: int = 2) -> dict:
    """One state-tracking run's config overrides: `n_layers` layers, trained on `track_curriculum(length)`
    with the loss at every position (task.running: the answer of every prefix; the score stays
    the last position's); validated at `length`."""
    return {**BASE, **TRACK_TASKS[task], **MODELS[model][1], "task.running": True, "data.seq_len": length,
            "task.curriculum": track_curriculum(length), "model.n_layers": n_layers, "model.d_model": d_model,
            "model.d_state": d_state, "train.seed": seed, "train.max_steps": int(steps),
            "train.max_seconds": float(cap_s)}


def _folder(out_dir, name: str):
    return Path(out_dir) / name if out_dir else None


NO_RECIPE = ", no recipe"      # the label suffix of a run without MQAR_RECIPE


def recall_runs(models, states, steps: int, cap_s: float = 0.0, length: int = 64, d_model: int = 64,
                vocab: int = 1024, n_test: int = 128, seed: int = 0, out_dir=None, progress=None,
                ablation: bool = False) -> list[dict]:
    """Train and score MQAR: each SSM of `models` at each state size of `states`, attention once
    (it has no N: its state is every key and value). One row per run: model, N, its steps and
    seconds (`steps_fields`), params, accuracy on `n_test` fixed sequences of `length`. With
    `ablation` (and attention among `models`), one more row: attention without MQAR_RECIPE,
    labelled 'attention (RoPE), no recipe'."""
    runs = [(model, n, True) for model in models for n in ([None] if model == "attention" else states)]
    runs += [("attention", None, False)] if ablation and "attention" in models else []
    rows = []
    for model, n, recipe in runs:
        o = recall_overrides(model, n or 16, steps, cap_s, length, d_model, vocab, seed, recipe)
        name = f"mqar-{model}" + (f"-n{n}" if n else "") + ("" if recipe else "-no-recipe")
        m, s = train_steps(o, _folder(out_dir, name), progress=progress)
        task = make_task(make_config(o).task)
        acc = accuracy_by_length(m, task, [length], n_test, n_test, seed=1234)[0]["accuracy"]
        rows.append({"model": label(model) + ("" if recipe else NO_RECIPE), "N": n if n else "-",
                     "d_model": d_model, "params": s["params"], **steps_fields(s), "accuracy": round(acc, 4)})
    return rows


def _find(rows, model: str, n=None):
    return next((r for r in rows if r["model"] == label(model) and (n is None or r["N"] == n)), None)


def recall_verdicts(rows: list[dict], margin: float = 0.05) -> list[dict]:
    """The paper's two MQAR claims checked on the measured rows, one row each: Mamba-2 above
    Mamba-1 at N=16; Mamba-2 at its largest N within `margin` of attention, either side (far
    above it is no match either: an attention run short of the ceiling the paper's attention
    reached). `holds`: yes / no, or 'not run' when a row it needs is missing."""
    out = []
    m1, m2 = _find(rows, "mamba", 16), _find(rows, "mamba2", 16)
    out.append({"claim": "Mamba-2 above Mamba-1 at N=16",
                "measured": (f"Mamba-2 {m2['accuracy']:.3f}, Mamba-1 {m1['accuracy']:.3f}" if m1 and m2 else "-"),
                "holds": ("yes" if m2["accuracy"] > m1["accuracy"] else "no") if m1 and m2 else "not run"})
    m2s = [r for r in rows if r["model"] == label("mamba2")]
    big, att = (max(m2s, key=lambda r: r["N"]) if m2s else None), _find(rows, "attention")
    out.append({"claim": f"Mamba-2 at its largest N within {100 * margin:.0f} points of attention",
                "measured": (f"Mamba-2 N={big['N']} {big['accuracy']:.3f}, attention {att['accuracy']:.3f}"
                             if big and att else "-"),
                "holds": ("yes" if abs(big["accuracy"] - att["accuracy"]) <= margin else "no") if big and att
                else "not run"})
    return out


def _track_one(task: str, model: str, steps: int, cap_s: float, length: int, test_lengths, d_model: int,
               d_state: int, n_test: int, seed: int, folder, progress, n_layers: int) -> tuple[dict, list[dict]]:
    """Train one (task, model) at `seed` and score it -> (its run row, accuracy_by_length's rows)."""
    o = track_overrides(task, model, steps, cap_s, length, d_model, d_state, seed, n_layers)
    m, s = train_steps(o, folder, progress=progress)
    t = make_task(make_config(o).task)
    acc = accuracy_by_length(m, t, list(test_lengths), n_test, n_test, seed=1234)
    return ({"task": task, "model": label(model), "seed": seed, "params": s["params"], **steps_fields(s),
             "val accuracy": round(s["val_acc"], 4)}, acc)


def track_runs(tasks, models, steps: int, cap_s: float = 0.0, length: int = 64, test_lengths=(64, 256),
               d_model: int = 32, d_state: int = 16, n_test: int = 128, seed: int = 0, out_dir=None,
               progress=None, n_layers: int = 2) -> tuple[list[dict], dict]:
    """Train each (task, model) at `length` and score it at `test_lengths` -> (one run row
    each: task, model, seed, steps and seconds; {(task, model label): accuracy_by_length's rows})."""
    runs, acc = [], {}
    for task in tasks:
        for model in models:
            row, acc[(task, label(model))] = _track_one(task, model, steps, cap_s, length, test_lengths, d_model,
                                                         d_state, n_test, seed, _folder(out_dir, f"{task}-{model}"),
                                                         progress, n_layers)
            runs.append(row)
    return runs, acc


def seed_runs(task: str, models, seeds, steps: int, cap_s: float = 0.0, length: int = 64, test_lengths=(64, 256),
              d_model: int = 32, d_state: int = 16, n_test: int = 128, out_dir=None, progress=None,
              n_layers: int = 2) -> tuple[list[dict], dict]:
    """`track_runs`' training of one task again at each of `seeds` (how much a result owes to
    its seed) -> (run rows; {(model label, seed): accuracy_by_length's rows}); run folders
    '<task>-<model>-seed<seed>'."""
    runs, acc = [], {}
    for model in models:
        for seed in seeds:
            row, acc[(label(model), seed)] = _track_one(task, model, steps, cap_s, length, test_lengths, d_model,
                                                         d_state, n_test, seed,
                                                         _folder(out_dir, f"{task}-{model}-seed{seed}"), progress,
                                                         n_layers)
            runs.append(row)
    return runs, acc


def with_seed(track_acc: dict, acc: dict, task: str, models, seed: int) -> dict:
    """`seed_runs`' accuracies with the main run's (`track_runs` at `seed`) first: {(model label,
    seed): rows} for each of `models` that both ran."""
    main = {(label(m), seed): track_acc[(task, label(m))] for m in models if (task, label(m)) in track_acc}
    return {**main, **{k: v for k, v in acc.items() if k not in main}}


def _len_label(length: int) -> str:
    return f"{length:,}"


def _length_columns(res, train_length: int) -> dict:
    """{'L (kx)' or 'L (trained)': accuracy (%)} of accuracy_by_length's rows."""
    out = {}
    for r in res:
        k = r["length"] / train_length
        head = _len_label(r["length"]) + (f" ({k:g}x)" if k != 1 else " (trained)")
        out[head] = "-" if r["accuracy"] is None else f"{100 * r['accuracy']:.1f}"
    return out


def track_table(acc: dict, train_length: int) -> list[dict]:
    """One row per (task, model): accuracy (%) by test length, each column 'L' or 'L (kx)'."""
    return [{"task": task, "model": model, **_length_columns(res, train_length)} for (task, model), res in acc.items()]


def seed_table(acc: dict, train_length: int) -> list[dict]:
    """`seed_runs`' accuracies: one row per (model, seed), accuracy (%) by test length."""
    return [{"model": model, "seed": seed, **_length_columns(res, train_length)} for (model, seed), res in acc.items()]


def _at(res, length: int):
    return next((r["accuracy"] for r in res if r["length"] == length and r["accuracy"] is not None), None)


def seed_verdicts(acc: dict, train_length: int, factor: int = 4, level: float = 0.95) -> list[dict]:
    """Per model of `seed_runs`: at how many seeds it reached `level` at `factor` x the trained
    length, and each seed's accuracy there ('not run' where that length was not tested)."""
    out = {}
    for (model, seed), res in acc.items():
        out.setdefault(model, []).append((seed, _at(res, factor * train_length)))
    rows = []
    for model, got in out.items():
        run = [(s, a) for s, a in got if a is not None]
        rows.append({"model": model, f"seeds at {level:.0%} or more at {factor}x":
                     f"{sum(a >= level for _, a in run)} of {len(run)}" if run else "not run",
                     "by seed": ", ".join(f"{s}: {100 * a:.1f}%" for s, a in run) or "-"})
    return rows


def chance(task: str) -> float:
    return make_task(make_config(TRACK_TASKS[task]).task).chance()


def track_verdicts(acc: dict, train_length: int, factor: int = 4, level: float = 0.95,
                   near: float = 0.1) -> list[dict]:
    """The Mamba-3 paper's claims at `factor` x the trained length, one row per (task, model):
    Mamba-3 (with its rotation, trapezoid on or off) at least `level`; Mamba-2 and Mamba-3
    without rotation within `near` of chance. 'not run' where that length was not tested."""
    out = []
    for (task, model), res in acc.items():
        a = _at(res, factor * train_length)
        c = chance(task)
        rotating = model in [label(m) for m in ROTATING]
        claim = f"at least {level:.0%}" if rotating else f"near chance ({c:.0%} +- {near:.0%})"
        if a is None:
            holds = "not run"
        else:
            holds = "yes" if (a >= level if rotating else abs(a - c) <= near) else "no"
        out.append({"task": task, "model": model, f"claim at {factor}x": claim,
                    "measured": "-" if a is None else f"{100 * a:.1f}%", "holds": holds})
    return out


def parity_states(bits, decay: float = 0.9) -> list[dict]:
    """The explanation's numbers, one row per position of `bits`: the parity so far; a real
    state h = decay * h + x (a decaying sum: positive weights, it cannot flip sign); and a
    rotating one, a unit vector turned by pi at every 1 (its first coordinate, cos of the
    accumulated angle, is +1 at even parity and -1 at odd, at any length, with no decay)."""
    h, angle, rows = 0.0, 0.0, []
    for t, x in enumerate(bits):
        h = decay * h + x
        angle += math.pi * x
        rows.append({"t": t, "bit": x, "parity": sum(bits[:t + 1]) % 2, f"real state ({decay:g})": round(h, 3),
                     "rotating state cos": round(math.cos(angle), 3)})
    return rows
