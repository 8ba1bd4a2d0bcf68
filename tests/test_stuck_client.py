"""Nothing hangs after the last round (docs/reliability.md): a ClientApp that never answers is
left out after ``faults.reply_timeout_s``, and once the run is over ``flrep run`` exits with the
summary's status (``incomplete``: a partition went unserved) within seconds, stopping Ray and
every process it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from tests.test_signals import _kill_all, _still_alive_after

STUCK = '''
import dataclasses
import time

from strategies import ALGORITHMS, register

fedavg = ALGORITHMS["fedavg"]


def train(rt, content):
    if rt.partition_id == 1:
        time.sleep(10**6)  # never answers
    return fedavg.handlers["train"](rt, content)


register(dataclasses.replace(fedavg, name="stuck", section="fedavg", handlers={**fedavg.handlers, "train": train}))
'''


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
@pytest.mark.injects_faults
def test_a_run_whose_client_never_answers_exits_soon_after_its_last_round_leaving_nothing(tmp_path):
    (tmp_path / "stuckclient.py").write_text(STUCK)
    out, marker = tmp_path / "out", uuid.uuid4().hex
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "FLREP_SIGNAL_TEST": marker}
    cmd = [sys.executable, "-m", "flower_app.cli", "run", "quickstart", "plugins=[stuckclient]", "algorithm=stuck",
           "rounds=1", "compare=[]", "data.num_clients=3", "train.fraction=1.0", "faults.reply_timeout_s=60",
           "wandb.enabled=false", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        said, _ = proc.communicate(timeout=600)
        ended = time.time()
        left = _still_alive_after(proc.pid, marker)
    finally:
        _kill_all(proc.pid, marker)
    assert proc.returncode == 1, said[-3000:]  # partition 1 went unserved: incomplete (faults.allow_unserved)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "incomplete" and summary["unserved_partitions"] == {"1": 1}, said[-3000:]
    train = next(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line)["phase"] == "train")
    assert train["failed_clients"] == [1], train
    assert ended - (out / "summary.json").stat().st_mtime < 30, said[-3000:]
    assert "stopped by SIGTERM" not in said and "resume=" not in said, said[-3000:]
    assert left == []
