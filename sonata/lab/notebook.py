"""What the notebooks share beyond figures: their parameters' allowed ranges and the
check each notebook runs right after its `parameters` cell, whether a person is at
the other end of the kernel, and notebook 06's model loading and generation panel.

    from sonata.lab.notebook import check
    check("01_train_tinystories", globals())

stops the notebook with one line naming the parameter, its value and its range
(`ParameterError`; in Jupyter the line is all that is shown, no traceback). The
ranges live here, once: each notebook's parameters cell repeats them in its comments
(`name: type = value  # help (range a..b)`) and a test holds the two together.
"""
from __future__ import annotations

import html
import sys
from pathlib import Path

import torch

from sonata.core.config import PRESETS, TRAIN_DEFAULTS, make_config, parse_curriculum
from sonata.core.errors import ConfigError, SonataError
from sonata.lab.generate import load_text_model, stream_text
from sonata.lab.race import STUDY07
from sonata.lab.recall import RECALL_MODELS, TRACK_MODELS, TRACK_TASKS
from sonata.lab.ssd import RACE09
from sonata.lab.table5b import MODELS as TABLE5B_MODELS, TASKS as TABLE5B_TASKS
from sonata.train.trainer import Trainer


class ParameterError(SonataError, ValueError):
    """A notebook parameter outside its allowed range (one line, no traceback in Jupyter)."""

    def _render_traceback_(self):        # IPython shows these lines instead of a traceback
        return [f"error: {self}"]


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


class Range:
    """An int (or float) in lo..hi, both included; with `zero`, 0 too (a switch such as
    "0: all")."""

    def __init__(self, lo, hi, kind=int, zero: bool = False):
        self.lo, self.hi, self.kind, self.zero = lo, hi, kind, zero

    def describe(self) -> str:
        return ("0 or " if self.zero else "") + f"range {_num(self.lo)}..{_num(self.hi)}"

    def problem(self, v) -> str | None:
        types = (int, float) if self.kind is float else (int,)
        if isinstance(v, bool) or not isinstance(v, types):
            return f"is not {'a number' if self.kind is float else 'an integer'}"
        if not (self.lo <= v <= self.hi or (self.zero and v == 0)):
            return "is out of range"
        return None


class OneOf:
    def __init__(self, *choices):
        self.choices = choices

    def describe(self) -> str:
        return "one of " + " | ".join(map(str, self.choices))

    def problem(self, v) -> str | None:
        return None if v in self.choices else "is not allowed"


class Text:
    """Any string (a path, a data source): checked where it is used."""

    def describe(self) -> str:
        return "any text"

    def problem(self, v) -> str | None:
        return None if isinstance(v, str) else "is not text"


class ListOf:
    """A list of `min_len`..`max_len` items, each allowed by `item`."""

    def __init__(self, item, min_len: int = 1, max_len: int = 10):
        self.item, self.min_len, self.max_len = item, min_len, max_len

    def describe(self) -> str:
        return f"{self.min_len} to {self.max_len} values, each {self.item.describe()}"

    def problem(self, v) -> str | None:
        if not isinstance(v, (list, tuple)):
            return "is not a list"
        if not self.min_len <= len(v) <= self.max_len:
            return "has the wrong number of values"
        for x in v:
            what = self.item.problem(x)
            if what:
                return f"holds {x!r}, which {what}"
        return None


class CommaInts(ListOf):
    """A comma-separated list of integers given as text ("1,2,4")."""

    def describe(self) -> str:
        return f"comma-separated, {self.min_len} to {self.max_len} values, each {self.item.describe()}"

    def problem(self, v) -> str | None:
        if not isinstance(v, str):
            return "is not text"
        try:
            vals = [int(x) for x in v.split(",")]
        except ValueError:
            return "is not a comma-separated list of integers"
        return super().problem(vals)


class Curriculum:
    """A task curriculum as text: length:steps pairs, then a last length (task.curriculum)."""

    def describe(self) -> str:
        return "length:steps pairs, then a last length"

    def problem(self, v) -> str | None:
        if not isinstance(v, str):
            return "is not text"
        try:
            stages = parse_curriculum(v)
        except ConfigError:
            return "is not length:steps pairs then a last length"
        if not stages:
            return "is empty"
        if min(length for length, _ in stages) < 4:
            return "has a length under 4"
        return None


SEED = Range(0, 2**31 - 1)
THREADS = Range(0, 256)
MODEL = {"d_model": Range(1, 2048), "n_layers": Range(1, 64), "d_state": Range(1, 256),
         "seq_len": Range(1, 8192), "max_stories": Range(2, 10_000_000, zero=True)}   # 0: all; 1 leaves no validation story

RANGES = {
    "00_selective_scan_kernels": {
        "batch": Range(1, 64), "d_inner": Range(1, 4096), "d_state": Range(1, 256),
        "seq_len": Range(1, 8192), "seed": SEED,
        "time_sizes": ListOf(OneOf("small", "seed", "seed-b32", "large"), 1, 4),
        "time_repeat": Range(1, 100), "threads": Range(1, 256),
        "step_batches": ListOf(Range(1, 64), 1, 4), "step_rounds": Range(1, 20), "step_steps": Range(1, 100),
    },
    "01_train_tinystories": {
        "data_source": Text(), **MODEL, "vocab_size": Range(258, 65536, zero=True),   # 0: the data's default
        "seq_len": Range(1, 8192, zero=True),
        "max_steps": Range(1, 1_000_000, zero=True), "max_seconds": Range(1, 86_400, float, zero=True),
        "micro_batch": Range(0, 32), "effective_batch": Range(1, 4096, zero=True), "lr": Range(1e-6, 1.0, float, zero=True),
        "warmup_steps": Range(0, 1_000_000), "eval_every": Range(0, 1_000_000), "seed": SEED,
        "backend": OneOf("auto", "reference", "cpu", "triton"), "threads": THREADS,
        "n_samples": Range(0, 20), "sample_tokens": Range(1, 4096), "out_dir": Text(),
    },
    "02_autotuning": {
        "profile": OneOf("auto", "cpu", "laptop-8gb", "h200"),
        "candidates": CommaInts(Range(1, 256), 1, 16), "effective_batch": Range(1, 256),
        "sustained_profile": OneOf("cpu", "laptop-8gb", "h200"),
        "sustained_steps": Range(1, 100_000), "peak_micro": Range(1, 256), "peak_steps": Range(1, 10_000),
        "eval_every": Range(0, 100_000), **MODEL, "threads": THREADS, "seed": SEED,
        "scaling_processes": ListOf(Range(1, 8), 1, 4), "scaling_steps": Range(1, 10_000),
    },
    "03_memory_leak_reproduction": {
        "leak": OneOf("keep_graph", "keep_activations"), "steps": Range(1, 10_000),
        "micro_batch": Range(1, 256), "headroom_mb": Range(0, 1_000_000),
        "guarded_steps": Range(1, 100_000), **MODEL, "threads": THREADS, "out_dir": Text(),
    },
    "04_benchmark_correction": {
        "steps": Range(1, 10_000), "warmup": Range(0, 1000), "window": Range(1, 1000),
        "micro_batch": Range(1, 256), **MODEL, "threads": THREADS,
    },
    "05_contracting_dynamics": {
        "lrs": ListOf(Range(1e-6, 10.0, float), 1, 10), "max_steps": Range(1, 100_000),
        "micro_batch": Range(0, 256), "seq_len": MODEL["seq_len"], "d_model": MODEL["d_model"],
        "n_layers": MODEL["n_layers"], "d_state": MODEL["d_state"], "a_min": Range(1e-8, 1.0, float),
        "max_stories": MODEL["max_stories"], "seed": SEED,
    },
    "06_generate": {
        "checkpoint": Text(), "prompt": Text(), "max_new_tokens": Range(1, 4096),
        "temperature": Range(0.0, 5.0, float), "top_k": Range(0, 200_000), "seed": SEED,
        "n_samples": Range(1, 20), "fallback_steps": Range(1, 100_000), "out_dir": Text(),
    },
    "07_ten_minute_speedrun": {
        "budget_s": Range(1, 7200, float), "data_source": OneOf("embedded", "tinystories"),
        "configs": ListOf(OneOf(*STUDY07), 1, len(STUDY07)), "curve_points": Range(1, 100),
        "seed": SEED, "out_dir": Text(),
    },
    "08_selection": {
        "task_cap_s": Range(1, 7200, float), "induction_steps": Range(1, 1_000_000),
        "induction_curriculum": Curriculum(), "long_steps": Range(0, 100_000),
        "long_curriculum": Curriculum(), "long_cap_s": Range(1, 7200, float),
        "archs": ListOf(OneOf("mamba", "lti", "attention"), 1, 3),
        "ablations": ListOf(OneOf("default-dt", "fixed-64"), 0, 2),
        "test_lengths": ListOf(Range(16, 1 << 20), 1, 20), "long_lengths": ListOf(Range(16, 1 << 20), 0, 20),
        "n_test": Range(1, 4096), "n_long": Range(1, 4096), "attention_eval_s": Range(1, 86_400, float),
        "copy_region": Range(16, 8192), "copy_steps": Range(1, 1_000_000), "copy_cap_s": Range(1, 7200, float),
        "seed": SEED, "out_dir": Text(),
    },
    "09_mamba2_ssd": {
        "duality_length": Range(1, 1024), "heads": Range(1, 16), "headdim": Range(1, 256),
        "d_state": Range(1, 256), "chunk": Range(1, 1024), "block_length": Range(2, 512),
        "block_chunk": Range(1, 512), "block_state": Range(1, 64),
        "lengths": ListOf(Range(1, 16384), 1, 8), "quadratic_max": Range(1, 4096),
        "recurrence_max": Range(1, 16384), "time_repeat": Range(1, 100),
        "states": ListOf(Range(1, 256), 1, 8), "cost_length": Range(1, 8192),
        "race_models": ListOf(OneOf(*RACE09), 1, len(RACE09)), "race_steps": Range(1, 100_000),
        "race_d_model": Range(2, 1024), "race_layers": Range(2, 16), "race_seq_len": Range(8, 2048),
        "race_batch": Range(1, 64), "seed": SEED,
    },
    "10_recall_and_state": {
        "mqar_models": ListOf(OneOf(*RECALL_MODELS), 1, len(RECALL_MODELS)),
        "mqar_states": ListOf(Range(4, 128), 1, 4), "mqar_length": Range(8, 256), "mqar_vocab": Range(8, 8192),
        "mqar_d_model": OneOf(16, 32, 64, 128), "mqar_steps": Range(1, 1_000_000),
        "mqar_cap_s": Range(1, 7200, float), "mqar_ablation": OneOf(True, False), "track_tasks": ListOf(OneOf(*TRACK_TASKS), 1, len(TRACK_TASKS)),
        "track_models": ListOf(OneOf(*TRACK_MODELS), 1, len(TRACK_MODELS)), "track_length": Range(4, 1024),
        "track_lengths": ListOf(Range(1, 16384), 1, 10), "track_d_model": OneOf(16, 32, 64, 128),
        "track_d_state": Range(4, 128), "track_layers": Range(1, 4), "track_steps": Range(1, 1_000_000), "track_cap_s": Range(1, 7200, float),
        "spread_models": ListOf(OneOf(*TRACK_MODELS), 0, len(TRACK_MODELS)), "spread_seeds": ListOf(SEED, 0, 8),
        "n_test": Range(1, 4096), "seed": SEED, "out_dir": Text(),
    },
    "11_state_tracking_table": {
        "tasks": ListOf(OneOf(*TABLE5B_TASKS), 1, len(TABLE5B_TASKS)),
        "models": ListOf(OneOf(*TABLE5B_MODELS), 1, len(TABLE5B_MODELS)), "steps": Range(1, 1_000_000),
        "cap_s": Range(1, 7200, float), "length": Range(2, 1024), "test_lengths": ListOf(Range(2, 16384), 1, 8),
        "d_model": OneOf(16, 32, 64, 128), "d_state": OneOf(8, 16, 32, 64, 128), "n_test": Range(1, 4096),
        "seed": SEED, "spread_tasks": ListOf(OneOf(*TABLE5B_TASKS), 0, len(TABLE5B_TASKS)),
        "spread_seeds": ListOf(SEED, 0, 8), "out_dir": Text(),
    },
}


# Rules joining two parameters: (names, holds(*values), the line when it does not)
RULES = {
    "01_train_tinystories": [
        (("micro_batch", "effective_batch", "data_source"),
         lambda mb, eff, src: mb == 0 or (eff or _default_batch(src)) % mb == 0,
         "parameter micro_batch = {micro_batch} does not divide effective_batch = {effective_batch} "
         "(0, or a divisor of effective_batch; effective_batch 0 is the data's: 16 on the embedded "
         "corpus, 4 on real text)")],
    "02_autotuning": [
        (("candidates", "effective_batch", "profile"),
         lambda cs, eff, prof: any(eff % int(c) == 0 and int(c) <= _cap(prof) for c in cs.split(",")),
         "parameter candidates = {candidates!r} has no micro-batch that divides effective_batch = "
         "{effective_batch} within the cap of profile {profile!r} (1 always does)"),
        (("scaling_processes", "effective_batch"), lambda ps, eff: all(eff % p == 0 for p in ps),
         "parameter scaling_processes = {scaling_processes!r} has a process count that does not divide "
         "effective_batch = {effective_batch} (each process trains effective_batch / processes sequences)")],
    "10_recall_and_state": [
        (("mqar_vocab", "mqar_length"), lambda v, L: v // 2 - 1 >= L // 4,
         "parameter mqar_vocab = {mqar_vocab} has too few keys for mqar_length = {mqar_length}: its "
         "mqar_length / 4 pairs need distinct keys, mqar_vocab / 2 - 1 of them")],
    "09_mamba2_ssd": [
        (("race_models", "race_d_model"), lambda ms, d: d % 2 == 0 or not any(m.startswith("hybrid") for m in ms),
         "parameter race_d_model = {race_d_model} must be even for the hybrid row (attention rotates pairs "
         "of channels)")],
}


def _default_batch(data_source: str) -> int:
    """Notebook 01's effective batch when its parameter is 0: the data's (TRAIN_DEFAULTS)."""
    return TRAIN_DEFAULTS["embedded" if data_source == "embedded" else "real"]["train.effective_batch"]


def _cap(profile: str) -> int:
    """The largest micro-batch the autotuner may choose under `profile` (auto: the cpu
    preset's without a GPU, the smallest GPU preset's with one)."""
    if profile == "auto":
        profile = "laptop-8gb" if torch.cuda.is_available() else "cpu"
    return PRESETS[profile]["max_micro_batch"]


def problem(name: str, value, spec) -> str | None:
    """The one line for `name = value`, or None when `spec` allows it."""
    what = spec.problem(value)
    if what is None:
        return None
    return f"parameter {name} = {value!r} {what}; allowed: {spec.describe()}"


def check(notebook: str, values: dict) -> None:
    """Check every parameter of `notebook` found in `values` (a notebook passes
    `globals()`); raise ParameterError naming the first one outside its range."""
    ranges = RANGES[notebook]
    for name, spec in ranges.items():
        if name in values:
            line = problem(name, values[name], spec)
            if line:
                raise ParameterError(line)
    for needs, holds, says in RULES.get(notebook, ()):
        if all(n in values for n in needs) and not holds(*(values[n] for n in needs)):
            raise ParameterError(says.format(**{n: values[n] for n in needs}))


def interactive_frontend() -> bool:
    """True in a kernel driven by a person's frontend (JupyterLab, Notebook: they can
    answer `input()`), False under papermill, nbval or nbclient (they send every cell
    with `allow_stdin` off) and outside Jupyter."""
    ip = sys.modules.get("IPython")
    shell = ip.get_ipython() if ip is not None else None
    kernel = getattr(shell, "kernel", None)
    return bool(getattr(kernel, "_allow_stdin", False))


def project_path(path) -> Path:
    """A relative path taken from the project root: JupyterLab starts a notebook's kernel
    in notebooks/, papermill and `make` in the root; both mean the same file."""
    p = Path(path)
    if p.is_absolute():
        return p
    here = Path.cwd()
    root = here.parent if here.name == "notebooks" and (here.parent / "sonata").is_dir() else here
    return root / p


def load_or_train(checkpoint, fallback_steps: int = 200, fallback_dir="runs/06_generate"):
    """Model, vocabulary, config and one line saying where they came from: `checkpoint`
    when it exists; otherwise a small model trained now with the seed configuration for
    `fallback_steps` steps into `fallback_dir` (reused when a previous fallback left one)."""
    path, fallback = project_path(checkpoint), project_path(fallback_dir) / "checkpoint.pt"
    shown = Path(fallback_dir) / "checkpoint.pt"         # paths as given, for the lines below
    if path.exists():
        model, vocab, cfg = load_text_model(path)
        return model, vocab, cfg, f"loaded {checkpoint}"
    if fallback.exists():
        model, vocab, cfg = load_text_model(fallback)
        return model, vocab, cfg, f"{checkpoint} is missing; loaded the small model trained earlier in {shown}"
    print(f"{checkpoint} is missing (notebook 01 and `make train` write it): training a small model "
          f"for {fallback_steps} steps into {fallback_dir} first")
    trainer = Trainer(make_config([f"train.max_steps={fallback_steps}", "train.eval_every=0"]), fallback.parent)
    s = trainer.run()
    model, vocab, cfg = load_text_model(fallback)
    return model, vocab, cfg, (f"{checkpoint} is missing; trained a small model instead: {s['steps']} steps, "
                               f"validation {s['val_bpb']:.2f} bits per byte, saved to {shown}")


def generation_panel(model, vocab, prompt: str = "Once upon a time", max_new_tokens: int = 120,
                     temperature: float = 0.8, top_k: int = 40, seed: int = 0):
    """An ipywidgets panel: prompt box, temperature, top-k, number of tokens and seed,
    a Generate button, and the story appearing token by token below them."""
    import ipywidgets as w          # the notebooks extra; only this panel needs it

    box = w.Textarea(value=prompt, description="prompt", layout=w.Layout(width="95%"))
    temp = w.FloatSlider(value=temperature, min=0.0, max=2.0, step=0.05, description="temperature")
    topk = w.IntSlider(value=top_k, min=0, max=len(vocab), description="top-k")
    n_tok = w.IntSlider(value=max_new_tokens, min=1, max=1000, description="tokens")
    seed_box = w.IntText(value=seed, description="seed")
    button = w.Button(description="Generate", button_style="primary")
    story = w.HTML(value="", layout=w.Layout(width="95%"))
    status = w.Label(value="")
    story.add_class("sonata-story")
    status.add_class("sonata-status")

    def show(prompt_text: str, generated: str) -> None:
        story.value = (f"<div style='white-space: pre-wrap'><b>{html.escape(prompt_text)}</b>"
                       f"{html.escape(generated)}</div>")

    def generate(_=None):
        button.disabled = True
        status.value = "generating..."
        text, n = "", 0
        try:
            for piece in stream_text(model, vocab, box.value, n_tok.value, temp.value, topk.value, seed_box.value):
                text, n = text + piece, n + 1
                show(box.value, text)
            status.value = f"done: {n} pieces, seed {seed_box.value}"
        finally:
            button.disabled = False

    button.on_click(generate)
    panel = w.VBox([box, w.HBox([temp, topk]), w.HBox([n_tok, seed_box]), w.HBox([button, status]), story])
    panel.generate = generate      # the same action as a click, for tests and scripts
    panel.story, panel.status = story, status
    return panel
