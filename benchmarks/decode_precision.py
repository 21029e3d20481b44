"""Weight-only int8 and bf16 decode against float32: tokens/s, weight bytes read per token, and
what the rounding does to the output, measured side by side in one run.

    python benchmarks/decode_precision.py [--shapes seed mamba-130m] [--batches 1 8]
                                          [--new-tokens 128] [--repeat 5]

Models with random weights in two shapes: the seed model (d_model 96, 2 layers, N 16, vocabulary
4,096) and mamba-130m's (d_model 768, 24 layers, N 16, vocabulary 50,280). Each decodes greedily
from the same 16-token prompt through `sonata.model.decode.Decoder(weights=...)`: the fused
Mamba-1 step reading its projections and head as float32, as int8 with one scale per output
(dequantized in the loop), or as bfloat16. The engines are interleaved (fp32, int8, bf16, fp32,
...) and each row is the median of --repeat runs after a warm-up. Columns:

  new tok/s       decoded tokens per second (batch x new tokens / seconds), the prompt excluded
  vs fp32         that over the float32 row's
  weight MB/token the projections' and head's bytes one step reads (scales included)
  GB/s            those bytes times steps per second: the bandwidth the step draws
  same greedy     the share of the new tokens equal to float32's greedy tokens (from the first
                  difference on, the sequences go their own ways)
  max |dlogit|    the largest logit difference from float32's on float32's own tokens (teacher
                  forcing: the same inputs every step), relative to the largest |logit|

The prompt runs once as the model's own float32 parallel forward in every row.
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

from sonata.core.config import ModelConfig  # noqa: E402
from sonata.model.decode import Decoder, sample_next  # noqa: E402
from sonata.model.lm import MambaLM  # noqa: E402

SHAPES = {"seed": dict(d_model=96, n_layers=2, d_state=16, vocab_size=4096),
          "mamba-130m": dict(d_model=768, n_layers=24, d_state=16, vocab_size=50280)}
WEIGHTS = ("fp32", "int8", "bf16")


def _decode(dec, prompt, new: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy: -> new ids (b, new) and every step's logits (copies)."""
    logits = dec.prefill(prompt)
    nxt = torch.empty(prompt.shape[0], dtype=torch.long)
    ids, seen = [], []
    with dec.threads():
        for i in range(new):
            seen.append(logits.clone())
            sample_next(logits, 0.0, out=nxt)
            ids.append(nxt.clone())
            if i + 1 < new:
                logits = dec._step(nxt)
    return torch.stack(ids, 1), seen


def _forced_error(model, prompt, ids, weights) -> float:
    """max |logits - float32's| / max |float32's|, feeding float32's own tokens `ids`."""
    ref, low = Decoder(model, prompt.shape[0]), Decoder(model, prompt.shape[0], weights=weights)
    a, b = ref.prefill(prompt).clone(), low.prefill(prompt).clone()
    worst, scale = 0.0, 0.0
    with torch.inference_mode():
        for t in range(ids.shape[1] - 1):
            a, b = ref.step(ids[:, t]).clone(), low.step(ids[:, t]).clone()
            worst, scale = max(worst, (a - b).abs().max().item()), max(scale, a.abs().max().item())
    return worst / scale


def _weight_bytes(dec) -> int:
    w = dec._weights
    return sum(a.nbytes for a in (w[3], w[6], w[7], w[11], w[12])) + \
        (sum(a.nbytes for a in w[14:19]) if dec.weights == "int8" else 0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    print(hardware_line())
    for shape in args.shapes:
        torch.manual_seed(0)
        model = MambaLM(ModelConfig(arch="mamba", **SHAPES[shape])).eval()
        for batch in args.batches:
            prompt = torch.randint(0, SHAPES[shape]["vocab_size"], (batch, 16),
                                   generator=torch.Generator().manual_seed(1))
            decs = {w: Decoder(model, batch, weights=w) for w in WEIGHTS}
            times = {w: [] for w in WEIGHTS}
            out = {}
            for w in WEIGHTS:                                   # warm-up (and compile)
                out[w] = _decode(decs[w], prompt, args.new_tokens)[0]
            for _ in range(args.repeat):
                for w in WEIGHTS:                               # interleaved
                    t0 = time.perf_counter()
                    _decode(decs[w], prompt, args.new_tokens)
                    times[w].append(time.perf_counter() - t0)
            rows, base = [], None
            for w in WEIGHTS:
                s = statistics.median(times[w])
                tps = batch * args.new_tokens / s
                base = base or tps
                mb = _weight_bytes(decs[w]) / 2**20
                same = (out[w] == out["fp32"]).float().mean().item()
                err = 0.0 if w == "fp32" else _forced_error(model, prompt, out["fp32"], w)
                rows.append([w, f"{tps:,.0f}", f"{tps / base:.2f}x", f"{mb:,.1f}",
                             f"{mb / 1024 * args.new_tokens / s:,.1f}", f"{100 * same:.1f}%", f"{err:.2e}"])
            print_table(["weights", "new tok/s", "vs fp32", "weight MB/token", "GB/s", "same greedy",
                         "max |dlogit|"], rows,
                        title=f"{shape} (d_model {SHAPES[shape]['d_model']}, {SHAPES[shape]['n_layers']} layers, "
                              f"{model.num_params():,} parameters), batch {batch}, {args.new_tokens} new tokens, "
                              f"median of {args.repeat}")


if __name__ == "__main__":
    main()
