"""Checkpoints in the Hugging Face layout, written without torch: config.json, a shard index
and safetensors shards (a real header, zero data). The listing reads headers and JSON only,
so what the tensors hold does not matter; their declared sizes do.

`files(...)` gives {name: bytes}; `write(dir, files)` puts them on disk and `upload(...)`
into a bucket, so the same checkpoint can be tested locally and on SeaweedFS.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_proxy.checkpoint.reader import INDEX, ITEMSIZE, MANIFEST
from moe_proxy.pruning.writer import OutTensor, header_bytes

QWEN3_TINY = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256, "hidden_size": 128,
    "intermediate_size": 256, "moe_intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
}
DENSE_TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 128,
              "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4}


def shard(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> bytes:
    """A safetensors file: its header, then zeros for every tensor's declared bytes."""
    out = [OutTensor(name, dtype, shape, []) for name, (dtype, shape) in tensors.items()]
    data = sum(t.nbytes for t in out)
    return header_bytes(out) + bytes(data)


def tensors_of(config: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors of a small model of this config: embeddings, per layer a router and its experts
    (or a dense MLP), norms."""
    h, inter, vocab = config["hidden_size"], config.get("moe_intermediate_size", config["intermediate_size"]), \
        config["vocab_size"]
    experts = config.get("num_experts") or config.get("n_routed_experts") or 0
    out = {"model.embed_tokens.weight": ("BF16", (vocab, h))}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out[f"{p}.input_layernorm.weight"] = ("BF16", (h,))
        if experts:
            out[f"{p}.mlp.gate.weight"] = ("BF16", (experts, h))
            for e in range(experts):
                for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                    out[f"{p}.mlp.experts.{e}.{proj}.weight"] = ("BF16", shape)
        else:
            for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                out[f"{p}.mlp.{proj}.weight"] = ("BF16", shape)
    out["lm_head.weight"] = ("BF16", (vocab, h))
    return out


def files(config: dict | None = None, shards: int = 2, proxy: bool = False,
          shapes: dict | None = None) -> dict[str, bytes]:
    """A complete checkpoint: config.json, the index and `shards` shards (1: a single
    model.safetensors, no index); with `proxy`, a proxy-manifest.json too. The tensors are
    those of `config`, or of `shapes` (a small config) when config.json is a real model's."""
    config = QWEN3_TINY if config is None else config
    tensors = list(tensors_of(shapes or config).items())
    out = {"config.json": json.dumps(config).encode()}
    if shards == 1:
        out["model.safetensors"] = shard(dict(tensors))
    else:
        per = -(-len(tensors) // shards)
        weight_map, total = {}, 0
        for i in range(shards):
            name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = dict(tensors[i * per:(i + 1) * per])
            out[name] = shard(part)
            weight_map.update({t: name for t in part})
            total += sum(ITEMSIZE[d] * _numel(s) for d, s in part.values())
        out[INDEX] = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}).encode()
    out["generation_config.json"] = b'{"do_sample": true}'
    if proxy:
        out[MANIFEST] = json.dumps({"source": "s3://somewhere", "files": {}}).encode()
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def header_size(data: bytes) -> int:
    """Bytes of a safetensors file's length prefix and header."""
    return 8 + int.from_bytes(data[:8], "little")


def write(directory: Path, content: dict[str, bytes]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in content.items():
        (directory / name).write_bytes(data)
    return directory


def upload(client, bucket: str, prefix: str, content: dict[str, bytes]) -> None:
    for name, data in content.items():
        client.put_object(Bucket=bucket, Key=f"{prefix.strip('/')}/{name}", Body=data)
