"""docs/extending.md's first steps, run as written: copy the template, rename it, run it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[1]


def guide_commands() -> str:
    """The first bash block of docs/extending.md's plug-in section."""
    text = (APP / "docs" / "extending.md").read_text()
    section = text.split("## A plug-in", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow  # a 30-round quickstart of two variants through the simulation engine
def test_the_plugin_guides_commands_work_as_written_and_clipping_shows(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-e", "-c", guide_commands()], cwd=APP, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("|")]
    mine = next(line for line in table if "my_clip" in line)
    fedavg = next(line for line in table if "fedavg" in line and "my_clip" not in line)
    assert "0.7826" in mine and "0.8518" in fedavg, table
    assert (tmp_path / "my-experiments" / "my_clip.py").is_file()
