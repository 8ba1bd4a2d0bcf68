"""A test's child command starts with the stop signals a terminal gives it."""

from __future__ import annotations

import signal


def as_in_a_terminal() -> None:
    """``preexec_fn``: SIGINT and SIGHUP at their defaults, as for a command typed in a terminal,
    whatever the test session ignores (a background job of a non-interactive shell starts with
    SIGINT ignored, a command under ``nohup`` with SIGHUP ignored; a child inherits both)."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
