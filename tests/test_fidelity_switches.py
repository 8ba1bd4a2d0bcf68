"""Fidelity switches (paper text vs official code) through the real ServerApp/ClientApp:
``train.aggregation``, ``local_only.clients``, ``fedavg.local_model_accuracy`` and ``fedprox.pull``."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Message

from flower_app.run.config import load_config, load_variants, validate_with_data
from flower_app.app.server_app import run_variants
from flower_app.results.progress import round_line
from strategies.common import ARRAYS, CONFIG, METRICS, NUM_EXAMPLES
from strategies.evaluator import ServerEvaluator
from strategies.fedavg import LOCAL_ACCURACY, OFFICIAL_ACCURACY, SCORE_LOCAL
from tests.local_grid import LocalGrid

# 6 digits clients of unequal sizes (Dirichlet), 3 sampled per round
TINY = ("wandb.enabled=false compare=[] data.num_clients=6 train.fraction=0.5 data.partition=dirichlet "
        "data.dirichlet_alpha=0.3 eval.final_window=2 fedrep.head_epochs=1")


class SnapshotGrid(LocalGrid):
    """A LocalGrid that also keeps a copy of every sent message's arrays as they were when sent
    (the server's global ArrayRecord, which messages share, changes in place afterwards)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent_arrays: list[dict[str, np.ndarray]] = []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for msg in messages:
            arrays = msg.content[ARRAYS] if ARRAYS in msg.content else {}
            self.sent_arrays.append({k: a.numpy().copy() for k, a in arrays.items()})
        return super().send_and_receive(messages, timeout=timeout)


def run(tmp_path: Path, overrides: str, num_nodes: int = 6) -> tuple[SnapshotGrid, dict, list[dict]]:
    overrides = f"{TINY} {overrides} out_dir={tmp_path}"
    grid = SnapshotGrid(num_nodes, {"experiment": "quickstart", "overrides": overrides})
    summary = run_variants(grid, load_variants("quickstart", overrides))
    assert summary["status"] == "completed"
    records = [json.loads(line) for line in (Path(summary["out_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return grid, summary, records


def exchanges(grid: SnapshotGrid, message_type: str = "train") -> list[tuple[int, int, Message, Message, dict]]:
    """(round, partition id, sent, reply, sent arrays) of every ``message_type`` message, in sending order."""
    out = []
    for sent, rep, arrays in zip(grid.sent, grid.replies, grid.sent_arrays):
        if sent.metadata.message_type == message_type:
            pid = int(grid.contexts[sent.metadata.dst_node_id].node_config["partition-id"])
            out.append((int(sent.content[CONFIG]["server-round"]), pid, sent, rep, arrays))
    return out


@pytest.mark.parametrize("algorithm, extra, aggregation", [
    ("fedavg", "", "examples"),
    ("fedavg", "", "uniform"),
    ("fedprox", "fedprox.mu=0.1", "uniform"),
    ("fedrep", "", "uniform"),
    ("fedper", "", "examples"),
    ("lg_fedavg", "lg.fedavg_rounds=0 lg.global_part=[fc2]", "uniform"),
])
def test_the_shared_arrays_are_averaged_as_train_aggregation_says(tmp_path, algorithm, extra, aggregation):
    grid, _, _ = run(tmp_path, f"algorithm={algorithm} {extra} rounds=2 train.aggregation={aggregation}")
    first = [(rep.content[ARRAYS], float(rep.content[METRICS][NUM_EXAMPLES]))
             for t, _, _, rep, _ in exchanges(grid) if t == 1]
    sizes = [n for _, n in first]
    assert len(first) == 3 and len(set(sizes)) == 3  # clients of different sizes
    weights = np.array(sizes if aggregation == "examples" else [1.0] * 3)
    weights /= weights.sum()
    for _, _, _, _, sent in [e for e in exchanges(grid) if e[0] == 2]:
        for key in first[0][0]:  # what the clients share: whole model, body or global part
            expected = sum(w * arrays[key].numpy().astype(np.float64) for (arrays, _), w in zip(first, weights))
            np.testing.assert_allclose(sent[key], expected, rtol=1e-5, atol=1e-6)


def test_uniform_and_example_weighted_averages_differ(tmp_path):
    sent = {}
    for aggregation in ("examples", "uniform"):
        grid, _, _ = run(tmp_path / aggregation, f"algorithm=fedavg rounds=2 train.aggregation={aggregation}")
        sent[aggregation] = next(arrays for t, _, _, _, arrays in exchanges(grid) if t == 2)
    assert not np.allclose(sent["examples"]["fc2.weight"], sent["uniform"]["fc2.weight"])


@pytest.mark.parametrize("clients", ["sampled", "all"])
def test_local_only_trains_the_sampled_clients_or_all_of_them(tmp_path, clients):
    grid, summary, records = run(tmp_path, f"algorithm=local_only rounds=3 local_only.clients={clients}")
    trained = {t: sorted(pid for r, pid, *_ in exchanges(grid) if r == t) for t in (1, 2, 3)}
    trains = [r for r in records if r["phase"] == "train"]
    for record in trains:
        sampled = sorted(record["clients"])
        assert len(sampled) == 3
        if clients == "all":
            assert trained[record["round"]] == list(range(6))
            assert record["trained_clients"] == record["asked"] == 6
        else:
            assert trained[record["round"]] == sampled
            assert "trained_clients" not in record and record["asked"] == 3
    for _, _, sent, *_ in exchanges(grid):
        assert ARRAYS not in sent.content  # nothing but the round config goes down
    assert summary["params_up"] == 0
    line = round_line(1, 3, trains[0], None, 0.0, 0.0)
    assert f"{6 if clients == 'all' else 3}/{6 if clients == 'all' else 3} clients replied" in line


def test_fedavg_reports_the_official_codes_local_model_accuracy(tmp_path):
    grid, summary, records = run(tmp_path, "algorithm=fedavg rounds=3 fedavg.local_model_accuracy=true")
    cfg = load_config("quickstart", f"{TINY} algorithm=fedavg".split())
    data, model = validate_with_data(cfg)
    evaluator = ServerEvaluator(data, model, torch.device("cpu"), 2048)
    latest: dict[int, tuple[float, int]] = {}  # pid -> (accuracy, test size) of its latest local model
    trains = {r["round"]: r for r in records if r["phase"] == "train"}
    evals = {r["round"]: r for r in records if r["phase"] == "eval"}
    for t in (1, 2, 3):
        fresh = []
        for _, pid, sent, rep, _ in [e for e in exchanges(grid) if e[0] == t]:
            assert sent.content[CONFIG][SCORE_LOCAL] is True
            metrics = rep.content[METRICS]
            evaluator.load(rep.content[ARRAYS])  # the client's model after its local training ...
            accuracy, _ = evaluator.per_client([pid])  # ... on its own test split
            assert metrics[LOCAL_ACCURACY] == pytest.approx(accuracy[pid])
            assert metrics["local_test_examples"] == len(data.client_test[pid])
            fresh.append(metrics[LOCAL_ACCURACY])
            latest[pid] = (metrics[LOCAL_ACCURACY], len(data.client_test[pid]))
        assert trains[t][LOCAL_ACCURACY] == pytest.approx(np.mean(fresh))
        assert "local_test_examples" not in trains[t]
        # official: every client's latest local model, the global model for one never trained; pooled
        scored = [latest.get(pid, (evals[t]["client_accuracy"][str(pid)], len(data.client_test[pid])))
                  for pid in range(6)]
        pooled = sum(a * n for a, n in scored) / sum(n for _, n in scored)
        assert evals[t][OFFICIAL_ACCURACY] == pytest.approx(pooled)
    assert summary[OFFICIAL_ACCURACY] == pytest.approx(np.mean([evals[t][OFFICIAL_ACCURACY] for t in (2, 3)]))
    assert summary[LOCAL_ACCURACY] == pytest.approx(np.mean([trains[t][LOCAL_ACCURACY] for t in (2, 3)]))
    # ours stays the global model on every client's test split
    assert summary["personalized_accuracy"] == pytest.approx(
        np.mean([evals[t]["personalized_accuracy"] for t in (2, 3)]))


def test_with_every_client_sampled_the_official_accuracy_pools_this_rounds_local_models(tmp_path):
    grid, _, records = run(tmp_path, "algorithm=fedprox fedprox.mu=0.1 rounds=2 train.fraction=1.0 "
                                     "fedavg.local_model_accuracy=true")
    evals = {r["round"]: r for r in records if r["phase"] == "eval"}
    for t in (1, 2):
        scores = [(rep.content[METRICS][LOCAL_ACCURACY], rep.content[METRICS]["local_test_examples"])
                  for r, _, _, rep, _ in exchanges(grid) if r == t]
        assert len(scores) == 6
        assert evals[t][OFFICIAL_ACCURACY] == pytest.approx(sum(a * n for a, n in scores) / sum(n for _, n in scores))


def test_local_model_accuracy_is_off_by_default(tmp_path):
    grid, summary, records = run(tmp_path, "algorithm=fedavg rounds=1")
    for _, _, sent, rep, _ in exchanges(grid):
        assert SCORE_LOCAL not in sent.content[CONFIG]
        assert LOCAL_ACCURACY not in rep.content[METRICS]
    assert OFFICIAL_ACCURACY not in summary and all(OFFICIAL_ACCURACY not in r for r in records)


@pytest.mark.parametrize("pull", ["gradient", "after_momentum"])
def test_fedprox_sends_its_pull_to_every_training_client(tmp_path, pull):
    grid, _, _ = run(tmp_path, f"algorithm=fedprox fedprox.mu=1.0 fedprox.pull={pull} train.momentum=0.5")
    sent = [s for _, _, s, _, _ in exchanges(grid)]
    assert sent and all(s.content[CONFIG]["proximal-pull"] == pull for s in sent)
    assert all(s.content[CONFIG]["proximal-mu"] == pytest.approx(1.0) for s in sent)
