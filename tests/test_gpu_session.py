"""bench/gpu_session.sh, the one command of a lent GPU machine, checked on the CPU (docs/gpu.md)."""

import importlib.util
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_session.sh"
STEPS = ("wheels", "engine", "entk", "bench-round", "run", "table-cell")


def load_driver(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_session", REPO / "bench" / "gpu_session.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def rows(summary: str) -> dict[str, list[str]]:
    """The summary table's rows by step: status, wall s, figure, file."""
    table = [line.strip("|").split(" | ") for line in summary.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in table[1:]}


@pytest.mark.slow
def test_dry_run_writes_every_figure(tmp_path):
    out = tmp_path / "figures"
    done = subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--dry-run", "--out", str(out),
                           "--work", str(tmp_path / "work"), "--budget", "3600"],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert summary in done.stdout
    table = rows(summary)
    assert list(table) == list(STEPS)
    for step, (status, wall, figure, file) in table.items():
        assert status == "ok" and float(wall) >= 0, (step, status, figure)
        if step != "wheels":
            assert re.search(r"\d", figure) and (out / file).is_file(), (step, figure, file)
    assert (out / "session.log").stat().st_size > 0


def test_budget_skips_steps_that_do_not_fit(tmp_path):
    out = tmp_path / "figures"
    done = subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--dry-run", "--out", str(out),
                           "--work", str(tmp_path / "work"), "--budget", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    table = rows((out / "summary.md").read_text())
    assert list(table) == list(STEPS)
    assert all(table[s][0] == "skipped" and "left of the budget" in table[s][2] for s in STEPS[1:])


def test_parts_are_joined_and_wheels_installed(tmp_path, monkeypatch):
    """A wheel carried in parts (as Ray's, larger than one carry) is joined and installed into SITE."""
    driver = load_driver(monkeypatch)
    wheel = tmp_path / "flrep_carried-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("flrep_carried/__init__.py", "VALUE = 7\n")
        z.writestr("flrep_carried-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: flrep-carried\nVersion: 0.1\n")
        z.writestr("flrep_carried-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("flrep_carried-0.1.dist-info/RECORD", "")
    carried = tmp_path / "carried" / "deep"
    carried.mkdir(parents=True)
    data = wheel.read_bytes()
    for i, start in enumerate(range(0, len(data), 100)):
        (carried / f"{wheel.name}.part{i:02d}").write_bytes(data[start:start + 100])
    monkeypatch.setattr(driver, "NEEDED", ("flrep_carried",))
    monkeypatch.setattr(driver, "SITE", tmp_path / "site")
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(RuntimeError, match="no --wheels"):
        driver.install(None)
    assert driver.join_parts(tmp_path / "carried") == [carried / wheel.name]
    assert (carried / wheel.name).read_bytes() == data
    assert driver.install(tmp_path / "carried") == "1 wheels installed for flrep_carried"
    assert (tmp_path / "site" / "flrep_carried" / "__init__.py").read_text() == "VALUE = 7\n"
