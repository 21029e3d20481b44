"""A run's summary (summary.json): what it trained, how far, how fast, where the time and
memory went, and every check's result. `run_summary` assembles it from the run's record
(sonata.train.record) and the figures the Trainer hands over by name (plan, profile, memory
guard, ...): it never reads a Trainer. `write_summary` writes it, `int8_report` adds an int8
run's figures. `Throughput` collects the sustained tokens/s as the steps go."""
from __future__ import annotations

from pathlib import Path

import torch

from sonata import kernels
from sonata.core.jsonsafe import finite_json
from sonata.core import checkpoint as ckpt
from sonata.data.batches import d2h, h2d
from sonata.model.quant import int8_state, load_int8_state, set_int8
from sonata.train import distributed
from sonata.train.evaluate import EvalResult
from sonata.train.memory import peak_memory_bytes
from sonata.train.record import RunRecord

MEASURE_SKIP = 2   # steps excluded from sustained tokens/s (compilation, allocator warm-up)


class Throughput:
    """Tokens and step time after the first MEASURE_SKIP steps of this run, and the
    bytes copied between host and device since the last step."""

    def __init__(self):
        self.tokens, self.seconds, self.steps = 0, 0.0, 0
        self.h2d, self.d2h = h2d.bytes, d2h.bytes

    def add(self, row: dict, step_tokens: int, nonfinite_steps: int, peak_mem_bytes: int) -> None:
        """Count a finished step and give its row the fields every row has (bytes copied, the
        non-finite steps so far, the peak memory), whichever way the step ended."""
        row["nonfinite_steps"], row["peak_mem_bytes"] = nonfinite_steps, peak_mem_bytes
        row["h2d_bytes"], row["d2h_bytes"] = h2d.bytes - self.h2d, d2h.bytes - self.d2h
        self.h2d, self.d2h = h2d.bytes, d2h.bytes
        self.steps += 1
        if self.steps > MEASURE_SKIP:
            self.tokens += step_tokens
            self.seconds += row["step_s"]

    @property
    def sustained(self) -> float | None:
        return self.tokens / self.seconds if self.seconds else None


def run_summary(record: RunRecord, last_eval, speed: Throughput, wall_s: float, *, cfg, plan, profile,
                device: torch.device, world: int, params: int, guard, leak_report: dict,
                train_seconds: float, data: dict) -> dict:
    """The summary of a finished run from its `record`: `last_eval` its final evaluation (an
    EvalResult, or a task's TaskEval), `speed` its throughput, `wall_s` the whole run() including
    the final checkpoint; `cfg` the run's config, `plan` and `profile` what it trained with,
    `world` its processes, `params` the model's parameters, `guard` its MemoryGuard,
    `leak_report` the LeakDetector's report, `train_seconds` the schedule's clock, `data` the
    corpus's or the task's summary. Peaks are the maxima over data-parallel ranks (a collective)."""
    peak_mem, guard_peak = peak_memory_bytes(device), guard.peak
    if world > 1:
        peak_mem, guard_peak = distributed.all_reduce_max([peak_mem, guard_peak])
    return {
        "steps": record.step, "tokens": record.tokens,
        # where the run's time went: a time budget (max_seconds) counts train_seconds only
        "wall_s": wall_s, "setup_s": record.setup_seconds, "eval_s": record.eval_seconds,
        "checkpoint_s": sum(record.checkpoint_seconds),
        "max_seconds": cfg.train.max_seconds, "train_seconds": train_seconds,   # the run's clock
        "stopped_by": record.ended_by, "resumed_budget": record.resumed_budget,
        "tok_per_s_sustained": speed.sustained, "sustained_excludes_steps": MEASURE_SKIP,
        **last_eval.fields(), **({"val_tokens": last_eval.tokens, "val_bytes": last_eval.bytes}
                                 if isinstance(last_eval, EvalResult) else {"val_sequences": last_eval.sequences}),
        "params": params,
        "device": str(device), "threads": torch.get_num_threads(),
        "world_size": world, "backend_dist": distributed.context().backend,
        "backend": kernels.resolve_backend(cfg.model.backend, torch.zeros(1, device=device))[0],
        "fallbacks": kernels.fallback_count(),
        "peak_mem_bytes": int(peak_mem),
        "h2d_bytes_in_steps": record.copied_bytes("h2d"), "d2h_bytes_in_steps": record.copied_bytes("d2h"),
        "host_offload_bytes": 0,     # nothing is offloaded to host memory in this trainer
        "precision": plan.precision, "micro_batch": plan.micro_batch, "accumulation": plan.accumulation,
        "effective_batch": plan.effective_batch, "batch_how": plan.how, "plan": plan.to_dict(),
        "profile": profile.to_dict(),
        "memory_budget_bytes": guard.budget, "guard_peak_bytes": int(guard_peak),
        **leak_report,
        "debug_leak": cfg.debug.leak,
        "autotune": record.autotune,
        **record.checkpoint_figures(),
        "restarts": distributed.context().restarts, "resumed_from_step": record.resumed_from_step,
        "launch_id": distributed.launch_id(),
        **record.counters,
        "data": data,
    }


def write_summary(summary: dict, out_dir: Path | None) -> dict:
    """`summary` (`run_summary`'s) written to `out_dir`/summary.json (None: nowhere; data
    parallel: rank 0 passes its folder) as valid JSON (`finite_json`: a NaN or infinite figure
    is null there; the dict returned, `summary` itself, keeps it)."""
    if out_dir:
        ckpt.write_atomic(Path(out_dir) / "summary.json", (finite_json(summary, indent=2) + "\n").encode(),
                          "summary")
    return summary


def int8_report(model, evaluate, device: torch.device, out_dir: Path | None = None) -> dict:
    """An int8 run's extra figures: validation (`evaluate(model=None)`: the run's evaluation of
    its own model, or of the model given) with the fake-quantization of `model` off (the float32
    weights), and of a model rebuilt from the real int8 export (weights int8 + scales), which is
    also written as model_int8.pt into `out_dir` (None: not written; data parallel: rank 0's)."""
    set_int8(model, False)
    try:
        fp32 = evaluate()
    finally:
        set_int8(model, True)
    q = type(model)(model.cfg).to(device)             # a MambaLM: int8 is sonata-only
    load_int8_state(q, int8_state(model))
    set_int8(q, True)
    export = evaluate(model=q)
    if out_dir:
        ckpt.write_atomic(Path(out_dir) / "model_int8.pt", ckpt.to_bytes(int8_state(model)), "int8 export")
    return {"val_loss_fp32_weights": fp32.loss, "val_loss_int8_export": export.loss,
            "val_bpb_int8_export": export.bpb}


__all__ = ["MEASURE_SKIP", "Throughput", "finite_json", "run_summary", "write_summary", "int8_report"]
