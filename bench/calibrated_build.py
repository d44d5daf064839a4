"""A calibrated 12.5% build by two trees, each timed spawn to exit, and their outputs compared.

bench/build_vs_commit.py times an uncalibrated build; this one times the builds that walk the
decoder layers (issue 42 item 4: one walk per calibrated build): a tiny real Qwen3-MoE
(make_tiny: 16 experts, top-2, `--layers` MoE layers), one-pass statistics made once by today's
tree, then `build --experts 2 --method saliency --calibration STATS` (12.5%) with each option
set, by the older tree and today's alternately (`--reps` each), every build in a fresh process
into its own directory. Besides the times it checks that both trees wrote the same proxy: the
manifests (every file's sha256, the fidelity figure, each layer's records) must be equal (the
last column; where they are not, the keys that differ are printed).

Usage: .venv/bin/python bench/calibrated_build.py [--commit f4debd5 | --old /tmp/old/src] [--options default,heal]
       [--reps 2] [--layers 4] [--hidden 64]
--quick: two layers, the default and --merge builds once each (the test; figures mean nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = {  # option set -> build_proxy keywords (beside experts=2, method, calibration)
    "default": {},  # reconstruct, kept only if closer end to end
    "heal": {"heal": True},
    "merge": {"merge": True, "reconstruct": False},
    "merge-reconstruct": {"merge": True, "reconstruct": True},
    "no-reconstruct": {"reconstruct": False},
    "auto": {"experts": "auto", "max_kl": 1e3, "max_experts": 4},
}

CHILD = r"""
import json, sys, time
t = time.perf_counter()
a = json.loads(sys.argv[1])
try:
    from moe_proxy.pruning.build import build_proxy
except ImportError:  # a tree before steps.py was split (f4debd5)
    from moe_proxy.pruning.steps import build_proxy
m = build_proxy(a["src"], a["dst"], **({"experts": 2, "method": "saliency", "calibration": a["stats"],
                                        "overwrite": True} | a["kw"]))
print(json.dumps({"in_process_s": time.perf_counter() - t, "manifest": dict(m)}))
"""


def timed(tree: str, args: dict) -> dict:
    """One build in a fresh process with `tree` first on the path: spawn-to-exit wall and CPU
    seconds (CPU is what other jobs on a shared machine disturb least)."""
    cpu, t = _children_cpu(), time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=tree))
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1]) | {"process_s": time.perf_counter() - t,
                                                               "process_cpu_s": _children_cpu() - cpu}


def _children_cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commit", default="f4debd5", help="the older tree (default: the last before one walk)")
    ap.add_argument("--old", help="the older tree's source root instead of --commit's (e.g. /tmp/old/src)")
    ap.add_argument("--options", default="default", help=f"comma-separated, of {', '.join(OPTIONS)}")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.options, a.reps, a.layers, a.samples = "default,merge", 1, 2, 16
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"old": a.old or _checkout(a.commit, Path(tmp) / "old"), "today": str(ROOT / "src")}
        sys.path.insert(0, trees["today"])  # the checkpoint and its statistics made by today's tree
        from moe_proxy.calibrate.statistics import calibrate
        from moe_proxy.demo.tiny import make_tiny

        src, stats = f"{tmp}/src", f"{tmp}/stats"
        make_tiny("qwen3_moe", src, seed=2, num_experts=16, num_experts_per_tok=2, num_hidden_layers=a.layers,
                  hidden_size=a.hidden, mlp_only_layers=[])
        calibrate(src, stats, samples=a.samples, seq_len=32)
        print("| options | tree | rep | process s | process CPU s | in-process s | KL | same manifest as old |")
        print("|---|---|---|---|---|---|---|---|")
        for name in a.options.split(","):
            manifests = {}
            for rep in range(a.reps):
                for tree, path in trees.items():
                    r = timed(path, {"src": src, "dst": f"{tmp}/{name}-{tree}-{rep}", "stats": stats,
                                     "kw": OPTIONS[name]})
                    m = r["manifest"]
                    manifests.setdefault(tree, m)
                    same = "" if tree == "old" else ("yes" if m == manifests["old"] else "NO")
                    print(f"| {name} | {tree} | {rep} | {r['process_s']:.2f} | {r['process_cpu_s']:.2f} | "
                          f"{r['in_process_s']:.2f} | "
                          f"{m.get('fidelity', {}).get('kl', '-')} | {same} |", flush=True)
            if manifests["today"] != manifests["old"]:
                diff = [k for k in manifests["old"] if manifests["old"][k] != manifests["today"].get(k)]
                print(f"{name}: manifests differ in {diff}", flush=True)
    return 0


def _checkout(commit: str, where: Path) -> str:
    """The source root of `commit`, extracted under `where`."""
    where.mkdir()
    archive = subprocess.run(["git", "archive", commit, "src"], capture_output=True, check=True, cwd=ROOT).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return str(where / "src")


if __name__ == "__main__":
    raise SystemExit(main())
