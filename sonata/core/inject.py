"""Fault injection for the subprocess tests, in one place. Every switch is an environment
variable read where the fault happens; none is ever set outside tests, and with none set
each function here does nothing.

    SONATA_TEST_TRIP="RANK:STEP"      rank RANK's memory guard trips before step STEP + 1 (its
                                      budget becomes 1 byte): one rank trips, the others agree
    SONATA_TEST_EXIT="RANK:POINT"     rank RANK dies (os._exit, no cleanup) at the trainer's
                                      `prepare` (before DDP's construction) or `finish` (before
                                      the final evaluation): survivors lose a peer outside a step
    SONATA_TEST_SLOW_SAVE=S           every atomic write sleeps S seconds between writing its
                                      temporary file and renaming it (a wide window for a kill)
    SONATA_TEST_DISK_FULL_AT=N        this process's N-th atomic write fails as a full disk does
"""
from __future__ import annotations

import errno
import os
import time

TRIP_ENV = "SONATA_TEST_TRIP"
EXIT_ENV = "SONATA_TEST_EXIT"
SLOW_SAVE_ENV = "SONATA_TEST_SLOW_SAVE"
DISK_FULL_ENV = "SONATA_TEST_DISK_FULL_AT"


def trip_hook(rank: int):
    """A before-step hook (hook(trainer)) that trips this rank's memory guard, or None."""
    spec = os.environ.get(TRIP_ENV, "")
    if not spec:
        return None
    r, _, s = spec.partition(":")
    if int(r) != rank:
        return None
    at = int(s or 0)

    def trip(trainer):
        if trainer.step == at:
            trainer.guard.budget = 1
    return trip


def exit_point(point: str, rank: int) -> None:
    """Die here when SONATA_TEST_EXIT names this rank and point."""
    spec = os.environ.get(EXIT_ENV, "")
    if spec and spec == f"{rank}:{point}":
        os._exit(1)


def disk_full(write_number: int) -> None:
    """Raise a full disk's OSError on the write SONATA_TEST_DISK_FULL_AT names."""
    if os.environ.get(DISK_FULL_ENV) == str(write_number):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def slow_save() -> None:
    """Sleep SONATA_TEST_SLOW_SAVE seconds (between a write and its rename)."""
    if os.environ.get(SLOW_SAVE_ENV):
        time.sleep(float(os.environ[SLOW_SAVE_ENV]))


__all__ = ["trip_hook", "exit_point", "disk_full", "slow_save", "TRIP_ENV", "EXIT_ENV", "SLOW_SAVE_ENV",
           "DISK_FULL_ENV"]
