"""torch.compile over sonata's models: every block family and a hybrid compile, train and give
eager's numbers. The fused numba kernels are opaque to dynamo (`dispatch.opaque`: a graph break
at each fused call, which runs as is); the PyTorch around them is traced. Before, dynamo stopped
with an error inside numba's dispatcher. The `aot_eager` backend traces forward and backward
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


def test_graph_breaks_are_the_fused_calls_only():
    """Mamba-1: a break at each fused call (conv, scan per layer) and none elsewhere; the
    breaks name torch.compiler.disable (the opaque kernels) or the fused module's first import."""
    torch._dynamo.reset()
    m = _model(arch="mamba")
    x = torch.randint(0, 64, (2, 24))
    ex = torch._dynamo.explain(m)(x)
    reasons = [str(r.reason) for r in ex.break_reasons]
    assert ex.graph_break_count >= len(reasons) > 0     # explain lists each distinct site once
    for r in reasons:
        assert "torch.compiler.disable" in r or "marked as skipped" in r, r
