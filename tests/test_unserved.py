"""A client stays the client it was (docs/reliability.md): a node that claims a partition that a
live node serves is refused, one that replaces a dead node is adopted; a partition that no node
served for a round is named in the summary, and such a run ends ``incomplete`` (exit 1) unless
``faults.allow_unserved`` accepts it."""

from __future__ import annotations

import json

import pytest
from flwr.app import Message

from flower_app.app.experiment import Experiment
from flower_app.app.federation import Federation, Traffic, rejoin
from flower_app.run.config import load_config
from tests.local_grid import LocalGrid

TINY = "wandb.enabled=false compare=[] data.num_clients=3 train.fraction=1.0 rounds=3 eval.final_window=1"


class Silent(LocalGrid):
    """Partition 1's node stops answering after round 1 (its replies never come)."""

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        if not any(m.metadata.message_type == "train" for m in self.sent[:-len(replies) or None]):
            return replies  # up to round 1's training, partition 1 answers
        gone = self.node_ids[1]
        return [r for r, m in zip(replies, messages) if m.metadata.dst_node_id != gone]


@pytest.mark.parametrize("allowed", [False, True], ids=["default", "allowed"])
def test_a_partition_that_no_node_served_is_named_and_the_run_is_incomplete_unless_allowed(tmp_path, allowed):
    overrides = f"{TINY} algorithm=fedavg faults.allow_unserved={str(allowed).lower()} out_dir={tmp_path}"
    grid = Silent(3, {"experiment": "quickstart", "overrides": overrides}, client_errors=True)
    summary = Experiment(grid, load_config("quickstart", overrides.split())).run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trains = [r for r in records if r["phase"] == "train"]
    assert trains[0]["unserved_clients"] == [] and all(r["unserved_clients"] == [1] for r in trains[1:])
    assert summary["unserved_partitions"] == {"1": 2}  # rounds 2 and 3
    if allowed:
        assert summary["status"] == "completed"
    else:
        assert summary["status"] == "incomplete"
        assert summary["failure_reason"].startswith("no node answered for partition(s) 1 (2 rounds)")
        assert "faults.allow_unserved=true" in summary["failure_reason"]


def test_a_client_that_answers_with_an_error_is_failed_not_unserved(tmp_path):
    overrides = f"{TINY} rounds=1 algorithm=fedavg out_dir={tmp_path}"
    grid = LocalGrid(3, {"experiment": "quickstart", "overrides": overrides}, client_errors=True)
    experiment = Experiment(grid, load_config("quickstart", overrides.split()))
    federation = experiment.start_federation()
    experiment.strategy.prepare_round(1, experiment.services)
    grid.fail = {2}
    record = experiment.train_round(1, federation)
    assert record["failed_clients"] == [2] and record["unserved_clients"] == []


class Claims:
    """A SuperLink's grid whose nodes answer the handshake with the partition each serves."""

    def __init__(self, serves: dict[int, int], listed: set[int]) -> None:
        self.serves, self.listed, self.asked = serves, listed, []

    def get_node_ids(self):
        return sorted(self.listed)

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.app import MetricRecord, RecordDict

        from strategies.common import METRICS

        self.asked += [m.metadata.dst_node_id for m in messages]
        return [Message(RecordDict({METRICS: MetricRecord({"partition-id": self.serves[m.metadata.dst_node_id],
                                                           "num-train": 10})}), reply_to=m)
                for m in messages if m.metadata.dst_node_id in self.serves]


def _federation() -> Federation:
    return Federation({0: 100, 1: 101, 2: 102}, {0: 10, 1: 10, 2: 10}, process_of={100: "a", 101: "b", 102: "c"})


def test_a_node_claiming_a_partition_a_live_node_serves_is_refused_and_the_live_node_keeps_it(caplog):
    fed = _federation()
    grid = Claims({100: 0, 102: 2, 200: 2}, listed={100, 102, 200})  # 101 died; 200 says it serves 2
    assert rejoin(grid, fed, Traffic()) == []
    assert fed.node_of[2] == 102 and 200 in fed.strangers and 102 in grid.asked
    assert "node 200 claims partition 2, which node 102 still serves: refused" in caplog.text


def test_a_node_that_replaces_a_dead_one_is_adopted():
    fed = _federation()
    grid = Claims({100: 0, 102: 2, 201: 1}, listed={100, 101, 102, 201})  # 101 is still listed but answers nothing
    assert rejoin(grid, fed, Traffic(), timeout=1) == [1]
    assert fed.node_of[1] == 201 and 101 in fed.strangers
