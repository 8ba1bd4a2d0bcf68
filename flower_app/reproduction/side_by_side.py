"""Runs side by side: ``flrep reproduce --jobs N`` and ``flrep tune --jobs N`` keep up to N ``flrep run``
children going at once, each in its own folder with its own log; only this process writes the
table's files (``reproduce.json``, the report, the tuning record), one run's end at a time.

A stop signal (Ctrl-C, ``timeout``, a scheduler's SIGTERM) reaches every running child, each is
waited for (killed if it has not stopped within :data:`GRACE_S`) and recorded as interrupted, as
a single run is: the same command, started again, resumes each from its checkpoint.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TypeVar

from flower_app.run.stop_signals import Stopped, stopping_on_signals

Item = TypeVar("Item")
Started = TypeVar("Started")

#: Seconds a stopped child has to end before it is killed.
GRACE_S = 60.0

_children: set[subprocess.Popen] = set()
_children_lock = threading.Lock()


def track(child: subprocess.Popen) -> None:
    """Count ``child`` among the running children that a stop signal reaches."""
    with _children_lock:
        _children.add(child)


def untrack(child: subprocess.Popen) -> None:
    with _children_lock:
        _children.discard(child)


def _signal_children(signum: int | None) -> None:
    """Pass ``signum`` to every running child (None: kill it)."""
    with _children_lock:
        children = [c for c in _children if c.poll() is None]
    for child in children:
        try:
            child.kill() if signum is None else child.send_signal(signum)
        except ProcessLookupError:  # it ended meanwhile
            pass


def run_all(items: Iterable[Item], limit: int, start: Callable[[Item], Started], run: Callable[[Started], int],
            finish: Callable[[Started, int], bool], interrupted: Callable[[Started, str], None]) -> None:
    """For each of ``items`` in order: ``start(item)`` (in this thread) prepares it, ``run(started)``
    runs its child and gives the exit code (in a worker thread when ``limit`` > 1), ``finish(started,
    code)`` (in this thread) records it and says whether to start more. At most ``limit`` run at
    once. When the command stops (a signal, or an error here), every running child is stopped and
    ``interrupted(started, why)`` records each; then the signal or error goes on."""
    if limit <= 1:  # one at a time, in this thread: ``run`` stops its own child on a signal
        for item in items:
            started = start(item)
            try:
                code = run(started)
            except Stopped as stop:
                interrupted(started, stop.name)
                raise
            if not finish(started, code):
                return
        return
    pending, going, more = list(items), {}, True
    with stopping_on_signals(), ThreadPoolExecutor(max_workers=limit) as pool:
        try:
            while going or (more and pending):
                while more and pending and len(going) < limit:
                    started = start(pending.pop(0))
                    going[pool.submit(run, started)] = started
                done, _ = wait(going, timeout=1.0, return_when=FIRST_COMPLETED)
                for future in done:
                    code = future.result()  # an error of a run's thread stops the command
                    more = finish(going.pop(future), code) and more
        except BaseException as error:
            _stop_all(going, error.signum if isinstance(error, Stopped) else None)
            why = error.name if isinstance(error, Stopped) else type(error).__name__
            for started in going.values():
                interrupted(started, why)
            raise


def _stop_all(going: dict[Future, object], signum: int | None) -> None:
    """Stop every running child (``signum``, or SIGTERM after an error) and wait for each; kill
    those still running after :data:`GRACE_S`."""
    import signal

    _signal_children(signal.SIGTERM if signum is None else signum)
    _, late = wait(going, timeout=GRACE_S)
    if late:
        _signal_children(None)
        wait(late)
