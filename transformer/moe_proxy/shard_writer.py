"""Stream a safetensors file: the header is computed up front from each tensor's dtype and
shape, then tensor bytes are written in order as they arrive, so no more than one tensor
(or one chunk of it) is ever held. The safetensors package can only serialise tensors that
are all in memory at once, hence this small writer; the format is its documented one:
8-byte little-endian header length, JSON header padded with spaces to 8 bytes, data.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Callable, Iterable

from .checkpoint import ITEMSIZE
from .storage import Store


@dataclass
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[bytes]]  # produces exactly nbytes, lazily

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


@dataclass
class Written:
    name: str
    size: int
    sha256: str


def write_file(store: Store, name: str, pieces: Iterable[bytes], on_bytes: Callable[[int], None] = lambda n: None) -> Written:
    """Write `pieces` to `store/name` atomically, hashing as we go."""
    h, size = hashlib.sha256(), 0
    w = store.writer(name)
    try:
        for piece in pieces:
            h.update(piece)
            w.write(piece)
            size += len(piece)
            on_bytes(len(piece))
    except BaseException:
        w.abort()
        raise
    w.commit()
    return Written(name, size, h.hexdigest())


def shard_pieces(tensors: list[OutTensor], metadata: dict[str, str] | None = None) -> Iterable[bytes]:
    yield header_bytes(tensors, metadata)
    for t in tensors:
        n = 0
        for chunk in t.chunks():
            n += len(chunk)
            yield chunk
        if n != t.nbytes:  # a bug, never a user error: refuse to write a corrupt shard
            raise AssertionError(f"{t.name}: produced {n} bytes, header says {t.nbytes}")
