"""Rollout/training mismatch on the fidelity lab's trained original and its default proxies.

Real RL stacks sample in bf16 with an inference engine and train in fp32; for MoE models the gap
flips routing and can grow into a collapse (docs/repro.md, "Rollout and trainer apart"). This lab
puts the same gap into `moe-proxy repro` (`--rollout-precision bf16` on an fp32 trainer) on the
lab's trained Qwen3-MoE original (bench/fidelity.py: 4 layers, 64 experts, top-4, trained on
text) and its default proxies (`calibrate --experts N` + `build --calibration`, the lab's
`seq-recon`) at 50% and 12.5% of the experts, and measures:

1. the gap at the lab's RL settings: routing mismatch share, probs-diff, mismatch KL, for a bf16
   rollout and for matching numerics (the floor: incremental decoding against a full forward);
2. at a learning rate high enough to move the policy fast: the first step of each failure
   (`mismatch` among them) of the baseline, and of R3 routing replay and token TIS, on the
   original and on each proxy: does the proxy fail where the original does, and do the fixes
   cure both?

Runs are cached like the fidelity lab's (bench/out/fidelity/qwen3/mismatch, keyed by model,
settings and code version). Prints markdown tables (docs/fidelity.md) and writes mismatch.json.

    python bench/mismatch.py            # ~10 min here on the lab's original (trained once, ~14 min)
    python bench/mismatch.py --quick    # a smoke run in seconds: tiny original, 50% only, 2 steps
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from moe_proxy.rl.config import ReproConfig
from moe_proxy.metrics.readers import read_metrics

HERE = Path(__file__).resolve().parent


def _lab():
    """bench/fidelity.py: bench/ is a folder of scripts, so the lab is imported from its folder."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import fidelity

    return fidelity


GAP = {"matched": {}, "bf16 rollout": dict(rollout_precision="bf16")}
FIXES = {"baseline": {}, "R3": dict(routing_replay="R3"),
         "TIS (token, 2)": dict(rollout_is="token", rollout_is_threshold=2.0),
         # controls: the same run without the gap (rollout in the trainer's numerics), with and without R3
         "no gap": dict(rollout_precision=None), "no gap, R3": dict(rollout_precision=None, routing_replay="R3")}
GAP_METRICS = ("moe/routing_mismatch", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max",
               "training/rollout_kl")
log = logging.getLogger("mismatch")


def mean_of(rows: dict[int, dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows.values() if key in r)


def gap_table(models: dict, root: Path, steps: int, rl: dict) -> tuple[list[str], list[dict]]:
    lab = _lab()
    lines = ["| model | rollout | routing mismatch | probs diff mean | probs diff max | mismatch KL |",
             "|---|---|---|---|---|---|"]
    rows = []
    for name, model in models.items():
        for setting, change in GAP.items():
            config = ReproConfig(**{"steps": steps, "seed": 0} | rl | change)
            run = read_metrics(lab.cached_run(model.path, root / "gap" / setting.replace(" ", "-") / name, config))
            figures = {key: mean_of(run, key) for key in GAP_METRICS}
            rows.append({"model": name, "rollout": setting, **figures})
            lines.append(f"| {name} | {setting} | {figures['moe/routing_mismatch']:.4f} | "
                         f"{figures['training/rollout_probs_diff_mean']:.2e} | "
                         f"{figures['training/rollout_probs_diff_max']:.2e} | {figures['training/rollout_kl']:.2e} |")
    return lines, rows


def fix_table(models: dict, root: Path, steps: int, rl: dict, lr: float,
              seeds: list[int]) -> tuple[list[str], list[dict]]:
    """Per model and fix, each seed's failures ("divergence@1 collapse@7", "-" for none)."""
    lab = _lab()
    lines = ["| model | " + " | ".join(FIXES) + " |", "|---|" + "---|" * len(FIXES)]
    rows = []
    for name, model in models.items():
        cells = []
        for fix, change in FIXES.items():
            per_seed = []
            for seed in seeds:
                config = ReproConfig(**{"steps": steps, "seed": seed} | rl | {"lr": lr, "rollout_precision": "bf16"}
                                     | change)
                where = fix.replace(",", "").split(" (")[0].replace(" ", "-") + ("" if seed == 0 else f"-seed{seed}")
                out = lab.cached_run(model.path, root / "fixes" / f"lr{lr:g}" / where / name, config)
                summary = json.loads((out / "summary.json").read_text())
                run = read_metrics(out)
                onsets = {sig: f["step"] for sig, f in summary["failures"].items()}
                kl = [run[s].get("training/rollout_kl", float("nan")) for s in sorted(run)]
                rows.append({"model": name, "fix": fix, "seed": seed, "onsets": onsets, "rollout_kl": kl,
                             "routing_mismatch": [run[s].get("moe/routing_mismatch") for s in sorted(run)]})
                per_seed.append(" ".join(f"{sig}@{step}" for sig, step in sorted(onsets.items(), key=lambda i: i[1]))
                                or "-")
            cells.append(" / ".join(per_seed))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny original, 50%% only, 2 steps")
    parser.add_argument("--gap-steps", type=int, default=4, help="RL steps of each gap run (default 4)")
    parser.add_argument("--steps", type=int, default=12, help="RL steps of each fix run (default 12)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate of the fix runs (default 1e-3, the "
                        "lab's high-lr scenario)")
    parser.add_argument("--seeds", type=int, default=3, help="sampling seeds of each fix run (default 3)")
    parser.add_argument("--out", type=Path, help="default: bench/out/fidelity (quick: bench/out/fidelity-quick)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("moe_proxy", "transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    torch.set_num_threads(1)  # the lab's rule on a shared 2-core machine
    lab = _lab()
    ratios = (0.5, 0.125)
    if args.quick:
        lab.MODEL.update(lab.QUICK_MODEL)
        lab.TRAIN.update(lab.QUICK_BATCH)
        lab.RL.update(lab.QUICK_RL)
        args.gap_steps = args.steps = 2
        args.seeds = 1
        ratios = (0.5,)
        lab.OUT = lab.OUT.with_name("fidelity-quick")
    lab.OUT = args.out or lab.OUT
    started = time.time()
    original, stats, _ = lab.trained("qwen3", lab.MODEL)
    variants = [v for v in lab.VARIANTS if v[0] == lab.DEFAULT]
    models = lab.build_family(original, stats, lab.OUT / "qwen3" / "proxies", variants,
                              lab.expert_total(lab.MODEL), ratios)
    root = lab.OUT / "qwen3" / "mismatch"
    gap_lines, gap_rows = gap_table(models, root, args.gap_steps, lab.RL)
    fix_lines, fix_rows = fix_table(models, root, args.steps, lab.RL, args.lr, list(range(args.seeds)))
    text = "\n".join([f"Gap, mean over {args.gap_steps} steps at the lab's RL settings (lr {lab.RL['lr']:g}):", "",
                      *gap_lines, "", f"Failures (signature@first step) per seed, bf16 rollout unless 'no gap', lr {args.lr:g}, "
                      f"{args.steps} steps, seeds {' / '.join(map(str, range(args.seeds)))}:", "",
                      *fix_lines])
    print(text)
    (root / f"mismatch-lr{args.lr:g}.json").write_text(json.dumps({"gap": gap_rows, "fixes": fix_rows, "rl": lab.RL, "lr": args.lr,
                                                    "code_version": lab.lab_code_version(),
                                                    "wall_s": round(time.time() - started, 1)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
