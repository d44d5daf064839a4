"""The fidelity lab's tracking measure with more prompts per RL step: is it less noisy, and do
the 50% proxies track their original better when it is?

The lab (bench/fidelity.py) scores a proxy by the median Pearson of its clean RL curves against
its original's, 8 prompts x 4 samples per step. Over 16 or 64 steps the reseeded original
tracks itself at only 0.53-0.63 (docs/fidelity.md): per-step sampling noise. This runs the same
clean scenario (same RL settings, steps, prompt and sampling seeds, paired runs) with BATCH
prompts per step on the lab's cached originals and proxies, and prints each proxy's and the
control's median Pearson per seed and their mean. Runs are cached (bench/out/fidelity/<model>/
rl-batch-<BATCH>/) with the lab's own keys; the lab must have built the proxies first:

    .venv/bin/python bench/fidelity.py --ratios 0.5 --variants plain seq-recon
    .venv/bin/python bench/rl_batch.py [--models qwen3 deepseek-v3] [--batch 64] [--steps 16]
        [--seeds 0 1 2 3] [--proxies plain-0.5 seq-recon-0.5] [--quick] [--out DIR]

`--quick` runs on what `bench/fidelity.py --quick` made (tiny models, the lab's quick RL
settings, 2 steps, seeds 0 and 1): a smoke run whose figures mean nothing.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import fidelity as lab  # noqa: E402


def scores(family: str, proxies: list[str], batch: int, steps: int, seeds: list[int]) -> dict[str, list[float]]:
    """name -> median Pearson against the original, one per seed (the control: the original reseeded)."""
    root = lab.OUT / family
    models = {"original": lab.Model(root / "original", 1.0, 1.0)}
    for name in proxies:
        path = root / "proxies" / name
        if not (path / "proxy-manifest.json").is_file():
            raise SystemExit(f"{path} is not built: run bench/fidelity.py for {family} first")
        models[name] = lab.Model(path, 0.0, 0.0)  # run_scenarios uses only the path
    out: dict[str, list[float]] = {}
    for seed in seeds:
        runs = lab.run_scenarios(models, {"clean": {}}, root / f"rl-batch-{batch}" / str(seed), steps, seed=seed)["clean"]
        loaded = [lab.load_run(runs["original"], "original")] + [
            lab.load_run(path, n) for n, path in runs.items() if n != "original"]
        for c in lab.compare_runs(loaded, list(lab.KEY_METRICS))[1:]:
            out.setdefault(c.run, []).append(c.median_pearson)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(lab.ORIGINALS), default=list(lab.ORIGINALS))
    parser.add_argument("--batch", type=int, default=64, help="prompts per RL step (the lab's: 8)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seeds", nargs="+", type=int, default=lab.SEEDS)
    parser.add_argument("--proxies", nargs="+", default=["plain-0.5", "seq-recon-0.5"])
    parser.add_argument("--quick", action="store_true", help="on bench/fidelity.py --quick's models, in seconds")
    parser.add_argument("--out", type=Path, help="the lab's output folder (default: bench/out/fidelity, with "
                        "--quick bench/out/fidelity-quick)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)  # as the lab: two torch threads per process thrash on a shared 2-core machine
    if args.quick:
        lab.RL.update(lab.QUICK_RL)
        args.steps, args.seeds = 2, args.seeds[:2]
        lab.OUT = lab.OUT.with_name("fidelity-quick")
    lab.OUT = args.out or lab.OUT
    lab.RL = lab.RL | {"batch_size": args.batch}  # what run_scenarios passes to every run
    print(f"clean median Pearson against the original, {args.batch} prompts x {lab.RL['group_size']} samples "
          f"per step, {args.steps} steps, seeds {' '.join(map(str, args.seeds))}\n")
    print("| lab model | proxy | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean |")
    print("|---|---|" + "---|" * (len(args.seeds) + 1))
    for family in args.models:
        for name, values in scores(family, args.proxies, args.batch, args.steps, args.seeds).items():
            print(f"| {family} | {name} | " + " | ".join(lab.fmt(v) for v in values) +
                  f" | {lab.fmt(lab.mean_of(values))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
