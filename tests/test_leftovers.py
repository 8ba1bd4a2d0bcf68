"""What a run leaves (docs/reliability.md): a simulated run's client state lives in its run
folder and goes when the run completes; ``flrep state`` lists what runs left elsewhere and removes
only what finished or deleted runs left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flower_app.cli import main as flrep
from flower_app.tools.leftovers import IN_USE_S, UNKNOWN_IDLE_S


def _kept(root: Path, name: str, run_folder: Path | None, idle_s: float) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "head.pt").write_bytes(b"x" * 100)
    if run_folder is not None:
        (folder / "owner.json").write_text(json.dumps({"run_folder": str(run_folder)}))
    old = time.time() - idle_s
    for path in [*folder.iterdir(), folder]:
        os.utime(path, (old, old))
    return folder


def _run(folder: Path, status: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"status": status}))
    return folder


def test_state_left_by_finished_or_deleted_runs_is_removed_and_nothing_else(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = tmp_path / "home" / ".cache" / "flrep" / "node-state"
    hour = 3600.0
    finished = _kept(root, "run1-client0", _run(tmp_path / "done", "completed"), hour)
    deleted = _kept(root, "run2-client0", tmp_path / "gone", hour)
    resumable = _kept(root, "run3-client0", _run(tmp_path / "failed", "failed"), hour)
    in_use = _kept(root, "run4-client0", tmp_path / "gone-too", IN_USE_S / 2)
    unknown = _kept(root, "checkpoints/old-run", None, hour)
    stale = _kept(root, "run5-client1", None, UNKNOWN_IDLE_S + hour)
    assert flrep(["state"]) == 0
    listed = capsys.readouterr().out
    assert "3 of them" in listed and "finished" in listed and "resumable" in listed and "in use" in listed
    assert all(f.exists() for f in (finished, deleted, resumable, in_use, unknown, stale))  # listing removes nothing
    assert flrep(["state", "--remove"]) == 0
    assert not finished.exists() and not deleted.exists() and not stale.exists()
    assert resumable.exists() and in_use.exists() and unknown.exists()


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
def test_two_simulated_runs_leave_no_client_state_outside_their_run_folders(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    outs = [tmp_path / "first", tmp_path / "second"]
    for out in outs:
        done = subprocess.run([sys.executable, "-m", "flower_app.cli", "run", "quickstart", "algorithm=fedrep",
                               "rounds=2", "compare=[]", "data.num_clients=3", "train.fraction=1.0",
                               "client_state.disk_above_bytes=0", "wandb.enabled=false", "--out", str(out)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert not (out / "client-state").exists()  # the heads were on disk there while the run went on
    cache = tmp_path / "home" / ".cache" / "flrep"
    assert not (cache / "client-state").exists() and not (cache / "node-state").exists()


def test_a_completed_run_keeps_its_server_checkpoint_and_drops_the_client_snapshots(tmp_path):
    from flower_app.app.server_app import run_variants
    from flower_app.run.config import load_variants
    from tests.local_grid import LocalGrid

    items = ["algorithm=fedrep", "compare=[]", "data.num_clients=4", "train.fraction=1.0", "rounds=2",
             "eval.final_window=1", "wandb.enabled=false", f"out_dir={tmp_path}"]
    seen = []
    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": " ".join(items)})
    original = grid.send_and_receive

    def watching(messages, *, timeout=None):  # the snapshots exist while the run goes
        replies = original(messages, timeout=timeout)
        seen.append(len(list((tmp_path / "checkpoint" / "clients").glob("client*/round*.pt"))))
        return replies

    grid.send_and_receive = watching
    assert run_variants(grid, load_variants("quickstart", items))["status"] == "completed"
    assert max(seen) >= 4  # each client's head, snapshotted
    assert (tmp_path / "checkpoint" / "server.pt").is_file() and not (tmp_path / "checkpoint" / "clients").exists()
