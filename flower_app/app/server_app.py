"""The ServerApp: validates the run's variants, runs each one's round loop, writes the results."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import threading
import time
from logging import ERROR, INFO, WARNING
from pathlib import Path

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.superlink.grid.inmemory_grid import InMemoryGrid
from omegaconf import DictConfig

from flower_app.app import checkpoint

from flower_app.run import console, run_dir, run_lock
from flower_app.results.comparison import comparison_table, write_comparison
from flower_app.run.flat_config import experiment_of, overrides_of
from flower_app.run.config import server_device, shadowed_overrides, validate_with_data, variants_from_run_config
from flower_app.run.smoke import describe_smoke
from flower_app.app.experiment import Experiment
from flower_app.app.outcome import COMMAND_START_ENV, output_dir
from strategies.checks import require
from strategies.state_store import RUN_STATE
from task.errors import ConfigError
from task.files import WriteFailed

app = ServerApp()
#: Set when the ServerApp stopped on a configuration error (logged in one line): the command
#: that started the simulation in this process exits 2.
stopped_by_config_error = threading.Event()
#: Set when the ServerApp's main has returned or raised: the run is over, whatever its ClientApps do.
finished = threading.Event()


def preflight(variants: tuple[DictConfig, ...], force: bool = False) -> Path | None:
    """Every check that needs no federation, before anything is written: config and data,
    the device, and the output directory (a new run needs one that holds no other run; a
    resumed one a readable checkpoint of the same config). With ``force``, after all other
    checks passed, an earlier run in the directory is moved aside; returns where it went."""
    for i, cfg in enumerate(variants):
        try:
            validate_with_data(cfg)
            server_device(cfg)
        except ConfigError as err:  # a compare entry is named as its config errors are
            if i == 0:
                raise
            raise ConfigError(f"compare[{i - 1}] (label={cfg.label}): {err}") from None
    base = output_dir(variants[0])
    moved = None
    if not variants[0].resume:
        if force:
            run_dir.check_writable(base)
            moved = run_dir.move_aside(base)
        run_dir.claim(base)
    else:
        check_resume(variants)
    return moved


def check_resume(variants: tuple[DictConfig, ...]) -> None:
    """``resume=`` continues a run of the same configuration: a readable checkpoint of it (each
    checkpointed variant's, in a comparison)."""
    base = output_dir(variants[0])
    if len(variants) == 1:
        checkpoint.load(base, variants[0])
        return
    require(bool(run_dir.run_files(base)), "resume", f"{str(base)!r} holds no run to continue")
    for cfg in variants:
        folder = base / cfg.label
        if (checkpoint.checkpoint_dir(folder) / checkpoint.SERVER_FILE).is_file():
            checkpoint.load(folder, cfg)


#: Seconds a simulation's SuperNode count must stay unchanged below the run's size to be final.
SETTLE_S = 5.0


def check_simulated_nodes(grid: Grid, num_clients: int, wait_s: float) -> None:
    """In Flower's simulation all SuperNodes register at once, around the ServerApp's start: a count
    that settles below the run's size is a configuration error within seconds (not after
    ``faults.node_wait_s``), before anything is written."""
    if not isinstance(grid, InMemoryGrid):
        return
    start = changed = time.monotonic()
    seen = -1
    while (count := len(list(grid.get_node_ids()))) < num_clients:
        now = time.monotonic()
        if count != seen:
            seen, changed = count, now
        elif (count > 0 and now - changed >= SETTLE_S) or now - start >= wait_s:
            raise ConfigError(f"data.num_clients={num_clients}, but the simulation has {count} SuperNodes: run "
                              f"flwr run . --federation-config \"num-supernodes={num_clients}\" (or flrep run, "
                              f"which starts one per client), or set data.num_clients={count}")
        time.sleep(0.2)


def run_variants(grid: Grid, variants: tuple[DictConfig, ...]) -> dict:
    """Run each variant in turn on the same federation; with several, write the comparison."""
    check_simulated_nodes(grid, int(variants[0].data.num_clients), float(variants[0].faults.node_wait_s))
    summary = _run_each(grid, variants)
    if summary.get("status") == "completed":  # nothing is left to resume: the working files of its clients
        base = output_dir(variants[0])  # and their snapshots go (server.pt stays: `flrep export` reads it)
        for folder in [base, *(base / cfg.label for cfg in variants if len(variants) > 1)]:
            shutil.rmtree(folder / RUN_STATE, ignore_errors=True)
            shutil.rmtree(checkpoint.checkpoint_dir(folder) / checkpoint.CLIENT_SNAPSHOTS, ignore_errors=True)
    return summary


def _run_each(grid: Grid, variants: tuple[DictConfig, ...]) -> dict:
    if len(variants) == 1:
        return Experiment(grid, variants[0]).run()  # it makes preflight's checks itself before writing
    preflight(variants)  # every variant's errors stop the run before the first variant writes anything
    base = output_dir(variants[0])
    summaries, records = {}, {}
    for number, cfg in enumerate(variants, 1):
        later_rounds = sum(int(v.rounds) for v in variants[number:])
        with run_lock.hold(base / cfg.label):  # a variant's folder has one owner too
            cfg = cfg.copy()
            cfg.out_dir = str(base / cfg.label)
            if cfg.resume:  # each variant resumes from its own folder: done, checkpointed, or not started
                done = _completed_variant(base / cfg.label)
                if done is not None:
                    log(INFO, "[flrep] %s completed before the interruption: kept", cfg.label)
                    summaries[cfg.label], records[cfg.label] = done
                    continue
                has_checkpoint = (checkpoint.checkpoint_dir(base / cfg.label) / checkpoint.SERVER_FILE).is_file()
                cfg.resume = str(base / cfg.label) if has_checkpoint else None
                if not has_checkpoint:  # started but never checkpointed: kept aside, started again
                    moved = run_dir.move_aside(base / cfg.label)
                    if moved is not None:
                        log(INFO, "[flrep] %s had no checkpoint: its files moved to %s, starting it again",
                            cfg.label, moved)
            experiment = Experiment(grid, cfg, (number, len(variants), later_rounds))
            summaries[cfg.label] = experiment.run()
            records[cfg.label] = experiment.recorder.records
    summary = write_comparison(base, summaries, records, f"{variants[0].experiment}: {' vs '.join(summaries)}")
    log(INFO, "[flrep] comparison (%s)\n%s", base / "comparison.md", comparison_table(summaries))
    log(INFO, "[flrep] outputs: %s", base)
    return summary


def _completed_variant(out: Path) -> tuple[dict, list[dict]] | None:
    """(summary, records) of a variant that completed in ``out``, else None."""
    path = out / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    if summary.get("status") != "completed":
        return None
    return summary, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Load and validate the configuration(s), then run the experiment."""
    console.configure()
    rc = context.run_config
    try:
        variants = variants_from_run_config(experiment_of(rc), overrides_of(rc))
        if COMMAND_START_ENV not in os.environ:  # flwr run: no flrep command said these at its start
            for line in shadowed_overrides(experiment_of(rc), overrides_of(rc)):
                log(WARNING, "[flrep] %s", line)
            for line in describe_smoke(experiment_of(rc), shlex.split(overrides_of(rc))) if variants[0].smoke else []:
                log(INFO, "[flrep] smoke: %s", line)
        run_variants(grid, variants)
    except ConfigError as err:  # one line, not a traceback: the message names the key and the fix
        log(ERROR, "[flrep] configuration error: %s", err)
        stopped_by_config_error.set()
        raise SystemExit(2) from None
    except WriteFailed as err:  # a full disk: the run said where (and how to continue); no traceback
        log(ERROR, "[flrep] run failed: %s", err)
        raise SystemExit(1) from None
    finally:
        finished.set()
