"""What a user sees and keeps: no Ray line and round lines within 100 columns on a terminal,
result files with the mode the umask allows, plots labelled with what they show, and an
unwritable output folder refused before any data is loaded."""

import fcntl
import importlib
import logging
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from flwr.common.logger import ConsoleHandler
from flwr.supercore.logger import LOGGER_NAME

from flower_app.results import comparison, plots
from flower_app.cli import main as flrep
from flower_app.run.config import load_variants
from flower_app.results.progress import LEVEL_PREFIX_COLUMNS, TERMINAL_COLUMNS, terminal_round_line
from flower_app.app.server_app import run_variants
from tests.local_grid import LocalGrid

ROOT = Path(__file__).resolve().parents[1]
TINY = ["wandb.enabled=false", "data.num_clients=4", "train.fraction=1.0", "rounds=2", "eval.final_window=1",
        "fedrep.head_epochs=1"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def on_a_terminal(argv: list[str], columns: int, timeout: float = 600) -> tuple[int, str]:
    """Run ``argv`` with stdout and stderr on a pseudo-terminal ``columns`` wide: (exit code, output)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=ROOT)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunks.append(os.read(master, 65536))
                except OSError:  # every writer closed the terminal
                    break
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), b"".join(chunks).decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
def test_a_quiet_run_on_a_terminal_shows_no_ray_line_and_round_lines_fit_100_columns(tmp_path):
    code, output = on_a_terminal([sys.executable, "-m", "flower_app.cli", "run", "quickstart", *TINY,
                                  "--out", str(tmp_path / "run")], columns=TERMINAL_COLUMNS)
    assert code == 0, output[-3000:]
    lines = [ANSI.sub("", part) for part in re.split(r"[\r\n]", output)]
    assert not [line for line in lines if "ClientAppActor" in line or "pid=" in line or "(raylet)" in line]
    rounds = [line.rstrip() for line in lines if "[flrep] round " in line]
    assert len(rounds) == 4, rounds  # two rounds of each of the two variants
    assert max(len(line) for line in rounds) <= TERMINAL_COLUMNS, rounds


@pytest.mark.parametrize("verbose", ["0", "1"])
def test_the_clientapps_output_reaches_flrep_only_with_verbose(verbose, monkeypatch):
    from flower_app.run import simulation
    from flower_app.run.console import VERBOSE_ENV

    engine = importlib.import_module("flwr.simulation.run_simulation")  # the module, not its function
    started = {}
    monkeypatch.setenv(VERBOSE_ENV, verbose)
    monkeypatch.setattr(simulation, "_start_ray", started.update)  # run_blocking starts Ray with these arguments
    monkeypatch.setattr(engine, "_run_simulation", lambda **kwargs: None)
    simulation.run_blocking("quickstart", ["rounds=1"], 2, 1.0, 0.0)
    assert started["log_to_driver"] is (verbose == "1")


def test_a_terminal_round_line_fits_100_columns_with_flowers_prefix():
    handler = next(h for h in logging.getLogger(LOGGER_NAME).handlers if isinstance(h, ConsoleHandler))
    colored, handler.colored = handler.colored, False
    try:
        def width(line: str) -> int:
            return len(handler.format(logging.LogRecord(LOGGER_NAME, logging.INFO, __file__, 1, line, (), None)))

        assert width("") == LEVEL_PREFIX_COLUMNS
        train = {"clients": list(range(5)), "train_loss": 0.2345678, "bytes_up": 3e6, "bytes_down": 3e6}
        evaluation = {"personalized_accuracy": 0.88691, "global_accuracy": 0.88221}
        usual = terminal_round_line(30, 30, train, evaluation, 14.7, 0.0)
        assert usual == "[flrep] round 30/30 | loss 0.2346 | acc 0.8869, global 0.8822 | 14.7s, ETA 0.0s"
        worst = terminal_round_line(
            12345, 99999, {"clients": list(range(500)), "asked": 1000, "failed_clients": list(range(999)),
                           "train_loss": 123456.789},
            {"personalized_accuracy": None, "personalized_loss": 1.23456e-7, "representation_distance": 0.123456,
             "global_grad_norm": 9.87654e-5}, 86400 * 3, 86400 * 30)
        assert width(usual) <= TERMINAL_COLUMNS and width(worst) == TERMINAL_COLUMNS and worst.endswith("…")
    finally:
        handler.colored = colored


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_a_finished_runs_files_have_the_mode_the_umask_allows(umask, mode, tmp_path):
    out = tmp_path / "run"
    overrides = " ".join([*TINY, f"out_dir={out}"])
    old = os.umask(umask)
    try:
        run_variants(LocalGrid(4, {"experiment": "quickstart", "overrides": overrides}),
                     load_variants("quickstart", overrides.split()))
    finally:
        os.umask(old)
    files = [p for p in out.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"summary.json", "comparison.md", "comparison.png", "metrics.jsonl", "config.yaml",
            "client_spread.png"} <= names
    assert {str(p.relative_to(out)): oct(p.stat().st_mode & 0o777) for p in files
            if p.stat().st_mode & 0o777 != mode} == {}


def _figures(monkeypatch, module) -> list:
    """The figures ``module`` saves (kept for inspection; nothing is written)."""
    saved = []
    monkeypatch.setattr(module, "save_figure", lambda fig, path: saved.append(fig))
    return saved


def _evals(key: str, values: list[float]) -> list[dict]:
    return [{"phase": "eval", "round": r + 1, key: v} for r, v in enumerate(values)]


def test_the_comparison_plot_is_labelled_with_what_it_shows(monkeypatch, tmp_path):
    saved = _figures(monkeypatch, comparison)
    comparison.plot_comparison({"a": _evals("personalized_accuracy", [0.5, 0.6]),
                                "b": _evals("personalized_accuracy", [0.4, 0.5])}, tmp_path / "c.png", "accuracy")
    comparison.plot_comparison({"a": _evals("personalized_loss", [2.0, 1.0])}, tmp_path / "r.png", "regression")
    assert [fig.axes[0].get_ylabel() for fig in saved] == ["test accuracy", "test loss"]


def test_the_client_histogram_counts_in_whole_clients(monkeypatch, tmp_path):
    saved = _figures(monkeypatch, plots)
    spread = {str(c): acc for c, acc in enumerate([0.1, 0.1, 0.1, 0.5, 0.9])}  # at most 3 clients in a bar
    plots.plot_run([{"phase": "eval", "round": 1, "personalized_accuracy": 0.34, "client_accuracy": spread}],
                   tmp_path, "t")
    histogram = saved[1].axes[1]
    ticks = [t for t in histogram.get_yticks() if histogram.get_ylim()[0] <= t <= histogram.get_ylim()[1]]
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux's /sys, where no file can be made")
@pytest.mark.parametrize("where", ["--out", "out_dir="])
def test_an_output_folder_where_no_file_can_be_made_is_refused_before_the_data_is_loaded(where, monkeypatch, capsys):
    import task.data.federated_data as federated_data

    def no_loading(*args, **kwargs):
        raise AssertionError("the data was loaded before the output folder was checked")

    monkeypatch.setattr(federated_data, "build_federated_data", no_loading)
    target = "/sys/flrep-no-such-run"  # root passes os.access here, yet no file can be made
    argv = ["--out", target] if where == "--out" else [f"out_dir={target}"]
    code = flrep(["run", "quickstart", *TINY, *argv])
    assert code == 2 and "is not writable" in capsys.readouterr().err
