"""How close a proxy is to its original: the fidelity figure of a calibrated build.

Both models run one decoder layer at a time (a pass of layerwise.driver), side by side, on
held-out calibration tokens: one layer of the original and the same layer of the proxy are
resident, each model's hidden states go through its own layer, and both layers are freed
before the next. The proxy is the one the plan describes, read through its output tensors
(steps.output_tensors: sliced routers, healed rows, kept experts) without writing it, so
`--experts auto` can measure several counts and write only the chosen one.

Recorded per decoder layer (relative squared errors, heal.py's objective, so the figures
compare with its before/after):
- `block_error` (MoE layers): ||proxy_block(X) - Y||^2 / ||Y||^2, with X the original MoE
  block's input and Y its output: what pruning this block alone does;
- `hidden_error`: the same ratio between the two models' hidden states after the layer, each
  model fed its own previous layers: the error carried forward to here.
At the end, through the original's final norm and LM head (the proxy's are byte-identical):
- `kl`: mean over tokens of KL(original || proxy) of the next-token distributions, nats;
- `loss_original`, `loss_proxy`: next-token cross-entropy of each on the same tokens, nats;
  `loss_delta` = loss_proxy - loss_original.

Tokens: the last quarter of the calibration sequences, at most FIDELITY_SAMPLES of them.
Healing fits on the first heal.HEAL_SAMPLES sequences, so with the default 64 samples no fit
has seen them; the selection statistics are computed on all sequences.

Module-level imports are torch-free (verify and the CLI read figures from the manifest);
the measurement imports torch when it runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from moe_proxy.checkpoint.reads import read_coalesced
from moe_proxy.errors import InvalidExpertCount
from moe_proxy.layerwise.driver import BATCH, Layer, LayerPass, walk

log = logging.getLogger(__name__)
FIDELITY_SAMPLES = 16  # held-out calibration sequences measured, at most
HEAD_CHUNK = 512  # tokens per LM-head matmul (bounds the [tokens, vocab] logits)


class FidelityTargetNotMet(InvalidExpertCount):
    """`--experts auto`: no allowed expert count reaches the KL target."""


class PlannedProxy:
    """The proxy a plan describes, readable like a Checkpoint (config, tensors, read) from the
    source's bytes and the plan's computed tensors: nothing is written."""

    def __init__(self, ckpt, config: dict, shards: dict):
        self.config, self.store = config, ckpt.store
        self.tensors = {t.name: t for ts in shards.values() for t in ts}  # OutTensor: name, dtype, shape
        self._file = {t.name: f for f, ts in shards.items() for t in ts}
        self.uri = f"{ckpt.uri} (proxy as planned, not written)"

    def read(self, name: str) -> bytes:
        t = self.tensors[name]
        return t.source() if callable(t.source) else read_coalesced(self.store, self._file[name], t.source)


def held_out(token_ids):
    """The calibration sequences the figure is measured on, and their [start, end) rows."""
    samples = int(token_ids.shape[0])
    n = max(1, min(FIDELITY_SAMPLES, samples // 4))
    return token_ids[samples - n:], [samples - n, samples]


def _round(x: float) -> float:
    return float(f"{x:.6g}")


class _Ratio:
    """||a - b||^2 / ||b||^2 accumulated over batches, in float64."""

    def __init__(self):
        self.num = self.den = 0.0

    def add(self, a, b) -> None:
        a, b = a.double(), b.double()
        self.num += float((a - b).pow(2).sum())
        self.den += float(b.pow(2).sum())

    @property
    def value(self) -> float:
        return _round(self.num / self.den) if self.den > 0 else 0.0


@dataclass
class Compared:
    """The two models side by side: per decoder layer its errors, then the head's figures."""

    layers: list[dict]  # {"layer", "hidden_error"} and, in MoE layers, {"block", "block_error"}
    kl: float
    loss_original: float
    loss_proxy: float


class FidelityPass(LayerPass[Compared]):
    """Walks the original; each layer of the proxy (`source`, its hidden states of `token_ids`)
    is loaded beside the original's and advanced with it."""

    desc = "measuring fidelity"
    dense = True  # every layer's hidden-state error

    def __init__(self, source: PlannedProxy, token_ids):
        self.source, self.token_ids = source, token_ids
        self.layers: list[dict] = []

    def begin(self, model, states) -> None:
        from moe_proxy.layerwise.model import HiddenStates, LayerwiseModel

        self.original, self.ho = model, states
        self.proxy = LayerwiseModel(self.source, dtype=model.dtype)
        self.hp = HiddenStates(self.proxy, self.token_ids, BATCH)

    def visit(self, layer: Layer) -> None:
        from moe_proxy.layerwise.model import moe_modules

        i = layer.index
        with self.proxy.layer(i) as lp:
            mp = moe_modules(lp)
            record: dict = {"layer": i}
            hook, block = None, _Ratio()
            if layer.moe is not None and mp is not None:
                def compare(module, args, out, proxy_block=mp.block) -> None:  # same input X, both blocks
                    z = proxy_block(args[0])
                    block.add(z[0] if isinstance(z, tuple) else z, out[0] if isinstance(out, tuple) else out)

                hook = layer.moe.block.register_forward_hook(compare)
                record["block"] = layer.block.prefix
            try:
                self.ho.advance(layer.module, i)
            finally:
                if hook is not None:
                    hook.remove()
            self.hp.advance(lp, i)
        if hook is not None:
            record["block_error"] = block.value
        hidden = _Ratio()
        for a, b in zip(self.hp.hidden, self.ho.hidden):
            hidden.add(a, b)
        record["hidden_error"] = hidden.value
        self.layers.append(record)

    def result(self) -> Compared:
        import torch

        kl, loss_o, loss_p = _head_figures(self.original, self.ho.hidden, self.hp.hidden,
                                           self.token_ids.split(BATCH), torch)
        return Compared(self.layers, kl, loss_o, loss_p)


def measure(ckpt, layout, plan, calibration, shards: dict, progress: bool = False) -> dict:
    """The fidelity figure of the proxy `plan` describes (its output tensors `shards`), on the
    held-out calibration tokens of `calibration` (see the module docstring)."""
    from moe_proxy.build.config import rewrite_config
    from moe_proxy.build.heal import HEAL_SAMPLES
    from moe_proxy.layerwise.model import release_freed_memory

    # What the shard write freed in its reader threads' heaps, which this thread does not reuse,
    # goes back to the OS before two models load (docs/performance.md, memory against depth).
    release_freed_memory()
    ids, rows = held_out(calibration.token_ids)
    proxy = PlannedProxy(ckpt, rewrite_config(ckpt.config, plan), shards)
    found = walk(ckpt, layout, FidelityPass(proxy, ids), ids, BATCH, progress)
    return {
        "tokens": {"sequences": int(ids.shape[0]), "seq_len": int(ids.shape[1]), "rows": rows,
                   "of": int(calibration.token_ids.shape[0]),
                   "sha256": calibration.summary.get("tokens", {}).get("sha256"),
                   "held_out_from_heal": rows[0] >= HEAL_SAMPLES},
        "layers": found.layers,
        "kl": _round(found.kl), "loss_original": _round(found.loss_original), "loss_proxy": _round(found.loss_proxy),
        "loss_delta": _round(found.loss_proxy - found.loss_original),
    }


def _head_figures(model, original: list, proxy: list, ids: tuple, torch) -> tuple[float, float, float]:
    """KL(original || proxy) per token and each model's next-token cross-entropy, through the
    original's final norm and LM head (tied to the embedding when the checkpoint has no head)."""
    norm = model.base.norm
    model.load(norm, "model.norm.")
    name = "lm_head.weight" if "lm_head.weight" in model.ckpt.tensors else "model.embed_tokens.weight"
    weight = model.tensors.read(name).to(model.dtype)
    kl = ce_o = ce_p = 0.0
    tokens = predicted = 0
    with torch.no_grad():
        for ho, hp, x in zip(original, proxy, ids):
            targets = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1).reshape(-1)
            for sel in torch.arange(targets.numel()).split(HEAD_CHUNK):
                lo = (norm(ho.reshape(-1, ho.shape[-1])[sel]) @ weight.T).double().log_softmax(-1)
                lp = (norm(hp.reshape(-1, hp.shape[-1])[sel]) @ weight.T).double().log_softmax(-1)
                kl += float((lo.exp() * (lo - lp)).sum())
                t = targets[sel]
                ce_o += float(torch.nn.functional.nll_loss(lo, t, ignore_index=-100, reduction="sum"))
                ce_p += float(torch.nn.functional.nll_loss(lp, t, ignore_index=-100, reduction="sum"))
                tokens += len(sel)
                predicted += int((t != -100).sum())
    norm.to("meta")
    return kl / tokens, ce_o / max(predicted, 1), ce_p / max(predicted, 1)


# --- --experts auto ------------------------------------------------------------------------------


def resolve_auto(src, options, max_experts: int | None, sizing, scale_out: bool, store_options: dict | None = None,
                 progress: bool = False):
    """`--experts auto --max-kl X`: `options` with the chosen count, and (its fidelity figure,
    notes saying what was tried, its ExpertPlan). Counts (sizing.auto_counts) are tried in increasing order,
    each planned and measured without writing anything; the first whose KL(original || proxy)
    is at most X is chosen. FidelityTargetNotMet says the best figure reached."""
    from moe_proxy.build.steps import open_source
    from moe_proxy.sizing import SizingOptions, auto_counts

    if options.experts != "auto" or options.max_kl is None:
        raise InvalidExpertCount("--experts auto and --max-kl X go together: the build picks the smallest expert count "
                                 "whose KL(original || proxy) per token is at most X")
    if not options.max_kl > 0:
        raise InvalidExpertCount(f"--max-kl {options.max_kl:g}: must be above 0 (only keeping every expert gives 0)")
    if not options.calibration:
        raise InvalidExpertCount("--experts auto needs --calibration STATS: the fidelity figure is measured on its tokens")
    if scale_out:
        raise InvalidExpertCount("--experts auto runs as a single build (it measures counts before writing); choose "
                                 "the count with it, then give the workers --experts N")
    ckpt, layout, _, calibration = open_source(src, options, store_options)
    if calibration.mode != "one-pass":  # made behind one proxy's pruned layers: that count only
        raise InvalidExpertCount(f"--experts auto tries several expert counts, and {options.calibration} holds "
                                 f"sequential statistics made for {calibration.summary['made_for']['experts']} "
                                 f"experts only: calibrate without --experts (one-pass statistics, usable for any "
                                 f"count), or build --experts {calibration.summary['made_for']['experts']}")
    budget = replace(sizing or SizingOptions(), experts=None, keep_ratio=None, top_k=options.top_k)
    counts = [c for c in auto_counts(ckpt.config, budget) if max_experts is None or c <= max_experts]
    count, figure, notes, plan = choose_experts(ckpt, layout, calibration, options, counts, progress)
    notes.append("one-pass statistics, as --experts auto needs (sequential ones are made for one count, known "
                 "before the build)" + ("; each count tried was reconstructed" if options.reconstruct else ""))
    return replace(options, experts=count), (figure, notes, plan)


def choose_experts(ckpt, layout, calibration, options, counts: list[int],
                   progress: bool = False) -> tuple[int, dict, list[str], object]:
    """The smallest of `counts` (ascending) whose proxy has KL <= options.max_kl, its fidelity
    figure, a note saying what was tried, and its ExpertPlan (built as measured: not planned and
    fitted again). A search, not a scan (each count is a build with its fits, hours on a real
    model): the largest count first (if even it misses the target, nothing smaller is tried),
    then halves, on the rule that more experts give a proxy closer to its original; the note says
    where the measured figures break that rule."""
    from moe_proxy.build.expert_plan import plan_experts
    from moe_proxy.build.steps import output_tensors
    from moe_proxy.calibrate.statistics import CalibrationError

    max_kl = options.max_kl
    if not counts:
        raise InvalidExpertCount("--experts auto: no expert count to try (valid counts above top-k and below all the "
                                 "experts, within the device budget and --max-experts)")
    tried: list[str] = []
    measured: dict[int, tuple[dict, object]] = {}  # count -> (figure, plan)

    def kl_of(count: int) -> float | None:
        """The count's KL, measured once (None: that count cannot be built)."""
        if count not in measured:
            try:
                plan = plan_experts(ckpt, layout, replace(options, experts=count, keep_ratio=None), progress,
                                    calibration=calibration)
            except (InvalidExpertCount, CalibrationError) as exc:  # e.g. fewer alive experts than the count
                tried.append(f"{count} -> not possible ({exc})")
                measured[count] = (None, None)
                return None
            figure = measure(ckpt, layout, plan, calibration, output_tensors(ckpt, layout, plan), progress)
            tried.append(f"{count} -> kl {figure['kl']:.4g}")
            log.info("--experts auto: %d experts per layer, KL %.4g (target %g)", count, figure["kl"], max_kl)
            measured[count] = (figure, plan)
        figure = measured[count][0]
        return None if figure is None else figure["kl"]

    hi = len(counts) - 1
    while hi >= 0 and kl_of(counts[hi]) is None:  # the largest counts may not be buildable (too few alive)
        hi -= 1
    if hi < 0 or kl_of(counts[hi]) > max_kl:
        best = min(((f["kl"], c) for c, (f, _) in measured.items() if f is not None), default=None)
        reached = f"best KL {best[0]:.4g} with {best[1]} experts" if best else "no count could be measured"
        raise FidelityTargetNotMet(f"--experts auto: no expert count reaches KL <= {max_kl:g} ({reached}); tried "
                                   f"{', '.join(tried)}; raise --max-kl or the device budget")
    lo = -1  # the largest index known to miss the target (-1: none measured below hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        kl = kl_of(counts[mid])
        if kl is not None and kl <= max_kl:
            hi = mid
        else:
            lo = mid
    count = counts[hi]
    figures = sorted((c, f["kl"]) for c, (f, _) in measured.items() if f is not None)
    broken = [f"{a} -> {ka:.4g} below {b} -> {kb:.4g}" for (a, ka), (b, kb) in zip(figures, figures[1:]) if ka < kb]
    note = f"--experts auto --max-kl {max_kl:g}: chose {count}; tried " + ", ".join(tried)
    if broken:
        note += f" (more experts measured farther from the original: {'; '.join(broken)}: a smaller count may meet it)"
    figure, plan = measured[count]
    return count, figure, [note], plan


def figure_lines(figure: dict | None, width: int = 23) -> list[str]:
    """The figure as lines a person reads (build's summary, verify's report), labels `width` wide."""
    if not figure:
        return []
    t = figure["tokens"]
    worst = max(figure["layers"], key=lambda r: r["hidden_error"], default=None)
    blocks = [f"{r['layer']}:{r['block_error']:.3g}" for r in figure["layers"] if "block_error" in r]
    return [
        f"  {'fidelity':<{width - 1}} KL(original || proxy) {figure['kl']:.4g} nats/token; loss "
        f"{figure['loss_original']:.4f} -> {figure['loss_proxy']:.4f} ({figure['loss_delta']:+.4f}) on "
        f"{t['sequences']} x {t['seq_len']} held-out calibration tokens",
        f"  {'block error':<{width - 1}} {' '.join(blocks) or 'none'}"
        + (f"; hidden-state error after the last layer {figure['layers'][-1]['hidden_error']:.3g}"
           f" (largest {worst['hidden_error']:.3g}, layer {worst['layer']})" if worst else ""),
    ]
