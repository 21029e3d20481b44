"""sonata.interop.mamba_ssm and sonata.interop.hf.accelerate, side by side with what a CPU user has without them.

    python benchmarks/ops.py [--threads 2] [--repeat 3] [--quick]

Table 1, the ops (forward + backward unless marked), at one layer of the seed model
(batch 8, d_inner 192, d_state 16, length 128) and at mamba-130m's width (batch 1,
d_inner 1536, length 512):
  sonata.interop.mamba_ssm         the op as a program written against mamba_ssm calls it
  mamba_ssm ref      the same call on the reference semantics (`sonata.interop.mamba_ssm.*_ref`: the
                     sequential loop of mamba_ssm's selective_scan_ref, written here)
  mambapy            mambapy's parallel scan (pscan) where it applies (per-batch B and C)
Each row gives the largest difference of sonata's output from the reference's.

Table 2, transformers' MambaForCausalLM with and without `sonata.interop.hf.accelerate` (the same
weights, loaded twice): a training step (forward, backward, Adam) in tokens/s, and greedy
generation (batch 1, 16-token prompt, 128 new tokens) in new tokens/s, at the seed size
(d_model 96, 2 layers, vocabulary 512) and at d_model 768 with 4 layers (mamba-130m's width)
with the seed's vocabulary and with mamba-130m's 50,280 (whose head, the same work with or
without sonata, then costs more than the 4 layers). Also: the largest logit difference, and
whether the greedy ids are equal.

Medians of --repeat timed runs after a warm-up; all rows in one run on one machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

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


# --------------------------------------------------------------------------- transformers

def _hf_pair(d_model, n_layers, vocab, seed=0):
    import transformers
    from sonata.interop.hf_accelerate import accelerate
    torch.manual_seed(seed)
    conf = transformers.MambaConfig(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=n_layers,
                                    state_size=16, expand=2, conv_kernel=4, eos_token_id=None,
                                    pad_token_id=None, bos_token_id=None)
    tmp = tempfile.mkdtemp(prefix="sonata_ops_bench_")
    transformers.MambaForCausalLM(conf).save_pretrained(tmp)
    load = lambda: transformers.MambaForCausalLM.from_pretrained(tmp)  # noqa: E731
    return load(), accelerate(load())


def hf_rows(repeat, quick):
    shapes = [("seed (96 x 2, vocab 512)", 96, 2, 512, 8, 128),
              ("768 x 4, vocab 512", 768, 4, 512, 2, 128),
              ("768 x 4, vocab 50,280", 768, 4, 50280, 2, 128)]
    rows, ratios = [], []
    for name, d, nl, vocab, batch, L in shapes[:1] if quick else shapes:
        plain, fast = _hf_pair(d, nl, vocab)
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, vocab, (batch, L), generator=g)
        with torch.no_grad():
            dlogit = (plain.eval()(idx[:2], use_cache=False).logits
                      - fast.eval()(idx[:2], use_cache=False).logits).abs().max().item()
        train = {}
        for which, m in (("plain", plain), ("accelerated", fast)):
            m.train()
            opt = torch.optim.Adam(m.parameters(), lr=1e-4)

            def step():
                loss = m(idx, labels=idx).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            train[which] = batch * L / median_time(step, warmup=1, repeat=repeat)
            m.eval()
        new, prompt = (128 if not quick else 32), torch.randint(0, vocab, (1, 16), generator=g)
        gen, ids = {}, {}
        for which, m in (("plain", plain), ("accelerated", fast)):
            with torch.no_grad():
                ids[which] = m.generate(prompt, max_new_tokens=new, do_sample=False)
                gen[which] = new / median_time(lambda: m.generate(prompt, max_new_tokens=new, do_sample=False),
                                               warmup=0, repeat=repeat)
        same = "yes" if torch.equal(ids["plain"], ids["accelerated"]) else "NO"
        for which in ("plain", "accelerated"):
            rows.append([name, which, f"{train[which]:,.0f}", f"{gen[which]:,.0f}"])
        ratios.append([name, f"{train['accelerated'] / train['plain']:.1f}x",
                       f"{gen['accelerated'] / gen['plain']:.1f}x", f"{dlogit:.1e}", same])
    return rows, ratios


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the seed sizes only, fewer tokens (a smoke run)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    print(hardware_line("cpu"))
    print(f"{args.threads} threads; median of {args.repeat} after a warm-up")
    print_table(["size", "op", "sonata.interop.mamba_ssm ms", "mamba_ssm ref ms", "mambapy ms", "vs ref", "vs mambapy",
                 "max |diff|"], op_rows(args.repeat, args.quick),
                title="mamba_ssm's ops on CPU (forward + backward unless marked)")
    rows, ratios = hf_rows(args.repeat, args.quick)
    print_table(["model", "transformers", "train tok/s", "generate new tok/s"], rows,
                title="transformers' MambaForCausalLM, with and without sonata.interop.hf.accelerate")
    print_table(["model", "train speed-up", "generate speed-up", "max |logit diff|", "same greedy ids"], ratios,
                title="speed-ups measured in this run")


if __name__ == "__main__":
    main()
