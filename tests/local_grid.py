"""An in-process Flower Grid for tests: delivers messages straight to the ClientApp.

Each node has its own ``Context`` (node config with its partition id, persistent state),
so the ServerApp's ``Experiment`` and the algorithms' server and client halves run exactly
as in simulation, only without the SuperLink and Ray start-up. ``sent`` and ``replies``
keep every message for inspection; ``fail`` makes chosen partitions raise; ``corrupt``
alters chosen partitions' training replies (a function of the reply content, by partition id);
``reverse`` returns the replies in reverse order; ``run_id`` and ``first_node_id`` make a
grid look like another run (as a resumed run is).

A client exception is raised into the test, so a crashing client fails it; a test that injects
faults which make clients raise says so with ``client_errors=True``, and the grid then turns them
into error replies, as the simulation runtime does. A grid made with ``fail``, ``corrupt`` or
``client_errors`` declares its faults (:data:`faults_declared`): the runs of that test may then have
failed replies (``tests/conftest.py`` fails any other test whose run has one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from flower_app.app.client_app import app as client_app


#: Whether the running test made a grid that injects faults (reset before each test by tests/conftest.py).
faults_declared = False


class LocalGrid(Grid):
    """``num_nodes`` nodes serving partitions ``0..num_nodes-1`` of one run config."""

    #: The error reason of a partition in ``fail`` (``{pid}``: its partition id).
    fail_reason = "partition {pid} was told to fail"

    def __init__(self, num_nodes: int, run_config: dict, fail: Iterable[int] = (), reverse: bool = False,
                 corrupt: Mapping[int, Callable[[RecordDict], None]] | None = None, run_id: int = 1,
                 first_node_id: int = 1000, client_errors: bool = False) -> None:
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
        self.node_ids = [first_node_id + i for i in range(num_nodes)]
        self.contexts = {
            node: Context(
                run_id=run_id,
                node_id=node,
                node_config={"partition-id": pid, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for pid, node in enumerate(self.node_ids)
        }
        self.fail = set(fail)
        self.corrupt = dict(corrupt or {})
        self.reverse = reverse  # deliver replies in reverse order (as a real federation may)
        self.client_errors = client_errors  # the test injects faults that make clients raise
        if self.fail or self.corrupt or client_errors:
            global faults_declared
            faults_declared = True
        self.sent: list[Message] = []
        self.replies: list[Message] = []
        self._waiting: dict[str, Message] = {}  # pushed messages' replies, by the message's id

    # -- Grid API used by the ServerApp ---------------------------------------------------
    @property
    def run(self):  # pragma: no cover - not used by the project's ServerApp
        raise NotImplementedError

    def set_run(self, run_id: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:  # pragma: no cover
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message at once; its reply waits for :meth:`pull_messages`."""
        replies = self.send_and_receive(messages)
        self._waiting.update({rep.metadata.reply_to_message_id: rep for rep in replies})
        return [rep.metadata.reply_to_message_id for rep in replies]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        wanted = set(message_ids)
        return [self._waiting.pop(i) for i in [i for i in self._waiting if i in wanted]]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        out = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            self.sent.append(msg)
            context = self.contexts[msg.metadata.dst_node_id]
            pid = int(context.node_config["partition-id"])
            if pid in self.fail:
                rep = Message(Error(code=0, reason=self.fail_reason.format(pid=pid)), reply_to=msg)
            else:
                try:
                    rep = client_app(msg, context)
                except Exception as exc:  # the simulation runtime turns exceptions into error replies
                    if not self.client_errors:
                        raise
                    rep = Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
            rep.metadata.__dict__["_src_node_id"] = msg.metadata.dst_node_id
            if pid in self.corrupt and msg.metadata.message_type == "train" and not rep.has_error():
                self.corrupt[pid](rep.content)
            self.replies.append(rep)
            out.append(rep)
        return out[::-1] if self.reverse else out
