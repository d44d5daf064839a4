"""Accelerator choice for runs: an Ascend NPU through torch_npu when it is installed, else
CUDA, else the CPU."""

from __future__ import annotations

import importlib

import torch

from moe_proxy.errors import InvalidReproConfig


def pick_device(requested: str | None = None) -> torch.device:
    """`requested` (e.g. "cpu", "cuda:1", "npu") wins; otherwise the best available device."""
    if requested:
        if requested.startswith("npu") and not _import_torch_npu():
            raise InvalidReproConfig(f"--device {requested}: torch_npu is not installed (Ascend images only)")
        try:
            return torch.device(requested)
        except RuntimeError as exc:
            raise InvalidReproConfig(f"--device {requested}: {exc}") from None
    if _import_torch_npu() and torch.npu.is_available():  # type: ignore[attr-defined]
        return torch.device("npu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def _import_torch_npu() -> bool:
    # torch_npu registers the "npu" device with torch on import; it exists only in Ascend images.
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    return True
