"""The one module that stands in for Flower's private strategy helpers, and the rule that no other
algorithm file reaches into Flower's private API."""

from __future__ import annotations

import re
from pathlib import Path

import flwr
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict
from flwr.serverapp.exception import InconsistentMessageReplies

from strategies import flower_compat
from strategies.flower_compat import checked_replies, messages_to, weighted_average

STRATEGIES = Path(__file__).resolve().parents[1] / "strategies"
PRIVATE = re.compile(r"\._check_and_log_replies|\._construct_messages|strategy_utils|from flwr[\w.]* import _|flwr[\w.]*\._\w")


def test_written_for_the_installed_flower():
    assert flwr.__version__ == flower_compat.WRITTEN_FOR_FLOWER, (
        f"Flower {flwr.__version__} is installed; strategies/flower_compat.py was written for "
        f"{flower_compat.WRITTEN_FOR_FLOWER}: check its helpers against the new release, then update WRITTEN_FOR_FLOWER")


def test_no_algorithm_file_uses_a_private_flower_name():
    found = [f"{p.name}:{i}: {line.strip()}" for p in sorted(STRATEGIES.glob("*.py")) if p.name != "flower_compat.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if PRIVATE.search(line)]
    assert found == []


def _reply(weight: float, value: float, node: int) -> Message:
    sent = Message(RecordDict(), dst_node_id=node, message_type="train")
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.full(2, value, np.float32))}),
                          "metrics": MetricRecord({"num-examples": weight})})
    return Message(content, reply_to=sent)


def test_checked_replies_separates_errors_and_checks_consistency():
    good = [_reply(1, 0.0, 1), _reply(3, 4.0, 2)]
    failed = Message(Error(code=0, reason="boom"), reply_to=Message(RecordDict(), dst_node_id=3, message_type="train"))
    valid, errors = checked_replies([good[0], failed, good[1]], is_train=True, weighted_by_key="num-examples")
    assert valid == good and errors == [failed]
    assert checked_replies([], is_train=True) == ([], [])
    with pytest.raises(InconsistentMessageReplies):
        checked_replies(good, is_train=True, weighted_by_key="another-key")
    assert checked_replies(good, is_train=True) == (good, [])  # no key: content not checked


def test_weighted_average_and_messages_to():
    contents = [m.content for m in (_reply(1, 0.0, 1), _reply(3, 4.0, 2))]
    np.testing.assert_allclose(weighted_average(contents, "num-examples")["w"].numpy(), [3.0, 3.0])
    record = RecordDict()
    sent = messages_to(record, [5, 7], "train")
    assert [m.metadata.dst_node_id for m in sent] == [5, 7]
    assert all(m.content is record and m.metadata.message_type == "train" for m in sent)
