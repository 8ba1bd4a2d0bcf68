"""``flrep reproduce --index``: the results page and figure generated from the committed tables."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from flower_app.cli import main as flrep
from flower_app.reproduction.index import FIGURE, PAGE, Commit, Files, markdown, rows
from flower_app.reproduction.tables import parse_table
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
{SCALES}explained:
  c.acc: a cause measured in another cell
cells:
  a: {{label: A, experiment: quickstart, paper: {{acc: 50.0, params: 1000}}}}
  b: {{label: B, experiment: quickstart, paper: {{acc: 60.0}}, columns: [acc]}}
  c: {{label: C, experiment: quickstart, paper: {{acc: 70.0}}, columns: [acc]}}
  d: {{label: D, experiment: quickstart, paper: {{acc: 80.0}}, columns: [acc]}}
  e: {{label: E, experiment: quickstart, paper: {{acc: 90.0}}, columns: [acc]}}
claims:
  - {{text: B beats A, cell: b, column: acc, op: ">", other: a}}
"""
TABLE_B = f"""title: Paper B, Figure 2
source: nowhere, Figure 2
columns:
  acc: {{key: personalized_accuracy, label: accuracy, percent: true}}
{SCALES}cells:
  x: {{label: X, experiment: quickstart, paper: {{acc: 40.0}}}}
  y: {{label: Y, experiment: quickstart}}
"""
HEADER = ("cell,label,column,metric,runs,n,mean,std,paper,difference,within_tolerance,ci95,paper_in_ci95,"
          "wall_s_per_seed,seeds")
CSV_A = "\n".join([
    HEADER,
    "a,A,acc,accuracy,3,3,51.0,0.5,50.0,,,,,1,0 1 2",             # +1.0: within 1.5 points
    "a,A,params,parameters,3,3,1010.0,0.0,1000.0,,,,,1,0 1 2",     # +1%: within 1.5% of the paper's
    "b,B,acc,accuracy,3,3,57.0,2.0,60.0,,,,,1,0 1 2",              # -3.0, the 95% interval is ± 4.97
    "c,C,acc,accuracy,3,3,75.0,0.1,70.0,,,,,1,0 1 2",              # +5.0, declared in explained:
    "d,D,acc,accuracy,1,1,85.0,0.0,80.0,,,,,1,0",                  # +5.0, one seed: open
    "e,E,acc,accuracy,0,0,,,90.0,,,,,,",                            # not run
]) + "\n"
MD_A = "| B beats A | `b.acc > a.acc` | holds (3/3 seeds) |\n"


@pytest.fixture
def tree(tmp_path):
    """A repository root with two tables: A reported (five cells, four run), B never run."""
    (tmp_path / "conf" / "tables").mkdir(parents=True)
    (tmp_path / "conf" / "tables" / "a.yaml").write_text(TABLE_A)
    (tmp_path / "conf" / "tables" / "b.yaml").write_text(TABLE_B)
    (tmp_path / "docs" / "reproduction" / "a").mkdir(parents=True)
    (tmp_path / "docs" / "reproduction" / "a" / "table.csv").write_text(CSV_A)
    (tmp_path / "docs" / "reproduction" / "a" / "table.md").write_text(MD_A)
    return tmp_path


def test_each_table_gets_its_counts_verdicts_and_a_link(tree):
    every = rows(Files(tree))
    assert [r.table.name for r in every] == ["a", "b"]
    verdicts = {f"{n.cell}.{n.column}": n.verdict for n in every[0].numbers}
    assert verdicts == {"a.acc": "within", "a.params": "within", "b.acc": "interval", "c.acc": "declared",
                        "d.acc": "open"}
    page = markdown(every)
    assert "| [Paper A, Table 1](reproduction/a/table.md) | 4/5 | 1–3 | 5 | 2 | 2 (1 CI, 1 notes) | 1 | 1/1 |" in page
    assert "| [Paper B, Figure 2](../conf/tables/b.yaml) | 0/2 | – | – | – | – | – | – |" in page
    assert "In all: 5 numbers, 2 within the tolerance, 2 explained, 1 open." in page
    assert ("- [`a`](reproduction/a/table.md): **open**: `d.acc` +5.00 (1 seed); CI: `b.acc` −3.00; "
            "notes: `c.acc` +5.00\n") in page
    assert "a cause measured in another cell" not in page  # the reason is on the table's page
    assert "`a.acc`" not in page  # a number within the tolerance is not listed


def test_flrep_reproduce_index_writes_the_page_and_the_figure(tree, monkeypatch, capsys):
    monkeypatch.setattr(config, "PROJECT_DIR", tree)
    assert flrep(["reproduce", "--index"]) == 0
    assert (tree / PAGE).read_text() == markdown(rows(Files(tree)))
    assert (tree / FIGURE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tree / FIGURE).parent.iterdir()) == ["a", "index.png"]  # no temporary file left
    assert str(tree / FIGURE) in capsys.readouterr().out


def test_an_explained_number_must_name_a_cell_and_column_with_a_paper_number():
    with pytest.raises(ConfigError, match=r"a\.yaml: explained\.e\.params needs"):
        parse_table("a", TABLE_A.replace("c.acc: a cause", "e.params: a cause"), "a.yaml")


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
    assert committed == markdown(rows(head)), (
        f"the committed {PAGE} is not what `flrep reproduce --index` makes of the committed tables: "
        "run it and commit the page and its figure")
