"""The checkpoints under a prefix: which directories hold one, at which training step, and
whether each is complete. Torch-free: the operator's CheckpointWatch lists with this too.

A training run writes a checkpoint every N steps, e.g. verl's
`<run>/global_step_<N>/actor/huggingface/`. A checkpoint is complete when config.json is
there, the index (or a single model.safetensors) is there, every shard the index names is
there, and each shard is exactly as long as its header says (header length plus the data the
header declares). Anything less is a writer still uploading or one that crashed, and the
entry's `reason` names the missing or short file.

Listing a prefix costs one object listing (file names and sizes), then per checkpoint:
- quick check (the default): config.json, the index's `metadata` (its first few KB: `total_size`,
  the bytes of every tensor the index maps) and each shard's 8-byte header length. Shards
  named `<stem>-NNNNN-of-MMMMM.safetensors` (how transformers and every trainer we know write
  them) must all be in the listing, and their sizes less their headers must add up to
  `total_size`: any shard missing, short, or left over from another save breaks the sum.
  A DeepSeek-V3 checkpoint (163 shards, an 8 MB index, 11 MB of headers) costs about 5 KB.
- deep check (`deep=True`, CLI `--deep`; and whenever the quick check cannot decide: a sum that
  does not add up, unconventional shard names, an index without `total_size` up front): the
  whole index and every shard header, which also names the short shard and checks that each
  tensor the index maps is in the shard it names. About 20 MB for DeepSeek-V3.

Two steps, so a caller can skip what it already knows:
    candidates = find(store, pattern, step_regex)      # names and sizes only
    entries = inspect(store, candidates)                 # reads config, index and headers
or both at once with `list_checkpoints(uri)`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import posixpath
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from moe_proxy.architectures import detect
from moe_proxy.checkpoint.reader import INDEX, MANIFEST, SINGLE, read_header
from moe_proxy.errors import CorruptCheckpoint, NotMoE, ObjectNotFound, StorageError, UnsupportedArchitecture
from moe_proxy.storage import LocalStore, Store, open_store

CONFIG = "config.json"
PROXIES_SUFFIX = "-proxies"  # moe-proxy's default destinations: <checkpoint>-proxies/<ns>/<name>/
MAX_JSON = 64 << 20  # config and index files larger than this are not checkpoint metadata

# What a directory holds, for `ListedCheckpoint.kind`.
MOE = "moe"  # a mixture-of-experts checkpoint moe-proxy can prune: a source
PROXY = "proxy"  # a proxy moe-proxy built (proxy-manifest.json, or under a *-proxies/ folder)
DENSE = "dense"  # a model without routed experts
UNSUPPORTED = "unsupported"  # an MoE architecture moe-proxy has no description for
UNKNOWN = "unknown"  # config.json missing or unreadable


@dataclass(frozen=True)
class Candidate:
    """A directory that may hold a checkpoint, as seen in the listing (nothing read yet)."""

    path: str  # relative to the listed prefix ("" for the prefix itself)
    step: int | None
    files: dict[str, int]  # file name (relative to `path`) -> size in bytes
    etags: dict[str, str] = field(default_factory=dict)  # file name -> ETag, where the store lists them (S3)

    @property
    def fingerprint(self) -> str:
        """Changes when a file of the directory is added, removed or rewritten: a digest of its
        listing (names, sizes, and ETags where the store gives them; a rewrite of the same size
        changes the ETag). What tells one save of a checkpoint from the next at the same path."""
        files = sorted((n, s, self.etags.get(n, "")) for n, s in self.files.items())
        return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]


@dataclass
class ListedCheckpoint:
    """One listed checkpoint. `source` is what a proxy can be built from: complete, MoE,
    supported, and not itself a proxy."""

    step: int | None
    uri: str
    path: str
    complete: bool
    kind: str
    reason: str | None = None  # why it is not complete (or not a source)
    architecture: str | None = None
    model_type: str | None = None
    bytes: int = 0  # every file in the directory
    shards: int = 0
    fingerprint: str | None = None  # Candidate.fingerprint: this save of the checkpoint

    @property
    def source(self) -> bool:
        return self.complete and self.kind == MOE

    def to_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if v is not None or k == "step"}
        out.pop("fingerprint", None)  # store-specific (S3's ETags): the same checkpoint reads alike anywhere
        out["source"] = self.source
        return out


# --- finding candidates: names and sizes only -------------------------------------------------


def step_of(path: str, step_regex: str | None = None) -> int | None:
    """The training step in a checkpoint's relative path: the first group (or the whole
    match) of `step_regex`, else the last integer in the path up to a `-proxies` folder; None
    when there is none."""
    if step_regex:
        m = re.search(step_regex, path)
        if not m:
            return None
        text = m.group(1) if m.groups() else m.group(0)
        try:
            return int(text)
        except (TypeError, ValueError):
            return None
    # A proxy under `<checkpoint>-proxies/` has its source's step, not the one in its own name
    # (`.../global_step_200/huggingface-proxies/team/proxy-8` is step 200).
    parts = path.split("/")
    cut = next((i + 1 for i, part in enumerate(parts) if part.endswith(PROXIES_SUFFIX)), len(parts))
    numbers = re.findall(r"\d+", "/".join(parts[:cut]))
    return int(numbers[-1]) if numbers else None


def matches(path: str, pattern: str) -> bool:
    """Glob match per path segment: `*` never crosses a `/`; a `**` segment spans any number."""
    return _match(path.split("/") if path else [], [p for p in pattern.strip("/").split("/") if p])


def _match(parts: list[str], pats: list[str]) -> bool:
    if not pats:
        return not parts
    if pats[0] == "**":
        return any(_match(parts[i:], pats[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pats[0]) and _match(parts[1:], pats[1:])


def _directories(names: list[str]) -> set[str]:
    out = set()
    for name in names:
        parent = posixpath.dirname(name)
        while True:
            out.add(parent)
            if not parent:
                break
            parent = posixpath.dirname(parent)
    return out


def find(store: Store, pattern: str | None = None, step_regex: str | None = None,
         sizes: dict[str, int] | None = None) -> list[Candidate]:
    """The directories that may hold a checkpoint: those matching `pattern` (relative to the
    store), or by default every directory holding a config.json. Sorted by step, then path.
    An S3 store's listing gives each file's ETag too, for the candidates' fingerprints."""
    etags: dict[str, str] = {}
    if sizes is None and hasattr(store, "list_entries"):
        entries = store.list_entries()
        sizes, etags = {n: e[0] for n, e in entries.items()}, {n: e[1] for n, e in entries.items()}
    sizes = store.list_sizes() if sizes is None else sizes
    names = [n for n in sizes if not posixpath.basename(n).startswith(".")]
    if pattern:
        dirs = sorted(d for d in _directories(names) if matches(d, pattern))
    else:
        dirs = sorted({posixpath.dirname(n) for n in names if posixpath.basename(n) == CONFIG})
    files_in: dict[str, dict[str, int]] = {}  # directory -> its own files (not its subfolders')
    etags_in: dict[str, dict[str, str]] = {}
    for n in names:
        files_in.setdefault(posixpath.dirname(n), {})[posixpath.basename(n)] = sizes[n]
        if n in etags:
            etags_in.setdefault(posixpath.dirname(n), {})[posixpath.basename(n)] = etags[n]
    out = [Candidate(d, step_of(d, step_regex), files_in.get(d, {}), etags_in.get(d, {})) for d in dirs]
    return sorted(out, key=_order)


def _order(item) -> tuple:
    return (item.step is None, item.step or 0, item.path)


# --- inspecting a candidate: config, index and shard headers ------------------------------------


class _Dir:
    """A read-only view of one directory of a store (one client, one byte counter for all)."""

    def __init__(self, store: Store, path: str):
        self.store, self.prefix = store, f"{path}/" if path else ""
        self.uri = f"{store.uri.rstrip('/')}/{path}" if path else store.uri

    def read_range(self, name: str, start: int, length: int) -> bytes:
        return self.store.read_range(self.prefix + name, start, length)

    def read_bytes(self, name: str) -> bytes:
        return self.store.read_bytes(self.prefix + name)


class Incomplete(Exception):
    """The checkpoint is not (yet) all there; the message names the file."""


def _read_json(d: _Dir, name: str, files: dict[str, int]) -> dict:
    if files[name] > MAX_JSON:
        raise CorruptCheckpoint(f"{d.uri}/{name}: {files[name]} bytes is too large for checkpoint metadata")
    try:
        data = json.loads(d.read_bytes(name))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpoint(f"{d.uri}/{name}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CorruptCheckpoint(f"{d.uri}/{name}: expected a JSON object")
    return data


def _shards(d: _Dir, files: dict[str, int]) -> tuple[list[str], dict | None]:
    """The shard files and the index's weight map (None for a single model.safetensors)."""
    if INDEX in files:
        weight_map = _read_json(d, INDEX, files).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CorruptCheckpoint(f"{d.uri}/{INDEX}: no weight_map")
        shards = list(dict.fromkeys(weight_map.values()))
        missing = [s for s in shards if s not in files]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise Incomplete(f"{len(missing)} of {len(shards)} shards missing: "
                             f"{', '.join(missing[:3])}{more}")
        return shards, weight_map
    if SINGLE in files:
        return [SINGLE], None
    raise Incomplete(f"neither {INDEX} nor {SINGLE} present")


def check_shard(d: _Dir, shard: str, size: int) -> set[str]:
    """Raise Incomplete unless the shard is exactly its header plus the data it declares;
    returns the names of its tensors."""
    try:
        tensors, _ = read_header(d, shard, size)
    except CorruptCheckpoint as exc:
        raise Incomplete(str(exc).replace(f"{d.uri}/", "")) from None
    if tensors:
        declared = max(t.end for t in tensors.values())
    else:  # a shard of no tensors is its header alone
        declared = 8 + int.from_bytes(d.read_range(shard, 0, 8), "little")
    if size != declared:
        raise Incomplete(f"{shard} is {size} bytes but its header declares {declared} "
                         f"({'truncated or still being written' if size < declared else 'trailing bytes'})")
    return set(tensors)


SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.safetensors$")
INDEX_HEAD = 4 << 10  # the index's metadata comes first (transformers sorts its keys) and is small


def _index_total_size(d: _Dir, files: dict[str, int]) -> int | None:
    """`metadata.total_size` from the start of the index, or None if it is not up front."""
    head = d.read_range(INDEX, 0, min(files[INDEX], INDEX_HEAD)).decode("utf-8", "replace")
    m = re.match(r'\s*\{\s*"metadata"\s*:\s*', head)
    try:
        meta, _ = json.JSONDecoder().raw_decode(head, m.end()) if m else (None, 0)
    except ValueError:
        return None
    total = meta.get("total_size") if isinstance(meta, dict) else None
    return total if isinstance(total, int) and not isinstance(total, bool) and total >= 0 else None


def quick_check(d: _Dir, files: dict[str, int], pool: ThreadPoolExecutor | None = None) -> int | None:
    """The number of shards if the checkpoint is complete by names, sizes, the index's
    total_size and each shard's 8-byte header length; raise Incomplete when the listing alone
    shows a shard missing; None when only the deep check can tell (and name the short shard)."""
    if INDEX not in files:
        return None
    groups: dict[tuple[str, str], dict[int, str]] = {}  # (stem, "MMMMM") -> shard number -> name
    for name in files:
        if m := SHARD_NAME.match(name):
            groups.setdefault((m["stem"], m["n"]), {})[int(m["i"])] = name
    if len(groups) != 1:  # no conventional names, or leftovers of a save with another sharding
        return None
    ((stem, of), shards), = groups.items()
    missing = [i for i in range(1, int(of) + 1) if i not in shards]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        shown = ", ".join(f"{stem}-{i:0{len(of)}d}-of-{of}.safetensors" for i in missing[:3])
        raise Incomplete(f"{len(missing)} of {int(of)} shards missing: {shown}{more}")
    total = _index_total_size(d, files)
    if total is None:
        return None

    def data_bytes(shard: str) -> int:  # -1: cut short within its header
        size = files[shard]
        header = int.from_bytes(d.read_range(shard, 0, 8), "little") if size >= 8 else size
        return size - 8 - header if 8 + header <= size else -1

    mapper = pool.map if pool is not None else map
    data = list(mapper(data_bytes, list(shards.values())))
    return len(shards) if -1 not in data and sum(data) == total else None


def deep_check(d: _Dir, files: dict[str, int], pool: ThreadPoolExecutor | None = None) -> int:
    """The number of shards, after reading the whole index and every shard's header; raise
    Incomplete naming the missing or short shard, or a tensor not where the index says."""
    shards, weight_map = _shards(d, files)
    mapper = pool.map if pool is not None else map
    found = dict(zip(shards, mapper(lambda s: check_shard(d, s, files[s]), shards)))
    if weight_map is not None:
        absent = [k for k, s in weight_map.items() if k not in found[s]]
        if absent:
            raise Incomplete(f"{len(absent)} tensor(s) of {INDEX} not in the shard it names, e.g. {absent[0]!r}")
    return len(shards)


def inspect(store: Store, candidate: Candidate, pool: ThreadPoolExecutor | None = None,
            deep: bool = False) -> ListedCheckpoint:
    """Read what decides a candidate: config.json, then the quick check, then (if it cannot
    decide, or with `deep`) the whole index and each shard's header."""
    d, files = _Dir(store, candidate.path), candidate.files
    entry = ListedCheckpoint(step=candidate.step, uri=d.uri, path=candidate.path, complete=False, kind=UNKNOWN,
                       bytes=sum(files.values()), fingerprint=candidate.fingerprint)
    is_proxy = MANIFEST in files or any(p.endswith(PROXIES_SUFFIX) for p in candidate.path.split("/"))
    if CONFIG not in files:
        entry.reason = f"{CONFIG} missing"
        entry.kind = PROXY if is_proxy else UNKNOWN
        return entry
    try:
        config = _read_json(d, CONFIG, files)
    except (CorruptCheckpoint, ObjectNotFound) as exc:
        entry.reason = str(exc).replace(f"{d.uri}/", "")
        return entry
    entry.model_type = config.get("model_type")
    if not entry.model_type and not config.get("architectures"):
        entry.reason = f"{CONFIG} names no model (neither model_type nor architectures)"
        return entry
    try:
        entry.architecture, entry.kind = detect(config).name, MOE
    except NotMoE:
        entry.kind = DENSE
    except UnsupportedArchitecture as exc:
        entry.kind, entry.reason = UNSUPPORTED, str(exc)
    if is_proxy:
        entry.kind = PROXY
    try:
        quick = quick_check(d, files, pool)  # a shard missing from the listing: decided here
        entry.shards = deep_check(d, files, pool) if deep or quick is None else quick
    except Incomplete as exc:
        entry.reason = str(exc)
        return entry
    except (CorruptCheckpoint, ObjectNotFound) as exc:  # e.g. a file deleted since the listing
        entry.reason = str(exc).replace(f"{d.uri}/", "")
        return entry
    entry.complete = True
    if is_proxy and entry.reason is None:
        entry.reason = "a proxy built by moe-proxy, not a source"
    elif entry.kind == DENSE:
        entry.reason = "not a mixture-of-experts model (no routed experts)"
    return entry


def inspect_all(store: Store, candidates: list[Candidate], workers: int = 16, deep: bool = False) -> list[ListedCheckpoint]:
    """inspect() every candidate; each checkpoint's shards are read concurrently."""
    with ThreadPoolExecutor(workers, thread_name_prefix="ckpt-headers") as pool:
        return [inspect(store, c, pool, deep) for c in candidates]


def list_checkpoints(uri: str | Store, pattern: str | None = None, step_regex: str | None = None,
                     deep: bool = False, **store_options) -> list[ListedCheckpoint]:
    """Every checkpoint under `uri` (local path or s3://), sorted by step ascending."""
    store = open_store(uri, **store_options) if isinstance(uri, str) else uri
    if isinstance(store, LocalStore) and not store.root.is_dir():
        raise StorageError(f"{store.uri}: no such directory")
    return inspect_all(store, find(store, pattern, step_regex), deep=deep)


def latest_before(checkpoints: list[ListedCheckpoint], step: int) -> ListedCheckpoint | None:
    """The newest source checkpoint strictly before `step`: the one to reproduce a failure
    that showed at `step` from."""
    earlier = [c for c in checkpoints if c.source and c.step is not None and c.step < step]
    return max(earlier, key=lambda c: c.step) if earlier else None


@dataclass
class CountingStore:
    """Wraps a store and counts the bytes read through it (tests, benchmarks)."""

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
