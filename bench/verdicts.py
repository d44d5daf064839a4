"""Do the proxy's verdicts match the original's? `moe-proxy diagnose` on the fidelity lab's trained
original and on its proxies, verdict by verdict (issue #29 item 3; issue #26's "Done when" run).

For each scenario (a failing run: a learning rate the model's own dynamics cannot take, with and
without the KL penalty, fp16 without loss scaling, fp16 on an original with a super expert planted
past its range, router logits scaled by an injected fault, a bf16 rollout beside the fp32 trainer
at a high learning rate, rollouts two steps stale as in asynchronous RL), `moe-proxy diagnose`
(moe_proxy.investigate.diagnose.diagnose, the function behind
the command: each run a `moe-proxy repro` process) runs the baseline and 4-7 catalogue candidates
that apply to it, on 2 seeds (4 for the routing collapses: Scenario.seeds), on the lab's trained Qwen3-MoE original (bench/fidelity.py: 4 layers,
64 experts, top-4, trained on text), on its default proxies (`calibrate --experts N` + `build
--calibration`, the lab's `seq-recon`) at 50%, 25% and 12.5% of the experts, and on random 50% proxies
(the control: `build --method random` draws with their own seeds, pinning the super experts as the
default does or not: random_draws); the super-expert scenario runs on the planted original
(fidelity.plant_super_expert) and its own proxies. The original is also diagnosed again on the
next seeds (`original-other-seeds`): what it says of itself is the floor of every figure below. It
reports:

1. verdict agreement: the share of (scenario, candidate) cells whose verdict on the proxy equals
   the original's;
2. onset agreement: of the (scenario, variant, seed) runs where the original reproduced, the share
   where the proxy reproduced within max(2 steps, 20% of the original's onset) of it; run
   agreement (the runs that fail or run clean alike) and the failure-rate gap (per variant, how
   much the share of seeds that fail differs: how often, not whether, a failure comes);
3. with --bisect, the bisection: 8 checkpoints of the trained original whose super expert doubles
   from one to the next (crossing fp16's range part-way), each run as it is (the truth), then
   `moe-proxy bisect` with the original itself (`--keep-ratio 1`: every expert kept, checked equal
   to the checkpoint), the default 50% build and a random 50% build: the same first bad checkpoint?
4. the diagnosis' wall time against the sum of its runs' (what one-by-one `moe-proxy repro` runs
   would take), and a check that a plain `moe-proxy repro` with a candidate's flags fails where
   diagnose's run of it did (same step, same metrics).

The original and its default proxies are the lab's (bench/fidelity.py's `trained` and
`build_family`, cached under --out, e.g. bench/out/mismatch-lab); a complete proxy found there is
reused as it is. Each diagnosis lives in OUT/qwen3/verdicts/<scenario>/<model>/ and reuses the runs
it finds with the same arguments (diagnose's own rule), so an interrupted lab resumes. Prints
markdown tables (docs/fidelity.md) and writes OUT/qwen3/verdicts/verdicts.json.

    nice -n 10 .venv/bin/python bench/verdicts.py --out bench/out/mismatch-lab --bisect   # hours on 2 shared cores
    nice -n 10 .venv/bin/python bench/verdicts.py --out bench/out/mismatch-lab --scenarios kl-drift --models original
    .venv/bin/python bench/verdicts.py --out bench/out/mismatch-lab --from-cache --bisect   # the tables of what finished
    .venv/bin/python bench/verdicts.py --out bench/out/mismatch-lab --ratios 0.125 --random-draws 0 \
        --unpinned-draws 0 --builds seq-recon-top2-0.125 --models original seq-recon-top2-0.125   # another build
    .venv/bin/python bench/verdicts.py --quick --bisect --out /tmp/v   # a smoke run: tiny planted original
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
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


TRAINED, PLANTED = "trained", "super-L1"  # the lab's trained original; the same with a super expert planted


@dataclasses.dataclass(frozen=True)
class Scenario:
    what: str
    flags: tuple[str, ...]  # repro flags after the lab's RL settings (the last value of a flag wins)
    fail_on: str
    steps: int
    candidates: tuple[str, ...]  # catalogue names (moe_proxy.investigate.catalogue), or NAME=--flag value (custom)
    original: str = TRAINED  # which lab original it runs on (and its proxies)
    seeds: int | None = None  # sampling seeds of its runs (None: --seeds)


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
    # Also the aux loss on against off (issue 29 item 1): the baseline runs without it, `aux-loss`
    # turns it on at 1e-3 (the catalogue's) and `aux-1e-2` at 1e-2 (probe, seeds 0 and 1 on the
    # original: 1e-2 and 1e-1 keep routing from collapsing in 12 steps). 4 seeds: the collapse is
    # chaotic (probe, 20 steps, seeds 0-3: the original collapses on seed 0 only, the 25% proxy on
    # seed 2 only, the 12.5% proxy on seeds 1 and 2 within 12 steps), so 2 seeds left the 25% and
    # 12.5% proxies' baselines clean and every verdict of theirs inconclusive.
    "high-lr": Scenario("lr 1e-3 (50x the lab's), balance losses off: routing collapses by itself",
                        ("--lr", "1e-3"), "collapse", 12,
                        ("lower-lr", "warmup", "z-loss", "aux-loss", "bf16", "grad-clip",
                         "aux-1e-2=--router-aux-coef 1e-2"), seeds=4),
    # Scenarios whose candidates split on the original (issue 29 item 1). Probe runs on the trained
    # original, 5 December 2026: lr 1e-3 without the KL penalty drifts past the KL limit at step 7
    # (seed 0) and 0 (seed 1), lr 3e-4 / 6e-4 do not in 12 steps (KL 0.1-0.6, not two steps in a
    # row), router logits do not grow at lr 1e-3 (max 5.1 -> 4.5 in 12 steps: nothing for z-loss to
    # cure); the planted super expert overflows fp16 at step 0, bf16 and fp32 do not.
    "super-fp16": Scenario("a super expert planted past fp16's range (MoE layer 1, its natural super expert "
                           "x1.4e5: max |output| 1.7e6 on task tokens), fp16 with dynamic loss scaling",
                           ("--precision", "fp16"), "overflow", 3,
                           ("bf16", "fp32", "loss-scaling", "lower-lr"), PLANTED),
    # A rollout/training mismatch that grows, then a collapse: asynchronous RL's stale rollouts. Probe
    # runs on the trained original, 20 steps, seeds 0-3 (5 December 2026): two steps stale at lr
    # 1e-3, the mismatch KL passes 0.01 at step 1 and routing collapses at steps 4, 5, 10 and 6; in
    # sync at lr 1e-3 it collapses on seed 0 only (step 10). On seeds 4-7 (original-other-seeds) it is
    # the other way round: 2 of 4 stale, 4 of 4 in sync. The collapse is lr 1e-3's, not the
    # staleness's: stale-drift is the scenario where staleness is the cause.
    "stale-rollout": Scenario("rollouts two steps stale (asynchronous RL, --rollout-staleness 2) at lr 1e-3: the "
                              "mismatch grows from step 1, routing collapses (as often in sync, over 8 seeds)",
                              ("--lr", "1e-3", "--rollout-staleness", "2"), "collapse", 12,
                              ("sync=--rollout-staleness 0", "rollout-is-token", "bypass", "routing-replay", "lower-lr",
                               "aux-1e-2=--router-aux-coef 1e-2"), seeds=4),  # 4: as high-lr, a collapse
    # The same mismatch with the staleness the cause (stale-rollout's collapse is not: over seeds 0-7
    # lr 1e-3 collapses routing as often in sync, 5 of 8, as two steps stale, 6 of 8). Probe on the
    # trained original, 16 steps, seeds 0-7 (5 December 2026): two steps stale at lr 3e-4 the policy
    # drifts past the KL limit on 8 of 8 seeds (steps 3-14), in sync on 2 (steps 7 and 14), at lr
    # 3e-5 on none.
    "stale-drift": Scenario("rollouts two steps stale at lr 3e-4: the mismatch grows and the policy drifts from "
                            "the reference (in sync it mostly does not)",
                            ("--lr", "3e-4", "--rollout-staleness", "2"), "divergence", 12,
                            ("sync=--rollout-staleness 0", "rollout-is-token", "bypass", "routing-replay", "lower-lr",
                             "kl-penalty=--kl-coef 0.05"), seeds=4),
    "kl-drift": Scenario("lr 1e-3 without the KL penalty: the policy drifts from the reference",
                         ("--lr", "1e-3", "--kl-coef", "0"), "divergence", 10,
                         ("lower-lr", "warmup", "kl-penalty=--kl-coef 0.05", "z-loss")),
}
# --quick: each scenario with 2 of its candidates (by name), all on the tiny planted original: a
# smoke run of every scenario issue 29 added (a precision fix, the async mismatch, the aux loss on
# or off, the drift without the KL penalty).
QUICK_SCENARIOS = {"super-fp16": ("bf16", "lower-lr"), "stale-rollout": ("sync", "lower-lr"),
                   "stale-drift": ("sync", "rollout-is-token"), "high-lr": ("aux-loss", "aux-1e-2"),
                   "kl-drift": ("lower-lr", "kl-penalty")}
RANDOM = ("random", dict(stats="one-pass", method="random", reconstruct=False))  # the control, built the lab's way


def random_draws(count: int, pinned: bool = True) -> list[tuple[str, dict]]:
    """The control's draws: `build --method random --seed N` for N < count, named `random-0.5` (seed
    0, the lab's first control) and `random-sN-0.5`. With the lab's statistics the build pins the
    super experts the rule finds (the planted one among them) whatever it draws; without `pinned`
    (`--no-keep-super`, named `random-nosuper-...`) nothing is pinned, so a draw keeps the planted
    expert with probability 1/2. The control is the draws' mean."""
    name, options = RANDOM
    name, options = (name, options) if pinned else (f"{name}-nosuper", options | dict(keep_super=False))
    return [(name if n == 0 else f"{name}-s{n}", options | dict(seed=n)) for n in range(count)]


def mean_row(draw: str) -> str:
    """The pooled row of a kind of random draw: every draw's cells together."""
    return re.sub(r"-s\d+-0\.5$", "-0.5", draw) + ", mean of draws"


ORIGINAL = "original"
# The original diagnosed again on other seeds (a 2-seed scenario's seeds 2 and 3 paired with 0 and 1):
# how often the original agrees with itself, the floor under every proxy's figures (as
# original-reseeded is under tracking). Its own prompts and samples: a user's second diagnosis.
OTHER_SEEDS = "original-other-seeds"
BISECT_BUILDS_ORIGINAL = ("--keep-ratio", "1")  # every expert kept, data-free: the checkpoint itself (checked)
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


def planted_original(lab, trained: Path, stats: Path) -> tuple[Path, Path]:
    """The trained original with its natural super expert of MoE layer 1 planted past fp16's range
    (fidelity.plant_super_expert), and its one-pass statistics; both reused where complete (the
    plant's own key holds the lab's code version: re-planting on every code change would remove
    the checkpoint under the diagnoses made from it)."""
    root = lab.OUT / "qwen3" / PLANTED
    planted, planted_stats = root / "original", root / "calibration"
    if not (planted / "planted.json").is_file():
        lab.plant_super_expert(trained, stats, planted, layer=1)
    if not (planted_stats / "calibration.json").is_file():
        lab.calibrate(str(planted), str(planted_stats), token_ids=lab.calibration_ids())
    return planted, planted_stats


def models_of(lab, original: Path, stats: Path, ratios: tuple[float, ...], draws: int = 1,
              unpinned: int = 0, build: bool = True, extra: tuple[str, ...] = ()) -> dict[str, Path]:
    """original (twice: OTHER_SEEDS), the default proxies at `ratios` and `draws` random 50% controls
    (and `unpinned` ones that pin no super expert: random_draws), and the `extra` builds (NAME-RATIO, NAME one of
    fidelity.VARIANTS, MERGE_VARIANTS or TOPK_VARIANTS, e.g. seq-0.125). A proxy with its manifest under
    OUT/qwen3/proxies is reused as it is (another lab process built it, perhaps from another
    version of the code: rebuilding it here would remove it under that process); the missing ones
    are built by fidelity.build_family, or left out without `build`."""
    proxies = original.parent / "proxies"
    default = next(v for v in lab.VARIANTS if v[0] == lab.DEFAULT)
    wanted = [(default, r) for r in ratios] + [(draw, 0.5) for draw in random_draws(draws)
                                               + random_draws(unpinned, pinned=False)]
    known = dict(lab.VARIANTS + lab.MERGE_VARIANTS + lab.TOPK_VARIANTS)
    for spec in extra:
        name, _, ratio = spec.rpartition("-")
        if name not in known:
            raise SystemExit(f"{spec}: not a lab build (NAME-RATIO, NAME one of {', '.join(known)})")
        wanted.append(((name, known[name]), float(ratio)))
    models = {ORIGINAL: original, OTHER_SEEDS: original}
    for (name, options), ratio in wanted:
        dst = proxies / f"{name}-{ratio:g}"
        if not (dst / "proxy-manifest.json").is_file():
            if not build:
                continue
            built = lab.build_family(original, stats, proxies, [(name, options)], lab.expert_total(lab.MODEL),
                                     (ratio,))
            if dst.name not in built:
                raise SystemExit(f"the build of {dst.name} refused: {lab.REFUSED.get(str(dst))}")
        models[dst.name] = dst
    return models



def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--ratios and --builds: the models models_of makes, for this lab and bench/learning.py."""
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.25, 0.125], metavar="R",
                        help="the default proxies' keep ratios (default 0.5 0.25 0.125)")
    parser.add_argument("--builds", nargs="*", default=[], metavar="NAME-RATIO", help="other builds besides the "
                        "default's, built where missing (fidelity.VARIANTS, MERGE_VARIANTS or TOPK_VARIANTS: e.g. "
                        "seq-0.125 seq-recon-top2-0.125)")


# ---------------------------------------------------------------- diagnoses

def candidate_name(candidate: str) -> str:
    """A Scenario candidate's name: the catalogue name, or a custom one's NAME before `=`."""
    return candidate.split("=")[0]


def fixes(names: tuple[str, ...]) -> list:
    """Catalogue entries by name; NAME=--flag value,... a custom candidate (as `diagnose --candidate`)."""
    from moe_proxy.investigate.catalogue import custom, pick

    return [custom(n) if "=" in n else pick([n])[0] for n in names]


def diagnose_all(models: dict[str, dict[str, Path]], scenarios: dict[str, Scenario], root: Path, base: list[str], seeds: int,
                 parallel: int, from_cache: bool = False) -> dict:
    """scenario -> model -> {"report": report.json, "wall_s", "runs_wall_s", "runs", "reused"}; `models`:
    original -> model name -> checkpoint. With `from_cache`, the finished diagnoses' reports as they
    are (nothing runs; the others left out)."""
    from moe_proxy.investigate.diagnose import RUN_RECORD, diagnose

    out: dict = {}
    for scenario, s in scenarios.items():
        for name, path in models[s.original].items():
            where = root / scenario / name
            if from_cache and not (where / "report.json").is_file():
                log.warning("%s on %s: no finished diagnosis in %s, left out", scenario, name, where)
                continue
            before = {p: p.stat().st_mtime_ns for p in where.glob(f"runs/*/seed-*/{RUN_RECORD}")}
            started = time.time()
            count = s.seeds or seeds
            shift = ["--seed", str(count)] if name == OTHER_SEEDS else []  # seeds count..2 count - 1
            if from_cache:
                report = json.loads((where / "report.json").read_text())
            else:
                # every cell, also where a proxy's baseline does not reproduce (diagnose stops there by default)
                report = diagnose(str(path), where, s.fail_on, [*base, *s.flags, "--steps", str(s.steps), *shift],
                                  fixes(s.candidates), seeds=count, parallel=parallel, baseline_first=False,
                                  all_seeds=True)
            if shift:  # paired with the original's seeds 0..count-1, seed by seed
                report = reseeded(report, -count)
            wall = time.time() - started
            names = [candidate_name(c) for c in s.candidates]  # a diagnosis made with more candidates: these only
            report = report | {"candidates": {n: c for n, c in report["candidates"].items() if n in names}}
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


def reseeded(report: dict, by: int) -> dict:
    """A diagnosis' report with its seeds renumbered by `by` (a run's outcome unchanged)."""
    def renumber(seeds: dict) -> dict:
        return {str(int(s) + by): o for s, o in seeds.items()}

    return report | {"seeds": [s + by for s in report["seeds"]],
                     "baseline": report["baseline"] | {"seeds": renumber(report["baseline"]["seeds"])},
                     "candidates": {n: c | {"seeds": renumber(c["seeds"])} for n, c in report["candidates"].items()}}


def one_by_one(result: dict, root: Path, check_model: str, parallel: int, run: bool = True) -> list[dict]:
    """Per scenario, one candidate's seed-0 run on `check_model` again as a plain `moe-proxy repro`
    (its diagnose-run.json's arguments, another --out), with the thread count diagnose gave it:
    does it fail at the same step, with the same key curves? The candidate: the first whose verdict
    is `reproduced`, else the first. A check made before (same arguments) is reused; without `run`,
    the scenarios without one are left out."""
    from moe_proxy.investigate.diagnose import RUN_RECORD
    from moe_proxy.metrics.readers import read_metrics

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
            if not run:
                continue
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


# ---------------------------------------------------------------- bisection

GROWTH_STEPS = tuple(range(1, 9))  # the run's checkpoints; the planted channel doubles from one to the next
QUICK_GROWTH = (1, 4, 8)
QUICK_BUILDS = {ORIGINAL: BISECT_BUILDS_ORIGINAL}
BISECT_REPRO = ("--precision", "fp16", "--steps", "2")  # each probe: fp16 with dynamic loss scaling
BISECT_BUILDS = {  # how each bisection builds a probe's model (moe-proxy bisect's build options)
    ORIGINAL: BISECT_BUILDS_ORIGINAL,
    # + --dataset: the default calibrated build (sequential statistics, reconstruction), on fewer
    # tokens than the lab's 64 x 128: a reconstructing build of this model took 5-20 min on the
    # shared 2-core machine with 8192 tokens, and the bisection makes one per probe
    "seq-recon-0.5": ("--experts", "32", "--samples", "16", "--seq-len", "64"),
    "random-0.5": ("--experts", "32", "--method", "random"),
}


def growing_checkpoints(trained: Path, info: dict, dst: Path, steps: tuple[int, ...] = GROWTH_STEPS) -> Path:
    """A run's checkpoints dst/global_step_N of the trained original whose super expert grows: in
    checkpoint N the planted channel (planted.json: layer, expert, channel, factor) is scaled by
    factor * 2**(N - last), so the last is the planted original and the channel's largest output on
    task tokens halves from each checkpoint to the one before (1.7e6 in the last): it crosses
    fp16's range (65504) part-way. Written once (the stamp holds the plant)."""
    from safetensors.torch import load_file, save_file

    stamp = dst / "growth.json"
    key = {k: info[k] for k in ("layer", "expert", "channel", "factor")} | {"steps": list(steps)}
    if stamp.is_file() and json.loads(stamp.read_text()) == key:
        return dst
    name = f"model.layers.{info['layer']}.mlp.experts.{info['expert']}.down_proj.weight"
    for step in steps:
        where = dst / f"global_step_{step}"
        where.mkdir(parents=True, exist_ok=True)
        for f in ("config.json", "generation_config.json"):
            (where / f).write_bytes((trained / f).read_bytes())
        tensors = load_file(trained / "model.safetensors")
        tensors[name][info["channel"]] *= info["factor"] * 2.0 ** (step - steps[-1])
        save_file(tensors, where / "model.safetensors", metadata={"format": "pt"})
    stamp.write_text(json.dumps(key))
    return dst


def bisections(prefix: Path, root: Path, base: list[str], dataset: Path, builds: dict = BISECT_BUILDS,
               run: bool = True) -> dict:
    """Each checkpoint's original run once (the truth: which overflow), then `moe-proxy bisect` with
    each of `builds`; a rerun reuses bisect's probes (its own rule) and the direct runs. Without
    `run`, the bisections that did not finish are left out."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    truth = {}
    for ckpt in sorted(prefix.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1])):
        direct = root / "direct" / ckpt.name
        if not (direct / "summary.json").is_file():
            subprocess.run([sys.executable, "-m", "moe_proxy", "repro", str(ckpt), "--out", str(direct), *base,
                            *BISECT_REPRO, "--fail-on", "overflow", "--no-progress"], env=env, check=True,
                           capture_output=True)
        summary = json.loads((direct / "summary.json").read_text())
        truth[int(ckpt.name.rsplit("_", 1)[1])] = (summary.get("first_failure") or {}).get("step") \
            if summary.get("reproduced") else None
    out = {"checkpoints": sorted(truth), "direct": truth,
           "first_bad_direct": next((s for s, onset in sorted(truth.items()) if onset is not None), None)}
    for name, flags in builds.items():
        where = root / name
        if not run and not (where / "report.json").is_file():
            continue
        data = ["--dataset", str(dataset)] if name.startswith(lab_default()) else []
        argv = ["bisect", str(prefix), "--out", str(where), "--fail-on", "overflow", *flags, *data, *base,
                *BISECT_REPRO]
        stamp = where / "bisect-wall.json"  # how the bisection went when it ran (a rerun reuses its probes)
        if run:
            started = time.time()
            ran = subprocess.run([sys.executable, "-m", "moe_proxy", *argv], env=env, capture_output=True, text=True)
            stamp.write_text(json.dumps({"returncode": ran.returncode, "wall_s": round(time.time() - started),
                                         "error": ran.stderr.strip().splitlines()[-1:] if ran.returncode else []}))
        report = json.loads((where / "report.json").read_text()) if (where / "report.json").is_file() else {}
        made = json.loads(stamp.read_text()) if stamp.is_file() else {"returncode": 0, "wall_s": None, "error": []}
        out[name] = {"argv": ["moe-proxy", *argv], "build": [*flags, *data], **made,
                     "first_bad": (report.get("first_bad") or {}).get("step"), "probes": report.get("probes"),
                     "monotone": report.get("monotone"), "boundary": report.get("boundary")}
        log.info("bisect on %s: first bad %s (%s)", name, out[name]["first_bad"], out[name]["boundary"])
    if ORIGINAL in builds:
        out["identity"] = keep_all_is_identity(root / ORIGINAL, prefix)
    return out


def lab_default() -> str:
    return _lab().DEFAULT


def keep_all_is_identity(bisect_out: Path, prefix: Path) -> dict:
    """Is a probe's --keep-ratio 1 proxy the checkpoint itself? The largest difference of any tensor
    (by the checkpoint's names), and the names missing from the proxy."""
    from safetensors.torch import load_file

    worst, missing, probes = 0.0, set(), sorted((bisect_out / "probes").glob("step-*/proxy/model.safetensors"))
    for built in probes:
        ckpt = load_file(prefix / f"global_step_{built.parent.parent.name.split('-')[1]}" / "model.safetensors")
        mine = load_file(built)
        missing |= set(ckpt) - set(mine)
        worst = max([worst, *((mine[n].float() - t.float()).abs().max().item() for n, t in ckpt.items()
                              if n in mine and mine[n].shape == t.shape)])
    return {"probes_checked": len(probes), "max_abs_difference": worst, "names_missing": sorted(missing)[:5]}


# ---------------------------------------------------------------- agreement

def tolerance(onset: int) -> float:
    return max(2.0, 0.2 * onset)


def runs_of(report: dict) -> dict[str, dict[str, dict]]:
    """variant (baseline first) -> seed -> that run's outcome."""
    return {"baseline": report["baseline"]["seeds"], **{n: c["seeds"] for n, c in report["candidates"].items()}}


# counts summed over scenarios and pooled draws; rate_gap / variants: the mean failure-rate gap
AGREEMENT_KEYS = ("verdicts_equal", "cells", "onsets_within", "onset_cells", "runs_equal", "runs", "rate_gap",
                  "variants")


def agreement(result: dict, proxy: str) -> dict:
    """Verdict and onset agreement of `proxy` with the original, per scenario and over all; also the
    failure-rate gap: per variant, |share of seeds failing on the proxy - on the original|, which
    "reproduced on some seed" cannot show (a cause that makes a failure likelier)."""
    rows = {}
    for scenario, by_model in result.items():
        if proxy not in by_model or ORIGINAL not in by_model:
            continue
        ref, mine = by_model[ORIGINAL]["report"], by_model[proxy]["report"]
        # the candidates both diagnosed (a diagnosis cut short for time may lack some)
        cells = [(n, c["verdict"], mine["candidates"][n]["verdict"]) for n, c in ref["candidates"].items()
                 if n in mine["candidates"]]
        onsets, same_runs, runs, rate_gap, variants = [], 0, 0, 0.0, 0
        proxy_runs = runs_of(mine)
        for variant, seeds in runs_of(ref).items():
            # (seed, original's run, proxy's run); a diagnosis cut short for time may lack some
            paired = [(seed, o, proxy_runs[variant][seed]) for seed, o in seeds.items()
                      if seed in proxy_runs.get(variant, {})]
            if not paired:
                continue
            # how often it fails: the share of seeds, whichever seeds they are
            rate_gap += abs(sum(bool(p["reproduced"]) - bool(o["reproduced"]) for _, o, p in paired)) / len(paired)
            variants += 1
            for seed, o, p in paired:
                same_runs += bool(p["reproduced"]) == bool(o["reproduced"])
                runs += 1
                if o["reproduced"]:
                    onsets.append({"variant": variant, "seed": int(seed), "original": o["step"],
                                   "proxy": p["step"] if p["reproduced"] else None,
                                   "within": bool(p["reproduced"]) and abs(p["step"] - o["step"]) <= tolerance(o["step"])})
        rows[scenario] = {"verdicts_equal": sum(a == b for _, a, b in cells), "cells": len(cells),
                          "disagree": [{"candidate": n, "original": a, "proxy": b} for n, a, b in cells if a != b],
                          "onsets_within": sum(o["within"] for o in onsets), "onset_cells": len(onsets),
                          "runs_equal": same_runs, "runs": runs, "rate_gap": rate_gap, "variants": variants,
                          "onsets": onsets}
    split = [n for n, by_model in result.items() if n in rows and splits(by_model[ORIGINAL]["report"])]
    return {"scenarios": rows, "all": {k: sum(r[k] for r in rows.values()) for k in AGREEMENT_KEYS},
            "splitting": {k: sum(rows[n][k] for n in split) for k in AGREEMENT_KEYS} | {"scenarios": split}}


def pooled(agrees: list[dict]) -> dict:
    """Several proxies' agreement as one, their cells together: the random control over its draws."""
    scenarios: dict = {}
    for a in agrees:
        for name, r in a["scenarios"].items():
            into = scenarios.setdefault(name, dict.fromkeys(AGREEMENT_KEYS, 0) | {"disagree": [], "onsets": []})
            for k in AGREEMENT_KEYS:
                into[k] += r[k]
            into["disagree"] += r["disagree"]
            into["onsets"] += r["onsets"]
    return {"scenarios": scenarios, "all": {k: sum(a["all"][k] for a in agrees) for k in AGREEMENT_KEYS},
            "splitting": {k: sum(a["splitting"][k] for a in agrees) for k in AGREEMENT_KEYS}
            | {"scenarios": agrees[0]["splitting"]["scenarios"]}}


def keeps_planted(models: dict[str, Path], info: dict) -> dict[str, bool]:
    """Per proxy of the planted original: does its build keep the planted super expert?"""
    kept = {}
    for name, path in models.items():
        if name not in (ORIGINAL, OTHER_SEEDS):
            layers = json.loads((path / "proxy-manifest.json").read_text())["layers"].values()
            kept[name] = any(v["layer"] == info["layer"] and info["expert"] in v["kept"] for v in layers)
    return kept


def splits(report: dict) -> bool:
    """Do the original's verdicts split the candidates (some fix, some do not)? Only there can a
    proxy's verdicts differ from a control's that says the same of every candidate."""
    return {"fixed", "reproduced"} <= {c["verdict"] for c in report["candidates"].values()}


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


def tables(result: dict, agree: dict[str, dict], checks: list[dict], scenarios: dict[str, Scenario]) -> str:
    proxies = list(agree)
    lines = ["Verdict agreement (candidate cells whose verdict equals the original's), onset agreement (of "
             "the runs where the original reproduced, the proxy within max(2 steps, 20%) of its onset) and run "
             "agreement (runs, baseline's included, that fail or run clean as the original's run of the same "
             "variant and seed), and the failure-rate gap (per variant, |share of seeds failing on the proxy - "
             f"on the original|, their mean: lower is closer). {OTHER_SEEDS} is the original diagnosed again on the "
             "next seeds (seeds n..2n-1 paired with 0..n-1): how far the original agrees with itself, the floor of "
             "these figures:", "",
             "| proxy | " + " | ".join(f"{s}: verdicts / onsets" for s in result)
             + " | all: verdicts | all: onsets | all: runs | all: failure-rate gap | splitting scenarios: verdicts |",
             "|---|" + "---|" * (len(result) + 5)]
    for p in proxies:
        a = agree[p]
        lines.append(f"| {p} | " + " | ".join(
            f"{pct(r['verdicts_equal'], r['cells'])} / {pct(r['onsets_within'], r['onset_cells'])}"
            if (r := a["scenarios"].get(s)) else "n/a" for s in result)
            + f" | **{pct(a['all']['verdicts_equal'], a['all']['cells'])}** | "
            f"**{pct(a['all']['onsets_within'], a['all']['onset_cells'])}** | {pct(a['all']['runs_equal'], a['all']['runs'])} | "
            f"{a['all']['rate_gap'] / max(1, a['all']['variants']):.3f} | "
            f"**{pct(a['splitting']['verdicts_equal'], a['splitting']['cells'])}** |")
    split = next(iter(agree.values()))["splitting"]["scenarios"] if agree else []
    lines += ["", f"Splitting scenarios (on the original some candidates fix, some do not): {', '.join(split) or 'none'}."]
    for scenario, by_model in result.items():
        if ORIGINAL not in by_model:
            continue
        s = scenarios[scenario]
        names = list(by_model)
        lines += ["", f"{scenario}: {s.what}; `--fail-on {s.fail_on}`, {s.steps} steps, seeds "
                  f"{', '.join(map(str, by_model[ORIGINAL]['report']['seeds']))}. Verdict (onset step per seed; "
                  "- ran clean):", "",
                  "| variant | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
                  "| baseline | " + " | ".join(baseline_cell(by_model[n]["report"]) for n in names) + " |"]
        for candidate in by_model[ORIGINAL]["report"]["candidates"]:
            ref = by_model[ORIGINAL]["report"]["candidates"][candidate]["verdict"]
            row = []
            for n in names:
                c = by_model[n]["report"]["candidates"][candidate]
                text = cell(c, by_model[n]["report"]["seeds"])
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


def bisect_table(b: dict, info: dict) -> str:
    """The bisection's markdown: each checkpoint's own run, then each model's bisection."""
    truth = " ".join(f"{s}: {'clean' if o is None else f'overflow at {o}'};" for s, o in b["direct"].items())
    lines = ["", f"Bisection: checkpoints global_step_{b['checkpoints'][0]}..{b['checkpoints'][-1]} of the trained "
             f"original, the super expert of MoE layer {info['layer']} (expert {info['expert']}, channel "
             f"{info['channel']}) doubling from each to the next (the last: x{info['factor']:g}, the planted "
             f"original). Each checkpoint run as it is (fp16, 2 steps): {truth} first bad: "
             f"{b['first_bad_direct']}.", "",
             "| bisected on | build per probe | first bad checkpoint | same as the original's | probes (step: onset) "
             "| wall |", "|---|---|---|---|---|---|"]
    for name, r in b.items():
        if not isinstance(r, dict) or "argv" not in r:
            continue
        probes = ", ".join(f"{p['step']}: {'clean' if p['onset'] is None else p['onset']}" for p in r["probes"] or [])
        wall = "-" if r["wall_s"] is None else f"{r['wall_s']} s"
        lines.append(f"| {name} | `{' '.join(r['build'])}` | "
                     f"{r['first_bad'] if r['returncode'] == 0 else 'error: ' + ' '.join(r['error'])} | "
                     f"{'yes' if r['first_bad'] == b['first_bad_direct'] else 'no'} | {probes} | {wall} |")
    if i := b.get("identity"):
        lines += ["", f"The `--keep-ratio 1` probes are the checkpoints themselves: largest difference of any "
                  f"tensor {i['max_abs_difference']:g} over {i['probes_checked']} probes, names missing: "
                  f"{', '.join(i['names_missing']) or 'none'}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny original, "
                        f"{', '.join(QUICK_SCENARIOS)} with 2 candidates each, 2 steps, 1 seed, the 50%% proxies; "
                        "with --bisect, 3 checkpoints bisected on the original")
    parser.add_argument("--scenarios", nargs="*", choices=list(SCENARIOS), default=list(SCENARIOS),
                        help="the diagnoses to make (none: the bisection alone)")
    parser.add_argument("--models", nargs="+", help="diagnose on these models only (original, seq-recon-0.5, "
                        "random-0.5, ...; default all): another process can take the others")
    parser.add_argument("--bisect", action="store_true", help="also the bisection: a run's checkpoints whose "
                        "planted super expert grows past fp16's range, bisected on the original and on proxies")
    parser.add_argument("--seeds", type=int, default=2, help="sampling seeds per run (default 2)")
    parser.add_argument("--random-draws", type=int, default=3, help="random 50%% controls, each `build --method "
                        "random` with its own --seed (default 3; quick: 1); their mean is the control")
    parser.add_argument("--unpinned-draws", type=int, default=3, help="random 50%% controls built with "
                        "--no-keep-super: no super expert pinned (default 3; quick: 1)")
    add_model_args(parser)
    parser.add_argument("--parallel", type=int, default=2, help="repro processes at a time (default 2)")
    parser.add_argument("--steps", type=int, help="RL steps of every run (default: each scenario's)")
    parser.add_argument("--from-cache", action="store_true", help="tables from the diagnoses already finished "
                        "under --out (no diagnosis runs; with --bisect, bisect reuses its probes)")
    parser.add_argument("--out", type=Path, help="the lab's output (default bench/out/fidelity, quick: "
                        "bench/out/fidelity-quick): its qwen3 original and proxies are used")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    lab = _lab()
    import torch

    torch.set_num_threads(1)  # the lab's rule on a shared 2-core machine (the builds run here)
    ratios = tuple(args.ratios)
    scenarios = {name: SCENARIOS[name] for name in args.scenarios}
    builds, growth = BISECT_BUILDS, GROWTH_STEPS
    if args.quick:
        lab.MODEL.update(lab.QUICK_MODEL)
        lab.TRAIN.update(lab.QUICK_BATCH)
        lab.RL.update(lab.QUICK_RL)
        ratios = (0.5,)
        args.seeds, args.steps, args.random_draws, args.unpinned_draws = 1, 2, 1, 1
        scenarios = {n: dataclasses.replace(SCENARIOS[n], original=PLANTED, seeds=None, candidates=tuple(
            c for c in SCENARIOS[n].candidates if candidate_name(c) in names)) for n, names in QUICK_SCENARIOS.items()}
        builds, growth = QUICK_BUILDS, QUICK_GROWTH
        lab.OUT = lab.OUT.with_name("fidelity-quick")
    if args.steps:
        scenarios = {n: dataclasses.replace(s, steps=args.steps) for n, s in scenarios.items()}
    lab.OUT = args.out or lab.OUT
    started = time.time()
    trained, stats = original_and_stats(lab)
    originals = {TRAINED: (trained, stats)}
    if args.bisect or any(s.original == PLANTED for s in scenarios.values()):
        originals[PLANTED] = planted_original(lab, trained, stats)
    wanted = list(dict.fromkeys(s.original for s in scenarios.values()))  # built in the scenarios' order
    models = {kind: {n: p for n, p in models_of(lab, *originals[kind], ratios, args.random_draws,
                                                          args.unpinned_draws, not args.from_cache,
                                                          tuple(args.builds)).items()
                     if not args.models or n in args.models} for kind in wanted}
    root = lab.OUT / "qwen3" / "verdicts"
    base = rl_flags(lab.RL)
    result = diagnose_all(models, scenarios, root, base, args.seeds, args.parallel, args.from_cache)
    check_model = f"{lab.DEFAULT}-0.5"
    checks = one_by_one(result, root, check_model, args.parallel, run=not args.from_cache)
    names = list(dict.fromkeys(n for by_kind in models.values() for n in by_kind if n != ORIGINAL))
    agree = {name: agreement(result, name) for name in names}
    draws = [n for n in names if n.startswith(RANDOM[0]) and agree[n]["scenarios"]]
    if len(draws) > 1:  # the control: all draws, then each kind (pinned, unpinned) apart where both ran
        agree["random-0.5, all draws"] = pooled([agree[n] for n in draws])
        for kind in dict.fromkeys(map(mean_row, draws)):
            if len(kind_draws := [n for n in draws if mean_row(n) == kind]) > 1:
                agree[kind] = pooled([agree[n] for n in kind_draws])
    seeds = list(range(args.seeds))
    text = tables(result, agree, checks, scenarios) if result else ""
    kept = None
    if PLANTED in models:  # the planted original's proxies that ran here
        info = json.loads((originals[PLANTED][0] / "planted.json").read_text())
        kept = keeps_planted(models[PLANTED], info)
        text += (f"\nThe planted super expert (MoE layer {info['layer']}, expert {info['expert']}) is kept by: "
                 + ", ".join(f"{n} {'yes' if k else 'no'}" for n, k in kept.items()) + ".\n")
    bisected = None
    if args.bisect:
        info = json.loads((originals[PLANTED][0] / "planted.json").read_text())
        prefix = growing_checkpoints(trained, info, root / "bisect" / "checkpoints", growth)
        dataset = root / "bisect" / "calibration.txt"  # for --dataset: the lab's calibration text, as bytes
        dataset.write_bytes(bytes(lab.calibration_ids().reshape(-1).tolist()).replace(b"\x00", b" "))
        bisected = bisections(prefix, root / "bisect", base, dataset,
                              {n: f for n, f in builds.items() if not args.models or n in args.models},
                              run=not args.from_cache)
        text += bisect_table(bisected, info)
    print(text)
    (root / "verdicts.md").write_text(text)
    (root / "verdicts.json").write_text(json.dumps({
        "scenarios": {n: dataclasses.asdict(s) for n, s in scenarios.items()}, "rl": lab.RL, "rl_flags": base,
        "models": {kind: {n: str(p) for n, p in by_kind.items()} for kind, by_kind in models.items()},
        "seeds": seeds, "agreement": agree, "keeps_planted": kept,
        "diagnoses": {s: {m: {k: v for k, v in d.items() if k != "report"} | {
            "verdicts": {n: c["verdict"] for n, c in d["report"]["candidates"].items()},
            "baseline": d["report"]["baseline"]["seeds"],
            "seeds": {n: c["seeds"] for n, c in d["report"]["candidates"].items()},
            "report": str(root / s / m / "report.json")} for m, d in by_model.items()} for s, by_model in result.items()},
        "one_by_one": checks, "bisection": bisected, "wall_s": round(time.time() - started, 1)}, indent=2))
    log.info("done in %.0fs; %s", time.time() - started, root / "verdicts.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
