"""The fixes the field tries when MoE RL training fails, each a change to `moe-proxy repro`'s
options: `diagnose` runs the failing run (the baseline) again with each, and says which cure it.

An entry is repro flags appended after the baseline's (the last value of a flag wins), so a
candidate is never a special case inside diagnose: what it runs is `moe-proxy repro` with
those flags, which a user can run by hand. A few depend on the baseline (lr / 10, a quarter
of the steps). `knobs` names the setting in the frameworks users run, for carrying a cure back
to the original's job. Custom candidates (`NAME=--flag value,--flag value`) are the same shape.
Every entry acts at every step count (a candidate that changes nothing is diagnose's
`no-change`, never a cure or a failure).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moe_proxy.errors import MoeProxyError
from moe_proxy.rl.config import ReproConfig


@dataclass(frozen=True)
class Fix:
    """A candidate fix: its name, what it changes, the knob it stands for, its repro flags."""

    name: str
    what: str
    knobs: str  # where verl / Megatron / TRL set the same thing
    flags: Callable[[ReproConfig], list[str]]  # repro flags, given the baseline's settings

    def changes(self, baseline: ReproConfig) -> list[str]:
        return self.flags(baseline)


def _fixed(*flags: str) -> Callable[[ReproConfig], list[str]]:
    return lambda _: list(flags)


CATALOGUE: dict[str, Fix] = {c.name: c for c in [
    Fix("fp32", "train and sample in fp32", "verl: actor.fsdp_config.mixed_precision param_dtype fp32; "
              "Megatron: no --bf16/--fp16; TRL: bf16=False, fp16=False", _fixed("--precision", "fp32")),
    Fix("bf16", "train and sample in bf16 (fp16's range, bf16's precision)",
              "verl: mixed_precision param_dtype bf16; Megatron: --bf16; TRL: bf16=True", _fixed("--precision", "bf16")),
    Fix("loss-scaling", "fp16 with dynamic loss scaling (skip and halve on overflow)",
              "Megatron: --fp16 with --loss-scale unset (dynamic), --initial-loss-scale; DeepSpeed: fp16.loss_scale 0; "
              "torch: GradScaler", _fixed("--precision", "fp16", "--loss-scaling", "dynamic")),
    Fix("lower-lr", "the learning rate / 10", "verl: actor.optim.lr; Megatron: --lr; TRL: learning_rate",
              lambda c: ["--lr", f"{c.lr / 10:g}"]),
    # 2 steps at least: a warm-up of 1 step runs step 0 at the full rate, which changes nothing.
    Fix("warmup", "linear warm-up over the first quarter of the steps (2 at least)",
              "verl: actor.optim.lr_warmup_steps(_ratio); Megatron: --lr-warmup-iters; TRL: warmup_ratio",
              lambda c: ["--warmup-steps", str(max(2, c.steps // 4))]),
    Fix("grad-clip", "clip the gradient norm at 1.0", "verl: actor.grad_clip; Megatron: --clip-grad; "
              "TRL: max_grad_norm", _fixed("--grad-clip", "1.0")),
    Fix("z-loss", "router z-loss 1e-3 (ST-MoE): keeps router logits small",
              "Megatron: --moe-z-loss-coeff; verl (Megatron backend): the same via override_transformer_config",
              _fixed("--router-z-coef", "1e-3")),
    Fix("aux-loss-off", "no router load-balancing loss during RL",
              "Megatron: --moe-aux-loss-coeff 0; transformers: router_aux_loss_coef 0 / output_router_logits False",
              _fixed("--router-aux-coef", "0")),
    Fix("aux-loss", "router load-balancing loss 1e-3 (Switch / Mixtral)",
              "Megatron: --moe-aux-loss-coeff 1e-3; transformers: output_router_logits True, router_aux_loss_coef",
              _fixed("--router-aux-coef", "1e-3")),
    # The rollout/training mismatch class (docs/repro.md, "Rollout and trainer apart").
    Fix("routing-replay", "R3: the trainer routes every token as the rollout engine did",
              "verl: actor_rollout_ref.actor.router_replay.mode=R3; slime: --use-rollout-routing-replay; "
              "NeMo-RL: policy.router_replay.enabled; Megatron (SkyRL): moe_enable_routing_replay",
              _fixed("--routing-replay", "R3")),
    Fix("rollout-is-token", "truncated importance sampling per token (TIS, threshold 2)",
              "verl: algorithm.rollout_correction.rollout_is=token, rollout_is_threshold=2.0; TRL: "
              "vllm_importance_sampling_correction=True; slime: --use-tis --tis-clip 2.0",
              _fixed("--old-logprobs", "trainer", "--rollout-is", "token", "--rollout-is-threshold", "2",
                     "--rollout-is-mode", "truncate")),
    Fix("rollout-is-sequence", "truncated importance sampling per sequence (threshold 2)",
              "verl: algorithm.rollout_correction.rollout_is=sequence, rollout_is_threshold=2.0",
              _fixed("--old-logprobs", "trainer", "--rollout-is", "sequence", "--rollout-is-threshold", "2",
                     "--rollout-is-mode", "truncate")),
    Fix("gspo", "one importance ratio per sequence (GSPO), clipped at 4e-4",
              "TRL: importance_sampling_level=\"sequence\", epsilon=3e-4, epsilon_high=4e-4; verl: "
              "actor.policy_loss.loss_mode=gspo, clip_ratio_low=3e-4, clip_ratio_high=4e-4",
              _fixed("--ratio-level", "sequence", "--clip-ratio", "4e-4")),
    Fix("fp32-router", "the routers' matmul and softmax/sigmoid in fp32",
              "Megatron: --moe-router-dtype fp32 (verl Megatron backend: override_transformer_config); "
              "NeMo-RL: policy.megatron_cfg.moe_router_dtype", _fixed("--router-dtype", "fp32")),
    Fix("fp32-lm-head", "the LM head in fp32",
              "TRL: cast_lm_head_to_fp32=True; MiniMax-M1 and ScaleRL keep the head in fp32",
              _fixed("--lm-head-dtype", "fp32")),
    Fix("adam-eps", "AdamW epsilon 1e-15: the update keeps its size when gradients are tiny (Wortsman et al., "
              "arXiv 2309.14322)", "Megatron: --adam-eps; verl: actor.optim.eps (FSDP), TRL: adam_epsilon",
              _fixed("--adam-eps", "1e-15")),
    Fix("skip-nonfinite", "skip the optimizer step when gradients are not finite (repro's default: a change only "
              "against a baseline run with --no-skip-nonfinite)", "verl's FSDP actor (always); Megatron: "
              "--check-for-nan-in-loss-and-grad with its skip; OLMo-core SkipStepOptimizer", _fixed("--skip-nonfinite")),
    Fix("bypass", "the rollout's own log-probs as the PPO ratio's old log-probs (no recompute)",
              "verl: algorithm.rollout_correction.bypass_mode=True", _fixed("--old-logprobs", "rollout",
                                                                            "--rollout-is", "off")),
]}


@dataclass(frozen=True)
class Suggestion:
    """A catalogue entry the loop tries for a failure signature, and why it may cure it."""

    name: str
    why: str


# What the loop (`triage`, a watched run) tries for each failure signature, most likely cure first.
# docs/diagnosis.md shows this table; a spec's or a command's own candidates replace it.
FOR_SIGNATURE: dict[str, tuple[Suggestion, ...]] = {
    "overflow": (
        Suggestion("loss-scaling", "dynamic loss scaling skips the overflowing step and halves the scale"),
        Suggestion("bf16", "bf16 has fp32's exponent range: values past fp16's 65504 stay finite"),
        Suggestion("fp32", "full precision: no range or rounding limit of a half format"),
        Suggestion("fp32-router", "router logits are where half-precision range runs out first in MoE"),
        Suggestion("grad-clip", "bounds the update that grows the activations past the range"),
    ),
    "underflow": (
        Suggestion("loss-scaling", "scaling the loss lifts small gradients above fp16's smallest normal"),
        Suggestion("bf16", "bf16's exponent range keeps tiny gradients that fp16 flushes to zero"),
        Suggestion("fp32", "full precision: no underflow at RL's gradient sizes"),
        Suggestion("adam-eps", "a tiny epsilon keeps the update's size when gradients are tiny"),
    ),
    "nan": (
        Suggestion("skip-nonfinite", "skips the optimizer step whose gradients are not finite"),
        Suggestion("bf16", "a NaN from fp16 overflow does not happen in bf16's range"),
        Suggestion("fp32", "full precision rules the numerics in or out as the cause"),
        Suggestion("grad-clip", "bounds the step that blows the weights up"),
        Suggestion("lower-lr", "a smaller step keeps the weights where the loss is finite"),
        Suggestion("fp32-lm-head", "the LM head's log-softmax in fp32 (MiniMax-M1, ScaleRL)"),
    ),
    "divergence": (
        Suggestion("lower-lr", "the most common cure for a growing loss or grad-norm"),
        Suggestion("grad-clip", "bounds each step's update"),
        Suggestion("warmup", "a warm-up keeps the first steps from over-shooting"),
        Suggestion("z-loss", "keeps router logits small (ST-MoE), a known MoE divergence source"),
        Suggestion("adam-eps", "a small epsilon (Wortsman et al.) against logit growth"),
        Suggestion("gspo", "one clipped ratio per sequence: steadier MoE RL (Qwen3's GSPO)"),
    ),
    "collapse": (
        Suggestion("aux-loss", "a load-balancing loss pulls tokens back to the other experts"),
        Suggestion("z-loss", "small router logits keep routing soft enough to spread"),
        Suggestion("fp32-router", "routing decided in fp32 rather than rounded logits"),
        Suggestion("lower-lr", "a smaller step lets the router drift less"),
        Suggestion("routing-replay", "training routes as the rollout did: no drift between the two"),
    ),
    "mismatch": (
        Suggestion("routing-replay", "R3: the trainer routes every token as the rollout engine did"),
        Suggestion("rollout-is-token", "importance sampling corrects the rollout/trainer probability gap"),
        Suggestion("rollout-is-sequence", "the same correction per sequence"),
        Suggestion("fp32-router", "the two sides' routing agrees when both route in fp32"),
        Suggestion("fp32-lm-head", "the two sides' token probabilities agree when the head is fp32"),
        Suggestion("gspo", "a sequence-level ratio is less sensitive to per-token gaps"),
    ),
}
# A threshold signature (METRIC>X[:K]) names any metric: the general cures.
FOR_THRESHOLD: tuple[Suggestion, ...] = (
    Suggestion("lower-lr", "the most common cure for a metric that grows past its bound"),
    Suggestion("grad-clip", "bounds each step's update"),
    Suggestion("z-loss", "keeps router logits small"),
    Suggestion("fp32", "full precision rules the numerics in or out as the cause"),
)


def suggested(signature: str) -> tuple[Suggestion, ...]:
    """The loop's candidates for a failure signature (a name of detect.SIGNATURES or METRIC>X[:K])."""
    return FOR_SIGNATURE.get(signature, FOR_THRESHOLD)


def custom(text: str) -> Fix:
    """`NAME=--flag value,--flag value`: the flags split on commas, then on the first space."""
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name or not rest.strip():
        raise MoeProxyError(f"--candidate {text!r}: expected NAME=--flag value[,--flag value], "
                            "e.g. low-lr=--lr 1e-6,--warmup-steps 5")
    flags: list[str] = []
    for part in rest.split(","):
        flags += part.strip().split(" ", 1) if part.strip() else []
    if not flags or not flags[0].startswith("--"):
        raise MoeProxyError(f"--candidate {text!r}: the changes are repro flags, e.g. {name}=--lr 1e-6")
    return Fix(name, "custom: " + " ".join(flags), "", _fixed(*flags))


def from_file(data: object, where: str) -> list[Fix]:
    """A YAML/JSON file's candidates: a list of {name, flags: [..]} (or {name, changes: "--flag v,..."})
    or a mapping NAME -> flags."""
    items = list(data.items()) if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise MoeProxyError(f"{where}: expected a list of candidates or a mapping NAME -> flags")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, tuple):
            name, flags = item
        elif isinstance(item, dict) and "name" in item:
            name, flags = item["name"], item.get("flags", item.get("changes"))
        else:
            raise MoeProxyError(f"{where}: candidate {i}: expected {{name, flags}}")
        if isinstance(flags, str):
            out.append(custom(f"{name}={flags}"))
        elif isinstance(flags, list) and all(isinstance(f, (str, int, float)) for f in flags) and flags:
            out.append(Fix(str(name), "custom: " + " ".join(map(str, flags)), "", _fixed(*map(str, flags))))
        else:
            raise MoeProxyError(f"{where}: candidate {name!r}: flags must be a list of repro flags or a string")
    return out


def pick(names: list[str]) -> list[Fix]:
    """Catalogue entries by name; an unknown name lists the known ones."""
    unknown = [n for n in names if n not in CATALOGUE]
    if unknown:
        raise MoeProxyError(f"unknown candidate {', '.join(map(repr, unknown))}: the catalogue has "
                            f"{', '.join(CATALOGUE)} (or give your own: --candidate NAME=--flag value)")
    return [CATALOGUE[n] for n in names]
