"""`python -m sonata generate` and sonata.lab.generate on inputs a user can get wrong or push to
an edge: a temperature so small that logits / temperature overflows float32 (its top token is
certain: greedy, never a crash in torch.multinomial), and a transformers-style folder whose
config.json has a value of the wrong kind (one `error:` line naming the file and the key)."""
import json
import math

import pytest
import torch

from sonata.__main__ import main
from sonata.core import checkpoint as ckpt
from sonata.core.config import Config
from sonata.interop.hf import export_hf
from sonata.lab.generate import generate_text, stream_text
from sonata.model.decode import sample_next
from models import _sonata, _vocab

# float32 has no quotient for these: 1e-45 is its smallest subnormal (a logit above ~5e-7
# overflows), 1e-46 and smaller round to 0 (0 / 0 is NaN), 5e-324 is float64's smallest.
TINY = ["1e-45", "1e-46", "1e-300", "5e-324"]

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A small random model as a sonata checkpoint and as an exported transformers folder."""
    root = tmp_path_factory.mktemp("generate")
    m = _sonata(seed=6)
    cfg = Config()
    cfg.model = m.cfg
    path = root / "ck.pt"
    ckpt.save({"model": m.state_dict(), "config": cfg.to_dict(), "vocab": _vocab().state_dict()}, path)
    export_hf(m, _vocab(), root / "hf", cfg)
    return m, path, root / "hf"


def _generate(capsys, *args):
    code = main(["generate", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- temperature

@pytest.mark.parametrize("temperature", TINY)
@pytest.mark.parametrize("top_k", ["0", "40"])
def test_cli_temperature_whose_quotient_overflows_is_greedy(saved, capsys, temperature, top_k):
    _, path, _ = saved
    args = (path, "--n", "2", "--max-new-tokens", "16", "--prompt", "Once", "--top-k", top_k)
    code, greedy, err = _generate(capsys, *args, "--temperature", "0")
    assert code == 0, err
    code, out, err = _generate(capsys, *args, "--temperature", temperature)
    assert code == 0 and err == "", err
    assert out == greedy and out.count("--- sample") == 2


@pytest.mark.parametrize("temperature", [float(t) for t in TINY])
def test_stream_text_at_an_overflowing_temperature_is_greedy(saved, temperature):
    m, _, _ = saved
    vocab = _vocab()
    greedy = "".join(stream_text(m, vocab, "Once", 20, temperature=0, top_k=0))
    for top_k in (0, 40):
        assert "".join(stream_text(m, vocab, "Once", 20, temperature=temperature, top_k=top_k, seed=3)) == greedy


def test_ordinary_temperatures_still_sample(saved):
    """The rule touches only quotients that overflow: 1e-30 (logits of a few units stay finite)
    and 0.8 sample as before, the same seed giving the same text."""
    m, _, _ = saved
    vocab = _vocab()
    a = "".join(stream_text(m, vocab, "Once", 30, temperature=0.8, top_k=0, seed=1))
    assert a == "".join(stream_text(m, vocab, "Once", 30, temperature=0.8, top_k=0, seed=1))
    assert a != "".join(stream_text(m, vocab, "Once", 30, temperature=0, top_k=0))
    greedy = "".join(stream_text(m, vocab, "Once", 30, temperature=0, top_k=0))
    assert "".join(stream_text(m, vocab, "Once", 30, temperature=1e-30, top_k=0, seed=1)) == greedy


@pytest.mark.parametrize("temperature", [float(t) for t in TINY])
def test_generate_text_at_an_overflowing_temperature_is_greedy(saved, temperature):
    """The batch path (MambaLM.generate -> sonata.model.decode.sample_next), from Python."""
    m, _, _ = saved
    vocab = _vocab()
    greedy = generate_text(m, vocab, "Once", n=2, max_new_tokens=20, temperature=0, top_k=0)
    assert generate_text(m, vocab, "Once", n=2, max_new_tokens=20, temperature=temperature, top_k=40) == greedy


def test_sample_next_takes_the_top_token_where_the_quotient_overflows():
    """Row 0's quotient overflows (40 / 1e-37 > 3.4e38): its top token, whatever the seed; row 1
    (all zeros: 0 / 1e-37 = 0) still samples uniformly; with top_k as well."""
    logits = torch.tensor([[1.0, 40.0, -50.0, 39.0], [0.0, 0.0, 0.0, 0.0]])
    before = logits.clone()
    seen = set()
    for seed in range(40):
        for top_k in (0, 2):
            g = torch.Generator().manual_seed(seed)
            nxt = sample_next(logits, 1e-37, top_k, g)
            assert int(nxt[0]) == 1
            seen.add(int(nxt[1]))
            out = torch.empty(2, dtype=torch.long)
            sample_next(logits[:1], 1e-45, top_k, g, out=out[:1])
            assert int(out[0]) == 1
    assert len(seen) > 1
    assert torch.equal(logits, before)            # the logits are not changed in place


# --------------------------------------------------------------------------- config.json

def _with(folder, dest, **changes):
    """A copy of the exported `folder` at `dest` whose config.json has `changes` (text as is)."""
    dest.mkdir()
    for f in folder.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    conf = json.loads((dest / "config.json").read_text())
    conf.update(changes)
    (dest / "config.json").write_text(json.dumps(conf))
    return dest


@pytest.mark.parametrize("key,value", [
    ("hidden_size", "abc"), ("hidden_size", None), ("layer_norm_epsilon", "x"),
    ("num_hidden_layers", 1.5), ("num_hidden_layers", 0), ("state_size", True),
    ("layer_norm_epsilon", math.nan), ("tie_word_embeddings", "false"),
])
def test_cli_generate_from_a_folder_with_a_bad_config_value_is_one_error_line(saved, tmp_path, capsys, key, value):
    _, _, folder = saved
    bad = _with(folder, tmp_path / "bad", **{key: value})
    code, out, err = _generate(capsys, bad, "--n", "1", "--max-new-tokens", "4")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {bad}/config.json: {key} ") and "Traceback" not in err, lines[0]
    assert out == ""
