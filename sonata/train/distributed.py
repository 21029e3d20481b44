"""Data-parallel training across processes: the one home of process-group logic.

Launch: `torchrun --nproc_per_node=N -m sonata train ...` or, with a clean exit
contract, `python -m sonata train --nproc N ...` (`sonata.launch`, through torch's
elastic launcher). Each worker reads RANK / WORLD_SIZE / LOCAL_RANK from the
environment (`init_from_env`); without them the world is 1 and no process group is
created at all, so the single-process path is unchanged.

- Backend: `nccl` when the run is on CUDA (device cuda:LOCAL_RANK), `gloo` on CPU.
  The control collectives of the trainer (guard flags, loss, the step agreement, the
  autotuner's choice, error messages) run on a separate gloo group on CPU tensors.
- Timeout: collectives give up after DIST_TIMEOUT_S (60 s, env SONATA_DIST_TIMEOUT_S),
  so a rank that dies or hangs cannot block the others forever; a rank whose peer
  died usually learns it at once (the socket closes). The autotuner's wait (rank 0
  tunes alone, the others wait for its choice) uses a second gloo group with a long
  timeout (WAIT_TIMEOUT_S).
- Data order: see `sonata.data.batches.BatchSampler.draw` (every rank draws the whole global
  batch's offsets from the same generator and keeps its own contiguous shard), so
  the data order equals a single-process run's and a checkpoint resumes on any
  number of processes.
- Stopping: the trainer agrees on every stop (memory guard, signals, divergence)
  with a collective before it raises, so all ranks stop at the same step; rank 0
  writes the checkpoint and prints the one `error:` line, the others exit 2
  silently (`shutdown(barrier=True)` lets rank 0 finish first).
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from sonata.core.errors import SonataError
from sonata.train.memory import MemoryBudgetExceeded

DIST_TIMEOUT_S = 60.0          # collectives (and so a dead or stuck peer) time out after this
WAIT_TIMEOUT_S = 6 * 3600.0    # the autotuner's wait for rank 0's choice


@dataclass(frozen=True)
class Ranks:
    """A process's place in the run: rank `rank` of `world` processes (rank 0 writes the files
    and prints; world 1: the one process, no process group)."""
    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.world > 1


@dataclass
class Context:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    backend: str | None = None           # gloo | nccl | None (single process)
    device: torch.device | None = None
    ctl: object = None                   # gloo group for control collectives
    wait: object = None                  # gloo group with a long timeout
    restarts: int = 0                    # how often the launcher restarted the workers (torchrun)


_ctx = Context()


def _timeout_s() -> float:
    try:
        return float(os.environ.get("SONATA_DIST_TIMEOUT_S", DIST_TIMEOUT_S))
    except ValueError:
        return DIST_TIMEOUT_S


def init_from_env(device: str = "auto") -> Context:
    """Join the process group that torchrun (or `launch`) describes in the environment;
    idempotent. `device`: train.device (auto | cpu | cuda). World 1: nothing is done."""
    global _ctx
    if _ctx.world > 1 and dist.is_initialized():
        return _ctx
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return _ctx
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    timeout = datetime.timedelta(seconds=_timeout_s())
    # the launcher's store outlives a restart: keys of this attempt under their own prefix,
    # so restarted workers never read a dead attempt's addresses
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    store = dist.PrefixStore(f"sonata/attempt{restart_count()}", store)
    dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=rank, world_size=world,
                            **({"device_id": dev} if cuda else {}))
    ctl = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    wait = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=WAIT_TIMEOUT_S))
    _ctx = Context(rank=rank, world=world, local_rank=local_rank, local_world=local_world,
                   backend=backend, device=dev, ctl=ctl, wait=wait, restarts=restart_count())
    if rank > 0:   # rank 0 says everything once; the others would only repeat it
        warnings.simplefilter("ignore")
    return _ctx


def restart_count() -> int:
    """How often torchrun (or `launch` with max_restarts) has restarted the workers."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def launch_id() -> str | None:
    """The identity of this launch of the workers, the same for every worker and every restart
    of one launch and different for the next launch; None outside the elastic launcher.
    torchrun's run id where it is one (`--standalone`, sonata's `--nproc` and a bare
    `torchrun --nproc-per-node N` draw a uuid; `--rdzv-id` is the user's). Plain torchrun with
    a `--master-port` or a rendezvous endpoint and no `--rdzv-id` names every launch "none":
    then the launch is its agent, by the folder the agent made for this launch's error files
    (TORCHELASTIC_ERROR_FILE = <that folder>/attempt_<restart>/<rank>/error.json), or by the
    agent's host and pid where that variable is missing."""
    run = os.environ.get("TORCHELASTIC_RUN_ID") or None
    if run != "none":
        return run
    parts = Path(os.environ.get("TORCHELASTIC_ERROR_FILE", "")).parts
    attempt = [i for i, p in enumerate(parts) if p.startswith("attempt_")]
    agent = str(Path(*parts[:attempt[-1]])) if attempt and attempt[-1] > 0 else \
        f"{socket.gethostname()}:{os.getppid()}"
    return f"none@{agent}"


def check_launch_id() -> None:
    """A launch over several machines named "none" (plain torchrun without `--rdzv-id`) has no
    identity its machines share (each agent is its own): one error line asking for an id."""
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1)
    if os.environ.get("TORCHELASTIC_RUN_ID") == "none" and nodes > 1:
        raise SonataError(f"a launch over {nodes} machines needs a --rdzv-id of its own (the same on every "
                          f"machine, new for each launch, e.g. sonata-$(date +%Y%m%d-%H%M)): without one "
                          f"torchrun names every launch 'none', and a restarted worker could resume another "
                          f"launch's checkpoint")


def context() -> Context:
    return _ctx


def active() -> bool:
    return _ctx.world > 1 and dist.is_available() and dist.is_initialized()


def rank() -> int:
    return _ctx.rank


def is_main() -> bool:
    return _ctx.rank == 0


class CollectiveFailed(RuntimeError):
    """A collective of the run failed: a peer died or hung. Raised by sonata's collectives
    (and `collective(...)` sections: DDP's construction and backward) in place of the
    backend's error, so that what counts as a lost peer is decided by where the error came
    from, not by words in its message (gloo raises a plain RuntimeError)."""

    def __init__(self, what: str, cause: BaseException):
        first = str(cause).strip().splitlines()[0][:200] if str(cause).strip() else type(cause).__name__
        super().__init__(f"{what}: {first}")


# The marks of a backend's own failure in an error raised by DDP's backward, where an
# ordinary autograd error can come from the same call: gloo's and NCCL's sources and the
# process group's words, not generic ones like "timed out".
_BACKEND_MARKS = ("gloo/", "ProcessGroupGloo", "NCCL", "ProcessGroupNCCL", "Connection closed by peer",
                  "Connection reset by peer")


@contextlib.contextmanager
def collective(what: str, backend_marks_only: bool = False):
    """A section of collective communication: a RuntimeError raised inside becomes
    CollectiveFailed(what) (`backend_marks_only`: only one carrying a backend's marks, for
    sections that also run ordinary computation, like DDP's backward)."""
    try:
        yield
    except CollectiveFailed:
        raise
    except RuntimeError as e:
        dist_error = getattr(dist, "DistError", ())
        if not backend_marks_only or (dist_error and isinstance(e, dist_error)) or \
                any(m in str(e) for m in _BACKEND_MARKS):
            raise CollectiveFailed(what, e) from e
        raise


def _reduce(values, op, group=None) -> list[float]:
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    with collective("all-reduce"):
        dist.all_reduce(t, op=op, group=group or _ctx.ctl)
    return t.tolist()


def all_reduce_max(values) -> list[float]:
    """Element-wise maximum over ranks (a list of numbers; float64, exact for byte counts)."""
    if not active():
        return [float(v) for v in values]
    return _reduce(values, dist.ReduceOp.MAX)


def all_reduce_sum(values) -> list[float]:
    if not active():
        return [float(v) for v in values]
    return _reduce(values, dist.ReduceOp.SUM)


def broadcast_object(obj, src: int = 0, wait: bool = False):
    """Rank `src`'s picklable object on every rank (messages, the autotune result)."""
    if not active():
        return obj
    box = [obj]
    with collective("broadcast"):
        dist.broadcast_object_list(box, src=src, group=_ctx.wait if wait else _ctx.ctl)
    return box[0]


def _tripped_ranks(flag: bool, extra=()) -> tuple[list[int], list[float]]:
    """One MAX all-reduce: which ranks raised `flag`, and the maximum of `extra` over ranks."""
    vals = [0.0] * _ctx.world + [float(v) for v in extra]
    vals[_ctx.rank] = 1.0 if flag else 0.0
    out = all_reduce_max(vals)
    return [r for r in range(_ctx.world) if out[r] > 0], out[_ctx.world:]


# ---------------------------------------------------------------- agreement
# Every stop is agreed before anything is raised, so all ranks stop at the same step.

@dataclass(frozen=True)
class StepAgreement:
    """What the ranks agree on after an optimizer step, each figure the maximum over ranks (one
    process: its own readings). It replaces a list of maxima read by position."""
    peak_bytes: int           # the process's peak memory so far (`memory.peak_memory_bytes`)
    step_peak_bytes: int      # the step's peak memory (the guard's reading: `MemoryGuard.peak_last`)
    signum: int | None        # a stop signal caught during the step (SIGINT / SIGTERM), or None
    step_seconds: float       # the step's time: the slowest rank's, so every rank counts the same

    def over_ranks(self, err: MemoryBudgetExceeded | None = None) -> "StepAgreement":
        """This rank's readings (and its guard's trip, `err`) agreed with the other ranks' in one
        MAX all-reduce (`agree_on_trip`: a trip on any rank raises on every rank)."""
        peak, step_peak, signum, seconds = agree_on_trip(
            err, [self.peak_bytes, self.step_peak_bytes, self.signum or 0, self.step_seconds])
        return StepAgreement(int(peak), int(step_peak), int(signum) or None, seconds)


def step_agreement(signum, step_seconds):
    """The memory guard's `agree` for a data-parallel step: before the step (no readings), its
    trip agreed; after it, this rank's readings (peak so far, step peak), its stop signal
    (`signum()`) and step time (`step_seconds()`) agreed over the ranks as the StepAgreement."""
    def agree(err: MemoryBudgetExceeded | None, readings) -> StepAgreement | None:
        if readings is None:
            agree_on_trip(err)
            return None
        return StepAgreement(int(readings[0]), int(readings[1]), signum(), step_seconds()).over_ranks(err)
    return agree


def wrap(model, device):
    """The model in DistributedDataParallel (its construction broadcasts rank 0's weights: a
    collective, so a lost peer is one line)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    with collective("DDP construction"):
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def agree_on_loss(loss: float, bad: bool) -> tuple[float, bool]:
    """The mean loss over ranks, and whether any rank saw a non-finite loss or gradient
    (then every rank skips the step)."""
    total, n_bad = all_reduce_sum([loss, float(bad)])
    return total / _ctx.world, n_bad > 0 or not math.isfinite(total)


def agree_on_trip(err: MemoryBudgetExceeded | None, numbers=()) -> list[float]:
    """Every rank says whether its memory guard tripped (`err`), in one MAX all-reduce
    that also carries `numbers`, whose maxima over ranks are returned. When any rank
    tripped, every rank raises the first tripping rank's error, naming that rank and
    the others that tripped (agreed: rank 0 prints it)."""
    tripped, maxima = _tripped_ranks(err is not None, numbers or ())
    if not tripped:
        return maxima
    first = tripped[0]
    f = broadcast_object(err.fields() if err is not None else None, src=first)
    raise MemoryBudgetExceeded(f["detail"], *f["advice"], budget_bytes=f["budget_bytes"],
                               used_bytes=f["used_bytes"], rank=first, world=_ctx.world,
                               also=tuple(tripped[1:]), agreed=True)


def barrier() -> None:
    if active():
        with collective("barrier"):
            dist.barrier(group=_ctx.ctl)


def is_comm_error(e: BaseException) -> bool:
    """A failure of a collective (a peer died or hung), not a bug of this rank: by type only
    (CollectiveFailed from sonata's collectives, or torch's DistError), never by message."""
    dist_error = getattr(dist, "DistError", ())
    return isinstance(e, CollectiveFailed) or bool(dist_error and isinstance(e, dist_error))


def shutdown(barrier: bool = False) -> None:
    """Leave the process group (every exit path). `barrier`: wait for the other ranks first
    (a clean or an agreed stop), so rank 0 finishes its checkpoint and its message."""
    global _ctx
    if not active():
        _ctx = Context()
        return
    try:
        if barrier:
            dist.barrier(group=_ctx.ctl)
    except Exception:      # noqa: BLE001 - a peer already gone: nothing to wait for
        pass
    try:
        dist.destroy_process_group()
    except Exception:      # noqa: BLE001
        pass
    _ctx = Context()


def local_threads(local_world: int) -> int:
    """CPU threads for one of `local_world` processes on this machine."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world))
