"""`moe-proxy inspect`: what a checkpoint is, from its config and headers alone."""

from __future__ import annotations

from moe_proxy.architectures import detect, expert_count, groups, top_k
from moe_proxy.checkpoint.reader import Checkpoint
from moe_proxy.checkpoint.layout import find_layout
from moe_proxy.checkpoint.params import stored_params


def summarize(ckpt: Checkpoint) -> dict:
    arch = detect(ckpt.config)
    layout = find_layout(ckpt, arch)
    n_group, topk_group = groups(arch, ckpt.config)
    n_layers = ckpt.config.get("num_hidden_layers")
    moe_layers = [b.layer for b in layout.blocks]
    shared = sorted({n.split(".shared_expert")[0] for n in layout.backbone if ".shared_expert" in n})
    return {
        "uri": ckpt.uri,
        "architecture": arch.name,
        "model_type": ckpt.config.get("model_type"),
        "layers": n_layers,
        "moe_layers": moe_layers,
        "dense_layers": [i for i in range(n_layers or 0) if i not in moe_layers],
        "mtp_layers": [i for i in moe_layers if n_layers is not None and i >= n_layers],
        "experts": expert_count(arch, ckpt.config),
        "top_k": top_k(arch, ckpt.config),
        "layers_with_shared_experts": len(shared),
        "grouped_routing": {"n_group": n_group, "topk_group": topk_group} if n_group > 1 else None,
        "expert_layout": "fused" if any(b.fused for b in layout.blocks) else "per-expert",
        "dtypes": sorted({t.dtype for t in ckpt.tensors.values()}),
        "params": {k.removesuffix("_before"): v for k, v in stored_params(ckpt, layout).items()},
        "bytes": sum(ckpt.file_sizes.values()),
        "shards": len(ckpt.files),
    }


def human(n: float, unit: str = "") -> str:
    for suffix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.4g}{suffix}{unit}"
        n /= 1000
    return f"{n:.4g}P{unit}"


def text(d: dict) -> str:
    g = d["grouped_routing"]
    lines = [
        f"checkpoint     {d['uri']}",
        f"architecture   {d['architecture']} ({d['model_type']})",
        f"layers         {d['layers']}: {len(d['dense_layers'])} dense, "
        f"{len(d['moe_layers']) - len(d['mtp_layers'])} MoE"
        + (f"; plus {len(d['mtp_layers'])} MTP layer{'s' if len(d['mtp_layers']) > 1 else ''} (MoE, "
           f"layer {', '.join(map(str, d['mtp_layers']))}), pruned alike" if d["mtp_layers"] else ""),
        f"experts        {d['experts']} routed per MoE layer, top-{d['top_k']}, {d['expert_layout']}",
        f"shared experts {'yes' if d['layers_with_shared_experts'] else 'none'}",
        f"grouped        {'n_group=%d, topk_group=%d' % (g['n_group'], g['topk_group']) if g else 'no'}",
        f"parameters     {human(d['params']['total'])} total, {human(d['params']['active'])} active per token",
        f"size           {human(d['bytes'], 'B')} in {d['shards']} shard(s), dtypes {', '.join(d['dtypes'])}",
    ]
    return "\n".join(lines)
