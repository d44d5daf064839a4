"""Settings of a reproduction run: the RL knobs that matter for failures, and the faults
that can be injected on purpose to check that a proxy reproduces what the original does."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

PRECISIONS = ("fp32", "bf16", "fp16")
LOSS_SCALING = ("dynamic", "none")
LR_SCHEDULES = ("constant", "cosine", "linear")
OP_FAULT_MODES = ("scale", "noise", "nan")


@dataclass
class Faults:
    """Faults injected from a given step (all off by default). Steps count from 0."""

    # Switch to fp16 compute without loss scaling from this step (as a misconfigured job would).
    fp16_no_scaling_step: int | None = None
    # Multiply the learning rate of this one step by lr_spike_factor.
    lr_spike_step: int | None = None
    lr_spike_factor: float = 100.0
    # Multiply every router's logits by router_scale_factor from this step on.
    router_scale_step: int | None = None
    router_scale_factor: float = 10.0
    # A faulty kernel: perturb the output of module `op_module` from step `op_step` on.
    op_module: str | None = None
    op_step: int | None = None
    op_mode: str = "scale"  # scale: output * value; noise: + value * N(0, std(output)); nan: poison one element
    op_value: float = 100.0

    def any(self) -> bool:
        return any(s is not None for s in (self.fp16_no_scaling_step, self.lr_spike_step,
                                           self.router_scale_step, self.op_step))


@dataclass
class ReproConfig:
    steps: int = 20
    seed: int = 0  # sampling, and the prompts unless prompt_seed is set
    prompt_seed: int | None = None  # same prompts, other samples: a run's own noise floor
    # Rollouts: `batch_size` prompts per step, each sampled `group_size` times (GRPO groups).
    batch_size: int = 8
    group_size: int = 4
    max_new_tokens: int = 8
    temperature: float = 1.0
    task: str = "arithmetic"
    # Optimisation.
    lr: float = 1e-5
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still measured)
    mini_batches: int = 2  # optimizer updates per step; >1 makes the later ones off-policy (ppo_kl != 0)
    clip_ratio: float = 0.2
    kl_coef: float = 0.01  # k3 ("low_var_kl") KL to the frozen reference, as verl's use_kl_loss
    router_aux_coef: float = 0.0  # Switch/Mixtral load-balancing loss
    router_z_coef: float = 0.0  # ST-MoE router z-loss
    # Numerics.
    precision: str = "fp32"
    loss_scaling: str = "dynamic"  # only used with fp16
    init_loss_scale: float = 2.0**16
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        from moe_proxy.errors import InvalidReproConfig

        checks = [
            (self.precision in PRECISIONS, f"precision must be one of {PRECISIONS}"),
            (self.loss_scaling in LOSS_SCALING, f"loss scaling must be one of {LOSS_SCALING}"),
            (self.lr_schedule in LR_SCHEDULES, f"lr schedule must be one of {LR_SCHEDULES}"),
            (self.faults.op_mode in OP_FAULT_MODES, f"faulty-op mode must be one of {OP_FAULT_MODES}"),
            (self.steps >= 1, "steps must be at least 1"),
            (self.batch_size >= 1 and self.group_size >= 2, "need batch >= 1 and group size >= 2 (GRPO)"),
            (1 <= self.mini_batches <= self.batch_size * self.group_size,
             "mini-batches must be between 1 and batch x group size"),
            (self.max_new_tokens >= 1, "max new tokens must be at least 1"),
            ((self.faults.op_step is None) == (self.faults.op_module is None),
             "a faulty-op fault needs both a module and a step"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidReproConfig(message)

    def lr_at(self, step: int) -> float:
        """Learning rate of `step`: warmup, then the schedule, times the spike fault if any."""
        lr = self.lr
        if step < self.warmup_steps:
            lr *= (step + 1) / self.warmup_steps
        else:
            progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
            if self.lr_schedule == "cosine":
                lr *= 0.5 * (1 + math.cos(math.pi * progress))
            elif self.lr_schedule == "linear":
                lr *= 1 - progress
        if self.faults.lr_spike_step == step:
            lr *= self.faults.lr_spike_factor
        return lr

    def precision_at(self, step: int) -> tuple[str, bool]:
        """(precision, dynamic loss scaling on?) for `step`, after the fp16 fault if any."""
        fault = self.faults.fp16_no_scaling_step
        if fault is not None and step >= fault:
            return "fp16", False
        return self.precision, self.precision == "fp16" and self.loss_scaling == "dynamic"

    def uses_half_precision(self) -> bool:
        """Whether any step computes in fp16/bf16 (set or injected)."""
        return self.precision != "fp32" or self.faults.fp16_no_scaling_step is not None

    def to_dict(self) -> dict:
        return asdict(self)
