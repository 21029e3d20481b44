"""The gated delta rule's fused CPU backend (numba): forward, hand-written backward and the
one-token step; `reference.py` is their oracle (tests/kernels/test_gdn.py).

Each (sequence, value head) pair is one work item: its state S (dk x dv) stays in one buffer
while the kernel walks the tokens, reading its key head's q and k in place (grouped heads are
never expanded). Per token, with a = exp(g_t):

    S <- a S;  p = S^T k;  u = beta (v - p);  S <- S + k u^T;  o = scale S^T q

two passes over S. Nothing of size (b, l, h, dk, dv) is ever stored: the forward keeps S at
the start of every chunk of `chunk_size` tokens (b, h, n_chunks, dk, dv), and the backward
walks the chunks last to first, recomputing a chunk's decayed states P_t = a_t S_{t-1} and
corrections u_t from its checkpoint (one chunk's worth, C x dk x dv, per worker), then the
chunk's tokens in reverse. With dS the gradient of S_t from the future and do_t that of o_t:

    dS += scale q do^T;  dq = scale S_t do;  du = dS^T k;  dk = dS u
    dv = beta du;  dbeta = du . (v - p);  dp = -beta du
    dP = dS + k dp^T;  dk += P dp;  dg = sum(P o dP);  dS <- a dP

again two passes over S per token. A value head's dq and dk are written per value head and
summed over the heads that share a key head afterwards (fixed order: deterministic, no atomics).
Work items are split over numba's workers (`cpu_simd.for_workers`), each writing only its own
rows. Arithmetic in float32 (float64 for float64 inputs), the results in the inputs' dtypes.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange

from sonata.kernels.cpu_arrays import np_view
from sonata.kernels.cpu_simd import VEC_FLAGS, for_workers, parallel_kernel, workers
from sonata.kernels.dispatch import compute_dtype, opaque
from sonata.kernels.gdn.reference import default_scale

POISON = False      # tests: fill the outputs with NaN first, so an unwritten element cannot pass


@parallel_kernel(**VEC_FLAGS)
def gdn_forward_kernel(q, k, v, g, beta, S0, scale, C, n_workers, o, ckpt, S_end):
    """q, k (b, L, hk, dk); v (b, L, h, dv); g, beta (b, L, h); S0 (b, h, dk, dv) -> o (b, L, h,
    dv), ckpt (b, h, n_chunks, dk, dv): S before each chunk, S_end (b, h, dk, dv)."""
    b, L, hk, dk = q.shape
    h, dv = v.shape[2], v.shape[3]
    rep = h // hk
    for w in prange(n_workers):
        p = np.empty(dv, dtype=v.dtype)
        acc = np.empty(dv, dtype=v.dtype)
        for item in range(w, b * h, n_workers):
            bi, hi = item // h, item % h
            ki = hi // rep
            S = S_end[bi, hi]
            S[:, :] = S0[bi, hi]
            for t in range(L):
                if t % C == 0:
                    ckpt[bi, hi, t // C] = S
                a = np.exp(g[bi, t, hi])
                bt = beta[bi, t, hi]
                p[:] = 0
                for i in range(dk):
                    kv = k[bi, t, ki, i]
                    for j in range(dv):
                        s = a * S[i, j]
                        S[i, j] = s
                        p[j] += s * kv
                for j in range(dv):
                    p[j] = bt * (v[bi, t, hi, j] - p[j])                # p is now u
                acc[:] = 0
                for i in range(dk):
                    kv = k[bi, t, ki, i]
                    qv = q[bi, t, ki, i] * scale
                    for j in range(dv):
                        s = S[i, j] + kv * p[j]
                        S[i, j] = s
                        acc[j] += s * qv
                for j in range(dv):
                    o[bi, t, hi, j] = acc[j]


@parallel_kernel(**VEC_FLAGS)
def gdn_backward_kernel(q, k, v, g, beta, ckpt, scale, C, do, dS_end, n_workers, dq, dk, dv, dg, dbeta, dS0):
    """The gradients (module docstring): dq, dk (b, L, h, dk) per value head, dv (b, L, h, dv),
    dg, dbeta (b, L, h), dS0 (b, h, dk, dv), from do (b, L, h, dv) and dS_end (b, h, dk, dv)."""
    b, L, hk, nk = q.shape
    h, nv = v.shape[2], v.shape[3]
    rep = h // hk
    n_chunks = ckpt.shape[2]
    for w in prange(n_workers):
        P = np.empty((C, nk, nv), dtype=v.dtype)                # a chunk's decayed states
        U = np.empty((C, nv), dtype=v.dtype)                    # its corrections u_t
        R = np.empty((C, nv), dtype=v.dtype)                    # its residuals v_t - p_t
        S = np.empty((nk, nv), dtype=v.dtype)
        du = np.empty(nv, dtype=v.dtype)
        for item in range(w, b * h, n_workers):
            bi, hi = item // h, item % h
            ki = hi // rep
            dS = dS0[bi, hi]
            dS[:, :] = dS_end[bi, hi]
            for c in range(n_chunks - 1, -1, -1):
                t0 = c * C
                t1 = min(L, t0 + C)
                S[:, :] = ckpt[bi, hi, c]
                for t in range(t0, t1):                         # recompute the chunk's states
                    r = t - t0
                    a = np.exp(g[bi, t, hi])
                    du[:] = 0
                    for i in range(nk):
                        kv = k[bi, t, ki, i]
                        for j in range(nv):
                            s = a * S[i, j]
                            P[r, i, j] = s
                            du[j] += s * kv
                    bt = beta[bi, t, hi]
                    for j in range(nv):
                        R[r, j] = v[bi, t, hi, j] - du[j]
                        U[r, j] = bt * R[r, j]
                    for i in range(nk):
                        kv = k[bi, t, ki, i]
                        for j in range(nv):
                            S[i, j] = P[r, i, j] + kv * U[r, j]
                for t in range(t1 - 1, t0 - 1, -1):             # and walk them back
                    r = t - t0
                    a = np.exp(g[bi, t, hi])
                    bt = beta[bi, t, hi]
                    du[:] = 0
                    for i in range(nk):
                        kv = k[bi, t, ki, i]
                        qv = q[bi, t, ki, i] * scale
                        sq = kv * 0
                        sk = kv * 0
                        for j in range(nv):
                            st = P[r, i, j] + kv * U[r, j]
                            dot = do[bi, t, hi, j]
                            sq += st * dot
                            d = dS[i, j] + qv * dot
                            dS[i, j] = d
                            sk += d * U[r, j]
                            du[j] += d * kv
                        dq[bi, t, hi, i] = scale * sq
                        dk[bi, t, hi, i] = sk
                    db = du[0] * 0
                    for j in range(nv):
                        dv[bi, t, hi, j] = bt * du[j]
                        db += du[j] * R[r, j]
                        du[j] = -bt * du[j]                     # du is now dp
                    dbeta[bi, t, hi] = db
                    dgs = db * 0
                    for i in range(nk):
                        kv = k[bi, t, ki, i]
                        sk = kv * 0
                        for j in range(nv):
                            pv = P[r, i, j]
                            d = dS[i, j] + kv * du[j]
                            sk += pv * du[j]
                            dgs += pv * d
                            dS[i, j] = a * d
                        dk[bi, t, hi, i] += sk
                    dg[bi, t, hi] = dgs


@njit(**VEC_FLAGS)
def gdn_step_kernel(S, q, k, v, g, beta, scale, o):
    """One token for every (sequence, head): S (b, h, dk, dv) in place, q, k (b, hk, dk), v (b,
    h, dv), g, beta (b, h) -> o (b, h, dv). Single-threaded (a step is microseconds of work)."""
    b, h, dk, dv = S.shape
    rep = h // q.shape[1]
    p = np.empty(dv, dtype=S.dtype)
    for bi in range(b):
        for hi in range(h):
            ki = hi // rep
            a = np.exp(S.dtype.type(g[bi, hi]))
            p[:] = 0
            for i in range(dk):
                kv = S.dtype.type(k[bi, ki, i])
                for j in range(dv):
                    s = a * S[bi, hi, i, j]
                    S[bi, hi, i, j] = s
                    p[j] += s * kv
            bt = S.dtype.type(beta[bi, hi])
            for j in range(dv):
                p[j] = bt * (S.dtype.type(v[bi, hi, j]) - p[j])
                o[bi, hi, j] = 0
            for i in range(dk):
                kv = S.dtype.type(k[bi, ki, i])
                qv = S.dtype.type(q[bi, ki, i]) * scale
                for j in range(dv):
                    s = S[bi, hi, i, j] + kv * p[j]
                    S[bi, hi, i, j] = s
                    o[bi, hi, j] += s * qv


def _arr(t, ct):
    """A C-contiguous numpy array of t in dtype ct (no copy when it already is one)."""
    if t.dtype != ct or not t.is_contiguous():
        t = t.to(ct).contiguous()
    return t.detach().numpy()


def _new(shape, ct):
    return torch.full(shape, math.nan, dtype=ct) if POISON else torch.empty(shape, dtype=ct)


def chunk_of(chunk_size: int, L: int) -> int:
    """The forward's checkpoint spacing for L tokens: chunk_size, at least 1 and at most L."""
    return max(1, min(int(chunk_size), L))


def gdn_forward(q, k, v, g, beta, S0, scale: float, chunk_size: int):
    """The fused forward -> (o (b, L, h, dv) in v's dtype, the final state (b, h, dk, dv) and the
    states every chunk (b, h, n_chunks, dk, dv), both in the compute dtype; the backward reads
    the last)."""
    ct = compute_dtype(v.dtype)
    b, L, h, dv = v.shape
    dk = q.shape[-1]
    C = chunk_of(chunk_size, L)
    n_chunks = -(-L // C)
    qa, ka, va, ga, ba = (_arr(t, ct) for t in (q, k, v, g, beta))
    S0a = np.zeros((b, h, dk, dv), dtype=va.dtype) if S0 is None else _arr(S0, ct)
    o, ckpt, S_end = _new((b, L, h, dv), ct), _new((b, h, n_chunks, dk, dv), ct), _new((b, h, dk, dv), ct)
    n = workers()
    for_workers(gdn_forward_kernel, n)(qa, ka, va, ga, ba, S0a, va.dtype.type(scale), C, n,
                                       o.numpy(), ckpt.numpy(), S_end.numpy())
    return o.to(v.dtype), S_end, ckpt


def gdn_backward(do, dS_end, q, k, v, g, beta, ckpt, scale: float, chunk_size: int, S0_dtype):
    """The fused backward from the forward's inputs and checkpoints -> (dq, dk, dv, dg, dbeta,
    dS0), each in its input's dtype (dS0 in `S0_dtype`; None when there was no initial state);
    do or dS_end may be None (no gradient reached that output)."""
    ct = compute_dtype(v.dtype)
    qa, ka, va, ga, ba = (_arr(t, ct) for t in (q, k, v, g, beta))
    b, L, hk, dk = qa.shape
    h, dv = va.shape[2], va.shape[3]
    doa = np.zeros((b, L, h, dv), dtype=va.dtype) if do is None else _arr(do, ct)
    dSa = np.zeros((b, h, dk, dv), dtype=va.dtype) if dS_end is None else _arr(dS_end, ct)
    dq, dkk = _new((b, L, h, dk), ct), _new((b, L, h, dk), ct)
    dvv, dg, dbeta, dS0 = _new((b, L, h, dv), ct), _new((b, L, h), ct), _new((b, L, h), ct), _new((b, h, dk, dv), ct)
    n = workers()
    for_workers(gdn_backward_kernel, n)(qa, ka, va, ga, ba, _arr(ckpt, ct), va.dtype.type(scale),
                                        chunk_of(chunk_size, L), doa, dSa, n, dq.numpy(), dkk.numpy(), dvv.numpy(),
                                        dg.numpy(), dbeta.numpy(), dS0.numpy())
    if hk != h:                                             # the value heads sharing a key head
        dq, dkk = (t.reshape(b, L, hk, h // hk, dk).sum(3) for t in (dq, dkk))
    return (dq.to(q.dtype), dkk.to(k.dtype), dvv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype),
            None if S0_dtype is None else dS0.to(S0_dtype))


@opaque
def gdn_step_cpu(state, q, k, v, g, beta, scale=None):
    """`gdn_step_ref` on the fused step kernel: state a C-contiguous float32 / float64 CPU tensor,
    updated in place; o (b, h, dv) in v's dtype."""
    scale = default_scale(q) if scale is None else float(scale)
    ct = state.dtype
    o = torch.empty(v.shape, dtype=ct)
    gdn_step_kernel(state.detach().numpy(), np_view(q, ct), np_view(k, ct), np_view(v, ct), np_view(g, ct),
                    np_view(beta, ct), state.detach().numpy().dtype.type(scale), o.numpy())
    return o.to(v.dtype)


__all__ = ["gdn_backward", "gdn_backward_kernel", "gdn_forward", "gdn_forward_kernel", "gdn_step_cpu",
           "gdn_step_kernel"]
