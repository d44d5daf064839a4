"""A store that counts what is read through it: how the listing tests show that only
headers are read."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_proxy.storage import Store


@dataclass
class CountingStore:
    """Wraps a store and counts the bytes read through it."""

    store: Store
    bytes_read: int = 0
    reads: int = 0
    uri: str = field(init=False)

    def __post_init__(self) -> None:
        self.uri = self.store.uri

    def read_range(self, name: str, start: int, length: int) -> bytes:
        data = self.store.read_range(name, start, length)
        self.bytes_read += len(data)
        self.reads += 1
        return data

    def read_bytes(self, name: str) -> bytes:
        data = self.store.read_bytes(name)
        self.bytes_read += len(data)
        self.reads += 1
        return data

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        return self.store.list_sizes(prefix)

    def __getattr__(self, name: str):  # exists, size, list, ... pass through
        return getattr(self.store, name)
