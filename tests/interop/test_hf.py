"""Hugging Face interchange against transformers' MambaForCausalLM as the peer oracle
(random weights saved to a temporary folder, CPU only, nothing downloaded). The fast decoder
is tested in test_decode.py (it does not need transformers)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from sonata.core import checkpoint as ckpt
from sonata.core.config import Config
from sonata.core.errors import CheckpointError, SonataError
from sonata.data.vocab import Vocab
from sonata.interop.hf import export_hf, import_hf
from sonata.lab.generate import load_model
from sonata.model.lm import MambaLM
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


def test_import_refuses_foreign_folders(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba2", "hidden_size": 8}))
    with pytest.raises(CheckpointError, match="Mamba-1"):
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
