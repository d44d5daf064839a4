"""Where checkpoints live: a local directory or (see s3.py) an object-store prefix.

A `Store` is a flat namespace of files under one root. Everything the transformer does goes
through these few calls, so reading (ranged) and writing (atomic, streamed) behave the same
whether the checkpoint is on disk or in a bucket.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Protocol

from moe_proxy.errors import CorruptCheckpoint, StorageError


class Writer(Protocol):
    """A file being written: bytes go in with `write`; nothing is visible under its final
    name until `commit`. `abort` throws the partial file away."""

    def write(self, data: bytes | memoryview) -> int: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


class Store(Protocol):
    uri: str

    def exists(self, name: str) -> bool: ...
    def size(self, name: str) -> int: ...
    def read_range(self, name: str, start: int, length: int) -> bytes: ...
    def read_bytes(self, name: str) -> bytes: ...
    def list(self) -> list[str]: ...
    # Every file whose name (relative to the store, as list() gives it) starts with `prefix`,
    # with its size, from one listing: no request per file.
    def list_sizes(self, prefix: str = "") -> dict[str, int]: ...
    def writer(self, name: str) -> Writer: ...
    def delete(self, name: str) -> None: ...
    # A content checksum the store itself keeps for a file, fetched without reading the file
    # (S3: the object's SHA256 checksum); None where there is none (local files: hash them).
    def checksum(self, name: str) -> str | None: ...
    # Throw away writes that never committed (a killed attempt's temporary files, incomplete
    # multipart uploads); returns how many. Only while no writer is active (a build's finalize).
    def discard_incomplete(self) -> int: ...


def open_store(uri: str, **options) -> Store:
    """A store for a local path or an `s3://bucket/prefix` URI. The CLI's transfer options
    (max_inflight_mb, streams, read_part_mb) become a `transfer` (inflight.Transfer) unless
    one is given."""
    if uri.startswith("s3://"):
        from moe_proxy.storage.inflight import Transfer
        from moe_proxy.storage.s3 import S3Store  # boto3 only when needed

        if {"max_inflight_mb", "streams", "read_part_mb"} & set(options):
            transfer = Transfer.from_options(options)
            options.setdefault("transfer", transfer)
        return S3Store(uri, **options)
    if "://" in uri:
        raise StorageError(f"unsupported location {uri!r}: use a local path or s3://bucket/prefix")
    return LocalStore(uri)


def location(uri: str) -> tuple[str, ...]:
    """Where `uri` points, however it is spelled: a local path resolved to its real path
    (symlinks followed, `.`/`..` and relative spellings gone, the folder need not exist), an
    `s3://` URI as ("s3:", bucket, *prefix parts) with empty parts dropped."""
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        return ("s3:", bucket, *filter(None, prefix.split("/")))
    return Path(uri).expanduser().resolve().parts


def overlap(a: str, b: str) -> str | None:
    """How locations `a` and `b` overlap: "same", "inside" (a lies inside b), "contains" (b
    lies inside a), or None when they are apart. A build must never write into its source."""
    la, lb = location(a), location(b)
    if la == lb:
        return "same"
    if la[:len(lb)] == lb:
        return "inside"
    if lb[:len(la)] == la:
        return "contains"
    return None


def write_bytes(store: Store, name: str, data: bytes) -> None:
    w = store.writer(name)
    try:
        w.write(data)
    except BaseException:
        w.abort()
        raise
    w.commit()


def sha256_of(store: Store, name: str, chunk: int = 64 << 20) -> str:
    """sha256 of a stored file, read in bounded chunks."""
    h = hashlib.sha256()
    total = store.size(name)
    for start in range(0, total, chunk):
        h.update(store.read_range(name, start, min(chunk, total - start)))
    return h.hexdigest()


class LocalStore:
    """A directory on local disk. Writes go to a hidden temporary file renamed into place on
    commit, so a crash never leaves a truncated file under a real name."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.uri = str(self.root)

    def _path(self, name: str) -> Path:
        return self.root / name

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def size(self, name: str) -> int:
        try:
            return self._path(name).stat().st_size
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{self._path(name)}: file not found") from None

    def read_range(self, name: str, start: int, length: int) -> bytes:
        try:
            with open(self._path(name), "rb") as f:
                f.seek(start)
                data = f.read(length)
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{self._path(name)}: file not found") from None
        if len(data) != length:
            raise CorruptCheckpoint(
                f"{self._path(name)}: wanted bytes {start}..{start + length} but the file has "
                f"{self.size(name)} bytes (truncated?)"
            )
        return data

    def read_bytes(self, name: str) -> bytes:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{self._path(name)}: file not found") from None

    def list(self) -> list[str]:
        return list(self.list_sizes())

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        folder = self.root / prefix.rpartition("/")[0]  # walk only the folder the prefix is in
        if not folder.is_dir():
            return {}
        out = {}
        for p in folder.rglob("*"):
            name = p.relative_to(self.root).as_posix()
            if p.name.startswith(".moe-proxy-tmp-") or not name.startswith(prefix):
                continue
            try:
                if p.is_file():
                    out[name] = p.stat().st_size
            except FileNotFoundError:  # deleted since the walk saw it
                continue
        return dict(sorted(out.items()))

    def writer(self, name: str) -> "LocalWriter":
        return LocalWriter(self._path(name))

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def checksum(self, name: str) -> str | None:
        return None

    def discard_incomplete(self) -> int:
        stale = list(self.root.rglob(".moe-proxy-tmp-*")) if self.root.is_dir() else []
        for path in stale:
            path.unlink(missing_ok=True)
        return len(stale)


def file_mode() -> int:
    """The mode a new file gets under this process's umask (0644 under 022), as `cp` and
    `save_pretrained` give: mkstemp's 0600 would make a proxy unreadable to anyone else."""
    try:  # Linux >= 4.7 reports it without changing it (changing it races with other threads)
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


class LocalWriter:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        fd, tmp = tempfile.mkstemp(prefix=".moe-proxy-tmp-", dir=path.parent)
        self.tmp = Path(tmp)
        self.file: BinaryIO = os.fdopen(fd, "wb")

    def write(self, data: bytes | memoryview) -> int:
        return self.file.write(data)

    def commit(self) -> None:
        self.file.flush()
        os.fchmod(self.file.fileno(), file_mode())
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)
