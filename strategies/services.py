"""The narrow view of a running experiment that server hooks and paper protocols work with.

The round loop implements it (:class:`flower_app.app.services.RunServices`); hooks never see the
loop itself. Everything a hook may do to the run goes through these members: talk to clients
(replies screened, failures recorded), read or replace the global arrays, evaluate on the
server's copy of the data, run or record a round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol, TypeVar

from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid
from omegaconf import DictConfig

from task.data.federated_data import FederatedData
from task.learning.split_model import SplitModel

if TYPE_CHECKING:
    from strategies.base import ServerHooks
    from strategies.evaluator import ServerEvaluator

T = TypeVar("T")
TemplateFn = Callable[[Message], Mapping[str, ArrayRecord]]

#: The phase of a training round's record in the main phase; a protocol that trains rounds after
#: it logs them under ``training_phase(<its name>)``.
TRAIN_PHASE = "train"


def training_phase(protocol: str) -> str:
    """The record phase of the training rounds that ``protocol`` runs after the main phase."""
    return f"{protocol}-{TRAIN_PHASE}"


def is_training_record(record: Mapping) -> bool:
    """Whether ``record`` is a training round's record, of the main phase or of a protocol's."""
    return record["phase"] == TRAIN_PHASE or record["phase"].endswith(f"-{TRAIN_PHASE}")


class Services(Protocol):
    """What a running experiment offers to its algorithm's hooks and to the paper protocols."""

    cfg: DictConfig  # the run's (variant's) configuration
    data: FederatedData  # the server's copy of the federated data (partitions, global test set, held-out clients)
    model: SplitModel  # the server's model object (for its structure; evaluation reloads its weights)
    evaluator: ServerEvaluator  # evaluates arrays on the server's copy of the data
    strategy: ServerHooks  # the algorithm's server half
    trainable: list[int]  # partition ids of the training clients (held-out and online clients excluded)
    records: list[dict]  # the records written so far
    last_main_round: int  # the last round of the main phase
    next_round: int  # the first round this process runs (> 1 when resumed)

    @property
    def train_sizes(self) -> dict[int, int]:
        """Training examples per partition id, as the nodes reported them."""

    @property
    def own_data(self) -> bool:
        """Whether the nodes hold their own data (then only they can score their test splits)."""

    @property
    def run_key(self) -> str:
        """A name unique to this run and variant (for files the server writes)."""

    def get_arrays(self) -> ArrayRecord:
        """The global arrays."""

    def set_arrays(self, arrays: ArrayRecord) -> None:
        """Replace the global arrays."""

    def nodes(self, pids: Iterable[int]) -> list[int]:
        """The node ids serving ``pids``."""

    def node_subset(self, pids: Iterable[int]) -> Grid:
        """A Grid that offers only the nodes of ``pids`` (for a Flower strategy's ``configure_*``)."""

    def send(self, messages: list[Message], phase: str,
             template: TemplateFn | None = None) -> tuple[list[Message], dict[int, str]]:
        """Send, screen (``template``: the arrays a reply must carry) and count ``phase``'s traffic;
        the sound replies (sorted by partition id) and why the others failed (partition id -> reason)."""

    def metric_of(self, replies: Iterable[Message], key: str) -> dict[int, float]:
        """``key`` of each reply's metrics, by partition id."""

    def progress(self, items: Iterable[T], label: str, total: int, unit: str = "client") -> Iterator[T]:
        """``items``, showing progress through them (a bar on a terminal, else a line every 30 s)."""

    def train_round(self, server_round: int, pids: list[int]) -> dict:
        """One training round of ``pids``, aggregated into the global arrays; its record."""

    def evaluate_round(self, server_round: int, pids: list[int]) -> dict:
        """Evaluate ``pids`` as the round loop does; the record."""

    def adopt_restarted(self, server_round: int) -> None:
        """Hand restarted SuperNodes (new node ids) their clients before ``server_round``."""

    def checkpoint(self, server_round: int) -> None:
        """Write the server checkpoint of ``server_round``."""

    def log(self, record: dict, track: str | None = None, stamp: bool = True) -> None:
        """Append ``record`` to the run's metrics (with traffic and elapsed time when ``stamp``;
        also to the tracker under ``track``)."""
