"""Where the checkpoint of a run comes from. transformers loads from local files only, so a
remote (s3://) checkpoint is first copied to a temporary directory, then loaded from there."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from moe_proxy.errors import CorruptCheckpoint
from moe_proxy.storage.materialize import local_copy
from moe_proxy.storage import open_store


@contextlib.contextmanager
def local_checkpoint(uri: str) -> Iterator[Path]:
    """Yield a local directory holding the checkpoint at `uri` (a path or s3://bucket/prefix)."""
    store = open_store(uri)
    if not store.exists("config.json"):
        raise CorruptCheckpoint(f"{uri}: no config.json there; expected a Hugging Face checkpoint directory")
    with local_copy(store) as path:
        yield Path(path)
