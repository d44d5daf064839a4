"""The metrics formats `watch` and `compare` read, detected from the path and its contents:

- jsonl: verl's FileLogger lines `{"step": N, "data": {...}}` or flat `{"step": N, "k": v}`
  (metrics_io.parse_line; a `null` value is non-finite: NaN);
- tensorboard: a TensorBoard log directory (searched recursively for `events.out.tfevents.*`,
  as TRL writes them under output_dir/runs/<date>_<host>/) or one event file, read with the
  `tensorboard` package's own loader (no TensorFlow): scalars and single-value tensors, grouped
  by step;
- trainer-state: an HF Trainer `trainer_state.json` (its `log_history`), or a run's output
  directory with `checkpoint-N/` directories (the newest checkpoint's).

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
from pathlib import Path

from moe_proxy.errors import MalformedMetrics
from moe_proxy.metrics.metrics_io import METRICS_FILE, parse_line
from moe_proxy.metrics.profiles import Profile, parse_metric_options, profile_for

FORMATS = {
    "jsonl": "JSON lines, verl's FileLogger {step, data} or flat {step, metric: value}",
    "tensorboard": "a TensorBoard log directory or events.out.tfevents.* file",
    "trainer-state": "an HF Trainer trainer_state.json or a run directory with checkpoint-N/",
}
EVENTS_GLOB = "events.out.tfevents.*"
TRAINER_STATE = "trainer_state.json"
END_NAMES = ("train_runtime", "train/train_runtime")  # the Trainer's speed metrics, logged when training ends
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


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


def refuse(path: Path, why: str) -> MalformedMetrics:
    listed = "; ".join(f"{k} ({v})" for k, v in FORMATS.items())
    return MalformedMetrics(f"{path}: {why}; readable formats: {listed} (--format picks one)")


def check_format(name: str | None) -> str | None:
    if name is not None and name not in FORMATS:
        raise MalformedMetrics(f"--format {name!r}: one of {', '.join(FORMATS)}")
    return name


def detect_format(path: Path) -> str | None:
    """The format of `path`; None when it does not exist yet (or is an empty directory: a
    follower waits); refused when it is something else."""
    try:
        return _detect_format(path)
    except OSError as exc:
        raise MalformedMetrics(f"{path}: cannot read ({exc.strerror or exc})") from None


def _detect_format(path: Path) -> str | None:
    if path.is_dir():
        if (path / METRICS_FILE).is_file():
            return "jsonl"
        if (path / TRAINER_STATE).is_file() or _checkpoints(path):
            return "trainer-state"
        try:
            if next(path.rglob(EVENTS_GLOB), None) is not None:
                return "tensorboard"
            empty = next(path.iterdir(), None) is None
        except OSError as exc:
            raise MalformedMetrics(f"{path}: cannot read the directory ({exc.strerror})") from None
        if empty:
            return None
        raise refuse(path, f"no {METRICS_FILE}, {TRAINER_STATE}, checkpoint-N/ or {EVENTS_GLOB} in the directory")
    if not path.exists():
        return None
    if not path.is_file():
        raise refuse(path, "not a regular file or directory")
    if "tfevents" in path.name:
        return "tensorboard"
    if path.name == TRAINER_STATE:
        return "trainer-state"
    try:
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError as exc:
        raise MalformedMetrics(f"{path}: cannot read ({exc.strerror})") from None
    if _is_record(head):
        return "tensorboard"
    text = head.decode("utf-8", errors="replace").lstrip()
    if path.suffix == ".jsonl" or not text:
        return "jsonl"
    if text.startswith("{"):
        first = text.split("\n", 1)[0]
        try:
            record = json.loads(first)
        except json.JSONDecodeError:
            record = None  # a JSON document over several lines: a trainer state?
        if isinstance(record, dict) and "step" in record:
            return "jsonl"
        if '"log_history"' in path.read_text(errors="replace"):
            return "trainer-state"
    raise refuse(path, "not a metrics file of a known format")


def _is_record(head: bytes) -> bool:
    """Whether `head` starts with a TFRecord whose length passes its CRC (an event file)."""
    if len(head) < 12:
        return False
    try:
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    except ImportError:
        return False
    return masked_crc32c(head[:8]) == struct.unpack("<I", head[8:12])[0]


def walk_records(path: Path) -> int:
    """The byte offset where the file's whole records end (each 8 length + 4 CRC + data + 4 CRC)."""
    end = 0
    with path.open("rb") as f:
        while True:
            header = f.read(8)
            if len(header) < 8:
                return end
            length = struct.unpack("<Q", header)[0]
            f.seek(4 + length, 1)
            if len(f.read(4)) < 4 or f.tell() > path.stat().st_size:
                return end
            end = f.tell()


def _checkpoints(path: Path) -> list[Path]:
    found = [p for p in path.iterdir() if p.is_dir() and _CHECKPOINT.match(p.name)
             and (p / TRAINER_STATE).is_file()] if path.is_dir() else []
    return sorted(found, key=lambda p: int(_CHECKPOINT.match(p.name)[1]))


def trainer_state_path(path: Path) -> Path:
    if path.is_file():
        return path
    if (path / TRAINER_STATE).is_file():
        return path / TRAINER_STATE
    checkpoints = _checkpoints(path)
    if not checkpoints:
        raise MalformedMetrics(f"{path}: no {TRAINER_STATE} and no checkpoint-N/{TRAINER_STATE} there")
    return checkpoints[-1] / TRAINER_STATE  # the newest checkpoint's holds the whole history


def trainer_state_rows(path: Path, partial_ok: bool = False) -> dict[int, dict[str, float]]:
    """log_history's entries by step (an entry's numbers; a null is NaN, strings are left out)."""
    return _history_rows(*_trainer_state(path, partial_ok))


def _trainer_state(path: Path, partial_ok: bool) -> tuple[Path, dict | None]:
    """(the state file, its JSON; None while it is being rewritten and `partial_ok`)."""
    state_file = trainer_state_path(path)
    try:
        return state_file, json.loads(state_file.read_text())
    except json.JSONDecodeError as exc:
        if partial_ok:  # being rewritten: the next poll reads it whole
            return state_file, None
        raise MalformedMetrics(f"{state_file}: not JSON ({exc.msg})") from None
    except OSError as exc:
        raise MalformedMetrics(f"{state_file}: cannot read ({exc.strerror})") from None


def _history_rows(state_file: Path, state: dict | None) -> dict[int, dict[str, float]]:
    if state is None:
        return {}
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise MalformedMetrics(f"{state_file}: no log_history list (not an HF Trainer state)")
    rows: dict[int, dict[str, float]] = {}
    for number, entry in enumerate(history):
        parsed = parse_line(json.dumps(entry), f"{state_file}: log_history[{number}]") if isinstance(entry, dict) \
            else None
        if parsed is not None:
            rows.setdefault(parsed[0], {}).update(parsed[1])
    return rows


def event_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    try:
        return sorted(p for p in path.rglob(EVENTS_GLOB) if p.is_file())
    except OSError as exc:
        raise MalformedMetrics(f"{path}: cannot read the directory ({exc.strerror})") from None


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


def _loader(path: Path):
    try:
        from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
    except ImportError:
        raise MalformedMetrics(f"{path}: reading TensorBoard event files needs the tensorboard package "
                               "(pip install tensorboard)") from None
    return LegacyEventFileLoader(str(path))


def check_event_file(path: Path) -> None:
    """A finished event file must be whole records (16 + length bytes each) to its end."""
    size = path.stat().st_size
    if size == 0:
        raise MalformedMetrics(f"{path}: empty event file (no records)")
    end = walk_records(path)
    if end != size:
        raise MalformedMetrics(f"{path}: truncated or corrupt event file (whole records end at byte {end} of "
                               f"{size})")


class EventsFollower:
    """New events of a TensorBoard directory (new files included) or file, by step."""

    def __init__(self, path: Path):
        self.path, self.loaders, self.pending = path, {}, {}
        self.emitted_upto: int | None = None

    def poll(self) -> None:
        for file in event_files(self.path) if self.path.exists() else []:
            if file not in self.loaders:
                self.loaders[file] = _loader(file)
            for event in self.loaders[file].Load():
                for tag, value in _event_values(event):
                    self.pending.setdefault(int(event.step), {})[tag] = value

    def rows(self, final: bool = False) -> list[tuple[int, dict[str, float]]]:
        """The steps complete now: all but the newest (its values may still be coming), or all."""
        self.poll()
        last = max(self.pending, default=None)
        done = sorted(s for s in self.pending if final or s != last)
        return [(s, self.pending.pop(s)) for s in done]


def tensorboard_rows(path: Path) -> dict[int, dict[str, float]]:
    files = event_files(path)
    if not files:
        raise MalformedMetrics(f"{path}: no {EVENTS_GLOB} files there")
    for file in files:
        check_event_file(file)
    return dict(EventsFollower(path).rows(final=True))


class MetricsFollower:
    """Reads the complete lines appended to a file since the last call."""

    def __init__(self, path: Path):
        self.path, self.offset, self.number, self.partial = path, 0, 0, b""

    def lines(self, final: bool = False) -> list[tuple[str, str]]:
        """(line, where) of each new complete line; `final` also takes an unterminated last line."""
        if not self.path.is_file():
            return []
        size = self.path.stat().st_size
        if size < self.offset:  # truncated or replaced: a new run starts over
            raise MalformedMetrics(f"{self.path}: the file shrank from {self.offset} to {size} bytes while "
                                   "being watched; a run's metrics file must only grow")
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        chunks = (self.partial + data).split(b"\n")
        self.partial = chunks.pop()
        if final and self.partial:
            chunks.append(self.partial)
            self.partial = b""
        out = []
        for chunk in chunks:
            self.number += 1
            out.append((chunk.decode("utf-8", errors="replace"), f"{self.path}:{self.number}"))
        return out


class JsonlFollower:
    def __init__(self, path: Path):
        self.lines = MetricsFollower(path)

    def rows(self, final: bool = False) -> list[tuple[int, dict[str, float]]]:
        out = []
        for line, where in self.lines.lines(final):
            parsed = parse_line(line, where)
            if parsed is not None:
                out.append(parsed)
        return out


class TrainerStateFollower:
    """trainer_state.json is rewritten whole at each save: the steps not yet given."""

    def __init__(self, path: Path):
        self.path, self.given = path, set()
        self.finished: str | None = None

    def rows(self, final: bool = False) -> list[tuple[int, dict[str, float]]]:
        try:
            state_file, state = _trainer_state(self.path, partial_ok=not final)
            rows = _history_rows(state_file, state)
        except MalformedMetrics:
            if final:
                raise
            return []  # no checkpoint yet
        self.finished = self.finished or _state_end(state)
        new = sorted(s for s in rows if s not in self.given)
        self.given.update(new)
        return [(s, rows[s]) for s in new]


def _state_end(state: dict | None) -> str | None:
    steps, last = (state.get("global_step"), state.get("max_steps")) if isinstance(state, dict) else (None, None)
    if isinstance(steps, int) and isinstance(last, int) and 0 < last <= steps:
        return f"{TRAINER_STATE}: global_step {steps} of max_steps {last}"
    return None


class RunFollower:
    """A growing run in any format, its rows renamed by the profile (detected from the first
    names seen, unless asked for): what `watch` reads. `finished` says why the log shows its
    writer is done (module doc), None while it does not; `last_step`: the run's last step."""

    def __init__(self, path: str | Path, options: ReadOptions | None = None, last_step: int | None = None):
        self.path, self.options, self.last_step = Path(path), options or ReadOptions(), last_step
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
            self.format = self.format or detect_format(self.path)
            if self.format is None:
                return []
            self.inner = {"jsonl": JsonlFollower, "tensorboard": EventsFollower,
                          "trainer-state": TrainerStateFollower}[self.format](self._source())
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
            return f"step {self.last_step} logged (--last-step)"
        return getattr(self.inner, "finished", None)

    def _source(self) -> Path:
        if self.format == "jsonl" and self.path.is_dir():
            return self.path / METRICS_FILE
        return self.path


def read_run(path: str | Path, options: ReadOptions | None = None) -> tuple[dict[int, dict[str, float]], Profile]:
    """A finished run's rows under the detectors' names, and the profile that named them."""
    try:
        return _read_run(Path(path), options or current_options())
    except OSError as exc:
        raise MalformedMetrics(f"{path}: cannot read ({exc.strerror or exc})") from None


def read_metrics(run: str | Path) -> dict[int, dict[str, float]]:
    """step -> {metric: value} under the detectors' names, from any format this module knows
    (detected, or as reading() asks), renamed by the run's name profile."""
    return read_run(run)[0]


def _read_run(path: Path, options: ReadOptions) -> tuple[dict[int, dict[str, float]], Profile]:
    fmt = check_format(options.format) or detect_format(path)
    if fmt is None:
        raise MalformedMetrics(f"{path}: no such file or directory, or an empty one (no {METRICS_FILE}, "
                               f"{EVENTS_GLOB} or {TRAINER_STATE} there)")
    if fmt == "jsonl":
        from moe_proxy.metrics.metrics_io import read_jsonl
        rows = read_jsonl(path)
    elif fmt == "tensorboard":
        rows = tensorboard_rows(path)
    else:
        rows = trainer_state_rows(path)
    if not rows:
        raise MalformedMetrics(f"{path}: no steps recorded")
    names = set().union(*rows.values())
    profile = profile_for(names, options.profile, parse_metric_options(list(options.metrics)))
    return {s: profile.rename(r) for s, r in sorted(rows.items())}, profile
