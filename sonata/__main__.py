"""Command line: python -m sonata train | generate.

    python -m sonata train [--out DIR] [--resume CHECKPOINT] [key=value ...]
    python -m sonata generate CHECKPOINT [--prompt TEXT] [--n N] [--max-new-tokens N]

A user mistake (unknown key, bad value, missing or corrupt file, empty corpus,
unsafe checkpoint) ends with exit status 2 and one line starting `error:`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sonata.errors import SonataError, TrainingInterrupted

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        raise SonataError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m sonata", description="Train and sample a tiny Mamba LM.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    tr = sub.add_parser("train", help="train a model; writes DIR/metrics.jsonl and DIR/checkpoint.pt")
    tr.add_argument("--out", help="output folder (default: runs/<time>, or the resumed run's folder)")
    tr.add_argument("--resume", help="checkpoint to continue from")
    tr.add_argument("--progress", default=None, help="auto | bar | lines | none")
    tr.add_argument("overrides", nargs="*", help="config overrides as section.key=value")
    ge = sub.add_parser("generate", help="sample stories from a checkpoint")
    ge.add_argument("checkpoint")
    ge.add_argument("--prompt", default="Once upon a time")
    ge.add_argument("--n", type=int, default=3)
    ge.add_argument("--max-new-tokens", type=int, default=200)
    ge.add_argument("--temperature", type=float, default=0.8)
    ge.add_argument("--top-k", type=int, default=40)
    ge.add_argument("--seed", type=int, default=0)
    return p


def cmd_train(args) -> int:
    from sonata import checkpoint as ckpt
    from sonata.config import Config, apply_overrides
    from sonata.trainer import Trainer

    state = None
    if args.resume:
        state = ckpt.load(args.resume)
        cfg = Config.from_dict(state["config"])
    else:
        cfg = Config()
    apply_overrides(cfg, args.overrides)
    out = args.out or (str(Path(args.resume).parent) if args.resume
                       else f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    trainer = Trainer(cfg, out, state=state, progress=args.progress)
    summary = trainer.run()
    keys = ("steps", "tokens", "val_loss", "val_bpb", "tok_per_s_sustained", "backend", "fallbacks")
    print(json.dumps({k: summary[k] for k in keys}))
    print(f"wrote {out}/metrics.jsonl, {out}/checkpoint.pt and {out}/summary.json")
    return 0


def cmd_generate(args) -> int:
    from sonata.trainer import generate_text, load_model

    if args.n < 1 or args.max_new_tokens < 0:
        raise SonataError("--n must be >= 1 and --max-new-tokens >= 0")
    model, vocab, _ = load_model(args.checkpoint)
    for i, text in enumerate(generate_text(model, vocab, args.prompt, args.n, args.max_new_tokens,
                                           args.temperature, args.top_k, args.seed)):
        print(f"--- sample {i + 1}\n{text}")
    return 0


def main(argv=None) -> int:
    try:
        args = _parser().parse_args(argv)
        return {"train": cmd_train, "generate": cmd_generate}[args.command](args)
    except TrainingInterrupted as e:
        print(f"error: {e}", file=sys.stderr)
        return 128 + e.signum
    except SonataError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
