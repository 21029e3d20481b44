"""sonata.data.batches: the corpus's coverage and stream, the seeded restorable sampler,
validation windows, sampling from the memory map, and the chunked upload."""
import numpy as np
import pytest
import torch

import sonata.data.batches as data_mod
from sonata.core.config import DataConfig
from sonata.core.errors import DataError
from sonata.data.batches import BatchSampler, build_corpus, val_batches
from sonata.data.token_cache import prepare
from sonata.data.vocab import EOT, Vocab


def test_coverage_and_stream(embedded):
    cfg = DataConfig(max_stories=120)
    c = build_corpus(cfg)
    # on the CPU the streams are the token cache's uint16 files, memory-mapped
    assert c.train.dtype == torch.uint16 and c.val.dtype == torch.uint16
    assert 0.5 < c.coverage <= 1.0
    train = c.train.int()           # torch has few uint16 kernels: compare in int32
    assert int(train.max()) < len(c.vocab) and int(train.min()) >= 0
    assert (train == Vocab.EOT_ID).sum() == c.n_train_stories
    text = c.vocab.decode(c.val.tolist())
    assert text.count(EOT) == c.n_val_stories


def test_sampler_is_seeded_and_restorable():
    stream = torch.arange(1000, dtype=torch.int32)
    s = BatchSampler(stream, 16, seed=3)
    state = s.state_dict()
    x1, y1 = s.draw(5)
    assert x1.shape == (5, 16) and torch.equal(x1 + 1, y1)
    s.load_state_dict(state)
    x2, _ = s.draw(5)
    assert torch.equal(x1, x2)
    x3, _ = BatchSampler(stream, 16, seed=3).draw(5)
    assert torch.equal(x1, x3)
    x4, _ = BatchSampler(stream, 16, seed=4).draw(5)
    assert not torch.equal(x1, x4)


def test_sampler_rejects_a_stream_shorter_than_a_window():
    with pytest.raises(DataError, match="shorter than"):
        BatchSampler(torch.arange(10, dtype=torch.int32), 16, seed=0)


def test_val_batches_predict_every_token_once():
    stream = torch.arange(103, dtype=torch.int32)
    ys = torch.cat([y.reshape(-1) for _, y in val_batches(stream, 10, 4)])
    assert torch.equal(ys, torch.arange(1, 103))


def test_memmap_sampling_equals_in_memory_sampling(tmp_path):
    prep = prepare(DataConfig(cache_dir=str(tmp_path)))
    mapped = prep.stream("train")
    in_memory = torch.from_numpy(mapped.numpy().astype(np.int32))
    a, b = BatchSampler(mapped, 32, seed=5), BatchSampler(in_memory, 32, seed=5)
    for n in (8, 3, 16):
        (xa, ya), (xb, yb) = a.draw(n), b.draw(n)
        assert xa.dtype == xb.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(a.gen.get_state(), b.gen.get_state())


def test_upload_is_chunked_and_counted(tmp_path, monkeypatch):
    """The once-only upload copies the map in chunks (no host copy of the whole
    stream) and gives the same ids as int32; on the CPU nothing crosses a bus."""
    prep = prepare(DataConfig(cache_dir=str(tmp_path)))
    mapped = prep.stream("validation")
    monkeypatch.setattr(data_mod, "UPLOAD_CHUNK", 1000)
    before = data_mod.h2d.bytes
    up = data_mod.upload_stream(mapped, torch.device("cpu"))
    assert up.dtype == torch.int32 and torch.equal(up, mapped.int())
    assert data_mod.h2d.bytes == before
