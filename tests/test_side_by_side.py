"""``flrep reproduce --jobs N`` and ``flrep tune --jobs N``: runs side by side, each recorded as it
ends, and a stop signal that reaches every run going."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flower_app.cli import main as flrep
from flower_app.reproduction.runner import reproduce
from flower_app.reproduction.tables import load_table
from tests import test_reproduce, test_tune

tiny, tuned = test_reproduce.tiny, test_tune.tuned  # the fixtures of the small tables these tests run


def _out_folder(cmd: list[str]) -> Path:
    return Path(cmd[cmd.index("--out") + 1])


class FakeRuns:
    """``run_child`` stand-in: each run lasts ``seconds``, writes its summary and counts the runs going at once."""

    def __init__(self, seconds: float = 0.4, fail: str | None = None) -> None:
        self.seconds, self.fail, self.going, self.most, self.order = seconds, fail, 0, 0, []
        self.lock = threading.Lock()

    def __call__(self, cmd: list[str], log) -> int:
        folder = _out_folder(cmd)
        with self.lock:
            self.going += 1
            self.most = max(self.most, self.going)
            self.order.append(f"{folder.parent.name}/{folder.name}")
        time.sleep(self.seconds)
        folder.mkdir(parents=True, exist_ok=True)
        failing = self.fail is not None and str(folder).endswith(self.fail)
        accuracy = 0.5 + 0.01 * int(folder.name[-1]) if folder.name[-1].isdigit() else 0.5
        summary = {"status": "failed" if failing else "completed", "personalized_accuracy": accuracy,
                   "validation_accuracy": 0.6 if folder.parent.name.endswith("=0.5") else 0.4}
        (folder / "summary.json").write_text(json.dumps(summary))
        with self.lock:
            self.going -= 1
        return 1 if failing else 0


def test_reproduce_keeps_n_runs_going_and_records_each_as_it_ends(tiny, tmp_path, monkeypatch, capsys):
    from flower_app.reproduction import runner as rep

    runs = FakeRuns(fail="seed1")
    monkeypatch.setattr(rep, "run_child", runs)
    out = tmp_path / "out"
    assert reproduce(load_table("tiny"), "cpu", [0, 1, 2, 3], ["a"], out, jobs=2) == 1  # seed 1 failed
    assert runs.most == 2 and runs.order == ["a/seed0", "a/seed1", "a/seed2", "a/seed3"]
    manifest = json.loads((out / "reproduce.json").read_text())["runs"]
    assert {k: r["status"] for k, r in manifest.items()} == {"a/seed0": "completed", "a/seed1": "failed",
                                                             "a/seed2": "completed", "a/seed3": "completed"}
    assert all(r["wall_s"] >= 0.4 and r["commit"] == "abc1234" for r in manifest.values())
    md = (out / "table.md").read_text()
    assert "51.67" in md  # the mean of seeds 0, 2 and 3 (50, 52, 53): every completed run is in the report
    said = capsys.readouterr()
    assert "run 4/4: a/seed3" in said.out and "a/seed1 failed (exit 1)" in said.err


def test_tune_runs_its_grid_side_by_side_and_chooses_as_one_at_a_time(tuned, tmp_path, monkeypatch):
    from flower_app.reproduction import runner as rep
    from flower_app.reproduction import tune as tuning

    runs = FakeRuns()
    monkeypatch.setattr(rep, "run_child", runs)
    monkeypatch.setattr(tuning, "run_child", runs)
    out = tmp_path / "out"
    assert flrep(["tune", "tiny", "a", "--out", str(out), "--jobs", "2"]) == 0
    assert runs.most == 2
    record = json.loads((out / "tuning" / "a.json").read_text())
    assert record["choice"] == 0.5 and record["mean"] == {"0.05": 0.4, "0.5": 0.6}
    assert all(r["status"] == "completed" and r["wall_s"] >= 0.4 for r in record["runs"].values())


def test_jobs_below_one_is_refused_naming_the_option(tiny, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        flrep(["reproduce", "tiny", "--only", "a", "--jobs", "0", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and "argument --jobs: 0 is not a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


#: ``flrep reproduce tiny --jobs 2`` in another process; each run a child that waits for a signal,
#: writes which one reached it and ends as a stopped run does.
SIDE_BY_SIDE = """
import sys
from pathlib import Path
from flower_app.reproduction import runner, tables
from flower_app.tools import bench_round
from flower_app.cli import main
tables.TABLES_DIR = Path(sys.argv[1])
bench_round.commit = lambda: "abc1234"
CHILD = '''
import os, signal, sys, time
from pathlib import Path
folder = Path(sys.argv[1])
folder.mkdir(parents=True, exist_ok=True)
def stop(signum, frame):
    (folder / "stopped").write_text(str(signum))
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
(folder / "pid").write_text(str(os.getpid()))
while True:
    time.sleep(0.1)
'''
runner.command = lambda table, scale, job, folder, settings=(): [sys.executable, "-c", CHILD, str(folder)]
sys.exit(main(["reproduce", "tiny", "--only", "a", "--seeds", "0", "1", "2", "--jobs", "2", "--out", sys.argv[2]]))
"""


def test_a_stop_signal_reaches_every_run_going_and_each_is_recorded_interrupted(tiny, tmp_path):
    out = tmp_path / "out"
    command = subprocess.Popen([sys.executable, "-c", SIDE_BY_SIDE, str(tiny), str(out)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    pids = [out / "runs" / "a" / f"seed{s}" / "pid" for s in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while not all(p.is_file() and p.read_text() for p in pids):
            assert command.poll() is None and time.monotonic() < deadline, command.communicate()
            time.sleep(0.1)
        command.send_signal(signal.SIGTERM)
        _, err = command.communicate(timeout=120)
    finally:
        command.kill()
    assert command.returncode == 128 + signal.SIGTERM, err
    for seed in (0, 1):  # each run got the signal and ended
        folder = out / "runs" / "a" / f"seed{seed}"
        assert (folder / "stopped").read_text() == str(int(signal.SIGTERM))
        with pytest.raises(ProcessLookupError):
            os.kill(int((folder / "pid").read_text()), 0)
    assert not (out / "runs" / "a" / "seed2").exists()  # two at once: the third never started
    manifest = json.loads((out / "reproduce.json").read_text())["runs"]
    assert {k: r["status"] for k, r in manifest.items()} == {"a/seed0": "interrupted", "a/seed1": "interrupted"}
    assert "interrupted by SIGTERM during a/seed0" in err and "interrupted by SIGTERM during a/seed1" in err
    assert "--jobs 2" in err.split("continue it with:")[1]
