"""The first-second checks of ``flrep run``: they need neither torch nor Flower, reject what the
full check would reject, and never reject a key the full schema accepts."""

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from flower_app.run.precheck import CONF_DIR, quick_check
from flower_app.run.schema import run_schema
from task.errors import ConfigError
from offline_data import shared


@pytest.mark.parametrize("experiment, overrides, message", [
    ("nope", [], "unknown experiment 'nope'"),
    ("quickstart", ["rounds"], "override 'rounds' must have the form key=value"),
    ("quickstart", ["train.lrr=0.1"], "train.lrr: unknown key; train has fraction"),
    ("quickstart", ["fedrep.head_epochz=2"], "fedrep.head_epochz: unknown key"),
    ("quickstart", ["data.synthetic.dd=3"], "data.synthetic.dd: unknown key"),
    ("lg_mnist", ["data.root=/no/such/dir"], "data.root='/no/such/dir' does not exist"),
])
def test_quick_mistakes_are_named(experiment, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        quick_check(experiment, overrides)


def test_valid_overrides_pass_and_unknown_sections_are_left_to_the_full_check():
    shared("mnist")  # lg_mnist's data (the check would download it)
    quick_check("lg_mnist", ["rounds=3", "train.lr=0.1", "fedrep.head_epochs=2", "data.root=mnist"])
    quick_check("quickstart", ["my_plugin.alpha=1"])  # a plug-in's own section: the full check decides


def test_every_key_of_the_full_schema_is_in_base_yaml():
    import yaml

    base = yaml.safe_load((CONF_DIR / "base.yaml").read_text())

    def leaves(node, prefix=""):
        for key in node:
            value = OmegaConf.select(node, key, throw_on_missing=False) if OmegaConf.is_dict(node) else None
            if OmegaConf.is_dict(value):
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    for key in leaves(OmegaConf.structured(run_schema())):
        if key == "experiment":  # set by the loader from the command line, never by a key
            continue
        node = base
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"{key} is in the schema but not in conf/base.yaml"
            node = node[part]


def test_the_quick_check_imports_neither_torch_nor_flower():
    code = ("import sys; from flower_app.run.precheck import quick_check; quick_check('quickstart', ['rounds=2']); "
            "assert not {'torch', 'flwr'} & set(sys.modules), sorted({'torch', 'flwr'} & set(sys.modules))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=CONF_DIR.parent)
