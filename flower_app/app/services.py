"""The round loop's implementation of :class:`strategies.services.Services`: the only view of a
running experiment that algorithm hooks and paper protocols get."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid
from omegaconf import DictConfig

from flower_app.app.federation import Federation, NodeSubset, exchange, metric_of
from flower_app.run.console import Progress
from strategies.base import ServerHooks
from strategies.evaluator import ServerEvaluator
from strategies.services import T, TemplateFn
from task.data.federated_data import FederatedData
from task.learning.split_model import SplitModel

if TYPE_CHECKING:
    from flower_app.app.experiment import Experiment


class RunServices:
    """Send/receive with reply screening and failure records, the evaluator, the trainable
    clients, get/set of the global arrays and the recorder of one :class:`Experiment`."""

    def __init__(self, experiment: Experiment) -> None:
        self._run = experiment

    @property
    def _fed(self) -> Federation:
        if self._run.fed is None:
            raise RuntimeError("the federation is not connected yet (hooks that talk to clients run after on_start)")
        return self._run.fed

    cfg: DictConfig = property(lambda self: self._run.cfg)  # type: ignore[assignment]
    data: FederatedData = property(lambda self: self._run.data)  # type: ignore[assignment]
    model: SplitModel = property(lambda self: self._run.model)  # type: ignore[assignment]
    evaluator: ServerEvaluator = property(lambda self: self._run.evaluator)  # type: ignore[assignment]
    strategy: ServerHooks = property(lambda self: self._run.strategy)  # type: ignore[assignment]
    trainable: list[int] = property(lambda self: list(self._run.trainable))  # type: ignore[assignment]
    records: list[dict] = property(lambda self: self._run.recorder.records)  # type: ignore[assignment]
    last_main_round: int = property(lambda self: self._run.last_main_round)  # type: ignore[assignment]
    next_round: int = property(lambda self: self._run.next_round)  # type: ignore[assignment]

    @property
    def train_sizes(self) -> dict[int, int]:
        return dict(self._fed.train_size)

    @property
    def own_data(self) -> bool:
        return self._fed.own_data

    @property
    def run_key(self) -> str:
        return f"{self._run.name}-{self._run.run_token}"

    @property
    def reply_timeout(self) -> float | None:
        """``faults.reply_timeout_s``: how long to wait for replies (None: until each arrives or fails)."""
        timeout = self._run.cfg.faults.reply_timeout_s
        return None if timeout is None else float(timeout)

    def get_arrays(self) -> ArrayRecord:
        return self._run.arrays

    def set_arrays(self, arrays: ArrayRecord) -> None:
        self._run.arrays = arrays

    def nodes(self, pids: Iterable[int]) -> list[int]:
        return self._fed.nodes(pids)

    def node_subset(self, pids: Iterable[int]) -> Grid:
        return NodeSubset(self._run.grid, self._fed.nodes(pids))

    def send(self, messages: list[Message], phase: str,
             template: TemplateFn | None = None) -> tuple[list[Message], dict[int, str]]:
        """Send ``messages``, screen the replies (``faults.reply_timeout_s``), tell the strategy
        which nodes failed; the sound replies and why the others failed (partition id -> reason)."""
        fed = self._fed
        with self._run.timer.phase(f"exchange: {phase}"):
            replies, failed = exchange(self._run.grid, messages, self._run.traffic, fed, phase, template,
                                       self.reply_timeout, self._run.timer)
        if failed:
            self._run.strategy.observe_failures(fed.nodes(p for p in failed if p in fed.node_of))
        return replies, failed

    def metric_of(self, replies: Iterable[Message], key: str) -> dict[int, float]:
        return metric_of(replies, self._fed, key)

    def progress(self, items: Iterable[T], label: str, total: int, unit: str = "client") -> Iterator[T]:
        progress = Progress(label, total, unit)
        try:
            for done, item in enumerate(items, 1):
                yield item
                progress.advance_to(done)
        finally:
            progress.close()

    def train_round(self, server_round: int, pids: list[int]) -> dict:
        return self._run.train_round(server_round, self._fed, pids)

    def evaluate_round(self, server_round: int, pids: list[int]) -> dict:
        return self._run.evaluate_round(server_round, self._fed, pids)

    def adopt_restarted(self, server_round: int) -> None:
        """Hand restarted SuperNodes their clients before ``server_round``."""
        self._run.adopt_restarted(server_round, self._fed)

    def checkpoint(self, server_round: int) -> None:
        """Write the server checkpoint of ``server_round``."""
        self._run.save_checkpoint(server_round, self._fed)

    def log(self, record: dict, track: str | None = None, stamp: bool = True) -> None:
        self._run.log_record(record, track, stamp)
