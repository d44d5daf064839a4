"""Calibrate benchmark: does `moe-proxy calibrate`'s peak memory grow with one layer, not
with depth?

Makes two Qwen3-MoE checkpoints (bf16, random weights) that differ only in depth, then
measures in a fresh process each:
- peak RSS of `calibrate` (layer by layer);
- the same with one of its two memory bounds undone (layerwise/model.py): oneDNN/ideep kernel
  caches at their default 1024 entries, or no heap trim after each layer; and with both
  undone (calibrate as it was before them);
- peak RSS of loading the whole model with transformers and running the same tokens (what a
  whole-model calibration pass needs), for contrast;
- the baseline: a process that only imports torch and transformers.

Prints a table and writes bench/out/calibrate_memory.json.
Usage: .venv/bin/python bench/calibrate_memory.py [--depths 4,16] [--out bench/out] [--only calibrate,both] [--quick]
(--quick: a tiny model at one depth, a few tokens, every measurement once: a smoke run whose
figures mean nothing; tests/bench/test_bench_quick.py runs it.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = dict(hidden_size=512, moe_intermediate_size=512, intermediate_size=1024, num_experts=32,
              num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=4096)
SAMPLES, SEQ_LEN = 16, 128
QUICK_CONFIG = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=64, num_experts=8,
                    num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
QUICK_SAMPLES, QUICK_SEQ_LEN = 4, 16

# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork+exec.
PEAK = "print('PEAK', [int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')][0])"
CALIBRATE = ("from moe_proxy.calibrate.statistics import calibrate\n"
             "calibrate({src!r}, {out!r}, samples={samples}, seq_len={seq_len})\n")
UNBOUNDED_CACHES = "import os\nos.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'] = os.environ['LRU_CACHE_CAPACITY'] = '1024'\n"
NO_TRIM = "import moe_proxy.layerwise.model\nmoe_proxy.layerwise.model.release_freed_memory = lambda: None\n"
SNIPPETS = {  # what is measured, as printed, and its code (SHORT: the names --only takes)
    "imports only": "import torch, transformers\n",
    "calibrate (layer by layer)": CALIBRATE,
    "calibrate, kernel caches 1024": UNBOUNDED_CACHES + CALIBRATE,
    "calibrate, no heap trim": NO_TRIM + CALIBRATE,
    "calibrate, both undone": UNBOUNDED_CACHES + NO_TRIM + CALIBRATE,  # the code before the two bounds
    "whole model in memory":
        "import torch, transformers\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained({src!r}, dtype=torch.bfloat16).eval()\n"
        "ids = torch.randint(0, {vocab}, ({samples}, {seq_len}))\n"
        "with torch.no_grad():\n    [m(b) for b in ids.split(8)]\n",
}


SHORT = dict(zip(("imports", "calibrate", "caches", "notrim", "both", "whole"), SNIPPETS))


def measure(code: str) -> tuple[int, float]:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code + PEAK], capture_output=True, text=True, check=True).stdout
    peak = int(next(line.split()[1] for line in out.splitlines() if line.startswith("PEAK")))
    return peak, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="4,16")
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--quick", action="store_true", help="tiny model, one depth (2), few tokens: a smoke run")
    ap.add_argument("--only", metavar="NAMES", help=f"measure only these, comma-separated: {', '.join(SHORT)} "
                    "(each in a fresh process either way; on a loaded machine a deep calibrate takes long)")
    args = ap.parse_args()
    unknown = set(args.only.split(",")) - set(SHORT) if args.only else set()
    if unknown:
        ap.error(f"--only {','.join(sorted(unknown))}: expected some of {', '.join(SHORT)}")
    snippets = {SHORT[k]: SNIPPETS[SHORT[k]] for k in args.only.split(",")} if args.only else SNIPPETS
    quick = (QUICK_CONFIG, QUICK_SAMPLES, QUICK_SEQ_LEN)
    config, samples, seq_len = quick if args.quick else (CONFIG, SAMPLES, SEQ_LEN)
    depths = "2" if args.quick else args.depths
    import torch

    from moe_proxy.demo.tiny import make_tiny

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for depth in map(int, depths.split(",")):
            src = Path(tmp) / f"d{depth}"
            make_tiny("qwen3_moe", src, dtype=torch.bfloat16, num_hidden_layers=depth, mlp_only_layers=[], **config)
            size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
            for i, (what, code) in enumerate(snippets.items()):
                # Statistics in a new directory each time: calibrate does nothing where they exist.
                peak, wall = measure(code.format(src=str(src), out=str(Path(tmp) / f"stats-{depth}-{i}"),
                                                 samples=samples, seq_len=seq_len, vocab=config["vocab_size"]))
                rows.append({"depth": depth, "checkpoint_bytes": size, "what": what, "peak_rss_bytes": peak,
                             "wall_s": round(wall, 1)})
                print(f"depth {depth:>3}  checkpoint {size / 2**20:7.0f} MiB  {what:<30} "
                      f"peak RSS {peak / 2**20:7.0f} MiB  {wall:6.1f} s", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "calibrate_memory.json").write_text(json.dumps(
        {"config": config, "samples": samples, "seq_len": seq_len, "quick": args.quick, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
