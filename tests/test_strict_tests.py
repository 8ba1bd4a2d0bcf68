"""The test harness itself fails when a client would hurt a user: a crashing client raises into
the test, and a run with failed client replies fails the test that made it."""

import json
import time

import pytest

from flower_app.app.server_app import run_variants
from flower_app.run.config import load_variants
from strategies import ALGORITHMS
from tests.conftest import runs_with_failed_clients
from tests.local_grid import LocalGrid

TINY = "wandb.enabled=false compare=[] data.num_clients=4 train.fraction=1.0 rounds=1 eval.final_window=1"


def test_a_crashing_client_fails_the_test(tmp_path, monkeypatch):
    def crash(rt, content):
        raise RuntimeError("this client crashes")

    monkeypatch.setitem(ALGORITHMS["fedavg"].handlers, "train", crash)
    overrides = f"{TINY} algorithm=fedavg out_dir={tmp_path}"
    with pytest.raises(RuntimeError, match="this client crashes"):
        run_variants(LocalGrid(4, {"experiment": "quickstart", "overrides": overrides}), load_variants("quickstart", overrides))


@pytest.mark.injects_faults  # it writes summaries of failed runs
def test_a_run_with_failed_replies_is_found_and_an_older_or_clean_one_is_not(tmp_path):
    def summary(folder: str, failed: int, skipped: list[int]) -> None:
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "summary.json").write_text(json.dumps({"failed_client_replies": failed,
                                                                    "rounds_skipped": skipped}))

    summary("old/run", 3, [])
    started = time.time() + 1e-3
    time.sleep(0.05)
    summary("clean/run", 0, [])
    summary("crashed/run", 2, [])
    summary("skipped/run", 0, [2])
    found = runs_with_failed_clients(tmp_path, started, {tmp_path / "old"})
    assert sorted(line.split("/")[-3] for line in found) == ["crashed", "skipped"]
