"""The elementwise passes around cpu.py's matrix multiplies, each one fused numba pass over
memory instead of one pass per torch op, with a torch twin (the same results, as torch ops)
that runs in float64 and where numba is missing; the tests compare the two.

    output    y    = (exp(s) raw_o + e raw_y + D x) * silu(z)
    gate      pre  = exp(s) raw_o + e raw_y + (dt G_ii + D) x;  dz = dout pre silu'(z);
              dY   = dout silu(z);  exp(s) dY;  e dY;  and the dot products over p
              dY . raw_o,  dY . raw_y,  x . dY
    epilogue  dx   = (dt f) raw_s + (dt exp(s_Q - s)) raw_e + (dt G_ii + D) dY;
              x . raw_s,  x . raw_e

(raw_o = C S0, raw_y = G (f o X), raw_s = G^T (e o dY), raw_e = B dE; cpu.py's notation.)
`prepare_dt` and `prepare_dt_backward` (torch ops) are dt's bias, softplus and clamp and their
gradient, shared by both CPU forms (cpu.py, cpu_recurrent.py).
The kernels see cpu.py's blocked tensors as rows: (R hg, p) per channel and (R hg,) per
position and head, R = b g nc Q; row r belongs to group (r // (nc Q)) % g, whose D rows are
passed as (g hg, p). The gate's sigmoid comes from torch (a vectorized exp). Single-threaded:
the passes are memory-bound, and a numba thread pool beside torch's spins on the cores the
matrix multiplies need. Compiled on first use and cached on disk (numba_cache conventions).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

try:
    from numba import njit

    from sonata.kernels import numba_cache

    numba_cache.install()
except ImportError:         # no numba: the torch twins run
    njit = None

_opts = {"cache": True, "nogil": True, "error_model": "numpy",
         "fastmath": {"reassoc", "contract", "nsz", "arcp"}}
_jit = njit(**_opts) if njit is not None else (lambda fn: fn)


@_jit
def _forward(raw_o, raw_y, fs, e, x, Dg, H, G, rpg, sz, z, out):
    N, P = raw_o.shape                                   # rows (R * hg, p)
    gated = z.shape[0] > 0
    for r in range(N // H):                              # rows: (position, head)
        gH = ((r // rpg) % G) * H                        # D rows of the group
        for hh in range(H):
            i, d = r * H + hh, gH + hh
            a, b = fs[i], e[i]
            if gated:
                for q in range(P):
                    out[i, q] = (raw_o[i, q] * a + raw_y[i, q] * b + Dg[d, q] * x[i, q]) * (z[i, q] * sz[i, q])
            else:
                for q in range(P):
                    out[i, q] = raw_o[i, q] * a + raw_y[i, q] * b + Dg[d, q] * x[i, q]


@_jit
def _gate(raw_o, raw_y, fs, e, x, dtgd, Dg, H, G, rpg, sz, z, dout, dz, dy, dyfs, dye, d_o, d_y, x_y):
    N, P = raw_o.shape
    gated = z.shape[0] > 0
    for r in range(N // H):                              # rows: (position, head)
        gH = ((r // rpg) % G) * H                        # D rows of the group
        for hh in range(H):
            i, d = r * H + hh, gH + hh
            a, b, c = fs[i], e[i], dtgd[i]
            so = np.float32(0.0)
            sy, sx = so, so
            if gated:
                for q in range(P):
                    pre = raw_o[i, q] * a + raw_y[i, q] * b + (c + Dg[d, q]) * x[i, q]
                    s, zz, g0 = sz[i, q], z[i, q], dout[i, q]
                    dz[i, q] = g0 * pre * s * (1.0 + zz * (1.0 - s))
                    g = g0 * zz * s
                    dy[i, q] = g
                    dyfs[i, q] = g * a
                    dye[i, q] = g * b
                    so += g * raw_o[i, q]
                    sy += g * raw_y[i, q]
                    sx += g * x[i, q]
            else:
                for q in range(P):
                    g = dout[i, q]
                    dyfs[i, q] = g * a
                    dye[i, q] = g * b
                    so += g * raw_o[i, q]
                    sy += g * raw_y[i, q]
                    sx += g * x[i, q]
            d_o[i], d_y[i], x_y[i] = so, sy, sx


@_jit
def _epilogue(raw_s, raw_e, x, dy, a_s, a_e, a_y, Dg, H, G, rpg, dx, x_s, x_e):
    N, P = raw_s.shape
    for r in range(N // H):                              # rows: (position, head)
        gH = ((r // rpg) % G) * H                        # D rows of the group
        for hh in range(H):
            i, d = r * H + hh, gH + hh
            a, b, c = a_s[i], a_e[i], a_y[i]
            ss = np.float32(0.0)
            se = ss
            for q in range(P):
                ss += x[i, q] * raw_s[i, q]
                se += x[i, q] * raw_e[i, q]
                dx[i, q] = raw_s[i, q] * a + raw_e[i, q] * b + dy[i, q] * (c + Dg[d, q])
            x_s[i], x_e[i] = ss, se


def _np(t, *shape):
    """A C-contiguous numpy view of t, reshaped to shape (a copy only where t is not one)."""
    t = t.detach()
    return (t.reshape(shape) if shape else t).contiguous().numpy()


def _dg(D3, H, P):
    """D as (g * hg, p) rows, its g (zeros, g = 1, without D)."""
    if D3 is None:
        return np.zeros((H, P), np.float32), 1
    return _np(D3.expand(D3.shape[0], H, P), -1, P), D3.shape[0]


def _none(P):
    return np.empty((0, P), np.float32)


def _nb_output(raw_o, raw_y, fs, e, x, D3, sz, z, rpg):
    """out (R, hg, p)."""
    R, H, P = raw_o.shape
    o = _np(raw_o, -1, P)
    out = np.empty_like(o)
    Dg, G = _dg(D3, H, P)
    _forward(o, _np(raw_y, -1, P), _np(fs, -1), _np(e, -1), _np(x, -1, P), Dg, H, G, rpg,
             _none(P) if sz is None else _np(sz, -1, P), _none(P) if z is None else _np(z, -1, P), out)
    return torch.from_numpy(out).view(R, H, P)


def _nb_gate(raw_o, raw_y, fs, e, x, dtgd, D3, sz, z, dout, rpg):
    """(dY, dz or None, dYfs, dYe, d_o, d_y, x_y); dY is dout itself without a gate."""
    R, H, P = raw_o.shape
    ro, dout_n = _np(raw_o, -1, P), _np(dout, -1, P)
    gated = z is not None
    dz, dy = (np.empty_like(ro) if gated else _none(P) for _ in range(2))
    dyfs, dye = np.empty_like(ro), np.empty_like(ro)
    d_o, d_y, x_y = (np.empty(ro.shape[0], ro.dtype) for _ in range(3))
    Dg, G = _dg(D3, H, P)
    _gate(ro, _np(raw_y, -1, P), _np(fs, -1), _np(e, -1), _np(x, -1, P), _np(dtgd, -1), Dg, H, G, rpg,
          _none(P) if sz is None else _np(sz, -1, P), _none(P) if z is None else _np(z, -1, P), dout_n,
          dz, dy, dyfs, dye, d_o, d_y, x_y)
    big = lambda a: torch.from_numpy(a).view(R, H, P)
    small = lambda a: torch.from_numpy(a).view(R, H)
    return (big(dy) if gated else big(dout_n), big(dz) if gated else None, big(dyfs), big(dye),
            small(d_o), small(d_y), small(x_y))


def _nb_epilogue(raw_s, raw_e, x, dy, a_s, a_e, a_y, D3, rpg):
    """(dx (R, hg, p), x_s, x_e)."""
    R, H, P = raw_s.shape
    s_ = _np(raw_s, -1, P)
    dx = np.empty_like(s_)
    x_s, x_e = (np.empty(s_.shape[0], s_.dtype) for _ in range(2))
    Dg, G = _dg(D3, H, P)
    _epilogue(s_, _np(raw_e, -1, P), _np(x, -1, P), _np(dy, -1, P), _np(a_s, -1), _np(a_e, -1),
              _np(a_y, -1), Dg, H, G, rpg, dx, x_s, x_e)
    return (torch.from_numpy(dx).view(R, H, P), torch.from_numpy(x_s).view(R, H),
            torch.from_numpy(x_e).view(R, H))


def _dot(a, b):
    return (a * b).sum(-1)


def _rows(t, blk):
    """Blocked (b, g, nc, Q, hg[, p]) -> rows (R, hg[, p]) for the fused kernels."""
    return t.reshape(blk.nb * blk.Q, *t.shape[4:])


def _fused_ok(t):
    return njit is not None and t.dtype == torch.float32 and t.device.type == "cpu"


def _v(t):
    return t[..., None]


def output(su, raw_o, raw_y, z):
    """y = fs raw_o + e raw_y (+ D x) (* silu(z)), blocked."""
    blk, dec = su.blk, su.dec
    zb = None if z is None else blk.put(z.to(raw_o.dtype))
    if _fused_ok(raw_o):
        r = lambda t: None if t is None else _rows(t, blk)
        D3 = None if su.Dv is None else su.Dv[0, :, 0, 0]
        sz = None if zb is None else torch.sigmoid(zb)
        return _nb_output(r(raw_o), r(raw_y), r(dec.fs), r(dec.e), r(su.xb), D3, r(sz), r(zb),
                              blk.nc * blk.Q).view(raw_o.shape)
    y = (raw_o * _v(dec.fs)).addcmul_(raw_y, _v(dec.e))      # not in place: the backward reads raw_o
    if su.Dv is not None:
        y.addcmul_(su.xb, su.Dv)
    return y if zb is None else y.mul_(F.silu(zb))


def gate(su, raw_o, raw_y, Gd, z, dout_b):
    """(dY, dz, fs dY, e dY, dY . raw_o, dY . raw_y, x . dY), blocked; dz None without z."""
    blk, dec, xb = su.blk, su.dec, su.xb
    zb = None if z is None else blk.put(z.to(raw_o.dtype))
    if _fused_ok(raw_o):
        r = lambda t: None if t is None else _rows(t, blk)
        D3 = None if su.Dv is None else su.Dv[0, :, 0, 0]
        sz = None if zb is None else torch.sigmoid(zb)
        outs = _nb_gate(r(raw_o), r(raw_y), r(dec.fs), r(dec.e), r(xb), r(su.dt_b * Gd), D3,
                           r(sz), r(zb), r(dout_b), blk.nc * blk.Q)
        return tuple(None if t is None else t.view(raw_o.shape[:4] + t.shape[1:]) for t in outs)
    dz = None
    if zb is not None:
        sz = torch.sigmoid(zb)
        pre = (raw_o * _v(dec.fs)).addcmul_(raw_y, _v(dec.e)).addcmul_(xb, _v(su.dt_b * Gd))
        if su.Dv is not None:
            pre.addcmul_(xb, su.Dv)
        dz = pre.mul_(dout_b).mul_(sz * (1.0 + zb * (1.0 - sz)))
        dY = dout_b * (zb * sz)
    else:
        dY = dout_b
    return (dY, dz, dY * _v(dec.fs), dY * _v(dec.e), _dot(dY, raw_o), _dot(dY, raw_y),
            _dot(xb, dY))


def epilogue(su, raw_s, raw_e, dYb, Gd):
    """(dx = (dt f) raw_s + (dt te) raw_e + (dt Gd + D) dY, x . raw_s, x . raw_e), blocked."""
    blk, dec, xb, dt_b = su.blk, su.dec, su.xb, su.dt_b
    if _fused_ok(raw_s):
        r = lambda t: _rows(t, blk)
        D3 = None if su.Dv is None else su.Dv[0, :, 0, 0]
        dx, x_s, x_e = _nb_epilogue(r(raw_s), r(raw_e), r(xb), r(dYb), r(dt_b * dec.f),
                                       r(dt_b * dec.te), r(dt_b * Gd), D3, blk.nc * blk.Q)
        return dx.view(raw_s.shape), x_s.view(raw_s.shape[:5]), x_e.view(raw_s.shape[:5])
    dx = (raw_s * _v(dt_b * dec.f)).addcmul_(raw_e, _v(dt_b * dec.te)).addcmul_(dYb, _v(dt_b * Gd))
    if su.Dv is not None:
        dx.addcmul_(dYb, su.Dv)
    return dx, _dot(xb, raw_s), _dot(xb, raw_e)


def prepare_dt(dt, dt_bias, softplus, limit):
    """The recurrence's step sizes (reference.prepare_dt) in the arithmetic dtype."""
    v = dt if dt_bias is None else dt + dt_bias.to(dt.dtype)
    if softplus:
        v = torch.where(v <= 20.0, F.softplus(v), v)
    lo, hi = limit
    return v.clamp(min=lo, max=hi) if (lo > 0.0 or hi < math.inf) else v


def prepare_dt_backward(ddte, dt, dt_bias, softplus, limit):
    """Gradient of prepare_dt: (ddt, ddt_bias)."""
    v = dt if dt_bias is None else dt + dt_bias.to(dt.dtype)
    g = ddte
    lo, hi = limit
    if lo > 0.0 or hi < math.inf:
        sp = torch.where(v <= 20.0, F.softplus(v), v) if softplus else v
        g = g * ((sp >= lo) & (sp <= hi)).to(g.dtype)
    if softplus:
        g = g * torch.where(v <= 20.0, torch.sigmoid(v), torch.ones_like(v))
    return g, (None if dt_bias is None else g.sum((0, 1)))
