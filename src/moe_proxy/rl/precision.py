"""Numerics of a run's modules: autocast per step precision, and single modules kept in fp32
under half-precision autocast (a router: Megatron's moe_router_dtype; the LM head: TRL's
cast_lm_head_to_fp32)."""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def compute_in_fp32(module: torch.nn.Module) -> None:
    """Run `module`'s forward in fp32 whatever autocast is on: its floating inputs cast up and
    autocast off inside, so its matmul and what follows (a router's softmax or sigmoid) are fp32.
    Its parameters must be fp32 already (the trainer's master weights; the rollout copy keeps
    these modules in fp32). In an fp32 run nothing changes."""
    forward = module.forward

    def fp32_forward(*args, **kwargs):
        args = tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        with torch.autocast(device, enabled=False):
            return forward(*args, **kwargs)

    module.forward = fp32_forward


def fp32_modules(model: torch.nn.Module, routers: list, router_dtype: str, lm_head_dtype: str) -> list[torch.nn.Module]:
    """The modules `--router-dtype fp32` / `--lm-head-dtype fp32` ask to compute in fp32."""
    chosen = [r.module for r in routers] if router_dtype == "fp32" else []
    head = model.get_output_embeddings() if lm_head_dtype == "fp32" else None
    return chosen + ([head] if head is not None else [])
