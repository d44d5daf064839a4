"""Where a run's metrics are read from: a local path (a mounted volume) or an `s3://` location,
behind one small interface the followers in readers.py share, so each format is read by one
piece of code wherever its writer puts it:

- `list(sub)`: what is at the location now, {name: Entry(size, version)}: a file location
  is one entry under its own name; a directory (prefix) gives every file under it by its
  name relative to the location (`sub`: only names starting with it, a hint that narrows
  the listing). `kind` then says "file", "dir" or None (nothing there yet).
- `read(name, start, end, version)`: bytes [start, end) of a listed file, or None when the
  file changed since it was listed (the next poll lists it again).

Local: a stat (and a walk of a directory) per poll; a file's version is its mtime and inode.
S3: one ListObjectsV2 per poll (names, sizes and ETags come in the listing: no request per
object; a location that is one object: its HEAD), and a ranged GET of only the bytes past what was read, with If-Match on the listed
ETag. S3 has no append: a writer re-uploads the whole object each time, so the follower
reads [its offset, the listed size) of the newest version; an object replaced by a shorter
one is the followers' error (the metrics must only grow). Storage errors (no such bucket,
access denied, unreachable endpoint) are storage.s3's, raised as they come: no secret in them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from moe_proxy.errors import MalformedMetrics, MetricsShrank, StorageError


@dataclass(frozen=True)
class Entry:
    size: int
    version: str  # changes when the file is rewritten: the S3 ETag, a local mtime and inode


class MetricsSource(Protocol):
    where: str  # the location as given, for messages
    kind: str | None  # "file", "dir", or None while nothing is there (as the last list() saw)

    def list(self, sub: str = "") -> dict[str, Entry]: ...
    def read(self, name: str, start: int, end: int, version: str) -> bytes | None: ...
    def label(self, name: str) -> str: ...


def is_s3(location: str | Path) -> bool:
    return isinstance(location, str) and location.startswith("s3://")


def open_source(location: str | Path, store_options: dict | None = None) -> MetricsSource:
    """A local path or an s3:// URI (`store_options`: storage.open_store's keyword arguments)."""
    if is_s3(location):
        return S3Source(str(location), store_options or {})
    if isinstance(location, str) and "://" in location:
        raise StorageError(f"unsupported location {location!r}: use a local path or s3://bucket/prefix")
    return LocalSource(Path(location))


class LocalSource:
    def __init__(self, path: Path):
        self.path, self.where, self.kind = path, str(path), None

    def list(self, sub: str = "") -> dict[str, Entry]:
        try:
            if self.path.is_file():
                self.kind = "file"
                return {self.path.name: _entry(self.path)}
            self.kind = "dir" if self.path.is_dir() else None
            return self._walk(sub) if self.kind else {}
        except OSError as exc:
            raise MalformedMetrics(f"{self.path}: cannot read ({exc.strerror or exc})") from None

    def _walk(self, sub: str) -> dict[str, Entry]:
        if sub and "/" not in sub and "*" not in sub:  # one file at the top: no walk
            found = self.path / sub
            return {sub: _entry(found)} if found.is_file() else {}
        out = {}
        try:
            files = sorted(self.path.rglob("*"))
        except OSError as exc:
            raise MalformedMetrics(f"{self.path}: cannot read the directory ({exc.strerror})") from None
        for p in files:
            name = p.relative_to(self.path).as_posix()
            try:
                if name.startswith(sub) and p.is_file():
                    out[name] = _entry(p)
            except FileNotFoundError:  # deleted since the walk saw it
                continue
        return out

    def read(self, name: str, start: int, end: int, version: str) -> bytes | None:
        path = self.path if self.kind == "file" else self.path / name
        try:
            with path.open("rb") as f:
                f.seek(start)
                return f.read(end - start)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise MalformedMetrics(f"{path}: cannot read ({exc.strerror or exc})") from None

    def label(self, name: str) -> str:
        return str(self.path if self.kind == "file" else self.path / name)


def _entry(path: Path) -> Entry:
    st = path.stat()
    return Entry(st.st_size, f"{st.st_mtime_ns}:{st.st_ino}")


class S3Source:
    """An object or a prefix: `store` is opened at the location (its listing, errors named by
    the location), `parent` at the folder above, lazily, to read the object itself when the
    location is one. A URI that ends in / or names a bucket only is a prefix."""

    def __init__(self, uri: str, store_options: dict):
        from moe_proxy.storage import open_store
        from moe_proxy.storage.s3 import parse_uri

        bucket, key = parse_uri(uri)
        self.where, self.options = f"s3://{bucket}/{key}".rstrip("/"), store_options
        self.folder, _, self.base = key.rpartition("/")
        self.store = open_store(self.where, **store_options)
        self._parent = None
        self.kind: str | None = "dir" if not key or uri.endswith("/") else None

    @property
    def parent(self):
        if self._parent is None:
            from moe_proxy.storage import open_store

            self._parent = open_store(f"s3://{self.store.bucket}/{self.folder}", **self.options)
        return self._parent

    @property
    def bytes_downloaded(self) -> int:
        return self.store.bytes_downloaded + (self._parent.bytes_downloaded if self._parent else 0)

    def list(self, sub: str = "") -> dict[str, Entry]:
        """One request once the kind is known (the prefix's listing, or the object's HEAD); until
        then the prefix is listed, then the object asked for (never its siblings' listing)."""
        if self.kind != "file":
            found = self.store.list_entries(sub if self.kind == "dir" else "")
            if found or self.kind == "dir":
                self.kind = "dir"
                return {k: Entry(*v) for k, v in found.items()}
        head = self.parent.entry(self.base)
        self.kind = "file" if head else None
        return {self.base: Entry(*head)} if head else {}

    def read(self, name: str, start: int, end: int, version: str) -> bytes | None:
        store = self.parent if self.kind == "file" else self.store
        return store.read_if_unchanged(name, start, end - start, version)

    def label(self, name: str) -> str:
        return f"{self.parent.uri if self.kind == 'file' else self.where}/{name}"


class Tail:
    """The bytes of one growing file not yet read: each call reads past its offset only. A
    file (object) shorter than the offset was truncated or replaced: errors.MetricsShrank, as the
    run's metrics must only grow."""

    def __init__(self, source: MetricsSource, name: str):
        self.source, self.name, self.offset = source, name, 0

    def new_bytes(self, entry: Entry) -> bytes:
        if entry.size < self.offset:
            raise MetricsShrank(f"{self.source.label(self.name)}: the file shrank from {self.offset} to "
                                   f"{entry.size} bytes while being watched (truncated, or replaced by a shorter "
                                   "one); a run's metrics file must only grow")
        if entry.size == self.offset:
            return b""
        data = self.source.read(self.name, self.offset, entry.size, entry.version)
        if data is None:
            return b""
        self.offset += len(data)
        return data
