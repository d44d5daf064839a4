"""One walk over a checkpoint's decoder layers, for every job done layer by layer.

`walk` materialises the model one decoder layer at a time (model.py), finds each layer's MoE
block in the checkpoint's layout and hands the loaded layer to a pass: the statistics
(calibrate/statistics.py), router healing, merging, reconstruction and the fidelity figure
(build/). A pass works on the layers it `visits` and carries the calibration hidden states
through them itself, since each does so its own way (through the original block with hooks
on it, through the pruned block, or both); the driver carries them through every other layer.
A walk without hidden states loads only the layers its pass visits. What a pass found comes
back from the walk as the pass's own result.

Several passes can share one walk (`walk_all`, e.g. a build's fit and its fidelity figure):
each layer is loaded once and handed to every pass in turn, each pass carrying its own hidden
states (its own tokens). A pass visited later in the same layer sees what an earlier one did
to that layer (the fidelity figure measures the layer just fitted).

Torch-free at import (the model is imported when a walk starts), so a module that declares a
pass keeps torch-free imports (pruning/fidelity.py: verify and the CLI read its figures).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from tqdm.auto import tqdm

from moe_proxy.checkpoint.layout import Layout, MoeBlock
from moe_proxy.checkpoint.reader import Checkpoint

if TYPE_CHECKING:
    import torch

    from moe_proxy.layerwise.model import HiddenStates, LayerwiseModel, MoeModules

R = TypeVar("R")
BATCH = 8  # calibration sequences per forward call


@dataclass
class Layer:
    """A loaded decoder layer, as a pass sees it."""

    index: int
    module: torch.nn.Module  # the decoder layer with its real tensors, freed once the pass returns
    block: MoeBlock | None  # its MoE block in the checkpoint's layout; None: a dense layer
    moe: MoeModules | None  # that block's modules; None: a dense layer
    model: LayerwiseModel
    states: HiddenStates | None  # the calibration hidden states at the layer's input
    started: float  # time.monotonic() before the layer was loaded


class LayerPass(Generic[R]):
    """A job done layer by layer. `visit` gets the MoE layers whose block `visits` accepts
    (every layer with `dense`) and must carry `layer.states` (if any) through the layer."""

    desc = "layers"  # the progress bar's label
    dense = False  # visit dense layers too

    def visits(self, block: MoeBlock) -> bool:
        """Whether the pass works on `block` (decided before its layer is loaded)."""
        return True

    def begin(self, model: LayerwiseModel, states: HiddenStates | None) -> None:
        """Before the first layer: the model being walked and its hidden states."""

    def visit(self, layer: Layer) -> str | None:
        """Work on `layer` and carry the hidden states through it; returns a progress line or None."""
        raise NotImplementedError

    def result(self) -> R:
        """What the pass found, after the last layer."""
        raise NotImplementedError


def walk(ckpt: Checkpoint, layout: Layout, layer_pass: LayerPass[R], token_ids: torch.Tensor | None = None,
         batch_size: int = BATCH, progress: bool = False) -> R:
    """Run `layer_pass` over the decoder layers of `ckpt`, one layer resident at a time, with
    the hidden states of `token_ids` ([sequences, tokens], `batch_size` sequences per forward
    call) carried from layer to layer; returns the pass's result."""
    return walk_all(ckpt, layout, [(layer_pass, token_ids)], batch_size, progress)[0]


def walk_all(ckpt: Checkpoint, layout: Layout, passes: list[tuple[LayerPass, torch.Tensor | None]],
             batch_size: int = BATCH, progress: bool = False) -> list:
    """`walk` for several (pass, its token_ids or None) at once, in one walk: each layer is loaded
    once and visited by the passes in their order; returns their results in that order."""
    from moe_proxy.layerwise.model import HiddenStates, LayerwiseModel

    model = LayerwiseModel(ckpt)
    states = [HiddenStates(model, ids, batch_size) if ids is not None else None for _, ids in passes]
    for (layer_pass, _), s in zip(passes, states):
        layer_pass.begin(model, s)
    blocks: dict[int, MoeBlock] = {}
    for b in layout.blocks:
        blocks.setdefault(b.layer, b)
    desc = ", ".join(p.desc for p, _ in passes)
    bar = tqdm(range(model.n_layers), desc=desc, unit="layer", disable=not progress)
    for i in bar:
        block = blocks.get(i)
        visits = [p.dense or (block is not None and p.visits(block)) for p, _ in passes]
        if not any(visits) and all(s is None for s in states):
            continue  # nothing to carry through it: not even loaded
        for line in _visit(model, i, block, [p for p, _ in passes], visits, states):
            if progress:
                bar.write(line)
    return [layer_pass.result() for layer_pass, _ in passes]


def _visit(model: LayerwiseModel, i: int, block: MoeBlock | None, passes: list[LayerPass], visits: list[bool],
           states: list[HiddenStates | None]) -> list[str]:
    """Layer `i` loaded once, each pass visiting it (or its states carried through it) in turn;
    the passes' progress lines."""
    from moe_proxy.layerwise.model import moe_modules

    started, lines = time.monotonic(), []
    with model.layer(i) as module:
        moe = moe_modules(module) if block is not None else None
        for layer_pass, visit, s in zip(passes, visits, states):
            if visit and (moe is not None or layer_pass.dense):
                lines.append(layer_pass.visit(Layer(i, module, block, moe, model, s, started)))
            elif s is not None:
                s.advance(module, i)
    return [line for line in lines if line]
