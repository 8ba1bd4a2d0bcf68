"""Every configuration error stops the run before round 1 with a message naming the key."""

import pytest
from flwr.app import Error, Message

from flower_app.cli import main as flrep
from flower_app.run.config import clients_per_round, load_config, validate_with_data
from flower_app.app.federation import Traffic, connect
from strategies.common import reply
from task.data.home import data_home
from task.errors import ConfigError
from task.data.sampling import sample_clients


def error_of(*overrides, experiment="quickstart"):
    with pytest.raises(ConfigError) as info:
        validate_with_data(load_config(experiment, list(overrides)))
    return str(info.value)


@pytest.mark.parametrize(
    "override, key, allowed",
    [
        ("algorithm=fedrepp", "algorithm", "fedavg"),
        ("data.name=imagenet", "data.name", "mnist"),
        ("model.name=vgg", "model.name", "lenet5"),
        ("train.lr=0", "train.lr", "positive"),
        ("train.lr=-0.1", "train.lr", "positive"),
        ("train.fraction=0", "train.fraction", "(0, 1]"),
        ("train.fraction=1.5", "train.fraction", "(0, 1]"),
        ("rounds=0", "rounds", "positive integer"),
        ("train.batch_size=2.5", "train.batch_size", "positive integer"),
        ("server_opt.name=sgdm", "server_opt.name", "use none"),
        ("algorithm=local_update server_opt.name=fedadam", "server_opt.name", "nesterov"),
        ("algorithm=local_update local_update.preset=fedsgd", "local_update.client_lr", "γ = 0"),
        ("algorithm=local_update local_update.preset=fedprox", "local_update.alpha", "α > 0"),
        ("algorithm=local_update local_update.preset=maml local_update.alpha=0.5", "local_update.alpha", "α = 0"),
        ("algorithm=local_update local_update.preset=custom", "local_update.theta", "list of weights"),
        ("algorithm=local_update local_update.preset=custom local_update.theta=[0,-1]", "local_update.theta", "weights >= 0"),
        ("algorithm=local_update local_update.theta=[1,2]", "local_update.theta", "preset=custom"),
        ("algorithm=local_update server_opt.momentum=1.0", "server_opt.momentum", "[0, 1)"),
        ("data.num_new_clients=20", "data.num_new_clients", "no training client"),
        ("model.head=[fc9]", "model.head", "fc1"),
        ("model.head=[fc1]", "model.head", "suffix"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(override, key, allowed):
    message = error_of(*override.split())
    assert key in message and allowed in message


def test_unknown_key_and_unknown_experiment():
    assert "trian" in error_of("trian.lr=0.1")
    with pytest.raises(ConfigError, match="experiment.*quickstart"):
        load_config("no_such_experiment")
    with pytest.raises(ConfigError, match="key=value"):
        load_config("quickstart", ["rounds"])


def test_missing_data_path_is_named(tmp_path):
    message = error_of("data.name=mnist", f"data.root={tmp_path / 'nowhere'}")
    assert "data.root" in message and "nowhere" in message
    assert "relative data.root" not in message
    # a relative path is a folder of the data home: the error names the home and how to fill it
    message = error_of("data.name=mnist", "data.root=no/such/mnist")
    assert f"no mnist files at {data_home() / 'no/such/mnist'}" in message and "FLREP_DATA" in message


def test_malformed_data_file_is_named(tmp_path):
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (tmp_path / name).write_bytes(b"not a gzip file")
    message = error_of("data.name=mnist", f"data.root={tmp_path}", "model.name=mlp_mnist")
    assert "gzip" in message and str(tmp_path) in message


def test_relative_data_root_resolves_in_the_data_home():
    cfg = load_config("lg_mnist_fedavg")
    assert cfg.data.root == str(data_home() / "mnist")


def test_more_clients_than_supernodes_is_refused_before_round_one():
    class Grid:
        def get_node_ids(self):
            return [1, 2, 3]

    with pytest.raises(ConfigError, match="data.num_clients.*20 clients.*3 SuperNodes"):
        connect(Grid(), 20, Traffic(), wait_s=0)


def test_handshake_maps_partitions_to_nodes():
    class Grid:
        def get_node_ids(self):
            return [7, 9]

        def send_and_receive(self, messages, timeout=None):
            pid = {7: 1, 9: 0}
            replies = [Message(reply(None, **{"partition-id": pid[m.metadata.dst_node_id],
                                              "num-train": 5 + pid[m.metadata.dst_node_id]}), reply_to=m)
                       for m in messages]
            for m, rep in zip(messages, replies):
                rep.metadata.__dict__["_src_node_id"] = m.metadata.dst_node_id
            return replies

    fed = connect(Grid(), 2, Traffic(), wait_s=0)
    assert fed.node_of == {0: 9, 1: 7}
    assert fed.train_size == {0: 5, 1: 6}


def test_handshake_tolerates_extra_nodes_but_names_the_failures_behind_a_missing_client():
    """A SuperLink may still list a SuperNode that died (it fails its handshake) or a node of
    another federation (it serves a partition outside the run)."""
    class Grid:
        def __init__(self, answers):
            self.answers = answers  # node id -> partition id, or an error reason

        def get_node_ids(self):
            return list(self.answers)

        def send_and_receive(self, messages, timeout=None):
            out = []
            for m in messages:
                answer = self.answers[m.metadata.dst_node_id]
                content = (Error(code=0, reason=answer) if isinstance(answer, str)
                           else reply(None, **{"partition-id": answer, "num-train": 4}))
                rep = Message(content, reply_to=m)
                rep.metadata.__dict__["_src_node_id"] = m.metadata.dst_node_id
                out.append(rep)
            return out

    fed = connect(Grid({1: 0, 2: "node unavailable", 3: 1, 4: 7}), 2, Traffic(), wait_s=0)
    assert fed.node_of == {0: 1, 1: 3} and fed.strangers == {2, 4}
    with pytest.raises(ConfigError, match=r"no node serves partition ids \[1\]: 1 of 2 nodes' ClientApps failed their "
                                          r"start-up handshake with: ConfigError: node config data-path='/x' does not exist$"):
        connect(Grid({1: 0, 3: "ConfigError: node config data-path='/x' does not exist"}), 2, Traffic(), wait_s=0)


def test_cli_exits_non_zero_on_config_error(capsys):
    assert flrep(["run", "quickstart", "train.lr=-1"]) == 2
    assert "train.lr" in capsys.readouterr().err


def test_sampling_is_a_pure_function_of_seed_and_round():
    cfg = load_config("quickstart")
    k = clients_per_round(cfg)
    assert k == 5
    a = [sample_clients(range(20), k, 0, t) for t in range(1, 30)]
    b = [sample_clients(range(20), k, 0, t) for t in range(1, 30)]
    c = [sample_clients(range(20), k, 1, t) for t in range(1, 30)]
    assert a == b and a != c
    assert all(len(set(s)) == k for s in a)
    # every client is picked at some point
    assert set().union(*map(set, a)) == set(range(20))



@pytest.mark.parametrize("override, message", [
    ("train.nesterov=maybe", "train.nesterov: got 'maybe', expected true or false"),
    ("data.partition=stripes", "data.partition: got 'stripes', expected one of iid, pathological"),
    ("fair.lambdas=[1,x]", "fair.lambdas[1]: got 'x', expected a number >= 0"),
    ("train.lr=inf", "train.lr: got inf, expected a positive number"),
    ("train.momentum=nan", "train.momentum: got nan, expected a number >= 0"),
    ("train.lrr=0.1", "train.lrr: unknown key; train has fraction, local_epochs"),
])
def test_types_choices_and_keys_are_checked_by_the_schema(override, message):
    with pytest.raises(ConfigError) as info:
        load_config("quickstart", [override])
    assert str(info.value).startswith(message)


def test_model_output_is_validated():
    message = error_of("model.output=probs")
    assert "model.output" in message and "softmax" in message
    message = error_of("model.output=softmax", experiment="linear_fedrep")  # a regression model
    assert "model.output" in message and "logits" in message
    validate_with_data(load_config("quickstart", ["model.output=softmax"]))
