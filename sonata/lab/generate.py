"""Loading a trained model and sampling text from it (no corpus, no trainer needed).

`load_model` reads a sonata checkpoint or a transformers Mamba folder (sonata.interop.hf);
`generate_text` samples whole continuations in a batch, `stream_text` yields one
continuation piece by piece as it is sampled; `PromptCache` keeps the decoding state after
prompts, so a prompt that begins with one already run (a chat's earlier turns) runs only its
new tokens. Both consume the prompt in one
parallel pass and decode with `sonata.model.decode.Decoder` (preallocated buffers).
A temperature so small that logits / temperature overflows float32 (1e-45, say) is greedy:
there the top token is certain (`sonata.model.decode.sample_next`).
"""
from __future__ import annotations

import codecs

import torch

from sonata.core import checkpoint as ckpt
from sonata.core.config import Config
from sonata.core.errors import CheckpointError
from sonata.data.tasks import make_task
from sonata.data.vocab import Vocab
from sonata.interop import hf
from sonata.model.decode import Decoder, sample_next
from sonata.model.lm import MambaLM, build_model


def load_model(path, device="cpu") -> tuple[MambaLM, Vocab | None, Config]:
    """Model, vocabulary and config from a checkpoint or from a folder written by
    `python -m sonata export --hf` (no corpus needed). A synthetic task's checkpoint
    (task.name set) has no vocabulary: None, and the task's vocabulary size."""
    if hf.is_hf_dir(path):
        model, vocab, cfg = hf.import_hf(path, device)
        if vocab is None:
            raise CheckpointError(f"{path} has no sonata vocabulary ({hf.VOCAB_FILE}); load the weights "
                                  f"alone with sonata.interop.hf.import_hf")
        return model, vocab, cfg
    state = ckpt.load(path, map_location=device)
    try:
        cfg = Config.from_dict(state["config"])
        vocab = Vocab.from_state_dict(state["vocab"]) if not cfg.task.name else None
        cfg.model.vocab_size = len(vocab) if vocab is not None else make_task(cfg.task).vocab_size
        model = build_model(cfg).to(device)
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
    start = _context(vocab, prompt)
    ids = torch.tensor([start] * n, dtype=torch.long, device=dev)
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    out = model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k,
                         generator=g, stop_token=vocab.EOT_ID)
    texts = []
    skip = 0 if prompt else 1                              # the story boundary that stood for ""
    for row in out.tolist():
        row = row[: row.index(vocab.EOT_ID, len(start))] if vocab.EOT_ID in row[len(start):] else row
        texts.append(vocab.decode(row[skip:]))
    return texts


def _context(vocab: Vocab, prompt: str) -> list[int]:
    """The prompt's ids; an empty prompt is a story boundary (<|endoftext|>), as in training."""
    return vocab.encode(prompt) or [vocab.EOT_ID]


@torch.inference_mode()
def stream_text(model: MambaLM, vocab: Vocab, prompt: str = "Once upon a time", max_new_tokens: int = 200,
                temperature: float = 0.8, top_k: int = 40, seed: int = 0, cache: "PromptCache | None" = None):
    """Yield the continuation of `prompt` piece by piece as tokens are sampled (one
    sequence); each piece is complete UTF-8 text; stops at <|endoftext|>. With `cache` (a
    PromptCache of `model` at batch 1) the prompt's cached beginning is not run again."""
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    ids = _context(vocab, prompt)
    if max_new_tokens <= 0:
        return
    if cache is not None:
        if cache.model is not model or cache.batch != 1:
            raise ValueError("stream_text's cache must be a PromptCache of the same model at batch 1")
        dec, logits = cache.start(ids)
    else:
        dec = Decoder(model, 1)
        logits = dec.prefill(torch.tensor([ids], dtype=torch.long, device=dev))
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    nxt = torch.empty(1, dtype=torch.long, device=dev)
    for i in range(max_new_tokens):
        sample_next(logits, temperature, top_k, g, out=nxt)
        tok = int(nxt)
        if tok == vocab.EOT_ID:
            break
        piece = decoder.decode(vocab.decode_bytes([tok]))
        if piece:
            yield piece
        if i + 1 < max_new_tokens:
            logits = dec.step(nxt)
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail


class PromptCache:
    """Decoding states after prompts, so that a prompt which begins with one already run (a
    shared system prompt, a chat's earlier turns) is not run again. `start(ids)` restores the
    state after the longest cached prompt that `ids` begins with (`Decoder.restore`: the same
    state, bit for bit), feeds only the tokens after it (one parallel pass from that state,
    `Decoder.extend`; a single token, one step), caches the state after `ids` too, and returns
    the decoder, ready to `step`, with the logits after `ids`. A prompt with nothing cached runs
    as one parallel prefill. Every layer's state is kept: the conv windows and SSM
    states, and the keys and values of attention layers in hybrids (which llama.cpp runs again
    on every turn of a hybrid). Past `max_entries` the least recently used state goes."""

    def __init__(self, model: MambaLM, batch: int = 1, max_entries: int = 16):
        if max_entries < 1:
            raise ValueError(f"a prompt cache holds at least 1 entry, not {max_entries}")
        self.model, self.batch, self.max_entries = model, batch, max_entries
        self.entries: dict[tuple, object] = {}           # prompt ids -> DecodeState, oldest use first
        self.reused = 0                                    # tokens the last `start` did not run again

    def longest_prefix(self, ids) -> tuple:
        """The longest cached prompt that `ids` begins with (() when none)."""
        ids = tuple(ids)
        return max((k for k in self.entries if ids[:len(k)] == k), key=len, default=())

    @torch.inference_mode()
    def start(self, ids):
        """-> (decoder, logits (batch, vocab)) after the prompt `ids` (a list of ids, the same
        for every sequence of the batch)."""
        ids = tuple(int(i) for i in ids)
        if not ids:
            raise ValueError("a prompt needs at least one token")
        dev = next(self.model.parameters()).device
        dec = Decoder(self.model, self.batch)
        key = self.longest_prefix(ids)
        if key:
            snap = self.entries.pop(key)
            self.entries[key] = snap                       # most recently used last
            logits = dec.restore(snap)
            rest = ids[len(key):]
            if len(rest) == 1:                             # one token: one step
                logits = dec.step(torch.full((self.batch,), rest[0], dtype=torch.long, device=dev))
            elif rest:                                     # more: one parallel pass from the state
                logits = dec.extend(torch.tensor([rest] * self.batch, dtype=torch.long, device=dev))
        else:
            logits = dec.prefill(torch.tensor([ids] * self.batch, dtype=torch.long, device=dev))
        self.reused = len(key)
        if ids != key:
            self.entries[ids] = dec.snapshot()
            while len(self.entries) > self.max_entries:
                self.entries.pop(next(iter(self.entries)))
        return dec, logits


def load_text_model(path, device="cpu") -> tuple[MambaLM, Vocab, Config]:
    """`load_model` for what needs text: a task checkpoint, which has no vocabulary, is a
    CheckpointError."""
    model, vocab, cfg = load_model(path, device)
    if vocab is None:
        raise CheckpointError(f"{path} is a model of the synthetic task {cfg.task.name!r}: it has no text "
                              f"vocabulary (score it with `python -m sonata eval {path} --lengths ...`)")
    return model, vocab, cfg
