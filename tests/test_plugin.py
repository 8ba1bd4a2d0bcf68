"""An algorithm is a plug-in: one defined here, outside strategies/, runs through the real
ServerApp/ClientApp loop; and the Flower plumbing in flower_app/ names no algorithm."""

import ast
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from flwr.app import ArrayRecord, MetricRecord
from flwr.serverapp.strategy import FedAvg

from flower_app.config import load_config
from flower_app.server_app import Experiment
from strategies import ALGORITHMS, Algorithm, register
from strategies.base import TAKE_ALL_NODES, ServerHooks, all_keys
from strategies.checks import positive
from strategies.common import ARRAYS, NUM_EXAMPLES, ClientRuntime, reply, round_config
from task.errors import ConfigError
from tests.local_grid import LocalGrid

MAX_NORM = 0.5
OVERRIDES = "wandb.enabled=false compare=[] data.num_clients=4 train.fraction=0.5 rounds=3 eval.final_window=1"


@dataclass
class ClipConfig:
    """The plug-in's own config section, ``clip.*``, with its defaults (conf/base.yaml has none)."""

    max_norm: float = positive(MAX_NORM)


class ClippedFedAvg(ServerHooks, FedAvg):
    """FedAvg whose server clips the averaged update to norm ``clip.max_norm`` (server-side update clipping)."""

    def __init__(self, max_norm: float) -> None:
        super().__init__(**TAKE_ALL_NODES)
        self.max_norm = max_norm

    def configure_train(self, server_round, arrays, config, grid):
        self.sent = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None:
            return None, metrics
        old, new = self.sent.to_torch_state_dict(), arrays.to_torch_state_dict()
        norm = math.sqrt(sum(float(((new[k] - old[k]) ** 2).sum()) for k in new))
        scale = min(1.0, self.max_norm / max(norm, 1e-12))
        return ArrayRecord({k: old[k] + scale * (new[k] - old[k]) for k in new}), metrics


def local_sgd(rt: ClientRuntime, content):
    """The client half: the configured local epochs from the received model."""
    rt.load(content[ARRAYS])
    result = rt.local_training(round_config(content))
    return reply(rt.arrays(), train_loss=result.mean_loss, **{NUM_EXAMPLES: len(rt.train)})


@pytest.fixture
def clipped_fedavg():
    algorithm = register(Algorithm(name="fedavg_clip", make_strategy=lambda cfg: ClippedFedAvg(cfg.clip.max_norm),
                                   handlers={"train": local_sgd}, shared_keys=all_keys,
                                   config=ClipConfig, section="clip"))
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
