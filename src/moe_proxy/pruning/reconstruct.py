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
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from moe_proxy.pruning.config import rewrite_config
from moe_proxy.pruning.heal import fit, relative_error
from moe_proxy.pruning.selection import Selection
from moe_proxy.checkpoint.layout import Layout, MoeBlock
from moe_proxy.checkpoint.reader import Checkpoint, TensorInfo
from moe_proxy.checkpoint.tensors import TORCH_DTYPES, dequantize_fp8, quantize_fp8
from moe_proxy.errors import CannotReconstruct, MoeProxyError
from moe_proxy.layerwise.blocks import block_io, proxy_block, router_params, swapped
from moe_proxy.layerwise.driver import BATCH, Layer, LayerPass, walk
from moe_proxy.layerwise.load import transformers_config

log = logging.getLogger(__name__)
RECON_SAMPLES = 32  # calibration sequences used (all of them if fewer)
HOLDOUT_SEQUENCES = 4  # every HOLDOUT_SEQUENCES-th sequence (0, 4, 8, ...) is held out
RECON_STEPS = 300  # at most, full-batch Adam steps per layer
RECON_PATIENCE = 40  # steps without a held-out improvement before stopping
ROUTER_LR, EXPERT_LR = 0.02, 0.01  # x the tensor's RMS
PLAIN_KEPT = "fitting did not lower the held-out error (as stored): plain selection kept"


def _storage(t: TensorInfo, scale: TensorInfo | None, option: str = "--reconstruct"):
    """(value -> {name: stored tensor}, value as it reads back) for one checkpoint tensor."""
    if scale is not None and t.dtype.startswith("F8"):
        def store(v: torch.Tensor):
            q, s = quantize_fp8(v, scale.shape, TORCH_DTYPES[t.dtype], TORCH_DTYPES[scale.dtype])
            return {t.name: q, scale.name: s}, dequantize_fp8(q, s)
        return store
    if t.dtype not in ("F32", "F16", "BF16", "F64"):
        raise CannotReconstruct(
            f"{t.name}: dtype {t.dtype} without a block scale cannot be re-quantised; build without {option}")

    def store(v: torch.Tensor):
        stored = v.to(TORCH_DTYPES[t.dtype]).contiguous()
        return {t.name: stored}, stored.float()
    return store


def _rms(p: torch.Tensor) -> float:
    return float(p.detach().pow(2).mean().sqrt()) or 1.0


class Targets:
    """The proxy block's parameters --reconstruct fits, and how each is written back into the
    checkpoint's own tensors (router rows; fused or per-expert expert tensors, split and
    transposed as layerwise.py joined them, FP8 re-quantised). `option`: the build option that
    writes them (--reconstruct, --merge), named when a checkpoint cannot be written back."""

    def __init__(self, proxy: torch.nn.Module, block: MoeBlock, arch, kept: list[int], option: str = "--reconstruct"):
        self.block, self.arch, self.kept, self.option = block, arch, kept, option
        self.router = {}
        for leaf, p in router_params(proxy).items():
            info = block.router.get(leaf)
            if info is not None and info[1] == 0:  # stored, experts on axis 0: fitted
                self.router[leaf] = p
        experts = getattr(proxy, "experts", None)
        self.experts = {f"experts.{n}": p for n, p in experts.named_parameters()} if experts is not None else {}
        for name in self.experts:  # refuse before fitting anything
            self._writer(name)

    def groups(self) -> list[tuple[list[torch.nn.Parameter], float]]:
        """(parameter, learning rate) pairs for heal.fit: a rate proportional to each tensor's RMS."""
        return ([([p], ROUTER_LR * _rms(p)) for p in self.router.values()]
                + [([p], EXPERT_LR * _rms(p)) for p in self.experts.values()])

    def fitted(self) -> list[str]:
        return sorted(self.router) + sorted(self.experts)

    def store(self, experts_only: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The fitted values as stored: ({checkpoint tensor: stored tensor}, {parameter: value read back})."""
        out, back = {}, {}
        for leaf, p in ({} if experts_only else self.router).items():
            t = self.block.router[leaf][0]
            written, back[leaf] = _storage(t, None)(p.detach())
            out |= written
        for name, p in self.experts.items():
            written, back[name] = self._writer(name)(p.detach())
            out |= written
        return out, back

    def _writer(self, name: str):
        leaf = name.split(".", 1)[1]
        b = self.block
        if leaf in b.fused:
            t = b.fused[leaf]
            if leaf + "_scale_inv" in b.fused or t.dtype.startswith("F8"):
                raise CannotReconstruct(f"{t.name}: fused FP8 experts cannot be re-quantised yet; build without "
                                        f"{self.option}")
            store = _storage(t, None, self.option)
            shape = (len(self.kept),) + tuple(t.shape[1:])

            def fused(v: torch.Tensor):
                flip = tuple(v.shape) != shape
                written, back = store(v.transpose(1, 2) if flip else v)
                return written, back.transpose(1, 2) if flip else back
            return fused
        hub = {"gate_up_proj": self.arch.hub_gate_up, "down_proj": self.arch.hub_down}.get(leaf)
        if hub is None or not b.per_expert:
            raise CannotReconstruct(f"{b.prefix}: the experts' parameter {leaf} has no checkpoint tensor "
                                    f"{self.option} knows how to write; build without {self.option}")
        parts = [[b.per_expert[e].get(f"{h}.weight") for h in hub] for e in self.kept]
        if any(t is None for ts in parts for t in ts):
            raise CannotReconstruct(f"{b.prefix}: per-expert tensors {hub} not found; build without {self.option}")
        stores = [[_storage(t, b.per_expert[e].get(f"{h}.weight_scale_inv"), self.option) for t, h in zip(ts, hub)]
                  for e, ts in zip(self.kept, parts)]

        def per_expert(v: torch.Tensor):
            written, back = {}, torch.empty_like(v)
            for j, ts in enumerate(parts):
                rows = [t.shape[0] for t in ts]
                flip = (sum(rows), ts[0].shape[1]) != tuple(v[j].shape)  # stored transposed to the module
                m = v[j].T if flip else v[j]
                pieces = []
                for store, chunk in zip(stores[j], m.split(rows, dim=0)):
                    w, r = store(chunk.contiguous())
                    written |= w
                    pieces.append(r)
                joined = torch.cat(pieces, dim=0)
                back[j] = joined.T if flip else joined
            return written, back
        return per_expert


class Spill:
    """Fitted tensors on local disk until the shards are written: memory stays one layer."""

    def __init__(self):
        self.dir = tempfile.TemporaryDirectory(prefix="moe-proxy-reconstruct-")
        self.count = 0

    def put(self, value: torch.Tensor):
        path = Path(self.dir.name) / f"{self.count}.bin"
        self.count += 1
        path.write_bytes(value.contiguous().view(torch.uint8).numpy().tobytes())
        return partial(_read, self, path)  # holds the spill (and its directory) while needed


def _read(spill: Spill, path: Path) -> bytes:
    return path.read_bytes()


def reconstruct(ckpt: Checkpoint, layout: Layout, plan, calibration, progress: bool = False,
                merge: bool = False) -> Reconstruction:
    """Fit every calibrated MoE layer (ReconstructPass): the fitted tensors (spilled), each
    layer's `reconstruct` (and, with `merge`, `merge`) record and the manifest's summary, which
    expert_plan.fit_plan puts into the plan it returns. `merge`: each layer's kept experts are
    first merged (merge.py); the merged experts, as stored, are where the fit starts and what the
    layer keeps when fitting does not help."""
    proxy_config = transformers_config(rewrite_config(ckpt.config, plan))
    ids = calibration.token_ids[:RECON_SAMPLES]
    if len(ids) < 2:
        raise MoeProxyError("--reconstruct needs at least 2 calibration sequences (one is held out)")
    held = torch.arange(len(ids)) % HOLDOUT_SEQUENCES == 0
    layer_pass = ReconstructPass(proxy_config, layout.arch, plan.selections, held, calibration if merge else None)
    found = walk(ckpt, layout, layer_pass, ids, BATCH, progress)
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
            from moe_proxy.pruning.merge import merge_into

            record, stored_m, back_m = merge_into(original, proxy, sel,
                                                  self.merge_with.layers[block.prefix].gate_mass, targets)
            found.merges[block.prefix], merged = record, (stored_m, back_m)
        with torch.no_grad():
            fit_before = float(relative_error(proxy, *train))
        r = fit(proxy, targets.groups(), train, val, RECON_STEPS, RECON_PATIENCE)
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
        found.records[block.prefix] = {
            "fitted": use,
            "error_before": {"held_out": round(r["before"], 6), "fit": round(fit_before, 6)},
            "error_after": ({"held_out": round(after, 6), "fit": round(fit_after, 6)} if use else
                            {"held_out": round(r["before"], 6), "fit": round(fit_before, 6)}),
            "steps": r["steps"], "best_step": r["best_step"],
            **({} if use else {"why": PLAIN_KEPT.replace("plain selection", "merged experts") if merged
                               else PLAIN_KEPT}),
        }
        with swapped(layer.module, run):  # on to the next layer through this layer as it will be written
            states.advance(layer.module, i)
        msg = (f"{block.prefix}: held-out relative error {r['before']:.4f} -> "
               f"{after if use else r['before']:.4f}{'' if use else ' (plain kept)'}, {r['steps']} steps, "
               f"{time.monotonic() - start:.1f} s")
        log.info(msg)
        return msg

    def result(self) -> Reconstruction:
        return self.found
