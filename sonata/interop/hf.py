"""Hugging Face transformers interchange: export a MambaLM as a `MambaForCausalLM`
(every layer Mamba-1, `model.arch=mamba`) or `Mamba2ForCausalLM` (every layer Mamba-2,
`model.arch=mamba2`) directory, and import such a directory (or any checkpoint in that layout,
e.g. the state-spaces/mamba-*-hf family on disk) back into a MambaLM. Other stacks (lti,
attention, a hybrid) have no transformers class and are refused in one line.

A directory written by `export_hf` holds:

    config.json             model_type "mamba" or "mamba2" and every shape field, use_bias /
                            use_conv_bias (and Mamba-2's n_groups, chunk_size) written explicitly
    model.safetensors       the weights; a tied embedding is stored once
                            (backbone.embeddings.weight, no lm_head.weight), an untied head
                            (model.tie_embeddings=false) as lm_head.weight
    generation_config.json  end-of-text id and sonata's default sampling settings
    vocab.json              sonata's compact vocabulary (sonata.data.vocab.Vocab)
    sonata_config.json      the full sonata config (for further training)
    README.md               how to load it and encode/decode with the vocabulary

The name mapping is the whole conversion, for both families: sonata's module names already
mirror the reference implementation (Mamba-2: in_proj split [z, xBC, dt], conv1d over xBC,
dt_bias, A_log, D per head, norm = the gated RMSNorm norm(y * silu(z)) in n_groups groups,
out_proj; transformers' Mamba2Mixer has the same). `a_param=direct` models store A itself; it
is written as A_log = log(-A), which exists only where A < 0 everywhere.
transformers is not needed here: only `safetensors` (transformers loads the result).

Every path that reads a config.json (import_hf, so `generate` / `eval` / `import DIR`, and
`hf_accelerate` through `config_from_hf`) reads it through one validating reader
(`read_hf_config`, `HfFields`): a value of the wrong kind, a size that is not a positive whole
number, a boolean written as a string, a NaN or infinite float is one CheckpointError naming
the file and the key.

`import_checkpoint` (the CLI's `python -m sonata import DIR --out CKPT`) writes an imported
folder as a sonata checkpoint that `train --init CKPT` starts from, with the overrides that
rebuild its shape (`train_overrides`).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from sonata.core import checkpoint as ckpt
from sonata.core.config import Config, ModelConfig
from sonata.core.errors import CheckpointError, SonataError
from sonata.data.vocab import Vocab
from sonata.model import families
from sonata.model.lm import MambaLM

CONFIG_FILE = "config.json"
VOCAB_FILE = "vocab.json"
SONATA_CONFIG_FILE = "sonata_config.json"
WEIGHTS_FILE = "model.safetensors"
# model_type -> transformers class, from the family table (a family's `hf` mapping)
HF_CLASSES = {f.hf.model_type: f.hf.cls for f in families.FAMILIES.values() if f.hf is not None}


def _require_safetensors():
    try:
        import safetensors.torch as st
    except ImportError:  # pragma: no cover - a dependency; the message names the fix
        raise SonataError("the safetensors package is needed: pip install safetensors") from None
    return st


# --------------------------------------------------------------------------- export

def hf_family(cfg: ModelConfig) -> str:
    """The transformers model_type a sonata model exports as (the family table's `hf` mapping:
    "mamba" for every layer Mamba-1, "mamba2" for every layer Mamba-2); a SonataError, in one
    line, for any other stack."""
    mapping = families.hf_mapping(cfg)
    if mapping is not None:
        return mapping.model_type
    have = ", ".join(f"{f.hf.cls} holds only {name} layers" for name, f in families.FAMILIES.items() if f.hf)
    raise SonataError(f"cannot export to transformers: model.arch={cfg.arch} ({','.join(cfg.kinds)}) has no "
                      f"transformers class; {have} (no other families or mixed stacks)")


def hf_config(model: MambaLM, eot_id: int = Vocab.EOT_ID) -> dict:
    """transformers' MambaConfig or Mamba2Config fields for `model`, every shape field explicit."""
    if hf_family(model.cfg) == "mamba2":
        return _hf_config_mamba2(model.cfg, eot_id)
    c = model.cfg
    return {
        "architectures": ["MambaForCausalLM"],
        "model_type": "mamba",
        "hidden_size": c.d_model,
        "num_hidden_layers": c.n_layers,
        "state_size": c.d_state,
        "expand": c.expand,
        "intermediate_size": c.d_inner,
        "conv_kernel": c.d_conv,
        "time_step_rank": c.effective_dt_rank,
        "vocab_size": c.vocab_size,
        "layer_norm_epsilon": c.norm_eps,
        "tie_word_embeddings": c.tie_embeddings,
        **_hf_common(c, eot_id),           # explicit: their defaults have changed across versions
    }


def _hf_config_mamba2(c: ModelConfig, eot_id: int) -> dict:
    """Mamba2Config fields. time_step_limit is left at its default (0, inf), the same in every
    transformers version, because infinity has no JSON form they agree on (5.x writes
    {"__float__": "Infinity"}); sonata's block applies no dt limit. chunk_size does not change
    the result (the chunked SSD is exact); sonata's is kept so a round trip gives the same config."""
    return {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "hidden_size": c.d_model,
        "num_hidden_layers": c.n_layers,
        "state_size": c.d_state,
        "expand": c.expand,
        "num_heads": c.nheads,
        "head_dim": c.headdim,
        "n_groups": c.ngroups,
        "chunk_size": c.chunk_size,
        "conv_kernel": c.d_conv,
        "vocab_size": c.vocab_size,
        "layer_norm_epsilon": c.norm_eps,
        "tie_word_embeddings": c.tie_embeddings,         # explicit: Mamba2Config's default is False
        "rescale_prenorm_residual": False,
        **_hf_common(c, eot_id),
    }


def _hf_common(c: ModelConfig, eot_id: int) -> dict:
    """The fields MambaConfig and Mamba2Config share."""
    return {
        "use_bias": False,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "residual_in_fp32": True,
        "time_step_min": c.dt_min,
        "time_step_max": c.dt_max,
        "time_step_floor": c.dt_init_floor,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "pad_token_id": eot_id,
        "use_cache": True,
        "dtype": "float32",
    }


def hf_state_dict(model: MambaLM) -> dict[str, torch.Tensor]:
    """The model's weights under transformers' names, float32, a tied embedding once (an untied
    head, model.tie_embeddings=false, as lm_head.weight).
    An `a_param=direct` model's A becomes A_log = log(-A); a SonataError if any A >= 0 (or if the
    stack has no transformers class, `hf_family`)."""
    hf_family(model.cfg)
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            if not model.cfg.tie_embeddings:
                out[name] = t.detach().to("cpu", torch.float32).contiguous().clone()
            continue                                           # tied: the embedding, once
        if name.endswith(".A_param"):
            if not bool((t < 0).all()):
                bad = int((t >= 0).sum())
                raise SonataError(f"cannot export to transformers: {name} has {bad} entries >= 0, and "
                                  f"transformers' Mamba stores A = -exp(A_log) (negative everywhere); "
                                  f"train with model.a_constraint=true or model.a_param=log")
            name, t = name[: -len("A_param")] + "A_log", torch.log(-t.double())
        name = "backbone.embeddings.weight" if name == "embedding.weight" else "backbone." + name
        out[name] = t.detach().to("cpu", torch.float32).contiguous().clone()
    return out


def _readme(cfg: dict, n_params: int) -> str:
    cls = HF_CLASSES[cfg["model_type"]]
    heads = (f", {cfg['num_heads']} heads of {cfg['head_dim']} in {cfg['n_groups']} groups"
             if cfg["model_type"] == "mamba2" else "")
    return f"""# A sonata {'Mamba-2' if cfg['model_type'] == 'mamba2' else 'Mamba'} language model

Exported by `python -m sonata export CKPT --hf DIR`: {n_params:,} parameters,
{cfg['num_hidden_layers']} layers, hidden size {cfg['hidden_size']}, state size {cfg['state_size']}{heads},
vocabulary {cfg['vocab_size']} (sonata's compact vocabulary, `{VOCAB_FILE}`).

## Load with transformers (no custom code)

```python
from transformers import {cls}
model = {cls}.from_pretrained("path/to/this/folder")
```

## Encode and decode text

The ids are sonata's compact vocabulary, not a `tokenizers` tokenizer: ids 0-255 are
raw bytes, 256 is `<|endoftext|>`, 257 and up are whole tiktoken `o200k_base` tokens
listed in `{VOCAB_FILE}` (`tokens`, o200k ids). Any other text is written as its
UTF-8 bytes, so decoding an encoding gives the text back exactly.

```python
import torch
from sonata.data.vocab import Vocab
from sonata.interop.hf import load_vocab            # or: Vocab.from_state_dict on vocab.json's fields

vocab = load_vocab("path/to/this/folder")   # a sonata.data.vocab.Vocab
ids = torch.tensor([vocab.encode("Once upon a time")])
out = model.generate(ids, max_new_tokens=50, do_sample=True, top_k=40, temperature=0.8)
print(vocab.decode(out[0].tolist()))        # stop at id {Vocab.EOT_ID} (<|endoftext|>) if you like
```

## Back into sonata

```python
from sonata.lab.generate import load_model
model, vocab, cfg = load_model("path/to/this/folder")   # a sonata.model.lm.MambaLM
```

To train on from these weights: `python -m sonata import path/to/this/folder --out init.pt`
writes a sonata checkpoint and prints the `python -m sonata train --init init.pt ...` line.
"""


def export_hf(model: MambaLM, vocab: Vocab | None, out_dir, cfg: Config | None = None,
              force: bool = False) -> Path:
    """Write `model` (and its vocabulary) as a transformers MambaForCausalLM (Mamba-1) or
    Mamba2ForCausalLM (Mamba-2) directory; any other stack is a SonataError (`hf_family`).

    Atomic: everything is written into a temporary folder beside `out_dir`, which is renamed
    into place only when complete (a kill or a full disk leaves no half-written export). A
    folder that exists and is not empty is refused unless `force`, which replaces it whole
    (`--hf .` in a project must not write over its README); an empty folder (`--hf .` in a
    fresh one, say) is filled in place. The folder gets the usual mode under the umask."""
    st = _require_safetensors()
    tensors = hf_state_dict(model)                       # refuses before anything is written
    out = Path(os.path.abspath(out_dir))                # `--hf .` names the folder it is
    if out.exists() and not out.is_dir():
        raise SonataError(f"--hf {out} exists and is not a folder")
    try:
        filled = out.is_dir() and any(out.iterdir())
    except OSError as e:
        raise SonataError(f"--hf {out} cannot be read: {e.strerror or e}") from None
    if filled and not force:
        raise SonataError(f"--hf {out} is a folder that is not empty; choose a new or empty one "
                          f"(or --force to replace it and everything in it)")
    tmp = _export_workspace(out)
    moved = []                                           # files placed in an empty `out`, so far
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)                    # mkdtemp's 0700 is not an export's mode
        conf = hf_config(model)
        st.save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
        gen = {"bos_token_id": Vocab.EOT_ID, "eos_token_id": Vocab.EOT_ID, "pad_token_id": Vocab.EOT_ID,
               "do_sample": True, "temperature": 0.8, "top_k": 40, "max_new_tokens": 200}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if vocab is not None:
            state = vocab.state_dict()
            (tmp / VOCAB_FILE).write_text(json.dumps({"kind": state["kind"],
                                                      "tokens": state["tokens"].tolist()}) + "\n")
        if cfg is not None:
            (tmp / SONATA_CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        (tmp / "README.md").write_text(_readme(conf, model.num_params()))
        if out.is_dir() and not any(out.iterdir()):      # empty (the current folder, say): filled
            for f in sorted(tmp.iterdir()):              # in place, so whoever stands in it stays
                f.rename(out / f.name)
                moved.append(out / f.name)
            tmp.rmdir()
        elif out.exists():                               # replaced whole, with force
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            try:
                tmp.rename(out)
            except BaseException:
                old.rename(out)                          # the folder it replaces stays as it was
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException as e:
        for f in moved:                                  # an empty folder is left empty
            try:
                f.unlink(missing_ok=True)
            except OSError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise SonataError(f"cannot write the export {out}: {e.strerror or e}") from None
        raise
    return out


def _export_workspace(out: Path) -> Path:
    """A new temporary folder beside `out` (its parent created if need be), or one SonataError
    naming what is in the way: a file where a folder should be, a folder that cannot be written
    (no permission, a read-only filesystem)."""
    parent = out.parent
    blocker = next((p for p in (parent, *parent.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise SonataError(f"--hf {out} cannot be created: {blocker} is a file, not a folder")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    except OSError as e:
        raise SonataError(f"--hf {out} cannot be written: the folder {parent} refuses it "
                          f"({e.strerror or _first_line(e)})") from None


# --------------------------------------------------------------------------- import

def load_vocab(path) -> Vocab | None:
    """The sonata vocabulary of an exported directory, or None when it has none."""
    f = Path(path) / VOCAB_FILE
    if not f.exists():
        return None
    try:
        d = json.loads(f.read_text())
        return Vocab.from_state_dict({"kind": d["kind"], "tokens": torch.tensor(d["tokens"], dtype=torch.int64)})
    except (OSError, KeyError, TypeError, ValueError, AttributeError, IndexError) as e:   # JSON, UTF-8 errors too
        raise CheckpointError(f"{f} is not a sonata vocabulary ({_first_line(e)})") from None


def is_hf_dir(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / CONFIG_FILE).exists()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:160] if text else type(e).__name__


def read_hf_config(path) -> dict:
    """The JSON object in `path`/config.json, or a CheckpointError naming the file: missing,
    unreadable, not UTF-8, not JSON, or JSON that is not an object. Its values are checked
    where they are read (`HfFields`)."""
    f = Path(path) / CONFIG_FILE
    try:
        conf = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a transformers model folder (no {CONFIG_FILE})") from None
    except OSError as e:
        raise CheckpointError(f"{f} cannot be read: {e.strerror or _first_line(e)}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{f} is not UTF-8 text ({_first_line(e)})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f} is not JSON ({e})") from None
    if not isinstance(conf, dict):
        raise CheckpointError(f"{f} is not a JSON object of settings (it holds {_shown(conf)})")
    return conf


def _shown(value) -> str:
    """A config value as config.json writes it (null, true, "abc", NaN), cut to 60 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_REQUIRED = object()


class HfFields:
    """The values of a transformers config.json (a MambaConfig or Mamba2Config dict) as sonata
    reads them, each checked where it is read: a value of the wrong kind (a string, null, a list,
    true for a size), a size that is not a whole number or not positive, a boolean given as a
    string, a NaN or infinite float is a CheckpointError naming the file and the key, with the
    value as the file has it. A whole number may be written as a float (2.0). A key that is absent
    takes the default given (transformers' own), or is an error when it has none.
    `where`: "DIR/config.json" (or "config.json" for a dict from elsewhere, e.g. a loaded model's)."""

    def __init__(self, conf: dict, path=""):
        self.where = f"{path}/{CONFIG_FILE}" if str(path) else CONFIG_FILE
        if not isinstance(conf, dict):
            raise CheckpointError(f"{self.where} is not a JSON object of settings (it holds {_shown(conf)})")
        self.conf = conf

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: {message}")

    def _bad(self, key, what: str) -> CheckpointError:
        return self.error(f"{key} must be {what}, not {_shown(self.conf[key])}")

    def raw(self, key, default=_REQUIRED):
        if key not in self.conf:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.where} has no {key!r}")
            return default
        return self.conf[key]

    def whole(self, key, default=_REQUIRED, minimum: int = 1, what: str = "a whole number") -> int:
        """A whole number >= minimum (2 or 2.0; not 1.5, "2", true, null, NaN)."""
        v = self.raw(key, default)
        if key not in self.conf:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v != int(v) or v < minimum:
            raise self._bad(key, f"{what} >= {minimum}")
        return int(v)

    def number(self, key, default=_REQUIRED, positive: bool = True) -> float:
        """A finite number, > 0 when `positive` (else >= 0)."""
        v = self.raw(key, default)
        if key not in self.conf:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or (v <= 0 if positive else v < 0):
            raise self._bad(key, f"a finite number {'>' if positive else '>='} 0")
        return float(v)

    def flag(self, key, default: bool) -> bool:
        """JSON's true or false (not "false", 0 or null)."""
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise self._bad(key, "true or false")
        return v

    def text(self, key, default=_REQUIRED) -> str:
        v = self.raw(key, default)
        if not isinstance(v, str):
            raise self._bad(key, "a string")
        return v


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers checkpoint folder: model.safetensors, its sharded
    form (model.safetensors.index.json), or pytorch_model.bin (loaded weights-only)."""
    st = _require_safetensors()
    index = path / "model.safetensors.index.json"
    try:
        if (path / WEIGHTS_FILE).exists():
            return st.load_file(str(path / WEIGHTS_FILE))
        if index.exists():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            root = path.resolve()
            out = {}
            for s in shards:
                f = (path / s).resolve()
                if f.parent != root:             # a name like ../x or /etc/x: never read outside
                    raise CheckpointError(f"{index} names a shard outside its folder: {s!r}")
                out.update(st.load_file(str(f)))
            return out
        if (path / "pytorch_model.bin").exists():
            return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # a truncated or foreign file: one line, never a traceback
        raise CheckpointError(f"cannot read the weights in {path}: {str(e).splitlines()[0][:160]}") from None
    raise CheckpointError(f"{path} has no {WEIGHTS_FILE}, sharded safetensors or pytorch_model.bin")


def _is_inf(v) -> bool:
    """Infinity as transformers' config.json writes it: a float (json's `Infinity`), the string,
    or 5.x's {"__float__": "Infinity"}."""
    if isinstance(v, dict):
        v = v.get("__float__")
    try:
        return math.isinf(float(v)) and float(v) > 0
    except (TypeError, ValueError):
        return False


def config_from_hf(conf: dict, path="") -> Config:
    """A sonata Config for a transformers MambaConfig or Mamba2Config dict (`read_hf_config`'s, or
    a loaded model's `config.to_dict()`); every value it reads is checked (`HfFields`), and what
    MambaLM cannot hold is refused, each in one line naming config.json and the key. The
    folder's sonata_config.json (an export's) is the base; the shape comes from config.json."""
    f = conf if isinstance(conf, HfFields) else HfFields(conf, path)
    kind = f.raw("model_type", None)
    if kind is not None:
        f.text("model_type")
    if kind not in HF_CLASSES:
        raise f.error(f"model_type is {kind!r}; sonata imports Mamba-1 ('mamba') and Mamba-2 ('mamba2') "
                      f"models only")
    if f.flag("use_bias", False):
        raise f.error("use_bias=true (biases on in_proj/out_proj) is not a sonata MambaLM")
    act = f.text("hidden_act", "silu")
    if act != "silu":
        raise f.error(f"hidden_act {act!r} is not silu")
    d, expand = f.whole("hidden_size"), f.whole("expand")
    n_layers, d_state = f.whole("num_hidden_layers"), f.whole("state_size")
    d_conv, vocab_size = f.whole("conv_kernel", 4), f.whole("vocab_size")
    norm_eps = f.number("layer_norm_epsilon", 1e-5)
    # transformers' defaults: MambaConfig ties the head, Mamba2Config does not
    tie = f.flag("tie_word_embeddings", kind == "mamba")
    dt = {ours: f.number(theirs, None, positive=(theirs != "time_step_floor"))   # initialisation only:
          for ours, theirs in (("dt_min", "time_step_min"), ("dt_max", "time_step_max"),   # kept for the record
                               ("dt_init_floor", "time_step_floor"))}
    if dt["dt_min"] is not None and dt["dt_max"] is not None and dt["dt_min"] > dt["dt_max"]:
        raise f.error(f"time_step_min {dt['dt_min']} is larger than time_step_max {dt['dt_max']}")
    cfg = _sonata_config_beside(path)
    m = cfg.model
    m.arch, m.layers = kind, ""
    m.d_model, m.n_layers, m.d_state, m.expand = d, n_layers, d_state, expand
    m.d_conv, m.vocab_size, m.norm_eps, m.tie_embeddings = d_conv, vocab_size, norm_eps, tie
    m.a_param = "log"
    for ours, v in dt.items():
        if v is not None:
            setattr(m, ours, v)
    if kind == "mamba2":
        _mamba2_fields(f, m)
    else:
        inner = f.raw("intermediate_size", None)
        if inner is not None and f.whole("intermediate_size") != expand * d:
            raise f.error(f"intermediate_size {inner} is not expand x hidden_size ({expand} x {d})")
        rank = f.raw("time_step_rank", "auto")
        m.dt_rank = math.ceil(d / 16) if rank == "auto" else f.whole("time_step_rank", what='"auto" or a whole number')
    if m.vocab_size >= 258:
        cfg.data.vocab_size = m.vocab_size
    try:
        return families.validate(cfg)
    except SonataError as e:
        raise f.error(f"not a model sonata can build ({e})") from None


def _sonata_config_beside(path) -> Config:
    """The Config in `path`/sonata_config.json (an export's), or the default one."""
    p = Path(str(path)) / SONATA_CONFIG_FILE if str(path) else None
    if p is None or not p.exists():
        return Config()
    try:
        return Config.from_dict(json.loads(p.read_text(encoding="utf-8")))
    except (OSError, SonataError, TypeError, ValueError, AttributeError, KeyError) as e:   # JSON, UTF-8 too
        raise CheckpointError(f"{p} is not a sonata config ({_first_line(e)})") from None


def _mamba2_fields(f: HfFields, m: ModelConfig) -> None:
    """Mamba2Config's head layout and what its mixer computes, checked against Mamba2Mixer: missing
    fields take transformers' defaults (n_groups 8, chunk_size 256), as from_pretrained would."""
    heads, headdim = f.whole("num_heads"), f.whole("head_dim")
    groups, chunk = f.whole("n_groups", 8), f.whole("chunk_size", 256)
    if heads * headdim != m.expand * m.d_model:
        raise f.error(f"num_heads x head_dim ({heads} x {headdim}) is not expand x hidden_size "
                      f"({m.expand * m.d_model})")
    if heads % groups:
        raise f.error(f"n_groups {groups} does not divide num_heads {heads} (each group of B and C is shared "
                      f"by num_heads / n_groups heads)")
    limit = f.raw("time_step_limit", [0.0, math.inf])
    if not (isinstance(limit, (list, tuple)) and len(limit) == 2 and not isinstance(limit[0], bool)
            and limit[0] == 0 and _is_inf(limit[1])):
        raise f.error(f"time_step_limit {_shown(limit)} clamps dt (or is not a pair of numbers); sonata's mamba2 "
                      f"block has no dt limit (only (0, inf))")
    if f.flag("norm_before_gate", False) or not f.flag("rms_norm", True):
        raise f.error("norm_before_gate=true or rms_norm=false; sonata's mamba2 block is norm(y * silu(z)), "
                      "an RMSNorm after the gate")
    m.headdim, m.ngroups, m.chunk_size = headdim, groups, chunk


def sonata_state_dict(weights: dict[str, torch.Tensor], cfg: Config, conf: dict | HfFields,
                      path="") -> dict[str, torch.Tensor]:
    """transformers' Mamba or Mamba-2 weights (names as in its state_dict) under MambaLM's names,
    float32 (a float32 tensor is passed through, not copied: `sonata.interop.hf_accelerate` shares
    storage this way); a tied head checked and set, an untied one (tie_word_embeddings=false)
    required, a missing conv bias (use_conv_bias=false) zero."""
    f = conf if isinstance(conf, HfFields) else HfFields(conf, path)
    conv_bias = f.flag("use_conv_bias", True)
    sd = {}
    for k, t in weights.items():
        k = k.removeprefix("backbone.").replace("embeddings.", "embedding.", 1)
        sd[k] = t.float()
    if "embedding.weight" not in sd:
        raise CheckpointError(f"{path}: no embedding weight (backbone.embeddings.weight)")
    head = sd.pop("lm_head.weight", None)
    if not cfg.model.tie_embeddings:
        if head is None:
            raise CheckpointError(f"{path}: tie_word_embeddings is false but the weights hold no lm_head.weight")
        sd["lm_head.weight"] = head
    elif head is not None and head is not sd["embedding.weight"] and not torch.equal(head, sd["embedding.weight"]):
        raise CheckpointError(f"{path}: lm_head.weight differs from the embedding, but config.json says "
                              f"tie_word_embeddings=true")
    else:
        sd["lm_head.weight"] = sd["embedding.weight"]
    for i in range(cfg.model.n_layers):                   # use_conv_bias=false: a zero bias is the same
        key, weight = f"layers.{i}.mixer.conv1d.bias", sd.get(f"layers.{i}.mixer.conv1d.weight")
        if key not in sd and not conv_bias and weight is not None:
            sd[key] = torch.zeros(weight.shape[0])        # d_inner (Mamba-1), d_inner + 2 G N (Mamba-2)
    return sd


def import_hf(path, device="cpu") -> tuple[MambaLM, Vocab | None, Config]:
    """MambaLM (eval mode), its vocabulary (None unless the folder has sonata's) and a Config,
    from a transformers Mamba-1 or Mamba-2 folder: one exported here, a `Mamba2ForCausalLM`'s
    save_pretrained (a tied or an untied head), or e.g. state-spaces/mamba-130m-hf."""
    path = Path(path)
    if not is_hf_dir(path):
        raise CheckpointError(f"{path} is not a transformers model folder (no {CONFIG_FILE})")
    fields = HfFields(read_hf_config(path), path)
    cfg = config_from_hf(fields, path)
    sd = sonata_state_dict(_read_weights(path), cfg, fields, path)
    model = MambaLM(cfg.model)
    try:
        model.load_state_dict(sd)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: the weights do not match {CONFIG_FILE}: "
                              f"{' '.join(str(e).split())[:240]}") from None
    return model.to(device).eval(), load_vocab(path), cfg


def train_overrides(cfg: Config) -> list[str]:
    """The `key=value` overrides that make `train` build `cfg`'s model shape, so `train --init`
    loads an imported checkpoint (a new run otherwise builds the default model)."""
    m = cfg.model
    keys = ["arch", "d_model", "n_layers", "d_state", "expand", "d_conv", "norm_eps"]
    keys += list(families.family(m.arch).hf.shape_keys)
    out = [f"model.{k}={getattr(m, k)}" for k in keys] + ([] if m.tie_embeddings else ["model.tie_embeddings=false"])
    return out + ([f"data.vocab_size={m.vocab_size}"] if m.vocab_size >= 258 else [])


def import_checkpoint(path, out, force: bool = False) -> tuple[Path, MambaLM, Config]:
    """A transformers Mamba or Mamba-2 folder written as a sonata checkpoint `out` (the model's
    weights, its config, and its vocabulary when the folder has sonata's): what `train --init`
    starts from (with `train_overrides(cfg)`), and `generate` / `eval` read when it has a vocabulary.
    An existing `out` is refused unless `force`."""
    out = Path(out)
    if out.is_dir() or (out.exists() and not force):
        raise SonataError(f"--out {out} exists; choose a new file name (or --force to replace the file)")
    model, vocab, cfg = import_hf(path)
    state = {"model": model.state_dict(), "config": cfg.to_dict()}
    if vocab is not None:
        state["vocab"] = vocab.state_dict()
    return ckpt.save(state, out), model, cfg


__all__ = ["export_hf", "import_hf", "import_checkpoint", "hf_config", "hf_family", "hf_state_dict",
           "config_from_hf", "read_hf_config", "HfFields", "load_vocab", "is_hf_dir", "sonata_state_dict", "train_overrides", "HF_CLASSES"]
