"""One owner per run folder (issue 48): an OS lock on ``<folder>/.flrep.lock`` taken before a
command's first write and held for its life; a second command on the folder is refused at once
(exit 2) naming the folder and the owner's PID. The lock file is no result and leaves with its owner."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flower_app.app import checkpoint

from flower_app.run import run_dir, run_lock
from flower_app.run.run_lock import LOCK_FILE, FolderBusy
from tests.terminal_signals import as_in_a_terminal

ARGS = ["quickstart", "algorithm=fedrep", "compare=[]", "rounds=4", "eval.final_window=2", "wandb.enabled=false"]
BUSY = re.compile(r"is in use by another flrep command \(PID (\d+)\)")


def _owner(folder: Path) -> subprocess.Popen:
    """Another process that owns ``folder`` until it is killed."""
    code = ("import sys, time; from pathlib import Path; from flower_app.run import run_lock; "
            "run_lock.acquire(Path(sys.argv[1])); print('owned', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "owned"
    return proc


def test_a_second_owner_is_refused_naming_the_folder_and_pid_until_the_first_is_killed(tmp_path):
    folder = tmp_path / "run"
    owner = _owner(folder)
    try:
        with pytest.raises(FolderBusy, match=rf"{re.escape(str(folder))} is in use .*\(PID {owner.pid}\)"):
            run_lock.acquire(folder)
    finally:
        owner.kill()
        owner.wait()
    with run_lock.hold(folder):  # the kernel dropped the killed owner's lock; its file is taken over
        assert (folder / LOCK_FILE).read_text().strip() == str(os.getpid())
    assert list(folder.iterdir()) == []


def test_a_refused_command_names_the_new_owner_not_the_killed_one_whose_file_it_took_over(tmp_path):
    """The new owner locks the file a killed owner left, then writes its PID: a command refused in
    between names the new owner, not the dead PID still in the file."""
    folder = tmp_path / "run"
    folder.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (folder / LOCK_FILE).write_text(f"{dead.stdout.strip()}\n")  # as a killed owner leaves it
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
            "print('locked', flush=True); time.sleep(0.5); os.ftruncate(fd, 0); "
            "os.write(fd, f'{os.getpid()}\\n'.encode()); time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", code, str(folder / LOCK_FILE)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "locked"
        with pytest.raises(FolderBusy, match=rf"\(PID {owner.pid}\)"):
            run_lock.acquire(folder)
    finally:
        owner.kill()
        owner.wait()


def test_the_lock_file_is_no_result_and_leaves_with_its_owner(tmp_path):
    folder = tmp_path / "made" / "run"
    with run_lock.hold(folder):
        assert (folder / LOCK_FILE).is_file()
        assert run_dir.run_files(folder) == [] and not checkpoint.resumable(folder)
        run_dir.claim(folder)  # a new run may start beside it
        with run_lock.hold(folder):  # the owner may take it again: still its own
            pass
        assert (folder / LOCK_FILE).is_file()
    assert not (tmp_path / "made").exists()  # the folders the lock made, left empty, went with it


def test_a_run_moved_aside_leaves_the_lock_behind(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("{}\n")
    with run_lock.hold(folder):
        moved = run_dir.move_aside(folder)
        assert [p.name for p in moved.iterdir()] == ["metrics.jsonl"]
        other = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from flower_app.run import "
                                "run_lock; run_lock.acquire(Path(sys.argv[1]))", str(folder)],
                               capture_output=True, text=True)
        assert other.returncode != 0 and f"(PID {os.getpid()})" in other.stderr


# -- real commands ---------------------------------------------------------------------------


def _start(*args: str, err: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flower_app.cli", "run", *args], stdout=subprocess.DEVNULL,
                            stderr=err.open("w"), preexec_fn=as_in_a_terminal)


def _race(tmp_path: Path, name: str, *args: str) -> tuple[int, int, str]:
    """Two copies of ``flrep run args`` started at once: (winner's exit code, its PID, the loser's
    stderr), after checking that the loser exited 2 within seconds, while the winner ran on."""
    procs = [_start(*args, err=tmp_path / f"{name}-{i}.err") for i in range(2)]
    try:
        start = time.monotonic()
        while all(p.poll() is None for p in procs) and time.monotonic() - start < 240:
            time.sleep(0.1)
        losers = [i for i, p in enumerate(procs) if p.poll() is not None]
        assert losers, "neither command ended"
        loser, winner = procs[losers[0]], procs[1 - losers[0]]
        err = (tmp_path / f"{name}-{losers[0]}.err").read_text()
        assert loser.returncode == 2, err[-3000:]
        # at once: before its data or engine, while the winner runs on (a busy 2-core machine
        # takes half a minute to import torch and Flower twice at once)
        assert time.monotonic() - start < 120 and winner.poll() is None
        assert "data ready" not in err and "simulation engine" not in err
        code = winner.wait(timeout=300)
    finally:
        for p in procs:
            p.kill()
    return code, winner.pid, err


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in lines]


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """An uninterrupted run, the winner of two new runs started into its folder at the same instant."""
    tmp = tmp_path_factory.mktemp("race")
    out = tmp / "whole"
    code, pid, err = _race(tmp, "new", *ARGS, "--out", str(out))
    assert code == 0
    assert f"{out} is in use" in err and BUSY.search(err).group(1) == str(pid), err[-3000:]
    return out


def test_the_loser_of_two_new_runs_into_one_folder_exits_2_and_the_winner_completes(whole):
    assert json.loads((whole / "summary.json").read_text())["status"] == "completed"
    assert [r["round"] for r in _records(whole) if r["phase"] == "train"] == [1, 2, 3, 4]
    assert not (whole / LOCK_FILE).exists()


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
def test_two_resumes_of_one_interrupted_run_one_proceeds_the_other_exits_2(whole, tmp_path):
    cut = tmp_path / "cut"
    proc = _start(*ARGS, "--out", str(cut), err=tmp_path / "cut.err")
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and not any(
                r["phase"] == "eval" and r["round"] == 2 for r in _records(cut)):
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # Ctrl-C after round 2
        assert proc.wait(timeout=60) != 0
    finally:
        proc.kill()
    assert not (cut / "summary.json").exists()
    code, pid, err = _race(tmp_path, "resume", *ARGS, f"resume={cut}")
    assert code == 0
    assert f"{cut} is in use" in err and BUSY.search(err).group(1) == str(pid), err[-3000:]
    assert _records(cut) == _records(whole)  # no round twice, none interleaved
    assert json.loads((cut / "summary.json").read_text())["status"] == "completed"
    assert shlex.join(["flrep", "run", *ARGS, f"resume={cut}"]) in (tmp_path / "cut.err").read_text()
