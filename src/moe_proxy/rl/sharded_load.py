"""Loading a run's models straight into their shards: no rank ever holds the whole model.

A rank of a distributed run builds the model on the meta device (transformers' own classes and
config, no storage), shards it with FSDP2 (distributed.shard), materialises only its shards
(`to_empty`) and fills them with the rows (dim 0) it owns, read from the checkpoint's
safetensors by byte range through checkpoint.module_tensors (local files or s3://). Buffers are
not sharded: persistent ones (DeepSeek's correction bias) are read whole, non-persistent ones
(rotary tables) are computed by the model's own initialisation, as from_pretrained does. Tied
weights stay one parameter (the meta model is tied before sharding), filled once.

A one-process run loads with `from_pretrained` instead: the distributed runs are checked against
it (tests/repro/test_distributed.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_proxy.checkpoint.module_tensors import ModuleTensors, Rows
from moe_proxy.checkpoint.reader import Checkpoint
from moe_proxy.errors import CorruptCheckpoint


def meta_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The causal LM of the checkpoint at `path` (config.json, generation_config.json) on the meta
    device: its modules and settings as from_pretrained gives them, without weights."""
    import transformers

    from moe_proxy.layerwise.load import transformers_config

    config = transformers_config(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (path / "generation_config.json").exists():
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    return model.eval()


def owned_rows(param: torch.Tensor) -> Rows | None:
    """The rows [start, stop) of dim 0 this rank holds of a parameter FSDP2 sharded (a DTensor
    sharded on dim 0 of a 1-D mesh); None for a tensor that is not sharded."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return None
    (placement,) = param.placements
    if placement.is_replicate():
        return None
    if not placement.is_shard(0):
        raise ValueError(f"expected FSDP's dim-0 sharding, got {param.placements}")
    mesh = param.device_mesh
    size, start = Shard.local_shard_size_and_offset(param.shape[0], mesh.size(0), mesh.get_local_rank(0))
    return start, start + size


def load_shards(model: torch.nn.Module, ckpt: Checkpoint, device: torch.device) -> torch.nn.Module:
    """Materialise `model` (built by meta_model, then sharded) on `device` with the checkpoint's
    values: this rank's rows of every parameter, every buffer whole."""
    computed = {name for name, _ in model.named_non_persistent_buffers()}
    model.to_empty(device=device)
    tensors = ModuleTensors(ckpt)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied parameters come once
            local = param.to_local() if hasattr(param, "to_local") else param
            local.copy_(tensors.tensor(name, param, owned_rows(param) if param.dim() else None))
        for name, buffer in model.named_buffers():
            if name not in computed:
                buffer.copy_(tensors.tensor(name, buffer))
            elif buffer.is_floating_point():
                buffer.fill_(torch.nan)  # so that one the model's initialisation misses shows
        for owner in sorted({name.rpartition(".")[0] for name in computed}):
            model._init_weights(model.get_submodule(owner))  # rotary tables: transformers' own formula
    buffers = dict(model.named_buffers())
    missed = [name for name in sorted(computed) if buffers[name].is_floating_point() and buffers[name].isnan().any()]
    if missed:
        raise CorruptCheckpoint(f"{ckpt.uri}: {type(model).__name__}'s initialisation does not compute its "
                                f"buffer(s) {', '.join(missed)}; this model cannot be loaded sharded")
    return model
