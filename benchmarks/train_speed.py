"""Training tokens/s of the seed configuration, per scan backend, for mambapy and the scan-free peer.

    python benchmarks/train_speed.py [--steps 6] [--rounds 3] [--batches 8 32] [--threads 2]

Seed configuration: d_model 96, 2 layers, d_state 16, seq_len 128, vocabulary 512,
fp32. The scan-free peer (`peer-free`) is mambapy's model with its scan replaced by an
O(batch * L * d_inner) stand-in (sonata.lab.peers.free_scan): what a step costs with the scan
for free. One training step = forward, cross-entropy, backward, AdamW step (PyTorch's fused
AdamW for every model, as sonata's trainer runs it; sonata's model with its own loss kernel,
the peers with PyTorch's). Warm-up steps are excluded; models are measured in interleaved
rounds (the order rotating from round to round); tokens/s is the median round, and each
ratio the median of the ratios taken within a round, so the machine's drift between rounds
cancels. Also: bytes saved for
backward per token (activations kept by autograd, parameters excluded), measured
with torch.autograd.graph.saved_tensors_hooks. Then the same micro-batches through
sonata's trainer and benchmark harness (benchmarks/validity.py): each figure with its
validity checks and verdict.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import hardware_line, print_table  # noqa: E402
from validity import validity_table  # noqa: E402

from sonata.lab.speed import STEP_SEQ_LEN, step_speed  # noqa: E402


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
    names = args.models or (["reference", "cpu", "peer-free", "mambapy"] if dev.type == "cpu"
                            else ["reference", "triton", "peer-free", "mambapy"])
    print(hardware_line(dev))
    rows, fallbacks = [], {}
    # interleaved rounds, the trainer's steady CPU heap for every model (sonata.lab.speed.step_speed)
    for r in step_speed(args.batches, names, rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                        device=dev):
        rows.append([r["model"], r["micro_batch"], f"{r['tok_per_s']:,.0f}",
                     *(f"{r[k]:.2f}x" if r[k] is not None else "-" for k in ("vs_peer_free", "vs_mambapy")),
                     f"{r['saved_bytes_per_token']:,.0f}", "{:,.0f}-{:,.0f}".format(*r["range"])])
        fallbacks[r["micro_batch"]] = r["fallbacks"]
    for batch, n in fallbacks.items():
        if n:
            print(f"note: {n} scans fell back to the reference at micro-batch {batch}")
    print_table(["model", "micro-batch", "tokens/s (median)", "vs scan-free peer", "vs mambapy",
                 "saved B/token", "tokens/s range"], rows,
                title=f"training speed, seed config (d_model 96, 2 layers, d_state 16, L {STEP_SEQ_LEN}, "
                      f"vocab 512, fp32), {args.rounds} interleaved rounds x {args.steps} steps (ratios: median "
                      f"of per-round ratios), "
                      f"{args.warmup} warm-up steps excluded; scan-free peer = mambapy with its scan "
                      f"replaced by sonata.lab.peers.free_scan")
    if not args.no_validity:
        # the same batches through sonata's own trainer and harness: each figure with its checks
        validity_table(args.batches, steps=30, threads=args.threads)


if __name__ == "__main__":
    main()
