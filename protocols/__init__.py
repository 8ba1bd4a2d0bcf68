"""Paper protocols that are not algorithms, one module each, in the order their phases run.

Adding one: write ``protocols/<name>.py`` with a :class:`~protocols.base.PaperProtocol` and add
it below (or call :func:`register`).
"""

from protocols.base import PaperProtocol
from protocols.fairness import Fairness
from protocols.finetune import FineTuning
from protocols.linear_rep import LinearRepresentation
from protocols.new_clients import NewClients
from protocols.ensemble import NewTest
from protocols.online import OnlineDevice

PROTOCOLS: list[PaperProtocol] = [Fairness(), OnlineDevice(), FineTuning(), NewTest(), LinearRepresentation(),
                                  NewClients()]


def register(protocol: PaperProtocol) -> PaperProtocol:
    """Add ``protocol`` after the built-in ones."""
    if any(p.name == protocol.name for p in PROTOCOLS):
        raise ValueError(f"a protocol named {protocol.name!r} is already registered")
    PROTOCOLS.append(protocol)
    return protocol
