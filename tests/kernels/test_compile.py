"""torch.compile over sonata's models: every block family and a hybrid compile, train and give
eager's numbers. The layers' fused kernels and Mamba-1's scan are PyTorch custom ops (traced as
such: no graph break); the other scans are opaque to dynamo (`dispatch.opaque`: a graph break at
each, which runs as is). Before, dynamo stopped with an error inside numba's dispatcher. The `aot_eager` backend traces forward and backward
without generating code (inductor's C++ would only add compile minutes here)."""
import pytest
import torch
import torch.nn.functional as F

from sonata.core.config import ModelConfig
from sonata.model import MambaLM

FAMILIES = {"mamba": dict(arch="mamba"), "mamba2": dict(arch="mamba2"), "mamba3": dict(arch="mamba3"),
            "mamba3-mimo": dict(arch="mamba3", mimo_rank=2), "gdn": dict(arch="gdn"),
            "attention": dict(arch="attention"), "hybrid": dict(arch="hybrid", layers="mamba2,attention")}


def _model(**kw):
    torch.manual_seed(0)
    base = dict(d_model=32, n_layers=2, d_state=8, vocab_size=64, headdim=16, chunk_size=16)
    return MambaLM(ModelConfig(**{**base, **kw}))


def _loss_and_grads(m, x):
    m.zero_grad(set_to_none=True)
    logits = m(x)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in m.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("name", FAMILIES)
def test_a_compiled_model_trains_with_eagers_numbers(name):
    torch._dynamo.reset()
    m = _model(**FAMILIES[name])
    x = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    want_loss, want = _loss_and_grads(m, x)
    compiled = torch.compile(m, backend="aot_eager")
    for _ in range(2):                                   # the second call runs the cached graphs
        loss, grads = _loss_and_grads(compiled, x)
        assert torch.allclose(loss, want_loss, atol=1e-5), name
        assert grads.keys() == want.keys()
        for k, g in want.items():
            assert torch.allclose(grads[k], g, atol=1e-5, rtol=1e-4), (name, k)


@pytest.mark.parametrize("name", FAMILIES)
def test_graph_breaks_only_where_a_scan_is_not_yet_an_op(name):
    """Mamba-1, GDN, attention and Mamba-3 MIMO (their fused kernels all custom ops: the
    layers', the selective scan's, the gated delta rule's; MIMO's chunked scan is PyTorch)
    compile into one graph with no break; the others (the SSD scan of Mamba-2 and Mamba-3 SISO)
    break only at their scans' opaque calls (dispatch.opaque), nowhere else."""
    torch._dynamo.reset()
    m = _model(**FAMILIES[name])
    x = torch.randint(0, 64, (2, 24))
    m(x)                                                 # every fused module imported
    ex = torch._dynamo.explain(m)(x)
    if name in ("mamba", "attention", "mamba3-mimo", "gdn"):
        assert (ex.graph_count, ex.graph_break_count) == (1, 0), [str(r.reason) for r in ex.break_reasons]
        return
    assert ex.graph_break_count > 0
    for r in ex.break_reasons:
        assert "torch.compiler.disable" in str(r.reason), str(r.reason)


@pytest.mark.parametrize("name", ["mamba", "attention", "mamba3-mimo", "gdn"])
def test_torch_export_of_the_inference_forward_saves_loads_and_runs(name, tmp_path):
    """The families whose kernels are all ops export (torch.export) with sonata's ops in the
    graph; the saved program loads back and gives eager's logits on other inputs too."""
    m = _model(**FAMILIES[name]).eval()
    x = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    ep = torch.export.export(m, (x,))
    if name == "mamba":
        ops = {str(n.target) for n in ep.graph.nodes if "sonata" in str(n.target)}
        assert {"sonata.selective_scan.default", "sonata.conv_silu.default", "sonata.rms_norm.default"} <= ops
    torch.export.save(ep, tmp_path / "m.pt2")
    from sonata.kernels import register_ops
    register_ops()                                       # what a fresh process calls before loading
    loaded = torch.export.load(tmp_path / "m.pt2").module()
    for seed in (2, 3):
        x = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            assert torch.allclose(loaded(x), m(x), atol=1e-5)
