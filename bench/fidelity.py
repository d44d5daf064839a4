"""The fidelity lab: do RL steps on a proxy behave like RL steps on the original?

1. Train a small Qwen3-MoE "original" (byte-level, 64 experts, top-4) on the Python standard
   library's own sources mixed with the task's format ("12+7=19" lines), long enough that its
   experts specialise. Cached in bench/out/fidelity/original (delete it to retrain).
2. Build proxies at 50% and 12.5% of the experts: clustering on router rows and on expert
   weights, routing-profile clustering and `frequency` (both from an in-memory calibration
   pass), and the `random` and `first-n` baselines.
3. Run the same RL steps (`moe-proxy repro` settings, same seed) on every model, without a
   fault and with each injected fault, plus a high-learning-rate scenario where the failure
   comes from the model's own dynamics rather than from a knob.
4. Compare every proxy run with the original's run of the same scenario (`moe-proxy compare`
   statistics), write results.json, table.md and plots under bench/out/fidelity/.

    .venv/bin/python bench/fidelity.py [--steps 20] [--quick]

About 20-30 minutes on 2 busy CPU cores the first time (training included), less when cached.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "transformer"))

from moe_proxy.build import build_proxy  # noqa: E402
from moe_proxy.compare import KEY_METRICS, compare_runs, load_run  # noqa: E402
from moe_proxy.plots import plot_curves  # noqa: E402
from moe_proxy.planner import PlanOptions, plan  # noqa: E402
from moe_proxy.repro import Faults, ReproConfig, run_repro  # noqa: E402
from moe_proxy.routing_stats import collect, routing_pins  # noqa: E402

OUT = ROOT / "bench" / "out" / "fidelity"
MODEL = dict(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, intermediate_size=256, moe_intermediate_size=64, num_experts=64, num_experts_per_tok=4,
             norm_topk_prob=True, router_aux_loss_coef=0.01, output_router_logits=True, tie_word_embeddings=False,
             max_position_embeddings=512)
TRAIN = dict(steps=1000, batch=16, seq_len=128, lr=3e-3, seed=0, task_share=0.3)
# A Qwen3-30B-A3B-shaped config: planned devices are reported for a real size at the same keep ratio.
REAL = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
RL = dict(lr=2e-5, batch_size=8, group_size=4, max_new_tokens=6, kl_coef=0.01, mini_batches=2)
FAULT_STEP = 6
SCENARIOS = {
    "clean": {},
    "lr-spike": dict(faults=Faults(lr_spike_step=FAULT_STEP, lr_spike_factor=300)),
    "router-scale": dict(faults=Faults(router_scale_step=FAULT_STEP, router_scale_factor=8)),
    "faulty-op": dict(faults=Faults(op_module="model.layers.2.mlp", op_step=FAULT_STEP, op_mode="scale",
                                    op_value=30.0)),
    "fp16-no-scaling": dict(faults=Faults(fp16_no_scaling_step=FAULT_STEP)),
    "high-lr": dict(lr=1e-3),  # no injected fault: does the proxy fail like the original on its own?
}
PROXIES = [  # (name, method, features)
    ("cluster-router", "cluster", "router"),
    ("cluster-weights", "cluster", "weights"),
    ("routing", "routing", None),
    ("frequency", "frequency", None),
    ("random", "random", None),
]
log = logging.getLogger("fidelity")


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


def train_original(path: Path) -> dict:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    key = {"model": MODEL, "train": TRAIN}
    stamp = path / "fidelity-train.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("key") == key:
        log.info("original: cached in %s", path)
        return json.loads(stamp.read_text())
    torch.manual_seed(TRAIN["seed"])
    rng = random.Random(TRAIN["seed"])
    text = np.frombuffer(corpus(), dtype=np.uint8)
    held_out, text = text[-200_000:], text[:-200_000]
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MODEL))
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN["lr"], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, TRAIN["lr"], total_steps=TRAIN["steps"], pct_start=0.05)
    seq, started, losses = TRAIN["seq_len"], time.time(), []
    for step in range(TRAIN["steps"]):
        rows = []
        for _ in range(TRAIN["batch"]):
            if rng.random() < TRAIN["task_share"]:
                rows.append(np.frombuffer(task_lines(rng, seq), dtype=np.uint8))
            else:
                start = rng.randrange(len(text) - seq)
                rows.append(text[start:start + seq])
        ids = torch.tensor(np.stack(rows), dtype=torch.long)
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
        held_out = np.frombuffer(corpus(), dtype=np.uint8)[-200_000:]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    starts = np.linspace(0, len(held_out) - seq - 1, n).astype(int)
    ids = torch.tensor(np.stack([held_out[s:s + seq] for s in starts]), dtype=torch.long)
    return float(model(input_ids=ids, labels=ids).loss)


# ---------------------------------------------------------------- 2. proxies

def build_all(original: Path) -> dict[str, Path]:
    rng = np.random.default_rng(1)
    text = np.frombuffer(corpus(), dtype=np.uint8)[:-200_000]
    calib = [torch.tensor(np.stack([text[s:s + 128] for s in rng.integers(0, len(text) - 129, 8)]), dtype=torch.long)
             for _ in range(4)]
    calib.append(torch.tensor(np.stack([np.frombuffer(task_lines(random.Random(i), 128), dtype=np.uint8)
                                        for i in range(8)]), dtype=torch.long))
    stats = collect(original, calib)
    proxies = {}
    for ratio in (0.5, 0.125):
        k = int(MODEL["num_experts"] * ratio)
        for name, method, features in PROXIES:
            dst = OUT / "proxies" / f"{name}-{ratio:g}"
            if method in ("frequency", "routing"):
                pins = routing_pins(stats, k, method)
                build_proxy(str(original), str(dst), experts=k, method="first-n", pins=pins, overwrite=True)
            else:
                build_proxy(str(original), str(dst), experts=k, method=method, features=features or "router",
                            overwrite=True)
            proxies[dst.name] = dst
    mass = {}
    for name, path in proxies.items():  # share of the original's gate mass the kept experts carried
        kept = {v["layer"]: v["kept"] for v in json.loads((path / "proxy-manifest.json").read_text())["layers"].values()}
        mass[name] = float(np.mean([stats[layer].gate_mass[kept[layer]].sum() / stats[layer].gate_mass.sum()
                                    for layer in kept]))
    (OUT / "gate_mass_kept.json").write_text(json.dumps(mass, indent=2))
    return proxies


# ---------------------------------------------------------------- 3-4. runs and comparison

CONTROL = "original-reseeded"  # the original again, same prompts, other samples: the noise floor


def run_all(models: dict[str, Path], steps: int) -> dict[str, dict[str, Path]]:
    runs: dict[str, dict[str, Path]] = {}
    for scenario, settings in SCENARIOS.items():
        for name, path in {**models, CONTROL: models["original"]}.items():
            out = OUT / "runs" / scenario / name
            seed = 1 if name == CONTROL else 0
            config = ReproConfig(steps=steps, seed=seed, prompt_seed=0, **(RL | settings))
            started = time.time()
            result = run_repro(str(path), out, config)
            log.info("%-16s %-22s %5.1fs failures %s", scenario, name, time.time() - started,
                     {k: v["step"] for k, v in result.failures.items()} or "none")
            runs.setdefault(scenario, {})[name] = out
    return runs


def seed_study(models: dict[str, Path], steps: int, seeds: tuple[int, ...] = (1, 2, 3)) -> str:
    """The clean scenario again with other prompts and sampling seeds: how stable is each
    proxy's median Pearson? (The control uses seed + 100 with the same prompts.)"""
    scores: dict[str, list[float | None]] = {}
    for seed in seeds:
        runs = {}
        for name, path in {**models, CONTROL: models["original"]}.items():
            out = OUT / "seeds" / str(seed) / name
            run_seed = seed + 100 if name == CONTROL else seed
            run_repro(str(path), out, ReproConfig(steps=steps, seed=run_seed, prompt_seed=seed, **RL))
            runs[name] = out
        loaded = [load_run(runs["original"], "original")] + [
            load_run(path, name) for name, path in runs.items() if name != "original"]
        for c in compare_runs(loaded, list(KEY_METRICS))[1:]:
            scores.setdefault(c.run, []).append(c.median_pearson)
        log.info("seed %d done", seed)
    lines = ["| proxy | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
             "|---|" + "---|" * (len(seeds) + 1)]
    for name, values in scores.items():
        finite = [v for v in values if v is not None]
        cells = ["n/a" if v is None else f"{v:.2f}" for v in values]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {np.mean(finite):.2f} |")
    text = "\n".join(lines) + "\n"
    (OUT / "seeds.md").write_text(text)
    (OUT / "seeds.json").write_text(json.dumps(scores, indent=2))
    return text


def planned_devices(ratio: float) -> dict:
    p = plan(REAL, PlanOptions(keep_ratio=ratio))
    return {"original": p.original.devices, "proxy": p.proxy.devices}


def summarise(runs: dict[str, dict[str, Path]], models: dict[str, Path]) -> list[dict]:
    rows = []
    for scenario, by_model in runs.items():
        loaded = [load_run(by_model["original"], "original")] + [
            load_run(path, name) for name, path in by_model.items() if name != "original"]
        for c in compare_runs(loaded, [m for m in KEY_METRICS])[1:]:
            ref = loaded[0].onsets
            ratio = 1.0 if c.run == CONTROL else 0.5 if c.run.endswith("-0.5") else 0.125
            rows.append({
                "scenario": scenario, "proxy": c.run, "keep_ratio": ratio, "median_pearson": c.median_pearson,
                "pearson": {m: s.pearson for m, s in c.metrics.items()},
                "reward_error": c.metrics["critic/rewards/mean"].normalised_error,
                "original_failures": ref, "proxy_failures": c.onsets,
                "reproduced": {sig: sig in c.onsets for sig in ref},
                "onset_shift": c.onset_shift, "step_time_ratio": c.step_time_ratio,
                "planned_devices": planned_devices(ratio),
            })
    return rows


def table(rows: list[dict], quality: dict[str, dict]) -> str:
    lines = ["| scenario | proxy | median Pearson | reward Pearson | grad-norm Pearson | original failure (step) | "
             "proxy failure (step) | reproduced | step time vs orig | planned devices (30B-A3B shape) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        orig = ", ".join(f"{k} ({v})" for k, v in sorted(r["original_failures"].items(), key=lambda i: i[1])) or "none"
        prox = ", ".join(f"{k} ({v})" for k, v in sorted(r["proxy_failures"].items(), key=lambda i: i[1])) or "none"
        if r["original_failures"]:
            rep = ", ".join(f"{sig}: {'yes' if ok else 'no'}"
                            + (f" ({r['onset_shift'][sig]:+d})" if ok and r["onset_shift"].get(sig) is not None else "")
                            for sig, ok in r["reproduced"].items())
        else:
            rep = "n/a (no failure)" + (" - false alarm" if r["proxy_failures"] else "")
        fmt = lambda v: "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"
        d = r["planned_devices"]
        lines.append(f"| {r['scenario']} | {r['proxy']} | {fmt(r['median_pearson'])} | "
                     f"{fmt(r['pearson'].get('critic/rewards/mean'))} | {fmt(r['pearson'].get('actor/grad_norm'))} | "
                     f"{orig} | {prox} | {rep} | {fmt(r['step_time_ratio'])}x | {d['proxy']} vs {d['original']} |")
    lines += ["", "| model | held-out loss (nats/byte) | task reward at step 0 | gate mass kept |", "|---|---|---|---|"]
    for name, q in quality.items():
        mass = "1.00" if name == "original" else f"{q.get('gate_mass', float('nan')):.2f}"
        lines.append(f"| {name} | {q['held_out_loss']:.3f} | {q['reward_step0']:.3f} | {mass} |")
    return "\n".join(lines) + "\n"


def plots(runs: dict[str, dict[str, Path]]) -> None:
    metrics = ["critic/rewards/mean", "actor/grad_norm", "actor/kl_loss", "actor/entropy",
               "moe/router_entropy/mean", "moe/load_max_share"]
    for scenario, by_model in runs.items():
        for ratio in ("0.5", "0.125"):
            names = ["original", CONTROL] + [n for n in by_model if n.endswith(f"-{ratio}")]
            loaded = [load_run(by_model[n], n) for n in names]
            plot_curves(loaded, metrics, OUT, name=f"{scenario}-{ratio}.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="few training steps, for a smoke run")
    parser.add_argument("--seed-study", action="store_true",
                        help="only the clean scenario with 3 more seeds (seeds.md): how stable the scores are")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    # One thread: on a shared 2-core machine, two torch threads per process thrash (measured
    # 13x slower under load); one is as fast when the machine is idle.
    torch.set_num_threads(1)
    for noisy in ("moe_proxy", "transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.quick:  # smoke run of the whole pipeline: 2 scenarios, 2 proxy kinds
        TRAIN["steps"] = 30
        global OUT
        OUT = OUT.with_name("fidelity-quick")
        for name in list(SCENARIOS)[2:]:
            del SCENARIOS[name]
        del PROXIES[1:-1]
    OUT.mkdir(parents=True, exist_ok=True)
    started = time.time()
    original = OUT / "original"
    info = train_original(original)
    log.info("original: held-out loss %.3f, trained in %ss", info["held_out_loss"], info["train_seconds"])
    models = {"original": original, **build_all(original)}
    if args.seed_study:
        print(seed_study(models, args.steps))
        return 0
    mass = json.loads((OUT / "gate_mass_kept.json").read_text())
    quality = {name: {"held_out_loss": held_out_loss(path), "gate_mass": mass.get(name)}
               for name, path in models.items()}
    runs = run_all(models, args.steps)
    for name in models:  # task skill before any RL update: the clean run's first-step reward
        quality[name]["reward_step0"] = load_run(runs["clean"][name]).rows[0]["critic/rewards/mean"]
    rows = summarise(runs, models)
    plots(runs)
    (OUT / "results.json").write_text(json.dumps(
        {"model": MODEL, "train": TRAIN | {k: v for k, v in info.items() if k != "key"}, "rl": RL,
         "fault_step": FAULT_STEP, "scenarios": {k: {kk: (dataclasses.asdict(vv) if dataclasses.is_dataclass(vv)
                                                           else vv) for kk, vv in v.items()}
                                                 for k, v in SCENARIOS.items()},
         "quality": quality, "rows": rows, "wall_s": round(time.time() - started, 1)}, indent=2, default=str))
    text = table(rows, quality)
    (OUT / "table.md").write_text(text)
    print(text)
    log.info("done in %.0fs; results in %s", time.time() - started, OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
