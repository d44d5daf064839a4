"""`moe-proxy verify`: is a proxy complete and consistent?

1. The manifest exists and every file it lists has its recorded size and sha256.
2. config.json agrees with the tensors: expert counts, contiguous expert numbering 0..k-1
   in every MoE block (transformers would load a gap silently, misrouting), top-k and
   grouped-routing constraints.
3. When transformers is installed: the proxy loads with AutoModelForCausalLM and runs a
   forward pass to finite logits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from moe_proxy.architectures import detect, expert_count, groups, top_k
from moe_proxy.checkpoint.reader import MANIFEST, open_checkpoint, read_json
from moe_proxy.errors import CorruptCheckpoint
from moe_proxy.checkpoint.layout import find_layout
from moe_proxy.storage import open_store, sha256_of


@dataclass
class Report:
    uri: str
    files_checked: int = 0
    problems: list[str] = field(default_factory=list)
    forward: str = "skipped"

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(uri: str, *, forward: bool = True, progress: bool = False, store_options: dict | None = None) -> Report:
    store = open_store(uri, **(store_options or {}))
    if not store.exists(MANIFEST):
        raise CorruptCheckpoint(f"{store.uri}: no {MANIFEST}: not a complete proxy (interrupted build?)")
    ckpt = open_checkpoint(store)
    report = Report(ckpt.uri)
    manifest = read_json(ckpt.store, MANIFEST)
    for name, rec in tqdm(sorted(manifest.get("files", {}).items()), desc="hashing", unit="file", disable=not progress):
        if not ckpt.store.exists(name):
            report.problems.append(f"{name}: listed in the manifest but missing")
        elif ckpt.store.size(name) != rec["size"]:
            report.problems.append(f"{name}: {ckpt.store.size(name)} bytes, manifest says {rec['size']}")
        elif sha256_of(ckpt.store, name) != rec["sha256"]:
            report.problems.append(f"{name}: sha256 differs from the manifest")
        report.files_checked += 1

    arch = detect(ckpt.config)
    layout = find_layout(ckpt, arch)  # raises on numbering gaps and count mismatches
    n, k = expert_count(arch, ckpt.config), top_k(arch, ckpt.config)
    n_group, topk_group = groups(arch, ckpt.config)
    if not 1 <= k <= n:
        report.problems.append(f"top-k {k} is not within 1..{n} experts")
    if n % n_group or n // n_group < arch.min_per_group or topk_group > n_group:
        report.problems.append(f"grouped routing invalid: {n} experts, n_group={n_group}, topk_group={topk_group}")
    for b in layout.blocks:
        router, axis = next(iter(b.router.values()))
        if router.shape[axis] != n:
            report.problems.append(f"{router.name}: {router.shape[axis]} router rows for {n} experts")
    if manifest.get("experts", {}).get("after") not in (None, n):
        report.problems.append(f"manifest says {manifest['experts']['after']} experts, config.json says {n}")
    if forward and report.ok:
        report.forward = run_forward(ckpt.store, ckpt.config)
        if report.forward.startswith("failed"):
            report.problems.append(f"transformers: {report.forward}")
    return report


def run_forward(store, config: dict) -> str:
    """Load with transformers and run one forward pass; 'skipped ...' when it is not installed."""
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        return "skipped (transformers not installed)"
    from moe_proxy.storage.materialize import local_copy

    transformers.logging.set_verbosity_error()  # its load report would list the MTP layer it skips
    with local_copy(store) as path:
        try:
            model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
        except Exception as exc:  # transformers raises many types; the message is what matters
            return f"failed to load: {exc}"
        n_layers = config.get("num_hidden_layers")
        unexpected = [k for k in info["unexpected_keys"] if not k.startswith(f"model.layers.{n_layers}.")]
        if info["missing_keys"] or unexpected or info["mismatched_keys"]:
            return (f"failed: missing {sorted(info['missing_keys'])[:3]}, unexpected {unexpected[:3]}, "
                    f"mismatched {info['mismatched_keys'][:3]}")
        vocab = min(int(config.get("vocab_size", 32)), 1000)
        x = torch.arange(8).remainder(vocab).unsqueeze(0)
        with torch.no_grad():
            logits = model.eval()(x).logits
        if not torch.isfinite(logits).all():
            return "failed: forward pass produced non-finite logits"
        return f"ok (logits {list(logits.shape)}, finite)"


def text(r: Report) -> str:
    head = "OK" if r.ok else "FAILED"
    lines = [f"{head}: {r.uri}", f"  files hashed   {r.files_checked}", f"  forward pass   {r.forward}"]
    lines += [f"  problem: {p}" for p in r.problems]
    return "\n".join(lines)


def as_json(r: Report) -> str:
    return json.dumps({"uri": r.uri, "ok": r.ok, "files_checked": r.files_checked, "forward": r.forward,
                       "problems": r.problems}, indent=2)
