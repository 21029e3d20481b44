"""A run's summary (summary.json), assembled from a finished Trainer: what it trained, how
far, how fast, where the time and memory went, and every check's result. The run's
bookkeeping comes from its record (`tr.record`, sonata.train.record), the rest from the
Trainer's machinery (plan, schedule, model, memory guard, data). `Throughput` collects the
sustained tokens/s as the steps go."""
from __future__ import annotations

import torch

from sonata import kernels
from sonata.core.jsonsafe import finite_json
from sonata.core import checkpoint as ckpt
from sonata.data.batches import d2h, h2d
from sonata.model.quant import int8_state, load_int8_state, set_int8
from sonata.train import distributed
from sonata.train.memory import peak_memory_bytes

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


def run_summary(tr, last_eval, speed: Throughput, wall_s: float) -> dict:
    """The summary of trainer `tr` after its run: `last_eval` its final evaluation, `speed` its
    throughput, `wall_s` the whole run() including the final checkpoint. Peaks are the
    maxima over data-parallel ranks (a collective)."""
    plan, rec = tr.plan, tr.record
    peak_mem, guard_peak = peak_memory_bytes(tr.device), tr.guard.peak
    if tr.world > 1:
        peak_mem, guard_peak = distributed.all_reduce_max([peak_mem, guard_peak])
    return {
        "steps": rec.step, "tokens": rec.tokens,
        # where the run's time went: a time budget (max_seconds) counts train_seconds only
        "wall_s": wall_s, "setup_s": rec.setup_seconds, "eval_s": rec.eval_seconds,
        "checkpoint_s": sum(rec.checkpoint_seconds),
        "max_seconds": tr.cfg.train.max_seconds, "train_seconds": tr.schedule.train_seconds,   # the run's clock
        "stopped_by": rec.stopped_by, "resumed_budget": rec.resumed_budget,
        "tok_per_s_sustained": speed.sustained, "sustained_excludes_steps": MEASURE_SKIP,
        **last_eval.fields(), **({"val_tokens": last_eval.tokens, "val_bytes": last_eval.bytes}
                                 if tr.corpus else {"val_sequences": last_eval.sequences}),
        "params": tr.model.num_params(),
        "device": str(tr.device), "threads": torch.get_num_threads(),
        "world_size": tr.world, "backend_dist": distributed.context().backend,
        "backend": kernels.resolve_backend(tr.cfg.model.backend, torch.zeros(1, device=tr.device))[0],
        "fallbacks": kernels.fallback_count(),
        "peak_mem_bytes": int(peak_mem),
        "h2d_bytes_in_steps": rec.copied_bytes("h2d"), "d2h_bytes_in_steps": rec.copied_bytes("d2h"),
        "host_offload_bytes": 0,     # nothing is offloaded to host memory in this trainer
        "precision": plan.precision, "micro_batch": plan.micro_batch, "accumulation": plan.accumulation,
        "effective_batch": plan.effective_batch, "batch_how": plan.how, "plan": plan.to_dict(),
        "profile": tr.profile.to_dict(),
        "memory_budget_bytes": tr.guard.budget, "guard_peak_bytes": int(guard_peak),
        **tr.leak.report(),
        "debug_leak": tr.cfg.debug.leak,
        "autotune": rec.autotune,
        **rec.checkpoint_figures(),
        "restarts": distributed.context().restarts, "resumed_from_step": rec.resumed_from_step,
        "launch_id": distributed.launch_id(),
        **rec.counters,
        "data": tr.corpus.summary() if tr.corpus else tr.task.summary(tr.cfg.data.seq_len),
    }


def write_summary(tr, last_eval, speed: Throughput, wall_s: float) -> dict:
    """`run_summary` (an int8 run's `int8_report` added), written to summary.json by rank 0 as
    valid JSON (`finite_json`: a NaN or infinite figure is null there; the dict returned keeps it)."""
    summary = run_summary(tr, last_eval, speed, wall_s)
    if tr.plan.precision == "int8":
        summary.update(int8_report(tr))
    if tr.out_dir and tr.is_main:
        ckpt.write_atomic(tr.out_dir / "summary.json", (finite_json(summary, indent=2) + "\n").encode(), "summary")
    return summary


def int8_report(tr) -> dict:
    """An int8 run's extra figures: validation with the fake-quantization off (the float32
    weights) and of a model rebuilt from the real int8 export (weights int8 + scales), which
    rank 0 also writes as model_int8.pt beside the checkpoint."""
    set_int8(tr.model, False)
    try:
        fp32 = tr.evaluate()
    finally:
        set_int8(tr.model, True)
    q = type(tr.model)(tr.cfg.model).to(tr.device)             # a MambaLM: int8 is sonata-only
    load_int8_state(q, int8_state(tr.model))
    set_int8(q, True)
    export = tr.evaluate(model=q)
    if tr.out_dir and tr.is_main:
        ckpt.write_atomic(tr.out_dir / "model_int8.pt", ckpt.to_bytes(int8_state(tr.model)), "int8 export")
    return {"val_loss_fp32_weights": fp32.loss, "val_loss_int8_export": export.loss,
            "val_bpb_int8_export": export.bpb}


__all__ = ["MEASURE_SKIP", "Throughput", "finite_json", "run_summary", "write_summary", "int8_report"]
