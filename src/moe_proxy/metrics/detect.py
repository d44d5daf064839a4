"""Failure detection on the per-step metrics: the first step of overflow, NaN/inf, divergence
and routing collapse, plus user thresholds (`actor/grad_norm>100:3`).

It reads nothing but the metric rows, so `compare` runs the same detector over any
metrics.jsonl (including runs recorded elsewhere) and gets the same onsets as `repro`.

Definitions (thresholds in `Thresholds`):
- nan: the loss or the updated parameters are not finite (the forward pass or an update broke), or
  in an fp32 step a hidden state is (fp32 does not overflow: an op broke).
- overflow: in a half-precision step (`numerics/half_precision`) the forward pass's hidden
  states are not finite (`numerics/nonfinite_activations`): a value went beyond the dtype's
  range, e.g. a super expert's massive activation in fp16. Loss scaling cannot help; detected
  at once, besides the nan it causes. Or: gradients hold inf/NaN while the loss was finite
  (`numerics/grad_overflow`, or the grad norm not finite: TRL, verl and Megatron log no count,
  and a NaN grad norm is the same finding from every reader, never a value skipped).
  Without loss scaling such a step is lost: detected at once. With dynamic loss scaling
  skipped steps are normal while the scale settles, so it is an overflow only after
  `overflow_patience` skipped steps in a row or when the scale falls below `min_loss_scale`
  (Megatron's hysteresis / min_scale).
- divergence: a watched magnitude (`DIVERGENCE_METRICS`) at least `divergence_factor` times its
  median over the first `baseline_steps` steps, for `divergence_patience` steps in a row, or the
  per-token KL to the reference above `kl_limit` (half a nat: the policy no longer resembles
  the reference) for as long. The onset is the first step of that run.
  Faults injected before `baseline_steps` are part of the baseline and cannot be seen this way.
- underflow: in a half-precision step, more than `underflow_frac` of the dense weights' gradient
  elements are exactly 0. Every token contributes to a dense weight's gradient, so in bf16 hardly
  any is 0; zeros are values below fp16's smallest subnormal (6e-8) flushed away, the sign of
  fp16 without loss scaling. How many flush depends on the gradients' size (tokens per batch,
  model width). An fp32 step is never judged: its rare exact zeros are cancellations, as are a
  half-precision step's up to `underflow_frac`.
- collapse: a layer's busiest expert is at least `collapse_excess` of the way from uniform routing
  to being in every token's top-k (`moe/load_max_excess/layer_N`, scale-free: uniform routing gives
  0 whatever the expert count), for `collapse_patience` steps in a row, in a layer where it was not
  in the baseline steps (a layer that routes the task's narrow data to one expert from the start is
  in its normal state, not a failure of the run; the other layers are still judged). Logs with raw
  shares only (`moe/load_max_share`, other frameworks' probes) are judged as before: one expert
  receives at least `collapse_share` of a layer's tokens, unless uniform routing (top_k / experts)
  already gives that. With experts <= top_k every token uses every expert: no collapse can show,
  and `cannot_show` says so rather than the run passing as clean.
- mismatch: the rollout engine's probabilities and the trainer's have come apart, for
  `mismatch_patience` steps in a row: the mismatch KL (`training/rollout_kl`, k3 of
  KL(rollout || trainer) per token) above `mismatch_kl`, or the Pearson correlation of their token
  probabilities (`training/rollout_actor_probs_pearson_corr`) below `mismatch_min_corr`, or more
  than `mismatch_is_share` of the importance weights trainer/rollout outside
  [1/threshold, threshold] (`rollout_corr/rollout_is_ratio_fraction_high` + `_low`, the run's
  --rollout-is-threshold). Healthy, as the field reports it: a mismatch KL of 1e-3 to 2e-3 on
  Qwen3-30B-A3B with a bf16 vLLM rollout (2e-4 to 5e-4 with routing replay, prime-rl #2808), a
  correlation near 1 (verl #5392 reports 0.6 on a run that failed); the defaults sit 5x to 10x
  past healthy.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import asdict, dataclass, field

from moe_proxy.errors import InvalidReproConfig
from moe_proxy.options import option

SIGNATURES = ("overflow", "underflow", "nan", "divergence", "collapse", "mismatch")
# What --fail-on takes, as every command's help, its error and the README say it.
FAIL_ON_CHOICES = f"{', '.join(SIGNATURES)}, or METRIC>VALUE[:STEPS]"


@dataclass
class FailOnOption:
    """--fail-on, the one flag that names a failure (repro, watch, diagnose, bisect), declared
    once; Signature.parse reads it."""

    fail_on: str | None = option(None, "str", f"stop once this failure is seen: {FAIL_ON_CHOICES} (e.g. "
                                 "actor/grad_norm>100:3)", metavar="SIGNATURE", cli_only="spec.reproduction.failOn")


DIVERGENCE_METRICS = ("actor/grad_norm", "moe/router_logit_max", "numerics/max_activation")
LAYER_SHARE = "moe/load_max_share/layer_"  # + N: one layer's busiest expert's share of its tokens
EXCESS = "moe/load_max_excess"  # the same on a scale from uniform (0) to collapse (1); routers.load_max_excess
LAYER_EXCESS = EXCESS + "/layer_"
UNIFORM = "moe/load_uniform_share"  # top_k / experts: >= 1 when every token uses every expert
BASELINE_METRICS = DIVERGENCE_METRICS + ("moe/load_max_share", EXCESS)
NAN_METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy")
_THRESHOLD = re.compile(r"^(?P<metric>[\w/.\-]+)\s*(?P<op>[<>])\s*(?P<value>[-+0-9.eEinfINF]+)(?::(?P<k>\d+))?$")


@dataclass
class Thresholds:
    divergence_factor: float = 10.0
    divergence_patience: int = 2
    baseline_steps: int = 3
    kl_limit: float = 0.5
    overflow_patience: int = 3
    min_loss_scale: float = 1.0
    collapse_share: float = 0.9  # raw share, for logs without moe/load_max_excess
    # On a 64-expert top-4 original (uniform share 1/16) 0.9 of the way is a raw share of 0.906:
    # the raw bar, within a point; a proxy keeping fewer experts meets it only when its busiest
    # expert is as far from uniform, not for having few experts (4 kept under top-2: raw >= 0.5).
    collapse_excess: float = 0.9
    collapse_patience: int = 2
    # Above the exact cancellations any run has (2.2e-6 of the dense elements on the fidelity lab's
    # model, in fp32 and in fp16 with loss scaling alike); fp16 without loss scaling flushed 1.1e-5
    # (lm head in fp32) to 1.3e-2 of them there (docs/fidelity.md).
    underflow_frac: float = 5e-6
    mismatch_kl: float = 0.01
    mismatch_min_corr: float = 0.9
    mismatch_is_share: float = 0.05
    mismatch_patience: int = 2


@dataclass
class Signature:
    """What --fail-on names: a built-in failure, or `metric>value[:steps]` (also `<`)."""

    name: str
    metric: str | None = None
    op: str = ">"
    value: float = 0.0
    patience: int = 1

    @classmethod
    def parse(cls, text: str) -> Signature:
        text = text.strip()
        if text in SIGNATURES:
            return cls(name=text)
        match = _THRESHOLD.match(text)
        if not match:
            raise InvalidReproConfig(
                f"--fail-on {text!r}: expected {FAIL_ON_CHOICES}, e.g. actor/grad_norm>100:3")
        try:
            value = float(match["value"])
        except ValueError:
            raise InvalidReproConfig(f"--fail-on {text!r}: {match['value']!r} is not a number") from None
        patience = int(match["k"] or 1)
        if patience < 1:
            raise InvalidReproConfig(f"--fail-on {text!r}: the step count must be at least 1")
        return cls(name=text, metric=match["metric"], op=match["op"], value=value, patience=patience)


@dataclass
class Onset:
    step: int  # the first step of the streak: where the failure began
    detail: str  # the values that completed the detection, those of step `seen`
    seen: int | None = None  # the step the detection completed at (= step when patience is 1)

    def line(self, name: str) -> str:
        """'step 3: divergence detected (...)', each figure with the step it belongs to."""
        at = "" if self.seen in (None, self.step) else f"at step {self.seen}: "
        return f"step {self.step}: {name} detected ({at}{self.detail})"


@dataclass
class FailureDetector:
    thresholds: Thresholds = field(default_factory=Thresholds)
    extra: list[Signature] = field(default_factory=list)  # user thresholds, watched besides the built-ins
    onsets: dict[str, Onset] = field(default_factory=dict)
    # signature -> why these rows cannot show it (a model whose experts <= top_k cannot collapse)
    cannot_show: dict[str, str] = field(default_factory=dict)
    _baseline: dict[str, list[float]] = field(default_factory=dict)
    _streaks: dict[str, list[int]] = field(default_factory=dict)  # signature -> steps of the current run
    _steps_seen: int = 0

    def update(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Feed one step's metrics; returns the signatures whose onset was found now."""
        found = []
        for name, (hit, detail, patience) in self._checks(metrics).items():
            if name in self.onsets:
                continue
            streak = self._streaks.setdefault(name, [])
            if not hit:
                streak.clear()
                continue
            streak.append(step)
            if len(streak) >= patience:
                self.onsets[name] = Onset(step=streak[0], detail=detail, seen=step)
                found.append(name)
        self._note_cannot_show(metrics)
        self._record_baseline(metrics)
        self._steps_seen += 1
        return found

    def holds(self, name: str, metrics: dict[str, float]) -> bool:
        """Whether signature `name`'s per-step test holds on one step's metrics, its patience aside,
        with the run's baseline as it stands (what `update` streaks; False for a name not watched):
        how a step after a detection is judged (the operator's recovery rule)."""
        hit = self._checks(metrics).get(name)
        return bool(hit and hit[0])

    def first(self) -> tuple[str, Onset] | None:
        if not self.onsets:
            return None
        return min(self.onsets.items(), key=lambda item: item[1].step)

    def _checks(self, m: dict[str, float]) -> dict[str, tuple[bool, str, int]]:
        t = self.thresholds
        checks: dict[str, tuple[bool, str, int]] = {}

        bad = [k for k in NAN_METRICS if k in m and not _finite(m[k])]
        if m.get("numerics/params_nonfinite", 0) > 0:
            bad.append("numerics/params_nonfinite")
        if m.get("numerics/nonfinite_activations", 0) > 0 and m.get("numerics/half_precision", 0) == 0:
            # fp32 cannot overflow a hidden state: a broken op made it, which a framework's loss may hide
            # (TRL drops NaN metrics, transformers' logging_nan_inf_filter averages a NaN loss away).
            bad.append("numerics/nonfinite_activations")
        checks["nan"] = (bool(bad), f"not finite: {', '.join(bad)}", 1)

        grads_bad = _grads_nonfinite(m) and not bad
        scale = m.get("numerics/loss_scale")
        bad_acts = m.get("numerics/nonfinite_activations", 0)
        if bad_acts > 0 and m.get("numerics/half_precision", 0) > 0:
            # Reported although the loss is NaN too: the overflow is the cause. (In fp32 a non-finite
            # activation is a NaN from a broken op, not a range problem: nan alone.)
            checks["overflow"] = (True, f"{bad_acts:g} hidden-state values not finite in half precision "
                                        "(forward overflow)", 1)
        elif scale is None:  # no loss scaling: a lost step is an overflow at once
            checks["overflow"] = (grads_bad, f"non-finite gradients without loss scaling{_norm_note(m)}", 1)
        elif scale < t.min_loss_scale:
            checks["overflow"] = (True, f"loss scale {scale:g} < {t.min_loss_scale:g}", 1)
        else:
            checks["overflow"] = (grads_bad, f"{t.overflow_patience} skipped steps in a row", t.overflow_patience)

        # Only a half-precision step can underflow: an fp32 gradient that is exactly 0 is exact
        # cancellation (seen: 2.2e-6 of a clean fp32 run's elements, docs/fidelity.md), not a flush.
        zero_frac = m.get("numerics/dense_grad_zero_frac", 0.0)
        half = m.get("numerics/half_precision", 1.0) > 0  # rows without the flag (older runs) as before
        checks["underflow"] = (half and zero_frac > t.underflow_frac, f"{zero_frac:.2g} of dense gradients are 0", 1)

        diverged = []
        if self._steps_seen >= t.baseline_steps:
            for key in DIVERGENCE_METRICS:
                base = statistics.median(self._baseline.get(key) or [math.nan])
                value = m.get(key)
                if _finite(value) and _finite(base) and base > 0 and value >= t.divergence_factor * base:
                    diverged.append(f"{key} {value:.4g} >= {t.divergence_factor:g} x baseline {base:.4g}")
        kl = m.get("actor/kl_loss")
        if kl is not None and _finite(kl) and kl > t.kl_limit:
            diverged.append(f"actor/kl_loss {kl:.4g} > {t.kl_limit:g}")
        checks["divergence"] = (bool(diverged), "; ".join(diverged), t.divergence_patience)

        checks["collapse"] = self._collapse(m)

        checks["mismatch"] = self._mismatch(m)

        for sig in self.extra:
            value = m.get(sig.metric)
            hit = value is not None and (value > sig.value if sig.op == ">" else value < sig.value)
            if value is not None and not _finite(value):
                hit = True  # a metric gone non-finite is past any threshold
            checks[sig.name] = (hit, f"{sig.metric}={value}", sig.patience)
        return checks

    def _collapse(self, m: dict[str, float]) -> tuple[bool, str, int]:
        """Layer by layer (`moe/load_max_excess/layer_N`, else `moe/load_max_share/layer_N`; the
        busiest layer's figure where a reader has no per-layer loads): a layer already past the
        threshold in the baseline steps is skipped, the others still judged. Judging only the
        busiest layer missed every collapse of a model with one such layer: a 25% or 12.5% proxy
        of a top-4 model, whose last layers put one expert in every token's top-4 from step 0
        (docs/fidelity.md, issue 29)."""
        t = self.thresholds
        if self._steps_seen < t.baseline_steps or m.get(UNIFORM, 0.0) >= 1.0:
            return False, "", t.collapse_patience
        shares = {k: v for k, v in m.items() if k.startswith(LAYER_EXCESS) and _finite(v)}
        if not shares and _finite(m.get(EXCESS)):
            shares = {EXCESS: m[EXCESS]}
        limit = t.collapse_excess
        if not shares:  # raw shares only: judged unless uniform routing already passes the bar
            if m.get(UNIFORM, 0.0) >= t.collapse_share:
                return False, "", t.collapse_patience
            limit = t.collapse_share
            shares = {k: v for k, v in m.items() if k.startswith(LAYER_SHARE) and _finite(v)}
            if not shares and _finite(m.get("moe/load_max_share")):
                shares = {"moe/load_max_share": m["moe/load_max_share"]}
        hit = [(v, k) for k, v in shares.items() if v >= limit
               and statistics.median(self._baseline.get(k) or [1.0]) < limit]
        if not hit:
            return False, "", t.collapse_patience
        value, key = max(hit)
        where = f"layer {key.rsplit('_', 1)[1]}'s" if "/layer_" in key else "a layer's"
        if key.startswith(EXCESS):
            return True, (f"{where} busiest expert is {value:.3g} of the way from uniform routing to every "
                          f"token's top-k ({key})"), t.collapse_patience
        return True, f"one expert takes {value:.3g} of {where} tokens", t.collapse_patience

    def _note_cannot_show(self, m: dict[str, float]) -> None:
        """A model with experts <= top_k (moe/load_uniform_share >= 1) routes every token to every
        expert: collapse, and a threshold on an expert-load metric, cannot show on it. Said once
        (`cannot_show`), so that a run that did not collapse is not read as one that was cured."""
        uniform = m.get(UNIFORM)
        if not _finite(uniform) or uniform < 1.0:
            return
        why = (f"experts <= top-k ({UNIFORM} {uniform:g}): every token uses every expert, so no "
               "expert can take more tokens than another")
        self.cannot_show.setdefault("collapse", why)
        for sig in self.extra:
            if sig.metric and sig.metric.startswith("moe/load_"):
                self.cannot_show.setdefault(sig.name, why)

    def _mismatch(self, m: dict[str, float]) -> tuple[bool, str, int]:
        t = self.thresholds
        kl, corr = m.get("training/rollout_kl"), m.get("training/rollout_actor_probs_pearson_corr")
        past = [m[k] for k in ("rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/rollout_is_ratio_fraction_low")
                if k in m]
        why = []
        if kl is not None and (not _finite(kl) or kl > t.mismatch_kl):
            why.append(f"rollout/trainer KL {kl:.3g} > {t.mismatch_kl:g}")
        if corr is not None and (not _finite(corr) or corr < t.mismatch_min_corr):
            why.append(f"probs correlation {corr:.3g} < {t.mismatch_min_corr:g}")
        if past and sum(past) > t.mismatch_is_share:
            why.append(f"{sum(past):.3g} of IS weights past the threshold (> {t.mismatch_is_share:g})")
        return bool(why), "; ".join(why), t.mismatch_patience

    def _record_baseline(self, m: dict[str, float]) -> None:
        for key in (*BASELINE_METRICS, *(k for k in m if k.startswith((LAYER_SHARE, LAYER_EXCESS)))):
            values = self._baseline.setdefault(key, [])
            if len(values) < self.thresholds.baseline_steps and key in m and _finite(m[key]):
                values.append(m[key])

    def to_dict(self) -> dict:
        return {name: asdict(onset) for name, onset in sorted(self.onsets.items(), key=lambda i: i[1].step)}


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _grads_nonfinite(m: dict[str, float]) -> bool:
    """Whether the step's gradients held inf/NaN: repro's count, or a grad norm that is not finite
    (what a framework without the count shows; the divergence check, which needs a finite value,
    skipped it and a NaN grad norm went unreported)."""
    norm = m.get("actor/grad_norm")
    return m.get("numerics/grad_overflow", 0) > 0 or (norm is not None and not _finite(norm))


def _norm_note(m: dict[str, float]) -> str:
    norm = m.get("actor/grad_norm")
    return f" (actor/grad_norm {norm})" if norm is not None and not _finite(norm) else ""
