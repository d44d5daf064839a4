"""`moe-proxy bisect --parallel P` against one probe at a time (issue 45 item 1, docs/performance.md,
"Bisection: probes a round"): the planted run of tests/repro/test_bisect.py (8 tiny Qwen3-MoE
checkpoints, steps 10..80, the last 3 with a dense MLP whose output overflows fp16), bisected from
scratch at each P, each a `moe-proxy bisect` process: its rounds, search rounds, probes, the
device-hours its report states (the plan's cost model), the first bad checkpoint and the wall time.

Usage: .venv/bin/python bench/bisect_rounds.py [P ...]   (default: 1 3)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARGS = ["--fail-on", "overflow", "--experts", "4", "--steps", "1", "--precision", "fp16"]


def planted(root: Path) -> Path:
    from moe_proxy.demo.run import OVERFLOWS, write_run
    from moe_proxy.demo.tiny import make_tiny

    make_tiny("qwen3_moe", root / "base")
    return write_run(root / "base", root / "run", {s: OVERFLOWS if s >= 60 else 1 for s in range(10, 90, 10)})


def measure(run: Path, out: Path, parallel: int) -> dict:
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "moe_proxy", "bisect", str(run), "--out", str(out), *ARGS,
                    "--parallel", str(parallel)], check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - started
    r = json.loads((out / "report.json").read_text())
    return {"P": parallel, "rounds": r["rounds"], "search rounds": r["search_rounds"],
            "probes": r["cost"]["probes"], "device-hours": f"{r['cost']['device_hours']:.3g}",
            "first bad": r["first_bad"]["step"], "order": " / ".join(", ".join(map(str, x["steps"]))
                                                                   for x in r["round_list"]),
            "wall s": round(wall)}


def main(argv: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = planted(Path(tmp))
        rows = [measure(run, Path(tmp) / f"p{p}", p) for p in map(int, argv or ["1", "3"])]
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
