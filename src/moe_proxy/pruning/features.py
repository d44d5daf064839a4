"""One feature vector per expert of an MoE block, for clustering.

- `router`: the expert's router row(s) (plus any per-expert router bias). Cheap: only the
  router tensors are read.
- `weights`: a compact, deterministic projection of each of the expert's matrices,
  R_out^T W R_in with fixed Gaussian sketches, so experts with similar weights land close.
  Reads every expert's weights (dequantising block-FP8 with its scale companion).

Turning bytes into tensors (dtypes, dequantisation) is tensors.py's.
"""

from __future__ import annotations

import numpy as np
import torch

from moe_proxy.checkpoint.reader import Checkpoint, TensorInfo
from moe_proxy.errors import MoeProxyError
from moe_proxy.checkpoint.layout import MoeBlock
from moe_proxy.checkpoint.tensors import FLOAT_DTYPES, dequantize_fp8, to_tensor

SKETCH = 8  # sketch width per matrix side: 64 numbers per matrix


def router_features(ckpt: Checkpoint, block: MoeBlock) -> np.ndarray:
    parts = []
    for t, axis in block.router.values():
        x = to_tensor(ckpt.read(t.name), t).float().movedim(axis, 0)
        parts.append(x.reshape(block.n_experts, -1))
    return torch.cat(parts, dim=1).double().numpy()


def _sketch(n: int, tag: str) -> torch.Tensor:
    seed = int.from_bytes(tag.encode()[-8:].rjust(8, b"\0"), "little") ^ n
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, SKETCH, generator=g, dtype=torch.float32) / SKETCH**0.5


def _project(w: torch.Tensor) -> torch.Tensor:
    out, inn = w.shape
    return (_sketch(out, "out").T @ w @ _sketch(inn, "in")).flatten()


def weight_features(ckpt: Checkpoint, block: MoeBlock) -> np.ndarray:
    rows = []
    for e in range(block.n_experts):
        parts = []
        for rest, t in sorted(block.per_expert.get(e, {}).items()):
            if not _is_matrix(rest, t):
                continue
            w = to_tensor(ckpt.read(t.name), t).float()
            scale = block.per_expert[e].get(rest + "_scale_inv")
            if scale is not None:
                w = dequantize_fp8(w, to_tensor(ckpt.read(scale.name), scale))
            parts.append(_project(w))
        for rest, t in sorted(block.fused.items()):
            if not _is_matrix(rest, t, fused=True):
                continue
            w = to_tensor(ckpt.read_slices(t.name, 0, [e]), t, t.shape[1:]).float()
            parts.append(_project(w))
        if not parts:
            dtypes = sorted({t.dtype for t in block.expert_tensors()})
            raise MoeProxyError(
                f"{block.prefix}: no floating-point expert matrices to build weight features from "
                f"(expert dtypes {dtypes}, e.g. MXFP4 blocks); use --features router"
            )
        rows.append(torch.cat(parts))
    return torch.stack(rows).double().numpy()


def _is_matrix(rest: str, t: TensorInfo, fused: bool = False) -> bool:
    rank = len(t.shape) - (1 if fused else 0)
    return rank == 2 and t.dtype in FLOAT_DTYPES and not rest.endswith(("_scale_inv", "scale", "_bias"))


def expert_features(ckpt: Checkpoint, block: MoeBlock, source: str) -> np.ndarray:
    if source == "router":
        return router_features(ckpt, block)
    if source == "weights":
        return weight_features(ckpt, block)
    raise MoeProxyError(f"unknown feature source {source!r}: use router or weights")
