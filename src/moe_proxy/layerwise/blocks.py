"""The proxy's MoE block beside the original's, one decoder layer at a time.

What sequential calibration, router healing, merging and reconstruction share when they run a
proxy layer by layer (model.py): the proxy block is the model's own MoE module class built from
the proxy config, holding the kept experts' rows of every tensor with one row per routed expert
(router rows, correction bias, fused experts); `swapped` runs a loaded original decoder layer
with it in place of the original block; `block_io` records what an MoE block receives and
returns; `router_params` names a block's trainable router tensors as the checkpoint does.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Iterator

import torch

from moe_proxy.errors import MoeProxyError, UnsupportedArchitecture


def proxy_block(original: torch.nn.Module, proxy_config, kept: list[int],
                dtype: torch.dtype = torch.float32, same_kernels: bool = False) -> torch.nn.Module:
    """The model's own MoE block class for `proxy_config`, with the kept experts of `original`
    (a loaded block). Tensors whose proxy shape differs from the original's are sliced to the
    kept rows on axis 0; all others are copied. Floating-point tensors are cast to `dtype`.
    `same_kernels`: the experts run with the original model's experts kernel (what the proxy
    runs with when transformers loads it); otherwise with the eager one (differentiable)."""
    impl = getattr(getattr(getattr(original, "experts", None), "config", None), "_experts_implementation", None)
    proxy_config = copy.copy(proxy_config)
    proxy_config._experts_implementation = impl if same_kernels and impl is not None else "eager"
    with torch.device("meta"):
        block = type(original)(proxy_config)
    wanted = block.state_dict()
    keep = torch.tensor(kept)
    state = {}
    for key, value in original.state_dict().items():
        if value.shape != wanted[key].shape:
            value = value.index_select(0, keep)
            if value.shape != wanted[key].shape:
                raise MoeProxyError(f"{key}: the original's {list(value.shape)} cannot be sliced to the proxy's "
                                    f"{list(wanted[key].shape)} by keeping experts {kept}")
        state[key] = (value.to(dtype) if value.is_floating_point() else value).clone()
    block.load_state_dict(state, strict=True, assign=True)
    return block.train(False)


@contextmanager
def swapped(layer: torch.nn.Module, block: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Decoder layer `layer` with `block` as its MoE block (`layer.mlp`) for the duration."""
    original = layer.mlp
    layer.mlp = block
    try:
        yield layer
    finally:
        layer.mlp = original


@contextmanager
def block_io(block: torch.nn.Module) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Lists that receive the block's input and output of every call made while inside."""
    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []

    def capture(module, args, out) -> None:
        xs.append(args[0].detach())
        ys.append((out[0] if isinstance(out, tuple) else out).detach())

    hook = block.register_forward_hook(capture)
    try:
        yield xs, ys
    finally:
        hook.remove()


def router_params(block: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The router's trainable tensors, named as the checkpoint's router leaves (`gate.weight`, ...)."""
    for attr in ("gate", "router"):
        router = getattr(block, attr, None)
        if isinstance(router, torch.nn.Module) and isinstance(getattr(router, "weight", None), torch.nn.Parameter):
            return {f"{attr}.{name}": p for name, p in router.named_parameters()}
    raise UnsupportedArchitecture(f"{type(block).__name__} has no router module (gate or router) with a weight: "
                                  f"its router rows cannot be fitted (use --no-reconstruct, without --heal)")
