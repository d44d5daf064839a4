"""Run a checkpoint one decoder layer at a time, with transformers' own modules.

The model is instantiated on the `meta` device (no memory), so every module is the model's
own class with the model's own config: attention, norms, rotary embedding, router scoring
function, grouped routing with DeepSeek's correction bias, renormalisation. Only one decoder
layer at a time gets real tensors, read lazily from the checkpoint (hub layout converted to
the module layout: per-expert tensors stacked into transformers' fused `gate_up_proj` /
`down_proj`, hub names the modules call otherwise (the `Arch`'s hub_* fields, e.g. Mixtral's
`block_sparse_moe.w1/w2/w3`) renamed, block-FP8 dequantised) and
freed back to `meta` after the calibration hidden states went through it. Peak memory is one
layer plus the hidden states, whatever the depth.

Two native effects would otherwise make the process grow layer after layer (measured in
docs/performance.md): oneDNN and ideep cache one compiled matmul primitive per input shape
(up to 1024 each, about 0.3 MB apiece), and every layer's routed-token counts are new shapes;
and glibc keeps the freed layer's chunks in a fragmented heap instead of returning them. So
the caches are bounded (`bound_kernel_caches`) and the heap is trimmed after each layer
(`release_freed_memory`).

What each layer receives besides the hidden states (causal / sliding-window masks, rotary
position embeddings, position ids) is captured from the model's own `forward`: its decoder
layers are swapped for recorders that pass hidden states through unchanged, so nothing of
the model's input preparation is re-implemented here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Iterator

import torch

from moe_proxy.checkpoint.module_tensors import ModuleTensors
from moe_proxy.checkpoint.reader import Checkpoint
from moe_proxy.errors import CorruptCheckpoint
from moe_proxy.layerwise.load import transformers_config

COMPUTE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
KERNEL_CACHE_CAPACITY = "32"  # primitives per cache: every fixed-shape matmul of a layer still hits


def bound_kernel_caches() -> None:
    """Cap oneDNN's and ideep's per-shape primitive caches (default 1024 entries each).
    Both read their capacity once, at their first matmul in the process, so this must run
    before the process's first bf16/fp16 matmul; a value the user set is kept."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", KERNEL_CACHE_CAPACITY)
    os.environ.setdefault("LRU_CACHE_CAPACITY", KERNEL_CACHE_CAPACITY)


@cache
def _malloc_trim():
    """glibc's malloc_trim, or None on another C library."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Hand the freed layer's memory back to the OS: glibc keeps freed chunks in its heap, where
    the next layer's differently sized allocations fragment it, and the process would grow."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class _Stop(Exception):
    """Raised by the last recorder: the model's forward has prepared every layer's inputs."""


class _Recorder(torch.nn.Module):
    def __init__(self, index: int, last: int, store: dict):
        super().__init__()
        self.index, self.last, self.store = index, last, store

    def forward(self, hidden_states, *args, **kwargs):
        self.store[self.index] = (args, kwargs)
        if self.index == self.last:
            raise _Stop
        return hidden_states


@dataclass
class MoeModules:
    """The parts of a decoder layer's MoE block the statistics need."""

    block: torch.nn.Module  # the sparse-MoE module (`layer.mlp`)
    router: torch.nn.Module  # `mlp.gate` or `mlp.router`
    experts: torch.nn.Module  # called as experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])


def moe_modules(layer: torch.nn.Module) -> MoeModules | None:
    mlp = getattr(layer, "mlp", None)
    experts = getattr(mlp, "experts", None)
    router = getattr(mlp, "gate", None) or getattr(mlp, "router", None)
    if experts is None or router is None:
        return None  # a dense layer (DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers)
    return MoeModules(mlp, router, experts)


class LayerwiseModel:
    """A checkpoint's decoder stack, materialised one layer at a time."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype | None = None):
        import transformers

        bound_kernel_caches()
        self.ckpt = ckpt
        self.tensors = ModuleTensors(ckpt)  # hub layout -> module layout
        self.config = transformers_config(ckpt.config)
        self.dtype = dtype or self._checkpoint_dtype()
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(self.config, dtype=self.dtype)
        self.base = model.model
        # Rotary tables are computed at construction, so build that module for real (no weights).
        if hasattr(self.base, "rotary_emb"):
            self.base.rotary_emb = type(self.base.rotary_emb)(config=self.base.config)
        self.layers = list(self.base.layers)
        self.n_layers = len(self.layers)
        self.load(self.base.embed_tokens, "model.embed_tokens.")

    def _checkpoint_dtype(self) -> torch.dtype:
        t = self.ckpt.tensors.get("model.embed_tokens.weight")
        if t is None:
            raise CorruptCheckpoint(f"{self.ckpt.uri}: no model.embed_tokens.weight, cannot embed calibration tokens")
        return COMPUTE_DTYPES.get(t.dtype, torch.bfloat16)

    # ---------------------------------------------------------------- inputs

    def layer_inputs(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[tuple, dict]]]:
        """Embedded tokens and, per decoder layer, the extra (args, kwargs) the model passes it."""
        store: dict[int, tuple[tuple, dict]] = {}
        recorders = [_Recorder(i, self.n_layers - 1, store) for i in range(self.n_layers)]
        self.base.layers = torch.nn.ModuleList(recorders)
        try:
            with torch.no_grad():
                self.base(input_ids=input_ids, use_cache=False)
        except _Stop:
            pass
        finally:
            self.base.layers = torch.nn.ModuleList(self.layers)
        hidden = self.base.embed_tokens(input_ids)
        return hidden, [store[i] for i in range(self.n_layers)]

    # ---------------------------------------------------------------- one layer

    @contextmanager
    def layer(self, index: int) -> Iterator[torch.nn.Module]:
        """Decoder layer `index` with its real tensors; freed back to `meta` on exit."""
        module = self.layers[index]
        self.load(module, f"model.layers.{index}.")
        try:
            yield module
        finally:
            module.to("meta")
            release_freed_memory()

    def load(self, module: torch.nn.Module, prefix: str) -> None:
        """Give `module` (a part of the model, on `meta`) its real tensors, those under `prefix`;
        `module.to("meta")` frees them again."""
        wanted = module.state_dict()
        loaded = {key: self.tensors.tensor(prefix + key, meta) for key, meta in wanted.items()}
        module.load_state_dict(loaded, strict=True, assign=True)
        module.eval()


def run_layer(layer: torch.nn.Module, hidden: torch.Tensor, extra: tuple[tuple, dict]) -> torch.Tensor:
    args, kwargs = extra
    with torch.no_grad():
        out = layer(hidden, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


class HiddenStates:
    """The calibration hidden states, batch by batch, carried forward one layer at a time."""

    def __init__(self, model: LayerwiseModel, token_ids: torch.Tensor, batch_size: int):
        self.hidden: list[torch.Tensor] = []
        self.extras: list[list[tuple[tuple, dict]]] = []
        for ids in token_ids.split(batch_size):
            h, extra = model.layer_inputs(ids)
            self.hidden.append(h)
            self.extras.append(extra)

    def fork(self) -> "HiddenStates":
        """A copy of these states to carry through another model of the same attention (a proxy):
        its own hidden states, the same per-layer position and mask inputs."""
        other = object.__new__(HiddenStates)
        other.hidden, other.extras = [h.clone() for h in self.hidden], self.extras
        return other

    def advance(self, layer: torch.nn.Module, index: int) -> None:
        """Push every batch through decoder layer `index`."""
        for b, h in enumerate(self.hidden):
            self.hidden[b] = run_layer(layer, h, self.extras[b][index])

    def observe(self, layer: torch.nn.Module, index: int) -> None:
        """Push every batch through decoder layer `index` for its hooks only: the hidden states
        stay where they are (e.g. scored by the original layer, then advanced by the proxy's)."""
        for b, h in enumerate(self.hidden):
            run_layer(layer, h, self.extras[b][index])
