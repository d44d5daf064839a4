"""What moe-proxy knows of each MoE architecture, as data.

Tensor roles are found from tensor *names* (see layout.py): an MoE block is whatever holds
`<block>.experts.<E>.*` (per-expert) or `<block>.experts.<name>` (fused, expert axis 0).
What differs between architectures is small and declarative: where the router sits relative
to the block, which per-expert vectors ride along with it, which config fields count
experts, whether routing is grouped, which layers hold experts and what the parameter count
(params.py) and the layer-by-layer loader (layerwise.py) must know. This is the one module
that knows model types: adding an architecture is adding one `Arch`.
Torch-free: the operator and planner import this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_proxy.errors import NotMoE, UnsupportedArchitecture


@dataclass(frozen=True)
class Arch:
    name: str  # what users read
    model_types: tuple[str, ...]  # config.json "model_type" values
    # Config fields that count routed experts per layer; every one present is rewritten.
    expert_count_keys: tuple[str, ...]
    # Router tensors relative to the MoE block; each has one row/element per expert.
    router: tuple[str, ...] = ("gate.weight",)
    top_k_keys: tuple[str, ...] = ("num_experts_per_tok",)  # every one present is rewritten
    min_per_group: int = 1  # experts each routing group must keep (V3 scores a group by its top-2)
    # Grouped routing: (n_group field, topk_group field), and the config condition that turns it on.
    group_keys: tuple[str, str] | None = None
    grouped_when: dict[str, str] = field(default_factory=dict)  # e.g. {"topk_method": "group_limited_greedy"}
    # Which decoder layers hold routed experts: "all"; "first_k_dense" (all from config's
    # first_k_dense_replace on, every moe_layer_freq-th); "sparse_step" (every
    # decoder_sparse_step-th, except mlp_only_layers).
    moe_layers: str = "all"
    # Attention and expert parameters config.json does not spell out (params.py).
    qkv_bias: bool = False  # q/k/v projections have biases even without attention_bias
    qk_norm: str | None = None  # RMSNorm on q and k: "head" (one per head) or "all" (over all channels)
    attention_sinks: bool = False  # one learned sink logit per attention head
    expert_biases: bool = False  # each routed expert's projections have biases
    # Checkpoint (hub) names where transformers' modules differ (layerwise.py): the MoE block
    # that the modules call `mlp`, and the per-expert projections that transformers stacks into
    # its fused `gate_up_proj` and `down_proj`.
    hub_moe: str = "mlp"
    hub_gate_up: tuple[str, ...] = ("gate_proj", "up_proj")
    hub_down: tuple[str, ...] = ("down_proj",)
    notes: str = ""


ARCHITECTURES: tuple[Arch, ...] = (
    Arch("Mixtral", ("mixtral",), ("num_local_experts", "num_experts"),
         hub_moe="block_sparse_moe", hub_gate_up=("w1", "w3"), hub_down=("w2",)),
    Arch("Qwen2-MoE", ("qwen2_moe",), ("num_experts",), moe_layers="sparse_step", qkv_bias=True,
         notes="shared_expert and shared_expert_gate are kept whole"),
    Arch("Qwen3-MoE", ("qwen3_moe",), ("num_experts", "num_local_experts"), moe_layers="sparse_step",
         qk_norm="head"),
    Arch("DeepSeek-V2", ("deepseek_v2",), ("n_routed_experts",),
         group_keys=("n_group", "topk_group"), grouped_when={"topk_method": "group_limited_greedy"},
         moe_layers="first_k_dense"),
    Arch("DeepSeek-V3", ("deepseek_v3", "kimi_k2"), ("n_routed_experts",),
         router=("gate.weight", "gate.e_score_correction_bias"), group_keys=("n_group", "topk_group"),
         min_per_group=2, moe_layers="first_k_dense",
         notes="also Kimi-K2 (same layout); the MTP layer (index num_hidden_layers) is pruned alike"),
    Arch("GLM-4.5 MoE", ("glm4_moe",), ("n_routed_experts",),
         router=("gate.weight", "gate.e_score_correction_bias"), group_keys=("n_group", "topk_group"),
         min_per_group=2, moe_layers="first_k_dense", notes="the MTP layer (index num_hidden_layers) is pruned alike"),
    Arch("OLMoE", ("olmoe",), ("num_experts", "num_local_experts"), qk_norm="all"),
    Arch("GPT-OSS", ("gpt_oss",), ("num_local_experts", "num_experts"),
         router=("router.weight", "router.bias"), top_k_keys=("num_experts_per_tok", "experts_per_token"),
         attention_sinks=True, expert_biases=True, notes="fused experts, also MXFP4 blocks/scales"),
)


# Model types transformers has no classes for, and the model type whose classes run them:
# Kimi-K2 is DeepSeek-V3's architecture under another name (its checkpoints ship DeepSeek-V3's
# remote code), so verify, calibrate, heal and repro run it with transformers' DeepSeek-V3.
TRANSFORMERS_MODEL_TYPE = {"kimi_k2": "deepseek_v3"}


def supported() -> str:
    return ", ".join(f"{a.name} ({'/'.join(a.model_types)})" for a in ARCHITECTURES)


def detect(config: dict) -> Arch:
    """The architecture of a config.json, or a clear error naming what is supported."""
    model_type = config.get("model_type")
    text = config.get("text_config")
    for arch in ARCHITECTURES:
        if model_type in arch.model_types:
            return arch
    if isinstance(text, dict) and text.get("model_type"):
        for arch in ARCHITECTURES:
            if text["model_type"] in arch.model_types:
                return arch
    names = config.get("architectures") or []
    if model_type is None and not names:
        raise UnsupportedArchitecture("config.json has neither model_type nor architectures")
    if not any(k in config for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")):
        raise NotMoE(
            f"model_type {model_type!r} ({', '.join(names) or 'no architectures field'}) is not a "
            f"mixture-of-experts model: config.json counts no routed experts, so there is nothing to prune"
        )
    raise UnsupportedArchitecture(
        f"architecture {model_type!r} ({', '.join(names) or '?'}) is not supported; supported: {supported()}"
    )


def expert_count(arch: Arch, config: dict) -> int:
    for key in arch.expert_count_keys:
        if isinstance(config.get(key), int):
            return config[key]
    raise NotMoE(f"config.json has no routed-expert count ({' / '.join(arch.expert_count_keys)})")


def top_k(arch: Arch, config: dict) -> int:
    k = config.get(arch.top_k_keys[0])
    if not isinstance(k, int) or k < 1:
        raise UnsupportedArchitecture(f"config.json has no valid {arch.top_k_keys[0]} (top-k): {k!r}")
    return k


def groups(arch: Arch, config: dict) -> tuple[int, int]:
    """(n_group, topk_group) when routing is grouped, else (1, 1)."""
    if arch.group_keys is None:
        return 1, 1
    if any(config.get(k) != v for k, v in arch.grouped_when.items()):
        return 1, 1
    n_group, topk_group = (config.get(k) or 1 for k in arch.group_keys)
    return int(n_group), int(topk_group)
