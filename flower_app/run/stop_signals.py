"""Stop signals as shells and schedulers send them: SIGINT (Ctrl-C), SIGTERM (``timeout``,
systemd, Docker, SLURM) and SIGHUP (a closed terminal) raise :class:`Stopped` in the main
thread, so that a command stops what it started in order and prints how to continue.

Only the first signal raises: a repeated one (the process group's and a parent's that passes
it on) is ignored while the command stops. A signal ignored when the command started (SIGINT
in a background job of a shell) stays ignored.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_requested = threading.Event()


class Stopped(BaseException):
    """A stop signal arrived; the command exits with :attr:`exit_code` (128 + the signal's number)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def stop_requested() -> bool:
    """Whether a stop signal arrived in this process (any thread may ask)."""
    return _requested.is_set()


def catch(on_stop: Callable[[], None] | None = None) -> None:
    """From now on each stop signal not ignored raises :class:`Stopped` in the main thread, after
    ``on_stop`` (a call from another thread does nothing). Call it again where a library replaced
    the handlers (Ray's SIGTERM one)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: object) -> None:
        if _requested.is_set():  # already stopping
            return
        _requested.set()
        if on_stop is not None:
            on_stop()
        raise Stopped(signum)

    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, handler)


@contextmanager
def stopping_on_signals() -> Iterator[None]:
    """Within: :func:`catch` (main thread only); the previous handlers come back after. A stop
    signal stays requested after a stop (the process is ending), until the next such block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    _requested.clear()
    catch()
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
