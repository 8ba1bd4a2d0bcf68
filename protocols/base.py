"""The interface of a paper protocol: an evaluation or phase of a paper that is not an algorithm
(+FT, new clients, New Test, the online device, fairness, linear-representation metrics).

A protocol works on the run's :class:`~strategies.services.Services`, like an algorithm's
hooks, and may answer its own message types on the clients (``handlers``). Every hook has a
default, so a protocol implements only what it adds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import Message
from omegaconf import DictConfig

from strategies.base import ClientFn
from strategies.common import ModelTraining
from strategies.services import Services


class PaperProtocol:
    """A protocol around the round loop; the loop calls these hooks on every active protocol."""

    name: str = ""
    handlers: Mapping[str, ClientFn] = {}  # client halves, by message type
    config: type | None = None  # the structured config (a dataclass) of the protocol's own section
    section: str | None = None  # the config key of that section (default: the protocol's name)

    def check(self, cfg: DictConfig) -> None:
        """Rules on the merged config (raise ConfigError naming the key)."""

    def smoke(self, cfg: DictConfig) -> Mapping[str, Any]:
        """The values of this protocol's keys that make a run of ``cfg`` short for a first look
        (``smoke=true``): its phase's epochs or rounds cut down."""
        return {}

    def client_training(self, cfg: DictConfig) -> ModelTraining | None:
        """On the clients: the local objective that replaces plain SGD in runs of ``cfg`` (the fair
        model's), or None."""
        return None

    def active(self, services: Services) -> bool:
        """Whether this run uses the protocol."""
        return False

    def clients_evaluate(self, services: Services) -> bool:
        """Whether the clients must evaluate themselves (their replies carry this protocol's metrics)."""
        return False

    def evaluate_config(self, server_round: int, services: Services) -> dict:
        """Entries added to the evaluation messages' config."""
        return {}

    def on_evaluate(self, server_round: int, record: dict, replies: list[Message], services: Services) -> None:
        """Add this protocol's metrics to an evaluation record (``replies``: the clients' evaluation replies)."""

    def ends_main_phase(self, record: dict, services: Services) -> bool:
        """After an evaluation of the main phase: whether the main training rounds end here."""
        return False

    def after_main(self, services: Services) -> None:
        """After the main training rounds (a phase with rounds of its own, checkpointed by the loop)."""

    def after_training(self, services: Services) -> dict | None:
        """After all training: a final phase; its record or None."""
        return None

    def summary(self, records: list[dict], services: Services) -> dict:
        """Summary keys of this protocol."""
        return {}

    def run_failure(self, summary: dict, services: Services) -> str | None:
        """Why the run failed by this protocol's own results (e.g. its phase learned nothing); None if it did not."""
        return None
