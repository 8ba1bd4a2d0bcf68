"""``flrep reproduce``: the table registry, the report, resuming, and an end-to-end table run."""

from __future__ import annotations

import csv
import io
import json
import signal
import sys
from pathlib import Path

import pytest

from flower_app.app import checkpoint

from flower_app.reproduction import tables
from flower_app.cli import main as flrep
from flower_app.reproduction.runner import Job, check, command, plan, reproduce, run_folder, write_report
from flower_app.run.stop_signals import Stopped
from flower_app.reproduction.tables import SCALES, load_table, table_names
from task.errors import ConfigError
from offline_data import shared

TINY = """
title: Tiny table
source: nowhere, Table 0
columns:
  acc: {key: personalized_accuracy, label: accuracy, percent: true}
  steps: {key: local_steps_total, label: steps, percent: false}
scales:
  paper: {note: the setting, overrides: []}
  cpu: {note: fewer rounds, overrides: [rounds=2]}
numbers:
  a_acc: {value: 50.0, what: A accuracy, not_attempted: "a test: shown beside the sensitivity rows only"}
  b_acc: {value: 90.0, what: B accuracy, not_attempted: "a test: shown beside the sensitivity rows only"}
  a_steps: {value: 100, what: A steps, not_attempted: "a test"}
  b_steps: {value: 100, what: B steps, not_attempted: "a test"}
cells:
  a: {label: A, experiment: quickstart, overrides: [algorithm=fedavg], paper: {acc: a_acc}, minutes: {cpu: 0.3}}
  b: {label: B, experiment: quickstart, overrides: [algorithm=fedrep], paper: {acc: b_acc}}
claims:
  - {text: B beats A, cell: b, column: acc, op: ">", other: a}
  - {text: A above 60, cell: a, column: acc, op: ">", value: 60}
"""


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    folder = tmp_path / "tables"
    folder.mkdir()
    (folder / "tiny.yaml").write_text(TINY)
    monkeypatch.setattr(tables, "TABLES_DIR", folder)
    from flower_app.tools import bench_round

    # runs record a clean commit, whatever the state of the checkout the tests run in (a run from a
    # changed tree does not count: test_a_run_from_a_tree_with_uncommitted_changes_is_not_counted)
    monkeypatch.setattr(bench_round, "commit", lambda: "abc1234")
    return folder


@pytest.mark.parametrize("name", table_names())
def test_every_shipped_table_loads_and_every_cell_config_is_valid(name, tmp_path):
    table = load_table(name)
    for scale in SCALES:
        check(table, scale, plan(table, [0], None, tmp_path / "out"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, message", [
    (("experiment: quickstart, overrides: [algorithm=fedavg]", "experiment: nope, overrides: []"),
     "cells.a.experiment='nope' is not a file"),
    (("other: a}", "other: zz}"), "names cell 'zz'"),
    (("paper: {acc: a_acc}", "paper: {accuracy: a_acc}"), "cells.a.paper.accuracy is not a column"),
    (("  cpu: {note: fewer rounds, overrides: [rounds=2]}\n", ""), "scales.cpu is missing"),
    (("op: \">\", value: 60", "op: \"=>\", value: 60"), "op one of"),
    (("minutes: {cpu: 0.3}}", "minutes: {cpu: 0.3}, keys: {accuracy: global_accuracy}}"),
     "cells.a.keys is {'accuracy': 'global_accuracy'}; expected summary keys under columns (acc, steps)"),
    (("minutes: {cpu: 0.3}}", "minutes: {cpu: 0.3}, columns: [steps]}"),
     "cells.a.columns is ['steps']; expected a non-empty list of columns (acc, steps) that holds every column"),
    (("paper: {acc: b_acc}}", "paper: {}, columns: [steps]}"),
     "claims[0]. reads column 'acc' of cell 'b', which reports only steps"),
])
def test_a_bad_table_file_names_the_file_and_key(tiny, edit, message):
    (tiny / "tiny.yaml").write_text(TINY.replace(*edit))
    with pytest.raises(ConfigError, match="tiny.yaml") as err:
        load_table("tiny")
    assert message in str(err.value)


def test_bad_cells_scales_and_folders_are_refused_before_anything_is_written(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    assert flrep(["reproduce", "tiny", "--only", "zz", "--out", str(out)]) == 2
    assert "--only 'zz'" in capsys.readouterr().err
    (tiny / "bad.yaml").write_text(TINY.replace("overrides: [algorithm=fedavg]", "overrides: [train.nope=1]"))
    assert flrep(["reproduce", "bad", "--out", str(out)]) == 2
    assert "cell 'a'" in capsys.readouterr().err and not out.exists()
    out.mkdir()
    (out / "reproduce.json").write_text(json.dumps({"table": "other", "scale": "cpu", "runs": {}}))
    assert flrep(["reproduce", "tiny", "--out", str(out)]) == 2
    assert "holds table 'other'" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["reproduce.json"]


def test_a_checkpointed_run_is_resumed_and_a_started_one_moved_aside(tiny, tmp_path):
    table = load_table("tiny")
    job = Job(table.cells["a"], 3)
    folder = run_folder(tmp_path, job)
    cmd = command(table, "cpu", job, folder)
    assert cmd[-2:] == ["--out", str(folder)] and "seed=3" in cmd and "rounds=2" in cmd and "algorithm=fedavg" in cmd
    folder.mkdir(parents=True)
    assert command(table, "cpu", job, folder)[-1] == "--force"  # moved aside by flrep run, never deleted
    (checkpoint.checkpoint_dir(folder)).mkdir(parents=True)
    (checkpoint.checkpoint_dir(folder) / checkpoint.SERVER_FILE).write_bytes(b"x")
    assert command(table, "cpu", job, folder)[-1] == f"resume={folder}"


def test_machine_settings_reach_every_run_and_result_settings_are_refused(tiny, tmp_path, capsys):
    table = load_table("tiny")
    job = Job(table.cells["a"], 0)
    cmd = command(table, "cpu", job, run_folder(tmp_path, job), ["simulation.client_gpus=0.1"])
    assert "simulation.client_gpus=0.1" in cmd and "rounds=2" in cmd
    out = tmp_path / "out"
    for bad in ("rounds=3", "train.lr=0.5", "simulation.client_gpus"):
        assert flrep(["reproduce", "tiny", "--set", bad, "--out", str(out)]) == 2
        assert f"--set {bad!r}" in capsys.readouterr().err
    assert flrep(["reproduce", "tiny", "--set", "simulation.nope=1", "--out", str(out)]) == 2
    assert "simulation.nope" in capsys.readouterr().err and not out.exists()


def _fake_run(out: Path, cell: str, seed: int, acc: float | None, status: str = "completed") -> None:
    folder = out / "runs" / cell / f"seed{seed}"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"status": status, "personalized_accuracy": acc,
                                                     "wall_time_s": 60.0}))


def test_a_run_made_with_other_settings_is_moved_aside_and_run_again(tiny, tmp_path, capsys, monkeypatch):
    import yaml
    from omegaconf import OmegaConf

    from flower_app.reproduction import runner as rep
    from flower_app.run.config import load_config

    table = load_table("tiny")
    job = Job(table.cells["a"], 0)
    folder = run_folder(tmp_path, job)
    _fake_run(tmp_path, "a", 0, 0.5)
    cfg = OmegaConf.to_container(load_config("quickstart", ["algorithm=fedavg", "rounds=2", "seed=0", "compare=[]"]),
                                 resolve=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert rep.stale_keys(table, "cpu", job, folder) == []  # this cell's run
    del cfg["train"]["aggregation"]  # a key added to the app later counts as its default ...
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert rep.stale_keys(table, "cpu", job, folder) == []
    (folder / "config.yaml").write_text(yaml.safe_dump({k: v for k, v in cfg.items() if k != "rounds"}))
    assert rep.stale_keys(table, "cpu", job, folder) == ["rounds"]  # ... which the scale's rounds=2 is not
    cfg["rounds"], cfg["train"]["lr"] = 3, 0.5  # the table's cell changed since
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert rep.stale_keys(table, "cpu", job, folder) == ["rounds", "train.lr"]
    ran = []
    monkeypatch.setattr(rep, "run_child", lambda cmd, log: ran.append(cmd) or 1)
    assert reproduce(table, "cpu", [0], ["a"], tmp_path) == 1  # the fake child fails
    assert "a/seed0 was run with other values of rounds, train.lr: moved to" in capsys.readouterr().out
    kept = next((tmp_path / "runs" / "a").glob("seed0.old-*"))
    assert json.loads((kept / "summary.json").read_text())["status"] == "completed" and len(ran) == 1


def test_each_run_records_the_commit_it_started_with(tiny, tmp_path, monkeypatch):
    """A long table spans commits: every run's record names the code that run started with."""
    from flower_app.tools import bench_round
    from flower_app.reproduction import runner as rep

    commits = iter(["aaa", "bbb+changes"])
    monkeypatch.setattr(bench_round, "commit", lambda: next(commits))
    monkeypatch.setattr(rep, "run_child", lambda cmd, log: 1)
    assert reproduce(load_table("tiny"), "cpu", [0, 1], ["a"], tmp_path) == 1  # the fake child fails
    runs = json.loads((tmp_path / "reproduce.json").read_text())["runs"]
    assert (runs["a/seed0"]["commit"], runs["a/seed1"]["commit"]) == ("aaa", "bbb+changes")


def test_a_table_whose_app_changes_beneath_it_records_the_run_and_starts_again(tiny, tmp_path, capsys, monkeypatch):
    """A key added to conf/ while a table runs is unknown to the running command's schema: the run
    is recorded, and the command starts itself again (with the new app) to continue the table."""
    import os

    import yaml
    from omegaconf import OmegaConf

    from flower_app import cli
    from flower_app.run import config as app_config
    from flower_app.reproduction import runner as rep

    out = tmp_path / "out"
    cfg = OmegaConf.to_container(app_config.load_config("quickstart", ["algorithm=fedavg", "rounds=2", "seed=0",
                                                                       "compare=[]"]), resolve=True)

    def child_under_a_new_app(cmd, log):
        _fake_run(out, "a", 0, 0.5)
        (out / "runs" / "a" / "seed0" / "config.yaml").write_text(yaml.safe_dump(cfg))

        def newer_conf(*args, **kwargs):
            raise ConfigError("train.new_key: unknown key")

        monkeypatch.setattr(app_config, "load_config", newer_conf)
        return 0

    class Exec(Exception):
        pass

    def execv(path, argv):
        raise Exec(argv)

    ran = []
    monkeypatch.setattr(rep, "run_child", lambda cmd, log: ran.append(cmd) or child_under_a_new_app(cmd, log))
    monkeypatch.setattr(os, "execv", execv)
    argv = ["reproduce", "tiny", "--seeds", "0", "1", "--only", "a", "--out", str(out), "--set", "wandb.enabled=false"]
    with pytest.raises(Exec) as again:
        flrep(argv)
    assert len(ran) == 1  # seed 1 is left to the new command
    record = json.loads((out / "reproduce.json").read_text())["runs"]["a/seed0"]
    assert record["status"] == "completed"
    said = capsys.readouterr().out
    assert "a/seed0 is recorded as completed" in said and "train.new_key: unknown key" in said
    assert "changed while this command ran; starting the same command again" in said
    restarted = again.value.args[0]
    assert restarted[1:3] == ["-m", "flower_app.cli"]
    assert vars(cli.parse_args(restarted[3:])) == vars(cli.parse_args(argv)) | {"out": str(out)}


def test_runs_of_an_older_table_revision_are_moved_aside_and_run_again(tiny, tmp_path, capsys, monkeypatch):
    from flower_app.reproduction import runner as rep

    for seed in (0, 1):
        _fake_run(tmp_path, "a", seed, 0.5)
    (tmp_path / "reproduce.json").write_text(json.dumps({"table": "tiny", "scale": "cpu", "runs": {
        "a/seed1": {"status": "completed", "revision": 2, "date": "2026-11-23T07:00:00+00:00", "commit": "abc",
                    "machine": {"processor": "x86_64", "cpu_count": 2}}}}))  # seed 0: recorded before revisions, i.e. 1
    ran, recorded = [], []

    def fake_child(cmd, log):  # what the manifest says while the run goes (an interrupted run keeps it)
        recorded.append(json.loads((tmp_path / "reproduce.json").read_text())["runs"]["a/seed0"])
        ran.append(cmd)
        return 1

    monkeypatch.setattr(rep, "run_child", fake_child)
    assert reproduce(load_table("tiny"), "cpu", [0, 1], ["a"], tmp_path) == 0  # revision 1: both count
    assert ran == []
    (tiny / "tiny.yaml").write_text(TINY + "revision: 2\n")
    assert reproduce(load_table("tiny"), "cpu", [0, 1], ["a"], tmp_path) == 1  # the fake child fails
    assert "a/seed0 was run for revision 1 of the table, which is now at revision 2: moved to" in capsys.readouterr().out
    kept = next((tmp_path / "runs" / "a").glob("seed0.old-*"))
    assert json.loads((kept / "summary.json").read_text())["status"] == "completed"
    assert len(ran) == 1 and "seed=0" in ran[0]  # seed 1 belongs to revision 2 and is kept
    assert recorded[0]["status"] == "started" and recorded[0]["revision"] == 2
    manifest = json.loads((tmp_path / "reproduce.json").read_text())
    assert manifest["runs"]["a/seed0"]["revision"] == 2 and manifest["runs"]["a/seed0"]["status"] == "failed"
    (tiny / "tiny.yaml").write_text(TINY + "revision: 0\n")
    with pytest.raises(ConfigError, match="revision is 0"):
        load_table("tiny")


def test_a_failed_run_is_kept_unless_retry_failed_and_then_runs_again_from_the_start(tiny, tmp_path, capsys,
                                                                                    monkeypatch):
    """A failed run is a result: resuming a diverged run from its checkpoint diverges again."""
    from flower_app.app import checkpoint
    from flower_app.reproduction import runner as rep

    _fake_run(tmp_path, "a", 0, 0.1, status="failed")
    folder = tmp_path / "runs" / "a" / "seed0"
    checkpoint.checkpoint_dir(folder).mkdir(parents=True)
    (checkpoint.checkpoint_dir(folder) / checkpoint.SERVER_FILE).write_text("{}")
    ran = []
    monkeypatch.setattr(rep, "run_child", lambda cmd, log: ran.append(cmd) or 0)
    assert reproduce(load_table("tiny"), "cpu", [0], ["a"], tmp_path) == 1  # the failed run still counts
    assert ran == [] and json.loads((folder / "summary.json").read_text())["status"] == "failed"
    out = capsys.readouterr().out
    assert "a/seed0 failed earlier: kept" in out and "0 already completed, 1 failed earlier, 0 to run" in out
    assert reproduce(load_table("tiny"), "cpu", [0], ["a"], tmp_path, retry_failed=True) == 1  # no summary: failed
    assert len(ran) == 1 and "--out" in ran[0] and not any(a.startswith("resume=") for a in ran[0])
    moved = next((tmp_path / "runs" / "a").glob("seed0.old-*"))
    assert json.loads((moved / "summary.json").read_text())["status"] == "failed"  # kept aside, never deleted


def test_the_report_gives_mean_std_paper_difference_and_claims(tiny, tmp_path):
    table = load_table("tiny")
    for seed, acc in enumerate([0.50, 0.52, 0.54]):
        _fake_run(tmp_path, "a", seed, acc)
    _fake_run(tmp_path, "b", 0, 0.80)
    _fake_run(tmp_path, "b", 1, 0.99, status="failed")  # a failed run is never counted
    manifest = {"table": "tiny", "scale": "cpu", "runs": {"a/seed0": {
        "status": "completed", "date": "2026-11-22T00:00:00+00:00", "commit": "abc",
        "machine": {"processor": "x86_64", "cpu_count": 2, "cuda": None}}}}
    write_report(table, "cpu", tmp_path, manifest)
    md = (tmp_path / "table.md").read_text()
    # 95% t-interval of the mean of 50, 52, 54: t(0.975, 2) = 4.303 × 2 / sqrt(3) = 4.97
    assert "| A | accuracy | 52.00 ± 2.00 | 3 | 50.00 | +2.00 | **no** | ± 4.97 | 1.0 min |" in md
    assert "| B | accuracy | 80.00 | 1 | 90.00 | -10.00 | **no** | – |" in md  # one seed: no interval
    assert "| A | steps | n/a (not reported) |" in md
    assert "## Sensitivity rows (never counted)" in md
    assert "| A accuracy | – | – | – | 0 | 50.00 | – | – | not attempted: a test: shown beside" in md
    assert "| B beats A | `b.acc > a.acc` | holds (1/1 seeds) |" in md  # only the seeds both cells completed
    assert "| A above 60 | `a.acc > 60` | fails (0/3 seeds) |" in md
    assert "commits abc" in md and (tmp_path / "table.png").is_file()
    rows = (tmp_path / "table.csv").read_text().splitlines()
    assert rows[0].startswith("cell,label,column") and len(rows) == 1 + 4


PRIMARY = """
title: Tiny table of primaries
source: nowhere, Table 0
columns:
  acc: {key: personalized_accuracy, label: accuracy, percent: true}
  steps: {key: local_steps_total, label: steps, percent: false}
scales:
  paper: {note: the setting, overrides: [], needs: "a GPU: 3 hours"}
  cpu: {note: fewer rounds, overrides: [rounds=2]}
numbers:
  a_acc: {value: 50.0, what: A accuracy}
  a_steps: {value: 100, what: A steps}
  b_acc: {value: 90.0, what: B accuracy}
  b_steps: {value: 100, what: B steps}
diagnosed:
  b_acc: {reason: the official code on our data gives 80.2, evidence: docs/reproduction/evidence/x.md}
suspected:
  b_steps: counted another way
cells:
  a: {label: A, experiment: quickstart, overrides: [algorithm=fedavg], primary: true, paper: {acc: a_acc, steps: a_steps}}
  b: {label: B, experiment: quickstart, overrides: [algorithm=fedrep], primary: true, paper: {acc: b_acc, steps: b_steps}}
"""


def test_the_report_judges_each_paper_number_on_its_primary_with_the_scale_and_the_evidence(tiny, tmp_path):
    """Agreement within the tolerance (points for a percentage, per cent of the paper's value otherwise);
    a reduced scale is not attempted; the paired evidence and the suspected causes are shown."""
    (tiny / "tiny.yaml").write_text(PRIMARY)
    table = load_table("tiny")
    for seed in range(3):
        for cell, acc, steps in (("a", 0.505, 101), ("b", 0.80, 150)):  # a agrees; b -10.0 points and +50%
            _fake_run(tmp_path, cell, seed, acc + 0.001 * seed)
            summary = tmp_path / "runs" / cell / f"seed{seed}" / "summary.json"
            summary.write_text(json.dumps({**json.loads(summary.read_text()), "local_steps_total": steps}))
    write_report(table, "cpu", tmp_path, {"table": "tiny", "scale": "cpu", "runs": {}})
    md = (tmp_path / "table.md").read_text()
    assert md.count("**not attempted**: needs a GPU: 3 hours") == 4  # the cpu scale is not the paper's for a cell
    (tiny / "tiny.yaml").write_text(PRIMARY.replace("overrides: [rounds=2]", "overrides: []"))
    table = load_table("tiny")  # the cpu scale is the paper's now
    write_report(table, "cpu", tmp_path, {"table": "tiny", "scale": "cpu", "runs": {}})
    md = (tmp_path / "table.md").read_text()
    assert "**The paper's 4 numbers**: 2 agrees, 1 differs, diagnosed, 1 differs, 0 inconclusive, 0 not attempted" in md
    assert "| A accuracy | `a` | accuracy | 50.60 ± 0.10 | 3 | 50.00 | +0.60 | ± 0.25 | **agrees** |" in md
    assert "| A steps | `a` | steps | 101 ± 0 | 3 | 100 | +1 (+1%) | ± 0 | **agrees** |" in md
    assert "**differs, diagnosed**: the official code on our data gives 80.2 |" in md
    assert "| B steps | `b` | steps | 150 ± 0 | 3 | 100 | +50 (+50%) | ± 0 | **differs**: counted another way |" in md
    assert "- `b_acc`: the official code on our data gives 80.2 ([evidence](../../../docs/reproduction/evidence/x.md))" in md
    assert "## Sensitivity rows" not in md
    verdicts = [r["verdict"] for r in csv.DictReader(io.StringIO((tmp_path / "table.csv").read_text()))]
    assert verdicts == ["agrees", "agrees", "differs, diagnosed", "differs"]


def test_a_cell_reports_only_its_own_columns_and_an_interval_can_exclude_the_paper(tiny, tmp_path):
    (tiny / "tiny.yaml").write_text(TINY.replace("paper: {acc: b_acc}}", "paper: {acc: b_acc}, columns: [acc]}"))
    table = load_table("tiny")
    for seed, acc in enumerate([0.80, 0.81, 0.82]):
        _fake_run(tmp_path, "b", seed, acc)
    write_report(table, "cpu", tmp_path, {"table": "tiny", "scale": "cpu", "runs": {}})
    md = (tmp_path / "table.md").read_text()
    assert "| B | accuracy | 81.00 ± 1.00 | 3 | 90.00 | -9.00 | **no** | ± 2.48 |" in md
    assert "| B | steps |" not in md and "| A | steps | not run |" in md
    assert len((tmp_path / "table.csv").read_text().splitlines()) == 1 + 3


def test_the_report_leaves_out_completed_runs_of_an_older_revision_and_names_them(tiny, tmp_path):
    (tiny / "tiny.yaml").write_text(TINY + "revision: 2\n")
    table = load_table("tiny")
    _fake_run(tmp_path, "a", 0, 0.18)  # e.g. a run that a later check would fail
    _fake_run(tmp_path, "a", 1, 0.50)
    write_report(table, "cpu", tmp_path, {"table": "tiny", "scale": "cpu", "runs": {"a/seed1": {
        "status": "completed", "revision": 2, "date": "2026-11-25T00:00:00+00:00", "commit": "abc",
        "machine": {"processor": "x86_64", "cpu_count": 2, "cuda": None}}}})
    md = (tmp_path / "table.md").read_text()
    assert "| A | accuracy | 50.00 | 1 |" in md
    assert ("**Not counted** (1 completed runs; running the table again replaces them): a/seed0 was run for "
            "revision 1 of the table, which is now at revision 2.") in md


def test_a_run_from_a_tree_with_uncommitted_changes_is_not_counted(tiny, tmp_path):
    """Its code cannot be traced to a commit: the report leaves it out, and running the table again
    moves it aside and runs it from a clean tree."""
    table = load_table("tiny")
    _fake_run(tmp_path, "a", 0, 0.40)
    _fake_run(tmp_path, "a", 1, 0.50)
    record = {"status": "completed", "date": "2026-11-25T00:00:00+00:00",
              "machine": {"processor": "x86_64", "cpu_count": 2, "cuda": None}}
    write_report(table, "cpu", tmp_path, {"table": "tiny", "scale": "cpu", "runs": {
        "a/seed0": {**record, "commit": "abc+changes"}, "a/seed1": {**record, "commit": "abc", "clean": True}}})
    md = (tmp_path / "table.md").read_text()
    assert "| A | accuracy | 50.00 | 1 |" in md
    assert ("a/seed0 was run from a tree with uncommitted changes (abc+changes): its code cannot be named"
            in md)


def test_a_recorded_run_missing_from_the_folder_is_named_not_counted_and_run_again(tiny, tmp_path, capsys,
                                                                                   monkeypatch):
    """A table continued where some of its recorded runs are not (made on another machine, the
    folder moved) does not silently lose them: the header names each, and the command runs it again."""
    from flower_app.reproduction import runner as rep

    _fake_run(tmp_path, "a", 0, 0.5)
    record = {"status": "completed", "revision": 1, "date": "2026-11-23T07:00:00+00:00", "commit": "abc",
              "machine": {"processor": "x86_64", "cpu_count": 2}}
    (tmp_path / "reproduce.json").write_text(json.dumps({"table": "tiny", "scale": "cpu", "runs": {
        "a/seed0": record, "a/seed1": record, "b/seed0": {**record, "status": "failed"}}}))
    ran = []
    monkeypatch.setattr(rep, "run_child", lambda cmd, log: ran.append(cmd) or 1)
    assert reproduce(load_table("tiny"), "cpu", [0, 1], ["a"], tmp_path) == 1  # the fake child fails
    printed = capsys.readouterr().out
    assert "a/seed1 was recorded as completed on 2026-11-23 (commit abc) but its folder runs/a/seed1 is missing: " \
           "it runs again" in printed and "a/seed0 was recorded" not in printed and "b/seed0" not in printed
    assert len(ran) == 1 and "seed=1" in ran[0]
    write_report(load_table("tiny"), "cpu", tmp_path, {"table": "tiny", "scale": "cpu", "runs": {
        "a/seed0": record, "a/seed1": record}})
    md = (tmp_path / "table.md").read_text()
    assert ("**Not counted** (1 completed runs; running the table again replaces them): a/seed1 was recorded as "
            "completed on 2026-11-23 (commit abc) but its folder runs/a/seed1 is missing.") in md
    assert "| A | accuracy | 50.00 | 1 |" in md


def test_a_dotted_column_key_reads_an_entry_of_a_summary_mapping():
    error = tables.Column("err", "newclient_error.20", "error at n = 20", percent=False)
    acc = tables.Column("acc", "personalized_accuracy", "accuracy", percent=True)
    summary = {"newclient_error": {"5": 0.9, "20": 0.125}, "personalized_accuracy": 0.5, "flag": True}
    assert error.value(summary) == 0.125 and acc.value(summary) == 50.0
    assert error.value({"newclient_error": {"5": 0.9}}) is None and error.value({}) is None
    assert tables.Column("f", "flag", "flag", percent=False).value(summary) is None  # a bool is not a number


def test_a_cell_can_report_a_column_under_its_own_summary_key(tiny, tmp_path):
    (tiny / "tiny.yaml").write_text(TINY.replace("paper: {acc: b_acc}}", "paper: {acc: b_acc}, keys: {acc: global_accuracy}}"))
    table = load_table("tiny")
    _fake_run(tmp_path, "a", 0, 0.50)
    _fake_run(tmp_path, "b", 0, 0.10)  # its personalized accuracy is not what column acc reports for b
    summary_file = tmp_path / "runs" / "b" / "seed0" / "summary.json"
    summary_file.write_text(json.dumps({**json.loads(summary_file.read_text()), "global_accuracy": 0.89}))
    write_report(table, "cpu", tmp_path, {"table": "tiny", "scale": "cpu", "runs": {}})
    md = (tmp_path / "table.md").read_text()
    assert "| B | accuracy (`global_accuracy`) | 89.00 | 1 | 90.00 | -1.00 | yes |" in md
    assert "| A | accuracy | 50.00 | 1 | 50.00 | +0.00 | yes |" in md
    assert "| B beats A | `b.acc > a.acc` | holds (1/1 seeds) |" in md


def test_a_pipe_in_a_label_does_not_break_the_markdown_table():
    from flower_app.reproduction.report import _cell

    assert _cell("error |Bw - B*w*|^2") == "error \\|Bw - B*w*\\|^2"


def test_a_run_resumed_on_another_machine_records_both_parts(tiny, tmp_path, monkeypatch):
    """Stopped on one machine and finished from its checkpoint on another: the record keeps the
    stopped part (machine, wall time) and the header names both machines."""
    from flower_app.tools import bench_round
    from flower_app.reproduction import runner as rep

    gpu = {"processor": "x86_64", "cpu_count": 16, "cuda": "NVIDIA H200"}
    cpu = {"processor": "x86_64", "cpu_count": 2, "cuda": None}
    folder = run_folder(tmp_path, Job(load_table("tiny").cells["a"], 0))

    def stopped(cmd, log):  # the run checkpoints, then SIGTERM reaches reproduce
        checkpoint.checkpoint_dir(folder).mkdir(parents=True)
        (checkpoint.checkpoint_dir(folder) / checkpoint.SERVER_FILE).write_bytes(b"x")
        raise Stopped(signal.SIGTERM)

    def finished(cmd, log):
        assert cmd[-1] == f"resume={folder}"
        (folder / "summary.json").write_text(json.dumps({"status": "completed", "personalized_accuracy": 0.5,
                                                         "wall_time_s": 60.0}))
        return 0

    monkeypatch.setattr(bench_round, "machine", lambda: gpu)
    monkeypatch.setattr(rep, "run_child", stopped)
    with pytest.raises(Stopped):
        reproduce(load_table("tiny"), "cpu", [0], ["a"], tmp_path)
    record = json.loads((tmp_path / "reproduce.json").read_text())["runs"]["a/seed0"]
    assert record["status"] == "interrupted" and record["machine"] == gpu and record["wall_s"] >= 0
    assert "Runs: 0 recorded" in (tmp_path / "table.md").read_text()  # an unfinished run is not counted
    monkeypatch.setattr(bench_round, "machine", lambda: cpu)
    monkeypatch.setattr(rep, "run_child", finished)
    assert reproduce(load_table("tiny"), "cpu", [0], ["a"], tmp_path) == 0
    record = json.loads((tmp_path / "reproduce.json").read_text())["runs"]["a/seed0"]
    assert record["status"] == "completed" and record["machine"] == cpu
    assert [p["machine"] for p in record["earlier_parts"]] == [gpu] and "wall_s" in record["earlier_parts"][0]
    assert "on x86_64 × 16 CPUs, NVIDIA H200; x86_64 × 2 CPUs" in (tmp_path / "table.md").read_text()


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
def test_reproduce_runs_each_cell_and_seed_once_and_resumes(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    table = load_table("tiny")
    assert reproduce(table, "cpu", [0, 1], ["a"], out) == 0
    first = {s: (run_folder(out, Job(table.cells["a"], s)) / "summary.json").stat().st_mtime_ns for s in (0, 1)}
    manifest = json.loads((out / "reproduce.json").read_text())
    assert sorted(manifest["runs"]) == ["a/seed0", "a/seed1"]
    assert all(r["status"] == "completed" and r["machine"]["cpu_count"] for r in manifest["runs"].values())
    summaries = [json.loads((run_folder(out, Job(table.cells["a"], s)) / "summary.json").read_text()) for s in (0, 1)]
    assert [s["seed"] for s in summaries] == [0, 1] and all(s["rounds"] == 2 for s in summaries)
    assert summaries[0]["personalized_accuracy"] != summaries[1]["personalized_accuracy"]  # the seeds differ
    capsys.readouterr()
    assert reproduce(table, "cpu", [0, 1], ["a"], out) == 0  # everything done: nothing runs again
    assert "2 already completed, 0 to run" in capsys.readouterr().out
    assert first == {s: (run_folder(out, Job(table.cells["a"], s)) / "summary.json").stat().st_mtime_ns for s in (0, 1)}
    md = (out / "table.md").read_text()
    assert "| A | accuracy |" in md and " | 2 | 50.00 |" in md and "| B | accuracy | not run | 0 |" in md


#: ``flrep reproduce tiny`` in another process, its one run waiting for the file ``argv[3]``.
OWNER = """
import sys, time
from pathlib import Path
from flower_app.reproduction import runner as reproduce
from flower_app.reproduction import tables
from flower_app.cli import main
tables.TABLES_DIR = Path(sys.argv[1])
def run_child(cmd, log):
    print("running", flush=True)
    while not Path(sys.argv[3]).exists():
        time.sleep(0.1)
    return 1
reproduce.run_child = run_child
sys.exit(main(["reproduce", "tiny", "--only", "a", "--seeds", "0", "--out", sys.argv[2]]))
"""


def test_a_second_reproduce_on_one_table_folder_exits_2_at_once_naming_the_first(tiny, tmp_path, capsys,
                                                                                 monkeypatch):
    import subprocess
    import sys
    import time

    from flower_app.reproduction import runner as rep

    out, go = tmp_path / "out", tmp_path / "go"
    first = subprocess.Popen([sys.executable, "-c", OWNER, str(tiny), str(out), str(go)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert "running\n" in iter(first.stdout.readline, "")  # it owns the folder and runs a cell
        manifest = (out / "reproduce.json").read_bytes()
        monkeypatch.setattr(rep, "run_child", lambda cmd, log: pytest.fail("a second command ran a cell"))
        start = time.monotonic()
        assert flrep(["reproduce", "tiny", "--only", "a", "--seeds", "0", "--out", str(out)]) == 2
        assert f"{out} is in use by another flrep command (PID {first.pid})" in capsys.readouterr().err
        assert time.monotonic() - start < 30 and (out / "reproduce.json").read_bytes() == manifest
    finally:
        go.touch()
        first.wait(timeout=120)
    assert first.returncode == 1  # its fake run failed; the folder is free again
    assert not (out / ".flrep.lock").exists()


@pytest.mark.slow  # over 30 s on 2 cores: the slow suite (README)
def test_a_fresh_clone_continues_a_table_from_the_runs_git_keeps(tiny, tmp_path, capsys):
    """Of a committed table folder git keeps each run's summary.json and config.yaml only; a fresh
    clone runs none of those cells again and rebuilds the table from them and its new runs."""
    out = tmp_path / "out"
    table = load_table("tiny")
    assert reproduce(table, "cpu", [0], ["a"], out) == 0
    seed0 = run_folder(out, Job(table.cells["a"], 0))
    kept = {name: (seed0 / name).read_bytes() for name in ("summary.json", "config.yaml")}
    clone = tmp_path / "clone"
    for name, data in kept.items():
        (clone / "runs" / "a" / "seed0").mkdir(parents=True, exist_ok=True)
        (clone / "runs" / "a" / "seed0" / name).write_bytes(data)
    (clone / "reproduce.json").write_bytes((out / "reproduce.json").read_bytes())
    capsys.readouterr()
    assert reproduce(table, "cpu", [0, 1], ["a"], clone) == 0
    assert "1 already completed, 1 to run" in capsys.readouterr().out
    assert (clone / "runs" / "a" / "seed0" / "summary.json").read_bytes() == kept["summary.json"]
    assert " | 2 | 50.00 |" in (clone / "table.md").read_text()


def test_git_keeps_the_summary_and_config_of_each_reproduction_run_and_nothing_else(tmp_path):
    """Git leaves out what a table's runs write beside their summary.json and config.yaml (the app
    bundle holds no docs at all: tests/test_app_bundle.py)."""
    import shutil
    import subprocess

    root = Path(__file__).parents[1]
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(root / ".gitignore", repo)
    kept = ["docs/reproduction/t/reproduce.json", "docs/reproduction/t/runs/a/seed0/config.yaml",
            "docs/reproduction/t/runs/a/seed0/summary.json", "docs/reproduction/t/runs/b/seed12/summary.json",
            "docs/reproduction/t/table.md", "docs/reproduction/t/tuning/a.json",
            "docs/reproduction/t/tuning/a/k=1/seed0/summary.json", "docs/reproduction/t/tuning/a/k=1/seed0/config.yaml"]
    left = ["t/runs/a/seed0.log", "t/runs/a/seed0/metrics.jsonl", "t/runs/a/seed0/checkpoint/r/server.pt",
            "t/runs/a/seed0/checkpoint/r/state.json", "t/runs/a/seed0/wandb/run.wandb",
            "t/runs/a/seed0.old-20261123-120000/summary.json", "t/runs/a/seed0.old-20261123-120000/metrics.jsonl",
            "t/tuning/a/k=1/seed0.log", "t/tuning/a/k=1/seed0/metrics.jsonl", "t/tuning/a/k=1/seed0/checkpoint/r/server.pt"]
    for name in kept + [f"docs/reproduction/{n}" for n in left]:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text("x")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    listed = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "docs"], cwd=repo, check=True,
                            capture_output=True, text=True).stdout.split()
    assert sorted(listed) == sorted(kept)


def test_sigterm_stops_the_running_cell_and_leaves_no_process(tmp_path):
    """SIGTERM to ``flrep reproduce`` stops its ``flrep run`` child (and that child's engine) and
    exits 143; the same command later starts the cell again."""
    shared("adult")  # lg_table4_adult's data
    import signal
    import subprocess
    import sys
    import time

    import psutil

    cmd = [sys.executable, "-m", "flower_app.cli", "reproduce", "lg_table4_adult", "--only", "lg_iid",
           "--seeds", "0", "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    parent = psutil.Process(proc.pid)
    # Until the cell's flrep run has started its engine's processes: about 6 s on an idle machine,
    # over 60 s on a loaded 2-core CI machine with cold imports (seen once), so wait up to 5 minutes.
    deadline = time.monotonic() + 300
    while (len(parent.children(recursive=True)) < 3 and proc.poll() is None
           and time.monotonic() < deadline):
        time.sleep(0.2)
    assert proc.poll() is None, f"flrep reproduce exited {proc.returncode}: {proc.stderr.read()}"
    descendants = parent.children(recursive=True)
    if len(descendants) < 3:  # stop it, and say what the run printed
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        log = tmp_path / "out" / "runs" / "lg_iid" / "seed0.log"
        pytest.fail("the cell's flrep run never started its engine; its log ends:\n"
                    + (log.read_text()[-3000:] if log.exists() else f"(no {log})"))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    assert "interrupted by SIGTERM during lg_iid/seed0" in proc.stderr.read()
    _, alive = psutil.wait_procs(descendants, timeout=30)
    assert not alive, [p.cmdline() for p in alive]


def test_a_table_file_that_cannot_be_written_is_one_line_naming_it_exit_3_and_keeps_the_runs(tiny, tmp_path, capsys,
                                                                                             monkeypatch):
    import errno

    from flower_app.reproduction import runner as rep
    from task.files import WriteFailed

    def child(cmd, log):  # a run that completes
        _fake_run(tmp_path, "a", 0, 0.5)
        return 0

    real = rep.write_atomic

    def full_at_the_report(path, write):
        if path.name == "table.md":
            raise WriteFailed(errno.ENOSPC, f"no space left on {path}") from OSError(errno.ENOSPC, "full")
        return real(path, write)

    monkeypatch.setattr(rep, "run_child", child)
    monkeypatch.setattr(rep, "write_atomic", full_at_the_report)
    assert flrep(["reproduce", "tiny", "--seeds", "0", "--only", "a", "--out", str(tmp_path)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"flrep: reproduce: no space left on {tmp_path / 'table.md'}; "), err
    assert json.loads((tmp_path / "reproduce.json").read_text())["runs"]["a/seed0"]["status"] == "completed"


def test_list_with_a_table_names_each_cell_its_role_numbers_and_cost(tiny, capsys):
    from flower_app.cli import main

    assert main(["reproduce", "tiny", "--list", "--seeds", "0", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tiny: Tiny table (2 cells")
    assert lines[1].split()[:6] == ["a", "sensitivity", "paper", "0", "cpu", "0.3"] and "a_acc" in lines[1]
    assert lines[2].split()[:2] == ["b", "sensitivity"] and "b_acc" in lines[2]
    assert lines[3] == "all cells, seeds 0 1: paper 0.0 h, cpu 0.0 h"


def test_a_running_cell_reports_its_rounds_and_eta(tmp_path, capsys, monkeypatch):
    from flower_app.reproduction import runner as rep
    from flower_app.run import console

    monkeypatch.setattr(console, "PROGRESS_EVERY_S", 0.0)
    script = ("import time\n"
              "print('INFO :      [flrep] round 1/2 | train loss 0.5 | elapsed 5.0s | ETA 5.0s', flush=True)\n"
              "time.sleep(2.5)\n"
              "print('INFO :      [flrep] round 2/2 | train loss 0.4 | elapsed 10.0s | ETA 0.0s', flush=True)\n"
              "time.sleep(2.5)\n")
    with open(tmp_path / "seed0.log", "a") as log:
        log.write("$ an earlier part's line: [flrep] round 9/9 | ETA 1.0s\n")
        assert rep.run_child([sys.executable, "-c", script], log) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[reproduce]   ")]
    run = f"{tmp_path.name}/seed0"  # the log's folder and name: which run, when several go side by side
    assert said == [f"[reproduce]   {run}: round 1/2, ETA 5.0s", f"[reproduce]   {run}: round 2/2, ETA 0.0s"]


def test_a_resumed_run_is_estimated_at_what_its_checkpoint_has_not_spent(tiny, tmp_path, capsys, monkeypatch):
    from flower_app.reproduction import runner as rep

    (tiny / "long.yaml").write_text(TINY.replace("minutes: {cpu: 0.3}", "minutes: {cpu: 30}"))
    table = load_table("long")
    resumed = run_folder(tmp_path, Job(table.cells["a"], 0))
    checkpoint.save(resumed, {"elapsed_s": 20 * 60.0})  # 20 of the cell's 30 minutes already spent

    def finished(cmd, log):
        folder = Path(cmd[cmd.index("--out") + 1]) if "--out" in cmd else Path(cmd[-1].split("=", 1)[1])
        assert (folder == resumed) == (cmd[-1] == f"resume={resumed}")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "summary.json").write_text(json.dumps({"status": "completed", "personalized_accuracy": 0.5}))
        return 0

    monkeypatch.setattr(rep, "run_child", finished)
    assert reproduce(table, "cpu", [0, 1], ["a"], tmp_path) == 0
    said = capsys.readouterr().out
    assert "2 to run (estimated 40 min)" in said  # 10 left of seed 0, 30 of seed 1
    assert "run 1/2: a/seed0 (A) | elapsed 0 min | ETA 40 min" in said
