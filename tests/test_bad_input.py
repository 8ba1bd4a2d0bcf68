"""Bad input never costs a user a result: each case below fails before round 1 (exit 2, naming
the key or file) and leaves every existing file as it was; a run that learned nothing ends
failed. The finished run they are tried against is a real one (in-process, one round)."""

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, Context, RecordDict
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from flower_app.commands.common import run_outcome as _outcome, summary_stamp as _summary_stamp
from flower_app.cli import main as flrep
from flower_app.run.config import load_config, load_variants, validate_with_data
from flower_app.app.experiment import Experiment
from flower_app.app.server_app import main as server_main
from flower_app.app.server_app import preflight
from task.data.datasets.image_folder import load_image_folder
from task.errors import ConfigError
from tests.local_grid import LocalGrid
from tests.offline_data import shared

TINY = ["wandb.enabled=false", "compare=[]", "data.num_clients=4", "train.fraction=1.0", "rounds=1",
        "eval.final_window=1"]


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> content hash)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished one-round quickstart run directory."""
    out = tmp_path_factory.mktemp("finished") / "run"
    overrides = " ".join([*TINY, f"out_dir={out}"])
    Experiment(LocalGrid(4, {"experiment": "quickstart", "overrides": overrides}),
               load_config("quickstart", overrides.split())).run()
    assert (out / "summary.json").is_file() and (out / "checkpoint" / "server.pt").is_file()
    return out


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = flrep(["run", "quickstart", *TINY, *argv])
    return code, capsys.readouterr().err


def test_a_new_run_refuses_a_directory_holding_another_run(finished, capsys):
    before = tree(finished)
    code, err = run_cli(capsys, "--out", str(finished))
    assert code == 2 and "holds an earlier run" in err and "resume=" in err and "--force" in err
    assert tree(finished) == before


def test_a_refused_resume_changes_nothing(finished, capsys):
    before = tree(finished)
    code, err = run_cli(capsys, "train.lr=0.2", f"resume={finished}")
    assert code == 2 and "train.lr" in err
    assert tree(finished) == before  # summary.json included


def test_resume_without_a_checkpoint_says_so_and_starts_fresh_moving_started_files_aside(tmp_path, capsys):
    from flower_app.cli import parse_args
    from flower_app.commands.common import prepare_run as _prepare

    started = tmp_path / "run"
    started.mkdir()
    (started / "config.yaml").write_text("rounds: 1\n")  # a run stopped after a round, before its first checkpoint
    (started / "metrics.jsonl").write_text('{"round": 1, "phase": "train"}\n')
    before = tree(started)
    overrides, cfg, out = _prepare(parse_args(["run", "quickstart", *TINY, f"resume={started}"]))
    err = capsys.readouterr().err
    assert f"no checkpoint in {started}" in err and "starting fresh" in err
    assert out == started and not cfg.resume and f"out_dir={started}" in overrides
    moved = next(tmp_path.glob("run.old-*"))
    assert f"moved to {moved}" in err and tree(moved) == before  # nothing deleted


def test_resume_of_a_folder_that_does_not_exist_is_refused_naming_it(tmp_path, capsys):
    typo = tmp_path / "rnu"
    code, err = run_cli(capsys, f"resume={typo}")
    assert code == 2 and f"nothing to resume at {typo}" in err and not typo.exists()


def test_resume_with_another_out_names_both_folders(finished, tmp_path, capsys):
    before = tree(finished)
    code, err = run_cli(capsys, f"resume={finished}", "--out", str(tmp_path / "elsewhere"))
    assert code == 2 and f"resume={finished}" in err and f"--out {tmp_path / 'elsewhere'}" in err
    assert tree(finished) == before and not (tmp_path / "elsewhere").exists()


def test_resume_of_a_completed_run_exits_0_at_once_and_rewrites_nothing(finished):
    import subprocess
    import sys

    stamps = {str(p): p.stat().st_mtime_ns for p in [finished, *finished.rglob("*")]}
    before = tree(finished)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "flower_app.cli", "run", "quickstart", *TINY, f"resume={finished}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "already completed" in proc.stdout, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr  # neither its data nor an engine was started (36 s before issue 48)
    assert "data ready" not in log and "simulation engine" not in log and time.monotonic() - start < 60
    assert tree(finished) == before
    assert {str(p): p.stat().st_mtime_ns for p in [finished, *finished.rglob("*")]} == stamps


def test_overrides_may_follow_the_options():
    from flower_app.cli import parse_args

    args = parse_args(["run", "quickstart", "rounds=2", "--out", "x", "resume=x", "seed=1"])
    assert (args.experiment, args.overrides, args.out) == ("quickstart", ["rounds=2", "resume=x", "seed=1"], "x")


def test_a_truncated_checkpoint_is_named(finished, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    server = copy / "checkpoint" / "server.pt"
    server.write_bytes(server.read_bytes()[:100])
    before = tree(copy)
    code, err = run_cli(capsys, f"resume={copy}")
    assert code == 2 and str(server) in err and "cannot be read" in err
    assert tree(copy) == before


def test_force_moves_the_earlier_run_aside_and_deletes_nothing(finished, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    before = tree(copy)
    moved = preflight(load_variants("quickstart", [*TINY, f"out_dir={copy}"]), force=True)
    assert moved is not None and moved.name.startswith("run.old-") and tree(moved) == before
    assert not copy.exists()


def test_an_output_path_that_is_a_file_is_refused(tmp_path, capsys):
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    code, err = run_cli(capsys, "--out", str(target))
    assert code == 2 and "is a file" in err and target.read_text() == "keep me"


def test_an_unwritable_output_directory_is_refused(tmp_path, capsys):
    """A normal user: a directory of mode 0500. Root ignores modes, so as root: /sys/kernel, where
    no file can be made."""
    if os.geteuid() == 0:
        if not Path("/sys/kernel").is_dir():
            pytest.skip("as root the only unwritable directory is Linux's /sys, absent here")
        locked = Path("/sys/kernel")
        code, err = run_cli(capsys, "--out", str(locked / "flrep-run"))
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            code, err = run_cli(capsys, "--out", str(locked / "flrep-run"))
        finally:
            locked.chmod(0o700)
    assert code == 2 and "not writable" in err and not (locked / "flrep-run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_is_a_config_error(tmp_path, capsys):
    code, err = run_cli(capsys, "simulation.device=cuda", "--out", str(tmp_path / "run"))
    assert code == 2 and "simulation.device" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("override", ["train.lr=.inf", "train.momentum=inf", "train.weight_decay=inf",
                                      "train.lr_decay=inf", "train.lr=nan"])
def test_non_finite_numbers_are_refused(override, tmp_path, capsys):
    code, err = run_cli(capsys, override, "--out", str(tmp_path / "run"))
    assert code == 2 and override.split("=")[0] in err and not (tmp_path / "run").exists()


def test_a_head_that_leaves_no_shared_part_is_refused(tmp_path, capsys):
    code, err = run_cli(capsys, "model.head=[fc1,fc2]", "--out", str(tmp_path / "run"))
    assert code == 2 and "model.head" in err and "share no parameters" in err


def test_a_compare_variant_failing_the_model_check_is_named_like_its_config_errors(tmp_path, capsys):
    out = tmp_path / "run"
    code, err = flrep(["run", "quickstart", *[o for o in TINY if not o.startswith("compare")], "--out", str(out),
                       'compare=["label=whole model.head=[fc1,fc2]"]']), capsys.readouterr().err
    assert code == 2 and "compare[0] (label=whole): model.head: " in err and "share no parameters" in err, err
    assert not out.exists()


def test_a_nan_cell_in_the_data_names_the_file_and_line(tmp_path):
    for name in ("adult.data", "adult.test"):
        shutil.copy(shared("adult") / name, tmp_path / name)
    lines = (tmp_path / "adult.data").read_text().splitlines()
    lines[2] = "nan" + lines[2][lines[2].index(","):]
    (tmp_path / "adult.data").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"adult\.data:3: column 'age' is 'nan'; expected a finite number"):
        validate_with_data(load_config("lg_fair_adult", [f"data.root={tmp_path}"]))


def test_an_empty_class_folder_is_named(tmp_path):
    from PIL import Image

    for split in ("train", "test"):
        (tmp_path / split / "cat").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / split / "cat" / "0.png")
    (tmp_path / "train" / "dog").mkdir()
    with pytest.raises(ConfigError, match=r"dog.*has no images"):
        load_image_folder(tmp_path, {}, tmp_path / "cache", None)


def test_a_run_whose_rounds_were_all_skipped_ends_failed(tmp_path):
    overrides = " ".join([*TINY, "rounds=2", f"out_dir={tmp_path}"])
    def nan_loss(content):  # every training reply is rejected
        content["metrics"]["train_loss"] = float("nan")

    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides}, corrupt={p: nan_loss for p in range(4)})
    summary = Experiment(grid, load_config("quickstart", overrides.split())).run()
    assert summary["status"] == "failed" and "2 of 2 training rounds were skipped" in summary["failure_reason"]
    assert _outcome(tmp_path, None) == 1


def test_a_run_stops_once_too_many_rounds_were_skipped_for_it_to_succeed(tmp_path):
    overrides = " ".join([*TINY, "rounds=6", "faults.max_skipped_fraction=0.3", f"out_dir={tmp_path}"])
    def nan_loss(content):  # every training reply is rejected, as a diverged model's are
        content["metrics"]["train_loss"] = float("nan")

    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides}, corrupt={p: nan_loss for p in range(4)})
    summary = Experiment(grid, load_config("quickstart", overrides.split())).run()
    trains = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in trains if r["phase"] == "train"] == [1, 2]  # 2 > 0.3 x 6: rounds 3-6 never ran
    assert summary["status"] == "failed" and "2 of 2 training rounds were skipped" in summary["failure_reason"]
    assert _outcome(tmp_path, None) == 1


def test_a_run_no_better_than_a_constant_prediction_ends_failed(tmp_path):
    overrides = " ".join([*TINY, "algorithm=fedavg", "rounds=2", f"out_dir={tmp_path}"])
    def zero_weights(content):  # the averaged model becomes all zeros: it predicts class 0 for every image
        arrays = content["arrays"]
        for key in list(arrays):
            arrays[key] = Array(np.zeros_like(arrays[key].numpy()))

    grid = LocalGrid(4, {"experiment": "quickstart", "overrides": overrides},
                     corrupt={p: zero_weights for p in range(4)})
    summary = Experiment(grid, load_config("quickstart", overrides.split())).run()
    assert summary["status"] == "failed" and "no better than always predicting the most frequent class" in \
        summary["failure_reason"]
    assert summary["global_accuracy"] <= 0.11 and _outcome(tmp_path, None) == 1


def test_a_stale_summary_is_not_taken_for_the_outcome(finished):
    assert _outcome(finished, None) == 0
    assert _outcome(finished, _summary_stamp(finished)) == 1  # no new summary was written


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path, monkeypatch):
    import flower_app.run.config as config

    (tmp_path / "experiment").mkdir()
    shutil.copy(config.CONF_DIR / "base.yaml", tmp_path / "base.yaml")
    (tmp_path / "experiment" / "broken.yaml").write_text("rounds: 3\ntrain:\n  lr: [0.1,\n")
    monkeypatch.setattr(config, "CONF_DIR", tmp_path)
    with pytest.raises(ConfigError, match=r"broken\.yaml: not valid YAML \(.* at line 4, column 1\)"):
        load_config("broken")


@pytest.mark.parametrize("override", ["rounds=[1,", "rounds={a"])
def test_an_unparsable_override_is_named(override, tmp_path, capsys):
    code, err = run_cli(capsys, override, "--out", str(tmp_path / "run"))
    assert code == 2 and f"override {override!r}" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, key", [("simulation.client_cpus=4096", "simulation.client_cpus"),
                                           ("simulation.client_gpus=64", "simulation.client_gpus")])
def test_client_resources_beyond_the_machine_are_refused(override, key, tmp_path, capsys):
    code, err = run_cli(capsys, override, "--out", str(tmp_path / "run"))
    assert code == 2 and key in err and "this machine has" in err and not (tmp_path / "run").exists()


def test_gpu_shares_beyond_the_machine_are_refused(monkeypatch):
    """Checked with a pretend GPU, so it runs on CPU-only machines too."""
    import torch
    from omegaconf import OmegaConf

    from flower_app.run.simulation import check_resources

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    sim = OmegaConf.create({"client_cpus": 1, "client_gpus": 0.25, "device": "cuda"})
    check_resources(sim)  # four ClientApps share the GPU
    sim.client_gpus = 2.0
    with pytest.raises(ConfigError, match="simulation.client_gpus=2: this machine has 1 CUDA GPU"):
        check_resources(sim)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    sim.client_gpus = 0.0
    with pytest.raises(ConfigError, match="simulation.device=cuda, but torch sees no CUDA GPU"):
        check_resources(sim)


@pytest.mark.parametrize("nodes", ["0", "-1", "x"])
def test_certs_needs_at_least_one_node(nodes, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        flrep(["certs", "--out", str(tmp_path / "keys"), "--nodes", nodes])
    assert info.value.code == 2 and "--nodes" in capsys.readouterr().err and not (tmp_path / "keys").exists()


@pytest.mark.parametrize("command", [["certs", "--nodes", "2"], ["split-data", "quickstart"]])
def test_an_output_under_a_file_is_named_not_a_traceback(command, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("keep me")
    assert flrep([*command, "--out", str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "Traceback" not in err and blocker.read_text() == "keep me"


def test_non_finite_float_data_names_the_split_and_first_sample():
    from types import SimpleNamespace

    import numpy as np

    from task.data.federated_data import check_finite

    x = np.zeros((10_000, 3), np.float32)
    x[5_000, 1] = np.inf
    split = SimpleNamespace(x=x, y=np.zeros(10_000, np.int64))
    clean = SimpleNamespace(x=np.zeros((5, 3), np.float32), y=np.zeros(5, np.int64))
    with pytest.raises(ConfigError, match="the train split's inputs hold NaN or Inf, first at sample 5000"):
        check_finite(SimpleNamespace(train=split, test=clean), "data.name=digits")
    targets = SimpleNamespace(x=clean.x, y=np.array([0.0, 1.0, np.nan, 0.0, 0.0]))
    with pytest.raises(ConfigError, match="the test split's targets hold NaN or Inf, first at sample 2"):
        check_finite(SimpleNamespace(train=clean, test=targets), "data.name=digits")


def test_a_refused_deploy_moves_nothing_aside_even_with_force(finished, tmp_path, capsys):
    before = tree(finished)
    code = flrep(["deploy", "--nodes", "4", "quickstart", *TINY, "--out", str(finished), "--force",
                  "--node-data", str(tmp_path / "missing")])
    assert code == 2 and "--node-data" in capsys.readouterr().err
    assert tree(finished) == before and not list(finished.parent.glob("run.old-*"))


class TwoNodeSimulation(InMemoryGrid):
    """Flower's simulation grid with 2 SuperNodes (Flower's default size) and nothing else."""

    def __init__(self) -> None:  # no link state: only the node ids are asked for
        pass

    def get_node_ids(self):
        return [11, 12]


class LateSimulation(TwoNodeSimulation):
    """Flower's simulation grid whose 20 SuperNodes register a second after the ServerApp starts."""

    def __init__(self) -> None:
        self.ready = time.monotonic() + 1.0

    def get_node_ids(self):
        return list(range(20)) if time.monotonic() >= self.ready else []


def test_supernodes_registering_after_the_serverapp_starts_are_waited_for():
    from flower_app.app.server_app import check_simulated_nodes

    check_simulated_nodes(LateSimulation(), 20, wait_s=30)  # no error: the count was not final yet


def test_too_few_simulated_supernodes_stop_the_serverapp_at_once_in_one_line_writing_nothing(tmp_path, caplog):
    out = tmp_path / "run"
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config={"experiment": "quickstart", "overrides": f"out_dir={out}"})
    start = time.monotonic()
    with pytest.raises(SystemExit) as stop:
        server_main(TwoNodeSimulation(), context)
    assert stop.value.code == 2 and time.monotonic() - start < 20  # not after faults.node_wait_s=30
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and 'num-supernodes=20' in errors[0] and "2 SuperNodes" in errors[0]
    assert not out.exists()
