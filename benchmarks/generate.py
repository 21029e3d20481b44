"""Generation speed: sonata against transformers' MambaForCausalLM on the same weights.

    python benchmarks/generate.py [--ckpt CHECKPOINT|DIR] [--new-tokens 256] [--batches 1 16]
                                  [--prompt-len 100] [--threads 2] [--repeat 3]

The sonata model (a checkpoint, or the seed configuration with random weights) is
exported with sonata.interop.hf into a temporary folder and loaded from there by
transformers, so both run the same weights. Greedy decoding (argmax), so the two
must produce the same ids: the table says whether they did. Rows:

  sonata            MambaLM.generate: the prompt in one parallel pass, then the
                    Decoder (on CPU in float32: one fused numba call per step,
                    sonata.kernels.selective.decode_cpu; else preallocated torch buffers)
  sonata reference  MambaLM.generate_reference: the prompt token by token, new state
                    tensors per step (the path generation took before)
  transformers      MambaForCausalLM.generate with its cache (use_cache=True), at 1 thread
                    and at --threads; the ratios use its faster setting

sonata's decode step runs on one thread for small models whatever --threads says
(sonata.model.decode.Decoder: the fused step is single-threaded, and the torch step's thread
fork/join costs more than its tiny ops).

New tokens/s exclude the prompt; time to first token is prompt in -> first new id
out, for one prompt of --prompt-len tokens. Median of --repeat runs after a warm-up.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import hardware_line, print_table  # noqa: E402

from sonata.core.config import ModelConfig  # noqa: E402
from sonata.interop.hf import export_hf  # noqa: E402
from sonata.lab.generate import load_model  # noqa: E402
from sonata.model.lm import MambaLM  # noqa: E402


def _median_s(fn, repeat: int) -> float:
    fn()                                                    # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default=None, help="checkpoint or exported folder (default: random seed model)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=100, help="prompt length for time to first token")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-reference", action="store_true", help="skip the slow token-by-token row")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    torch.manual_seed(0)
    if args.ckpt:
        model, _, _ = load_model(args.ckpt)
        what = args.ckpt
    else:
        model, what = MambaLM(ModelConfig(vocab_size=512)).eval(), "seed configuration, random weights"
    tmp = tempfile.mkdtemp(prefix="sonata_hf_")
    export_hf(model, None, tmp)
    hf = transformers.MambaForCausalLM.from_pretrained(tmp).eval()
    vocab = model.cfg.vocab_size
    print(hardware_line("cpu"))
    print(f"model: {what}; {model.num_params():,} parameters; transformers {transformers.__version__}; "
          f"{args.threads} threads; greedy; {args.new_tokens} new tokens")

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():                                   # same weights: same logits
        probe = torch.randint(0, vocab, (2, 32), generator=g)
        dlogit = (model(probe) - hf(probe).logits).abs().max().item()
    torch.set_num_threads(args.threads)   # again: numba's pool resets it at its first call

    def ours(p):
        return model.generate(p, args.new_tokens, temperature=0)

    def reference(p):
        return model.generate_reference(p, args.new_tokens, temperature=0)

    def theirs(p):
        with torch.no_grad():
            return hf.generate(p, max_new_tokens=args.new_tokens, do_sample=False, use_cache=True,
                               eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(p))

    rows, speed = [], {}
    for b in args.batches:
        p = torch.randint(0, vocab, (b, 16), generator=g)
        same = torch.equal(ours(p), theirs(p))
        torch.set_num_threads(args.threads)
        runs = [("sonata", ours, args.threads)] + \
            ([] if args.no_reference else [("sonata reference", reference, args.threads)]) + \
            [("transformers", theirs, n) for n in sorted({1, args.threads})]
        for name, fn, n in runs:
            torch.set_num_threads(n)
            s = _median_s(lambda: fn(p), args.repeat)
            speed[name, b] = max(speed.get((name, b), 0.0), b * args.new_tokens / s)  # its best setting
            rows.append([name, n, b, f"{b * args.new_tokens / s:,.0f}", f"{s / args.new_tokens * 1e3:.3f}",
                         "yes" if same else "NO"])
        torch.set_num_threads(args.threads)
    print_table(["implementation", "threads", "batch", "new tok/s", "ms/step", "same ids as transformers"], rows,
                title=f"generation, {args.new_tokens} new tokens after a 16-token prompt "
                      f"(max |logit difference| {dlogit:.1e})")

    p = torch.randint(0, vocab, (1, args.prompt_len), generator=g)
    first = [("sonata", lambda: model.generate(p, 1, temperature=0)),
             ("transformers", lambda: hf.generate(p, max_new_tokens=1, do_sample=False, use_cache=True,
                                                  eos_token_id=None, pad_token_id=0,
                                                  attention_mask=torch.ones_like(p)))]
    if not args.no_reference:
        first.insert(1, ("sonata reference", lambda: model.generate_reference(p, 1, temperature=0)))
    ttft = {}
    for name, fn in first:
        with torch.no_grad():
            ttft[name] = _median_s(fn, max(args.repeat, 5))
    print_table(["implementation", "time to first token (ms)"],
                [[n, f"{s * 1e3:.2f}"] for n, s in ttft.items()],
                title=f"time to first token, batch 1, {args.prompt_len}-token prompt")

    ratios = []                       # against transformers at its faster thread setting
    for b in args.batches:
        ratios.append([b, f"{speed['sonata', b] / speed['transformers', b]:.1f}x"] +
                      ([f"{speed['sonata', b] / speed['sonata reference', b]:.1f}x"]
                       if not args.no_reference else []))
    print_table(["batch", "sonata / transformers"] + ([] if args.no_reference else ["sonata / reference"]),
                ratios, title="speed-ups measured in this run")


if __name__ == "__main__":
    main()
