"""Real corruptions of real checkpoints and proxies, for the negative tests of verify and build."""

import hashlib
import json

from safetensors.torch import load_file, save_file

from moe_proxy.checkpoint.reader import INDEX, MANIFEST


def shard_of(path, tensor):
    return json.loads((path / INDEX).read_text())["weight_map"][tensor]


def rehash(path, *names):
    """What a careless tool would do after editing a proxy's files: record their new size and sha256
    in its manifest (a source checkpoint has none)."""
    if not (path / MANIFEST).exists():
        return
    manifest = json.loads((path / MANIFEST).read_text())
    for name in names:
        data = (path / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / MANIFEST).write_text(json.dumps(manifest))


def edit_shard(path, shard, edit):
    """Rewrite one shard with safetensors after `edit(tensors)`, keep the index true, re-hash both."""
    tensors = edit(load_file(path / shard))
    save_file(tensors, path / shard, metadata={"format": "pt"})
    index = json.loads((path / INDEX).read_text())
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if f != shard} | dict.fromkeys(tensors, shard)
    (path / INDEX).write_text(json.dumps(index))
    rehash(path, shard, INDEX)


def edit_config(path, **fields):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | fields))
    rehash(path, "config.json")


def renumber_expert(path, block, old, new):
    """Rename expert `old` of `block` to `new` in every shard holding it: a numbering gap."""
    shards = {f for k, f in json.loads((path / INDEX).read_text())["weight_map"].items()
              if k.startswith(f"{block}.experts.{old}.")}
    for shard in shards:
        edit_shard(path, shard, lambda ts: {k.replace(f"{block}.experts.{old}.", f"{block}.experts.{new}."): v
                                            for k, v in ts.items()})
    return sorted(shards)
