"""CPU seconds to plan a proxy (select the experts of every MoE layer) of the benchmark
checkpoint, with scikit-learn's OpenMP/BLAS pools on one thread, as the build runs them
(selection.py), and on their default threads, for comparison. On busy cores the default
pools' worker threads spin while waiting, which costs CPU and the build's planning time.

Run: .venv/bin/python bench/plan_cpu.py [CKPT]   (default bench/out/ckpt-8gb: bench/build.py --size 8
makes it). Each setting runs in a fresh process; it prints CPU and wall seconds, and whether
both kept the same experts.
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import contextlib, json, sys, time
import threadpoolctl
if sys.argv[2] == "default":  # the pools as scikit-learn leaves them
    threadpoolctl.threadpool_limits = lambda **kw: contextlib.nullcontext()
from moe_proxy.architectures import detect
from moe_proxy.pruning.expert_plan import plan_experts
from moe_proxy.options import PruningOptions
from moe_proxy.checkpoint.layout import find_layout
from moe_proxy.checkpoint.reader import open_checkpoint
import moe_proxy.pruning.features, moe_proxy.pruning.selection, sklearn.cluster  # imports are not planning
ckpt = open_checkpoint(sys.argv[1])
layout = find_layout(ckpt, detect(ckpt.config))
cpu, wall = time.process_time(), time.perf_counter()
plan = plan_experts(ckpt, layout, PruningOptions(experts=8))
print(json.dumps({"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall,
                  "layers": len(layout.blocks), "kept": {k: s.kept for k, s in plan.selections.items()}}))
"""


def main() -> int:
    ckpt = sys.argv[1] if len(sys.argv) > 1 else "bench/out/ckpt-8gb"
    runs = {}
    for mode in ("one-thread", "default"):
        out = subprocess.run([sys.executable, "-c", CHILD, ckpt, mode], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-2000:])
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        r = runs[mode]
        print(f"{mode:>10} threads: planning {r['layers']} layers took {r['cpu_s']:.2f} CPU s, {r['wall_s']:.1f} s wall")
    print("same experts kept:", runs["one-thread"]["kept"] == runs["default"]["kept"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
