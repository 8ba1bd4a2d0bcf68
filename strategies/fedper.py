"""FedPer (Arivazhagan et al., 2019): shared body, personal head, trained jointly.

Server: FedRep's body averaging.
Client: load the received body and its own head (kept in ``context.state``), train head
and body together for the usual local epochs/steps, keep the head, send the body only.
A never-sampled client is evaluated as in FedRep (``fedrep.unsampled_head``).
"""

from __future__ import annotations

from flwr.app import RecordDict

from strategies.base import Algorithm, register
from strategies.common import ARRAYS, NUM_EXAMPLES, ClientRuntime, body_keys, reply, round_config
from strategies.fedrep import check, check_model, evaluate_with_own_head, keep_head, load_own_head, make_strategy


def train_fedper(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Joint local training of body and own head; keep the head, send the body."""
    rt.load(content[ARRAYS])
    load_own_head(rt)
    result = rt.local_training(round_config(content))
    keep_head(rt)
    metrics = {"train_loss": result.mean_loss, "local_steps": result.steps, NUM_EXAMPLES: len(rt.train)}
    return reply(rt.arrays(rt.body_keys()), **metrics)


ALGORITHM = register(Algorithm(
    name="fedper",
    description="FedAvg of the body, each client keeping its own head (Arivazhagan et al. 2019)",
    make_strategy=make_strategy,
    handlers={"train": train_fedper, "evaluate": evaluate_with_own_head},
    shared_keys=body_keys,
    check=check,
    check_model=check_model,
    supports_finetune=True,
    load_personal=load_own_head,
))
