"""Every hyper-parameter, in dataclasses: the one source of configuration.

The command line, the notebooks and the tests use the same dotted names
(`model.d_model=64`, `train.max_steps=20`); `apply_overrides` parses them
against the dataclass field types and `Config.validate` checks the values, so
a typo or a bad value is a `ConfigError` naming the key, never a silent default.
`Config.validate` checks each key's own range and writes nothing; what the block
families need of the model keys (model.arch and model.layers naming a family,
Mamba-2's head layout, attention's heads, ...) is the family table's check
(`sonata.model.families.validate`: this, then the families'), which the Trainer,
the model builders and the importers run before anything is built or written.
"""
from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass, field, fields

from sonata.core.errors import ConfigError


PRECISIONS = ("fp32", "fp16", "bf16", "int8")
FLOAT32_MAX = 3.4028234663852886e38     # the largest finite float32
INT32_MAX = 2**31 - 1                   # every integer setting fits an int32 (a size a typo made stops here)
MAX_EMBED_STD = 1e4     # model.embed_std's ceiling: far past any init in use, and every model trains finite at it


@dataclass
class ModelConfig:
    arch: str = "mamba"         # mamba | lti (time-invariant ablation: delta, B, C parameters) | attention (RoPE)
                                # | gpt2 (transformers' GPT2LMHeadModel: the race's baseline, benchmarks/race.py)
    d_model: int = 96
    n_layers: int = 2
    d_state: int = 16
    expand: int = 2
    d_conv: int = 4
    dt_rank: int = 0            # 0: ceil(d_model / 16), as in the reference implementation
    dt_min: float = 1e-3
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    vocab_size: int = 0         # 0: taken from the vocabulary when the model is built
    backend: str = "auto"       # selective-scan backend: auto | reference | cpu | triton
    a_param: str = "log"        # log: A = -exp(A_log), contracting by construction; direct: A is the parameter
    a_constraint: bool = False  # after each optimizer step, project A <= -a_min (every exp(delta*A) < 1)
    a_min: float = 1e-4
    norm_eps: float = 1e-5      # RMSNorm epsilon (transformers' layer_norm_epsilon)
    n_heads: int = 4            # model.arch=attention / gpt2: heads (attention: d_model / n_heads must be even)
    headdim: int = 32           # mamba2: channels per SSD head (d_inner / headdim heads)
    ngroups: int = 1            # mamba2: groups of B and C, shared by nheads / ngroups heads each
    chunk_size: int = 64        # mamba2, mamba3: the SSD's chunk length (the result does not depend on it)
    rope_fraction: float = 0.5  # mamba3: the share of the state rotated by data-dependent angles (0: no rotation)
    trapezoid: bool = True      # mamba3: the exponential-trapezoidal update (false: exponential Euler)
    bounded_angle: float = 0.0  # mamba3: 0 the form's step angle; g > 0: pi sigmoid(g theta),
                                # within (0, pi), saturating at 0 and a half turn (notebook 10's half-turn row)
    mamba3_form: str = "released"  # mamba3: released (mamba_ssm's Mamba3: pi tanh(theta) dt angles shared by
                                # the heads, A = -heavy_tail(a)) | paper (sonata's first reading of the
                                # paper: per-head angle Delta theta, biased A and lambda, Mamba-2's gated norm)
    mimo_rank: int = 1          # mamba3 released: 1 SISO, R > 1 MIMO of rank R (mamba_ssm's mimo_rank)
    outproj_norm: bool = False  # mamba3 released: a per-head RMSNorm before the gate (mamba_ssm's is_outproj_norm)
    allow_neg_eigval: bool = False  # gdn: beta = 2 sigmoid(b), so the delta rule's transition has eigenvalues
                                # in (-1, 1] (fla's allow_neg_eigval; Grazzi et al. 2025): parity needs them
    tie_embeddings: bool = True # the output head shares the embedding's weight (false: its own, nn.Linear's init)
    embed_std: float = 0.02     # the embedding's initial standard deviation (mamba_ssm's 0.02; 1.0: unit-variance inputs)
    layers: str = ""            # a hybrid stack, one block per layer: e.g. mamba2,mamba2,attention,mamba2
                                # (sets n_layers, and arch: the one kind, or hybrid); "": n_layers of arch

    def __setattr__(self, name, value):
        """Setting `layers` (a hybrid stack) sets what it implies: n_layers (one per entry) and arch
        (the one family, or hybrid). Config.validate refuses a later n_layers or arch that
        contradicts it; validation itself writes nothing."""
        object.__setattr__(self, name, value)
        if name == "layers" and isinstance(value, str) and value:
            kinds = self.kinds
            object.__setattr__(self, "n_layers", len(kinds))
            object.__setattr__(self, "arch", kinds[0] if len(set(kinds)) == 1 else "hybrid")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def kinds(self) -> tuple[str, ...]:
        """The block of each layer: `layers` split, or n_layers times arch."""
        if self.layers:
            return tuple(k.strip() for k in self.layers.split(","))
        return (self.arch,) * self.n_layers

    @property
    def layer_counts(self) -> dict[str, int]:
        """How many layers of each block, in order of first use, without listing every layer (a
        depth a typo made, 10^9, is one entry)."""
        if self.layers:
            counts: dict[str, int] = {}
            for k in self.kinds:
                counts[k] = counts.get(k, 0) + 1
            return counts
        return {self.arch: self.n_layers}

    @property
    def nheads(self) -> int:
        """mamba2: SSD heads, d_inner / headdim."""
        return self.d_inner // self.headdim if self.headdim > 0 else 0

    @property
    def effective_dt_rank(self) -> int:
        """Mamba-1's dt_proj rank: model.dt_rank, or ceil(d_model / 16) when it is 0 (automatic)."""
        return self.dt_rank or math.ceil(self.d_model / 16)


@dataclass
class DataConfig:
    source: str = "embedded"    # embedded | tinystories | a path to .txt / .parquet / folder
    vocab_size: int = 512       # compact vocabulary, total: 256 bytes + specials + most frequent tokens
    seq_len: int = 128
    val_fraction: float = 0.1
    max_stories: int = 0        # 0: all; otherwise the first N stories of the source's train split
    cache_dir: str = ""         # token caches live here; "": $XDG_CACHE_HOME/sonata or ~/.cache/sonata


@dataclass
class TrainConfig:
    max_steps: int = 1000       # optimizer steps; under train.max_seconds a cap (0: none): the first to end wins
    max_seconds: float = 0.0    # time budget: seconds inside optimizer steps (not setup, evaluation or checkpoints: the summary's setup_s, eval_s, checkpoint_s), lr over their fraction; 0: off
    micro_batch: int = 0        # sequences per forward/backward; 0: the profile's choice
    effective_batch: int = 0    # sequences per optimizer step (micro x accumulation); 0: the profile's
    autotune: bool = False      # measure the profile's candidate micro-batches first, train with the fastest that fits
    fixed_micro_batch: int = 0  # N > 0: micro-batch N, no autotuner and no cap (peak micro-benchmarks)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta2: float = 0.95         # AdamW's second-moment decay (beta1 0.9)
    grad_clip: float = 1.0
    seed: int = 0
    precision: str = "auto"     # auto (the profile's) | fast (bf16 on a CPU with native bf16: AVX-512 BF16 or AMX; else auto) | fp32 | fp16 (autocast + GradScaler) | bf16 (autocast) | int8 (fake-quant weights)
    decay_steps: int = 0        # cosine horizon; 0: train.max_steps (set it to extend a run exactly)
    max_nonfinite: int = 5      # consecutive non-finite steps (skipped) before training stops
    eval_every: int = 100       # 0: only at the end
    eval_tokens: int = 0        # 0: the whole validation split
    checkpoint_every: int = 0   # also checkpoint every N steps; 0: by time only
    checkpoint_every_s: float = 120.0   # checkpoint when this many seconds passed since the last; 0: off
    keep_checkpoints: int = 0   # also keep the last K periodic checkpoints as checkpoint-step<N>.pt; 0: none
    log_every: int = 1          # metrics.jsonl row every N steps
    tensorboard: bool = False   # also write every metrics row as TensorBoard scalars under the run folder
    threads: int = 0            # torch intra-op threads; 0: leave as is
    device: str = "auto"        # auto | cpu | cuda


@dataclass
class ProfileConfig:
    """Which hardware profile caps the run, and overrides of its fields (0 / "": the preset's)."""
    name: str = "auto"          # auto (by device) | cpu | laptop-8gb | h200
    memory_budget_mb: int = 0   # the fuse: resident set (CPU) or device memory (CUDA) may not pass it
    max_micro_batch: int = 0    # the cap on the micro-batch (train.fixed_micro_batch ignores it)
    effective_batch: int = 0    # default for train.effective_batch
    candidates: str = ""        # micro-batches the autotuner measures, e.g. "1,2,4,8"
    precision: str = ""         # what train.precision=auto means under this profile


MODULAR = ("modsum", "arith", "arith_brackets")      # the tasks task.modulus applies to
TASKS = ("induction", "copying", "mqar", "parity", "modsum", "arith", "arith_brackets")


@dataclass
class TaskConfig:
    """A synthetic task of the Mamba papers instead of language modeling (sonata.data.tasks): fresh
    sequences of length data.seq_len every step, the loss on the answer positions only."""
    name: str = ""              # "": language modeling on data.*; induction | copying | mqar | parity | modsum
                                # | arith | arith_brackets (modular arithmetic without / with brackets)
    n_data: int = 16            # copying: data tokens per sequence (data.seq_len = noise region + n_data)
    vocab_size: int = 8192      # mqar: keys 1..V/2-1, values V/2..V-1, 0 the filler (8192: the Mamba-2 paper's)
    n_pairs: int = 0            # mqar: key-value pairs per sequence (0: a quarter of each length, the paper's T/4)
    mix_pairs: bool = False     # mqar: each training batch draws D, D/2, D/4 or D/8 pairs (Zoology's mix); scored at D
    modulus: int = 5            # modsum, arith, arith_brackets: numbers 0..m-1, the answer mod m
    running: bool = False       # parity, modsum, arith: the loss at every prefix's answer, not the last only
    curriculum: str = ""        # "L:S,L:S,...,L": S steps at length L, then the next; the last length to the end ("": data.seq_len)
    eval_seqs: int = 256        # validation: this many fixed sequences at data.seq_len
    eval_seed: int = 1234       # the validation set's seed (test sets: see `python -m sonata eval --lengths`)


@dataclass
class DebugConfig:
    """Switches for reproducing bugs. Never on by default; every metrics row names them when on."""
    leak: str = "none"          # none | keep_graph (each step's loss kept with its graph) | keep_activations


@dataclass(frozen=True)
class Profile:
    """What a machine may do: the resolved form of a preset plus `profile.*` overrides."""
    name: str
    memory_budget_mb: int
    max_micro_batch: int
    effective_batch: int
    candidates: tuple
    precision: str
    budget_source: str = "preset"   # preset | override | "50% of available RAM" ...

    @property
    def memory_budget_bytes(self) -> int:
        return self.memory_budget_mb * 2**20

    def to_dict(self) -> dict:
        return asdict(self)


DEFAULT_CANDIDATES = (1, 2, 4, 6, 8, 12, 16, 24, 32)
CPU_BUDGET_FRACTION = 0.5   # the cpu preset's budget: this fraction of the RAM available at start

# memory_budget_mb 0 in a preset: computed from the machine (see resolve_profile).
PRESETS = {
    "cpu": dict(memory_budget_mb=0, max_micro_batch=32, effective_batch=16,
                candidates=DEFAULT_CANDIDATES, precision="fp32"),
    # an 8 GiB laptop GPU: 7 GiB for us, the rest for the display and the driver
    "laptop-8gb": dict(memory_budget_mb=7 * 1024, max_micro_batch=8, effective_batch=16,
                       candidates=DEFAULT_CANDIDATES, precision="fp16"),
    "h200": dict(memory_budget_mb=128 * 1024, max_micro_batch=256, effective_batch=256,
                 candidates=DEFAULT_CANDIDATES + (48, 64, 96, 128, 192, 256), precision="bf16"),
}


def resolve_profile(section: "ProfileConfig", device_type: str, available_bytes: int,
                    device_total_bytes: int = 0) -> Profile:
    """The Profile for this machine. `available_bytes`: RAM available now (CPU budget);
    `device_total_bytes`: the GPU's memory (CUDA), which also picks the preset for `auto`."""
    name = section.name
    if name == "auto":
        name = "cpu" if device_type != "cuda" else (
            "h200" if device_total_bytes >= 64 * 2**30 else "laptop-8gb")
    p = dict(PRESETS[name])
    source = "preset"
    if p["memory_budget_mb"] == 0:
        p["memory_budget_mb"] = max(1, int(available_bytes * CPU_BUDGET_FRACTION) // 2**20)
        source = f"{CPU_BUDGET_FRACTION:.0%} of the RAM available at start"
    elif device_type == "cuda" and device_total_bytes:
        cap = int(device_total_bytes * 0.95) // 2**20
        if p["memory_budget_mb"] > cap:
            p["memory_budget_mb"], source = cap, "95% of the device's memory"
    if section.memory_budget_mb:
        p["memory_budget_mb"], source = section.memory_budget_mb, "profile.memory_budget_mb"
    if section.max_micro_batch:
        p["max_micro_batch"] = section.max_micro_batch
    if section.effective_batch:
        p["effective_batch"] = section.effective_batch
    if section.candidates:
        p["candidates"] = parse_candidates(section.candidates)
    if section.precision:
        p["precision"] = section.precision
    return Profile(name=name, budget_source=source, **p)


def parse_curriculum(text: str) -> list[tuple[int, int]]:
    """task.curriculum "64:8000,256:3000,1024" -> [(64, 8000), (256, 3000), (1024, 0)]: the
    first 8,000 optimizer steps at length 64, the next 3,000 at 256, the rest at 1,024 (the
    last length has no step count: it runs to the end)."""
    if not text.strip():
        return []
    out = []
    items = [v.strip() for v in text.split(",")]
    for i, item in enumerate(items):
        length, _, steps = item.partition(":")
        last = i == len(items) - 1
        try:
            pair = (int(length), int(steps) if steps else 0)
        except ValueError:
            pair = None
        if pair is None or pair[0] < 1 or (not last and pair[1] < 1) or (last and steps):
            raise ConfigError(f"bad value for task.curriculum: {text!r} (length:steps pairs, then a last "
                              f"length without steps, e.g. 64:8000,256:3000,1024)")
        out.append(pair)
    return out


def parse_candidates(text: str) -> tuple:
    try:
        vals = tuple(sorted({int(v) for v in text.replace(" ", "").split(",") if v}))
    except ValueError:
        raise ConfigError(f"bad value for profile.candidates: {text!r} is not a comma-separated "
                          f"list of integers") from None
    if not vals or min(vals) < 1:
        raise ConfigError(f"bad value for profile.candidates: {text!r} (positive integers, e.g. 1,2,4,8)")
    return vals


LEAKS = ("none", "keep_graph", "keep_activations")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    task: TaskConfig = field(default_factory=TaskConfig)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """A saved config (a checkpoint's, an export's): every key known, every value of its
        field's type (an int for a float), else a ConfigError naming the key. A model section
        without model.mamba3_form was saved before the released Mamba-3 existed: its form is
        the paper form, so an old Mamba-3 checkpoint resumes as the model it was."""
        cfg = cls()
        if not isinstance(d, dict):
            raise ConfigError(f"a config is a mapping of sections, not a {type(d).__name__}")
        for section, values in d.items():
            sub = _section(cfg, section)
            if not isinstance(values, dict):
                raise ConfigError(f"config section {section!r} is a {type(values).__name__}, not a mapping")
            hints = typing.get_type_hints(type(sub))
            for k, v in values.items():
                if k not in hints:
                    raise ConfigError(f"unknown config key {section}.{k}")
                if isinstance(v, str) and hints[k] is not str:
                    raise ConfigError(f"bad value for {section}.{k}: {v!r} is not {_a(hints[k])}")
                set_value(cfg, f"{section}.{k}", v)
        if "mamba3_form" not in d.get("model", {"mamba3_form": None}):
            cfg.model.mamba3_form = "paper"     # saved before the released form: its Mamba-3 was the paper form
        return cfg.validate()

    def validate(self) -> "Config":
        m, d, t = self.model, self.data, self.train
        for section in fields(self):            # inf or nan passes a range check and makes a NaN model
            for f in fields(getattr(self, section.name)):
                v, key = getattr(getattr(self, section.name), f.name), f"{section.name}.{f.name}"
                _check(not isinstance(v, float) or math.isfinite(v) or key == "train.max_seconds",  # (its own)
                       f"{key} must be a finite number, not {v!r}")
                _check(not isinstance(v, int) or isinstance(v, bool) or abs(v) <= INT32_MAX,
                       f"{key} must be at most {INT32_MAX:,} in size, not {v}")
                # a model's numbers become float32 tensors: 1e300 is finite here and infinite there
                _check(section.name != "model" or not isinstance(v, float) or abs(v) <= FLOAT32_MAX,
                       f"{key} must be within float32's range (at most {FLOAT32_MAX:.4g}), not {v!r}")
        # which family each layer is, and what each family needs of the other keys, is the
        # family table's to check (sonata.model.families.validate runs this, then its check)
        _check(bool(m.arch), "model.arch must be set (a block family, gpt2 or hybrid)")
        if m.layers:
            kinds = m.kinds
            derived = kinds[0] if len(set(kinds)) == 1 else "hybrid"
            _check(m.n_layers == len(kinds) and m.arch == derived,
                   f"model.n_layers={m.n_layers} / model.arch={m.arch} contradict model.layers={m.layers} "
                   f"({len(kinds)} layers, arch {derived}): set model.layers after them, or leave them out")
        _check(0 <= m.rope_fraction <= 1, f"model.rope_fraction must be in [0, 1], not {m.rope_fraction}")
        _check(m.bounded_angle >= 0, f"model.bounded_angle must be 0 (off) or positive, not {m.bounded_angle}")
        _check(m.mamba3_form in ("released", "paper"),
               f"model.mamba3_form must be released or paper, not {m.mamba3_form!r}")
        _check(m.mimo_rank >= 1, f"model.mimo_rank must be at least 1 (1 = SISO), not {m.mimo_rank}")
        _check(m.d_model > 0, "model.d_model must be positive")
        _check(math.isfinite(m.embed_std) and 0 < m.embed_std <= MAX_EMBED_STD,
               f"model.embed_std must be in (0, {MAX_EMBED_STD:g}], not {m.embed_std}")
        _check(m.headdim > 0, "model.headdim must be positive")
        _check(m.ngroups > 0, "model.ngroups must be positive")
        _check(m.chunk_size > 0, "model.chunk_size must be positive")
        _check(m.n_heads > 0, "model.n_heads must be positive")
        _check(m.n_layers > 0, "model.n_layers must be positive")
        _check(m.d_state > 0, "model.d_state must be positive")
        _check(m.expand > 0, "model.expand must be positive")
        _check(m.d_conv > 0, "model.d_conv must be positive")
        _check(m.dt_rank >= 0, "model.dt_rank must be >= 0 (0 = automatic)")
        _check(0 < m.dt_min <= m.dt_max, "model.dt_min must be in (0, model.dt_max]")
        _check(m.backend in ("auto", "reference", "cpu", "triton"),
               f"model.backend must be auto, reference, cpu or triton, not {m.backend!r}")
        _check(d.vocab_size >= 258, "data.vocab_size must be at least 258 (256 bytes + end-of-text + 1)")
        _check(d.vocab_size <= 65536, "data.vocab_size must be at most 65536 (the token cache is uint16)")
        _check(d.seq_len > 0, "data.seq_len must be positive")
        _check(0 < d.val_fraction < 1, "data.val_fraction must be in (0, 1)")
        _check(d.max_stories >= 0, "data.max_stories must be >= 0")
        _check(t.max_steps >= 0, "train.max_steps must be >= 0")
        _check(isinstance(t.max_seconds, (int, float)) and not isinstance(t.max_seconds, bool)
               and math.isfinite(t.max_seconds) and t.max_seconds >= 0,
               f"train.max_seconds must be a number >= 0 (0 = no time budget), not {t.max_seconds!r}")
        _check(not (t.max_seconds and t.decay_steps),
               "set train.decay_steps or train.max_seconds, not both (under a time budget the cosine "
               "ends with the budget)")
        _check(t.micro_batch >= 0, "train.micro_batch must be >= 0 (0 = the profile's choice)")
        _check(t.effective_batch >= 0, "train.effective_batch must be >= 0 (0 = the profile's)")
        _check(t.fixed_micro_batch >= 0, "train.fixed_micro_batch must be >= 0 (0 = off)")
        _check(not (t.micro_batch and t.fixed_micro_batch),
               "set train.micro_batch or train.fixed_micro_batch, not both")
        _check(not (t.micro_batch and t.effective_batch) or t.effective_batch % t.micro_batch == 0,
               f"train.effective_batch ({t.effective_batch}) must be a multiple of "
               f"train.micro_batch ({t.micro_batch})")
        _check(t.lr > 0 and math.isfinite(t.lr), "train.lr must be a positive number")
        _check(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio must be in [0, 1]")
        _check(t.warmup_steps >= 0, "train.warmup_steps must be >= 0")
        _check(t.weight_decay >= 0, "train.weight_decay must be >= 0")
        _check(t.lr * t.weight_decay < 1,
               f"train.weight_decay ({t.weight_decay:g}) x train.lr ({t.lr:g}) must be below 1: each AdamW step "
               f"multiplies the weights by 1 - lr x weight_decay")
        _check(0 < t.beta2 < 1, "train.beta2 must be in (0, 1)")
        _check(t.grad_clip >= 0, "train.grad_clip must be >= 0 (0 = off)")
        _check(m.a_param in ("log", "direct"), f"model.a_param must be log or direct, not {m.a_param!r}")
        _check(m.a_min > 0, "model.a_min must be positive")
        _check(m.norm_eps > 0, "model.norm_eps must be positive")
        _check(t.precision in ("auto", "fast") + PRECISIONS,
               f"train.precision must be auto, fast or one of {', '.join(PRECISIONS)}, not {t.precision!r}")
        p = self.profile
        _check(p.name in ("auto",) + tuple(PRESETS),
               f"profile.name must be auto or one of {', '.join(PRESETS)}, not {p.name!r}")
        for k in ("memory_budget_mb", "max_micro_batch", "effective_batch"):
            _check(getattr(p, k) >= 0, f"profile.{k} must be >= 0 (0 = the preset's)")
        if p.candidates:
            parse_candidates(p.candidates)
        _check(p.precision in ("",) + PRECISIONS,
               f"profile.precision must be one of {', '.join(PRECISIONS)}, not {p.precision!r}")
        _check(self.debug.leak in LEAKS,
               f"debug.leak must be one of {', '.join(LEAKS)}, not {self.debug.leak!r}")
        _check(t.decay_steps >= 0, "train.decay_steps must be >= 0 (0 = train.max_steps)")
        _check(t.max_nonfinite > 0, "train.max_nonfinite must be positive")
        _check(t.checkpoint_every_s >= 0 and math.isfinite(t.checkpoint_every_s),
               "train.checkpoint_every_s must be >= 0 (0 = off)")
        for k in ("eval_every", "eval_tokens", "checkpoint_every", "keep_checkpoints", "threads"):
            _check(getattr(t, k) >= 0, f"train.{k} must be >= 0")
        _check(t.log_every > 0, "train.log_every must be positive")
        _check(t.device in ("auto", "cpu", "cuda"), f"train.device must be auto, cpu or cuda, not {t.device!r}")
        k = self.task
        _check(k.name in ("",) + TASKS, f"task.name must be empty (language modeling) or one of "
                                         f"{', '.join(TASKS)}, not {k.name!r}")
        _check(k.n_data > 0, "task.n_data must be positive")
        _check(k.eval_seqs > 0, "task.eval_seqs must be positive")
        _check(k.name != "mqar" or 4 <= k.vocab_size <= 65536,
               f"task.vocab_size must be in 4..65536 (keys 1..V/2-1, values V/2..V-1), not {k.vocab_size}")
        _check(k.n_pairs >= 0, "task.n_pairs must be >= 0 (0 = a quarter of each sequence's length)")
        _check(k.name not in MODULAR or 2 <= k.modulus <= 65536, f"task.modulus must be in 2..65536, not {k.modulus}")
        _check(not k.running or k.name in ("parity", "modsum", "arith"),
               f"task.running=true is for task.name=parity, modsum or arith, not {k.name or '(none)'}")
        min_len = {"induction": 4, "copying": 2 * k.n_data, "mqar": 4 * (k.n_pairs or 1),
                   "arith_brackets": 2}.get(k.name, 1)
        if k.name == "arith_brackets":          # its generator recurses about length / 4 deep
            for length in [d.seq_len] + [n for n, _ in parse_curriculum(k.curriculum)]:
                _check(length <= 16384, f"task arith_brackets sequences are at most 16384 positions, not {length}")
        if k.name == "mqar":                    # each length's pairs need distinct keys
            for length in [d.seq_len] + [n for n, _ in parse_curriculum(k.curriculum)]:
                pairs, keys = k.n_pairs or length // 4, k.vocab_size // 2 - 1
                _check(pairs <= keys, f"task mqar at length {length} has {pairs} key-value pairs but "
                                      f"task.vocab_size={k.vocab_size} has only {keys} keys (1..V/2-1)")
        _check(d.seq_len >= min_len, f"data.seq_len ({d.seq_len}) must be at least {min_len} for task "
                                      f"{k.name} (the training length)")
        for length, _ in parse_curriculum(k.curriculum):
            _check(length >= min_len, f"task.curriculum: length {length} is under {min_len}, the shortest "
                                      f"sequence of task {k.name or '(none)'}")
        return self


# The defaults of `make train` (notebook 01) by the data it trains on. On real text (any
# data.source but the embedded corpus) they are sonata's best configuration in the ten-minute
# race against a tiny GPT (benchmarks/race.py, notebook 07, docs/results.md): vocabulary 2048 (more of each
# story in fewer tokens), lr 6e-3, weight decay 0.3 (at 2048 tokens the sample is seen 50-80
# times in 600 s: the runs overfit, and 0.3 against 0.1 is the race's largest lever), a
# 512-token context at 4 sequences per step (the same tokens per step as 16 x 128; a Mamba's
# cost is linear in the context), precision `fast` (bf16 on a CPU that multiplies bf16
# natively, else the profile's), and the run is a 600 s time budget. The 326 KB embedded corpus keeps the seed configuration, the dossier's model
# that notebooks 02-05 and `make test` measure, although vocabulary 2048 with lr 6e-3 scores
# better there too (README, "Results").
TRAIN_DEFAULTS = {
    "embedded": {"data.vocab_size": 512, "data.seq_len": 128, "train.effective_batch": 16, "train.lr": 3e-3,
                 "train.weight_decay": 0.1, "train.max_steps": 1500, "train.max_seconds": 0.0},
    "real": {"data.vocab_size": 2048, "data.seq_len": 512, "train.effective_batch": 4, "train.lr": 6e-3,
             "train.weight_decay": 0.3, "train.precision": "fast", "train.max_steps": 0, "train.max_seconds": 600.0},
}
_LENGTH_KEYS = ("train.max_steps", "train.max_seconds")


def with_train_defaults(overrides: dict) -> dict:
    """`overrides` on top of TRAIN_DEFAULTS for their data.source. A key of TRAIN_DEFAULTS
    that is absent or 0 takes the data's default; the run's length (train.max_steps,
    train.max_seconds) is the data's only when neither is set, so `train.max_steps=3000`
    alone is a step-based run on any data."""
    source = overrides.get("data.source", DataConfig.source)
    defaults = dict(TRAIN_DEFAULTS["embedded" if source == "embedded" else "real"])
    given = {k: v for k, v in overrides.items() if not (k in defaults and v == 0)}
    if any(k in given for k in _LENGTH_KEYS):
        defaults.update({"train.max_steps": 0, "train.max_seconds": 0.0})
    return {**defaults, **given}


def describe_length(cfg: Config) -> str:
    """One line: the vocabulary, peak learning rate and length a run was configured with."""
    t = cfg.train
    if t.max_seconds:
        length = f"a {t.max_seconds:g} s time budget" + (f", at most {t.max_steps:,} steps" if t.max_steps else "")
    else:
        length = f"{t.max_steps:,} steps"
    return f"vocabulary {cfg.data.vocab_size:,}, peak lr {t.lr:g}, {length}"


def _a(typ) -> str:
    """'an int', 'a float'."""
    return ("an " if typ.__name__[0] in "aeiou" else "a ") + typ.__name__


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _section(cfg: Config, name: str):
    if name not in {f.name for f in fields(cfg)}:
        raise ConfigError(f"unknown config section {name!r} (sections: model, data, train, profile, debug, task)")
    return getattr(cfg, name)


def _parse(text: str, typ, key: str):
    if typ is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"bad value for {key}: {text!r} is not a boolean (true/false)")
    if typ is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"bad value for {key}: {text!r} is not an integer") from None
    if typ is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"bad value for {key}: {text!r} is not a number") from None
    return text


def set_value(cfg: Config, key: str, value) -> None:
    """Set `section.name` to `value` (a string is parsed by the field's type)."""
    if key.count(".") != 1:
        raise ConfigError(f"config keys look like section.name, got {key!r}")
    section, name = key.split(".")
    sub = _section(cfg, section)
    hints = typing.get_type_hints(type(sub))
    if name not in hints or name not in {f.name for f in fields(sub)}:
        raise ConfigError(f"unknown config key {key!r}")
    typ = hints[name]
    if isinstance(value, str) and typ is not str:
        value = _parse(value, typ, key)
    elif typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"bad value for {key}: {value!r} is not {_a(typ)}")
    setattr(sub, name, value)


def apply_overrides(cfg: Config, overrides) -> Config:
    """Apply `key=value` strings (or a {key: value} mapping) and validate."""
    items = overrides.items() if isinstance(overrides, dict) else [_split(o) for o in overrides]
    for k, v in items:
        set_value(cfg, k, v)
    return cfg.validate()


def _split(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise ConfigError(f"expected key=value, got {text!r}")
    k, v = text.split("=", 1)
    return k.strip(), v.strip()


def make_config(overrides=()) -> Config:
    """The default configuration with overrides applied and validated."""
    return apply_overrides(Config(), overrides)


__all__ = ["Config", "ModelConfig", "DataConfig", "TrainConfig", "ProfileConfig", "DebugConfig", "TaskConfig",
           "Profile", "PRESETS", "resolve_profile", "apply_overrides",
           "make_config", "set_value", "ConfigError", "TRAIN_DEFAULTS", "with_train_defaults",
           "describe_length"]
