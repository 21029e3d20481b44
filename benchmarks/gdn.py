"""The gated delta rule (Gated DeltaNet) on CPU: sonata's forms side by side, against
transformers' torch path for Qwen3-Next.

    python benchmarks/gdn.py [--quick] [--threads 1] [--rounds 5]

Table 1, the rule, per shape, float32: milliseconds per call (median over interleaved rounds)
for the forward and the forward+backward, and tokens/s (batch x L over the forward+backward):
  recurrent ref   sonata.kernels.gdn.gdn_recurrent_ref, the torch loop over tokens (the oracle)
  chunked ref     sonata.kernels.gdn.gdn_chunked_ref, the WY form in torch (backend reference)
  transformers    transformers' torch_chunk_gated_delta_rule (Qwen3-Next's own CPU path,
                  unwrapped so no hub kernel stands in), its l2-norm off (q, k come normalised)
  fused cpu       sonata.kernels.gdn.gated_delta_rule(backend="cpu"): the numba kernels
Table 2, the one-token step at batch 1, microseconds (median of 300): sonata's fused
gated_delta_rule_step, its torch reference gdn_step_ref, transformers'
torch_recurrent_gated_delta_rule on one token.
Table 3, a tiny random Qwen3NextForCausalLM (hidden 256, 4 layers: 3 linear attention, 1 full
attention; 8 value heads of 64, 4 key heads of 64; dense MLPs, no experts): a prefill of 256 tokens (ms) and the
cached decoding of 32 tokens after it (ms per token), batch 1, transformers' own torch path
against the same model after `sonata.interop.gdn_ops.patch()` (the rule, the convolution and
the gated norm on sonata's kernels). Logits are checked equal (max difference shown).

One run, one host: compare rows with each other. On a shared host use --threads 1.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import hardware_line, print_table  # noqa: E402

from sonata.kernels.gdn import gated_delta_rule, gated_delta_rule_step, gdn_chunked_ref, gdn_recurrent_ref  # noqa: E402
from sonata.kernels.gdn import gdn_step_ref, l2norm  # noqa: E402


def inputs(b, L, h, hk, dk, dv, grad=True):
    g = torch.Generator().manual_seed(0)
    q, k = l2norm(torch.randn(b, L, hk, dk, generator=g)), l2norm(torch.randn(b, L, hk, dk, generator=g))
    v = torch.randn(b, L, h, dv, generator=g)
    gate = -torch.rand(b, L, h, generator=g) * 0.5
    beta = torch.rand(b, L, h, generator=g)
    return [t.requires_grad_(grad) for t in (q, k, v, gate, beta)]


def timed(fn, reps=1):
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def rule_table(shapes, rounds):
    from transformers.models.qwen3_next import modeling_qwen3_next as qn
    hf = getattr(qn.torch_chunk_gated_delta_rule, "__wrapped__", qn.torch_chunk_gated_delta_rule)
    impls = {
        "recurrent ref": lambda *x: gdn_recurrent_ref(*x),
        "chunked ref": lambda *x: gdn_chunked_ref(*x, chunk_size=64),
        "transformers": lambda *x: hf(*x[:3], g=x[3], beta=x[4], chunk_size=64)[0],
        "fused cpu": lambda *x: gated_delta_rule(*x, backend="cpu"),
    }
    rows = []
    for shape in shapes:
        xs = inputs(*shape)
        b, L = shape[0], shape[1]
        fwd, fb = {n: [] for n in impls}, {n: [] for n in impls}
        for n, f in impls.items():                       # warm-up (numba compiles here)
            f(*xs).sum().backward()
        for _ in range(rounds):
            for n, f in impls.items():
                with torch.no_grad():
                    fwd[n].append(timed(lambda: f(*xs)))
                fb[n].append(timed(lambda: f(*xs).sum().backward()))
        base = statistics.median(fb["transformers"])
        for n in impls:
            mf, mb = statistics.median(fwd[n]), statistics.median(fb[n])
            rows.append([f"b{b} L{L} h{shape[2]}/{shape[3]} dk{shape[4]} dv{shape[5]}", n, f"{mf * 1e3:.2f}",
                         f"{mb * 1e3:.2f}", f"{b * L / mb:,.0f}", f"{base / mb:.1f}x"])
    print_table(["shape", "form", "fwd ms", "fwd+bwd ms", "tok/s f+b", "vs transformers"], rows,
                "Table 1: the gated delta rule, float32")


def step_table(shapes, reps):
    from transformers.models.qwen3_next import modeling_qwen3_next as qn
    hf = getattr(qn.torch_recurrent_gated_delta_rule, "__wrapped__", qn.torch_recurrent_gated_delta_rule)
    rows = []
    for shape in shapes:
        _, _, h, hk, dk, dv = shape
        q, k, v, g, beta = inputs(1, 1, h, hk, dk, dv, grad=False)
        S = torch.zeros(1, h, dk, dv)
        cases = {"fused step": lambda: gated_delta_rule_step(S, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]),
                 "torch step (ref)": lambda: gdn_step_ref(S, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]),
                 "transformers": lambda: hf(q, k, v, g=g, beta=beta, initial_state=S, output_final_state=True)}
        with torch.inference_mode():
            times = {n: [] for n in cases}
            for n, f in cases.items():
                f()
            for _ in range(reps):
                for n, f in cases.items():
                    times[n].append(timed(f))
        base = statistics.median(times["transformers"])
        for n in cases:
            m = statistics.median(times[n])
            rows.append([f"h{h}/{hk} dk{dk} dv{dv}", n, f"{m * 1e6:.1f}", f"{base / m:.1f}x"])
    print_table(["shape", "step", "us / step", "vs transformers"], rows, "Table 2: the one-token step, batch 1")


def model_table(prompt_len, new_tokens, rounds):
    import transformers
    from sonata.interop import gdn_ops
    cfg = transformers.Qwen3NextConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_value_heads=8, linear_num_key_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        mlp_only_layers=[0, 1, 2, 3])
    torch.manual_seed(0)
    m = transformers.Qwen3NextForCausalLM(cfg).eval()
    ids = torch.randint(0, 1024, (1, prompt_len), generator=torch.Generator().manual_seed(1))

    def run():
        out = m(ids, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(new_tokens):
            out = m(nxt, cache=cache, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - t) / new_tokens

    res = {"transformers": ([], []), "sonata ops": ([], [])}
    logits = {}
    with torch.inference_mode():
        for _ in range(rounds + 1):
            for name in res:
                gdn_ops.patch() if name == "sonata ops" else gdn_ops.unpatch()
                logits[name] = m(ids).logits
                pre = timed(lambda: m(ids, use_cache=True))
                dec = run()
                res[name][0].append(pre)
                res[name][1].append(dec)
        gdn_ops.unpatch()
    diff = (logits["sonata ops"] - logits["transformers"]).abs().max().item()
    base_p, base_d = (statistics.median(x[1:]) for x in res["transformers"])
    rows = []
    for name, (pre, dec) in res.items():
        p, d = statistics.median(pre[1:]), statistics.median(dec[1:])
        rows.append([name, f"{p * 1e3:.1f}", f"{base_p / p:.1f}x", f"{d * 1e3:.2f}", f"{base_d / d:.1f}x"])
    print_table(["Qwen3-Next (tiny, random)", f"prefill {prompt_len} ms", "speed-up", "decode ms/token",
                 "speed-up"], rows, f"Table 3: Qwen3NextForCausalLM, batch 1 (max logit difference {diff:.1e})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes, few rounds")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    print(hardware_line(), f"; torch threads {torch.get_num_threads()}")
    shapes = [(2, 128, 4, 2, 32, 32)] if a.quick else [(4, 256, 4, 2, 32, 32), (2, 512, 8, 4, 64, 64)]
    rounds = 2 if a.quick else a.rounds
    rule_table(shapes, rounds)
    step_table([(1, 1, 4, 2, 32, 32), (1, 1, 8, 4, 64, 64), (1, 1, 16, 8, 128, 128)], 50 if a.quick else 300)
    model_table(64 if a.quick else 256, 8 if a.quick else 32, rounds)


if __name__ == "__main__":
    main()
