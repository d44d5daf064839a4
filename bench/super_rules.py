"""How many super experts each rule flags, per MoE layer, on stored calibration statistics:
the rule moe-proxy used before (max |output| >= 10x the layer's median and >= 1/10 of the
model's largest) and REAP's (calibrate/statistics.py, super_experts).

    .venv/bin/python bench/super_rules.py STATS [STATS ...]

e.g. the fidelity lab's bench/out/fidelity/qwen3/calibration (docs/fidelity.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent / "src"))  # after PYTHONPATH

from moe_proxy.calibrate import statistics as cal  # noqa: E402

OLD_RATIO, OLD_GLOBAL = 10.0, 0.1  # the replaced rule's factors


def old_rule(layers: dict[str, cal.LayerStats]) -> dict[str, list[int]]:
    top = max(float(s.max_abs.max()) for s in layers.values())
    return {p: [e for e, v in enumerate(s.max_abs.tolist())
                if v >= OLD_RATIO * float(s.max_abs.median()) and v >= OLD_GLOBAL * top and v > 0]
            for p, s in layers.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stats", nargs="+", help="calibration statistics (moe-proxy calibrate --out)")
    args = parser.parse_args()
    print("| statistics | layer | dead | old rule | REAP's rule |\n|---|---|---|---|---|")
    for uri in args.stats:
        c = cal.load(uri)
        old, new = old_rule(c.layers), cal.super_experts(c.layers)
        for p, s in sorted(c.layers.items(), key=lambda item: item[1].layer):
            print(f"| {uri} | {s.layer} | {len(s.dead())} | {len(old[p])}: {old[p]} | {len(new[p])}: {new[p]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
