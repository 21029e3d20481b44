"""The training loop: one `Trainer` from config to checkpoint.

Each optimizer step draws `effective_batch` windows at once from the device-side
sampler and splits them into micro-batches (so the data order does not depend on
the micro-batch), accumulates gradients with the loss scaled by 1/accumulation,
clips, sets the learning rate from the warm-up + cosine schedule (a pure function
of the step, so resume needs no scheduler object), and steps AdamW. Every
`log_every` steps a row goes to `metrics.jsonl`; validation reports loss per token
and bits per byte over the whole validation split.

Precision modes: fp32; fp16 (autocast + GradScaler, its skipped steps counted); bf16
(autocast); int8 (fake-quantized projections and head, straight-through gradients,
real int8 export evaluated beside the fp32 weights). A NaN/Inf loss or gradient skips
the update; `max_nonfinite` in a row stops training with the last good state saved.
SIGINT/SIGTERM stop between steps with an emergency checkpoint, so a checkpoint never
holds a half-applied step.

Profile and batch. The Profile (sonata.config) caps the run: `train.micro_batch=0`
takes the largest profile candidate within the cap that divides the effective batch;
`train.autotune=true` measures the candidates first (sonata.autotune) and trains with
the fastest that fits; `train.fixed_micro_batch=N` skips both the tuner and the cap
(a warning says so). The MemoryGuard (sonata.memory) checks before and after every
step; when it trips, the last good state is checkpointed and `MemoryBudgetExceeded`
is raised. The leak detector follows the memory after each step and warns once.

`debug.leak` reproduces two classic leaks on purpose (notebook 03): `keep_graph`
keeps every step's loss with its autograd graph (the backward retains the graph, so
its saved activations stay alive), `keep_activations` keeps each micro-step's
logits (detached: the activations outlive the backward, the graph does not). Off by
default; every metrics row names it when on.

Data parallel (sonata.distributed; `torchrun -m sonata train` or `python -m sonata
train --nproc N`). `train.effective_batch` is the GLOBAL batch: each of the W ranks
trains on effective_batch / W sequences per step (its contiguous shard of the global
batch, drawn as a single process draws it: see BatchSampler.draw), in micro-batches
of train.micro_batch, accumulation = effective_batch / (micro_batch x W), with
DistributedDataParallel (`no_sync` on all but the last micro-step). DDP averages the
gradients, so the update equals the single-process update for the same global batch
up to float summation order; clipping follows the sync; the reported loss is the
mean over ranks, and the non-finite decision is agreed (any rank's non-finite value
skips the step everywhere). Only rank 0 writes metrics, checkpoints (the bare
model's state dict: the same format as a single-process run, loadable on any number
of ranks), the summary and progress. The memory guard runs on every rank; each
check is agreed by a collective before anything is raised, so a trip on one rank
stops all ranks at the same step (rank 0 checkpoints the last good state and names
the rank). Signals and divergence are agreed the same way. With the autotuner on,
rank 0 measures the candidates alone (the bare model, no collectives: the per-rank
throughput that the micro-batch decides) while the other ranks wait, and broadcasts
its choice.
"""
from __future__ import annotations

import contextlib
import json
import math
import random
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from sonata import checkpoint as ckpt
from sonata import distributed
from sonata import kernels
from sonata.config import Config
from sonata.data import BatchSampler, Corpus, Vocab, build_corpus, d2h, h2d, val_batches
from sonata.config import resolve_profile
from sonata.errors import CheckpointError, ConfigError, TrainingDiverged, TrainingInterrupted
from sonata.memory import (LeakDetector, MemoryBudgetExceeded, MemoryGuard, available_ram_bytes,
                           device_total_bytes, is_out_of_memory, peak_memory_bytes,
                           release_free_memory)
from sonata.kernels.timing import sync
from sonata.model import MambaLM, param_groups
from sonata.progress import Progress
from sonata.tensorboard_log import TensorBoardLog

MEASURE_SKIP = 2   # steps excluded from sustained tokens/s (compilation, allocator warm-up)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available")
    return torch.device(name)


def lr_at(step: int, t) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up, then cosine to
    min_lr at train.decay_steps (0: train.max_steps), constant after."""
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, (t.decay_steps or t.max_steps) - t.warmup_steps)
    frac = min(1.0, (step - t.warmup_steps) / span)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)),
                       "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                       "gauss": float(np_state[4])}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class EvalResult:
    loss: float       # nats per token
    bpb: float        # bits per UTF-8 byte
    tokens: int
    bytes: int


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


def autocast_for(precision: str, device: torch.device):
    if precision == "fp16":
        return torch.autocast(device.type, dtype=torch.float16)
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def check_precision(precision: str, device: torch.device) -> None:
    """A clear error where a mode cannot run, never a silent switch."""
    if precision in ("fp16", "bf16"):
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"train.precision=bf16 cannot run on {torch.cuda.get_device_name(device)}")
        try:
            with torch.autocast(device.type, dtype=dtype):
                torch.nn.functional.linear(torch.ones(2, 2, device=device), torch.ones(2, 2, device=device))
        except (RuntimeError, AssertionError) as e:
            raise ConfigError(f"train.precision={precision} cannot run on {device.type}: "
                              f"{str(e).splitlines()[0]}") from None


def plan_batch(t, profile, world: int = 1) -> tuple[int, int, str]:
    """(micro_batch, effective_batch, how) before any autotuning, from train.* and the
    profile. The effective batch is global: with `world` processes each trains on
    effective / world sequences, which the micro-batch must divide. Raises ConfigError
    for a micro-batch above the cap or a batch that does not split."""
    eff = t.effective_batch or profile.effective_batch
    if eff % world:
        raise ConfigError(f"train.effective_batch ({eff}) is the global batch and must be a "
                          f"multiple of the number of processes ({world})")
    per = eff // world
    split = f" (train.effective_batch {eff} / {world} processes = {per})" if world > 1 else ""
    if t.fixed_micro_batch:
        n = t.fixed_micro_batch
        how = (f"fixed by train.fixed_micro_batch={n}: the autotuner and the profile cap "
               f"({profile.max_micro_batch}) are off; ")
        if per % n == 0:
            return n, eff, how + f"accumulation {per // n}" + (f" on each of {world} processes"
                                                              if world > 1 else "")
        if world > 1:
            raise ConfigError(f"train.fixed_micro_batch ({n}) must divide the per-process batch{split}")
        # one process: a peak micro-benchmark of n sequences, whatever the effective batch
        return n, n, how + f"effective batch {n}, not {eff}, which is not a multiple of {n}"
    if t.micro_batch:
        if t.micro_batch > profile.max_micro_batch:
            raise ConfigError(
                f"train.micro_batch={t.micro_batch} is above profile {profile.name}'s cap of "
                f"{profile.max_micro_batch}; raise profile.max_micro_batch, or use "
                f"train.fixed_micro_batch={t.micro_batch} for a peak micro-benchmark")
        if per % t.micro_batch:
            raise ConfigError(f"train.micro_batch ({t.micro_batch}) must divide the per-process batch{split}"
                              if world > 1 else f"train.effective_batch ({eff}) must be a multiple of "
                              f"train.micro_batch ({t.micro_batch})")
        return t.micro_batch, eff, "train.micro_batch"
    fitting = [c for c in profile.candidates if c <= profile.max_micro_batch and per % c == 0]
    mb = max(fitting) if fitting else 1
    return mb, eff, (f"largest candidate within profile {profile.name}'s cap that divides "
                     + (f"the per-process batch {per} ({eff} / {world} processes)" if world > 1 else f"{eff}"))


class Trainer:
    """trainer = Trainer(cfg, out_dir); trainer.run() -> summary dict."""

    def __init__(self, cfg: Config, out_dir=None, state: dict | None = None, progress: str | None = None):
        self.cfg = cfg.validate()
        t = cfg.train
        dctx = distributed.init_from_env(t.device)       # world 1 without torchrun: nothing
        self.world, self.rank = dctx.world, dctx.rank
        self.is_main = dctx.rank == 0
        self._solo = False            # rank 0 autotuning alone: world-1 semantics, no collectives
        self._net = None              # the DistributedDataParallel wrapper (world > 1, from run())
        self._stop = None             # run()'s signal flag, read by the agreed after-step check
        self._step_maxima = None      # [peak, step peak, signal] maxima over ranks, last step
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
        if t.precision == "auto":
            t.precision = self.profile.precision
        check_precision(t.precision, self.device)
        if state is not None:
            self._replan_for_world(t)
        t.micro_batch, t.effective_batch, self.batch_how = plan_batch(t, self.profile, self.world)
        if t.fixed_micro_batch:
            warnings.warn(f"sonata: micro-batch {self.batch_how}", UserWarning, stacklevel=2)
            if t.autotune:
                warnings.warn("sonata: train.autotune is ignored: train.fixed_micro_batch is set",
                              UserWarning, stacklevel=2)
        self.autotune_result: dict | None = None
        self.guard = MemoryGuard(self.profile.memory_budget_bytes, self.device,
                                 what=("profile.memory_budget_mb" if cfg.profile.memory_budget_mb else
                                       f"profile {self.profile.name}: {self.profile.budget_source}"))
        self.leak = LeakDetector()
        self._leaked: list = []          # debug.leak only
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.progress_mode = progress
        vocab = Vocab.from_state_dict(state["vocab"]) if state else None
        self.corpus: Corpus = build_corpus(cfg.data, self.device, vocab=vocab)
        cfg.model.vocab_size = len(self.corpus.vocab)
        seed_everything(t.seed)
        self.model = MambaLM(cfg.model).to(self.device)
        self.model.set_int8(t.precision == "int8")
        self.optimizer = torch.optim.AdamW(param_groups(self.model, t.weight_decay), lr=t.lr,
                                           betas=(0.9, 0.95), eps=1e-8)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=t.precision == "fp16")
        self.sampler = BatchSampler(self.corpus.train, cfg.data.seq_len, seed=t.seed)
        self.step = 0
        self.tokens = 0
        self.counters = {"nonfinite_steps": 0, "scaler_skipped_steps": 0}
        self._consecutive_nonfinite = 0
        self.history: list[dict] = []
        self.emergency_reason: str | None = None
        self._byte_len = torch.from_numpy(self.corpus.vocab.byte_lengths).to(self.device)
        if state:
            self._load_state(state)

    def _replan_for_world(self, t) -> None:
        """Resuming on a different number of processes: the global batch stays; a
        micro-batch that does not divide the new per-process batch is re-planned (the
        largest divisor below it), with a warning, rather than refused."""
        eff, mb = t.effective_batch, t.micro_batch or t.fixed_micro_batch
        if not (eff and mb) or eff % self.world:
            return                                   # plan_batch explains what does not divide
        per = eff // self.world
        if per % mb == 0:
            return
        new = max(d for d in range(1, min(mb, per) + 1) if per % d == 0)
        warnings.warn(f"sonata: the checkpoint's micro-batch {mb} does not divide the per-process "
                      f"batch {per} (global {eff} / {self.world} processes); training with "
                      f"micro-batch {new}", UserWarning, stacklevel=3)
        if t.fixed_micro_batch:
            t.fixed_micro_batch = new
        else:
            t.micro_batch = new

    @property
    def accumulation(self) -> int:
        """Micro-steps per optimizer step on this rank."""
        t = self.cfg.train
        world = 1 if self._solo else self.world
        return t.effective_batch // (t.micro_batch * world)

    @property
    def _ddp(self) -> bool:
        """Collectives in this step: world > 1 and not rank 0's solo autotuning."""
        return self.world > 1 and not self._solo

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
                "scheduler": {"kind": "warmup_cosine", "step": self.step},
                "step": self.step, "micro_step": self.step * self.accumulation * self.world,
                "world_size": self.world,
                "tokens": self.tokens, "counters": dict(self.counters),
                "sampler": self.sampler.state_dict(), "rng": rng_state(),
                "vocab": self.corpus.vocab.state_dict(), "config": self.cfg.to_dict(),
                "profile": self.profile.to_dict(), "autotune": self.autotune_result}

    def _load_state(self, state: dict) -> None:
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            self.sampler.load_state_dict(state["sampler"])
            self.step, self.tokens = int(state["step"]), int(state["tokens"])
            self.counters.update(state.get("counters", {}))
            self.autotune_result = state.get("autotune")
            if self.autotune_result:
                self.batch_how = "autotuned before step 1 (recorded in the checkpoint)"
            set_rng_state(state["rng"])
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            raise CheckpointError(f"checkpoint does not match this configuration: {str(e).splitlines()[0][:200]}") from None

    def model_is_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def save_checkpoint(self, path=None) -> Path | None:
        """Atomic save; a model with NaN/Inf weights is never written over a good checkpoint."""
        path = Path(path) if path else self.out_dir / "checkpoint.pt"
        if not self.is_main:                 # rank 0 writes; the state is the same on every rank
            return path
        if not self.model_is_finite():
            warnings.warn(f"sonata: model has non-finite weights at step {self.step}; "
                          f"checkpoint {path} left as it was", RuntimeWarning, stacklevel=2)
            return None
        return ckpt.save(self.state_dict(), path)

    # ------------------------------------------------------------------ steps
    def train_step(self) -> dict:
        """One optimizer step; a non-finite loss or gradient skips the update (counted)."""
        t, model = self.cfg.train, self.model
        mb, acc = t.micro_batch, self.accumulation
        ddp = self._ddp
        net = self._net if ddp and self._net is not None else model
        sync(self.device)
        t0 = time.perf_counter()
        model.train()
        # the global batch's offsets, this rank's shard of rows (the whole batch at world 1)
        x, y = self.sampler.draw(t.effective_batch, shard=(self.rank, self.world) if ddp else (0, 1))
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for i in range(acc):
            xb, yb = x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]
            # DDP: gradients are all-reduced only in the last micro-step's backward
            no_sync = net.no_sync() if net is not model and i < acc - 1 else contextlib.nullcontext()
            with no_sync:
                with autocast_for(t.precision, self.device):
                    logits = net(xb)                                    # (mb, L, V)
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), yb.reshape(-1))
                leak = self.cfg.debug.leak
                self.scaler.scale(loss / acc).backward(retain_graph=leak == "keep_graph")
                loss_sum += loss.detach()
                if leak == "keep_graph":        # the bug, on purpose: the graph stays alive
                    self._leaked.append(loss)
                elif leak == "keep_activations":
                    self._leaked.append(logits.detach())
        self.scaler.unscale_(self.optimizer)
        clip = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        lr = lr_at(self.step, t)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        loss_val = d2h.item(loss_sum / acc)                             # synchronizes the device
        gnorm = d2h.item(grad_norm)
        bad = not math.isfinite(loss_val) or (not math.isfinite(gnorm) and t.precision != "fp16")
        if ddp:     # the global mean loss; any rank's non-finite value skips the step everywhere
            loss_sum_all, n_bad = distributed.all_reduce_sum([loss_val, float(bad)])
            loss_val, bad = loss_sum_all / self.world, n_bad > 0 or not math.isfinite(loss_sum_all)
        skipped = None
        if bad:
            skipped = "nonfinite"
            self.scaler.update()                                        # no-op unless fp16
        else:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)                            # skips itself on inf grads (fp16)
            self.scaler.update()
            if self.scaler.is_enabled() and self.scaler.get_scale() < scale:
                skipped = "scaler"
            elif self.cfg.model.a_constraint:
                for layer in model.layers:
                    layer.mixer.constrain_A(self.cfg.model.a_min)
        if skipped == "nonfinite":
            self.counters["nonfinite_steps"] += 1
            self._consecutive_nonfinite += 1
        else:
            self._consecutive_nonfinite = 0
            if skipped == "scaler":
                self.counters["scaler_skipped_steps"] += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self._threads and torch.get_num_threads() != self._threads:
            # numba's OpenMP layer resets the OpenMP thread count when its pool starts (the
            # first fused-kernel call): set ours again, so train.threads / threads per rank hold
            torch.set_num_threads(self._threads)
        sync(self.device)                       # the clock is read only once the device is done
        dt = time.perf_counter() - t0
        n_tok = t.effective_batch * self.cfg.data.seq_len
        self.step += 1
        self.tokens += n_tok
        row = {"step": self.step, "loss": loss_val, "lr": lr, "tokens": self.tokens,
               "tok_per_s": n_tok / dt, "step_s": dt, "grad_norm": gnorm,
               "skipped": skipped, "fallbacks": kernels.fallback_count()}
        if self.cfg.debug.leak != "none":
            row["debug_leak"] = self.cfg.debug.leak
        return row

    # ------------------------------------------------------------------ batch
    def apply_autotune(self, progress: str | None = None) -> dict:
        """Measure the profile's candidates (state restored after) and train with the
        choice. Raises SonataError when no candidate is eligible."""
        from sonata.autotune import AutotuneResult, autotune
        from sonata.errors import SonataError
        if self.world > 1:
            return self._apply_autotune_distributed(progress)
        bar = Progress(len(self.profile.candidates), "autotune",
                       self.progress_mode if progress is None else progress)
        try:
            res = autotune(self, progress=bar)
        finally:
            bar.close()
        self.autotune_result = res.to_dict()
        if res.micro_batch is None:
            raise SonataError(f"autotune: {res.reason}; raise profile.memory_budget_mb or use "
                              f"train.fixed_micro_batch")
        self.cfg.train.micro_batch = res.micro_batch
        self.cfg.train.effective_batch = res.effective_batch
        self.batch_how = f"autotuned: {res.reason}"
        assert isinstance(res, AutotuneResult)
        return self.autotune_result

    def _apply_autotune_distributed(self, progress: str | None = None) -> dict:
        """Rank 0 measures the candidates alone, on the bare model (no collectives, so
        nothing can leave the ranks out of step), for the per-process batch: the
        micro-batch decides per-process throughput and memory. The other ranks wait
        (a long-timeout group) and take its choice, so every rank trains with the same
        micro-batch. Called before the model is wrapped in DDP."""
        from sonata.autotune import autotune
        from sonata.errors import SonataError
        t = self.cfg.train
        glob_eff = t.effective_batch
        outcome = None
        if self.is_main:
            bar = Progress(len(self.profile.candidates), "autotune",
                           self.progress_mode if progress is None else progress)
            self._solo = True
            t.effective_batch = glob_eff // self.world
            try:
                res = autotune(self, progress=bar)
                outcome = {"result": res.to_dict()}
            except SonataError as e:
                outcome = {"error": str(e)}
            except Exception as e:       # noqa: BLE001 - the others must not wait forever
                outcome = {"error": f"autotune failed on rank 0: {type(e).__name__}: {e}"}
                raise
            finally:
                self._solo = False
                t.effective_batch = glob_eff
                bar.close()
                outcome = distributed.broadcast_object(outcome, src=0, wait=True)
        else:
            outcome = distributed.broadcast_object(None, src=0, wait=True)
        if "error" in outcome:
            raise _all_ranks(SonataError(outcome["error"]))
        res = outcome["result"]
        self.autotune_result = res
        if res["micro_batch"] is None:
            raise _all_ranks(SonataError(f"autotune: {res['reason']}; raise profile.memory_budget_mb "
                                         f"or use train.fixed_micro_batch"))
        t.micro_batch = res["micro_batch"]
        self.batch_how = (f"autotuned on rank 0 for the per-process batch {res['effective_batch']} "
                          f"(global {glob_eff} / {self.world} processes): {res['reason']}")
        return self.autotune_result

    @torch.no_grad()
    def evaluate(self, max_tokens: int | None = None, model: MambaLM | None = None) -> EvalResult:
        t = self.cfg.train
        model = model or self.model
        model.eval()
        nats = torch.zeros((), dtype=torch.float64, device=self.device)
        n_tok = n_bytes = 0
        limit = t.eval_tokens if max_tokens is None else max_tokens
        shard = self._ddp              # each rank evaluates every world-th batch; sums all-reduced
        for i, (x, y) in enumerate(val_batches(self.corpus.val, self.cfg.data.seq_len,
                                               max(16, t.micro_batch), limit)):
            if shard and i % self.world != self.rank:
                continue
            with autocast_for(t.precision, self.device):
                logits = model(x)
            nats += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                    reduction="sum").double()
            n_tok += y.numel()
            n_bytes += int(self._byte_len[y].sum())
        model.train()
        total = float(nats)
        if shard:
            total, n_tok, n_bytes = distributed.all_reduce_sum([total, n_tok, n_bytes])
            n_tok, n_bytes = int(n_tok), int(n_bytes)
        return EvalResult(loss=total / max(n_tok, 1), bpb=total / (math.log(2) * max(n_bytes, 1)),
                          tokens=n_tok, bytes=n_bytes)

    def evaluate_int8_export(self) -> EvalResult:
        """Validation of a model rebuilt from the real int8 export (weights int8 + scales)."""
        q = MambaLM(self.cfg.model).to(self.device)
        q.load_int8_state(self.model.int8_state())
        q.set_int8(True)
        return self.evaluate(model=q)

    # ------------------------------------------------------------------ loop
    def _open_metrics(self):
        if not self.is_main:
            return None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / "metrics.jsonl"
        kept = []
        if self.step and path.exists():   # resuming: drop rows past the checkpoint's step
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row.get("step", 0) <= self.step:
                    kept.append(line)
        f = open(path, "w")
        for line in kept:
            f.write(line + "\n")
        return f

    def _emergency(self, reason: str) -> Path | None:
        self.emergency_reason = reason
        if self.out_dir:
            return self.save_checkpoint()
        return None

    def _guarded_step(self) -> dict:
        """train_step between the guard's two checks. Alone, a trip raises at once; in
        DDP the ranks first agree (every rank learns of any rank's trip and all stop at
        the same step). An allocation failure inside the step becomes
        MemoryBudgetExceeded (the gradients of the failed step are dropped)."""
        ddp = self._ddp
        if ddp:
            trip_at = distributed.test_trip_step(self.rank)
            if trip_at is not None and self.step == trip_at:     # test-only: see sonata.distributed
                self.guard.budget = 1
        _, err = self._check(lambda: self.guard.check_before_step(self.step))
        if ddp:
            self._agree_on_trip(err)
        try:
            row = self.train_step()
        except Exception as e:
            # in DDP an allocation failure inside the step cannot be agreed on (the other
            # ranks are inside DDP's all-reduce): this rank stops and the others learn it
            # from the process group (a closed connection, or the timeout)
            self.guard.abort_step()
            if not is_out_of_memory(e):
                raise
            self.optimizer.zero_grad(set_to_none=True)
            self._leaked.clear()
            raise self.guard.out_of_memory(self.step, e) from None
        row["mem_bytes"], err = self._check(lambda: self.guard.after_step(self.step))
        row["step_peak_bytes"] = self.guard.peak_last
        if ddp:
            self._step_maxima = self._agree_on_trip(
                err, [peak_memory_bytes(self.device), self.guard.peak_last,
                      (self._stop.signum if self._stop is not None else None) or 0])
        return row

    def _check(self, check):
        """(check(), None); in DDP a trip is returned as (None, error) to be agreed on."""
        if not self._ddp:
            return check(), None
        try:
            return check(), None
        except MemoryBudgetExceeded as e:
            return None, e

    def _agree_on_trip(self, err: MemoryBudgetExceeded | None, extra=()) -> list[float]:
        """Every rank says whether its guard tripped (one MAX all-reduce, with `extra`
        numbers whose maximum over ranks is returned); when any did, every rank raises
        the first tripping rank's message, naming that rank, so all stop together."""
        tripped, maxima = distributed.tripped_ranks(err is not None, extra)
        if not tripped:
            return maxima
        self.guard.abort_step()                     # ranks that did not trip were sampling
        first = tripped[0]
        msg = distributed.broadcast_object(str(err) if err is not None else None, src=first)
        where = f"on rank {first} of {self.world}" + (
            f" (also rank{'s' if len(tripped) > 2 else ''} {', '.join(map(str, tripped[1:]))})"
            if len(tripped) > 1 else "")
        if msg.startswith("memory budget exceeded"):
            msg = f"memory budget exceeded {where}" + msg[len("memory budget exceeded"):]
        else:
            msg = f"{where}: {msg}"
        budget = err.budget_bytes if err is not None else self.guard.budget
        raise MemoryBudgetExceeded(msg, budget, err.used_bytes if err is not None else 0)

    def _memory_tripped(self, e: MemoryBudgetExceeded) -> MemoryBudgetExceeded:
        self._leaked.clear()                          # a debug leak must not reach the checkpoint
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        path = self._emergency("memory")
        where = (f"; the last good state (step {self.step}) is in {path}; resume with --resume "
                 f"{path} and a larger profile.memory_budget_mb" if path else
                 f"; no checkpoint written (no output folder)")
        out = MemoryBudgetExceeded(str(e) + where, e.budget_bytes, e.used_bytes)
        return _all_ranks(out) if self._ddp else out

    def run(self, on_step=None) -> dict:
        """Train to train.max_steps. `on_step(trainer, row)` may add fields to each row."""
        t = self.cfg.train
        metrics = self._open_metrics() if self.out_dir else None
        tboard = TensorBoardLog(self.out_dir) if metrics and t.tensorboard else None
        kernels.reset_fallback_count()
        release_free_memory(self.device)
        h2d_start, d2h_start = h2d.bytes, d2h.bytes
        t_start = time.perf_counter()
        measured_tokens, measured_s, done_here = 0, 0.0, 0
        last_eval: EvalResult | None = None
        if t.autotune and not t.fixed_micro_batch and self.autotune_result is None:
            self.apply_autotune()
        if self.world > 1 and self._net is None:
            from torch.nn.parallel import DistributedDataParallel as DDP
            self._net = DDP(self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self._stop = None
        self._step_maxima = None
        bar = Progress(t.max_steps - self.step, "train", self.progress_mode)
        leak_warned = False
        try:
            with _StopSignal() as stop:
                self._stop = stop
                while self.step < t.max_steps:
                    row = self._guarded_step()
                    stop_signum = stop.signum
                    if self._step_maxima is not None:      # agreed over ranks after the step
                        peak_all, step_peak_all, signum = self._step_maxima
                        row["peak_mem_bytes_all_ranks"] = int(peak_all)
                        row["step_peak_bytes"] = int(step_peak_all)
                        stop_signum = int(signum) or None   # a later signal: the next step's turn
                    row["h2d_bytes"], row["d2h_bytes"] = h2d.bytes - h2d_start, d2h.bytes - d2h_start
                    h2d_start, d2h_start = h2d.bytes, d2h.bytes
                    done_here += 1
                    if done_here > MEASURE_SKIP:
                        measured_tokens += t.effective_batch * self.cfg.data.seq_len
                        measured_s += row["step_s"]
                    row["nonfinite_steps"] = self.counters["nonfinite_steps"]
                    row["peak_mem_bytes"] = (row.pop("peak_mem_bytes_all_ranks") if self._ddp
                                             else peak_memory_bytes(self.device))
                    self.leak.record(row["mem_bytes"])
                    if self.leak.enough:
                        row["mem_slope_bytes_per_step"] = self.leak.slope()
                        if not leak_warned and self.leak.leaking():
                            leak_warned = True
                            warnings.warn(f"sonata: {self.leak.message()} (step {self.step})",
                                          RuntimeWarning, stacklevel=2)
                    if on_step is not None:
                        on_step(self, row)
                    final = self.step == t.max_steps
                    if (t.eval_every and self.step % t.eval_every == 0) or final:
                        last_eval = self.evaluate()
                        row.update(val_loss=last_eval.loss, val_bpb=last_eval.bpb)
                    self.history.append(row)
                    if metrics and (self.step % t.log_every == 0 or final or "val_loss" in row
                                    or row["skipped"]):
                        metrics.write(json.dumps(row) + "\n")
                        metrics.flush()
                        if tboard:
                            tboard.write(row)
                    if self._consecutive_nonfinite >= t.max_nonfinite:
                        self._emergency("nonfinite")
                        raise _all_ranks(TrainingDiverged(
                            f"{self._consecutive_nonfinite} consecutive non-finite steps, the last at "
                            f"step {self.step}; updates were skipped, the last good state is in "
                            f"{self.out_dir / 'checkpoint.pt' if self.out_dir else '(no --out)'}; "
                            f"lower train.lr or check the data"), self._ddp)
                    if self.out_dir and t.checkpoint_every and self.step % t.checkpoint_every == 0 and not final:
                        self.save_checkpoint()
                    post = {"loss": row["loss"], "tok/s": round(row["tok_per_s"])}
                    if "val_bpb" in row:
                        post["val_bpb"] = row["val_bpb"]
                    bar.update(1, **post)
                    if stop_signum is not None:
                        self._emergency(signal.Signals(stop_signum).name)
                        raise _all_ranks(TrainingInterrupted(
                            f"stopped by {signal.Signals(stop_signum).name} after step {self.step}; "
                            f"resume with --resume {self.out_dir / 'checkpoint.pt' if self.out_dir else '?'}",
                            stop_signum), self._ddp)
        except MemoryBudgetExceeded as e:
            raise self._memory_tripped(e) from None
        except KeyboardInterrupt:
            # a second Ctrl-C mid-step: the step may be half-applied, so keep the last
            # periodic checkpoint rather than writing this state over it
            self.emergency_reason = "KeyboardInterrupt"
            raise
        finally:
            bar.close()
            if metrics:
                metrics.close()
            if tboard:
                tboard.close()
        if last_eval is None:
            last_eval = self.evaluate()
        peak_mem, guard_peak = distributed.all_reduce_max(
            [peak_memory_bytes(self.device), self.guard.peak]) if self._ddp else \
            (peak_memory_bytes(self.device), self.guard.peak)
        summary = {
            "steps": self.step, "tokens": self.tokens,
            "wall_s": time.perf_counter() - t_start,
            "tok_per_s_sustained": measured_tokens / measured_s if measured_s else None,
            "sustained_excludes_steps": MEASURE_SKIP,
            "val_loss": last_eval.loss, "val_bpb": last_eval.bpb,
            "val_tokens": last_eval.tokens, "val_bytes": last_eval.bytes,
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
            "precision": t.precision,
            "micro_batch": t.micro_batch, "accumulation": self.accumulation,
            "effective_batch": t.effective_batch, "batch_how": self.batch_how,
            "profile": self.profile.to_dict(),
            "memory_budget_bytes": self.guard.budget, "guard_peak_bytes": int(guard_peak),
            **self.leak.report(),
            "debug_leak": self.cfg.debug.leak,
            "autotune": self.autotune_result,
            **self.counters,
            "data": self.corpus.summary(),
        }
        if t.precision == "int8":
            fp32 = self._eval_without_int8()
            q = self.evaluate_int8_export()
            summary.update(val_loss_fp32_weights=fp32.loss, val_loss_int8_export=q.loss,
                           val_bpb_int8_export=q.bpb)
            if self.out_dir and self.is_main:
                torch.save(self.model.int8_state(), self.out_dir / "model_int8.pt")
        if self.out_dir and self.is_main:
            self.save_checkpoint()
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def _eval_without_int8(self) -> EvalResult:
        self.model.set_int8(False)
        try:
            return self.evaluate()
        finally:
            self.model.set_int8(True)


def _all_ranks(e: Exception, agreed: bool = True) -> Exception:
    """Mark an error that every rank raises at the same point (an agreed stop): rank 0
    prints it, the others exit 2 silently (sonata.__main__)."""
    if agreed:
        e.all_ranks = True
    return e
