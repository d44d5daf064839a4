"""How close a proxy is to its original: the fidelity figure of a calibrated build.

Both models run one decoder layer at a time (a pass of layerwise.driver), side by side, on
held-out calibration tokens: one layer of the original and the same layer of the proxy are
resident, each model's hidden states go through its own layer, and both layers are freed
before the next. The proxy is the one the plan describes, read through its output tensors
(output_shards.output_tensors: sliced routers, healed rows, kept experts) without writing it, so
`--experts auto` (pruning/auto.py) can measure several counts and write only the chosen one.
Several proxies are measured in one walk (measure_many): the original's layer is loaded and
run once, then each proxy's layer in turn. A build that fits tensors measures in the walk of
its fit (expert_plan.fit_plan: the pass of `fidelity_pass` beside the fit's): its proxy reads
the fitted tensors as the fit makes them (`as_fitted`), layer L's once the fit visited L.

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

from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Mapping

from moe_proxy.checkpoint.reads import read_coalesced
from moe_proxy.layerwise.driver import BATCH, Layer, LayerPass, walk

FIDELITY_SAMPLES = 16  # held-out calibration sequences measured, at most
HEAD_CHUNK = 512  # tokens per LM-head matmul (bounds the [tokens, vocab] logits)


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


@dataclass(frozen=True)
class FitSlot:
    """An output tensor's source where a fit may replace it: the source tensor it would replace."""

    name: str


class FitSlots(dict):
    """A plan's `fitted` under which output_shards.output_tensors lays out every tensor a fit could
    replace (router rows, kept experts) with a FitSlot as its source."""

    def get(self, name, default=None):
        return FitSlot(name)


def as_fitted(ckpt, config: dict, slots: dict, plain: dict, fitted: Mapping) -> PlannedProxy:
    """The proxy whose tensors are `fitted`'s (source tensor -> bytes, or a function returning
    them) where it holds them when they are read, the plain selection's elsewhere: `slots` and
    `plain` are output_tensors of the plan with FitSlots and without fits. A fit filling `fitted`
    layer by layer in the same walk is thus measured as it goes, with its final tensors."""
    plain_proxy = PlannedProxy(ckpt, config, plain)
    shards = {f: [replace(t, source=partial(_fitted_or, fitted, t.source.name, partial(plain_proxy.read, t.name)))
                  if isinstance(t.source, FitSlot) else t for t in ts] for f, ts in slots.items()}
    return PlannedProxy(ckpt, config, shards)


def _fitted_or(fitted: Mapping, name: str, plain: Callable[[], bytes]) -> bytes:
    source = fitted.get(name)
    if source is None:
        return plain()
    return source() if callable(source) else source


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
    """One proxy beside the original: per decoder layer its errors, then the head's figures."""

    layers: list[dict]  # {"layer", "hidden_error"} and, in MoE layers, {"block", "block_error"}
    kl: float
    loss_original: float
    loss_proxy: float


class FidelityPass(LayerPass[list[Compared]]):
    """Walks the original once for several proxies (`sources`, e.g. every count `--experts auto`
    screens): each original layer is loaded and run once, its MoE block's inputs and outputs kept,
    then each proxy's layer is loaded in turn, scored on those inputs and advanced on its own
    hidden states (forked from the original's: same embedding and position inputs)."""

    desc = "measuring fidelity"
    dense = True  # every layer's hidden-state error

    def __init__(self, sources: list[PlannedProxy], token_ids):
        self.sources, self.token_ids = sources, token_ids
        self.layers: list[list[dict]] = [[] for _ in sources]

    def begin(self, model, states) -> None:
        from moe_proxy.layerwise.model import LayerwiseModel

        self.original, self.ho = model, states
        self.proxies = [LayerwiseModel(s, dtype=model.dtype) for s in self.sources]
        self.hp = [states.fork() for _ in self.sources]

    def visit(self, layer: Layer) -> None:
        import torch

        from moe_proxy.layerwise.model import moe_modules

        i, seen = layer.index, []  # the original MoE block's (input, output) per batch
        hook = None if layer.moe is None else layer.moe.block.register_forward_hook(
            lambda module, args, out: seen.append((args[0], _first(out))))
        try:
            self.ho.advance(layer.module, i)
        finally:
            if hook is not None:
                hook.remove()
        for proxy, hp, records in zip(self.proxies, self.hp, self.layers):
            record: dict = {"layer": i}
            with proxy.layer(i) as lp:
                mp = moe_modules(lp)
                if hook is not None and mp is not None:
                    block = _Ratio()
                    with torch.no_grad():
                        for x, y in seen:
                            block.add(_first(mp.block(x)), y)
                    record |= {"block": layer.block.prefix, "block_error": block.value}
                hp.advance(lp, i)
            hidden = _Ratio()
            for a, b in zip(hp.hidden, self.ho.hidden):
                hidden.add(a, b)
            records.append(record | {"hidden_error": hidden.value})

    def result(self) -> list[Compared]:
        import torch

        heads = _head_figures(self.original, self.ho.hidden, [hp.hidden for hp in self.hp],
                              self.token_ids.split(BATCH), torch)
        return [Compared(layers, *head) for layers, head in zip(self.layers, heads)]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def measure(ckpt, layout, plan, calibration, shards: dict, progress: bool = False) -> dict:
    """The fidelity figure of the proxy `plan` describes (its output tensors `shards`), on the
    held-out calibration tokens of `calibration` (see the module docstring)."""
    return measure_many(ckpt, layout, [(plan, shards)], calibration, progress)[0]


def measure_many(ckpt, layout, proxies: list[tuple], calibration, progress: bool = False) -> list[dict]:
    """The figures of several proxies, (plan, its output tensors) each, in one walk of the original."""
    from moe_proxy.pruning.config import rewrite_config

    sources = [PlannedProxy(ckpt, rewrite_config(ckpt.config, plan), shards) for plan, shards in proxies]
    layer_pass, ids = fidelity_pass(sources, calibration)
    return figures(walk(ckpt, layout, layer_pass, ids, BATCH, progress), calibration)


def fidelity_pass(sources: list[PlannedProxy], calibration) -> tuple[FidelityPass, object]:
    """The pass that measures `sources` against the original, and the tokens it walks with."""
    from moe_proxy.layerwise.model import release_freed_memory

    # What the shard write freed in its reader threads' heaps, which this thread does not reuse,
    # goes back to the OS before two models load (docs/performance.md, memory against depth).
    release_freed_memory()
    ids, _ = held_out(calibration.token_ids)
    return FidelityPass(sources, ids), ids


def figures(found: list[Compared], calibration) -> list[dict]:
    """The figures (module docstring) of what a FidelityPass found, on `calibration`'s tokens."""
    from moe_proxy.pruning.heal import HEAL_SAMPLES

    ids, rows = held_out(calibration.token_ids)
    tokens = {"sequences": int(ids.shape[0]), "seq_len": int(ids.shape[1]), "rows": rows,
              "of": int(calibration.token_ids.shape[0]), "sha256": calibration.summary.get("tokens", {}).get("sha256"),
              "held_out_from_heal": rows[0] >= HEAL_SAMPLES}
    return [{"tokens": tokens, "layers": c.layers, "kl": _round(c.kl),
             "loss_original": _round(c.loss_original), "loss_proxy": _round(c.loss_proxy),
             "loss_delta": _round(c.loss_proxy - c.loss_original)} for c in found]


def _head_figures(model, original: list, proxies: list[list], ids: tuple, torch) -> list[tuple[float, float, float]]:
    """Per proxy: KL(original || proxy) per token and each model's next-token cross-entropy,
    through the original's final norm and LM head (tied to the embedding when the checkpoint has
    no head); the original's logits computed once for all."""
    norm = model.base.norm
    model.load(norm, "model.norm.")
    name = "lm_head.weight" if "lm_head.weight" in model.ckpt.tensors else "model.embed_tokens.weight"
    weight = model.tensors.read(name).to(model.dtype)
    kl, ce_p = [0.0] * len(proxies), [0.0] * len(proxies)
    ce_o, tokens, predicted = 0.0, 0, 0
    log_probs = lambda h, sel: (norm(h.reshape(-1, h.shape[-1])[sel]) @ weight.T).double().log_softmax(-1)  # noqa: E731
    nll = lambda lp, t: float(torch.nn.functional.nll_loss(lp, t, ignore_index=-100, reduction="sum"))  # noqa: E731
    with torch.no_grad():
        for b, x in enumerate(ids):
            targets = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], dim=1).reshape(-1)
            for sel in torch.arange(targets.numel()).split(HEAD_CHUNK):
                lo, t = log_probs(original[b], sel), targets[sel]
                ce_o += nll(lo, t)
                for p, hidden in enumerate(proxies):
                    lp = log_probs(hidden[b], sel)
                    kl[p] += float((lo.exp() * (lo - lp)).sum())
                    ce_p[p] += nll(lp, t)
                tokens += len(sel)
                predicted += int((t != -100).sum())
    norm.to("meta")
    return [(k / tokens, ce_o / max(predicted, 1), c / max(predicted, 1)) for k, c in zip(kl, ce_p)]


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
