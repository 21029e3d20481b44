"""One optimizer update from a drawn batch: `Updater(model, cfg, device, precision, task,
injected_leak)(net, x, y, plan)`, the Trainer's.

In order: the micro-steps (forward under the plan's precision, the loss, backward scaled by
1 / accumulation; DDP's gradient all-reduce only in the last micro-step's backward), the
gradient clip, the loss and gradient norm read back (data parallel: the mean loss over
ranks, and a non-finite value on any rank counts for all), then the optimizer step, or its
skip when a value is not finite (fp16's GradScaler may skip too), and the A constraint. It
counts skipped updates; the trainer stops a run after train.max_nonfinite in a row.
"""
from __future__ import annotations

import contextlib
import math

import torch

from sonata import kernels
from sonata.core.device import autocast_for, sync
from sonata.data.batches import d2h
from sonata.data.tasks import answer_loss
from sonata.model.lm import param_groups
from sonata.train import distributed
from sonata.train.plan import Plan


class Updater:
    """`optimizer`: AdamW over `param_groups` (no decay on A, D, norms, biases), fused (one
    kernel over all parameters on CPU and CUDA, 4x the per-tensor loop); `scaler`: fp16's
    GradScaler (disabled otherwise)."""

    def __init__(self, model, cfg, device, precision: str, task, injected_leak):
        t = cfg.train
        self.model, self.cfg, self.device, self.task, self.injected_leak = model, cfg, device, task, injected_leak
        self.optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(0.9, t.beta2),
                                           eps=1e-8, fused=device.type in ("cpu", "cuda"))
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self.counters = {"nonfinite_steps": 0, "scaler_skipped_steps": 0}
        self.consecutive_nonfinite = 0

    def load_optimizer(self, state: dict) -> None:
        """A checkpoint's optimizer state (moments, step counts) under this run's AdamW
        settings: a resume's train.weight_decay and train.beta2 apply (the saved groups'
        values would otherwise win while the run's config says otherwise)."""
        ours = [{k: g[k] for k in ("weight_decay", "betas", "eps")} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state)
        for g, settings in zip(self.optimizer.param_groups, ours):
            g.update(settings)

    def __call__(self, net, x, y, plan: Plan) -> tuple[float, float, str | None]:
        """-> (mean loss, gradient norm, why the update was skipped or None)."""
        loss_sum = self._micro_steps(net, x, y, plan)
        grad_norm = self._clip_gradients()
        loss, gnorm, bad = self._read_loss(loss_sum / plan.accumulation, grad_norm, plan)
        skipped = self._optimizer_step(bad)
        self._count(skipped)
        return loss, gnorm, skipped

    def warm(self, plan: Plan, seq_len: int) -> None:
        """Before a time budget's clock starts: one forward and backward of a micro-batch of
        zeros, no update (the gradients are dropped; no random number is drawn), so the
        one-time cost of compiling or loading the kernels (seconds on the first step of a
        process) is setup, not training time."""
        x = torch.zeros((plan.micro_batch, seq_len), dtype=torch.long, device=self.device)
        self.model.train()
        with autocast_for(plan.precision, self.device):
            logits = self.model(x)
        logits.float().sum().backward()
        self.optimizer.zero_grad(set_to_none=True)
        sync(self.device)

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
                loss = self.loss(logits.float(), yb)
                with distributed.collective("DDP backward", backend_marks_only=True) if net is not self.model \
                        else contextlib.nullcontext():          # DDP all-reduces gradients in it
                    self.scaler.scale(loss / acc).backward(retain_graph=self.injected_leak.retain_graph)
                loss_sum += loss.detach()
                self.injected_leak.after_backward(loss, logits)
        return loss_sum

    def loss(self, logits, y) -> torch.Tensor:
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
                self.model.constrain_A(self.cfg.model.a_min)
        self.optimizer.zero_grad(set_to_none=True)
        return skipped

    def _count(self, skipped: str | None) -> None:
        if skipped == "nonfinite":
            self.counters["nonfinite_steps"] += 1
            self.consecutive_nonfinite += 1
        else:
            self.consecutive_nonfinite = 0
            if skipped == "scaler":
                self.counters["scaler_skipped_steps"] += 1


__all__ = ["Updater"]
