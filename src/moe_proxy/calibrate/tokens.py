"""Calibration tokens: documents from a dataset file, tokenised with the checkpoint's own
tokenizer, packed into `samples` rows of `seq_len` tokens. A checkpoint that ships no tokenizer
reads its text as bytes (id = byte value, the UTF-8 encoding), as repro feeds such a checkpoint
(rl/task.Codec), when its vocabulary holds the 256 byte values. Without a dataset, with a tokenizer
that cannot be loaded, or with neither a tokenizer nor a byte vocabulary, seeded random token ids
(the caller says so plainly).

Dataset formats (by file name):
- `.jsonl` / `.json`: one JSON object per line with a `text` string, a `prompt` string, or a
  verl-style chat `prompt` (a list of {"role", "content"} messages, rendered with the
  tokenizer's chat template);
- `.parquet` (verl's dataset format; needs pyarrow): the same fields as columns;
- anything else: plain UTF-8 text, documents separated by blank lines.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_proxy.errors import BadDataset, MoeProxyError
from moe_proxy.storage import Store

log = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json")


@dataclass
class Tokens:
    ids: torch.Tensor  # [samples, seq_len] int64
    origin: str  # what the ids are, in words (dataset + tokenizer, or random)
    random: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.ids.to(torch.int64).numpy().tobytes()).hexdigest()


def read_documents(path: str, store_options: dict | None = None) -> list[str | list[dict]]:
    """The dataset's documents: strings, or chat message lists still to be rendered.
    `path` is a local file or an s3://bucket/key object."""
    if path.startswith("s3://"):
        with tempfile.TemporaryDirectory(prefix="moe-proxy-data-") as tmp:
            return read_documents(_download(path, Path(tmp), store_options or {}))
    p = Path(path)
    if not p.is_file():
        raise BadDataset(f"dataset {path}: no such file")
    if p.suffix == ".parquet":
        docs = _parquet(p)
    elif p.suffix in (".jsonl", ".json"):
        docs = _jsonl(p)
    else:
        text = p.read_text(encoding="utf-8", errors="strict")
        docs = [d.strip() for d in text.split("\n\n") if d.strip()]
    docs = [d for d in docs if d]
    if not docs:
        raise BadDataset(f"dataset {path}: no documents (the file is empty or every record is blank)")
    return docs


def _download(uri: str, into: Path, store_options: dict) -> str:
    from moe_proxy.storage import open_store

    parent, _, name = uri.rpartition("/")
    store = open_store(parent, **store_options)
    if not name or not store.exists(name):
        raise BadDataset(f"dataset {uri}: no such object")
    local = into / name
    local.write_bytes(store.read_bytes(name))
    return str(local)


def _record(obj, where: str) -> str | list[dict]:
    if not isinstance(obj, dict):
        raise BadDataset(f"{where}: expected a JSON object with a 'text' or 'prompt' field, got {type(obj).__name__}")
    value = obj.get("text", obj.get("prompt"))
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
        return [{"role": str(m.get("role", "user")), "content": str(m["content"])} for m in value]
    if hasattr(value, "tolist"):  # parquet list columns arrive as numpy arrays
        return _record({"prompt": value.tolist()}, where)
    raise BadDataset(
        f"{where}: no usable 'text' string or 'prompt' (string or list of {{role, content}} messages); "
        f"fields present: {sorted(obj)}"
    )


def _jsonl(p: Path) -> list:
    docs = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise BadDataset(f"dataset {p}, line {n}: not valid JSON ({exc})") from None
        docs.append(_record(obj, f"dataset {p}, line {n}"))
    return docs


def _parquet(p: Path) -> list:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise BadDataset(f"dataset {p}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        rows = pq.read_table(p).to_pylist()
    except Exception as exc:  # pyarrow raises many kinds for a broken file
        raise BadDataset(f"dataset {p}: not a readable parquet file ({exc})") from None
    return [_record(r, f"dataset {p}, row {i}") for i, r in enumerate(rows)]


def ships_tokenizer(store: Store) -> bool:
    """Whether the checkpoint has a vocabulary file (side files alone, as tiny checkpoints carry,
    do not count: the rule of repro's rl/task.Codec)."""
    return any(store.exists(f) for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def load_tokenizer(store: Store):
    """The checkpoint's tokenizer, or None when it ships none that transformers can load."""
    from transformers import AutoTokenizer

    if not ships_tokenizer(store):
        return None
    present = [f for f in TOKENIZER_FILES if store.exists(f)]
    with tempfile.TemporaryDirectory(prefix="moe-proxy-tok-") as tmp:
        for f in present:
            Path(tmp, f).write_bytes(store.read_bytes(f))
        try:
            return AutoTokenizer.from_pretrained(tmp)
        except Exception as exc:  # a broken or exotic tokenizer: fall back to random ids, said plainly
            log.warning("the checkpoint's tokenizer could not be loaded (%s)", exc)
            return None


def _render(doc: str | list[dict], tokenizer) -> str:
    if isinstance(doc, str):
        return doc
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(doc, tokenize=False)
    return "\n".join(f"{m['role']}: {m['content']}" for m in doc)


def calibration_tokens(store: Store, dataset: str | None, samples: int, seq_len: int, seed: int,
                       vocab_size: int, store_options: dict | None = None) -> Tokens:
    if samples < 1 or seq_len < 1:
        raise MoeProxyError(f"--samples and --seq-len must be positive (got {samples}, {seq_len})")
    docs = read_documents(dataset, store_options) if dataset else None
    ships = docs is not None and ships_tokenizer(store)  # looked up once: on S3 each file is a request
    tokenizer = load_tokenizer(store) if ships else None
    # No tokenizer at all: the checkpoint is byte-level (repro feeds it bytes) if its vocabulary
    # holds them; one that ships a tokenizer transformers cannot load is not.
    as_bytes = docs is not None and not ships and vocab_size >= 256
    if docs is None or (tokenizer is None and not as_bytes):
        why = ("no --dataset given" if docs is None else "the checkpoint's tokenizer could not be loaded"
               if ships else
               f"the checkpoint has no usable tokenizer and a vocabulary of {vocab_size} < 256 byte values")
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (samples, seq_len), generator=g)
        return Tokens(ids, f"seeded random token ids (seed {seed}; {why}): routing statistics of random text", True)

    stream: list[int] = []
    eos = ord("\n") if as_bytes else tokenizer.eos_token_id  # repro's byte codec ends an answer at a newline
    for doc in docs:
        stream += (list(_render(doc, None).encode("utf-8")) if as_bytes
                   else tokenizer(_render(doc, tokenizer), add_special_tokens=True)["input_ids"])
        if eos is not None:
            stream.append(eos)
        if len(stream) >= samples * seq_len:
            break
    rows = len(stream) // seq_len
    if rows == 0:
        raise BadDataset(f"dataset {dataset}: {len(stream)} tokens in all, fewer than one sequence of {seq_len}")
    if rows < samples:
        log.warning("dataset %s holds %d tokens: %d samples of %d instead of %d", dataset, len(stream), rows,
                    seq_len, samples)
    n = min(rows, samples)
    ids = torch.tensor(stream[: n * seq_len], dtype=torch.int64).reshape(n, seq_len)
    bad = int(ids.max())
    if bad >= vocab_size:
        raise BadDataset(f"the tokenizer produced id {bad}, outside the model's vocabulary of {vocab_size}")
    how = ("read as bytes (id = byte value: the checkpoint has no usable tokenizer; repro feeds it bytes too)"
           if as_bytes else "tokenised with the checkpoint's tokenizer")
    return Tokens(ids, f"{dataset}, {len(docs)} documents, {how}", False)
