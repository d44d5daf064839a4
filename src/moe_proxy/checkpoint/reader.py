"""Open a Hugging Face checkpoint without loading it: config.json, the shard index and each
shard's safetensors *header* (8-byte little-endian length, then JSON). Headers give every
tensor's dtype, shape and byte range, which is all the planner needs; tensor bytes are read
later by range, only for the tensors that are kept (reads.py). Torch-free, so the operator can use it.
"""

from __future__ import annotations

import json
import math
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from moe_proxy.errors import CorruptCheckpoint
from moe_proxy.checkpoint.reads import read_coalesced
from moe_proxy.storage import Store, open_store

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MANIFEST = "proxy-manifest.json"
JOURNAL = ".moe-proxy-journal"  # prefix of a build's journals: present until its manifest is published
MAX_HEADER = 100 << 20  # safetensors itself refuses headers over 100 MB
SMALL_READ_THREADS = 16  # small planning requests (HEADs, headers, routers) in flight at once

# Bytes per element of each safetensors dtype.
ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str  # shard file name
    start: int  # absolute byte offset in the shard file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Checkpoint:
    store: Store
    config: dict
    files: list[str]  # shard files, in index order
    tensors: dict[str, TensorInfo]  # every tensor, grouped by file and in byte order
    index_metadata: dict = field(default_factory=dict)
    file_sizes: dict[str, int] = field(default_factory=dict)
    # Tensors read once and kept (routers, see preload): read() and read_slices() serve them.
    preloaded: dict[str, bytes] = field(default_factory=dict)

    @property
    def uri(self) -> str:
        return self.store.uri

    def in_file(self, file: str) -> list[TensorInfo]:
        return [t for t in self.tensors.values() if t.file == file]

    def read(self, name: str) -> bytes:
        if (data := self.preloaded.get(name)) is not None:
            return data
        t = self.tensors[name]
        return self.store.read_range(t.file, t.start, t.nbytes)

    def read_slices(self, name: str, axis: int, keep: list[int], gap: int = 0) -> bytes:
        """The bytes of tensor `name` restricted to indices `keep` along `axis`, in that order.
        Only the needed byte ranges are read; ranges at most `gap` bytes apart are merged into
        one request."""
        t = self.tensors[name]
        ranges = slice_ranges(t, axis, keep)
        if (data := self.preloaded.get(name)) is not None:
            return b"".join(data[s - t.start : s - t.start + n] for s, n in ranges)
        return read_coalesced(self.store, t.file, ranges, gap)

    def preload(self, names: list[str]) -> None:
        """Read tensors `names` once and keep them (a build's routers: for the source identity,
        the features and the output rows alike). Neighbours in a file come in one request;
        files are read in parallel."""
        by_file: dict[str, list[TensorInfo]] = {}
        for t in sorted((self.tensors[n] for n in names if n not in self.preloaded), key=lambda t: (t.file, t.start)):
            by_file.setdefault(t.file, []).append(t)

        def read_file(ts: list[TensorInfo]) -> None:
            data = memoryview(read_coalesced(self.store, ts[0].file, [(t.start, t.nbytes) for t in ts]))
            at = 0
            for t in ts:
                self.preloaded[t.name] = bytes(data[at : at + t.nbytes])
                at += t.nbytes

        _in_parallel(read_file, list(by_file.values()))

    def other_files(self) -> list[str]:
        """Files that are neither shards nor the index (tokenizer, generation config, code)."""
        skip = set(self.files) | {INDEX, "config.json", MANIFEST}
        return [n for n in self.store.list() if n not in skip and not n.startswith(".")]


def slice_ranges(t: TensorInfo, axis: int, keep: list[int]) -> list[tuple[int, int]]:
    """Absolute (start, length) byte ranges selecting `keep` along `axis` of a C-ordered tensor."""
    outer = math.prod(t.shape[:axis])
    inner = math.prod(t.shape[axis + 1 :]) * ITEMSIZE[t.dtype]
    n = t.shape[axis]
    return [(t.start + (o * n + e) * inner, inner) for o in range(outer) for e in keep]


def read_header(store: Store, file: str, file_size: int) -> tuple[dict[str, TensorInfo], dict]:
    """Parse and validate one shard's safetensors header. Returns (tensors, __metadata__)."""
    where = f"{store.uri}/{file}"
    if file_size < 8:
        raise CorruptCheckpoint(f"{where}: {file_size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", store.read_range(file, 0, 8))
    if n > MAX_HEADER or 8 + n > file_size:
        raise CorruptCheckpoint(
            f"{where}: header length {n} exceeds the file ({file_size} bytes): truncated or not safetensors"
        )
    raw = store.read_range(file, 8, n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpoint(f"{where}: safetensors header is not valid JSON ({exc})") from None
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + n
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpoint(f"{where}: malformed header entry for {name!r}") from None
        if dtype not in ITEMSIZE:
            raise CorruptCheckpoint(f"{where}: tensor {name!r} has unsupported dtype {dtype!r}")
        if not (0 <= begin <= end) or base + end > file_size:
            raise CorruptCheckpoint(
                f"{where}: tensor {name!r} offsets {begin}..{end} exceed the file's "
                f"{file_size - base} data bytes (truncated?)"
            )
        if end - begin != math.prod(shape) * ITEMSIZE[dtype]:
            raise CorruptCheckpoint(
                f"{where}: tensor {name!r} spans {end - begin} bytes, but {dtype}{list(shape)} needs "
                f"{math.prod(shape) * ITEMSIZE[dtype]}"
            )
        tensors[name] = TensorInfo(name, dtype, shape, file, base + begin, base + end)
    return dict(sorted(tensors.items(), key=lambda kv: kv[1].start)), metadata


def _in_parallel(fn, items: list) -> list:
    """[fn(x) for x in items], SMALL_READ_THREADS at a time; the first failure (in item order) raises."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(SMALL_READ_THREADS, len(items)), thread_name_prefix="small-read") as pool:
        return list(pool.map(fn, items))


def read_json(store: Store, name: str) -> dict:
    try:
        data = json.loads(store.read_bytes(name))
    except ValueError as exc:
        raise CorruptCheckpoint(f"{store.uri}/{name}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CorruptCheckpoint(f"{store.uri}/{name}: expected a JSON object")
    return data


def check_finished(store: Store) -> None:
    """Refuse a directory a moe-proxy build has begun and not finished (its journals are there,
    its manifest is not): its shards may be partial or of another build."""
    if not store.exists(MANIFEST) and any(n.startswith(JOURNAL) for n in store.list()):
        raise CorruptCheckpoint(f"{store.uri}: incomplete proxy (a build started there has not finished: no "
                                f"{MANIFEST}); rerun the build")


def open_checkpoint(uri: str | Store, **store_options) -> Checkpoint:
    store = open_store(uri, **store_options) if isinstance(uri, str) else uri
    if not store.exists("config.json"):
        raise CorruptCheckpoint(f"{store.uri}: no config.json (is this a Hugging Face checkpoint directory?)")
    config = read_json(store, "config.json")
    index_metadata: dict = {}
    if store.exists(INDEX):
        index = read_json(store, INDEX)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CorruptCheckpoint(f"{store.uri}/{INDEX}: no weight_map")
        index_metadata = index.get("metadata") or {}
        files = list(dict.fromkeys(weight_map.values()))
        missing = [f for f, there in zip(files, _in_parallel(store.exists, files)) if not there]
        if missing:
            raise CorruptCheckpoint(f"{store.uri}: shard(s) named in {INDEX} are missing: {', '.join(missing)}")
    elif store.exists(SINGLE):
        weight_map, files = None, [SINGLE]
    else:
        raise CorruptCheckpoint(f"{store.uri}: neither {INDEX} nor {SINGLE} found")

    # Every shard's size and header, the shards in parallel: these are latency-bound requests.
    sizes = dict(zip(files, _in_parallel(store.size, files)))
    tensors: dict[str, TensorInfo] = {}
    for found, _ in _in_parallel(lambda f: read_header(store, f, sizes[f]), files):
        tensors.update(found)
    if weight_map is not None:
        absent = [k for k, f in weight_map.items() if k not in tensors or tensors[k].file != f]
        if absent:
            raise CorruptCheckpoint(
                f"{store.uri}: {len(absent)} tensor(s) in {INDEX} are not in the shard it names, "
                f"e.g. {absent[0]!r} -> {weight_map[absent[0]]}"
            )
    return Checkpoint(store, config, files, tensors, index_metadata, sizes)
