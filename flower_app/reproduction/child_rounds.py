"""A table's ``flrep run`` child: run it, and report its progress (the round and ETA it writes to its log)."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

from flower_app.reproduction import side_by_side
from flower_app.run.stop_signals import Stopped, stopping_on_signals

#: A round's line in a run's log: its round and ETA (:func:`flower_app.results.progress.round_line`).
ROUND_LINE = re.compile(r"\[flrep\] (round \d+/\d+) .*\| ETA ([\d.]+)s")


def report_rounds(path: str, start: int, ended: threading.Event) -> None:
    """Until ``ended``: the latest round of the run writing ``path`` (from byte ``start``) and its ETA, a line every
    :data:`~flower_app.run.console.PROGRESS_EVERY_S` seconds (the first as soon as a round ends), named by the
    log's folder and name (``<cell>/seed<k>``: runs side by side say which is which)."""
    from flower_app.run import console
    from flower_app.results.progress import clock

    run = f"{Path(path).parent.name}/{Path(path).stem}"
    last_said, latest, said = 0.0, None, None
    with open(path, errors="replace") as fh:
        fh.seek(start)
        while not ended.wait(1.0):
            for line in fh.readlines():
                found = ROUND_LINE.search(line)
                latest = found.groups() if found else latest
            if latest and latest != said and (said is None or time.monotonic() - last_said >= console.PROGRESS_EVERY_S):
                print(f"[reproduce]   {run}: {latest[0]}, ETA {clock(float(latest[1]))}", flush=True)
                last_said, said = time.monotonic(), latest


def run_child(cmd: list[str], log) -> int:
    """Run ``cmd`` (output to ``log``, whose rounds are reported as they end) and return its exit
    code. A stop signal to this process (:mod:`flower_app.run.stop_signals`) is passed on to the
    child (``flrep run`` then stops its engine and workers), which is waited for, killed only if it
    has not stopped within a minute; then :class:`Stopped` goes on."""
    ended = threading.Event()
    log.flush()
    threading.Thread(target=report_rounds, args=(log.name, log.tell(), ended), daemon=True).start()
    with stopping_on_signals():
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        side_by_side.track(child)
        try:
            return child.wait()
        except Stopped as stop:
            if child.poll() is None:
                child.send_signal(stop.signum)
                try:
                    child.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
            raise
        finally:
            side_by_side.untrack(child)
            ended.set()
