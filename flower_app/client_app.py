"""The ClientApp: routes each message to the configured algorithm's client half.

Per worker process it caches what does not change between messages: the merged config,
the federated dataset as tensors on the device, and the model object with the run's
common initial weights.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from flower_app.client_checkpoint import snapshot_mod
from flower_app.config import head_groups, initial_model, pick_device, run_config_of
from strategies import ALGORITHMS
from strategies.common import ClientRuntime, reply, round_config
from strategies.finetune import finetune
from strategies.new_clients import adapt_head
from strategies.tct import compute_entk
from task.learning.engine import TensorData
from task.learning.fairness import attribute_matrix
from task.errors import ConfigError
from task.data.federated_data import FederatedData, build_federated_data
from task.data.node_data import check_node_data, load_node_data

app = ClientApp(mods=[snapshot_mod])


_device_data: dict[int, tuple] = {}


def _data_on_device(fed, device: torch.device) -> tuple[TensorData, TensorData]:
    """The full train/test arrays of ``fed``'s dataset as tensors on ``device`` (once per dataset)."""
    key = id(fed.bundle)
    if key not in _device_data:
        bundle = fed.bundle
        train = TensorData.from_arrays(bundle.train.x, bundle.train.y, device, attribute_matrix(bundle.train.attributes))
        test = TensorData.from_arrays(bundle.test.x, bundle.test.y, device, attribute_matrix(bundle.test.attributes))
        _device_data[key] = (bundle, train, test)  # the bundle is kept so its id stays unique
    return _device_data[key][1], _device_data[key][2]


def _own_data(cfg, data_path: str) -> FederatedData:
    """A SuperNode's own dataset (node config ``data-path``) as a one-client federation."""
    bundle = load_node_data(cfg.data, data_path)
    return FederatedData(bundle, [np.arange(len(bundle.train))], [np.arange(len(bundle.test))],
                         global_test=np.arange(0), new_clients=[])


@functools.lru_cache(maxsize=16)
def _worker_cache(experiment: str, overrides: str, label: str | None, data_path: str | None):
    """Config, data tensors on the device, model and initial weights (per process and variant)."""
    cfg = run_config_of({"experiment": experiment, "overrides": overrides}, label)
    torch.set_num_threads(max(1, int(cfg.simulation.client_cpus)))
    device = pick_device(cfg)
    fed = _own_data(cfg, data_path) if data_path else build_federated_data(cfg.data, int(cfg.seed))
    train, test = _data_on_device(fed, device)
    model = initial_model(cfg, fed.bundle).to(device)
    head = head_groups(cfg, model)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return cfg, fed, train, test, model, head, initial, device


def runtime_for(context: Context, content: RecordDict | None = None) -> ClientRuntime:
    """This client's runtime for the run variant named in ``content`` (default: the first)."""
    rc = context.run_config
    label = round_config(content).get("variant") if content is not None else None
    if "partition-id" not in context.node_config:
        raise ConfigError("node config: partition-id is missing (start the SuperNode with "
                          "--node-config \"partition-id=<i> data-path=<dir>\")")
    data_path = str(context.node_config["data-path"]) if "data-path" in context.node_config else None
    cfg, fed, train, test, model, head, initial, device = _worker_cache(
        str(rc.get("experiment", "quickstart")), str(rc.get("overrides", "")), label, data_path
    )
    pid = int(context.node_config["partition-id"])
    if data_path is None and not 0 <= pid < fed.num_clients:
        raise ConfigError(f"node config: partition-id {pid} is outside the {fed.num_clients} clients of data.num_clients")
    index = 0 if data_path else pid
    train_idx = torch.as_tensor(fed.client_train[index], device=device)
    test_idx = torch.as_tensor(fed.client_test[index], device=device)
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
    )


@app.query("info")
def info(msg: Message, context: Context) -> Message:
    """Handshake: which partition this node serves, how much data it holds and whether the data is
    its own (node config ``data-path``, checked against the run's input shape and classes)."""
    rt = runtime_for(context, msg.content)
    config = round_config(msg.content)
    own = "data-path" in context.node_config
    if own and "input-shape" in config:
        bundle = _worker_cache(str(context.run_config.get("experiment", "quickstart")),
                               str(context.run_config.get("overrides", "")), config.get("variant"),
                               str(context.node_config["data-path"]))[1].bundle
        check_node_data(bundle, tuple(config["input-shape"]), int(config["num-classes"]), context.node_config["data-path"])
    content = reply(None, **{"partition-id": rt.partition_id, "num-train": len(rt.train), "num-test": len(rt.test),
                             "own-data": float(own)})
    return Message(content=content, reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One training round of the configured algorithm."""
    rt = runtime_for(context, msg.content)
    content = ALGORITHMS[rt.cfg.algorithm].train(rt, msg.content)
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Personalized evaluation on the local test split, with the model this client would use."""
    rt = runtime_for(context, msg.content)
    algorithm = ALGORITHMS[rt.cfg.algorithm]
    if algorithm.evaluate is None:
        rt.load(msg.content["arrays"])
        content = reply(None, **rt.evaluate_local(round_config(msg.content)))
    else:
        content = algorithm.evaluate(rt, msg.content)
    return Message(content=content, reply_to=msg)


@app.train("finetune")
def finetune_action(msg: Message, context: Context) -> Message:
    """+FT: fine-tune the final global model on local data, report before/after."""
    rt = runtime_for(context, msg.content)
    return Message(content=finetune(rt, msg.content), reply_to=msg)


@app.train("newclient")
def newclient_action(msg: Message, context: Context) -> Message:
    """New client: fit a fresh head on the frozen learned representation, report accuracy per epoch."""
    rt = runtime_for(context, msg.content)
    return Message(content=adapt_head(rt, msg.content), reply_to=msg)


@app.query("localpart")
def local_part_action(msg: Message, context: Context) -> Message:
    """New Test (LG-FedAvg, Local-only): send this client's own part to the server once."""
    rt = runtime_for(context, msg.content)
    send = ALGORITHMS[rt.cfg.algorithm].send_local
    if send is None:
        raise ValueError(f"algorithm {rt.cfg.algorithm!r} has no local part to send")
    return Message(content=send(rt, msg.content), reply_to=msg)


@app.query("entk")
def entk_action(msg: Message, context: Context) -> Message:
    """TCT's convexify step: compute and keep this client's eNTK features (never sent)."""
    rt = runtime_for(context, msg.content)
    if rt.cfg.algorithm != "tct":
        raise ValueError(f"query.entk belongs to algorithm tct, this run is {rt.cfg.algorithm!r}")
    return Message(content=compute_entk(rt, msg.content), reply_to=msg)
