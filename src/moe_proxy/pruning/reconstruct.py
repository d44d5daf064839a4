"""`build --reconstruct`: re-fit the kept experts and router rows of every MoE layer so the
pruned block reproduces the original block, layer by layer (an extension of `--heal`).

Layer by layer (a pass of layerwise.driver, one decoder layer resident, as `calibrate`): the calibration
tokens of the statistics go through the *proxy being built*. At MoE layer i, the original
layer runs on the proxy's hidden states and its block's input X and output Y are recorded;
the proxy block (the model's own MoE class, proxy config, kept experts) is fitted on them:

    minimise  ||proxy_block(X) - Y||^2 / ||Y||^2

over the router rows stored with one row per expert (router weight, bias) and all of the
kept experts' tensors (fused gate_up / down projections and their biases), with Adam in
float32, full batch, learning rates proportional to each tensor's RMS. Every
HOLDOUT_SEQUENCES-th calibration sequence is held out: the held-out error picks the step kept, and RECON_PATIENCE
steps without improvement stop the fit (early stopping). The fitted tensors are then rounded
to the checkpoint's storage format (its dtype; block-FP8 experts re-quantised with their
`weight_scale_inv` layout) and the held-out error is measured again on what will be stored.
A layer keeps its fitted tensors only if that error is below the plain selection's;
otherwise the plain proxy's bytes are written unchanged. The hidden states then go through
the layer as it will be written (fitted or plain), so the next layer is fitted on the inputs
the proxy will really give it.

Tensor names, shapes, dtypes and the quantisation layout are those of the plain proxy. The
fitted tensors are spilled to a local temporary directory, layer by layer, and read back
when the shards are written, so memory stays one layer whatever the depth. DeepSeek's
correction bias has no gradient and stays as sliced; shared experts and the backbone are
copied as in the plain proxy.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from moe_proxy.pruning.config import rewrite_config
from moe_proxy.pruning.fitted_tensors import Spill, Targets
from moe_proxy.pruning.heal import fit, relative_error
from moe_proxy.pruning.selection import Selection
from moe_proxy.checkpoint.layout import Layout, MoeBlock
from moe_proxy.checkpoint.reader import Checkpoint
from moe_proxy.errors import MoeProxyError
from moe_proxy.layerwise.blocks import block_io, proxy_block, swapped
from moe_proxy.layerwise.driver import Layer, LayerPass
from moe_proxy.layerwise.load import transformers_config

log = logging.getLogger(__name__)
RECON_SAMPLES = 32  # calibration sequences used (all of them if fewer)
HOLDOUT_SEQUENCES = 4  # every HOLDOUT_SEQUENCES-th sequence (0, 4, 8, ...) is held out
RECON_STEPS = 300  # at most, full-batch Adam steps per layer
RECON_PATIENCE = 40  # steps without a held-out improvement before stopping
ROUTER_LR, EXPERT_LR = 0.02, 0.01  # x the tensor's RMS
PLAIN_KEPT = "fitting did not lower the held-out error (as stored): plain selection kept"


def _rms(p: torch.Tensor) -> float:
    return float(p.detach().pow(2).mean().sqrt()) or 1.0


def lr_groups(targets: Targets) -> list[tuple[list[torch.nn.Parameter], float]]:
    """(parameter, learning rate) pairs for heal.fit: a rate proportional to each tensor's RMS."""
    return ([([p], ROUTER_LR * _rms(p)) for p in targets.router.values()]
            + [([p], EXPERT_LR * _rms(p)) for p in targets.experts.values()])


def reconstruct_pass(ckpt: Checkpoint, layout: Layout, plan, calibration,
                     merge: bool = False) -> tuple[ReconstructPass, torch.Tensor]:
    """The pass that reconstructs `plan`'s MoE layers, and the calibration tokens it walks with."""
    proxy_config = transformers_config(rewrite_config(ckpt.config, plan))
    ids = calibration.token_ids[:RECON_SAMPLES]
    if len(ids) < 2:
        raise MoeProxyError("--reconstruct needs at least 2 calibration sequences (one is held out)")
    held = torch.arange(len(ids)) % HOLDOUT_SEQUENCES == 0
    return ReconstructPass(proxy_config, layout.arch, plan.selections, held, calibration if merge else None), ids


def summarised(found: Reconstruction, ids: torch.Tensor, calibration) -> Reconstruction:
    """`found` with the manifest's summary: what was fitted, on which tokens (`ids`, those of
    reconstruct_pass), by which rule."""
    held = torch.arange(len(ids)) % HOLDOUT_SEQUENCES == 0
    n_fit, n_held = int((~held).sum()), int(held.sum())
    seq_len = int(ids.shape[1])
    found.summary = {
        "objective": "relative squared error of the MoE block output, ||proxy_block(X) - Y||^2 / ||Y||^2, X the "
                     "block input through the already reconstructed proxy, Y the original block's output on X",
        "fitted": sorted(found.fitted),
        "tokens": {"calibration_sha256": calibration.summary["tokens"]["sha256"], "sequences": len(ids),
                   "seq_len": seq_len, "split": f"every {HOLDOUT_SEQUENCES}th calibration sequence "
                                                f"(0, {HOLDOUT_SEQUENCES}, ...) held out",
                   "fit": {"sequences": n_fit, "tokens": n_fit * seq_len},
                   "held_out": {"sequences": n_held, "tokens": n_held * seq_len}},
        "optimizer": {"name": "Adam", "dtype": "float32", "max_steps": RECON_STEPS, "patience": RECON_PATIENCE,
                      "lr_router_x_rms": ROUTER_LR, "lr_experts_x_rms": EXPERT_LR},
        "rule": "a layer keeps its fitted tensors only if, as stored (dtype, FP8 re-quantised), they lower the "
                "held-out error below the plain selection's; and the proxy keeps them only if its KL to the original "
                "is not above the plain selection's (end_to_end)",
        "layers": found.counts,
    }
    return found


@dataclass
class Reconstruction:
    """What reconstruction wrote, per MoE block it fitted."""

    tensors: dict[str, Callable[[], bytes]] = field(default_factory=dict)  # checkpoint tensor -> its bytes (spilled)
    records: dict[str, dict] = field(default_factory=dict)  # block prefix -> its manifest record's `reconstruct`
    merges: dict[str, list] = field(default_factory=dict)  # block prefix -> its `merge` record (--merge)
    fitted: set[str] = field(default_factory=set)  # the parameters some layer kept fitted
    counts: dict[str, int] = field(default_factory=lambda: {"fitted": 0, "plain": 0})
    summary: dict = field(default_factory=dict)  # the manifest's `reconstruct` (what, on which tokens, the rule)


class ReconstructPass(LayerPass[Reconstruction]):
    """Each selected MoE layer: the original block on the proxy's hidden states, the proxy
    block fitted to it (merged first with `merge_with`: the statistics whose gate mass weights
    the merges), what is written spilled, and the hidden states carried on through the layer
    as it will be written."""

    desc = "reconstructing"

    def __init__(self, proxy_config, arch, selections: dict[str, Selection], held: torch.Tensor, merge_with=None):
        self.proxy_config, self.arch, self.selections = proxy_config, arch, selections
        self.held = held  # which calibration sequences are held out
        self.merge_with = merge_with
        self.spill = Spill()
        self.found = Reconstruction()

    def visits(self, block: MoeBlock) -> bool:
        return block.prefix in self.selections

    def visit(self, layer: Layer) -> str:
        # A method's locals: nothing of this layer (its float32 block with gradients, the values
        # stored and read back, the block it ran with) is alive when the next layer loads.
        i, block, original, states, held = layer.index, layer.block, layer.moe.block, layer.states, self.held
        found = self.found
        start = time.monotonic()
        sel = self.selections[block.prefix]
        with block_io(original) as (xs, ys):  # the original block on the proxy's hidden states
            states.observe(layer.module, i)
        x, y = torch.cat(xs).float(), torch.cat(ys).float()  # [sequences, T, H]
        h = x.shape[-1]
        train = (x[~held].reshape(1, -1, h), y[~held].reshape(1, -1, h))
        val = (x[held].reshape(1, -1, h), y[held].reshape(1, -1, h))
        proxy = proxy_block(original, self.proxy_config, sel.kept)
        targets = Targets(proxy, block, self.arch, sel.kept)
        merged = None
        if self.merge_with is not None and block.prefix in self.merge_with.layers:
            from moe_proxy.pruning.merge import merge_into  # (scipy: only with --merge)

            record, stored_m, back_m = merge_into(original, proxy, sel,
                                                  self.merge_with.layers[block.prefix].gate_mass, targets)
            found.merges[block.prefix], merged = record, (stored_m, back_m)
        with torch.no_grad():
            fit_before = float(relative_error(proxy, *train))
        r = fit(proxy, lr_groups(targets), train, val, RECON_STEPS, RECON_PATIENCE)
        stored, back = targets.store()
        params = dict(proxy.named_parameters())
        with torch.no_grad():
            for name, value in back.items():
                params[name].copy_(value)
            after, fit_after = float(relative_error(proxy, *val)), float(relative_error(proxy, *train))
        use = after < r["before"]
        run = proxy_block(original, self.proxy_config, sel.kept, layer.model.dtype, same_kernels=True)
        # The layer as written: the fitted tensors, else the merged experts (--merge), else the plain
        # selection's, which the writer reads from the source and `run` already holds.
        written = (stored, back) if use else merged
        if written is not None:
            run_params = dict(run.named_parameters())
            with torch.no_grad():
                for name, value in written[1].items():
                    run_params[name].copy_(value)
            for name, value in written[0].items():
                found.tensors[name] = self.spill.put(value)
        if use:
            found.fitted.update(targets.fitted())
        found.counts["fitted" if use else "plain"] += 1
        found.records[block.prefix] = _record(r, use, (fit_before, fit_after, after), merged is not None)
        with swapped(layer.module, run):  # on to the next layer through this layer as it will be written
            states.advance(layer.module, i)
        msg = (f"{block.prefix}: held-out relative error {r['before']:.4f} -> "
               f"{after if use else r['before']:.4f}{'' if use else ' (plain kept)'}, {r['steps']} steps, "
               f"{time.monotonic() - start:.1f} s")
        log.info(msg)
        return msg

    def result(self) -> Reconstruction:
        return self.found


def _record(r: dict, use: bool, errors: tuple[float, float, float], merged: bool) -> dict:
    """A layer's manifest record: the fit (heal.fit's `r`), whether the layer keeps it, and the
    errors (fit before, fit after, held out after) of what it keeps."""
    fit_before, fit_after, after = errors
    before = {"held_out": round(r["before"], 6), "fit": round(fit_before, 6)}
    return {
        "fitted": use,
        "error_before": before,
        "error_after": {"held_out": round(after, 6), "fit": round(fit_after, 6)} if use else before,
        "steps": r["steps"], "best_step": r["best_step"],
        **({} if use else {"why": PLAIN_KEPT.replace("plain selection", "merged experts") if merged
                           else PLAIN_KEPT}),
    }
