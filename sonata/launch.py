"""`python -m sonata train --nproc N ...`: N worker processes on this machine through torch's
elastic launcher, with sonata's exit contract (rank 0's output only, live; exit 2 and one
`error:` line when a worker fails; restarts that resume from the survivors' checkpoint).
The workers themselves are ordinary `python -m sonata` processes (sonata.train.distributed).

How the launcher learns what happened without reading the workers' text: each worker that
ends with an `error:` line also writes it as a status file (`report`, STATUS_ENV names the
folder), with its rank, its attempt (a restart is the next attempt: only the last attempt's
files say why the launch failed) and whether it only lost contact with a peer. A worker that only lost
a peer prints nothing under this launcher (the failing rank's own line says more); the
launcher prints what the status files say is missing: the failing rank's line when rank 0
had none of its own, else one naming the rank and its exit code.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

STATUS_ENV = "SONATA_LAUNCH_STATUS"     # set for the workers: the folder of their status files


def _attempt() -> int:
    """This worker's attempt: how often the launcher restarted the workers before it."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def under_launcher() -> bool:
    return bool(os.environ.get(STATUS_ENV))


def report(rank: int, line: str, lost_peer: bool) -> None:
    """A worker's final `error:` line for the launcher (nothing outside sonata's launcher)."""
    folder = os.environ.get(STATUS_ENV)
    if not folder:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{rank}-{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": rank, "line": line, "lost_peer": lost_peer, "time": time.time(),
                       "attempt": _attempt()}, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass                     # the launcher then says what it knows itself


def _statuses(folder: str, since: float, attempt: int | None) -> list[dict]:
    """The status files of the workers of `attempt` (written after `since`), oldest first: an
    earlier attempt's ranks failed, were restarted and are not why the launch failed."""
    out = []
    for path in glob.glob(os.path.join(folder, "rank*.json")):
        try:
            with open(path) as f:
                st = json.load(f)
        except (OSError, ValueError):
            continue
        if st.get("time", 0) >= since and attempt in (None, st.get("attempt", 0)):
            out.append(st)
    return sorted(out, key=lambda st: st["time"])


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
    status_dir = os.path.join(log_dir, "status")
    saved_env = os.environ.get(STATUS_ENV)
    os.environ[STATUS_ENV] = status_dir                 # the workers inherit it
    failure = None
    try:
        elastic_launch(config, sys.executable)("-m", "sonata", *argv)
    except ChildFailedError as e:
        failure = e
    except (KeyboardInterrupt, SignalException) as e:   # the agent stops the workers itself
        failure = e
    finally:
        if saved_env is None:
            os.environ.pop(STATUS_ENV, None)
        else:
            os.environ[STATUS_ENV] = saved_env
        for t in tails:
            t.done.set()
        for t in tails:
            t.join(timeout=10)
    if failure is None:
        _rmtree(log_dir)
        return 0
    attempts = [int(m.group(1)) for p in glob.glob(os.path.join(log_dir, f"{run_id}*", "attempt_*"))
                if (m := re.search(r"attempt_(\d+)$", p))]
    statuses = _statuses(status_dir, started, max(attempts, default=None))   # the last attempt's
    said = [st for st in statuses if st["rank"] == 0 and not st["lost_peer"]]     # rank 0's own line, shown
    if isinstance(failure, (KeyboardInterrupt, SignalException)):
        sig = getattr(failure, "sigval", None)
        if not said:
            print(f"error: interrupted{f' by {sig.name}' if sig else ''}; the workers were stopped "
                  f"(their output: {log_dir})", file=sys.stderr)
        return 128 + (int(sig) if sig else 2)
    first_rank, first = failure.get_first_failure()
    code = first.exitcode
    if not said:       # rank 0 said nothing of its own: say what the failing rank said
        own = [st for st in statuses if not st["lost_peer"]]
        own.sort(key=lambda st: (st["rank"] != first_rank, st["time"]))
        line = own[0]["line"] if own else None
        if line is None:
            how = (f"was killed by signal {-code}" if code is not None and code < 0
                   else f"failed with exit code {code}")
            lost = " (the other ranks lost contact with it)" if any(st["lost_peer"] for st in statuses) else ""
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
