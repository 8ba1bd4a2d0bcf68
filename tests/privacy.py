"""The privacy check: what a client keeps as private never crosses the wire, by value.

The plug-in ``tests.privacy_spy`` (``plugins=[tests.privacy_spy]``), imported by every process of a
run, the simulation engine's Ray workers included, calls :func:`install`: it wraps every client
handler of every algorithm and protocol. After each message a client handles it writes, under ``<out_dir>/privacy/<label>/``,
what the handler received (every array and every number of its configs and metrics), what it
replied, and every array the client keeps for that variant (``context.state``'s ArrayRecords under
its label and the files they point to) before and after.

:func:`leaks` then reads those records in the test and names every value on the wire, in either
direction, that gives away a value a client kept and did not receive as it is:

- **by hash**: an array equal to a kept one (names and shapes play no part);
- **by closeness**: an array within a relative 1e-5 (in norm) of a kept one of its shape;
- **by update**: a reply's array minus the array the client received under that key, close to
  how a kept array changed while the client handled a message;
- **by scalar**: a number in a config or metrics record close (relative 1e-6) to an element of a
  kept array of at most four elements that is not a whole number (kept round counters are not private).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from uuid import uuid4

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

FOLDER = "privacy"  # under the run's out_dir, one folder per variant
SHARED = Callable[[str], bool]  # "<state entry>/<key>" -> whether the algorithm shares it by design
ARRAY_TOL = 1e-5  # relative distance (in norm) below which two arrays are one value
SCALAR_TOL = 1e-6


def fingerprint(array: np.ndarray) -> str:
    """The value of an array: dtype, shape and bytes."""
    array = np.ascontiguousarray(array)
    return hashlib.sha256(f"{array.dtype}{array.shape}".encode() + array.tobytes()).hexdigest()


# --- the client side: the plug-in that records every handled message -------------------------------

def _arrays(content: RecordDict) -> dict[str, np.ndarray]:
    return {f"{name}/{key}": array.numpy() for name, record in content.array_records.items()
            for key, array in record.items()}


def _scalars(content: RecordDict) -> dict[str, float]:
    out = {}
    for name, record in content.items():
        if not isinstance(record, (ConfigRecord, MetricRecord)):
            continue
        for key, value in record.items():
            values = value if isinstance(value, list) else [value]
            for i, v in enumerate(values):
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"{name}/{key}" + (f"[{i}]" if isinstance(value, list) else "")] = float(v)
    return out


def _kept(state: RecordDict, label: str) -> dict[str, np.ndarray]:
    """The arrays kept by run variant ``label`` (variants share a node's state, each under its label)."""
    out = {}
    for entry, record in state.items():
        if not entry.startswith(f"{label}/"):
            continue
        if isinstance(record, ArrayRecord):
            out.update({f"{entry}/{k}": a.numpy() for k, a in record.items()})
        elif isinstance(record, ConfigRecord) and "path" in record and Path(str(record["path"])).is_file():
            out.update({f"{entry}/{k}": t.numpy() for k, t in torch.load(str(record["path"]), weights_only=True).items()})
    return out


def _spied(kind: str, handler):
    def spied(rt, content: RecordDict) -> RecordDict:
        before = _kept(rt.state, str(rt.cfg.label))
        reply = handler(rt, content)
        folder = Path(str(rt.cfg.out_dir)) / FOLDER / str(rt.cfg.label)
        folder.mkdir(parents=True, exist_ok=True)
        record = {"pid": rt.partition_id, "kind": kind, "round": int(content["config"].get("server-round", 0))
                  if "config" in content else 0, "down": _arrays(content), "up": _arrays(reply),
                  "down_scalars": _scalars(content), "up_scalars": _scalars(reply),
                  "kept_before": before, "kept_after": _kept(rt.state, str(rt.cfg.label))}
        np.save(folder / f"{rt.partition_id}-{kind}-{uuid4().hex}.npy", np.array(record, dtype=object))
        return reply
    spied.spied = True
    return spied


def _spy_on(handlers: dict) -> None:
    for kind, handler in list(handlers.items()):
        if not getattr(handler, "spied", False):
            handlers[kind] = _spied(kind, handler)


def install() -> None:
    """Wrap the handlers of every registered algorithm and protocol (plug-ins loaded before this one too)."""
    from flower_app.app import client_app
    from strategies import ALGORITHMS

    for algorithm in ALGORITHMS.values():
        _spy_on(algorithm.handlers)
    _spy_on(client_app.PROTOCOL_HANDLERS)


# --- the test side: what the records show ---------------------------------------------------------

@dataclass
class Call:
    pid: int
    kind: str
    round: int
    down: dict[str, np.ndarray]
    up: dict[str, np.ndarray]
    down_scalars: dict[str, float]
    up_scalars: dict[str, float]
    kept_before: dict[str, np.ndarray]
    kept_after: dict[str, np.ndarray]


def calls(variant_dir: Path) -> list[Call]:
    """The recorded messages of one variant (``<out_dir>/privacy/<label>``), in round order."""
    found = [Call(**np.load(path, allow_pickle=True).item()) for path in variant_dir.glob("*.npy")]
    return sorted(found, key=lambda c: (c.round, c.pid, c.kind))


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or not np.issubdtype(a.dtype, np.floating) or not np.issubdtype(b.dtype, np.floating):
        return False
    scale = float(np.linalg.norm(b.astype(np.float64)))
    return scale > 0 and float(np.linalg.norm(a.astype(np.float64) - b.astype(np.float64))) <= ARRAY_TOL * scale


def leaks(recorded: list[Call], shared: SHARED = lambda name: False) -> list[str]:
    """Every value on the wire that gives away a kept private value (see the module's doc)."""
    assert recorded, "no message was recorded: nothing was checked"
    received = {}
    for call in recorded:
        received.setdefault(call.pid, set()).update(fingerprint(a) for a in call.down.values())
    private: dict[str, tuple[str, np.ndarray]] = {}  # hash -> (where, value)
    updates: list[tuple[str, np.ndarray]] = []
    for call in recorded:
        for kept in (call.kept_before, call.kept_after):
            for name, value in kept.items():
                if not shared(name) and (h := fingerprint(value)) not in received[call.pid]:
                    private.setdefault(h, (f"partition {call.pid} keeps {name}", value))
        for name, value in call.kept_after.items():
            old = call.kept_before.get(name)
            if (not shared(name) and old is not None and old.shape == value.shape
                    and np.issubdtype(value.dtype, np.floating) and not np.array_equal(old, value)):
                updates.append((f"partition {call.pid}'s update of {name} in {call.kind}", value - old))
    assert private, "no client kept anything private: nothing was checked"
    scalars = [(where, float(x)) for where, value in private.values() if value.size <= 4
               for x in value.ravel().tolist() if not float(x).is_integer()]
    found = []
    for call in recorded:
        for direction, arrays, numbers in (("down", call.down, call.down_scalars), ("up", call.up, call.up_scalars)):
            at = f"{direction} {call.kind} of partition {call.pid}"
            for key, array in arrays.items():
                if (h := fingerprint(array)) in private:
                    found.append(f"{at}: {key} is {private[h][0]} (by hash)")
                    continue
                close = next((where for where, value in private.values() if _close(array, value)), None)
                if close:
                    found.append(f"{at}: {key} is {close} (by closeness)")
                    continue
                if direction == "up" and key in call.down and array.shape == call.down[key].shape:
                    delta = array.astype(np.float64) - call.down[key].astype(np.float64)
                    moved = next((where for where, update in updates if _close(delta, update)), None)
                    if moved:
                        found.append(f"{at}: {key} minus what was received is {moved} (by update)")
            for key, number in numbers.items():
                match = next((where for where, x in scalars if math.isclose(number, x, rel_tol=SCALAR_TOL)), None)
                if match:
                    found.append(f"{at}: {key}={number} is an element of {match} (by scalar)")
    return found
