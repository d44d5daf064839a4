"""Resource planning: how many accelerators an RL step needs, for the original and for a proxy.

From a checkpoint's config.json alone (no weights, no torch) it counts parameters (total and
active per token, params.config_params) of the original and of the proxy, estimates RL-training memory, and finds
the smallest whole number of nodes that holds each. The operator uses it to size the
reproduction Job (`devices: auto`); `moe-proxy plan` prints it.

The memory model, stated so that it can be checked by hand (bytes per parameter P):
- policy weights `w` bytes (bf16: 2, fp16: 2, fp32: 4), gradients `w` bytes,
- Adam: fp32 master copy + two moments = 12 bytes (4 + 4 + 4) when w < 4, else 8,
- frozen reference policy for the KL term: `w` bytes (`reference=True`),
all sharded across devices (ZeRO-3 / FSDP); plus, on every device, activations of one
micro-batch with full activation checkpointing, as RL frameworks run MoE models: each layer's
input (H * w bytes per token per layer) plus one layer's working set while it is recomputed
(Korthikanti et al. 2022: 34 * H bytes per token at 16-bit, and top_k * 3 * I * w bytes of
routed-expert intermediates), plus a fixed runtime reserve per device. A device is usable up to `utilization` of
its memory.

Kept experts: with a keep ratio (not an explicit count), the planner prefers at least
2 x top-k kept experts when the ratio gives fewer, if that fits the device budget (by default
the devices the ratio's proxy needs anyway, i.e. no extra node): with kept <= top-k every
token uses every kept expert, so load imbalance and routing collapse cannot show. An explicit
expert count is kept as given. Either way the plan's `notes` say what was decided and why.

Step time, for the device-hours ratio: the phases of one RL step (rollout prefill and decode,
old-log-prob and reference passes, training, optimizer, weight sync, expert-parallel
all-to-all), each timed on the side's devices by step_cost.py, whose docstring states the
model; device-hours per step = devices * the phases' sum.

What a run cost (run_device_hours, RUN_COST_RULE): one rule for bisect's and triage's reports
and the operator's Diagnosis probes: the steps the run completed (one stopped at its failure
costs the steps it ran, not those planned) x the proxy's device-hours per step planned at the
precision it ran at.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Callable

from moe_proxy.architectures import Arch, detect, expert_count, groups, top_k
from moe_proxy.errors import InvalidExpertCount, InvalidOptions
from moe_proxy.step_cost import Accelerator, ModelShape, Phases, StepShape, phases
from moe_proxy.checkpoint.params import Params, config_int, config_params, expert_width, moe_layer_indices, text_config

GIB = 1 << 30
GB = 10**9


# Known accelerators (sources: docs/performance.md); memory is overridable per plan. Kubernetes
# resource names first; product names select the same or another device. Unknown names use the
# Ascend figures. Links: per device, one direction.
ASCEND_910B = Accelerator("huawei.com/Ascend910", 64, 313, 1.6, 196, 25, "Ascend 910B")
H100 = Accelerator("nvidia.com/gpu", 80, 989, 3.35, 450, 50, "H100 SXM")
H200 = Accelerator("nvidia.com/gpu", 141, 989, 4.8, 450, 50, "H200 SXM")
ACCELERATORS: dict[str, Accelerator] = {
    "huawei.com/Ascend910": ASCEND_910B,
    "huawei.com/npu": replace(ASCEND_910B, resource="huawei.com/npu"),
    "nvidia.com/gpu": H100,
    "Ascend910B": ASCEND_910B,
    "H100": H100,
    "H200": H200,
}

BYTES_PER_PARAM = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class SizingOptions:
    experts: int | None = None  # routed experts per layer to keep ...
    keep_ratio: float | None = None  # ... or the fraction to keep
    top_k: int | None = None  # the proxy's top-k (default: the original's, capped at experts)
    precision: str = "bf16"
    accelerator: str = "huawei.com/Ascend910"
    device_memory_gb: float | None = None  # default: the accelerator's
    devices_per_node: int = 8
    micro_batch_tokens: int = 4096  # tokens per device per micro-batch
    workload: StepShape = StepShape()  # the RL step's shape, for its time (step_cost.py)
    reference: bool = True  # a frozen reference policy is resident (KL term)
    # a separate rollout weight copy, resident beside the policy and sharded like it, in this
    # precision (repro's --rollout-precision, or the training precision with --rollout-kernels)
    rollout_copy: str | None = None
    # repro's --rollout-staleness N keeps N + 1 snapshots of the policy's weights (in the training
    # precision, sharded like it) to sync the copy from: this many
    rollout_snapshots: int = 0
    utilization: float = 0.9  # usable fraction of device memory
    reserve_gb: float = 4.0  # runtime, communication buffers, fragmentation, per device
    max_devices: int | None = None  # the proxy's device budget (default: what the keep ratio's proxy needs)


def rollout_copy(precision: str, rollout_precision: str | None, rollout_kernels: str | None,
                 staleness: int = 0) -> str | None:
    """The precision of the rollout engine's own weight copy, as repro makes it: its
    --rollout-precision, else the training precision when only --rollout-kernels or
    --rollout-staleness asks for a copy; None: no copy (the rollout is the policy itself)."""
    return rollout_precision or (precision if rollout_kernels or staleness else None)


def rollout_snapshots(staleness: int) -> int:
    """The policy snapshots repro keeps for --rollout-staleness N (rollout.RolloutEngine.sync)."""
    return staleness + 1 if staleness else 0


@dataclass(frozen=True)
class Memory:
    weights: int  # bytes, all devices together
    gradients: int
    optimizer: int
    reference: int
    activations_per_device: int  # bytes on every device
    rollout: int = 0  # the rollout engine's own weight copy and its snapshots (SizingOptions.rollout_*)

    @property
    def static(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.reference + self.rollout


@dataclass(frozen=True)
class Side:
    """One model (the original or the proxy) planned on the accelerator."""

    experts_per_layer: int
    top_k: int
    params: Params
    memory: Memory
    devices: int  # smallest whole-node count that holds it
    nodes: int
    phases: Phases  # seconds per RL step, by phase (step_cost.py)

    @property
    def step_seconds(self) -> float:
        return self.phases.total

    @property
    def device_hours_per_step(self) -> float:
        return self.devices * self.step_seconds / 3600

    def device_hours(self) -> dict[str, float]:
        """Device-hours per RL step, by phase."""
        return {name: self.devices * seconds / 3600 for name, seconds in self.phases.items()}


@dataclass(frozen=True)
class Sizing:
    architecture: str
    moe_layers: int
    precision: str
    accelerator: str
    device_memory_gb: float
    devices_per_node: int
    original: Side
    proxy: Side
    workload: StepShape = StepShape()  # the RL step timed
    notes: tuple[str, ...] = ()  # decisions a person should see (kept experts raised or not, and why)
    rollout_copy: str | None = None  # SizingOptions.rollout_copy
    rollout_snapshots: int = 0  # SizingOptions.rollout_snapshots

    @property
    def device_reduction(self) -> float:
        """Fraction of devices saved, e.g. 0.875 for 64 -> 8."""
        return 1 - self.proxy.devices / self.original.devices

    @property
    def device_hours_ratio(self) -> float:
        """Proxy device-hours per RL step over the original's."""
        return self.proxy.device_hours_per_step / self.original.device_hours_per_step

    def summary(self) -> dict:
        """A JSON-ready dict (the ProxyModel status keeps this)."""
        out = asdict(self)
        out["device_reduction"] = round(self.device_reduction, 4)
        out["device_hours_ratio"] = round(self.device_hours_ratio, 4)
        out["device_hours_per_step"] = self.phase_table()
        return out

    def phase_table(self) -> dict[str, dict[str, float | None]]:
        """Device-hours per RL step by phase (and "total"): original, proxy, proxy/original."""
        o, x = self.original.device_hours(), self.proxy.device_hours()
        o["total"], x["total"] = self.original.device_hours_per_step, self.proxy.device_hours_per_step
        return {name: {"original": o[name], "proxy": x[name], "ratio": x[name] / o[name] if o[name] else None}
                for name in o}


# What a run cost: said in every report that prices runs (bisect, triage, a Diagnosis's status).
RUN_COST_RULE = ("moe-proxy plan's model: the proxy's devices x its RL step's time at the run's precision, x the "
                 "steps each run completed (a run stopped at its failure costs the steps it ran); builds not counted")


def run_device_hours(per_step: float, steps_completed: int) -> float:
    """What one run cost by RUN_COST_RULE: `per_step`, the proxy's device-hours per RL step as
    plan prices it at the precision the run ran at (Sizing.proxy.device_hours_per_step; the
    operator's status.plan.deviceHoursPerStep.total.proxy), x the steps it completed."""
    if not (per_step >= 0 and math.isfinite(per_step)):
        raise InvalidOptions(f"device-hours per step {per_step!r}: a finite number, 0 or more")
    if isinstance(steps_completed, bool) or not isinstance(steps_completed, int) or steps_completed < 0:
        raise InvalidOptions(f"steps completed {steps_completed!r}: a whole number, 0 or more")
    return per_step * steps_completed


# --- the expert target ---------------------------------------------------------------------


def ratio_experts(n: int, arch: Arch, n_group: int, keep_ratio: float) -> tuple[int, list[str]]:
    """A keep ratio's first count: n x ratio rounded to whole routing groups, at least
    `min_per_group` in each; notes say when that is not n x ratio or keeps everything."""
    if not 0 < keep_ratio <= 1:
        raise InvalidExpertCount(f"keep ratio must be in (0, 1], got {keep_ratio}")
    exact = n * keep_ratio
    experts = max(n_group * arch.min_per_group, round(exact / n_group) * n_group)
    notes = []
    if experts == n:
        notes.append(f"keep ratio {keep_ratio:g} keeps all {n} experts: the proxy is a copy of the original's "
                     f"experts (nothing pruned)")
    elif experts != exact:
        unit = (f"the same number in each of the {n_group} routing groups, at least {arch.min_per_group}"
                if n_group > 1 else f"rounded, at least {arch.min_per_group}")
        notes.append(f"keep ratio {keep_ratio:g} of {n} experts is {exact:g}: {experts} kept ({unit})")
    return experts, notes


def target_experts(n: int, arch: Arch, n_group: int, experts: int | None, keep_ratio: float | None) -> int:
    """The routed experts per layer to keep, validated; errors suggest valid values."""
    if (experts is None) == (keep_ratio is None):
        raise InvalidOptions("give exactly one of experts per layer or a keep ratio")
    if keep_ratio is not None:
        experts, _ = ratio_experts(n, arch, n_group, keep_ratio)
    assert experts is not None
    valid = list(range(n_group * arch.min_per_group, n + 1, n_group))
    if experts < 1 or experts > n or experts % n_group or experts // n_group < arch.min_per_group:
        why = (
            f"the model has {n} routed experts per layer" if experts < 1 or experts > n
            else f"grouped routing has {n_group} groups (each must keep the same number, at least "
                 f"{arch.min_per_group})"
        )
        shown = ", ".join(map(str, valid[:12])) + (" ..." if len(valid) > 12 else "")
        raise InvalidExpertCount(f"cannot keep {experts} experts per layer: {why}; valid values: {shown}")
    return experts


def preferred_experts(n: int, arch: Arch, n_group: int, k: int) -> int | None:
    """The smallest valid kept-expert count of at least 2 x top-k that still prunes (< n); the
    largest valid count under n if 2 x top-k does not prune; None if no valid count exceeds k."""
    valid = [e for e in range(n_group * arch.min_per_group, n, n_group) if e > k]
    return next((e for e in valid if e >= 2 * k), valid[-1] if valid else None)


def auto_counts(config: dict, opts: SizingOptions) -> list[int]:
    """The kept-expert counts `build --experts auto` may choose, ascending: valid for the routing
    groups, more than top-k (the proxy's, `opts.top_k`, else the original's), fewer than all the
    experts, and, with `opts.max_devices`, within that device budget."""
    c = text_config(config)
    arch = detect(c)
    n, k = expert_count(arch, c), opts.top_k or top_k(arch, c)
    n_group, _ = groups(arch, c)
    counts = [e for e in range(n_group * arch.min_per_group, n, n_group) if e > k]
    if opts.max_devices is None:
        return counts
    return [e for e in counts if estimate(config, replace(opts, experts=e, keep_ratio=None)).proxy.devices
            <= opts.max_devices]


def auto_plan(config: dict, opts: SizingOptions) -> Sizing:
    """The plan of `--experts auto`: sized for the largest count the build may choose (see
    auto_counts), so the devices hold whichever it picks; its notes say so."""
    counts = auto_counts(config, opts)
    if not counts:
        budget = f" within the device budget of {opts.max_devices}" if opts.max_devices is not None else ""
        raise InvalidExpertCount(f"experts auto: no valid expert count above top-k and below all the experts{budget}")
    plan = estimate(config, replace(opts, experts=counts[-1], keep_ratio=None))
    note = (f"experts auto: the build picks the smallest of {', '.join(map(str, counts))} experts whose fidelity "
            f"meets the KL target; planned for the largest, {counts[-1]} ({plan.proxy.devices} devices)")
    return replace(plan, notes=(*plan.notes, note))


# --- memory and devices --------------------------------------------------------------------


def _memory(c: dict, params: Params, k: int, n_moe: int, opts: SizingOptions) -> Memory:
    w = BYTES_PER_PARAM[opts.precision]
    layers, h = config_int(c, "num_hidden_layers"), c["hidden_size"]
    per_token = layers * h * w + 34 * h * w // 2 + (k * 3 * expert_width(c) * w if n_moe else 0)
    return Memory(
        weights=params.total * w,
        gradients=params.total * w,
        optimizer=params.total * (12 if w < 4 else 8),
        reference=params.total * w if opts.reference else 0,
        activations_per_device=opts.micro_batch_tokens * per_token,
        rollout=(params.total * BYTES_PER_PARAM[opts.rollout_copy] if opts.rollout_copy else 0)
        + opts.rollout_snapshots * params.total * w,
    )


def devices_needed(memory: Memory, device_bytes: float, opts: SizingOptions) -> int:
    """Smallest multiple of devices_per_node whose devices hold the sharded static memory plus
    each device's activations and reserve."""
    room = device_bytes * opts.utilization - opts.reserve_gb * GB - memory.activations_per_device
    if room <= 0:
        raise InvalidExpertCount(
            f"one micro-batch of {opts.micro_batch_tokens} tokens does not fit on a "
            f"{device_bytes / GB:g} GB device; lower micro_batch_tokens"
        )
    nodes = max(1, math.ceil(memory.static / room / opts.devices_per_node))
    return nodes * opts.devices_per_node


def model_shape(c: dict, params: Params, experts: int, k: int, n_moe: int, precision: str) -> ModelShape:
    """What step_cost needs of one side; an expert's parameters are what one more expert adds."""
    heads, w = config_int(c, "num_attention_heads"), BYTES_PER_PARAM[precision]
    if c.get("kv_lora_rank"):  # multi-head latent attention caches the latent and the rope key
        qk, v = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
        kv = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    else:
        qk = v = c.get("head_dim") or c["hidden_size"] // heads
        kv = 2 * (c.get("num_key_value_heads") or heads) * qk
    one_more = config_params(c, experts + 1, k).total - params.total
    return ModelShape(params.total, params.active, one_more // max(1, n_moe), experts, k, n_moe,
                      config_int(c, "num_hidden_layers"), c["hidden_size"], heads * (qk + v), kv, w,
                      12 if w < 4 else 8)


def estimate(config: dict, opts: SizingOptions) -> Sizing:
    """Plan the original and the proxy described by `opts` (see SizingOptions)."""
    if opts.precision not in BYTES_PER_PARAM:
        raise InvalidOptions(f"precision {opts.precision!r}: expected one of {', '.join(BYTES_PER_PARAM)}")
    if opts.rollout_copy not in (None, *BYTES_PER_PARAM):
        raise InvalidOptions(f"rollout copy precision {opts.rollout_copy!r}: expected one of "
                             f"{', '.join(BYTES_PER_PARAM)}")
    if opts.devices_per_node < 1:
        raise InvalidOptions(f"devices per node must be at least 1, got {opts.devices_per_node}")
    w = opts.workload
    if min(w.sequences, w.prompt_tokens) < 1 or min(w.response_tokens, w.updates) < 0 \
            or not (0 < w.mfu <= 1 and 0 < w.hbm_efficiency <= 1):
        raise InvalidOptions(f"RL step: sequences and prompt tokens must be at least 1, response tokens and "
                             f"updates at least 0, MFU and HBM efficiency in (0, 1]; got {w}")
    c = text_config(config)
    arch = detect(c)
    n, k = expert_count(arch, c), top_k(arch, c)
    n_group, _ = groups(arch, c)
    kept = target_experts(n, arch, n_group, opts.experts, opts.keep_ratio)
    if opts.top_k is not None and not 1 <= opts.top_k <= kept:
        raise InvalidExpertCount(f"top-k {opts.top_k} must be between 1 and the kept experts ({kept})")
    if opts.max_devices is not None and opts.max_devices < 1:
        raise InvalidExpertCount(f"device budget must be at least 1 device, got {opts.max_devices}")
    acc = ACCELERATORS.get(opts.accelerator, replace(ASCEND_910B, resource=opts.accelerator, name=""))
    device_gb = opts.device_memory_gb or acc.memory_gb
    n_moe = len(moe_layer_indices(c, arch))

    workload = replace(opts.workload, reference=opts.reference)
    usable = device_gb * GB * opts.utilization - opts.reserve_gb * GB

    def side(experts: int, top: int) -> Side:
        params = config_params(c, experts, top)
        memory = _memory(c, params, top, n_moe, opts)
        devices = devices_needed(memory, device_gb * GB, opts)
        shape = model_shape(c, params, experts, top, n_moe, opts.precision)
        return Side(experts, top, params, memory, devices, devices // opts.devices_per_node,
                    phases(shape, workload, acc, devices, opts.devices_per_node, usable))

    wanted_k = opts.top_k or k  # the proxy's top-k before it is capped at the kept experts
    proxy = side(kept, min(wanted_k, kept))
    proxy, notes = _prefer_twice_top_k(proxy, side, opts, preferred_experts(n, arch, n_group, wanted_k), wanted_k)
    if opts.keep_ratio is not None and proxy.experts_per_layer == kept:  # not raised: how the ratio rounded
        notes = ratio_experts(n, arch, n_group, opts.keep_ratio)[1] + notes
    mtp = c.get("num_nextn_predict_layers") or 0
    if mtp:
        notes.append(f"{mtp} MTP layer{'s' * (mtp > 1)} (num_nextn_predict_layers) not counted: an RL step "
                     f"neither samples nor trains with {'them' if mtp > 1 else 'it'}; the proxy keeps "
                     f"{'them' if mtp > 1 else 'it'}, pruned alike")
    return Sizing(arch.name, n_moe, opts.precision, opts.accelerator, device_gb, opts.devices_per_node,
                original=side(n, k), proxy=proxy, workload=workload, notes=tuple(notes), rollout_copy=opts.rollout_copy,
                rollout_snapshots=opts.rollout_snapshots)


def _prefer_twice_top_k(proxy: Side, side: Callable[[int, int], Side], opts: SizingOptions, preferred: int | None,
                        k: int) -> tuple[Side, list[str]]:
    """Raise a keep ratio's kept experts to `preferred` (see preferred_experts) if the device
    budget holds it; an explicit expert count stays. Returns the proxy side and notes saying why."""
    kept = proxy.experts_per_layer
    trivial = (f"kept experts ({kept}) <= top-k ({k}): every token uses every kept expert, so load "
               f"imbalance and routing collapse cannot show")
    if preferred is None or kept >= preferred:
        return proxy, [trivial] if kept <= k else []
    if opts.experts is not None:
        return proxy, [f"{trivial}; {kept} experts kept as given ({preferred} would avoid it)"] if kept <= k else []
    goal = f"{preferred} (2 x top-k = {2 * k}{'' if preferred >= 2 * k else ' would keep every expert'})"
    budget = opts.max_devices if opts.max_devices is not None else proxy.devices
    budget_text = (f"the device budget of {budget}" if opts.max_devices is not None
                   else f"the {budget} devices that {kept} experts need (no device budget given)")
    raised = side(preferred, min(k, preferred))
    if raised.devices <= budget:
        return raised, [f"kept experts raised from {kept} (keep ratio {opts.keep_ratio:g}) to {goal}, so that "
                        f"routing stays a choice; {raised.devices} devices, within {budget_text}"]
    why = (f"kept experts stay {kept} (keep ratio {opts.keep_ratio:g}): {goal} would need {raised.devices} "
           f"devices, over {budget_text}")
    return proxy, [f"{why}; {trivial}" if kept <= k else why]


def _workload_text(w: StepShape) -> str:
    return (f"{w.sequences} sequences of {w.prompt_tokens} prompt + {w.response_tokens} response tokens, "
            f"{w.updates} optimizer update{'s' * (w.updates != 1)}, {'' if w.recompute else 'no '}recomputation, "
            f"{'' if w.reference else 'no '}reference pass; MFU {w.mfu:g}, HBM efficiency {w.hbm_efficiency:g}")


def format_sizing(p: Sizing) -> str:
    """The plan as a short table a person reads."""

    def row(label: str, o, x) -> str:
        return f"  {label:<28}{o:>18}{x:>18}"

    def gib(b: int) -> str:  # the unit that fits: a tiny model's rows are not "0.0 GiB"
        for unit, size in (("TiB", GIB * 1024), ("GiB", GIB), ("MiB", GIB / 1024), ("KiB", GIB / 1024 ** 2)):
            if b >= size:
                return f"{b / size:,.1f} {unit}"
        return f"{b:,} B"

    o, x = p.original, p.proxy
    lines = [
        f"{p.architecture}: {p.moe_layers} MoE layers, {p.precision}, {p.accelerator} "
        f"({p.device_memory_gb:g} GB, {p.devices_per_node} per node)",
        row("", "original", "proxy"),
        row("routed experts per layer", o.experts_per_layer, x.experts_per_layer),
        row("top-k", o.top_k, x.top_k),
        row("parameters (total)", f"{o.params.total:,}", f"{x.params.total:,}"),
        row("parameters (active)", f"{o.params.active:,}", f"{x.params.active:,}"),
        row("weights", gib(o.memory.weights), gib(x.memory.weights)),
        row("gradients", gib(o.memory.gradients), gib(x.memory.gradients)),
        row("optimizer states", gib(o.memory.optimizer), gib(x.memory.optimizer)),
        row("reference policy", gib(o.memory.reference), gib(x.memory.reference)),
        *([row(f"rollout copy ({p.rollout_copy})" + (f" + {p.rollout_snapshots} snapshots" if p.rollout_snapshots
                                                       else ""), gib(o.memory.rollout), gib(x.memory.rollout))]
          if o.memory.rollout else []),
        row("activations per device", gib(o.memory.activations_per_device), gib(x.memory.activations_per_device)),
        row("devices (whole nodes)", f"{o.devices} ({o.nodes} node{'s' * (o.nodes != 1)})",
            f"{x.devices} ({x.nodes} node{'s' * (x.nodes != 1)})"),
        f"  device-hours per RL step{'':<4}{'original':>18}{'proxy':>18}{'proxy/original':>16}",
        *(f"    {name.replace('_', ' '):<26}{r['original']:>18.4g}{r['proxy']:>18.4g}"
          f"{'-' if r['ratio'] is None else format(r['ratio'], '.3f'):>16}" for name, r in p.phase_table().items()),
        f"  devices saved: {p.device_reduction:.1%}; device-hours per step, proxy/original: "
        f"{p.device_hours_ratio:.3f}",
        f"  step: {_workload_text(p.workload)}",
    ]
    return "\n".join(lines + [f"  note: {note}" for note in p.notes])
