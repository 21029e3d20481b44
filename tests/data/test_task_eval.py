"""Task evaluation (sonata.data.tasks.evaluate_task) reduces each batch to the summed loss and
the count of right answers and runs the model's head at the answer positions only: the figures
are those of the whole logits scored at the answers, and the memory it adds grows neither with
the number of sequences nor with their length."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from sonata.core.config import ModelConfig
from sonata.data import tasks
from sonata.data.tasks import EVAL_BLOCK, MQAR, Parity, evaluate_task
from sonata.model.lm import MambaLM


@torch.no_grad()
def reference(model, task, length, n, seed, chunked):
    """The straightforward figures: every sequence's whole logits (block by block with the
    carried state when `chunked`, else one pass), then the cross-entropy and the argmax at the
    answer positions -> (loss, accuracy, answers)."""
    model.eval()
    blocks, ans = task.eval_blocks(range(n), length, seed)
    if chunked:
        state, parts = None, []
        for x in blocks:
            logits, state = model(x, state, return_state=True)
            parts.append(logits)
        logits = torch.cat(parts, 1)
    else:
        logits = model(torch.cat(list(blocks), 1))
    assert logits.shape == (n, length, task.vocab_size)
    picked = logits[:, ans.pos].float()                                  # (n, k, vocab)
    loss = F.cross_entropy(picked.reshape(-1, task.vocab_size), ans.target.reshape(-1))
    right = (picked.argmax(-1) == ans.target)
    return float(loss), float(right.float().mean()), right.numel()


CASES = {   # (arch, chunked, task, length, n): several answers a sequence, and one
    "mamba-mqar": ("mamba", True, MQAR(64, 0), 64, 5),
    "mamba-parity": ("mamba", True, Parity(), 48, 5),
    "mamba-mqar-blocks": ("mamba", True, MQAR(64, 8), EVAL_BLOCK + 40, 2),   # answers in both blocks
    "mamba-parity-blocks": ("mamba", True, Parity(), EVAL_BLOCK + 7, 2),
    "attention-mqar": ("attention", False, MQAR(64, 0), 64, 5),
    "attention-parity": ("attention", False, Parity(), 48, 5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_evaluation_gives_the_figures_of_the_whole_logits(case, monkeypatch):
    """On a small random model, evaluate_task's loss and accuracy are the reference's (up to the
    order of the float sums), with several batches (EVAL_TOKENS made small) and the head run
    in several slices (EVAL_ANSWERS made small), and the model is left as it was."""
    arch, chunked, task, length, n = CASES[case]
    torch.manual_seed(0)
    m = MambaLM(ModelConfig(arch=arch, vocab_size=task.vocab_size, d_model=16, n_layers=2, d_state=4,
                            backend="cpu"))
    loss, acc, answers = reference(m, task, length, n, seed=3, chunked=chunked)
    m.train()
    x = torch.randint(0, task.vocab_size, (2, 12))
    before = m(x)
    if length <= EVAL_BLOCK:                      # 2 rows a batch: 3 batches, the last one short
        monkeypatch.setattr(tasks, "EVAL_TOKENS", 2 * length)
    monkeypatch.setattr(tasks, "EVAL_ANSWERS", 7)
    ev = evaluate_task(m, task, length, n, seed=3, chunked=chunked)
    assert (ev.sequences, ev.length) == (n, length)
    assert ev.loss == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert round(ev.accuracy * answers) == round(acc * answers)          # the same answers right
    assert ev.accuracy == pytest.approx(acc, abs=1e-7)
    assert m.training
    assert torch.equal(m(x), before)


def test_hidden_is_what_the_head_reads():
    """MambaLM.hidden, which task evaluation runs the head on at the answers alone, is forward's
    input to lm_head: the same logits, whole or chunked with the state carried."""
    torch.manual_seed(1)
    m = MambaLM(ModelConfig(vocab_size=40, d_model=16, n_layers=2, d_state=4, backend="cpu"))
    x = torch.randint(0, 40, (3, 20))
    assert torch.equal(m.lm_head(m.hidden(x)), m(x))
    h1, s = m.hidden(x[:, :9], return_state=True)
    h2, _ = m.hidden(x[:, 9:], s, return_state=True)
    assert torch.allclose(m.lm_head(torch.cat([h1, h2], 1)), m(x), atol=1e-5)


# The evaluation's added peak resident set (MiB), MQAR (length / 4 answers a sequence) at
# vocabulary 1,024 on a 1-layer mamba of width 16, measured by this test on the 2-core
# development VM:
#
#     n, length                             64, 256   256, 256   64, 1,024   256, 1,024
#     before: every position's logits,
#       every answer's kept to the end          112        208         208          593
#     after: the head at the answers,
#       each block reduced at once             14.8       14.8        14.7         14.7
#
# Every n here fills a forward (EVAL_TOKENS positions: 64 x 256, 16 x 1,024), so the model's own
# activations are the same in each (at n 8 and length 256 a forward holds 2,048 positions, and
# its activations are smaller: a difference that is the model's, and bounded).
GROWTH_MIB = 8

MEASURE = """
import json, torch
from sonata.core.config import ModelConfig
from sonata.data.tasks import MQAR, evaluate_task, peak_rss_bytes, reset_peak_rss
from sonata.model.lm import MambaLM
V = 1024
torch.manual_seed(0)
m = MambaLM(ModelConfig(arch="mamba", vocab_size=V, d_model=16, n_layers=1, d_state=4, backend="cpu"))
task = MQAR(V, 0)
evaluate_task(m, task, 256, 64, seed=2)         # the kernels compiled
peaks = []
for n, length in [(64, 256), (256, 256), (64, 1024), (256, 1024)]:
    before = reset_peak_rss()
    evaluate_task(m, task, length, n, seed=1)
    peaks.append([n, length, (peak_rss_bytes() - before) / 2**20])
print(json.dumps(peaks))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="the peak is reset through Linux's /proc")
def test_evaluation_memory_grows_neither_with_n_nor_with_length():
    """The resident peak the evaluation adds (reset_peak_rss, as accuracy_by_length reads it) at
    four times the sequences and four times the length stays within GROWTH_MIB of the smallest;
    before, it grew by hundreds of MiB. Measured in a fresh process whose allocator maps every
    block of 64 KiB or more on its own (MALLOC_MMAP_THRESHOLD_), so that freed memory leaves the
    resident set at once and the peak is what was live: in the test process, pages earlier
    tests left resident made the readings vary by 20 MiB."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    peaks = {(n, length): round(mib, 1) for n, length, mib in json.loads(r.stdout.splitlines()[-1])}
    print("added peak (MiB):", peaks)
    assert max(peaks.values()) - peaks[64, 256] < GROWTH_MIB, peaks
