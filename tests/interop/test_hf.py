"""Hugging Face interchange against transformers' MambaForCausalLM and Mamba2ForCausalLM as the
peer oracles (random weights saved to a temporary folder, CPU only, nothing downloaded). The
fast decoder is tested in test_decode.py (it does not need transformers)."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from sonata.core import checkpoint as ckpt
from sonata.core.config import Config, ModelConfig, make_config
from sonata.core.errors import CheckpointError, SonataError
from sonata.data.vocab import Vocab
from sonata.interop.hf import export_hf, import_hf, train_overrides
from sonata.lab.generate import load_model
from sonata.model.lm import MambaLM
from conftest import _assert_one_error_line, run_cli, tiny_overrides
from models import VOCAB, _ids, _sonata, _vocab

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

def _hf(path):
    return transformers.MambaForCausalLM.from_pretrained(str(path)).eval()


@pytest.mark.parametrize("a_param", ["log", "direct"])
def test_export_logits_match_transformers(tmp_path, a_param):
    m = _sonata(a_param)
    export_hf(m, _vocab(), tmp_path / "hf")
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["model_type"] == "mamba" and conf["use_bias"] is False and conf["use_conv_bias"] is True
    assert (conf["hidden_size"], conf["num_hidden_layers"], conf["state_size"], conf["intermediate_size"],
            conf["time_step_rank"], conf["vocab_size"]) == (32, 2, 8, 64, 2, VOCAB)
    for f in ("generation_config.json", "vocab.json", "README.md"):
        assert (tmp_path / "hf" / f).exists()
    from safetensors import safe_open
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "backbone.embeddings.weight" in keys and "lm_head.weight" not in keys   # tied: stored once
    hf = _hf(tmp_path / "hf")
    assert hf.lm_head.weight.data_ptr() == hf.backbone.embeddings.weight.data_ptr()
    idx = _ids()
    with torch.no_grad():
        ours, theirs = m(idx), hf(idx).logits
    assert theirs.shape == ours.shape
    assert (ours - theirs).abs().max().item() < 1e-4
    assert ours.std().item() > 0.1                                     # not trivially equal


def test_import_of_random_transformers_model_gives_same_logits(tmp_path):
    torch.manual_seed(3)
    conf = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=3, state_size=6,
                                    expand=2, conv_kernel=3, time_step_rank=5, layer_norm_epsilon=1e-6)
    hf = transformers.MambaForCausalLM(conf).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(str(tmp_path / "hf"))
    m, vocab, cfg = import_hf(tmp_path / "hf")
    assert vocab is None and cfg.model.dt_rank == 5 and cfg.model.d_conv == 3 and cfg.model.norm_eps == 1e-6
    idx = _ids(2, 23)
    with torch.no_grad():
        assert (m(idx) - hf(idx).logits).abs().max().item() < 1e-4
    # the imported model trains: gradients reach every parameter
    loss = torch.nn.functional.cross_entropy(m.train()(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    # a folder without sonata's vocabulary cannot be sampled as text: one clear error
    with pytest.raises(CheckpointError, match="no sonata vocabulary"):
        load_model(tmp_path / "hf")


def test_greedy_64_tokens_same_ids_as_transformers(tmp_path):
    m = _sonata(seed=4)
    export_hf(m, _vocab(), tmp_path / "hf")
    hf = _hf(tmp_path / "hf")
    prompt = _ids(2, 7, seed=5)
    ours = m.generate(prompt, 64, temperature=0)
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=64, do_sample=False, eos_token_id=None,
                             pad_token_id=Vocab.EOT_ID, attention_mask=torch.ones_like(prompt))
    assert theirs.shape == ours.shape == (2, 7 + 64)
    assert torch.equal(ours, theirs)
    assert len(set(ours[0, 7:].tolist())) > 1


def test_direct_A_not_negative_everywhere_is_refused(tmp_path):
    m = _sonata("direct")
    with torch.no_grad():
        m.layers[1].mixer.A_param[3, 2] = 0.01
    with pytest.raises(SonataError, match=r"layers\.1\.mixer\.A_param has 1 entries >= 0"):
        export_hf(m, _vocab(), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def _checkpoint(tmp_path, m: MambaLM, name="ck.pt"):
    cfg = Config()
    cfg.model = m.cfg
    path = tmp_path / name
    ckpt.save({"model": m.state_dict(), "config": cfg.to_dict(), "vocab": _vocab().state_dict()}, path)
    return path


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=os.getcwd(), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "sonata", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_cli_export_then_load_back_and_generate(tmp_path):
    m = _sonata(seed=6)
    path = _checkpoint(tmp_path, m)
    r = _cli("export", str(path), "--hf", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    back, vocab, cfg = load_model(tmp_path / "out")
    assert torch.equal(torch.from_numpy(vocab.tokens), torch.from_numpy(_vocab().tokens))
    idx = _ids()
    with torch.no_grad():
        assert torch.allclose(back(idx), m(idx), atol=1e-6)
    g = _cli("generate", str(tmp_path / "out"), "--n", "2", "--max-new-tokens", "8", "--prompt", "Once")
    assert g.returncode == 0, g.stderr
    assert g.stdout.count("--- sample") == 2 and g.stdout.count("\nOnce") == 2


def test_cli_export_refuses_positive_direct_A_with_one_error_line(tmp_path):
    m = _sonata("direct", seed=7)
    with torch.no_grad():
        m.layers[0].mixer.A_param[0, 0] = 0.5
    r = _cli("export", str(_checkpoint(tmp_path, m)), "--hf", str(tmp_path / "out"))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot export to transformers")


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_an_untied_head_exports_loads_in_transformers_and_imports_back(tmp_path, arch):
    """model.tie_embeddings=false: tie_word_embeddings false and lm_head.weight stored; transformers'
    model keeps the two apart with sonata's logits; importing the folder gives the same model."""
    m = _sonata(seed=7, tie_embeddings=False) if arch == "mamba" else _sonata2(seed=7, tie_embeddings=False)
    assert not torch.allclose(m.lm_head.weight, m.embedding.weight)
    export_hf(m, _vocab(), tmp_path / "hf")
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["tie_word_embeddings"] is False
    from safetensors import safe_open
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert {"backbone.embeddings.weight", "lm_head.weight"} <= set(f.keys())
    hf = _hf(tmp_path / "hf") if arch == "mamba" else _hf2(tmp_path / "hf")
    assert hf.lm_head.weight.data_ptr() != hf.backbone.embeddings.weight.data_ptr()
    assert torch.equal(hf.lm_head.weight, m.lm_head.weight)
    idx = _ids(3, 21)
    back, _, cfg = import_hf(tmp_path / "hf")
    assert cfg.model.tie_embeddings is False and back.lm_head.weight is not back.embedding.weight
    with torch.no_grad():
        ours, theirs = m(idx), hf(idx).logits
        assert (ours - theirs).abs().max().item() < 1e-4 and ours.std().item() > 0.1
        assert torch.equal(back(idx), ours)


def test_a_head_that_contradicts_tie_word_embeddings_is_a_clear_error(tmp_path):
    export_hf(_sonata(seed=7, tie_embeddings=False), _vocab(), tmp_path / "untied")
    conf = json.loads((tmp_path / "untied" / "config.json").read_text())
    (tmp_path / "untied" / "config.json").write_text(json.dumps({**conf, "tie_word_embeddings": True}))
    with pytest.raises(CheckpointError, match="lm_head.weight differs from the embedding, but config.json "
                                              "says tie_word_embeddings=true"):
        import_hf(tmp_path / "untied")
    export_hf(_sonata(seed=7), _vocab(), tmp_path / "tied")
    conf = json.loads((tmp_path / "tied" / "config.json").read_text())
    (tmp_path / "tied" / "config.json").write_text(json.dumps({**conf, "tie_word_embeddings": False}))
    r = run_cli("import", str(tmp_path / "tied"), "--out", str(tmp_path / "x.pt"))
    _assert_one_error_line(r, "tie_word_embeddings is false but the weights hold no lm_head.weight")
    assert not (tmp_path / "x.pt").exists()


def test_import_refuses_foreign_folders(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(CheckpointError, match=r"model_type is 'llama'; sonata imports Mamba-1 .* and Mamba-2"):
        import_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "mamba", "hidden_size": 32, "num_hidden_layers": 2, "state_size": 8, "expand": 2,
         "vocab_size": VOCAB}))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        import_hf(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match="cannot read the weights"):
        import_hf(tmp_path)


def test_export_refuses_a_folder_that_is_not_empty_and_force_replaces_it_whole(tmp_path):
    """`export --hf .` in a project must not write over its README: a non-empty folder is
    refused (one error line, nothing changed) unless --force, which replaces the folder whole;
    an empty folder is fine; no temporary folder is left beside it."""
    m = _sonata(seed=8)
    path = _checkpoint(tmp_path, m)
    target = tmp_path / "project"
    target.mkdir()
    (target / "README.md").write_text("mine\n")
    r = _cli("export", str(path), "--hf", str(target))
    assert r.returncode == 2 and r.stderr.startswith("error: --hf") and "not empty" in r.stderr, r.stderr
    assert [p.name for p in target.iterdir()] == ["README.md"] and (target / "README.md").read_text() == "mine\n"
    r = _cli("export", str(path), "--hf", str(target), "--force")
    assert r.returncode == 0, r.stderr
    assert (target / "model.safetensors").exists() and "mine" not in (target / "README.md").read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    export_hf(m, _vocab(), empty)
    assert (empty / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_export_into_the_current_empty_folder_fills_it_in_place_with_a_normal_mode(tmp_path):
    """Issue 42 items 11 and 19: `export --hf .` gave a traceback (a path with an empty name)
    even in an empty folder, and every export folder came out mode 0700 (mkdtemp's). Now `.`
    names the folder it is, an empty one is filled in place (a shell standing in it stays
    there), and the folder gets the usual mode under the umask."""
    m = _sonata(seed=8)
    path = _checkpoint(tmp_path, m)
    here = tmp_path / "here"
    here.mkdir()
    inode = here.stat().st_ino
    r = subprocess.run([sys.executable, "-m", "sonata", "export", str(path), "--hf", "."], cwd=here,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert (here / "model.safetensors").exists() and here.stat().st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    umask = os.umask(0)
    os.umask(umask)
    fresh = export_hf(m, _vocab(), tmp_path / "fresh")
    assert fresh.stat().st_mode & 0o777 == 0o777 & ~umask


def test_import_refuses_shards_outside_the_folder(tmp_path):
    m = _sonata(seed=9)
    export_hf(m, _vocab(), tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "outside.safetensors")
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"backbone.embeddings.weight": "../outside.safetensors"}}))
    with pytest.raises(CheckpointError, match="outside its folder"):
        import_hf(tmp_path / "hf")



# --------------------------------------------------------------------------- Mamba-2

def _sonata2(seed=0, **kw) -> MambaLM:
    """A small Mamba-2 MambaLM (8 heads of 8 in 2 groups, chunk 8 so a 37-token input has a partial
    chunk) with every parameter moved off its initial value; the embedding scaled up so the logits
    are not tiny (std about 0.5: a 1e-5 agreement means something)."""
    torch.manual_seed(seed)
    c = dict(arch="mamba2", d_model=32, n_layers=2, d_state=8, headdim=8, ngroups=2, chunk_size=8,
             vocab_size=VOCAB)
    m = MambaLM(ModelConfig(**{**c, **kw})).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("A_log"):
                p.add_(torch.randn_like(p) * 0.3)
            elif p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.mul_(torch.empty_like(p).uniform_(0.7, 1.3))
        m.embedding.weight.mul_(5)
    return m


def _hf2(path):
    _assert_transformers_own_mamba2_path()
    return transformers.Mamba2ForCausalLM.from_pretrained(str(path)).eval()


def _assert_transformers_own_mamba2_path():
    """The peer is transformers' own PyTorch code: had sonata's mamba_ssm shim (or mamba_ssm) been
    importable when transformers' Mamba-2 module was imported, its ops would be resolved to those
    (at import, `use_kernel_func_from_hub_with_fallback`) and the comparison would be circular."""
    from transformers.models.mamba2 import modeling_mamba2 as mm
    for name in ("mamba2_chunk_scan", "mamba2_selective_state_update", "causal_conv1d_fn", "causal_conv1d_update"):
        cells = _cells(getattr(mm, name))
        if "is_new_implementation" in cells:                # this transformers' wrapper (5.x)
            devices = cells["supported_devices"].cell_contents if "supported_devices" in cells else None
            own = cells["is_new_implementation"].cell_contents is False or (devices is not None and "cpu" not in devices)
            assert own, f"transformers' {name} is not its own on CPU"


def _cells(f):
    """The closure of transformers' op wrapper by name; with the `kernels` package installed
    (transformers 5.25 requires it) the wrapper sits inside kernels' `Func` module, whose
    forward calls it."""
    if isinstance(f, torch.nn.Module):
        forward = type(f).forward
        f = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))["func"].cell_contents
    return dict(zip(f.__code__.co_freevars, f.__closure__ or ()))


def _random_hf2(path, seed=3, **kw):
    """A random transformers Mamba2ForCausalLM saved to `path` (every parameter perturbed)."""
    torch.manual_seed(seed)
    c = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, state_size=6, expand=2, num_heads=8,
             head_dim=12, n_groups=2, chunk_size=16, conv_kernel=3, layer_norm_epsilon=1e-6,
             tie_word_embeddings=True)
    _assert_transformers_own_mamba2_path()
    hf = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(**{**c, **kw})).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(str(path))
    return hf


@pytest.mark.parametrize("ngroups,chunk", [(1, 8), (2, 8), (4, 64)])
def test_mamba2_export_logits_match_transformers(tmp_path, ngroups, chunk):
    """Measured max |logit difference| on this CPU (float32, 3 x 37 tokens): about 2e-7 at
    logits of std 0.5; the bound is 1e-5."""
    m = _sonata2(ngroups=ngroups, chunk_size=chunk)
    export_hf(m, _vocab(), tmp_path / "hf")
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["model_type"] == "mamba2" and conf["architectures"] == ["Mamba2ForCausalLM"]
    assert (conf["hidden_size"], conf["num_hidden_layers"], conf["state_size"], conf["num_heads"],
            conf["head_dim"], conf["n_groups"], conf["chunk_size"], conf["vocab_size"]) == \
        (32, 2, 8, 8, 8, ngroups, chunk, VOCAB)
    assert conf["use_bias"] is False and conf["use_conv_bias"] is True and conf["tie_word_embeddings"] is True
    assert "Mamba2ForCausalLM" in (tmp_path / "hf" / "README.md").read_text()
    hf = _hf2(tmp_path / "hf")
    assert hf.lm_head.weight.data_ptr() == hf.backbone.embeddings.weight.data_ptr()
    assert hf.backbone.layers[0].mixer.norm.group_size == 64 // ngroups
    idx = _ids(3, 37)
    with torch.no_grad():
        ours, theirs = m(idx), hf(idx).logits
    assert theirs.shape == ours.shape
    diff = (ours - theirs).abs().max().item()
    print(f"mamba2 export ngroups={ngroups} chunk={chunk}: max |logit diff| {diff:.2e}, logit std {ours.std():.3f}")
    assert diff < 1e-5
    assert ours.std().item() > 0.3                                     # not trivially equal


def test_mamba2_greedy_64_tokens_same_ids_as_transformers(tmp_path):
    """transformers decodes with its cache (the recurrent selective_state_update after a chunked
    prefill), sonata with its fused decoding step: the same 64 greedy ids."""
    m = _sonata2(seed=4)
    export_hf(m, _vocab(), tmp_path / "hf")
    hf = _hf2(tmp_path / "hf")
    prompt = _ids(2, 11, seed=5)
    ours = m.generate(prompt, 64, temperature=0)
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=64, do_sample=False, eos_token_id=None,
                             pad_token_id=Vocab.EOT_ID, attention_mask=torch.ones_like(prompt))
    assert theirs.shape == ours.shape == (2, 11 + 64)
    assert torch.equal(ours, theirs)
    assert len(set(ours[0, 11:].tolist())) > 1


def test_mamba2_round_trip_is_exact(tmp_path):
    """export -> import gives the same weights bit for bit and the same shape; exporting the
    import again writes the same config.json and tensors."""
    m = _sonata2(seed=6, norm_eps=1e-6, d_conv=3)
    export_hf(m, _vocab(), tmp_path / "a")
    back, vocab, cfg = import_hf(tmp_path / "a")
    assert (cfg.model.arch, cfg.model.headdim, cfg.model.ngroups, cfg.model.chunk_size, cfg.model.d_conv,
            cfg.model.norm_eps, cfg.model.nheads) == ("mamba2", 8, 2, 8, 3, 1e-6, 8)
    assert torch.equal(torch.from_numpy(vocab.tokens), torch.from_numpy(_vocab().tokens))
    sd, sd_back = m.state_dict(), back.state_dict()
    assert sd.keys() == sd_back.keys() and all(torch.equal(sd[k], sd_back[k]) for k in sd)
    assert back.lm_head.weight is back.embedding.weight
    export_hf(back, vocab, tmp_path / "b")
    assert (tmp_path / "a" / "config.json").read_text() == (tmp_path / "b" / "config.json").read_text()
    from safetensors.torch import load_file
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("conv_bias", [True, False])
def test_import_of_random_transformers_mamba2_gives_same_logits_and_trains(tmp_path, conv_bias):
    hf = _random_hf2(tmp_path / "hf", use_conv_bias=conv_bias)
    m, vocab, cfg = import_hf(tmp_path / "hf")
    assert vocab is None and (cfg.model.arch, cfg.model.d_model, cfg.model.headdim, cfg.model.ngroups,
                              cfg.model.chunk_size, cfg.model.d_conv, cfg.model.norm_eps) == \
        ("mamba2", 48, 12, 2, 16, 3, 1e-6)
    idx = _ids(2, 41)
    with torch.no_grad():
        diff = (m(idx) - hf(idx).logits).abs().max().item()
    print(f"mamba2 import use_conv_bias={conv_bias}: max |logit diff| {diff:.2e}")
    assert diff < 1e-5
    loss = torch.nn.functional.cross_entropy(m.train()(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_cli_import_of_a_transformers_mamba2_trains_and_exports_back(tmp_path):
    """`import DIR --out CKPT` prints the `train --init` line; that run trains a few steps from the
    imported weights; its checkpoint exports back and loads in Mamba2ForCausalLM with sonata's logits."""
    _random_hf2(tmp_path / "hf")
    init = tmp_path / "init.pt"
    r = run_cli("import", str(tmp_path / "hf"), "--out", str(init))
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("python -m sonata train --init"))
    shape = line.split()[6:]
    assert "model.arch=mamba2" in shape and "model.headdim=12" in shape and "data.vocab_size=300" in shape
    run = tmp_path / "run"
    r = run_cli("train", "--init", str(init), "--out", str(run), "--progress", "none",
                *tiny_overrides(), *shape)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and torch.isfinite(torch.tensor(summary["val_loss"]))
    start, trained = ckpt.load(init)["model"], ckpt.load(run / "checkpoint.pt")["model"]
    assert start.keys() == trained.keys()
    assert not torch.equal(start["layers.0.mixer.in_proj.weight"], trained["layers.0.mixer.in_proj.weight"])
    assert (start["layers.0.mixer.A_log"] - trained["layers.0.mixer.A_log"]).abs().max() < 0.1   # it started there
    r = run_cli("export", str(run / "checkpoint.pt"), "--hf", str(tmp_path / "back"))
    assert r.returncode == 0 and "Mamba2ForCausalLM" in r.stdout, r.stderr
    ours, _, _ = load_model(run / "checkpoint.pt")
    idx = _ids(2, 23)
    with torch.no_grad():
        assert (ours(idx) - _hf2(tmp_path / "back")(idx).logits).abs().max().item() < 1e-5


def test_train_overrides_rebuild_the_imported_shape_for_both_families(tmp_path):
    """What `import` prints for `train --init`: a default config with those overrides builds a
    model the imported weights load into (strictly), Mamba-1 and Mamba-2."""
    for i, m in enumerate((_sonata(seed=1, d_conv=3, norm_eps=1e-6), _sonata2(seed=1, d_conv=3, headdim=16, ngroups=4),
                           _sonata2(seed=1, tie_embeddings=False))):
        export_hf(m, _vocab(), tmp_path / str(i))
        back, _, cfg = import_hf(tmp_path / str(i))
        rebuilt = make_config(train_overrides(cfg))
        assert rebuilt.model.arch == m.cfg.arch and rebuilt.data.vocab_size == VOCAB
        assert rebuilt.model.tie_embeddings == m.cfg.tie_embeddings
        rebuilt.model.vocab_size = rebuilt.data.vocab_size            # what the trainer sets from its vocabulary
        fresh = MambaLM(rebuilt.model)
        fresh.load_state_dict(back.state_dict())
        assert torch.equal(fresh.lm_head.weight, m.lm_head.weight) and torch.equal(fresh.embedding.weight, m.embedding.weight)


def test_cli_export_refuses_stacks_without_a_transformers_class_in_one_line(tmp_path):
    for layers in ("mamba2,attention", "mamba,mamba2"):
        torch.manual_seed(0)
        m = MambaLM(ModelConfig(layers=layers, d_model=32, d_state=8, headdim=8, vocab_size=VOCAB, n_heads=4))
        cfg = Config()
        cfg.model = m.cfg
        cfg.validate()
        path = tmp_path / f"{layers.replace(',', '-')}.pt"
        ckpt.save({"model": m.state_dict(), "config": cfg.to_dict(), "vocab": _vocab().state_dict()}, path)
        r = run_cli("export", str(path), "--hf", str(tmp_path / "out"))
        _assert_one_error_line(r, f"cannot export to transformers: model.arch=hybrid ({layers}) has no transformers class")
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change,fragment", [
    (dict(n_groups=3), "n_groups 3 does not divide num_heads 8"),
    (dict(use_bias=True), "use_bias=true"),
    (dict(time_step_limit=(0.0, 0.1)), "time_step_limit [0.0, 0.1] clamps dt"),
])
def test_import_refuses_mamba2_folders_sonata_cannot_represent(tmp_path, change, fragment):
    _random_hf2(tmp_path / "hf", **change)
    with pytest.raises(CheckpointError, match=re.escape(fragment)):
        import_hf(tmp_path / "hf")


def test_cli_import_of_an_unrepresentable_mamba2_is_one_error_line(tmp_path):
    _random_hf2(tmp_path / "hf", n_groups=3)
    r = run_cli("import", str(tmp_path / "hf"), "--out", str(tmp_path / "x.pt"))
    _assert_one_error_line(r, "n_groups 3 does not divide num_heads 8")
    assert not (tmp_path / "x.pt").exists()
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**conf, "n_groups": 2, "num_heads": 7}))
    r = run_cli("import", str(tmp_path / "hf"), "--out", str(tmp_path / "x.pt"))
    _assert_one_error_line(r, "num_heads x head_dim (7 x 12) is not expand x hidden_size (96)")
    (tmp_path / "x.pt").write_bytes(b"mine")
    _random_hf2(tmp_path / "ok")
    r = run_cli("import", str(tmp_path / "ok"), "--out", str(tmp_path / "x.pt"))
    _assert_one_error_line(r, "exists")
    assert (tmp_path / "x.pt").read_bytes() == b"mine"


# --------------------------------------------------------------------------- user mistakes

def _main(capsys, *args):
    """`python -m sonata ARGS` in this process: its exit status, stdout and stderr lines."""
    from sonata.__main__ import main
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, [ln for ln in err.splitlines() if ln.strip()]


def test_cli_export_under_a_regular_file_is_one_error_line(tmp_path, capsys):
    """`export --hf afile/sub`: mkdir of afile gave a FileExistsError traceback."""
    path = _checkpoint(tmp_path, _sonata(seed=6))
    (tmp_path / "afile").write_text("mine\n")
    code, out, err = _main(capsys, "export", path, "--hf", tmp_path / "afile" / "sub")
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --hf "), err
    assert f"{tmp_path / 'afile'} is a file" in err[0]
    assert (tmp_path / "afile").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ck.pt"]


def _deny_writes_in(monkeypatch, folder):
    """Make `folder` unwritable: by its mode, and, where this process would write anyway (root),
    by refusing what export_hf does there (a temporary folder, a rename into it) as the kernel would."""
    import errno
    import tempfile
    folder.chmod(0o555)
    if not os.access(folder, os.W_OK):
        return
    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    real_mkdtemp, real_rename = tempfile.mkdtemp, os.rename

    def mkdtemp(*a, dir=None, **kw):
        if dir is not None and os.path.abspath(dir) == str(folder):
            raise denied
        return real_mkdtemp(*a, dir=dir, **kw)

    def rename(src, dst, *a, **kw):
        if os.path.dirname(os.path.abspath(dst)) == str(folder):
            raise denied
        return real_rename(src, dst, *a, **kw)
    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(os, "rename", rename)


@pytest.mark.parametrize("where", ["new folder in it", "itself, empty"])
def test_cli_export_into_an_unwritable_folder_is_one_error_line(tmp_path, capsys, monkeypatch, where):
    """A new --hf folder inside a read-only one (mkdtemp's PermissionError was a traceback), and an
    empty --hf folder that cannot be written (filled in place: nothing of the export is left in it)."""
    path = _checkpoint(tmp_path, _sonata(seed=6))
    ro = tmp_path / "ro"
    ro.mkdir()
    target = ro / "out" if where == "new folder in it" else ro
    try:
        _deny_writes_in(monkeypatch, ro)
        code, out, err = _main(capsys, "export", path, "--hf", target)
    finally:
        ro.chmod(0o755)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert str(ro) in err[0] and "Permission denied" in err[0], err[0]
    assert list(ro.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt", "ro"]


def _exported(tmp_path, arch="mamba"):
    folder = tmp_path / arch
    export_hf(_sonata(seed=4) if arch == "mamba" else _sonata2(seed=4), _vocab(), folder)
    return folder


def _set(folder, **changes):
    conf = json.loads((folder / "config.json").read_text())
    conf.update(changes)
    (folder / "config.json").write_text(json.dumps(conf))


NAN, INF = float("nan"), float("inf")
BAD_FIELDS = [    # (family, key, value): every config.json key sonata reads, each kind of mistake
    ("mamba", "hidden_size", "abc"), ("mamba", "hidden_size", None), ("mamba", "hidden_size", 1.5),
    ("mamba", "hidden_size", 0), ("mamba", "hidden_size", -32), ("mamba", "hidden_size", True),
    ("mamba", "hidden_size", "32"), ("mamba", "hidden_size", INF),
    ("mamba", "num_hidden_layers", 1.5), ("mamba", "num_hidden_layers", 0), ("mamba", "num_hidden_layers", None),
    ("mamba", "state_size", 0), ("mamba", "state_size", [8]), ("mamba", "expand", "2"), ("mamba", "expand", 0),
    ("mamba", "expand", 1.5), ("mamba", "conv_kernel", 0), ("mamba", "conv_kernel", None),
    ("mamba", "vocab_size", 2.5), ("mamba", "vocab_size", -1),
    ("mamba", "layer_norm_epsilon", "x"), ("mamba", "layer_norm_epsilon", NAN), ("mamba", "layer_norm_epsilon", INF),
    ("mamba", "layer_norm_epsilon", 0), ("mamba", "layer_norm_epsilon", -1e-5), ("mamba", "layer_norm_epsilon", None),
    ("mamba", "tie_word_embeddings", "false"), ("mamba", "tie_word_embeddings", 1),
    ("mamba", "use_bias", "false"), ("mamba", "use_conv_bias", "true"), ("mamba", "use_conv_bias", None),
    ("mamba", "hidden_act", 3), ("mamba", "model_type", ["mamba"]),
    ("mamba", "time_step_min", NAN), ("mamba", "time_step_min", 0), ("mamba", "time_step_max", -INF),
    ("mamba", "time_step_max", "0.1"), ("mamba", "time_step_floor", "x"), ("mamba", "time_step_floor", NAN),
    ("mamba", "intermediate_size", "64"), ("mamba", "intermediate_size", 64.5),
    ("mamba", "time_step_rank", "x"), ("mamba", "time_step_rank", 0), ("mamba", "time_step_rank", 2.5),
    ("mamba2", "num_heads", "8"), ("mamba2", "num_heads", 0), ("mamba2", "head_dim", 1.5),
    ("mamba2", "n_groups", "2"), ("mamba2", "n_groups", 0), ("mamba2", "chunk_size", 0),
    ("mamba2", "chunk_size", None), ("mamba2", "norm_before_gate", "false"), ("mamba2", "rms_norm", "true"),
    ("mamba2", "time_step_limit", "x"), ("mamba2", "layer_norm_epsilon", NAN), ("mamba2", "tie_word_embeddings", "no"),
]


@pytest.mark.parametrize("family,key,value", BAD_FIELDS, ids=[f"{f}-{k}-{v!r}" for f, k, v in BAD_FIELDS])
def test_import_names_the_file_and_key_of_a_bad_config_value(tmp_path, family, key, value):
    """Issue item 9: int("abc"), int(None) and float("x") were tracebacks, 1.5 layers was read as 1,
    "false" as true, NaN as a number. Each is a CheckpointError naming config.json and the key, with
    the value as the file has it."""
    folder = _exported(tmp_path, family)
    _set(folder, **{key: value})
    with pytest.raises(CheckpointError) as e:
        import_hf(folder)
    msg = str(e.value)
    assert msg.startswith(f"{folder}/config.json: {key} "), msg
    assert json.dumps(value) in msg and "\n" not in msg, msg


def test_config_values_of_the_right_kind_still_import(tmp_path):
    """Whole numbers written as 2.0, "auto" for time_step_rank, a null intermediate_size (derived),
    transformers' time_step_limit forms, a missing optional key: the model is the one exported."""
    folder = _exported(tmp_path)
    ref, _, cfg = import_hf(folder)
    _set(folder, hidden_size=32.0, num_hidden_layers=2.0, expand=2.0, time_step_rank="auto",
         intermediate_size=None, layer_norm_epsilon=1e-5, time_step_min=1e-3)
    conf = json.loads((folder / "config.json").read_text())
    del conf["conv_kernel"], conf["use_bias"], conf["time_step_floor"]
    (folder / "config.json").write_text(json.dumps(conf))
    back, _, again = import_hf(folder)
    assert again.model == cfg.model and isinstance(again.model.d_model, int)
    sd, sd_back = ref.state_dict(), back.state_dict()
    assert all(torch.equal(sd[k], sd_back[k]) for k in sd)
    folder2 = _exported(tmp_path, "mamba2")
    for limit in ([0, "Infinity"], [0.0, {"__float__": "Infinity"}], [0.0, INF]):
        _set(folder2, time_step_limit=limit, chunk_size=8.0)
        assert import_hf(folder2)[2].model.chunk_size == 8


@pytest.mark.parametrize("content", [b"[1, 2]", b"\xff\xfe not utf-8", b"{\"model_type\": ", b"null"])
def test_a_config_json_that_is_not_a_json_object_is_one_error(tmp_path, content):
    folder = _exported(tmp_path)
    (folder / "config.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=re.escape(f"{folder}/config.json")):
        import_hf(folder)
    folder2 = tmp_path / "dir"
    (folder2 / "config.json").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=re.escape(f"{folder2}/config.json")):
        import_hf(folder2)


def test_cli_import_and_generate_of_a_bad_config_value_are_one_error_line(tmp_path, capsys):
    folder = _exported(tmp_path)
    _set(folder, num_hidden_layers=1.5)
    for args in (["import", folder, "--out", tmp_path / "x.pt"], ["generate", folder, "--max-new-tokens", "4"],
                 ["eval", folder, "--text", folder / "README.md"]):
        code, out, err = _main(capsys, *args)
        assert code == 2 and len(err) == 1 and out == "", (args, err)
        assert err[0] == f"error: {folder}/config.json: num_hidden_layers must be a whole number >= 1, not 1.5"
    assert not (tmp_path / "x.pt").exists()


def test_a_bad_sonata_config_or_vocabulary_beside_config_json_is_one_error(tmp_path):
    folder = _exported(tmp_path)
    (folder / "sonata_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=re.escape(f"{folder}/sonata_config.json is not a sonata config")):
        import_hf(folder)
    (folder / "sonata_config.json").write_bytes(b"\xff")
    with pytest.raises(CheckpointError, match=re.escape(f"{folder}/sonata_config.json is not a sonata config")):
        import_hf(folder)
    (folder / "sonata_config.json").unlink()
    (folder / "vocab.json").write_bytes(b"\xff")
    with pytest.raises(CheckpointError, match=re.escape(f"{folder}/vocab.json is not a sonata vocabulary")):
        import_hf(folder)
