"""The metrics formats `watch` and `compare` read, detected from the location and its contents:

- jsonl: verl's FileLogger lines `{"step": N, "data": {...}}` or flat `{"step": N, "k": v}`
  (metrics_io.parse_line; a `null` value is non-finite: NaN);
- tensorboard: a TensorBoard log directory (searched recursively for `events.out.tfevents.*`,
  as TRL writes them under output_dir/runs/<date>_<host>/; a restarted run adds a file) or one
  event file: TFRecords (length, CRC, data, CRC; the `tensorboard` package's CRC) parsed as
  they arrive into the `tensorboard` package's Event protos (no TensorFlow): scalars and
  single-value tensors, grouped by step;
- trainer-state: an HF Trainer `trainer_state.json` (its `log_history`), or a run's output
  directory with `checkpoint-N/` directories (the newest checkpoint's); rewritten whole at each
  save, so it is read again when its version (ETag, mtime) changes.

A location is a local path or an `s3://bucket/prefix[/file]` (sources.py: the same followers
read both; on S3 each poll lists the prefix and reads only the bytes past what was read).
Each reader yields rows step -> {name: value} under the framework's names; profiles.py renames
them to the detectors'. A follower reads what was appended since the last poll (watch), and says
when the log itself shows that its writer is done (RunFollower.finished): transformers' Trainer
logs `train_runtime` once, at the end of train() (TensorBoard: `train/train_runtime`); a
trainer_state.json whose global_step has reached max_steps; or the step the caller names as the
last (verl logs no end of its own: its trainer.total_training_steps).
Torch-free; `tensorboard` is imported only when an event file is read.
"""

from __future__ import annotations

import contextvars
import json
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from moe_proxy.errors import MalformedMetrics
from moe_proxy.metrics.metrics_io import METRICS_FILE, parse_line
from moe_proxy.metrics.profiles import Profile, parse_metric_options, profile_for
from moe_proxy.metrics.sources import Entry, MetricsSource, Tail, open_source

FORMATS = {
    "jsonl": "JSON lines, verl's FileLogger {step, data} or flat {step, metric: value}",
    "tensorboard": "a TensorBoard log directory or events.out.tfevents.* file",
    "trainer-state": "an HF Trainer trainer_state.json or a run directory with checkpoint-N/",
}
EVENTS_GLOB = "events.out.tfevents.*"
TRAINER_STATE = "trainer_state.json"
END_NAMES = ("train_runtime", "train/train_runtime")  # the Trainer's speed metrics, logged when training ends
_CHECKPOINT_STATE = re.compile(rf"^checkpoint-(\d+)/{re.escape(TRAINER_STATE)}$")


@dataclass
class ReadOptions:
    """What --format, --profile and --metric ask for (None: detect)."""

    format: str | None = None
    profile: str | None = None
    metrics: tuple[str, ...] = ()


_OPTIONS: contextvars.ContextVar[ReadOptions] = contextvars.ContextVar("read_options", default=ReadOptions())


@contextmanager
def reading(options: ReadOptions) -> Iterator[None]:
    """Within: read_metrics (and so compare's load_run) reads with these options."""
    token = _OPTIONS.set(options)
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def current_options() -> ReadOptions:
    return _OPTIONS.get()


def refuse(where: str | Path, why: str) -> MalformedMetrics:
    listed = "; ".join(f"{k} ({v})" for k, v in FORMATS.items())
    return MalformedMetrics(f"{where}: {why}; readable formats: {listed} (--format picks one)")


def check_format(name: str | None) -> str | None:
    if name is not None and name not in FORMATS:
        raise MalformedMetrics(f"--format {name!r}: one of {', '.join(FORMATS)}")
    return name


# ----------------------------------------------------------------------------- detection

def detect_format(location: str | Path, store_options: dict | None = None) -> str | None:
    """The format at `location` (a path or s3:// URI); None when nothing is there yet (or an
    empty directory: a follower waits); refused when it is something else."""
    source = open_source(location, store_options)
    return detect_in(source, source.list())


def detect_in(source: MetricsSource, listing: dict[str, Entry]) -> str | None:
    if not listing:
        return None
    if source.kind == "dir":
        names = set(listing)
        if METRICS_FILE in names:
            return "jsonl"
        if TRAINER_STATE in names or any(_CHECKPOINT_STATE.match(n) for n in names):
            return "trainer-state"
        if any(_is_event_file(n) for n in names):
            return "tensorboard"
        raise refuse(source.where, f"no {METRICS_FILE}, {TRAINER_STATE}, checkpoint-N/ or {EVENTS_GLOB} in the "
                     "directory")
    (name, entry), = listing.items()
    return _file_format(source, name, entry)


def _file_format(source: MetricsSource, name: str, entry: Entry) -> str:
    if "tfevents" in name:
        return "tensorboard"
    if name == TRAINER_STATE:
        return "trainer-state"
    if name.endswith(".jsonl"):
        return "jsonl"
    head = source.read(name, 0, min(entry.size, 4096), entry.version) or b""
    if _is_record(head):
        return "tensorboard"
    text = head.decode("utf-8", errors="replace").lstrip()
    if not text:
        return "jsonl"
    if text.startswith("{"):
        first = text.split("\n", 1)[0]
        try:
            record = json.loads(first)
        except json.JSONDecodeError:
            record = None  # a JSON document over several lines: a trainer state?
        if isinstance(record, dict) and "step" in record:
            return "jsonl"
        whole = source.read(name, 0, entry.size, entry.version) or b""
        if b'"log_history"' in whole:
            return "trainer-state"
    raise refuse(source.where, "not a metrics file of a known format")


def _is_event_file(name: str) -> bool:
    return fnmatch(name.rpartition("/")[2], EVENTS_GLOB)


def _is_record(head: bytes) -> bool:
    """Whether `head` starts with a TFRecord whose length passes its CRC (an event file)."""
    if len(head) < 12:
        return False
    try:
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    except ImportError:
        return False
    return masked_crc32c(head[:8]) == struct.unpack("<I", head[8:12])[0]


# ----------------------------------------------------------------------------- JSON lines

class JsonlFollower:
    """The complete lines appended to a JSON-lines file since the last call (the location, or
    its metrics.jsonl): only the new bytes are read."""

    def __init__(self, source: MetricsSource):
        self.source, self.tail, self.number, self.partial = source, None, 0, b""

    def lines(self, final: bool = False) -> list[tuple[str, str]]:
        """(line, where) of each new complete line; `final` also takes an unterminated last line."""
        listing = self.source.list(METRICS_FILE)
        name = next(iter(listing), None) if self.source.kind == "file" else METRICS_FILE
        if name not in listing:
            return []
        self.tail = self.tail or Tail(self.source, name)
        chunks = (self.partial + self.tail.new_bytes(listing[name])).split(b"\n")
        self.partial = chunks.pop()
        if final and self.partial:
            chunks.append(self.partial)
            self.partial = b""
        where = self.source.label(name)
        out = []
        for chunk in chunks:
            self.number += 1
            out.append((chunk.decode("utf-8", errors="replace"), f"{where}:{self.number}"))
        return out

    def rows(self, final: bool = False) -> list[tuple[int, dict[str, float]]]:
        out = []
        for line, where in self.lines(final):
            parsed = parse_line(line, where)
            if parsed is not None:
                out.append(parsed)
        return out

    def check(self) -> None:
        if self.tail is None:
            raise MalformedMetrics(f"{self.source.where}: no {METRICS_FILE} there (pass a run directory or a "
                                   ".jsonl file)")


# ----------------------------------------------------------------------------- TensorBoard

class EventRecords:
    """TFRecord framing over bytes as they arrive (each record: 8 length + 4 CRC + data + 4 CRC,
    CRCs as the tensorboard package computes them): whole records out, a partial last one kept
    for the next bytes."""

    def __init__(self, where: str):
        self.where, self.buffer, self.consumed = where, b"", 0

    def feed(self, data: bytes) -> list[bytes]:
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

        buf, pos, out = self.buffer + data, 0, []
        while len(buf) - pos >= 12:
            header, crc = buf[pos:pos + 8], struct.unpack("<I", buf[pos + 8:pos + 12])[0]
            if masked_crc32c(header) != crc:
                raise MalformedMetrics(f"{self.where}: truncated or corrupt event file (a record's length fails "
                                       f"its CRC at byte {self.consumed + pos})")
            end = pos + 12 + struct.unpack("<Q", header)[0]
            if end + 4 > len(buf):
                break  # the rest of the record is still coming
            record = buf[pos + 12:end]
            if masked_crc32c(record) != struct.unpack("<I", buf[end:end + 4])[0]:
                raise MalformedMetrics(f"{self.where}: truncated or corrupt event file (a record fails its CRC at "
                                       f"byte {self.consumed + pos})")
            out.append(record)
            pos = end + 4
        self.buffer, self.consumed = buf[pos:], self.consumed + pos
        return out

    def check_end(self) -> None:
        """A finished event file must be whole records to its end, and not empty."""
        size = self.consumed + len(self.buffer)
        if size == 0:
            raise MalformedMetrics(f"{self.where}: empty event file (no records)")
        if self.buffer:
            raise MalformedMetrics(f"{self.where}: truncated or corrupt event file (whole records end at byte "
                                   f"{self.consumed} of {size})")


def _event_values(event) -> Iterator[tuple[str, float]]:
    """(tag, value) of an event's scalars and single-value tensors."""
    from tensorboard.util.tensor_util import make_ndarray

    for value in event.summary.value:
        kind = value.WhichOneof("value")
        if kind == "simple_value":
            yield value.tag, float(value.simple_value)
        elif kind == "tensor":
            try:
                array = make_ndarray(value.tensor)
            except (TypeError, ValueError):
                continue
            if array.size == 1 and array.dtype.kind in "fiub":
                yield value.tag, float(array.reshape(()))


def _event_proto(where: str):
    try:
        from tensorboard.compat.proto.event_pb2 import Event
    except ImportError:
        raise MalformedMetrics(f"{where}: reading TensorBoard event files needs the tensorboard package "
                               "(pip install tensorboard)") from None
    return Event


def _parsed(parse, data: bytes, where: str):
    from google.protobuf.message import DecodeError

    try:
        return parse(data)
    except DecodeError as exc:
        raise MalformedMetrics(f"{where}: a record is not a TensorBoard event ({exc})") from None


class EventsFollower:
    """New events of a TensorBoard directory (new files included: a restarted run writes
    another) or file, by step; each file's new bytes only."""

    def __init__(self, source: MetricsSource):
        self.source, self.files, self.pending = source, {}, {}

    def poll(self, final: bool = False) -> None:
        listing = self.source.list()
        names = sorted(n for n in listing if self.source.kind == "file" or _is_event_file(n))
        for name in names:
            if name not in self.files:
                self.files[name] = Tail(self.source, name), EventRecords(self.source.label(name))
            tail, records = self.files[name]
            parse = _event_proto(records.where).FromString
            for data in records.feed(tail.new_bytes(listing[name])):
                event = _parsed(parse, data, records.where)
                for tag, value in _event_values(event):
                    self.pending.setdefault(int(event.step), {})[tag] = value
            if final:
                records.check_end()

    def rows(self, final: bool = False) -> list[tuple[int, dict[str, float]]]:
        """The steps complete now: all but the newest (its values may still be coming), or all."""
        self.poll(final)
        last = max(self.pending, default=None)
        done = sorted(s for s in self.pending if final or s != last)
        return [(s, self.pending.pop(s)) for s in done]

    def check(self) -> None:
        if not self.files:
            raise MalformedMetrics(f"{self.source.where}: no {EVENTS_GLOB} files there")


# ----------------------------------------------------------------------------- trainer_state.json

class TrainerStateFollower:
    """trainer_state.json is rewritten whole at each save (the newest checkpoint-N/ holds the
    whole history): read again when its version changes; the steps not yet given."""

    def __init__(self, source: MetricsSource):
        self.source, self.given, self.read_version = source, set(), None
        self.finished: str | None = None

    def rows(self, final: bool = False) -> list[tuple[int, dict[str, float]]]:
        listing = self.source.list()
        name = _state_name(self.source, listing)
        if name is None or (name, listing[name].version) == self.read_version:
            if final and name is None:
                raise MalformedMetrics(f"{self.source.where}: no {TRAINER_STATE} and no checkpoint-N/"
                                       f"{TRAINER_STATE} there")
            return []
        try:
            state = _state(self.source, name, listing[name])
            rows = _history_rows(self.source.label(name), state)
        except MalformedMetrics:
            if final:
                raise
            return []  # being rewritten, or not a state yet: the next poll reads it again
        self.read_version = (name, listing[name].version)
        self.finished = self.finished or _state_end(state)
        new = sorted(s for s in rows if s not in self.given)
        self.given.update(new)
        return [(s, rows[s]) for s in new]

    def check(self) -> None:
        pass  # rows(final=True) refuses a location without a state


def _state_name(source: MetricsSource, listing: dict[str, Entry]) -> str | None:
    if source.kind == "file":
        return next(iter(listing), None)
    if TRAINER_STATE in listing:
        return TRAINER_STATE
    checkpoints = sorted((int(m[1]), n) for n in listing if (m := _CHECKPOINT_STATE.match(n)))
    return checkpoints[-1][1] if checkpoints else None


def _state(source: MetricsSource, name: str, entry: Entry) -> dict:
    data = source.read(name, 0, entry.size, entry.version)
    if data is None:
        raise MalformedMetrics(f"{source.label(name)}: changed while being read")
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MalformedMetrics(f"{source.label(name)}: not JSON ({getattr(exc, 'msg', exc)})") from None


def _history_rows(where: str, state: dict) -> dict[int, dict[str, float]]:
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise MalformedMetrics(f"{where}: no log_history list (not an HF Trainer state)")
    rows: dict[int, dict[str, float]] = {}
    for number, entry in enumerate(history):
        parsed = parse_line(json.dumps(entry), f"{where}: log_history[{number}]") if isinstance(entry, dict) \
            else None
        if parsed is not None:
            rows.setdefault(parsed[0], {}).update(parsed[1])
    return rows


def _state_end(state: dict | None) -> str | None:
    steps, last = (state.get("global_step"), state.get("max_steps")) if isinstance(state, dict) else (None, None)
    if isinstance(steps, int) and isinstance(last, int) and 0 < last <= steps:
        return f"{TRAINER_STATE}: global_step {steps} of max_steps {last}"
    return None


FOLLOWERS = {"jsonl": JsonlFollower, "tensorboard": EventsFollower, "trainer-state": TrainerStateFollower}


# ----------------------------------------------------------------------------- a run

class RunFollower:
    """A growing run in any format, at a local path or an s3:// location (`store_options`:
    storage.open_store's keyword arguments), its rows renamed by the profile (detected from the
    first names seen, unless asked for): what `watch` reads. `finished` says why the log shows
    its writer is done (module doc), None while it does not; `last_step`: the run's last step.
    `source.kind` is None while nothing is at the location."""

    def __init__(self, path: str | Path, options: ReadOptions | None = None, last_step: int | None = None,
                 store_options: dict | None = None, last_step_said: str = "--last-step"):
        self.path, self.options, self.last_step = path, options or ReadOptions(), last_step
        self.last_step_said = last_step_said  # where last_step was given, for `finished`
        self.source = open_source(path, store_options)
        self.finished: str | None = None
        self.format = check_format(self.options.format)
        self.added = parse_metric_options(list(self.options.metrics))
        self.profile: Profile | None = None
        if self.options.profile is not None:
            self.profile = profile_for([], self.options.profile, self.added)
        self.inner = None

    def rows(self, final: bool = False) -> list[tuple[int, dict[str, float]]]:
        try:
            return self._rows(final)
        except OSError as exc:
            raise MalformedMetrics(f"{self.path}: cannot read ({exc.strerror or exc})") from None

    def _rows(self, final: bool) -> list[tuple[int, dict[str, float]]]:
        if self.inner is None:
            self.format = self.format or detect_in(self.source, self.source.list())
            if self.format is None:
                return []
            self.inner = FOLLOWERS[self.format](self.source)
        rows = self.inner.rows(final)
        self.finished = self.finished or self._end(rows)
        if rows and (self.profile is None or (self.profile.detected and self.profile.name == "verl")):
            names = set().union(*(r for _, r in rows))
            found = profile_for(names, None, self.added)
            if self.profile is None or found.name != "verl":
                self.profile = found
        profile = self.profile
        return [(s, profile.rename(r)) for s, r in rows] if profile else rows

    def _end(self, rows: list[tuple[int, dict[str, float]]]) -> str | None:
        # the newest TensorBoard step is held back until a later one comes; it counts here
        seen = rows + list(getattr(self.inner, "pending", {}).items())
        if any(name in row for _, row in seen for name in END_NAMES):
            return "train_runtime logged (the Trainer's end of training)"
        if self.last_step is not None and any(step >= self.last_step for step, _ in seen):
            return f"step {self.last_step} logged ({self.last_step_said})"
        return getattr(self.inner, "finished", None)


def read_run(path: str | Path, options: ReadOptions | None = None,
             store_options: dict | None = None) -> tuple[dict[int, dict[str, float]], Profile]:
    """A finished run's rows under the detectors' names, and the profile that named them; a
    local path or an s3:// location (`store_options`: storage.open_store's keyword arguments)."""
    try:
        return _read_run(path, options or current_options(), store_options)
    except OSError as exc:
        raise MalformedMetrics(f"{path}: cannot read ({exc.strerror or exc})") from None


def read_metrics(run: str | Path) -> dict[int, dict[str, float]]:
    """step -> {metric: value} under the detectors' names, from any format this module knows
    (detected, or as reading() asks), renamed by the run's name profile."""
    return read_run(run)[0]


def _read_run(path: str | Path, options: ReadOptions,
              store_options: dict | None) -> tuple[dict[int, dict[str, float]], Profile]:
    source = open_source(path, store_options)
    listing = source.list()
    fmt = check_format(options.format) or detect_in(source, listing)
    if fmt is None:
        raise MalformedMetrics(f"{source.where}: no such file or directory, or an empty one (no {METRICS_FILE}, "
                               f"{EVENTS_GLOB} or {TRAINER_STATE} there)")
    follower = FOLLOWERS[fmt](source)
    rows: dict[int, dict[str, float]] = {}
    for step, values in follower.rows(final=True):
        rows.setdefault(step, {}).update(values)
    follower.check()
    if not rows:
        raise MalformedMetrics(f"{source.where}: no steps recorded")
    names = set().union(*rows.values())
    profile = profile_for(names, options.profile, parse_metric_options(list(options.metrics)))
    return {s: profile.rename(r) for s, r in sorted(rows.items())}, profile
