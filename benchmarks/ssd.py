"""The SSD (Mamba-2) scan on CPU: sonata's cpu path against transformers' CPU path, the
readable chunked reference and sonata's Mamba-1 scan; and the decoding step.

    python benchmarks/ssd.py [--quick] [--threads 1] [--rounds 5] [--dtypes fp32 bf16]
                             [--no-models | --only-models] [--model-rounds 5] [--model-steps 2]

Table 1, per shape and precision (fp32, or bf16 = torch.autocast("cpu", torch.bfloat16) around
fp32 inputs), milliseconds per call (median over interleaved rounds; `f+b speed-up` is the
median of the per-round ratios transformers / sonata, each round's calls seconds apart):
  sonata        sonata.kernels.ssd.ssd(..., backend="cpu"): forward, and forward+backward;
                `form` names which of its two forms the rule picked (ssd.cpu.prefer_recurrent:
                the fused recurrence up to N = 128, the chunked form beyond)
  sonata chunked  the chunked form pinned (ssd_cpu(..., form="chunked")), f+b
  transformers  transformers' own torch path for Mamba-2, `mamba2_chunk_scan` of
                transformers.models.mamba2.modeling_mamba2 (the function behind Mamba2Mixer's
                chunked forward, called unwrapped so no hub kernel can stand in for it)
  chunked ref   sonata.kernels.ssd.reference.ssd_chunked_ref (the paper's form, for reading)
  mamba-1       sonata.kernels.selective_scan(..., backend="cpu") at the same d_inner x N
All SSD calls compute the same thing: dt_bias + softplus, the scan with groups 1, D per head;
`max diff` is sonata's largest relative difference from transformers' output. tok/s is
batch x L over sonata's forward+backward. Peak MiB: the resident-set growth during one
forward+backward (peak RSS reset through /proc/self/clear_refs before the call; the process
runs with MALLOC_MMAP_THRESHOLD_ fixed so freed tensors go back to the system).

Table 2, the decoding step at batch 1 (microseconds per step, median of 200): sonata's fused
ssd_step, its torch-ops reference ssd_step_ref, and transformers' torch
`mamba2_selective_state_update` (Mamba2Mixer's decoding path) on the same state.

Table 3, the model (--models; off with --no-models): training tokens/s of sonata's LM
(`sonata.model.lm.MambaLM`, backend cpu) with Mamba-1 blocks at N=16 (model.arch=mamba, the
default) against Mamba-2 blocks (model.arch=mamba2, headdim 32, chunk 64) at N = 16, 64,
128, and at N = 64 with mamba_ssm's headdim 64, same d_model and depth: the seed size (d_model 96, 2 layers, batch 16 x L 128) and a
larger one (d_model 256, 2 layers, batch 4 x L 512), vocabulary 512, fp32 and bf16 (autocast
around the forward; `precision=fast` is bf16 only where the CPU multiplies bf16 natively,
fp32 here otherwise). A step is forward, sonata's cross-entropy on float32 logits, backward
and fused AdamW (`sonata.lab.speed.race_step`'s step, the trainer's steady CPU heap). The
models take turns in interleaved rounds (order rotated), `x Mamba-1` is the median of the
per-round ratios, so the host's drift cancels.

One run, one host: compare rows with each other, not with other runs. On a host shared with
other work, use --threads 1: with 2 OpenMP threads on 2 busy cores every torch op waits at a
barrier for a descheduled thread, and the figures measure the neighbours.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time

if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and __name__ == "__main__":
    # big allocations from mmap, returned on free: peak-RSS deltas then belong to one call
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import print_table

from sonata.kernels import selective_scan
from sonata.kernels.ssd import ssd, ssd_step, ssd_step_ref
from sonata.kernels.ssd.cpu import prefer_recurrent, ssd_cpu
from sonata.kernels.ssd.reference import ssd_chunked_ref

# name, batch, L, d_inner (= 2 d_model), headdim, N, chunk
SHAPES = [
    ("d96 p16 N16 Q64", 4, 512, 192, 16, 16, 64),
    ("d96 p16 N16 Q256", 4, 512, 192, 16, 16, 256),
    ("d256 p64 N64 Q64", 4, 512, 512, 64, 64, 64),
    ("d256 p64 N128 Q256", 4, 512, 512, 64, 128, 256),
    ("d128 p32 N64 Q64", 16, 128, 256, 32, 64, 64),
    ("d256 p64 N128 Q256", 16, 128, 512, 64, 128, 256),
    ("mamba2-130m layer", 1, 512, 1536, 64, 128, 256),
    ("mamba2-130m layer", 1, 2048, 1536, 64, 128, 256),
]
QUICK = [0, 2, 6]
IMPLS = ("sonata", "sonata chunked", "transformers", "chunked ref", "mamba-1")


def cpu_line() -> str:
    from sonata.lab.bench import hardware_name
    return (f"cpu: {hardware_name(torch.device('cpu'))} ({os.cpu_count()} cores); "
            f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}); "
            f"python {platform.python_version()}")


def _transformers_scan():
    from transformers.models.mamba2 import modeling_mamba2 as m2
    return (getattr(m2.mamba2_chunk_scan, "__wrapped__", m2.mamba2_chunk_scan),
            getattr(m2.mamba2_selective_state_update, "__wrapped__", m2.mamba2_selective_state_update))


def make_inputs(b, L, di, p, n, seed=0):
    """Mamba-2's initialization: A = -exp(U[log 1, log 16]), dt_bias = softplus^-1 of
    dt in [1e-3, 0.1] log-uniform, D = 1; x, B, C, dt standard normal (dt scaled by 0.5)."""
    g = torch.Generator().manual_seed(seed)
    h = di // p
    dt0 = torch.exp(torch.rand(h, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    ssm = dict(x=torch.randn(b, L, h, p, generator=g), dt=torch.randn(b, L, h, generator=g) * 0.5,
               A=-torch.exp(torch.rand(h, generator=g) * math.log(16)),
               B=torch.randn(b, L, 1, n, generator=g), C=torch.randn(b, L, 1, n, generator=g),
               D=torch.ones(h), dt_bias=dt0 + torch.log(-torch.expm1(-dt0)))
    m1 = dict(u=torch.randn(b, di, L, generator=g), delta=torch.randn(b, di, L, generator=g) * 0.5,
              A=-torch.arange(1, n + 1.0).repeat(di, 1), B=torch.randn(b, n, L, generator=g),
              C=torch.randn(b, n, L, generator=g), D=torch.ones(di), delta_bias=torch.full((di,), -3.0))
    return ssm, m1


def callers(chunk):
    tf_scan, _ = _transformers_scan()
    kw = lambda t: dict(D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True)
    return {
        "sonata": lambda t: ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk, backend="cpu", **kw(t)),
        "sonata chunked": lambda t: ssd_cpu(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk, form="chunked",
                                            **kw(t)),
        "transformers": lambda t: tf_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk, **kw(t)),
        "chunked ref": lambda t: ssd_chunked_ref(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk, **kw(t)),
        "mamba-1": lambda t: selective_scan(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"],
                                            delta_bias=t["delta_bias"], delta_softplus=True, backend="cpu"),
    }


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":"))


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def one_call(fn, inp, backward: bool, dtype: str):
    leaves = {k: v.clone().requires_grad_(backward) for k, v in inp.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"), \
            torch.set_grad_enabled(backward):
        start = time.perf_counter()
        out = fn(leaves)
        if backward:
            out.float().backward(torch.ones(out.shape))
        elapsed = time.perf_counter() - start
    return elapsed, out.detach()


def peak_mib(fn, inp, dtype):
    leaves = {k: v.clone() for k, v in inp.items()}
    if not _reset_peak():
        return "n/a"
    base = _rss("VmRSS")
    one_call(fn, leaves, True, dtype)
    return f"{(_rss('VmHWM') - base) / 2**20:.0f}"


def bench_shape(shape, dtype, rounds, budget_s):
    name, b, L, di, p, n, chunk = shape
    ssm, m1 = make_inputs(b, L, di, p, n)
    fns = callers(chunk)
    inputs = {k: (m1 if k == "mamba-1" else ssm) for k in fns}
    times = {(k, bw): [] for k in fns for bw in (False, True)}
    outs, want = {}, {}
    for k, fn in fns.items():                                   # warm-up, and the round budget
        t0, outs[k] = one_call(fn, inputs[k], True, dtype)
        want[k] = max(1, min(rounds, int(budget_s / max(t0, 1e-9))))
    for r in range(rounds):                                     # interleaved, order rotated
        order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
        for k in order:
            if r < want[k]:
                for bw in (False, True):
                    times[k, bw].append(one_call(fns[k], inputs[k], bw, dtype)[0])
    ms = {key: 1e3 * statistics.median(v) for key, v in times.items()}
    mem = {k: peak_mib(fns[k], inputs[k], dtype) for k in ("sonata", "transformers")}
    ref = outs["transformers"].double()
    diff = ((outs["sonata"].double() - ref).norm() / ref.norm()).item()
    fb = ms["sonata", True]
    speedup = statistics.median(t / s for t, s in zip(times["transformers", True], times["sonata", True]))
    form = "recurrent" if prefer_recurrent(ssm["x"], ssm["B"]) else "chunked"
    return [f"{name}, {b}x{L}", dtype, form, f"{ms['sonata', False]:.1f}", f"{fb:.1f}", f"{b * L / fb * 1e3:,.0f}",
            f"{ms['sonata chunked', True]:.1f}",
            f"{ms['transformers', False]:.1f}", f"{ms['transformers', True]:.1f}",
            f"{speedup:.1f}x", f"{ms['chunked ref', True]:.1f}", f"{ms['mamba-1', True]:.1f}",
            f"{mem['sonata']} / {mem['transformers']}", f"{diff:.1e}"]


def bench_step(h, p, n, steps=200):
    _, tf_step = _transformers_scan()
    g = torch.Generator().manual_seed(0)
    state = torch.randn(1, h, p, n, generator=g)
    x, z = torch.randn(1, h, p, generator=g), None
    dt, A = torch.randn(1, h, generator=g), -torch.rand(h, generator=g) * 4
    B, C, D, bias = (torch.randn(1, 1, n, generator=g), torch.randn(1, 1, n, generator=g), torch.ones(h),
                     torch.randn(h, generator=g))
    calls = {
        "sonata ssd_step": lambda s: ssd_step(s, x, dt, A, B, C, D, z, bias, True),
        "ssd_step_ref": lambda s: ssd_step_ref(s, x, dt, A, B, C, D, z, bias, True),
        "transformers": lambda s: tf_step(s, x, dt[..., None].expand(1, h, p), A[:, None, None].expand(h, p, n),
                                          B, C, D[:, None].expand(h, p), dt_bias=bias[:, None].expand(h, p),
                                          dt_softplus=True),
    }
    out = {}
    with torch.no_grad():
        ys = {k: f(state.clone()) for k, f in calls.items()}
        for k, f in calls.items():
            s = state.clone()
            ts = []
            for _ in range(steps):
                t0 = time.perf_counter()
                f(s)
                ts.append(time.perf_counter() - t0)
            out[k] = f"{1e6 * statistics.median(ts):.0f}"
    diff = ((ys["sonata ssd_step"] - ys["transformers"]).norm() / ys["transformers"].norm()).item()
    return [f"h{h} p{p} N{n}", *out.values(), f"{diff:.1e}"]


# name, d_model, batch, L
MODEL_SIZES = [("seed", 96, 16, 128), ("d256", 256, 4, 512)]
# label, arch, N, headdim (Mamba-2; 32 is sonata's default, 64 mamba_ssm's)
MODEL_ROWS = [("mamba N16", "mamba", 16, 0), ("mamba2 N16", "mamba2", 16, 32), ("mamba2 N64", "mamba2", 64, 32),
              ("mamba2 N64 headdim 64", "mamba2", 64, 64), ("mamba2 N128", "mamba2", 128, 32)]


def model_step(arch, n, d_model, batch, L, dtype, vocab=512, seed=0, headdim=32):
    """-> step(): one training step of sonata's LM (2 layers of `arch` at d_state n, backend
    cpu; Mamba-2 heads of `headdim`) on a fixed random batch: forward under bf16 autocast for
    dtype bf16, sonata's loss on float32 logits, backward, fused AdamW."""
    from sonata.core.config import ModelConfig
    from sonata.kernels import cross_entropy
    from sonata.model.lm import MambaLM
    torch.manual_seed(seed)
    extra = {"headdim": headdim} if arch == "mamba2" else {}
    model = MambaLM(ModelConfig(arch=arch, d_model=d_model, n_layers=2, d_state=n, vocab_size=vocab,
                                backend="cpu", **extra))
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, vocab, (2, batch, L), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(x)
        cross_entropy(logits.float(), y, "cpu").backward()
        opt.step()
    return step


def bench_models(size, dtype, rounds, steps, warmup=2):
    """Rows of table 3 for one size and precision: tokens/s (median round) and the median of
    the per-round ratios to Mamba-1 N=16."""
    name, d, batch, L = size
    fns = {row[0]: model_step(row[1], row[2], d, batch, L, dtype, headdim=row[3]) for row in MODEL_ROWS}
    for f in fns.values():
        for _ in range(warmup):
            f()
    tps = {k: [] for k in fns}
    keys = list(fns)
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            t0 = time.perf_counter()
            for _ in range(steps):
                fns[k]()
            tps[k].append(steps * batch * L / (time.perf_counter() - t0))
    base = tps[MODEL_ROWS[0][0]]
    return [[f"{name}: d_model {d}, 2 layers, {batch}x{L}", dtype, k, f"{statistics.median(v):,.0f}",
             f"{statistics.median(a / b for a, b in zip(v, base)):.2f}x", f"{min(v):,.0f}-{max(v):,.0f}"]
            for k, v in tps.items()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three shapes, fp32, plus bf16 at the first")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=12.0, help="most seconds of rounds per implementation")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--no-models", action="store_true", help="skip table 3 (the models' training speed)")
    ap.add_argument("--model-rounds", type=int, default=5)
    ap.add_argument("--model-steps", type=int, default=2, help="steps per model per round")
    ap.add_argument("--only-models", action="store_true", help="table 3 alone")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(cpu_line())
    if args.quick:
        plan = [(SHAPES[i], "fp32") for i in QUICK] + [(SHAPES[QUICK[0]], "bf16")]
    else:
        plan = [(s, d) for d in args.dtypes for s in SHAPES]
    if args.only_models:
        plan = []
    rows = []
    for shape, dtype in plan:
        rows.append(bench_shape(shape, dtype, args.rounds, args.budget_s))
        print("  done:", rows[-1][0], dtype, file=sys.stderr, flush=True)
    if plan:
        print_table(["shape, batch x L", "dtype", "form", "sonata fwd ms", "sonata f+b ms", "sonata f+b tok/s",
                     "sonata chunked f+b ms",
                     "transformers fwd ms", "transformers f+b ms", "f+b speed-up", "chunked ref f+b ms",
                     "mamba-1 f+b ms", "peak MiB sonata / transformers", "max diff"], rows,
                    title=f"SSD scan, median of up to {args.rounds} interleaved rounds after a warm-up; "
                          f"speed-up: median of the per-round ratios transformers / sonata (f+b)")
        steps = [bench_step(12, 16, 16), bench_step(24, 64, 128)]
        print_table(["decode step, batch 1", "sonata ssd_step us", "ssd_step_ref us", "transformers us",
                     "max diff"], steps,
                    title="SSD decoding step (state updated in place), median of 200 steps")
    if args.no_models:
        return
    from sonata.train.memory import steady_cpu_heap
    steady_cpu_heap()                       # the trainer's heap: no page faults from step to step
    mrows = []
    sizes = MODEL_SIZES[:1] if args.quick else MODEL_SIZES
    for size in sizes:
        for dtype in (["fp32"] if args.quick else args.dtypes):
            mrows += bench_models(size, dtype, args.model_rounds, args.model_steps)
            print("  done: models", size[0], dtype, file=sys.stderr, flush=True)
    print_table(["size", "dtype", "model (backend cpu)", "train tokens/s", "x Mamba-1 N16", "tokens/s range"],
                mrows, title=f"training speed of sonata's LM, Mamba-1 against Mamba-2 (headdim 32 unless "
                             f"named, chunk 64), {args.model_rounds} interleaved rounds x {args.model_steps} "
                             f"steps after a warm-up")


if __name__ == "__main__":
    main()
