"""A checkpoint's tensors in the layout of transformers' modules, whole or a block of rows.

The hub layout (what checkpoints store) and the module layout (what transformers' classes hold)
differ: per-expert tensors are stacked into the fused `experts.gate_up_proj` [N, 2I, H] /
`experts.down_proj` [N, H, I], some MoE blocks keep a hub name (the `Arch`'s hub_* fields, e.g.
Mixtral's `block_sparse_moe.w1/w2/w3`), some 3-D tensors are stored transposed, and block FP8 is
dequantised. The layer-by-layer calibration reads whole tensors; a sharded reproduction reads
only the rows (dim 0) its rank owns, so no process ever holds the whole model: a plain tensor's
rows are one byte range, the fused experts are read expert by expert. Needs torch.
"""

from __future__ import annotations

import torch

from moe_proxy.architectures import detect
from moe_proxy.checkpoint.reader import Checkpoint
from moe_proxy.checkpoint.tensors import FLOAT_DTYPES, TORCH_DTYPES, dequantize_fp8, to_tensor
from moe_proxy.errors import CorruptCheckpoint, MoeProxyError

Rows = tuple[int, int]  # [start, stop) along dim 0


class ModuleTensors:
    """Reads module parameters (and persistent buffers) of a model of `ckpt`'s architecture."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.arch = detect(ckpt.config)

    def tensor(self, name: str, like: torch.Tensor, rows: Rows | None = None) -> torch.Tensor:
        """The checkpoint's tensor for module parameter `name` (of `like`'s shape and dtype), or
        its rows [start, stop) along dim 0 only."""
        want = tuple(like.shape) if rows is None else (rows[1] - rows[0], *like.shape[1:])
        for candidate in self.hub_names(name):
            if candidate in self.ckpt.tensors:
                stored = self.ckpt.tensors[candidate]
                if rows is not None and stored.shape[:1] != tuple(like.shape[:1]):
                    raise CorruptCheckpoint(f"{self.ckpt.uri}: tensor for {name} has shape {list(stored.shape)}, "
                                            f"the model expects {list(like.shape)}")
                x = self.read(candidate, rows)
                break
        else:
            if name + "_blocks" in self.ckpt.tensors:
                raise MoeProxyError(
                    f"{name}: MXFP4 experts (_blocks/_scales) cannot be run layer by layer yet; calibrate a "
                    f"floating-point or block-FP8 copy of this checkpoint"
                )
            x = self._stacked_experts(name, like, rows)
        if x.shape != want and x.dim() == 3 and x.transpose(1, 2).shape == want:
            x = x.transpose(1, 2)  # Qwen3-VL style hub layout, transposed relative to the module
        if x.shape != want:
            raise CorruptCheckpoint(
                f"{self.ckpt.uri}: tensor for {name} has shape {list(x.shape)}, the model expects {list(want)}"
            )
        return x.to(like.dtype).contiguous()

    def hub_names(self, name: str) -> list[str]:
        """Where the checkpoint may keep module parameter `name`: as named, or under the
        architecture's hub name of the MoE block."""
        return list(dict.fromkeys((name, name.replace(".mlp.", f".{self.arch.hub_moe}."))))

    def read(self, name: str, rows: Rows | None = None) -> torch.Tensor:
        """Stored tensor `name` (or its rows), as numbers: block FP8 dequantised to float32."""
        t = self.ckpt.tensors[name]
        if t.dtype not in FLOAT_DTYPES:
            raise MoeProxyError(
                f"{name}: dtype {t.dtype} (e.g. MXFP4 blocks) cannot be run layer by layer yet; "
                f"calibrate a floating-point or block-FP8 checkpoint"
            )
        scale = self.ckpt.tensors.get(name + "_scale_inv")
        if t.dtype.startswith("F8") and scale is not None:  # scale blocks span rows: the whole tensor
            x = dequantize_fp8(to_tensor(self.ckpt.read(name), t), to_tensor(self.ckpt.read(scale.name), scale))
            return x if rows is None else x[rows[0]:rows[1]]
        if rows is None:
            return to_tensor(self.ckpt.read(name), t)
        start, stop = rows
        shape = (stop - start, *t.shape[1:])
        if stop <= start:  # FSDP gives the last ranks no rows of a short tensor
            return torch.empty(shape, dtype=TORCH_DTYPES[t.dtype])
        return to_tensor(self.ckpt.read_slices(name, 0, list(range(start, stop))), t, shape)

    def _stacked_experts(self, name: str, like: torch.Tensor, rows: Rows | None) -> torch.Tensor:
        """transformers' fused `experts.gate_up_proj` [N, 2I, H] / `experts.down_proj` [N, H, I]
        from the hub's per-expert tensors (the `Arch`'s hub_gate_up / hub_down: gate/up/down_proj,
        or Mixtral's w1/w3/w2), filled expert by expert into the module's dtype: the experts asked
        for are held once, plus one expert."""
        head, _, leaf = name.rpartition(".")
        names = {"gate_up_proj": self.arch.hub_gate_up, "down_proj": self.arch.hub_down}.get(leaf)
        for block in self.hub_names(head) if names else []:
            first = f"{block}.0.{names[0]}.weight"
            if first not in self.ckpt.tensors:
                continue
            n = sum(1 for e in range(like.shape[0]) if f"{block}.{e}.{names[0]}.weight" in self.ckpt.tensors)
            if n != like.shape[0]:
                raise CorruptCheckpoint(f"{self.ckpt.uri}: {block} has {n} experts, the model expects {like.shape[0]}")
            start, stop = rows or (0, n)
            out = torch.empty((stop - start, *like.shape[1:]), dtype=like.dtype)
            for e in range(start, stop):
                part = torch.cat([self.read(f"{block}.{e}.{p}.weight") for p in names], dim=0)
                if part.shape != out.shape[1:] and part.T.shape == out.shape[1:]:
                    part = part.T  # a module stored transposed relative to the hub
                if part.shape != out.shape[1:]:
                    raise CorruptCheckpoint(f"{self.ckpt.uri}: {block}.{e} {'/'.join(names)} give "
                                            f"{list(part.shape)}, the model expects {list(out.shape[1:])}")
                out[e - start] = part
            return out
        raise CorruptCheckpoint(f"{self.ckpt.uri}: no tensor for the model's parameter {name}")
