"""``flrep reproduce --index``: the results page and figure generated from the committed tables."""

from __future__ import annotations

import json
import shutil
import subprocess
from datetime import date

import pytest

from flower_app.cli import main as flrep
from flower_app.reproduction.index import FIGURE, PAGE, Commit, Files, inventory, markdown, rows
from flower_app.reproduction import code_versions
from flower_app.reproduction.run_flags import run_flags
from flower_app.reproduction.tables import load_table, parse_table, table_names
from flower_app.results.provenance import source_hash
from flower_app.run import config
from task.errors import ConfigError

SCALES = """scales:
  paper: {note: the setting, overrides: []}
  cpu: {note: the same, overrides: []}
"""
TABLE_A = f"""title: Paper A, Table 1, with a long title
short: Paper A, Table 1
source: nowhere, Table 1
columns:
  acc: {{key: personalized_accuracy, label: accuracy, percent: true}}
  params: {{key: params_total, label: parameters}}
tolerance: 1.5
{SCALES}numbers:
  a_acc: {{value: 50.0, what: A accuracy}}
  a_params: {{value: 1000, what: A parameters}}
  b_acc: {{value: 60.0, what: B accuracy}}
  c_acc: {{value: 70.0, what: C accuracy}}
  d_acc: {{value: 80.0, what: D accuracy}}
  e_acc: {{value: 90.0, what: E accuracy}}
  f_acc: {{value: 95.0, what: F accuracy}}
  g_acc: {{value: null, what: G accuracy, not_attempted: "unreadable in our copy: the row lost a value"}}
diagnosed:
  c_acc: {{reason: the official code on our data gives 75.1, evidence: docs/reproduction/evidence/x.md}}
suspected:
  f_acc: a cause not paired with evidence
cells:
  a: {{label: A, experiment: quickstart, primary: true, paper: {{acc: a_acc, params: a_params}}}}
  a2: {{label: A at another rate, experiment: quickstart, paper: {{acc: a_acc}}, columns: [acc]}}
  b: {{label: B, experiment: quickstart, primary: true, paper: {{acc: b_acc}}, columns: [acc]}}
  c: {{label: C, experiment: quickstart, primary: true, paper: {{acc: c_acc}}, columns: [acc]}}
  d: {{label: D, experiment: quickstart, primary: true, paper: {{acc: d_acc}}, columns: [acc]}}
  e: {{label: E, experiment: quickstart, primary: true, paper: {{acc: e_acc}}, columns: [acc]}}
  f: {{label: F, experiment: quickstart, primary: true, paper: {{acc: f_acc}}, columns: [acc]}}
claims:
  - {{text: B beats A, cell: b, column: acc, op: ">", other: a}}
"""
TABLE_B = f"""title: Paper B, Figure 2
source: nowhere, Figure 2
columns:
  acc: {{key: personalized_accuracy, label: accuracy, percent: true}}
{SCALES}numbers:
  x_acc: {{value: 40.0, what: X accuracy}}
cells:
  x: {{label: X, experiment: quickstart, primary: true, paper: {{acc: x_acc}}}}
  y: {{label: Y, experiment: quickstart}}
"""
HEADER = ("cell,label,column,metric,role,number,verdict,why,runs,n,mean,std,paper,difference,within_tolerance,ci95,"
          "paper_in_ci95,wall_s_per_seed,seeds")
CSV_A = "\n".join([
    HEADER,
    "a,A,acc,accuracy,primary,a_acc,,,3,3,51.0,0.5,50.0,,,,,1,0 1 2",             # +1.0: agrees
    "a,A,params,parameters,primary,a_params,,,3,3,1010.0,0.0,1000.0,,,,,1,0 1 2",  # +1%: within 1.5% of the paper's
    "a2,A2,acc,accuracy,sensitivity,a_acc,,,3,3,40.0,0.5,50.0,,,,,1,0 1 2",        # a sensitivity row: never counted
    "b,B,acc,accuracy,primary,b_acc,,,3,3,57.0,2.0,60.0,,,,,1,0 1 2",              # -3.0, ± 4.97 reaches the band
    "c,C,acc,accuracy,primary,c_acc,,,3,3,75.0,0.1,70.0,,,,,1,0 1 2",              # +5.0, diagnosed
    "d,D,acc,accuracy,primary,d_acc,,,1,1,85.0,0.0,80.0,,,,,1,0",                  # +5.0, one seed
    "e,E,acc,accuracy,primary,e_acc,,,0,0,,,90.0,,,,,,",                            # not run
    "f,F,acc,accuracy,primary,f_acc,,,3,3,91.0,0.2,95.0,,,,,1,0 1 2",              # -4.0: differs
]) + "\n"
MD_A = "| B beats A | `b.acc > a.acc` | holds (3/3 seeds) |\n"
DEFINED = parse_table("a", TABLE_A, "a.yaml").definition
MANIFEST_A = {"table": "a", "scale": "cpu", "runs": {
    **{f"{c}/seed{s}": {"status": "completed", "commit": "abc1234", "clean": True, "definition": DEFINED(c, "cpu")}
       for c in "abcf" for s in (0, 1, 2)},
    "d/seed0": {"status": "completed", "commit": "abc1234+changes", "definition": DEFINED("d", "cpu")},
}}


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path)


def make_tree(tmp_path):
    """A repository root with two tables: A reported (seven cells, six run), B never run."""
    (tmp_path / "conf" / "tables").mkdir(parents=True)
    (tmp_path / "conf" / "tables" / "a.yaml").write_text(TABLE_A)
    (tmp_path / "conf" / "tables" / "b.yaml").write_text(TABLE_B)
    (tmp_path / "conf" / "papers.yaml").write_text(
        "papers:\n  - paper: Paper A\n    tables:\n      - {where: Table 1, table: a}\n"
        "      - {where: Table 2, count: 4, not_attempted: 'no data offline: Sent140'}\n"
        "  - paper: Paper B\n    tables:\n      - {where: Figure 2, table: b}\n")
    (tmp_path / "docs" / "reproduction" / "a").mkdir(parents=True)
    (tmp_path / "docs" / "reproduction" / "a" / "table.csv").write_text(CSV_A)
    (tmp_path / "docs" / "reproduction" / "a" / "table.md").write_text(MD_A)
    (tmp_path / "docs" / "reproduction" / "a" / "reproduce.json").write_text(json.dumps(MANIFEST_A))
    return tmp_path


def test_each_paper_number_is_judged_on_its_primary_only(tree):
    every = rows(Files(tree))
    assert [r.table.name for r in every] == ["a", "b"]
    verdicts = {n.id: n.verdict for n in every[0].numbers}
    assert verdicts == {"a_acc": "agrees", "a_params": "agrees", "b_acc": "inconclusive", "c_acc": "differs, diagnosed",
                        "d_acc": "inconclusive", "e_acc": "not attempted", "f_acc": "differs", "g_acc": "not attempted"}
    why = {n.id: n.why for n in every[0].numbers}
    assert why["d_acc"] == "1 of 3 seeds" and why["e_acc"] == "declared, not run yet"
    assert why["f_acc"] == "a cause not paired with evidence"
    assert why["g_acc"].startswith("unreadable in our copy")
    owed = {n.id: n.owed for n in every[0].numbers}
    assert owed["b_acc"] == 2 and owed["a_acc"] == 0 and owed["d_acc"] == 2  # wide intervals get seeds 3 and 4


def test_a_primary_whose_tuning_failed_everywhere_differs_and_one_not_tuned_awaits(tree):
    table = tree / "conf" / "tables" / "a.yaml"
    table.write_text(TABLE_A.replace("paper: {acc: e_acc}, columns: [acc]}",
                                     "paper: {acc: e_acc}, columns: [acc], tune: {key: train.lr, grid: [0.1, 1.0]}}"))
    why = {n.id: (n.verdict, n.why) for n in rows(Files(tree))[0].numbers}
    assert why["e_acc"] == ("not attempted", "awaits tuning: train.lr over [0.1, 1.0] on validation data "
                                             "(flrep tune a e --out docs/reproduction/a)")
    reduced = TABLE_A.replace(SCALES, "scales:\n  paper: {note: the setting, overrides: [], needs: a GPU}\n"
                                      "  cpu: {note: fewer rounds, overrides: [rounds=2]}\n")
    table.write_text(reduced.replace("paper: {acc: e_acc}, columns: [acc]}",
                                     "paper: {acc: e_acc}, columns: [acc], tune: {key: train.lr, grid: [0.1, 1.0]}}"))
    why = {n.id: (n.verdict, n.why) for n in rows(Files(tree))[0].numbers}
    assert why["e_acc"] == ("not attempted", "awaits tuning: train.lr over [0.1, 1.0] on validation data "
                                             "(flrep tune a e --scale paper --out DIR); "
                                             "the paper's scale needs a GPU")
    record = {"key": "train.lr", "grid": [0.1, 1.0], "seeds": [0], "fraction": 0.2, "choice": None,
              "mean": {"0.1": None, "1.0": None}}
    (tree / "docs" / "reproduction" / "a" / "tuning").mkdir()
    (tree / "docs" / "reproduction" / "a" / "tuning" / "e.json").write_text(json.dumps(record))
    why = {n.id: (n.verdict, n.why) for n in rows(Files(tree))[0].numbers}
    assert why["e_acc"] == ("differs", "every value of its tuning of train.lr failed (tuning/e.json): nothing to run")


def test_a_primary_whose_seeds_failed_differs_and_owes_no_seed_it_ran(tree):
    manifest_path = tree / "docs" / "reproduction" / "a" / "reproduce.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["runs"].update({f"e/seed{k}": {"status": "failed"} for k in range(3)})
    manifest_path.write_text(json.dumps(manifest))
    e = next(n for n in rows(Files(tree))[0].numbers if n.id == "e_acc")
    assert (e.verdict, e.owed) == ("differs", 0) and e.why.startswith("its runs failed (seed 0, 1, 2")


def test_the_page_counts_every_printed_number_with_the_five_verdicts(tree):
    source = Files(tree)
    every = rows(source)
    page = markdown(every, inventory(source, every))
    # 8 numbers of table a, 1 of b, 4 of a part no table covers: 13 printed
    assert ("**13 printed numbers** ([inventory](#what-the-papers-print)): 6 attempted, of which **2 agree**, "
            "1 differ with a diagnosis, 1 differ, 2 are inconclusive; 7 not attempted (no data offline: 4; "
            "declared, not run yet: 2; unreadable in our copy: 1).") in page
    assert "| [Paper A, Table 1](reproduction/a/table.md) | 8 | 2 | 1 | 1 | 2 | 2 | 4 | 1 | 1/1 |" in page
    assert "| [Paper B, Figure 2](../conf/tables/b.yaml) | 1 | 0 | 0 | 0 | 0 | 1 | 0 | 0 | – |" in page
    assert "| Paper A | Table 2 | 4 | not attempted: no data offline: Sent140 |" in page
    assert "| [`a`](reproduction/a/table.md) | B beats A | **holds** (3/3 seeds) |" in page
    assert "flags: changed tree (1)" in page
    assert "`a2" not in page  # a sensitivity row is never counted


def test_flags_say_what_a_reviewer_should_know_about_a_primarys_runs(tree):
    table = parse_table("a", TABLE_A, "a.yaml")
    now = table.definition("b", "cpu")
    runs = {f"b/seed{s}": {"status": "completed", "commit": c, "definition": d}
            for s, c, d in ((0, "abc1234", "0ld0ld0ld0ld"), (1, "def5678", now), (2, "def5678", now))}
    flags = run_flags(table, "b", "cpu", [0, 1, 2], {"runs": runs}, None)
    assert flags == ("seeds from 2 code versions", "definition changed after its first run")
    recorded = {"modules": ["task/x.py"], "hash": source_hash(["task/x.py"], lambda p: "old text")}
    runs = {f"b/seed{s}": {"status": "completed", "commit": "abc1234", "definition": now, "source": recorded}
            for s in (0, 1, 2)}
    assert run_flags(table, "b", "cpu", [0, 1, 2], {"runs": runs}, None) == ()
    (tree / "task").mkdir()
    (tree / "task" / "x.py").write_text("new text")
    assert run_flags(table, "b", "cpu", [0, 1, 2], {"runs": runs}, Files(tree).text) == ("code changed since",)


def _same_numbers(tree, commits: dict[str, dict[str, str]]) -> None:
    """A same_numbers.json against the tree's reference files: {commit: {case: result}}; case "fedavg" is of
    algorithm fedavg in experiment quickstart, "fedrep" of fedrep there, "fair" of lg_fedavg in experiment fair."""
    baseline = tree / "docs" / "behaviour-baseline"
    baseline.mkdir(parents=True, exist_ok=True)
    covers = {"fedavg": ("fedavg", "quickstart"), "fedrep": ("fedrep", "quickstart"), "fair": ("lg_fedavg", "fair")}
    for name in covers:
        (baseline / f"{name}.json").write_text(f'{{"recorded": "{name}"}}')
    record = {"code": code_versions.code_hashes(["task/x.py"], Files(tree).text),
              "commits": {c: {"checked": "2026-12-06", "cases": {
                  name: {"algorithm": covers[name][0], "experiment": covers[name][1], "result": result, "detail": "",
                         "reference": code_versions.reference_hash(name, Files(tree).text)}
                  for name, result in cases.items()}} for c, cases in commits.items()}}
    (tree / code_versions.RECORD).parent.mkdir(parents=True, exist_ok=True)
    (tree / code_versions.RECORD).write_text(json.dumps(record))


def test_commits_that_give_the_numbers_of_now_are_the_code_now(tree):
    table = parse_table("a", TABLE_A, "a.yaml")
    now = table.definition("b", "cpu")
    old = {"modules": ["task/x.py"], "hash": source_hash(["task/x.py"], lambda p: "old text")}
    (tree / "task").mkdir()
    (tree / "task" / "x.py").write_text("new text")
    runs = {f"b/seed{s}": {"status": "completed", "commit": c, "definition": now, "source": old}
            for s, c in ((0, "abc1234"), (1, "def5678"), (2, "def5678"))}
    summaries = []
    for s in (0, 1, 2):
        folder = tree / "docs" / "reproduction" / "a" / "runs" / "b" / f"seed{s}"
        folder.mkdir(parents=True)
        summaries.append(folder / "summary.json")
        summaries[-1].write_text('{"algorithm": "fedavg", "experiment": "fair"}')
    flags = ("seeds from 2 code versions", "code changed since")
    ran = {"runs": runs}
    assert run_flags(table, "b", "cpu", [0, 1, 2], ran, Files(tree).text) == ("code changed since",)
    every = {"fedavg": "same", "fair": "same"}
    _same_numbers(tree, {"abc1234": {**every, "fedrep": "differs"}, "def5678": every})
    assert run_flags(table, "b", "cpu", [0, 1, 2], ran, Files(tree).text) == ()  # fedrep's change is not fedavg's
    _same_numbers(tree, {"abc1234": {**every, "fair": "not run"}, "def5678": every})
    assert run_flags(table, "b", "cpu", [0, 1, 2], ran, Files(tree).text) == flags[1:]  # its protocol unchecked
    _same_numbers(tree, {"abc1234": {**every, "fair": "differs"}, "def5678": every})
    assert run_flags(table, "b", "cpu", [0, 1, 2], ran, Files(tree).text) == flags[1:]
    _same_numbers(tree, {"abc1234": {"fedavg": "differs", "fair": "same"}, "def5678": every})
    assert run_flags(table, "b", "cpu", [0, 1, 2], ran, Files(tree).text) == flags[1:]
    _same_numbers(tree, {"abc1234": {"fedavg": "not run", "fair": "same"}, "def5678": every})
    assert run_flags(table, "b", "cpu", [0, 1, 2], ran, Files(tree).text) == flags[1:]  # no fedavg case ran
    runs["b/seed0"]["source"] = {"modules": ["task/x.py"], "hash": source_hash(["task/x.py"], lambda p: "other")}
    _same_numbers(tree, {"abc1234": {**every, "fedavg": "differs"}, "def5678": every})
    assert run_flags(table, "b", "cpu", [0, 1, 2], ran, Files(tree).text) == flags
    _same_numbers(tree, {"abc1234": every, "def5678": every})
    assert run_flags(table, "b", "cpu", [0, 1, 2], ran, Files(tree).text) == ()
    (tree / "task" / "x.py").write_text("newer text")  # a module the runs executed changed since the check
    assert run_flags(table, "b", "cpu", [0, 1, 2], ran, Files(tree).text) == flags
    _same_numbers(tree, {"abc1234": every, "def5678": every})
    for s in (0, 1, 2):
        del runs[f"b/seed{s}"]["source"]  # runs that recorded no modules: every module of the record must be as checked
    assert run_flags(table, "b", "cpu", [0, 1, 2], ran, Files(tree).text) == ()
    (tree / "task" / "x.py").write_text("newest text")
    assert run_flags(table, "b", "cpu", [0, 1, 2], ran, Files(tree).text) == ("seeds from 2 code versions",)
    _same_numbers(tree, {"abc1234": {**every, "fedrep": "same"}, "def5678": every})
    (tree / "docs" / "behaviour-baseline" / "fedrep.json").write_text('{"recorded": 3}')  # another case re-recorded
    assert run_flags(table, "b", "cpu", [0, 1, 2], ran, Files(tree).text) == ()
    (tree / "docs" / "behaviour-baseline" / "fedavg.json").write_text('{"recorded": 3}')  # its algorithm's case
    assert run_flags(table, "b", "cpu", [0, 1, 2], ran, Files(tree).text) == ("seeds from 2 code versions",)
    _same_numbers(tree, {"abc1234": every, "def5678": every})
    (tree / "docs" / "behaviour-baseline" / "fair.json").write_text('{"recorded": 3}')  # its experiment's case
    assert run_flags(table, "b", "cpu", [0, 1, 2], ran, Files(tree).text) == ("seeds from 2 code versions",)


@pytest.mark.parametrize("edit, error", [
    (("  a2: {label: A at another rate, experiment: quickstart, paper",
      "  a2: {label: A at another rate, experiment: quickstart, primary: true, paper"),
     r"numbers\.a_acc needs exactly one primary cell\.column \(or a not_attempted reason\); it has 2: a\.acc, a2\.acc"),
    (("  e: {label: E, experiment: quickstart, primary: true,", "  e: {label: E, experiment: quickstart,"),
     r"numbers\.e_acc needs exactly one primary cell\.column .* it has 0"),
    (("paper: {acc: b_acc}", "paper: {acc: b_ac}"), r"cells\.b\.paper\.acc is 'b_ac'; expected the id .*did you mean `b_acc`"),
    (("g_acc: {value: null, what: G accuracy, not_attempted: \"unreadable in our copy: the row lost a value\"}",
      "g_acc: {value: null, what: G accuracy}"), r"numbers\.g_acc\.value is null: a number our copy lost needs a not_attempted"),
    (("diagnosed:\n  c_acc: {reason: the official code on our data gives 75.1, evidence: docs/reproduction/evidence/x.md}",
      "diagnosed:\n  c_acc: the official code on our data gives 75.1"), r"diagnosed\.c_acc needs .*evidence"),
    (("suspected:", "explained:\n  c.acc: why\nsuspected:"), r"explained is no longer a key"),
])
def test_a_table_attaches_each_paper_number_to_exactly_one_primary(edit, error):
    with pytest.raises(ConfigError, match=error):
        parse_table("a", TABLE_A.replace(*edit), "a.yaml")


def test_every_table_file_attaches_each_paper_number_to_exactly_one_primary_and_its_evidence_exists():
    for name in table_names():
        table = load_table(name)  # the parse refuses a number with no primary, or two
        for number in table.numbers.values():
            assert (number.not_attempted is None) == (table.primary_of(number.id) is not None), (name, number.id)
        for ref, diagnosis in table.diagnosed.items():
            assert (config.PROJECT_DIR / diagnosis.evidence).is_file(), f"{name}: diagnosed.{ref}: no {diagnosis.evidence}"


def test_flrep_reproduce_index_writes_the_page_and_the_figure(tree, monkeypatch, capsys):
    monkeypatch.setattr(config, "PROJECT_DIR", tree)
    assert flrep(["reproduce", "--index"]) == 0
    every = rows(Files(tree))
    assert (tree / PAGE).read_text() == markdown(every, inventory(Files(tree), every))
    assert (tree / FIGURE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tree / FIGURE).parent.iterdir()) == ["a", "index.png"]  # no temporary file left
    assert str(tree / FIGURE) in capsys.readouterr().out


def test_the_committed_page_is_what_the_index_makes_of_the_committed_tables():
    """Read from HEAD, not the working tree: a table being run beside the tests cannot change the answer,
    and a fresh clone (CI) checks exactly what was committed."""
    root = config.PROJECT_DIR
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                                                     capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: the committed page cannot be read")
    head = Commit(root)
    committed = head.text(PAGE)
    assert committed is not None, f"{PAGE} is not committed"
    every = rows(head)
    assert committed == markdown(every, inventory(head, every)), (
        f"the committed {PAGE} is not what `flrep reproduce --index` makes of the committed tables: "
        "run it and commit the page and its figure")


BENCH = f"""title: A benchmark
short: Bench
source: no paper
columns:
  acc: {{key: personalized_accuracy, label: accuracy, percent: true}}
rank: {{column: acc}}
{SCALES}cells:
  p: {{label: P, experiment: quickstart}}
  q: {{label: Q, experiment: quickstart}}
  r: {{label: R, experiment: quickstart}}
"""


def test_a_benchmark_is_listed_apart_with_the_cells_its_page_puts_on_top(tree):
    (tree / "conf" / "tables" / "bench.yaml").write_text(BENCH)
    folder = tree / "docs" / "reproduction" / "bench"
    folder.mkdir()
    (folder / "table.csv").write_text("\n".join([
        HEADER, "p,P,acc,accuracy,sensitivity,,,,3,3,80.0,1.0,,,,,,1,0 1 2",
        "q,Q,acc,accuracy,sensitivity,,,,2,2,79.0,1.0,,,,,,1,0 1", "r,R,acc,accuracy,sensitivity,,,,0,0,,,,,,,,,"]) + "\n")
    (folder / "table.md").write_text("## Ranking by accuracy\n\nNot significantly below the first: `p`, `q`.\n")
    page = markdown(rows(Files(tree)), [])
    assert "| [Bench](reproduction/bench/table.md) | 2 of 3 | 2–3 | `p`, `q` |" in page
    assert "| [Bench]" not in page.split("## Benchmarks")[0]  # not among the paper tables


def test_every_link_of_the_committed_index_names_a_file_of_the_repository():
    import re

    page = (config.PROJECT_DIR / PAGE).read_text()
    targets = {t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", page) if "://" not in t}
    missing = [t for t in sorted(targets) if t and not ((config.PROJECT_DIR / PAGE).parent / t).exists()]
    assert targets and not missing, f"{PAGE} links to files that do not exist: {missing}"


def test_a_difference_in_numbers_is_found_and_a_metric_only_one_side_reports_is_not():
    from tests.behaviour_baseline import difference
    assert difference({"a": 1.0, "added_since": 2}, {"a": 1.0, "renamed": 3}, exact=True) == ""
    assert difference({"a": 0.49639856614338934}, {"a": 0.49639855214970885}, exact=True) != ""  # 85fe1a3's change
    assert difference({"r": [{"a": 1.0}]}, {"r": [{"a": 1.1}]}, exact=True) == "/r[0]/a: recorded 1.0, then 1.1"
    assert difference({"r": [1, 2]}, {"r": [1]}, exact=True) == "/r: 2 vs 1 items"
    assert difference({"status": "completed"}, {"status": "failed"}, exact=True) != ""
    assert difference({"a": float("nan")}, {"a": float("nan")}, exact=True) == ""


def test_the_check_takes_numbers_within_its_tolerance_and_names_a_missing_key():
    from tests.behaviour_baseline import difference, same
    assert same({"a": 1.0, "r": [2.0]}, {"a": 1.0 + 2e-6, "r": [2.0]}) and not same({"a": 1.0}, {"a": 1.001})
    assert difference({"a": 1.0, "b": 2}, {"a": 1.0}) == "/b: only in recorded"
    assert difference({"a": 1.0}, {"a": 1.0, "c": 3}) == "/c: only in now"
    assert difference({"r": [{"a": 1.0}]}, {"r": [{"a": 1.1}]}) == "/r[0]/a: recorded 1.0, now 1.1"


def test_same_numbers_on_chosen_cases_rechecks_them_and_keeps_the_others(tmp_path, monkeypatch):
    import tests.behaviour_baseline as baseline
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "x.py").write_text("code")
    folder = tmp_path / code_versions.BASELINE
    folder.mkdir(parents=True)
    for name in ("fedavg", "lg_fair_adult"):
        (folder / f"{name}.json").write_text(f'{{"recorded": "{name}"}}')
    old = {"algorithm": "lg_fedavg", "experiment": "lg_fair_adult", "result": "same", "detail": "", "reference": "old"}
    kept = {"algorithm": "fedavg", "experiment": "quickstart", "result": "same", "detail": "", "reference": "r"}
    record = {"code": code_versions.code_hashes(["task/x.py"], Files(tmp_path).text),
              "commits": {"abc1234": {"checked": "2026-12-01", "cases": {"fedavg": kept, "lg_fair_adult": old}}}}
    (tmp_path / code_versions.RECORD).parent.mkdir(parents=True)
    (tmp_path / code_versions.RECORD).write_text(json.dumps(record))
    monkeypatch.setattr(baseline, "ROOT", tmp_path)
    monkeypatch.setattr(baseline, "app_modules", lambda root: ["task/x.py"])
    monkeypatch.setattr(baseline, "short_commit", lambda rev: rev)
    monkeypatch.setattr(baseline, "outputs_in", lambda tree, cases: {n: {"result": {"a": 1.0}} for n in cases})
    monkeypatch.setattr(baseline, "outputs_at", lambda rev, cases: {n: {"result": {"a": 1.5}} for n in cases})
    assert baseline.same_numbers(["--cases", "no_such_case", "abc1234"]) == 2
    assert json.loads((tmp_path / code_versions.RECORD).read_text()) == record  # nothing written
    assert baseline.same_numbers(["--cases", "lg_fair_adult", "abc1234"]) == 0
    cases = json.loads((tmp_path / code_versions.RECORD).read_text())["commits"]["abc1234"]["cases"]
    assert cases["fedavg"] == kept
    assert cases["lg_fair_adult"]["result"] == "differs" and cases["lg_fair_adult"]["detail"] == "/a: recorded 1.0, then 1.5"
    assert cases["lg_fair_adult"]["reference"] == code_versions.reference_hash("lg_fair_adult", Files(tmp_path).text)
    entry = json.loads((tmp_path / code_versions.RECORD).read_text())["commits"]["abc1234"]
    assert entry["checked"] == "2026-12-01" and cases["lg_fair_adult"]["checked"] == date.today().isoformat()


@pytest.fixture
def one_module_tree(tmp_path, monkeypatch):
    """``tests.behaviour_baseline`` on a tree whose app is the one module ``task/x.py``, on "this cpu"."""
    import tests.behaviour_baseline as baseline
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "x.py").write_text("code")
    (tmp_path / code_versions.RECORD).parent.mkdir(parents=True)
    monkeypatch.setattr(baseline, "ROOT", tmp_path)
    monkeypatch.setattr(baseline, "app_modules", lambda root: ["task/x.py"])
    monkeypatch.setattr(baseline, "machine", lambda: "this cpu")
    return baseline


def test_a_code_change_that_gives_every_cases_numbers_carries_the_record_over_and_any_other_empties_it(
        one_module_tree, tmp_path, monkeypatch, capsys):
    baseline = one_module_tree
    monkeypatch.setattr(baseline, "CASES", {"fedavg": baseline.CASES["fedavg"]})
    numbers = {"a": 1.0}
    monkeypatch.setattr(baseline, "outputs_in", lambda tree, cases: {n: {"result": dict(numbers)} for n in cases})
    checked = {"abc1234": {"checked": "2026-12-01", "cases": {"fedavg": {"result": "same"}}}}

    def recorded_against(code: str, machine: str = "this cpu") -> None:
        (tmp_path / "task" / "x.py").write_text(code)
        record = {"code": code_versions.code_hashes(["task/x.py"], Files(tmp_path).text), "commits": checked,
                  "machine": machine, "outputs": baseline.output_digests({"fedavg": {"result": {"a": 1.0}}})}
        (tmp_path / code_versions.RECORD).write_text(json.dumps(record))
        (tmp_path / "task" / "x.py").write_text("code, edited")

    def record_now() -> dict:
        return json.loads((tmp_path / code_versions.RECORD).read_text())

    recorded_against("code")
    assert baseline.main(["same-numbers"]) == 0  # no commit: only the carry-over
    assert record_now()["commits"] == checked and "its 1 commits carry over" in capsys.readouterr().out
    assert record_now()["code"] == code_versions.code_hashes(["task/x.py"], Files(tmp_path).text)
    numbers["a"] = 1.0 + 1e-12  # the edit changed a number
    recorded_against("code")
    assert baseline.same_numbers([]) == 0
    assert record_now()["commits"] == {} and "same-numbers abc1234" in capsys.readouterr().out
    numbers["a"] = 1.0
    recorded_against("code", machine="another cpu")  # the same numbers, but compared on another machine
    assert baseline.same_numbers([]) == 0
    assert record_now()["commits"] == {} and record_now()["machine"] == "this cpu"


def test_a_record_lacking_some_cases_numbers_runs_every_case_so_the_next_code_change_can_carry_it_over(
        one_module_tree, tmp_path, monkeypatch, capsys):
    baseline = one_module_tree
    monkeypatch.setattr(baseline, "CASES", {n: baseline.CASES[n] for n in ("fedavg", "lg_fair_adult")})
    ran = []
    monkeypatch.setattr(baseline, "outputs_in", lambda tree, cases: ran.append(sorted(cases)) or
                        {n: {"result": {"a": 1.0}} for n in cases})
    checked = {"abc1234": {"checked": "2026-12-01", "cases": {"fedavg": {"result": "same"}}}}
    code = code_versions.code_hashes(["task/x.py"], Files(tmp_path).text)
    incomplete = {"code": code, "commits": checked, "machine": "this cpu",
                  "outputs": baseline.output_digests({"fedavg": {"result": {"a": 1.0}}})}  # lg_fair_adult's missing
    (tmp_path / code_versions.RECORD).write_text(json.dumps(incomplete))
    (tmp_path / "task" / "x.py").write_text("code, edited")
    assert baseline.same_numbers([]) == 0  # it cannot carry over: nothing says what lg_fair_adult gave before
    assert "the record lacks the numbers of lg_fair_adult on this machine: the record starts empty" in capsys.readouterr().out
    (tmp_path / "task" / "x.py").write_text("code")
    (tmp_path / code_versions.RECORD).write_text(json.dumps(incomplete))
    ran.clear()
    assert baseline.same_numbers(["--cases", "fedavg"]) == 0  # the code of the record: every case runs
    assert ran == [["fedavg", "lg_fair_adult"]]
    assert set(json.loads((tmp_path / code_versions.RECORD).read_text())["outputs"]) == {"fedavg", "lg_fair_adult"}
    (tmp_path / "task" / "x.py").write_text("code, edited")
    assert baseline.same_numbers([]) == 0
    assert "its 1 commits carry over" in capsys.readouterr().out


def test_a_commit_runs_the_cases_of_now_with_its_own_code(monkeypatch):
    import tests.behaviour_baseline as baseline
    monkeypatch.setattr(baseline, "CASES", {"fedavg": baseline.CASES["fedavg"],
                                             "unknown": ("quickstart", "algorithm=no_such_algorithm")})
    then = baseline.outputs_at("HEAD")
    now = baseline.outputs_in(baseline.ROOT)
    assert "no_such_algorithm" in then["unknown"]["error"] and "error" in now["unknown"]
    assert baseline.difference(now["fedavg"]["result"], then["fedavg"]["result"], exact=True) == ""
    assert then["fedavg"]["result"]["."]["summary"]["algorithm"] == "fedavg"
