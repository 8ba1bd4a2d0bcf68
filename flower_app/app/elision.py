"""A large record that many messages of one exchange share crosses to each client process once.

In simulation one ClientApp process serves many nodes (two Ray workers serve 1,000 clients), and
every evaluate message of a round carries the same global arrays (FedRep CIFAR-10: a 1.2 MB body,
1.2 GB a round through Ray's object store). So, only where the start-up handshake showed client
processes that serve several nodes each (never in a deployment, whose SuperNodes have processes of
their own):

- the server sends such a record (an ArrayRecord of at least :data:`ELIDE_ABOVE_BYTES` carried by
  two or more messages of the exchange) in full in the first messages, one per client process it
  knows of, and leaves it out of the others; every message names the digest of each such record
  (config record :data:`BODIES`: record name -> digest). The engine hands the first messages to
  idle workers first, so each process usually serves one of the full ones first;
- a client process keeps the shared records of the last message that named any (:data:`HELD`, by
  digest; so at most one message's worth: the body of the current round, not of the past ones)
  and puts them back into a message that lacks them before any handler sees it;
- a process that does not hold one (it served none of the full messages, or it restarted) answers
  with :data:`MISSING` instead, and the server sends that message again in full.

So a reply never depends on which process serves a message, and the handlers see the same content
as without elision (an exchange whose messages shared different records, one group each, would
send some again where a process switches groups; no algorithm here sends such an exchange). What
the run counts as communication (``Traffic``) is what each algorithm sends to each client, elided
or not: the numbers of a run do not change.
"""

from __future__ import annotations

import hashlib
import uuid
from collections import Counter
from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable

BODIES = "flrep-bodies"  # config record of a message: record name -> digest of a shared record
MISSING = "flrep-missing"  # config record of a reply: the records this client process does not hold
PROCESS = "flrep-process"  # config record of the handshake reply: which client process answered
ELIDE_ABOVE_BYTES = 64 * 1024  # smaller records are sent in every message

#: This client process, as the handshake reply names it.
PROCESS_ID = uuid.uuid4().hex
#: The shared records of the last message that named any, by digest, as this client process holds them.
HELD: dict[str, ArrayRecord] = {}


def record_bytes(record: ArrayRecord) -> int:
    """The serialized size of ``record``'s arrays."""
    return sum(len(array.data) for array in record.values())


def digest(record: ArrayRecord) -> str:
    """A digest of ``record``: its keys, dtypes, shapes and bytes."""
    h = hashlib.blake2b(digest_size=16)
    for key, array in record.items():
        h.update(f"{key}\0{array.dtype}\0{tuple(array.shape)}\0{array.stype}\0".encode())
        h.update(array.data)
    return h.hexdigest()


def _copy(record: ArrayRecord) -> ArrayRecord:
    """A record of its own with the same arrays (their bytes are shared: they never change)."""
    return ArrayRecord(dict(record.items()))


# -- server half ------------------------------------------------------------------------------
def shared_bodies(messages: list[Message]) -> list[dict[str, str]]:
    """Per message: its large records that other messages of ``messages`` carry too (name -> digest)."""
    digests: dict[int, str] = {}  # id(record) -> digest: a strategy sends one record object to all nodes
    found: list[dict[str, str]] = []
    for msg in messages:
        bodies = {}
        for name, record in msg.content.array_records.items():
            if record_bytes(record) >= ELIDE_ABOVE_BYTES:
                if id(record) not in digests:
                    digests[id(record)] = digest(record)
                bodies[name] = digests[id(record)]
        found.append(bodies)
    count = Counter(d for bodies in found for d in bodies.values())
    return [{name: d for name, d in bodies.items() if count[d] > 1} for bodies in found]


def wire_messages(messages: list[Message], processes: int) -> list[tuple[Message, Message, dict[str, str]]]:
    """(message to send, the message it stands for, its shared records) for each of ``messages``:
    each shared record is carried in full by its first ``processes`` messages and left out of the
    rest (``processes`` 0: nothing is left out, and the messages are sent as they are)."""
    if processes <= 0:
        return [(msg, msg, {}) for msg in messages]
    full = Counter()
    out = []
    for msg, bodies in zip(messages, shared_bodies(messages)):
        if not bodies:
            out.append((msg, msg, bodies))
            continue
        left_out = {name for name, d in bodies.items() if full[d] >= processes}
        full.update(d for name, d in bodies.items() if name not in left_out)
        out.append((resend(msg, bodies, left_out), msg, bodies))
    return out


def resend(msg: Message, bodies: dict[str, str], left_out: Iterable[str] = ()) -> Message:
    """A new message for ``msg``'s node with its content less the records ``left_out``, naming its
    shared records ``bodies``."""
    left_out = set(left_out)
    content = RecordDict({name: record for name, record in msg.content.items() if name not in left_out})
    content[BODIES] = ConfigRecord(dict(bodies))
    meta = msg.metadata
    return Message(content, dst_node_id=meta.dst_node_id, message_type=meta.message_type, ttl=meta.ttl,
                   group_id=meta.group_id or None, dst_task_id=meta.dst_task_id)


def asks_for_bodies(reply: Message) -> bool:
    """Whether ``reply`` says its client process lacked a record that was left out."""
    return not reply.has_error() and MISSING in reply.content.config_records


def shares_processes(process_of: dict[int, str]) -> int:
    """How many client processes to send shared records to in full: the number of distinct
    processes that answered the handshake (node -> process), when some serve several nodes; 0 when
    every node has a process of its own (a deployment), which turns elision off."""
    distinct = len(set(process_of.values()))
    return distinct if distinct < len(process_of) else 0


# -- client half ------------------------------------------------------------------------------
def elision_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Keep the shared records a message carries in full; put them back where they were left out,
    or answer :data:`MISSING` when this process does not hold one."""
    if not msg.has_content() or BODIES not in msg.content.config_records:
        return call_next(msg, context)
    bodies = {str(name): str(d) for name, d in msg.content.config_records[BODIES].items()}
    content = RecordDict({name: record for name, record in msg.content.items() if name != BODIES})
    for d in [d for d in HELD if d not in bodies.values()]:  # an earlier round's: no message needs it again
        del HELD[d]
    missing = []
    for name, d in bodies.items():
        if name in content.array_records:
            HELD[d] = _copy(content.array_records[name])
        elif d in HELD:
            content[name] = _copy(HELD[d])
        else:
            missing.append(name)
    if missing:
        return Message(RecordDict({MISSING: ConfigRecord({"records": missing})}), reply_to=msg)
    # a new message: the received one stays as it was sent (an in-process grid keeps it)
    return call_next(Message(content, metadata=msg.metadata), context)
