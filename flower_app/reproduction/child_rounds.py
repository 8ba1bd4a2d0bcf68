"""A running cell's progress: the round and ETA of the ``flrep run`` child writing its log."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

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
