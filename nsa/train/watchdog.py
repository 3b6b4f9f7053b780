"""Liveness of a training process: a heartbeat file per rank and a stall watchdog.

A stalled step (a dead NCCL peer, a deadlocked data loader, a wedged kernel) otherwise hangs a
job until someone notices. :class:`Watchdog` turns it into a diagnosis: when no step completes
in time it writes every thread's Python stack (and the CUDA memory summary) to
``run_dir/stall/rank{rank}.txt`` and ends the process with a non-zero exit code.

Two layers, because a Python thread only runs when it can take the GIL:

* The watchdog thread checks the time since the last step every ``poll_interval_s`` and, past
  the allowance, writes the stall report and calls ``os._exit(exit_code)``. This covers the
  usual stalls, where the main thread waits in C code that released the GIL (a CUDA
  synchronisation, a collective, a queue, a lock, a socket).
* A backstop for a main thread that holds the GIL forever inside C code, where the watchdog
  thread cannot run at all: every poll re-arms ``faulthandler.dump_traceback_later`` (a C
  thread that needs no GIL) at twice the allowance plus one poll interval. If the watchdog
  thread misses its polls that long, faulthandler writes all stacks to stderr and exits with
  code 1. ``faulthandler``'s timer is process-wide: nothing else in the process may use
  ``dump_traceback_later`` while a watchdog runs (pytest's ``faulthandler_timeout`` does).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

HEARTBEAT_DIR = "heartbeat"
STALL_DIR = "stall"
STALL_EXIT_CODE = 75  # EX_TEMPFAIL in sysexits.h: a temporary failure, resuming may succeed
CUDA_SUMMARY_TIMEOUT_S = 60.0  # the memory summary takes the allocator's lock; never wait longer
STDERR_FD = 2


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / HEARTBEAT_DIR / f"rank{rank}.json"


def stall_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / STALL_DIR / f"rank{rank}.txt"


class Heartbeat:
    """``beat(step)`` atomically replaces ``run_dir/heartbeat/rank{rank}.json``.

    The file holds ``{"rank", "step", "time" (Unix seconds), "pid"}``; a reader never sees a
    partial file, since each beat writes a temporary file and renames it over the old one.
    """

    def __init__(self, run_dir: Path, rank: int = 0):
        self.rank = rank
        self.path = heartbeat_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(f".{self.path.name}.tmp")

    def beat(self, step: int) -> None:
        record = {"rank": self.rank, "step": step, "time": time.time(), "pid": os.getpid()}
        self._tmp.write_text(json.dumps(record) + "\n")
        os.replace(self._tmp, self.path)


class Watchdog:
    """Ends the process with a stall report when no step completes for ``timeout_s`` seconds.

    Call :meth:`start` before the first step and :meth:`step_done` after every step (it only
    stores the step and a timestamp). The clock starts at :meth:`start`; until the first
    ``step_done`` the allowance is ``first_timeout_s`` (default ``timeout_s``), room for
    compilation and warm-up. The timeout must exceed the longest gap between two calls, so
    call ``step_done(step)`` again after other long work in the loop (evaluation, checkpoints).
    :meth:`stop` ends the thread; as a context manager the watchdog starts on entry and stops
    on exit, also when the loop raises (a watchdog left running would kill a process that
    carries on after catching the error).

    On a stall it writes ``run_dir/stall/rank{rank}.txt`` (a header with rank, pid, last step,
    seconds since it and the time; every thread's stack; ``torch.cuda.memory_summary()`` of
    each device when this process has initialised CUDA), prints one line naming the file to
    stderr and calls ``os._exit(exit_code)``: no ``finally`` block or ``atexit`` hook runs.
    """

    def __init__(self, run_dir: Path, rank: int = 0, timeout_s: float = 600.0, *,
                 first_timeout_s: float | None = None, poll_interval_s: float | None = None,
                 exit_code: int = STALL_EXIT_CODE):
        first_timeout_s = timeout_s if first_timeout_s is None else first_timeout_s
        poll_interval_s = min(1.0, timeout_s / 10) if poll_interval_s is None else poll_interval_s
        for name, value in (("timeout_s", timeout_s), ("first_timeout_s", first_timeout_s),
                            ("poll_interval_s", poll_interval_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not 1 <= exit_code <= 255:
            raise ValueError(f"exit_code must be in 1..255 (0 hides a stall), got {exit_code}")
        self.rank = rank
        self.path = stall_path(run_dir, rank)
        self.timeout_s = timeout_s
        self.first_timeout_s = first_timeout_s
        self.poll_interval_s = poll_interval_s
        self.exit_code = exit_code
        self._last: tuple[int | None, float] = (None, time.monotonic())  # (step, when)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        if self._thread is not None:
            raise RuntimeError("this watchdog was already started")
        self._last = (None, time.monotonic())
        self._arm_backstop(self.first_timeout_s)
        self._thread = threading.Thread(target=self._watch, name=f"nsa-watchdog-rank{self.rank}",
                                        daemon=True)
        self._thread.start()
        return self

    def step_done(self, step: int) -> None:
        """Record that ``step`` completed now (one tuple assignment: atomic, no lock)."""
        self._last = (step, time.monotonic())

    def stop(self) -> None:
        """End the watchdog thread and wait for it; safe to call more than once."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
        faulthandler.cancel_dump_traceback_later()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _allowance(self, last_step: int | None) -> float:
        return self.first_timeout_s if last_step is None else self.timeout_s

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_interval_s):
            last_step, since = self._last
            allowance = self._allowance(last_step)
            idle = time.monotonic() - since
            if idle > allowance:
                self._report_and_exit(last_step, idle)
            self._arm_backstop(allowance)

    def _arm_backstop(self, allowance: float) -> None:
        """(Re)start faulthandler's GIL-free timer: it fires only if this thread stops polling."""
        faulthandler.dump_traceback_later(2 * allowance + self.poll_interval_s, exit=True,
                                          file=STDERR_FD)

    def _report_and_exit(self, last_step: int | None, idle: float) -> None:
        faulthandler.cancel_dump_traceback_later()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: faulthandler writes to the descriptor behind the file object's back, and
        # every write must land at the end.
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        with os.fdopen(os.open(self.path, flags, 0o644), "w") as f:
            f.write(stall_header(self.rank, last_step, idle, self._allowance(last_step)))
            f.flush()
            # Straight to the file descriptor, without Python objects: works whatever state the
            # other threads are in.
            faulthandler.dump_traceback(f, all_threads=True)
            _sync(f)
            print(f"[nsa watchdog] rank {self.rank}: no step completed for {idle:.1f} s "
                  f"(last step {last_step}); stacks in {self.path}; exiting with code "
                  f"{self.exit_code}", file=sys.stderr, flush=True)
            if torch.cuda.is_initialized():
                # The summary waits for the caching allocator's lock, which a stuck main thread
                # may hold: if it never returns, faulthandler appends the stacks and exits.
                faulthandler.dump_traceback_later(CUDA_SUMMARY_TIMEOUT_S, exit=True, file=f)
                for device in range(torch.cuda.device_count()):
                    f.write(f"\n=== torch.cuda.memory_summary(device={device}) ===\n")
                    f.write(torch.cuda.memory_summary(device))
                faulthandler.cancel_dump_traceback_later()
            _sync(f)
        os._exit(self.exit_code)


def stall_header(rank: int, last_step: int | None, idle: float, allowance: float) -> str:
    """The first lines of a stall report, with a key to the thread ids of the stack dump."""
    last = "none completed" if last_step is None else str(last_step)
    names = "".join(f"  0x{t.ident:016x} {t.name}{' (daemon)' if t.daemon else ''}\n"
                    for t in threading.enumerate() if t.ident is not None)
    return (f"stall on rank {rank}\n"
            f"pid: {os.getpid()}\n"
            f"last step: {last}\n"
            f"seconds since last step: {idle:.1f} (allowance {allowance:g} s)\n"
            f"time: {datetime.now(timezone.utc).isoformat(timespec='seconds')}\n"
            f"threads:\n{names}"
            f"\n=== Python stacks of all threads (most recent call first) ===\n")


def _sync(f) -> None:
    f.flush()
    os.fsync(f.fileno())
