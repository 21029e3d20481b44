"""sonata.data.token_cache: the on-disk cache equals the in-memory path, is rebuilt when it does
not match, survives a kill and a full disk, takes validation splits from hub-shaped folders,
and keeps its errors to one line."""
import errno
import json
import signal
import time
from pathlib import Path

import subprocess
import sys

import numpy as np
import pytest

from sonata.core.config import DataConfig
from sonata.core.errors import DataError
from sonata.data.sources import split_train_val
from sonata.data.vocab import EOT, Vocab
import sonata.data.sources as sources
import sonata.data.token_cache as token_cache
from sonata.data.token_cache import prepare


def _reference(stories, val_fraction=0.1, size=512, val=None):
    """The in-memory path: split (unless a validation split is given), vocabulary, encode."""
    train, carved = split_train_val(stories, val_fraction) if val is None else (stories, val)
    v = Vocab.build(train, size)
    return v, v.encode_stories(train)[0], v.encode_stories(carved)[0]


def _assert_same(prep, ref):
    v, train, val = ref
    assert prep.vocab.tokens.tolist() == v.tokens.tolist()
    assert np.array_equal(prep.stream("train").numpy(), train)
    assert np.array_equal(prep.stream("validation").numpy(), val)


@pytest.fixture
def small_txt(tmp_path, embedded):
    p = tmp_path / "small.txt"
    p.write_text(f"\n{EOT}\n".join(embedded[:80]) + "\n")
    return p


def test_cache_equals_the_in_memory_path_and_is_reused(tmp_path, embedded):
    """Same vocabulary and streams as the in-memory path for the embedded corpus, so
    training from the cache gives the losses it gave before (same sampler draws)."""
    cfg = DataConfig(cache_dir=str(tmp_path))
    prep = prepare(cfg)
    assert not prep.cached and prep.validation_from == "carved"
    _assert_same(prep, _reference(embedded))
    assert prep.splits["train"].coverage == pytest.approx(_reference_coverage(embedded))
    meta = prep.dir / "meta.json"
    stamp = (meta.stat().st_mtime_ns, prep.splits["train"].path.stat().st_mtime_ns)
    again = prepare(cfg)
    assert again.cached and again.dir == prep.dir
    assert (meta.stat().st_mtime_ns, again.splits["train"].path.stat().st_mtime_ns) == stamp
    assert again.vocab.tokens.tolist() == prep.vocab.tokens.tolist()
    side = json.loads(meta.read_text())
    assert side["splits"]["train"]["tokens"] * 2 == prep.splits["train"].path.stat().st_size
    assert side["key"]["tokenizer"] == "o200k_base" and side["format"] == token_cache.CACHE_FORMAT
    assert not list(prep.dir.glob("*.tmp"))


def _reference_coverage(stories):
    train, _ = split_train_val(stories, 0.1)
    return Vocab.build(train, 512).encode_stories(train)[1]


def _truncate(d):
    p = d / "train.u16"
    p.write_bytes(p.read_bytes()[:-2])


def _grow(d):
    with open(d / "validation.u16", "ab") as f:
        f.write(b"\0\0")


def _flip_first_byte(d):
    p = d / "train.u16"
    b = bytearray(p.read_bytes())
    b[0] ^= 1
    p.write_bytes(bytes(b))


def _edit_meta(**changes):
    def f(d):
        m = json.loads((d / "meta.json").read_text())
        m.update(changes)
        (d / "meta.json").write_text(json.dumps(m))
    return f


def _garble_meta(d):
    (d / "meta.json").write_text("{not json")


@pytest.mark.parametrize("damage,why", [
    (_truncate, "wrong size"),
    (_grow, "wrong size"),
    (_flip_first_byte, "recorded hash"),
    (_edit_meta(format=99), "format version 99"),
    (_edit_meta(vocab=[]), "vocabulary does not match"),
    (_garble_meta, "unreadable sidecar"),
    ("source", "source changed"),
])
def test_a_cache_that_does_not_match_is_rebuilt_with_a_notice(tmp_path, small_txt, embedded,
                                                              capsys, damage, why):
    cfg = DataConfig(source=str(small_txt), cache_dir=str(tmp_path / "cache"), vocab_size=300)
    first = prepare(cfg)
    stories, vocab = embedded[:80], None
    if damage == "source":
        stories = embedded[:79] + ["A different last story."]
        small_txt.write_text(f"\n{EOT}\n".join(stories) + "\n")
    else:
        damage(first.dir)
    capsys.readouterr()
    again = prepare(cfg, vocab=vocab)
    err = capsys.readouterr().err
    notices = [line for line in err.splitlines() if "rebuilding the token cache" in line]
    assert len(notices) == 1 and why in notices[0], err
    assert not again.cached
    _assert_same(again, _reference(stories, size=300))
    assert prepare(cfg, vocab=vocab).cached                # and the rebuilt cache is trusted


def test_a_checkpoints_vocabulary_gets_its_own_cache_and_fresh_runs_keep_the_rule(tmp_path, small_txt,
                                                                                  embedded, capsys):
    """Resuming a checkpoint whose vocabulary differs builds a cache of its own (no rebuild
    of the shared one); a later fresh run of the same data still gets the rule's vocabulary
    from its untouched cache. (Before: the resume rebuilt the shared cache in place with the
    checkpoint's vocabulary, and every later fresh run silently trained with it.)"""
    cfg = DataConfig(source=str(small_txt), cache_dir=str(tmp_path / "cache"), vocab_size=300)
    fresh = prepare(cfg)
    ckpt_vocab = Vocab(fresh.vocab.tokens[:-1])               # a resumed checkpoint's vocabulary
    capsys.readouterr()
    resumed = prepare(cfg, vocab=ckpt_vocab)
    assert "rebuilding" not in capsys.readouterr().err and resumed.dir != fresh.dir
    tr, va = split_train_val(embedded[:80], 0.1)
    _assert_same(resumed, (ckpt_vocab, ckpt_vocab.encode_stories(tr)[0], ckpt_vocab.encode_stories(va)[0]))
    again = prepare(cfg)
    assert again.cached and again.dir == fresh.dir
    assert again.vocab.tokens.tolist() == fresh.vocab.tokens.tolist() != ckpt_vocab.tokens.tolist()
    assert prepare(cfg, vocab=ckpt_vocab).cached                # the checkpoint's own, reused


def test_a_killed_preparation_leaves_nothing_trusted(tmp_path, embedded):
    """SIGKILL while preparing: only temporary files remain; the next run rebuilds."""
    big = tmp_path / "big.txt"
    text = f"\n{EOT}\n".join(embedded) + f"\n{EOT}\n"
    big.write_text(text * 12)                             # ~4 MiB: a second or two to prepare
    cache = tmp_path / "cache"
    args = [sys.executable, "-m", "sonata", "prepare", f"data.source={big}", f"data.cache_dir={cache}",
            "--progress", "none"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and not list(cache.rglob("*.tmp")):
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert list(cache.rglob("*.tmp")), "killed before it started writing"
    assert not list(cache.rglob("meta.json"))             # no sidecar: nothing is trusted
    cfg = DataConfig(source=str(big), cache_dir=str(cache))
    prep = prepare(cfg)
    assert not prep.cached and not list(cache.rglob("*.tmp"))
    fresh = prepare(DataConfig(source=str(big), cache_dir=str(tmp_path / "fresh")))
    assert np.array_equal(prep.stream("train").numpy(), fresh.stream("train").numpy())
    assert np.array_equal(prep.stream("validation").numpy(), fresh.stream("validation").numpy())


def test_disk_full_is_one_error_and_leaves_no_cache(tmp_path, small_txt, monkeypatch):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(token_cache, "_compact_file", full)
    cfg = DataConfig(source=str(small_txt), cache_dir=str(tmp_path))
    with pytest.raises(DataError, match="disk full"):
        prepare(cfg)
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("meta.json"))


def test_validation_split_comes_from_a_hub_shaped_folder(tmp_path, embedded):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    folder = tmp_path / "hub" / "data"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"text": embedded[:70]}), folder / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"text": embedded[70:100]}), folder / "train-00001-of-00002.parquet")
    pq.write_table(pa.table({"text": embedded[100:120]}), folder / "validation-00000-of-00001.parquet")
    prep = prepare(DataConfig(source=str(tmp_path / "hub"), cache_dir=str(tmp_path / "c"), vocab_size=300))
    assert prep.validation_from == "source"
    assert prep.splits["train"].stories == 100 and prep.splits["validation"].stories == 20
    dd = datasets.load_dataset(str(tmp_path / "hub"))      # datasets' own reading of the folder
    _assert_same(prep, _reference(list(dd["train"]["text"]), size=300, val=list(dd["validation"]["text"])))


def test_validation_split_comes_from_a_sibling_txt(tmp_path, embedded):
    """TinyStoriesV2-GPT4-train.txt beside TinyStoriesV2-GPT4-valid.txt."""
    (tmp_path / "TS-train.txt").write_text(f"\n{EOT}\n".join(embedded[:90]) + "\n")
    (tmp_path / "TS-valid.txt").write_text(f"\n{EOT}\n".join(embedded[90:110]) + "\n")
    cfg = DataConfig(source=str(tmp_path / "TS-train.txt"), cache_dir=str(tmp_path / "c"), vocab_size=300)
    prep = prepare(cfg)
    assert prep.validation_from == "source"
    _assert_same(prep, _reference(embedded[:90], size=300, val=embedded[90:110]))
    short = prepare(DataConfig(source=cfg.source, cache_dir=cfg.cache_dir, vocab_size=300, max_stories=40))
    assert (short.splits["train"].stories, short.splits["validation"].stories) == (40, 4)


@pytest.mark.parametrize("make,fragment", [
    (lambda p: p.write_bytes(b"a story\n<|endoftext|>\nbad \xff byte"), "is not UTF-8 text"),
    (lambda p: p.write_text(""), "has 0 stories"),
])
def test_prepare_keeps_the_one_line_errors(tmp_path, make, fragment):
    p = tmp_path / "c.txt"
    make(p)
    with pytest.raises(DataError, match=fragment):
        prepare(DataConfig(source=str(p), cache_dir=str(tmp_path / "c")))
    assert not list((tmp_path / "c").rglob("*.tmp")) and not list((tmp_path / "c").rglob("meta.json"))


def test_prepare_refuses_a_parquet_without_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"story": ["a", "b"]}), tmp_path / "s.parquet")
    with pytest.raises(DataError, match="no 'text' column"):
        prepare(DataConfig(source=str(tmp_path / "s.parquet"), cache_dir=str(tmp_path / "c")))


def test_cache_dir_defaults_to_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert token_cache.cache_dir_of(DataConfig()) == tmp_path / "xdg" / "sonata"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert token_cache.cache_dir_of(DataConfig()) == Path.home() / ".cache" / "sonata"
    assert token_cache.cache_dir_of(DataConfig(cache_dir=str(tmp_path / "x"))) == tmp_path / "x"


def test_an_unwritable_cache_dir_is_one_error_before_work(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(Exception, match="data.cache_dir .* cannot be created or written"):
        prepare(DataConfig(cache_dir=str(tmp_path / "file" / "sub")))


def test_hub_splits_are_streamed_as_arrow_batches(tmp_path, embedded, monkeypatch):
    """data.source=tinystories without SONATA_TINYSTORIES: the hub's own train and
    validation splits (here an in-memory DatasetDict standing in for the download)."""
    import datasets
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": embedded[:60]}),
                               "validation": datasets.Dataset.from_dict({"text": embedded[60:75]})})
    monkeypatch.delenv("SONATA_TINYSTORIES", raising=False)
    monkeypatch.setattr(sources, "_hub_splits", lambda: {s: dd[s] for s in dd})
    prep = prepare(DataConfig(source="tinystories", cache_dir=str(tmp_path), vocab_size=300))
    assert prep.validation_from == "source" and prep.dir.name.startswith("tinystories-hub-")
    _assert_same(prep, _reference(embedded[:60], size=300, val=embedded[60:75]))


def test_prepare_from_the_hub_offline_fails_fast_with_a_hint(tmp_path, monkeypatch):
    monkeypatch.delenv("SONATA_TINYSTORIES", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = time.perf_counter()
    with pytest.raises(DataError, match="SONATA_TINYSTORIES"):
        prepare(DataConfig(source="tinystories", cache_dir=str(tmp_path)))
    assert time.perf_counter() - t < 15
