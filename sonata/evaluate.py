"""Validation: loss per token and bits per UTF-8 byte of a model over a token stream
(every token predicted exactly once, windows of seq_len), optionally sharded over
data-parallel ranks."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sonata import distributed
from sonata.data import val_batches
from sonata.device import autocast_for


@dataclass
class EvalResult:
    loss: float       # nats per token
    bpb: float        # bits per UTF-8 byte
    tokens: int
    bytes: int


@torch.no_grad()
def evaluate_stream(model, stream: torch.Tensor, byte_len: torch.Tensor, seq_len: int, batch: int,
                    max_tokens: int = 0, precision: str = "fp32", shard: tuple[int, int] = (0, 1)) -> EvalResult:
    """`byte_len[t]`: UTF-8 bytes of token t. `shard=(rank, world)`: this rank evaluates
    every world-th batch and the sums are all-reduced (every rank gets the total)."""
    rank, world = shard
    device = stream.device
    was_training = model.training
    model.eval()
    nats = torch.zeros((), dtype=torch.float64, device=device)
    n_tok = n_bytes = 0
    for i, (x, y) in enumerate(val_batches(stream, seq_len, batch, max_tokens)):
        if world > 1 and i % world != rank:
            continue
        with autocast_for(precision, device):
            logits = model(x)                                               # (b, L, V)
        nats += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                reduction="sum").double()
        n_tok += y.numel()
        n_bytes += int(byte_len[y].sum())
    model.train(was_training)
    total = float(nats)
    if world > 1:
        total, n_tok, n_bytes = distributed.all_reduce_sum([total, n_tok, n_bytes])
        n_tok, n_bytes = int(n_tok), int(n_bytes)
    return EvalResult(loss=total / max(n_tok, 1), bpb=total / (math.log(2) * max(n_bytes, 1)),
                      tokens=n_tok, bytes=n_bytes)
