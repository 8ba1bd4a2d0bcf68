"""Plug-ins load in every process of a run: the template examples/plugins/fedavg_clip.py, copied
beside the user's experiments and named in ``plugins``, runs through the simulation engine's Ray
workers and through real SuperNodes; an installed package's entry point is loaded without the key;
a plug-in that cannot be imported stops the command before start-up, naming it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flower_app.run.config import load_config
from flower_app.app.plugins import ENTRY_POINT_GROUP
from strategies import ALGORITHMS
from task.errors import ConfigError

APP = Path(__file__).resolve().parents[1]
TEMPLATE = APP / "examples" / "plugins" / "fedavg_clip.py"
RUN = ["plugins=[fedavg_clip]", "algorithm=fedavg_clip", "compare=[]", "wandb.enabled=false", "eval.final_window=1"]


def _flrep(args: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only the current directory offers the plug-in
    return subprocess.run([sys.executable, "-m", "flower_app.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def user_folder(tmp_path) -> Path:
    """A user's folder holding a copy of the plug-in template, and nothing else."""
    folder = tmp_path / "experiments"
    folder.mkdir()
    shutil.copy(TEMPLATE, folder / "fedavg_clip.py")
    return folder


def _completed(out: Path, result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["algorithm"] == "fedavg_clip"
    return summary


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
def test_a_plugin_runs_through_the_simulation_engines_workers(user_folder):
    out = user_folder / "out"
    result = _flrep(["run", "quickstart", *RUN, "rounds=2", "data.num_clients=6", "train.fraction=1.0",
                     "simulation.client_cpus=1", "--out", str(out)], user_folder, timeout=600)
    _completed(out, result)
    trains = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trains = [r for r in trains if r["phase"] == "train"]
    assert [r["round"] for r in trains] == [1, 2] and all(r["failed_clients"] == [] for r in trains)
    assert "clip" in (out / "config.yaml").read_text()


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
def test_a_plugin_runs_on_real_supernodes(user_folder):
    out = user_folder / "out"
    result = _flrep(["deploy", "--nodes", "2", "quickstart", *RUN, "rounds=1", "train.fraction=1.0",
                     "--out", str(out)], user_folder, timeout=600)
    _completed(out, result)


PROBE = """
from flwr.app import ConfigRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from strategies import ALGORITHMS, Algorithm, register
from strategies.base import TAKE_ALL_NODES, ServerHooks, all_keys
from strategies.common import CONFIG, METRICS, reply
from strategies.flower_compat import messages_to


class ProbedFedAvg(ServerHooks, FedAvg):
    def __init__(self):
        super().__init__(**TAKE_ALL_NODES)
        self.answers, self.failed, self.expected = {}, {}, {}

    def on_start(self, services):
        record = RecordDict({CONFIG: ConfigRecord({"variant": services.cfg.label})})
        replies, self.failed = services.send(messages_to(record, services.nodes(services.trainable), "query.trainsize"),
                                             "probe")
        self.answers = {str(int(r.content[METRICS]["pid"])): int(r.content[METRICS]["n"]) for r in replies}
        self.expected = {str(pid): n for pid, n in services.train_sizes.items()}

    def summary_extra(self, records):
        return {"probe_answers": self.answers, "probe_failed": {str(k): v for k, v in self.failed.items()},
                "probe_expected": self.expected}


def train_size(rt, content):
    return reply(None, pid=rt.partition_id, n=len(rt.train))


register(Algorithm(name="fedavg_probe", description="FedAvg that asks each client its training size first",
                   make_strategy=lambda cfg: ProbedFedAvg(), shared_keys=all_keys,
                   handlers={"train": ALGORITHMS["fedavg"].handlers["train"], "query.trainsize": train_size}))
"""


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
def test_a_plugins_query_handler_answers_on_real_supernodes(user_folder):
    """A SuperNode's ClientApp process imports the app before it reads the run's configuration,
    so before the plug-in: the plug-in's ``query.trainsize`` must still be routed to its handler."""
    (user_folder / "fedavg_probe.py").write_text(PROBE)
    out = user_folder / "out"
    result = _flrep(["deploy", "--nodes", "2", "quickstart", "plugins=[fedavg_probe]", "algorithm=fedavg_probe",
                     "compare=[]", "wandb.enabled=false", "eval.final_window=1", "rounds=1", "train.fraction=1.0",
                     "--out", str(out)], user_folder, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["probe_failed"] == {}
    assert sorted(summary["probe_answers"]) == ["0", "1"]
    assert summary["probe_answers"] == summary["probe_expected"]


def test_a_plugin_that_cannot_be_imported_stops_the_run_before_start_up(user_folder):
    out = user_folder / "out"
    start = time.monotonic()
    result = _flrep(["run", "quickstart", "plugins=[fedavg_clipp]", "algorithm=fedavg_clip", "--out", str(out)],
                    user_folder, timeout=120)
    assert result.returncode == 2 and "plugins: cannot import 'fedavg_clipp'" in result.stderr, result.stderr
    assert time.monotonic() - start < 60 and not out.exists()


@pytest.mark.injects_faults
def test_a_plugin_that_fails_only_in_the_workers_is_named_in_a_short_log_and_blocks_no_rerun(user_folder):
    from flower_app.run import run_dir

    (user_folder / "workerfail.py").write_text(
        "import sys\nif 'default_worker' in sys.argv[0]:  # a Ray worker\n"
        "    raise ImportError('workerfail needs a library this worker lacks')\n")
    out = user_folder / "out"
    result = _flrep(["run", "quickstart", "plugins=[workerfail]", "compare=[]", "rounds=2", "data.num_clients=4",
                     "wandb.enabled=false", "--out", str(out)], user_folder, timeout=300)
    said = result.stdout + result.stderr
    assert result.returncode == 2, said[-3000:]
    assert "plugins: cannot import 'workerfail' (ImportError: workerfail needs a library this worker lacks)" in said
    assert len(said.splitlines()) < 50 and "Traceback" not in said and "\x1b" not in said, said[-3000:]
    run_dir.claim(out)  # nothing of a run that did no round blocks the next one


def test_an_installed_packages_entry_point_is_loaded_without_the_key(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "flrep_clip_plugin-0.1.dist-info").mkdir(parents=True)
    (site / "flrep_clip_plugin-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: flrep-clip-plugin\nVersion: 0.1\n")
    (site / "flrep_clip_plugin-0.1.dist-info" / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nfedavg_clip = fedavg_clip_installed\n")
    shutil.copy(TEMPLATE, site / "fedavg_clip_installed.py")
    monkeypatch.syspath_prepend(str(site))
    try:
        cfg = load_config("quickstart", ["algorithm=fedavg_clip", "clip.max_norm=0.2"])
        assert cfg.algorithm == "fedavg_clip" and cfg.clip.max_norm == 0.2 and cfg.plugins == []
    finally:
        ALGORITHMS.pop("fedavg_clip", None)
        sys.modules.pop("fedavg_clip_installed", None)


def test_a_broken_entry_point_is_named(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "broken_plugin-0.1.dist-info").mkdir(parents=True)
    (site / "broken_plugin-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (site / "broken_plugin-0.1.dist-info" / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nbroken = no_such_module\n")
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(ConfigError, match="entry point broken = 'no_such_module'.*package broken-plugin"):
        load_config("quickstart")


def test_the_plugins_key_takes_a_list_of_module_names():
    with pytest.raises(ConfigError, match=r"plugins: got 3, expected a list of module names"):
        load_config("quickstart", ["plugins=3"])
