"""Weights & Biases logging that can never fail a run.

wandb runs offline unless ``wandb.mode`` or ``$WANDB_MODE`` says otherwise; any wandb
error (not installed, unreachable, bad key) is logged once and tracking turns itself off.
"""

from __future__ import annotations

import os
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.common.logger import log
from omegaconf import DictConfig, OmegaConf

INIT_TIMEOUT_S = 30


class Tracker:
    """Mirrors the run's metrics to wandb when enabled and reachable."""

    def __init__(self, cfg: DictConfig, out_dir: Path, name: str) -> None:
        self.run = None
        if not cfg.wandb.enabled:
            return
        mode = cfg.wandb.mode or os.environ.get("WANDB_MODE") or "offline"
        try:
            import wandb

            self.run = wandb.init(
                project=cfg.wandb.project,
                entity=cfg.wandb.entity,
                mode=mode,
                name=name,
                group=OmegaConf.select(cfg, "experiment"),
                dir=str(out_dir),
                config=OmegaConf.to_container(cfg, resolve=True),
                settings=wandb.Settings(init_timeout=INIT_TIMEOUT_S, silent=True),
                reinit="create_new",
            )
        except Exception as err:  # noqa: BLE001 - tracking must never stop a run
            self._disable(err)

    def _disable(self, err: Exception) -> None:
        log(WARNING, "wandb disabled for this run: %s", err)
        self.run = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Log scalar metrics for ``step``."""
        if self.run is None:
            return
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        try:
            self.run.log(scalars, step=step)
        except Exception as err:  # noqa: BLE001
            self._disable(err)

    def finish(self, summary: dict[str, Any]) -> None:
        """Store the summary and close the wandb run."""
        if self.run is None:
            return
        try:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
            self.run.finish()
        except Exception as err:  # noqa: BLE001
            self._disable(err)
