"""metrics.jsonl in verl's FileLogger format: one line per step, `{"step": N, "data": {...}}`.

Non-finite values are written as the bare tokens NaN / Infinity, as Python's json writes them.
Readers accept that format and flat lines (`{"step": N, "metric": value}`); a `null` value is
read as NaN (verl's FileLogger serialises with orjson, which writes NaN and Infinity as null).
readers.read_metrics reads these and the other formats readers.py knows (TensorBoard, trainer_state.json)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from moe_proxy.errors import MalformedMetrics

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def append_step(path: Path, step: int, data: dict[str, float]) -> None:
    with path.open("a") as f:
        f.write(json.dumps({"step": step, "data": data}) + "\n")
        f.flush()


def metrics_path(run: str | Path) -> Path:
    """A run directory's metrics.jsonl, or the .jsonl file itself."""
    path = Path(run)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise MalformedMetrics(f"{run}: no {METRICS_FILE} there (pass a run directory or a .jsonl file)")
    return path


def read_jsonl(run: str | Path) -> dict[int, dict[str, float]]:
    """step -> {metric: value} of a JSON-lines file. Later lines for the same step update earlier ones."""
    path = metrics_path(run)
    rows: dict[int, dict[str, float]] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        parsed = parse_line(line, f"{path}:{number}")
        if parsed is not None:
            rows.setdefault(parsed[0], {}).update(parsed[1])
    if not rows:
        raise MalformedMetrics(f"{path}: no steps recorded")
    return dict(sorted(rows.items()))


def parse_line(line: str, where: str) -> tuple[int, dict[str, float]] | None:
    """(step, numeric metrics) of one line, verl's `{"step", "data": {...}}` or flat; None for a
    blank line. Strings and lists are not curves and are left out; null is NaN (module doc)."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise MalformedMetrics(f"{where}: not JSON ({exc.msg}); each line must be one JSON object") from None
    if not isinstance(record, dict):
        raise MalformedMetrics(f"{where}: a line must be a JSON object, got {type(record).__name__}")
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or step != int(step):
        raise MalformedMetrics(f"{where}: missing or non-integer \"step\"")
    data = record["data"] if isinstance(record.get("data"), dict) else {
        k: v for k, v in record.items() if k != "step"}
    return int(step), {key: math.nan if value is None else float(value) for key, value in data.items()
                       if value is None or (not isinstance(value, bool) and isinstance(value, (int, float)))}


def read_summary(run: str | Path) -> dict | None:
    path = Path(run) / SUMMARY_FILE if Path(run).is_dir() else Path(run).with_name(SUMMARY_FILE)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise MalformedMetrics(f"{path}: not JSON ({exc.msg})") from None


def finite_or_none(value: float | None) -> float | None:
    """For JSON meant for strict parsers (termination log, report.json)."""
    return value if value is not None and math.isfinite(value) else None
