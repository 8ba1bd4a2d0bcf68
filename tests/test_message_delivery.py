"""The simulation engine's message delivery in one pass per sweep (flower_app/run/message_delivery.py)
takes what Flower's own per-node sweep takes, from Flower's in-memory LinkState (flwr is pinned:
this test fails where an upgrade changes what it relies on)."""

import threading
import time
from queue import Queue

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.proto.task_pb2 import Task  # pylint: disable=no-name-in-module
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.server.superlink.linkstate.utils import generate_rand_int_from_bytes
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid

from flower_app.run import message_delivery
from flower_app.run.message_delivery import deliver_pending, one_pass_delivery, take_pending


def federation(num_nodes):
    """An in-memory LinkState with ``num_nodes`` nodes and a Grid on it, as the engine builds them."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    run = Run.create_empty(run_id=generate_rand_int_from_bytes(8))
    run.primary_task_id, run.federation_id = generate_rand_int_from_bytes(8), NOOP_FEDERATION_ID
    TaskIdentity.task_id, TaskIdentity.run_id = run.primary_task_id, run.run_id
    state = factory.state()
    state.run_ids[run.run_id] = RunRecord(run=run)
    state.task_store[run.primary_task_id] = Task(task_id=run.primary_task_id, run_id=run.run_id)
    nodes = vce_api._register_nodes(num_nodes, factory)
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return state, grid, list(nodes)


def push(grid, nodes, ttl=None):
    messages = [Message(RecordDict({"config": ConfigRecord({"i": i})}), dst_node_id=n, message_type="evaluate", ttl=ttl)
                for i, n in enumerate(nodes)]
    grid.push_messages(messages)
    return messages


def flower_sweep(state, nodes):
    return [m for n in nodes for m in state.get_message_ins(node_id=n, limit=1)]


def scenario(sweep):
    """Three sweeps over 6 nodes: node 0 has two messages, node 5 none, one message expires;
    what each sweep takes, as (node, i), and what is left undelivered."""
    state, grid, nodes = federation(6)
    mapping = {n: p for p, n in enumerate(nodes)}
    push(grid, [nodes[0], nodes[1], nodes[0], nodes[2], nodes[3]])
    expired = push(grid, [nodes[4]], ttl=0.05)
    time.sleep(0.1)
    taken = []
    for _ in range(3):
        taken.append(sorted((mapping[m.metadata.dst_node_id], int(m.content["config"]["i"])) for m in sweep(state, mapping)))
    left = [m for m in state.message_ins_store.values() if m.metadata.delivered_at == ""]
    return taken, len(left), expired[0].metadata.message_id in state.message_ins_store


def test_one_pass_takes_what_flowers_sweep_takes():
    ours, theirs = scenario(take_pending), scenario(flower_sweep)
    assert ours == theirs
    taken, left, expired_kept = ours
    assert taken == [[(0, 0), (1, 1), (2, 3), (3, 4)], [(0, 2)], []]  # one message per node and sweep
    assert left == 0 and not expired_kept


def test_the_engine_runs_with_it_and_gets_flowers_back_after():
    original = vce_api.add_messages_to_queue
    with one_pass_delivery():
        assert vce_api.add_messages_to_queue is deliver_pending
    assert vce_api.add_messages_to_queue is original


def test_the_delivery_thread_fills_the_queue_in_push_order_until_stopped():
    state, grid, nodes = federation(50)
    mapping = {n: p for p, n in enumerate(nodes)}
    order = list(reversed(nodes))
    push(grid, order)
    queue, stop = Queue(), threading.Event()
    thread = threading.Thread(target=deliver_pending, args=(state, queue, mapping, stop))
    thread.start()
    got = [queue.get(timeout=5) for _ in nodes]
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert [m.metadata.dst_node_id for m in got] == order


def test_a_state_without_the_in_memory_store_gets_flowers_sweep(monkeypatch):
    state, grid, nodes = federation(3)
    push(grid, nodes)
    monkeypatch.setattr(message_delivery, "_one_pass_possible", lambda state: False)
    queue, stop = Queue(), threading.Event()
    thread = threading.Thread(target=deliver_pending, args=(state, queue, {n: i for i, n in enumerate(nodes)}, stop))
    thread.start()
    got = {queue.get(timeout=5).metadata.dst_node_id for _ in nodes}
    stop.set()
    thread.join(timeout=5)
    assert got == set(nodes)
