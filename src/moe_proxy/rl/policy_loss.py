"""The policy loss's parts as RL frameworks compute them, as plain functions of log-probabilities:
the PPO ratio per token or per sequence (GSPO), the importance-sampling correction of the
rollout/trainer gap (TIS and its masked form), and the figures of that gap under verl's names.

Shapes: [rows, tokens] for log-probabilities and the answer mask (1 on answer tokens).
"""

from __future__ import annotations

import math

import torch

LOG_CLAMP = 20.0  # exp(20) ~ 5e8: past any threshold, still finite in fp32


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """pi_theta / pi_old per token, or per sequence as GSPO defines it (arXiv 2507.18071, verl's
    compute_policy_loss_gspo): s_i = exp(mean over the answer of log(pi_theta / pi_old)), the same
    for every token of the answer, with the gradient of the tokens' own log-probabilities
    (s_i * grad log pi_theta(y_t))."""
    if level == "token":
        return torch.exp(logp - old_logp)
    lengths = mask.sum(-1).clamp_min(1)
    seq = ((logp - old_logp) * mask).sum(-1) / lengths
    log_ratio = logp - logp.detach() + seq.detach().unsqueeze(-1)
    return torch.exp(log_ratio.clamp(max=10.0))


def is_log_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log(pi_trainer / pi_rollout) per token, or summed over each answer (the sequence's weight is
    the product of its tokens', verl's rollout_is=sequence), broadcast to the answer's tokens."""
    log_w = (old_logp - rollout_logp).clamp(-LOG_CLAMP, LOG_CLAMP) * mask
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).clamp(-LOG_CLAMP, LOG_CLAMP).expand_as(old_logp)
    return log_w


def rollout_is_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str,
                       threshold: float, mode: str) -> torch.Tensor:
    """The correction applied to each token's policy loss (detached): the IS weight truncated at
    `threshold` (TIS), or with `mode="mask"` kept where it lies within [1/threshold, threshold] and
    0 elsewhere (the token, or the whole sequence, leaves the loss)."""
    w = is_log_weights(old_logp, rollout_logp, mask, level).exp().detach()
    if mode == "truncate":
        return w.clamp(max=threshold)
    return torch.where((w <= threshold) & (w >= 1.0 / threshold), w, torch.zeros_like(w))


# --- the rollout/trainer gap's figures -----------------------------------------------------------
# Sums first, so that a distributed run adds up every rank's before dividing (Comm.sum / Comm.max).

SUMS = ("n", "d", "d2", "x", "y", "xy", "x2", "y2", "kl", "w", "w_high", "w_low", "w_n")
MAXES = ("d_max", "w_max")


def gap_sums(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str,
             threshold: float) -> tuple[list[float], list[float]]:
    """The sums (SUMS) and maxima (MAXES) behind `gap_metrics`, over the answer tokens of `mask`."""
    keep = mask.bool()
    t, r = trainer_logp.detach().float()[keep], rollout_logp.detach().float()[keep]
    x, y = r.exp(), t.exp()  # verl: rollout probs, actor probs
    d = (y - x).abs()
    log_ratio = (t - r).clamp(-LOG_CLAMP, LOG_CLAMP)
    kl = (log_ratio.exp() - log_ratio - 1).clamp_min(0)  # k3 of KL(rollout || trainer), from the rollout
    w = is_log_weights(trainer_logp.detach().float(), rollout_logp.detach().float(), mask, level).exp()
    w = w[:, 0][mask.sum(-1) > 0] if level == "sequence" else w[keep]
    sums = [t.numel(), d.sum(), d.pow(2).sum(), x.sum(), y.sum(), (x * y).sum(), x.pow(2).sum(), y.pow(2).sum(),
            kl.sum(), w.sum(), (w > threshold).sum(), (w < 1.0 / threshold).sum(), w.numel()]
    maxes = [d.max() if d.numel() else 0.0, w.max() if w.numel() else 0.0]
    return [float(v) for v in sums], [float(v) for v in maxes]


def gap_metrics(sums: list[float], maxes: list[float]) -> dict[str, float]:
    """verl's training/rollout_probs_diff_{mean,max,std} and rollout_actor_probs_pearson_corr,
    the mismatch KL (prime-rl's mismatch_kl), and the raw IS weights' figures (verl's rollout_corr/)."""
    s = dict(zip(SUMS, sums))
    m = dict(zip(MAXES, maxes))
    n, wn = max(s["n"], 1.0), max(s["w_n"], 1.0)
    mean = s["d"] / n
    var = max(0.0, (s["d2"] - n * mean * mean) / max(n - 1, 1.0))  # torch.std: unbiased
    cov = s["xy"] / n - (s["x"] / n) * (s["y"] / n)
    sx = math.sqrt(max(0.0, s["x2"] / n - (s["x"] / n) ** 2))
    sy = math.sqrt(max(0.0, s["y2"] / n - (s["y"] / n) ** 2))
    return {
        "training/rollout_probs_diff_mean": mean, "training/rollout_probs_diff_max": m["d_max"],
        "training/rollout_probs_diff_std": math.sqrt(var),
        # identical distributions (no spread) correlate perfectly
        "training/rollout_actor_probs_pearson_corr": cov / (sx * sy) if sx * sy > 0 else 1.0,
        "training/rollout_kl": s["kl"] / n,
        "rollout_corr/rollout_is_mean": s["w"] / wn, "rollout_corr/rollout_is_max": m["w_max"],
        "rollout_corr/rollout_is_ratio_fraction_high": s["w_high"] / wn,
        "rollout_corr/rollout_is_ratio_fraction_low": s["w_low"] / wn,
    }
