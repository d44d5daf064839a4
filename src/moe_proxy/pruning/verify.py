"""`moe-proxy verify`: is a proxy complete and consistent?

1. The manifest exists and every file it lists has its recorded size and sha256; every
   file the proxy is made of (config, index, shards) is listed.
2. config.json agrees with the tensors: shard headers within their files, expert counts,
   router rows, contiguous expert numbering 0..k-1 in every MoE block (transformers would
   load a gap silently, misrouting), top-k and grouped-routing constraints.
3. When transformers is installed: the proxy loads with AutoModelForCausalLM and runs a
   forward pass to finite logits (non-finite weights are named with their shard).

Every failed check is a problem in the report (exit status 1), naming the file and the
reason; only a missing manifest (not a proxy at all) raises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from moe_proxy.architectures import detect, expert_count, groups, top_k
from moe_proxy.checkpoint.reader import INDEX, MANIFEST, open_checkpoint, read_json
from moe_proxy.errors import CorruptCheckpoint, NotMoE, UnsupportedArchitecture
from moe_proxy.checkpoint.layout import find_layout
from moe_proxy.pruning.fidelity import figure_lines
from moe_proxy.storage import open_store, sha256_of


@dataclass
class Report:
    uri: str
    files_checked: int = 0
    problems: list[str] = field(default_factory=list)
    forward: str = "skipped"
    fidelity: dict | None = None  # the build's fidelity figure, as its manifest records it

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(uri: str, *, forward: bool = True, progress: bool = False, store_options: dict | None = None) -> Report:
    store = open_store(uri, **(store_options or {}))
    if not store.exists(MANIFEST):
        raise CorruptCheckpoint(f"{store.uri}: no {MANIFEST}: not a complete proxy (interrupted build?)")
    report = Report(store.uri)
    manifest = read_json(store, MANIFEST)
    report.fidelity = manifest.get("fidelity")
    listed = manifest.get("files", {})
    for name, rec in tqdm(sorted(listed.items()), desc="hashing", unit="file", disable=not progress):
        if not store.exists(name):
            report.problems.append(f"{name}: listed in the manifest but missing")
        elif store.size(name) != rec["size"]:
            report.problems.append(f"{name}: {store.size(name)} bytes, manifest says {rec['size']} (truncated or altered)")
        elif sha256_of(store, name) != rec["sha256"]:
            report.problems.append(f"{name}: sha256 differs from the manifest (the bytes changed)")
        report.files_checked += 1

    try:  # a proxy whose headers or layout are broken is a failed verification, not bad input
        ckpt = open_checkpoint(store)
        arch = detect(ckpt.config)
        layout = find_layout(ckpt, arch)  # numbering gaps, router rows vs config's expert count
    except (CorruptCheckpoint, NotMoE, UnsupportedArchitecture) as exc:
        report.problems.append(str(exc))
        return report
    for name in ["config.json", *([INDEX] if store.exists(INDEX) else []), *ckpt.files]:
        if name not in listed:
            report.problems.append(f"{name}: part of the proxy but not listed in the manifest")
    n, k = expert_count(arch, ckpt.config), top_k(arch, ckpt.config)
    n_group, topk_group = groups(arch, ckpt.config)
    if not 1 <= k <= n:
        report.problems.append(f"top-k {k} is not within 1..{n} experts")
    if n % n_group or n // n_group < arch.min_per_group or topk_group > n_group:
        report.problems.append(f"grouped routing invalid: {n} experts, n_group={n_group}, topk_group={topk_group}")
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
    except ImportError:
        return "skipped (transformers not installed)"
    from moe_proxy.layerwise.load import load_causal_lm
    from moe_proxy.storage.materialize import local_copy

    transformers.logging.set_verbosity_error()  # its load report would list the MTP layer it skips
    with local_copy(store) as path:
        try:
            # mismatched shapes come back in `info` (named below) instead of an opaque exception
            model, info = load_causal_lm(path, output_loading_info=True, ignore_mismatched_sizes=True)
        except Exception as exc:  # transformers raises many types; the message is what matters
            return f"failed to load: {exc}"
        n_layers = config.get("num_hidden_layers")
        unexpected = [k for k in info["unexpected_keys"] if not k.startswith(f"model.layers.{n_layers}.")]
        found = {"missing": sorted(info["missing_keys"]), "unexpected": unexpected,  # lists or sets, by version
                 "mismatched": [f"{k[0]} {list(k[1])} in the file, {list(k[2])} from config" if isinstance(k, tuple)
                                else k for k in sorted(info["mismatched_keys"], key=str)]}
        if any(found.values()):
            return "failed: config.json and the tensors disagree: " + "; ".join(
                f"{what} {', '.join(keys[:3])}"
                for what, keys in found.items() if keys)
        vocab = min(int(config.get("vocab_size", 32)), 1000)
        x = torch.arange(8).remainder(vocab).unsqueeze(0)
        with torch.no_grad():
            logits = model.eval()(x).logits
        if not torch.isfinite(logits).all():
            bad = [name for name, t in model.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
            return f"failed: forward pass produced non-finite logits; non-finite weights: {_where(store, bad)}"
        return f"ok (logits {list(logits.shape)}, finite)"


def _where(store, names: list[str]) -> str:
    """`tensor (shard)` for each name, the shard read from the proxy's headers."""
    if not names:
        return "none (the activations overflow)"
    files = {t.name: t.file for t in open_checkpoint(store).tensors.values()}
    return ", ".join(f"{n} ({files.get(n, '?')})" for n in names[:5])


def text(r: Report) -> str:
    head = "OK" if r.ok else "FAILED"
    lines = [f"{head}: {r.uri}", f"  files hashed   {r.files_checked}", f"  forward pass   {r.forward}"]
    lines += figure_lines(r.fidelity, width=15)
    lines += [f"  problem: {p}" for p in r.problems]
    return "\n".join(lines)


def as_json(r: Report) -> str:
    return json.dumps({"uri": r.uri, "ok": r.ok, "files_checked": r.files_checked, "forward": r.forward,
                       "problems": r.problems, **({"fidelity": r.fidelity} if r.fidelity else {})}, indent=2)
