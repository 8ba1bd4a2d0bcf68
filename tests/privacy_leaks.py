"""A plug-in of leaky Ditto clients, the privacy check's negative controls (:mod:`tests.test_privacy`).
Each passes reply screening: same keys, shapes and dtypes as the global model."""

from __future__ import annotations

from flwr.app import ArrayRecord

from strategies import ALGORITHMS, Algorithm, register
from strategies.common import ARRAYS
from strategies.ditto import PERSONAL, DittoConfig, evaluate_personal, make_strategy, train_ditto
from strategies.state_store import kept_arrays


def personal_model_as_global(rt, content):
    """Ditto that sends its personal model v under the global model's names."""
    out = train_ditto(rt, content)
    out[ARRAYS] = ArrayRecord(kept_arrays(rt, PERSONAL))
    return out


def personal_update_scaled(rt, content):
    """Ditto that sends the received w plus its personal model's update, scaled by (1 + 1e-6)."""
    received = content[ARRAYS].to_torch_state_dict()
    before = kept_arrays(rt, PERSONAL) or {k: v.clone() for k, v in rt.initial_state.items()}
    out = train_ditto(rt, content)
    after = kept_arrays(rt, PERSONAL)
    out[ARRAYS] = ArrayRecord({k: received[k] + (1 + 1e-6) * (after[k] - before[k]) for k in received})
    return out


for name, train in (("leaky_ditto_names", personal_model_as_global), ("leaky_ditto_update", personal_update_scaled)):
    if name not in ALGORITHMS:
        register(Algorithm(name=name, make_strategy=make_strategy, shared_keys=ALGORITHMS["ditto"].shared_keys,
                           handlers={"train": train, "evaluate": evaluate_personal}, config=DittoConfig,
                           section="ditto"))
