"""The SSD (Mamba-2) scan: one entry point with mamba_ssm's `mamba_chunk_scan_combined`
arguments, several backends, and the recurrent decoding step.

    ssd(x, dt, A, B, C, chunk_size=64, D=None, z=None, dt_bias=None, initial_states=None,
        seq_idx=None, dt_softplus=False, dt_limit=(0.0, inf), return_final_states=False,
        backend="auto") -> out (b, l, h, p)  [, final_states (b, h, p, n)]
    ssd_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_limit=(0.0, inf)) -> y (b, h, p), state updated in place

Shapes and meaning are `reference.py`'s. Backends:
  reference  the chunked form in plain PyTorch (`ssd_chunked_ref`, autograd through it)
  recurrent  the step-by-step recurrence (`ssd_recurrent_ref`: the float64 oracle)
  cpu        the fused numba recurrence up to d_state 128 (`cpu_recurrent.py`), the chunked form
             on matrix multiplies beyond (`cpu.py`; the rule: `cpu.prefer_recurrent`)
  triton     fused Triton kernels (`triton.py`; CUDA, or CPU tensors under TRITON_INTERPRET=1)
  auto       triton on CUDA, cpu on CPU
`ssd_packed` takes the Mamba-2 block's packed [x | B | C] instead (the model's entry).
When a requested fast path cannot run (triton without a GPU or the interpreter, triton not
importable, cpu asked for GPU tensors) the next best runs instead (cpu for CPU tensors, the
reference otherwise) and sonata.kernels' process-wide fallback counter moves, warning once
per reason. A sequence of length 0 returns at once (the initial state is the final one).
Which backend runs is sonata.kernels.dispatch's rule, the same for every family (`SSD` below:
its extra `recurrent` backend, and `cpu` as the fallback for CPU tensors): in particular `auto`
choosing the Triton kernels for CUDA tensors warns once per process while they are not in
sonata.kernels.GPU_VERIFIED (they have only run in Triton's interpreter).
The folder: reference.py (the oracles), cpu.py / cpu_fused.py / cpu_recurrent.py / cpu_steps.py
(the numba backend), step.py (the one-token step), triton.py / triton_fwd.py / triton_bwd.py.
"""
from __future__ import annotations

import math

import torch

from sonata.kernels import dispatch
from sonata.kernels.ssd.cpu import prefer_recurrent, ssd_cpu
from sonata.kernels.ssd.reference import ssd_chunked_ref, ssd_recurrent_ref
from sonata.kernels.ssd.step import ssd_step, ssd_step_ref

SSD = dispatch.Family("ssd", "ssd", cpu=None, triton="ssd.triton", label="ssd ", extra=("recurrent",),
                      fallback="cpu", dtypes=None)          # check_inputs takes the dtypes
BACKENDS = SSD.backends
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shape(t):
    return tuple(t.shape)


def check_inputs(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                 seq_idx=None, dt_limit=(0.0, math.inf)):
    """ValueError naming the first argument that does not fit x (b, l, h, p) and B (b, l, g, n)."""
    def bad(msg):
        raise ValueError(f"ssd: {msg}")
    if x.dim() != 4:
        bad(f"x must be (batch, seqlen, nheads, headdim), got {_shape(x)}")
    if x.dtype not in _FLOATS:
        bad(f"x must be a floating tensor (float16/bfloat16/float32/float64), got {x.dtype}")
    b, L, h, p = x.shape
    if B.dim() != 4 or B.shape[:2] != (b, L):
        bad(f"B must be (batch, seqlen, ngroups, dstate) = ({b}, {L}, g, n), got {_shape(B)}")
    if C.shape != B.shape:
        bad(f"C must have B's shape {_shape(B)}, got {_shape(C)}")
    g, n = B.shape[2], B.shape[3]
    if g < 1 or h % g:
        bad(f"{h} heads cannot share {g} groups of B and C (nheads must be a multiple of ngroups)")
    for name, t, want in (("dt", dt, (b, L, h)), ("A", A, (h,)), ("z", z, (b, L, h, p)),
                          ("dt_bias", dt_bias, (h,)), ("initial_states", initial_states, (b, h, p, n)),
                          ("seq_idx", seq_idx, (b, L))):
        if t is not None and _shape(t) != want:
            bad(f"{name} must be {want} for x {_shape(x)} and B {_shape(B)}, got {_shape(t)}")
    if D is not None and _shape(D) not in ((h,), (h, p)):
        bad(f"D must be ({h},) or ({h}, {p}), got {_shape(D)}")
    if seq_idx is not None and (seq_idx.dtype.is_floating_point or seq_idx.dtype == torch.bool):
        bad(f"seq_idx must hold integers, got {seq_idx.dtype}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        bad(f"chunk_size must be a positive int, got {chunk_size!r}")
    if len(dt_limit) != 2 or not dt_limit[0] <= dt_limit[1]:
        bad(f"dt_limit must be (low, high) with low <= high, got {dt_limit!r}")
    for name, t in (("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z),
                    ("dt_bias", dt_bias), ("initial_states", initial_states), ("seq_idx", seq_idx)):
        if t is not None and t.device != x.device:
            bad(f"{name} is on {t.device}, x on {x.device}")


def resolve_backend(backend: str, x: torch.Tensor) -> tuple[str, str | None]:
    """Which backend runs for tensors like x: (name, why it is not the requested one)."""
    return dispatch.resolve(SSD, backend, x)


def ssd(x, dt, A, B, C, chunk_size=64, D=None, z=None, dt_bias=None, initial_states=None,
        seq_idx=None, dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False,
        backend="auto"):
    """The SSD scan (module docstring)."""
    check_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_limit)
    name, why = resolve_backend(backend, x)
    if why is not None:
        dispatch.record_fallback(why)
    args = (x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus,
            tuple(dt_limit), return_final_states)
    if x.shape[1] == 0:
        name = "recurrent"                              # nothing to compute
    if name == "triton":
        dispatch.triton_chosen("ssd", backend, x)
        return SSD.load_triton()[0].ssd_triton(*args)
    impl = {"reference": ssd_chunked_ref, "recurrent": ssd_recurrent_ref, "cpu": ssd_cpu}[name]
    return impl(*args[:5], chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias,
                initial_states=initial_states, seq_idx=seq_idx, dt_softplus=dt_softplus,
                dt_limit=tuple(dt_limit), return_final_states=return_final_states)


FUSED_NORM = True     # ssd_packed's norm inside the recurrence's kernels (off: rms_norm_gated after it)


def ssd_packed(xBC, dt, A, headdim, ngroups, dstate, chunk_size=64, D=None, dt_bias=None, dt_softplus=False,
               dt_limit=(0.0, math.inf), backend="auto", norm=None):
    """`ssd` over the Mamba-2 block's packed convolution output xBC (b, l, h*headdim + 2*G*N)
    = [x | B | C] (the layout of in_proj's xBC slice), no gate, no initial or final state ->
    out (b, l, h, headdim). Where the cpu backend picks the fused recurrence, one kernel pair
    reads the three parts in place and writes one packed gradient (`cpu_recurrent.
    SSDPackedFunction`); elsewhere the parts are split off and `ssd` runs.

    norm = (z, weight, eps): the block's gated norm after it, norm(y * silu(z)) * weight over
    `ngroups` groups (`GatedRMSNorm`, `rms_norm_gated` with norm_before_gate False) -> (b, l,
    h*headdim). The fused recurrence computes it in its own kernels (each work item's rows are
    one group); elsewhere `rms_norm_gated` runs after `ssd`."""
    b, L, width = xBC.shape
    gn = ngroups * dstate
    if headdim < 1 or (width - 2 * gn) % headdim or width - 2 * gn < headdim:
        raise ValueError(f"ssd_packed: xBC's {width} channels are not h*{headdim} + 2*{gn}")
    h = (width - 2 * gn) // headdim
    x, B, C = xBC.split([h * headdim, gn, gn], dim=-1)
    x, B, C = x.reshape(b, L, h, headdim), B.reshape(b, L, ngroups, dstate), C.reshape(b, L, ngroups, dstate)
    check_inputs(x, dt, A, B, C, chunk_size, D, None, dt_bias, None, None, dt_limit)
    name, why = resolve_backend(backend, x)
    if (name, why) == ("cpu", None) and L > 0 and prefer_recurrent(x, B):
        from sonata.kernels.ssd.cpu_recurrent import ssd_cpu_recurrent_packed
        y = ssd_cpu_recurrent_packed(xBC, dt, A, (h, headdim, ngroups, dstate), D=D, dt_bias=dt_bias,
                                     dt_softplus=dt_softplus, dt_limit=dt_limit, norm=norm if FUSED_NORM else None)
        if norm is None or FUSED_NORM:
            return y
    else:
        y = ssd(x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                dt_limit=dt_limit, backend=backend)
    if norm is None:
        return y
    from sonata.kernels import rms_norm_gated          # looked up here: a test may substitute it
    z, weight, eps = norm
    return rms_norm_gated(y.reshape(b, L, h * headdim), weight, z, eps, h * headdim // ngroups,
                          norm_before_gate=False, backend=backend)


__all__ = [
    "BACKENDS",
    "SSD",
    "check_inputs",
    "resolve_backend",
    "ssd",
    "ssd_chunked_ref",
    "ssd_cpu",
    "ssd_packed",
    "ssd_recurrent_ref",
    "ssd_step",
    "ssd_step_ref",
]
