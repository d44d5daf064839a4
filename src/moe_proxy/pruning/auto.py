"""`--experts auto --max-kl X`: the smallest expert count whose proxy has KL(original || proxy)
at most X (pruning/fidelity.py), with as few full builds as the figures allow (issue 31).

1. Screen: every candidate count is selected without fits (the plain selection, from the one
   set of one-pass statistics) and all are measured in one walk of the original
   (fidelity.measure_many). A build without fits (--no-reconstruct, no --heal or --merge) is
   exactly that plain proxy, so its answer is read off the screen: no full build at all.
2. With fits (the default reconstruction, --heal, --merge), a full build of a count fits its
   plain plan (expert_plan.fit_plan) and measures it: hours on a real model. The plain figure
   falls with the count, and fitting scales a count's figure by a factor that changes slowly
   with the count, so full builds go only where the answer can change (Search.run): first the
   smallest count whose plain figure meets X (or, when none does, the largest count: if even it
   misses, the target is refused, after one more build only where another count's plain figure
   is the best); then, below the smallest count known to meet X, the largest one that the plain
   figures scaled by the fit factors measured so far predict to miss it, then the count above
   the last one that missed, until a count that meets X sits right above one that misses. Two
   predictions that turn out wrong switch the search to halving the counts left. Where the
   plain figure rises with the count the notes say so: a smaller count may then meet X.
3. The chosen count's plan, fitted once, is the one the build writes (steps.prepare `planned`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Callable

from moe_proxy.pruning.fidelity import measure_many
from moe_proxy.errors import CalibrationError, FidelityTargetNotMet, InvalidExpertCount, InvalidOptions

log = logging.getLogger(__name__)
BASE = 3  # counts between the lowest and highest built ones before their fit factors' trend is extrapolated
SURPRISES = 2  # wrong predictions before the search falls back to halving


def check_auto(options, scale_out: bool) -> None:
    """Refuse what --experts auto cannot do, before anything is read."""
    if options.experts != "auto" or options.max_kl is None:
        raise InvalidOptions("--experts auto and --max-kl X go together: the build picks the smallest expert count "
                             "whose KL(original || proxy) per token is at most X")
    if not options.max_kl > 0:
        raise InvalidOptions(f"--max-kl {options.max_kl:g}: must be above 0 (only keeping every expert gives 0)")
    if not options.calibration:
        raise InvalidOptions("--experts auto needs --calibration STATS: the fidelity figure is measured on its tokens")
    if scale_out:
        raise InvalidOptions("--experts auto runs as a single build (it measures counts before writing); choose "
                             "the count with it, then give the workers --experts N")


def resolve_auto(source, options, max_experts: int | None, sizing, progress: bool = False):
    """`options` with the chosen count, and (its fidelity figure, notes saying what was tried,
    its ExpertPlan), for the opened `source` (prepared.OpenedSource). Counts: sizing.auto_counts within
    `max_experts`."""
    from moe_proxy.sizing import SizingOptions, auto_counts

    ckpt, layout, calibration = source.ckpt, source.layout, source.calibration
    if calibration.mode != "one-pass":  # made behind one proxy's pruned layers: that count only
        raise CalibrationError(f"--experts auto tries several expert counts, and {options.calibration} holds "
                               f"sequential statistics made for {calibration.summary['made_for']['experts']} "
                               f"experts only: calibrate without --experts (one-pass statistics, usable for any "
                               f"count), or build --experts {calibration.summary['made_for']['experts']}")
    budget = replace(sizing or SizingOptions(), experts=None, keep_ratio=None, top_k=options.top_k)
    counts = [c for c in auto_counts(ckpt.config, budget) if max_experts is None or c <= max_experts]
    count, figure, notes, plan = choose_experts(ckpt, layout, calibration, options, counts, progress)
    notes.append("one-pass statistics, as --experts auto needs (sequential ones are made for one count, known "
                 "before the build)")
    return replace(options, experts=count), (figure, notes, plan)


@dataclass
class Search:
    """The counts that can be built, their plain figures, and what the full builds measured."""

    counts: list[int]  # ascending
    plain: list[float]  # KL of each count's plain (unfitted) proxy
    max_kl: float
    full: dict[int, float] = field(default_factory=dict)  # index into counts -> KL of its full build
    surprises: int = 0  # full builds on the other side of the target than predicted
    halving: bool = False  # predictions failed: the counts left are halved

    def factor(self, i: int) -> float:
        """What fitting did to count i's figure (full / plain), in log space."""
        return math.log(max(self.full[i], 1e-300) / max(self.plain[i], 1e-300))

    def predicted(self, i: int) -> float:
        """Count i's full figure as predicted: its plain figure scaled by the fit factor of the
        built counts, interpolated in log over the index between the two around it; beyond them,
        along the line through the lowest and highest built counts (the widest base: neighbours'
        noise makes a wild slope), or constant while those are fewer than BASE counts apart."""
        built = sorted(self.full)
        if not built:
            return self.plain[i]
        below, above = [j for j in built if j <= i], [j for j in built if j >= i]
        a, b = (below[-1], above[0]) if below and above else (built[0], built[-1])
        if a == b or (not (below and above) and b - a < BASE):
            return self.plain[i] * math.exp(self.factor(below[-1] if below else above[0]))
        w = (i - a) / (b - a)
        return self.plain[i] * math.exp((1 - w) * self.factor(a) + w * self.factor(b))

    def first(self) -> int:
        """The first count to build: the smallest whose plain figure meets the target, else the largest."""
        return next((i for i, kl in enumerate(self.plain) if kl <= self.max_kl), len(self.counts) - 1)

    def rising(self) -> list[str]:
        """Where the plain figure rises with the count (the search assumes it falls)."""
        return [f"{a} -> {ka:.3g} below {b} -> {kb:.3g}" for a, ka, b, kb in
                zip(self.counts, self.plain, self.counts[1:], self.plain[1:]) if kb > ka]

    def probe_after(self, lo: int, hi: int | None) -> int:
        """The next count to build, the answer known to lie in (lo, hi] (hi None: above lo, if
        anywhere). Below a count that meets: the largest count predicted to miss (where the
        predicted figures cross the target from above), else the one right above lo. Building
        the side predicted to miss first makes a prediction too cautious show at once, instead
        of a walk down one count at a time."""
        if hi is None:
            top = len(self.counts) - 1
            if self.halving:
                return top
            return next((i for i in range(lo + 1, top) if self.predicted(i) <= self.max_kl), top)
        if self.halving:
            return (lo + hi) // 2
        return max((i for i in range(lo + 1, hi) if self.predicted(i) > self.max_kl), default=lo + 1)

    def run(self, build: Callable[[int], float]) -> int | None:
        """Full builds (`build(i)`: count i's fitted KL) until the answer is known: the index of
        the smallest count meeting the target, None when none does."""
        lo, hi, probe = -1, None, self.first()
        while True:
            expected = self.predicted(probe) <= self.max_kl
            informed = bool(self.full)  # the first build's prediction knows no fit factor yet
            self.full[probe] = kl = build(probe)
            if kl <= self.max_kl:
                hi = probe
            else:
                lo = probe
            if hi is None and len(self.counts) - 1 in self.full:  # even the largest count misses: refused,
                best = min(range(len(self.counts)), key=self.plain.__getitem__)  # unless the best plain one
                if best in self.full:  # (another count, where the figure does not fall) meets it
                    return None
                probe, lo = best, -1
                continue
            if hi is not None and hi - lo == 1:
                return hi
            self.surprises += informed and (kl <= self.max_kl) != expected
            self.halving |= self.surprises >= SURPRISES
            probe = self.probe_after(lo, hi)


def choose_experts(ckpt, layout, calibration, options, counts: list[int],
                   progress: bool = False) -> tuple[int, dict, list[str], object]:
    """The smallest of `counts` (ascending) whose proxy has KL <= options.max_kl, its fidelity
    figure, the notes saying what was screened and built, and its ExpertPlan (fitted once)."""
    from moe_proxy.pruning.expert_plan import fit_plan, plan_experts
    from moe_proxy.pruning.output_shards import output_tensors

    max_kl = options.max_kl
    if not counts:
        raise InvalidExpertCount("--experts auto: no expert count to try (valid counts above top-k and below all the "
                                 "experts, within the device budget and --max-experts)")
    plain_options = replace(options, keep_ratio=None, heal=False, merge=False, reconstruct=False)
    plans, impossible = {}, {}
    for count in counts:  # selection only: cheap
        try:
            plans[count] = plan_experts(ckpt, layout, replace(plain_options, experts=count), calibration=calibration)
        except (InvalidExpertCount, CalibrationError) as exc:  # e.g. fewer alive experts than the count
            impossible[count] = str(exc)
    buildable = list(plans)
    if not buildable:
        raise FidelityTargetNotMet(f"--experts auto: no expert count can be built: {_impossible(impossible)}")
    figures = measure_many(ckpt, layout, [(plans[c], output_tensors(ckpt, layout, plans[c])) for c in buildable],
                           calibration, progress)
    search = Search(buildable, [f["kl"] for f in figures], max_kl)
    rising = search.rising()
    screened = (f"screened {len(buildable)} counts without fits in one pass (plain KL "
                f"{', '.join(f'{c}: {kl:.3g}' for c, kl in zip(buildable, search.plain))})"
                + (f"; not possible: {_impossible(impossible)}" if impossible else ""))
    notes = [f"--experts auto --max-kl {max_kl:g}: {screened}"]
    if not options.fits:  # the plain proxies are the builds: read the answer off the screen
        meeting = [i for i, kl in enumerate(search.plain) if kl <= max_kl]
        if not meeting:
            best = min(range(len(buildable)), key=search.plain.__getitem__)
            raise FidelityTargetNotMet(f"--experts auto: no expert count reaches KL <= {max_kl:g} (best KL "
                                       f"{search.plain[best]:.4g} with {buildable[best]} experts); {screened}; raise "
                                       f"--max-kl or the device budget")
        chosen = meeting[0]
        notes.append(f"chose {buildable[chosen]}: no fits asked, so the screen's figures are the builds' (0 full "
                     f"builds)" + (f"; the plain figure rises with the count at {'; '.join(rising)}" if rising else ""))
        return buildable[chosen], figures[chosen], notes, plans[buildable[chosen]]
    if rising:
        notes.append(f"the plain figure rises with the count at {'; '.join(rising)}: the full builds follow it "
                     f"(predictions that fail twice switch the search to halving), and a count below one that "
                     f"misses the target is not tried, so a smaller count than the one chosen may meet it")
    return _search_full(ckpt, layout, calibration, options, search, plans, notes, progress, fit_plan)


def _search_full(ckpt, layout, calibration, options, search: Search, plans: dict, notes: list[str], progress,
                 fit_plan):
    """The full builds of the search (module docstring, step 2): the chosen count's figure and plan."""
    built: list[str] = []
    kept: dict[int, tuple[dict, object]] = {}  # the smallest count meeting the target so far: figure, plan

    def build(i: int) -> float:
        count = search.counts[i]
        plan = fit_plan(ckpt, layout, plans[count], options, calibration, progress)
        figure = plan.fidelity  # measured in the walk that fitted it (expert_plan.fit_plan)
        built.append(f"{count} -> kl {figure['kl']:.4g}")
        log.info("--experts auto: %d experts per layer fitted, KL %.4g (target %g)", count, figure["kl"],
                 search.max_kl)
        if figure["kl"] <= search.max_kl:  # a larger count's plan is freed (its spilled fits too)
            kept.clear()
            kept[i] = (figure, plan)
        return figure["kl"]

    chosen = search.run(build)
    if chosen is None:
        reached = min(search.full.items(), key=lambda item: item[1])
        raise FidelityTargetNotMet(f"--experts auto: no expert count reaches KL <= {search.max_kl:g} (best KL "
                                   f"{reached[1]:.4g} with {search.counts[reached[0]]} experts); full builds "
                                   f"{', '.join(built)}; {notes[0].split(': ', 1)[1]}; raise --max-kl or the device budget")
    notes.append(f"chose {search.counts[chosen]}; {len(built)} full build(s) with fits, in order: {', '.join(built)}")
    figure, plan = kept[chosen]
    return search.counts[chosen], figure, notes, plan


def _impossible(why: dict[int, str]) -> str:
    """The counts the statistics cannot serve, and the reason for the first of them."""
    return f"{', '.join(map(str, why))} (e.g. {next(iter(why))}: {next(iter(why.values()))})"
