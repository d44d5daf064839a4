"""Tensor bytes as torch tensors: the safetensors dtype table and block-FP8 dequantisation.

What clustering features (features.py), the layer-by-layer loader (layerwise.py) and router
healing (heal.py) share when they turn a checkpoint's bytes into numbers. Needs torch.
"""

from __future__ import annotations

import torch

from moe_proxy.checkpoint.reader import TensorInfo
from moe_proxy.errors import MoeProxyError

# safetensors dtype -> torch dtype (every dtype that reads as numbers; not MXFP4's packed U8 blocks' meaning).
TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
    "F32": torch.float32, "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}


def to_tensor(data: bytes, t: TensorInfo, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The bytes of tensor `t` (or of a slice of it, of `shape`) as a tensor of its dtype."""
    if t.dtype not in TORCH_DTYPES:
        raise MoeProxyError(f"{t.name}: dtype {t.dtype} cannot be read as numbers")
    return torch.frombuffer(bytearray(data), dtype=TORCH_DTYPES[t.dtype]).reshape(shape or t.shape)


def dequantize_fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Block FP8 (a weight with its `_scale_inv` companion): `scale[i, j]` multiplies block
    (i, j) of the weight. Returns float32."""
    bo, bi = -(-w.shape[0] // scale.shape[0]), -(-w.shape[1] // scale.shape[1])
    s = scale.float().repeat_interleave(bo, 0)[: w.shape[0]].repeat_interleave(bi, 1)[:, : w.shape[1]]
    return w.float() * s


def quantize_fp8(w: torch.Tensor, scale_shape: tuple[int, ...], dtype: torch.dtype = torch.float8_e4m3fn,
                 scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 again, with the block layout of a `_scale_inv` of `scale_shape` (the inverse of
    dequantize_fp8): per block, scale = largest magnitude / the format's largest value, stored
    in `scale_dtype`, and the weight divided by it. Returns (weight in `dtype`, scale)."""
    (o, i), (so, si) = w.shape, scale_shape
    bo, bi = -(-o // so), -(-i // si)
    padded = torch.zeros(so * bo, si * bi, dtype=torch.float32)
    padded[:o, :i] = w.float()
    blocks = padded.reshape(so, bo, si, bi)
    top = torch.finfo(dtype).max
    scale = (blocks.abs().amax(dim=(1, 3)) / top).to(scale_dtype)
    scale = torch.where(scale.float() > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale
    q = (blocks / scale.float()[:, None, :, None]).clamp(-top, top).reshape(so * bo, si * bi)[:o, :i]
    return q.to(dtype).contiguous(), scale.contiguous()
