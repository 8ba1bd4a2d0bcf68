"""+FT: after training, each client fine-tunes the final global model on its own data.

The ServerApp sends the final global model with a ``train.finetune`` message; the client
measures its local test accuracy before, fine-tunes the head (on body features computed
once) or the full model for ``finetune.epochs`` epochs, measures again, and keeps the
fine-tuned copy on the client (only metrics go back).
"""

from __future__ import annotations

from flwr.app import RecordDict

from strategies.common import ARRAYS, NUM_EXAMPLES, ClientRuntime, reply
from task.learning.engine import train, train_head_on_features

SALT = 7919  # keeps fine-tuning shuffles distinct from any training round's


def finetune(rt: ClientRuntime, content: RecordDict) -> RecordDict:
    """Fine-tune the received model; report local test accuracy before and after."""
    rt.load(content[ARRAYS])
    ft = rt.cfg.finetune
    before = rt.evaluate_local()
    optimizer = rt.optimizer(lr=ft.lr)
    generator = rt.generator(int(rt.cfg.rounds) + 1, SALT)
    batch = int(rt.cfg.train.batch_size)
    if ft.part == "head":
        train_head_on_features(rt.model, rt.head, rt.train, optimizer, batch, generator, int(ft.epochs), rt.regression)
    else:
        train(rt.model, rt.train, optimizer, batch, generator, epochs=int(ft.epochs), regression=rt.regression)
    after = rt.evaluate_local()
    rt.state[rt.state_key("finetuned-model")] = rt.arrays()
    metrics = {f"{k}_before": v for k, v in before.items() if k != NUM_EXAMPLES}
    metrics.update({f"{k}_after": v for k, v in after.items() if k != NUM_EXAMPLES})
    return reply(None, **metrics, **{NUM_EXAMPLES: before[NUM_EXAMPLES]})
