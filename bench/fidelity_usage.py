"""Usage-aware proxies in the fidelity lab (bench/fidelity.py): calibration statistics from
`moe-proxy calibrate` (layer by layer) on the lab's own calibration tokens, then proxies at
50% and 12.5% of the 64 experts (12.5% keeps 8 > top-4):

- `frequency-cal`: the top-N experts by gate mass per layer (the lab's in-memory `frequency`,
  computed by this path instead);
- `saliency`: the top-N experts by REAP saliency per layer;
- `output-saliency`: clusters of expert outputs, each represented by its most salient member;
- each with and without `--heal`.

They run the lab's scenarios with the lab's settings and are compared with the lab's cached
runs of the original and of the reseeded-original control (run bench/fidelity.py first).
Writes bench/out/fidelity-usage/{results.json,table.md}.

    .venv/bin/python bench/fidelity_usage.py [--steps 16]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "transformer"))
spec = importlib.util.spec_from_file_location("fidelity", ROOT / "bench" / "fidelity.py")
fid = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fid)

from moe_proxy.build import build_proxy  # noqa: E402
from moe_proxy.calibration import calibrate  # noqa: E402

OUT = ROOT / "bench" / "out" / "fidelity-usage"
VARIANTS = [  # (name, method, features, heal)
    ("frequency-cal", "frequency", "router", False),  # the lab's `frequency`, through calibrate
    ("frequency-cal-healed", "frequency", "router", True),
    ("saliency", "saliency", "router", False),
    ("saliency-healed", "saliency", "router", True),
    ("output-saliency", "cluster", "output", False),
    ("output-saliency-healed", "cluster", "output", True),
]
log = logging.getLogger("fidelity-usage")


def calibration_ids() -> torch.Tensor:
    """The lab's calibration tokens (bench/fidelity.py build_all): corpus windows and task lines."""
    rng = np.random.default_rng(1)
    text = np.frombuffer(fid.corpus(), dtype=np.uint8)[:-200_000]
    rows = [text[s:s + 128] for _ in range(4) for s in rng.integers(0, len(text) - 129, 8)]
    rows += [np.frombuffer(fid.task_lines(random.Random(i), 128), dtype=np.uint8) for i in range(8)]
    return torch.tensor(np.stack(rows), dtype=torch.long)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    for noisy in ("moe_proxy", "transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    original = fid.OUT / "original"
    if not (original / "config.json").exists():
        raise SystemExit("run bench/fidelity.py first: it trains and caches the original")
    started = time.time()
    OUT.mkdir(parents=True, exist_ok=True)
    stats = OUT / "calibration"
    calibrate(str(original), str(stats), token_ids=calibration_ids())
    models, quality = {}, {}
    for ratio in (0.5, 0.125):
        k = int(fid.MODEL["num_experts"] * ratio)
        for name, method, features, heal in VARIANTS:
            dst = OUT / "proxies" / f"{name}-{ratio:g}"
            m = build_proxy(str(original), str(dst), experts=k, method=method, features=features,
                            calibration=str(stats), heal=heal, overwrite=True)
            models[dst.name] = dst
            quality[dst.name] = {"held_out_loss": fid.held_out_loss(dst),
                                 "gate_mass": float(np.mean([v["gate_mass_kept"] for v in m["layers"].values()]))}
    runs: dict[str, dict[str, Path]] = {}
    for scenario, settings in fid.SCENARIOS.items():
        cached = fid.OUT / "runs" / scenario
        runs[scenario] = {"original": cached / "original", fid.CONTROL: cached / fid.CONTROL}
        for name, path in models.items():
            out = OUT / "runs" / scenario / name
            fid.run_repro(str(path), out, fid.ReproConfig(steps=args.steps, seed=0, prompt_seed=0,
                                                          **(fid.RL | settings)))
            runs[scenario][name] = out
            log.info("%-16s %s done", scenario, name)
    for name in models:
        quality[name]["reward_step0"] = fid.load_run(runs["clean"][name]).rows[0]["critic/rewards/mean"]
    rows = fid.summarise(runs, models)
    text = fid.table(rows, quality)
    (OUT / "table.md").write_text(text)
    (OUT / "results.json").write_text(json.dumps({"rows": rows, "quality": quality,
                                                  "wall_s": round(time.time() - started, 1)}, indent=2, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
