"""FedAMP: one client step is a gradient step of f_i + λ/(2α_k)‖w − u_i‖², the server's cloud models
and attention weights against a hand computation, what crosses the wire (by value, through the real
ServerApp/ClientApp), the server's store through a checkpoint, and bad values refused by key."""

import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from flower_app.app.server_app import Experiment
from flower_app.run.config import load_config, validate_with_data
from strategies import fedamp
from strategies.common import ARRAYS, CONFIG, METRICS, NUM_EXAMPLES
from strategies.state_store import keep_arrays, kept_arrays
from task.errors import ConfigError
from tests.local_grid import LocalGrid
from tests.test_fedrep import make_runtime
from tests.test_personal_models import BASE, ONE_FULL_BATCH_STEP, loss_at, message, objective_step, params, perturbed


@pytest.mark.parametrize("kept", [True, False])
def test_a_client_step_descends_its_loss_plus_the_pull_toward_its_cloud_model(kept):
    """With a kept w_i (or, the first time, the run's initial weights) and the received u_i."""
    rt = make_runtime("fedamp", [*ONE_FULL_BATCH_STEP, "fedamp.lam=0.6", "fedamp.alpha_k=0.4"])
    w = perturbed(rt, 0.3, 1) if kept else params(rt.model)
    if kept:
        keep_arrays(rt, fedamp.OWN_MODEL, {**rt.model.state_dict(), **w})
    u = perturbed(rt, 0.5, 2)
    sent = fedamp.train_fedamp(rt, message(rt, u))
    pull = 0.6 / 0.4
    want = objective_step(rt, w, lambda x: loss_at(rt, x) + pull / 2 * sum(((x[k] - u[k]) ** 2).sum() for k in x),
                          float(rt.cfg.train.lr))
    plain = objective_step(rt, w, lambda x: loss_at(rt, x), float(rt.cfg.train.lr))
    got = kept_arrays(rt, fedamp.OWN_MODEL)
    assert set(sent[ARRAYS]) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.as_tensor(sent[ARRAYS][k].numpy()), want[k], rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(want[k], plain[k], atol=1e-4) for k in want)  # the pull moved the step


def test_the_official_penalty_has_no_gradient_the_client_trains_its_loss_alone():
    rt = make_runtime("fedamp", [*ONE_FULL_BATCH_STEP, "fedamp.penalty=official"])
    w = perturbed(rt, 0.3, 3)
    keep_arrays(rt, fedamp.OWN_MODEL, {**rt.model.state_dict(), **w})
    sent = fedamp.train_fedamp(rt, message(rt, perturbed(rt, 0.5, 4)))
    want = objective_step(rt, w, lambda x: loss_at(rt, x), float(rt.cfg.train.lr))
    for k in want:
        torch.testing.assert_close(torch.as_tensor(sent[ARRAYS][k].numpy()), want[k], rtol=1e-5, atol=1e-6)


def test_the_client_refuses_a_cloud_model_of_other_arrays():
    rt = make_runtime("fedamp")
    with pytest.raises(ValueError, match="cloud model"):
        fedamp.train_fedamp(rt, message(rt, {"fc2.weight": params(rt.model)["fc2.weight"]}))


class Nodes:
    """The only part of a Grid that configure_train uses."""

    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


W0, W1, W2 = [0.0, 0.0, 1.0], [1.0, 0.0, 1.5], [0.0, 1.0, 1.0]  # initial, client 1's, client 2's (a: 2, b: 1)


def three_clients(peers: str):
    """Clients 1 and 2 have uploaded W1 and W2, client 3 not yet (α_k = 0.5, σ = 2)."""
    cfg = load_config("quickstart", ["algorithm=fedamp", "compare=[]", "fedamp.alpha_k=0.5", "fedamp.sigma=2",
                                     f"fedamp.peers={peers}"])
    server = fedamp.make_strategy(cfg)
    server.observe_population({1: 10, 2: 10, 3: 10})
    server.models = {1: np.array(W1, np.float32), 2: np.array(W2, np.float32)}
    server.last_uploaders = {2}
    arrays = ArrayRecord({"a": Array(np.array(W0[:2], np.float32)), "b": Array(np.array(W0[2:], np.float32))})
    sent = server.configure_train(5, arrays, ConfigRecord({"variant": "fedamp"}), Nodes([1, 3]))
    return server, {m.metadata.dst_node_id: np.concatenate([m.content[ARRAYS]["a"].numpy(),
                                                            m.content[ARRAYS]["b"].numpy()]) for m in sent}


def mix(weights):
    return [sum(x * w[i] for x, w in weights) for i in range(3)]


def test_cloud_models_against_a_hand_computation():
    """‖W1 − W2‖² = 2.25, ‖W1 − W0‖² = 1.25, ‖W0 − W2‖² = 1; ξ = 0.5·e^(−d/2)/2; client 3 counts at W0."""
    server, u = three_clients("all")
    xi12, xi13 = 0.25 * math.exp(-2.25 / 2), 0.25 * math.exp(-1.25 / 2)
    xi31, xi32 = 0.25 * math.exp(-1.25 / 2), 0.25 * math.exp(-1 / 2)
    np.testing.assert_allclose(u[1], mix([(1 - xi12 - xi13, W1), (xi12, W2), (xi13, W0)]), rtol=1e-6)
    np.testing.assert_allclose(u[3], mix([(1 - xi31 - xi32, W0), (xi31, W1), (xi32, W2)]), rtol=1e-6)
    np.testing.assert_allclose(sorted(server.self_weights), sorted([1 - xi12 - xi13, 1 - xi31 - xi32]), rtol=1e-12)


def test_last_round_peers_are_the_previous_rounds_uploads_only():
    server, u = three_clients("last_round")
    xi12, xi32 = 0.25 * math.exp(-2.25 / 2), 0.25 * math.exp(-1 / 2)
    np.testing.assert_allclose(u[1], mix([(1 - xi12, W1), (xi12, W2)]), rtol=1e-6)
    np.testing.assert_allclose(u[3], mix([(1 - xi32, W0), (xi32, W2)]), rtol=1e-6)
    replies = []
    for node, w in ((1, [2.0, 2.0, 2.0]), (3, [3.0, 3.0, 3.0])):
        content = RecordDict({ARRAYS: ArrayRecord({"a": Array(np.array(w[:2], np.float32)),
                                                  "b": Array(np.array(w[2:], np.float32))}),
                              METRICS: MetricRecord({NUM_EXAMPLES: 10.0, "train_loss": 1.0})})
        reply = Message(content, reply_to=Message(RecordDict(), dst_node_id=node, message_type="train"))
        reply.metadata.__dict__["_src_node_id"] = node  # as tests/local_grid.py does
        replies.append(reply)
    arrays, metrics = server.aggregate_train(5, replies)
    assert arrays is None and server.last_uploaders == {1, 3}
    assert server.models[1].tolist() == [2.0] * 3 and server.models[3].tolist() == [3.0] * 3
    assert server.models[2].tolist() == W2  # kept from before
    assert metrics["self_attention_min"] == pytest.approx(min(1 - xi12, 1 - xi32))


def test_a_checkpoint_keeps_the_servers_store_under_new_node_ids():
    server, _ = three_clients("last_round")
    state = server.state_dict({1: 0, 2: 1, 3: 2})
    fresh, _ = three_clients("last_round")
    fresh.models, fresh.last_uploaders = {}, set()
    fresh.load_state_dict(state, {0: 11, 1: 12, 2: 13})
    assert set(fresh.models) == {11, 12} and fresh.last_uploaders == {12}
    assert fresh.models[11].tolist() == W1 and fresh.models[12].tolist() == W2


def test_down_goes_each_clients_cloud_model_and_up_its_own_model(tmp_path):
    """Through the real ServerApp/ClientApp: every u_i is the mixture of what the clients uploaded
    before, never another client's model; every upload is the client's kept model; evaluation
    sends no arrays; no reply failed."""
    overrides = f"{BASE} algorithm=fedamp fedamp.alpha_k=0.5 fedamp.sigma=4 rounds=4 out_dir={tmp_path}"
    cfg = load_config("quickstart", overrides.split())
    grid = LocalGrid(6, {"experiment": "quickstart", "overrides": overrides})
    summary = Experiment(grid, cfg).run()
    assert summary["status"] == "completed" and summary["failed_client_replies"] == 0
    model = validate_with_data(cfg)[1]
    keys = fedamp.parameter_keys(model, cfg)
    initial = np.concatenate([model.state_dict()[k].numpy().ravel() for k in keys])
    pairs = [(m, r) for m, r in zip(grid.sent, grid.replies) if m.metadata.message_type == "train"]
    by_round: dict[int, list] = {}
    for m, r in pairs:
        assert r.metadata.reply_to_message_id == m.metadata.message_id
        by_round.setdefault(int(m.content[CONFIG]["server-round"]), []).append((m, r))
    assert sorted(by_round) == [1, 2, 3, 4] and len(pairs) == 12
    store: dict[int, np.ndarray] = {}  # the server's store, replayed from what crossed
    mixed_weights = []
    for t in sorted(by_round):
        for m, _ in by_round[t]:  # all of a round's cloud models come from the store before it
            node, u = m.metadata.dst_node_id, fedamp.flat(m.content[ARRAYS], keys)
            others = [n for n in grid.node_ids if n != node]
            peers = [store[n] for n in others if n in store]
            fresh = len(others) - len(peers)
            want, self_weight = fedamp.cloud_model(store.get(node, initial), peers + [initial] * bool(fresh),
                                                   [1] * len(peers) + [fresh] * bool(fresh), 0.5, 4.0)
            np.testing.assert_array_equal(u, want)
            mixed_weights.append(self_weight)
            if len(store) > 1:  # never another client's raw model
                for src, w in store.items():
                    if src != node:
                        assert np.linalg.norm(u.astype(np.float64) - w) > 1e-5 * np.linalg.norm(w)
        for _, r in by_round[t]:
            store[r.metadata.src_node_id] = fedamp.flat(r.content[ARRAYS], keys)
    assert min(mixed_weights) < 1 - 1e-3  # the attention mixed other models in: the check can fail
    for node, w in store.items():  # each client's last upload is its kept model
        kept = grid.contexts[node].state[f"{cfg.label}/{fedamp.OWN_MODEL}"].to_torch_state_dict()
        np.testing.assert_array_equal(w, np.concatenate([kept[k].numpy().ravel() for k in keys]))
    assert not any(len(record) for m in grid.sent + grid.replies if m.metadata.message_type == "evaluate"
                   for record in m.content.array_records.values())



def test_with_the_official_penalty_fedamp_is_local_only_value_for_value(tmp_path):
    """PFLlib's gradient-free term leaves each client training f_i alone from its own model: every
    evaluation of every client is Local-only's (same seed, batches and sampling)."""
    from tests.test_personal_models import run_recorded

    def scores(algorithm: str, extra: str = "") -> list[dict]:
        grid = run_recorded(f"algorithm={algorithm} {extra}", tmp_path / f"{algorithm}{len(extra)}")
        evals = [(r.metadata.src_node_id, dict(r.content[METRICS])) for r in grid.replies
                 if r.metadata.message_type == "evaluate"]
        assert len(evals) == 18  # rounds 1, 2 and 4 (eval.every=2): 6 clients each
        return evals

    official = scores("fedamp", "fedamp.penalty=official")
    assert official == scores("local_only")
    assert scores("fedamp") != official  # the paper's pull changes them: the check can fail

@pytest.mark.parametrize("override, key, allowed", [
    ("fedamp.alpha_k=0", "fedamp.alpha_k", "positive"),
    ("fedamp.sigma=-1", "fedamp.sigma", "positive"),
    ("fedamp.lam=-0.5", "fedamp.lam", ">= 0"),
    ("fedamp.penalty=norm", "fedamp.penalty", "official"),
    ("fedamp.peers=some", "fedamp.peers", "last_round"),
])
def test_a_bad_value_is_refused_naming_its_key(override, key, allowed):
    with pytest.raises(ConfigError) as info:
        load_config("quickstart", ["algorithm=fedamp", "compare=[]", *override.split()])
    assert str(info.value).startswith(f"{key}:") and allowed in str(info.value)
