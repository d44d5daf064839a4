"""Per-rank peak memory of one distributed reproduction (FSDP2 over W CPU ranks, gloo) beside
the planner's per-device estimate for the same model and W.

    .venv/bin/python bench/repro_memory.py [--ranks 1 2 4] [--hidden 768] [--experts 32]

The proxy is a random Qwen3-MoE made here (moe_proxy.demo.tiny, larger settings): 4 MoE layers,
`--experts` routed experts of width 384, hidden `--hidden`, a vocabulary of 8192 (about 132M
parameters at the defaults). Each rank runs one RL step of `repro` (rollout, old and reference
log-probs, one update: Adam's moments exist from then on) and reports its peak RSS
(ru_maxrss) and its RSS before loading any weights (the runtime floor: Python, torch,
transformers). The planner's estimate is its ZeRO-3/FSDP model at fp32 (weights, gradients,
Adam and the reference, sharded: 20 bytes per parameter over W) plus one micro-batch's
activations; its fixed per-device runtime reserve is left out, the floor stands for it here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transformer"))

MIB = 1 << 20
PROMPT_TOKENS = 6  # "12+34=" in bytes
NEW_TOKENS = 4
BATCH, GROUP = 4, 2


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_main(checkpoint: str, out: str) -> dict:
    """One rank (started by torch.distributed's elastic launcher): one repro step."""
    import torch

    from moe_proxy.repro.config import ReproConfig
    from moe_proxy.repro.runner import run_repro

    torch.set_num_threads(1)
    floor = _rss()
    run_repro(checkpoint, out, ReproConfig(steps=1, batch_size=BATCH, group_size=GROUP, max_new_tokens=NEW_TOKENS,
                                           mini_batches=1, lr=1e-5))
    return {"floor": floor, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def planner_estimate(config: dict, ranks: int) -> tuple[int, int]:
    """(sharded static bytes per rank, activation bytes per rank) from the planner's model."""
    from moe_proxy.checkpoint.params import config_params, moe_layer_indices
    from moe_proxy.sizing import SizingOptions, _memory

    tokens = BATCH * GROUP // ranks * (PROMPT_TOKENS + NEW_TOKENS)  # one micro-batch of this rank's rows
    params = config_params(config)
    memory = _memory(config, params, config["num_experts_per_tok"], len(moe_layer_indices(config)),
                     SizingOptions(precision="fp32", micro_batch_tokens=tokens))
    return memory.static // ranks, memory.activations_per_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--experts", type=int, default=32)
    args = parser.parse_args()

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from moe_proxy.demo.tiny import make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "proxy"
        make_tiny("qwen3_moe", ckpt, hidden_size=args.hidden, num_hidden_layers=4, num_attention_heads=12,
                  num_key_value_heads=4, head_dim=64, intermediate_size=2048, moe_intermediate_size=384,
                  num_experts=args.experts, num_experts_per_tok=2, mlp_only_layers=[], vocab_size=8192)
        config = json.loads((ckpt / "config.json").read_text())
        from moe_proxy.checkpoint.params import config_params

        total = config_params(config).total
        print(f"proxy: qwen3_moe, {total / 1e6:.1f}M parameters ({total * 4 / MIB:.0f} MiB of fp32 weights), "
              f"{BATCH}x{GROUP} rollouts of {NEW_TOKENS} tokens, one step")
        print(f"{'W':>2} {'peak RSS/rank MiB':>18} {'floor MiB':>10} {'peak-floor':>11} "
              f"{'planner/rank MiB':>17} {'(static/W + act)':>17}")
        for ranks in args.ranks:
            launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=f"repro-memory-{ranks}",
                                  rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                                  monitor_interval=0.5)
            results = elastic_launch(launch, rank_main)(str(ckpt), str(Path(tmp) / f"run{ranks}"))
            peak = max(r["peak"] for r in results.values())
            floor = max(r["floor"] for r in results.values())
            static, acts = planner_estimate(config, ranks)
            print(f"{ranks:>2} {peak / MIB:>18.0f} {floor / MIB:>10.0f} {(peak - floor) / MIB:>11.0f} "
                  f"{(static + acts) / MIB:>17.0f} {f'{static / MIB:.0f} + {acts / MIB:.0f}':>17}", flush=True)


if __name__ == "__main__":
    main()
