"""The online device (LG-FedAvg Table 3): after the main phase a new device with rotated data
joins for ``online.rounds`` rounds, each with a fraction ``online.fraction`` of the original
devices; every evaluated round records the accuracy on normal data (mean over the original
devices' local tests) and on the device's rotated test set. ``online.start_accuracy`` ends the
main phase at the first evaluated round whose global accuracy reaches it. A run whose online
training loss ends no lower than in its first online round has failed (diverged or learned nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from logging import INFO
from typing import Optional

import numpy as np
from flwr.common.logger import log
from omegaconf import DictConfig

from protocols.base import PaperProtocol
from strategies.checks import nonnegative, positive, require, unit_interval
from strategies.common import fmt
from strategies.services import Services, training_phase
from task.data.sampling import sample_clients
from task.learning.metrics import final_window_mean


@dataclass
class OnlineConfig:
    """``online.*``: the online phase with the rotated device (LG-FedAvg Table 3)."""

    rounds: int = nonnegative()  # online rounds after the main phase
    fraction: float = unit_interval()  # share of the other clients sampled with the device each online round
    start_accuracy: Optional[float] = positive()  # end the main phase at this global accuracy


class OnlineDevice(PaperProtocol):
    """Online rounds with the rotated device after the main phase."""

    name = "online"
    config = OnlineConfig

    def smoke(self, cfg: DictConfig) -> dict:
        """Two online rounds, after the main phase's rounds (not at an accuracy a short run never reaches)."""
        if not cfg.data.online_device.enabled:
            return {}
        return {"online.rounds": min(int(cfg.online.rounds), 2), "online.start_accuracy": None}

    def check(self, cfg: DictConfig) -> None:
        online_on = bool(cfg.data.online_device.enabled)
        require(cfg.online.rounds == 0 or online_on, "online.rounds", "the online phase needs its device: set "
                "data.online_device.enabled=true (and count it in data.num_clients)")
        require(not online_on or cfg.online.rounds > 0, "data.online_device.enabled",
                "the online device only trains in the online phase: set online.rounds > 0")

    def active(self, services: Services) -> bool:
        return int(services.cfg.online.rounds) > 0 or services.cfg.online.start_accuracy is not None

    def ends_main_phase(self, record: dict, services: Services) -> bool:
        goal = services.cfg.online.start_accuracy
        if goal is not None and (record.get("global_accuracy") or 0.0) >= goal:
            log(INFO, "[flrep] global accuracy reached online.start_accuracy=%s at round %d", goal, record["round"])
            return True
        return False

    def after_main(self, services: Services) -> None:
        cfg, device = services.cfg, services.data.online_device
        start, rounds = services.last_main_round, int(cfg.online.rounds)
        others = math.ceil(float(cfg.online.fraction) * len(services.trainable) - 1e-9)
        for s in range(max(1, services.next_round - start), rounds + 1):  # a resumed run goes on where it stopped
            t = start + s
            pids = [device] + (sample_clients(services.trainable, others, int(cfg.seed), t) if others else [])
            services.adopt_restarted(t)
            record = services.train_round(t, pids)
            record["phase"] = training_phase("online")
            services.log(record, stamp=False)
            if not (s % int(cfg.eval.every) and s <= rounds - int(cfg.eval.final_window) and s != 1):
                self.evaluate(t, s, services)
            services.checkpoint(t)

    def evaluate(self, t: int, s: int, services: Services) -> None:
        """Online round ``s`` (round ``t``): accuracy on normal data and on the device's rotated test set."""
        device, rounds = services.data.online_device, int(services.cfg.online.rounds)
        record = services.evaluate_round(t, services.trainable + [device])
        accs = {int(k): v for k, v in record["client_accuracy"].items()}
        normal = [v for k, v in accs.items() if k != device]
        record.update(phase="online", online_round=s, normal_accuracy=float(np.mean(normal)) if normal else None,
                      rotated_accuracy=accs.get(device))
        services.log(record, track="online")
        log(INFO, "[flrep] online round %d/%d (round %d) | normal acc %s | rotated acc %s | global acc %s",
            s, rounds, t, fmt(record["normal_accuracy"]), fmt(record["rotated_accuracy"]),
            fmt(record.get("global_accuracy")))

    def summary(self, records: list[dict], services: Services) -> dict:
        online = [r for r in records if r["phase"] == "online"]
        if not online:
            return {}
        last, window = online[-1]["round"], int(services.cfg.eval.final_window)
        out = {"online_start_round": services.last_main_round, "online_rounds": online[-1]["online_round"]}
        losses = [r["train_loss"] for r in records
                  if r["phase"] == training_phase("online") and r.get("train_loss") is not None]
        if len(losses) > 1:
            out.update(online_train_loss_first=losses[0],
                       online_train_loss_final=float(np.mean(losses[-window:])))
        for key in ("normal_accuracy", "rotated_accuracy", "global_accuracy"):
            out[f"online_{key}"] = final_window_mean([r["round"] for r in online], [r.get(key) for r in online],
                                                     last, window)
        return out

    def run_failure(self, summary: dict, services: Services) -> str | None:
        """The online phase learned nothing: its training loss ended (mean of the final window) no lower
        than in its first round, as when the device's training diverges and collapses."""
        first, final = summary.get("online_train_loss_first"), summary.get("online_train_loss_final")
        if first is None or final is None or final < first:
            return None
        return (f"its online training loss ended at {final:.4f} (mean of the final window), no lower than in its first "
                f"online round ({first:.4f}): the online phase diverged or learned nothing")
