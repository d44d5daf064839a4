"""The proxy block's tensors a fit or a merge makes, written back as the checkpoint stores them.

--reconstruct (reconstruct.py) and --merge (merge.py) both change a kept expert's tensors (and
--reconstruct its router rows) in the proxy block, the model's own MoE class: `Targets` names
those parameters and turns their values back into the checkpoint's own tensors (router rows;
fused or per-expert expert tensors, split and transposed as the module layout joined them;
dtype; block-FP8 re-quantised), with the value each reads back as. `Spill` keeps the stored
bytes on local disk until the shards are written, so memory stays one layer.
"""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path

import torch

from moe_proxy.checkpoint.layout import MoeBlock
from moe_proxy.checkpoint.reader import TensorInfo
from moe_proxy.checkpoint.tensors import TORCH_DTYPES, dequantize_fp8, quantize_fp8
from moe_proxy.errors import CannotReconstruct
from moe_proxy.layerwise.blocks import router_params


def _storage(t: TensorInfo, scale: TensorInfo | None, option: str = "--reconstruct"):
    """(value -> {name: stored tensor}, value as it reads back) for one checkpoint tensor."""
    if scale is not None and t.dtype.startswith("F8"):
        def store(v: torch.Tensor):
            q, s = quantize_fp8(v, scale.shape, TORCH_DTYPES[t.dtype], TORCH_DTYPES[scale.dtype])
            return {t.name: q, scale.name: s}, dequantize_fp8(q, s)
        return store
    if t.dtype not in ("F32", "F16", "BF16", "F64"):
        raise CannotReconstruct(
            f"{t.name}: dtype {t.dtype} without a block scale cannot be re-quantised; build without {option}")

    def store(v: torch.Tensor):
        stored = v.to(TORCH_DTYPES[t.dtype]).contiguous()
        return {t.name: stored}, stored.float()
    return store


class Targets:
    """The proxy block's parameters --reconstruct fits (or --merge sets), and how each is written back into the
    checkpoint's own tensors (router rows; fused or per-expert expert tensors, split and
    transposed as layerwise.py joined them, FP8 re-quantised). `option`: the build option that
    writes them (--reconstruct, --merge), named when a checkpoint cannot be written back."""

    def __init__(self, proxy: torch.nn.Module, block: MoeBlock, arch, kept: list[int], option: str = "--reconstruct"):
        self.block, self.arch, self.kept, self.option = block, arch, kept, option
        self.router = {}
        for leaf, p in router_params(proxy).items():
            info = block.router.get(leaf)
            if info is not None and info[1] == 0:  # stored, experts on axis 0: fitted
                self.router[leaf] = p
        experts = getattr(proxy, "experts", None)
        self.experts = {f"experts.{n}": p for n, p in experts.named_parameters()} if experts is not None else {}
        for name in self.experts:  # refuse before fitting anything
            self._writer(name)

    def fitted(self) -> list[str]:
        return sorted(self.router) + sorted(self.experts)

    def store(self, experts_only: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The fitted values as stored: ({checkpoint tensor: stored tensor}, {parameter: value read back})."""
        out, back = {}, {}
        for leaf, p in ({} if experts_only else self.router).items():
            t = self.block.router[leaf][0]
            written, back[leaf] = _storage(t, None)(p.detach())
            out |= written
        for name, p in self.experts.items():
            written, back[name] = self._writer(name)(p.detach())
            out |= written
        return out, back

    def _writer(self, name: str):
        leaf = name.split(".", 1)[1]
        b = self.block
        if leaf in b.fused:
            t = b.fused[leaf]
            if leaf + "_scale_inv" in b.fused or t.dtype.startswith("F8"):
                raise CannotReconstruct(f"{t.name}: fused FP8 experts cannot be re-quantised yet; build without "
                                        f"{self.option}")
            store = _storage(t, None, self.option)
            shape = (len(self.kept),) + tuple(t.shape[1:])

            def fused(v: torch.Tensor):
                flip = tuple(v.shape) != shape
                written, back = store(v.transpose(1, 2) if flip else v)
                return written, back.transpose(1, 2) if flip else back
            return fused
        hub = {"gate_up_proj": self.arch.hub_gate_up, "down_proj": self.arch.hub_down}.get(leaf)
        if hub is None or not b.per_expert:
            raise CannotReconstruct(f"{b.prefix}: the experts' parameter {leaf} has no checkpoint tensor "
                                    f"{self.option} knows how to write; build without {self.option}")
        parts = [[b.per_expert[e].get(f"{h}.weight") for h in hub] for e in self.kept]
        if any(t is None for ts in parts for t in ts):
            raise CannotReconstruct(f"{b.prefix}: per-expert tensors {hub} not found; build without {self.option}")
        stores = [[_storage(t, b.per_expert[e].get(f"{h}.weight_scale_inv"), self.option) for t, h in zip(ts, hub)]
                  for e, ts in zip(self.kept, parts)]

        def per_expert(v: torch.Tensor):
            written, back = {}, torch.empty_like(v)
            for j, ts in enumerate(parts):
                rows = [t.shape[0] for t in ts]
                flip = (sum(rows), ts[0].shape[1]) != tuple(v[j].shape)  # stored transposed to the module
                m = v[j].T if flip else v[j]
                pieces = []
                for store, chunk in zip(stores[j], m.split(rows, dim=0)):
                    w, r = store(chunk.contiguous())
                    written |= w
                    pieces.append(r)
                joined = torch.cat(pieces, dim=0)
                back[j] = joined.T if flip else joined
            return written, back
        return per_expert


class Spill:
    """Fitted tensors on local disk until the shards are written: memory stays one layer."""

    def __init__(self):
        self.dir = tempfile.TemporaryDirectory(prefix="moe-proxy-reconstruct-")
        self.count = 0

    def put(self, value: torch.Tensor):
        path = Path(self.dir.name) / f"{self.count}.bin"
        self.count += 1
        path.write_bytes(value.contiguous().view(torch.uint8).numpy().tobytes())
        return partial(_read, self, path)  # holds the spill (and its directory) while needed


def _read(spill: Spill, path: Path) -> bytes:
    return path.read_bytes()
