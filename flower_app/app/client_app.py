"""The ClientApp: routes each message to the handler the run's algorithm (or a paper protocol) declares for its type.

Per worker process it caches what does not change between messages: the merged config,
the federated dataset as tensors on the device, and the model object with the run's
common initial weights.
"""

from __future__ import annotations

import copy
import functools
import time
import zlib
from collections.abc import Iterator

import numpy as np
import torch
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.client_app import DEFAULT_ACTION
from omegaconf import DictConfig

from flower_app.app.client_checkpoint import snapshot_mod
from flower_app.app.elision import PROCESS, PROCESS_ID, elision_mod
from flower_app.app.federation import mark_node
from flower_app.run.flat_config import experiment_of, overrides_of
from flower_app.run.config import head_groups, initial_model, pick_device, run_config_of
from flower_app.app.timing import stamp
from protocols import PROTOCOLS
from strategies import ALGORITHMS
from strategies.common import ARRAYS, ClientRuntime, reply, round_config
from strategies.state_store import NODE_CACHE, in_simulation, on_cluster
from task.learning.engine import TensorData, derived_seed, fast_layout, precision, seed_global_generators
from task.learning.fairness import attribute_matrix
from task.errors import ConfigError
from task.data.datasets.images import ImageArray
from task.data.federated_data import FederatedData, build_federated_data
from task.data.partition_cache import check_partition_id, client_data
from task.data.node_data import check_node_data, load_node_data

app = ClientApp(mods=[elision_mod, snapshot_mod])

PROTOCOL_HANDLERS = {kind: fn for protocol in PROTOCOLS for kind, fn in protocol.handlers.items()}


_device_data: dict[int, tuple] = {}


def _tensors(bundle, device: torch.device) -> tuple[TensorData, TensorData]:
    """The train/test arrays of ``bundle`` as tensors on ``device`` (uint8 images stay uint8)."""
    return tuple(
        (TensorData.stored_images if isinstance(split.x, ImageArray) else TensorData.from_arrays)(
            split.x, split.y, device, attribute_matrix(split.attributes))
        for split in (bundle.train, bundle.test))


def _data_on_device(fed, device: torch.device) -> tuple[TensorData, TensorData]:
    """The full train/test arrays of ``fed``'s shared dataset on ``device`` (once per dataset and
    process: every variant and client of a simulation worker slices the same tensors)."""
    key = id(fed.bundle)
    if key not in _device_data:
        _device_data[key] = (fed.bundle, *_tensors(fed.bundle, device))  # the bundle is kept so its id stays unique
    return _device_data[key][1], _device_data[key][2]


def _own_data(cfg, data_path: str) -> FederatedData:
    """A SuperNode's own dataset (node config ``data-path``) as a one-client federation."""
    bundle = load_node_data(cfg.data, data_path)
    return FederatedData(bundle, [np.arange(len(bundle.train))], [np.arange(len(bundle.test))],
                         global_test=np.arange(0), new_clients=[])


@functools.lru_cache(maxsize=16)
def _variant_config(experiment: str, overrides: str, label: str | None, state_dir: str | None) -> DictConfig:
    """The merged config of a run variant. A deployed node keeps its data caches on its own disk (its
    ``state-dir``/cache, else its user's ``~/.cache/flrep``), not under the run config's ``data.cache_dir``."""
    cfg = run_config_of({"experiment": experiment, "overrides": overrides}, label)
    if not in_simulation():
        cfg = copy.deepcopy(cfg)
        cfg.data.cache_dir = str(Path(state_dir).expanduser() / "cache" if state_dir else NODE_CACHE.expanduser())
    return cfg


_models: dict[tuple, tuple] = {}


def _variant_model(variant: tuple, cfg: DictConfig, bundle, device: torch.device,
                   data: list[TensorData]) -> tuple:
    """The model of a run variant on ``device``, its head groups and its initial weights: built once per
    variant (and input shape and classes), whichever partitions this process serves; ``data`` is given
    the model's memory layout (:func:`fast_layout`)."""
    key = (*variant, tuple(bundle.input_shape), int(bundle.num_classes))
    if key in _models:
        fast_layout(_models[key][0], data)
        return _models[key]
    model = initial_model(cfg, bundle).to(device)
    fast_layout(model, data)  # before the initial weights are taken: they keep the model's layout
    _models[key] = model, head_groups(cfg, model), {k: v.detach().clone() for k, v in model.state_dict().items()}
    return _models[key]


@functools.cache
def _worker_cache(experiment: str, overrides: str, label: str | None, data_path: str | None,
                  state_dir: str | None = None, partition: int | None = None):
    """Config, data tensors on the device, model and initial weights (per process, variant and data).
    A node given a ``partition`` (a deployed node without ``data-path``, or a node of ``flwr run``'s
    simulation) reads only that client's data from its partition cache (:mod:`task.data.partition_cache`):
    a process serving many such nodes keeps an entry for each, all sharing their variant's config and model."""
    cfg = _variant_config(experiment, overrides, label, state_dir)
    torch.set_num_threads(max(1, int(cfg.simulation.client_cpus)))
    device = pick_device(cfg)
    if data_path:
        fed = _own_data(cfg, data_path)
    elif partition is not None:
        fed = client_data(cfg.data, int(cfg.seed), partition, Path(str(cfg.data.cache_dir)).expanduser())
    else:
        fed = build_federated_data(cfg.data, int(cfg.seed))
    # a node's own data or partition belongs to this cache entry alone
    train, test = _tensors(fed.bundle, device) if data_path or partition is not None else _data_on_device(fed, device)
    model, head, initial = _variant_model((experiment, overrides, label, state_dir), cfg, fed.bundle, device,
                                          [train, test])
    return cfg, fed, train, test, model, head, initial, device


def runtime_for(context: Context, content: RecordDict | None = None) -> ClientRuntime:
    """This client's runtime for the run variant named in ``content`` (default: the first)."""
    rc = context.run_config
    label = round_config(content).get("variant") if content is not None else None
    if "partition-id" not in context.node_config:
        raise ConfigError("node config: partition-id is missing (start the SuperNode with "
                          "--node-config \"partition-id=<i> data-path=<dir>\")")
    data_path = str(context.node_config["data-path"]) if "data-path" in context.node_config else None
    state_dir = str(context.node_config["state-dir"]) if "state-dir" in context.node_config else None
    pid = int(context.node_config["partition-id"])
    one_client = data_path is None and not in_simulation()  # a deployed node: read only its partition
    cfg, fed, train, test, model, head, initial, device = _worker_cache(
        experiment_of(rc), overrides_of(rc), label, data_path, state_dir,
        pid if one_client else None,
    )
    if data_path is None and not one_client:
        check_partition_id(pid, fed.num_clients)
    model.load_state_dict(initial)  # every message finds the model as the run began: nothing of the
    # worker's previous client (its head, its local part) carries over to this one
    index = 0 if data_path or one_client else pid
    train_idx = torch.as_tensor(fed.client_train[index], device=device)
    test_idx = torch.as_tensor(fed.client_test[index], device=device)
    validation = train.subset(torch.as_tensor(fed.client_validation[index], device=device)) if fed.validating else None
    return ClientRuntime(
        cfg=cfg,
        partition_id=pid,
        device=device,
        train=train.subset(train_idx),
        test=test.subset(test_idx),
        model=model,
        head=head,
        initial_state=initial,
        regression=fed.bundle.task == "regression",
        state=context.state,
        run_id=int(context.run_id),
        node_id=int(context.node_id),
        state_dir=str(context.node_config["state-dir"]) if "state-dir" in context.node_config else None,
        validation=validation,
        model_training=next(filter(None, (p.client_training(cfg) for p in PROTOCOLS)), None),
    )


@functools.cache
def warm_up() -> None:
    """The first optimizer step of a process imports torch's compiler stack (about 3 s on a busy
    2-core CPU): take it once per process during the handshake, so round 1 measures training."""
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.5)
    layer(torch.zeros(1, 2)).sum().backward()
    optimizer.step()


@app.query("info")
def info(msg: Message, context: Context) -> Message:
    """Handshake: which partition this node serves, how much data it holds and whether the data is
    its own (node config ``data-path``, checked against the run's input shape and classes)."""
    warm_up()
    rt = runtime_for(context, msg.content)
    config = round_config(msg.content)
    own = "data-path" in context.node_config
    if own and "input-shape" in config:
        state_dir = context.node_config.get("state-dir")
        bundle = _worker_cache(experiment_of(context.run_config), overrides_of(context.run_config), config.get("variant"),
                               str(context.node_config["data-path"]), str(state_dir) if state_dir else None)[1].bundle
        check_node_data(bundle, tuple(config["input-shape"]), int(config["num-classes"]), context.node_config["data-path"])
    content = reply(None, **{"partition-id": rt.partition_id, "num-train": len(rt.train), "num-test": len(rt.test),
                             "own-data": float(own)})
    content[PROCESS] = ConfigRecord({"id": PROCESS_ID})  # whether processes serve several nodes (elision)
    return Message(content=content, reply_to=msg)


def _route(msg: Message, context: Context) -> Message:
    """Answer ``msg`` with the handler its message type has in the run's algorithm or a protocol
    (the reply reports the seconds of runtime setup and of the handler, see :mod:`flower_app.app.timing`)."""
    start = time.perf_counter()
    rt = runtime_for(context, msg.content)
    kind = msg.metadata.message_type
    handler = ALGORITHMS[rt.cfg.algorithm].handlers.get(kind) or PROTOCOL_HANDLERS.get(kind)
    if handler is None:
        if kind != "evaluate":
            raise ValueError(f"{kind} has no handler in algorithm {rt.cfg.algorithm!r} or any protocol")
        handler = evaluate_global_model
    # dropout draws from torch's global generators: seed them from (seed, round, client, message
    # type), as the shuffling generators, so a run repeats exactly whichever process serves a client
    server_round = int(round_config(msg.content).get("server-round", 0))
    seed_global_generators(derived_seed(int(rt.cfg.seed), server_round, rt.partition_id, zlib.crc32(kind.encode())),
                           rt.device)
    ready = time.perf_counter()
    with precision(str(rt.cfg.train.precision), rt.device):
        content = handler(rt, msg.content)
    stamp(content, "setup_s", ready - start)
    stamp(content, "compute_s", time.perf_counter() - ready)
    if on_cluster(rt.cfg):
        import ray

        mark_node(content, ray.get_runtime_context().get_node_id()[:12])
    return Message(content=content, reply_to=msg)


def evaluate_global_model(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Evaluation of an algorithm without its own handler: the received model on the local test split."""
    rt.load(content[ARRAYS])
    return reply(None, **rt.evaluate_local(round_config(content)))


def _message_types() -> set[str]:
    """Every message type an algorithm or a protocol answers."""
    kinds = {"train", "evaluate", *PROTOCOL_HANDLERS}
    for algorithm in ALGORITHMS.values():
        kinds.update(algorithm.handlers)
    return kinds


_routed: set[str] = set()


def route_message_types() -> None:
    """Route every message type an algorithm or a protocol answers to :func:`_route` (the ones
    already routed stay as they are)."""
    for kind in sorted(_message_types() - _routed):
        category, _, action = kind.partition(".")
        getattr(app, category)(action or DEFAULT_ACTION)(_route)
        _routed.add(kind)


@app.lifespan()
def plugins_routed(context: Context) -> Iterator[None]:
    """Before Flower dispatches a message: load the run's plug-ins (by reading its configuration)
    and route the message types they answer, such as a plug-in's ``query.<action>``."""
    if "experiment" in context.run_config:
        run_config_of(context.run_config)
    route_message_types()
    yield


route_message_types()
