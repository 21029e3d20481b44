"""`python -m sonata eval CKPT --text FILE` (sonata.train.evaluate): the trainer's own validation
figures on the same text, one error line for each bad input."""
import json
import math

import pytest

from conftest import run_cli, tiny_overrides
from sonata.__main__ import main
from sonata.core.config import make_config
from sonata.data.sources import load_stories, split_train_val
from sonata.data.vocab import EOT
from sonata.train.trainer import Trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model whose final validation covers the whole validation split, and that
    split written out as text."""
    out = tmp_path_factory.mktemp("eval")
    cfg = make_config(tiny_overrides(**{"train.eval_tokens": 0}))
    tr = Trainer(cfg, out, progress="none")
    summary = tr.run()
    _, val = split_train_val(load_stories("embedded", max_stories=60), cfg.data.val_fraction)
    text = out / "val.txt"
    text.write_text(f"\n{EOT}\n".join(val) + "\n")
    return out / "checkpoint.pt", text, summary, tr


def test_eval_gives_the_trainers_validation_figures_on_the_same_text(trained, capsys):
    path, text, summary, tr = trained
    assert main(["eval", str(path), "--text", str(text), "--json", "--device", "cpu"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == summary["val_tokens"] == tr.corpus.val.numel() - 1
    assert got["bytes"] == summary["val_bytes"]
    assert got["loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    assert got["bpb"] == pytest.approx(summary["val_bpb"], rel=1e-6)
    assert got["bpb"] == pytest.approx(got["loss"] * got["tokens"] / (math.log(2) * got["bytes"]), rel=1e-12)
    assert got["stories"] == summary["data"]["stories_val"] and got["seq_len"] == 32


def test_eval_of_text_without_separators_is_one_story(trained, tmp_path, capsys):
    path, text, _, tr = trained
    story = text.read_text().split(EOT)[0].strip()
    one, sep = tmp_path / "one.txt", tmp_path / "sep.txt"
    one.write_text(story + "\n")
    sep.write_text(f"{EOT}\n{story}\n{EOT}")
    results = []
    for f in (one, sep):
        assert main(["eval", str(path), "--text", str(f), "--json", "--device", "cpu"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert results[0] == results[1] and results[0]["stories"] == 1
    ids, _ = tr.corpus.vocab.encode_stories([story])
    assert results[0]["tokens"] == len(ids) - 1


def test_cli_eval_prints_loss_and_bits_per_byte(trained):
    path, text, summary, _ = trained
    r = run_cli("eval", str(path), "--text", str(text))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{text}: {summary['data']['stories_val']} stories, {summary['val_tokens']:,} tokens")
    assert lines[1] == f"validation loss: {summary['val_loss']:.4f} nats/token"
    assert lines[2] == f"bits per byte: {summary['val_bpb']:.4f}"


def _eval_error(capsys, *args):
    assert main(["eval", *map(str, args)]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_eval_bad_inputs_are_one_error_line(trained, tmp_path, capsys):
    path, text, _, tr = trained
    missing = tmp_path / "missing.txt"
    assert _eval_error(capsys, path, "--text", missing) == f"error: text file not found: {missing}"
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("Once upon a time, a caf\u00e9.".encode("latin-1"))
    assert _eval_error(capsys, path, "--text", latin) == \
        f"error: text file {latin} is not UTF-8 text (invalid continuation byte at byte 23)"
    short = tmp_path / "short.txt"
    short.write_text("Hi.")
    n = len(tr.corpus.vocab.encode_stories(["Hi."])[0])
    assert _eval_error(capsys, path, "--text", short) == (
        f"error: text file {short} is too short to score: {n} tokens under the checkpoint's vocabulary, "
        f"at least data.seq_len + 1 = 33 needed (one full window)")
    empty = tmp_path / "empty.txt"
    empty.write_text(f"\n{EOT}\n")
    assert "too short to score: 0 tokens" in _eval_error(capsys, path, "--text", empty)
    assert _eval_error(capsys, path, "--text", tmp_path) == f"error: cannot read text file {tmp_path}: Is a directory"
    assert _eval_error(capsys, tmp_path / "none.pt", "--text", text) == \
        f"error: checkpoint not found: {tmp_path / 'none.pt'}"
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    assert "truncated or corrupt" in _eval_error(capsys, bad, "--text", text)
    assert _eval_error(capsys, path) == "error: eval needs --text FILE for a language model (--lengths is for task checkpoints)"
    assert _eval_error(capsys, path, "--text", text, "--device", "tpu") == \
        "error: --device must be auto, cpu or cuda, not 'tpu'"


def test_loss_by_position_is_the_loss_of_each_window_position(trained):
    """`by_position`: the mean over windows of the loss at each position, checked against
    the model's own logits window by window; weighted by the windows covering each position
    it gives back the overall loss."""
    import torch
    import torch.nn.functional as F
    from sonata.data.batches import val_batches
    _, _, summary, tr = trained
    ev = tr.evaluate(by_position=True)
    L = tr.cfg.data.seq_len
    assert len(ev.position_loss) == L and ev.loss == pytest.approx(summary["val_loss"], rel=1e-9)
    sums, counts = torch.zeros(L, dtype=torch.float64), torch.zeros(L, dtype=torch.float64)
    with torch.no_grad():
        tr.model.eval()
        for x, y in val_batches(tr.corpus.val, L, 7):
            nats = F.cross_entropy(tr.model(x).transpose(1, 2), y, reduction="none").double()
            sums[:y.shape[1]] += nats.sum(0)
            counts[:y.shape[1]] += y.shape[0]
        tr.model.train()
    assert ev.position_loss == pytest.approx((sums / counts).tolist(), rel=1e-5)
    total = sum(p * c for p, c in zip(ev.position_loss, counts.tolist()))
    assert total / counts.sum().item() == pytest.approx(ev.loss, rel=1e-6)
    assert tr.evaluate().position_loss == ()


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_eval_of_an_int8_or_bf16_checkpoint_gives_the_trainers_figures(tmp_path, capsys, precision):
    """Issue 42 item 15: the trainer validates under the run's precision (int8: fake-quantized
    projections; bf16: autocast), eval scored every checkpoint in fp32 and so disagreed with
    the trainer's figures, contrary to docs/cli.md."""
    cfg = make_config(tiny_overrides(**{"train.eval_tokens": 0, "train.precision": precision,
                                        "train.max_steps": 4}))
    summary = Trainer(cfg, tmp_path, progress="none").run()
    _, val = split_train_val(load_stories("embedded", max_stories=60), cfg.data.val_fraction)
    text = tmp_path / "val.txt"
    text.write_text(f"\n{EOT}\n".join(val) + "\n")
    assert main(["eval", str(tmp_path / "checkpoint.pt"), "--text", str(text), "--json", "--device", "cpu"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == summary["val_tokens"]
    assert got["loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    assert got["bpb"] == pytest.approx(summary["val_bpb"], rel=1e-6)
    assert got["precision"] == precision
