"""Token-cache preparation against tiktoken alone, its memory, and a cache hit's start.

    python benchmarks/data_pipeline.py [--text FILE] [--sizes 20 200] [--workdir DIR]

For each size (MiB), a corpus is made by repeating a text (default: the embedded
corpus; any `<|endoftext|>`-separated file may be given) and, in one run:

- tiktoken MiB/s: tiktoken's own `encode_ordinary_batch` over the same stories, in
  batches, with as many threads as this process may use (the issue's yardstick);
- bare encode MiB/s: tiktoken's `encode_to_numpy` over the same stories joined with
  <|endoftext|> in chunks, on the same threads (what preparation is built on: the
  gap to it is the cost of everything else);
- prepare MiB/s: `python -m sonata prepare` in a subprocess, as its summary line
  reports it (the whole preparation: counting pass, encoding, vocabulary, compaction,
  fsync), and the subprocess's peak resident set (whole process, torch included);
- first step: seconds from starting `python -m sonata train ... train.max_steps=1`
  (a second time: the cache is warm) until its first metrics row is written; the
  same for the embedded corpus gives the part that does not depend on the data.

Nothing here is a test; the machine is shared, so read the ratios.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import hardware_line, print_table  # noqa: E402

from sonata.data.sources import EMBEDDED_CORPUS, resolve_source, story_batches  # noqa: E402
from sonata.data.vocab import EOT, get_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def make_corpus(text_file: Path, mib: int, out: Path) -> Path:
    """`text_file`'s stories repeated until the file holds at least `mib` MiB."""
    stories = [s for batch, _ in story_batches(resolve_source(str(text_file)), "train") for s in batch]
    unit = (f"\n{EOT}\n".join(stories) + f"\n{EOT}\n").encode()
    reps = -(-mib * 2**20 // len(unit))
    with open(out, "wb") as f:
        for _ in range(reps):
            f.write(unit)
    return out


def tiktoken_mib_s(path: Path, threads: int) -> tuple[float, float]:
    """(encode_ordinary_batch MiB/s, encode_to_numpy on joined chunks MiB/s)."""
    enc = get_tokenizer()
    batches = [b for b, _ in story_batches(resolve_source(str(path)), "train")]
    nbytes = path.stat().st_size
    t = time.perf_counter()
    for b in batches:
        enc.encode_ordinary_batch(b, num_threads=threads)
    ordinary = nbytes / 2**20 / (time.perf_counter() - t)
    allowed = {EOT}
    with ThreadPoolExecutor(threads) as pool:
        t = time.perf_counter()
        for b in batches:
            chunks = [EOT.join(b[i:i + 160]) + EOT for i in range(0, len(b), 160)]
            list(pool.map(lambda c: enc.encode_to_numpy(c, allowed_special=allowed, disallowed_special=()),
                          chunks))
        bare = nbytes / 2**20 / (time.perf_counter() - t)
    return ordinary, bare


def run_prepare(path: Path, cache: Path) -> tuple[float, int, str]:
    """(prepare's own MiB/s, peak RSS bytes of the subprocess, its train line); the
    child is reaped with wait4, whose rusage is that child's alone."""
    cmd = [sys.executable, "-m", "sonata", "prepare", f"data.source={path}", f"data.cache_dir={cache}",
           "--progress", "none"]
    with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=so, stderr=se, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        so.seek(0)
        se.seek(0)
        out, err = so.read(), se.read()
    if proc.returncode:
        raise SystemExit(f"prepare failed: {err.strip()}")
    line = next(s for s in out.splitlines() if s.startswith("train:"))
    mib_s = float(re.search(r"([\d.]+) MiB/s", line).group(1))
    return mib_s, usage.ru_maxrss * 1024, line


def first_step_seconds(path: Path, cache: Path, run_dir: Path) -> float:
    """Process start to the first metrics row of `python -m sonata train ... max_steps=1`."""
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    cmd = [sys.executable, "-m", "sonata", "train", "--out", str(run_dir), "--progress", "none",
           f"data.source={path}", f"data.cache_dir={cache}", "train.max_steps=1", "train.eval_every=0",
           "train.eval_tokens=256"]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while proc.poll() is None:
        if first is None and metrics.exists() and metrics.stat().st_size:
            first = time.perf_counter() - t
        time.sleep(0.005)
    if proc.returncode:
        raise SystemExit(f"train failed: {proc.stderr.read().strip()}")
    return first if first is not None else time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", type=Path, default=EMBEDDED_CORPUS, help="text repeated to each size")
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 200], help="corpus sizes in MiB")
    ap.add_argument("--workdir", type=Path, default=None, help="corpora and caches (default: a temp dir)")
    args = ap.parse_args()
    threads = cores()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="sonata-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(hardware_line())
    print(f"text: {args.text} repeated; {threads} threads for tiktoken and for preparation; work dir {work}")
    rows, peaks = [], {}
    for mib in args.sizes:
        corpus = make_corpus(args.text, mib, work / f"corpus_{mib}mib.txt")
        ordinary, bare = tiktoken_mib_s(corpus, threads)
        prep, peak, line = run_prepare(corpus, work / f"cache_{mib}")
        first_step_seconds(corpus, work / f"cache_{mib}", work / f"run_{mib}")   # first: warms the OS file cache
        second = first_step_seconds(corpus, work / f"cache_{mib}", work / f"run_{mib}")
        peaks[mib] = peak
        rows.append([f"{corpus.stat().st_size / 2**20:.0f}", f"{ordinary:.1f}", f"{bare:.1f}", f"{prep:.1f}",
                     f"{prep / ordinary:.0%}", f"{peak / 2**20:.0f}", f"{second:.2f}"])
        print(f"  {mib} MiB: {line}", flush=True)
    print_table(["MiB", "tiktoken batch MiB/s", "bare encode MiB/s", "prepare MiB/s", "prepare / tiktoken",
                 "prepare peak RSS MiB", "first step s (cache hit)"], rows,
                title="token-cache preparation vs tiktoken, same text and threads")
    floor = first_step_seconds(EMBEDDED_CORPUS, work / "cache_embedded", work / "run_embedded")
    floor = first_step_seconds(EMBEDDED_CORPUS, work / "cache_embedded", work / "run_embedded")
    print(f"first step s (cache hit) of the embedded corpus (0.3 MiB), the same command: {floor:.2f} "
          f"(the start-up that does not depend on the data: imports, model, optimizer, first step)")
    if len(peaks) > 1:
        lo, hi = min(peaks), max(peaks)
        print(f"peak RSS difference {hi} MiB vs {lo} MiB corpus: {(peaks[hi] - peaks[lo]) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
