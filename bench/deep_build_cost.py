"""Build cost of a deep proxy: sequential calibration + `build --reconstruct` of a real-width
Qwen3-30B-A3B-shaped checkpoint stays one decoder layer resident (peak memory flat with depth).

Writes two bf16 checkpoints with random weights and the real shapes of Qwen3-30B-A3B (hidden
2048, 32 query / 4 key-value heads of 128, 128 experts of width 768, top-8, vocabulary 151936),
differing only in depth (default 4 and 16 layers; one shard per layer, and the shallow one's
shards are hard links to the deep one's, so the disk holds one copy, about 1.25 GB a layer).
Then runs, each in a fresh process through the CLI as a user would (progress on, so the time
of every layer is printed):

    moe-proxy calibrate SRC --out STATS --sequential --experts 16 --method saliency --samples S --seq-len L
    moe-proxy build SRC DST --experts 16 --method saliency --calibration STATS --reconstruct

(`--reconstruct` with at most --steps fit steps per layer: memory, not quality, is shown; the
build also measures its fidelity figure, the original and the fitted and plain proxies layer by
layer in the walk that fits, to keep the fits only if they are closer). Prints peak RSS (VmHWM)
and wall time of each, the per-layer times the commands printed, the build's peak per phase
(reconstruct+fidelity: their one walk, then write; VmHWM reset at each phase's start, see RUN) with what was resident
at its start and end, and writes bench/out/deep_build_cost.json. Deletes the checkpoints and
proxies at the end (--keep: don't; a later run under the same --out links a kept deeper
checkpoint's shards instead of writing them again).

    nice -n 19 .venv/bin/python bench/deep_build_cost.py [--depths 4,16] [--samples 4] [--seq-len 32] [--steps 3]

--quick: a tiny model of the same layout at depths 1 and 2 (a smoke run; figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
QWEN3_30B_A3B = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     moe_intermediate_size=768, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
                     vocab_size=151936)
QUICK = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
             intermediate_size=64, num_experts=16, num_experts_per_tok=2, vocab_size=256)
KEPT = 1 / 8  # 12.5%

# The child process: the CLI command, with --reconstruct's step cap and a peak per phase.
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork+exec. Each phase
# (the library functions wrapped below) starts by resetting VmHWM (`5` to /proc/self/clear_refs,
# Linux >= 4.0) and ends by reading it: "PHASE name peak rss-at-start rss-at-end" (bytes), so a
# phase's peak is its own and what a phase leaves resident shows in the next one's start.
RUN = """import sys
import moe_proxy.pruning.expert_plan as plan, moe_proxy.pruning.build as pipe, moe_proxy.pruning.reconstruct as rec
rec.RECON_STEPS = rec.RECON_PATIENCE = {steps}
from moe_proxy.cli import main

def status(key):
    return [int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith(key)][0]

overall = 0
def phase(name, fn):
    def run(*a, **k):
        global overall
        overall, start = max(overall, status('VmHWM')), status('VmRSS')
        open('/proc/self/clear_refs', 'w').write('5')
        try:
            return fn(*a, **k)
        finally:
            print('PHASE', name, status('VmHWM'), start, status('VmRSS'), flush=True)
    return run

plan.fit_plan = phase('reconstruct+fidelity', plan.fit_plan)  # the fit, the figure and its check of the fits
pipe.write_share = phase('write', pipe.write_share)
sys.argv = ['moe-proxy'] + {argv!r}
try:
    code = main()
finally:
    print('PEAK', max(overall, status('VmHWM')), flush=True)
sys.exit(code)
"""
# reconstruct's "model.layers.3.mlp: held-out ... 12.3 s" (printed and logged: counted once),
# calibrate's "layer   3: ... (4.5 s)"
LAYER_TIME = re.compile(r"^(model\.layers\.\d+\.mlp): held-out.*?, ([\d.]+) s$|^(layer +\d+): .*\(([\d.]+) s\)$")


def config(shape: dict, depth: int) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": depth,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
            "router_aux_loss_coef": 0.001, "attention_bias": False, "torch_dtype": "bfloat16", **shape}


def layer_tensors(shape: dict, i: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Decoder layer i in the Hugging Face hub layout of Qwen3-MoE (per-expert tensors), bf16."""
    h, d, e, w = shape["hidden_size"], shape["head_dim"], shape["num_experts"], shape["moe_intermediate_size"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(dims, generator=gen) * 0.02).to(torch.bfloat16)

    p = f"model.layers.{i}."
    out = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
           p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
           p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
           p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
           p + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
           p + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
           p + "mlp.gate.weight": rand(e, h)}
    for x in range(e):
        out |= {f"{p}mlp.experts.{x}.gate_proj.weight": rand(w, h), f"{p}mlp.experts.{x}.up_proj.weight": rand(w, h),
                f"{p}mlp.experts.{x}.down_proj.weight": rand(h, w)}
    return out


def write_checkpoints(root: Path, shape: dict, depths: list[int]) -> dict[int, Path]:
    """One checkpoint per depth; shards are hard links to the deepest one's (or to those of a
    deeper checkpoint an earlier run kept under `root`: the weights are seeded, so identical)."""
    kept = [int(d.name.split("-")[1]) for d in root.glob("depth-*") if (d / "config.json").exists()]
    deep = max([max(depths)] + kept)
    files: dict[str, list[str]] = {}
    src = root / f"depth-{deep}"
    src.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    names = ["model-embed.safetensors"] + [f"model-layer-{i:03d}.safetensors" for i in range(deep)]
    for n, name in enumerate(names):
        if (src / name).exists():  # from an earlier run (--keep): its tensor names only
            with safe_open(src / name, "pt") as f:
                files[name] = sorted(f.keys())
            continue
        if n == 0:
            v, h = shape["vocab_size"], shape["hidden_size"]
            tensors = {"model.embed_tokens.weight": (torch.randn(v, h, generator=gen) * 0.02).to(torch.bfloat16),
                       "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
                       "lm_head.weight": (torch.randn(v, h, generator=gen) * 0.02).to(torch.bfloat16)}
        else:
            tensors = layer_tensors(shape, n - 1, gen)
        files[name] = sorted(tensors)
        save_file(tensors, src / name, metadata={"format": "pt"})
        del tensors
        print(f"  wrote {name}", flush=True)
    out = {}
    for depth in depths:
        path = root / f"depth-{depth}"
        path.mkdir(exist_ok=True)
        mine = names[: depth + 1]
        for name in mine:
            if path != src and not (path / name).exists():
                os.link(src / name, path / name)
        weight_map = {t: f for f in mine for t in files[f]}
        size = sum((path / f).stat().st_size for f in mine)
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}))
        (path / "config.json").write_text(json.dumps(config(shape, depth), indent=2))
        out[depth] = path
    return out


def run(argv: list[str], steps: int, log: Path) -> dict:
    """One CLI command in a fresh process: its peak RSS, wall time and the per-layer times it printed."""
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-c", RUN.format(steps=steps, argv=argv)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
        lines = []
        for line in proc.stdout:
            f.write(line)
            lines.append(line.rstrip("\n"))
            if not line.startswith(("PEAK", "PHASE")):
                print("    " + line.rstrip("\n")[-160:], flush=True)
        if proc.wait() != 0:
            raise SystemExit(f"{' '.join(argv[:2])} failed (exit {proc.returncode}), log in {log}")
    peak = int(next(line.split()[1] for line in lines if line.startswith("PEAK")))
    times = {m.group(1) or m.group(3): float(m.group(2) or m.group(4)) for line in lines
             for part in line.split("\r") if (m := LAYER_TIME.search(part.strip()))}
    per_layer = list(times.values())
    phases = {name: {"peak_rss_bytes": int(hwm), "rss_at_start_bytes": int(at_start), "rss_at_end_bytes": int(at_end)}
              for name, hwm, at_start, at_end in (line.split()[1:] for line in lines if line.startswith("PHASE "))}
    return {"peak_rss_bytes": peak, "wall_s": round(time.perf_counter() - start, 1), "per_layer_s": per_layer,
            "phases": phases}


HEADER = f"{'depth':>5}  {'checkpoint':>10}  {'command':<24} {'peak RSS':>9}  {'wall':>7}  per layer (mean, max)"


def row_line(r: dict) -> str:
    t = r["per_layer_s"]
    per = f"{sum(t) / len(t):6.1f} s, {max(t):6.1f} s over {len(t)} layers" if t else "-"
    return (f"{r['depth']:>5}  {r['checkpoint_bytes'] / 2**30:7.2f} GiB  {r['what']:<24} "
            f"{r['peak_rss_bytes'] / 2**30:5.2f} GiB  {r['wall_s']:6.0f} s  {per}"
            + "".join(f"\n{'':>19}{name:<12} peak {ph['peak_rss_bytes'] / 2**20:7.1f} MiB (resident at start "
                      f"{ph['rss_at_start_bytes'] / 2**20:7.1f}, at end {ph['rss_at_end_bytes'] / 2**20:7.1f} MiB)"
                      for name, ph in r.get("phases", {}).items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="4,16")
    ap.add_argument("--samples", type=int, default=4, help="calibration sequences (random ids: no tokenizer)")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3, help="fit steps per layer of --reconstruct, at most")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints and proxies")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, depths 1,2: a smoke run")
    args = ap.parse_args()
    shape, depths = (QUICK, [1, 2]) if args.quick else (QWEN3_30B_A3B, sorted(map(int, args.depths.split(","))))
    work = Path(args.out) / "deep_build_cost"
    kept = max(2 * shape["num_experts_per_tok"], round(shape["num_experts"] * KEPT))
    rows = []
    try:
        print(f"writing checkpoints of depths {depths} under {work}", flush=True)
        srcs = write_checkpoints(work, shape, depths)
        for depth in depths:
            src, stats, dst = srcs[depth], work / f"stats-{depth}", work / f"proxy-{depth}"
            size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
            common = ["--experts", str(kept), "--method", "saliency"]
            commands = {
                "calibrate --sequential": ["calibrate", str(src), "--out", str(stats), "--sequential", *common,
                                           "--samples", str(args.samples), "--seq-len", str(args.seq_len)],
                "build --reconstruct": ["build", str(src), str(dst), *common, "--calibration", str(stats),
                                        "--reconstruct", "--overwrite"],
            }
            for what, argv in commands.items():
                print(f"depth {depth}: moe-proxy {' '.join(argv)}", flush=True)
                r = run(argv, args.steps, work / f"{what.split()[0]}-{depth}.log")
                rows.append({"depth": depth, "checkpoint_bytes": size, "what": what} | r)
                print(HEADER + "\n" + row_line(rows[-1]), flush=True)  # each row as soon as measured
        print("\n" + HEADER)
        for r in rows:
            print(row_line(r), flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "deep_build_cost.json").write_text(json.dumps(
            {"shape": shape, "depths": depths, "experts_kept": kept, "samples": args.samples,
             "seq_len": args.seq_len, "steps": args.steps, "quick": args.quick, "rows": rows}, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
