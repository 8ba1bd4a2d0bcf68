"""Delivery of pending messages to the simulation engine's workers in one pass per sweep.

Flower 1.41's simulation runtime hands messages to its ClientApp workers from a thread
(``flwr.server.superlink.fleet.vce.vce_api.add_messages_to_queue``) that, every 0.1 s, asks the
in-memory LinkState once per simulated node for that node's next message; each ask walks every
stored message and checks it for expiry and federation, so one sweep costs nodes × stored messages
checks, and messages stay stored until their replies are pulled. With 1,000 nodes and 1,000
evaluate messages one sweep took 3.7 CPU seconds (4 ms in one pass), so the thread burned a core
for the whole exchange, holding the GIL and the LinkState's lock while the ClientApps' replies
waited for both: in one evaluation of FedRep CIFAR-10 (1000, 2) it used 23-30 CPU seconds against
11-13 of all ClientApps (docs/benchmark.md, "Evaluating 1,000 clients").

:func:`deliver_pending` does the same sweep in one pass over the stored messages: per node at most
one message not yet delivered, expired or foreign ones dropped by the LinkState's own check, the
taken ones marked delivered; it hands them over in the order they were pushed (Flower's: node
order). :func:`one_pass_delivery` installs it while :func:`flower_app.run.simulation.run_blocking`
runs the engine. It reads the in-memory LinkState's store and lock (flwr is pinned; a test compares
it with Flower's own sweep) and falls back to Flower's per-node asks on any other state.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from queue import Queue
from typing import Any

SWEEP_S = 0.1  # Flower's pause between sweeps


def deliver_pending(state: Any, queue: Queue, nodes_mapping: Mapping[int, int], f_stop: threading.Event) -> None:
    """Put each node's next pending message into ``queue`` until ``f_stop`` is set (the signature
    of Flower's ``add_messages_to_queue``)."""
    take = take_pending if _one_pass_possible(state) else _take_per_node
    while not f_stop.is_set():
        for message in take(state, nodes_mapping):
            queue.put(message)
        f_stop.wait(SWEEP_S)


def take_pending(state: Any, nodes: Mapping[int, int]) -> list:
    """Per node of ``nodes`` its first stored message not yet delivered (in push order), checked by
    the LinkState (expired ones are deleted, not taken) and marked delivered."""
    from flwr.supercore.date import now

    with state.lock:
        first: dict[int, str] = {}
        for message_id, message in state.message_ins_store.items():
            meta = message.metadata
            if meta.delivered_at == "" and meta.dst_node_id in nodes and meta.dst_node_id not in first:
                first[meta.dst_node_id] = message_id
        state._check_stored_messages(set(first.values()))
        taken = [state.message_ins_store[i] for i in first.values() if i in state.message_ins_store]
        delivered_at = now().isoformat()
        for message in taken:
            message.metadata.delivered_at = delivered_at
    return taken


def _take_per_node(state: Any, nodes: Mapping[int, int]) -> list:
    """Flower's own sweep: one ask per node."""
    return [message for node in nodes for message in state.get_message_ins(node_id=node, limit=1)]


def _one_pass_possible(state: Any) -> bool:
    return all(hasattr(state, name) for name in ("lock", "message_ins_store", "_check_stored_messages"))


@contextmanager
def one_pass_delivery() -> Iterator[None]:
    """Run the simulation engine with :func:`deliver_pending` as its delivery thread."""
    from flwr.server.superlink.fleet.vce import vce_api

    original = vce_api.add_messages_to_queue
    vce_api.add_messages_to_queue = deliver_pending
    try:
        yield
    finally:
        vce_api.add_messages_to_queue = original
