"""``flrep superlink``: finds this user's local SuperLink of ``flwr run .`` with the processes
it started and stops them by PID; a SuperLink started by hand is never touched."""

import subprocess
import sys
import textwrap
import time

import psutil

from flower_app.cli import main as flrep
from flower_app.tools.superlink import local_superlinks

FAKE = textwrap.dedent("""\
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # its SuperExec
    time.sleep(120)
""")


def _start(tmp_path, name: str, *args: str) -> subprocess.Popen:
    script = tmp_path / name / "flower-superlink"
    script.parent.mkdir()
    script.write_text(FAKE)
    return subprocess.Popen([sys.executable, str(script), *args])


def test_the_local_superlink_and_its_children_are_stopped_and_a_hand_started_one_kept(tmp_path, capsys):
    local = _start(tmp_path, "a", "--insecure", "--log-file", str(tmp_path / "local-superlink" / "superlink.log"))
    by_hand = _start(tmp_path, "b", "--insecure")
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not psutil.Process(local.pid).children():
            time.sleep(0.1)
        child = psutil.Process(local.pid).children()[0]
        assert [p.pid for p in local_superlinks()] == [local.pid]
        assert flrep(["superlink"]) == 0
        listed = capsys.readouterr().out
        assert str(local.pid) in listed and str(child.pid) in listed and str(by_hand.pid) not in listed
        assert local.poll() is None  # listing stops nothing
        assert flrep(["superlink", "--stop"]) == 0
        assert "stopped 2 process(es)" in capsys.readouterr().out
        assert local.wait(timeout=15) is not None and not child.is_running()
        assert by_hand.poll() is None
        assert flrep(["superlink"]) == 0 and "no local SuperLink" in capsys.readouterr().out
    finally:
        for proc in (local, by_hand):
            for kid in psutil.Process(proc.pid).children() if proc.poll() is None else []:
                kid.kill()
            proc.kill()


def test_a_finished_run_left_unreaped_is_listed_as_such(tmp_path, capsys):
    script = tmp_path / "x" / "flower-superlink"
    script.parent.mkdir()
    script.write_text(textwrap.dedent("""\
        import subprocess, sys, time
        finished = subprocess.Popen([sys.executable, "-c", "pass"])  # a run that ended; never waited for
        time.sleep(120)
    """))
    link = subprocess.Popen([sys.executable, str(script), "--log-file", str(tmp_path / "local-superlink" / "s.log")])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not [c for c in psutil.Process(link.pid).children()
                                                     if c.status() == psutil.STATUS_ZOMBIE]:
            time.sleep(0.1)
        zombie = psutil.Process(link.pid).children()[0]
        assert flrep(["superlink"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.split()[:1] == [str(zombie.pid)])
        assert "a finished run's process, not yet reaped by Flower's SuperExec" in line
    finally:
        link.kill()
        link.wait()
