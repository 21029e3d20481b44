"""Notebook 02's throughput studies, each returning records (the notebook writes the sentences):

- `sustained_and_peak`: a training run under its profile against a fixed-batch
  micro-benchmark, three readings each;
- `measure_scaling`: 1 against N data-parallel processes at one global batch.

A cell a run was too short to measure holds `too_few_steps`'s words; `sonata.lab.bench.ratio`
divides two cells, or gives None for such a cell.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path


from sonata.core.config import make_config
from sonata.train.memory import too_few_steps
from sonata.train.summary import MEASURE_SKIP
from sonata.train.trainer import Trainer


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
