"""verdicts.py's bisection alone, and once more calibrated on the RL task's own text (issue 43).

The checkpoints are the trained original with its super expert's channel doubling from one to
the next (verdicts.growing_checkpoints); each is run as it is (the truth), then `moe-proxy bisect`
runs on the original (`--keep-ratio 1`), the default 50% build calibrated on the lab's text and
a random 50% build (verdicts.bisections). `--task-text` adds the default 50% build calibrated on
the task's own prompts and answers (`a+b=c` lines, the arithmetic task): the data the run trains
on, which decides which experts a failure on the task needs (docs/fidelity.md, under the
bisection table). Each bisection resumes (bisect's own rule); the direct runs are kept in OUT.

    nice -n 19 .venv/bin/python bench/verdicts_bisect.py --out /tmp/vb --task-text
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import verdicts  # noqa: E402

TASK_LINES = 4000  # about 36 KB: more text than the 16 x 64 tokens a probe calibrates on


def task_text(path: Path, lines: int = TASK_LINES, seed: int = 0) -> Path:
    """The arithmetic task's prompts with their answers (rl/task.make_prompts' `a+b=` over 0..99)."""
    rng = random.Random(seed)
    path.write_text("\n".join(f"{a}+{b}={a + b}" for a, b in ((rng.randrange(100), rng.randrange(100))
                                                            for _ in range(lines))) + "\n")
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--task-text", action="store_true", help="also the default 50%% build calibrated on the "
                   "task's own text")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    lab = verdicts._lab()
    trained, stats = verdicts.original_and_stats(lab)
    planted, _ = verdicts.planted_original(lab, trained, stats)
    info = json.loads((planted / "planted.json").read_text())
    prefix = verdicts.growing_checkpoints(trained, info, lab.OUT / "qwen3" / "verdicts" / "bisect" / "checkpoints")
    args.out.mkdir(parents=True, exist_ok=True)
    text = args.out / "calibration.txt"  # the lab's calibration text, as bytes (verdicts.py's own)
    text.write_bytes(bytes(lab.calibration_ids().reshape(-1).tolist()).replace(b"\x00", b" "))
    base = verdicts.rl_flags(lab.RL)
    result = verdicts.bisections(prefix, args.out, base, text)
    if args.task_text:  # a build name that starts with the lab's default gets --dataset
        default = f"{verdicts.lab_default()}-0.5"
        result |= {k: v for k, v in verdicts.bisections(
            prefix, args.out, base, task_text(args.out / "task.txt"),
            {f"{default}-task": verdicts.BISECT_BUILDS[default]}).items() if k.endswith("-task")}
    (args.out / "bisections.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(verdicts.bisect_table(result, info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
