"""Real deployments on loopback: flower-superlink + flower-supernode processes running the app
(FedRep for two rounds; a SuperNode killed mid-run), TLS with SuperNode authentication (a
registered key joins, an unregistered one is refused), and the start-up checks."""

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flower_app.tools.certs import load_deployment_keys, make_deployment_keys
from flower_app.app.checkpoint import SERVER_FILE
from flower_app.tools.deploy import LocalDeployment, free_port, wait_for_port
from task.errors import ConfigError
from tests.terminal_signals import as_in_a_terminal

RUN = ["compare=[]", "wandb.enabled=false", "train.fraction=1.0", "eval.final_window=1", "fedrep.head_epochs=2"]


def _records(out) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _summary(out: Path, work: Path) -> dict:
    """The run's summary; without one, the failure shows the end of every deployment log."""
    path = out / "summary.json"
    if not path.is_file():
        tails = "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                          for log in sorted(work.glob("*.log")))
        pytest.fail(f"the run wrote no {path}; the deployment's logs end:\n{tails}")
    return json.loads(path.read_text())


def _start_nodes(deployment: LocalDeployment, nodes: int) -> None:
    deployment.start_superlink()
    for i in range(nodes):
        deployment.start_supernode(i, {"partition-id": i, "num-partitions": nodes})


def _run_in_background_until_round_one_ends(deployment: LocalDeployment, overrides: list[str], out) -> threading.Thread:
    """Start the run on a thread and return once round 1 was evaluated and its checkpoint written (the run
    goes on): the checkpoint comes after the round's records, and a run stopped between them has none to resume."""
    runner = threading.Thread(target=deployment.run, args=("quickstart", overrides), kwargs={"timeout_s": 900})
    runner.start()
    deadline = time.monotonic() + 600  # a bound for a stuck run only: a loaded 2-core machine may take minutes
    while not (any(r["phase"] == "eval" and r["round"] == 1 for r in _records(out))
               and (out / "checkpoint" / SERVER_FILE).is_file()):
        if time.monotonic() > deadline or not runner.is_alive():
            pytest.fail(f"round 1 was not evaluated (run alive: {runner.is_alive()}); records: {_records(out)}")
        time.sleep(0.2)
    return runner


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
def test_fedrep_runs_on_a_superlink_with_three_supernodes(tmp_path):
    out = tmp_path / "out"
    with LocalDeployment(tmp_path / "deployment") as deployment:
        _start_nodes(deployment, 3)
        deployment.run("quickstart", RUN + ["algorithm=fedrep", "rounds=2", "data.num_clients=3", f"out_dir={out}"],
                       timeout_s=900)
        processes = list(deployment.processes.values())
    assert all(p.poll() is not None for p in processes)  # every process it started has stopped
    summary = _summary(out, tmp_path / "deployment")
    assert summary["status"] == "completed" and summary["algorithm"] == "fedrep"
    trains = [r for r in _records(out) if r["phase"] == "train"]
    assert [r["round"] for r in trains] == [1, 2]
    assert all(r["clients"] == [0, 1, 2] and r["failed_clients"] == [] for r in trains)
    assert summary["personalized_accuracy"] > 0.5  # digits, 2 classes per client: heads learn fast


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
@pytest.mark.injects_faults  # a SuperNode is killed mid-run
def test_a_killed_supernode_does_not_end_the_run(tmp_path):
    out = tmp_path / "out"
    with LocalDeployment(tmp_path / "deployment") as deployment:
        _start_nodes(deployment, 3)
        overrides = RUN + ["algorithm=fedavg", "rounds=3", "data.num_clients=3", "faults.reply_timeout_s=60",
                           "faults.allow_unserved=true", f"out_dir={out}"]
        runner = _run_in_background_until_round_one_ends(deployment, overrides, out)
        deployment.stop("supernode-2")  # the node of partition 2 dies after round 1
        runner.join()
    summary = _summary(out, tmp_path / "deployment")
    assert summary["status"] == "completed" and summary["unserved_partitions"].get("2", 0) >= 1
    trains = {r["round"]: r for r in _records(out) if r["phase"] == "train"}
    assert trains[1]["failed_clients"] == []
    assert trains[3]["failed_clients"] == [2] and "skipped" not in trains[3]
    assert summary["failed_client_replies"] >= 2
    assert summary["rounds_skipped"] == []


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
@pytest.mark.injects_faults  # a SuperNode goes down mid-run
def test_a_restarted_supernode_rejoins_with_the_state_it_kept_on_disk(tmp_path):
    out = tmp_path / "out"
    node = {i: {"partition-id": i, "num-partitions": 3, "state-dir": str(tmp_path / f"node-{i}")} for i in range(3)}
    with LocalDeployment(tmp_path / "deployment") as deployment:
        deployment.start_superlink()
        for i in range(3):
            deployment.start_supernode(i, node[i])
        overrides = RUN + ["algorithm=fedrep", "rounds=3", "data.num_clients=3", "faults.reply_timeout_s=60",
                           "faults.allow_unserved=true", f"out_dir={out}"]
        runner = _run_in_background_until_round_one_ends(deployment, overrides, out)
        deployment.stop("supernode-2")  # partition 2's node goes down after round 1 and comes back
        deployment.start_supernode(2, node[2], name="supernode-2-restarted")
        runner.join()
        restarted_log = (deployment.work / "supernode-2-restarted.log").read_text()
    summary = _summary(out, tmp_path / "deployment")
    assert summary["status"] == "completed"
    trains = {r["round"]: r for r in _records(out) if r["phase"] == "train"}
    assert trains[1]["failed_clients"] == [] and trains[3]["failed_clients"] == []
    assert trains[3]["clients"] == [0, 1, 2]
    assert "client 2: state of round 1 restored" in restarted_log  # its FedRep head, from its state-dir


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
@pytest.mark.injects_faults  # a SuperNode goes down mid-run and another claims a live node's partition
def test_a_supernode_claiming_a_partition_a_live_node_serves_is_refused_and_the_run_is_incomplete(tmp_path):
    out = tmp_path / "out"
    with LocalDeployment(tmp_path / "deployment") as deployment:
        _start_nodes(deployment, 3)
        overrides = RUN + ["algorithm=fedavg", "rounds=4", "data.num_clients=3", "faults.reply_timeout_s=60",
                           f"out_dir={out}"]
        runner = _run_in_background_until_round_one_ends(deployment, overrides, out)
        deployment.stop("supernode-1")  # partition 1's node dies; its restart claims partition 2 by mistake
        deployment.start_supernode(1, {"partition-id": 2, "num-partitions": 3}, name="supernode-1-as-2")
        runner.join()
        run_log = (deployment.work / "run.log").read_text()
    summary = _summary(out, tmp_path / "deployment")
    assert "which node" in run_log and "still serves: refused" in run_log, run_log[-3000:]
    trains = [r for r in _records(out) if r["phase"] == "train"]
    assert all(2 not in r["failed_clients"] for r in trains)  # the live node of partition 2 kept serving it
    assert summary["unserved_partitions"].get("1", 0) >= 1
    assert summary["status"] == "incomplete" and "partition(s) 1 (" in summary["failure_reason"]


def test_an_authenticated_supernode_joins_and_an_unregistered_key_is_refused(tmp_path):
    keys = make_deployment_keys(tmp_path / "keys", 2)
    with LocalDeployment(tmp_path / "deployment", keys) as deployment:
        deployment.start_superlink()
        registered = deployment.register(keys.node_keys[0][1])
        deployment.start_supernode(0, {"partition-id": 0}, keys.node_keys[0][0])
        stranger = deployment.start_supernode(1, {"partition-id": 1}, keys.node_keys[1][0])
        assert stranger.wait(timeout=60) != 0
        refused = (deployment.work / "supernode-1.log").read_text()
        assert "Failed to activate SuperNode" in refused
        joined_log = deployment.work / "supernode-0.log"
        deadline = time.monotonic() + 60
        while f"SuperNode ID: {registered}" not in joined_log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert f"SuperNode ID: {registered}" in joined_log.read_text()
        assert deployment.processes["supernode-0"].poll() is None


def test_deploy_names_missing_node_data_and_keys_before_starting_anything(tmp_path, capsys):
    from flower_app.cli import main as flrep

    (tmp_path / "nodes" / "node-0").mkdir(parents=True)
    args = ["deploy", "--nodes", "2", "quickstart", "compare=[]", "--out", str(tmp_path / "out")]
    assert flrep(args + ["--node-data", str(tmp_path / "nodes")]) == 2
    assert "--node-data: no node folder" in capsys.readouterr().err
    assert flrep(args + ["--tls", str(tmp_path / "no-keys")]) == 2
    assert "TLS files missing" in capsys.readouterr().err
    assert not (tmp_path / "out" / "deployment").exists()  # no process was started


def test_missing_certificates_and_an_unreachable_superlink_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"TLS files missing: .*ca\.crt"):
        load_deployment_keys(tmp_path / "nowhere", 2)
    keys = make_deployment_keys(tmp_path / "keys", 1)
    keys.server_key.unlink()
    with pytest.raises(ConfigError, match=r"ssl-keyfile: .*server\.key does not exist"):
        LocalDeployment(tmp_path / "deployment", keys)
    with pytest.raises(ConfigError, match=r"the SuperLink at 127\.0\.0\.1:\d+ is unreachable"):
        wait_for_port(f"127.0.0.1:{free_port()}", 1.0, "the SuperLink")


def test_ports_are_free_and_outside_the_ephemeral_range():
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(20)]
    assert all(p < low or (low <= 10000 and p <= high) for p in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises if taken


def test_a_supernode_that_cannot_start_is_named_before_the_run_is_submitted(tmp_path, monkeypatch):
    with socket.socket() as taken, LocalDeployment(tmp_path / "deployment") as deployment:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: the SuperNode cannot bind it
        deployment.start_superlink()
        monkeypatch.setattr("flower_app.tools.deploy.free_port", lambda: taken.getsockname()[1])
        deployment.start_supernode(0, {"partition-id": 0, "num-partitions": 1})
        with pytest.raises(RuntimeError, match=r"supernode-0 exited with status 1; its log ends:"):
            deployment.run("quickstart", RUN + ["data.num_clients=1", f"out_dir={tmp_path / 'out'}"], timeout_s=60)
        assert "run" not in deployment.processes  # nothing was submitted
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_deployment_stopped_mid_run_resumes_to_the_same_metrics(tmp_path):
    overrides = RUN + ["algorithm=fedrep", "rounds=3", "data.num_clients=3", "faults.reply_timeout_s=60"]
    with LocalDeployment(tmp_path / "whole-deployment") as deployment:
        _start_nodes(deployment, 3)
        deployment.run("quickstart", overrides + [f"out_dir={tmp_path / 'whole'}"], timeout_s=900)
    cut = tmp_path / "cut"
    with LocalDeployment(tmp_path / "cut-deployment") as deployment:
        _start_nodes(deployment, 3)
        runner = _run_in_background_until_round_one_ends(deployment, overrides + [f"out_dir={cut}"], cut)
        deployment.stop("superlink")  # the whole deployment goes down after round 1, the ServerApp first
        deployment.stop()  # (stopped after its nodes, it would skip the rounds left and end failed)
        runner.join()
    assert not (cut / "summary.json").exists()
    with LocalDeployment(tmp_path / "resumed-deployment") as deployment:
        _start_nodes(deployment, 3)
        deployment.run("quickstart", overrides + [f"resume={cut}"], timeout_s=900)
        assert "resuming" in (deployment.work / "run.log").read_text()

    def metrics(out) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in _records(out)]

    assert metrics(cut) == metrics(tmp_path / "whole")
    assert json.loads((cut / "summary.json").read_text())["status"] == "completed"


def _state(pid: int) -> str | None:
    """The process state letter of ``pid`` (None when it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _left_behind(pgids: set[int], marker: str) -> list[str]:
    """Live processes in the started process groups, or whose command line names ``marker``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z" and (int(fields[2]) in pgids or marker in cmdline):
            found.append(f"{stat.parent.name}: {cmdline[:120]}")
    return found


@pytest.mark.parametrize("how", ["sigterm", "sighup", "parent dies"])
def test_a_stopped_deploy_leaves_no_process_behind(tmp_path, how):
    """flrep deploy stopped by a signal, or orphaned by its parent's death, stops the SuperLink,
    the SuperNodes, the run and their children: nothing it started is left running."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "flower_app.cli", "deploy", "--nodes", "2", "quickstart", *RUN, "rounds=500",
           "--out", str(out)]
    launcher = cmd if how != "parent dies" else ["sh", "-c", shlex.join(cmd) + " & wait"]
    proc = subprocess.Popen(launcher, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=as_in_a_terminal)
    pids_file = out / "deployment" / "processes.json"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and "run" not in (json.loads(pids_file.read_text()) if pids_file.is_file() else {}):
            time.sleep(0.5)
        pids = json.loads(pids_file.read_text())
        assert {"superlink", "supernode-0", "supernode-1", "run"} <= set(pids)
        port = Path(f"/proc/{pids['superlink']}/cmdline").read_bytes().split(b"\0")
        marker = f"127.0.0.1:{port[port.index(b'--port') + 1].decode()}"
        if how == "parent dies":
            proc.send_signal(signal.SIGKILL)  # the shell: flrep is re-parented
            proc.wait(timeout=30)
        else:
            proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGHUP)
            assert proc.wait(timeout=90) == 128 + (signal.SIGTERM if how == "sigterm" else signal.SIGHUP)
            assert "were stopped" in proc.stderr.read().decode()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and _left_behind(set(pids.values()), marker):
            time.sleep(0.5)
        assert _left_behind(set(pids.values()), marker) == []
        assert all(_state(pid) in (None, "Z") for pid in pids.values())
    finally:  # a failed check must not leave the deployment running
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)


def test_deploy_shows_the_runs_own_lines_while_it_runs(tmp_path, capsys, monkeypatch):
    from flower_app.tools import deploy

    monkeypatch.setenv("FLREP_VERBOSE", "0")
    monkeypatch.setattr(deploy, "FOLLOW_EVERY_S", 0.05)
    log = tmp_path / "run.log"
    script = ("import sys, time; print('INFO :      [flrep] round 1/2', flush=True); time.sleep(0.5); "
              "print('DEBUG : grpc chatter', flush=True); print('WARNING :   a client failed', flush=True)")
    with log.open("w") as fh:
        process = subprocess.Popen([sys.executable, "-c", script], stdout=fh, stderr=subprocess.STDOUT)
    deploy.follow(log, process, timeout_s=60)
    assert capsys.readouterr().err.splitlines() == ["INFO :      [flrep] round 1/2", "WARNING :   a client failed"]
