"""Where the checkpoint of a run comes from. transformers loads from local files only, so for a
one-process run a remote (s3://) checkpoint is first copied to a temporary directory, then
loaded from there; the ranks of a distributed run copy only its small files."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from moe_proxy.errors import CorruptCheckpoint
from moe_proxy.storage.materialize import local_copy
from moe_proxy.checkpoint.reader import check_finished, read_json
from moe_proxy.storage import Store, open_store


def check_source(uri: str) -> Store:
    """The store of a run's checkpoint, refused unless it is a finished Hugging Face checkpoint
    with a readable config.json (checked before a run starts, so that a refused run writes nothing)."""
    store = open_store(uri)
    if not store.exists("config.json"):
        raise CorruptCheckpoint(f"{uri}: no config.json there; expected a Hugging Face checkpoint directory")
    read_json(store, "config.json")  # a truncated or malformed one: refused as inspect, plan and build do
    check_finished(store)
    return store


@contextlib.contextmanager
def local_checkpoint(store: Store, weights: bool = True) -> Iterator[Path]:
    """Yield a local directory holding the checkpoint in `store` (check_source's).
    `weights=False`: a remote checkpoint's safetensors are not copied (a rank of a distributed
    run reads only its rows of them, by range: sharded_load.py), only config and tokenizer."""
    with local_copy(store, skip_suffix=None if weights else ".safetensors") as path:
        yield Path(path)
