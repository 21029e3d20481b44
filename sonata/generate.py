"""Loading a trained model and sampling text from it (no corpus, no trainer needed)."""
from __future__ import annotations

import torch

from sonata import checkpoint as ckpt
from sonata.config import Config
from sonata.data import Vocab
from sonata.errors import CheckpointError
from sonata.model import MambaLM


def load_model(path, device="cpu") -> tuple[MambaLM, Vocab, Config]:
    """Model, vocabulary and config from a checkpoint (no corpus needed)."""
    state = ckpt.load(path, map_location=device)
    try:
        cfg = Config.from_dict(state["config"])
        vocab = Vocab.from_state_dict(state["vocab"])
        cfg.model.vocab_size = len(vocab)
        model = MambaLM(cfg.model).to(device)
        model.load_state_dict(state["model"])
    except (KeyError, RuntimeError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} is incomplete or does not match its config: "
                              f"{str(e).splitlines()[0][:200]}") from None
    model.eval()
    return model, vocab, cfg


def generate_text(model: MambaLM, vocab: Vocab, prompt: str = "Once upon a time", n: int = 1,
                  max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40,
                  seed: int = 0) -> list[str]:
    """`n` continuations of `prompt`, each stopped at <|endoftext|>."""
    dev = next(model.parameters()).device
    ids = torch.tensor([vocab.encode(prompt)] * n, dtype=torch.long, device=dev)
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    out = model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k,
                         generator=g, stop_token=vocab.EOT_ID)
    texts = []
    for row in out.tolist():
        row = row[: row.index(vocab.EOT_ID, len(ids[0]))] if vocab.EOT_ID in row[len(ids[0]):] else row
        texts.append(vocab.decode(row))
    return texts




@torch.no_grad()
def stream_text(model: MambaLM, vocab: Vocab, prompt: str = "Once upon a time", max_new_tokens: int = 200,
                temperature: float = 0.8, top_k: int = 40, seed: int = 0):
    """Yield the continuation of `prompt` piece by piece as tokens are sampled (one
    sequence); each piece is complete UTF-8 text; stops at <|endoftext|>."""
    import codecs

    import torch.nn.functional as F
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    states = [layer.mixer.empty_state(1, dev) for layer in model.layers]
    logits = None
    for t in vocab.encode(prompt):
        logits, states = model.step(torch.tensor([t], device=dev), states)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for _ in range(max_new_tokens):
        if logits is None:
            break
        if temperature <= 0:
            nxt = logits.argmax(-1)
        else:
            lg = logits.float() / temperature
            if top_k:
                kth = lg.topk(min(top_k, lg.shape[-1]), dim=-1).values[:, -1:]
                lg = lg.masked_fill(lg < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(lg, -1), 1, generator=g)[:, 0]
        tok = int(nxt)
        if tok == vocab.EOT_ID:
            break
        piece = decoder.decode(vocab.decode_bytes([tok]))
        if piece:
            yield piece
        logits, states = model.step(nxt, states)
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail
