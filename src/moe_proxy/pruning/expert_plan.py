"""Plan a proxy: per MoE block, expert features -> clustering -> the kept experts (ascending,
renumbered 0..k-1 in that order), with the expert count, new top-k and grouped-routing
fields checked against the architecture's constraints. Errors suggest valid values.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from tqdm.auto import tqdm

from moe_proxy.architectures import Arch, expert_count, groups, top_k
from moe_proxy.checkpoint.reader import Checkpoint
from moe_proxy.errors import CorruptCheckpoint, InvalidExpertCount
from moe_proxy.checkpoint.layout import Layout
from moe_proxy.sizing import SizingOptions, estimate, target_experts  # one rule for plan, build and the operator
from moe_proxy.options import CALIBRATED_FEATURES, SCORED_METHODS
from moe_proxy.pruning.selection import Selection
from moe_proxy.options import PruningOptions


@dataclass
class ExpertPlan:
    arch: Arch
    experts_before: int
    experts_after: int
    top_k_before: int
    top_k_after: int
    n_group: int
    topk_group: int
    selections: dict[str, Selection]  # block prefix -> selection
    notes: list[str]
    calibration: dict | None = None  # the statistics' identity, for the manifest
    # Fitted tensors (--heal, --merge, --reconstruct; see fit_plan): source tensor name (router,
    # fused or per-expert of a kept expert) -> the proxy tensor's bytes, read when written
    # (spilled to local disk or the build's fits artifact, not held in memory)
    fitted: dict[str, Callable[[], bytes]] = field(default_factory=dict)
    reconstruction: dict | None = None  # what --reconstruct fitted, on which tokens (the manifest's)
    fidelity: dict | None = None  # the proxy measured against the original (fidelity.py)
    merge: dict | None = None  # how --merge made the kept experts (the manifest's)


def proxy_counts(arch: Arch, config: dict, options: PruningOptions, sizing: SizingOptions | None = None) -> ExpertPlan:
    """The proxy's expert count, top-k and routing groups (an ExpertPlan without selections),
    checked against the architecture's constraints. A keep ratio becomes a count by the rule
    `moe-proxy plan` uses (sizing.estimate: rounded to whole groups, raised to 2 x top-k
    where the device budget of `sizing`, default the ratio's own devices, holds it), with its notes."""
    n, k0 = expert_count(arch, config), top_k(arch, config)
    n_group, topk_group = groups(arch, config)
    if n % n_group:
        raise CorruptCheckpoint(f"config.json has {n} experts in {n_group} groups: not an equal split")
    notes = []
    if options.keep_ratio is not None:
        sized = estimate(config, replace(sizing or SizingOptions(), experts=None, keep_ratio=options.keep_ratio,
                                         top_k=options.top_k))
        k = sized.proxy.experts_per_layer
        notes += sized.notes
    else:
        k = target_experts(n, arch, n_group, options.experts, None)
    limit = min(k, topk_group * (k // n_group)) if n_group > 1 else k
    if options.top_k is not None:
        if not 1 <= options.top_k <= limit:
            raise InvalidExpertCount(f"--top-k {options.top_k} must be between 1 and {limit} with {k} experts kept")
        new_top_k = options.top_k
    else:
        new_top_k = min(k0, limit)
        if new_top_k != k0:
            notes.append(f"top-k clamped from {k0} to {new_top_k}: only {k} experts kept"
                         + (f" ({k // n_group} in each of {topk_group} selected groups)" if n_group > 1 else ""))
    return ExpertPlan(arch, n, k, k0, new_top_k, n_group, topk_group, {}, notes)


def _usage_notes(layer: int, record: dict, k: int, n_group: int) -> list[str]:
    """What a usage-aware selection did that the user must hear of (usage.usage_select's record)."""
    notes = []
    keeps = f"in {n_group} routing groups" if n_group > 1 else "experts"
    if record.get("super_not_kept"):  # said, never dropped silently (issue 30)
        notes.append(f"layer {layer}: super experts not kept, the layer keeps {k} ({keeps}): " + ", ".join(
            f"{e} ({f['rule']}, max |output| {f['max_abs']:.4g})" for e, f in record["super_not_kept"].items()))
    if record.get("dead_kept"):  # --fill-dead: fewer alive experts than the count
        notes.append(f"layer {layer}: fewer alive experts than the {k} kept ({keeps}) on the calibration data (a "
                     f"collapsed router?); {len(record['dead_kept'])} dead experts kept to fill the count "
                     f"(--fill-dead), the most routed first: {record['dead_kept']}")
    return notes


def plan_experts(ckpt: Checkpoint, layout: Layout, options: PruningOptions, progress: bool = False,
              calibration=None, sizing: SizingOptions | None = None) -> ExpertPlan:
    """`calibration`: a calibration.Calibration of this checkpoint, for usage-aware selection."""
    # torch (features) and scikit-learn (selection) load only when experts are selected.
    from moe_proxy.pruning.features import expert_features
    from moe_proxy.pruning.selection import select
    from moe_proxy.pruning.usage import usage_select

    arch, config = layout.arch, ckpt.config
    options.validate()
    plan = proxy_counts(arch, config, options, sizing)
    n, k, k0, new_top_k = plan.experts_before, plan.experts_after, plan.top_k_before, plan.top_k_after
    n_group, topk_group, notes = plan.n_group, plan.topk_group, plan.notes
    if calibration is not None:  # sequential statistics: only for the proxy they were made for
        calibration.check_target(plan, options)
        calibration = calibration.judged(options)  # super experts by this build's thresholds
    unknown = set(options.pins) - {b.layer for b in layout.blocks}
    if unknown:
        raise InvalidExpertCount(
            f"--pin names layer(s) {sorted(unknown)} which have no routed experts; MoE layers: "
            f"{[b.layer for b in layout.blocks]}"
        )
    selections = {}
    for block in tqdm(layout.blocks, desc="selecting experts", unit="layer", disable=not progress):
        pins = options.pins.get(block.layer, [])
        bad = [e for e in pins if not 0 <= e < n]
        if bad:
            raise InvalidExpertCount(f"--pin {block.layer}:{bad[0]}: experts are numbered 0..{n - 1}")
        if len(set(pins)) > k:
            raise InvalidExpertCount(f"{len(set(pins))} experts pinned in layer {block.layer} but only {k} kept")
        stats = calibration.layers.get(block.prefix) if calibration is not None else None
        if stats is not None:
            sel = selections[block.prefix] = usage_select(ckpt, block, stats, calibration.super.get(block.prefix, {}),
                                                          k, n_group, options, sorted(set(pins)))
            notes += _usage_notes(block.layer, sel.record, k, n_group)
            continue
        if calibration is not None:
            notes.append(f"{block.prefix}: no calibration statistics (MTP layer), selected without them")
        # Baselines ignore features but still report cluster sizes, from the cheap router rows;
        # so do blocks without statistics asked for statistics-based features.
        data_free = options.method == "cluster" and options.features not in CALIBRATED_FEATURES
        feats = expert_features(ckpt, block, options.features if data_free else "router")
        selections[block.prefix] = select(
            feats, k, n_group=n_group, method="cluster" if options.method in SCORED_METHODS else options.method,
            clustering=options.clustering, seed=options.seed, pins=sorted(set(pins)), layer=block.layer,
        )
    plan.selections = selections
    if calibration is not None:
        plan.calibration = calibration.record()
        notes += calibration.selection_notes(selections)
    if k <= new_top_k:
        notes.append(f"{k} experts kept with top-k {new_top_k}: every token uses every kept expert, so load "
                     f"imbalance and routing collapse cannot show; keep at least {2 * k0} experts if you can")
    return fit_plan(ckpt, layout, plan, options, calibration, progress)


def fit_plan(ckpt: Checkpoint, layout: Layout, plan: ExpertPlan, options: PruningOptions, calibration,
             progress: bool = False) -> ExpertPlan:
    """The plan with the fitted tensors `options` ask for (--heal, --merge, --reconstruct) on top
    of its selection, and its fidelity figure, as a new plan: `plan` is left as it was, so that
    `--experts auto` fits only the counts it must, each from its screened plan. One walk of the
    decoder layers (layerwise.driver.walk_all): at each layer the fit's pass, then the fidelity
    figure's, which reads the tensors just fitted (fidelity.as_fitted), so each layer is loaded
    once and the figure is that of the plan returned. Each pass returns its own result (tensors,
    per-layer records, summary); this is the one place they go into a plan."""
    if not options.fits:
        return plan
    from moe_proxy.layerwise.driver import BATCH, walk_all  # torch-heavy, only when asked
    from moe_proxy.pruning.config import rewrite_config
    from moe_proxy.pruning.fidelity import FitSlots, PlannedProxy, as_fitted, fidelity_pass, figures
    from moe_proxy.pruning.output_shards import output_tensors

    fit_pass, ids, made = _fit_pass(ckpt, layout, plan, options, calibration)
    # --reconstruct keeps its fits only if closer end to end than the plain selection (merged
    # experts have none to fall back to): both are measured in the walk.
    judge = options.reconstruct and not (options.heal or options.merge)
    config, plain = rewrite_config(ckpt.config, plan), output_tensors(ckpt, layout, replace(plan, fitted={}))
    fitted = as_fitted(ckpt, config, output_tensors(ckpt, layout, replace(plan, fitted=FitSlots())), plain, made)
    measuring, held = fidelity_pass([fitted] + ([PlannedProxy(ckpt, config, plain)] if judge else []), calibration)
    found, compared = walk_all(ckpt, layout, [(fit_pass, ids), (measuring, held)], BATCH, progress)
    measured = figures(compared, calibration)
    fitted_plan = _fitted(plan, options, calibration, found, ids)
    if judge:
        return keep_fits_if_closer(fitted_plan, *measured)
    return replace(fitted_plan, fidelity=measured[0])


def _fit_pass(ckpt: Checkpoint, layout: Layout, plan: ExpertPlan, options: PruningOptions, calibration):
    """The pass that fits what `options` ask for, its calibration tokens (None: it walks without),
    and the fitted tensors it fills layer by layer (source tensor -> bytes or a function returning them)."""
    if options.heal:
        from moe_proxy.pruning.heal import heal_pass  # torch-heavy, only when asked

        layer_pass, ids = heal_pass(ckpt, plan, calibration)
        return layer_pass, ids, layer_pass.healed.tensors
    if options.reconstruct:  # with --merge, it merges each layer first (merge.py)
        from moe_proxy.pruning.reconstruct import reconstruct_pass

        layer_pass, ids = reconstruct_pass(ckpt, layout, plan, calibration, merge=options.merge)
        return layer_pass, ids, layer_pass.found.tensors
    from moe_proxy.pruning.merge import merge_pass

    layer_pass = merge_pass(ckpt, layout, plan, calibration)
    return layer_pass, None, layer_pass.merged.tensors


def _fitted(plan: ExpertPlan, options: PruningOptions, calibration, found, ids) -> ExpertPlan:
    """`plan` with what the fit's pass `found` (its tensors, records and summaries)."""
    notes = list(plan.notes)
    if options.heal:
        return _with_fits(plan, {n: _held(b) for n, b in found.tensors.items()}, {"heal": found.records}, notes)
    if options.merge and calibration.mode != "one-pass":
        notes.append("--merge with sequential statistics: each layer was scored behind the plain (unmerged) proxy's "
                     "earlier layers")
    if options.reconstruct:
        from moe_proxy.pruning.reconstruct import summarised

        found = summarised(found, ids, calibration)
        if not options.merge:
            return _with_fits(plan, found.tensors, {"reconstruct": found.records}, notes,
                              reconstruction=found.summary)
    from moe_proxy.pruning.merge import merge_record  # (scipy: only with --merge)

    if options.reconstruct:  # merged, then fitted (merged experts have no plain selection to fall back to)
        record, more = merge_record(plan, list(found.merges))
        return _with_fits(plan, found.tensors, {"merge": found.merges, "reconstruct": found.records},
                          notes + more, reconstruction=found.summary, merge=record)
    record, more = merge_record(plan, list(found.records))
    return _with_fits(plan, found.tensors, {"merge": found.records}, notes + more, merge=record)


def _held(data: bytes) -> Callable[[], bytes]:
    return lambda: data


def _with_fits(plan: ExpertPlan, tensors: dict[str, Callable[[], bytes]], records: dict[str, dict[str, object]],
               notes: list[str], **fields) -> ExpertPlan:
    """`plan` with fitted tensors and, per layer, the passes' records (key -> block prefix -> record)."""
    selections = {prefix: replace(sel, record={**sel.record, **{key: per[prefix] for key, per in records.items()
                                                                  if prefix in per}})
                  for prefix, sel in plan.selections.items()}
    return replace(plan, selections=selections, fitted=dict(tensors), notes=notes, **fields)


PLAIN_CLOSER = ("reconstruction not kept: the fitted proxy's KL to the original, {fitted:.3g}, is above the plain "
                "selection's, {plain:.3g}, on the held-out calibration tokens (the plain proxy is written; "
                "docs/fidelity.md, super experts)")


def keep_fits_if_closer(plan: ExpertPlan, fitted: dict, unfitted: dict) -> ExpertPlan:
    """`plan` with its reconstructed tensors only if the proxy they make is, end to end, at least
    as close to the original as the plain selection; else the plain proxy's plan. Each fitted
    layer lowered its own block error, and that almost always lowers the KL too, but not where a
    super expert's massive outputs dominate every squared error: there the fit matched those few
    tokens and the KL came out 4x the plain proxy's (docs/fidelity.md). `fitted` and `unfitted`:
    the two proxies' fidelity figures, measured in the fit's walk on the figure's held-out
    tokens; the manifest's `reconstruction.end_to_end` records the two KLs, and `fidelity` holds
    the figure of the proxy kept (so --experts auto measures it once)."""
    if not plan.fitted:  # no layer kept its fit: the plain proxy, whose figure both are
        return replace(plan, fidelity=unfitted)
    plain = replace(plan, fitted={})
    kept = fitted["kl"] <= unfitted["kl"]
    reconstruction = {**plan.reconstruction,
                      "end_to_end": {"kl_fitted": fitted["kl"], "kl_plain": unfitted["kl"], "kept": kept}}
    if kept:
        return replace(plan, reconstruction=reconstruction, fidelity=fitted)
    why = PLAIN_CLOSER.format(fitted=fitted["kl"], plain=unfitted["kl"])
    selections = {prefix: replace(sel, record={**sel.record, "reconstruct": sel.record["reconstruct"]
                                               | {"fitted": False, "why": why}})
                  if sel.record.get("reconstruct", {}).get("fitted") else sel
                  for prefix, sel in plan.selections.items()}
    reconstruction |= {"fitted": [], "layers": {"fitted": 0, "plain": sum(plan.reconstruction["layers"].values())}}
    return replace(plain, selections=selections, reconstruction=reconstruction, fidelity=unfitted,
                   notes=plan.notes + [why])


PLAN_FIELDS = ("experts_before", "experts_after", "top_k_before", "top_k_after", "n_group", "topk_group", "notes",
               "calibration", "reconstruction", "merge", "fidelity")


def plan_record(plan: ExpertPlan) -> dict:
    """What a scale-out's workers write into their journals: everything finalize needs of the
    plan (config, index, manifest), as JSON. Fitted tensors (--heal, --reconstruct) are not in it;
    their fidelity figure, measured where they were fitted, is (finalize does not walk again)."""
    return {**{f: getattr(plan, f) for f in PLAN_FIELDS},
            "selections": {prefix: {"kept": s.kept, "cluster_sizes": s.cluster_sizes, "assignment": s.assignment,
                                    "record": s.record} for prefix, s in plan.selections.items()}}


def plan_from_record(record: dict, layout: Layout) -> ExpertPlan:
    """The plan a record describes, checked against this checkpoint's layout: one selection per
    MoE block, each keeping `experts_after` distinct experts of the block's, the same number
    per routing group, the cluster sizes covering every expert."""
    try:
        plan = ExpertPlan(layout.arch, **{f: record[f] for f in PLAN_FIELDS[:7]},
                          selections={p: Selection(**s) for p, s in record["selections"].items()},
                          calibration=record["calibration"], reconstruction=record["reconstruction"],
                          merge=record["merge"], fidelity=record["fidelity"])
    except (KeyError, TypeError) as exc:
        raise CorruptCheckpoint(f"the workers' plan is incomplete ({exc!r}); rerun the workers") from None
    blocks = {b.prefix: b for b in layout.blocks}
    if set(plan.selections) != set(blocks):
        raise CorruptCheckpoint(f"the workers' plan selects experts in {sorted(set(plan.selections) ^ set(blocks))[:3]}"
                                f", which this checkpoint's MoE blocks do not match; rerun the workers")
    n, k, per = plan.experts_before, plan.experts_after, plan.experts_before // max(plan.n_group, 1)
    for prefix, s in plan.selections.items():
        groups = [sum(1 for e in s.kept if e // per == g) for g in range(plan.n_group)]
        if (blocks[prefix].n_experts != n or s.kept != sorted(set(s.kept)) or len(s.kept) != k
                or not all(0 <= e < n for e in s.kept) or len(set(groups)) != 1 or sum(s.cluster_sizes) != n):
            raise CorruptCheckpoint(f"the workers' plan for {prefix} (kept {s.kept}) is not a valid choice of {k} "
                                    f"of its {blocks[prefix].n_experts} experts; rerun the workers")
    return plan
