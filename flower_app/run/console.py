"""What a user sees while a run goes: flrep's own lines, Flower's and Ray's chatter only with
``--verbose``, colour only on a terminal, a progress bar over the rounds and short round lines
(:mod:`flower_app.results.progress`) on a terminal.

``flrep`` commands set :data:`VERBOSE_ENV` before the ServerApp starts, so the same choice
holds in its simulation and in ``flwr run .`` (where the variable may be set by hand).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import warnings

from flwr.common.logger import ConsoleHandler, update_console_handler
from flwr.supercore.logger import LOGGER_NAME

VERBOSE_ENV = "FLREP_VERBOSE"
#: Every line of flrep's own starts with this.
TAG = "[flrep]"
#: Terminal control sequences (colours, cursor moves) as Ray and Flower write them into messages.
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


#: Flower's modules that log each failed ClientApp call with its traceback, before the error
#: comes back in its reply (which flrep logs, one line per client): shown only with ``--verbose``.
_CLIENT_ERROR_ECHOES = (os.path.join("flwr", "server", "superlink", "fleet", "vce", ""),
                        os.path.join("flwr", "simulation", "ray_transport", ""))


class _FlrepOnly(logging.Filter):
    """Lets through flrep's own lines and every warning or error, but not Flower's echoes of
    client errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        if any(module in record.pathname for module in _CLIENT_ERROR_ECHOES):
            return False
        return record.levelno >= logging.WARNING or str(record.msg).startswith(TAG)


def plain(text: str) -> str:
    """``text`` without terminal control sequences: what a log file or ``metrics.jsonl`` keeps of
    an error message that Ray or Flower coloured."""
    return ANSI_ESCAPE.sub("", text)


def verbose_chosen() -> bool:
    """Whether the command asked for Flower's and Ray's own lines (:data:`VERBOSE_ENV` is ``1``)."""
    return os.environ.get(VERBOSE_ENV) == "1"


def configure(verbose: bool | None = None) -> None:
    """Set up the console: ``verbose`` (default: :func:`verbose_chosen`) shows Flower's INFO
    lines and Ray's warnings; colour codes only when stderr is a terminal."""
    if verbose is None:
        verbose = verbose_chosen()
    update_console_handler(colored=sys.stderr.isatty())
    if not sys.stderr.isatty():  # Ray's prefixes of the worker lines it forwards
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    for handler in logging.getLogger(LOGGER_NAME).handlers:
        if isinstance(handler, ConsoleHandler):
            for old in [f for f in handler.filters if isinstance(f, _FlrepOnly)]:
                handler.removeFilter(old)
            if not verbose:
                handler.addFilter(_FlrepOnly())
    if not verbose:
        warnings.filterwarnings("ignore", category=FutureWarning, module="ray")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="ray")


def say(message: str, since: float | None = None) -> None:
    """Print one flrep line to stderr (with the seconds since ``since``, a ``time.time()``)."""
    suffix = f" ({time.time() - since:.1f}s since start)" if since is not None else ""
    print(f"{TAG} {message}{suffix}", file=sys.stderr, flush=True)


class RoundBar:
    """A progress bar over the rounds when stderr is a terminal; nothing otherwise."""

    def __init__(self, total: int, done: int, variant: str = "") -> None:
        """``variant``: which variant of a run of several (shown before the bar)."""
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, desc=f"{TAG} {variant + ' ' if variant else ''}rounds",
                            unit="round", leave=False, dynamic_ncols=True)

    def advance(self, line: str, short: str, postfix: str = "") -> None:
        """Log a round's ``line`` (on a terminal its ``short`` form, above the bar) and move the bar
        on by a round (``postfix``: shown after the bar, e.g. the whole run's ETA)."""
        from flwr.common.logger import log

        if self.bar is None:
            log(logging.INFO, line)
            return
        with self.bar.external_write_mode():
            log(logging.INFO, short)
        if postfix:
            self.bar.set_postfix_str(postfix, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


#: Seconds between two progress lines of a long phase when stderr is not a terminal.
PROGRESS_EVERY_S = 30.0


class Progress:
    """Progress through ``total`` items of a phase (``label``): a bar when stderr is a terminal
    and ``bar`` is true (none under the round bar), else a line at most every
    :data:`PROGRESS_EVERY_S` seconds once the phase has taken that long: no silent minute."""

    def __init__(self, label: str, total: int, unit: str = "client", bar: bool = True) -> None:
        self.label, self.total, self.done = label, total, 0
        self.start = self.last_line = time.monotonic()
        self.bar = None
        if bar and sys.stderr.isatty() and total > 1:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"{TAG} {label}", unit=unit, leave=False, dynamic_ncols=True)

    def advance_to(self, done: int) -> None:
        """``done`` items are finished."""
        from flwr.common.logger import log

        if self.bar is not None:
            self.bar.update(done - self.done)
        self.done = done
        now = time.monotonic()
        if self.bar is None and now - self.last_line >= PROGRESS_EVERY_S and done < self.total:
            self.last_line = now
            log(logging.INFO, "%s %s: %d/%d after %.0fs", TAG, self.label, done, self.total, now - self.start)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
