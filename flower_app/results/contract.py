"""The results contract of a run directory.

``config.yaml`` (resolved config), ``metrics.jsonl`` (one JSON object per round and
phase), ``summary.json`` and ``plots/*.png``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from flower_app.results.plots import plot_run
from flower_app.run.run_dir import write_text_atomic
from task.files import WriteFailed, append_line


def clean_json(value: Any) -> Any:
    """JSON-safe value (NaN/inf become null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    return value


class RunRecorder:
    """Writes a run's outputs as they happen."""

    def __init__(self, out_dir: Path, cfg: DictConfig, records: Iterable[dict[str, Any]] = ()) -> None:
        """Start ``out_dir``'s outputs; a resumed run passes the ``records`` of its checkpoint."""
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        self.metrics_path = out_dir / "metrics.jsonl"
        self.records: list[dict[str, Any]] = list(records)
        write_text_atomic(self.metrics_path, "".join(json.dumps(r) + "\n" for r in self.records))

    def log(self, record: dict[str, Any]) -> None:
        """Append one record to ``metrics.jsonl`` (a whole line or, when the write fails, nothing)."""
        record = clean_json(record)
        append_line(self.metrics_path, json.dumps(record) + "\n")
        self.records.append(record)

    def write_summary(self, summary: dict[str, Any]) -> Path:
        """Write ``summary.json``."""
        path = self.out_dir / "summary.json"
        write_text_atomic(path, json.dumps(clean_json(summary), indent=2) + "\n")
        return path

    def finish(self, summary: dict[str, Any], title: str) -> None:
        """Write the plots, then ``summary.json``. A plot that cannot be written makes the run
        failed (its reason names the file) and is raised after that summary is written."""
        try:
            plot_run(self.records, self.out_dir / "plots", title)
        except WriteFailed as err:
            summary.update(status="failed", failure_reason=str(err))
            self.write_summary(summary)
            raise
        self.write_summary(summary)
