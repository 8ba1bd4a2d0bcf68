"""No silent minute: a long exchange or server phase reports its progress (a line every 30 s off
a terminal), and each round of a multi-variant run says the variant's place and the run's ETA."""

import logging

import pytest

from flower_app.app.server_app import run_variants
from flower_app.run import console
from flower_app.run.config import load_variants
from tests.local_grid import LocalGrid


@pytest.fixture
def flrep_lines(monkeypatch):
    """flrep's log lines of the test (Flower's logger does not propagate to pytest's caplog)."""
    from flwr.common.logger import FLOWER_LOGGER

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Keep(level=logging.INFO)
    FLOWER_LOGGER.addHandler(handler)
    yield lines
    FLOWER_LOGGER.removeHandler(handler)


class OneReplyAPull(LocalGrid):
    """Replies arrive one by one, as from clients that finish at different times."""

    def pull_messages(self, message_ids):
        wanted = set(message_ids)
        first = next((i for i in self._waiting if i in wanted), None)
        return [] if first is None else [self._waiting.pop(first)]


def _run(tmp_path, overrides: list[str], grid=LocalGrid) -> None:
    items = ["data.num_clients=8", "rounds=2", "eval.final_window=1", "wandb.enabled=false",
             f"out_dir={tmp_path}", *overrides]
    variants = load_variants("quickstart", items)
    run_variants(grid(8, {"experiment": "quickstart", "overrides": " ".join(items)}), variants)


def test_a_multi_variant_run_shows_each_variants_place_and_the_runs_eta(tmp_path, flrep_lines):
    _run(tmp_path, ["compare=[algorithm=fedavg,algorithm=fedper]"])
    rounds = [line for line in flrep_lines if line.startswith("[flrep] round ")]
    assert len(rounds) == 6
    assert [line.split(" | ")[-1].split(",")[0] for line in rounds] == [
        "variant 1/3", "variant 1/3", "variant 2/3", "variant 2/3", "variant 3/3", "variant 3/3"]
    assert all(", run ETA " in line for line in rounds)


def test_a_single_run_has_no_variant_part(tmp_path, flrep_lines):
    _run(tmp_path, ["compare=[]"])
    rounds = [line for line in flrep_lines if line.startswith("[flrep] round ")]
    assert len(rounds) == 2 and not any("variant" in line for line in rounds)


def test_fine_tuning_and_a_long_exchange_report_progress_off_a_terminal(tmp_path, flrep_lines, monkeypatch):
    from flower_app.app import federation

    monkeypatch.setattr(console, "PROGRESS_EVERY_S", 0.0)  # a line after every pull: as a 30 s wait would
    monkeypatch.setattr(federation, "PULL_INTERVAL_S", 0.0)
    _run(tmp_path, ["compare=[]", "algorithm=fedavg", "finetune.enabled=true", "finetune.epochs=1"], OneReplyAPull)
    finetune = [line.split(" after ")[0] for line in flrep_lines if line.startswith("[flrep] finetune: ")]
    assert finetune == [f"[flrep] finetune: {n}/8" for n in range(1, 8)]


def test_progress_lines_wait_for_the_interval_and_stop_at_the_end(flrep_lines, monkeypatch):
    clock = iter([0.0, 10.0, 31.0, 45.0, 70.0]).__next__
    monkeypatch.setattr(console.time, "monotonic", clock)
    progress = console.Progress("New Test", 10, unit="model")  # starts at 0 s
    for done, _ in zip((2, 5, 7, 10), range(4)):  # at 10, 31, 45 and 70 s
        progress.advance_to(done)
    progress.close()
    assert flrep_lines == ["[flrep] New Test: 5/10 after 31s"]  # not before 30 s, not again until 61 s, not when done
