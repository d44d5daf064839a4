"""`moe-proxy calibrate`: per-expert usage statistics of an MoE checkpoint on calibration
tokens, computed one decoder layer at a time (a pass of layerwise.driver), stored once and
reused by every build of the same checkpoint.

Per MoE layer and routed expert (float64 sums over the calibration tokens; the routing is
the model's own, read from the arguments its MoE block passes to its experts):

| tensor `layers.<L>.<name>` | shape | meaning |
|---|---|---|
| `tokens`        | [E]      | tokens routed to the expert (top-k slots) |
| `gate_mass`     | [E]      | sum of the routing weights it received |
| `saliency`      | [E]      | REAP: mean over its routed tokens of gate weight x L2 norm of its output |
| `max_abs`       | [E]      | largest magnitude in its output, on its routed tokens and on the probe tokens |
| `output_mean`   | [E, 64]  | its mean output over its routed tokens, through a fixed Gaussian sketch |
| `output_probe`  | [E, 256] | its outputs on 16 probe tokens (the same for every expert), each sketched to 16 numbers |
| `routing_probe` | [E, 64]  | its router logit on 64 probe tokens, centred per token |

plus `tokens` [samples, seq_len] (the calibration token ids, so a build can replay them for
`--heal`). `calibration.json` (written last: its presence marks the statistics complete)
holds the schema version, the source's identity (build.source_identity: config, tensor
table, router bytes), the tokens' sha256 and origin, and per layer the dead and super
experts under the default criteria (criteria.py).

Two modes (`mode` in calibration.json). One-pass (the default): every layer is scored on the
original's hidden states. Sequential (`--sequential --experts N --method M`, pruning/sequential.py):
each MoE layer is scored on hidden states that went through the already-pruned layers before
it, its experts are selected right after it is scored, and the hidden states then go
through the pruned layer; `made_for` records the proxy it was made for (expert count, top-k,
method and the options that decide the selection) and per layer the experts kept, and a
build for another proxy is refused (`CalibrationStatistics.check_target`).

Criteria (dead and super experts, also applied by `build --calibration`): criteria.py.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from moe_proxy import __version__
from moe_proxy.architectures import detect, expert_count
from moe_proxy.calibrate.criteria import LayerStats, selection_flags, selection_key, super_experts, thresholds
from moe_proxy.calibrate.tokens import Tokens, calibration_tokens
from moe_proxy.checkpoint.reader import Checkpoint, open_checkpoint, read_json
from moe_proxy.checkpoint.layout import Layout, MoeBlock, find_layout, source_identity
from moe_proxy.errors import CalibrationError, MoeProxyError
from moe_proxy.layerwise.blocks import swapped
from moe_proxy.layerwise.driver import Layer, LayerPass, walk
from moe_proxy.layerwise.model import MoeModules
from moe_proxy.storage import Store, open_store, write_bytes

log = logging.getLogger(__name__)
FORMAT = "moe-proxy-calibration/v1"
SUMMARY, TENSORS = "calibration.json", "calibration.safetensors"
SKETCH_DIM, PROBE_TOKENS, PROBE_DIM, ROUTING_PROBE = 64, 16, 16, 64
ONE_PASS, SEQUENTIAL = "one-pass", "sequential"


def _sketch(n: int, d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n * 1000 + d)
    return torch.randn(n, d, generator=g, dtype=torch.float64) / d**0.5


class ExpertObserver:
    """Accumulates one MoE layer's statistics from the calls its block makes to its experts."""

    def __init__(self, prefix: str, layer: int, mods: MoeModules, n_experts: int, hidden: int):
        self.prefix, self.layer, self.mods, self.n = prefix, layer, mods, n_experts
        f64 = dict(dtype=torch.float64)
        self.tokens = torch.zeros(n_experts, **f64)
        self.gate_mass = torch.zeros(n_experts, **f64)
        self.saliency_sum = torch.zeros(n_experts, **f64)
        self.max_abs = torch.zeros(n_experts, **f64)
        self.output_sum = torch.zeros(n_experts, hidden, **f64)
        self.output_probe = torch.zeros(n_experts, PROBE_TOKENS * PROBE_DIM, **f64)
        self.routing_probe = torch.zeros(n_experts, ROUTING_PROBE, **f64)
        self._probed = False
        self._inside = False
        self._hook = mods.experts.register_forward_pre_hook(self._observe)

    def expert_output(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's own output on tokens x, computed by the model's experts module."""
        idx = torch.full((len(x), 1), e, dtype=torch.long)
        self._inside = True
        try:
            with torch.no_grad():
                return self.mods.experts(x, idx, torch.ones(len(x), 1, dtype=x.dtype))
        finally:
            self._inside = False

    def _observe(self, module, args) -> None:
        if self._inside:
            return
        x, index, weights = args[0], args[1], args[2]
        flat_idx, flat_w = index.reshape(-1), weights.reshape(-1).double()
        real = flat_idx < self.n  # some implementations mark empty slots with index n
        flat_idx, flat_w = flat_idx[real], flat_w[real]
        self.tokens += torch.bincount(flat_idx, minlength=self.n).double()
        self.gate_mass.index_add_(0, flat_idx, flat_w)
        for e in torch.unique(flat_idx).tolist():
            tok, slot = torch.where(index == e)
            out = self.expert_output(x[tok], e).double()
            w = weights[tok, slot].double()
            self.saliency_sum[e] += (w * out.norm(dim=-1)).sum()
            self.max_abs[e] = max(self.max_abs[e], out.abs().max())
            self.output_sum[e] += out.sum(dim=0)
        if not self._probed:
            self._probe(x)

    def _probe(self, x: torch.Tensor) -> None:
        """All experts on the same few tokens: comparable outputs, and outliers of rarely routed experts."""
        self._probed = True
        pick = torch.linspace(0, len(x) - 1, PROBE_TOKENS).long()
        sketch = _sketch(x.shape[-1], PROBE_DIM)
        for e in range(self.n):
            out = self.expert_output(x[pick], e).double()
            self.max_abs[e] = max(self.max_abs[e], out.abs().max())
            self.output_probe[e] = (out @ sketch).flatten()
        router = self.mods.router
        bias = getattr(router, "bias", None)
        pick = torch.linspace(0, len(x) - 1, ROUTING_PROBE).long()
        logits = torch.nn.functional.linear(x[pick].double(), router.weight.double(),
                                            bias.double() if isinstance(bias, torch.Tensor) else None)
        self.routing_probe = (logits - logits.mean(dim=1, keepdim=True)).T.contiguous()

    def finish(self) -> LayerStats:
        self._hook.remove()
        routed = self.tokens.clamp(min=1)
        mean_out = self.output_sum / routed[:, None]
        return LayerStats(self.prefix, self.layer, self.tokens, self.gate_mass, self.saliency_sum / routed,
                          self.max_abs, mean_out @ _sketch(mean_out.shape[1], SKETCH_DIM),
                          self.output_probe, self.routing_probe)


# ---------------------------------------------------------------- the artifact


@dataclass
class CalibrationStatistics:
    summary: dict
    layers: dict[str, LayerStats]  # MoE block prefix -> statistics
    token_ids: torch.Tensor
    uri: str = ""
    super: dict[str, dict[int, str]] = field(default_factory=dict)  # prefix -> expert -> rule(s), super_experts
    criteria: dict = field(default_factory=thresholds)  # what `super` was judged by

    @property
    def identity(self) -> str:
        return self.summary["source"]["identity"]

    @property
    def mode(self) -> str:
        return self.summary.get("mode", ONE_PASS)  # statistics written before modes existed are one-pass

    def record(self) -> dict:
        """What a proxy's manifest says about the statistics it was built from."""
        return {"uri": self.uri, "format": self.summary["format"], "mode": self.mode,
                **({"made_for": self.summary["made_for"]} if self.mode == SEQUENTIAL else {}),
                "tokens": self.summary["tokens"],
                "criteria": self.criteria,
                "super": {p: sorted(v) for p, v in self.super.items() if v}}

    def check_target(self, plan, options) -> None:
        """Sequential statistics describe one proxy: refuse a build of another."""
        if self.mode != SEQUENTIAL:
            return
        made, want = self.summary["made_for"], selection_key(plan, options)
        diff = [f"{k} {made.get(k)!r} (this build: {v!r})" for k, v in want.items() if made.get(k) != v]
        diff += [f"{k} {v!r} (this build: none)" for k, v in made.items() if k not in want]
        if diff:
            raise CalibrationError(
                f"{self.uri}: these statistics are sequential, made for the proxy of {selection_flags(made)}: "
                f"each layer was scored behind that proxy's pruned earlier layers, so they do not hold for this "
                f"build ({'; '.join(diff)}); run moe-proxy calibrate SRC --out STATS "
                f"{selection_flags(want)} for this proxy, or moe-proxy calibrate SRC --out STATS --one-pass "
                f"for statistics any build can use"
            )

    def judged(self, options) -> "CalibrationStatistics":
        """These statistics with their super experts judged by the build's thresholds (PruningOptions).
        Sequential statistics keep the ones judged when each layer was selected: check_target has
        made sure they were made with the same thresholds."""
        if self.mode == SEQUENTIAL:
            return self
        rule = dict(range_share=options.super_range_share, outlier=options.super_outlier)
        return replace(self, super=super_experts(self.layers, **rule), criteria=thresholds(**rule))

    def selection_notes(self, selections: dict) -> list[str]:
        """Notes where a build keeps other experts than sequential statistics were made behind (pins)."""
        if self.mode != SEQUENTIAL:
            return []
        return [f"{p}: kept {sel.kept}, but the sequential statistics were made behind {info['kept']} "
                f"(e.g. --pin): later layers were scored behind a slightly different proxy"
                for p, sel in selections.items()
                if (info := self.summary["layers"].get(p)) is not None and info.get("kept") != sel.kept]

    def check_source(self, identity: str, uri: str) -> None:
        if identity != self.identity:
            raise CalibrationError(
                f"{self.uri}: these statistics were computed on {self.summary['source']['uri']} "
                f"(identity {self.identity[:12]}), not on {uri} (identity {identity[:12]}): another checkpoint "
                f"or another step of the run; run moe-proxy calibrate {uri} --out STATS"
            )


def save(store: Store, cal: CalibrationStatistics) -> None:
    tensors = {"tokens": cal.token_ids.to(torch.int64).contiguous()}
    for s in cal.layers.values():
        for name in LayerStats.NAMES:
            tensors[f"layers.{s.layer}.{name}"] = getattr(s, name).contiguous()
    store.delete(SUMMARY)  # unpublish first: stale statistics never sit beside new tensors
    write_bytes(store, TENSORS, st_save(tensors, metadata={"format": FORMAT}))
    write_bytes(store, SUMMARY, (json.dumps(cal.summary, indent=2) + "\n").encode())


def load(uri: str | Store, **store_options) -> CalibrationStatistics:
    store = open_store(uri, **store_options) if isinstance(uri, str) else uri
    if not store.exists(SUMMARY):
        raise CalibrationError(f"{store.uri}: no {SUMMARY}: not a calibration, or an incomplete one; "
                               f"run moe-proxy calibrate")
    summary = read_json(store, SUMMARY)
    if summary.get("format") != FORMAT:
        raise CalibrationError(f"{store.uri}/{SUMMARY}: format {summary.get('format')!r}, expected {FORMAT!r}")
    if not store.exists(TENSORS):
        raise CalibrationError(f"{store.uri}: {TENSORS} is missing beside {SUMMARY}")
    try:
        tensors = st_load(store.read_bytes(TENSORS))
    except Exception as exc:
        raise CalibrationError(f"{store.uri}/{TENSORS}: unreadable ({exc})") from None
    layers = {}
    for prefix, info in summary["layers"].items():
        try:
            layers[prefix] = LayerStats(prefix, info["layer"],
                                        *(tensors[f"layers.{info['layer']}.{n}"] for n in LayerStats.NAMES))
        except KeyError as exc:
            raise CalibrationError(f"{store.uri}/{TENSORS}: missing tensor {exc}") from None
    # Sequential statistics judged each layer's super experts when it was selected (against the
    # layers scored so far): the build keeps the same ones.
    if summary.get("mode") == SEQUENTIAL:
        supers = {p: {int(e): (info.get("super_rules") or {}).get(str(e), "reap") for e in info["super"]}
                  for p, info in summary["layers"].items()}
        return CalibrationStatistics(summary, layers, tensors["tokens"], store.uri, supers, summary["criteria"])
    return CalibrationStatistics(summary, layers, tensors["tokens"], store.uri, super_experts(layers))


# ---------------------------------------------------------------- the pass


def calibrate(src: str | Store, out: str | Store, dataset: str | None = None, samples: int = 64,
              seq_len: int = 256, seed: int = 0, batch_size: int = 8, progress: bool = False,
              store_options: dict | None = None, token_ids: torch.Tensor | None = None,
              sequential=None) -> dict:
    """Compute and store the statistics; returns the summary (also `calibration.json`).
    `token_ids` ([samples, seq_len]): the caller's own tokens instead of `dataset` (library use,
    e.g. a byte-level model without a tokenizer). `sequential`: the PruningOptions of the proxy
    to calibrate for (pruning/sequential.py); None: one pass over the original."""
    ckpt = open_checkpoint(src, **(store_options or {}))
    layout = find_layout(ckpt, detect(ckpt.config))
    out_store = open_store(out, **(store_options or {})) if isinstance(out, str) else out
    tokens = _tokens(ckpt, dataset, samples, seq_len, seed, store_options, token_ids)
    identity = source_identity(ckpt, layout)
    proxy = None
    if sequential is not None:
        # The one import of build from calibrate, when it runs: the build's own selection is what
        # sequential statistics interleave with the scoring (tests/house/test_imports.py lists it).
        from moe_proxy.pruning.sequential import SequentialProxy

        proxy = SequentialProxy(ckpt, layout, sequential)
    mode = {"mode": SEQUENTIAL, "made_for": proxy.key} if proxy is not None else {"mode": ONE_PASS}
    if (old := _same_statistics(out_store, identity, tokens, mode)) is not None:
        log.info("%s already holds these statistics (same checkpoint and tokens): nothing to do", out_store.uri)
        return old | {"up_to_date": True}
    layers = run_statistics(ckpt, layout, tokens.ids, batch_size, progress, proxy)
    summary = _summary(ckpt, layout, identity, tokens, seed, mode, layers, proxy)
    save(out_store, CalibrationStatistics(summary, layers, tokens.ids))
    return summary


def _tokens(ckpt: Checkpoint, dataset: str | None, samples: int, seq_len: int, seed: int,
            store_options: dict | None, token_ids: torch.Tensor | None) -> Tokens:
    """The calibration tokens: the caller's `token_ids` (checked), or `samples` sequences of
    `dataset` (random ids, warned about, where there is none), within the model's positions."""
    seq_len = int(token_ids.shape[1]) if token_ids is not None else seq_len
    max_pos = ckpt.config.get("max_position_embeddings")
    if isinstance(max_pos, int) and seq_len > max_pos:
        raise MoeProxyError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings ({max_pos})")
    if token_ids is not None:
        vocab = int(ckpt.config["vocab_size"])
        if token_ids.dim() != 2 or int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab:
            raise MoeProxyError(f"token_ids must be [samples, seq_len] ids in 0..{vocab - 1}")
        tokens = Tokens(token_ids.long(), "token ids given by the caller", False)
    else:
        tokens = calibration_tokens(ckpt.store, dataset, samples, seq_len, seed, int(ckpt.config["vocab_size"]),
                                    store_options)
    if tokens.random:
        log.warning("calibration tokens: %s", tokens.origin)
    return tokens


def _same_statistics(out_store: Store, identity: str, tokens: Tokens, mode: dict) -> dict | None:
    """The summary already in `out_store` when it is of these very statistics (same checkpoint,
    tokens and mode); None otherwise."""
    if not out_store.exists(SUMMARY):
        return None
    try:
        old = read_json(out_store, SUMMARY)
    except MoeProxyError:
        old = {}
    if (old.get("format") == FORMAT and old.get("source", {}).get("identity") == identity
            and old.get("tokens", {}).get("sha256") == tokens.sha256 and out_store.exists(TENSORS)
            and {"mode": old.get("mode", ONE_PASS), **({"made_for": old.get("made_for")}
                                                         if "made_for" in old else {})} == mode):
        return old
    return None


def _summary(ckpt: Checkpoint, layout: Layout, identity: str, tokens: Tokens, seed: int, mode: dict,
             layers: dict[str, LayerStats], proxy: SequentialTarget | None) -> dict:
    """calibration.json: what was measured, on which tokens, and per layer its dead and super experts."""
    supers = proxy.supers if proxy is not None else super_experts(layers)
    rule = proxy.super_rule if proxy is not None else {}
    return {
        "format": FORMAT,
        "tool_version": __version__,
        **mode,
        "source": {"uri": ckpt.uri, "identity": identity, "architecture": layout.arch.name,
                   "model_type": ckpt.config.get("model_type")},
        "tokens": {"samples": int(tokens.ids.shape[0]), "seq_len": int(tokens.ids.shape[1]),
                   "sha256": tokens.sha256, "origin": tokens.origin, "random": tokens.random, "seed": seed},
        "criteria": thresholds(**rule),
        "experts": expert_count(layout.arch, ckpt.config),
        "layers": {
            p: {"layer": s.layer, "tokens_routed": int(s.tokens.sum()), "dead": s.dead(supers=supers[p]),
                "super": sorted(supers[p]), "super_rules": {str(e): rule for e, rule in sorted(supers[p].items())},
                "super_rarely_routed": s.rarely_routed(supers[p]),
                "load_imbalance": round(s.load_imbalance(), 4)}
            | ({"kept": proxy.kept[p]} if proxy is not None else {})
            for p, s in layers.items()
        },
        "skipped": {b.prefix: "not part of the transformers model (MTP layer): no statistics; builds select "
                              "its experts without calibration"
                    for b in layout.blocks if b.prefix not in layers},
    }


class SequentialTarget(Protocol):
    """The proxy sequential statistics are made for (pruning.sequential.SequentialProxy)."""

    key: dict  # what decides its kept experts: the artifact's `made_for`
    supers: dict[str, list[int]]  # per MoE block selected so far: its super experts
    kept: dict[str, list[int]]  # per MoE block selected so far: its kept experts
    super_rule: dict  # the super-expert criteria of its options (thresholds' keywords)

    def select(self, block: MoeBlock, scored: dict[str, LayerStats]) -> list[int]:
        """Select `block`'s experts from the statistics of every layer scored so far; its kept experts."""

    def block(self, original: torch.nn.Module, kept: list[int], dtype: torch.dtype) -> torch.nn.Module:
        """The pruned block that replaces `original` (a loaded MoE block) in the proxy."""


class StatisticsPass(LayerPass[dict[str, LayerStats]]):
    """Per MoE block prefix, its statistics. With a `proxy`, each MoE layer is scored on the
    proxy's hidden states, its experts are selected, and the hidden states are then carried
    through the pruned layer."""

    desc = "calibrating"

    def __init__(self, n_experts: int, proxy: SequentialTarget | None = None):
        self.n, self.proxy = n_experts, proxy
        self.stats: dict[str, LayerStats] = {}

    def visit(self, layer: Layer) -> str:
        i, block, mods, states = layer.index, layer.block, layer.moe, layer.states
        observer = ExpertObserver(block.prefix, i, mods, self.n, layer.model.config.hidden_size)
        if self.proxy is None:
            states.advance(layer.module, i)
        else:  # the original layer scores the proxy's hidden states; they stay put for now
            states.observe(layer.module, i)
        s = self.stats[block.prefix] = observer.finish()
        kept = ""
        if self.proxy is not None:  # select now, then carry the hidden states through the pruned layer
            selected = self.proxy.select(block, self.stats)
            with swapped(layer.module, self.proxy.block(mods.block, selected, layer.model.dtype)):
                states.advance(layer.module, i)
            kept = f"  kept {selected}"
        return (f"layer {i:>3}: dead {len(s.dead())}/{self.n} {s.dead()[:8]}  load imbalance "
                f"{s.load_imbalance():.2f}  max |output| {float(s.max_abs.max()):.3g} "
                f"(expert {int(s.max_abs.argmax())}){kept}  ({time.monotonic() - layer.started:.1f} s)")

    def result(self) -> dict[str, LayerStats]:
        return self.stats


def run_statistics(ckpt: Checkpoint, layout: Layout, token_ids: torch.Tensor, batch_size: int = 8,
                   progress: bool = False, proxy: SequentialTarget | None = None) -> dict[str, LayerStats]:
    """Per MoE block prefix, its statistics (StatisticsPass)."""
    n = expert_count(layout.arch, ckpt.config)
    return walk(ckpt, layout, StatisticsPass(n, proxy), token_ids, batch_size, progress)
