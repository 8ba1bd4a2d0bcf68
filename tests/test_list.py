"""``flrep list`` (the experiment catalogue, the algorithms' descriptions) and the did-you-mean
hints of unknown keys, experiments, choices and tables."""

import re

import pytest

import subprocess
import sys
import time

from flower_app.tools.catalogue import builtin_algorithms, load_catalogue, minutes
from flower_app.cli import main as flrep
from flower_app.run.config import experiment_names, load_config
from flower_app.reproduction.tables import load_table
from strategies import ALGORITHMS
from task.errors import ConfigError


def test_the_catalogue_covers_every_experiment_with_its_own_dataset():
    catalogue = load_catalogue()
    assert sorted(catalogue) == experiment_names()
    wrong = {name: (entry.dataset, load_config(name).data.name) for name, entry in catalogue.items()
             if entry.dataset != load_config(name).data.name}
    assert not wrong, f"conf/experiments.yaml dataset vs the experiment's data.name: {wrong}"


def test_list_prints_one_line_per_experiment_and_algorithm(capsys):
    assert flrep(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    catalogue = load_catalogue()
    for name, entry in catalogue.items():
        mine = [line for line in lines if line.split()[:1] == [name]]
        assert len(mine) == 1, (name, mine)
        assert re.search(rf"\s{re.escape(entry.dataset)}\s+{re.escape(minutes(entry.minutes_cpu))}\s", mine[0])
        assert entry.reproduces in mine[0]
    assert "13 min" in next(line for line in lines if line.split()[:1] == ["fedrep_cifar10_100x2"])  # GPU measured
    for name, algorithm in ALGORITHMS.items():  # every one of strategies/ has a description
        if not algorithm.make_strategy.__module__.startswith("strategies."):
            continue  # a test's plug-in
        mine = [line for line in lines if line.split()[:1] == [name]]
        assert len(mine) == 1 and algorithm.description and algorithm.description in mine[0], name


def test_the_listed_algorithms_are_the_registered_ones():
    builtin = {name: a.description for name, a in ALGORITHMS.items() if a.make_strategy.__module__.startswith("strategies.")}
    assert builtin_algorithms() == dict(sorted(builtin.items()))


def test_list_answers_in_under_a_second_without_importing_torch():
    # CPU seconds of the answer (imports included), which other work on the machine does not stretch
    script = ("import sys, time; start = time.process_time(); from flower_app.cli import main; code = main(['list']); "
              "print(code, round(time.process_time() - start, 3), 'torch' in sys.modules, file=sys.stderr)")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    code, seconds, imported = proc.stderr.split()[-3:]
    assert (code, imported) == ("0", "False") and float(seconds) < 1.0, (proc.stderr, time.monotonic() - start)


def test_minutes_read_as_seconds_minutes_or_hours():
    assert [minutes(v) for v in (0.75, 67, 330, None)] == ["45 s", "67 min", "5.5 h", "-"]


def test_a_malformed_catalogue_entry_is_named(tmp_path):
    path = tmp_path / "experiments.yaml"
    path.write_text("quickstart: {reproduces: x, dataset: digits, minutes_cpu: soon, minutes_gpu: null}\n")
    with pytest.raises(ConfigError, match="quickstart: reproduces and dataset are text"):
        load_catalogue(path)
    path.write_text("quickstart: {reproduces: x, dataset: digits}\n")
    with pytest.raises(ConfigError, match="quickstart: expected the keys"):
        load_catalogue(path)


@pytest.mark.parametrize("argv, hint", [
    (["run", "quikstart"], "did you mean `quickstart`?"),
    (["run", "quickstart", "train.lrr=0.1"], "did you mean `train.lr`?"),
])
def test_flrep_run_suggests_the_closest_name(argv, hint, capsys, monkeypatch):
    monkeypatch.setenv("FLREP_VERBOSE", "0")  # restored after: `flrep run` sets it
    assert flrep(argv) == 2
    assert capsys.readouterr().err.rstrip().endswith(hint)


@pytest.mark.parametrize("experiment, overrides, message", [
    ("quikstart", [], "unknown experiment 'quikstart'; available: .*; did you mean `quickstart`\\?$"),
    ("quickstart", ["train.lrr=0.1"], "train.lrr: unknown key; train has .*; did you mean `train.lr`\\?$"),
    ("quickstart", ["trian.lr=0.1"], "trian: unknown key; .*; did you mean `train`\\?$"),
    ("quickstart", ["algorithm=fedrepp"], "algorithm: got 'fedrepp', expected one of .*; did you mean `fedrep`\\?$"),
    ("quickstart", ["model.output=softmx"], "expected one of logits, softmax; did you mean `softmax`\\?$"),
])
def test_the_full_check_suggests_the_closest_name(experiment, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(experiment, overrides)


@pytest.mark.parametrize("experiment, overrides", [("nope", []), ("quickstart", ["zzz=1"]),
                                                   ("quickstart", ["train.batch_size=2.5"])])
def test_nothing_close_suggests_nothing(experiment, overrides):
    with pytest.raises(ConfigError) as err:
        load_config(experiment, overrides)
    assert "did you mean" not in str(err.value)


def test_an_unknown_table_suggests_the_closest():
    with pytest.raises(ConfigError, match="did you mean `lg_table1_mnist`\\?$"):
        load_table("lg_table1_mnst")
