"""Notebook 11's study: the Mamba-3 paper's state-tracking table (Lahoti et al. 2026, Table 5b)
on a CPU. Three tasks in the paper's protocol (after Grazzi et al. 2025): parity with one layer,
modular arithmetic without brackets and with brackets (mod 5) with three; state size 64; trained
at short lengths and scored at 256. Rows: Mamba-2, Mamba-3 as released (SISO, and MIMO of rank 4),
Gated DeltaNet with the eigenvalue range [0, 1] and [-1, 1] (`model.allow_neg_eigval`), and
attention; the paper's figures beside sonata's; a seed spread. One row is a lever, not the
protocol: Mamba-3 SISO with its step size initialised in [0.1, 1] (`mamba3-dt1`).

The score is the paper's scaled accuracy: 100 (a - c) / (1 - c), a the accuracy at the last
position and c the chance 1/m (0 is chance, 100 every answer right). Every run is defined by its
steps (the same training on any host); `cap_s` caps its seconds and its row says when it stopped
short. The library returns rows; the notebook writes sentences and plots.
"""
from __future__ import annotations

import statistics

from sonata.core.config import make_config
from sonata.data.tasks import accuracy_by_length, make_task
from sonata.lab.recall import BASE, track_curriculum
from sonata.lab.selection import steps_fields, train_steps

# name -> (label, config overrides): the table's rows
MODELS = {
    "mamba2": ("Mamba-2", {"model.arch": "mamba2"}),
    "mamba3": ("Mamba-3 SISO", {"model.arch": "mamba3"}),
    "mamba3-mimo4": ("Mamba-3 MIMO R=4", {"model.arch": "mamba3", "model.mimo_rank": 4}),
    # the one lever beside the protocol: Mamba-3 SISO with its step dt initialised in [0.1, 1]
    # (mamba_ssm's [0.001, 0.1] elsewhere). An angle pi tanh(theta) dt needs dt >= 1 to turn by pi
    "mamba3-dt1": ("Mamba-3 SISO, dt init [0.1, 1]", {"model.arch": "mamba3", "model.dt_min": 0.1,
                                                       "model.dt_max": 1.0}),
    "gdn": ("Gated DeltaNet [0, 1]", {"model.arch": "gdn"}),
    "gdn-neg": ("Gated DeltaNet [-1, 1]", {"model.arch": "gdn", "model.allow_neg_eigval": True}),
    "attention": ("attention (RoPE)", {"model.arch": "attention"}),
}

# name -> (column label, config overrides, layers): the paper's columns. Parity and arithmetic
# without brackets train with the loss at every prefix's answer (task.running); a bracketed
# prefix has no value, so that task's loss is its one answer.
TASKS = {
    "parity": ("parity", {"task.name": "parity", "task.running": True}, 1),
    "arith": ("arith. w/o brackets", {"task.name": "arith", "task.modulus": 5, "task.running": True}, 3),
    "arith_brackets": ("arith. w/ brackets", {"task.name": "arith_brackets", "task.modulus": 5}, 3),
}

# The paper's Table 5b (scaled accuracy, %; its models trained on lengths up to 40, scored at
# 256), as transcribed from arXiv 2603.15569. It has no MIMO, [0, 1] GDN or attention row.
PAPER_5B = [
    {"model": "Mamba-2", "parity": 0.90, "arith. w/o brackets": 47.81, "arith. w/ brackets": 0.88},
    {"model": "Mamba-3 w/o RoPE", "parity": 2.27, "arith. w/o brackets": 1.49, "arith. w/ brackets": 0.72},
    {"model": "Mamba-3 w/ standard RoPE", "parity": 1.56, "arith. w/o brackets": 20.70, "arith. w/ brackets": 2.62},
    {"model": "Mamba-3", "parity": 100.00, "arith. w/o brackets": 98.51, "arith. w/ brackets": 87.75},
    {"model": "Gated DeltaNet [-1, 1]", "parity": 100.00, "arith. w/o brackets": 99.25, "arith. w/ brackets": 93.50},
]


def label(model: str) -> str:
    return MODELS[model][0]


def column(task: str) -> str:
    return TASKS[task][0]


def overrides(task: str, model: str, steps: int, cap_s: float = 0.0, length: int = 40, d_model: int = 64,
              d_state: int = 64, seed: int = 0) -> dict:
    """One run's config overrides: BASE's optimiser (sonata.lab.recall: Adam at 3e-3, batch 32),
    the task's layers, width `d_model`, state `d_state`, trained on `track_curriculum(length)`
    (300 steps at each of 1/8, 1/4 and 1/2 of `length`, then `length`), validated at `length`."""
    _, task_o, layers = TASKS[task]
    return {**BASE, **task_o, **MODELS[model][1], "data.seq_len": length,
            "task.curriculum": track_curriculum(length), "model.n_layers": layers, "model.d_model": d_model,
            "model.d_state": d_state, "train.seed": seed, "train.max_steps": int(steps),
            "train.max_seconds": float(cap_s)}


def scaled(accuracy: float, chance: float) -> float:
    """The paper's scaled accuracy (%): 0 at chance, 100 when every answer is right."""
    return 100 * (accuracy - chance) / (1 - chance)


def chance(task: str) -> float:
    return make_task(make_config(TASKS[task][1]).task).chance()


def runs(tasks, models, seeds, steps: int, cap_s: float = 0.0, length: int = 40, test_lengths=(40, 256),
         d_model: int = 64, d_state: int = 64, n_test: int = 256, out_dir=None, progress=None) -> tuple[list, dict]:
    """Train each (task, model, seed) and score it at `test_lengths` -> (one run row each: task,
    model, seed, params, steps and seconds, validation accuracy; {(task, model, seed):
    accuracy_by_length's rows}). Run folders '<task>-<model>-seed<seed>' under `out_dir`."""
    rows, acc = [], {}
    for task in tasks:
        for model in models:
            for seed in seeds:
                o = overrides(task, model, steps, cap_s, length, d_model, d_state, seed)
                folder = None if out_dir is None else f"{out_dir}/{task}-{model}-seed{seed}"
                m, s = train_steps(o, folder, progress=progress)
                t = make_task(make_config(o).task)
                acc[(task, model, seed)] = accuracy_by_length(m, t, list(test_lengths), n_test, n_test, seed=1234)
                rows.append({"task": task, "model": label(model), "seed": seed, "params": s["params"],
                             **steps_fields(s), "val accuracy": round(s["val_acc"], 4)})
    return rows, acc


def _at(res, length: int):
    return next((r["accuracy"] for r in res if r["length"] == length), None)


def table(acc: dict, test_length: int = 256) -> list[dict]:
    """One row per model, one column per task: the scaled accuracy (%) at `test_length`, the
    median over the seeds run, and its range over them when there are several ('-' where not
    run)."""
    tasks = list(dict.fromkeys(t for t, _, _ in acc))
    models = list(dict.fromkeys(m for _, m, _ in acc))
    out = []
    for model in models:
        row = {"model": label(model)}
        for task in tasks:
            vals = sorted(scaled(a, chance(task)) for (t, m, _), res in acc.items()
                          if t == task and m == model and (a := _at(res, test_length)) is not None)
            if not vals:
                row[column(task)] = "-"
                continue
            mid = statistics.median(vals)
            row[column(task)] = f"{mid:.1f}" + (f" ({vals[0]:.1f}..{vals[-1]:.1f}, {len(vals)} seeds)"
                                                  if len(vals) > 1 else "")
        out.append(row)
    return out


def by_length(acc: dict, task: str, seed: int) -> dict:
    """{model label: [(length, accuracy)]} of one task at one seed (the plot's curves)."""
    return {label(m): [(r["length"], r["accuracy"]) for r in res]
            for (t, m, s), res in acc.items() if t == task and s == seed}


def verdicts(acc: dict, test_length: int = 256, level: float = 90.0, near: float = 10.0) -> list[dict]:
    """The paper's two orderings checked on the measured rows, per task and seed set: the
    rotating or negative-eigenvalue models (Mamba-3, GDN [-1, 1]) at least `level` scaled at
    `test_length` at their median seed; Mamba-2 and GDN [0, 1] (real, positive transitions)
    within `near` of chance on parity. 'not run' where a row is missing."""
    out = []
    med = {(r["model"], t): v for r in table(acc, test_length) for t, v in r.items() if t != "model"}
    for task in TASKS:
        for model, claim in (("mamba3", "solves"), ("gdn-neg", "solves"), ("mamba2", "fails"), ("gdn", "fails")):
            if claim == "fails" and task != "parity":
                continue
            v = med.get((label(model), column(task)))
            if v is None or v == "-":
                holds, shown = "not run", "-"
            else:
                x = float(v.split(" ")[0])
                holds = "yes" if (x >= level if claim == "solves" else abs(x) <= near) else "no"
                shown = f"{x:.1f}"
            out.append({"task": column(task), "model": label(model),
                        "claim": f"at least {level:g} scaled" if claim == "solves" else f"within {near:g} of chance",
                        "measured": shown, "holds": holds})
    return out
