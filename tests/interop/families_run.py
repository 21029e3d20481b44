"""The nine transformers Mamba families, run in one fresh process: `python families_run.py
FOLDER OUT [--shim] [--save]` (used by test_families.py, not a test itself).

--save builds each family's tiny random model (seeded) and saves it under FOLDER/<family>
(nothing downloaded); every run loads the saved folders. --shim calls
sonata.interop.mamba_ssm.install() before transformers is imported, and counts the calls
that reach sonata's kernels (the SSD CPU kernel, the fused decoding step, the fused
Mamba-1 scan and conv, the fused RMSNorm). Per family it writes to OUT (torch.save): the
eval logits (float32, and float64 without the shim), greedy ids after a cached prompt pass,
one training step's loss and gradients, packed-sequence results where the family has no
attention, and the call counts of each phase."""
from __future__ import annotations

import sys
from collections import Counter

import torch

SSM = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
           mamba_chunk_size=16)
ATTN = dict(num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)
FAMILIES = {
    # name: (config class, model class, config kwargs); hidden 32, 2 layers (one mixer, one attention
    # for the hybrids), 4 heads of 16, 2 groups, N 8, chunk 16, vocabulary 64
    "Mamba": ("MambaConfig", "MambaForCausalLM", dict(hidden_size=32, state_size=8, num_hidden_layers=2,
                                                      time_step_rank=4)),
    "FalconMamba": ("FalconMambaConfig", "FalconMambaForCausalLM",
                    dict(hidden_size=32, state_size=8, num_hidden_layers=2, time_step_rank=4)),
    "Jamba": ("JambaConfig", "JambaForCausalLM",
              dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                   expert_layer_period=2, expert_layer_offset=1, num_experts=2, num_experts_per_tok=1,
                   mamba_d_state=8, mamba_dt_rank=4, **ATTN)),
    "Mamba2": ("Mamba2Config", "Mamba2ForCausalLM",
               dict(hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2, num_hidden_layers=2,
                    expand=2, conv_kernel=4, chunk_size=16)),
    "Bamba": ("BambaConfig", "BambaForCausalLM",
              dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, attn_layer_indices=[1], **ATTN, **SSM)),
    "GraniteMoeHybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                              layer_types=["mamba", "attention"], num_local_experts=2, num_experts_per_tok=1,
                              shared_intermediate_size=32, **ATTN, **SSM)),
    "Zamba2": ("Zamba2Config", "Zamba2ForCausalLM",
               dict(hidden_size=32, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], mamba_d_state=8,
                    mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4, chunk_size=16, num_attention_heads=4,
                    num_key_value_heads=4, intermediate_size=64, num_mem_blocks=1, adapter_rank=4,
                    attention_dropout=0.0)),
    "FalconH1": ("FalconH1Config", "FalconH1ForCausalLM",
                 dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, mamba_d_ssm=64,
                      **{k: v for k, v in SSM.items() if k != "mamba_expand"}, **ATTN)),
    "NemotronH": ("NemotronHConfig", "NemotronHForCausalLM",
                  dict(hidden_size=32, layers_block_type=["mamba", "attention", "mlp"], num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=64, ssm_state_size=8, mamba_num_heads=4,
                       mamba_head_dim=16, n_groups=2, expand=2, chunk_size=16, conv_kernel=4, attention_dropout=0.0,
                       hidden_dropout=0.0)),
}
MAMBA1 = ("Mamba", "FalconMamba", "Jamba")
MOE = ("Jamba", "GraniteMoeHybrid")
PACKED = ("Mamba2",)                    # no attention layer: seq_idx alone keeps sequences apart
VOCAB, BATCH, L, PROMPT, NEW = 64, 2, 40, 12, 10
INIT = 0.2                              # 10x transformers' default: the mixers' outputs must reach the logits
COUNTS = Counter()


def count_kernel_calls():
    """Wrap the sonata functions that only the shim's ops reach, so each call is counted."""
    import sonata.interop.mamba2_ops as m2
    import sonata.interop.mamba_ssm as m1
    import sonata.kernels.ssd as ssd_pkg
    import sonata.kernels.ssd.step as step
    for mod, name, key in ((ssd_pkg, "ssd_cpu", "ssd_cpu"), (step, "_step_kernel", "ssd_step_fused"),
                           (m1, "selective_scan", "selective_scan"), (m1, "conv_silu", "conv_silu"),
                           (m2, "rms_norm_gated", "rms_norm"), (m2, "causal_conv", "split_conv"),
                           (m2, "causal_conv_silu", "split_conv"),
                           (m2, "ssd_packed", "ssd_cpu")):      # the training path's SSD (packed x, B, C)
        f = getattr(mod, name)

        def counted(*a, _f=f, _key=key, **k):
            COUNTS[_key] += 1
            return _f(*a, **k)
        setattr(mod, name, counted)


def save_models(folder):
    import transformers
    for name, (cfg_cls, model_cls, kw) in FAMILIES.items():
        cfg = getattr(transformers, cfg_cls)(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                             use_cache=True, initializer_range=INIT, **kw)
        torch.manual_seed(0)
        getattr(transformers, model_cls)(cfg).save_pretrained(f"{folder}/{name}")


def phase(fn):
    """(result, the kernel calls made while fn ran)."""
    before = Counter(COUNTS)
    out = fn()
    return out, dict(COUNTS - before)


def run_family(name, folder, shim):
    import transformers
    from sonata.kernels import fallback_count
    extra = {"experts_implementation": "eager"} if name in MOE else {}    # grouped_mm has no float64
    model = getattr(transformers, FAMILIES[name][1]).from_pretrained(f"{folder}/{name}", **extra).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, L), generator=g)
    res, calls = {}, {}
    fallbacks = fallback_count()
    with torch.no_grad():
        res["logits"], calls["eval"] = phase(lambda: model(ids).logits.double())
        res["generate"], calls["generate"] = phase(lambda: model.generate(
            ids[:, :PROMPT], attention_mask=torch.ones(BATCH, PROMPT, dtype=torch.long), max_new_tokens=NEW,
            min_new_tokens=NEW, do_sample=False))
    model.train()

    def step():
        loss = model(ids, labels=ids, use_cache=False).loss      # no cache: the fused mixer op
        loss.backward()
        return loss.detach().double(), {k: p.grad.double() for k, p in model.named_parameters() if p.grad is not None}
    (res["loss"], res["grads"]), calls["train"] = phase(step)
    model.zero_grad()
    if name in PACKED:
        res["packed"] = packed(model, ids, shim)
    if not shim:
        with torch.no_grad():
            res["logits64"] = model.eval().double()(ids).logits
    res["calls"], res["fallbacks"] = calls, fallback_count() - fallbacks
    return res


def packed(model, ids, shim):
    """Two sequences packed in one row with seq_idx against each alone: eval logits, and the
    gradients of the summed next-token loss of both. Through the backbone (Mamba2ForCausalLM
    keeps its keyword arguments for the loss; Mamba2Model hands them to the mixers)."""
    a, b = ids[0, :17], ids[1, :23]
    row = torch.cat([a, b])[None]
    seq_idx = torch.tensor([[0] * 17 + [1] * 23], dtype=torch.int32)

    def logits(x, **kw):
        return model.lm_head(model.backbone(x, **kw).last_hidden_state)[0]
    out = {}
    model.eval()
    try:
        with torch.no_grad():
            out["packed"] = logits(row, seq_idx=seq_idx).double()
    except ValueError as e:
        return {"error": str(e)}
    with torch.no_grad():
        out["apart"] = torch.cat([logits(a[None]), logits(b[None])]).double()
    model.train()
    ce = torch.nn.functional.cross_entropy
    lg = logits(row, seq_idx=seq_idx)
    (ce(lg[:16], a[1:], reduction="sum") + ce(lg[17:-1], b[1:], reduction="sum")).backward()
    out["packed_grads"] = {k: p.grad.double().clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for s in (a, b):
        ce(logits(s[None])[:-1], s[1:], reduction="sum").backward()
    out["apart_grads"] = {k: p.grad.double().clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


def main(argv):
    folder, out = argv[0], argv[1]
    shim = "--shim" in argv
    if shim:
        from sonata.interop import mamba_ssm
        mamba_ssm.install()
        count_kernel_calls()
    if "--save" in argv:
        save_models(folder)
    torch.manual_seed(0)
    results = {}
    import time
    for name in FAMILIES:
        t0 = time.perf_counter()
        try:
            results[name] = run_family(name, folder, shim)
        except Exception as e:                      # noqa: BLE001  (reported per family by the test)
            import traceback
            results[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
        print(f"{name} {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    torch.save(results, out)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
