"""Name profiles: each training framework's metric names, mapped to the roles the failure
detectors (detect.py) judge, so that a TRL, OpenRLHF, MindSpeed-RL or Megatron run is read as
if verl had written it. A row's names are renamed to the verl / moe-proxy name of their role;
names that are no role pass through unchanged (so moe-proxy's own `moe/...` and `numerics/...`
names, which the probes write into any framework's logs, are understood under every profile).

The profile is detected from the names (the one with most of its names in the run; verl, the
identity, when none matches); `--profile NAME` overrides, `--metric ROLE=NAME` adds a mapping.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_proxy.errors import InvalidReproConfig

# role -> the name the detectors and compare read (verl's names; moe-proxy's for MoE and numerics).
ROLES = {
    "policy_loss": "actor/pg_loss",
    "kl": "actor/kl_loss",
    "entropy": "actor/entropy",
    "grad_norm": "actor/grad_norm",
    "reward": "critic/rewards/mean",
    "learning_rate": "actor/lr",
    "loss_scale": "numerics/loss_scale",
    "skipped_steps": "numerics/grad_overflow",  # non-finite gradients: the step was skipped
    "router_logit_max": "moe/router_logit_max",
    "expert_load": "moe/load_max_share",  # per layer: moe/load_max_share/layer_N
    # the same from uniform (0) to one expert in every token's top-k (1); what collapse reads first
    "expert_load_excess": "moe/load_max_excess",
    "max_activation": "numerics/max_activation",
    "nonfinite_activations": "numerics/nonfinite_activations",
    "params_nonfinite": "numerics/params_nonfinite",
    "dense_grad_zero_frac": "numerics/dense_grad_zero_frac",
    "rollout_kl": "training/rollout_kl",  # rollout/trainer gap (prime-rl mismatch_kl)
    "rollout_probs_corr": "training/rollout_actor_probs_pearson_corr",
    "rollout_is_high": "rollout_corr/rollout_is_ratio_fraction_high",
}

# signature -> the roles any one of which lets it be judged, and what is missing when none is there.
NEEDS = {
    "nan": (("policy_loss", "kl", "entropy", "params_nonfinite"), "no loss, KL, entropy or weight check"),
    "overflow": (("loss_scale", "skipped_steps", "nonfinite_activations"),
                 "no loss scale, skipped-step count or activation check; only a grad norm gone non-finite is seen"),
    "underflow": (("dense_grad_zero_frac",), "no share of zero gradients"),
    "divergence": (("grad_norm", "kl", "router_logit_max", "max_activation"),
                   "no grad norm, KL, router logit max or max activation"),
    "collapse": (("expert_load", "expert_load_excess"),
                 "no per-expert load (moe/load_max_excess or moe/load_max_share: the probes write them)"),
    "mismatch": (("rollout_kl", "rollout_probs_corr", "rollout_is_high"),
                 "no rollout/trainer gap (training/rollout_kl, rollout probs correlation or IS weights)"),
}


def _train(names: dict[str, str]) -> dict[str, str]:
    """The same names as the `train/` scalars TensorBoard writers make of them."""
    return {**names, **{f"train/{k}": v for k, v in names.items()}}


# framework name -> role, per profile. Sources (read in the projects' code):
PROFILES: dict[str, dict[str, str]] = {
    # verl: verl/workers/actor/dp_actor.py (actor/pg_loss, actor/kl_loss, actor/entropy,
    # actor/grad_norm), verl/trainer/ppo/metric_utils.py (critic/rewards/mean); moe-proxy's repro.
    "verl": {name: role for role, name in ROLES.items()},
    # transformers Trainer (src/transformers/trainer.py: loss, grad_norm, learning_rate) and TRL
    # (trl/trainer/grpo_trainer.py: self._metrics[mode]["kl"], ["entropy"], ["reward"]);
    # transformers' TensorBoardCallback (integrations/integration_utils.py, rewrite_logs) writes
    # them as train/<name>.
    "trl": _train({"loss": "policy_loss", "grad_norm": "grad_norm", "kl": "kl", "entropy": "entropy",
                   "reward": "reward", "learning_rate": "learning_rate"}),
    # OpenRLHF: openrlhf/trainer/ppo_trainer.py, save_logs_and_checkpoints, writes each status
    # value as train/<k> (TensorBoard add_scalar, and wandb); the PPO training step's status
    # (same file, and openrlhf/trainer/ray/ppo_actor.py): status["policy_loss"], ["kl"],
    # ["reward"], ["actor_lr"]. No grad norm is logged.
    "openrlhf": _train({"policy_loss": "policy_loss", "kl": "kl", "reward": "reward", "actor_lr": "learning_rate"}),
    # MindSpeed-RL: mindspeed_rl/trainer/grpo_trainer_hybrid.py writes every metric as
    # train/<k>; its actor's metrics carry verl's names (actor/pg_loss, actor/kl_loss,
    # actor/entropy, and grad_norm).
    "mindspeed-rl": {f"train/{k}": v for k, v in {"actor/pg_loss": "policy_loss", "actor/kl_loss": "kl",
                                                   "actor/entropy": "entropy", "grad_norm": "grad_norm",
                                                   "actor/grad_norm": "grad_norm", "actor/lr": "learning_rate"
                                                   }.items()},
    # Megatron-LM: megatron/training/training.py, training_log: writer.add_scalar('grad-norm'),
    # ('loss-scale'), ('learning-rate') and each loss_dict key ('lm loss').
    "megatron": {"lm loss": "policy_loss", "grad-norm": "grad_norm", "loss-scale": "loss_scale",
                 "learning-rate": "learning_rate"},
}


TRAIN = "train/"  # transformers' TensorBoard callback prefixes every logged name with it
OWN_PREFIXES = ("moe/", "numerics/")  # moe-proxy's own names (repro, moe_proxy.probes)


@dataclass
class Profile:
    name: str
    mapping: dict[str, str]  # framework name -> detector name
    detected: bool = False  # chosen from the names, not asked for
    added: dict[str, str] = field(default_factory=dict)  # --metric ROLE=NAME: NAME -> role

    def rename(self, row: dict[str, float]) -> dict[str, float]:
        """The row under the detectors' names; a name that is no role is kept as it is. A name
        that is already the detectors' own wins over a framework name for the same role."""
        out = {}
        for key, value in row.items():
            # the probes' names as a Trainer's TensorBoard writes them (train/moe/..., train/numerics/...)
            plain = key.removeprefix(TRAIN)
            target = self.mapping.get(key, plain if plain.startswith(OWN_PREFIXES) else key)
            if target != key and target in row:
                out[key] = value
                continue
            out[target] = value
        return out


def parse_metric_options(items: list[str] | None) -> dict[str, str]:
    """`--metric ROLE=NAME` (repeatable) -> {NAME: role}."""
    added = {}
    for item in items or ():
        role, sep, name = item.partition("=")
        role, name = role.strip(), name.strip()
        if not sep or not name or role not in ROLES:
            raise InvalidReproConfig(f"--metric {item!r}: expected ROLE=NAME with ROLE one of {', '.join(ROLES)}")
        added[name] = role
    return added


def profile_for(names: set[str] | list[str], name: str | None = None, added: dict[str, str] | None = None) -> Profile:
    """The profile called `name`, or the one that knows most of `names` (verl when none does)."""
    if name is not None and name not in PROFILES:
        raise InvalidReproConfig(f"--profile {name!r}: no such profile; one of {', '.join(PROFILES)}")
    detected = name is None
    if name is None:
        present = set(names)
        scores = {p: len(present & (set(m) - set(ROLES.values()))) for p, m in PROFILES.items()}
        best = max(scores.values())
        name = next(p for p, s in scores.items() if s == best) if best else "verl"
    mapping = {k: ROLES[role] for k, role in PROFILES[name].items()}
    added = added or {}
    mapping.update({k: ROLES[role] for k, role in added.items()})
    return Profile(name, mapping, detected, dict(added))


def coverage(names: set[str]) -> tuple[list[str], dict[str, str]]:
    """(roles found among the detectors' `names`, {signature: why it cannot be judged})."""
    found = [role for role, metric in ROLES.items()
             if any(n == metric or n.startswith(metric + "/") for n in names)]
    missing = {sig: why for sig, (roles, why) in NEEDS.items() if not set(roles) & set(found)}
    return found, missing


def coverage_lines(profile: Profile | None, names: set[str]) -> list[str]:
    """What watch and compare print: the profile, the roles found, the signatures not judged."""
    found, missing = coverage(names)
    head = f"metrics: {profile.name} names{' (detected)' if profile and profile.detected else ''}; " if profile else ""
    lines = [f"{head}roles found: {', '.join(found) or 'none'}"]
    lines += [f"  {sig}: cannot be judged from this run's metrics ({why})" for sig, why in missing.items()]
    return lines
