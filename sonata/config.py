"""Every hyper-parameter, in dataclasses: the one source of configuration.

The command line, the notebooks and the tests use the same dotted names
(`model.d_model=64`, `train.max_steps=20`); `apply_overrides` parses them
against the dataclass field types and `Config.validate` checks the values, so
a typo or a bad value is a `ConfigError` naming the key, never a silent default.
"""
from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass, field, fields

from sonata.errors import ConfigError


PRECISIONS = ("fp32", "fp16", "bf16", "int8")


@dataclass
class ModelConfig:
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

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def dt_rank_(self) -> int:
        return self.dt_rank or math.ceil(self.d_model / 16)


@dataclass
class DataConfig:
    source: str = "embedded"    # embedded | tinystories | a path to .txt / .parquet / folder
    vocab_size: int = 512       # compact vocabulary, total: 256 bytes + specials + most frequent tokens
    seq_len: int = 128
    val_fraction: float = 0.1
    max_stories: int = 0        # 0: all; otherwise the first N stories of the source


@dataclass
class TrainConfig:
    max_steps: int = 1000
    micro_batch: int = 16
    effective_batch: int = 16   # micro_batch x accumulation steps
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    precision: str = "fp32"     # fp32 | fp16 (autocast + GradScaler) | bf16 (autocast) | int8 (fake-quant weights)
    decay_steps: int = 0        # cosine horizon; 0: train.max_steps (set it to extend a run exactly)
    max_nonfinite: int = 5      # consecutive non-finite steps (skipped) before training stops
    eval_every: int = 100       # 0: only at the end
    eval_tokens: int = 0        # 0: the whole validation split
    checkpoint_every: int = 0   # 0: only the final checkpoint
    log_every: int = 1          # metrics.jsonl row every N steps
    threads: int = 0            # torch intra-op threads; 0: leave as is
    device: str = "auto"        # auto | cpu | cuda

    @property
    def accumulation(self) -> int:
        return self.effective_batch // self.micro_batch


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        cfg = cls()
        for section, values in d.items():
            sub = _section(cfg, section)
            names = {f.name for f in fields(sub)}
            for k, v in values.items():
                if k not in names:
                    raise ConfigError(f"unknown config key {section}.{k}")
                setattr(sub, k, v)
        return cfg.validate()

    def validate(self) -> "Config":
        m, d, t = self.model, self.data, self.train
        _check(m.d_model > 0, "model.d_model must be positive")
        _check(m.n_layers > 0, "model.n_layers must be positive")
        _check(m.d_state > 0, "model.d_state must be positive")
        _check(m.expand > 0, "model.expand must be positive")
        _check(m.d_conv > 0, "model.d_conv must be positive")
        _check(m.dt_rank >= 0, "model.dt_rank must be >= 0 (0 = automatic)")
        _check(0 < m.dt_min <= m.dt_max, "model.dt_min must be in (0, model.dt_max]")
        _check(m.backend in ("auto", "reference", "cpu", "triton"),
               f"model.backend must be auto, reference, cpu or triton, not {m.backend!r}")
        _check(d.vocab_size >= 258, "data.vocab_size must be at least 258 (256 bytes + end-of-text + 1)")
        _check(d.seq_len > 0, "data.seq_len must be positive")
        _check(0 < d.val_fraction < 1, "data.val_fraction must be in (0, 1)")
        _check(d.max_stories >= 0, "data.max_stories must be >= 0")
        _check(t.max_steps >= 0, "train.max_steps must be >= 0")
        _check(t.micro_batch > 0, "train.micro_batch must be positive")
        _check(t.effective_batch > 0, "train.effective_batch must be positive")
        _check(t.effective_batch % t.micro_batch == 0,
               f"train.effective_batch ({t.effective_batch}) must be a multiple of "
               f"train.micro_batch ({t.micro_batch})")
        _check(t.lr > 0 and math.isfinite(t.lr), "train.lr must be a positive number")
        _check(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio must be in [0, 1]")
        _check(t.warmup_steps >= 0, "train.warmup_steps must be >= 0")
        _check(t.weight_decay >= 0, "train.weight_decay must be >= 0")
        _check(t.grad_clip >= 0, "train.grad_clip must be >= 0 (0 = off)")
        _check(m.a_param in ("log", "direct"), f"model.a_param must be log or direct, not {m.a_param!r}")
        _check(m.a_min > 0, "model.a_min must be positive")
        _check(t.precision in PRECISIONS,
               f"train.precision must be one of {', '.join(PRECISIONS)}, not {t.precision!r}")
        _check(t.decay_steps >= 0, "train.decay_steps must be >= 0 (0 = train.max_steps)")
        _check(t.max_nonfinite > 0, "train.max_nonfinite must be positive")
        for k in ("eval_every", "eval_tokens", "checkpoint_every", "threads"):
            _check(getattr(t, k) >= 0, f"train.{k} must be >= 0")
        _check(t.log_every > 0, "train.log_every must be positive")
        _check(t.device in ("auto", "cpu", "cuda"), f"train.device must be auto, cpu or cuda, not {t.device!r}")
        return self


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _section(cfg: Config, name: str):
    if name not in {f.name for f in fields(cfg)}:
        raise ConfigError(f"unknown config section {name!r} (sections: model, data, train)")
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
        raise ConfigError(f"bad value for {key}: {value!r} is not a {typ.__name__}")
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


__all__ = ["Config", "ModelConfig", "DataConfig", "TrainConfig", "apply_overrides",
           "make_config", "set_value", "ConfigError"]
