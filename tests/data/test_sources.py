"""sonata.data.sources: the embedded corpus, the split by story, local files (txt, parquet,
folders), the hub path offline, and the real TinyStories sample."""
import pytest

from sonata.core.errors import DataError
from sonata.data.sources import load_stories, split_train_val
from sonata.data.vocab import EOT, Vocab


def test_embedded_corpus_has_at_least_300_stories(embedded):
    assert len(embedded) >= 300
    assert all(EOT not in s and s == s.strip() and s for s in embedded)


def test_split_is_deterministic_and_by_story(embedded):
    a_train, a_val = split_train_val(embedded, 0.1)
    b_train, b_val = split_train_val(list(embedded), 0.1)
    assert a_train == b_train and a_val == b_val
    assert len(a_val) == round(len(embedded) * 0.1)
    # by story: a text on both sides is one the corpus holds more than once
    assert all(embedded.count(story) >= 2 for story in set(a_train) & set(a_val))
    assert sorted(a_train + a_val) == sorted(embedded)


def test_local_txt_and_parquet_and_folder(tmp_path):
    stories = [f"Story number {i}. Tom ran." for i in range(5)]
    txt = tmp_path / "s.txt"
    txt.write_text(f"\n{EOT}\n".join(stories) + "\n")
    assert load_stories(str(txt)) == stories
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": stories}), tmp_path / "s.parquet")
    assert load_stories(str(tmp_path / "s.parquet")) == stories
    folder = tmp_path / "hub" / "data"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"text": stories}), folder / "train-00000-of-00001.parquet")
    assert load_stories(str(tmp_path / "hub")) == stories


@pytest.mark.parametrize("content,fragment", [
    ("", "has 0 stories"),
    (f"only one story\n{EOT}\n", "has 1 stories"),
])
def test_empty_or_tiny_corpus_is_refused(tmp_path, content, fragment):
    p = tmp_path / "c.txt"
    p.write_text(content)
    with pytest.raises(DataError, match=fragment):
        load_stories(str(p))


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_stories(str(tmp_path / "nope.txt"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="unsupported"):
        load_stories(str(tmp_path / "x.csv"))


def test_hub_offline_fails_fast_with_a_hint(monkeypatch):
    import time
    monkeypatch.delenv("SONATA_TINYSTORIES", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = time.perf_counter()
    with pytest.raises(DataError, match="SONATA_TINYSTORIES"):
        load_stories("tinystories")
    assert time.perf_counter() - t < 15


def test_hub_unreachable_fails_fast_without_hf_hub_offline(monkeypatch):
    import time

    import sonata.data.sources as sources
    monkeypatch.delenv("SONATA_TINYSTORIES", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(sources, "_hub_reachable", lambda *a, **k: False)
    import datasets  # already imported: the offline switch must still reach it
    t = time.perf_counter()
    with pytest.raises(DataError, match="offline"):
        load_stories("tinystories")
    assert time.perf_counter() - t < 15
    assert datasets.config.HF_HUB_OFFLINE


def test_real_tinystories_sample(tinystories_path, monkeypatch):
    monkeypatch.setenv("SONATA_TINYSTORIES", str(tinystories_path))
    stories = load_stories("tinystories")
    assert len(stories) == 2316
    train, _ = split_train_val(stories, 0.1)
    v = Vocab.build(train[:500], 512)
    ids, cov = v.encode_stories(train[:50])
    assert 0.6 < cov < 1.0
    assert v.decode(ids.tolist()).split(EOT)[0].strip() == train[0]
