"""Synthetic DeepSeek-V3-style checkpoints for the build benchmarks, and their byte facts.

Real format (sharded safetensors + index + config), grouped routing, a dense first layer,
a shared expert, bf16 experts, fp32 routers and correction biases, random weights, one layer
per shard. `BENCH` is the benchmark's shape (H = 2048, 64 experts of width 512: one MoE
layer's experts are 403 MB); `QUICK` is a tiny one (16 experts, a few MB) for smoke runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe_proxy.pruning.writer import OutTensor, header_bytes

KEYS = ("bench-access-key", "bench-secret-key")
GB = 1 << 30


@dataclass(frozen=True)
class Dims:
    hidden: int = 2048
    moe_inter: int = 512
    dense_inter: int = 4096
    vocab: int = 32000
    experts: int = 64
    n_group: int = 4
    topk_group: int = 2
    top_k: int = 8
    keep: int = 8  # experts the benchmark's proxy keeps
    heads: int = 16
    q_lora: int = 512
    kv_lora: int = 512
    rope: int = 64
    nope: int = 128
    v_head: int = 128

    @property
    def layer_expert_bytes(self) -> int:
        """One MoE layer's routed experts (bf16)."""
        return self.experts * 3 * self.hidden * self.moe_inter * 2

    @property
    def router_bytes(self) -> int:
        """One MoE layer's router weight and correction bias (fp32)."""
        return (self.experts * self.hidden + self.experts) * 4

    @property
    def rss_target(self) -> int:
        """The build's memory target: 1.5 x one layer's experts + 512 MiB."""
        return int(1.5 * self.layer_expert_bytes) + (512 << 20)


BENCH = Dims()
QUICK = Dims(hidden=256, moe_inter=128, dense_inter=512, vocab=1024, experts=16, top_k=4, keep=8, heads=4,
             q_lora=64, kv_lora=64, rope=16, nope=32, v_head=32)


def bf16(shape, rng) -> bytes:
    """Random finite bf16 values (sign and mantissa random, exponent in a small range), fast."""
    u = rng.integers(0, 1 << 16, size=math.prod(shape), dtype=np.uint16)
    return ((u & 0x807F) | 0x3C00).tobytes()


def layer_tensors(d: Dims, layer: int, dense: bool) -> list[tuple[str, str, tuple]]:
    p, h = f"model.layers.{layer}.", d.hidden
    out = [(p + "input_layernorm.weight", "BF16", (h,)), (p + "post_attention_layernorm.weight", "BF16", (h,)),
           (p + "self_attn.q_a_proj.weight", "BF16", (d.q_lora, h)),
           (p + "self_attn.q_a_layernorm.weight", "BF16", (d.q_lora,)),
           (p + "self_attn.q_b_proj.weight", "BF16", (d.heads * (d.nope + d.rope), d.q_lora)),
           (p + "self_attn.kv_a_proj_with_mqa.weight", "BF16", (d.kv_lora + d.rope, h)),
           (p + "self_attn.kv_a_layernorm.weight", "BF16", (d.kv_lora,)),
           (p + "self_attn.kv_b_proj.weight", "BF16", (d.heads * (d.nope + d.v_head), d.kv_lora)),
           (p + "self_attn.o_proj.weight", "BF16", (h, d.heads * d.v_head))]
    if dense:
        return out + [(p + f"mlp.{n}_proj.weight", "BF16", s) for n, s in
                      (("gate", (d.dense_inter, h)), ("up", (d.dense_inter, h)), ("down", (h, d.dense_inter)))]
    out += [(p + "mlp.gate.weight", "F32", (d.experts, h)), (p + "mlp.gate.e_score_correction_bias", "F32", (d.experts,))]
    mlp = (("gate", (d.moe_inter, h)), ("up", (d.moe_inter, h)), ("down", (h, d.moe_inter)))
    out += [(p + f"mlp.shared_experts.{n}_proj.weight", "BF16", s) for n, s in mlp]
    for e in range(d.experts):
        out += [(p + f"mlp.experts.{e}.{n}_proj.weight", "BF16", s) for n, s in mlp]
    return out


def generate(path: Path, gb: float, d: Dims = BENCH) -> Path:
    """A sharded checkpoint of about `gb` GB (at least one MoE layer), one layer per shard.
    Cached on disk: a folder that has its index is reused."""
    if (path / "model.safetensors.index.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    fixed = 2 * d.vocab * d.hidden * 2 + 3 * d.hidden * d.dense_inter * 2
    n_moe = max(1, round((gb * GB - fixed) / (d.layer_expert_bytes * 1.1)))
    layers = 1 + n_moe
    groups = [[("model.embed_tokens.weight", "BF16", (d.vocab, d.hidden))] + layer_tensors(d, 0, dense=True)]
    groups += [layer_tensors(d, i, dense=False) for i in range(1, layers)]
    groups[-1] += [("model.norm.weight", "BF16", (d.hidden,)), ("lm_head.weight", "BF16", (d.vocab, d.hidden))]
    rng = np.random.default_rng(0)
    weight_map, total = {}, 0
    for i, tensors in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"

        def data(n, dtype, shape):
            if dtype == "F32":  # routers: real floats, so clustering has something to find
                return rng.normal(0, 0.02 if "bias" not in n else 0.001, math.prod(shape)).astype(np.float32).tobytes()
            return bf16(shape, rng)

        outs = [OutTensor(n, dt, s, []) for n, dt, s in tensors]
        with open(path / name, "wb") as f:
            f.write(header_bytes(outs))
            for n, dt, s in tensors:
                f.write(data(n, dt, s))
        for t in outs:
            weight_map[t.name] = name
            total += t.nbytes
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": d.hidden,
        "intermediate_size": d.dense_inter, "moe_intermediate_size": d.moe_inter, "num_hidden_layers": layers,
        "n_routed_experts": d.experts, "n_shared_experts": 1, "num_experts_per_tok": d.top_k, "n_group": d.n_group,
        "topk_group": d.topk_group, "first_k_dense_replace": 1, "vocab_size": d.vocab,
        "num_attention_heads": d.heads, "kv_lora_rank": d.kv_lora, "q_lora_rank": d.q_lora,
        "qk_rope_head_dim": d.rope, "qk_nope_head_dim": d.nope, "v_head_dim": d.v_head, "torch_dtype": "bfloat16",
        "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    }, indent=2))
    return path


@dataclass
class Facts:
    """What a build of this checkpoint must move, from its own files."""
    bytes: int  # all shards
    shards: int
    moe_layers: int
    headers: int  # safetensors header bytes, all shards
    routers: int  # router tensors, all MoE layers

    @classmethod
    def of(cls, path: Path, d: Dims) -> "Facts":
        shards = sorted(path.glob("*.safetensors"))
        index = json.loads((path / "model.safetensors.index.json").read_text())
        n_moe = sum(1 for k in index["weight_map"] if k.endswith("mlp.gate.weight"))
        headers = sum(8 + int.from_bytes(f.open("rb").read(8), "little") for f in shards)
        return cls(sum(f.stat().st_size for f in shards), len(shards), n_moe, headers, n_moe * d.router_bytes)


def upload(client, path: Path, bucket: str, prefix: str) -> None:
    for f in sorted(path.iterdir()):
        client.upload_file(str(f), bucket, f"{prefix}/{f.name}")


def read_object(client, bucket: str, key: str) -> bytes:
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()
