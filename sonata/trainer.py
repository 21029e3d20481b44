"""The training loop: one `Trainer` from config to checkpoint.

Each optimizer step draws `effective_batch` windows at once from the device-side
sampler and splits them into micro-batches (so the data order does not depend on
the micro-batch), accumulates gradients with the loss scaled by 1/accumulation,
clips, sets the learning rate from the warm-up + cosine schedule (a pure function
of the step, so resume needs no scheduler object), and steps AdamW. Every
`log_every` steps a row goes to `metrics.jsonl`; validation reports loss per token
and bits per byte over the whole validation split.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.nn.functional as F

from sonata import checkpoint as ckpt
from sonata import kernels
from sonata.config import Config
from sonata.data import BatchSampler, Corpus, Vocab, build_corpus, h2d, val_batches
from sonata.errors import CheckpointError, ConfigError, TrainingDiverged
from sonata.model import MambaLM, param_groups
from sonata.progress import Progress

MEASURE_SKIP = 2   # steps excluded from sustained tokens/s (compilation, allocator warm-up)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available")
    return torch.device(name)


def lr_at(step: int, t) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up, cosine to min_lr."""
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.max_steps - t.warmup_steps)
    frac = min(1.0, (step - t.warmup_steps) / span)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)),
                       "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                       "gauss": float(np_state[4])}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    mi = psutil.Process().memory_info()
    return int(getattr(mi, "peak_wset", 0) or _ru_maxrss() or mi.rss)


def _ru_maxrss() -> int:
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (ImportError, OSError):
        return 0


@dataclass
class EvalResult:
    loss: float       # nats per token
    bpb: float        # bits per UTF-8 byte
    tokens: int
    bytes: int


class Trainer:
    """trainer = Trainer(cfg, out_dir); trainer.run() -> summary dict."""

    def __init__(self, cfg: Config, out_dir=None, state: dict | None = None, progress: str | None = None):
        self.cfg = cfg.validate()
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.device = resolve_device(t.device)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.progress_mode = progress
        vocab = Vocab.from_state_dict(state["vocab"]) if state else None
        self.corpus: Corpus = build_corpus(cfg.data, self.device, vocab=vocab)
        cfg.model.vocab_size = len(self.corpus.vocab)
        seed_everything(t.seed)
        self.model = MambaLM(cfg.model).to(self.device)
        self.optimizer = torch.optim.AdamW(param_groups(self.model, t.weight_decay), lr=t.lr,
                                           betas=(0.9, 0.95), eps=1e-8)
        self.sampler = BatchSampler(self.corpus.train, cfg.data.seq_len, seed=t.seed)
        self.step = 0
        self.tokens = 0
        self.history: list[dict] = []
        self._byte_len = torch.from_numpy(self.corpus.vocab.byte_lengths).to(self.device)
        if state:
            self._load_state(state)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": {"kind": "warmup_cosine", "step": self.step},
                "step": self.step, "tokens": self.tokens, "sampler": self.sampler.state_dict(),
                "rng": rng_state(), "vocab": self.corpus.vocab.state_dict(),
                "config": self.cfg.to_dict()}

    def _load_state(self, state: dict) -> None:
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.sampler.load_state_dict(state["sampler"])
            self.step, self.tokens = int(state["step"]), int(state["tokens"])
            set_rng_state(state["rng"])
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            raise CheckpointError(f"checkpoint does not match this configuration: {str(e).splitlines()[0][:200]}") from None

    def save_checkpoint(self, path=None) -> Path:
        path = Path(path) if path else self.out_dir / "checkpoint.pt"
        return ckpt.save(self.state_dict(), path)

    # ------------------------------------------------------------------ steps
    def train_step(self) -> dict:
        t, model = self.cfg.train, self.model
        mb, acc = t.micro_batch, t.accumulation
        t0 = time.perf_counter()
        model.train()
        x, y = self.sampler.draw(t.effective_batch)                     # (eb, L) each
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for i in range(acc):
            xb, yb = x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb]
            logits = model(xb)                                          # (mb, L, V)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), yb.reshape(-1))
            (loss / acc).backward()
            loss_sum += loss.detach()
        clip = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        lr = lr_at(self.step, t)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        loss_val = float(loss_sum / acc)                                # synchronizes the device
        dt = time.perf_counter() - t0
        n_tok = t.effective_batch * self.cfg.data.seq_len
        self.step += 1
        self.tokens += n_tok
        return {"step": self.step, "loss": loss_val, "lr": lr, "tokens": self.tokens,
                "tok_per_s": n_tok / dt, "step_s": dt, "grad_norm": float(grad_norm),
                "fallbacks": kernels.fallback_count()}

    @torch.no_grad()
    def evaluate(self, max_tokens: int | None = None) -> EvalResult:
        t = self.cfg.train
        self.model.eval()
        nats = torch.zeros((), dtype=torch.float64, device=self.device)
        n_tok = n_bytes = 0
        limit = t.eval_tokens if max_tokens is None else max_tokens
        for x, y in val_batches(self.corpus.val, self.cfg.data.seq_len, max(16, t.micro_batch), limit):
            logits = self.model(x)
            nats += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                    reduction="sum").double()
            n_tok += y.numel()
            n_bytes += int(self._byte_len[y].sum())
        self.model.train()
        total = float(nats)
        return EvalResult(loss=total / max(n_tok, 1), bpb=total / (math.log(2) * max(n_bytes, 1)),
                          tokens=n_tok, bytes=n_bytes)

    # ------------------------------------------------------------------ loop
    def _open_metrics(self):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / "metrics.jsonl"
        kept = []
        if self.step and path.exists():   # resuming: drop rows past the checkpoint's step
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row.get("step", 0) <= self.step:
                    kept.append(line)
        f = open(path, "w")
        for line in kept:
            f.write(line + "\n")
        return f

    def run(self) -> dict:
        t = self.cfg.train
        metrics = self._open_metrics() if self.out_dir else None
        kernels.reset_fallback_count()
        h2d_start = h2d.bytes
        t_start = time.perf_counter()
        measured_tokens, measured_s = 0, 0.0
        last_eval: EvalResult | None = None
        bar = Progress(t.max_steps - self.step, "train", self.progress_mode)
        try:
            while self.step < t.max_steps:
                row = self.train_step()
                row["h2d_bytes"] = h2d.bytes - h2d_start
                h2d_start = h2d.bytes
                if len(self.history) >= MEASURE_SKIP:
                    measured_tokens += t.effective_batch * self.cfg.data.seq_len
                    measured_s += row["step_s"]
                if not math.isfinite(row["loss"]):
                    raise TrainingDiverged(f"non-finite loss at step {self.step}; lower train.lr or check the data")
                final = self.step == t.max_steps
                if (t.eval_every and self.step % t.eval_every == 0) or final:
                    last_eval = self.evaluate()
                    row.update(val_loss=last_eval.loss, val_bpb=last_eval.bpb)
                self.history.append(row)
                if metrics and (self.step % t.log_every == 0 or final or "val_loss" in row):
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
                if self.out_dir and t.checkpoint_every and self.step % t.checkpoint_every == 0 and not final:
                    self.save_checkpoint()
                post = {"loss": row["loss"], "tok/s": round(row["tok_per_s"])}
                if "val_bpb" in row:
                    post["val_bpb"] = row["val_bpb"]
                bar.update(1, **post)
        finally:
            bar.close()
            if metrics:
                metrics.close()
        if last_eval is None:
            last_eval = self.evaluate()
        summary = {
            "steps": self.step, "tokens": self.tokens,
            "wall_s": time.perf_counter() - t_start,
            "tok_per_s_sustained": measured_tokens / measured_s if measured_s else None,
            "sustained_excludes_steps": MEASURE_SKIP,
            "val_loss": last_eval.loss, "val_bpb": last_eval.bpb,
            "val_tokens": last_eval.tokens, "val_bytes": last_eval.bytes,
            "params": self.model.num_params(),
            "device": str(self.device), "threads": torch.get_num_threads(),
            "backend": kernels.resolve_backend(self.cfg.model.backend,
                                               self.corpus.train.new_zeros(1, dtype=torch.float32))[0],
            "fallbacks": kernels.fallback_count(),
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "precision": t.precision,
            "data": self.corpus.summary(),
        }
        if self.out_dir:
            self.save_checkpoint()
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary


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


