"""Validation: loss per token and bits per UTF-8 byte of a model over a token stream
(every token predicted exactly once, windows of seq_len), optionally sharded over
data-parallel ranks; `evaluate_file` scores any UTF-8 text file the same way
(`python -m sonata eval`), under the precision the checkpoint trained with
(`trained_precision`), so it gives the trainer's figures for an int8 or bf16 run too."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from sonata.core import checkpoint as ckpt
from sonata.core.device import autocast_for, check_precision
from sonata.core.errors import ConfigError, DataError
from sonata.data.batches import val_batches
from sonata.data.sources import read_text as _read_text, split_stories
from sonata.model.quant import set_int8
from sonata.train import distributed


@dataclass
class EvalResult:
    loss: float       # nats per token
    bpb: float        # bits per UTF-8 byte
    tokens: int
    bytes: int
    position_loss: tuple = ()   # by_position: nats per token at each position of the window (0 = first)

    def fields(self) -> dict:
        """What a metrics row and the summary report."""
        return {"val_loss": self.loss, "val_bpb": self.bpb}


@torch.no_grad()
def evaluate_stream(model, stream: torch.Tensor, byte_len: torch.Tensor, seq_len: int, batch: int,
                    max_tokens: int = 0, precision: str = "fp32", shard: tuple[int, int] = (0, 1),
                    by_position: bool = False) -> EvalResult:
    """`byte_len[t]`: UTF-8 bytes of token t. `shard=(rank, world)`: this rank evaluates
    every world-th batch and the sums are all-reduced (every rank gets the total).
    `by_position`: also the loss at each position of the window (`position_loss`: does a
    model lose early in its context, late, or uniformly?); one process only."""
    if by_position and shard[1] > 1:
        raise ValueError("by_position is computed in one process")
    rank, world = shard
    device = stream.device
    was_training = model.training
    model.eval()
    nats = torch.zeros((), dtype=torch.float64, device=device)
    at_pos = torch.zeros(seq_len, dtype=torch.float64, device=device)
    rows_at_pos = torch.zeros(seq_len, dtype=torch.float64, device=device)
    n_tok = n_bytes = 0
    for i, (x, y) in enumerate(val_batches(stream, seq_len, batch, max_tokens)):
        if world > 1 and i % world != rank:
            continue
        with autocast_for(precision, device):
            logits = model(x)                                               # (b, L, V)
        per_token = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                    reduction="none").double()
        nats += per_token.sum()
        if by_position:                                                      # the last window may be shorter
            at_pos[:y.shape[1]] += per_token.view(y.shape).sum(0)
            rows_at_pos[:y.shape[1]] += y.shape[0]
        n_tok += y.numel()
        n_bytes += int(byte_len[y].sum())
    model.train(was_training)
    total = float(nats)
    if world > 1:
        total, n_tok, n_bytes = distributed.all_reduce_sum([total, n_tok, n_bytes])
        n_tok, n_bytes = int(n_tok), int(n_bytes)
    positions = tuple((at_pos / rows_at_pos.clamp(min=1)).tolist()) if by_position else ()
    return EvalResult(loss=total / max(n_tok, 1), bpb=total / (math.log(2) * max(n_bytes, 1)),
                      tokens=n_tok, bytes=n_bytes, position_loss=positions)


@dataclass
class TextEval(EvalResult):
    stories: int = 0
    coverage: float = 1.0     # share of o200k tokens the vocabulary keeps whole


def trained_precision(path, device) -> str:
    """The precision a checkpoint's run trained and validated with (its plan's: fp32, fp16,
    bf16 or int8), when it can run on `device`, else fp32; an exported folder's weights: fp32."""
    if Path(path).is_dir():
        return "fp32"
    plan = ckpt.load(path).get("plan")
    precision = plan.get("precision", "fp32") if isinstance(plan, dict) else "fp32"
    if precision in ("fp16", "bf16"):
        try:
            check_precision(precision, torch.device(device))
        except ConfigError:
            return "fp32"
    return precision if precision in ("fp16", "bf16", "int8") else "fp32"


def evaluate_file(model, vocab, path, seq_len: int, batch: int = 16, precision: str = "fp32") -> TextEval:
    """Validation loss and bits per byte of `model` on a UTF-8 text file, scored exactly
    as the trainer scores its validation split: the text's stories (separated by
    <|endoftext|>, or the whole text as one story), stripped, each followed by
    <|endoftext|>, encoded with `vocab` (the checkpoint's own) and predicted in windows
    of `seq_len`, every token once; bytes are counted by `vocab.byte_lengths` (a story
    boundary counts as one byte), under `precision` (int8: the model's projections fake-quantized
    while it runs, as in training). The file is read whole. A missing or unreadable file,
    text that is not UTF-8, or one shorter than seq_len + 1 tokens (one full window) is a
    DataError."""
    path = Path(path)
    stories = split_stories(_read_text(path, "text file"))
    ids, coverage = vocab.encode_stories(stories) if stories else (np.zeros(0, dtype=np.int32), 1.0)
    if len(ids) < seq_len + 1:
        raise DataError(f"text file {path} is too short to score: {len(ids)} tokens under the checkpoint's vocabulary, "
                        f"at least data.seq_len + 1 = {seq_len + 1} needed (one full window)")
    device = next(model.parameters()).device
    stream = torch.from_numpy(ids).to(device)
    byte_len = torch.from_numpy(vocab.byte_lengths).to(device)
    if precision == "int8":
        set_int8(model, True)
    try:
        r = evaluate_stream(model, stream, byte_len, seq_len, batch, precision=precision)
    finally:
        if precision == "int8":
            set_int8(model, False)
    return TextEval(loss=r.loss, bpb=r.bpb, tokens=r.tokens, bytes=r.bytes, stories=len(stories),
                    coverage=coverage)
