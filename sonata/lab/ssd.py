"""Notebook 09's study: Mamba-2's state-space duality (SSD, Dao and Gu 2024) shown with numbers.

One selective state-space layer with one decay per head is at once
- a recurrence: S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t (linear in L, serial);
- a masked quadratic form, like attention: y = M x with M[i, j] = (C_i . B_j) dt_j
  exp(dt_{j+1} A + ... + dt_i A) for j <= i and 0 above the diagonal (quadratic in L, all
  matrix multiplies) (`ssd_matrix`, `ssd_quadratic`);
- and, between the two, the chunked form: M cut into chunks of Q positions, the diagonal
  blocks computed as small quadratic forms and every off-diagonal block, which has rank at
  most N (it factors through the state), through the chunks' states (`block_ranks`).

`duality` runs the forms on one input and gives their largest differences from the float64
recurrence; `form_times` times them against the sequence length; `state_cost` times
Mamba-1's selective scan against Mamba-2's SSD at equal d_inner as the state size N grows;
`small_race` trains Mamba-1 and Mamba-2 models for the same number of steps. The library
returns rows; the notebook writes the sentences. Every "chunked" figure here pins sonata's
chunked CPU form (`ssd_cpu(..., form="chunked")`): the cpu backend's own choice at N <= 128 is
the fused recurrence (docs/kernels.md), which would time a different algorithm under the name.
"""
from __future__ import annotations

import gc
import time

import torch

from sonata.core.config import make_config
from sonata.kernels import selective_scan
from sonata.kernels.ssd import ssd, ssd_cpu
from sonata.kernels.ssd.reference import expand_groups, prepare_dt, segsum, ssd_recurrent_ref
from sonata.train.trainer import Trainer


def make_inputs(L: int, nheads: int = 4, headdim: int = 16, d_state: int = 16, ngroups: int = 1,
                batch: int = 1, seed: int = 0, dtype=torch.float64) -> dict:
    """One random SSD input with mamba_ssm's shapes (dt before softplus, A < 0)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    return {"x": r(batch, L, nheads, headdim), "dt": r(batch, L, nheads, scale=0.5) - 1.0,
            "A": -torch.rand(nheads, generator=g).to(dtype) * 2 - 0.1,
            "B": r(batch, L, ngroups, d_state), "C": r(batch, L, ngroups, d_state),
            "D": torch.ones(nheads, dtype=dtype)}


def ssd_matrix(dt, A, B, C) -> torch.Tensor:
    """The SSD as one matrix per head: (b, h, L, L), M[i, j] = (C_i . B_j) dt_j exp(sum_{k=j+1}^{i}
    dt_k A) on and below the diagonal, 0 above. dt already through softplus."""
    h = dt.shape[-1]
    Bh, Ch = expand_groups(B, h), expand_groups(C, h)                       # (b, L, h, n)
    decay = torch.exp(segsum((dt * A).transpose(1, 2)))                      # (b, h, L, L)
    cb = torch.einsum("bihn,bjhn->bhij", Ch, Bh)
    return cb * decay * dt.transpose(1, 2)[:, :, None, :]


def ssd_quadratic(x, dt, A, B, C, D=None, dt_softplus=True) -> torch.Tensor:
    """The masked quadratic ("attention") form of the SSD: y = M x (+ D x); x (b, L, h, p)."""
    dtc = prepare_dt(dt, None, dt_softplus)
    y = torch.einsum("bhij,bjhp->bihp", ssd_matrix(dtc, A, B, C), x)
    return y if D is None else y + x * D[:, None]


def duality(L: int = 200, nheads: int = 4, headdim: int = 16, d_state: int = 16, chunk: int = 64,
            seed: int = 0) -> list[dict]:
    """The four forms on one input, each against the float64 recurrence: the largest |difference|."""
    inp = make_inputs(L, nheads, headdim, d_state, seed=seed)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
    oracle = ssd_recurrent_ref(*args, D=inp["D"], dt_softplus=True)
    f32 = [t.float() for t in args]
    forms = [
        ("recurrence (float64, the oracle)", "linear, serial", lambda: oracle),
        ("masked quadratic form, M x (float64)", "quadratic", lambda: ssd_quadratic(*args, D=inp["D"])),
        (f"chunked, Q={chunk} (the paper's listing, float64)", "linear + Q^2",
         lambda: ssd(*args, chunk_size=chunk, D=inp["D"], dt_softplus=True, backend="reference")),
        (f"chunked, Q={chunk} (sonata's CPU fast path, float32)", "linear + Q^2",
         lambda: ssd_cpu(*f32, chunk_size=chunk, D=inp["D"].float(), dt_softplus=True, form="chunked")),
    ]
    return [{"form": name, "cost in L": cost,
             "max |y - recurrence|": float((fn().double() - oracle).abs().max())} for name, cost, fn in forms]


def block_ranks(L: int = 96, chunk: int = 16, d_state: int = 4, seed: int = 0):
    """One head's matrix M (L, L) and, for the chunk grid, the numerical rank of every block
    strictly below the diagonal (never above N = d_state) and of the diagonal blocks."""
    inp = make_inputs(L, 1, 1, d_state, seed=seed)
    M = ssd_matrix(prepare_dt(inp["dt"], None, True), inp["A"], inp["B"], inp["C"])[0, 0]   # (L, L)
    nc = -(-L // chunk)
    off, diag = [], []
    for i in range(nc):
        for j in range(i + 1):
            blk = M[i * chunk:(i + 1) * chunk, j * chunk:(j + 1) * chunk]
            rank = int(torch.linalg.matrix_rank(blk, rtol=1e-10))
            (diag if i == j else off).append(rank)
    return M, {"chunks": nc, "N": d_state, "largest off-diagonal rank": max(off, default=0),
               "off-diagonal blocks": len(off), "smallest diagonal rank": min(diag)}


def _ms(fn, repeat: int) -> float:
    fn()                                                                   # warm-up
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def form_times(lengths=(128, 256, 512, 1024), nheads: int = 8, headdim: int = 32, d_state: int = 64,
               chunk: int = 64, repeat: int = 3, recurrence_max: int = 1024, quadratic_max: int = 4096) -> list[dict]:
    """Forward milliseconds (best of `repeat`, float32, batch 1) of the three forms against L:
    the quadratic form (up to `quadratic_max`), the recurrence step by step in torch (up to
    `recurrence_max`: it is a Python loop), sonata's chunked CPU path."""
    rows = []
    for L in lengths:
        inp = {k: v.float() for k, v in make_inputs(L, nheads, headdim, d_state).items()}
        a = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
        with torch.no_grad():
            row = {"L": L}
            row["quadratic ms"] = round(_ms(lambda: ssd_quadratic(*a), repeat), 2) if L <= quadratic_max else None
            row["recurrence ms"] = (round(_ms(lambda: ssd_recurrent_ref(*a, dt_softplus=True), repeat), 2)
                                    if L <= recurrence_max else None)
            row["chunked ms"] = round(_ms(lambda: ssd_cpu(*a, chunk_size=chunk, dt_softplus=True, form="chunked"),
                                          repeat), 2)
        rows.append(row)
    return rows


def state_cost(states=(16, 64, 128), d_inner: int = 192, headdim: int = 32, L: int = 512, batch: int = 4,
               repeat: int = 3, seed: int = 0) -> list[dict]:
    """Forward + backward milliseconds (best of `repeat`, float32) of one layer's scan at equal
    d_inner as N grows: Mamba-1's selective scan (sonata's fused CPU kernel: d_inner x N decays
    per token) against Mamba-2's SSD (sonata's chunked CPU path: d_inner / headdim decays)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in states:
        u = torch.randn(batch, d_inner, L, generator=g)
        delta = torch.randn(batch, d_inner, L, generator=g) * 0.5 - 1
        A1 = -torch.rand(d_inner, n, generator=g) - 0.5
        B1, C1 = torch.randn(batch, n, L, generator=g), torch.randn(batch, n, L, generator=g)
        m1 = [u, delta, A1, B1, C1]
        h = d_inner // headdim
        x = torch.randn(batch, L, h, headdim, generator=g)
        dt = torch.randn(batch, L, h, generator=g) * 0.5 - 1
        A2 = -torch.rand(h, generator=g) - 0.5
        B2, C2 = torch.randn(batch, L, 1, n, generator=g), torch.randn(batch, L, 1, n, generator=g)
        m2 = [x, dt, A2, B2, C2]
        for t in m1 + m2:
            t.requires_grad_(True)

        def mamba1():
            selective_scan(*m1, delta_softplus=True, backend="cpu").sum().backward()

        def mamba2():
            ssd_cpu(*m2, chunk_size=64, dt_softplus=True, form="chunked").sum().backward()

        t1, t2 = _ms(mamba1, repeat), _ms(mamba2, repeat)
        rows.append({"N": n, "Mamba-1 scan ms": round(t1, 2), "Mamba-2 SSD ms": round(t2, 2),
                     "Mamba-1 / Mamba-2": round(t1 / t2, 2)})
    return rows


# notebook 09's small race: the same data, steps, batch and optimizer; only the blocks differ.
RACE09 = {
    "mamba1-n16": {"model.arch": "mamba", "model.d_state": 16},
    "mamba2-n16": {"model.arch": "mamba2", "model.d_state": 16},
    "mamba2-n64": {"model.arch": "mamba2", "model.d_state": 64},
    "hybrid-n64": {"model.d_state": 64},          # mamba2 layers, the middle one attention
}


def hybrid_layers(n_layers: int) -> str:
    """mamba2 layers with attention in the middle one (n_layers >= 2): mamba2,attention for 2."""
    return ",".join("attention" if i == n_layers // 2 else "mamba2" for i in range(n_layers))


def race_overrides(name: str, d_model: int, n_layers: int, seq_len: int, batch: int, steps: int,
                   seed: int = 0) -> dict:
    """The configuration of one RACE09 row: the heads of 32 channels where d_inner allows (else
    the largest width under 32 that divides it), attention heads of even width."""
    d_inner = 2 * d_model
    headdim = max(h for h in range(1, 33) if d_inner % h == 0)
    n_heads = next(n for n in (4, 2, 1) if d_model % (2 * n) == 0)
    o = {"model.d_model": d_model, "model.n_layers": n_layers, "model.headdim": headdim,
         "model.n_heads": n_heads, "data.seq_len": seq_len, "train.micro_batch": batch,
         "train.effective_batch": batch, "train.max_steps": steps, "train.eval_every": 0,
         "train.seed": seed, **RACE09[name]}
    if name.startswith("hybrid"):
        o["model.layers"] = hybrid_layers(n_layers)
    return o


def small_race(steps: int, names=tuple(RACE09), d_model: int = 64, n_layers: int = 2, seq_len: int = 128,
               batch: int = 8, seed: int = 0) -> list[dict]:
    """Train each named RACE09 configuration for `steps` optimizer steps on the embedded corpus
    (the run's length is its steps, never the host's speed); one row each: layers, parameters,
    tokens/s (sustained: the first steps, compilation and warm-up, excluded; this host, this run),
    validation bits per byte."""
    rows = []
    for name in names:
        cfg = make_config(race_overrides(name, d_model, n_layers, seq_len, batch, steps, seed))
        tr = Trainer(cfg, None, progress="none")
        s = tr.run()
        rows.append({"model": name, "layers": ",".join(cfg.model.kinds), "params": s["params"],
                     "steps": s["steps"], "tokens/s": int(s["tok_per_s_sustained"] or s["tokens"] / max(s["train_seconds"], 1e-9)),
                     "val bpb": round(s["val_bpb"], 4)})
        del tr
        gc.collect()
    return rows
