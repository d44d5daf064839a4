"""Stream a safetensors file: the header is computed up front from each tensor's dtype and
shape, then tensor bytes are written in order as they arrive, so only a bounded window of
parts (each at most a read part, 16 MiB by default) is ever held. The safetensors package can
only serialise tensors that are all in memory at once, hence this small writer; the format is
its documented one:
8-byte little-endian header length, JSON header padded with spaces to 8 bytes, data.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable

from moe_proxy.checkpoint.reader import ITEMSIZE
from moe_proxy.storage import Store, Writer


@dataclass
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    # Where its bytes come from: (start, length) ranges of the source shard, in order, or a
    # function that returns them (router rows: read whole and sliced; healed router rows).
    source: list[tuple[int, int]] | Callable[[], bytes]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def header_bytes(tensors: list[OutTensor], metadata: dict[str, str] | None = None) -> bytes:
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def shard_size(tensors: list[OutTensor]) -> int:
    return len(header_bytes(tensors)) + sum(t.nbytes for t in tensors)


@dataclass
class Written:
    name: str
    size: int
    sha256: str


def write_file(store: Store, name: str, pieces: Iterable[bytes], on_bytes: Callable[[int], None] = lambda n: None,
               expected_size: int | None = None,
               commit: Callable[[Writer, Written], None] | None = None) -> Written:
    """Write `pieces` to `store/name` atomically, hashing as we go. The hash runs on its own
    thread (hashlib releases the GIL), overlapping with the write; one thread keeps order. A
    piece's hash is done before the next piece is taken, so a read-ahead that frees a piece's
    budget when the next is taken (reads.read_ahead) never has it still held here.
    `commit(writer, written)`: commits it instead (e.g. behind the next file); by default now."""
    h, size = hashlib.sha256(), 0
    w = store.writer(name)
    with ThreadPoolExecutor(1, thread_name_prefix="sha256") as hasher:
        try:
            for piece in pieces:
                hashed = hasher.submit(h.update, piece)
                w.write(piece)
                size += len(piece)
                on_bytes(len(piece))
                hashed.result()
            if expected_size is not None and size != expected_size:  # a bug, never a user error
                raise AssertionError(f"{name}: produced {size} bytes, expected {expected_size}")
        except BaseException:
            w.abort()
            raise
    written = Written(name, size, h.hexdigest())  # the pool has drained (with-exit): the digest is complete
    w.commit() if commit is None else commit(w, written)
    return written
