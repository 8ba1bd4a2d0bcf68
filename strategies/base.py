"""The plug-in interface of an algorithm: its server hooks, its client handlers, its registry entry.

An algorithm is one module ``strategies/<name>.py`` that defines

- its server half: a Flower strategy that also subclasses :class:`ServerHooks`
  (``class MyServer(ServerHooks, FedAvg)``); the round loop calls Flower's
  ``configure_train``/``aggregate_train``/``configure_evaluate`` and the hooks below, and
  nothing else;
- its client half: one function per message type it answers (``train``, ``evaluate``,
  ``query.<action>``, ``train.<action>``), each ``(ClientRuntime, content) -> reply content``;
- ``ALGORITHM = Algorithm(...)``, registered with :func:`register` (one line in
  ``strategies/__init__.py``, or a call from your own code).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, Strategy
from omegaconf import DictConfig

from strategies.common import ARRAYS, METRICS, ClientRuntime
from strategies.flower_compat import checked_replies, weighted_average
from task.learning.split_model import SplitModel

if TYPE_CHECKING:
    from strategies.services import Services

ClientFn = Callable[[ClientRuntime, RecordDict], RecordDict]
KeysFn = Callable[[SplitModel, DictConfig], list[str]]

# Flower strategies sample from the nodes the server loop hands them (already sampled
# by a seeded, algorithm-independent rule), so they must take all of them.
TAKE_ALL_NODES = dict(
    fraction_train=1.0,
    fraction_evaluate=1.0,
    min_train_nodes=1,
    min_evaluate_nodes=1,
    min_available_nodes=1,
)


class WeightedAverage(FedAvg):
    """Flower's FedAvg whose average weighs each reply by its training examples or all alike
    (``train.aggregation``: examples | uniform); the training metrics are averaged the same way.

    Put it last among the bases, after any Flower subclass of FedAvg
    (``class S(ServerHooks, FedProx, WeightedAverage)``), so that their ``super()`` reaches it.
    """

    aggregation: str = "examples"

    def average_as(self, cfg: DictConfig) -> WeightedAverage:
        """Take the weights ``train.aggregation`` names; returns self."""
        self.aggregation = str(cfg.train.aggregation)
        return self

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        if self.aggregation == "examples":
            arrays, metrics = super().aggregate_train(server_round, replies)
            return dtypes_of_replies(arrays, replies), metrics
        valid, _ = checked_replies(replies, is_train=True, weighted_by_key=self.weighted_by_key)
        if not valid:
            return None, None
        contents = [RecordDict({**m.content, METRICS: MetricRecord({**m.content[METRICS], self.weighted_by_key: 1.0})})
                    for m in valid]
        return (dtypes_of_replies(weighted_average(contents, self.weighted_by_key), valid),
                self.train_metrics_aggr_fn(contents, self.weighted_by_key))


def dtypes_of_replies(arrays: ArrayRecord | None, replies: list[Message]) -> ArrayRecord | None:
    """``arrays`` with the dtypes of the replies' arrays: Flower's average makes integer buffers
    (batch norm's ``num_batches_tracked``) float64; they go back as the rounded integers."""
    sent = next((m.content[ARRAYS] for m in replies if not m.has_error() and ARRAYS in m.content), None)
    if arrays is None or sent is None:
        return arrays
    out = ArrayRecord()
    for key, array in arrays.items():
        value, dtype = array.numpy(), sent[key].numpy().dtype if key in sent else None
        if dtype is not None and value.dtype != dtype:
            value = np.asarray(np.rint(value) if np.issubdtype(dtype, np.integer) else value).astype(dtype)
        out[key] = Array(value)
    return out


def same_arrays_as_sent(message: Message) -> dict[str, ArrayRecord]:
    """The default reply template: a reply returns the ``arrays`` it was sent (if any), shape for shape."""
    return {ARRAYS: message.content[ARRAYS]} if ARRAYS in message.content else {}


class ServerHooks:
    """Every hook the round loop may call on an algorithm's server half, each with a default.

    Mix it into a Flower strategy: ``class MyServer(ServerHooks, FedAvg)``. Hooks that act
    receive the run's :class:`~strategies.services.Services`, never the loop itself.

    Checkpointed state is declared, not pickled: ``checkpointed`` names the attributes that
    hold it (numbers, strings, arrays, tensors, ArrayRecords, lists and dicts of them) and
    ``node_keyed`` the attributes keyed by node id: sets of node ids, or dicts from node id to
    plain data (stored by partition id, because a resumed run's nodes have new ids).
    """

    checkpointed: ClassVar[tuple[str, ...]] = ()
    node_keyed: ClassVar[tuple[str, ...]] = ()

    def on_start(self, services: Services) -> None:
        """Once, after the handshake and before the first round (also of a resumed run)."""

    def observe_population(self, sizes: dict[int, int]) -> None:
        """Every training client's node id -> training examples (after the handshake and each rejoin)."""

    def prepare_round(self, server_round: int, services: Services) -> dict | None:
        """Before each training round: a phase of its own (e.g. TCT's convexify step); its record or None."""
        return None

    def reply_template(self, message: Message) -> Mapping[str, ArrayRecord]:
        """The arrays (by record, key, shape and dtype) a training reply to ``message`` must carry."""
        return same_arrays_as_sent(message)

    def aggregate_skipped(self, server_round: int, replies: Iterable[Message]) -> None:
        """A round skipped for too few sound replies: absorb what the replying clients already committed."""

    def observe_failures(self, nodes: Iterable[int]) -> None:
        """Nodes whose messages failed or whose replies were rejected."""

    def has_global_model(self, server_round: int) -> bool:
        """Whether the server's arrays form a whole model to score on the global test set at this round."""
        return True

    def last_round(self, rounds: int) -> int:
        """The round the training ends with, as planned now: ``rounds``, or earlier where the
        algorithm's own schedule ends sooner (e.g. a fixed number of rounds after a phase that
        starts at a goal accuracy). Asked again after every round."""
        return rounds

    def run_failure(self, last_round: int) -> str | None:
        """After training that ended at ``last_round`` (the last round run, a protocol's rounds
        after the main phase included): why the run is not a run of this algorithm (e.g. it never
        entered its defining phase), which fails it with this reason; None for a sound run."""
        return None

    def must_evaluate(self, server_round: int) -> bool:
        """Evaluate this round whatever ``eval.every`` says."""
        return False

    def evaluate_on_server(self, server_round: int, arrays: ArrayRecord, global_idx: np.ndarray,
                           client_idx: dict[int, np.ndarray]) -> dict | None:
        """Scores of arrays that are not a model (global/per-client accuracy and loss), or None."""
        return None

    def observe_eval(self, server_round: int, record: dict, services: Services) -> None:
        """After each evaluation, with its record (keys it adds are written with it)."""

    def local_part_messages(self, server_round: int, services: Services) -> list[Message] | None:
        """New Test: the ``query.localpart`` messages asking every client for its own part (None: it has none)."""
        return None

    def summary_extra(self, records: list[dict]) -> dict:
        """Algorithm-specific summary keys computed from the run's records."""
        return {}

    def state_dict(self, pid_of: Mapping[int, int]) -> dict[str, Any]:
        """The server state a checkpoint keeps, as plain data (node ids as partition ids through ``pid_of``)."""
        state = {name: to_plain(getattr(self, name)) for name in self.checkpointed}
        for name in self.node_keyed:
            value = getattr(self, name)
            if isinstance(value, dict):
                state[name] = sorted([pid_of[n], to_plain(v)] for n, v in value.items() if n in pid_of)
            else:
                state[name] = sorted(pid_of[n] for n in value if n in pid_of)
        return state

    def renumber_nodes(self, new_of_old: Mapping[int, int]) -> None:
        """Move the ``node_keyed`` state of restarted SuperNodes (old node id -> new node id)."""
        for name in self.node_keyed:
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, {new_of_old.get(n, n): v for n, v in value.items()})
            else:
                setattr(self, name, {new_of_old.get(n, n) for n in value})

    def load_state_dict(self, state: Mapping[str, Any], node_of: Mapping[int, int]) -> None:
        """Restore :meth:`state_dict` (partition ids back to node ids through ``node_of``)."""
        for name in self.checkpointed:
            setattr(self, name, from_plain(state[name]))
        for name in self.node_keyed:
            if isinstance(getattr(self, name), dict):
                setattr(self, name, {node_of[p]: from_plain(v) for p, v in state[name] if p in node_of})
            else:
                setattr(self, name, {node_of[p] for p in state[name] if p in node_of})


_ARRAYS_TAG = "__arrayrecord__"


def to_plain(value: Any) -> Any:
    """``value`` as plain checkpoint data (an ArrayRecord becomes a tagged dict of numpy arrays)."""
    if isinstance(value, ArrayRecord):
        return {_ARRAYS_TAG: {k: a.numpy() for k, a in value.items()}}
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, np.generic)):
        return value
    raise TypeError(f"{type(value).__name__} is not plain checkpoint data; declare plain attributes in `checkpointed`")


def from_plain(value: Any) -> Any:
    """The inverse of :func:`to_plain`."""
    if isinstance(value, dict) and set(value) == {_ARRAYS_TAG}:
        return ArrayRecord({k: Array(v) for k, v in value[_ARRAYS_TAG].items()})
    if isinstance(value, dict):
        return {k: from_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class Algorithm:
    """One federated algorithm: its server half, its client handlers and its config section.

    - ``make_strategy``: builds the server half (a Flower strategy with :class:`ServerHooks`).
    - ``handlers``: the client half, by message type (``train`` is required).
    - ``shared_keys``: the model state keys the server holds and sends; None for algorithms
      without shared arrays (Local-only).
    - ``trained_global_keys``: of those, the ones that hold the federation's trained global
      weights at the end of a run, where that is fewer (LG-FedAvg's server also keeps the
      warm-start local part); None: all of ``shared_keys``. ``flrep export`` lists the rest
      as local.
    - ``config``: the structured config (a dataclass) of the algorithm's own section, or None.
    - ``section``: the config key of that section (default: the algorithm's name).
    - ``check``: cross-key rules on the merged config (raise ConfigError naming the key).
    - ``check_model``: rules that need the data and the built model.
    - ``server_opts``: the values of ``server_opt.name`` it accepts (``none``: no server optimizer).
    - ``supports_finetune``: whether ``finetune.enabled`` (+FT) applies.
    - ``load_personal``: what a client puts over the received global arrays before +FT (FedPer,
      FedRep: its own head, as the official FedRep code's final round; Local-only: its own model); None: nothing.
    - ``local_representation``: whether clients keep a local representation (fair adversarial training needs one).
    - ``trains_fair_model``: whether its clients train ``model.name=adult_fair`` with the fair objective
      (:class:`protocols.fairness.FairTraining`, whole local epochs of the whole model); refused for the others.
    - ``snapshot_after``: message types after which the client's state is snapshotted (resume).
    - ``new_test_best``: whether its clients can answer New Test with the whole model of their
      best Local Test evaluation (``new_test.models=best``: the official main_local.py's
      selection, or the algorithm's own official one, as LG-FedAvg's main_lg.py).
    - ``description``: one phrase and its paper, shown by ``flrep list`` (optional).
    - ``smoke``: the values of its own keys that make a run of ``cfg`` short for a first look
      (``smoke=true``, ``flrep run --smoke``): its warm starts, stages and inner epochs cut down;
      None: it has none beyond the core's (rounds, local epochs).

    Without an ``evaluate`` handler a client's personalized model *is* the global model, so
    the server evaluates it on every client's local test split itself (same numbers, no messages).
    """

    name: str
    make_strategy: Callable[[DictConfig], Strategy]
    handlers: Mapping[str, ClientFn]
    shared_keys: KeysFn | None
    trained_global_keys: KeysFn | None = None
    config: type | None = None
    section: str | None = None
    check: Callable[[DictConfig], None] | None = None
    check_model: Callable[[DictConfig, Any, SplitModel], None] | None = None
    server_opts: tuple[str, ...] = ("none",)
    supports_finetune: bool = False
    load_personal: Callable[[ClientRuntime], object] | None = None
    local_representation: bool = False
    trains_fair_model: bool = False
    snapshot_after: frozenset[str] = field(default_factory=lambda: frozenset({"train", "evaluate"}))
    new_test_best: bool = False
    description: str = ""
    smoke: Callable[[DictConfig], Mapping[str, Any]] | None = None

    @property
    def evaluates_on_clients(self) -> bool:
        """Whether clients evaluate their own personalized model (an ``evaluate`` handler)."""
        return "evaluate" in self.handlers


ALGORITHMS: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` to the registry (its name must be new and its handlers include ``train``)."""
    if algorithm.name in ALGORITHMS and ALGORITHMS[algorithm.name] is not algorithm:
        raise ValueError(f"an algorithm named {algorithm.name!r} is already registered")
    if "train" not in algorithm.handlers:
        raise ValueError(f"algorithm {algorithm.name!r} declares no 'train' handler")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def all_keys(model: SplitModel, cfg: DictConfig) -> list[str]:
    """Every state key: the whole model is global."""
    return list(model.state_dict())
