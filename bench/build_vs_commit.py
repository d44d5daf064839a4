"""The same build by today's tree and by an older commit's, each timed spawn to exit.

Benchmarks that start the clock inside the process see only what runs after the imports they
did first. Before the torch-free line (#15), `import moe_proxy.pruning` imported torch and
scikit-learn, so bench/build.py's old in-process clock left out about 5 CPU s that a user's
`moe-proxy build` pays; after it, those imports happen inside `build_proxy` and were counted.
This script settles such comparisons: the 1 GB benchmark checkpoint on a local SeaweedFS,
built by both trees alternately (twice each), whole-process wall and CPU seconds, plus the
in-process figures after imports for reference.

Usage: .venv/bin/python bench/build_vs_commit.py [--commit 1fdc64b] [--size 1] [--smoke]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from moe_proxy.demo.seaweed import SeaweedFS  # noqa: E402
from build import children_cpu  # noqa: E402  (bench/build.py: CPU seconds of reaped children)
from synthetic import BENCH, KEYS, QUICK, generate, upload  # noqa: E402

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
def cpu(): u = resource.getrusage(resource.RUSAGE_SELF); return u.ru_utime + u.ru_stime
a = json.loads(sys.argv[1])
from moe_proxy.pruning import build_proxy  # every tree has it there (a module before #15, a package after)
from moe_proxy.storage import open_store
c, t = cpu(), time.perf_counter()
src, dst = (open_store(u, endpoint_url=a["endpoint"]) for u in (a["src"], a["dst"]))
build_proxy(src, dst, experts=a["experts"], features="router", overwrite=True)
print(json.dumps({"in_process_s": time.perf_counter() - t, "in_process_cpu_s": cpu() - c}))
"""


def timed(tree: Path, args: dict) -> dict:
    """One build in a fresh process with `tree` first on the path: spawn-to-exit wall and CPU."""
    cpu0, t = children_cpu(), time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(tree)))
    wall, cpu = time.perf_counter() - t, children_cpu() - cpu0
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1]) | {"process_s": wall, "process_cpu_s": cpu}


def _source_root(commit: str) -> str:
    """Where moe_proxy lived at `commit`: src/ since #25, transformer/ before."""
    listed = subprocess.run(["git", "ls-tree", "--name-only", commit, "src/moe_proxy"], capture_output=True,
                            text=True, check=True).stdout
    return "src" if listed.strip() else "transformer"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commit", default="1fdc64b", help="the older tree (default: the last pre-#15 build table's)")
    ap.add_argument("--size", type=float, default=1, help="checkpoint GB")
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--smoke", action="store_true", help="tiny layers (synthetic.QUICK), for the test; figures mean nothing")
    a = ap.parse_args()
    d = QUICK if a.smoke else BENCH
    os.environ.update(AWS_ACCESS_KEY_ID=KEYS[0], AWS_SECRET_ACCESS_KEY=KEYS[1], AWS_REGION="us-east-1")
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        old.mkdir()
        root = _source_root(a.commit)
        archive = subprocess.run(["git", "archive", a.commit, root], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        trees = {a.commit: old / root, "today": Path("src").resolve()}
        ckpt = generate(Path(a.out) / f"ckpt-{a.size:g}gb{'-smoke' if a.smoke else ''}", a.size, d)
        with SeaweedFS(Path(tmp) / "s3", *KEYS, buckets=["bench"]) as s3:
            upload(s3.client(), ckpt, "bench", "src")
            print("| tree | rep | process s | process CPU s | in-process s (after imports) | in-process CPU s |")
            print("|---|---|---|---|---|---|")
            for rep in range(2):
                for name, tree in trees.items():
                    r = timed(tree, dict(src="s3://bench/src", dst=f"s3://bench/{name}-{rep}",
                                         endpoint=s3.endpoint_url, experts=d.keep))
                    print(f"| {name} | {rep} | {r['process_s']:.2f} | {r['process_cpu_s']:.2f} | "
                          f"{r['in_process_s']:.2f} | {r['in_process_cpu_s']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
