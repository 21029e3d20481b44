"""sonata/kernels/cpu_simd.py: the fused CPU kernels' shared pieces (shared numba
infrastructure, at the top of sonata/kernels beside numba_cache.py and cpu_arrays.py): lane
widths, compile flags (JIT_FLAGS, VEC_FLAGS, INLINE_FLAGS), vectorizable float32 exp, softplus
and sigmoid (fast_exp, fast_softplus, fast_sigmoid), the work queue (take_item) and LLVM vector
codegen (VectorIR). Every family's numba kernels (selective/, layers/, ssd/) compile with these;
each family's cpu.py is the torch glue in front of its kernels.

Work distribution. Each parallel pass runs one `prange` iteration per thread, and
the threads take work items from a shared atomic counter (`take_item`) until none are
left, instead of getting a fixed share each: on a machine where another process
holds one of the cores, the thread that runs does the work instead of the pass
waiting for the share of the thread that does not. Which thread computes an item
never changes what the item computes or where it writes.

Precision. float32 arithmetic for float16 / bfloat16 / float32 inputs (numba has
no bfloat16: the torch glue converts to contiguous float32 numpy arrays), float64
for float64 inputs, so `torch.autograd.gradcheck` runs through the fused backward.
In float32, exp and softplus are vectorizable polynomial versions (< 1 ulp, see
below) instead of libm calls. The kernels are compiled for both dtypes (lazily,
on first use) and cached on disk (`cache=True`, NUMBA_CACHE_DIR is honoured), the cache
keyed by every source of this folder (`numba_cache`: an edit here reaches selective/decode_cpu.py's kernels).
"""
from __future__ import annotations

import math
import os
import threading
import types as pytypes

import numba
import numpy as np
import torch
from llvmlite import ir
from llvmlite.binding import get_host_cpu_features
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from sonata.kernels import numba_cache

numba_cache.install()      # before any @njit(cache=True): the cache is keyed by all kernel sources

LANES_OVERRIDE = os.environ.get("SONATA_CPU_LANES", "")


def _vector_bits() -> int:
    """Width of the vector registers numba compiles for: 512 with AVX-512, else 256 (AVX2;
    narrower machines just run the same loops in more pieces). The host's, unless numba is
    told to compile for another CPU (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES)."""
    if numba.config.CPU_NAME or numba.config.CPU_FEATURES:
        features = numba.config.CPU_FEATURES or ""
    else:
        features = get_host_cpu_features().flatten()
    return 512 if "+avx512f" in features.split(",") else 256


def _lanes_setting(default: int) -> int:
    """SONATA_CPU_LANES (16 or 32) overrides the scan's lanes, e.g. to test or measure the
    other width on one machine. The kernels then compile in the process and skip the disk
    cache (numba's cache does not key on a module constant: it would hand back the kernels of
    the machine's default width, or keep these for later processes)."""
    value = LANES_OVERRIDE
    if value == "":
        return default
    if value not in ("16", "32"):     # an ImportError: the dispatcher names it as a fallback's reason
        raise ImportError(f"SONATA_CPU_LANES={value!r}: use 16 or 32 (or leave it unset)")
    return int(value)


# Channels per block of the scan kernels: the lanes of their vector loops, two vector
# registers of float32 (16 with AVX2, 32 with AVX-512). Per (time step, state) the kernels
# also broadcast B and C, run the loop and, in the backward, reduce dB and dC over the lanes;
# two registers per row spread that over twice the channels of one. Measured on an AVX-512
# host, 32 lanes against 16: the training step 1.05-1.08x at micro-batch 8 and 1.05x at 32
# (64 lanes: 1.00x). A work item is one block of W channels of one sequence; the partition
# depends only on the shapes (and W), so results do not depend on the threads.
W = _lanes_setting(32 if _vector_bits() == 512 else 16)
# The lanes of the conv and loss kernels: 16 on every machine (the conv measured slower
# with 32).
WC = 16

# error_model="numpy": float division by zero gives inf/nan instead of a Python
# exception, whose check would also block vectorization.
JIT_FLAGS = dict(cache=LANES_OVERRIDE == "", nogil=True, error_model="numpy")
# The kernels' loops over the W lanes may reassociate their sums (the lane reductions
# of dB, dC) and fuse multiply-adds, so that they vectorize (AVX2 / AVX-512). The order
# is fixed at compile time: results stay bit-identical from call to call. No 'nnan'/'ninf':
# NaNs and infinities propagate as in the reference.
VEC_FLAGS = dict(JIT_FLAGS, fastmath={"reassoc", "contract"})
# Helpers are inlined into the kernels by numba (a call per time step would pass
# every array argument's fields on the stack, and block vectorization); they then
# compile with the kernel's fastmath flags.
INLINE_FLAGS = dict(inline="always")


# Kernels that split their work over numba's thread pool (`prange` over n_workers) are
# compiled twice: `parallel_kernel` is the parallel one, `serial(kernel)` a twin compiled
# without `parallel` (prange runs as range), for one worker. Why: a parallel call starts numba's
# OpenMP pool at NUMBA_NUM_THREADS threads even when told to use one, and after each call
# the idle ones wait actively. With torch at one thread on a busy host that waiting thread
# takes the core the work needs: a Mamba-2 training step at one thread, beside one other busy
# process on 2 cores, measured 248 ms against 9.4 ms with NUMBA_NUM_THREADS=1 (its conv and
# loss kernels are parallel ones). The twin is the same code object under its own qualified
# name (numba's cache keys a kernel by its name and bytecode, not its flags: the twins must
# not share an entry), with the other parallel kernels it calls swapped for their twins.
_SOURCE = "_sonata_parallel_source"


def parallel_kernel(**opts):
    """njit(parallel=True, **opts), remembering the source for its serial twin."""
    def deco(fn):
        kernel = njit(parallel=True, **opts)(fn)
        setattr(kernel, _SOURCE, (fn, opts))
        return kernel
    return deco


def serial(kernel):
    """The one-worker twin of a `parallel_kernel` (built on first use, after its module's
    globals exist: the parallel kernels it calls become their twins too)."""
    twin = kernel.__dict__.get("_sonata_serial")
    if twin is None:
        fn, opts = getattr(kernel, _SOURCE)
        env = dict(fn.__globals__)
        for name in fn.__code__.co_names:                  # the globals it reads
            if name in env and env[name] is not kernel and _SOURCE in getattr(env[name], "__dict__", {}):
                env[name] = serial(env[name])
        py = pytypes.FunctionType(fn.__code__, env, fn.__name__ + "_serial", fn.__defaults__, fn.__closure__)
        py.__qualname__, py.__module__ = fn.__qualname__ + "_serial", fn.__module__
        twin = kernel._sonata_serial = njit(**opts)(py)
    return twin


def for_workers(kernel, n_workers: int):
    """The kernel to call with `n_workers`: the parallel one for more than one, else its twin."""
    return kernel if n_workers > 1 else serial(kernel)


_threads = threading.local()


def workers() -> int:
    """The workers of the next kernel call: torch's thread count, at most numba's. numba's own
    setting is per calling thread and is set (again) only when that count changed for this
    thread, and never at one worker: setting it starts the pool, and one worker runs the twins."""
    n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if n > 1 and getattr(_threads, "n", None) != n:
        numba.set_num_threads(n)
        _threads.n = n
    return n


# --------------------------------------------------------------------------- exp

# float32 exp that LLVM can vectorize (libm's expf is a scalar call; numba has no
# SVML here): Cody-Waite range reduction x = k ln2 + r, |r| <= ln2/2, a degree-7
# polynomial (Cephes expf), scaling by 2**k built from the exponent bits.
# Max error 1.003 ulp over the normal range (tested). Results below 2**-125.4 (x < -86.9), which
# libm returns as tiny normals or subnormals (< 1.9e-38), are flushed to 0; x > 88.72
# overflows to inf as in libm; NaN stays NaN. float64 uses math.exp.
# The clamps let NaN through (comparisons with NaN are false) and keep k in [-125, 128],
# so 2 * 2**(k-1) is one scaling for every k: no branch on the sign of k and no select for
# inf or NaN in the vector code (tests/kernels/test_cpu_simd.py checks it against float64 exp).
_F = np.float32
_LOG2E, _LN2_HI, _LN2_LO = _F(1.44269504088896341), _F(0.693359375), _F(-2.12194440e-4)
_P0, _P1, _P2 = _F(1.9875691500e-4), _F(1.3981999507e-3), _F(8.3334519073e-3)
_P3, _P4, _P5 = _F(4.1665795894e-2), _F(1.6666665459e-1), _F(5.0000001201e-1)
_EXP_LO, _EXP_HI = _F(-86.9), _F(89.0)
_ZERO, _HALF, _ONE = _F(0.0), _F(0.5), _F(1.0)


@intrinsic
def _pow2_f32(typingctx, k):
    """2**k as float32 for an integral float32 k in [-126, 127], from the exponent bits."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.shl(builder.add(builder.fptosi(args[0], i32), ir.Constant(i32, 127)),
                           ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())
    return sig, codegen


# Its own fastmath flags, stated: a callee without them inherits its caller's, and in the
# kernels' 'reassoc' LLVM rewrote (e_r + e_r) * 2**(k-1) as e_r * 2**k, which overflows to inf
# for 88.37 < x <= 88.72. 'contract' (fused multiply-adds) only; inlined by LLVM with these.
@njit(**dict(JIT_FLAGS, fastmath={"contract"}))
def fast_exp_f32(x):
    xc = _EXP_LO if x < _EXP_LO else x            # NaN passes both clamps
    xc = _EXP_HI if xc > _EXP_HI else xc
    k = np.floor(xc * _LOG2E + _HALF)             # in [-125, 128]
    r = (xc - k * _LN2_HI) - k * _LN2_LO
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    e_r = (p * r) * r + r + _ONE                  # exp(r)
    res = (e_r + e_r) * _pow2_f32(k - _ONE)       # 2**128 is no float32; inf past 88.72
    return _ZERO if x < _EXP_LO else res


def fast_exp(x):
    return math.exp(x)


@overload(fast_exp, **INLINE_FLAGS)
def _exp_overload(x):
    if x == types.float32:
        return lambda x: fast_exp_f32(x)
    return lambda x: math.exp(x)


# --------------------------------------------------------------------------- work queue

@intrinsic
def take_item(typingctx, counter):
    """Atomically counter[0] += 1, returning the old value: the next work item to take.
    counter is a 1-d int64 array. Only hands out work items: no result depends on it."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None
    sig = types.int64(counter)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", ary.data, ir.Constant(ir.IntType(64), 1), "monotonic")
    return sig, codegen


# --------------------------------------------------------------------------- softplus, sigmoid

# softplus(x) = max(x, 0) + log1p(w), w = exp(-|x|) in (0, 1], with
# log1p(w) = 2 atanh(s) = 2 (s + s^3/3 + ... + s^15/15), s = w / (2 + w) <= 1/3
# (truncation error < 2e-9 relative; < 3 ulp in all after float32 rounding, tested):
# vectorizable, unlike libm's log1pf, and computed inside the kernel so that the result
# does not depend on how torch would split an elementwise op over its threads. x > 20
# returns x (torch's threshold).
_TWO, _TWENTY = _F(2.0), _F(20.0)
_Q15, _Q13, _Q11, _Q9 = _F(1 / 15), _F(1 / 13), _F(1 / 11), _F(1 / 9)
_Q7, _Q5, _Q3 = _F(1 / 7), _F(1 / 5), _F(1 / 3)


@njit(**INLINE_FLAGS)
def fast_softplus_f32(x):
    w = fast_exp_f32(-abs(x))
    s = w / (_TWO + w)
    s2 = s * s
    p = ((((((_Q15 * s2 + _Q13) * s2 + _Q11) * s2 + _Q9) * s2 + _Q7) * s2 + _Q5) * s2
         + _Q3) * s2 + _ONE
    res = max(x, _ZERO) + (s + s) * p
    return x if (x > _TWENTY or x != x) else res


def fast_softplus(x):
    return x if x > 20 else math.log1p(math.exp(x))


@overload(fast_softplus, **INLINE_FLAGS)
def _softplus_overload(x):
    if x == types.float32:
        return lambda x: fast_softplus_f32(x)
    return lambda x: x if x > 20 else math.log1p(math.exp(x))


@njit(**INLINE_FLAGS)
def fast_sigmoid(x, one):
    # `one` is 1 in x's dtype: a bare literal would promote float32 arithmetic to float64
    return one / (one + fast_exp(-x))


# --------------------------------------------------------------------------- explicit vectors

# For loops LLVM's vectorizer serves badly, a kernel can emit its vector loop itself: an
# @intrinsic whose codegen builds the loop from `VectorIR`'s pieces on raw pointers (`addr`).
# Why: the vectorizer versions each inner loop behind runtime checks that the arrays it
# writes and reads do not overlap, paid every time the loop starts; where the inner loop is
# short (one row of d_state) and starts often, the checks and the per-row horizontal sums
# cost as much as the work (the SSD recurrence's backward, perf on the AVX-512 EPYC). An
# explicit loop has no checks, and may keep sums in vector registers across rows. Its
# sums are in a fixed order (a fixed tree for the horizontal ones): bit-identical reruns.
VECTOR_BITS = _vector_bits()


def vector_lanes(dtype) -> int:
    """Lanes of one explicit vector of `dtype` (float32: 16 with AVX-512, 8 with AVX2)."""
    return VECTOR_BITS // (8 * np.dtype(dtype).itemsize)


@intrinsic
def addr(typingctx, a, off):
    """A pointer to element `off` of `a`'s data (counted from its first element, in
    elements: for a C-contiguous array, its flat index)."""
    if not isinstance(a, types.Array) or not isinstance(off, types.Integer):
        return None
    sig = types.CPointer(a.dtype)(a, off)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.gep(ary.data, [_i64(builder, args[1])])
    return sig, codegen


_I32, _I64 = ir.IntType(32), ir.IntType(64)


def _i64(builder, v):
    return v if v.type.width == 64 else builder.sext(v, _I64)


class VectorIR:
    """Codegen helpers over one vector type: VECTOR_BITS of the scalar type `et` (an LLVM float
    or double). Offsets are in elements, loads and stores unaligned."""

    def __init__(self, builder, et):
        self.b = builder
        self.vt = ir.VectorType(et, VECTOR_BITS // (32 if isinstance(et, ir.FloatType) else 64))
        self.lanes = ir.Constant(_I64, self.vt.count)
        self.zero = ir.Constant(self.vt, [0.0] * self.vt.count)

    def i64(self, v):
        return _i64(self.b, v)

    def _at(self, ptr, off):
        return self.b.bitcast(self.b.gep(ptr, [off]), self.vt.as_pointer())

    def load(self, ptr, off):
        return self.b.load(self._at(ptr, off), align=4)

    def store(self, v, ptr, off):
        self.b.store(v, self._at(ptr, off), align=4)

    def scalar(self, ptr, i):
        return self.b.load(self.b.gep(ptr, [i]))

    def splat(self, x):
        v = self.b.insert_element(ir.Constant(self.vt, ir.Undefined), x, ir.Constant(_I32, 0))
        return self.b.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, self.vt.count), [0] * self.vt.count))

    def fma(self, a, b, c):
        """a * b + c, fused (llvm.fma on the vector type)."""
        name = "llvm.fma.v%d%s" % (self.vt.count, "f32" if isinstance(self.vt.element, ir.FloatType) else "f64")
        fn = self.b.module.globals.get(name) or ir.Function(self.b.module, ir.FunctionType(self.vt, [self.vt] * 3),
                                                            name)
        return self.b.call(fn, [a, b, c])

    def hsum(self, v):
        """The lanes' sum: halves added pairwise (a fixed tree)."""
        w = self.vt.count
        while w > 1:
            h = w // 2
            lo = self.b.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h))))
            hi = self.b.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h, w))))
            v, w = self.b.fadd(lo, hi), h
        return self.b.extract_element(v, ir.Constant(_I32, 0))

    def hsum4(self, v0, v1, v2, v3):
        """The lane sums of four vectors at once, as a 4-lane vector: halves of pairs added
        (lanes >= 4), 15 shuffles and adds at 16 lanes against 48 for four `hsum`s."""
        w = self.vt.count

        def pick(a, b, idx):
            return self.b.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, len(idx)), idx))

        h = w // 2                          # [v0 | v1] and [v2 | v3], half-sums of each
        u01 = self.b.fadd(pick(v0, v1, list(range(h)) + list(range(w, w + h))),
                          pick(v0, v1, list(range(h, w)) + list(range(w + h, 2 * w))))
        u23 = self.b.fadd(pick(v2, v3, list(range(h)) + list(range(w, w + h))),
                          pick(v2, v3, list(range(h, w)) + list(range(w + h, 2 * w))))
        q = h // 2                          # four segments of w / 4 lanes: [v0 | v1 | v2 | v3]
        lo = list(range(q)) + list(range(h, h + q))
        hi = list(range(q, h)) + list(range(h + q, w))
        r = self.b.fadd(pick(u01, u23, lo + [w + i for i in lo]), pick(u01, u23, hi + [w + i for i in hi]))
        seg = q
        while seg > 1:                      # fold every segment in half
            half = seg // 2
            lo = [k * seg + i for k in range(4) for i in range(half)]
            hi = [k * seg + half + i for k in range(4) for i in range(half)]
            r = self.b.fadd(pick(r, r, lo), pick(r, r, hi))
            seg = half
        return r

    def by_four(self, p, step, accs, out):
        """Runs step(rows) over rows 0..p-1 four at a time, then one at a time for the rest; step
        adds each row's terms to its vector variable in `accs` (4 of them, zeroed here), whose
        lane sums then go to out[row] (`hsum4` for a block of four)."""
        b, four = self.b, ir.Constant(p.type, 4)

        def run(rows):
            for acv in accs[:len(rows)]:
                b.store(self.zero, acv)
            step(rows)

        with cgutils.for_range(b, b.udiv(p, four)) as bl:
            rows = [b.add(b.mul(bl.index, four), ir.Constant(p.type, r)) for r in range(4)]
            run(rows)
            sums = self.hsum4(*(b.load(acv) for acv in accs))
            for r, i in enumerate(rows):
                b.store(b.extract_element(sums, ir.Constant(_I32, r)), b.gep(out, [i]))
        with cgutils.for_range(b, b.urem(p, four)) as il:
            i = b.add(b.mul(b.udiv(p, four), four), il.index)
            run([i])
            b.store(self.hsum(b.load(accs[0])), b.gep(out, [i]))

    def var(self, init=None):
        """A vector variable (an alloca LLVM keeps in a register)."""
        return cgutils.alloca_once_value(self.b, self.zero if init is None else init)
