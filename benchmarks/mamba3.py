"""Mamba-3 (released form: SISO, MIMO) against Mamba-2 at the same width and state, on CPU.

Two tables, every row measured in one run, interleaved rounds, medians:

1. training: a whole 2-layer LM's step (forward, sonata's loss, backward, AdamW) in tokens/s,
   its ratio to Mamba-2's in the same rounds, and the activation memory (what the forward
   saves for the backward, counted by autograd's saved-tensor hooks). Rows: Mamba-2 (SSD, headdim 32),
   Mamba-3 SISO (its scan on the SSD kernel), Mamba-3 MIMO R=4 (chunks of matrix products:
   model.chunk_size 64 score rows, 16 tokens = 64 / R as mamba_ssm's MIMO chunks, and 32 rows,
   8 tokens), the paper form, and Mamba-3 SISO on the token-by-token reference scan (the
   oracle's speed, for scale).
2. generation: one token of the same LMs at batch 1 (the layers' own one-token steps), median
   microseconds per token and the ratio to Mamba-2.

    python benchmarks/mamba3.py [--threads 1] [--rounds 5] [--quick]

Goals (issue 53): SISO training >= 0.8x Mamba-2's tokens/s at equal N, MIMO R=4 >= 0.5x,
generation per token within 1.2x of Mamba-2. Nothing here is a test.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from _common import hardware_line, print_table
from sonata.core.config import ModelConfig
from sonata.kernels import cross_entropy
from sonata.model.lm import MambaLM

# label, config overrides (beside arch, d_model, d_state, 2 layers, backend cpu)
ROWS = [("mamba2", {"arch": "mamba2"}),
        ("mamba3 SISO", {"arch": "mamba3"}),
        ("mamba3 MIMO R=4", {"arch": "mamba3", "mimo_rank": 4}),
        ("mamba3 MIMO R=4, chunk 32", {"arch": "mamba3", "mimo_rank": 4, "chunk_size": 32}),
        ("mamba3 paper form", {"arch": "mamba3", "mamba3_form": "paper"}),
        ("mamba3 SISO, reference scan", {"arch": "mamba3", "backend": "reference"})]
SIZES = [("seed", 96, 16, 16, 128), ("d256 N64", 256, 64, 4, 512)]     # name, d_model, N, batch, L


def build(over, d, n, vocab=512, seed=0):
    torch.manual_seed(seed)
    kw = {"backend": "cpu", "headdim": 32, **over}
    return MambaLM(ModelConfig(d_model=d, n_layers=2, d_state=n, vocab_size=vocab, **kw))


def train_step(model, batch, L, vocab=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, vocab, (2, batch, L), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step():
        opt.zero_grad(set_to_none=True)
        cross_entropy(model(x).float(), y, "cpu").backward()
        opt.step()
    return step


def saved_mib(model, batch, L, vocab=512):
    """MiB that the forward keeps for the backward (autograd's saved tensors, each storage
    counted once): the training step's activation memory, independent of the allocator."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t
    x = torch.randint(0, vocab, (batch, L), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).float().sum()
    return f"{sum(seen.values()) / 2**20:.1f}"


def interleaved(fns, rounds, work):
    """{name: [work / seconds per round]}, rounds rotated so no row always runs first."""
    out = {k: [] for k in fns}
    keys = list(fns)
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            t0 = time.perf_counter()
            fns[k]()
            out[k].append(work[k] / (time.perf_counter() - t0))
    return out


def training_rows(size, rounds, skip_ref):
    name, d, n, batch, L = size
    rows = [r for r in ROWS if not (skip_ref and "reference" in r[0])]
    models = {label: build(over, d, n) for label, over in rows}
    steps = {label: train_step(m, batch, L) for label, m in models.items()}
    for f in steps.values():
        f()                                                     # warm-up (numba compiles, allocator)
    tps = interleaved(steps, rounds, {k: batch * L for k in steps})
    mem = {k: saved_mib(m, batch, L) for k, m in models.items()}
    base = tps["mamba2"]
    return [[f"{name}: d_model {d}, N {n}, {batch}x{L}", k, f"{statistics.median(v):,.0f}",
             f"{statistics.median(a / b for a, b in zip(v, base)):.2f}x", mem[k]] for k, v in tps.items()]


def generation_rows(size, tokens):
    name, d, n, _, _ = size
    fns = {}
    for label, over in ROWS:
        if "reference" in label:
            continue
        model = build(over, d, n).eval()
        states = [layer.mixer.empty_state(1, "cpu") for layer in model.layers]
        idx = torch.zeros(1, dtype=torch.long)

        def run(model=model, states=states, idx=idx):
            with torch.inference_mode():
                for _ in range(tokens):
                    model.step(idx, states)
        fns[label] = run
    for f in fns.values():
        f()
    per = interleaved(fns, 5, {k: tokens for k in fns})          # tokens per second
    base = per["mamba2"]
    return [[f"{name}: d_model {d}, N {n}, batch 1", k, f"{1e6 / statistics.median(v):.0f}",
             f"{statistics.median(b / a for a, b in zip(v, base)):.2f}x"] for k, v in per.items()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=100, help="tokens per generation round")
    ap.add_argument("--quick", action="store_true", help="the seed size only, 3 rounds")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sizes = SIZES[:1] if a.quick else SIZES
    rounds = 3 if a.quick else a.rounds
    print(hardware_line(), f"; {a.threads} thread(s)")
    train = [row for i, s in enumerate(sizes) for row in training_rows(s, rounds, skip_ref=i > 0)]
    print_table(["size", "model", "train tokens/s", "vs mamba2", "saved for backward, MiB"], train,
                "1. training step, fp32 (the reference scan at the seed size only)")
    gen = [row for s in sizes for row in generation_rows(s, a.tokens)]
    print_table(["size", "model", "us/token", "vs mamba2"], gen, "2. generation, one token at a time")


if __name__ == "__main__":
    main()
