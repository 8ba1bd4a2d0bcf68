"""``flrep reproduce TABLE --out DIR --take-from OTHER``: runs made in several places make one table,
and nothing DIR holds is overwritten."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from flower_app.cli import main as flrep
from flower_app.reproduction.runner import load_manifest, save_manifest
from flower_app.run.config import load_config
from tests import test_reproduce, test_tune

tiny, tuned = test_reproduce.tiny, test_tune.tuned
ALGORITHM = {"a": "fedavg", "b": "fedrep"}  # the tiny table's cells


def _run(out: Path, cell: str, seed: int, status: str, acc: float | None = None, rounds: int = 2,
         extra: tuple[str, ...] = ()) -> Path:
    """A run of ``cell`` in table folder ``out`` as ``flrep reproduce`` leaves it: its folder (config,
    summary unless unfinished, a checkpoint), its log and its record."""
    folder = out / "runs" / cell / f"seed{seed}"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "checkpoint" / "server.pt").write_text("state")
    overrides = [f"algorithm={ALGORITHM[cell]}", f"rounds={rounds}", f"seed={seed}", "compare=[]", *extra]
    cfg = OmegaConf.to_container(load_config("quickstart", overrides), resolve=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    if status != "interrupted":
        (folder / "summary.json").write_text(json.dumps({"status": status, "personalized_accuracy": acc,
                                                         "wall_time_s": 60.0}))
    (folder.parent / f"seed{seed}.log").write_text(f"log of {out.name}\n")
    manifest = load_manifest(out) or {"table": "tiny", "scale": "cpu", "runs": {}}
    manifest["runs"][f"{cell}/seed{seed}"] = {"status": status, "commit": f"{out.name}1", "clean": True,
                                              "revision": 1, "machine": {"platform": out.name}}
    save_manifest(out, manifest)
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _ours(out: Path, cell: str) -> tuple[int, float]:
    row = next(r for r in csv.DictReader(io.StringIO((out / "table.csv").read_text())) if r["cell"] == cell)
    return int(row["n"]), float(row["mean"])


def test_finished_runs_made_elsewhere_join_the_table_and_nothing_here_is_overwritten(tiny, tmp_path, capsys):
    here, there = tmp_path / "here", tmp_path / "there"
    _run(here, "a", 0, "completed", 0.5)
    _run(here, "b", 0, "interrupted")
    _run(there, "a", 0, "completed", 0.9)  # this folder has its own a/seed0: kept
    _run(there, "a", 1, "completed", 0.7)
    _run(there, "b", 0, "completed", 0.8)  # finished there, unfinished here
    _run(there, "b", 1, "failed", 0.1)  # a failed run is a result too
    _run(there, "b", 2, "interrupted")  # unfinished there: not taken
    _run(there, "a", 2, "completed", 0.2, rounds=3)  # not this cell's settings at this scale
    before = _files(there)

    assert flrep(["reproduce", "tiny", "--out", str(here), "--take-from", str(there)]) == 0
    out = capsys.readouterr().out
    assert "took 3 from" in out and "a/seed1, b/seed0, b/seed1" in out
    assert "kept this folder's own: a/seed0" in out
    assert "not taken: a/seed2 (was run with other values of rounds)" in out
    runs = load_manifest(here)["runs"]
    assert runs["a/seed0"]["commit"] == "here1" and runs["a/seed1"]["commit"] == "there1"
    assert runs["b/seed0"]["status"] == "completed" and runs["b/seed1"]["status"] == "failed"
    assert "b/seed2" not in runs and "a/seed2" not in runs
    assert json.loads((here / "runs/a/seed0/summary.json").read_text())["personalized_accuracy"] == 0.5
    assert (here / "runs/a/seed1.log").read_text() == "log of there\n"
    assert (here / "runs/a/seed1/config.yaml").is_file() and not (here / "runs/a/seed1/checkpoint").exists()
    moved = next((here / "runs" / "b").glob("seed0.old-*"))  # this folder's unfinished run: aside, not deleted
    assert (moved / "checkpoint" / "server.pt").read_text() == "state"
    assert _ours(here, "a") == (2, 60.0) and _ours(here, "b") == (1, 80.0)  # the report counts what came in
    assert _files(there) == before  # OTHER is only read
    # again: nothing new to take, nothing changes
    snapshot = _files(here / "runs")
    assert flrep(["reproduce", "tiny", "--out", str(here), "--take-from", str(there)]) == 0
    assert "took 0 from" in capsys.readouterr().out and _files(here / "runs") == snapshot


def test_only_takes_the_named_cells(tiny, tmp_path, capsys):
    here, there = tmp_path / "here", tmp_path / "there"
    _run(there, "a", 0, "completed", 0.5)
    _run(there, "b", 0, "completed", 0.8)
    assert flrep(["reproduce", "tiny", "--out", str(here), "--take-from", str(there), "--only", "b"]) == 0
    assert set(load_manifest(here)["runs"]) == {"b/seed0"} and not (here / "runs" / "a").exists()


def test_another_table_scale_or_the_folder_itself_is_refused_before_anything_is_written(tiny, tmp_path, capsys):
    here, there = tmp_path / "here", tmp_path / "there"
    assert flrep(["reproduce", "tiny", "--out", str(here), "--take-from", str(there)]) == 2
    assert "no reproduce.json there" in capsys.readouterr().err and not here.exists()
    _run(there, "a", 0, "completed", 0.5)
    manifest = load_manifest(there)
    save_manifest(there, {**manifest, "table": "other"})
    assert flrep(["reproduce", "tiny", "--out", str(here), "--take-from", str(there)]) == 2
    assert "is of table 'other', not 'tiny'" in capsys.readouterr().err and not here.exists()
    save_manifest(there, {**manifest, "scale": "paper"})
    assert flrep(["reproduce", "tiny", "--out", str(here), "--take-from", str(there)]) == 2
    assert "at scale 'paper', not --scale cpu" in capsys.readouterr().err and not here.exists()
    assert flrep(["reproduce", "tiny", "--out", str(there), "--take-from", str(there)]) == 2
    assert "that is --out itself" in capsys.readouterr().err


def test_a_tuning_comes_with_its_runs_unless_this_folder_chose_otherwise(tuned, tmp_path, capsys):
    here, there = tmp_path / "here", tmp_path / "there"
    record = {"table": "tiny", "cell": "a", "key": "train.lr", "grid": [0.05, 0.5], "seeds": [0], "fraction": 0.2,
              "choice": 0.5, "mean": {"0.05": 0.6, "0.5": 0.7}, "metric": "validation_accuracy"}
    (there / "tuning" / "a" / "train.lr=0.5" / "seed0").mkdir(parents=True)
    (there / "tuning" / "a" / "train.lr=0.5" / "seed0" / "summary.json").write_text('{"status": "completed"}')
    (there / "tuning" / "a.json").write_text(json.dumps(record))
    _run(there, "a", 0, "completed", 0.6, extra=("train.lr=0.5",))  # made with the tuned value
    assert flrep(["reproduce", "tiny", "--out", str(here), "--take-from", str(there)]) == 0
    assert "took 2 from" in capsys.readouterr().out  # the tuning of a, then a/seed0 with its choice
    assert json.loads((here / "tuning" / "a.json").read_text())["choice"] == 0.5
    assert (here / "tuning" / "a" / "train.lr=0.5" / "seed0" / "summary.json").is_file()
    assert "**0.5**" in (here / "table.md").read_text() and _ours(here, "a") == (1, 60.0)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "tuning").mkdir(parents=True)
    (elsewhere / "tuning" / "a.json").write_text(json.dumps({**record, "choice": 0.05}))
    assert flrep(["reproduce", "tiny", "--out", str(elsewhere), "--take-from", str(there)]) == 0
    out = capsys.readouterr().out
    assert "not taken: tuning of a (it chose 0.5, this folder 0.05: this folder's is kept)" in out
    assert "not taken: a/seed0 (was run with other values of train.lr)" in out
    assert json.loads((elsewhere / "tuning" / "a.json").read_text())["choice"] == 0.05
