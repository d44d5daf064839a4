"""`--experts auto --max-kl X`: the smallest expert count, within noise, whose proxy has KL(original || proxy)
at most X (pruning/fidelity.py), with at most 3 full builds (issues 31, 45).

1. Screen: every candidate count is selected without fits (the plain selection, from the one
   set of one-pass statistics) and all are measured in one walk of the original
   (fidelity.measure_many). A build without fits (--no-reconstruct, no --heal or --merge) is
   exactly that plain proxy, so its answer is read off the screen: no full build at all.
2. With fits (the default reconstruction, --heal, --merge), a full build of a count fits its
   plain plan (expert_plan.fit_plan) and measures it: hours on a real model. Fitting damps what
   the selection loses, by a factor that drifts with the count (on the lab's original 0.023 at 5
   experts, 0.08 at 25, 0.49 at 30), so a count's full figure is predicted from its plain one
   (smoothed over 5 counts, so that one count's selection noise is not read as the trend): the
   line, in log, of the full figure over the plain one through the built counts around it, or
   beyond them through the lowest and highest (Search.predicted); with one build, the plain
   figure times that build's factor. Every prediction has a noise margin (Search.margin): the
   plain figures' scatter around their smoothed curve (the same measure on the same tokens made
   them, and fitting only shrinks a selection's departures, so it bounds the full figures' noise
   from above), grown by the noise of the builds the line leans on, more so beyond them. The
   first build is the smallest count (the cheapest fits; a target above its figure is met by it,
   1 build). Each next build is the smallest count predicted to meet the target beyond its
   margin, among those between the largest count seen to miss and the smallest seen to meet it
   (where none is, the count right below the one that met, or the largest count). The search
   stops when a count that meets sits right above one that misses, or after BUDGET (3) full
   builds once one meets and no count between it and the largest miss is predicted to meet the
   target beyond its margin: the smallest count measured to meet the target is chosen, and the
   notes name the counts right below it left unbuilt with their predicted figures, and which of
   them were judged within noise of the target (Search.gap). Where the last build taught the
   trend that one of those meets beyond noise, the search goes on past the budget
   (Search.hopes). An unreachable target is refused once the largest count (and, where another
   count's plain figure is the best, that one) misses; the refusal names the counts predicted
   within noise of the target.

   The answer is the exhaustive one (building every count: the smallest that meets the target)
   where the figures follow a steady trend (the noise figure is then 0), and otherwise within
   noise: a smaller count than the chosen one may meet the target where (a) the full figure does
   not fall with the count, so that a count below one seen to miss meets it (where the plain
   figure rises, the notes say so), or (b) the search stopped with counts between the largest
   miss and the chosen count unbuilt, predicted to meet the target by less than their margin or
   to miss it. Either way the chosen count is measured to meet the target: the proxy is at worst
   larger than needed, never further from the original than asked.
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
SMOOTH = 2  # plain figures averaged (in log) on each side of a count: one count's selection noise is not the trend
BUDGET = 3  # full builds after which the smallest count measured to meet the target is chosen


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
    budget: int = BUDGET
    smooth: list[float] = field(init=False)  # log of each count's plain figure, smoothed (SMOOTH)
    noise: float = field(init=False)  # the plain figures' scatter around it (log, root mean square)

    def __post_init__(self):
        logs = [math.log(max(kl, 1e-300)) for kl in self.plain]
        n = len(logs)
        widths = [min(SMOOTH, i, n - 1 - i) for i in range(n)]  # a window centred on each count
        self.smooth = [sum(logs[i - w:i + w + 1]) / (2 * w + 1) for i, w in zip(range(n), widths)]
        # The noise figure of the full figures: the same measure on the same held-out tokens made
        # the plain ones, and fitting only shrinks a selection's departure from the trend, so the
        # plain figures' scatter bounds it from above. A window of n counts holds the count
        # itself, which hides 1/n of its departure: each square is scaled by n / (n - 1) (the
        # end counts, windows of 1, say nothing).
        squares = [(x - m) ** 2 * (2 * w + 1) / (2 * w) for x, m, w in zip(logs, self.smooth, widths) if w]
        self.noise = math.sqrt(sum(squares) / len(squares)) if squares else 0.0

    def base(self, i: int) -> tuple[int, int, float] | None:
        """The two built counts the line for count i goes through (those around it, or beyond
        them the lowest and highest: the widest base, as neighbours' noise makes a wild slope)
        and i's place on it, in smoothed log plain figure (0 at the first, 1 at the second, beyond
        them outside [0, 1]); None while fewer than two counts are built."""
        built = sorted(self.full)
        if len(built) < 2:
            return None
        below, above = [j for j in built if j < i], [j for j in built if j > i]
        a, b = (below[-1], above[0]) if below and above else (built[0], built[-1])
        span = self.smooth[b] - self.smooth[a]
        w = (self.smooth[i] - self.smooth[a]) / span if span else (i - a) / (b - a)
        # between two builds whose smoothed plain figures are out of order or close, w would be a
        # wild extrapolation: a count between them is taken to lie between them
        return a, b, min(1.0, max(0.0, w)) if below and above else w

    def predicted(self, i: int) -> float:
        """Count i's full figure as predicted: measured where built; else the line, in log, of the
        full figure over the plain one (smoothed: the mean log of the SMOOTH counts on either side
        and its own), through two built counts (Search.base): fitting damps what the selection
        loses as a power of it; with one build, the plain figure times that build's fit factor.
        A steady trend (plain figure and fit factor each exponential in the count's order) is
        predicted exactly once two counts are built."""
        if i in self.full:
            return self.full[i]
        if not self.full:
            return self.plain[i]
        if (line := self.base(i)) is None:
            j = next(iter(self.full))
            return math.exp(self.smooth[i] + math.log(max(self.full[j], 1e-300)) - self.smooth[j])
        a, b, w = line
        fa, fb = (math.log(max(self.full[j], 1e-300)) for j in (a, b))
        return math.exp(fa + w * (fb - fa))

    def margin(self, i: int) -> float:
        """How far (log) count i's measured figure may lie from its prediction by noise alone:
        its own noise, and that of the builds the prediction leans on (a line through two noisy
        points, whose error grows beyond them); 0 where built."""
        if i in self.full:
            return 0.0
        line = self.base(i)
        lean = 1.0 if line is None else (1 - line[2]) ** 2 + line[2] ** 2
        return self.noise * math.sqrt(1 + lean)

    def meets(self, i: int) -> bool:
        """Whether count i is predicted to meet the target by more than its noise margin."""
        return self.predicted(i) * math.exp(self.margin(i)) <= self.max_kl

    def within_noise(self, i: int) -> bool:
        """Whether count i is predicted within its noise margin of the target, either side: a
        build could measure it either side."""
        return abs(math.log(self.predicted(i) / self.max_kl)) < self.margin(i)

    def rising(self) -> list[str]:
        """Where the plain figure rises with the count (the search assumes it falls)."""
        return [f"{a} -> {ka:.3g} below {b} -> {kb:.3g}" for a, ka, b, kb in
                zip(self.counts, self.plain, self.counts[1:], self.plain[1:]) if kb > ka]

    def probe_after(self, lo: int, hi: int | None) -> int:
        """The next count to build, the answer known to lie in (lo, hi] (hi None: above lo, if
        anywhere): the smallest count predicted to meet the target beyond noise (Search.meets);
        where none is, the count right below hi (to see it miss), or the largest count."""
        end = len(self.counts) if hi is None else hi
        return next((i for i in range(lo + 1, end) if self.meets(i)), end - 1)

    def run(self, build: Callable[[int], float]) -> int | None:
        """Full builds (`build(i)`: count i's fitted KL) until the answer is known: the index of
        the smallest count meeting the target, None when none does. The first build is the
        smallest count (the cheapest fits); after `budget` builds, the smallest count measured
        to meet the target once no count below it down to the largest seen to miss is predicted
        to meet it beyond noise, whether or not the one right below it was built (gap())."""
        lo, hi, probe, top = -1, None, 0, len(self.counts) - 1
        while True:
            self.full[probe] = kl = build(probe)
            lo, hi = (lo, probe) if kl <= self.max_kl else (probe, hi)
            if hi is None and top in self.full:  # even the largest count misses: refused,
                best = min(range(len(self.counts)), key=self.plain.__getitem__)  # unless the best plain one
                if best in self.full:  # (another count, where the figure does not fall) meets it
                    return None
                probe, lo = best, -1
                continue
            if hi is not None and (hi - lo == 1 or len(self.full) >= self.budget and not self.hopes(lo, hi)):
                return hi
            probe = self.probe_after(lo, hi)

    def hopes(self, lo: int, hi: int) -> bool:
        """Whether a count between lo and hi is predicted to meet the target beyond noise (with
        what the last build taught: where it was not predicted, the budget does not stop the search)."""
        return any(self.meets(i) for i in range(lo + 1, hi))

    def gap(self, chosen: int) -> list[int]:
        """The counts right below the chosen one, down to the largest built one, that were not
        built (the budget ran out): the answer would be one of them if one met the target."""
        below = [j for j in self.full if j < chosen]
        return list(range(max(below, default=-1) + 1, chosen))


def choose_experts(ckpt, layout, calibration, options, counts: list[int],
                   progress: bool = False) -> tuple[int, dict, list[str], object]:
    """The smallest of `counts` (ascending) whose proxy has KL <= options.max_kl, its fidelity
    figure, the notes saying what was screened and built, and its ExpertPlan (fitted once)."""
    from moe_proxy.pruning.expert_plan import fit_plan

    max_kl = options.max_kl
    search, plans, figures, notes = screen(ckpt, layout, calibration, options, counts, progress)
    buildable, rising = search.counts, search.rising()
    if not options.fits:  # the plain proxies are the builds: read the answer off the screen
        meeting = [i for i, kl in enumerate(search.plain) if kl <= max_kl]
        if not meeting:
            best = min(range(len(buildable)), key=search.plain.__getitem__)
            raise FidelityTargetNotMet(f"--experts auto: no expert count reaches KL <= {max_kl:g} (best KL "
                                       f"{search.plain[best]:.4g} with {buildable[best]} experts); "
                                       f"{notes[0].split(': ', 1)[1]}; raise --max-kl or the device budget")
        chosen = meeting[0]
        notes.append(f"chose {buildable[chosen]}: no fits asked, so the screen's figures are the builds' (0 full "
                     f"builds)" + (f"; the plain figure rises with the count at {'; '.join(rising)}" if rising else ""))
        return buildable[chosen], figures[chosen], notes, plans[buildable[chosen]]
    if rising:
        notes.append(f"the plain figure rises with the count at {'; '.join(rising)}: where the full figure does "
                     f"too, a count below one seen to miss may meet the target (only the chosen count and those "
                     f"built are measured)")
    return _search_full(ckpt, layout, calibration, options, search, plans, notes, progress, fit_plan)


def screen(ckpt, layout, calibration, options, counts: list[int],
           progress: bool = False) -> tuple[Search, dict, list[dict], list[str]]:
    """Step 1: every count of `counts` (ascending) selected without fits and measured in one walk.
    Returns the Search over the counts that can be built, their plain plans by count, their
    figures and the first note (what was screened)."""
    from moe_proxy.pruning.expert_plan import plan_experts
    from moe_proxy.pruning.output_shards import output_tensors

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
    search = Search(buildable, [f["kl"] for f in figures], options.max_kl)
    screened = (f"screened {len(buildable)} counts without fits in one pass (plain KL "
                f"{', '.join(f'{c}: {kl:.3g}' for c, kl in zip(buildable, search.plain))})"
                + (f"; not possible: {_impossible(impossible)}" if impossible else ""))
    return search, plans, figures, [f"--experts auto --max-kl {options.max_kl:g}: {screened}"]


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
                                   f"{', '.join(built)}{_within_note(search, range(len(search.counts)))}; "
                                   f"{notes[0].split(': ', 1)[1]}; raise --max-kl or the device budget")
    notes.append(f"chose {search.counts[chosen]}; {len(built)} full build(s) with fits, in order: {', '.join(built)}")
    if gap := search.gap(chosen):
        notes.append(_gap_note(search, chosen, gap))
    figure, plan = kept[chosen]
    return search.counts[chosen], figure, notes, plan


def _gap_note(search: Search, chosen: int, gap: list[int]) -> str:
    """What the budget left unbuilt below the chosen count, what the fit factor's trend predicts
    there, and which of those counts it judged within noise of the target."""
    counts, below = search.counts, gap[0] - 1
    missed = f"{counts[below]} missed it" if below >= 0 else "no smaller count was built"
    return (f"after {len(search.full)} full builds the smallest count measured to meet the target was chosen; "
            f"{missed}, and {', '.join(str(counts[i]) for i in gap)} between were not built (predicted KL "
            f"{', '.join(f'{search.predicted(i):.3g}' for i in gap)} from the fit factor's trend, none meeting "
            f"it beyond noise: the plain figures' scatter is {search.noise:.2g} in log){_within_note(search, gap)}: "
            f"if one of them met it, it would have been the answer")


def _within_note(search: Search, indices) -> str:
    """The unbuilt counts among `indices` whose predicted figure lies within its noise margin of the
    target (a build could measure it either side), with that figure and margin."""
    within = [i for i in indices if i not in search.full and search.within_noise(i)]
    named = (f"{search.counts[i]} (predicted KL {search.predicted(i):.3g}, noise x{math.exp(search.margin(i)):.2f})"
             for i in within)
    return f"; judged within noise of the target: {', '.join(named)}" if within else ""


def _impossible(why: dict[int, str]) -> str:
    """The counts the statistics cannot serve, and the reason for the first of them."""
    return f"{', '.join(map(str, why))} (e.g. {next(iter(why))}: {next(iter(why.values()))})"
