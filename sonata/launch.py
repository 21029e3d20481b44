"""`python -m sonata train --nproc N ...`: N worker processes on this machine through torch's
elastic launcher, with sonata's exit contract (rank 0's output only, live; exit 2 and one
`error:` line when a worker fails; restarts that resume from the survivors' checkpoint).
The workers themselves are ordinary `python -m sonata` processes (sonata.distributed).

What is left of reading text: the workers' stderr is tailed to the console, and the line
sonata.__main__ prints for a lost peer (LOST_CONTACT) is held back, because the failing
rank's own line says more. A structured channel (a status file per worker) would replace
that match; not written yet.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

LOST_CONTACT = "error: rank 0: lost contact"     # sonata.__main__'s line for a failed collective


def _quiet_elastic_logs() -> None:
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)


class _Tail(threading.Thread):
    """Copy one worker's redirected stream to ours, live, without a prefix."""

    def __init__(self, pattern: str, dst):
        super().__init__(daemon=True)
        self.pattern, self.dst = pattern, dst
        self.done = threading.Event()
        self.error_lines: list[str] = []
        self.held: list[str] = []      # "lost contact" lines: the failing rank's own line is better

    def _attempts(self) -> list[str]:
        """This stream's log of each attempt (a restart starts attempt_N+1), in order."""
        return sorted(glob.glob(self.pattern),
                      key=lambda p: int(re.search(r"attempt_(\d+)", p).group(1)))

    def run(self):
        seen = 0
        while True:
            files = self._attempts()
            if len(files) <= seen:
                if self.done.is_set():
                    return
                time.sleep(0.05)
                continue
            self._follow(files[seen], lambda: len(self._attempts()) > seen + 1)
            seen += 1

    def _follow(self, path: str, superseded) -> None:
        """Copy `path` line by line until the run is done or a newer attempt exists."""
        with open(path, errors="replace") as f:
            buf = ""
            while True:
                chunk = f.readline()
                if chunk:
                    buf += chunk
                    if buf.endswith("\n"):
                        self._emit(buf)
                        buf = ""
                elif self.done.is_set() or superseded():
                    rest = f.read()
                    if buf or rest:
                        for line in (buf + rest).splitlines():
                            self._emit(line + "\n")
                    return
                else:
                    time.sleep(0.05)

    def _emit(self, line: str):
        if line.startswith(LOST_CONTACT):
            self.held.append(line.rstrip("\n"))
            return
        if line.startswith("error:"):
            self.error_lines.append(line.rstrip("\n"))
        self.dst.write(line)
        self.dst.flush()


def launch(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Run `python -m sonata <argv>` in `nproc` worker processes on this machine through
    torch's elastic launcher (standalone rendezvous on localhost). When a worker fails,
    the launcher restarts all of them up to `max_restarts` times; restarted workers of
    `train` resume from the run's checkpoint (the survivors' emergency checkpoint).

    Only rank 0's output reaches the console (live, unprefixed); the others' goes to
    a temporary log folder. Exit status: 0 when every worker succeeded; otherwise the
    first failing worker's status mapped as the single-process command does (2, or
    128 + signal for an interrupt), with exactly one `error:` line: rank 0's own when
    it printed one, else the failing rank's, else one naming the rank, its exit code
    and its log folder. torchrun's own failure report (ChildFailedError) is not shown.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_elastic_logs()
    started = time.time()
    log_dir = tempfile.mkdtemp(prefix="sonata-ranks-")
    run_id = uuid.uuid4().hex[:12]
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id,
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
                          monitor_interval=0.1, start_method="spawn",
                          logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL))
    base = os.path.join(log_dir, f"{run_id}*", "attempt_*", "0")
    tails = [_Tail(os.path.join(base, "stdout.log"), sys.stdout),
             _Tail(os.path.join(base, "stderr.log"), sys.stderr)]
    for t in tails:
        t.start()
    failure = None
    try:
        elastic_launch(config, sys.executable)("-m", "sonata", *argv)
    except ChildFailedError as e:
        failure = e
    except (KeyboardInterrupt, SignalException) as e:   # the agent stops the workers itself
        failure = e
    finally:
        for t in tails:
            t.done.set()
        for t in tails:
            t.join(timeout=10)
    if failure is None:
        _rmtree(log_dir)
        return 0
    if isinstance(failure, (KeyboardInterrupt, SignalException)):
        sig = getattr(failure, "sigval", None)
        if not tails[1].error_lines:
            print(f"error: interrupted{f' by {sig.name}' if sig else ''}; the workers were stopped "
                  f"(their output: {log_dir})", file=sys.stderr)
        return 128 + (int(sig) if sig else 2)
    first_rank, first = failure.get_first_failure()
    code = first.exitcode
    if not tails[1].error_lines:       # rank 0 said nothing: say what the failing rank said
        line = None
        for r, f in sorted(failure.failures.items(), key=lambda kv: (kv[0] != first_rank, kv[0])):
            for path in glob.glob(os.path.join(log_dir, f"{run_id}*", "attempt_*", str(f.local_rank),
                                               "stderr.log")):
                errs = [ln for ln in Path(path).read_text(errors="replace").splitlines()
                        if ln.startswith("error:") and " lost contact " not in ln]
                if errs:
                    line = errs[0]
                    break
            if line:
                break
        if line is None:
            how = (f"was killed by signal {-code}" if code is not None and code < 0
                   else f"failed with exit code {code}")
            lost = " (the other ranks lost contact with it)" if tails[1].held else ""
            line = f"error: worker rank {first_rank} {how}{lost}; the workers' output is in {log_dir}"
            saved = Path(argv[argv.index("--out") + 1]) / "checkpoint.pt" if "--out" in argv else None
            if lost and saved and saved.exists() and saved.stat().st_mtime >= started:
                line += f"; the survivors saved the last completed step in {saved} (resume with --resume {saved})"
        print(line, file=sys.stderr)
    else:
        _rmtree(log_dir)
    if code is not None and code > 128:
        return code
    if code is not None and code < 0:                   # killed by a signal
        return 128 - code
    return 2


def _rmtree(path: str) -> None:
    import shutil
    shutil.rmtree(path, ignore_errors=True)
