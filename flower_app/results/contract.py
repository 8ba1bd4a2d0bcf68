"""The results contract of a run directory.

``config.yaml`` (resolved config), ``metrics.jsonl`` (one JSON object per round and
phase), ``summary.json`` and ``plots/*.png`` (``partition.png`` at the start, the others at the end).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common.logger import log
from omegaconf import DictConfig, OmegaConf

from flower_app.results.plots import plot_partition, plot_run
from flower_app.run.run_dir import write_text_atomic
from task.data.federated_data import FederatedData, label_counts
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

    def write_partition(self, data: FederatedData | None, title: str) -> None:
        """Write ``plots/partition.png`` (the clients' training labels and sizes) once per run: a resumed
        run keeps the one it has. ``data`` None (the nodes load their own data, so the server does not
        know the partition): no picture, said in the log. A picture that cannot be drawn is logged and
        the run goes on; one that cannot be written (a full disk) raises like every other result."""
        path = self.out_dir / "plots" / "partition.png"
        if data is None:
            log(INFO, "[flrep] no plots/partition.png: the nodes load their own data, so the server does not "
                "know the partition")
            return
        if path.exists():
            return
        held_out = {p: "new client" for p in data.new_clients}
        if data.online_device is not None:
            held_out[data.online_device] = "online device"
        try:
            plot_partition(label_counts(data), np.array([len(i) for i in data.client_train]), path, title, held_out)
        except WriteFailed:
            raise
        except Exception as err:  # a picture never stops a run
            log(WARNING, "[flrep] plots/partition.png was not drawn: %s: %s", type(err).__name__, err)

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
