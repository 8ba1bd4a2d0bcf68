"""Resume: a run interrupted in the middle of a round and resumed from its last checkpoint
ends with exactly the metrics of the same run left alone (server arrays, strategy state,
server-optimizer moments, TCT's stage, client sampling and every client's own state)."""

import json

import pytest
from flwr.app import Message

from flower_app.config import load_config
from flower_app.server_app import Experiment
from task.errors import ConfigError
from tests.local_grid import LocalGrid

BASE = ("wandb.enabled=false compare=[] data.num_clients=6 train.fraction=0.5 rounds=5 eval.every=1 "
        "eval.final_window=2 fedrep.head_epochs=2")
CASES = {
    "scaffold": "algorithm=scaffold",
    "fedrep": "algorithm=fedrep",
    "local_update-adam": "algorithm=local_update local_update.steps=3 server_opt.name=adam server_opt.lr=0.01",
    "fedavg-fedavgm": "algorithm=fedavg server_opt.name=fedavgm server_opt.lr=0.5",
    "lg_fedavg": "algorithm=lg_fedavg lg.fedavg_rounds=2 lg.global_part=[fc2]",
    "tct": "algorithm=tct tct.stage1_rounds=2 tct.features=64 tct.local_steps=2",
}
STOP_ROUND = 4


class InterruptedGrid(LocalGrid):
    """Dies (KeyboardInterrupt) after two clients trained in round ``STOP_ROUND``."""

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        messages = list(messages)
        first = messages[0] if messages else None
        if (first is not None and first.metadata.message_type == "train"
                and int(first.content["config"]["server-round"]) == STOP_ROUND):
            super().send_and_receive(messages[:2])
            raise KeyboardInterrupt
        return super().send_and_receive(messages, timeout=timeout)


def _run(grid_type, overrides: str, **grid_args) -> dict:
    cfg = load_config("quickstart", overrides.split())
    return Experiment(grid_type(6, {"experiment": "quickstart", "overrides": overrides}, **grid_args), cfg).run()


def _metrics(out_dir) -> list[dict]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("elapsed_s", "convexify_seconds", "entk_client_seconds_max",
                                                      "entk_samples_per_s")} for r in records]


@pytest.mark.parametrize("name", list(CASES))
def test_an_interrupted_run_resumes_to_the_same_metrics(tmp_path, name):
    common = f"{BASE} {CASES[name]} client_state.dir={tmp_path / 'state'}"
    whole = _run(LocalGrid, f"{common} out_dir={tmp_path / 'whole'}")
    with pytest.raises(KeyboardInterrupt):
        _run(InterruptedGrid, f"{common} out_dir={tmp_path / 'cut'}", run_id=2, first_node_id=2000)
    resumed = _run(LocalGrid, f"{common} resume={tmp_path / 'cut'}", run_id=3, first_node_id=3000)
    assert _metrics(tmp_path / "cut") == _metrics(tmp_path / "whole")
    for key in ("personalized_accuracy", "global_accuracy", "params_up", "params_down", "failed_client_replies"):
        assert resumed[key] == whole[key], key


def test_resume_refuses_another_config_or_a_missing_checkpoint(tmp_path):
    common = f"{BASE} algorithm=fedavg rounds=2"
    _run(LocalGrid, f"{common} out_dir={tmp_path / 'run'}")
    with pytest.raises(ConfigError, match=r"resume=.*other values of train\.lr"):
        _run(LocalGrid, f"{common} train.lr=0.2 resume={tmp_path / 'run'}")
    with pytest.raises(ConfigError, match=r"resume=.*no checkpoint there"):
        _run(LocalGrid, f"{common} resume={tmp_path / 'elsewhere'}")
