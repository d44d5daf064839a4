"""Do the proxy's verdicts match the original's? `moe-proxy diagnose` on the fidelity lab's trained
original and on its proxies, verdict by verdict (issue #29 item 3; issue #26's "Done when" run).

For each scenario (a failing run: a learning rate the model's own dynamics cannot take, fp16 without
loss scaling, router logits scaled by an injected fault, a bf16 rollout beside the fp32 trainer at a
high learning rate), `moe-proxy diagnose` (moe_proxy.repro.diagnose.diagnose, the function behind
the command: each run a `moe-proxy repro` process) runs the baseline and >= 6 catalogue candidates
that apply to it, on 2 seeds, on the lab's trained Qwen3-MoE original (bench/fidelity.py: 4 layers,
64 experts, top-4, trained on text), on its default proxies (`calibrate --experts N` + `build
--calibration`, the lab's `seq-recon`) at 50% and 12.5% of the experts, and on a random 50% proxy
(`build --method random`, the control). It reports:

1. verdict agreement: the share of (scenario, candidate) cells whose verdict on the proxy equals
   the original's;
2. onset agreement: of the (scenario, variant, seed) runs where the original reproduced, the share
   where the proxy reproduced within max(2 steps, 20% of the original's onset) of it;
3. the diagnosis' wall time against the sum of its runs' (what one-by-one `moe-proxy repro` runs
   would take), and a check that a plain `moe-proxy repro` with a candidate's flags fails where
   diagnose's run of it did (same step, same metrics).

The original and its default proxies are the lab's (bench/fidelity.py's `trained` and
`build_family`, cached under --out, e.g. bench/out/mismatch-lab); a complete proxy found there is
reused as it is. Each diagnosis lives in OUT/qwen3/verdicts/<scenario>/<model>/ and reuses the runs
it finds with the same arguments (diagnose's own rule), so an interrupted lab resumes. Prints
markdown tables (docs/fidelity.md) and writes OUT/qwen3/verdicts/verdicts.json.

    nice -n 10 .venv/bin/python bench/verdicts.py --out bench/out/mismatch-lab   # ~45 min here, 3 at a time
    .venv/bin/python bench/verdicts.py --out bench/out/mismatch-lab --from-cache   # the tables of what finished
    .venv/bin/python bench/verdicts.py --quick --out /tmp/v   # a smoke run: tiny original, 2 steps, 2 candidates
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
log = logging.getLogger("verdicts")


def _lab():
    """bench/fidelity.py: bench/ is a folder of scripts, so the lab is imported from its folder."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import fidelity

    return fidelity


@dataclasses.dataclass(frozen=True)
class Scenario:
    what: str
    flags: tuple[str, ...]  # repro flags after the lab's RL settings (the last value of a flag wins)
    fail_on: str
    steps: int
    candidates: tuple[str, ...]  # catalogue names (moe_proxy.repro.catalogue)


# Onsets on the lab's trained qwen3 original, seed 0 (probe runs, 5 December 2026): the bf16 rollout
# diverges at step 1 (collapse at 7), the router fault at step 3, fp16 underflows at step 0, lr 1e-3
# alone collapses routing at step 10 (no divergence in 12 steps).
SCENARIOS = {
    "bf16-rollout": Scenario("rollout in bf16 (its own weight copy), trainer fp32, lr 1e-3",
                             ("--lr", "1e-3", "--rollout-precision", "bf16"), "divergence", 8,
                             ("routing-replay", "rollout-is-token", "rollout-is-sequence", "gspo", "bypass",
                              "lower-lr")),
    "router-scale": Scenario("router logits x50 from step 2 (injected: the control)",
                             ("--fault-router-scale", "2:50"), "divergence", 8,
                             ("z-loss", "aux-loss", "lower-lr", "warmup", "bf16", "grad-clip")),
    "fp16-no-scaling": Scenario("fp16 training and rollout, no loss scaling",
                                ("--precision", "fp16", "--loss-scaling", "none"), "underflow", 3,
                                ("loss-scaling", "fp32", "bf16", "lower-lr", "fp32-router", "fp32-lm-head")),
    "high-lr": Scenario("lr 1e-3 (50x the lab's), balance losses off: routing collapses by itself",
                        ("--lr", "1e-3"), "collapse", 12,
                        ("lower-lr", "warmup", "z-loss", "aux-loss", "bf16", "grad-clip")),
}
QUICK_SCENARIO = "fp16-no-scaling"
QUICK_CANDIDATES = ("loss-scaling", "lower-lr")
RANDOM = ("random", dict(stats="one-pass", method="random", reconstruct=False))  # the control, built the lab's way
ORIGINAL = "original"
WALL = "verdicts-wall.json"  # a diagnosis' wall time and its runs', when it ran from scratch


def rl_flags(rl: dict) -> list[str]:
    """The lab's RL settings (fidelity.RL) as repro flags."""
    return [token for key, value in rl.items() for token in (f"--{key.replace('_', '-')}", f"{value:g}"
                                                              if isinstance(value, float) else str(value))]


# ---------------------------------------------------------------- models

def original_and_stats(lab) -> tuple[Path, Path]:
    """The lab's qwen3 original and its one-pass statistics; both reused where they are complete
    (the original is retrained only when its training code changed: fidelity.train_original)."""
    root = lab.OUT / "qwen3"
    stats = root / "calibration"
    if (stats / "calibration.json").is_file():
        lab.train_original(root / "original", lab.MODEL)  # cached by the training code's version
        return root / "original", stats
    original, stats, _ = lab.trained("qwen3", lab.MODEL)
    return original, stats


def models_of(lab, original: Path, stats: Path, ratios: tuple[float, ...]) -> dict[str, Path]:
    """original, the default proxies at `ratios` and the random 50% control. A proxy with its
    manifest under OUT/qwen3/proxies is reused as it is (another lab process built it, perhaps
    from another version of the code: rebuilding it here would remove it under that process);
    the missing ones are built by fidelity.build_family."""
    proxies = lab.OUT / "qwen3" / "proxies"
    default = next(v for v in lab.VARIANTS if v[0] == lab.DEFAULT)
    wanted = [(default, r) for r in ratios] + [(RANDOM, 0.5)]
    models = {ORIGINAL: original}
    for (name, options), ratio in wanted:
        dst = proxies / f"{name}-{ratio:g}"
        if not (dst / "proxy-manifest.json").is_file():
            built = lab.build_family(original, stats, proxies, [(name, options)], lab.expert_total(lab.MODEL),
                                     (ratio,))
            if dst.name not in built:
                raise SystemExit(f"the build of {dst.name} refused: {lab.REFUSED.get(str(dst))}")
        models[dst.name] = dst
    return models


# ---------------------------------------------------------------- diagnoses

def diagnose_all(models: dict[str, Path], scenarios: dict[str, Scenario], root: Path, base: list[str], seeds: int,
                 parallel: int, from_cache: bool = False) -> dict:
    """scenario -> model -> {"report": report.json, "wall_s", "runs_wall_s", "runs", "reused"}. With
    `from_cache`, the finished diagnoses' reports as they are (nothing runs; the others left out)."""
    from moe_proxy.repro.catalogue import pick
    from moe_proxy.repro.diagnose import RUN_RECORD, diagnose

    out: dict = {}
    for scenario, s in scenarios.items():
        for name, path in models.items():
            where = root / scenario / name
            if from_cache and not (where / "report.json").is_file():
                log.warning("%s on %s: no finished diagnosis in %s, left out", scenario, name, where)
                continue
            before = {p: p.stat().st_mtime_ns for p in where.glob(f"runs/*/seed-*/{RUN_RECORD}")}
            started = time.time()
            if from_cache:
                report = json.loads((where / "report.json").read_text())
            else:
                report = diagnose(str(path), where, s.fail_on, [*base, *s.flags, "--steps", str(s.steps)],
                                  pick(list(s.candidates)), seeds=seeds, parallel=parallel)
            wall = time.time() - started
            records = {p: json.loads(p.read_text()) for p in where.glob(f"runs/*/seed-*/{RUN_RECORD}")}
            reused = sum(1 for p in records if before.get(p) == p.stat().st_mtime_ns)
            timing = {"wall_s": round(wall, 1), "runs": len(records), "reused": reused, "parallel": parallel,
                      "runs_wall_s": round(sum(r.get("wall_s", 0.0) for r in records.values()), 1)}
            stamp = where / WALL
            if not reused:  # a diagnosis made here from scratch: its timing, for a rerun from the cache
                stamp.write_text(json.dumps(timing))
            elif reused == len(records) and stamp.is_file():
                timing = json.loads(stamp.read_text()) | {"from_cache": True}
            out.setdefault(scenario, {})[name] = {"report": report, **timing}
            log.info("%s on %s: %.0fs (%d runs, %d reused); fixed by %s", scenario, name, wall, len(records), reused,
                     ", ".join(report["fixed_by"]) or "none")
    return out


def one_by_one(result: dict, root: Path, check_model: str, parallel: int) -> list[dict]:
    """Per scenario, one candidate's seed-0 run on `check_model` again as a plain `moe-proxy repro`
    (its diagnose-run.json's arguments, another --out), with the thread count diagnose gave it:
    does it fail at the same step, with the same key curves? The candidate: the first whose verdict
    is `reproduced`, else the first. A check made before (same arguments) is reused."""
    from moe_proxy.repro.diagnose import RUN_RECORD
    from moe_proxy.repro.metrics_io import read_metrics

    checks = []
    for scenario, by_model in result.items():
        if check_model not in by_model:
            continue
        candidates = by_model[check_model]["report"]["candidates"]
        name = next((n for n, c in candidates.items() if c["verdict"] == "reproduced"), next(iter(candidates)))
        seed = by_model[check_model]["report"]["seeds"][0]
        ran = root / scenario / check_model / "runs" / name / f"seed-{seed}"
        argv = json.loads((ran / RUN_RECORD).read_text())["argv"]
        plain = root / scenario / "one-by-one" / check_model / name / f"seed-{seed}"
        argv = [*argv[:argv.index("--out") + 1], str(plain), *argv[argv.index("--out") + 2:]]
        record = plain.parent / f"{plain.name}.check.json"
        done = json.loads(record.read_text()) if record.is_file() else {}
        if done.get("argv") != argv or not (plain / "summary.json").is_file():  # else made by an earlier run
            env = dict(os.environ)
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // parallel)))
            started = time.time()
            code = subprocess.run([sys.executable, "-m", "moe_proxy", *argv], capture_output=True, text=True, env=env,
                                  check=False).returncode
            done = {"argv": argv, "returncode": code, "wall_s": round(time.time() - started, 1)}
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(done))
        mine, theirs = (json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else {}
                        for d in (plain, ran))
        same_metrics, worst = None, None
        if mine and theirs:  # the key curves: equal bit for bit, else their largest relative difference
            a, b = read_metrics(plain / "metrics.jsonl"), read_metrics(ran / "metrics.jsonl")
            keys = ("critic/rewards/mean", "actor/pg_loss", "actor/grad_norm")
            same_metrics = a.keys() == b.keys() and all(
                json.dumps([a[s].get(k) for k in keys]) == json.dumps([b[s].get(k) for k in keys]) for s in a)
            worst = max((abs(x - y) / max(abs(x), abs(y), 1e-12) for s in a.keys() & b.keys() for k in keys
                         if isinstance(x := a[s].get(k), float) and isinstance(y := b[s].get(k), float)), default=0.0)
        step = (mine.get("first_failure") or {}).get("step") if mine.get("reproduced") else None
        diagnosed = candidates[name]["seeds"][str(seed)]
        checks.append({"scenario": scenario, "model": check_model, "candidate": name, "seed": seed,
                       "argv": ["moe-proxy", *argv], "returncode": done["returncode"], "wall_s": done["wall_s"],
                       "repro": {"reproduced": mine.get("reproduced"), "step": step,
                                 "steps_completed": mine.get("steps_completed")},
                       "diagnose": diagnosed, "same_step": step == diagnosed["step"]
                       and mine.get("steps_completed") == diagnosed["steps_completed"],
                       "same_metrics": same_metrics, "max_relative_difference": worst})
    return checks


# ---------------------------------------------------------------- agreement

def tolerance(onset: int) -> float:
    return max(2.0, 0.2 * onset)


def runs_of(report: dict) -> dict[str, dict[str, dict]]:
    """variant (baseline first) -> seed -> that run's outcome."""
    return {"baseline": report["baseline"]["seeds"], **{n: c["seeds"] for n, c in report["candidates"].items()}}


def agreement(result: dict, proxy: str) -> dict:
    """Verdict and onset agreement of `proxy` with the original, per scenario and over all."""
    rows = {}
    for scenario, by_model in result.items():
        if proxy not in by_model or ORIGINAL not in by_model:
            continue
        ref, mine = by_model[ORIGINAL]["report"], by_model[proxy]["report"]
        cells = [(n, c["verdict"], mine["candidates"][n]["verdict"]) for n, c in ref["candidates"].items()]
        onsets, same_runs, runs = [], 0, 0
        for variant, seeds in runs_of(ref).items():
            for seed, o in seeds.items():
                p = runs_of(mine)[variant][seed]
                same_runs += bool(p["reproduced"]) == bool(o["reproduced"])
                runs += 1
                if o["reproduced"]:
                    onsets.append({"variant": variant, "seed": int(seed), "original": o["step"],
                                   "proxy": p["step"] if p["reproduced"] else None,
                                   "within": bool(p["reproduced"]) and abs(p["step"] - o["step"]) <= tolerance(o["step"])})
        rows[scenario] = {"verdicts_equal": sum(a == b for _, a, b in cells), "cells": len(cells),
                          "disagree": [{"candidate": n, "original": a, "proxy": b} for n, a, b in cells if a != b],
                          "onsets_within": sum(o["within"] for o in onsets), "onset_cells": len(onsets),
                          "runs_equal": same_runs, "runs": runs, "onsets": onsets}
    total = {k: sum(r[k] for r in rows.values())
             for k in ("verdicts_equal", "cells", "onsets_within", "onset_cells", "runs_equal", "runs")}
    return {"scenarios": rows, "all": total}


# ---------------------------------------------------------------- tables

def pct(a: int, b: int) -> str:
    return f"{a}/{b} ({100 * a / b:.0f}%)" if b else "n/a"


def cell(c: dict, seeds: list[int]) -> str:
    """A candidate's verdict and its step per seed (- : ran clean)."""
    steps = "/".join(str(c["seeds"][str(s)]["step"]) if c["seeds"][str(s)]["reproduced"] else "-" for s in seeds)
    return f"{c['verdict']} ({steps})"


def baseline_cell(report: dict) -> str:
    seeds = report["baseline"]["seeds"]
    return "/".join(str(o["step"]) if o["reproduced"] else "-" for o in seeds.values())


def tables(result: dict, agree: dict[str, dict], checks: list[dict], scenarios: dict[str, Scenario],
           seeds: list[int]) -> str:
    proxies = list(agree)
    lines = ["Verdict agreement (candidate cells whose verdict equals the original's), onset agreement (of "
             "the runs where the original reproduced, the proxy within max(2 steps, 20%) of its onset) and run "
             "agreement (runs, baseline's included, that fail or run clean as the original's run of the same "
             "variant and seed):", "",
             "| proxy | " + " | ".join(f"{s}: verdicts / onsets" for s in result)
             + " | all: verdicts | all: onsets | all: runs |", "|---|" + "---|" * (len(result) + 3)]
    for p in proxies:
        a = agree[p]
        lines.append(f"| {p} | " + " | ".join(
            f"{pct(r['verdicts_equal'], r['cells'])} / {pct(r['onsets_within'], r['onset_cells'])}"
            if (r := a["scenarios"].get(s)) else "n/a" for s in result)
            + f" | **{pct(a['all']['verdicts_equal'], a['all']['cells'])}** | "
            f"**{pct(a['all']['onsets_within'], a['all']['onset_cells'])}** | {pct(a['all']['runs_equal'], a['all']['runs'])} |")
    for scenario, by_model in result.items():
        if ORIGINAL not in by_model:
            continue
        s = scenarios[scenario]
        names = list(by_model)
        lines += ["", f"{scenario}: {s.what}; `--fail-on {s.fail_on}`, {s.steps} steps, seeds "
                  f"{', '.join(map(str, seeds))}. Verdict (onset step per seed; - ran clean):", "",
                  "| variant | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
                  "| baseline | " + " | ".join(baseline_cell(by_model[n]["report"]) for n in names) + " |"]
        for candidate in by_model[ORIGINAL]["report"]["candidates"]:
            ref = by_model[ORIGINAL]["report"]["candidates"][candidate]["verdict"]
            row = []
            for n in names:
                c = by_model[n]["report"]["candidates"][candidate]
                text = cell(c, seeds)
                row.append(text if n == ORIGINAL or c["verdict"] == ref else f"**{text}**")
            lines.append(f"| {candidate} | " + " | ".join(row) + " |")
    lines += ["", "Wall time of the diagnoses (all models of a scenario) against the sum of their runs' (what "
              "one-by-one `moe-proxy repro` runs, one after another, take):", "",
              "| scenario | runs | runs at a time | diagnose wall | sum of the runs | ratio |",
              "|---|---|---|---|---|---|"]
    for scenario, by_model in result.items():
        runs = sum(m["runs"] for m in by_model.values())
        reused = sum(m["reused"] for m in by_model.values())
        wall, one = sum(m["wall_s"] for m in by_model.values()), sum(m["runs_wall_s"] for m in by_model.values())
        at_once = "/".join(sorted({str(m["parallel"]) for m in by_model.values()}))
        lines.append(f"| {scenario} | {runs}{f' ({reused} reused)' if reused else ''} | {at_once} | {wall:.0f} s | "
                     f"{one:.0f} s | {one / wall:.2f}x |" if wall else f"| {scenario} | {runs} | {at_once} | - | "
                     f"{one:.0f} s | - |")
    if checks:
        lines += ["", "A candidate's run again as a plain `moe-proxy repro` (same arguments, another --out):", "",
                  "| scenario | model | candidate, seed | diagnose: onset (steps run) | repro: onset (steps run) | "
                  "same step | key curves |", "|---|---|---|---|---|---|---|"]
        for c in checks:
            d, r = c["diagnose"], c["repro"]
            lines.append(f"| {c['scenario']} | {c['model']} | {c['candidate']}, {c['seed']} | "
                         f"{'clean' if d['step'] is None else d['step']} ({d['steps_completed']}) | "
                         f"{'clean' if r['step'] is None else r['step']} ({r['steps_completed']}) | "
                         f"{'yes' if c['same_step'] else 'no'} | " + ("equal" if c["same_metrics"] else
                         f"differ by {c['max_relative_difference']:.1g} at most (relative)") + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: tiny original, {QUICK_SCENARIO} only, "
                        "2 steps, 2 candidates, 1 seed, the 50%% proxies")
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--seeds", type=int, default=2, help="sampling seeds per run (default 2)")
    parser.add_argument("--parallel", type=int, default=2, help="repro processes at a time (default 2)")
    parser.add_argument("--steps", type=int, help="RL steps of every run (default: each scenario's)")
    parser.add_argument("--from-cache", action="store_true", help="tables from the diagnoses already finished "
                        "under --out (nothing runs but the one-by-one checks not made yet)")
    parser.add_argument("--out", type=Path, help="the lab's output (default bench/out/fidelity, quick: "
                        "bench/out/fidelity-quick): its qwen3 original and proxies are used")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    lab = _lab()
    import torch

    torch.set_num_threads(1)  # the lab's rule on a shared 2-core machine (the builds run here)
    ratios = (0.5, 0.125)
    scenarios = {name: SCENARIOS[name] for name in args.scenarios}
    if args.quick:
        lab.MODEL.update(lab.QUICK_MODEL)
        lab.TRAIN.update(lab.QUICK_BATCH)
        lab.RL.update(lab.QUICK_RL)
        ratios = (0.5,)
        args.seeds, args.steps = 1, 2
        scenarios = {QUICK_SCENARIO: dataclasses.replace(SCENARIOS[QUICK_SCENARIO], candidates=QUICK_CANDIDATES)}
        lab.OUT = lab.OUT.with_name("fidelity-quick")
    if args.steps:
        scenarios = {n: dataclasses.replace(s, steps=args.steps) for n, s in scenarios.items()}
    lab.OUT = args.out or lab.OUT
    started = time.time()
    original, stats = original_and_stats(lab)
    models = models_of(lab, original, stats, ratios)
    root = lab.OUT / "qwen3" / "verdicts"
    base = rl_flags(lab.RL)
    result = diagnose_all(models, scenarios, root, base, args.seeds, args.parallel, args.from_cache)
    check_model = f"{lab.DEFAULT}-0.5"
    checks = one_by_one(result, root, check_model, args.parallel)
    agree = {name: agreement(result, name) for name in models if name != ORIGINAL}
    seeds = next(iter(next(iter(result.values())).values()))["report"]["seeds"]
    text = tables(result, agree, checks, scenarios, seeds)
    print(text)
    (root / "verdicts.md").write_text(text)
    (root / "verdicts.json").write_text(json.dumps({
        "scenarios": {n: dataclasses.asdict(s) for n, s in scenarios.items()}, "rl": lab.RL, "rl_flags": base,
        "models": {n: str(p) for n, p in models.items()}, "seeds": seeds, "agreement": agree,
        "diagnoses": {s: {m: {k: v for k, v in d.items() if k != "report"} | {
            "verdicts": {n: c["verdict"] for n, c in d["report"]["candidates"].items()},
            "baseline": d["report"]["baseline"]["seeds"],
            "seeds": {n: c["seeds"] for n, c in d["report"]["candidates"].items()},
            "report": str(root / s / m / "report.json")} for m, d in by_model.items()} for s, by_model in result.items()},
        "one_by_one": checks, "wall_s": round(time.time() - started, 1)}, indent=2))
    log.info("done in %.0fs; %s", time.time() - started, root / "verdicts.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
