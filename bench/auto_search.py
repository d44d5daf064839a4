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

    .venv/bin/python bench/auto_search.py [--before 6b841d8] [--counts 5-35] [--jobs 2]
    .venv/bin/python bench/auto_search.py --synthetic 0.03    # the unit test's drifting figures instead

Prints a table (target, exhaustive answer, each search's answer and counts built, in order) and
the mean and largest number of full builds, and writes bench/out/auto-search/sweep.json.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import types
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "auto-search"
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
            answer = cls(list(counts), list(plain), x).run(lambda i: built.append(i) or full[i])
            row[name] = {"answer": None if answer is None else counts[answer], "built": [counts[i] for i in built]}
        rows.append(row)
    return rows


def report(rows: list[dict], classes: dict[str, type]) -> str:
    names = list(classes)
    lines = ["| max_kl | exhaustive | " + " | ".join(f"{n}: chosen | {n}: built (count order) | {n}: builds"
                                                      for n in names) + " |",
             "|---|---|" + "---|---|---|" * len(names)]
    for r in rows:
        lines.append(f"| {r['max_kl']:.4g} | {r['exhaustive']} | " + " | ".join(
            f"{r[n]['answer']} | {', '.join(map(str, r[n]['built']))} | {len(r[n]['built'])}" for n in names) + " |")
    for n in names:
        builds = [len(r[n]["built"]) for r in rows]
        same = sum(r[n]["answer"] == r["exhaustive"] for r in rows)
        lines.append(f"{n}: full builds mean {sum(builds) / len(builds):.2f}, max {max(builds)} over {len(rows)} "
                     f"targets; answer = exhaustive at {same}/{len(rows)}")
    return "\n".join(lines)


def synthetic(drift: float, seed: int = 0) -> tuple[list[int], list[float], list[float]]:
    """tests/calibration/test_auto_search.py's figures: 59 counts (5-63) of a 64-expert top-4 model, a
    plain figure falling at a seeded rate, and a fit factor of 0.01 x exp(drift x index)."""
    counts = list(range(5, 64))
    rate = __import__("random").Random(seed).uniform(0.04, 0.12)
    plain = [3.0 * math.exp(-rate * c) for c in counts]
    return counts, plain, [kl * 0.01 * math.exp(drift * i) for i, kl in enumerate(plain)]


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
    parser.add_argument("--before", default="6b841d8", help="the commit whose search is compared")
    parser.add_argument("--counts", help="LO-HI: only these counts (default: every buildable count)")
    parser.add_argument("--jobs", type=int, default=1, help="full builds made at once (each a process)")
    parser.add_argument("--synthetic", type=float, metavar="DRIFT", help="instead of the lab's figures, the "
                        "test's: a fit factor drifting by exp(DRIFT) a count (seconds, no model)")
    args = parser.parse_args()
    counts, plain, full = synthetic(args.synthetic) if args.synthetic is not None else lab(args)
    classes = searches(args.before)
    rows = sweep(counts, plain, full, classes)
    OUT.mkdir(parents=True, exist_ok=True)
    name = "sweep.json" if args.synthetic is None else f"sweep-synthetic-{args.synthetic:g}.json"
    (OUT / name).write_text(json.dumps({"counts": counts, "plain": plain, "full": full, "rows": rows}, indent=1))
    print("count: plain -> full KL: " + ", ".join(f"{c}: {p:.3g} -> {kl:.3g}" for c, p, kl in zip(counts, plain, full)))
    print(report(rows, classes))


if __name__ == "__main__":
    main()
