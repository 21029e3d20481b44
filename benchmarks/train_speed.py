"""Training tokens/s of the seed configuration, per scan backend, for mambapy and the scan-free peer.

    python benchmarks/train_speed.py [--steps 6] [--rounds 3] [--batches 8 32] [--threads 2]

Seed configuration: d_model 96, 2 layers, d_state 16, seq_len 128, vocabulary 512,
fp32. The scan-free peer (`peer-free`) is mambapy's model with its scan replaced by an
O(batch * L * d_inner) stand-in (sonata.peers.free_scan): what a step costs with the scan
for free. One training step = forward, cross-entropy, backward, AdamW step. Warm-up
steps are excluded; models are measured in interleaved rounds and the median round
is reported, so machine noise hits every column alike. Also: bytes saved for
backward per token (activations kept by autograd, parameters excluded), measured
with torch.autograd.graph.saved_tensors_hooks. Then the same micro-batches through
sonata's trainer and benchmark harness (benchmarks/validity.py): each figure with its
validity checks and verdict.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _common import hardware_line, print_table  # noqa: E402
from validity import validity_table  # noqa: E402

from sonata.config import ModelConfig  # noqa: E402
from sonata.kernels import fallback_count, resolve_backend  # noqa: E402
from sonata.kernels.timing import saved_tensor_bytes, sync  # noqa: E402
from sonata.memory import steady_cpu_heap  # noqa: E402
from sonata.model import MambaLM  # noqa: E402
from sonata.peers import mambapy_lm  # noqa: E402

SEED = dict(d_model=96, n_layers=2, d_state=16, vocab_size=512)
SEQ_LEN = 128
PEERS = ("peer-free", "mambapy")      # the columns every model is compared with


def build(name, device):
    torch.manual_seed(0)
    if name in ("mambapy", "peer-free"):
        return mambapy_lm(SEED["d_model"], SEED["n_layers"], SEED["d_state"], SEED["vocab_size"], device,
                          scan_free=name == "peer-free")
    return MambaLM(ModelConfig(backend=name, **SEED)).to(device)


def saved_bytes_per_token(model, x, y) -> float:
    def fwd():
        return F.cross_entropy(model(x).reshape(-1, SEED["vocab_size"]), y.reshape(-1))
    loss, n = saved_tensor_bytes(fwd, exclude=list(model.parameters()))
    loss.backward()
    model.zero_grad(set_to_none=True)
    return n / x.numel()


def make_step(model, x, y):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).reshape(-1, SEED["vocab_size"]), y.reshape(-1))
        loss.backward()
        opt.step()
        return loss
    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="measured steps per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=None,
                    help="any of reference cpu triton mambapy (default: all that run here)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-validity", action="store_true",
                    help="skip the harness table (sonata's trainer, with verdicts)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    if dev.type == "cpu":
        steady_cpu_heap()         # as sonata's trainer runs; every model measured with it alike
    names = args.models or (["reference", "cpu", "peer-free", "mambapy"] if dev.type == "cpu"
                            else ["reference", "triton", "peer-free", "mambapy"])
    print(hardware_line(dev))
    rows = []
    for batch in args.batches:
        g = torch.Generator().manual_seed(batch)
        x = torch.randint(0, SEED["vocab_size"], (batch, SEQ_LEN), generator=g).to(dev)
        y = torch.randint(0, SEED["vocab_size"], (batch, SEQ_LEN), generator=g).to(dev)
        models = {n: build(n, dev) for n in names}
        saved = {n: saved_bytes_per_token(m, x, y) for n, m in models.items()}
        steps = {n: make_step(m, x, y) for n, m in models.items()}
        before = fallback_count()
        for n in names:                          # warm-up: compilation, allocator, caches
            for _ in range(args.warmup):
                steps[n]()
        per_round = {n: [] for n in names}
        for _ in range(args.rounds):             # interleaved rounds
            for n in names:
                sync(dev)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    steps[n]()
                sync(dev)
                per_round[n].append(args.steps * x.numel() / (time.perf_counter() - t0))
        fallbacks = fallback_count() - before
        med = {n: statistics.median(per_round[n]) for n in names}
        for n in names:
            ran = n if n in PEERS else resolve_backend(n, x.float())[0]
            rows.append([n if ran == n else f"{n} (ran {ran})", batch, f"{med[n]:,.0f}",
                         *(f"{med[n] / med[p]:.2f}x" if p in med else "-" for p in PEERS),
                         f"{saved[n]:,.0f}",
                         f"{min(per_round[n]):,.0f}-{max(per_round[n]):,.0f}"])
        if fallbacks:
            print(f"note: {fallbacks} scans fell back to the reference at micro-batch {batch}")
    print_table(["model", "micro-batch", "tokens/s (median)", "vs scan-free peer", "vs mambapy",
                 "saved B/token", "tokens/s range"], rows,
                title=f"training speed, seed config (d_model 96, 2 layers, d_state 16, L {SEQ_LEN}, "
                      f"vocab 512, fp32), {args.rounds} interleaved rounds x {args.steps} steps, "
                      f"{args.warmup} warm-up steps excluded; scan-free peer = mambapy with its scan "
                      f"replaced by sonata.peers.free_scan")
    if not args.no_validity:
        # the same batches through sonata's own trainer and harness: each figure with its checks
        validity_table(args.batches, steps=30, threads=args.threads)


if __name__ == "__main__":
    main()
