"""Map a checkpoint's tensor names to roles: MoE blocks (router tensors, per-expert or fused
expert tensors with their quantisation companions) and everything else (the backbone, which
is copied byte for byte). Detection is by name, per tensor, so per-expert and fused layouts
and MTP layers are all found the same way. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from moe_proxy.architectures import Arch, expert_count
from moe_proxy.checkpoint.reader import Checkpoint, TensorInfo
from moe_proxy.errors import CorruptCheckpoint, NotMoE

PER_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<e>\d+)\.(?P<rest>.+)$")
FUSED = re.compile(r"^(?P<block>.+)\.experts\.(?P<rest>[A-Za-z_][^.]*)$")
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class MoeBlock:
    prefix: str  # e.g. "model.layers.3.mlp"
    layer: int  # decoder layer index (the MTP layer has index num_hidden_layers)
    n_experts: int
    router: dict[str, tuple[TensorInfo, int]] = field(default_factory=dict)  # leaf -> (tensor, expert axis)
    per_expert: dict[int, dict[str, TensorInfo]] = field(default_factory=dict)  # expert -> rest -> tensor
    fused: dict[str, TensorInfo] = field(default_factory=dict)  # rest -> tensor, expert axis 0

    def expert_tensors(self) -> list[TensorInfo]:
        return [t for rests in self.per_expert.values() for t in rests.values()] + list(self.fused.values())

    @property
    def expert_numel(self) -> int:
        return sum(t.numel for t in self.expert_tensors())

    @property
    def expert_bytes(self) -> int:
        return sum(t.nbytes for t in self.expert_tensors())


@dataclass
class Layout:
    arch: Arch
    blocks: list[MoeBlock]  # in layer order
    backbone: list[str]  # tensor names copied unchanged


def find_layout(ckpt: Checkpoint, arch: Arch) -> Layout:
    n_config = expert_count(arch, ckpt.config)
    blocks: dict[str, MoeBlock] = {}

    def block(prefix: str) -> MoeBlock:
        if prefix not in blocks:
            m = LAYER.search(prefix + ".")
            blocks[prefix] = MoeBlock(prefix, int(m.group(1)) if m else len(blocks), n_config)
        return blocks[prefix]

    claimed: set[str] = set()
    for name, t in ckpt.tensors.items():
        if m := PER_EXPERT.match(name):
            block(m["block"]).per_expert.setdefault(int(m["e"]), {})[m["rest"]] = t
            claimed.add(name)
        elif m := FUSED.match(name):
            block(m["block"]).fused[m["rest"]] = t
            claimed.add(name)
    if not blocks:
        raise NotMoE(
            f"{ckpt.uri}: no routed-expert tensors (*.experts.*) found although config.json describes "
            f"{arch.name}: nothing to prune"
        )

    for b in blocks.values():
        # Router tensors are exact siblings: never `shared_expert_gate.weight`, which also ends in gate.weight.
        for leaf in arch.router:
            t = ckpt.tensors.get(f"{b.prefix}.{leaf}")
            if t is not None:
                b.router[leaf] = (t, _expert_axis(t, n_config))
                claimed.add(t.name)
        _validate(b, n_config, arch)
    backbone = [n for n in ckpt.tensors if n not in claimed]
    return Layout(arch, sorted(blocks.values(), key=lambda b: (b.layer, b.prefix)), backbone)


def _expert_axis(t: TensorInfo, n: int) -> int:
    if t.shape and t.shape[0] == n:
        return 0
    if t.shape and t.shape[-1] == n:  # experts on the last axis, e.g. a [1, N] bias vector
        return len(t.shape) - 1
    raise CorruptCheckpoint(f"{t.file}: router tensor {t.name} {list(t.shape)} has no axis of "
                            f"config.json's expert count {n}: its rows disagree with the config")


def _validate(b: MoeBlock, n: int, arch: Arch) -> None:
    where = f"MoE block {b.prefix}"
    if arch.router[0] not in b.router:
        raise CorruptCheckpoint(f"{where}: router tensor {b.prefix}.{arch.router[0]} not found")
    if b.per_expert:
        ids = sorted(b.per_expert)
        if ids != list(range(n)):
            files = sorted({t.file for rests in b.per_expert.values() for t in rests.values()})
            missing, extra = sorted(set(range(n)) - set(ids)), sorted(set(ids) - set(range(n)))
            raise CorruptCheckpoint(
                f"{', '.join(files)}: {where}: {len(ids)} experts (missing {missing[:8]}, unexpected "
                f"{extra[:8]}) do not match config's {n} experts numbered 0..{n - 1}"
            )
        rests = set(b.per_expert[0])
        for e, r in b.per_expert.items():
            if set(r) != rests:
                raise CorruptCheckpoint(
                    f"{where}: expert {e} has tensors {sorted(r)} but expert 0 has {sorted(rests)}"
                )
    for rest, t in b.fused.items():
        if not t.shape or t.shape[0] != n:
            raise CorruptCheckpoint(f"{where}: fused tensor experts.{rest} {list(t.shape)} has not {n} experts on axis 0")


def source_identity(ckpt: Checkpoint, layout: Layout) -> str:
    """Tells two checkpoints apart, even two steps of one run: config, tensor table, router bytes."""
    h = hashlib.sha256(json.dumps(ckpt.config, sort_keys=True).encode())
    for t in ckpt.tensors.values():
        h.update(f"{t.name}|{t.dtype}|{t.shape}|{t.file}|{t.start}|{t.end}\n".encode())
    for b in layout.blocks:
        for t, _ in b.router.values():
            h.update(ckpt.read(t.name))
    return h.hexdigest()
