"""Parameter counts, total and active per token, two ways. Torch-free (no numpy either).

- `config_params`: from config.json alone, for a checkpoint that may not exist yet (the
  planner sizes the original and any proxy of it before a byte is read). Counts what
  transformers stores for the architecture (tests check it against transformers' own models).
- `stored_params`: from a checkpoint's safetensors headers, what is actually stored (every
  tensor, whatever its quantisation), for `inspect` and a build's manifest.

Architecture facts they need (which layers are MoE, attention biases and norms, expert
biases) are fields of the `Arch` entries in architectures.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_proxy.architectures import Arch, detect, expert_count, top_k
from moe_proxy.errors import InvalidExpertCount

if TYPE_CHECKING:
    from moe_proxy.checkpoint.reader import Checkpoint
    from moe_proxy.checkpoint.layout import Layout


@dataclass(frozen=True)
class Params:
    total: int
    active: int  # per token: backbone + top-k routed experts + shared experts


# --- reading config.json -------------------------------------------------------------------


def text_config(config: dict) -> dict:
    """The language-model part of a config (multimodal checkpoints nest it in text_config)."""
    inner = config.get("text_config")
    if isinstance(inner, dict) and "hidden_size" not in config:
        return {**inner, "model_type": inner.get("model_type", config.get("model_type"))}
    return config


def config_int(config: dict, *keys: str, default: int | None = None) -> int:
    """The first of `keys` that config.json sets to an integer (else `default`, else an error)."""
    for key in keys:
        if isinstance(config.get(key), int):
            return config[key]
    if default is None:
        raise InvalidExpertCount(f"config.json lacks {' / '.join(keys)}, needed to plan")
    return default


def moe_layer_indices(config: dict, arch: Arch | None = None) -> list[int]:
    """Indices of the decoder layers that hold routed experts (MTP layers not counted)."""
    arch = arch or detect(config)
    n = config_int(config, "num_hidden_layers")
    if arch.moe_layers == "first_k_dense":
        first, freq = config.get("first_k_dense_replace") or 0, config.get("moe_layer_freq") or 1
        return [i for i in range(n) if i >= first and i % freq == 0]
    if arch.moe_layers == "sparse_step":
        step, dense = config.get("decoder_sparse_step") or 1, set(config.get("mlp_only_layers") or [])
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    return list(range(n))


def expert_width(c: dict) -> int:
    """One routed expert's intermediate size."""
    return c.get("moe_intermediate_size") or c["intermediate_size"]


# --- from config.json ------------------------------------------------------------------------


def _attention(c: dict, arch: Arch) -> int:
    h, heads = c["hidden_size"], config_int(c, "num_attention_heads")
    if c.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2)
        rope, nope, v = c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
        q_rank = c.get("q_lora_rank")
        q = h * q_rank + q_rank + q_rank * heads * (nope + rope) if q_rank else h * heads * (nope + rope)
        kv = h * (c["kv_lora_rank"] + rope) + c["kv_lora_rank"] + c["kv_lora_rank"] * heads * (nope + v)
        return q + kv + heads * v * h
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    total = h * q + 2 * h * kv + q * h
    if c.get("attention_bias") or c.get("qkv_bias") or arch.qkv_bias:
        total += q + 2 * kv + (h if c.get("attention_bias") else 0)
    if arch.qk_norm == "head":  # RMSNorm per head on q and k
        total += 2 * head_dim
    elif arch.qk_norm == "all":  # RMSNorm over all q and k channels
        total += q + kv
    if arch.attention_sinks:  # one sink logit per head
        total += heads
    return total


def _expert(c: dict, arch: Arch) -> int:
    """One routed expert (gated MLP: gate, up, down)."""
    h, i = c["hidden_size"], expert_width(c)
    return 3 * h * i + (2 * i + h if arch.expert_biases else 0)


def _router(c: dict, arch: Arch, n_experts: int) -> int:
    """Router rows plus the per-expert vectors that ride with them (bias, correction bias)."""
    return n_experts * (c["hidden_size"] + len(arch.router) - 1)


def _shared(c: dict) -> int:
    h = c["hidden_size"]
    if c.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one gated shared expert
        return 3 * h * c["shared_expert_intermediate_size"] + h
    if c.get("n_shared_experts"):  # DeepSeek, GLM: one MLP of n_shared times the expert width
        return 3 * h * expert_width(c) * c["n_shared_experts"]
    return 0


def config_params(config: dict, experts: int | None = None, k: int | None = None) -> Params:
    """Parameters of the checkpoint described by config.json, with `experts` routed experts per
    MoE layer (default: as the config says) and top-`k` routing (default: as the config says)."""
    c = text_config(config)
    arch = detect(c)
    n = expert_count(arch, c) if experts is None else experts
    k = top_k(arch, c) if k is None else k
    h, vocab, layers = c["hidden_size"], c["vocab_size"], config_int(c, "num_hidden_layers")
    moe = set(moe_layer_indices(c, arch))
    embed = vocab * h * (1 if c.get("tie_word_embeddings") else 2)
    backbone = embed + h  # final norm
    routed_total = routed_active = 0
    for i in range(layers):
        backbone += _attention(c, arch) + 2 * h
        if i in moe:
            backbone += _router(c, arch, n) + _shared(c)
            routed_total += n * _expert(c, arch)
            routed_active += min(k, n) * _expert(c, arch)
        else:
            backbone += 3 * h * c["intermediate_size"]
    return Params(total=backbone + routed_total, active=backbone + routed_active)


# --- from the headers ------------------------------------------------------------------------


def stored_params(ckpt: Checkpoint, layout: Layout, experts: int | None = None,
                  k: int | None = None) -> dict[str, int]:
    """Stored elements, total and active per token (top-k of the routed experts), as
    {total,active}_before; with `experts` (and the proxy's top-`k`) also {total,active}_after,
    for the proxy that keeps `experts` routed experts per MoE layer."""
    total = sum(t.numel for t in ckpt.tensors.values())
    n, k0 = expert_count(layout.arch, ckpt.config), top_k(layout.arch, ckpt.config)
    routed = sum(b.expert_numel for b in layout.blocks)
    router = sum(t.numel for b in layout.blocks for t, _ in b.router.values())
    out = {"total_before": total, "active_before": total - routed + routed * k0 // n}
    if experts is not None:
        tk = k0 if k is None else k
        after = total - routed - router + routed * experts // n + router * experts // n
        out |= {"total_after": after, "active_after": after - routed * experts // n + routed * tk // n}
    return out
