"""The privacy check: what a client keeps as private never crosses the wire, by value.

:class:`RecordingGrid` runs the real ServerApp/ClientApp (as :class:`~tests.local_grid.LocalGrid`)
and, after every message a client handles, records the hash of every array that client keeps
(``context.state``'s ArrayRecords and the files its entries point to) and did not receive as it
is (a warm-start part the server handed it is not the client's own). :func:`leaks` then names
each array that crossed the wire, in either direction, with the value of an array some client
kept at some point. Names and shapes play no part: a personal model sent under the global
model's names is found.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message

from tests.local_grid import LocalGrid

Shared = Callable[[str], bool]  # array key -> whether the algorithm shares it by design (not private)


def fingerprint(array: np.ndarray) -> str:
    """The value of an array: dtype, shape and bytes."""
    array = np.ascontiguousarray(array)
    return hashlib.sha256(f"{array.dtype}{array.shape}".encode() + array.tobytes()).hexdigest()


def _arrays_of(record: object) -> Iterable[tuple[str, np.ndarray]]:
    if isinstance(record, ArrayRecord):
        yield from ((k, a.numpy()) for k, a in record.items())
    elif isinstance(record, ConfigRecord) and "path" in record:
        yield from ((k, t.numpy()) for k, t in torch.load(str(record["path"]), weights_only=True).items())


class RecordingGrid(LocalGrid):
    """A LocalGrid that records what every client keeps after each message (key -> value hashes)."""

    def __init__(self, *args, shared: Shared = lambda key: False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shared = shared
        self.kept: dict[str, str] = {}  # value hash -> "partition p keeps <entry>/<key>"
        self.received: dict[int, set[str]] = {node: set() for node in self.node_ids}

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        out = []
        for message in messages:
            node = message.metadata.dst_node_id
            for record in message.content.array_records.values():
                self.received[node].update(fingerprint(a.numpy()) for a in record.values())
            out += super().send_and_receive([message], timeout=timeout)
            context = self.contexts[node]
            for entry, record in context.state.items():
                for key, array in _arrays_of(record):
                    if not self.shared(key) and (h := fingerprint(array)) not in self.received[node]:
                        where = f"partition {context.node_config['partition-id']} keeps {entry}/{key}"
                        self.kept.setdefault(h, where)
        return out


def wire_arrays(grid: LocalGrid) -> Iterable[tuple[str, str, np.ndarray]]:
    """(direction and message type, key, array) of every array sent to or from a client."""
    for direction, messages in (("down", grid.sent), ("up", grid.replies)):
        for message in messages:
            if message.has_error():
                continue
            for record in message.content.array_records.values():
                for key, array in record.items():
                    yield f"{direction} {message.metadata.message_type}", key, array.numpy()


def leaks(grid: RecordingGrid) -> list[str]:
    """Every array on the wire whose value a client kept as private."""
    assert grid.kept, "no client kept anything: nothing was checked"
    return [f"{where} ({grid.kept[h]}) as {key}" for where, key, array in wire_arrays(grid)
            if (h := fingerprint(array)) in grid.kept]
