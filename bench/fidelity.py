"""The fidelity lab: do RL steps on a proxy behave like RL steps on the original?

1. Train a small Qwen3-MoE "original" (byte-level, 64 experts, top-4) on the Python standard
   library's own sources mixed with the task's format ("12+7=19" lines), long enough that its
   experts specialise. Cached in bench/out/fidelity/original (delete it to retrain).
2. `calibrate` it (moe_proxy.calibrate.statistics, the code behind `moe-proxy calibrate`) on the lab's
   calibration tokens, then build proxies at 50% and 12.5% of the experts with
   `build_proxy` (the code behind `moe-proxy build`): data-free clustering on router rows and
   on expert weights, the usage-aware variants through `--calibration` (routing-profile
   clusters, frequency, saliency, output clusters with saliency representatives, the last
   three with and without `--heal`), and the `random` and `first-n` baselines.
3. Run the same RL steps (`moe-proxy repro` settings, same seed) on every model: without a
   fault, with each injected fault, and at a high learning rate with the router balance
   losses off and on (load collapse). Once more after one identical short LM healing phase
   applied to every model, the original included.
4. A second family: the original with one super expert amplified past fp16's range (a planted
   massive activation), its own calibration and the same proxies, run in fp16 with dynamic
   loss scaling. Which proxies keep the expert, and so the overflow?
5. Compare every proxy run with the original's run of the same scenario (`moe-proxy compare`
   statistics, each against its shuffled-step-order control), write results.json, table.md,
   summary.md and plots under bench/out/fidelity/.

    .venv/bin/python bench/fidelity.py [--steps 16] [--quick] [--seed-study] [--collapse-study] [--out DIR]

About 40-60 minutes on 2 busy CPU cores when the original is cached. Every build and run is
cached under bench/out/fidelity/ by its settings and the code's version (the lab's source and
that of every moe_proxy module it imports), so an interrupted lab resumes and a rerun after a
code change recomputes. --quick is a smoke run of the whole pipeline on a tiny, barely trained
original (seconds; its figures mean nothing); tests/bench/test_bench_quick.py runs it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import random
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "transformer"))

from moe_proxy.build.pipeline import build_proxy  # noqa: E402
from moe_proxy.calibrate.statistics import calibrate  # noqa: E402
from moe_proxy.calibrate.statistics import load as load_calibration  # noqa: E402
from moe_proxy.repro.compare import KEY_METRICS, compare_runs, load_run  # noqa: E402
from moe_proxy.sizing import SizingOptions, estimate  # noqa: E402
from moe_proxy.repro.plots import plot_curves  # noqa: E402
from moe_proxy.repro.config import Faults, ReproConfig  # noqa: E402
from moe_proxy.repro.runner import run_repro  # noqa: E402

OUT = ROOT / "bench" / "out" / "fidelity"
PACKAGE = ROOT / "transformer"  # where moe_proxy's sources are
MODEL = dict(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, intermediate_size=256, moe_intermediate_size=64, num_experts=64, num_experts_per_tok=4,
             norm_topk_prob=True, router_aux_loss_coef=0.01, output_router_logits=True, tie_word_embeddings=False,
             max_position_embeddings=512)
TRAIN = dict(steps=1000, batch=16, seq_len=128, lr=3e-3, seed=0, task_share=0.3)
# The healing phase every model gets before the "after healing" runs: a few LM steps on the
# original's training mix, same batches, seed and settings for all.
HEAL_PHASE = dict(steps=30, batch=16, seq_len=128, lr=5e-4, seed=7, task_share=0.3)
# A Qwen3-30B-A3B-shaped config: planned devices are reported for a real size at the same keep ratio.
REAL = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
RL = dict(lr=2e-5, batch_size=8, group_size=4, max_new_tokens=6, kl_coef=0.01, mini_batches=2)
RATIOS = (0.5, 0.125)
FAULT_STEP = 6
FP16_MAX = 65504.0
PERMUTATIONS = 200  # shuffled-step controls per comparison
SCENARIOS = {  # on the trained original and its proxies; RL's router aux and z losses are off unless set
    "clean": {},
    "lr-spike": dict(faults=Faults(lr_spike_step=FAULT_STEP, lr_spike_factor=300)),
    "router-scale": dict(faults=Faults(router_scale_step=FAULT_STEP, router_scale_factor=8)),
    "faulty-op": dict(faults=Faults(op_module="model.layers.2.mlp", op_step=FAULT_STEP, op_mode="scale",
                                    op_value=30.0)),
    "fp16-no-scaling": dict(faults=Faults(fp16_no_scaling_step=FAULT_STEP)),
    # no injected fault: does the proxy fail like the original on its own? Balance losses off ...
    "high-lr": dict(lr=1e-3),
    # ... and on (Switch aux loss as in pre-training, ST-MoE z-loss): is a collapse theirs?
    "high-lr-balanced": dict(lr=1e-3, router_aux_coef=0.01, router_z_coef=1e-3),
}
HEALED_SCENARIOS = {"clean": {}}
SUPER_SCENARIOS = {  # on the planted original and its proxies
    "fp16-super": dict(precision="fp16", steps=8),  # fp16 done right (dynamic loss scaling)
    "fp32-super": dict(steps=8),  # the same model in fp32: no overflow, but the activation shows
}
VARIANTS = [  # (name, build_proxy options); "calibrated": built with the lab's `calibrate` statistics
    ("cluster-router", dict(method="cluster", features="router")),
    ("cluster-weights", dict(method="cluster", features="weights")),
    ("routing", dict(method="cluster", features="routing", calibrated=True)),
    ("frequency", dict(method="frequency", calibrated=True)),
    ("frequency-healed", dict(method="frequency", calibrated=True, heal=True)),
    ("saliency", dict(method="saliency", calibrated=True)),
    ("saliency-healed", dict(method="saliency", calibrated=True, heal=True)),
    ("output-saliency", dict(method="cluster", features="output", calibrated=True)),
    ("output-saliency-healed", dict(method="cluster", features="output", calibrated=True, heal=True)),
    ("random", dict(method="random")),
    ("first-n", dict(method="first-n")),
]
# Only in the super-expert family: frequency without pinning super experts (--no-keep-super).
SUPER_VARIANTS = VARIANTS + [("frequency-no-super", dict(method="frequency", calibrated=True, keep_super=False))]
CONTROL = "original-reseeded"  # the original again, same prompts, other samples: the noise floor
# --quick: a smoke run of every stage in seconds (tiny model, 2 steps, one ratio; clean and the super scenarios).
QUICK_MODEL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                   intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2)
QUICK_BATCH = dict(steps=2, batch=2, seq_len=32)
QUICK_RL = dict(batch_size=2, group_size=2, max_new_tokens=4, mini_batches=1)
QUICK_VARIANTS = ("frequency", "random")
log = logging.getLogger("fidelity")


@dataclasses.dataclass
class Model:
    path: Path
    ratio: float  # share of the experts kept (1.0: the original)
    gate_mass: float  # share of the original's gate mass on calibration tokens the kept experts carried
    keeps_super: bool | None = None  # the planted super expert is kept (super family only)


# ---------------------------------------------------------------- 1. the original

def corpus() -> bytes:
    """Python standard library sources, in sorted file order (the same bytes on every run)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        parts.append(data)
        size += len(data)
        if size > 4_000_000:
            break
    return b"\n".join(parts)


def task_lines(rng: random.Random, length: int) -> bytes:
    text = ""
    while len(text) < length:
        a, b = rng.randrange(100), rng.randrange(100)
        text += f"{a}+{b}={a + b}\n"
    return text[:length].encode()


def lm_batch(rng: random.Random, text: np.ndarray, batch: int, seq: int, task_share: float) -> torch.Tensor:
    """One LM batch of the training mix: stdlib windows and task lines."""
    rows = []
    for _ in range(batch):
        if rng.random() < task_share:
            rows.append(np.frombuffer(task_lines(rng, seq), dtype=np.uint8))
        else:
            start = rng.randrange(len(text) - seq)
            rows.append(text[start:start + seq])
    return torch.tensor(np.stack(rows), dtype=torch.long)


def train_text() -> tuple[np.ndarray, np.ndarray]:
    """(training text, held-out text: the last 200 KB)."""
    text = np.frombuffer(corpus(), dtype=np.uint8)
    return text[:-200_000], text[-200_000:]


def train_original(path: Path) -> dict:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    key = {"model": MODEL, "train": TRAIN, "code": training_code_version()}
    stamp = path / "fidelity-train.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("key") == key:
        log.info("original: cached in %s", path)
        return json.loads(stamp.read_text())
    torch.manual_seed(TRAIN["seed"])
    rng = random.Random(TRAIN["seed"])
    text, held_out = train_text()
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MODEL))
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN["lr"], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, TRAIN["lr"], total_steps=TRAIN["steps"], pct_start=0.05)
    started, losses = time.time(), []
    for step in range(TRAIN["steps"]):
        ids = lm_batch(rng, text, TRAIN["batch"], TRAIN["seq_len"], TRAIN["task_share"])
        out = model(input_ids=ids, labels=ids)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(out.loss.item())
        if step % 50 == 0:
            log.info("train step %d loss %.3f (%.0fs)", step, out.loss.item(), time.time() - started)
    model.config.output_router_logits = False
    model.save_pretrained(path)
    info = {"key": key, "train_seconds": round(time.time() - started, 1),
            "final_train_loss": float(np.mean(losses[-20:])),
            "held_out_loss": held_out_loss(path, held_out)}
    stamp.write_text(json.dumps(info, indent=2))
    return info


@torch.no_grad()
def held_out_loss(path: Path, held_out: np.ndarray | None = None, n: int = 32, seq: int = 128) -> float:
    """Mean next-byte loss on stdlib text the original never trained on (nats/byte)."""
    from transformers import AutoModelForCausalLM

    if held_out is None:
        held_out = train_text()[1]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    starts = np.linspace(0, len(held_out) - seq - 1, n).astype(int)
    ids = torch.tensor(np.stack([held_out[s:s + seq] for s in starts]), dtype=torch.long)
    return float(model(input_ids=ids, labels=ids).loss)


def calibration_ids() -> torch.Tensor:
    """The lab's calibration tokens: 32 stdlib windows and 8 task sequences of 128 bytes."""
    rng = np.random.default_rng(1)
    text = train_text()[0]
    rows = [text[s:s + 128] for _ in range(4) for s in rng.integers(0, len(text) - 129, 8)]
    rows += [np.frombuffer(task_lines(random.Random(i), 128), dtype=np.uint8) for i in range(8)]
    return torch.tensor(np.stack(rows), dtype=torch.long)


def weights_stamp(path: Path) -> list:
    """Changes whenever the checkpoint's weights are rewritten (cache key of runs)."""
    files = sorted(path.glob("*.safetensors"))
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def imported_sources(entry: Path, root: Path = PACKAGE, package: str = "moe_proxy") -> list[Path]:
    """`entry` and every module of `package` (sources under `root`) it imports, directly or
    through another module, imports inside functions included; each package's __init__ too."""
    seen: set[Path] = set()
    todo = [entry.resolve()]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing module's package
                    here = path.relative_to(root.resolve()).with_suffix("").parts[:-1]
                    base = ".".join([*here[:len(here) - node.level + 1], *([base] if base else [])])
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for parts in (name.split(".") for name in names if name.split(".")[0] == package):
                for i in range(1, len(parts) + 1):  # each package on the way, then the module
                    where = root.joinpath(*parts[:i])
                    todo += [f.resolve() for f in (where / "__init__.py", where.with_suffix(".py")) if f.is_file()]
    return sorted(seen)


def code_version(entry: Path = Path(__file__), root: Path = PACKAGE, package: str = "moe_proxy") -> str:
    """sha256 over `entry`'s source, that of every `package` module it imports (imported_sources)
    and the torch and transformers versions."""
    import transformers

    digest = hashlib.sha256(f"torch {torch.__version__} transformers {transformers.__version__}\n".encode())
    for path in imported_sources(entry, root, package):
        digest.update(f"{path.name} {len(path.read_bytes())}\n".encode() + path.read_bytes())
    return digest.hexdigest()


@functools.cache
def lab_code_version() -> str:
    """Part of every cache key but the original's: a rerun after a change to the lab or to any
    moe_proxy module it uses recomputes what that code made."""
    return code_version()


def training_code_version() -> str:
    """The original's cache key: the source of the functions that train and score it (no
    moe_proxy code runs there), so editing the rest of the lab does not retrain it (13.5 min)."""
    import transformers

    sources = [inspect.getsource(f) for f in (corpus, task_lines, lm_batch, train_text, train_original, held_out_loss)]
    return hashlib.sha256("\n".join([torch.__version__, transformers.__version__, *sources]).encode()).hexdigest()


def code_checked(path: Path, make):
    """make() after removing `path` if it was made by other code than this (its stamp is
    `path`.code-version): for the outputs that calibrate and build_proxy reuse as they are."""
    stamp = path.with_name(path.name + ".code-version")
    if path.exists() and not (stamp.exists() and stamp.read_text() == lab_code_version()):
        shutil.rmtree(path)
    result = make()
    stamp.write_text(lab_code_version())
    return result


# ---------------------------------------------------------------- 2. a planted super expert

@torch.no_grad()
def plant_super_expert(original: Path, stats: Path, dst: Path, layer: int = 1) -> dict:
    """A copy of `original` whose natural super expert in `layer` (of the experts the RL task's
    tokens reach, the one with the largest output magnitude in the calibration statistics) has
    one output channel scaled until its output on task tokens exceeds fp16's range twice over:
    the massive activation of "Unveiling Super Experts", made large enough to overflow fp16.
    fp32 still computes it exactly."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    s = next(v for v in load_calibration(str(stats)).layers.values() if v.layer == layer)
    model = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    experts = model.model.layers[layer].mlp.experts
    seen = {}
    hook = experts.register_forward_pre_hook(lambda _m, args: seen.update(x=args[0], idx=args[1]))
    ids = torch.tensor(np.stack([np.frombuffer(task_lines(random.Random(100 + i), 64), dtype=np.uint8)
                                 for i in range(32)]), dtype=torch.long)
    model(input_ids=ids)
    hook.remove()
    reached = torch.unique(seen["idx"])
    expert = int(reached[s.max_abs[reached].argmax()])
    key = {"source": weights_stamp(original), "layer": layer, "expert": expert, "code": lab_code_version()}
    stamp = dst / "planted.json"
    if stamp.exists() and json.loads(stamp.read_text())["key"] == key:
        return json.loads(stamp.read_text())
    routed = (seen["idx"] == expert).any(-1)
    gate, up = torch.nn.functional.linear(seen["x"][routed], experts.gate_up_proj[expert]).chunk(2, -1)
    out = torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[expert])
    channel = int(out.abs().mean(0).argmax())
    factor = 2 * FP16_MAX / float(out[:, channel].abs().quantile(0.1))
    dst.mkdir(parents=True, exist_ok=True)
    for f in original.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "fidelity-train.json":
            shutil.copy2(f, dst / f.name)
    tensors = load_file(original / "model.safetensors")
    tensors[f"model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"][channel] *= factor
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    plus = ids.reshape(-1) == ord("+")
    info = {"key": key, "layer": layer, "expert": expert, "channel": channel, "factor": round(factor, 1),
            "natural_max_abs": float(s.max_abs[expert]), "layer_median_max_abs": float(s.max_abs.median()),
            "planted_max_abs": float(out[:, channel].abs().max() * factor),
            "routed_share_of_task_tokens": float(routed.float().mean()),
            "routed_share_of_plus_tokens": float((routed & plus).sum() / plus.sum())}
    stamp.write_text(json.dumps(info, indent=2))
    return info


# ---------------------------------------------------------------- 3. proxies

def build_family(original: Path, stats: Path, out: Path, variants: list, planted: dict | None = None
                 ) -> dict[str, Model]:
    """Every variant at every keep ratio, built from `original`."""
    cal = load_calibration(str(stats))
    share = {s.layer: s.share for s in cal.layers.values()}
    models = {"original": Model(original, 1.0, 1.0, True if planted else None)}
    for ratio in RATIOS:
        k = int(MODEL["num_experts"] * ratio)
        for name, options in variants:
            options = dict(options)
            calibrated = options.pop("calibrated", False)
            dst = out / f"{name}-{ratio:g}"
            manifest = code_checked(dst, lambda: build_proxy(
                str(original), str(dst), experts=k, overwrite=True, calibration=str(stats) if calibrated else None,
                **options))
            kept = {v["layer"]: v["kept"] for v in manifest["layers"].values()}
            mass = float(np.mean([float(share[layer][kept[layer]].sum()) for layer in kept]))
            keeps = planted["expert"] in kept[planted["layer"]] if planted else None
            models[dst.name] = Model(dst, ratio, mass, keeps)
            log.info("built %-28s gate mass kept %.2f%s", dst.name, mass,
                     "" if keeps is None else f", super expert {'kept' if keeps else 'dropped'}")
    return models


# ---------------------------------------------------------------- 4. the healing phase

def healing_phase(model: Model, dst: Path) -> Model:
    """HEAL_PHASE LM steps on the training mix (same batches for every model), saved to dst."""
    from transformers import AutoModelForCausalLM

    key = {"phase": HEAL_PHASE, "source": str(model.path), "weights": weights_stamp(model.path),
           "code": lab_code_version()}
    stamp = dst / "heal-phase.json"
    if not (stamp.exists() and json.loads(stamp.read_text()) == key):
        torch.manual_seed(HEAL_PHASE["seed"])
        rng = random.Random(HEAL_PHASE["seed"])
        text = train_text()[0]
        net = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).train()
        net.config.output_router_logits = True  # the original's training objective, aux loss included
        opt = torch.optim.AdamW(net.parameters(), lr=HEAL_PHASE["lr"], weight_decay=0.0)
        for _ in range(HEAL_PHASE["steps"]):
            ids = lm_batch(rng, text, HEAL_PHASE["batch"], HEAL_PHASE["seq_len"], HEAL_PHASE["task_share"])
            loss = net(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
        net.config.output_router_logits = False
        net.save_pretrained(dst)
        stamp.write_text(json.dumps(key))
    return dataclasses.replace(model, path=dst)


# ---------------------------------------------------------------- 5. runs and comparison

def run_scenarios(models: dict[str, Model], scenarios: dict, out: Path, steps: int,
                  seed: int = 0) -> dict[str, dict[str, Path]]:
    """scenario -> model name -> run directory; the control is the original with seed + 1."""
    runs: dict[str, dict[str, Path]] = {}
    for scenario, settings in scenarios.items():
        for name, model in {**models, CONTROL: models["original"]}.items():
            run_seed = seed + 1 if name == CONTROL else seed
            config = ReproConfig(**({"steps": steps, "seed": run_seed, "prompt_seed": seed} | RL | settings))
            runs.setdefault(scenario, {})[name] = cached_run(model.path, out / scenario / name, config)
    return runs


def cached_run(model: Path, out: Path, config: ReproConfig) -> Path:
    key = {"model": str(model), "weights": weights_stamp(model), "config": config.to_dict(),
           "code": lab_code_version()}
    stamp = out / "lab-key.json"
    if stamp.exists() and json.loads(stamp.read_text()) == json.loads(json.dumps(key, default=str)):
        return out
    started = time.time()
    result = run_repro(str(model), out, config)
    stamp.write_text(json.dumps(key, default=str))
    log.info("%-48s %5.1fs failures %s", str(out.relative_to(OUT)), time.time() - started,
             {k: v["step"] for k, v in result.failures.items()} or "none")
    return out


def load_shift(rows: dict[int, dict[str, float]]) -> float | None:
    """Change of the mean (over layers) busiest-expert share: last 4 steps minus first 3."""
    series = [r["moe/load_max_share/mean"] for _, r in sorted(rows.items()) if "moe/load_max_share/mean" in r]
    if len(series) < 7:
        return None
    return float(np.mean(series[-4:]) - np.mean(series[:3]))


def compare_scenarios(runs: dict[str, dict[str, Path]], models: dict[str, Model], family: str) -> list[dict]:
    rows = []
    for scenario, by_model in runs.items():
        loaded = [load_run(by_model["original"], "original")] + [
            load_run(path, name) for name, path in by_model.items() if name != "original"]
        ref = loaded[0]
        for run, c in zip(loaded[1:], compare_runs(loaded, list(KEY_METRICS), permutations=PERMUTATIONS)[1:]):
            model = models.get(c.run, models["original"])
            rows.append({
                "family": family, "scenario": scenario, "proxy": c.run, "keep_ratio": model.ratio,
                "median_pearson": c.median_pearson,
                "shuffled": dataclasses.asdict(c.shuffled) if c.shuffled else None,
                "pearson": {m: s.pearson for m, s in c.metrics.items()},
                "original_failures": ref.onsets, "proxy_failures": c.onsets,
                "reproduced": {sig: sig in c.onsets for sig in ref.onsets},
                "onset_shift": c.onset_shift, "step_time_ratio": c.step_time_ratio,
                "load_shift": load_shift(run.rows), "original_load_shift": load_shift(ref.rows),
                "max_activation": max((r.get("numerics/max_activation", 0.0) for r in run.rows.values()),
                                      default=None),
                "keeps_super": model.keeps_super,
                "planned_devices": planned_devices(model.ratio),
            })
    return rows


def planned_devices(ratio: float) -> dict:
    p = estimate(REAL, SizingOptions(keep_ratio=ratio))
    return {"original": p.original.devices, "proxy": p.proxy.devices}


# ---------------------------------------------------------------- 6. tables and plots

def fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None or not np.isfinite(value) else f"{value:.{digits}f}"


def failures_text(onsets: dict[str, int]) -> str:
    return ", ".join(f"{k} ({v})" for k, v in sorted(onsets.items(), key=lambda i: i[1])) or "none"


def reproduced_text(r: dict) -> str:
    if not r["original_failures"]:
        return "n/a (no failure)" + (" - false alarm" if r["proxy_failures"] else "")
    return ", ".join(f"{sig}: {'yes' if ok else 'no'}"
                     + (f" ({r['onset_shift'][sig]:+d})" if ok and r["onset_shift"].get(sig) is not None else "")
                     for sig, ok in r["reproduced"].items())


def full_table(rows: list[dict]) -> str:
    lines = ["| family | scenario | proxy | median Pearson | shuffled: mean / p | reward Pearson | "
             "grad-norm Pearson | original failure (step) | proxy failure (step) | reproduced | "
             "load shift (orig / proxy) | max activation | step time vs orig | planned devices (30B-A3B) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sh = r["shuffled"] or {}
        d = r["planned_devices"]
        lines.append(
            f"| {r['family']} | {r['scenario']} | {r['proxy']} | {fmt(r['median_pearson'])} | "
            f"{fmt(sh.get('mean'))} / {fmt(sh.get('p_value'), 3)} | {fmt(r['pearson'].get('critic/rewards/mean'))} | "
            f"{fmt(r['pearson'].get('actor/grad_norm'))} | {failures_text(r['original_failures'])} | "
            f"{failures_text(r['proxy_failures'])} | {reproduced_text(r)} | "
            f"{fmt(r['original_load_shift'])} / {fmt(r['load_shift'])} | {fmt(r['max_activation'], 0)} | "
            f"{fmt(r['step_time_ratio'])}x | {d['proxy']} vs {d['original']} |")
    return "\n".join(lines) + "\n"


def fault_cell(row: dict | None, signature: str) -> str:
    """Did the proxy show the original's `signature` failure in this scenario (onset shift)?"""
    if row is None:
        return "n/a"
    mine, theirs = row["proxy_failures"].get(signature), row["original_failures"].get(signature)
    if theirs is None:
        return "neither" if mine is None else f"false alarm ({mine})"
    return "no" if mine is None else f"yes ({mine - theirs:+d})"


def alarm_cell(row: dict | None) -> str:
    """A scenario where the original may not fail: does the proxy stay as quiet?"""
    if row is None:
        return "n/a"
    if row["original_failures"]:
        return reproduced_text(row)
    return "quiet" if not row["proxy_failures"] else "false alarm: " + failures_text(row["proxy_failures"])


def summary_tables(rows: list[dict], quality: dict[str, dict], seeds: dict[str, dict[str, list]]) -> str:
    """The per-proxy tables of docs/fidelity.md: tracking, faults, model quality."""
    at = {(r["family"], r["scenario"], r["proxy"]): r for r in rows}
    tracked = [n for n in quality["main"] if n != "original"] + [CONTROL]
    super_only = [n for n in quality["super"] if n not in tracked and n != "original"]
    return "\n".join(tracking_table(at, tracked, quality, seeds) + [""] + fault_table(rows, at, tracked + super_only)
                     + [""] + quality_table(quality)) + "\n"


def tracking_table(at: dict, names: list[str], quality: dict[str, dict], seeds: dict[str, dict[str, list]]
                   ) -> list[str]:
    """Clean-scenario correlation, its shuffled control and the seed mean, before and after the
    healing phase. `seeds`: family -> proxy -> median Pearson with seeds 1-3 (--seed-study)."""
    lines = ["| proxy | held-out loss | gate mass kept | clean: median Pearson | clean: shuffled mean (p) | "
             "clean, mean of 4 seeds | after healing phase: median Pearson | after healing: shuffled mean (p) | "
             "after healing, mean of 4 seeds | held-out loss after healing |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def cells(family: str, name: str) -> str:
        r = at.get((family, "clean", name))
        if r is None:
            return "n/a | n/a | n/a"
        sh = r["shuffled"] or {}
        values = [v for v in [r["median_pearson"], *seeds.get(family, {}).get(name, [])] if v is not None]
        mean = fmt(float(np.mean(values))) if len(values) > 1 else "n/a"
        return f"{fmt(r['median_pearson'])} | {fmt(sh.get('mean'))} ({fmt(sh.get('p_value'), 3)}) | {mean}"

    for name in names:
        q = quality["main"].get(name, quality["main"]["original"])  # the control is the original
        qh = quality["healed"].get(name, quality["healed"]["original"])
        lines.append(f"| {name} | {fmt(q['held_out_loss'], 3)} | {fmt(q['gate_mass'])} | {cells('main', name)} | "
                     f"{cells('healed', name)} | {fmt(qh['held_out_loss'], 3)} |")
    return lines


def fault_table(rows: list[dict], at: dict, names: list[str]) -> list[str]:
    """Per proxy: the original's failures reproduced or not, false alarms, load shifts, and the
    planted super expert kept or not; first the original's own onsets."""
    lines = ["| proxy | lr-spike | faulty-op | fp16-no-scaling | router-scale | "
             "high-lr, balance losses off: divergence / collapse / load shift | same, losses on: collapse / "
             "load shift | fp16 super expert: keeps it / overflow |",
             "|---|---|---|---|---|---|---|---|"]
    reference = {(r["family"], r["scenario"]): r for r in rows}

    def onset(family: str, scenario: str, signature: str) -> str:
        r = reference.get((family, scenario))
        step = r["original_failures"].get(signature) if r else None
        return "n/a" if r is None else "none" if step is None else f"{signature} ({step})"

    def original_shift(scenario: str) -> str:
        r = reference.get(("main", scenario))
        return fmt(r["original_load_shift"]) if r else "n/a"

    router = reference.get(("main", "router-scale"))
    lines.append(f"| original (reference) | {onset('main', 'lr-spike', 'divergence')} | "
                 f"{onset('main', 'faulty-op', 'divergence')} | {onset('main', 'fp16-no-scaling', 'underflow')} | "
                 f"{failures_text(router['original_failures']) if router else 'n/a'} | "
                 f"{onset('main', 'high-lr', 'divergence')} / {onset('main', 'high-lr', 'collapse')} / "
                 f"{original_shift('high-lr')} | {onset('main', 'high-lr-balanced', 'collapse')} / "
                 f"{original_shift('high-lr-balanced')} | yes / {onset('super', 'fp16-super', 'overflow')} |")
    for name in names:
        off, on = at.get(("main", "high-lr", name)), at.get(("main", "high-lr-balanced", name))
        sup = at.get(("super", "fp16-super", name))
        keeps = "n/a" if sup is None or sup["keeps_super"] is None else ("yes" if sup["keeps_super"] else "no")
        lines.append(
            f"| {name} | {fault_cell(at.get(('main', 'lr-spike', name)), 'divergence')} | "
            f"{fault_cell(at.get(('main', 'faulty-op', name)), 'divergence')} | "
            f"{fault_cell(at.get(('main', 'fp16-no-scaling', name)), 'underflow')} | "
            f"{alarm_cell(at.get(('main', 'router-scale', name)))} | "
            f"{fault_cell(off, 'divergence')} / {fault_cell(off, 'collapse')} / "
            f"{fmt(off['load_shift']) if off else 'n/a'} | "
            f"{fault_cell(on, 'collapse')} / {fmt(on['load_shift']) if on else 'n/a'} | "
            f"{keeps} / {fault_cell(sup, 'overflow')} |")
    return lines


def quality_table(quality: dict[str, dict]) -> list[str]:
    lines = ["| family | model | held-out loss | task reward at step 0 | gate mass kept |", "|---|---|---|---|---|"]
    for family, by_name in quality.items():
        for name, q in by_name.items():
            lines.append(f"| {family} | {name} | {fmt(q['held_out_loss'], 3)} | "
                         f"{fmt(q.get('reward_step0'), 3)} | {fmt(q['gate_mass'])} |")
    return lines


def plots(runs: dict[str, dict[str, Path]], prefix: str = "") -> None:
    metrics = ["critic/rewards/mean", "actor/grad_norm", "actor/kl_loss", "actor/entropy",
               "moe/router_entropy/mean", "moe/load_max_share/mean", "numerics/max_activation"]
    for scenario, by_model in runs.items():
        for ratio in RATIOS:
            names = ["original", CONTROL] + [n for n in by_model if n.endswith(f"-{ratio:g}")]
            loaded = [load_run(by_model[n], n) for n in names]
            plot_curves(loaded, metrics, OUT, name=f"{prefix}{scenario}-{ratio:g}.png")


def seed_study(models: dict[str, Model], steps: int, name: str, seeds: tuple[int, ...] = (1, 2, 3)) -> str:
    """The clean scenario again with other prompts and sampling seeds: how stable is each
    proxy's median Pearson? (The control uses seed + 1 with the same prompts.)"""
    scores: dict[str, list[float | None]] = {}
    for seed in seeds:
        runs = run_scenarios(models, {"clean": {}}, OUT / name / str(seed), steps, seed=seed)["clean"]
        loaded = [load_run(runs["original"], "original")] + [
            load_run(path, n) for n, path in runs.items() if n != "original"]
        for c in compare_runs(loaded, list(KEY_METRICS))[1:]:
            scores.setdefault(c.run, []).append(c.median_pearson)
    lines = ["| proxy | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
             "|---|" + "---|" * (len(seeds) + 1)]
    for proxy, values in scores.items():
        finite = [v for v in values if v is not None]
        lines.append(f"| {proxy} | " + " | ".join(fmt(v) for v in values) + f" | {fmt(np.mean(finite))} |")
    text = "\n".join(lines) + "\n"
    (OUT / f"{name}.md").write_text(text)
    (OUT / f"{name}.json").write_text(json.dumps(scores, indent=2))
    return text


def collapse_study(models: dict[str, Model], steps: int, seeds: tuple[int, ...] = (0, 1, 2, 3)) -> str:
    """high-lr with the balance losses off and on, with seeds 0-3 (seed 0: the main run's, reused
    from its cache): how often does each model's routing collapse, and how far does its load drift?"""
    stats: dict[str, dict[str, list]] = {}
    for seed in seeds:
        for scenario in ("high-lr", "high-lr-balanced"):
            out = OUT / "runs" if seed == 0 else OUT / "collapse" / str(seed)
            runs = run_scenarios(models, {scenario: SCENARIOS[scenario]}, out, steps, seed=seed)[scenario]
            for name, path in runs.items():
                run = load_run(path, name)
                entry = stats.setdefault(name, {})
                entry.setdefault(f"{scenario}/collapse", []).append(run.onsets.get("collapse"))
                entry.setdefault(f"{scenario}/load_shift", []).append(load_shift(run.rows))
    (OUT / "collapse.json").write_text(json.dumps(stats, indent=2))
    lines = ["| model | losses off: collapsed (seeds) | losses off: mean load shift | losses on: collapsed (seeds) | "
             "losses on: mean load shift |", "|---|---|---|---|---|"]
    for name, entry in stats.items():
        cells = []
        for scenario in ("high-lr", "high-lr-balanced"):
            onsets = entry[f"{scenario}/collapse"]
            shifts = [v for v in entry[f"{scenario}/load_shift"] if v is not None]
            cells += [f"{sum(o is not None for o in onsets)}/{len(onsets)}", fmt(float(np.mean(shifts)))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (OUT / "collapse.md").write_text(text)
    return text


def quality_of(models: dict[str, Model], clean_runs: dict[str, Path]) -> dict[str, dict]:
    return {name: {"held_out_loss": held_out_loss(m.path), "gate_mass": m.gate_mass,
                   "reward_step0": load_run(clean_runs[name]).rows[0]["critic/rewards/mean"]}
            for name, m in models.items()}


def main() -> int:
    global OUT, RATIOS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a smoke run of the whole pipeline in seconds: a tiny "
                        "original trained 2 steps, 2 variants at 50%%, the clean and super-expert scenarios, "
                        "2 RL steps, one seed")
    parser.add_argument("--seed-study", action="store_true",
                        help="only the clean scenario with 3 more seeds, before and after the healing phase "
                        "(seeds.md, seeds-healed.md): how stable the scores are")
    parser.add_argument("--collapse-study", action="store_true",
                        help="only high-lr with the balance losses off and on, seeds 0-3 (collapse.md)")
    parser.add_argument("--out", type=Path, help="where to write (default: bench/out/fidelity, with --quick "
                        "bench/out/fidelity-quick)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    # One thread: on a shared 2-core machine, two torch threads per process thrash (measured
    # 13x slower under load); one is as fast when the machine is idle.
    torch.set_num_threads(1)
    for noisy in ("moe_proxy", "transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    variants, super_variants = VARIANTS, SUPER_VARIANTS
    if args.quick:
        MODEL.update(QUICK_MODEL)
        TRAIN.update(QUICK_BATCH)
        HEAL_PHASE.update(QUICK_BATCH, steps=1)
        RL.update(QUICK_RL)
        args.steps = 2
        RATIOS = (0.5,)  # 4 of 8 experts (top-2)
        OUT = OUT.with_name("fidelity-quick")
        for name in list(SCENARIOS)[1:]:
            del SCENARIOS[name]
        for settings in SUPER_SCENARIOS.values():  # both: the fp16 one overflows, the fp32 one scores quality
            settings["steps"] = args.steps
        variants = [v for v in VARIANTS if v[0] in QUICK_VARIANTS]
        super_variants = [v for v in SUPER_VARIANTS if v[0] in QUICK_VARIANTS + ("frequency-no-super",)]
    OUT = args.out or OUT
    OUT.mkdir(parents=True, exist_ok=True)
    started = time.time()
    original = OUT / "original"
    info = train_original(original)
    log.info("original: held-out loss %.3f, trained in %ss", info["held_out_loss"], info["train_seconds"])
    stats = OUT / "calibration"
    code_checked(stats, lambda: calibrate(str(original), str(stats), token_ids=calibration_ids()))
    main_models = build_family(original, stats, OUT / "proxies", variants)
    healed_models = {name: healing_phase(m, OUT / "healed" / name) for name, m in main_models.items()}
    if args.seed_study:
        print(seed_study(main_models, args.steps, "seeds"))
        print(seed_study(healed_models, args.steps, "seeds-healed"))
        return 0
    if args.collapse_study:
        print(collapse_study(main_models, args.steps))
        return 0

    planted = OUT / "original-super"
    super_info = plant_super_expert(original, stats, planted)
    log.info("planted super expert: %s", {k: v for k, v in super_info.items() if k != "key"})
    super_stats = OUT / "calibration-super"
    code_checked(super_stats, lambda: calibrate(str(planted), str(super_stats), token_ids=calibration_ids()))
    super_models = build_family(planted, super_stats, OUT / "proxies-super", super_variants, super_info)

    runs = {"main": run_scenarios(main_models, SCENARIOS, OUT / "runs", args.steps),
            "healed": run_scenarios(healed_models, HEALED_SCENARIOS, OUT / "runs-healed", args.steps),
            "super": run_scenarios(super_models, SUPER_SCENARIOS, OUT / "runs-super", args.steps)}
    families = {"main": main_models, "healed": healed_models, "super": super_models}
    rows = [row for family, by_scenario in runs.items()
            for row in compare_scenarios(by_scenario, families[family], family)]
    quality = {"main": quality_of(main_models, runs["main"]["clean"]),
               "healed": quality_of(healed_models, runs["healed"]["clean"]),
               "super": quality_of(super_models, runs["super"]["fp32-super"])}
    plots(runs["main"])
    plots(runs["healed"], prefix="healed-")
    plots(runs["super"])
    seeds = {family: json.loads((OUT / f"{name}.json").read_text())
             for family, name in (("main", "seeds"), ("healed", "seeds-healed")) if (OUT / f"{name}.json").exists()}
    summary = summary_tables(rows, quality, seeds)
    (OUT / "summary.md").write_text(summary)
    (OUT / "table.md").write_text(full_table(rows))
    (OUT / "results.json").write_text(json.dumps(
        {"model": MODEL, "train": TRAIN | {k: v for k, v in info.items() if k != "key"}, "heal_phase": HEAL_PHASE,
         "rl": RL, "fault_step": FAULT_STEP, "permutations": PERMUTATIONS, "planted": super_info,
         "scenarios": {k: {kk: (dataclasses.asdict(vv) if dataclasses.is_dataclass(vv) else vv)
                           for kk, vv in v.items()} for k, v in {**SCENARIOS, **SUPER_SCENARIOS}.items()},
         "quality": quality, "rows": rows, "wall_s": round(time.time() - started, 1)}, indent=2, default=str))
    print(summary)
    log.info("done in %.0fs; results in %s", time.time() - started, OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
