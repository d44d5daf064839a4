"""Per-rank peak memory of one distributed reproduction (FSDP2 over W CPU ranks, gloo) beside
the planner's per-device estimate for the same model and W.

    nice -n 10 .venv/bin/python bench/repro_memory.py [--ranks 1 2 4] [--hidden 768] [--experts 32] [--quick]

The proxy is a random Qwen3-MoE made here (moe_proxy.demo.tiny, larger settings): 4 MoE layers,
`--experts` routed experts of width 384, hidden `--hidden`, a vocabulary of 8192 (about 132M
parameters at the defaults). Two launches per W, each rank reporting its RSS (/proc) and peak
RSS (VmHWM):

- load: what a rank of `repro` does before its first step (the same calls as the runner): join
  the group (gloo), build policy and reference (on the meta device and loaded into their FSDP2
  shards when W > 1; from_pretrained when W = 1). The runtime floor is the RSS once the model's
  code is imported and built without weights (Python, torch, transformers); "file pages" is the
  part of the loaded RSS that files mapped since the floor make up: the checkpoint mapped from
  disk (from_pretrained's zero-copy safetensors load), page cache rather than allocations;
- step: one RL step of `repro` itself (rollout, old and reference log-probs, one update: Adam's
  moments exist from then on).

The planner's estimate is its ZeRO-3/FSDP model at fp32 (weights, gradients, Adam and the
reference, sharded: 20 bytes per parameter over W) plus one micro-batch's activations; its fixed
per-device runtime reserve is left out, the floor stands for it here. The last columns are what
the planner does not count, from the model: FSDP2 gathers one unit (a decoder layer, or the root:
embeddings and head) in full for its forward and backward, and the backward holds its full
gradient until the reduce-scatter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

MIB = 1 << 20
PROMPT_TOKENS = 6  # "12+34=" in bytes
NEW_TOKENS = 4
BATCH, GROUP = 4, 2


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _status(field: str) -> int:
    """Bytes of a /proc/self/status field: VmHWM is this process's peak RSS (not ru_maxrss, which
    Linux carries over fork and exec: a rank would report at least its launcher's RSS), RssFile
    the part of the RSS that is pages of files mapped into memory."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))


def _peak() -> int:
    return _status("VmHWM")


def rank_load(checkpoint: str) -> dict:
    """One rank, up to its first step: the group, then policy and reference as the runner loads them."""
    import torch

    from moe_proxy.checkpoint.reader import open_checkpoint
    from moe_proxy.rl.distributed import join, shard
    from moe_proxy.rl.sharded_load import load_shards, meta_model
    from moe_proxy.layerwise.load import load_causal_lm

    torch.set_num_threads(1)
    start = _rss()
    comm = join("cpu")
    joined = _rss()
    meta_model(Path(checkpoint))  # imports and builds the model's code, no weights
    floor, libraries = _rss(), _status("RssFile")  # (shared libraries are file pages too)
    models = []
    for _ in ("policy", "reference"):
        if comm.distributed:
            models.append(load_shards(shard(meta_model(Path(checkpoint)), comm), open_checkpoint(checkpoint),
                                      comm.device))
        else:
            models.append(load_causal_lm(checkpoint, dtype=torch.float32))
    loaded, peak, mapped = _rss(), _peak(), _status("RssFile") - libraries
    comm.close()
    return {"group": joined - start, "floor": floor, "loaded": loaded, "mapped": mapped, "peak": peak}


def rank_step(checkpoint: str, out: str) -> dict:
    """One rank: one repro step."""
    import torch

    from moe_proxy.rl.config import ReproConfig
    from moe_proxy.rl.runner import run_repro

    torch.set_num_threads(1)
    run_repro(checkpoint, out, ReproConfig(steps=1, batch_size=BATCH, group_size=GROUP, max_new_tokens=NEW_TOKENS,
                                           mini_batches=1, lr=1e-5))
    return {"peak": _peak()}


def unit_bytes(config: dict) -> tuple[int, int]:
    """fp32 bytes of the largest FSDP unit (one decoder layer, or the root: embeddings, head,
    norm), from the model's own modules on the meta device."""
    import torch
    import transformers

    from moe_proxy.layerwise.load import transformers_config

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers_config(config), dtype=torch.float32)
    layer = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    root = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.model.layers.parameters())
    return layer * 4, root * 4


def planner_estimate(config: dict, ranks: int) -> tuple[int, int]:
    """(sharded static bytes per rank, activation bytes per rank) from the planner's model."""
    from moe_proxy.checkpoint.params import config_params, moe_layer_indices
    from moe_proxy.sizing import SizingOptions, _memory

    tokens = BATCH * GROUP // ranks * (PROMPT_TOKENS + NEW_TOKENS)  # one micro-batch of this rank's rows
    params = config_params(config)
    memory = _memory(config, params, config["num_experts_per_tok"], len(moe_layer_indices(config)),
                     SizingOptions(precision="fp32", micro_batch_tokens=tokens))
    return memory.static // ranks, memory.activations_per_device


def _launch(ranks: int, name: str, fn, *fn_args) -> dict:
    """`fn(*fn_args)` on `ranks` local ranks (torch's elastic launcher); each figure the max over ranks."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=f"repro-memory-{name}-{ranks}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5)
    results = list(elastic_launch(launch, fn)(*fn_args).values())
    return {key: max(r[key] for r in results) for key in results[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny proxy on W = 1, 2: checks that the bench runs; its figures mean nothing")
    args = parser.parse_args()
    vocab = 8192
    if args.quick:
        args.ranks, args.hidden, args.experts, vocab = [1, 2], 96, 4, 512

    from moe_proxy.demo.tiny import make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "proxy"
        make_tiny("qwen3_moe", ckpt, hidden_size=args.hidden, num_hidden_layers=4, num_attention_heads=12,
                  num_key_value_heads=4, head_dim=64, intermediate_size=2048, moe_intermediate_size=384,
                  num_experts=args.experts, num_experts_per_tok=2, mlp_only_layers=[], vocab_size=vocab)
        config = json.loads((ckpt / "config.json").read_text())
        from moe_proxy.checkpoint.params import config_params

        total = config_params(config).total
        print(f"proxy: qwen3_moe, {total / 1e6:.1f}M parameters ({total * 4 / MIB:.0f} MiB of fp32 weights), "
              f"{BATCH}x{GROUP} rollouts of {NEW_TOKENS} tokens, one step")
        layer, root = unit_bytes(config)
        print(f"largest FSDP units (fp32, in full): decoder layer {layer / MIB:.0f} MiB, root {root / MIB:.0f} MiB")
        print("MiB per rank (the largest over the ranks):")
        print(f"{'W':>2} {'floor':>6} {'gloo':>5} {'loaded':>7} {'(file pages)':>13} {'load peak':>10} "
              f"{'step peak':>10} {'planner':>8} {'(static/W + act)':>17} {'step peak-floor-planner':>24}")
        for ranks in args.ranks:
            load = _launch(ranks, "load", rank_load, str(ckpt))
            step = _launch(ranks, "step", rank_step, str(ckpt), str(Path(tmp) / f"run{ranks}"))
            static, acts = planner_estimate(config, ranks)
            planner = static + acts
            print(f"{ranks:>2} {load['floor'] / MIB:>6.0f} {load['group'] / MIB:>5.0f} {load['loaded'] / MIB:>7.0f} "
                  f"{load['mapped'] / MIB:>13.0f} {load['peak'] / MIB:>10.0f} {step['peak'] / MIB:>10.0f} {planner / MIB:>8.0f} "
                  f"{f'{static / MIB:.0f} + {acts / MIB:.0f}':>17} "
                  f"{(step['peak'] - load['floor'] - planner) / MIB:>24.0f}", flush=True)


if __name__ == "__main__":
    main()
