"""A shared body crosses to each client process once (flower_app/app/elision.py), through the real
ServerApp and ClientApp: messages after the first leave it out where the client process holds it,
a process without it asks and gets it in full, a deployment's nodes always get it, and the run's
numbers are those of a run that sends every body."""

import json

import pytest
from flwr.app import ConfigRecord

from flower_app.app import elision
from flower_app.app.server_app import run_variants
from flower_app.run.config import load_variants
from strategies.common import ARRAYS
from tests.behaviour_baseline import _clean
from tests.local_grid import LocalGrid

OVERRIDES = ("algorithm=fedrep compare=[] rounds=2 eval.every=1 eval.final_window=1 data.num_clients=8 "
             "train.fraction=0.5 fedrep.head_epochs=2 wandb.enabled=false")


class ProcessGrid(LocalGrid):
    """A LocalGrid whose nodes are served by client processes named by ``process_of(partition id)``:
    each process has its own kept records, and the handshake reply names the process."""

    def __init__(self, num_nodes, run_config, process_of):
        super().__init__(num_nodes, run_config)
        self.process_of = process_of
        self.held = {}

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            pid = int(self.contexts[msg.metadata.dst_node_id].node_config["partition-id"])
            process = self.process_of(pid)
            elision.HELD = self.held.setdefault(process, type(elision.HELD)())
            rep = super().send_and_receive([msg], timeout=timeout)[0]
            if msg.metadata.message_type == "query.info" and not rep.has_error():
                rep.content[elision.PROCESS] = ConfigRecord({"id": process})
            replies.append(rep)
        return replies


def run(tmp_path, name, process_of, elide_above):
    out = tmp_path / name
    overrides = f"{OVERRIDES} out_dir={out}"
    grid = ProcessGrid(8, {"experiment": "quickstart", "overrides": overrides}, process_of)
    saved = elision.ELIDE_ABOVE_BYTES, elision.HELD
    elision.ELIDE_ABOVE_BYTES = elide_above
    try:
        summary = run_variants(grid, load_variants("quickstart", overrides.split()))
    finally:
        elision.ELIDE_ABOVE_BYTES, elision.HELD = saved
    assert summary["status"] == "completed"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return grid, _clean(records), _clean(summary)


def exchanges(grid, kind):
    """The messages of ``kind`` and their replies, one list per exchange (by server round)."""
    rounds = {}
    for msg, rep in zip(grid.sent, grid.replies):
        if msg.metadata.message_type == kind:
            rounds.setdefault(int(msg.content["config"]["server-round"]), []).append((msg, rep))
    return list(rounds.values())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run with every body sent (nothing is large enough to leave out)."""
    return run(tmp_path_factory.mktemp("reference"), "all", lambda pid: "one", elide_above=10**12)


def test_messages_after_the_first_leave_out_the_body_the_process_holds(tmp_path, reference):
    grid, records, summary = run(tmp_path, "elided", lambda pid: "one", elide_above=0)
    assert (records, summary) == reference[1:]  # traffic included: it counts what the algorithm sends
    for kind in ("evaluate", "train"):
        for exchange in exchanges(grid, kind):
            carried = [ARRAYS in msg.content for msg, _ in exchange]
            assert carried == [True] + [False] * (len(exchange) - 1), kind
            assert all(elision.BODIES in msg.content for msg, _ in exchange)
            assert not any(elision.asks_for_bodies(rep) for _, rep in exchange)
    assert len(exchanges(grid, "evaluate")[0]) == 8
    assert [len(held) for held in grid.held.values()] == [1]  # this round's body, not the earlier ones
    ref_grid = reference[0]
    assert all(ARRAYS in m.content and elision.BODIES not in m.content
               for m in ref_grid.sent if m.metadata.message_type in ("train", "evaluate"))


def test_a_process_without_the_body_asks_for_it_and_gets_it_in_full(tmp_path, reference):
    # two processes: the first two messages of each exchange (sent in full) both reach process "a",
    # so process "b" holds nothing the first time it serves a message of a new body
    grid, records, summary = run(tmp_path, "fallback", lambda pid: "a" if pid < 2 else "b", elide_above=0)
    assert (records, summary) == reference[1:]
    first = exchanges(grid, "evaluate")[0]
    asked = [msg.metadata.dst_node_id for msg, rep in first if elision.asks_for_bodies(rep)]
    assert asked, "process b never lacked the body"
    for node in asked:  # each was sent again, in full, and answered
        again = [(m, r) for m, r in first if m.metadata.dst_node_id == node and not elision.asks_for_bodies(r)]
        assert len(again) == 1 and ARRAYS in again[0][0].content and "accuracy" in again[0][1].content["metrics"]


def test_nodes_with_processes_of_their_own_always_get_the_body(tmp_path, reference):
    # a deployment: every SuperNode runs its own ClientApp processes
    grid, records, summary = run(tmp_path, "deployed", lambda pid: f"node{pid}", elide_above=0)
    assert (records, summary) == reference[1:]
    for msg in grid.sent:
        assert elision.BODIES not in msg.content
        if msg.metadata.message_type in ("train", "evaluate"):
            assert ARRAYS in msg.content
