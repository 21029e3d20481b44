"""transformers' GPT-2 as a sonata model (`model.arch=gpt2`): the race's baseline."""
from __future__ import annotations

import torch


def check(cfg) -> list[str]:
    """model.arch=gpt2's errors (sonata.model.families): heads that divide the width, and none
    of the sonata-only embedding settings. Writes nothing."""
    errors = []
    if not (cfg.n_heads > 0 and cfg.d_model % cfg.n_heads == 0):
        errors.append(f"model.n_heads ({cfg.n_heads}) must divide model.d_model ({cfg.d_model})")
    if not (cfg.tie_embeddings and cfg.embed_std == 0.02):
        errors.append("model.tie_embeddings and model.embed_std are sonata models' (model.arch=gpt2 is "
                      "transformers' GPT-2)")
    return errors


class GPT2LM(torch.nn.Module):
    """transformers' GPT2LMHeadModel as a sonata language model (`model.arch=gpt2`): the
    baseline of the ten-minute race (benchmarks/race.py), trained by sonata's own trainer on the
    same batches as any sonata model. Width model.d_model, model.n_layers blocks of
    model.n_heads heads, context `n_positions` (data.seq_len), tied embeddings, no dropout
    (sonata's models have none). forward(idx) -> logits (b, L, vocab); no recurrent state."""

    def __init__(self, cfg, n_positions: int):
        super().__init__()
        try:
            import transformers
        except ImportError:
            from sonata.core.errors import ConfigError
            raise ConfigError("model.arch=gpt2 needs transformers: pip install transformers") from None
        self.cfg = cfg
        conf = transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=n_positions, n_embd=cfg.d_model,
                                       n_layer=cfg.n_layers, n_head=cfg.n_heads, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=True,
                                       bos_token_id=None, eos_token_id=None)   # no 50256 outside the vocabulary
        self.gpt = transformers.GPT2LMHeadModel(conf)

    def forward(self, idx, state=None, return_state: bool = False):
        if state is not None or return_state:
            raise ValueError("model.arch=gpt2 has no recurrent state (score whole sequences)")
        return self.gpt(input_ids=idx, use_cache=False).logits

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())          # the tied embedding once
