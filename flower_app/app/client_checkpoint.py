"""Client-state snapshots, so a resumed run restores every client's state of its checkpoint round.

A ClientApp mod: the start-up handshake (``query.info``) names the snapshot folder and, when
the run resumes, the round to restore; after every training or evaluation message (and TCT's
``query.entk``) that changed its state, the client writes that state for the round (a resume
restores the newest snapshot of a round <= its checkpoint round), ``round<t>.pt`` under
``<folder>/client<partition id>/`` (the newest two are kept). The folder is the node
config's ``state-dir``/checkpoints/<run name> when the SuperNode has one; in ``flrep run``'s
simulation, whose nodes share the server's disk, the one the server names
(``<out_dir>/checkpoint/clients``); on any other node ``~/.cache/flrep/node-state/checkpoints/
<run name>``. A deployed node never writes to a path the server sends. Arrays kept on disk are
hard-linked into the snapshot (their files are replaced, never rewritten, so the link keeps the
round's content).
"""

from __future__ import annotations

import os
import shutil
import time
from logging import INFO, WARNING
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.logger import log

from flower_app.run.config import run_config_of
from flower_app.app.timing import stamp
from strategies import ALGORITHMS
from strategies.common import CONFIG
from strategies.state_store import in_simulation, mark_owner, node_home, safe_name
from task.files import load_torch, save_torch_atomic

LOCATION = "flrep-checkpoint"  # context.state entry: where this node's snapshots go
KEEP = 2


def snapshot_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Restore on a resuming handshake; snapshot after each message that changed the client's state
    (the newest snapshot of a round <= t is what a resume restores, so an unchanged state needs none)."""
    kind = msg.metadata.message_type
    config = msg.content[CONFIG] if CONFIG in msg.content.config_records else ConfigRecord()
    if kind == "query.info" and "checkpoint-dir" in config:
        _remember(context, config)
    variant = str(config.get("variant", ""))
    before = {k: context.state[k] for k in _variant_keys(context, variant)}  # held: their ids stay unique
    reply = call_next(msg, context)
    if (kind in _snapshot_types(context, config.get("variant")) and not reply.has_error() and LOCATION in context.state
            and _changed(context, variant, before)):
        start = time.perf_counter()
        try:
            _snapshot(context, variant, int(config.get("server-round", 0)))
            stamp(reply.content, "snapshot_s", time.perf_counter() - start)
        except OSError as err:  # the reply is sound; only a resume would miss this round's state
            log(WARNING, "client %s: state of round %s not snapshotted: %s", context.node_config.get("partition-id"),
                config.get("server-round"), err)
    return reply


def _changed(context: Context, variant: str, before: dict) -> bool:
    """Whether a message replaced, added or removed any of the variant's state entries (every
    write of client state assigns a new record)."""
    now = _variant_keys(context, variant)
    return set(now) != set(before) or any(context.state[k] is not before[k] for k in now)


def _snapshot_types(context: Context, variant: str | None) -> frozenset[str]:
    """The message types after which the variant's algorithm may have changed the client's state."""
    cfg = run_config_of(context.run_config, str(variant) if variant else None)
    return ALGORITHMS[cfg.algorithm].snapshot_after


def _client_dir(context: Context) -> Path:
    where = context.state[LOCATION]
    return Path(str(where["dir"])) / f"client{int(context.node_config['partition-id'])}"


def _remember(context: Context, config: ConfigRecord) -> None:
    own = "state-dir" in context.node_config or not in_simulation()  # else the server's run folder (shared disk)
    if not own:
        folder = Path(str(config["checkpoint-dir"]))
    else:
        state_dir = context.node_config.get("state-dir")
        folder = node_home(str(state_dir) if state_dir else None) / "checkpoints"
        folder = folder / safe_name(str(config.get("checkpoint-key", "run")))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if own:
            mark_owner(folder, run_config_of(context.run_config))
    except OSError as err:
        log(WARNING, "client state is not snapshotted (%s): a resumed run starts this client afresh; give the "
            "SuperNode a state-dir in its node config", err)
        return
    context.state[LOCATION] = ConfigRecord({"dir": str(folder)})
    restore = int(config.get("restore-round", -1))
    if restore >= 0:
        restore_snapshot(context, str(config.get("variant", "")), restore)


def _variant_keys(context: Context, variant: str) -> list[str]:
    return [k for k in context.state.keys() if k.startswith(f"{variant}/")]


def _snapshot(context: Context, variant: str, server_round: int) -> None:
    keys = _variant_keys(context, variant)
    folder = _client_dir(context)
    if not keys and not folder.is_dir():
        return  # no state yet (or an algorithm without client state): nothing to restore either
    folder.mkdir(parents=True, exist_ok=True)
    files = folder / f"round{server_round:06d}.files"
    shutil.rmtree(files, ignore_errors=True)
    entries: dict[str, dict] = {}
    for key in keys:
        record = context.state[key]
        if isinstance(record, ArrayRecord):
            entries[key] = {"arrays": record.to_torch_state_dict()}
        elif isinstance(record, ConfigRecord):
            config = dict(record.items())
            if "path" in config:
                files.mkdir(parents=True, exist_ok=True)
                source = Path(str(config["path"]))
                target = files / f"{key.replace('/', '__')}{source.suffix}"
                _link_or_copy(source, target)
                config["path"] = str(target)
                entries[key] = {"config": config, "live": str(source)}
            else:
                entries[key] = {"config": config}
    path = folder / f"round{server_round:06d}.pt"
    save_torch_atomic({"variant": variant, "entries": entries}, path)
    for old in sorted(folder.glob("round*.pt"))[:-KEEP]:
        old.unlink()
        shutil.rmtree(old.with_suffix(".files"), ignore_errors=True)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def restore_snapshot(context: Context, variant: str, server_round: int) -> int | None:
    """Replace this variant's client state by its newest snapshot of a round <= ``server_round``
    (no snapshot: the client had not trained by then, so its state is empty). The round restored."""
    for key in _variant_keys(context, variant):
        del context.state[key]
    folder = _client_dir(context)
    rounds = [int(p.stem[5:]) for p in folder.glob("round*.pt") if int(p.stem[5:]) <= server_round]
    if not rounds:
        return None
    found = max(rounds)
    saved = load_torch(folder / f"round{found:06d}.pt")
    for key, entry in saved["entries"].items():
        if "arrays" in entry:
            context.state[key] = ArrayRecord(entry["arrays"])
            continue
        config = dict(entry["config"])
        if "live" in entry:  # back to a file of its own: the snapshot's folder is pruned later
            live = Path(entry["live"])
            live.parent.mkdir(parents=True, exist_ok=True)
            tmp = live.with_name(f"{live.name}.restoring")
            tmp.unlink(missing_ok=True)
            _link_or_copy(Path(config["path"]), tmp)
            tmp.replace(live)
            config["path"] = str(live)
        context.state[key] = ConfigRecord(config)
    log(INFO, "client %s: state of round %d restored", context.node_config["partition-id"], found)
    return found
