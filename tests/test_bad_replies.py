"""Bad replies (missing records or arrays, wrong shapes or dtypes, NaN/Inf, negative or missing
example counts) are rejected with the node named and never reach any strategy's aggregate:
a round with one corrupted reply ends exactly like the same round without that client."""

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from flower_app.run.config import load_config
from flower_app.app.reply_check import reply_problem
from flower_app.app.server_app import Experiment
from strategies.common import ARRAYS, METRICS, NUM_EXAMPLES
from tests.local_grid import LocalGrid

BASE = ("wandb.enabled=false compare=[] data.num_clients=4 train.fraction=1.0 eval.every=1000 "
        "eval.final_window=1 fedrep.head_epochs=1")

#: algorithm -> (extra overrides, rounds; the last round's replies are corrupted)
ALGORITHMS = {
    "fedavg": ("", 1),
    "fedprox": ("", 1),
    "scaffold": ("", 1),
    "fedrep": ("", 1),
    "fedper": ("", 1),
    "lg_fedavg": ("lg.fedavg_rounds=1 lg.global_part=[fc2]", 2),
    "local_only": ("", 1),
    "local_update": ("local_update.steps=3", 1),
    "local_update-adam": ("algorithm=local_update server_opt.name=adam server_opt.lr=0.01", 1),
    "fedavg-fedadam": ("algorithm=fedavg server_opt.name=fedadam server_opt.lr=0.01", 1),
    "tct": ("tct.stage1_rounds=1 tct.features=64 tct.local_steps=2", 2),
}


def _first(record: ArrayRecord) -> tuple[str, np.ndarray]:
    key = next(iter(record))
    return key, record[key].numpy()


def _replace(content: RecordDict, name: str, key: str, value: np.ndarray) -> None:
    arrays = {k: (value if k == key else a.numpy()) for k, a in content[name].items()}
    content[name] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def drop_array(content):
    key, _ = _first(content[ARRAYS])
    content[ARRAYS] = ArrayRecord({k: a for k, a in content[ARRAYS].items() if k != key})


def wrong_shape(content):
    key, value = _first(content[ARRAYS])
    _replace(content, ARRAYS, key, np.zeros(value.size + 1, dtype=value.dtype))


def wrong_dtype(content):
    key, value = _first(content[ARRAYS])
    _replace(content, ARRAYS, key, value.astype(np.float64))


def nan_array(content):
    key, value = _first(content[ARRAYS])
    value = value.copy()
    value.flat[0] = np.nan
    _replace(content, ARRAYS, key, value)


def inf_last_record(content):
    name = list(content.array_records)[-1]  # SCAFFOLD / TCT: the control variate
    key, value = _first(content[name])
    value = value.copy()
    value.flat[-1] = np.inf
    _replace(content, name, key, value)


def negative_examples(content):
    content[METRICS][NUM_EXAMPLES] = -5.0


def nan_metric(content):
    content[METRICS]["train_loss"] = float("nan")


def no_metrics(content):
    del content[METRICS]


def no_arrays(content):
    del content[ARRAYS]


WITH_ARRAYS = [drop_array, wrong_shape, wrong_dtype, nan_array, inf_last_record, no_arrays]
ANY_REPLY = [negative_examples, nan_metric, no_metrics]


def _started(tmp_path, algorithm: str, rounds: int, extra: str):
    """An in-process experiment of 4 clients, its grid and its started federation."""
    overrides = f"{BASE} algorithm={algorithm} rounds={rounds} {extra} out_dir={tmp_path}"
    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides})
    experiment = Experiment(grid, load_config("quickstart", overrides.split()))
    return experiment, grid, experiment.start_federation()


def _round(tmp_path, name: str, fail=(), corrupt=None):
    extra, rounds = ALGORITHMS[name]
    experiment, grid, fed = _started(tmp_path, name.split("-")[0], rounds, extra)
    for t in range(1, rounds + 1):
        experiment.strategy.prepare_round(t, experiment.services)
        last = t == rounds
        grid.corrupt, grid.fail = ({1: corrupt} if corrupt and last else {}), (set(fail) if last else set())
        record = experiment.train_round(t, fed)
    return experiment, record


def _state(experiment: Experiment) -> dict[str, np.ndarray]:
    """The global arrays and every array the strategy keeps (control variates, moments ...)."""
    out = {f"arrays/{k}": a.numpy() for k, a in experiment.arrays.items()}
    for name, value in vars(experiment.strategy).items():
        if isinstance(value, ArrayRecord):
            value = {k: a.numpy() for k, a in value.items()}
        if isinstance(value, dict):
            out.update({f"{name}/{k}": np.asarray(v) for k, v in value.items()
                        if isinstance(v, (np.ndarray, torch.Tensor))})
    return out


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_a_corrupted_reply_never_reaches_the_aggregate(tmp_path, name):
    reference, ref_record = _round(tmp_path / "ref", name, fail={1})
    expected = _state(reference)
    corruptions = ANY_REPLY + (WITH_ARRAYS if name != "local_only" else [])
    corruptions = [c for c in corruptions if c is not inf_last_record or name in ("scaffold", "tct")]
    for corrupt in corruptions:
        experiment, record = _round(tmp_path / corrupt.__name__, name, corrupt=corrupt)
        assert record["failed_clients"] == [1], corrupt.__name__
        assert record["failures"]["1"].startswith("rejected: "), record["failures"]
        got = _state(experiment)
        assert got.keys() == expected.keys()
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{name} {corrupt.__name__} {key}")
        assert record.get("train_loss") == ref_record.get("train_loss")


def test_rejection_reasons_name_the_record_and_key():
    from flwr.app import Message

    good = RecordDict({ARRAYS: ArrayRecord({"w": Array(np.ones((2, 3), np.float32))}),
                       METRICS: MetricRecord({NUM_EXAMPLES: 3.0})})
    template = {ARRAYS: good[ARRAYS]}

    def problem(mutate) -> str | None:
        content = RecordDict({ARRAYS: ArrayRecord({"w": Array(np.ones((2, 3), np.float32))}),
                              METRICS: MetricRecord({NUM_EXAMPLES: 3.0})})
        mutate(content)
        return reply_problem(Message(content, dst_node_id=1, message_type="train"), template, training=True)

    assert problem(lambda c: None) is None
    assert problem(wrong_shape) == "arrays['w']: shape (7,), expected (2, 3)"
    assert problem(wrong_dtype) == "arrays['w']: dtype float64, expected float32"
    assert problem(nan_array) == "arrays['w'] holds NaN or Inf"
    assert problem(negative_examples) == "metric 'num-examples' is negative (-5.0)"
    assert problem(no_arrays) == "record 'arrays' is missing"
    assert problem(no_metrics) == "record 'metrics' is missing"
    assert problem(lambda c: c[METRICS].pop(NUM_EXAMPLES)) == "metric 'num-examples' is missing"
    assert problem(drop_array) == "arrays: missing arrays ['w']"


def test_a_round_with_too_few_sound_replies_is_skipped(tmp_path):
    overrides = f"{BASE} algorithm=fedavg rounds=1 faults.min_replies=3 out_dir={tmp_path}"
    cfg = load_config("quickstart", overrides.split())
    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides}, corrupt={1: nan_array})
    experiment = Experiment(grid, cfg)
    before = {k: a.numpy().copy() for k, a in experiment.arrays.items()}
    fed = experiment.start_federation()
    grid.fail = {0}
    record = experiment.train_round(1, fed)
    assert record["skipped"] is True and record["failed_clients"] == [0, 1]
    for key, value in before.items():
        np.testing.assert_array_equal(experiment.arrays[key].numpy(), value)


def test_a_skipped_scaffold_round_keeps_c_the_mean_of_the_clients_c_i(tmp_path):
    """The clients that replied in a skipped round keep their c_i⁺: the server's c takes their
    Δc_i (and only x stays), so c = Σ π_i c_i holds for the next round."""
    overrides = f"{BASE} algorithm=scaffold rounds=1 faults.min_replies=4 out_dir={tmp_path}"
    cfg = load_config("quickstart", overrides.split())
    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides})
    experiment = Experiment(grid, cfg)
    before = {k: a.numpy().copy() for k, a in experiment.arrays.items()}
    fed = experiment.start_federation()
    grid.fail = {3}
    assert experiment.train_round(1, fed)["skipped"] is True
    for key, value in before.items():
        np.testing.assert_array_equal(experiment.arrays[key].numpy(), value)
    clients = [_client_control(grid, node) for node in grid.node_ids[:3]]
    assert set(experiment.strategy.control) == set(clients[0])
    for key, c in experiment.strategy.control.items():
        torch.testing.assert_close(c, sum(ci[key] for ci in clients) / 4)  # uniform π_i = 1/N, c_4 = 0


def _client_control(grid: LocalGrid, node: int) -> dict[str, torch.Tensor]:
    """The c_i a client keeps in its node state."""
    state = grid.contexts[node].state
    (key,) = [k for k in state.keys() if k.endswith("scaffold-ci")]
    return state[key].to_torch_state_dict()


def _latest_client_controls(grid: LocalGrid, suffix: str) -> list[dict[str, torch.Tensor]]:
    """Every client's latest c_i (zero for a client that never trained)."""
    out = []
    for node in grid.node_ids:
        state = grid.contexts[node].state
        keys = [k for k in state.keys() if k.endswith(suffix)]
        out.append(state[keys[0]].to_torch_state_dict() if keys else {})
    return out


@pytest.mark.parametrize("name,rounds,suffix,control_of", [
    ("scaffold", 3, "scaffold-ci", lambda strategy: strategy.control),
    ("tct", 4, "tct-ci", lambda strategy: strategy.stage2.control),
])
def test_after_a_rejected_reply_c_is_exactly_the_mean_of_the_clients_c_i(tmp_path, name, rounds, suffix, control_of):
    """Client 1's round-2 (TCT: round-3) reply is computed, so the client holds its c_i⁺, and then
    rejected; the server never absorbs its Δc_i. In the next round the client must start from the
    c_i the server counts, so that after it c = Σ π_i c_i (π_i = 1/N) to float tolerance."""
    extra = {"scaffold": "", "tct": "tct.stage1_rounds=1 tct.features=64 tct.local_steps=2"}[name]
    experiment, grid, fed = _started(tmp_path, name, rounds, extra)
    for t in range(1, rounds + 1):
        experiment.strategy.prepare_round(t, experiment.services)
        grid.corrupt = {1: nan_metric} if t == rounds - 1 else {}
        record = experiment.train_round(t, fed)
        assert record["failed_clients"] == ([1] if t == rounds - 1 else [])
    clients = _latest_client_controls(grid, suffix)
    control = control_of(experiment.strategy)
    assert control and all(set(c) == set(control) for c in clients)
    for key, c in control.items():
        torch.testing.assert_close(c, sum(ci[key] for ci in clients) / 4, rtol=1e-5, atol=1e-6)


@pytest.mark.injects_faults  # every evaluation reply carries a NaN loss
def test_a_run_whose_final_evaluations_all_fail_is_a_failed_run(tmp_path, monkeypatch):
    """A diverged model (NaN losses) is rejected at every evaluation: the run has no result, so it
    ends failed instead of completed with an empty headline."""
    from strategies import ALGORITHMS as REGISTRY
    from strategies.common import reply

    monkeypatch.setitem(REGISTRY["fedrep"].handlers, "evaluate", lambda rt, content: reply(None, loss=float("nan"),
                                                                                              accuracy=0.5))
    overrides = f"{BASE} algorithm=fedrep rounds=2 out_dir={tmp_path}"
    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides})
    summary = Experiment(grid, load_config("quickstart", overrides.split())).run()
    assert summary["status"] == "failed" and summary["personalized_accuracy"] is None
    assert "no evaluation of the final 1 rounds produced a metric" in summary["failure_reason"]
