"""The golden numbers: the quickstart, run through the real ServerApp/ClientApp, gives exactly the
metrics recorded in docs/behaviour-baseline/quickstart.json (numbers within a relative 1e-4, as
``tests/behaviour_baseline.py check``), and the README prints those figures."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.behaviour_baseline import CASES, KERNELS, run_case, same

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


def test_the_golden_check_runs_on_the_portable_kernels_and_passes():
    """The script pins the x86 kernels before torch loads (the same sums on every x86 CPU), says so, and
    ``l2gd`` (a case that moved by more than 1e-4 between two CPUs' own kernels) gives its record."""
    env = {k: v for k, v in os.environ.items() if k not in KERNELS}
    done = subprocess.run([sys.executable, "tests/behaviour_baseline.py", "check", "docs/behaviour-baseline", "l2gd"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert "kernels: ATen DEFAULT, MKL_CBWR=COMPATIBLE, ONEDNN_MAX_CPU_ISA=SSE41" in done.stdout, done.stdout + done.stderr
    assert "same     l2gd" in done.stdout and done.returncode == 0, done.stdout + done.stderr[-3000:]
