"""An algorithm is a plug-in: the template examples/plugins/fedavg_clip.py, outside strategies/,
runs through the real ServerApp/ClientApp loop; and the Flower plumbing in flower_app/ names no
algorithm. Loading plug-ins in every process: tests/test_plugin_loading.py."""

import ast
import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest

from flower_app.run.config import load_config
from flower_app.app.server_app import Experiment
from strategies import ALGORITHMS, Algorithm, register
from strategies.base import all_keys
from strategies.common import ARRAYS
from task.errors import ConfigError
from tests.local_grid import LocalGrid

MAX_NORM = 0.5
OVERRIDES = "wandb.enabled=false compare=[] data.num_clients=4 train.fraction=0.5 rounds=3 eval.final_window=1"
TEMPLATE = Path(__file__).resolve().parents[1] / "examples" / "plugins" / "fedavg_clip.py"


@pytest.fixture
def clipped_fedavg():
    """The plug-in template (examples/plugins/fedavg_clip.py), imported and registered for one test."""
    spec = importlib.util.spec_from_file_location("fedavg_clip_template", TEMPLATE)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module.ALGORITHM
    ALGORITHMS.pop(module.ALGORITHM.name)
    del sys.modules[spec.name]


def test_an_algorithm_defined_outside_strategies_runs_through_the_real_loop(tmp_path, clipped_fedavg):
    overrides = f"{OVERRIDES} algorithm=fedavg_clip out_dir={tmp_path}"
    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides})
    experiment = Experiment(grid, load_config("quickstart", overrides.split()))
    fed = experiment.start_federation()
    before = {k: v.copy() for k, v in ((k, a.numpy()) for k, a in experiment.arrays.items())}
    experiment.train_round(1, fed)
    step = math.sqrt(sum(float(((experiment.arrays[k].numpy() - before[k]) ** 2).sum()) for k in before))
    assert step == pytest.approx(MAX_NORM, rel=1e-4)  # local SGD moves much further: the server clipped it
    summary = experiment.run()
    assert summary["status"] == "completed" and summary["algorithm"] == "fedavg_clip"
    assert summary["global_accuracy"] is not None and summary["rounds_skipped"] == []
    trained = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert trained and all(set(m.content[ARRAYS].keys()) == set(before) for m in trained)


def test_a_plugin_section_is_typed_and_checked_by_the_library(tmp_path, clipped_fedavg):
    cfg = load_config("quickstart", [f"algorithm={clipped_fedavg.name}"])
    assert cfg.clip.max_norm == MAX_NORM
    assert load_config("quickstart", ["clip.max_norm=1"]).clip.max_norm == 1.0
    for bad, expected in (("clip.max_norm=-1", "clip.max_norm: got -1.0, expected a positive number"),
                          ("clip.max_norm=big", "clip.max_norm: got 'big', expected a positive number"),
                          ("clip.maxnorm=1",
                           "clip.maxnorm: unknown key; clip has max_norm; did you mean `clip.max_norm`?")):
        with pytest.raises(ConfigError) as info:
            load_config("quickstart", [bad])
        assert str(info.value) == expected


def test_registering_needs_a_new_name_and_a_train_handler():
    with pytest.raises(ValueError, match="already registered"):
        register(Algorithm(name="fedavg", make_strategy=lambda cfg: None, handlers={"train": lambda rt, c: c},
                           shared_keys=all_keys))
    with pytest.raises(ValueError, match="train"):
        register(Algorithm(name="nothing", make_strategy=lambda cfg: None, handlers={}, shared_keys=all_keys))


def _code_tokens(path: Path) -> list[str]:
    """Identifiers and string constants of ``path``, docstrings and comments excluded."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str)}
    tokens = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            tokens.append(node.id)
        elif isinstance(node, ast.Attribute):
            tokens.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.arg)):
            tokens.append(getattr(node, "name", None) or node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            tokens.append(node.value)
    return tokens


def test_flower_app_names_no_algorithm():
    root = Path(__file__).resolve().parents[1] / "flower_app"
    hits = []
    for path in sorted(root.glob("*.py")):
        for token in _code_tokens(path):
            for name in ALGORITHMS:
                if re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", token):
                    hits.append(f"{path.name}: {token!r}")
    assert not hits, hits


def test_the_token_scan_finds_a_name_in_code(tmp_path):
    source = tmp_path / "x.py"
    source.write_text('"""fedrep in a docstring is fine."""\n# fedrep in a comment too\nif algorithm == "fedrep":\n    pass\n')
    assert "fedrep" in _code_tokens(source) and "fedrep in a docstring is fine." not in _code_tokens(source)


def test_each_message_finds_the_model_at_the_initial_weights_whatever_the_last_client_left(tmp_path):
    """A careless handler that leaves its client's values in the model (here: every weight set to
    the partition id) leaks nothing into the next client the worker serves."""
    import torch

    from strategies.fedavg import make_strategy as fedavg_server
    from strategies.common import reply

    found = []

    def careless_train(rt, content):
        found.append({k: v.clone() for k, v in rt.model.state_dict().items()})
        rt.load(content[ARRAYS])  # the received global weights, as FedAvg's client does
        answer = reply(rt.arrays(), num_examples=len(rt.train))
        with torch.no_grad():  # and junk left behind in the model
            for value in rt.model.state_dict().values():
                value.fill_(float(rt.partition_id + 1))
        return answer

    algorithm = register(Algorithm(name="careless", make_strategy=fedavg_server,
                                   handlers={"train": careless_train}, shared_keys=all_keys))
    try:
        overrides = f"{OVERRIDES} algorithm=careless train.fraction=1.0 rounds=2 out_dir={tmp_path}"
        grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides})  # one process serves all 4
        experiment = Experiment(grid, load_config("quickstart", overrides.split()))
        fed = experiment.start_federation()
        experiment.train_round(1, fed)
        experiment.train_round(2, fed)
    finally:
        ALGORITHMS.pop(algorithm.name)
    initial = found[0]  # the first message of a fresh worker: the run's initial weights
    assert len(found) == 8 and not any(torch.all(v == 1.0) for v in initial.values())
    for state in found[1:]:
        assert all(torch.equal(state[k], initial[k]) for k in initial)


def test_a_plugins_own_evaluation_metrics_are_recorded(tmp_path):
    import json

    from strategies.common import reply
    from strategies.fedavg import make_strategy as fedavg_server
    from strategies.fedavg import local_sgd

    def evaluate_with_a_score(rt, content):
        rt.load(content[ARRAYS])
        metrics = rt.evaluate_local()
        return reply(None, **metrics, my_score=float(rt.partition_id))

    algorithm = register(Algorithm(name="scored", make_strategy=fedavg_server, shared_keys=all_keys,
                                   handlers={"train": local_sgd, "evaluate": evaluate_with_a_score}))
    try:
        overrides = f"{OVERRIDES} algorithm=scored train.fraction=1.0 rounds=1 out_dir={tmp_path}"
        grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides})
        assert Experiment(grid, load_config("quickstart", overrides.split())).run()["status"] == "completed"
    finally:
        ALGORITHMS.pop(algorithm.name)
    evals = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if r["phase"] == "eval"]
    assert evals[-1]["reply_metrics"] == {"my_score": 1.5}  # the mean over partitions 0..3


def test_an_unknown_algorithm_points_at_plugins():
    with pytest.raises(ConfigError, match=r"algorithm: got 'my_clip', .*; if 'my_clip' is a plug-in's algorithm, "
                                          r"name its module: plugins=\[<module>\]"):
        load_config("quickstart", ["algorithm=my_clip"])
