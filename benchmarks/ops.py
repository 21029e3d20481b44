"""sonata.interop.mamba_ssm and sonata.interop.hf_accelerate, side by side with what a CPU user has without them.

    python benchmarks/ops.py [--threads 2] [--clock wall|cpu] [--repeat 2] [--ops-big] [--no-ops] [--sizes seed,m2-130m]
        [--lengths 512,2048] [--families Mamba,Mamba2,Bamba] [--layers 2]  (see --help)

Table 1, the ops (forward + backward unless marked), at one layer of the seed model
(batch 8, d_inner 192, d_state 16, length 128) and, with --ops-big, at mamba-130m's width
(batch 1, d_inner 1536, length 512):
  sonata.interop.mamba_ssm         the op as a program written against mamba_ssm calls it
  mamba_ssm ref      the same call on the reference semantics (`sonata.interop.mamba_ssm.*_ref`: the
                     sequential loop of mamba_ssm's selective_scan_ref, written here)
  mambapy            mambapy's parallel scan (pscan) where it applies (per-batch B and C)
Each row gives the largest difference of sonata's output from the reference's.

Table 2, transformers' model families with and without sonata, in two worker processes fed
the same jobs in turn (which goes first alternates): "transformers" is transformers' own CPU
path; "with sonata" calls `sonata.interop.mamba_ssm.install()` before importing transformers
(every family's mamba_ssm / causal_conv1d ops resolve to sonata's) and `accelerate()`s the
models it applies to (Mamba, Mamba2: fused mixers, sonata's decoding loop with transformers'
logits processors; Bamba, GraniteMoeHybrid: that loop with `hf_hybrid.HybridDecoder`). Per family (Mamba, Mamba2, Bamba; GraniteMoeHybrid with --families) and
size (seed: 96 wide, batch 8 x 128; m2-130m: 768 wide, Mamba-2 24 heads of 64, N 128, batch
1 x L for L in --lengths, Mamba-1 at --mamba1-lengths): a training step (forward, backward,
Adam) and a prompt pass (forward with a cache, no grad) in tokens/s, generation (batch 1,
16-token prompt; greedy, top-p 0.9 at temperature 0.8, repetition penalty 1.2) in new
tokens/s, the peak resident memory of each process during the job (VmHWM after resetting
it through /proc/self/clear_refs; in brackets, how far it rose above the process's resident
set at the job's start), and whether the greedy ids are equal. Same weights (saved once,
loaded by both), --layers layers (hybrids: the last one attention), vocabulary --vocab.

Medians of --repeat timed runs after a warm-up; all rows in one run on one machine. Table 2
times each job by the wall clock or, with --clock cpu, by its worker's CPU time (every thread of
the process, so an OpenMP pool spinning beside the job counts; time spent waiting for a core
on a shared machine does not).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import hardware_line, print_table  # noqa: E402

from sonata.interop import mamba_ssm as ops  # noqa: E402
from sonata.lab.timing import median_time  # noqa: E402

SCAN_SIZES = {"seed layer": (8, 192, 16, 128), "mamba-130m layer": (1, 1536, 16, 512)}


def _scan_inputs(b, d, n, L, groups=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    bc = (b, groups, n, L) if groups else (b, n, L)
    return dict(u=r(b, d, L), delta=r(b, d, L) * 0.5 - 1.0, A=-torch.arange(1, n + 1.0).repeat(d, 1),
                B=r(*bc), C=r(*bc), D=torch.ones(d), z=r(b, d, L), delta_bias=torch.rand(d, generator=g) - 3.0)


def _timed(fn, inp, backward, repeat):
    leaves = {k: v if v is None else v.clone().requires_grad_(backward) for k, v in inp.items()}

    def call():
        out = fn(**leaves)
        if backward:
            out.backward(torch.ones_like(out))
            for v in leaves.values():
                if v is not None:
                    v.grad = None
        return out
    with torch.set_grad_enabled(backward):
        return median_time(call, warmup=1, repeat=repeat)


def _scan(impl):
    return lambda **t: impl(**t, delta_softplus=True)


def _mambapy(**t):
    from sonata.lab.peers import mambapy_scan
    return mambapy_scan(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"], t["delta_bias"])


def _inner_inputs(b, d_model, L, n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    di, r = 2 * d_model, -(-d_model // 16)
    w = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    return dict(xz=w(b, 2 * di, L), conv1d_weight=w(di, 1, 4, scale=0.5), conv1d_bias=w(di, scale=0.1),
                x_proj_weight=w(r + 2 * n, di, scale=di ** -0.5), delta_proj_weight=w(di, r, scale=r ** -0.5),
                out_proj_weight=w(d_model, di, scale=di ** -0.5), out_proj_bias=None,
                A=-torch.arange(1, n + 1.0).repeat(di, 1), D=torch.ones(di), delta_bias=torch.rand(di, generator=g) - 3.0)


def op_rows(repeat, quick):
    rows = []
    for size, (b, d, n, L) in SCAN_SIZES.items():
        if quick and size != "seed layer":
            continue
        cases = [("selective_scan_fn", 0, True), ("selective_scan_fn (forward)", 0, False),
                 ("selective_scan_fn, grouped B/C (G=4)", 4, True)]
        for name, groups, backward in cases:
            inp = _scan_inputs(b, d, n, L, groups)
            with torch.no_grad():
                err = (_scan(ops.selective_scan_fn)(**inp) - _scan(ops.selective_scan_ref)(**inp)).abs().max()
            ours = _timed(_scan(ops.selective_scan_fn), inp, backward, repeat)
            ref = _timed(_scan(ops.selective_scan_ref), inp, backward, repeat)
            peer = _timed(_mambapy, inp, backward, repeat) if not groups and _has_mambapy() else None
            rows.append(_op_row(size, name, ours, ref, peer, err))
        inp = _inner_inputs(b, d // 2, L)
        with torch.no_grad():
            err = (ops.mamba_inner_fn(**inp) - ops.mamba_inner_ref(**inp)).abs().max()
        rows.append(_op_row(size, "mamba_inner_fn", _timed(ops.mamba_inner_fn, inp, True, repeat),
                            _timed(ops.mamba_inner_ref, inp, True, repeat), None, err))
    return rows


def _op_row(size, name, ours, ref, peer, err):
    return [size, name, f"{ours * 1e3:.2f}", f"{ref * 1e3:.1f}", "-" if peer is None else f"{peer * 1e3:.1f}",
            f"{ref / ours:.1f}x", "-" if peer is None else f"{peer / ours:.1f}x", f"{float(err):.1e}"]


def _has_mambapy():
    try:
        from sonata.lab.peers import import_mambapy
        import_mambapy()
        return True
    except ImportError:
        return False


# --------------------------------------------------------------------------- transformers' families

def _family_config(family, size, layers, vocab):
    """(config class, model class, kwargs): seed (96 wide; Mamba-2 heads 6 x 32, N 16, chunk 64) or
    m2-130m (768 wide; Mamba-2 heads 24 x 64, N 128, chunk 256; Mamba-1 N 16), `layers` layers
    (the hybrid: the last one attention), tied heads, no special tokens (every run its full length)."""
    big = size == "m2-130m"
    d = 768 if big else 96
    heads, hd, n, chunk = (24, 64, 128, 256) if big else (6, 32, 16, 64)
    base = dict(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, tie_word_embeddings=True,
                eos_token_id=None, pad_token_id=None, bos_token_id=None)
    if family == "Mamba":
        return "MambaConfig", "MambaForCausalLM", dict(base, state_size=16, expand=2)
    if family == "Mamba2":
        return "Mamba2Config", "Mamba2ForCausalLM", dict(base, num_heads=heads, head_dim=hd, state_size=n, n_groups=1,
                                                          expand=2, chunk_size=chunk)
    ssm = dict(mamba_n_heads=heads, mamba_d_head=hd, mamba_d_state=n, mamba_n_groups=1, mamba_expand=2,
               mamba_chunk_size=chunk)
    attn = dict(num_attention_heads=12 if big else 4, num_key_value_heads=4 if big else 2, intermediate_size=2 * d)
    if family == "Bamba":
        return "BambaConfig", "BambaForCausalLM", dict(base, attn_layer_indices=[layers - 1], **attn, **ssm)
    if family == "GraniteMoeHybrid":       # Granite 4.0-H's layout: Mamba-2 layers, an attention layer, MoE MLPs
        return "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
            base, layer_types=["mamba"] * (layers - 1) + ["attention"], num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=2 * d, **attn, **ssm)
    raise SystemExit(f"unknown family {family!r} (Mamba, Mamba2, Bamba, GraniteMoeHybrid)")


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
GEN = {"greedy": dict(do_sample=False), "top-p 0.9, T 0.8": dict(do_sample=True, top_p=0.9, temperature=0.8),
       "rep. penalty 1.2": dict(do_sample=False, repetition_penalty=1.2)}


def _rss_mb(field):
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(field)) / 1024


def _worker(conn, use_sonata, threads, clock):
    """One process, with or without sonata: the shim installed before transformers is imported
    (so every family's Mamba-2 / Mamba-1 ops resolve to sonata's), and `accelerate` on the models
    it applies to (Mamba, Mamba2; generation of Bamba, GraniteMoeHybrid). Runs the jobs sent to it, one at a time."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(threads)
    if use_sonata:
        ops.install()
    import transformers
    held = {}
    while (job := conn.recv()) is not None:
        folder, cls, task, shape = job
        if folder not in held:
            held.clear()
            model = getattr(transformers, cls).from_pretrained(folder)
            if use_sonata:
                from sonata.core.errors import SonataError
                from sonata.interop.hf_accelerate import accelerate
                try:
                    accelerate(model)
                except SonataError:            # a model accelerate does not take: the shim's ops alone
                    pass
            held[folder] = (model, torch.optim.Adam(model.parameters(), lr=1e-5))
        model, opt = held[folder]
        with open("/proc/self/clear_refs", "w") as f:    # the peak resident set, from here
            f.write("5")
        before = _rss_mb("VmRSS")
        ids = torch.randint(0, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(1))
        t0 = clock()
        out = None
        if task == "train":
            model.train()
            loss = model(ids, labels=ids, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        elif task == "prompt":
            model.eval()
            with torch.no_grad():
                model(ids, use_cache=True)
        else:
            model.eval()
            torch.manual_seed(0)
            new = task.split(":")[2]
            out = model.generate(ids, max_new_tokens=int(new), **GEN[task.split(":")[1]])
        conn.send((clock() - t0, _rss_mb("VmHWM"), before, out))


def family_rows(args):
    """Per family, size and task, the same job in the two worker processes, alternating which
    goes first; medians of --repeat after one warm-up; the peak resident memory of each."""
    import multiprocessing as mp

    import transformers
    ctx = mp.get_context("spawn")
    workers = {}
    for name, flag in (("transformers", False), ("sonata", True)):
        a, b = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(b, flag, args.threads, CLOCKS[args.clock]), daemon=True)
        proc.start()
        workers[name] = (a, proc)
    tmp = tempfile.mkdtemp(prefix="sonata_ops_bench_")
    rows = []
    try:
        for size in args.sizes.split(","):
            for family in args.families.split(","):
                cfg_cls, cls, kw = _family_config(family, size, args.layers, args.vocab)
                folder = f"{tmp}/{family}-{size}"
                torch.manual_seed(0)
                getattr(transformers, cls)(getattr(transformers, cfg_cls)(**kw)).save_pretrained(folder)
                big = size == "m2-130m"
                spec = args.mamba1_lengths if family == "Mamba" else args.lengths
                lengths = [int(v) for v in spec.split(",")] if big else [128]
                batch = 1 if big else 8
                jobs = [("train tok/s", "train", (batch, L), L) for L in lengths]
                jobs += [("prompt tok/s", "prompt", (batch, L), L) for L in lengths]
                new = args.new_big if big else args.new_seed
                jobs += [(f"gen {g} tok/s", f"gen:{g}:{new}", (1, 16), 16) for g in GEN]
                for label, task, shape, L in jobs:
                    res = {w: [] for w in workers}
                    for r in range(1 + args.repeat):
                        for w in (("transformers", "sonata") if r % 2 == 0 else ("sonata", "transformers")):
                            workers[w][0].send((folder, cls, task, shape))
                            res[w].append(workers[w][0].recv())
                    n_tok = new * shape[0] if task.startswith("gen") else shape[0] * shape[1]
                    rate = {w: n_tok / statistics.median(t for t, *_ in v[1:]) for w, v in res.items()}
                    peak = {w: max(p for _, p, _, _ in v) for w, v in res.items()}
                    grow = {w: max(p - b for _, p, b, _ in v) for w, v in res.items()}
                    same = ""
                    if task.startswith("gen:greedy"):
                        same = "yes" if torch.equal(res["sonata"][0][3], res["transformers"][0][3]) else "NO"
                    rows.append([family, size, L if not task.startswith("gen") else f"16+{new}", label,
                                 f"{rate['transformers']:,.0f}", f"{rate['sonata']:,.0f}",
                                 f"{rate['sonata'] / rate['transformers']:.1f}x",
                                 f"{peak['transformers']:,.0f} (+{grow['transformers']:,.0f})",
                                 f"{peak['sonata']:,.0f} (+{grow['sonata']:,.0f})", same])
                    print(" | ".join(str(c) for c in rows[-1]), file=sys.stderr, flush=True)
    finally:
        for conn, proc in workers.values():
            conn.send(None)
            proc.join(timeout=30)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="time each job by the wall clock, or by "
                    "the CPU time of its process (all its threads; steadier on a shared machine, where waiting "
                    "for a core is not the job's cost)")
    ap.add_argument("--repeat", type=int, default=2, help="timed runs per job after one warm-up (median)")
    ap.add_argument("--ops-big", action="store_true", help="table 1 also at mamba-130m's layer (its reference's "
                    "backward is a Python loop: minutes)")
    ap.add_argument("--no-ops", action="store_true", help="skip table 1 (the ops)")
    ap.add_argument("--families", default="Mamba,Mamba2,Bamba", help="also GraniteMoeHybrid")
    ap.add_argument("--sizes", default="seed,m2-130m", help="seed, m2-130m or both")
    ap.add_argument("--lengths", default="512,2048", help="sequence lengths at m2-130m (seed: 8 x 128)")
    ap.add_argument("--mamba1-lengths", default="512", help="the same for Mamba (transformers' CPU path is a "
                    "Python loop over the sequence: 2048 costs minutes)")
    ap.add_argument("--layers", type=int, default=2, help="layers of every model (hybrids: the last attention)")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--new-seed", type=int, default=128, help="new tokens per generate call at the seed size")
    ap.add_argument("--new-big", type=int, default=32, help="new tokens per generate call at m2-130m")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    print(hardware_line("cpu"))
    print(f"{args.threads} threads; {args.clock} clock; median of {args.repeat} after a warm-up; OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', '(unset)')}, NUMBA_THREADING_LAYER="
          f"{os.environ.get('NUMBA_THREADING_LAYER', '(unset)')} (both workers inherit them)")
    if not args.no_ops:
        print_table(["size", "op", "sonata.interop.mamba_ssm ms", "mamba_ssm ref ms", "mambapy ms", "vs ref",
                     "vs mambapy", "max |diff|"], op_rows(args.repeat, not args.ops_big),
                    title="mamba_ssm's ops on CPU (forward + backward unless marked)")
    rows = family_rows(args)
    print_table(["family", "size", "L", "measure", "transformers", "with sonata", "ratio", "peak MB transformers",
                 "peak MB sonata", "same greedy ids"], rows,
                title=f"transformers' families with and without sonata ({args.layers} layers, vocabulary "
                      f"{args.vocab}; peak resident MB of each process during the job, (+ over its start))")
    print(f"\nwhole run {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
