"""`build --reconstruct`: re-fit the kept experts and router rows of every MoE layer so the
pruned block reproduces the original block, layer by layer (an extension of `--heal`).

Layer by layer (layerwise.py, one decoder layer resident, as `calibrate`): the calibration
tokens of the statistics go through the *proxy being built*. At MoE layer i, the original
layer runs on the proxy's hidden states and its block's input X and output Y are recorded;
the proxy block (the model's own MoE class, proxy config, kept experts) is fitted on them:

    minimise  ||proxy_block(X) - Y||^2 / ||Y||^2

over the router rows stored with one row per expert (router weight, bias) and all of the
kept experts' tensors (fused gate_up / down projections and their biases), with Adam in
float32, full batch, learning rates proportional to each tensor's RMS. Every HOLDOUT-th
calibration sequence is held out: the held-out error picks the step kept, and RECON_PATIENCE
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

import torch
from tqdm.auto import tqdm

from moe_proxy.build.config import rewrite_config
from moe_proxy.build.heal import _router_params, fit, relative_error
from moe_proxy.calibrate.layerwise import HiddenStates, LayerwiseModel, moe_modules, transformers_config
from moe_proxy.calibrate.proxy import block_io, proxy_block, swapped
from moe_proxy.checkpoint.layout import Layout, MoeBlock
from moe_proxy.checkpoint.reader import Checkpoint, TensorInfo
from moe_proxy.checkpoint.tensors import TORCH_DTYPES, dequantize_fp8, quantize_fp8
from moe_proxy.errors import MoeProxyError

log = logging.getLogger(__name__)
RECON_SAMPLES = 32  # calibration sequences used (all of them if fewer)
HOLDOUT = 4  # every HOLDOUT-th sequence (0, 4, 8, ...) is held out
RECON_STEPS = 300  # at most, full-batch Adam steps per layer
RECON_PATIENCE = 40  # steps without a held-out improvement before stopping
ROUTER_LR, EXPERT_LR = 0.02, 0.01  # x the tensor's RMS
BATCH = 8
PLAIN_KEPT = "fitting did not lower the held-out error (as stored): plain selection kept"


class CannotReconstruct(MoeProxyError):
    """A checkpoint whose experts cannot be written back in their own format."""


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
        for leaf, p in _router_params(proxy).items():
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
                merge: bool = False) -> None:
    """Fit every calibrated MoE layer; fills plan.tensor_overrides, plan.reconstruction and
    each layer's `reconstruct` record in its selection. `merge`: each layer's kept experts are
    first merged (merge.py); the merged experts, as stored, are where the fit starts and what
    the layer keeps when fitting does not help."""
    proxy_config = transformers_config(rewrite_config(ckpt.config, plan))
    model = LayerwiseModel(ckpt)
    ids = calibration.token_ids[:RECON_SAMPLES]
    if len(ids) < 2:
        raise MoeProxyError("--reconstruct needs at least 2 calibration sequences (one is held out)")
    held = torch.arange(len(ids)) % HOLDOUT == 0
    states = HiddenStates(model, ids, BATCH)
    p = _Pass(plan, proxy_config, layout.arch, model.dtype, states, held, Spill(), calibration if merge else None)
    bar = tqdm(range(model.n_layers), desc="reconstructing", unit="layer", disable=not progress)
    for i in bar:
        block = next((b for b in layout.blocks if b.layer == i), None)
        with model.layer(i) as layer:
            mods = moe_modules(layer)
            if mods is None or block is None or block.prefix not in plan.selections:
                states.advance(layer, i)
                continue
            # In a function: nothing of this layer (its float32 block with gradients, the values
            # stored and read back, the block it ran with) is alive when the next layer loads.
            msg = _fit_layer(p, layer, i, mods.block, block)
            log.info(msg)
            if progress:
                bar.write(msg)
    n_fit, n_held = int((~held).sum()), int(held.sum())
    seq_len = int(ids.shape[1])
    plan.reconstruction = {
        "objective": "relative squared error of the MoE block output, ||proxy_block(X) - Y||^2 / ||Y||^2, X the "
                     "block input through the already reconstructed proxy, Y the original block's output on X",
        "fitted": sorted(p.fitted_names),
        "tokens": {"calibration_sha256": calibration.summary["tokens"]["sha256"], "sequences": len(ids),
                   "seq_len": seq_len, "split": f"every {HOLDOUT}th calibration sequence (0, {HOLDOUT}, ...) held out",
                   "fit": {"sequences": n_fit, "tokens": n_fit * seq_len},
                   "held_out": {"sequences": n_held, "tokens": n_held * seq_len}},
        "optimizer": {"name": "Adam", "dtype": "float32", "max_steps": RECON_STEPS, "patience": RECON_PATIENCE,
                      "lr_router_x_rms": ROUTER_LR, "lr_experts_x_rms": EXPERT_LR},
        "rule": "a layer keeps its fitted tensors only if, as stored (dtype, FP8 re-quantised), they lower the "
                "held-out error below the plain selection's",
        "layers": p.counts,
    }
    if merge:
        from moe_proxy.build.merge import describe

        plan.merge = describe(plan, p.merged_blocks)


@dataclass
class _Pass:
    """What every layer's fit shares, and what it adds to (the fitted tensors' names, the counts,
    the merged blocks)."""

    plan: object  # the ExpertPlan being filled
    proxy_config: object  # the proxy's transformers config
    arch: object
    dtype: torch.dtype  # the checkpoint's
    states: HiddenStates  # the calibration tokens' hidden states through the proxy so far
    held: torch.Tensor  # which calibration sequences are held out
    spill: Spill
    merge_with: object = None  # the statistics whose gate mass weights the merges (--merge), else None
    fitted_names: set = field(default_factory=set)
    counts: dict = field(default_factory=lambda: {"fitted": 0, "plain": 0})
    merged_blocks: list = field(default_factory=list)


def _fit_layer(p: _Pass, layer: torch.nn.Module, i: int, original: torch.nn.Module, block: MoeBlock) -> str:
    """Fit MoE block `block` of loaded decoder layer `layer` (`original`: its MoE module),
    record it in the plan, spill what is written and advance the hidden states through the
    layer as it will be written; returns the progress line."""
    plan, proxy_config, states, held = p.plan, p.proxy_config, p.states, p.held
    start = time.monotonic()
    sel = plan.selections[block.prefix]
    with block_io(original) as (xs, ys):  # the original block on the proxy's hidden states
        states.observe(layer, i)
    x, y = torch.cat(xs).float(), torch.cat(ys).float()  # [sequences, T, H]
    h = x.shape[-1]
    train = (x[~held].reshape(1, -1, h), y[~held].reshape(1, -1, h))
    val = (x[held].reshape(1, -1, h), y[held].reshape(1, -1, h))
    proxy = proxy_block(original, proxy_config, sel.kept)
    targets = Targets(proxy, block, p.arch, sel.kept)
    merged = None
    if p.merge_with is not None and block.prefix in p.merge_with.layers:
        from moe_proxy.build.merge import merge_into

        record, stored_m, back_m = merge_into(original, proxy, sel,
                                              p.merge_with.layers[block.prefix].gate_mass, targets)
        sel.record["merge"], merged = record, (stored_m, back_m)
        p.merged_blocks.append(block.prefix)
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
    run = proxy_block(original, proxy_config, sel.kept, p.dtype, same_kernels=True)
    # The layer as written: the fitted tensors, else the merged experts (--merge), else the plain
    # selection's, which the writer reads from the source and `run` already holds.
    written = (stored, back) if use else merged
    if written is not None:
        run_params = dict(run.named_parameters())
        with torch.no_grad():
            for name, value in written[1].items():
                run_params[name].copy_(value)
        for name, value in written[0].items():
            plan.tensor_overrides[name] = p.spill.put(value)
    if use:
        p.fitted_names.update(targets.fitted())
    p.counts["fitted" if use else "plain"] += 1
    sel.record["reconstruct"] = {
        "fitted": use,
        "error_before": {"held_out": round(r["before"], 6), "fit": round(fit_before, 6)},
        "error_after": ({"held_out": round(after, 6), "fit": round(fit_after, 6)} if use else
                        {"held_out": round(r["before"], 6), "fit": round(fit_before, 6)}),
        "steps": r["steps"], "best_step": r["best_step"],
        **({} if use else {"why": PLAIN_KEPT.replace("plain selection", "merged experts") if merged
                           else PLAIN_KEPT}),
    }
    with swapped(layer, run):  # on to the next layer through this layer as it will be written
        states.advance(layer, i)
    msg = (f"{block.prefix}: held-out relative error {r['before']:.4f} -> "
           f"{after if use else r['before']:.4f}{'' if use else ' (plain kept)'}, {r['steps']} steps, "
           f"{time.monotonic() - start:.1f} s")
    return msg
