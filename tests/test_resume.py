"""Resume: a run interrupted in the middle of a round and resumed from its last checkpoint
ends with exactly the metrics of the same run left alone (server arrays, strategy state,
server-optimizer moments, TCT's stage, client sampling and every client's own state)."""

import json

import pytest
from flwr.app import Context, Message, RecordDict

from flower_app.run.config import load_config
from flower_app.run.config import load_variants, variants_from_run_config
from flower_app.app.server_app import Experiment, preflight, run_variants
from strategies.common import ARRAYS
from task.errors import ConfigError
from task.files import load_torch
from tests.local_grid import LocalGrid

BASE = ("wandb.enabled=false compare=[] data.num_clients=6 train.fraction=0.5 rounds=5 eval.every=1 "
        "eval.final_window=2 fedrep.head_epochs=2")
CASES = {
    "scaffold": "algorithm=scaffold",
    "fedrep": "algorithm=fedrep",
    "local_update-adam": "algorithm=local_update local_update.steps=3 server_opt.name=adam server_opt.lr=0.01",
    "fedavg-fedavgm": "algorithm=fedavg server_opt.name=fedavgm server_opt.lr=0.5",
    "lg_fedavg": "algorithm=lg_fedavg lg.fedavg_rounds=2 lg.global_part=[fc2]",
    "lg_fedavg-warm_start_best": ("algorithm=lg_fedavg lg.fedavg_rounds=4 lg.global_part=[fc2] lg.warm_start=best "
                                  "train.lr=0.5 rounds=6"),  # cut in round 4: the best warm-start model comes from the checkpoint
    "lg_fedavg-selection": ("algorithm=lg_fedavg lg.fedavg_rounds=1 lg.global_part=[fc2] rounds=6 train.lr=1.0 "
                            "new_test.enabled=true new_test.models=best"),  # round 3, before the cut, stays selected
    "lg_fedavg-online": ("algorithm=lg_fedavg lg.fedavg_rounds=1 lg.global_part=[fc2] rounds=2 "
                         "data.online_device.enabled=true data.online_device.train_size=100 "
                         "data.online_device.test_size=30 online.rounds=3 online.fraction=0.4"),  # cut in online round 2
    "tct": "algorithm=tct tct.stage1_rounds=2 tct.features=64 tct.local_steps=2 rounds=8",
    "fedavg-local_model_accuracy": "algorithm=fedavg fedavg.local_model_accuracy=true",  # its kept local scores
    "local_only-all_clients": "algorithm=local_only local_only.clients=all",
    "local_from_average": "algorithm=local_from_average",  # the clients' own models
    "ditto": "algorithm=ditto",  # the personal models
    "apfl-adaptive": "algorithm=apfl apfl.adaptive=true",  # the personal models and mixing weights
    "apfl-official": "algorithm=apfl apfl.variant=official apfl.start=received",
    "fed_mtl": "algorithm=fed_mtl mtl.lam1=0.5 mtl.lam2=0.01",  # the server's columns, the clients' models
    "fed_mtl-official": "algorithm=fed_mtl mtl.lam1=0.5 mtl.omega=official mtl.columns=sampled",
    "perfedavg": "algorithm=perfedavg perfedavg.inner_lr=0.01",
    "l2gd": "algorithm=l2gd l2gd.p=0.5 l2gd.alpha=0.03 eval.every=5 seed=4",  # rounds 3-4 aggregate: the average is pending at the cut
    "fedala": "algorithm=fedala",  # the clients' local models and ALA weights (start phases span the cut)
    "fedamp-last_round": "algorithm=fedamp fedamp.peers=last_round",  # the server's store of models and last uploaders
    "fedproto-keep_absent": "algorithm=fedproto fedproto.keep_absent=true",  # the server's prototypes, the clients' models
    "feddbe": "algorithm=feddbe",  # the server's global mean, the clients' bias memories
    "fedrod": "algorithm=fedrod",  # the clients' personal heads
    "fedbn": "algorithm=fedbn model.name=digits_mlp_bn",  # the clients' batch-norm layers
    "pfedme-beta": "algorithm=pfedme pfedme.beta=2",  # the clients' personal models, the server's mixing
    "fedbabu": "algorithm=fedbabu finetune.enabled=true finetune.epochs=2",  # the frozen head, +FT after the cut
}
STOP_ROUND = 4


class InterruptedGrid(LocalGrid):
    """Dies (KeyboardInterrupt) after two clients trained in round ``STOP_ROUND`` (of the
    variant ``stop_variant``, when set)."""

    stop_variant: str | None = None

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        messages = list(messages)
        first = messages[0] if messages else None
        if (first is not None and first.metadata.message_type == "train"
                and int(first.content["config"]["server-round"]) == STOP_ROUND
                and self.stop_variant in (None, first.content["config"]["variant"])):
            super().send_and_receive(messages[:2])
            raise KeyboardInterrupt
        return super().send_and_receive(messages, timeout=timeout)


def _run(grid_type, overrides: str, **grid_args) -> dict:
    cfg = load_config("quickstart", overrides.split())
    return Experiment(grid_type(6, {"experiment": "quickstart", "overrides": overrides}, **grid_args), cfg).run()


def _run_variants(grid: LocalGrid, overrides: str) -> dict:
    return run_variants(grid, variants_from_run_config("quickstart", overrides))


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
    for key in ("official_local_accuracy", "lg_warm_start_round", "local_test_selected", "local_test_selected_round"):
        assert resumed.get(key) == whole.get(key), key


def test_resume_refuses_another_config_or_a_missing_checkpoint(tmp_path):
    common = f"{BASE} algorithm=fedavg rounds=2"
    _run(LocalGrid, f"{common} out_dir={tmp_path / 'run'}")
    with pytest.raises(ConfigError, match=r"resume=.*other values of train\.lr"):
        _run(LocalGrid, f"{common} train.lr=0.2 resume={tmp_path / 'run'}")
    with pytest.raises(ConfigError, match=r"resume=.*no checkpoint there"):
        _run(LocalGrid, f"{common} resume={tmp_path / 'elsewhere'}")


def test_the_same_data_in_another_data_home_is_the_same_run_and_other_data_is_not(tmp_path, monkeypatch):
    """A run made on a machine whose data home differs (a lent GPU, a fresh clone) resumes here and
    still counts in its table; a run on another data file does not."""
    from flower_app.app.checkpoint import config_differences, plain_config

    monkeypatch.setenv("FLREP_DATA", str(tmp_path / "gpu-home"))
    there = plain_config(load_config("fedrep_cifar10_100x2", []))
    monkeypatch.setenv("FLREP_DATA", str(tmp_path / "home"))
    here = load_config("fedrep_cifar10_100x2", [])
    assert there["data"]["root"] != str(here.data.root)
    assert config_differences(there, here) == []
    there["data"]["root"] = str(tmp_path / "home" / "cifar10-jpeg" / "other.tar")
    assert config_differences(there, here) == ["data.root"]


def test_a_checkpoint_written_before_a_key_existed_resumes_at_that_keys_default(tmp_path):
    import torch

    common = f"{BASE} algorithm=fedavg rounds=2 finetune.enabled=true finetune.part=full finetune.epochs=1"
    _run(LocalGrid, f"{common} out_dir={tmp_path / 'run'}")
    path = tmp_path / "run" / "checkpoint" / "server.pt"
    state = load_torch(path)
    del state["config"]["finetune"]["prox_mu"], state["config"]["fedprox"]  # as written before they existed
    torch.save(state, path)
    with pytest.raises(ConfigError, match=r"resume=.*other values of finetune\.prox_mu; "):
        _run(LocalGrid, f"{common} finetune.prox_mu=1 resume={tmp_path / 'run'}")
    assert _run(LocalGrid, f"{common} resume={tmp_path / 'run'}")["status"] == "completed"


RESTART_AFTER = 2
#: Local-only clients that keep the model of their best evaluation for New Test (a high rate makes
#: accuracy fall as well as rise, so a best model from before the restart is still the best after it).
BEST_MODELS = "local_only.clients=all new_test.enabled=true new_test.models=best train.lr=2.0"
#: LG-FedAvg with main_lg.py's selection: partition 1's best local part and candidate, kept before
#: its restart, make the New Test model of the round selected.
LG_SELECTION = "lg.fedavg_rounds=0 lg.global_part=[fc2] new_test.enabled=true new_test.models=best train.lr=2.0"
#: The summary key of the round whose model partition 1 uploads for New Test.
NEW_TEST_ROUND = {"local_only": lambda summary: summary["local_test_best_client_round"]["1"],
                  "lg_fedavg": lambda summary: summary["local_test_selected_round"]}


class RestartingGrid(LocalGrid):
    """The SuperNode of partition 1 restarts after the ``last_message`` of round ``RESTART_AFTER``:
    it comes back with a new node id, an empty ``Context.state`` and the node config ``restarted_config``."""

    def __init__(self, *args, restarted_config: dict, last_message: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.restarted_config = restarted_config
        self.last_message = last_message

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        messages = list(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        if (messages and messages[0].metadata.message_type == self.last_message
                and int(messages[0].content["config"]["server-round"]) == RESTART_AFTER):
            old = self.node_ids[1]
            new = old + 500
            self.node_ids[1] = new
            context = self.contexts.pop(old)
            self.contexts[new] = Context(run_id=context.run_id, node_id=new, node_config=dict(self.restarted_config),
                                         state=RecordDict(), run_config=context.run_config)
        return replies


def _new_test_uploads(grid: LocalGrid) -> dict[int, dict]:
    """The arrays each partition uploaded for New Test, as lists of numbers."""
    return {int(grid.contexts[r.metadata.src_node_id].node_config["partition-id"]):
            {k: v.tolist() for k, v in r.content[ARRAYS].to_torch_state_dict().items()}
            for r in grid.replies if r.metadata.message_type == "query.localpart"}


def _with_state_dirs(grid: LocalGrid, root) -> LocalGrid:
    for pid, node in enumerate(grid.node_ids):
        grid.contexts[node].node_config["state-dir"] = str(root / f"node-{pid}")
    return grid


@pytest.mark.parametrize("algorithm, last_message", [("fedrep", "evaluate"), ("scaffold", "train"), ("ditto", "evaluate"),
                                                     ("apfl apfl.adaptive=true", "evaluate"), ("fed_mtl", "evaluate"),
                                                     (f"local_only {BEST_MODELS}", "evaluate"),
                                                     (f"lg_fedavg {LG_SELECTION}", "query.lgselect")])
def test_a_restarted_supernode_finds_its_state_in_its_state_dir(tmp_path, algorithm, last_message):
    overrides = f"{BASE} algorithm={algorithm} train.fraction=1.0 rounds=4"
    cfg = load_config("quickstart", f"{overrides} out_dir={tmp_path / 'whole'}".split())
    run_config = {"experiment": "quickstart", "overrides": overrides}
    whole_grid = _with_state_dirs(LocalGrid(6, run_config), tmp_path / "whole-nodes")
    whole = Experiment(whole_grid, cfg).run()

    def restarted(name: str, state_dir, client_errors: bool = False) -> tuple[dict, LocalGrid]:
        config = {"partition-id": 1, "num-partitions": 6, "state-dir": str(state_dir)}
        grid = RestartingGrid(6, run_config, restarted_config=config, last_message=last_message,
                              client_errors=client_errors)
        cfg = load_config("quickstart", f"{overrides} out_dir={tmp_path / name}".split())
        return Experiment(_with_state_dirs(grid, tmp_path / f"{name}-nodes"), cfg).run(), grid

    kept, kept_grid = restarted("kept", tmp_path / "kept-nodes" / "node-1")
    assert kept["failed_client_replies"] == 0  # the server adopted the new node before it sent again
    assert _metrics(tmp_path / "kept") == _metrics(tmp_path / "whole")
    assert kept["personalized_accuracy"] == whole["personalized_accuracy"]
    assert len(_new_test_uploads(whole_grid)) == (6 if "new_test.enabled=true" in algorithm else 0)
    assert _new_test_uploads(kept_grid) == _new_test_uploads(whole_grid)  # New Test's models, by value
    # the node came back without its disk: a client that needs its lost state fails its reply
    _, lost_grid = restarted("lost", tmp_path / "empty-disk", client_errors=True)
    assert _metrics(tmp_path / "lost") != _metrics(tmp_path / "whole")
    if "new_test.enabled=true" in algorithm:  # partition 1's best model was kept before its restart
        assert NEW_TEST_ROUND[algorithm.split()[0]](whole) <= RESTART_AFTER
        assert _new_test_uploads(lost_grid)[1] != _new_test_uploads(whole_grid)[1]


@pytest.mark.parametrize("stop_variant", ["fedrep", "fedavg"])
def test_a_comparison_resumes_each_variant_from_its_own_folder(tmp_path, stop_variant):
    """compare=[...]: the variants that completed are kept, the interrupted one resumes and
    the ones not yet started start afresh; the comparison equals the uninterrupted one."""
    common = f"{BASE} compare=[algorithm=fedavg] client_state.dir={tmp_path / 'state'}"
    run_config = {"experiment": "quickstart", "overrides": common}
    whole = _run_variants(LocalGrid(6, run_config), f"{common} out_dir={tmp_path / 'whole'}")
    cut = InterruptedGrid(6, run_config, run_id=2, first_node_id=2000)
    cut.stop_variant = stop_variant
    with pytest.raises(KeyboardInterrupt):
        _run_variants(cut, f"{common} out_dir={tmp_path / 'cut'}")
    resumed = _run_variants(LocalGrid(6, run_config, run_id=3, first_node_id=3000), f"{common} resume={tmp_path / 'cut'}")
    for label in ("fedrep", "fedavg"):
        assert _metrics(tmp_path / "cut" / label) == _metrics(tmp_path / "whole" / label), label
    drop = ("out_dir", "wall_time_s")
    assert ({v: {k: x for k, x in row.items() if k not in drop} for v, row in resumed["comparison"].items()}
            == {v: {k: x for k, x in row.items() if k not in drop} for v, row in whole["comparison"].items()})


def test_a_fresh_run_never_meets_an_old_runs_snapshots(tmp_path):
    """A new run is refused in an old run's folder; moved aside (--force), the old run keeps its
    snapshots and the new one starts without them."""
    common = f"{BASE} algorithm=fedrep rounds=2 out_dir={tmp_path / 'run'}"
    _run(LocalGrid, common)
    stale = tmp_path / "run" / "checkpoint" / "clients" / "client0" / "round000099.pt"
    stale.write_bytes(b"an older run's snapshot")
    with pytest.raises(ConfigError, match="holds an earlier run"):
        _run(LocalGrid, f"{common} train.lr=0.2")
    moved = preflight(load_variants("quickstart", f"{common} train.lr=0.2"), force=True)
    _run(LocalGrid, f"{common} train.lr=0.2")
    assert (moved / stale.relative_to(tmp_path / "run")).read_bytes() == b"an older run's snapshot"
    assert not stale.exists()
    assert (tmp_path / "run" / "checkpoint" / "server.pt").is_file()
