"""Signals the way shells and schedulers send them: SIGINT or SIGTERM to the whole process group
(Ctrl-C, ``timeout``, systemd, Docker, SLURM), to flrep alone, or through a ``timeout`` wrapper.
The command exits 130 (SIGINT) or 143 (SIGTERM) with no traceback and no Ray stack dump, names
what it stopped, prints the command that continues it, and leaves no process behind."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.terminal_signals import as_in_a_terminal
from offline_data import shared

RUN = ["quickstart", "algorithm=fedrep", "compare=[]", "eval.final_window=2", "wandb.enabled=false"]
RAY_DUMP = ("*** SIGTERM received", "*** SIGINT received", "*** Aborted at", "PC: @", "Fatal Python error")


def _start(cmd: list[str], log: Path, marker: str) -> subprocess.Popen:
    """``cmd`` in a session of its own (its PID is its process group's), its stop signals as in a
    terminal, its processes marked."""
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "FLREP_SIGNAL_TEST": marker},
                            preexec_fn=as_in_a_terminal)


def _left_behind(sid: int, marker: str) -> list[str]:
    """The live processes of session ``sid`` or carrying ``marker`` in their environment (Ray's
    processes included, wherever they moved)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            environ = (proc / "environ").read_bytes()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if stat[0] != "Z" and (int(stat[3]) == sid or f"FLREP_SIGNAL_TEST={marker}".encode() in environ):
            found.append(f"{proc.name} [{stat[0]}]: {cmdline[:100]}")
    return found


def _still_alive_after(sid: int, marker: str, seconds: float = 15) -> list[str]:
    """:func:`_left_behind` once they are gone or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while _left_behind(sid, marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _left_behind(sid, marker)


def _kill_all(sid: int, marker: str) -> None:
    """SIGKILL to ``sid`` and to whatever of it is left behind (a failed test leaves nothing running)."""
    for pid in (sid, *(int(line.split()[0]) for line in _left_behind(sid, marker))):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _wait_for_round(proc: subprocess.Popen, out: Path, log: Path, seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while not any(r.get("phase") == "eval" and r.get("round", 0) >= 1 for r in _records(out)):
        assert proc.poll() is None, f"exited {proc.returncode} before round 1:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "round 1 was never written"
        time.sleep(0.2)


def _stop(cmd: list[str], out: Path, tmp_path: Path, sig: int, target: str = "group",
          grace_s: float = 15) -> tuple[str, list[str]]:
    """Start ``cmd``, send ``sig`` after its round 1 (to its process group, or to its own PID) and
    check its exit code and output; its output and the processes still alive ``grace_s`` after its exit."""
    log, marker = tmp_path / "output.log", uuid.uuid4().hex
    proc = _start(cmd, log, marker)
    try:
        _wait_for_round(proc, out, log)
        (os.killpg if target == "group" else os.kill)(proc.pid, sig)
        code = proc.wait(timeout=90)
        left = _still_alive_after(proc.pid, marker, grace_s)
    finally:
        _kill_all(proc.pid, marker)
    text = log.read_text()
    assert code == 128 + sig, text[-3000:]
    assert "Traceback" not in text and not any(dump in text for dump in RAY_DUMP), text[-3000:]
    return text, left


def _resume_line(text: str, command: str) -> str:
    """The one continue command in ``text``."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(f"flrep {command} ")]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


def _flrep(*args: str) -> list[str]:
    return [sys.executable, "-m", "flower_app.cli", *args]


def test_one_stop_per_command_and_a_sigint_ignored_at_start_stays_ignored():
    from flower_app.run.stop_signals import Stopped, stop_requested, stopping_on_signals

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job of a shell
    try:
        with stopping_on_signals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            with pytest.raises(Stopped) as stop:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            assert stop.value.exit_code == 143 and str(stop.value) == "stopped by SIGTERM" and stop_requested()
            os.kill(os.getpid(), signal.SIGHUP)  # a second signal while stopping: ignored
            time.sleep(0.2)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
        with stopping_on_signals():  # a new block clears the stop: later tests' exchanges in this process go on
            pass
    assert not stop_requested()


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_group_signal_stops_flrep_run_cleanly(tmp_path, sig):
    out = tmp_path / "run"
    text, left = _stop(_flrep("run", *RUN, "rounds=60", "--out", str(out)), out, tmp_path, sig)
    assert left == []
    assert f"flrep: run in {out} stopped by {signal.Signals(sig).name}" in text
    assert _resume_line(text, "run") == shlex.join(["flrep", "run", *RUN, "rounds=60", f"resume={out}"])


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
def test_sigterm_to_flrep_alone_and_through_timeout(tmp_path):
    out = tmp_path / "run"
    text, left = _stop(_flrep("run", *RUN, "rounds=60", "--out", str(out)), out, tmp_path, signal.SIGTERM, "pid")
    assert left == [] and _resume_line(text, "run").endswith(f"resume={out}")
    wrapped = tmp_path / "wrapped"  # timeout passes SIGTERM on to its command, then to its own group
    text, left = _stop(["timeout", "3600", *_flrep("run", *RUN, "rounds=60", "--out", str(wrapped))], wrapped,
                       tmp_path, signal.SIGTERM, "pid")
    assert left == [] and _resume_line(text, "run").endswith(f"resume={wrapped}")


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
def test_a_run_stopped_by_a_group_sigterm_resumes_to_the_same_metrics(tmp_path):
    whole = subprocess.run(_flrep("run", *RUN, "rounds=4", "--out", str(tmp_path / "whole")),
                           capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr[-3000:]
    cut = tmp_path / "cut"
    text, _ = _stop(_flrep("run", *RUN, "rounds=4", "--out", str(cut)), cut, tmp_path, signal.SIGTERM)
    assert not (cut / "summary.json").exists()
    resumed = subprocess.run(_flrep(*shlex.split(_resume_line(text, "run"))[1:]), capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    strip = ("elapsed_s",)
    assert ([{k: v for k, v in r.items() if k not in strip} for r in _records(cut)]
            == [{k: v for k, v in r.items() if k not in strip} for r in _records(tmp_path / "whole")])


@pytest.mark.slow
def test_ctrl_c_stops_flrep_deploy_cleanly(tmp_path):
    """(SIGTERM to the group already stopped the deployment, whose processes have sessions of their own.)
    flrep deploy waits for what it started, the ServerApp that Flower's SuperLink starts detached
    included, before it exits: nothing of it is left 2 s later."""
    out = tmp_path / "run"
    cmd = _flrep("deploy", "--nodes", "2", *RUN, "rounds=500", "--out", str(out))
    text, left = _stop(cmd, out, tmp_path, signal.SIGINT, grace_s=2)
    assert left == []
    assert "flrep: deployment stopped by SIGINT" in text
    assert _resume_line(text, "deploy").endswith(f"resume={out}")


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_group_signal_stops_flrep_reproduce_and_its_run(tmp_path, sig):
    shared("adult")  # lg_table4_adult's data
    out = tmp_path / "table"
    cmd = _flrep("reproduce", "lg_table4_adult", "--only", "lg_iid", "--seeds", "0", "--out", str(out))
    text, left = _stop(cmd, out / "runs" / "lg_iid" / "seed0", tmp_path, sig)
    assert left == []
    assert f"[reproduce] interrupted by {signal.Signals(sig).name} during lg_iid/seed0" in text
    assert _resume_line(text, "reproduce") == shlex.join(
        ["flrep", "reproduce", "lg_table4_adult", "--scale", "cpu", "--seeds", "0", "--out", str(out),
         "--only", "lg_iid"])
    record = json.loads((out / "reproduce.json").read_text())["runs"]["lg_iid/seed0"]
    assert record["status"] == "interrupted"
    run_log = (out / "runs" / "lg_iid" / "seed0.log").read_text()
    assert "Traceback" not in run_log and f"stopped by {signal.Signals(sig).name}" in run_log
