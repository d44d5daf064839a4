"""How many full builds `--experts auto --max-kl X` makes, before and after a change of its
search (pruning/auto.py Search), for every target X across the whole range (issue 45 item 4).

1. The figures: on the fidelity lab's trained qwen3 original (bench/fidelity.py trains it and
   makes its one-pass statistics; 4 MoE layers, 64 experts, top-4) the search's own screen
   (auto.screen: every count's plain proxy in one walk), then every buildable count's full
   build (expert_plan.fit_plan: the default reconstruction and its figure, what `build
   --experts auto` fits), each cached in bench/out/auto-search/ by count. That is the
   expensive part (1-4 minutes per count on 2 shared cores, 29 counts): `--counts 5-12` limits it.
2. The sweep: for each target X (one between every two neighbouring full figures, one below the
   smallest, one above the largest), the search of this tree and that of `--before COMMIT`'s
   pruning/auto.py run on those figures (a full build is a look-up) and say which counts they
   built; beside them the exhaustive answer (the smallest count whose full figure meets X).
   Builds are counted, not timed: the figures are deterministic, the machine is shared.

    .venv/bin/python bench/auto_search.py [--before b5dd109] [--counts 5-35] [--jobs 2]
    .venv/bin/python bench/auto_search.py --replay            # the lab's figures as checked in: seconds
    .venv/bin/python bench/auto_search.py --synthetic 0.03    # the unit test's drifting figures instead
    .venv/bin/python bench/auto_search.py --synthetic 0.03 --noise 0.1 --plain-noise 0.3 --seeds 10

`--replay` reads bench/auto_search_lab.json: the 29 counts' plain and full figures as
docs/performance.md printed them (the build cache is not kept). `--noise` multiplies each full
figure by exp(N(0, NOISE)), `--plain-noise` each plain one, seeded: each seed is one sweep.

Prints a table (target, exhaustive answer, each search's answer and counts built, in order) and
the mean and largest number of full builds, how often the answer is the exhaustive one and, for
this tree's search, whether it is within noise (every smaller count that meets the target was
not built and meets it by less than the noise margin the search gave it: Search.margin), and
writes bench/out/auto-search/sweep.json (or sweep-synthetic-*.json).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import types
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "auto-search"
LAB = ROOT / "bench" / "auto_search_lab.json"
sys.path.append(str(ROOT / "src"))  # after PYTHONPATH, as bench/fidelity.py


def lab_source():
    """The lab's trained qwen3 original and its one-pass statistics (trained or reused)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import fidelity as lab  # noqa: E402  (torch, transformers: only when figures are made)

    lab.OUT = ROOT / "bench" / "out" / "fidelity"
    original, stats, _ = lab.trained("qwen3", lab.ORIGINALS["qwen3"])
    return str(original), str(stats)


def opened(max_kl: float = 0.005):
    """The opened original, the options of `build --experts auto --max-kl X` and the counts."""
    from dataclasses import replace

    from moe_proxy.options import PruningOptions
    from moe_proxy.pruning.prepared import open_source
    from moe_proxy.sizing import SizingOptions, auto_counts

    original, stats = lab_source()
    options = PruningOptions(experts="auto", max_kl=max_kl, calibration=stats).resolved()
    source = open_source(original, options, None)
    budget = replace(SizingOptions(), experts=None, keep_ratio=None, top_k=options.top_k)
    return source, options, auto_counts(source.ckpt.config, budget)


def plain_figures() -> dict[int, float]:
    """Every buildable count's plain figure: the search's own screen (cached)."""
    cached = OUT / "plain.json"
    if cached.exists():
        return {int(c): kl for c, kl in json.loads(cached.read_text()).items()}
    from moe_proxy.pruning.auto import screen

    source, options, counts = opened()
    search = screen(source.ckpt, source.layout, source.calibration, options, counts)[0]
    plain = dict(zip(search.counts, search.plain))
    OUT.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(plain, indent=1))
    return plain


def full_figure(count: int) -> float:
    """Count's full build (fits and figure, as --experts auto makes it), cached by count."""
    cached = OUT / f"full-{count}.json"
    if cached.exists():
        return json.loads(cached.read_text())["kl"]
    from dataclasses import replace

    from moe_proxy.pruning.expert_plan import fit_plan, plan_experts

    source, options, _ = opened()
    plain_options = replace(options, keep_ratio=None, heal=False, merge=False, reconstruct=False, experts=count)
    plan = plan_experts(source.ckpt, source.layout, plain_options, calibration=source.calibration)
    figure = fit_plan(source.ckpt, source.layout, plan, options, source.calibration).fidelity
    cached.write_text(json.dumps({"count": count, "kl": figure["kl"], "figure": figure}, indent=1))
    return figure["kl"]


def searches(before: str) -> dict[str, type]:
    """The Search class of this tree and of `before`'s pruning/auto.py (loaded from git)."""
    from moe_proxy.pruning import auto

    text = subprocess.run(["git", "show", f"{before}:src/moe_proxy/pruning/auto.py"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    old = sys.modules[f"auto_{before}"] = types.ModuleType(f"auto_{before}")
    exec(compile(text, f"{before}:auto.py", "exec"), old.__dict__)
    return {before: old.Search, "today": auto.Search}


def targets(full: list[float]) -> list[float]:
    """One target between every two neighbouring distinct full figures (geometric mean), one
    below the smallest (refused) and one above the largest."""
    levels = sorted(set(full))
    return ([levels[0] / 2] + [math.sqrt(a * b) for a, b in zip(levels, levels[1:])] + [levels[-1] * 2])


def sweep(counts: list[int], plain: list[float], full: list[float], classes: dict[str, type]) -> list[dict]:
    """Each search's answer and builds at every target, and the exhaustive answer."""
    rows = []
    for x in targets(full):
        row = {"max_kl": x, "exhaustive": next((c for c, kl in zip(counts, full) if kl <= x), None)}
        for name, cls in classes.items():
            built: list[int] = []
            search = cls(list(counts), list(plain), x)
            answer = search.run(lambda i: built.append(i) or full[i])
            row[name] = {"answer": None if answer is None else counts[answer], "built": [counts[i] for i in built]}
            if hasattr(search, "margin"):  # this tree's search: is the answer within its noise?
                row[name]["within_noise"] = within_noise(search, answer, full)
        rows.append(row)
    return rows


def within_noise(search, answer: int | None, full: list[float]) -> bool:
    """Whether every count below the answer (every count, for a refusal) that meets the target
    was left unbuilt and meets it by less than the noise margin the search gave it."""
    end = len(full) if answer is None else answer
    return all(i not in search.full and math.log(search.max_kl / full[i]) < search.margin(i)
               for i in range(end) if full[i] <= search.max_kl)


def report(rows: list[dict], classes: dict[str, type]) -> str:
    names = list(classes)
    lines = ["| max_kl | exhaustive | " + " | ".join(f"{n}: chosen | {n}: built (count order) | {n}: builds"
                                                      for n in names) + " |",
             "|---|---|" + "---|---|---|" * len(names)]
    for r in rows:
        lines.append(f"| {r['max_kl']:.4g} | {r['exhaustive']} | " + " | ".join(
            f"{r[n]['answer']} | {', '.join(map(str, r[n]['built']))} | {len(r[n]['built'])}" for n in names) + " |")
    lines += [summary(rows, n) for n in names]
    return "\n".join(lines)


def summary(rows: list[dict], name: str) -> str:
    builds = [len(r[name]["built"]) for r in rows]
    same = sum(r[name]["answer"] == r["exhaustive"] for r in rows)
    noise = [r[name]["within_noise"] for r in rows if "within_noise" in r[name]]
    return (f"{name}: full builds mean {sum(builds) / len(builds):.2f}, max {max(builds)}, <= 3 at "
            f"{sum(b <= 3 for b in builds)}/{len(rows)} targets; answer = exhaustive at {same}/{len(rows)}"
            + (f", within noise at {sum(noise)}/{len(noise)}" if noise else ""))


def synthetic(drift: float, seed: int = 0, noise: float = 0.0,
              plain_noise: float = 0.0) -> tuple[list[int], list[float], list[float]]:
    """tests/calibration/test_auto_search.py's figures: 59 counts (5-63) of a 64-expert top-4 model, a
    plain figure falling at a seeded rate, and a fit factor of 0.01 x exp(drift x index); then,
    seeded, each full figure times exp(N(0, noise)) and each plain one times exp(N(0, plain_noise))."""
    counts = list(range(5, 64))
    rng = random.Random(seed)
    rate = rng.uniform(0.04, 0.12)
    trend = [3.0 * math.exp(-rate * c) for c in counts]
    full = [kl * 0.01 * math.exp(drift * i + rng.gauss(0, noise)) for i, kl in enumerate(trend)]
    return counts, [kl * math.exp(rng.gauss(0, plain_noise)) for kl in trend], full


def replayed(path: Path = LAB) -> tuple[list[int], list[float], list[float]]:
    """The lab's figures as checked in (bench/auto_search_lab.json)."""
    lab = json.loads(path.read_text())
    return lab["counts"], lab["plain"], lab["full"]


def lab(args) -> tuple[list[int], list[float], list[float]]:
    """The lab original's counts, plain and full figures (made where not cached)."""
    plain = plain_figures()
    counts = sorted(plain)
    if args.counts:
        lo, hi = map(int, args.counts.split("-"))
        counts = [c for c in counts if lo <= c <= hi]
    with ProcessPoolExecutor(args.jobs) as pool:
        full = list(pool.map(full_figure, counts))
    return counts, [plain[c] for c in counts], full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="b5dd109", help="the commit whose search is compared")
    parser.add_argument("--counts", help="LO-HI: only these counts (default: every buildable count)")
    parser.add_argument("--jobs", type=int, default=1, help="full builds made at once (each a process)")
    parser.add_argument("--synthetic", type=float, metavar="DRIFT", help="instead of the lab's figures, the "
                        "test's: a fit factor drifting by exp(DRIFT) a count (seconds, no model)")
    parser.add_argument("--noise", type=float, default=0.0, help="with --synthetic: the full figures' noise (log sd)")
    parser.add_argument("--plain-noise", type=float, default=0.0, help="with --synthetic: the plain figures' noise")
    parser.add_argument("--seeds", type=int, default=1, help="with --synthetic: sweeps, one per seed (0, 1, ...)")
    parser.add_argument("--replay", nargs="?", const=str(LAB), metavar="JSON", help="the lab's figures as checked "
                        "in (bench/auto_search_lab.json), no builds")
    args = parser.parse_args()
    classes = searches(args.before)
    if args.synthetic is not None and args.seeds > 1:  # one line per seed, then all of them together
        every: list[dict] = []
        for seed in range(args.seeds):
            rows = sweep(*synthetic(args.synthetic, seed, args.noise, args.plain_noise), classes)
            every += rows
            print(f"seed {seed}: " + "; ".join(summary(rows, n) for n in classes))
        print(f"all {args.seeds} seeds: " + "; ".join(summary(every, n) for n in classes))
        return
    if args.synthetic is not None:
        counts, plain, full = synthetic(args.synthetic, 0, args.noise, args.plain_noise)
    else:
        counts, plain, full = replayed(Path(args.replay)) if args.replay else lab(args)
    rows = sweep(counts, plain, full, classes)
    OUT.mkdir(parents=True, exist_ok=True)
    name = ("sweep.json" if args.synthetic is None else
            f"sweep-synthetic-{args.synthetic:g}-{args.noise:g}-{args.plain_noise:g}.json")
    (OUT / name).write_text(json.dumps({"counts": counts, "plain": plain, "full": full, "rows": rows}, indent=1))
    print("count: plain -> full KL: " + ", ".join(f"{c}: {p:.3g} -> {kl:.3g}" for c, p, kl in zip(counts, plain, full)))
    print(report(rows, classes))


if __name__ == "__main__":
    main()
