"""What moe-proxy knows of each MoE architecture, as data.

Tensor roles are found from tensor *names* (see layout.py): an MoE block is whatever holds
`<block>.experts.<E>.*` (per-expert) or `<block>.experts.<name>` (fused, expert axis 0).
What differs between architectures is small and declarative: where the router sits relative
to the block, which per-expert vectors ride along with it, which config fields count
experts, and whether routing is grouped. Adding an architecture is adding one `Arch`.
Torch-free: the operator and planner import this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import NotMoE, UnsupportedArchitecture


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
    notes: str = ""


ARCHITECTURES: tuple[Arch, ...] = (
    Arch("Mixtral", ("mixtral",), ("num_local_experts", "num_experts")),
    Arch("Qwen2-MoE", ("qwen2_moe",), ("num_experts",),
         notes="shared_expert and shared_expert_gate are kept whole"),
    Arch("Qwen3-MoE", ("qwen3_moe",), ("num_experts", "num_local_experts")),
    Arch("DeepSeek-V2", ("deepseek_v2",), ("n_routed_experts",),
         group_keys=("n_group", "topk_group"), grouped_when={"topk_method": "group_limited_greedy"}),
    Arch("DeepSeek-V3", ("deepseek_v3", "kimi_k2"), ("n_routed_experts",),
         router=("gate.weight", "gate.e_score_correction_bias"), group_keys=("n_group", "topk_group"),
         min_per_group=2, notes="also Kimi-K2 (same layout); the MTP layer (index num_hidden_layers) is pruned alike"),
    Arch("GLM-4.5 MoE", ("glm4_moe",), ("n_routed_experts",),
         router=("gate.weight", "gate.e_score_correction_bias"), group_keys=("n_group", "topk_group"),
         min_per_group=2, notes="the MTP layer (index num_hidden_layers) is pruned alike"),
    Arch("OLMoE", ("olmoe",), ("num_experts", "num_local_experts")),
    Arch("GPT-OSS", ("gpt_oss",), ("num_local_experts", "num_experts"),
         router=("router.weight", "router.bias"), top_k_keys=("num_experts_per_tok", "experts_per_token"),
         notes="fused experts, also MXFP4 blocks/scales"),
)


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
