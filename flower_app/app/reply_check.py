"""Screening of client replies before anything aggregates them.

A reply is rejected, with a reason that names the record and key, when it lacks a record or
array the algorithm expects, when an array has the wrong shape or dtype, when an array or
metric holds NaN or Inf, or when its example count is missing (training) or negative. The
expected arrays of a training reply come from the strategy's hook
``reply_template(message) -> {record name: ArrayRecord}`` (the arrays, by key, shape and
dtype, that the reply to ``message`` must carry; by default the ``arrays`` it was sent,
shape for shape: :class:`strategies.base.ServerHooks`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord

from strategies.common import METRICS, NUM_EXAMPLES


def reply_problem(reply: Message, template: Mapping[str, ArrayRecord] | None, training: bool) -> str | None:
    """Why ``reply`` must not be used, or None when it is sound."""
    content = reply.content
    problem = _metrics_problem(content[METRICS] if METRICS in content.metric_records else None, training)
    if problem:
        return problem
    for name, expected in (template or {}).items():
        if name not in content.array_records:
            return f"record {name!r} is missing"
        problem = _template_problem(name, content.array_records[name], expected)
        if problem:
            return problem
    for name, record in content.array_records.items():
        for key, array in record.items():
            values = array.numpy()
            if values.dtype.kind in "fc" and not np.isfinite(values).all():
                return f"{name}[{key!r}] holds NaN or Inf"
    return None


def _metrics_problem(metrics: MetricRecord | None, training: bool) -> str | None:
    if metrics is None:
        return f"record {METRICS!r} is missing" if training else None
    for key, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        if any(not math.isfinite(float(v)) for v in values):
            return f"metric {key!r} is NaN or Inf"
    if NUM_EXAMPLES not in metrics:
        return f"metric {NUM_EXAMPLES!r} is missing" if training else None
    if float(metrics[NUM_EXAMPLES]) < 0:
        return f"metric {NUM_EXAMPLES!r} is negative ({metrics[NUM_EXAMPLES]})"
    return None


def _template_problem(name: str, got: ArrayRecord, expected: ArrayRecord) -> str | None:
    missing = [k for k in expected if k not in got]
    if missing:
        return f"{name}: missing arrays {missing[:5]}"
    extra = [k for k in got if k not in expected]
    if extra:
        return f"{name}: unexpected arrays {extra[:5]}"
    for key, want in expected.items():
        have = got[key]
        if tuple(have.shape) != tuple(want.shape):
            return f"{name}[{key!r}]: shape {tuple(have.shape)}, expected {tuple(want.shape)}"
        if have.dtype != want.dtype:
            return f"{name}[{key!r}]: dtype {have.dtype}, expected {want.dtype}"
    return None
