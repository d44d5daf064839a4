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
            device = torch.device(requested)
        except RuntimeError as exc:
            raise InvalidReproConfig(f"--device {requested}: {exc}") from None
        _check_present(device, requested)
        return device
    if _import_torch_npu() and torch.npu.is_available():  # type: ignore[attr-defined]
        return torch.device("npu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def _check_present(device: torch.device, requested: str) -> None:
    """Refuse a device this torch, or this machine, does not have, now rather than at the first
    tensor moved there (an AssertionError from torch for CUDA on a CPU build)."""
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.npu, torch.xpu, ...
    if device.type == "cpu" or not hasattr(backend, "device_count"):
        return
    count = backend.device_count()  # 0 where this torch lacks the backend, too
    if count == 0:
        if device.type == "cuda" and torch.version.cuda is None and torch.version.hip is None:
            raise InvalidReproConfig(f"--device {requested}: this torch has no CUDA (CPU build)")
        raise InvalidReproConfig(f"--device {requested}: no {device.type} device is visible here "
                                 f"(driver, or *_VISIBLE_DEVICES)")
    if device.index is not None and device.index >= count:
        raise InvalidReproConfig(f"--device {requested}: this machine has {count} {device.type} device(s), "
                                 f"numbered from 0")


def _import_torch_npu() -> bool:
    # torch_npu registers the "npu" device with torch on import; it exists only in Ascend images.
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    return True
