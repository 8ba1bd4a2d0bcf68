"""A full disk loses nothing and says so: every write is whole or absent, no temporary file is
left, a result that cannot be written makes the run failed naming the file, and the run
resumes once there is room again (injected ``ENOSPC``, and a real 3 MB tmpfs where allowed)."""

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from matplotlib.figure import Figure
from omegaconf import OmegaConf

from flower_app.app import checkpoint
from flower_app.results.comparison import write_comparison
from flower_app.results.contract import RunRecorder
from flower_app.run.run_dir import write_atomic
from task.files import WriteFailed

EVALS = [{"round": t, "phase": "eval", "personalized_accuracy": 0.5, "client_accuracy": {"0": 0.5}} for t in (1, 2)]


def full_disk() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def files_in(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_a_metrics_line_is_whole_or_absent(tmp_path, monkeypatch):
    recorder = RunRecorder(tmp_path, OmegaConf.create({}))
    recorder.log(EVALS[0])
    before = (tmp_path / "metrics.jsonl").read_bytes()
    real_write = os.write

    def half_then_full(fd: int, data) -> int:  # the disk takes part of the line, then is full
        if len(data) > 8:
            return real_write(fd, bytes(data)[:len(data) // 2])
        raise full_disk()

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(WriteFailed, match=f"^no space left on {tmp_path / 'metrics.jsonl'}$"):
        recorder.log(EVALS[1])
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_bytes() == before  # no torn line
    assert recorder.records == [EVALS[0]]  # the records are what the file holds
    recorder.log(EVALS[1])
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == EVALS


def test_an_atomic_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old\n")

    def half_then_full(tmp: Path) -> None:
        tmp.write_text("ha")
        raise full_disk()

    with pytest.raises(WriteFailed, match=f"^no space left on {path}$"):
        write_atomic(path, half_then_full)
    assert files_in(tmp_path) == ["summary.json"] and path.read_text() == "old\n"


def test_a_checkpoint_that_does_not_fit_names_its_file_and_leaves_no_temporary_one(tmp_path, monkeypatch):
    def torch_on_a_full_disk(obj, f) -> None:  # as torch's writer reports a full disk: its own RuntimeError
        fh = open(f, "wb") if isinstance(f, (str, Path)) else f
        try:
            fh.write(b"PK" * 100)
            raise full_disk()
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
        finally:
            if fh is not f:
                fh.close()

    checkpoint.save(tmp_path, {"round": 1})
    saved = (tmp_path / "checkpoint" / "server.pt").read_bytes()
    monkeypatch.setattr(torch, "save", torch_on_a_full_disk)
    with pytest.raises(WriteFailed, match=f"^no space left on {tmp_path / 'checkpoint' / 'server.pt'}$"):
        checkpoint.save(tmp_path, {"round": 2})
    assert files_in(tmp_path) == ["checkpoint/server.pt"]
    assert (tmp_path / "checkpoint" / "server.pt").read_bytes() == saved


def savefig_on_a_full_disk(monkeypatch) -> None:
    def savefig(self, fname, **kwargs) -> None:
        Path(fname).write_bytes(b"\x89PNG")
        raise full_disk()

    monkeypatch.setattr(Figure, "savefig", savefig)


def test_a_plot_that_cannot_be_written_fails_the_run_naming_it(tmp_path, monkeypatch):
    recorder = RunRecorder(tmp_path, OmegaConf.create({}), EVALS)
    savefig_on_a_full_disk(monkeypatch)
    with pytest.raises(WriteFailed):
        recorder.finish({"status": "completed", "personalized_accuracy": 0.5}, "run")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["failure_reason"] == f"no space left on {tmp_path / 'plots' / 'accuracy.png'}"
    assert files_in(tmp_path) == ["config.yaml", "metrics.jsonl", "summary.json"]


def test_a_comparison_plot_that_cannot_be_written_fails_the_comparison(tmp_path, monkeypatch):
    summaries = {label: {"status": "completed", "algorithm": label, "personalized_accuracy": 0.5}
                 for label in ("fedrep", "fedavg")}
    savefig_on_a_full_disk(monkeypatch)
    with pytest.raises(WriteFailed):
        write_comparison(tmp_path, summaries, {label: EVALS for label in summaries}, "two")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["failure_reason"] == f"no space left on {tmp_path / 'plots' / 'comparison.png'}"
    assert files_in(tmp_path) == ["comparison.md", "summary.json"]



ARGS = ["quickstart", "algorithm=fedrep", "compare=[]", "data.num_clients=4", "rounds=4", "eval.final_window=2",
        "fedrep.head_epochs=1", "wandb.enabled=false"]
TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{8}")  # run_dir.write_atomic's temporary files
LEFT_FREE = 100_000  # bytes: room for the start and a round or two of checkpoints, not for the whole run


def flrep_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flower_app.cli", "run", *args],
                          capture_output=True, text=True, timeout=600)


def records(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs (mounting needs root with CAP_SYS_ADMIN: skipped elsewhere), unmounted after."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)],
                               capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command on this machine")
    if mount.returncode != 0:
        pytest.skip(f"a tmpfs cannot be mounted here (needs root with CAP_SYS_ADMIN): {mount.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.slow
def test_a_run_on_a_full_disk_stops_cleanly_and_resumes(tmp_path, small_disk):
    whole = flrep_run(*ARGS, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize - LEFT_FREE))
    out = small_disk / "run"
    cut = flrep_run(*ARGS, "--out", str(out))
    said = cut.stdout + cut.stderr
    (tmp_path / "cut.log").write_text(said)
    assert cut.returncode == 1, said[-3000:]
    assert f"no space left on {out}/" in said and "unexpected pos" not in said and "Traceback" not in said, said[-3000:]
    assert (out / "metrics.jsonl").read_bytes().endswith(b"\n") and records(out)  # whole lines only
    assert not [p for p in out.rglob("*") if p.suffix in (".tmp", ".restoring") or TEMPORARY.match(p.name)]
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else None
    assert summary is None or (summary["status"] == "failed"
                               and summary["failure_reason"].startswith(f"no space left on {out}/"))
    filler.unlink()
    resumed = flrep_run(*ARGS, f"resume={out}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert records(out) == records(tmp_path / "whole")
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"


def _filled(disk: Path) -> None:
    with open(disk / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass


@pytest.mark.parametrize("command", [["run", *ARGS, "--out"], ["reproduce", "lg_table4_adult", "--only", "lg_iid",
                                                                  "--seeds", "0", "--out"]], ids=["run", "reproduce"])
def test_a_full_disk_at_the_start_is_one_line_exit_2_and_nothing_made(small_disk, command):
    _filled(small_disk)
    before = files_in(small_disk)
    out = small_disk / "new" / "out"
    done = subprocess.run([sys.executable, "-m", "flower_app.cli", *command, str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    said = (done.stdout + done.stderr).strip().splitlines()
    assert len(said) == 1 and f"no space left on the disk of {out}" in said[0], said
    assert files_in(small_disk) == before and not (small_disk / "new").exists()


def test_a_disk_that_fills_while_the_lock_is_taken_leaves_nothing(tmp_path, monkeypatch):
    from flower_app.run import run_lock

    def full(fd: int, data) -> int:
        raise full_disk()

    monkeypatch.setattr(run_lock.os, "write", full)
    with pytest.raises(run_lock.NoRoom, match=f"^no space left on the disk of {tmp_path / 'a' / 'b'}: "):
        run_lock.acquire(tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_on_a_disk_with_no_room_is_refused_before_anything_is_made(tmp_path, monkeypatch):
    from flower_app.run import run_lock

    real = os.statvfs
    monkeypatch.setattr(run_lock.os, "statvfs", lambda p: os.statvfs_result((*real(p)[:4], 0, *real(p)[5:])))
    with pytest.raises(run_lock.NoRoom, match=r"\(0 bytes free; a command needs 64 KiB to start\)"):
        run_lock.acquire(tmp_path / "a")
    assert list(tmp_path.iterdir()) == []
