"""Check the RL step's cost model (moe_proxy.step_cost, behind `moe-proxy plan`) against
measured steps, and print the published models' plan table.

1. `--table`: device-hours per RL step by phase for DeepSeek-V3, Qwen3-235B-A22B and
   Qwen3-30B-A3B at 50%, 25% and 12.5% of the experts (the plan's defaults), as
   docs/performance.md shows it.
2. The check (default): this machine's CPU as an accelerator (matmul FLOP/s and memory
   bandwidth measured with torch, one thread, links infinitely fast: one process), a lab-like
   Qwen3-MoE original (random weights, made with transformers' classes) and its 50% and 12.5%
   proxies (`moe-proxy build`'s code, router features). Each runs `moe-proxy repro`'s steps;
   the model predicts `timing_s/gen` (prefill + decode), `old_log_prob`, `ref` and
   `update_actor` (training + optimizer) from the run's own batch shape; prediction beside
   measurement (the mean over the steps after the first).

    .venv/bin/python bench/rl_cost.py [--quick] [--table] [--widths 128,512] [--steps 3] [--out DIR]

--quick: one tiny width, 2 steps of a small batch (seconds; tests/bench runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "src"))

from moe_proxy.architectures import detect, expert_count, top_k  # noqa: E402
from moe_proxy.checkpoint.params import config_params, moe_layer_indices  # noqa: E402
from moe_proxy.demo.published import PUBLISHED  # noqa: E402
from moe_proxy.sizing import ACCELERATORS, SizingOptions, estimate, model_shape  # noqa: E402
from moe_proxy.step_cost import Accelerator, Phases, StepShape, phases  # noqa: E402

# The fidelity lab's Qwen3-MoE (bench/fidelity.py MODEL) with the hidden and expert widths scaled.
LAB = dict(vocab_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=64,
           num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[], max_position_embeddings=512)
RATIOS = (0.5, 0.125)
MEASURED = ("timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor")


def lab_config(width: int) -> dict:
    return LAB | dict(hidden_size=width, head_dim=width // 4, intermediate_size=2 * width,
                      moe_intermediate_size=width // 2)


# ---------------------------------------------------------------- 1. the published models' table

def published_table(accelerators=("huawei.com/Ascend910", "H200")) -> str:
    names = ("rollout_decode", "optimizer", "weight_sync", "all_to_all", "train")
    lines = [f"| model | accelerator | kept experts | devices | device-h/step original | proxy | ratio | "
             f"{' | '.join(n.replace('_', ' ') for n in names)} |", "|" + "---|" * (7 + len(names))]
    for model, config in PUBLISHED.items():
        for acc in accelerators:
            for ratio in (0.5, 0.25, 0.125):
                p = estimate(config, SizingOptions(keep_ratio=ratio, accelerator=acc))
                t = p.phase_table()
                lines.append(f"| {model} | {ACCELERATORS[acc].name} | {p.proxy.experts_per_layer} of "
                             f"{p.original.experts_per_layer} ({ratio:g}) | {p.original.devices} -> {p.proxy.devices} | "
                             f"{t['total']['original']:.3g} | {t['total']['proxy']:.3g} | {t['total']['ratio']:.3f} | "
                             + " | ".join(f"{t[n]['ratio']:.2f}" for n in names) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- 2. the CPU as an accelerator

def measure_cpu(quick: bool) -> Accelerator:
    """Matmul FLOP/s (fp32, square matrices) and memory bandwidth (a copy: read + write), one
    thread, the best of a few tries."""
    import torch

    n, size = (512, 1 << 24) if quick else (1536, 1 << 26)
    a, b = torch.randn(n, n), torch.randn(n, n)
    src, dst = torch.empty(size // 4), torch.empty(size // 4)
    flops, bandwidth = 0.0, 0.0
    for _ in range(3 if quick else 5):
        t = time.perf_counter()
        torch.mm(a, b)
        flops = max(flops, 2 * n ** 3 / (time.perf_counter() - t))
        t = time.perf_counter()
        dst.copy_(src)
        bandwidth = max(bandwidth, 2 * size / (time.perf_counter() - t))
    return Accelerator("cpu", 1e6, flops / 1e12, bandwidth / 1e12, name="this CPU, 1 thread")


def make_models(out: Path, width: int) -> dict[str, Path]:
    from moe_proxy.pruning.build import build_proxy
    from moe_proxy.demo.tiny import make_tiny
    from moe_proxy.options import PruningOptions

    original = out / f"w{width}" / "original"
    if not (original / "config.json").exists():
        make_tiny("qwen3_moe", original, **lab_config(width))
    models = {"original": original}
    for ratio in RATIOS:
        dst = out / f"w{width}" / f"proxy-{ratio:g}"
        if not (dst / "proxy-manifest.json").exists():
            build_proxy(str(original), str(dst), PruningOptions(experts=int(LAB["num_experts"] * ratio)),
                        overwrite=True)
        models[f"proxy {ratio:g}"] = dst
    return models


@dataclass(frozen=True)
class Row:
    width: int
    model: str
    experts: int
    predicted: dict[str, float]
    measured: dict[str, float]


def predict(path: Path, cpu: Accelerator, sequences: int, prompt: int, response: int, updates: int) -> dict[str, float]:
    """The model's figures for repro's timings: one device, fp32, no recomputation, no links."""
    config = json.loads((path / "config.json").read_text())
    params = config_params(config)
    arch = detect(config)
    shape = model_shape(config, params, expert_count(arch, config), top_k(arch, config),
                        len(moe_layer_indices(config)), "fp32")
    w = StepShape(sequences=sequences, prompt_tokens=prompt, response_tokens=response, updates=updates,
                 recompute=False, mfu=1.0, hbm_efficiency=1.0)
    p: Phases = phases(shape, w, cpu, devices=1, per_node=1, usable_bytes=1e15)
    return {"timing_s/gen": p.rollout_prefill + p.rollout_decode, "timing_s/old_log_prob": p.old_log_prob,
            "timing_s/ref": p.reference, "timing_s/update_actor": p.train + p.optimizer}


def run_and_compare(out: Path, width: int, cpu: Accelerator, config) -> list[Row]:
    from moe_proxy.metrics.readers import read_metrics
    from moe_proxy.rl.runner import run_repro

    rows = []
    for name, path in make_models(out, width).items():
        run = out / f"w{width}" / "runs" / name.replace(" ", "-")
        run_repro(str(path), run, config)
        steps = read_metrics(run)
        later = [m for s, m in sorted(steps.items())][1:]  # the first step pays one-off costs
        measured = {k: sum(m[k] for m in later) / len(later) for k in MEASURED}
        rows_per_step = config.batch_size * config.group_size
        response = round(sum(m["response_length/max"] for m in later) / len(later))  # generation runs to the longest
        tokens = sum(m["perf/total_num_tokens"] for m in later) / len(later) / rows_per_step
        prompt = max(1, round(tokens - sum(m["response_length/mean"] for m in later) / len(later)))
        predicted = predict(path, cpu, rows_per_step, prompt, response, config.mini_batches)
        config_json = json.loads((path / "config.json").read_text())
        experts = expert_count(detect(config_json), config_json)
        rows.append(Row(width, name, experts, predicted, measured))
    return rows


def comparison_table(rows: list[Row]) -> str:
    lines = ["| width | model | experts | " + " | ".join(f"{k.split('/')[1]} predicted / measured s (ratio)"
                                                       for k in MEASURED) + " |", "|" + "---|" * (3 + len(MEASURED))]
    for r in rows:
        cells = [f"{r.predicted[k]:.3g} / {r.measured[k]:.3g} ({r.predicted[k] / r.measured[k]:.2f})" for k in MEASURED]
        lines.append(f"| {r.width} | {r.model} | {r.experts} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_table(rows: list[Row]) -> str:
    """Proxy over original, per phase, predicted and measured: what `plan` reports is this ratio."""
    lines = ["| width | proxy | " + " | ".join(f"{k.split('/')[1]} predicted / measured" for k in MEASURED) + " |",
             "|" + "---|" * (2 + len(MEASURED))]
    originals = {r.width: r for r in rows if r.model == "original"}
    for r in rows:
        o = originals[r.width]
        if r is o:
            continue
        cells = [f"{r.predicted[k] / o.predicted[k]:.2f} / {r.measured[k] / o.measured[k]:.2f}" for k in MEASURED]
        lines.append(f"| {r.width} | {r.model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--table", action="store_true", help="print the published models' table too")
    ap.add_argument("--widths", default=None, help="hidden sizes of the lab originals (default 128,512; quick: 64)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "rl_cost")
    args = ap.parse_args()

    import torch

    from moe_proxy.rl.config import ReproConfig

    torch.set_num_threads(1)  # the figures are one core's: the machine is shared
    if args.table or args.quick:
        print(published_table())
    cpu = measure_cpu(args.quick)
    print(f"\nthis CPU, 1 thread: {cpu.peak_tflops * 1e3:.1f} GFLOP/s fp32 matmul, {cpu.hbm_tbps * 1e3:.1f} GB/s copy")
    widths = [int(w) for w in (args.widths or ("64" if args.quick else "128,512")).split(",")]
    steps = args.steps or (2 if args.quick else 4)
    config = ReproConfig(steps=steps, batch_size=2 if args.quick else 8, group_size=2 if args.quick else 4,
                         max_new_tokens=4 if args.quick else 16, precision="fp32", mini_batches=2)
    rows = [row for w in widths for row in run_and_compare(args.out, w, cpu, config)]
    print(f"\n{config.batch_size} prompts x {config.group_size} answers, up to {config.max_new_tokens} new tokens, "
          f"{config.mini_batches} updates per step, fp32; mean of steps 2-{steps}\n")
    print(comparison_table(rows))
    print("\nproxy / original:\n")
    print(ratio_table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rl_cost.json").write_text(json.dumps(
        {"cpu": {"gflops": cpu.peak_tflops * 1e3, "gbps": cpu.hbm_tbps * 1e3}, "quick": args.quick,
         "rows": [r.__dict__ for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
