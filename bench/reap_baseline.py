"""REAP itself, for the fidelity lab's held-out loss column: llm-compressor's
REAPPruningModifier (sequential pipeline: each MoE layer scored on the hidden states of the
already pruned layers before it, then pruned) on a lab original, with the lab's calibration
tokens, down to K experts per layer.

It runs in llm-compressor's own environment, never the project's (llm-compressor pins its
own transformers); bench/fidelity.py calls it through subprocess and skips the REAP column
when that environment is absent:

    python -m venv bench/out/reap-venv
    bench/out/reap-venv/bin/pip install torch==2.13.0          # first: the CPU wheel, no CUDA torch
    bench/out/reap-venv/bin/pip install llmcompressor==0.14.0.1
    bench/out/reap-venv/bin/python bench/reap_baseline.py SRC DST --experts K --tokens IDS.npy

Loads with plain transformers (llm-compressor's own load path imports torchvision), saves
with save_pretrained, then rewrites every expert-count field of config.json (llm-compressor
leaves the original count in some of them) and checks the saved tensors hold K experts per
layer. The lab scores the result in another process: a reload in this one can silently leave
experts randomly initialised (pruning-anchors.md, last section).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

EXPERT_COUNT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


def expert_count(config: dict) -> int:
    for field in EXPERT_COUNT_FIELDS:
        if isinstance(config.get(field), int) and config[field] > 0:
            return config[field]
    raise SystemExit(f"config.json has none of {EXPERT_COUNT_FIELDS}: not an MoE checkpoint")


def rewrite_counts(config_path: Path, k: int) -> None:
    config = json.loads(config_path.read_text())
    for field in EXPERT_COUNT_FIELDS:
        if field in config:
            config[field] = k
    config_path.write_text(json.dumps(config, indent=2))


def experts_per_layer(dst: Path) -> dict[int, int]:
    """Experts stored per layer, from the saved tensors' names or fused shapes."""
    from safetensors import safe_open

    found: dict[int, set[int]] = {}
    fused: dict[int, int] = {}
    for file in dst.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if m := re.search(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.", name):
                    found.setdefault(int(m[1]), set()).add(int(m[2]))
                elif m := re.search(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name):
                    fused[int(m[1])] = f.get_slice(name).get_shape()[0]
    return {layer: len(ids) for layer, ids in found.items()} | fused


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--experts", type=int, required=True, help="experts kept per MoE layer")
    parser.add_argument("--tokens", type=Path, required=True, help="calibration token ids, [samples, seq_len] .npy")
    args = parser.parse_args()
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.pruning.reap import REAPPruningModifier
    from transformers import AutoModelForCausalLM, ByT5Tokenizer

    torch.set_num_threads(1)
    n = expert_count(json.loads((args.src / "config.json").read_text()))
    if not 0 < args.experts < n:
        raise SystemExit(f"--experts {args.experts}: must be between 1 and {n - 1}")
    ids = np.load(args.tokens)
    model = AutoModelForCausalLM.from_pretrained(args.src, dtype=torch.float32)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist()})
    # The lab's originals are byte-level without tokenizer files, and oneshot wants a processor
    # with a dataset: ByT5's needs no files. The ids are already tokens, all of one length, so it
    # only collates them (no padding happens).
    oneshot(model=model, dataset=data, processor=ByT5Tokenizer(),
            recipe=[REAPPruningModifier(sparsity=1 - args.experts / n)],
            num_calibration_samples=len(ids), max_seq_length=int(ids.shape[1]), pipeline="sequential")
    model.save_pretrained(args.dst)
    rewrite_counts(args.dst / "config.json", args.experts)
    stored = experts_per_layer(args.dst)
    if not stored or set(stored.values()) != {args.experts}:
        raise SystemExit(f"saved checkpoint holds {stored} experts per layer, expected {args.experts}")
    print(json.dumps({"experts": args.experts, "of": n, "layers": stored}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
