"""What a real API server does on create that kmock's emulator leaves out, shared by the tests
that serve the emulator to an operator process (tests/chart, tests/images)."""

from __future__ import annotations

import time
import uuid


def stamp_created(data: dict) -> None:
    """Give an object being created a uid, a generation and a creation time, as the API server
    does (the operator's ownerReferences need the uid)."""
    meta = data.setdefault("metadata", {})
    meta.setdefault("uid", str(uuid.uuid4()))
    meta.setdefault("generation", 1)
    meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
