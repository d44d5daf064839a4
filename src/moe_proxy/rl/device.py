"""Accelerator choice for runs: an Ascend NPU through torch_npu when it is installed, else
CUDA, else the CPU."""

from __future__ import annotations

import importlib
import os

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


# The variable that says which devices of a kind a process sees (and numbers from 0).
VISIBLE = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def device_slots(requested: str | None, ranks: int, parallel: int) -> list[dict[str, str]]:
    """The environment of each of `parallel` concurrent runs of `ranks` ranks (one device each)
    on this machine: `slot_envs` with the devices visible here."""
    if parallel == 1:
        return [{}]  # one run has the machine as it is
    device = pick_device(requested)
    variable = VISIBLE.get(device.type)
    if variable is None:
        return [{}] * parallel
    count = getattr(torch, device.type).device_count()
    visible = os.environ.get(variable)  # numbers of the devices this process sees, in its order
    ids = visible.split(",")[:count] if visible else [str(i) for i in range(count)]
    return slot_envs(requested or device.type, ranks, parallel, ids)


def slot_envs(device: str, ranks: int, parallel: int, ids: list[str]) -> list[dict[str, str]]:
    """Slot i of `parallel` gets devices i*ranks .. (i+1)*ranks-1 of `ids` (the devices seen here),
    through CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES: a run sees only its own, numbered
    from 0, so its ranks use them all. One run alone (parallel 1), or a CPU run, sets nothing.
    Refused: a device index (`cuda:1`, one device) shared by runs at a time, and more devices
    than there are."""
    kind, _, index = device.partition(":")
    variable = VISIBLE.get(kind)
    if parallel == 1 or variable is None:
        return [{}] * parallel
    if index:
        raise InvalidReproConfig(f"--device {device} names one device, which {parallel} runs at a time would share: "
                                 f"give --device {kind} (each run gets devices of its own), or --parallel 1")
    if ranks * parallel > len(ids):
        raise InvalidReproConfig(f"--parallel {parallel} runs of {ranks} rank(s) need {ranks * parallel} {kind} "
                                 f"devices, one per rank; {len(ids)} are visible here: lower --parallel")
    return [{variable: ",".join(ids[i * ranks:(i + 1) * ranks])} for i in range(parallel)]
