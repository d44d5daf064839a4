"""Does the proxy learn like the original? RL tracking on a task where RL learns (issue #29 item 2).

On the fidelity lab's tasks the reward is flat within a run (two-digit sums: the lab's small
originals answer them with any two digits), so tracking there measures sampling noise. Here the
task is one where the reward rises within the run: `small-sums` (moe_proxy.rl.task: one-digit
sums, scored 1 - |answer - sum| / 10). The lab's trained original answers "3+4=" with two digits
(reward about 0.05 at step 0) and learns to answer small numbers within about 20 steps at lr 1e-4
(reward about 0.6): a change of its answers' first token and length that GRPO's advantages reach at
once, on every prompt. The runs are the lab's (bench/fidelity.py's RL settings: 8 prompts x 4
samples, 6 new tokens, 2 mini-batches, KL 0.01) with the task and the learning rate of TASK.

Each model (the lab's trained qwen3 original, its default proxies at 50%, 25% and 12.5% and the
random 50% controls: bench/verdicts.py's models; other builds with --builds) runs with SEEDS prompt/sampling seeds; the
original again with another sampling seed and the same prompts (`original-reseeded`) is the
floor. Tracking: the median Pearson of the key curves (moe-proxy compare) against the original's
run with the same seed, and the reward curve's own Pearson; reward of the first and last steps.
Runs are cached by fidelity.cached_run (settings and code version). Prints markdown tables
(docs/fidelity.md), writes OUT/qwen3/learning/learning.json and a plot of seed 0's curves.

    nice -n 10 .venv/bin/python bench/learning.py --out bench/out/mismatch-lab
    .venv/bin/python bench/learning.py --quick --out /tmp/l   # a smoke run: tiny original, 2 seeds, 3 steps
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench/ is a folder of scripts
import verdicts  # noqa: E402

TASK = dict(task="small-sums", lr=1e-4)  # on top of the lab's RL settings
STEPS, SEEDS = 32, 4
EDGE = 4  # "first steps" and "last steps" of the reward table
REWARD = "critic/rewards/mean"
log = logging.getLogger("learning")


def runs_of(lab, models: dict[str, Path], out: Path, steps: int, seeds: range) -> dict[int, dict[str, Path]]:
    """seed -> model name -> run directory (the control: the original with another sampling seed)."""
    wrapped = {n: lab.Model(p, 1.0, 1.0) for n, p in models.items()}
    return {seed: lab.run_scenarios(wrapped, {"learning": TASK}, out / f"seed-{seed}", steps, seed=seed)["learning"]
            for seed in seeds}


def tracking(lab, runs: dict[int, dict[str, Path]]) -> dict[str, dict]:
    """model -> per seed: median Pearson of the key curves and the reward curve's Pearson against the
    original's run of that seed; reward over the first and last EDGE steps."""
    out: dict[str, dict] = {}
    for by_model in runs.values():
        loaded = [lab.load_run(by_model["original"], "original")] + [
            lab.load_run(p, n) for n, p in by_model.items() if n != "original"]
        compared = {c.run: c for c in lab.compare_runs(loaded, list(lab.KEY_METRICS))}
        for run in loaded:
            rewards = [row[REWARD] for _, row in sorted(run.rows.items())]
            c = compared[run.name]
            figures = out.setdefault(run.name, {"median": [], "reward_pearson": [], "first": [], "last": []})
            figures["median"].append(c.median_pearson)
            figures["reward_pearson"].append(c.metrics[REWARD].pearson if REWARD in c.metrics else None)
            figures["first"].append(float(np.mean(rewards[:EDGE])))
            figures["last"].append(float(np.mean(rewards[-EDGE:])))
    for figures in out.values():
        figures["mean"] = lab.mean_of(figures["median"])
        figures["reward_mean"] = lab.mean_of(figures["reward_pearson"])
    return out


def table(figures: dict[str, dict], steps: int, seeds: range) -> str:
    floor = figures[verdicts._lab().CONTROL]
    lines = [f"| model | reward, first {EDGE} steps -> last {EDGE} (mean of seeds) | tracking: median Pearson per "
             "seed | tracking: mean | reward curve's Pearson: mean | at or above the floor |",
             "|---|---|---|---|---|---|"]
    for name, f in figures.items():
        if name == "original":
            verdict = "(reference)"
        elif name == verdicts._lab().CONTROL:
            verdict = "(the floor)"
        else:
            verdict = "yes" if f["mean"] >= floor["mean"] else f"**no** ({f['mean'] - floor['mean']:+.2f})"
        lines.append(f"| {name} | {np.mean(f['first']):.2f} -> {np.mean(f['last']):.2f} | "
                     f"{' / '.join(fmt(v) for v in f['median'])} | {fmt(f['mean'])} | {fmt(f['reward_mean'])} | "
                     f"{verdict} |")
    return "\n".join([f"small-sums, lr {TASK['lr']:g}, {steps} steps, seeds {seeds[0]}-{seeds[-1]}:", "",
                      *lines]) + "\n"


def fmt(value: float | None) -> str:
    return "n/a" if value is None or not np.isfinite(value) else f"{value:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="the lab's output with its qwen3 original and proxies "
                        "(default bench/out/fidelity; quick: bench/out/fidelity-quick)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"RL steps per run (default {STEPS})")
    parser.add_argument("--seeds", type=int, default=SEEDS, help=f"prompt/sampling seeds (default {SEEDS})")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds FIRST to FIRST + SEEDS - 1 (default 0): "
                        "a second process on other seeds shares the work, the runs' cache the rest")
    parser.add_argument("--random-draws", type=int, default=1, help="random 50%% controls (default 1)")
    verdicts.add_model_args(parser)
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny original, 50%% proxies, "
                        "2 seeds, 3 steps")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("transformers").setLevel(logging.WARNING)
    lab = verdicts._lab()
    import torch

    torch.set_num_threads(1)  # the lab's rule on a shared 2-core machine
    ratios = tuple(args.ratios)
    if args.quick:
        lab.MODEL.update(lab.QUICK_MODEL)
        lab.TRAIN.update(lab.QUICK_BATCH)
        lab.RL.update(lab.QUICK_RL)
        lab.OUT = lab.OUT.with_name("fidelity-quick")
        ratios, args.steps, args.seeds = (0.5,), 3, 2
    lab.OUT = args.out or lab.OUT
    started = time.time()
    models = verdicts.models_of(lab, *verdicts.original_and_stats(lab), ratios, args.random_draws,
                                extra=tuple(args.builds))
    models.pop(verdicts.OTHER_SEEDS)  # the verdicts' floor; here the floor is fidelity.CONTROL
    root = lab.OUT / "qwen3" / "learning"
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    runs = runs_of(lab, models, root, args.steps, seeds)
    figures = tracking(lab, runs)
    text = table(figures, args.steps, seeds)
    names = ["original", lab.CONTROL, *(n for n in models if n != "original")]
    plot = lab.plot_curves([lab.load_run(runs[seeds[0]][n], n) for n in names], [REWARD, "response_length/mean",
                           "actor/entropy", "actor/kl_loss", "moe/router_entropy/mean", "actor/grad_norm"], root,
                           name=f"learning-seed{seeds[0]}.png")
    text += f"\nSeed {seeds[0]}'s curves: {plot[0] if plot else 'none'}\n"
    print(text)
    (root / "learning.md").write_text(text)
    (root / "learning.json").write_text(json.dumps({"task": TASK, "rl": lab.RL, "steps": args.steps,
                                                    "seeds": args.seeds, "figures": figures,
                                                    "models": {n: str(p) for n, p in models.items()},
                                                    "wall_s": round(time.time() - started, 1)}, indent=2))
    log.info("done in %.0fs; %s", time.time() - started, root / "learning.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
