"""Running a model needs its files on local disk: a local store is used in place, a remote one
is copied to a temporary directory that is removed afterwards (the model itself is loaded by
layerwise.load.load_causal_lm)."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from moe_proxy.storage import LocalStore, Store


@contextmanager
def local_copy(store: Store, skip_suffix: str | None = None) -> Iterator[str]:
    """A local directory with the store's files (those ending in `skip_suffix` left out of a copy)."""
    if isinstance(store, LocalStore):
        yield str(store.root)
        return
    with tempfile.TemporaryDirectory(prefix="moe-proxy-") as tmp:
        for name in store.list():
            if name.startswith(".") or (skip_suffix and name.endswith(skip_suffix)):
                continue
            path = Path(tmp) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            size, chunk = store.size(name), 64 << 20
            with open(path, "wb") as f:
                for start in range(0, size, chunk):
                    f.write(store.read_range(name, start, min(chunk, size - start)))
        yield tmp

