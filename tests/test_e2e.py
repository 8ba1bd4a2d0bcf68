"""End-to-end runs of the Flower app in the simulation engine through the `flrep` command."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from flower_app.tools.deploy import free_port
from tests.terminal_signals import as_in_a_terminal

SUMMARY_KEYS = {
    "algorithm", "dataset", "num_clients", "rounds", "personalized_accuracy", "personalized_accuracy_std",
    "personalized_accuracy_worst10", "global_accuracy", "bytes_up", "bytes_down", "wall_time_s", "seed",
}


def flrep_run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "flower_app.cli", "run", *args],
                          capture_output=True, text=True, timeout=timeout)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quickstart")
    proc = flrep_run("quickstart", "algorithm=fedavg", "compare=[]", "rounds=4", "eval.final_window=2",
                     "finetune.enabled=true", "finetune.epochs=3", "wandb.enabled=true", "--out", str(out))
    return proc, out


def test_quickstart_writes_the_results_contract(quickstart_run):
    proc, out = quickstart_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["algorithm"] == "fedavg" and summary["dataset"] == "digits"
    assert summary["num_clients"] == 20 and summary["rounds"] == 4 and summary["status"] == "completed"
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["round"] for r in records if r["phase"] == "train"] == [1, 2, 3, 4]
    evals = [r for r in records if r["phase"] == "eval"]
    assert len(evals[-1]["client_accuracy"]) == 20
    # headline = mean of the final window (rounds 3 and 4), not the best round
    expected = (evals[-1]["personalized_accuracy"] + evals[-2]["personalized_accuracy"]) / 2
    assert summary["personalized_accuracy"] == pytest.approx(expected)
    assert summary["final_window_rounds"] == [3, 4]
    assert summary["global_accuracy_best"] == max(r["global_accuracy"] for r in evals)
    assert summary["global_accuracy_last"] == evals[-1]["global_accuracy"]
    assert "(mean of rounds 3-4 (2 evaluations))" in proc.stdout + proc.stderr  # the real window, in words
    # communication counted from the messages: 5 clients x 4 rounds, model down and up
    params = 64 * 64 + 64 + 64 * 10 + 10
    train_records = [r for r in records if r["phase"] == "train"]
    assert train_records[-1]["params_up"] == 4 * 5 * params
    finetune = [r for r in records if r["phase"] == "finetune"]
    assert finetune and summary["finetune_accuracy_after"] is not None
    assert (out / "config.yaml").is_file()
    assert {p.name for p in (out / "plots").glob("*.png")} == {"accuracy.png", "client_spread.png", "partition.png"}
    assert list((out / "wandb").glob("offline-run-*")), "wandb should log offline by default"


def test_quickstart_logs_progress_with_eta_and_output_path(quickstart_run):
    proc, out = quickstart_run
    log = proc.stdout + proc.stderr
    assert "round 4/4" in log and "personalized acc" in log and "global acc" in log and "ETA" in log
    # the output path is the run's last word (Ray's own shutdown warnings may still follow it)
    assert str(out) in [line for line in log.splitlines() if "[flrep]" in line][-1]


def test_local_only_runs_without_a_global_model(tmp_path):
    proc = flrep_run("quickstart", "algorithm=local_only", "local_only.clients=all", "compare=[]", "rounds=2",
                     "eval.final_window=1",
                     "new_test.enabled=true",
                     "wandb.enabled=false", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["global_accuracy"] is None
    # nothing goes down; each client's model goes up once, for the New Test ensemble
    assert summary["bytes_down"] == 0 and summary["params_up"] == 20 * (64 * 64 + 64 + 64 * 10 + 10)
    # the numbers of this seed (the same in-process): each client's own model, then New Test's ensemble of them
    assert summary["personalized_accuracy"] == pytest.approx(0.9736, abs=0.01)
    assert summary["new_test_accuracy"] == pytest.approx(0.3622, abs=0.01)


def test_a_run_starts_its_own_ray_where_ray_start_left_the_address_of_a_gone_cluster():
    """``ray start`` writes its cluster's address to Ray's temp folder and a killed cluster leaves it
    there; ``ray.init()`` joins that address, so a run without ``simulation.ray_address`` used to
    wait for ever on a cluster that is gone."""
    gone = f"127.0.0.1:{free_port()}"
    ray_tmp = Path(tempfile.mkdtemp(prefix="flrep-rt-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    try:
        (ray_tmp / "ray").mkdir()
        (ray_tmp / "ray" / "ray_current_cluster").write_text(gone)
        out = ray_tmp / "run"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        proc = subprocess.run([sys.executable, "-m", "flower_app.cli", "run", "quickstart", "algorithm=local_only",
                               "local_only.clients=all", "rounds=2", "compare=[]",
                               "wandb.enabled=false", "--out", str(out)], env=dict(env, RAY_TMPDIR=str(ray_tmp)),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads((out / "summary.json").read_text())["status"] == "completed"
        assert "Failed to connect to GCS" not in proc.stderr
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_a_crashing_server_app_exits_non_zero(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "plots").write_text("")  # passes every start-up check; the ServerApp crashes writing its plots
    proc = flrep_run("quickstart", "rounds=1", "wandb.enabled=false", "--out", str(out))
    assert proc.returncode != 0
    assert "run failed" in proc.stderr


def test_same_seed_repeats_the_run(quickstart_run, tmp_path):
    _, first = quickstart_run
    proc = flrep_run("quickstart", "algorithm=fedavg", "compare=[]", "rounds=4", "eval.final_window=2",
                     "finetune.enabled=true", "finetune.epochs=3", "wandb.enabled=false", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = [r for r in read_jsonl(first / "metrics.jsonl") if r["phase"] == "eval"]
    b = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["phase"] == "eval"]
    assert [r["client_accuracy"] for r in a] == [r["client_accuracy"] for r in b]
    assert [r["global_loss"] for r in a] == pytest.approx([r["global_loss"] for r in b], rel=1e-5)


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
def test_an_interrupted_simulation_resumes_through_flrep_run(tmp_path):
    args = ["quickstart", "algorithm=fedrep", "compare=[]", "rounds=4", "eval.final_window=2", "wandb.enabled=false"]
    whole = flrep_run(*args, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    cut = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "flower_app.cli", "run", *args, "--out", str(cut)],
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "cut.err").open("w"),
                            preexec_fn=as_in_a_terminal)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and not any(
                r["phase"] == "eval" and r["round"] == 2 for r in _records(cut)):
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # Ctrl-C after round 2
        assert proc.wait(timeout=60) == 130  # promptly, not waiting on the simulation's threads
    finally:
        proc.kill()
    assert not (cut / "summary.json").exists()
    hint = [line.strip() for line in (tmp_path / "cut.err").read_text().splitlines() if line.strip().startswith("flrep run ")]
    assert hint == [shlex.join(["flrep", "run", *args, f"resume={cut}"])]
    resumed = flrep_run(*shlex.split(hint[0])[2:])  # the printed command, as a user would paste it
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout + resumed.stderr
    strip = ("elapsed_s",)
    assert ([{k: v for k, v in r.items() if k not in strip} for r in _records(cut)]
            == [{k: v for k, v in r.items() if k not in strip} for r in _records(tmp_path / "whole")])
    a, b = (json.loads((d / "summary.json").read_text()) for d in (cut, tmp_path / "whole"))
    assert a["personalized_accuracy"] == b["personalized_accuracy"] and a["status"] == "completed"


def _records(out) -> list[dict]:
    path = out / "metrics.jsonl"
    return read_jsonl(path) if path.is_file() else []
