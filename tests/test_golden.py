"""The golden numbers: the quickstart, run through the real ServerApp/ClientApp, gives exactly the
metrics recorded in docs/behaviour-baseline/quickstart.json (numbers within a relative 1e-4, as
``tests/behaviour_baseline.py check``), and the README prints those figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.behaviour_baseline import CASES, run_case, same

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "docs" / "behaviour-baseline" / "quickstart.json"


def test_the_quickstart_gives_the_recorded_numbers(tmp_path):
    experiment, overrides = CASES["quickstart"]
    now = json.loads(json.dumps(run_case(experiment, overrides, tmp_path / "run"), sort_keys=True))
    recorded = json.loads(RECORDED.read_text())
    assert sorted(now) == sorted(recorded) == ["fedavg", "fedrep"]
    for variant in recorded:
        assert now[variant]["summary"]["personalized_accuracy"] == recorded[variant]["summary"]["personalized_accuracy"]
        assert same(recorded[variant]["summary"], now[variant]["summary"]), variant
        assert same(recorded[variant]["records"], now[variant]["records"]), variant


def test_the_readme_prints_the_recorded_quickstart_figures():
    recorded = json.loads(RECORDED.read_text())
    readme = (ROOT / "README.md").read_text()
    printed = dict(re.findall(r"(FedRep|FedAvg) (0\.\d{4})", readme.split("personalized accuracy:", 1)[1][:80]))
    assert printed == {name: f"{recorded[name.lower()]['summary']['personalized_accuracy']:.4f}"
                       for name in ("FedRep", "FedAvg")}
