"""The console: flrep's lines and warnings always, Flower's INFO chatter only with --verbose,
no colour codes when stderr is not a terminal."""

import logging

from flwr.common.logger import ConsoleHandler
from flwr.supercore.logger import LOGGER_NAME

from flower_app.run import console


def _console_handler() -> ConsoleHandler:
    return next(h for h in logging.getLogger(LOGGER_NAME).handlers if isinstance(h, ConsoleHandler))


def _record(level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord(LOGGER_NAME, level, __file__, 1, msg, (), None)


def test_only_flrep_lines_and_warnings_pass_unless_verbose():
    handler = _console_handler()
    flower_info = _record(logging.INFO, "configure_train: Sampled 5 nodes (out of 5)")
    ours = _record(logging.INFO, "[flrep] round 1/2 | train loss 0.5")
    warning = _record(logging.WARNING, "a node failed")
    try:
        console.configure(verbose=False)
        assert not handler.filter(flower_info) and handler.filter(ours) and handler.filter(warning)
        assert "\x1b[" not in handler.format(ours)  # pytest's stderr is not a terminal
        console.configure(verbose=True)
        assert handler.filter(flower_info) and handler.filter(ours)
    finally:
        console.configure(verbose=True)
        handler.colored = True


def test_the_round_bar_is_silent_off_a_terminal():
    bar = console.RoundBar(total=3, done=0)
    assert bar.bar is None
    bar.advance("[flrep] round 1/3 | train loss 0.5 | 5/5 clients replied", "[flrep] round 1/3 | loss 0.5")
    bar.close()



def test_a_coloured_client_error_is_recorded_and_logged_without_colour_codes(tmp_path, caplog):
    from flower_app.app.server_app import Experiment
    from flower_app.run.config import load_config
    from tests.local_grid import LocalGrid

    class ColouredErrors(LocalGrid):  # as Ray words an actor's exception
        fail_reason = "\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=1) partition {pid}: \x1b[1;31mboom\x1b[0m"

    overrides = f"wandb.enabled=false compare=[] data.num_clients=3 train.fraction=1.0 rounds=1 out_dir={tmp_path}"
    grid = ColouredErrors(3, {"experiment": "quickstart", "overrides": overrides}, client_errors=True)
    experiment = Experiment(grid, load_config("quickstart", overrides.split()))
    federation = experiment.start_federation()
    experiment.strategy.prepare_round(1, experiment.services)
    grid.fail = {1}
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        record = experiment.train_round(1, federation)
    assert record["failures"] == {"1": "error: ray::ClientAppActor.run() (pid=1) partition 1: boom"}
    assert "partition 1: boom" in caplog.text and "\x1b" not in caplog.text
