"""Small random models the tests share (test_hf.py, test_decode.py): every parameter moved
off its initial value, so a wrong mapping of weights cannot pass by coincidence."""
import numpy as np
import torch

from sonata.core.config import ModelConfig
from sonata.data.vocab import Vocab
from sonata.model.lm import MambaLM

VOCAB = 300


def _vocab() -> Vocab:
    return Vocab(np.arange(1000, 1000 + VOCAB - Vocab.FIRST_TOKEN))


def _sonata(a_param="log", seed=0, **kw) -> MambaLM:
    """A small MambaLM with every parameter moved off its initial value (D=1, norms=1 and
    S4D-real A would let a wrong mapping pass)."""
    torch.manual_seed(seed)
    m = MambaLM(ModelConfig(d_model=32, n_layers=2, d_state=8, vocab_size=VOCAB, a_param=a_param,
                            **kw)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("A_param"):
                p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))
            elif name.endswith("A_log"):
                p.add_(torch.randn_like(p) * 0.3)
            elif p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.mul_(torch.empty_like(p).uniform_(0.7, 1.3))
    return m


def _ids(b=3, t=19, seed=1):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))
