"""The reference a proxy is held to: the original model with each router restricted to the
kept experts (logits of dropped experts forced to -inf, before any scoring)."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch


def routers(model) -> dict[int, torch.nn.Module]:
    """Router module per decoder layer index, for every transformers MoE class we support."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        for attr in ("gate", "router"):
            r = getattr(mlp, attr, None)
            if r is not None and "Router" in type(r).__name__:
                out[i] = r
    return out


@contextmanager
def restricted(model, kept_by_layer: dict[int, list[int]]):
    real = torch.nn.functional
    by_ptr: dict[int, list[int]] = {}
    saved_bias = []
    for layer, router in routers(model).items():
        kept = kept_by_layer[layer]
        by_ptr[router.weight.data_ptr()] = kept
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:  # sigmoid(-inf) is 0, not -inf: the correction bias must drop them too
            saved_bias.append((bias, bias.clone()))
            dropped = [e for e in range(bias.shape[0]) if e not in kept]
            bias.data[dropped] = float("-inf")

    class Shim:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def linear(x, w, b=None):
            out = real.linear(x, w, b)
            kept = by_ptr.get(w.data_ptr())
            if kept is not None:
                mask = torch.full((out.shape[-1],), float("-inf"), dtype=out.dtype)
                mask[kept] = 0
                out = out + mask
            return out

    modules = {sys.modules[type(r).__module__] for r in routers(model).values()}
    saved = {m: m.F for m in modules}
    try:
        for m in modules:
            m.F = Shim()
        yield model
    finally:
        for m, f in saved.items():
            m.F = f
        for bias, value in saved_bias:
            bias.data.copy_(value)
