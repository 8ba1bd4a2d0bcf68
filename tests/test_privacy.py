"""What a client keeps as private (heads, personal models, local parts, whole local models)
never crosses the wire in either direction, checked by value through the real ServerApp/ClientApp."""

import pytest

from flower_app.run.config import load_config
from flower_app.app.server_app import Experiment
from strategies import ALGORITHMS, Algorithm, register
from strategies.common import ARRAYS
from strategies.ditto import PERSONAL, DittoConfig, evaluate_personal, make_strategy, train_ditto
from strategies.state_store import kept_arrays
from tests.privacy import RecordingGrid, leaks

BASE = "wandb.enabled=false compare=[] data.num_clients=6 train.fraction=0.5 rounds=4 eval.every=2 eval.final_window=1"
PRIVATE = {  # algorithm -> overrides of a run in which clients keep private state
    "ditto": "algorithm=ditto",
    "apfl": "algorithm=apfl apfl.adaptive=true",
    "apfl-official": "algorithm=apfl apfl.variant=official apfl.start=received",  # v starts as the received w
    "ditto-received": "algorithm=ditto ditto.start=received",
    "fedrep": "algorithm=fedrep fedrep.head_epochs=1",
    "fedper": "algorithm=fedper",
    "lg_fedavg": "algorithm=lg_fedavg lg.fedavg_rounds=1 lg.global_part=[fc2]",
    "local_only": "algorithm=local_only",
    "fed_mtl": "algorithm=fed_mtl",
}
SHARED_BY_DESIGN = {"fed_mtl": "fc1."}  # Fed-MTL sends its regularised first layers: only the rest is private


def run_recorded(overrides: str, tmp_path, shared_prefix: str | None = None) -> RecordingGrid:
    overrides = f"{BASE} {overrides} out_dir={tmp_path}"
    shared = (lambda key: key.startswith(shared_prefix)) if shared_prefix else (lambda key: False)
    grid = RecordingGrid(6, {"experiment": "quickstart", "overrides": overrides}, shared=shared)
    summary = Experiment(grid, load_config("quickstart", overrides.split())).run()
    assert summary["status"] == "completed"
    return grid


@pytest.mark.parametrize("name", list(PRIVATE))
def test_no_array_a_client_keeps_crosses_the_wire(tmp_path, name):
    grid = run_recorded(PRIVATE[name], tmp_path, SHARED_BY_DESIGN.get(name))
    assert leaks(grid) == []
    assert any(m.metadata.message_type == "train" and ARRAYS in m.content for m in grid.replies) or name == "local_only"


def leaky_train(rt, content):
    """Ditto that sends its personal model v under the global model's names (same keys, shapes, dtypes)."""
    out = train_ditto(rt, content)
    out[ARRAYS] = type(out[ARRAYS])({k: v for k, v in kept_arrays(rt, PERSONAL).items()})
    return out


@pytest.fixture
def leaky_ditto():
    algorithm = register(Algorithm(name="leaky_ditto", make_strategy=make_strategy, shared_keys=ALGORITHMS["ditto"].shared_keys,
                                   handlers={"train": leaky_train, "evaluate": evaluate_personal},
                                   config=DittoConfig, section="ditto"))
    yield algorithm
    ALGORITHMS.pop(algorithm.name)


def test_the_check_finds_a_personal_model_sent_under_the_global_models_names(tmp_path, leaky_ditto):
    grid = run_recorded("algorithm=leaky_ditto", tmp_path)  # reply screening (names, shapes) lets it through
    found = leaks(grid)
    assert found and all(line.startswith("up train") and "personal-model" in line for line in found)


def test_lg_selection_passes_carry_no_private_array(tmp_path):
    """LG-FedAvg with main_lg.py's selection (new_test.models=best): its passes send the averaged
    global part down and accuracies up; the only private arrays on the wire are New Test's uploads."""
    grid = run_recorded(f"{PRIVATE['lg_fedavg']} eval.every=1 new_test.enabled=true new_test.models=best", tmp_path)
    found = leaks(grid)
    assert found and all(leak.startswith("up query.localpart ") for leak in found)
    assert any(m.metadata.message_type == "query.lgselect" for m in grid.sent)
