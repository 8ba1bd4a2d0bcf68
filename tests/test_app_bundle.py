"""The app bundle is the app (docs/deployment.md): ``flwr build`` packs the code that the ServerApp
and the ClientApps run and the experiments' configuration, nothing else, under 1 MB; unpacked
alone, it holds both apps. ``flwr run`` (and so every deployment test) sends the bundle that the
same ``fab-include`` rules make."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

APP = Path(__file__).resolve().parents[1]
RUNTIME = {".info", "pyproject.toml", "flower_app", "strategies", "task", "protocols", "conf"}


def test_the_bundle_holds_the_apps_and_their_configuration_only_and_is_under_1_mb(tmp_path):
    built = subprocess.run([sys.executable, "-m", "flwr.cli.app", "build", "--app", str(APP)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    fabs = list(tmp_path.glob("*.fab"))
    assert built.returncode == 0 and len(fabs) == 1, built.stdout + built.stderr
    assert fabs[0].stat().st_size < 1_000_000, fabs[0].stat().st_size
    with zipfile.ZipFile(fabs[0]) as fab:
        names = fab.namelist()
        fab.extractall(tmp_path / "app")
    assert {n.split("/")[0] for n in names} <= RUNTIME, sorted({n.split("/")[0] for n in names} - RUNTIME)
    assert not [n for n in names if n.startswith(("flower_app/commands/", "flower_app/reproduction/", "conf/tables/"))]
    assert "conf/base.yaml" in names and "conf/experiment/quickstart.yaml" in names
    check = ("import flower_app, flower_app.app.server_app, flower_app.app.client_app; "
             "from flower_app.run.config import load_variants; load_variants('quickstart'); print(flower_app.__file__)")
    loaded = subprocess.run([sys.executable, "-c", check], cwd=tmp_path / "app", capture_output=True, text=True,
                            timeout=300, env={"PATH": "/usr/bin:/bin", "FLREP_DATA": str(tmp_path / "data")})
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.strip() == str(tmp_path / "app" / "flower_app" / "__init__.py")
