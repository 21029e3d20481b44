"""The training loop: `Trainer(cfg, out_dir).run()` from config to checkpoint.

Each optimizer step draws the global batch from the device-side sampler, splits
this process's share into micro-batches, accumulates gradients, clips, and steps
AdamW at the learning rate of `lr_at` (warm-up + cosine, a pure function of the
step) or, under a time budget (train.max_seconds), of `lr_at_progress` (the same
cosine over the fraction of the budget used). The batch, accumulation and precision
come from the run's frozen `Plan` (sonata.plan); the MemoryGuard wraps each step (sonata.memory); data parallel adds
DDP and the agreements of sonata.distributed. The README's "Architecture" section
describes how the pieces fit.
"""
from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from sonata import checkpoint as ckpt
from sonata import distributed
from sonata import kernels
from sonata.autotune import choose_plan
from sonata.config import Config, resolve_profile
from sonata.data import BatchSampler, Corpus, build_corpus, d2h, h2d
from sonata.device import autocast_for, check_precision, resolve_device, sync
from sonata.errors import CheckpointError, ConfigError, TrainingDiverged, TrainingInterrupted, WorkerLost
from sonata.evaluate import EvalResult, evaluate_stream
from sonata.memory import (STAGE_SETTLE_STEPS, InjectedLeak, LeakDetector, MemoryBudgetExceeded, MemoryGuard,
                           available_ram_bytes, device_total_bytes, leak_threshold, peak_memory_bytes,
                           release_free_memory, steady_cpu_heap)
from sonata.model import MambaLM, param_groups
from sonata.plan import Plan, plan_batch, resumed_inputs
from sonata.progress import Progress
from sonata.rng import rng_state, seed_everything, set_rng_state
from sonata.tensorboard_log import TensorBoardLog
from sonata.tasks import TaskSampler, answer_loss, evaluate_task, make_task
from sonata.vocab import Vocab

MEASURE_SKIP = 2   # steps excluded from sustained tokens/s (compilation, allocator warm-up)


def _cosine(frac: float, t) -> float:
    """train.lr at frac 0, train.lr * train.min_lr_ratio (the floor) at frac 1, cosine between."""
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def lr_at(step: int, t) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up, then cosine to
    min_lr at train.decay_steps (0: train.max_steps), constant after."""
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, (t.decay_steps or t.max_steps) - t.warmup_steps)
    frac = min(1.0, (step - t.warmup_steps) / span)
    return _cosine(frac, t)


def lr_at_progress(step: int, progress: float, t) -> float:
    """Learning rate of a time-budgeted run (train.max_seconds) for optimizer step `step`
    ending at `progress`, the fraction of the budget used (in [0, 1]): the cosine of
    `lr_at` over the budget, so the step that ends the budget (progress 1) trains at the
    floor, train.lr * train.min_lr_ratio. Warm-up stays in steps: the rate rises linearly
    over train.warmup_steps and never exceeds the cosine."""
    lr = _cosine(min(1.0, max(0.0, progress)), t)
    if t.warmup_steps and step < t.warmup_steps:
        lr = min(lr, t.lr * (step + 1) / t.warmup_steps)
    return lr


def continue_in_steps(t, state: dict):
    """The train.* values of a run resumed from `state` (a checkpoint's dict): `t` itself,
    unless the checkpoint's run had a time budget.

    A budgeted run resumes *in steps*: the resumed run is an ordinary step-based run
    (train.max_seconds 0) whose cosine horizon (train.decay_steps) is the number of
    steps the whole budget reaches at the pace the run had, steps / (fraction of the
    budget used): for a run that used its budget (its last step ran at budget progress
    1, the checkpoint's `budget_progress`; its measured time may end a little short),
    the steps it reached (the resumed run trains at the floor), for an interrupted one
    its steps so far extrapolated to the end of its budget. train.max_steps becomes that horizon (within the budgeted
    run's step cap, if it had one), unless changed on resume. Why steps, not a fresh
    or remaining budget: time is not reproducible, steps are; from the checkpoint on,
    two resumes train identically, and a resumed run's own checkpoints resume like
    any step-based run. A budget cannot be changed (or added) on resume: a new budget
    is a new run (ConfigError)."""
    saved = state.get("config", {}).get("train", {})
    budget = float(saved.get("max_seconds", 0) or 0)
    if t.max_seconds and t.max_seconds != budget:
        raise ConfigError(f"train.max_seconds cannot be {'changed' if budget else 'set'} on resume "
                          f"(a resumed run continues in steps: set train.max_steps; a new budget is a new run)")
    steps, used = int(state.get("step", 0)), float(state.get("train_seconds", 0.0))
    if not budget or steps == 0 or used <= 0:
        return t                     # a step-based run, or a budgeted one that spent nothing yet
    if float(state.get("budget_progress", 0.0)) >= 1.0:
        horizon = steps              # its last step ran at the floor (its time may end a bit short)
    else:
        horizon = max(steps, round(steps / min(1.0, used / budget)))
    cap = int(saved.get("max_steps", 0))
    max_steps = t.max_steps if t.max_steps != cap else (min(horizon, cap) if cap else horizon)
    decay = t.decay_steps if t.decay_steps != int(saved.get("decay_steps", 0)) else horizon
    return replace(t, max_seconds=0.0, max_steps=max_steps, decay_steps=decay)


class _StopSignal:
    """While training, SIGINT/SIGTERM set a flag; the loop stops between steps, so an
    emergency checkpoint never catches an optimizer step half-applied."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:        # a second signal: stop now
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


class _Throughput:
    """Tokens and step time after the first MEASURE_SKIP steps of this run, and the
    bytes copied between host and device since the last step."""

    def __init__(self):
        self.tokens, self.seconds, self.steps = 0, 0.0, 0
        self.h2d, self.d2h = h2d.bytes, d2h.bytes

    def add(self, row: dict, step_tokens: int) -> None:
        row["h2d_bytes"], row["d2h_bytes"] = h2d.bytes - self.h2d, d2h.bytes - self.d2h
        self.h2d, self.d2h = h2d.bytes, d2h.bytes
        self.steps += 1
        if self.steps > MEASURE_SKIP:
            self.tokens += step_tokens
            self.seconds += row["step_s"]

    @property
    def sustained(self) -> float | None:
        return self.tokens / self.seconds if self.seconds else None


class Trainer:
    """trainer = Trainer(cfg, out_dir); trainer.run() -> summary dict.

    `state`: a checkpoint's dict to resume from (a budgeted run resumes in steps:
    `continue_in_steps`); `progress`: auto | bar | lines | none.
    `trainer.plan` is what the run trains with; `cfg` stays what was asked (but for
    a resumed budgeted run's train.*, which `continue_in_steps` turns into steps)."""

    def __init__(self, cfg: Config, out_dir=None, state: dict | None = None, progress: str | None = None):
        cfg.validate()
        saved_budget = (state or {}).get("config", {}).get("train", {}).get("max_seconds")
        # the checkpoint's budget, time and steps when resuming a budgeted run (the summary says it)
        self.resumed_budget = ({"max_seconds": saved_budget, "train_seconds": state.get("train_seconds", 0.0),
                                "steps": state["step"]} if saved_budget else None)
        if state:
            cfg = replace(cfg, train=continue_in_steps(cfg.train, state)).validate()
        self.cfg = cfg
        t = cfg.train
        dctx = distributed.init_from_env(t.device)       # world 1 without torchrun: nothing
        self.world, self.rank = dctx.world, dctx.rank
        self.is_main = dctx.rank == 0
        self._net = None              # the DistributedDataParallel wrapper (world > 1, from run())
        self._stop = None             # run()'s signal flag, agreed with the guard after each step
        self._threads = t.threads or (distributed.local_threads(dctx.local_world)
                                      if self.world > 1 and (dctx.device is None or dctx.device.type == "cpu")
                                      else 0)     # per rank on CPU: cores // processes on this machine
        if self._threads:
            torch.set_num_threads(self._threads)
        if self.world > 1 and not self.is_main:
            progress = "none"
        self.device = dctx.device if self.world > 1 else resolve_device(t.device)
        self.profile = resolve_profile(cfg.profile, self.device.type, available_ram_bytes(),
                                       device_total_bytes(self.device))
        asked = resumed_inputs(t, state["config"], state.get("plan"), self.world) if state else t
        self.plan: Plan = plan_batch(asked, self.profile, self.world)
        check_precision(self.plan.precision, self.device)
        if t.fixed_micro_batch:
            warnings.warn(f"sonata: micro-batch {self.plan.how}", UserWarning, stacklevel=2)
            if t.autotune:
                warnings.warn("sonata: train.autotune is ignored: train.fixed_micro_batch is set",
                              UserWarning, stacklevel=2)
        self.autotune_result: dict | None = None
        self.guard = MemoryGuard(self.profile.memory_budget_bytes, self.device,
                                 what=("profile.memory_budget_mb" if cfg.profile.memory_budget_mb else
                                       f"profile {self.profile.name}: {self.profile.budget_source}"))
        self.leak = LeakDetector()
        self._step_tokens = None      # the tokens of the last step the leak detector followed
        self.injected_leak = InjectedLeak(cfg.debug.leak)     # debug.leak: the micro-step hook
        self.before_step: list = []                           # hooks(trainer) run before each step
        if self.world > 1 and distributed.test_trip_hook(self.rank):   # test-only: see sonata.distributed
            self.before_step.append(distributed.test_trip_hook(self.rank))
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.progress_mode = progress
        # the data: a corpus (language modeling) or a synthetic task's fresh sequences
        self.task = make_task(cfg.task) if cfg.task.name else None
        self.corpus: Corpus | None = None
        if self.task is None:
            vocab = Vocab.from_state_dict(state["vocab"]) if state else None
            self.corpus = build_corpus(cfg.data, self.device, vocab=vocab, progress=progress,
                                       budget_bytes=self.profile.memory_budget_bytes)
        cfg.model.vocab_size = self.task.vocab_size if self.task else len(self.corpus.vocab)
        seed_everything(t.seed)
        self.model = MambaLM(cfg.model).to(self.device)
        self.model.set_int8(self.plan.precision == "int8")
        # fused: one kernel over all parameters (CPU and CUDA), 4x faster than the per-tensor loop
        self.optimizer = torch.optim.AdamW(param_groups(self.model, t.weight_decay), lr=t.lr,
                                           betas=(0.9, t.beta2), eps=1e-8,
                                           fused=self.device.type in ("cpu", "cuda"))
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.plan.precision == "fp16")
        self.sampler = (TaskSampler(self.task, cfg.data.seq_len, seed=t.seed, device=self.device,
                                    curriculum=cfg.task.curriculum) if self.task
                        else BatchSampler(self.corpus.train, cfg.data.seq_len, seed=t.seed, device=self.device))
        self.step = 0
        self.tokens = 0
        self.train_seconds = 0.0      # time inside optimizer steps, all runs of this model (resumes add)
        self._last_step_s = 0.0       # the last step's time (data parallel: the slowest rank's)
        self._last_progress = 0.0     # under a budget: the budget fraction the last step ran at
        self._step_s = 0.0            # this rank's time of the last train_step
        self.stopped_by: str | None = None   # after run(): "time" (the budget) or "steps"
        self.counters = {"nonfinite_steps": 0, "scaler_skipped_steps": 0}
        self._consecutive_nonfinite = 0
        self._step_start = None       # (sampler, rng) at the start of the step in progress (DDP)
        self.checkpoint_seconds: list[float] = []
        self.setup_seconds = 0.0      # before the first step of run() (autotuning, kernel warm-up)
        self.eval_seconds = 0.0       # validation inside run()
        self._last_save = time.monotonic()
        self.resumed_from_step = int(state["step"]) if state else None
        self.history: list[dict] = []
        self._last_row: dict | None = None          # the metrics row of the last completed step
        self._resumed_last_row: dict | None = None
        self.emergency_reason: str | None = None
        self._byte_len = (torch.from_numpy(self.corpus.vocab.byte_lengths).to(self.device)
                          if self.corpus else None)
        if state:
            self.load_state_dict(state)
            if self.autotune_result:
                self.plan = self.plan.with_batch(self.plan.micro_batch,
                                                 "autotuned before step 1 (recorded in the checkpoint)")

    @property
    def accumulation(self) -> int:
        """Micro-steps per optimizer step on this process."""
        return self.plan.accumulation

    @property
    def batch_how(self) -> str:
        return self.plan.how

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything a resume needs (what a checkpoint holds)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
                "scheduler": {"kind": "warmup_cosine", "step": self.step},
                "step": self.step, "micro_step": self.step * self.accumulation * self.world,
                "world_size": self.world,
                "tokens": self.tokens, "train_seconds": self.train_seconds,
                "budget_progress": self._last_progress, "counters": dict(self.counters),
                "consecutive_nonfinite": self._consecutive_nonfinite,
                "sampler": self.sampler.state_dict(), "rng": rng_state(),
                "vocab": self.corpus.vocab.state_dict() if self.corpus else None, "config": self.cfg.to_dict(),
                "plan": self.plan.to_dict(), "last_row": self._last_row,
                "launch_id": distributed.launch_id(),   # which launch wrote it (restarts resume only their own)
                "profile": self.profile.to_dict(), "autotune": self.autotune_result}

    def load_state_dict(self, state: dict) -> None:
        """The training state of `state_dict()` (the plan is resolved in __init__)."""
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            self.sampler.load_state_dict(state["sampler"])
            self.step, self.tokens = int(state["step"]), int(state["tokens"])
            self.train_seconds = float(state.get("train_seconds", 0.0))
            self.counters.update(state.get("counters", {}))
            self._consecutive_nonfinite = int(state.get("consecutive_nonfinite", 0))
            self.autotune_result = state.get("autotune")
            self._last_row = self._resumed_last_row = state.get("last_row")
            set_rng_state(state["rng"])
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            raise CheckpointError(f"checkpoint does not match this configuration: {str(e).splitlines()[0][:200]}") from None
        self.optimizer.zero_grad(set_to_none=True)

    def start_from(self, model_state: dict) -> None:
        """A new run from another run's weights (`train --init`, notebook 08's second phase):
        the model's parameters, nothing else (the optimizer, schedule and data start afresh).
        Weights of another architecture or shape are a CheckpointError."""
        try:
            self.model.load_state_dict(model_state)
        except (RuntimeError, KeyError) as e:
            raise CheckpointError(f"the initial weights do not fit this model: {str(e).splitlines()[0][:200]}") from None

    def model_is_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def save_checkpoint(self, path=None, any_rank: bool = False) -> Path | None:
        """Atomic save; a model with NaN/Inf weights is never written over a good checkpoint.
        Rank 0 writes (the state is the same on every rank) unless `any_rank` (a survivor
        of a lost peer). With train.keep_checkpoints=K the last K are also kept by step."""
        path = Path(path) if path else self.out_dir / "checkpoint.pt"
        if not (self.is_main or any_rank):
            return path
        if not self.model_is_finite():
            warnings.warn(f"sonata: model has non-finite weights at step {self.step}; "
                          f"checkpoint {path} left as it was", RuntimeWarning, stacklevel=2)
            return None
        t0 = time.perf_counter()
        ckpt.save(self.state_dict(), path)
        if self.cfg.train.keep_checkpoints and path.name == "checkpoint.pt":
            ckpt.keep_last(path, self.step, self.cfg.train.keep_checkpoints)
        self.checkpoint_seconds.append(time.perf_counter() - t0)
        self._last_save = time.monotonic()
        return path

    def _checkpoint_due(self, final: bool) -> bool:
        """Every train.checkpoint_every steps, and when train.checkpoint_every_s passed since
        the last checkpoint (the final one is written by _finish)."""
        t = self.cfg.train
        if not self.out_dir or final:
            return False
        return bool((t.checkpoint_every and self.step % t.checkpoint_every == 0) or
                    (t.checkpoint_every_s and time.monotonic() - self._last_save >= t.checkpoint_every_s))

    # ------------------------------------------------------------------ one step
    def train_step(self, plan: Plan | None = None) -> dict:
        """One optimizer step under `plan` (default: the run's); a non-finite loss or
        gradient skips the update (counted). Returns the step's metrics row."""
        plan = plan or self.plan
        ddp = plan.world_size > 1
        net = self._net if ddp and self._net is not None else self.model
        if ddp:     # a peer lost inside this step: the survivors save the state of its start
            self._step_start = (self.sampler.state_dict(), rng_state())
        sync(self.device)
        t0 = time.perf_counter()
        lr = self._set_lr()
        # the global batch's offsets, this rank's shard of rows (the whole batch at world 1)
        x, y = self.sampler.draw(plan.effective_batch, shard=(self.rank, self.world) if ddp else (0, 1))
        loss_sum = self._micro_steps(net, x, y, plan)
        grad_norm = self._clip_gradients()
        loss, gnorm, bad = self._read_loss(loss_sum / plan.accumulation, grad_norm, plan)
        skipped = self._optimizer_step(bad)
        self._count(skipped)
        if self._threads and torch.get_num_threads() != self._threads:
            # numba's OpenMP layer resets the OpenMP thread count when its pool starts (the
            # first fused-kernel call): set ours again, so train.threads / threads per rank hold
            torch.set_num_threads(self._threads)
        sync(self.device)                       # the clock is read only once the device is done
        dt = time.perf_counter() - t0
        self._step_s = dt
        n_tok = plan.effective_batch * x.shape[1]          # x: this rank's rows; a task's length may vary
        self.step += 1
        self.tokens += n_tok
        self._step_start = None
        row = {"step": self.step, "loss": loss, "lr": lr, "tokens": self.tokens, "step_tokens": n_tok,
               "tok_per_s": n_tok / dt, "step_s": dt, "grad_norm": gnorm,
               "skipped": skipped, "fallbacks": kernels.fallback_count()}
        if self.cfg.debug.leak != "none":
            row["debug_leak"] = self.cfg.debug.leak
        return row

    def _set_lr(self) -> float:
        lr = self.lr_now()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def budget_progress(self) -> float:
        """Under train.max_seconds: the fraction of the budget that will be used when the
        next step ends, estimated as the training seconds so far plus the last step's
        time (at most 1; the step that reaches 1 is the run's last)."""
        return min(1.0, (self.train_seconds + self._last_step_s) / self.cfg.train.max_seconds)

    def lr_now(self) -> float:
        """The learning rate of the next optimizer step."""
        t = self.cfg.train
        return lr_at_progress(self.step, self.budget_progress(), t) if t.max_seconds else lr_at(self.step, t)

    def _micro_steps(self, net, x, y, plan: Plan) -> torch.Tensor:
        """Forward and backward of each micro-batch; returns the summed loss (on device)."""
        mb, acc = plan.micro_batch, plan.accumulation
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for i in range(acc):
            xb, yb = x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]
            # DDP: gradients are all-reduced only in the last micro-step's backward
            no_sync = net.no_sync() if net is not self.model and i < acc - 1 else contextlib.nullcontext()
            with no_sync:
                with autocast_for(plan.precision, self.device):
                    logits = net(xb)                                    # (mb, L, V)
                loss = self._loss(logits.float(), yb)
                with distributed.collective("DDP backward", backend_marks_only=True) if net is not self.model \
                        else contextlib.nullcontext():          # DDP all-reduces gradients in it
                    self.scaler.scale(loss / acc).backward(retain_graph=self.injected_leak.retain_graph)
                loss_sum += loss.detach()
                self.injected_leak.after_backward(loss, logits)
        return loss_sum

    def _loss(self, logits, y) -> torch.Tensor:
        """The training loss: cross-entropy of every next token, or of a task's answers only."""
        def loss_fn(lg, tg):
            return kernels.cross_entropy(lg, tg, self.cfg.model.backend)
        return answer_loss(logits, y, loss_fn) if self.task else loss_fn(logits, y)

    def _clip_gradients(self) -> torch.Tensor:
        self.scaler.unscale_(self.optimizer)
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)

    def _read_loss(self, loss: torch.Tensor, grad_norm: torch.Tensor, plan: Plan) -> tuple[float, float, bool]:
        """(loss, gradient norm, non-finite?) as numbers; data parallel: the mean loss over
        ranks, and any rank's non-finite value counts for all."""
        loss_val = d2h.item(loss)                                       # synchronizes the device
        gnorm = d2h.item(grad_norm)
        bad = not math.isfinite(loss_val) or (not math.isfinite(gnorm) and plan.precision != "fp16")
        if plan.world_size > 1:
            loss_val, bad = distributed.agree_on_loss(loss_val, bad)
        return loss_val, gnorm, bad

    def _optimizer_step(self, bad: bool) -> str | None:
        """Step (unless `bad`) and apply the constraint; returns why the update was skipped."""
        if bad:
            self.scaler.update()                                        # no-op unless fp16
            skipped = "nonfinite"
        else:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)                            # skips itself on inf grads (fp16)
            self.scaler.update()
            skipped = "scaler" if self.scaler.is_enabled() and self.scaler.get_scale() < scale else None
            if skipped is None and self.cfg.model.a_constraint:
                for layer in self.model.layers:
                    layer.mixer.constrain_A(self.cfg.model.a_min)
        self.optimizer.zero_grad(set_to_none=True)
        return skipped

    def _count(self, skipped: str | None) -> None:
        if skipped == "nonfinite":
            self.counters["nonfinite_steps"] += 1
            self._consecutive_nonfinite += 1
        else:
            self._consecutive_nonfinite = 0
            if skipped == "scaler":
                self.counters["scaler_skipped_steps"] += 1

    # ------------------------------------------------------------------ batch plan
    def apply_autotune(self, progress: str | None = None) -> dict:
        """Measure the profile's candidates (the trainer's state is restored after) and
        train with the choice (data parallel: rank 0's, broadcast). Returns the result
        as a dict; raises SonataError when no candidate is eligible."""
        with self._bar(len(self.profile.candidates), "autotune", progress) as bar:
            self.plan, self.autotune_result = choose_plan(self, progress=bar)
        return self.autotune_result

    def _bar(self, total: int, what: str, progress: str | None = None):
        return contextlib.closing(Progress(total, what, self.progress_mode if progress is None else progress))

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, max_tokens: int | None = None, model: MambaLM | None = None,
                 split: str = "validation"):
        """Validation loss and bits per byte (the whole split unless train.eval_tokens or
        `max_tokens` limit it); data parallel: sharded over the ranks, summed. `split`
        "train": the same figures on the start of the training stream. A task: loss and
        accuracy on its fixed validation sequences at the training length (TaskEval)."""
        t = self.cfg.train
        if self.task:
            k = self.cfg.task
            return evaluate_task(model or self.model, self.task, self.cfg.data.seq_len, k.eval_seqs,
                                 k.eval_seed, chunked=self.cfg.model.arch != "attention")
        stream = {"validation": self.corpus.val, "train": self.corpus.train}[split]
        return evaluate_stream(model or self.model, stream, self._byte_len, self.cfg.data.seq_len,
                               max(16, self.plan.micro_batch), t.eval_tokens if max_tokens is None else max_tokens,
                               self.plan.precision, (self.rank, self.world))

    def _timed_evaluate(self):
        t0 = time.perf_counter()
        try:
            return self.evaluate()
        finally:
            self.eval_seconds += time.perf_counter() - t0

    def evaluate_int8_export(self) -> EvalResult:
        """Validation of a model rebuilt from the real int8 export (weights int8 + scales)."""
        q = MambaLM(self.cfg.model).to(self.device)
        q.load_int8_state(self.model.int8_state())
        q.set_int8(True)
        return self.evaluate(model=q)

    # ------------------------------------------------------------------ the loop
    def run(self, on_step=None) -> dict:
        """Train to train.max_steps, or under a time budget (train.max_seconds > 0) until
        that many seconds of training time have passed. `on_step(trainer, row)` may add
        fields to each row.

        Training time is the time inside optimizer steps (`row["step_s"]`, summed; data
        parallel: the slowest rank's each step): setup, autotuning, evaluation, metrics
        and checkpoint writing are not counted. Each row's `train_s` is the total so far.
        Under a budget the learning rate follows `lr_at_progress` (the cosine ends at
        the budget) and the run stops after the step whose projected end reaches it
        (that step trains at the floor); train.max_steps > 0 still caps it, and the
        first of the two ends the run (a warning says when the step cap came first);
        train.max_steps=0 means no step cap. train.eval_every stays in steps."""
        t = self.cfg.train
        t_start = time.perf_counter()
        with self._on_lost_peer():           # autotuning and DDP's construction talk to the peers too
            self._prepare()
        self.setup_seconds = time.perf_counter() - t_start       # autotuning, DDP, kernel warm-up
        metrics = self._open_metrics() if self.out_dir else None
        tboard = TensorBoardLog(self.out_dir) if metrics and t.tensorboard else None
        speed = _Throughput()
        last_eval: EvalResult | None = None
        peak_all = 0
        try:
            with self._train_bar() as bar, _StopSignal() as stop, \
                    self._on_lost_peer():                  # inside: signals are still only flagged
                self._stop = stop
                while not self._finished():
                    row, peak_all, signum = self._guarded_step()
                    speed.add(row, row["step_tokens"])
                    row["nonfinite_steps"] = self.counters["nonfinite_steps"]
                    row["peak_mem_bytes"] = peak_all
                    self._follow_memory(row)
                    if on_step is not None:
                        on_step(self, row)
                    final = self._finished(row)
                    if (t.eval_every and self.step % t.eval_every == 0) or final:
                        last_eval = self._timed_evaluate()
                        row.update(last_eval.fields())
                    self.history.append(row)
                    due = self.step % t.log_every == 0 or final or "val_loss" in row or row["skipped"]
                    # a checkpoint carries the row of its step: a resume writes it when the
                    # file lacks it (rank 0 died after the step, a survivor saved)
                    self._last_row = row if due else None
                    if metrics and due:
                        metrics.write(row)
                        if tboard:
                            tboard.write(row)
                    self._stop_if_diverged()
                    if self._checkpoint_due(final):
                        self.save_checkpoint()
                    bar.update(self._bar_units(bar), loss=row["loss"], **{"tok/s": round(row["tok_per_s"])},
                               **({"val_bpb": row["val_bpb"]} if "val_bpb" in row else {}))
                    if signum is not None:
                        self._stop_on_signal(signum)
        except MemoryBudgetExceeded as e:
            done = self._last_row
            if done is not None and done["step"] == self.step and (not self.history or self.history[-1] is not done):
                self.history.append(done)            # a step the check after it tripped: logged too
                if metrics:
                    metrics.write(done)
            raise self._memory_tripped(e) from None
        except KeyboardInterrupt:
            # a second Ctrl-C mid-step: the step may be half-applied, so keep the last
            # periodic checkpoint rather than writing this state over it
            self.emergency_reason = "KeyboardInterrupt"
            raise
        finally:
            if metrics:
                metrics.close()
            if tboard:
                tboard.close()
        self._warn_if_capped()
        with self._on_lost_peer():           # the final evaluation and the peaks are collectives
            distributed.test_exit_point("finish")
            return self._finish(last_eval or self._timed_evaluate(), speed, t_start)

    def _finished(self, row: dict | None = None) -> bool:
        """Whether the run is over, and why (`stopped_by`): its budget spent (the step of
        `row` ran at progress 1) or its step count reached."""
        t = self.cfg.train
        if self.stopped_by is None:
            if t.max_seconds and row is not None and row["progress"] >= 1.0:
                self.stopped_by = "time"
            elif self.step >= t.max_steps and (t.max_steps or not t.max_seconds):
                self.stopped_by = "steps"
        return self.stopped_by is not None

    def _warn_if_capped(self) -> None:
        t = self.cfg.train
        if t.max_seconds and self.stopped_by == "steps" and t.min_lr_ratio < 1:
            warnings.warn(f"sonata: train.max_steps={t.max_steps} ended the run after {self.train_seconds:.1f} s "
                          f"of its {t.max_seconds:g} s budget (the learning rate had not reached its floor); "
                          f"train.max_steps=0 lifts the step cap", UserWarning, stacklevel=3)

    def _train_bar(self):
        """Steps to go; under a budget, whole seconds of it."""
        t = self.cfg.train
        if t.max_seconds:
            return self._bar(math.ceil(t.max_seconds), f"train ({t.max_seconds:g} s budget, seconds)")
        return self._bar(t.max_steps - self.step, "train")

    def _bar_units(self, bar) -> int:
        if not self.cfg.train.max_seconds:
            return 1
        done = bar.total if self.stopped_by == "time" else min(bar.total, int(self.train_seconds))
        return max(0, done - bar.n)

    def _prepare(self) -> None:
        """Before the first step: autotune when asked, the DDP wrapper, clean counters."""
        t = self.cfg.train
        kernels.reset_fallback_count()
        if self.device.type == "cpu":
            steady_cpu_heap()
        release_free_memory(self.device)
        if t.autotune and not t.fixed_micro_batch and self.autotune_result is None:
            self.apply_autotune()
        if t.max_seconds and self._net is None:        # (a DDP-wrapped model is warm already)
            self._warm_kernels()
        if self.world > 1 and self._net is None:
            from torch.nn.parallel import DistributedDataParallel as DDP
            distributed.test_exit_point("prepare")
            with distributed.collective("DDP construction"):     # it broadcasts rank 0's weights
                self._net = DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self._stop = None
        self._leak_warned = False
        self._last_save = time.monotonic()
        self._last_step_s = 0.0      # an autotuner's steps do not count towards the budget
        self.stopped_by = None

    def _warm_kernels(self) -> None:
        """Under a time budget, before the clock starts: one forward and backward of a
        micro-batch of zeros, no update (the gradients are dropped; no random number is
        drawn), so the one-time cost of compiling or loading the scan kernels (seconds
        on the first step of a process) is setup, not training time."""
        x = torch.zeros((self.plan.micro_batch, self.cfg.data.seq_len), dtype=torch.long, device=self.device)
        self.model.train()
        with autocast_for(self.plan.precision, self.device):
            logits = self.model(x)
        logits.float().sum().backward()
        self.optimizer.zero_grad(set_to_none=True)
        sync(self.device)

    def _guarded_step(self) -> tuple[dict, int, int | None]:
        """One step inside the memory guard: (row, peak memory, signal to stop on).
        Data parallel: the guard's checks, the peaks and the signal are agreed over ranks."""
        for hook in self.before_step:
            hook(self)
        if self.cfg.train.max_seconds:
            progress = self.budget_progress()       # what the step's learning rate is set from
        row = None
        try:
            with self.guard.watch(self.step, self._agree if self.world > 1 else None) as watch:
                row = self._last_row = self.train_step()   # the same dict gains its fields below
        except MemoryBudgetExceeded:
            if row is not None:          # the step completed; the check after it tripped: it counts
                if self.cfg.train.max_seconds:
                    row["progress"] = self._last_progress = progress
                self._count_time(row["step_s"], row)
            raise
        if self.cfg.train.max_seconds:
            row["progress"] = self._last_progress = progress
        row["mem_bytes"], row["step_peak_bytes"] = watch.mem_bytes, watch.peak
        if watch.maxima is None:
            self._count_time(row["step_s"], row)
            return row, peak_memory_bytes(self.device), self._stop.signum
        peak_all, row["step_peak_bytes"], signum = (int(v) for v in watch.maxima[:3])
        self._count_time(watch.maxima[3], row)       # every rank counts the same time
        return row, peak_all, signum or None          # a later signal: the next step's turn

    def _count_time(self, step_s: float, row: dict) -> None:
        self._last_step_s = step_s
        self.train_seconds += step_s
        row["train_s"] = self.train_seconds

    def _agree(self, err: MemoryBudgetExceeded | None, numbers) -> list[float]:
        """The guard's agreement; after the step it also carries this rank's signal and
        step time (the maximum over ranks is the step's training time everywhere)."""
        extra = [*numbers, self._stop.signum or 0, self._step_s] if numbers is not None else []
        return distributed.agree_on_trip(err, extra)

    def _follow_memory(self, row: dict) -> None:
        """The leak detector; it warns once per run. A step of another size (a task's
        curriculum moving to its next length) starts its window afresh: the memory a longer
        sequence needs is the workload's, not a leak."""
        if row["step_tokens"] != self._step_tokens:
            if self._step_tokens is not None:           # the heap settles for a few steps first
                self.leak = LeakDetector(skip=STAGE_SETTLE_STEPS)
            self.leak.threshold = leak_threshold(row["step_tokens"])     # it grows with the step
            self._step_tokens = row["step_tokens"]
        self.leak.record(row["mem_bytes"])
        if self.leak.enough:
            row["mem_slope_bytes_per_step"] = self.leak.slope()
            if not self._leak_warned and self.leak.leaking():
                self._leak_warned = True
                warnings.warn(f"sonata: {self.leak.message()} (step {self.step})", RuntimeWarning, stacklevel=3)

    def _stop_if_diverged(self) -> None:
        n = self._consecutive_nonfinite
        if n < self.cfg.train.max_nonfinite:
            return
        self._emergency("nonfinite")
        raise TrainingDiverged(
            f"{n} consecutive non-finite steps, the last at step {self.step}",
            f"updates were skipped, the last good state is in "
            f"{self.out_dir / 'checkpoint.pt' if self.out_dir else '(no --out)'}",
            "lower train.lr or check the data", step=self.step, agreed=self.world > 1)

    def _stop_on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        self._emergency(name)
        raise TrainingInterrupted(
            f"stopped by {name} after step {self.step}",
            f"resume with --resume {self.out_dir / 'checkpoint.pt' if self.out_dir else '?'}",
            signum=signum, step=self.step, agreed=self.world > 1)

    def _emergency(self, reason: str) -> Path | None:
        self.emergency_reason = reason
        if self.out_dir:
            return self.save_checkpoint()
        return None

    @contextlib.contextmanager
    def _on_lost_peer(self):
        """Data parallel: a failed collective (a peer died or hung) becomes WorkerLost,
        after this survivor saved the last completed step."""
        try:
            yield
        except Exception as e:       # noqa: BLE001 - only a lost peer is handled here
            if self.world > 1 and distributed.is_comm_error(e):
                raise self._lost_peer(e) from None
            raise

    def _lost_peer(self, e: BaseException) -> WorkerLost:
        """Another process died or hung: save the last completed step here (every survivor
        holds a full replica; a step cut short is rolled back to its start) and stop."""
        if self._step_start is not None:            # the model and optimizer are untouched
            sampler, rng = self._step_start
            self.sampler.load_state_dict(sampler)
            set_rng_state(rng)
            self.optimizer.zero_grad(set_to_none=True)
        self.emergency_reason = "lost a peer"
        path = self.save_checkpoint(any_rank=True) if self.out_dir else None
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        return WorkerLost(first, checkpoint=path, step=self.step, rank=self.rank)

    def _memory_tripped(self, e: MemoryBudgetExceeded) -> MemoryBudgetExceeded:
        self.injected_leak.clear()                    # a debug leak must not reach the checkpoint
        self.optimizer.zero_grad(set_to_none=True)    # the gradients of a failed step
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return e.stopped(self.step, self._emergency("memory")).replace(agreed=self.world > 1)

    def _open_metrics(self) -> ckpt.MetricsLog | None:
        if not self.is_main:
            return None
        return ckpt.MetricsLog(self.out_dir / "metrics.jsonl", through_step=self.step,
                               last_row=self._resumed_last_row)

    def _finish(self, last_eval: EvalResult, speed: _Throughput, t_start: float) -> dict:
        """The summary (written with the final checkpoint on rank 0); its wall time runs from
        `t_start` to after that checkpoint, so it holds every part it lists."""
        plan = self.plan
        if self.out_dir and self.is_main:
            self.save_checkpoint()
        wall_s = time.perf_counter() - t_start
        peak_mem, guard_peak = (peak_memory_bytes(self.device), self.guard.peak)
        if self.world > 1:
            peak_mem, guard_peak = distributed.all_reduce_max([peak_mem, guard_peak])
        summary = {
            "steps": self.step, "tokens": self.tokens,
            # where the run's time went: a time budget (max_seconds) counts train_seconds only
            "wall_s": wall_s, "setup_s": self.setup_seconds, "eval_s": self.eval_seconds,
            "checkpoint_s": sum(self.checkpoint_seconds),
            "max_seconds": self.cfg.train.max_seconds, "train_seconds": self.train_seconds,
            "stopped_by": self.stopped_by, "resumed_budget": self.resumed_budget,
            "tok_per_s_sustained": speed.sustained,
            "sustained_excludes_steps": MEASURE_SKIP,
            **last_eval.fields(), **({"val_tokens": last_eval.tokens, "val_bytes": last_eval.bytes}
                                     if self.corpus else {"val_sequences": last_eval.sequences}),
            "params": self.model.num_params(),
            "device": str(self.device), "threads": torch.get_num_threads(),
            "world_size": self.world, "backend_dist": distributed.context().backend,
            "backend": kernels.resolve_backend(self.cfg.model.backend,
                                               torch.zeros(1, device=self.device))[0],
            "fallbacks": kernels.fallback_count(),
            "peak_mem_bytes": int(peak_mem),       # the maximum over ranks
            "h2d_bytes_in_steps": sum(r["h2d_bytes"] for r in self.history),
            "d2h_bytes_in_steps": sum(r["d2h_bytes"] for r in self.history),
            "host_offload_bytes": 0,     # nothing is offloaded to host memory in this trainer
            "precision": plan.precision,
            "micro_batch": plan.micro_batch, "accumulation": plan.accumulation,
            "effective_batch": plan.effective_batch, "batch_how": plan.how,
            "plan": plan.to_dict(),
            "profile": self.profile.to_dict(),
            "memory_budget_bytes": self.guard.budget, "guard_peak_bytes": int(guard_peak),
            **self.leak.report(),
            "debug_leak": self.cfg.debug.leak,
            "autotune": self.autotune_result,
            "checkpoints_written": len(self.checkpoint_seconds),
            "checkpoint_s_mean": (sum(self.checkpoint_seconds) / len(self.checkpoint_seconds)
                                  if self.checkpoint_seconds else None),
            "checkpoint_s_max": max(self.checkpoint_seconds, default=None),
            "restarts": distributed.context().restarts, "resumed_from_step": self.resumed_from_step,
            "launch_id": distributed.launch_id(),
            **self.counters,
            "data": self.corpus.summary() if self.corpus else self.task.summary(self.cfg.data.seq_len),
        }
        if plan.precision == "int8":
            fp32 = self._eval_without_int8()
            q = self.evaluate_int8_export()
            summary.update(val_loss_fp32_weights=fp32.loss, val_loss_int8_export=q.loss,
                           val_bpb_int8_export=q.bpb)
            if self.out_dir and self.is_main:
                ckpt.write_atomic(self.out_dir / "model_int8.pt", ckpt.to_bytes(self.model.int8_state()),
                                  "int8 export")
        if self.out_dir and self.is_main:
            ckpt.write_atomic(self.out_dir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode(),
                              "summary")
        return summary

    def _eval_without_int8(self) -> EvalResult:
        self.model.set_int8(False)
        try:
            return self.evaluate()
        finally:
            self.model.set_int8(True)
