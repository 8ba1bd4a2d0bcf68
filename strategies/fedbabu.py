"""FedBABU (Oh, Kim, Yun, ICLR 2022): only the body learns in federation; the head stays at its
random initialisation, the same on every client, and is fine-tuned for personalization at evaluation.

Server: holds and sends the whole model, its head the run's initial head; averages the bodies
the clients send (weights: ``train.aggregation``), so the head never changes.
Client: load the received model, train the body with the head frozen for the usual local
epochs/steps, send the body. Every evaluation scores that global model (the paper's accuracy
before fine-tuning, PFLlib's per-round evaluation), on the server. The personalized accuracy is +FT's (``finetune.enabled=true``): every client
fine-tunes the final body with the initial head, ``finetune.part=head`` as the paper's abstract
says, ``full`` (body and head) as PFLlib's ``clientBABU.fine_tune`` (10 epochs there), and keeps the copy.
Nothing a client trains stays private during training: the head is frozen, the body is shared.
"""

from __future__ import annotations

from collections.abc import Mapping

from flwr.app import ArrayRecord, Message, RecordDict
from omegaconf import DictConfig

from strategies.base import TAKE_ALL_NODES, Algorithm, ServerHooks, WeightedAverage, all_keys, register
from strategies.common import ARRAYS, NUM_EXAMPLES, ClientRuntime, body_keys, reply, round_config
from strategies.fedrep import body_parameters
from strategies.services import Services


class BodyOnlyAverage(ServerHooks, WeightedAverage):
    """Holds the whole model and sends it; the replies carry the body, whose average replaces the
    body: the head stays the initial one, value for value."""

    body: tuple[str, ...] = ()

    def on_start(self, services: Services) -> None:
        self.body = tuple(body_keys(services.model, services.cfg))

    def reply_template(self, message: Message) -> Mapping[str, ArrayRecord]:
        """The body of the model sent."""
        sent = message.content[ARRAYS]
        return {ARRAYS: ArrayRecord({k: sent[k] for k in self.body})}


def make_strategy(cfg: DictConfig) -> BodyOnlyAverage:
    """FedBABU's server half: FedAvg of the bodies."""
    return BodyOnlyAverage(**TAKE_ALL_NODES).average_as(cfg)


def train_fedbabu(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """The body's local epochs with the received (initial) head frozen; send the body."""
    rt.load(content[ARRAYS])
    result = rt.local_training(round_config(content), params=body_parameters(rt))
    return reply(rt.arrays(rt.body_keys()), train_loss=result.mean_loss, local_steps=result.steps,
                 **{NUM_EXAMPLES: len(rt.train)})


ALGORITHM = register(Algorithm(
    name="fedbabu",
    description="FedAvg of the body with the head frozen at its initialisation, fine-tuned at evaluation (+FT) "
                "(Oh et al. 2022)",
    make_strategy=make_strategy,
    handlers={"train": train_fedbabu},
    shared_keys=all_keys,
    supports_finetune=True,
))
