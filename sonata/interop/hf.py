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
from sonata.model.lm import MambaLM

VOCAB_FILE = "vocab.json"
SONATA_CONFIG_FILE = "sonata_config.json"
WEIGHTS_FILE = "model.safetensors"
HF_CLASSES = {"mamba": "MambaForCausalLM", "mamba2": "Mamba2ForCausalLM"}   # model_type -> class


def _require_safetensors():
    try:
        import safetensors.torch as st
    except ImportError:  # pragma: no cover - a dependency; the message names the fix
        raise SonataError("the safetensors package is needed: pip install safetensors") from None
    return st


# --------------------------------------------------------------------------- export

def hf_family(cfg: ModelConfig) -> str:
    """The transformers model_type a sonata model exports as: "mamba" (every layer Mamba-1) or
    "mamba2" (every layer Mamba-2); a SonataError, in one line, for any other stack."""
    kinds = set(cfg.kinds)
    if len(kinds) == 1 and next(iter(kinds)) in HF_CLASSES:
        return next(iter(kinds))
    raise SonataError(f"cannot export to transformers: model.arch={cfg.arch} ({','.join(cfg.kinds)}) has no "
                      f"transformers class; MambaForCausalLM holds only mamba layers and Mamba2ForCausalLM "
                      f"only mamba2 layers (no lti, attention or mixed stacks)")


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
        "time_step_rank": c.dt_rank_,
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
    if out.is_dir() and any(out.iterdir()) and not force:
        raise SonataError(f"--hf {out} is a folder that is not empty; choose a new or empty one "
                          f"(or --force to replace it and everything in it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)                        # mkdtemp's 0700 is not an export's mode
    try:
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
            tmp.rmdir()
        elif out.exists():                               # replaced whole, with force
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SonataError(f"cannot write the export {out}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# --------------------------------------------------------------------------- import

def load_vocab(path) -> Vocab | None:
    """The sonata vocabulary of an exported directory, or None when it has none."""
    f = Path(path) / VOCAB_FILE
    if not f.exists():
        return None
    try:
        d = json.loads(f.read_text())
        return Vocab.from_state_dict({"kind": d["kind"], "tokens": torch.tensor(d["tokens"], dtype=torch.int64)})
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{f} is not a sonata vocabulary ({str(e).splitlines()[0][:120]})") from None


def is_hf_dir(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").exists()


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
    """A sonata Config for a transformers MambaConfig or Mamba2Config dict; refuses, in one line
    naming the field, what MambaLM cannot hold. The folder's sonata_config.json (an export's) is
    the base; the shape comes from config.json."""
    def need(key):
        if key not in conf:
            raise CheckpointError(f"{path}/config.json has no {key!r}")
        return conf[key]

    kind = conf.get("model_type")
    if kind not in HF_CLASSES:
        raise CheckpointError(f"{path}/config.json: model_type is {kind!r}; sonata imports Mamba-1 ('mamba') "
                              f"and Mamba-2 ('mamba2') models only")
    if conf.get("use_bias", False):
        raise CheckpointError(f"{path}: use_bias=true (biases on in_proj/out_proj) is not a sonata MambaLM")
    if conf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {conf['hidden_act']!r} is not silu")
    d, expand = int(need("hidden_size")), need("expand")
    if int(expand) != expand:
        raise CheckpointError(f"{path}: expand {expand} is not a whole number (sonata's model.expand is)")
    expand = int(expand)
    cfg = Config()
    p = Path(str(path)) / SONATA_CONFIG_FILE if path else None
    if p is not None and p.exists():
        try:
            cfg = Config.from_dict(json.loads(p.read_text()))
        except (json.JSONDecodeError, SonataError) as e:
            raise CheckpointError(f"{p} is not a sonata config ({e})") from None
    m = cfg.model
    m.arch, m.layers = kind, ""
    m.d_model, m.n_layers, m.d_state, m.expand = d, int(need("num_hidden_layers")), int(need("state_size")), expand
    m.d_conv = int(conf.get("conv_kernel", 4))
    m.vocab_size = int(need("vocab_size"))
    m.norm_eps = float(conf.get("layer_norm_epsilon", 1e-5))
    # transformers' defaults: MambaConfig ties the head, Mamba2Config does not
    m.tie_embeddings = bool(conf.get("tie_word_embeddings", kind == "mamba"))
    m.a_param = "log"
    for ours, theirs in (("dt_min", "time_step_min"), ("dt_max", "time_step_max"), ("dt_init_floor", "time_step_floor")):
        if theirs in conf:                               # initialisation only: kept for the record
            setattr(m, ours, float(conf[theirs]))
    if kind == "mamba2":
        _mamba2_fields(conf, m, need, path)
    else:
        inner, rank = conf.get("intermediate_size"), conf.get("time_step_rank", "auto")
        if inner is not None and int(inner) != expand * d:
            raise CheckpointError(f"{path}: intermediate_size {inner} is not expand x hidden_size")
        m.dt_rank = math.ceil(d / 16) if rank == "auto" else int(rank)
    if m.vocab_size >= 258:
        cfg.data.vocab_size = m.vocab_size
    try:
        return cfg.validate()
    except SonataError as e:
        raise CheckpointError(f"{path}: config.json is not a model sonata can build ({e})") from None


def _mamba2_fields(conf: dict, m: ModelConfig, need, path) -> None:
    """Mamba2Config's head layout and what its mixer computes, checked against Mamba2Mixer: missing
    fields take transformers' defaults (n_groups 8, chunk_size 256), as from_pretrained would."""
    heads, headdim = int(need("num_heads")), int(need("head_dim"))
    groups, chunk = int(conf.get("n_groups", 8)), int(conf.get("chunk_size", 256))
    if heads * headdim != m.expand * m.d_model:
        raise CheckpointError(f"{path}: num_heads x head_dim ({heads} x {headdim}) is not expand x hidden_size "
                              f"({m.expand * m.d_model})")
    if groups <= 0 or heads % groups:
        raise CheckpointError(f"{path}: n_groups {groups} does not divide num_heads {heads} (each group of B "
                              f"and C is shared by num_heads / n_groups heads)")
    limit = conf.get("time_step_limit", [0.0, math.inf])
    if not (isinstance(limit, (list, tuple)) and len(limit) == 2 and limit[0] == 0 and _is_inf(limit[1])):
        raise CheckpointError(f"{path}: time_step_limit {limit} clamps dt; sonata's mamba2 block has no dt "
                              f"limit (only (0, inf))")
    if conf.get("norm_before_gate", False) or not conf.get("rms_norm", True):
        raise CheckpointError(f"{path}: norm_before_gate=true or rms_norm=false; sonata's mamba2 block is "
                              f"norm(y * silu(z)), an RMSNorm after the gate")
    if chunk <= 0:
        raise CheckpointError(f"{path}: chunk_size {chunk} is not positive")
    m.headdim, m.ngroups, m.chunk_size = headdim, groups, chunk


def sonata_state_dict(weights: dict[str, torch.Tensor], cfg: Config, conf: dict, path="") -> dict[str, torch.Tensor]:
    """transformers' Mamba or Mamba-2 weights (names as in its state_dict) under MambaLM's names,
    float32 (a float32 tensor is passed through, not copied: `sonata.interop.hf_accelerate` shares
    storage this way); a tied head checked and set, an untied one (tie_word_embeddings=false)
    required, a missing conv bias (use_conv_bias=false) zero."""
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
        if key not in sd and not conf.get("use_conv_bias", True) and weight is not None:
            sd[key] = torch.zeros(weight.shape[0])        # d_inner (Mamba-1), d_inner + 2 G N (Mamba-2)
    return sd


def import_hf(path, device="cpu") -> tuple[MambaLM, Vocab | None, Config]:
    """MambaLM (eval mode), its vocabulary (None unless the folder has sonata's) and a Config,
    from a transformers Mamba-1 or Mamba-2 folder: one exported here, a `Mamba2ForCausalLM`'s
    save_pretrained (a tied or an untied head), or e.g. state-spaces/mamba-130m-hf."""
    path = Path(path)
    if not is_hf_dir(path):
        raise CheckpointError(f"{path} is not a transformers model folder (no config.json)")
    try:
        conf = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}/config.json is not JSON ({e})") from None
    cfg = config_from_hf(conf, path)
    sd = sonata_state_dict(_read_weights(path), cfg, conf, path)
    model = MambaLM(cfg.model)
    try:
        model.load_state_dict(sd)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: the weights do not match config.json: "
                              f"{' '.join(str(e).split())[:240]}") from None
    return model.to(device).eval(), load_vocab(path), cfg


def train_overrides(cfg: Config) -> list[str]:
    """The `key=value` overrides that make `train` build `cfg`'s model shape, so `train --init`
    loads an imported checkpoint (a new run otherwise builds the default model)."""
    m = cfg.model
    keys = ["arch", "d_model", "n_layers", "d_state", "expand", "d_conv", "norm_eps"]
    keys += ["headdim", "ngroups", "chunk_size"] if m.arch == "mamba2" else ["dt_rank", "a_param"]
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
           "config_from_hf", "load_vocab", "is_hf_dir", "sonata_state_dict", "train_overrides", "HF_CLASSES"]
