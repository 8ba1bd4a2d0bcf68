"""The local SuperLink that ``flwr run .`` starts detached (with its SuperExec and simulation
processes) and leaves running after the run: find this user's, and stop them by PID.

Flower starts it with ``--log-file ~/.flwr/local-superlink/superlink.log``; that is how it is
told apart from a SuperLink a user started by hand, which is never touched.
"""

from __future__ import annotations

import os

import psutil

#: Part of the command line of the SuperLink that ``flwr run .`` starts for a local run.
LOCAL_MARKER = "local-superlink"


def local_superlinks() -> list[psutil.Process]:
    """This user's local SuperLinks started by ``flwr run .``."""
    found = []
    for proc in psutil.process_iter(["pid", "uids", "cmdline"]):
        try:
            cmdline = proc.info["cmdline"] or []
            mine = proc.info["uids"] is not None and proc.info["uids"].real == os.getuid()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if mine and any(os.path.basename(part) == "flower-superlink" for part in cmdline[:2]) \
                and any(LOCAL_MARKER in part for part in cmdline):
            found.append(proc)
    return found


def with_descendants(link: psutil.Process) -> list[psutil.Process]:
    """``link`` and every process it started (SuperExec, simulation), children first."""
    try:
        family = [*link.children(recursive=True), link]
    except psutil.NoSuchProcess:
        return []
    return [p for p in family if _alive(p)]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def finished_runs(link: psutil.Process) -> list[psutil.Process]:
    """The finished run processes (``flwr-simulation``) under ``link`` that Flower's SuperExec has
    not reaped yet: it starts each run with ``subprocess.Popen`` and keeps no handle, so Python
    reaps a finished one only when the SuperExec starts its next process. They hold no memory."""
    try:
        return [p for p in link.children(recursive=True) if not _alive(p)]
    except psutil.NoSuchProcess:
        return []


def describe(proc: psutil.Process) -> str:
    """``PID  command line`` of a process (shortened)."""
    try:
        return f"{proc.pid:>7}  {' '.join(proc.cmdline())[:150]}"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return f"{proc.pid:>7}  (gone)"


def stop(processes: list[psutil.Process], grace_s: float = 10.0) -> list[int]:
    """SIGTERM ``processes``, SIGKILL those still alive after ``grace_s``; the PIDs that ended."""
    gone, alive = signal_and_wait(processes, "terminate", grace_s)
    gone_late, _ = signal_and_wait(alive, "kill", grace_s)
    return sorted(p.pid for p in [*gone, *gone_late])


def signal_and_wait(processes: list[psutil.Process], method: str, wait_s: float):
    """Call ``method`` (terminate or kill) on each process; (ended, still alive) after at most ``wait_s``."""
    for proc in processes:
        try:
            getattr(proc, method)()
        except psutil.NoSuchProcess:
            pass
    return psutil.wait_procs(processes, timeout=wait_s)
