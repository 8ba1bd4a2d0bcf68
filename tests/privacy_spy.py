"""A plug-in that records every message each client handles, for the privacy check (:mod:`tests.privacy`).
Name it last in ``plugins``: it wraps the handlers registered before it."""

from tests.privacy import install

install()
