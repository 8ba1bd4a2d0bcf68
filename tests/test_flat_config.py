"""Flower's run-config with flat keys (``flwr run . --run-config "algorithm='fedper' rounds=3"``):
every key of conf/base.yaml is declared in pyproject.toml, parsed and fused by Flower's own
functions, and reaches the run's configuration; an undeclared key is refused."""

from pathlib import Path

import pytest
import tomli
from flwr.common.config import get_fused_config_from_dir, parse_config_args

from flower_app.run import flat_config
from flower_app.run.config import run_config_of, variants_from_run_config

APP = Path(__file__).resolve().parents[1]


def _run_config(text: str) -> dict:
    """What the ServerApp's context.run_config holds after ``flwr run . --run-config TEXT``."""
    return get_fused_config_from_dir(APP, parse_config_args([text]))


def test_pyproject_declares_every_key_of_base_yaml():
    declared = tomli.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert declared == {**flat_config.OWN_KEYS, **{key: "" for key in flat_config.flat_keys()}}
    assert "train.lr" in declared and "fedprox.mu" in declared and len(declared) > 150
    assert flat_config.main([]) == 0  # the generated block is the file's


def test_a_stale_block_is_found_and_rewritten(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("rounds: 3\ntrain: {lr: 0.1, momentum: 0.0}\n")
    project = tmp_path / "pyproject.toml"
    project.write_text("[project]\nname = 'x'\n\n[tool.flwr.app.config]\nexperiment = 'quickstart'\n\n[tool.ruff]\n")
    assert flat_config.main([], project, base) == 1
    assert flat_config.main(["--write"], project, base) == 0 and flat_config.main([], project, base) == 0
    written = tomli.loads(project.read_text())
    assert written["tool"]["flwr"]["app"]["config"] == {"experiment": "quickstart", "overrides": "", "rounds": "",
                                                        "train.lr": "", "train.momentum": ""}
    assert written["tool"]["ruff"] == {} and written["project"] == {"name": "x"}


def test_flat_keys_reach_the_run_after_overrides():
    rc = _run_config("algorithm='fedper' rounds=3 train.lr=0.05 simulation.ray_address='' data.normalize=false "
                     "overrides='rounds=7 seed=4'")
    assert flat_config.overrides_of(rc) == "rounds=7 seed=4 algorithm=fedper rounds=3 data.normalize=false train.lr=0.05"
    variants = variants_from_run_config(flat_config.experiment_of(rc), flat_config.overrides_of(rc))
    cfg = run_config_of(rc)
    assert (cfg.algorithm, cfg.rounds, cfg.train.lr, cfg.seed, cfg.data.normalize) == ("fedper", 3, 0.05, 4, False)
    assert [v.algorithm for v in variants] == ["fedper", "fedavg"]  # the quickstart's comparison stays
    assert all(v.rounds == 3 for v in variants)


def test_a_list_is_given_as_a_string_and_experiment_selects_the_file():
    cfg = run_config_of(_run_config("experiment='lg_mnist' compare='[]' lg.lg_rounds=2"))
    assert (cfg.algorithm, list(cfg.compare), cfg.lg.lg_rounds) == ("lg_fedavg", [], 2)


def test_an_undeclared_key_is_refused_by_flower_not_dropped():
    with pytest.raises(ValueError, match="Key 'rouns' is not present"):
        _run_config("rouns=3")
    with pytest.raises(ValueError, match="Key 'train.lrr' is not present"):
        _run_config("train.lrr=0.1")


def test_a_bad_value_names_its_key():
    from task.errors import ConfigError

    with pytest.raises(ConfigError, match="rounds"):
        run_config_of(_run_config("rounds='many'"))
