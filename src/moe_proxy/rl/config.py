"""Settings of a reproduction run: the RL knobs that matter for failures, and the faults
that can be injected on purpose to check that a proxy reproduces what the original does."""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import asdict, dataclass, field

from moe_proxy.errors import InvalidReproConfig
from moe_proxy.options import option

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16")
LOSS_SCALING = ("dynamic", "none")
LR_SCHEDULES = ("constant", "cosine", "linear")
OP_FAULT_MODES = ("scale", "noise", "nan")
# The rollout engine and the policy loss as RL frameworks run them (docs/repro.md, "Rollout and
# trainer apart"): each value is named after the framework setting it stands for.
ROLLOUT_KERNELS = ("eager", "grouped")  # transformers' experts kernels: eager, grouped_mm
OLD_LOGPROBS = ("trainer", "rollout")  # rollout: verl's bypass mode
ROLLOUT_IS = ("off", "token", "sequence")  # verl algorithm.rollout_correction.rollout_is
ROLLOUT_IS_MODES = ("truncate", "mask")  # TIS truncates the weights; mask drops the tokens / sequences
RATIO_LEVELS = ("token", "sequence")  # sequence: GSPO (TRL importance_sampling_level)
ROUTING_REPLAY = ("off", "R2", "R3")  # verl actor.router_replay.mode
HEAD_DTYPES = ("auto", "fp32")


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
class RankFault:
    """Fault injection for the run itself: rank `rank` is killed (`exit`, SIGKILL as the OOM
    killer does) or stops answering (`hang`) when step `step` starts."""

    rank: int
    step: int
    mode: str = "exit"

    @classmethod
    def parse(cls, text: str, mode: str) -> RankFault:
        rank, _, step = text.partition("@")
        if not rank.isdigit() or not step.isdigit():
            raise InvalidReproConfig(f"--fault-rank-{mode} {text!r}: expected RANK@STEP, e.g. 1@2")
        return cls(int(rank), int(step), mode)

    def maybe_fire(self, rank: int, step: int) -> None:
        if rank != self.rank or step != self.step:
            return
        log.warning("rank %d: injected fault: %s at step %d", rank, self.mode, step)
        if self.mode == "exit":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang: never answer again, until someone kills us
            time.sleep(60)


@dataclass
class ReproConfig:
    """A reproduction run's settings: `moe-proxy repro`'s flags and a ProxyModel's
    spec.reproduction fields (moe_proxy.options generates both)."""

    steps: int = option(20, "int", "RL steps to run (fewer when the failure asked for is seen)", crd="maxSteps",
                        metavar="N", minimum=1, crd_default=50)
    seed: int = option(0, "int", "seed of sampling, and of the prompts", crd="seed", minimum=0)
    prompt_seed: int | None = None  # same prompts, other samples: a run's own noise floor (the fidelity lab)
    # Rollouts: `batch_size` prompts per step, each sampled `group_size` times (GRPO groups).
    batch_size: int = option(8, "int", "prompts per step", crd="batchSize", minimum=1)
    group_size: int = option(4, "int", "answers sampled per prompt (a GRPO group)", crd="groupSize", minimum=2)
    max_new_tokens: int = option(8, "int", "tokens generated per answer, at most", crd="maxNewTokens", minimum=1)
    temperature: float = option(1.0, "float", "sampling temperature", crd="temperature", above=0)
    task: str = "arithmetic"
    # Optimisation.
    lr: float = option(1e-5, "float", "learning rate", crd="lr", above=0)
    lr_schedule: str = option("constant", "str", "learning-rate schedule after warmup", crd="lrSchedule",
                              choices=LR_SCHEDULES)
    warmup_steps: int = option(0, "int", "linear warmup steps", crd="warmupSteps", minimum=0)
    grad_clip: float = option(1.0, "float", "gradient-norm clipping (0 turns it off; the norm is still measured)",
                              crd="gradClip", minimum=0)
    mini_batches: int = option(2, "int", "optimizer updates per step (more than 1 makes the later ones off-policy)",
                               crd="miniBatches", minimum=1)
    clip_ratio: float = option(0.2, "float", "PPO clip ratio", crd="clipRatio", minimum=0)
    kl_coef: float = option(0.01, "float", "k3 KL to the frozen reference (verl's use_kl_loss)", crd="klCoef",
                            minimum=0)
    router_aux_coef: float = option(0.0, "float", "Switch/Mixtral load-balancing loss", crd="routerAuxCoef",
                                    minimum=0)
    router_z_coef: float = option(0.0, "float", "ST-MoE router z-loss", crd="routerZCoef", minimum=0)
    # Numerics.
    precision: str = option("fp32", "str", "compute precision of training and rollouts", crd="precision",
                            choices=PRECISIONS, crd_default="bf16")
    loss_scaling: str = option("dynamic", "str", "fp16 loss scaling (with fp16 only)", crd="lossScaling",
                               choices=LOSS_SCALING)
    init_loss_scale: float = 2.0**16
    adam_eps: float = option(1e-8, "float", "AdamW epsilon (Megatron --adam-eps)", crd="adamEps", above=0)
    skip_nonfinite: bool | None = option(
        None, "tristate", "skip the optimizer step when gradients are not finite, counted in "
        "numerics/skipped_steps (verl's FSDP actor; the default); --no-skip-nonfinite steps anyway",
        crd="skipNonfinite")
    router_dtype: str = option("auto", "str", "fp32: the routers' matmul and softmax/sigmoid in fp32 under "
                               "half-precision autocast (Megatron moe_router_dtype)", crd="routerDtype",
                               choices=HEAD_DTYPES)
    lm_head_dtype: str = option("auto", "str", "fp32: the LM head in fp32 under half-precision autocast "
                                "(TRL cast_lm_head_to_fp32)", crd="lmHeadDtype", choices=HEAD_DTYPES)
    # The rollout engine: its own copy of the weights, in its own numerics, synced after every update.
    rollout_precision: str | None = option(None, "str", "precision of the rollout engine's own weight copy "
                                           "(default: sample with the trainer's model and precision)",
                                           crd="rolloutPrecision", choices=PRECISIONS)
    rollout_kernels: str | None = option(None, "str", "experts kernel of the rollout engine's copy (default: "
                                         "the trainer's)", crd="rolloutKernels", choices=ROLLOUT_KERNELS)
    rollout_staleness: int = option(0, "int", "the rollout engine samples with the policy as it was this many "
                                    "steps before (asynchronous RL: prime-rl's async_level, verl's one-step-off-policy, "
                                    "AReaL's max_head_offpolicyness); its own copy of the weights", crd="rolloutStaleness",
                                    minimum=0, metavar="N")
    # The policy loss.
    old_logprobs: str = option("trainer", "str", "old log-probabilities: recomputed by the trainer before the "
                               "update, or the rollout's own (verl's bypass mode)", crd="oldLogprobs",
                               choices=OLD_LOGPROBS)
    rollout_is: str = option("off", "str", "importance-sampling correction of the rollout/trainer gap, per "
                             "token or per sequence (verl rollout_correction.rollout_is)", crd="rolloutIs",
                             choices=ROLLOUT_IS)
    rollout_is_threshold: float = option(2.0, "float", "IS weights above it are truncated (or masked); with "
                                         "mask, those below its inverse too", crd="rolloutIsThreshold", above=0)
    rollout_is_mode: str = option("truncate", "str", "truncate the IS weights at the threshold (TIS) or mask "
                                  "the tokens / sequences past it", crd="rolloutIsMode", choices=ROLLOUT_IS_MODES)
    ratio_level: str = option("token", "str", "the PPO ratio per token, or one per sequence (GSPO)",
                              crd="ratioLevel", choices=RATIO_LEVELS)
    routing_replay: str = option("off", "str", "R3: the trainer's forwards route as the rollout did; R2: the "
                                 "updates route as the trainer's old-log-prob pass did", crd="routingReplay",
                                 choices=ROUTING_REPLAY)
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
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
            (self.rollout_precision in (None, *PRECISIONS), f"rollout precision must be one of {PRECISIONS}"),
            (self.rollout_kernels in (None, *ROLLOUT_KERNELS), f"rollout kernels must be one of {ROLLOUT_KERNELS}"),
            (self.old_logprobs in OLD_LOGPROBS, f"old log-probs must be one of {OLD_LOGPROBS}"),
            (self.rollout_is in ROLLOUT_IS, f"rollout IS must be one of {ROLLOUT_IS}"),
            (self.rollout_is_mode in ROLLOUT_IS_MODES, f"rollout IS mode must be one of {ROLLOUT_IS_MODES}"),
            (self.rollout_is_threshold > 0, "the rollout IS threshold must be above 0"),
            (self.ratio_level in RATIO_LEVELS, f"ratio level must be one of {RATIO_LEVELS}"),
            (self.routing_replay in ROUTING_REPLAY, f"routing replay must be one of {ROUTING_REPLAY}"),
            (self.router_dtype in HEAD_DTYPES and self.lm_head_dtype in HEAD_DTYPES,
             f"router and LM-head dtypes must be one of {HEAD_DTYPES}"),
            (self.adam_eps > 0, "adam eps must be above 0"),
            (self.rollout_staleness >= 0, "rollout staleness must be 0 or more steps"),
            (self.rollout_is == "off" or self.old_logprobs == "trainer",
             "--rollout-is corrects the trainer's old log-probs for the rollout's; with --old-logprobs rollout the "
             "ratio is against the rollout already: choose one"),
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

    def separate_rollout(self) -> bool:
        """Whether the rollout engine holds its own copy of the weights (own precision, kernels or
        weights' age)."""
        return self.rollout_precision is not None or self.rollout_kernels is not None or self.rollout_staleness > 0

    def to_dict(self) -> dict:
        return asdict(self)
