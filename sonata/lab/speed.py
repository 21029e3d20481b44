"""The seed model's bare training step (forward, loss, backward, AdamW) per scan backend,
beside mambapy's model and the scan-free peer, in interleaved rounds (`step_speed`: notebook 00
and benchmarks/train_speed.py), and the race models' step (`race_step`: benchmarks/profile_step.py).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from sonata.core.config import ModelConfig, make_config
from sonata.core.device import sync
from sonata.kernels import cross_entropy, fallback_count, resolve_backend
from sonata.lab.timing import saved_tensor_bytes
from sonata.train.memory import steady_cpu_heap
from sonata.model.lm import MambaLM
from sonata.lab.peers import mambapy_lm
from sonata.lab.race import RACE


STEP_SEED = dict(d_model=96, n_layers=2, d_state=16, vocab_size=512)   # the dossier's model
STEP_SEQ_LEN = 128
STEP_PEERS = ("peer-free", "mambapy")    # the columns every model is compared with


def step_model(name: str, device="cpu") -> torch.nn.Module:
    """The seed model, seeded: sonata with scan backend `name`, mambapy's model (`mambapy`), or
    mambapy's model with its scan replaced by `sonata.lab.peers.free_scan` (`peer-free`: what its
    step costs when the scan costs nothing)."""
    torch.manual_seed(0)
    if name in STEP_PEERS:
        return mambapy_lm(STEP_SEED["d_model"], STEP_SEED["n_layers"], STEP_SEED["d_state"],
                          STEP_SEED["vocab_size"], device, scan_free=name == "peer-free")
    return MambaLM(ModelConfig(backend=name, **STEP_SEED)).to(device)


def _step_loss(model, x, y) -> torch.Tensor:
    """The forward and cross-entropy of the seed model's step: sonata's loss kernel for sonata's
    model (as its trainer runs it), PyTorch's for the peers."""
    if isinstance(model, MambaLM):
        return cross_entropy(model(x), y, model.cfg.backend)
    return F.cross_entropy(model(x).reshape(-1, STEP_SEED["vocab_size"]), y.reshape(-1))


def train_step(model, x, y):
    """-> step(): one plain training step on the fixed batch (x, y): zero_grad, forward,
    cross-entropy, backward, AdamW (PyTorch's fused kernel, as sonata's trainer runs it, for
    every model alike)."""
    dev = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=dev.type in ("cpu", "cuda"))

    def step():
        opt.zero_grad(set_to_none=True)
        loss = _step_loss(model, x, y)
        loss.backward()
        opt.step()
        return loss
    return step


def race_step(name: str, seed: int = 0):
    """-> (step(), tokens per step): one training step of race configuration `name`
    (sonata.lab.race.RACE) at its global batch, context, vocabulary and precision, on a fixed
    random batch: forward under the run's autocast, sonata's loss kernel on float32 logits (as
    the trainer computes every model's loss), backward, fused AdamW with the trainer's parameter groups.
    The model is built as the trainer builds it (`sonata.model.lm.build_model`), seeded."""
    from dataclasses import replace

    from sonata.core.config import resolve_profile
    from sonata.core.device import autocast_for
    from sonata.model.lm import build_model, param_groups
    from sonata.train.plan import resolve_precision
    cfg = make_config(RACE[name])
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=cfg.data.vocab_size))
    torch.manual_seed(seed)
    model = build_model(cfg)
    t = cfg.train
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, cfg.data.vocab_size, (2, t.effective_batch, cfg.data.seq_len), generator=g)
    opt = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(0.9, t.beta2), fused=True)
    precision = resolve_precision(t.precision, resolve_profile(cfg.profile, "cpu", 1 << 30))

    def step():
        opt.zero_grad(set_to_none=True)
        with autocast_for(precision, torch.device("cpu")):
            logits = model(x)
        loss = cross_entropy(logits.float(), y, cfg.model.backend)
        loss.backward()
        opt.step()
        return loss
    return step, x.numel()


def saved_bytes_per_token(model, x, y) -> float:
    """Bytes autograd keeps for the backward of one forward + loss, per token (parameters
    excluded)."""
    loss, n = saved_tensor_bytes(lambda: _step_loss(model, x, y), exclude=list(model.parameters()))
    loss.backward()
    model.zero_grad(set_to_none=True)
    return n / x.numel()


def step_speed(batches=(8, 32), names=("cpu", "peer-free"), rounds: int = 5, steps: int = 6,
               warmup: int = 3, device="cpu") -> list[dict]:
    """Training tokens/s of the seed model per micro-batch and model (`step_model` names), on
    fixed random batches of STEP_SEQ_LEN tokens. Every model warms up `warmup` steps, then the
    models take turns, `steps` steps each per round, for `rounds` rounds, each round starting
    one model further along (no model always runs first, or right after the same one). The
    machine's speed drifts by more than the differences measured, so a ratio is taken within
    each round (models a few seconds apart) and the median of the rounds' ratios is the figure;
    tokens/s is the median round. CPU runs keep the trainer's steady heap. One record per
    (micro-batch, model): `model` (with the backend that really ran when it fell back),
    `micro_batch`, `tok_per_s`, `range` (slowest and fastest round), `vs_peer_free` /
    `vs_mambapy` (median per-round ratios, None when that peer was not measured),
    `saved_bytes_per_token`, `fallbacks` (scans that fell back at that micro-batch)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        steady_cpu_heap()
    names = list(names)
    records = []
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        x = torch.randint(0, STEP_SEED["vocab_size"], (batch, STEP_SEQ_LEN), generator=g).to(dev)
        y = torch.randint(0, STEP_SEED["vocab_size"], (batch, STEP_SEQ_LEN), generator=g).to(dev)
        models = {n: step_model(n, dev) for n in names}
        saved = {n: saved_bytes_per_token(m, x, y) for n, m in models.items()}
        fns = {n: train_step(m, x, y) for n, m in models.items()}
        before = fallback_count()
        for n in names:                          # warm-up: compilation, allocator, caches
            for _ in range(warmup):
                fns[n]()
        per_round = {n: [] for n in names}
        for r in range(rounds):                  # interleaved rounds, rotating order
            k = r % len(names)
            for n in names[k:] + names[:k]:
                sync(dev)
                t0 = time.perf_counter()
                for _ in range(steps):
                    fns[n]()
                sync(dev)
                per_round[n].append(steps * x.numel() / (time.perf_counter() - t0))
        fallbacks = fallback_count() - before

        def ratio(n, peer):
            if peer not in per_round:
                return None
            return statistics.median(a / b for a, b in zip(per_round[n], per_round[peer]))
        for n in names:
            ran = n if n in STEP_PEERS else resolve_backend(n, x.float())[0]
            records.append({
                "model": n if ran == n else f"{n} (ran {ran})", "micro_batch": batch,
                "tok_per_s": statistics.median(per_round[n]),
                "range": (min(per_round[n]), max(per_round[n])),
                "vs_peer_free": ratio(n, "peer-free"), "vs_mambapy": ratio(n, "mambapy"),
                "saved_bytes_per_token": saved[n], "fallbacks": fallbacks})
    return records
