"""Does the loop give the original's answer on a proxy? `moe-proxy triage` on a run's checkpoints
with the original itself as the probe's model (`--keep-ratio 1`: every expert kept), with the
default build at 50% and 12.5% of the experts, and with random builds of the same sizes (the
control), on the fidelity lab's failure kinds planted into a run's checkpoints from one on:

- super-fp16: a routed expert's output past fp16's range (its down_proj x 1e6), fp16 training:
  `--fail-on overflow` (the lab's super-fp16 scenario);
- expert-blowup: one expert's weights blow up (gate, up and down x 30), fp32: its output crosses
  `numerics/max_activation>50`;
- router-collapse: one expert's router row turned onto the mean direction of its inputs (collapse_row),
  so it is in nearly every token's top-k: `moe/load_max_excess>0.5` (scale-free: a proxy keeping
  few experts is not past it for having few, docs/metrics.md).

Each scenario's run is the base checkpoint copied once per step (verl's layout), the plant in the
checkpoints from `--planted-from` on, and the original's metrics log failing the step after that
checkpoint (the log is written, not trained: what the loop must find is the checkpoint). For each
(scenario, build) cell it prints whether triage's first bad checkpoint, its `fixed_by` and each
candidate's verdict equal the original's (the `--keep-ratio 1` triage), and the loop's cost.

The inherited scenarios (INHERITED, `--inherited`) plant outside the routed experts, in what every
proxy keeps: dense-fp16 and attention-fp16 (a dense MLP's or an attention output past fp16's range:
`overflow`, cured by bf16 and fp32) and sharp-head (the LM head in a state where the run's learning
rate diverges: `divergence`, cured by lower-lr). Random builds should reproduce them too; their goal
is the original's own floor: the original's triage again on other seed sets (`--floor-seeds`,
default 2 for these), each counted against its first like a build (OUT/floor.json and a table).

    nice -n 10 .venv/bin/python bench/loop_fidelity.py --out bench/out/loop-fidelity   # hours on 2 cores
    .venv/bin/python bench/loop_fidelity.py --quick --out /tmp/lf   # a smoke run: tiny original, 3 checkpoints
    .venv/bin/python bench/loop_fidelity.py --quick --inherited --out /tmp/lfi   # the inherited ones, their floor

Full size uses the fidelity lab's trained Qwen3-MoE original (bench/fidelity.py, 64 experts, top-4;
`--dataset` then calibrates each probe, the default build); `--quick` a tiny random Qwen3-MoE
(32 experts, top-2: 12.5% keeps 4, more than top-k, so collapse can show), data-free builds, one scenario and the 50% builds unless asked for more.
Each triage lives in OUT/<scenario>/<build>/ and resumes (triage's own rule); OUT/loop-fidelity.json
holds the table's figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Scenario:
    what: str
    fail_on: str
    repro: tuple[str, ...]  # the probes' and the diagnosis's repro flags
    candidates: tuple[str, ...]  # catalogue names; () = the catalogue's for the signature
    plant: str  # which plant (PLANTS)


SCENARIOS = {
    "super-fp16": Scenario("an expert's output past fp16's range, fp16 training", "overflow",
                           ("--precision", "fp16", "--steps", "1"), ("bf16", "fp32", "lower-lr"), "overflow"),
    # the tiny original's largest hidden value is 0.13 clean and 221 with the blown-up expert (probe, seed 0)
    "expert-blowup": Scenario("one expert's weights x 30 (gate, up, down), fp32", "numerics/max_activation>50",
                              ("--steps", "2"), ("lower-lr", "z-loss"), "blowup"),
    # collapse_row puts it in the top-2 of 97% of the tiny original's tokens (moe/load_max_excess 0.97; x 100
    # alone: 72%, 0.70); its clean checkpoints read 0.16-0.26 (probe runs, seeds 0 and 1): 0.5 lies between
    "router-collapse": Scenario("one expert's router row onto its inputs' mean: it takes nearly every token",
                                "moe/load_max_excess>0.5", ("--steps", "2"), ("aux-loss", "lower-lr"), "collapse"),
}
# Full size: the trained original routes the RL task's arithmetic to a few hot experts by itself; its
# busiest layer reads moe/load_max_excess 0.90 clean (layer 2, probe, seed 0), past the quick
# original's 0.5, while the planted layer 1 reads 0.58 clean and 0.92 planted: watch that layer.
FULL_SIZE_FAIL_ON = {"router-collapse": "moe/load_max_excess/layer_{layer}>0.75"}
BUILDS_ORIGINAL = ("--keep-ratio", "1")  # every expert kept, data-free: the checkpoint itself

# Inherited: failures carried by what every proxy keeps (attention, the dense layers, the final norm
# and the LM head), planted from the same checkpoint on. Every build should reproduce them, random
# ones too; the goal is the original's own floor (its triage again on other seeds, --floor-seeds).
INHERITED = {
    # the dense layer 0 MLP's down_proj x 1e6: the largest hidden value 1.45e4 in fp32 and in bf16, not
    # finite in fp16 (31k values); 0.127 clean in all three (repro, 1 step, seed 0)
    "dense-fp16": Scenario("the dense MLP's output past fp16's range, fp16 training", "overflow",
                           ("--precision", "fp16", "--steps", "1"), ("bf16", "fp32", "lower-lr"), "dense"),
    # the MoE layer's attention o_proj x 1e6: 7.0e4 in fp32 and bf16, not finite in fp16 (29k values)
    "attention-fp16": Scenario("an attention output past fp16's range, fp16 training", "overflow",
                               ("--precision", "fp16", "--steps", "1"), ("bf16", "fp32", "lower-lr"), "attention"),
    # the final norm's gain x 1e4 and the LM head / 1e4: the same logits at the checkpoint, but an Adam
    # step on the head moves them 1e4 times as far. At the run's lr (1e-5) the KL to the reference is
    # 1.3-2.0 at step 1 and 3.1 at step 2 (seeds 0, 1); at lr 1e-6 at most 0.053 by step 3 (seeds 0-2);
    # clean at 1e-5: 2e-6 (repro, seed 0)
    "sharp-head": Scenario("the LM head in a sharp state: the run's learning rate diverges", "divergence",
                           ("--steps", "3"), ("lower-lr", "z-loss"), "sharp-head"),
}


def builds(ratios: tuple[float, ...], dataset: Path | None, base: Path, draws: int = 1) -> dict[str, tuple[str, ...]]:
    """The original, then per ratio the default build (calibrated with --dataset) and `draws` random
    ones: random-R is the build's own draw (seed 0), random-R#s the draw seed s would make."""
    out = {"original": BUILDS_ORIGINAL}
    for r in ratios:
        out[f"default-{r:g}"] = ("--keep-ratio", f"{r:g}", *(("--dataset", str(dataset)) if dataset else ()))
        out[f"random-{r:g}"] = ("--keep-ratio", f"{r:g}", "--method", "random")
        for s in range(1, draws):
            out[f"random-{r:g}#{s}"] = ("--keep-ratio", f"{r:g}", "--method", "random", *random_draw(base, r, s))
    return out


def random_draw(base: Path, ratio: float, seed: int) -> tuple[str, ...]:
    """`--pin` flags keeping exactly the experts `build --method random --seed SEED` keeps. Triage's
    --seed is the runs' (the probe's build seed is always 0), so other draws are passed as pins:
    selection.py's draw (rng [seed, layer, group 0]) over every expert, as many as the keep ratio's
    count (raised to 2 x top-k, as the planner does when the device holds it: on CPU it does)."""
    import numpy as np

    top_k = json.loads((base / "config.json").read_text())["num_experts_per_tok"]
    pins = []
    for layer, n in routers(base).items():
        k = min(n, max(round(ratio * n), 2 * top_k))
        chosen = np.random.default_rng([seed, layer, 0]).choice(n, k, replace=False)
        pins += [f"{layer}:{e}" for e in sorted(chosen.tolist())]
    return ("--pin", ",".join(pins)) if pins else ()


def routers(base: Path) -> dict[int, int]:
    """MoE layer -> its routed experts, from the routers (Qwen3-MoE names: model.layers.L.mlp.gate.weight)."""
    from safetensors import safe_open

    layers = {}
    for file in base.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            layers |= {int(k.split(".")[2]): f.get_slice(k).get_shape()[0] for k in f.keys()
                       if k.endswith(".mlp.gate.weight")}
    return dict(sorted(layers.items()))


# --- the planted run ----------------------------------------------------------------------------


def plant(checkpoint: Path, kind: str, layer: int, expert: int, row=None) -> None:
    """Plant a failure of `kind` into one routed expert of MoE layer `layer` (Qwen3-MoE names);
    `row`: the collapse's router row (collapse_row)."""
    from safetensors.torch import load_file, save_file

    files = sorted(checkpoint.glob("*.safetensors"))
    prefix = f"model.layers.{layer}.mlp"
    factors = {"overflow": {f"{prefix}.experts.{expert}.down_proj.weight": 1e6},
               "blowup": {f"{prefix}.experts.{expert}.{p}_proj.weight": 30.0 for p in ("gate", "up", "down")},
               "collapse": {f"{prefix}.gate.weight": None}}[kind]
    for file in files:
        tensors = load_file(file)
        hit = [n for n in factors if n in tensors]
        for name in hit:
            if factors[name] is None:  # the router: expert's row only
                tensors[name][expert] = row.to(tensors[name].dtype)
            else:
                tensors[name] = tensors[name] * factors[name]
        if hit:
            save_file(tensors, file, metadata={"format": "pt"})


# The inherited plants: factors on weights outside the routed experts (Qwen3-MoE names; LAYER: the
# MoE layer planted). Layer 0 is dense in the tiny models.
INHERITED_PLANTS = {"dense": {"model.layers.0.mlp.down_proj.weight": 1e6},
                    "attention": {"model.layers.LAYER.self_attn.o_proj.weight": 1e6},
                    "sharp-head": {"model.norm.weight": 1e4, "lm_head.weight": 1e-4}}


def plant_inherited(checkpoint: Path, kind: str, layer: int) -> None:
    from moe_proxy.demo.run import scale

    for name, factor in INHERITED_PLANTS[kind].items():
        name = name.replace("LAYER", str(layer))
        try:
            scale(checkpoint, name, factor)
        except KeyError:  # e.g. the lab's full-size original has no dense layer
            raise SystemExit(f"the {kind} plant: {checkpoint} has no tensor {name}") from None


COLLAPSE_PROMPT_SEED = 1000  # prompts no probe trains on (their seeds are 0, 1, ...)


def collapse_row(base: Path, layer: int, expert: int):
    """The collapsed router row: the row x 100 plus, at the same norm, the mean direction of the
    router's inputs on the RL task's prompts (repro's default task, which the probes train on), run
    through the original. A router collapses when one expert's logit rises on every token: the
    gradient of that rise is the inputs' mean. The direction does not carry across text: the mean
    over CAL.txt's tokens puts the expert in the top-2 of 84% of CAL.txt's tokens and of 60% of a
    probe's (seed 0 runs, 6 December 2026), the prompts' mean in 97% of a probe's."""
    import torch
    from transformers import AutoModelForCausalLM

    from moe_proxy.rl.task import Codec, make_prompts

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    gate = model.model.layers[layer].mlp.gate
    inputs = []
    hook = gate.register_forward_pre_hook(lambda _, a: inputs.append(a[0].reshape(-1, a[0].shape[-1])))
    codec = Codec(base, model.config.vocab_size)
    with torch.no_grad():
        for step in range(4):
            for prompt in make_prompts("arithmetic", COLLAPSE_PROMPT_SEED, step, 16):
                model(torch.tensor([codec.encode(codec.render(prompt))]))
    hook.remove()
    mean = torch.cat(inputs).mean(0)
    row = gate.weight.detach()[expert] * 100.0
    return row + mean / mean.norm() * row.norm()


def planted_run(base: Path, run: Path, steps: tuple[int, ...], planted_from: int, kind: str, layer: int,
                expert: int) -> Path:
    """The run's checkpoints run/global_step_N/actor/huggingface, planted from `planted_from` on;
    written once (run/planted.json holds what was planted)."""
    from moe_proxy.demo.run import checkpoint_dir

    stamp = {"steps": list(steps), "planted_from": planted_from, "kind": kind, "layer": layer, "expert": expert,
             "base": str(base), **({"row": "x100 + mean direction"} if kind == "collapse" else {})}
    if (run / "planted.json").is_file() and json.loads((run / "planted.json").read_text()) == stamp:
        return run
    shutil.rmtree(run, ignore_errors=True)
    row = collapse_row(base, layer, expert) if kind == "collapse" else None
    for step in steps:
        target = checkpoint_dir(run, step)
        shutil.copytree(base, target)
        if step >= planted_from:
            if kind in INHERITED_PLANTS:
                plant_inherited(target, kind, layer)
            else:
                plant(target, kind, layer, expert, row)
    (run / "planted.json").write_text(json.dumps(stamp))
    return run


def original_log(path: Path, scenario: Scenario, last_step: int, fails_from: int) -> Path:
    """The original's metrics (verl's lines), the scenario's failure from `fails_from` on."""
    from moe_proxy.demo.run import write_log

    if scenario.fail_on == "overflow":
        return write_log(path, last_step, fails_from)
    from moe_proxy.metrics.detect import Thresholds

    # divergence: the KL to the reference past the detector's limit (half a nat) from `fails_from` on
    divergence = f"actor/kl_loss>{Thresholds().kl_limit}"
    metric, value = (divergence if scenario.fail_on == "divergence" else scenario.fail_on).split(">")
    rows = [{"step": s, "data": {"actor/pg_loss": 0.5, "actor/grad_norm": 1.0, "critic/rewards/mean": 0.2,
                                 metric: float(value) * (10 if s >= fails_from else 0.1)}}
            for s in range(1, last_step + 1)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- the loop on each build ----------------------------------------------------------------------


def triage(run: Path, log: Path, out: Path, scenario: Scenario, build: tuple[str, ...], seeds: int,
           seed: int = 0) -> dict:
    """`moe-proxy triage` (a process of its own, one thread) on seeds seed..seed+seeds-1, or its
    report from before."""
    argv = [sys.executable, "-m", "moe_proxy", "triage", str(log), str(run), "--out", str(out),
            "--fail-on", scenario.fail_on, *build, *scenario.repro, "--seeds", str(seeds),
            *(("--seed", str(seed)) if seed else ()),
            *(("--candidates", ",".join(scenario.candidates)) if scenario.candidates else ())]
    ran = subprocess.run(argv, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if ran.returncode not in (0, 3) or not (out / "report.json").is_file():  # 3: nothing to diagnose
        return {"error": (ran.stderr.strip().splitlines() or [f"exit {ran.returncode}"])[-1]}
    return json.loads((out / "report.json").read_text())


def agreement(truth: dict, cell: dict) -> dict:
    """A cell against the original's triage: the same first bad checkpoint, fixed_by and verdicts."""
    if "error" in cell or "error" in truth:
        return {"error": cell.get("error") or truth.get("error")}
    step = (cell.get("first_bad") or {}).get("step")
    true_step = (truth.get("first_bad") or {}).get("step")
    verdicts = {n: v["verdict"] for n, v in (cell.get("verdicts") or {}).items()}
    true_verdicts = {n: v["verdict"] for n, v in (truth.get("verdicts") or {}).items()}
    same = [n for n in true_verdicts if verdicts.get(n) == true_verdicts[n]]
    return {"first_bad": step, "first_bad_equal": step == true_step, "fixed_by": cell.get("fixed_by", []),
            "fixed_by_equal": cell.get("fixed_by", []) == truth.get("fixed_by", []),
            "verdicts_equal": len(same), "verdicts": len(true_verdicts), "state": cell.get("state"),
            "cost": {k: (cell.get("cost") or {}).get(k) for k in ("builds", "probe_runs", "candidate_runs",
                                                                   "original_steps")}}


def table(result: dict) -> str:
    lines = ["| scenario | build | state | first bad (original's) | fixed by | verdicts equal | builds | runs |"
             " original steps |", "|---|---|---|---|---|---|---|---|---|"]
    for name, cells in result.items():
        truth_step = (cells["original"]["report"].get("first_bad") or {}).get("step")
        for build, c in cells.items():
            a = c["agreement"]
            if "error" in a:
                lines.append(f"| {name} | {build} | error: {a['error'][:80]} | | | | | | |")
                continue
            k = a["cost"]
            steps = "-" if k["original_steps"] is None else f"{k['original_steps']:.3g}"
            lines.append(f"| {name} | {build} | {a['state']} | {a['first_bad']} ({truth_step})"
                         f"{'' if a['first_bad_equal'] else ' **differs**'} | {', '.join(a['fixed_by']) or 'none'}"
                         f"{'' if a['fixed_by_equal'] else ' **differs**'} | {a['verdicts_equal']}/{a['verdicts']} | "
                         f"{k['builds']} | {(k['probe_runs'] or 0) + (k['candidate_runs'] or 0)} | {steps} |")
    return "\n".join(lines)


# --- the original's own floor ---------------------------------------------------------------------


def floor_builds(floor_seeds: int, seeds: int) -> dict[str, int]:
    """The original's triage again on `floor_seeds` other seed sets, none shared with seed 0's
    (a triage runs seeds --seed..--seed+seeds-1): cell name -> its --seed."""
    return {f"original-seed{i * seeds}": i * seeds for i in range(1, floor_seeds + 1)}


def agrees(a: dict) -> bool:
    """A cell gives the original's answer: the same first bad checkpoint, fixed_by and every verdict."""
    return "error" not in a and a["first_bad_equal"] and a["fixed_by_equal"] and a["verdicts_equal"] == a["verdicts"]


def floor_summary(result: dict) -> dict:
    """Per scenario and in total, (agreeing, cells) against the original on its first seeds: `floor`
    counts the original's own triages on other seeds (original-seed*), every other build its own
    cell. Scenarios without floor cells are left out."""
    per, total = {}, {}
    for name, cells in result.items():
        if not any(b.startswith("original-seed") for b in cells):
            continue
        counts = {}
        for build, c in cells.items():
            if build == "original":
                continue
            column = "floor" if build.startswith("original-seed") else build
            k, n = counts.get(column, (0, 0))
            counts[column] = (k + agrees(c["agreement"]), n + 1)
        per[name] = counts
        for column, (k, n) in counts.items():
            tk, tn = total.get(column, (0, 0))
            total[column] = (tk + k, tn + n)
    return {"scenarios": per, "total": total}


def _differs(a: dict) -> str:
    """What a cell got other than the original's answer, in a few words."""
    if "error" in a:
        return f"error: {a['error'][:60]}"
    if not a["first_bad_equal"]:
        return f"first bad {a['first_bad']}" if a["first_bad"] is not None else "no checkpoint reproduces"
    if not a["fixed_by_equal"]:
        return f"fixed by {', '.join(a['fixed_by']) or 'none'}"
    return f"verdicts {a['verdicts_equal']}/{a['verdicts']}"


def floor_table(result: dict, summary: dict) -> str:
    """Markdown: per scenario the original's answer, how often it gives it again on other seeds (the
    floor) and each build's cell; a last row of totals."""
    columns = [c for c in summary["total"] if c != "floor"]
    lines = ["| scenario (signature) | original: first bad; fixed by | the original, other seeds (floor) | "
             + " | ".join(columns) + " |", "|---" * (3 + len(columns)) + "|"]
    for name, counts in summary["scenarios"].items():
        truth = result[name]["original"]["report"]
        step = (truth.get("first_bad") or {}).get("step")
        k, n = counts["floor"]
        fixed = ", ".join(truth.get("fixed_by") or []) or "none"
        row = [f"{name} (`{truth.get('signature', '?')}`)", f"{step}; {fixed}", f"{k}/{n}"]
        for column in columns:
            a = result[name][column]["agreement"]
            row.append("agrees" if agrees(a) else _differs(a))
        lines.append("| " + " | ".join(row) + " |")
    cells = [f"{k}/{n} ({100 * k / n:.0f}%)" for k, n in (summary["total"][c] for c in ["floor", *columns])]
    lines.append("| **cells that agree** | | " + " | ".join(f"**{c}**" for c in cells) + " |")
    return "\n".join(lines)


def tally(result: dict) -> dict[str, str]:
    """Per build (the random draws of a ratio together): cells that agree / cells, over the scenarios."""
    counts: dict[str, list[int]] = {}
    for cells in result.values():
        for build, c in cells.items():
            n = counts.setdefault(build.split("#")[0], [0, 0])
            n[0] += agrees(c["agreement"])
            n[1] += 1
    return {build: f"{a}/{n}" for build, (a, n) in counts.items()}


def base_checkpoint(out: Path, quick: bool, dataset: Path | None = None) -> tuple[Path, Path | None]:
    """(the original's checkpoint, the calibration text or None): tiny with --quick (calibrated
    with --dataset if given), else the lab's."""
    if quick:
        from moe_proxy.demo.tiny import make_tiny

        base = out / "base"
        if not (base / "config.json").is_file():
            # 32: with 16, 12.5% keeps 2 = top-k, which the planner raises to 4 (25%); with 32 it is 4
            make_tiny("qwen3_moe", base, num_experts=32)
        return base, dataset
    sys.path.insert(0, str(HERE))
    import fidelity
    import verdicts

    original, _ = verdicts.original_and_stats(fidelity)
    dataset = out / "calibration.txt"  # the lab's calibration text, as bytes (verdicts.py's bisection does so)
    dataset.write_bytes(bytes(fidelity.calibration_ids().reshape(-1).tolist()).replace(b"\x00", b" "))
    return original, dataset


def super_expert(original: Path, layer: int) -> int:
    """The full-size original's natural super expert of `layer` among the experts the RL task's
    tokens reach (fidelity.task_super_expert, the fidelity lab's plant): a failure carried by an
    expert the task never routes to could not show on the original itself."""
    import fidelity
    import torch
    import verdicts
    from transformers import AutoModelForCausalLM

    _, stats = verdicts.original_and_stats(fidelity)
    layer_stats = next(v for v in fidelity.load_calibration(str(stats)).layers.values() if v.layer == layer)
    model = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    return fidelity.task_super_expert(model, layer_stats, layer)[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny original, 3 checkpoints")
    p.add_argument("--scenarios", nargs="+", choices=[*SCENARIOS, *INHERITED],
                   help="default: all expert-carried ones (quick: super-fp16)")
    p.add_argument("--inherited", action="store_true", help="the inherited scenarios (%s), besides --scenarios"
                   % ", ".join(INHERITED))
    p.add_argument("--floor-seeds", type=int, metavar="N", help="the original's triage again on N other seed "
                   "sets (the floor; default: 2 for the inherited scenarios, 0 for the others)")
    p.add_argument("--ratios", nargs="+", type=float, help="default: 0.5 0.125 (quick: 0.5)")
    p.add_argument("--seeds", type=int, help="default 2 (quick: 1)")
    p.add_argument("--dataset", type=Path, help="with --quick: calibrate the default builds on this text "
                   "(without it, quick's default builds are data-free)")
    p.add_argument("--layer", type=int, default=1, help="the MoE layer planted (default 1)")
    p.add_argument("--expert", type=int, help="the expert planted (default: quick 0; full size the layer's "
                   "natural super expert among those the RL task reaches, as the fidelity lab plants)")
    p.add_argument("--random-draws", type=int, help="random builds per ratio, each a cell (default 3; quick: 1 "
                   "for super-fp16 alone, else 3)")
    args = p.parse_args()
    quick = args.quick
    scenarios = args.scenarios or ([] if args.inherited else ["super-fp16"] if quick else list(SCENARIOS))
    scenarios += [n for n in INHERITED if args.inherited and n not in scenarios]
    if args.floor_seeds is not None and args.floor_seeds < 0:
        p.error(f"--floor-seeds {args.floor_seeds}: must be 0 or more")
    ratios = tuple(args.ratios or ((0.5,) if quick else (0.5, 0.125)))
    steps = (10, 20, 30) if quick else tuple(range(10, 90, 10))
    planted_from = 20 if quick else 60
    seeds = args.seeds or (1 if quick else 2)
    # one draw says little of the control (it may keep the planted expert or not): 3 unless quick's smoke
    draws = args.random_draws or (1 if quick and scenarios == ["super-fp16"] else 3)
    args.out.mkdir(parents=True, exist_ok=True)
    base, dataset = base_checkpoint(args.out, quick, args.dataset)
    expert = args.expert if args.expert is not None else 0 if quick else super_expert(base, args.layer)
    result = {}
    for name in scenarios:
        s = {**SCENARIOS, **INHERITED}[name]
        if not quick and name in FULL_SIZE_FAIL_ON:
            s = dataclasses.replace(s, fail_on=FULL_SIZE_FAIL_ON[name].format(layer=args.layer))
        run = planted_run(base, args.out / name / "run", steps, planted_from, s.plant, args.layer, expert)
        log = original_log(args.out / name / "metrics.jsonl", s, steps[-1], planted_from + 5)
        floor_seeds = (2 if name in INHERITED else 0) if args.floor_seeds is None else args.floor_seeds
        cells = {}
        runs = {build: (flags, 0) for build, flags in builds(ratios, dataset, base, draws).items()}
        runs |= {build: (BUILDS_ORIGINAL, seed) for build, seed in floor_builds(floor_seeds, seeds).items()}
        for build, (flags, seed) in runs.items():
            report = triage(run, log, args.out / name / build, s, flags, seeds, seed)
            cells[build] = {"report": report}
            print(f"{name} {build}: {report.get('answer') or report.get('error')}", flush=True)
        for c in cells.values():
            c["agreement"] = agreement(cells["original"]["report"], c["report"])
        result[name] = cells
    (args.out / "loop-fidelity.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print("cells that agree (random draws together): " + ", ".join(f"{b} {n}" for b, n in tally(result).items()))
    summary = floor_summary(result)
    if summary["scenarios"]:
        (args.out / "floor.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(floor_table(result, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
