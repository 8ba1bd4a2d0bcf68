"""Where a run's time goes: wall seconds per phase on the server, and the seconds each client
reports for its own work (runtime setup with data loading, the handler's compute, the state
snapshot), carried in the reply metrics under ``t/`` and taken out before any aggregation.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from flwr.app import Message, RecordDict

from strategies.common import METRICS

PREFIX = "t/"  # reply-metric keys of client timings


def stamp(content: RecordDict, name: str, seconds: float) -> None:
    """Report ``seconds`` of client work ``name`` in a reply (when it carries metrics)."""
    if METRICS in content.metric_records:
        content[METRICS][PREFIX + name] = float(seconds)


class PhaseTimer:
    """Wall seconds and calls per named phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed block as (part of) phase ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        """Count ``seconds`` under ``name``."""
        self.seconds[name] += seconds
        self.calls[name] += 1

    def take_client_times(self, replies: Iterable[Message], phase: str) -> None:
        """Move the clients' ``t/`` metrics of ``phase``'s replies into this timer (summed over clients)."""
        for rep in replies:
            if rep.has_error() or METRICS not in rep.content.metric_records:
                continue
            metrics = rep.content[METRICS]
            for key in [k for k in metrics.keys() if k.startswith(PREFIX)]:
                self.add(f"clients: {phase} {key[len(PREFIX):]}", float(metrics[key]))
                del metrics[key]

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{phase: {"s": seconds, "calls": n}}``, in the order the phases first ran."""
        return {name: {"s": round(s, 4), "calls": self.calls[name]} for name, s in self.seconds.items()}
