"""What the algorithms take from Flower beyond its public API, in one place.

Flower's message strategies keep a few helpers private (``Strategy._check_and_log_replies``,
``Strategy._construct_messages``, ``strategy_utils.aggregate_arrayrecords``). The algorithms call
the functions below instead; a Flower upgrade that moves those helpers breaks this module alone,
and ``tests/test_flower_compat.py`` names the version it was written for.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO

from flwr.app import Message, RecordDict
from flwr.common import log
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords, validate_message_reply_consistency

#: The Flower release whose private helpers this module stands in for.
WRITTEN_FOR_FLOWER = "1.41.0"


def checked_replies(replies: Iterable[Message], is_train: bool,
                    weighted_by_key: str | None = None) -> tuple[list[Message], list[Message]]:
    """(replies with content, error replies), logged as Flower's strategies log them. With
    ``weighted_by_key``, the content replies are checked as Flower's FedAvg checks them (one
    ArrayRecord with the same keys in each training reply, one MetricRecord holding the key);
    an inconsistent set raises Flower's ``InconsistentMessageReplies``."""
    replies = list(replies)
    valid = [m for m in replies if not m.has_error()]
    errors = [m for m in replies if m.has_error()]
    if not replies:
        return [], []
    log(INFO, "%s: Received %s results and %s failures", "aggregate_train" if is_train else "aggregate_evaluate",
        len(valid), len(errors))
    for msg in errors:
        log(INFO, "\t> Received error in reply from node %d: %s", msg.metadata.src_node_id, msg.error.reason)
    if weighted_by_key is not None and valid:
        validate_message_reply_consistency([m.content for m in valid], weighted_by_key, check_arrayrecord=is_train)
    return valid, errors


def messages_to(record: RecordDict, node_ids: Iterable[int], message_type: str) -> list[Message]:
    """One message per node, each carrying ``record``."""
    return [Message(content=record, message_type=message_type, dst_node_id=node) for node in node_ids]


def weighted_average(contents: list[RecordDict], weighted_by_key: str):
    """The ArrayRecord average of ``contents``, each weighed by its MetricRecord's ``weighted_by_key``."""
    return aggregate_arrayrecords(contents, weighted_by_key)
