"""What ``resume=`` names, checked in a command's first second (nothing heavy imported, nothing
written): a folder that exists, and the same folder as ``--out`` (or ``out_dir=``) when both are
given; and whether the run there completed (then it is left exactly as it is).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from flower_app.run.run_dir import read_summary
from task.errors import ConfigError

_NONE = (None, "", "null", "None")


def _last(overrides: list[str], key: str) -> str | None:
    """The value of the last ``key=value`` override (the one that counts), or None."""
    values = [value for name, _, value in (o.partition("=") for o in overrides) if name.strip() == key]
    return values[-1].strip() if values else None


def check_target(overrides: Iterable[str], out: str | None) -> None:
    """A ConfigError when ``resume=`` names a folder that does not exist, or another folder than
    ``out`` (``--out``) or ``out_dir=``."""
    overrides = list(overrides)
    value = _last(overrides, "resume")
    if value in _NONE:
        return
    target = Path(value).expanduser().resolve()
    other, option = (out, "--out") if out else (_last(overrides, "out_dir"), "out_dir=")
    if other not in _NONE and Path(other).expanduser().resolve() != target:
        raise ConfigError(f"resume={target} and {option} {Path(other).expanduser().resolve()} name two folders; "
                          f"a resumed run goes on in its own folder: drop {option}, or resume the run in the other")
    if not target.is_dir():
        raise ConfigError(f"nothing to resume at {target}: no such folder (start a new run there with --out {target})")


def completed(folder: Path) -> bool:
    """Whether the run in ``folder`` completed (its summary says so): ``resume=`` has nothing to do."""
    return (read_summary(folder) or {}).get("status") == "completed"
