"""The destination: checked before a build writes (apart from the source; empty, an interrupted
build of it, or a proxy moe-proxy wrote, replaced only with --overwrite), the files earlier
builds wrote there (the only ones a build may delete), and the proxy manifest, written last:
its presence marks the proxy complete.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

from moe_proxy import __version__
from moe_proxy.checkpoint.params import stored_params
from moe_proxy.checkpoint.reader import JOURNAL, MANIFEST
from moe_proxy.errors import DestinationExists
from moe_proxy.pruning.prepared import Prepared
from moe_proxy.pruning.writer import Written
from moe_proxy.storage import Store, overlap

REPLACED = f"{JOURNAL}-replaced.json"  # the files of the proxy this build replaces (--overwrite)


class Published(dict):
    """A manifest as published: the dict, `sha256`, that of the proxy-manifest.json bytes, and
    `up_to_date`, whether dst held this very proxy already (the build was a no-op)."""

    sha256: str = ""
    up_to_date: bool = False


def check_apart(src: str, dst: str) -> None:
    """Refuse a destination that is, contains or lies inside the source, however spelled
    (real paths, symlinks followed; normalised s3:// bucket and prefix): writing there could
    overwrite or delete the source's own files."""
    how = overlap(dst, src)
    if how == "same":
        raise DestinationExists(f"destination {dst} is the source checkpoint itself; choose another directory")
    if how is not None:
        where = "lies inside" if how == "inside" else "contains"
        raise DestinationExists(f"destination {dst} {where} the source checkpoint {src}; a proxy must never be "
                                f"written into or around its source: choose a directory apart from it")


def check_destination(dst: Store, build_id: str, overwrite: bool) -> tuple[Published | None, list[str]]:
    """(the existing manifest when dst already holds this very proxy, else None; the files of
    the proxy this build replaces). dst must be empty, or a moe-proxy output: a finished proxy
    (replaced only with `overwrite`) or an interrupted build (resumed). Anything else is refused
    whatever the flags: --overwrite never deletes a file moe-proxy did not write."""
    names = dst.list()
    if not names:
        return None, []
    manifest = _proxy_manifest(dst) if MANIFEST in names else None
    if manifest is None and not journals(dst):
        some = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise DestinationExists(f"{dst.uri} is not empty and is not a moe-proxy output (it holds {some}); "
                                f"choose a new or empty directory: nothing there is ever deleted, --overwrite "
                                f"replaces only an earlier proxy")
    if manifest is None:  # an interrupted build: resumed, or (another build's) replaced by this one
        return None, []
    if manifest.get("build_id") == build_id and all(dst.exists(f) for f in manifest.get("files", {})):
        return manifest, []
    if not overwrite:
        raise DestinationExists(
            f"{dst.uri} already holds a different proxy (of {manifest.get('source', {}).get('uri')}, "
            f"method {manifest.get('method')}); pass --overwrite to replace it"
        )
    return None, [MANIFEST, *manifest.get("files", {})]


def _proxy_manifest(dst: Store) -> Published | None:
    """dst's proxy-manifest.json when it is one moe-proxy wrote; None for anything else."""
    data = dst.read_bytes(MANIFEST)
    try:
        m = json.loads(data)
    except ValueError:
        return None
    if not isinstance(m, dict) or not str(m.get("format", "")).startswith("moe-proxy/"):
        return None
    published = Published(m)
    published.sha256 = hashlib.sha256(data).hexdigest()
    return published


def journals(dst: Store) -> list[str]:
    return [n for n in dst.list() if n.startswith(JOURNAL)]


def owned(dst: Store) -> set[str]:
    """The files earlier moe-proxy builds wrote into dst, as their journals (and the record of a
    replaced proxy) list them: the only files a build may ever delete there."""
    owned = set()
    for name in journals(dst):
        if name.endswith(".safetensors"):  # fitted tensors (fits_name), not a list of files
            continue
        try:
            j = json.loads(dst.read_bytes(name))
        except ValueError:
            continue
        owned |= set(j.get("files", {})) | set(j.get("replaces", []))
    return owned


def make_manifest(p: Prepared, written: dict[str, Written]) -> dict:
    ckpt, plan, options = p.ckpt, p.plan, p.options
    return {
        "format": "moe-proxy/v1",
        "tool_version": __version__,
        "build_id": p.build_id,
        "source": {"uri": ckpt.uri, "architecture": plan.arch.name,
                   "model_type": ckpt.config.get("model_type"), "identity": p.identity},
        "method": asdict(options) | {"pins": {str(k): v for k, v in options.pins.items()}},
        "experts": {"before": plan.experts_before, "after": plan.experts_after,
                    "top_k_before": plan.top_k_before, "top_k_after": plan.top_k_after,
                    "n_group": plan.n_group, "topk_group": plan.topk_group},
        "notes": plan.notes,
        **({"fidelity": plan.fidelity} if plan.fidelity else {}),
        **({"calibration": plan.calibration} if plan.calibration else {}),
        **({"reconstruct": plan.reconstruction} if plan.reconstruction else {}),
        **({"merge": plan.merge} if plan.merge else {}),
        "layers": {
            b.prefix: {"layer": b.layer, "kept": plan.selections[b.prefix].kept,
                       "cluster_sizes": plan.selections[b.prefix].cluster_sizes} | plan.selections[b.prefix].record
            for b in p.layout.blocks
        },
        "params": stored_params(ckpt, p.layout, plan.experts_after, plan.top_k_after),
        "bytes": {"before": sum(ckpt.file_sizes.values()),
                  "after": sum(w.size for f, w in written.items() if f in p.shards)},
        "files": {f: {"size": w.size, "sha256": w.sha256} for f, w in sorted(written.items())},
    }
