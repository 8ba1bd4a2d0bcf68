"""An algorithm is a plug-in: one defined here, outside strategies/, runs through the real
ServerApp/ClientApp loop; and the Flower plumbing in flower_app/ names no algorithm."""

import ast
import math
import re
from pathlib import Path

import pytest
from flwr.app import ArrayRecord, MetricRecord
from flwr.serverapp.strategy import FedAvg

from flower_app.config import load_config
from flower_app.server_app import Experiment
from strategies import ALGORITHMS, Algorithm, register
from strategies.base import TAKE_ALL_NODES, ServerHooks, all_keys
from strategies.common import ARRAYS, NUM_EXAMPLES, ClientRuntime, reply, round_config
from tests.local_grid import LocalGrid

MAX_NORM = 0.05
OVERRIDES = "wandb.enabled=false compare=[] data.num_clients=4 train.fraction=0.5 rounds=3 eval.final_window=1"


class ClippedFedAvg(ServerHooks, FedAvg):
    """FedAvg whose server clips the averaged update to norm ``MAX_NORM`` (server-side update clipping)."""

    def configure_train(self, server_round, arrays, config, grid):
        self.sent = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None:
            return None, metrics
        old, new = self.sent.to_torch_state_dict(), arrays.to_torch_state_dict()
        norm = math.sqrt(sum(float(((new[k] - old[k]) ** 2).sum()) for k in new))
        scale = min(1.0, MAX_NORM / max(norm, 1e-12))
        return ArrayRecord({k: old[k] + scale * (new[k] - old[k]) for k in new}), metrics


def local_sgd(rt: ClientRuntime, content):
    """The client half: the configured local epochs from the received model."""
    rt.load(content[ARRAYS])
    result = rt.local_training(round_config(content))
    return reply(rt.arrays(), train_loss=result.mean_loss, **{NUM_EXAMPLES: len(rt.train)})


@pytest.fixture
def clipped_fedavg():
    algorithm = register(Algorithm(name="fedavg_clip", make_strategy=lambda cfg: ClippedFedAvg(**TAKE_ALL_NODES),
                                   handlers={"train": local_sgd}, shared_keys=all_keys))
    yield algorithm
    ALGORITHMS.pop(algorithm.name)


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


def test_registering_needs_a_new_name_and_a_train_handler():
    with pytest.raises(ValueError, match="already registered"):
        register(Algorithm(name="fedavg", make_strategy=lambda cfg: None, handlers={"train": local_sgd},
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
