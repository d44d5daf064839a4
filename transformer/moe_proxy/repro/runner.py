"""The reproduction run: GRPO-style RL steps on a checkpoint, one metrics line per step.

One step = sample `group_size` answers to each of `batch_size` prompts, score them with the
task's rule-based reward, normalise the rewards within each group (GRPO advantages), then
`mini_batches` clipped policy-gradient updates with a k3 KL term to a frozen copy of the
starting model (verl's use_kl_loss) and optional router load-balancing / z losses.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from moe_proxy.repro.config import ReproConfig
from moe_proxy.repro.detect import FailureDetector, Signature, Thresholds
from moe_proxy.repro.device import pick_device
from moe_proxy.repro.faults import FaultInjector
from moe_proxy.repro.metrics_io import METRICS_FILE, SUMMARY_FILE, append_step, finite_or_none
from moe_proxy.repro.routers import RouterTap
from moe_proxy.repro.source import local_checkpoint
from moe_proxy.repro.task import Codec, make_prompts, reward

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Metrics copied into the operator's termination log (it must stay under 4 KB).
HEADLINE = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "critic/rewards/mean",
            "moe/load_max_share", "numerics/max_activation", "numerics/loss_scale")
_LAYER = re.compile(r"layers\.(\d+)\.")
_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+$")


@dataclass
class RunResult:
    steps_completed: int
    failures: dict[str, dict]
    reproduced: bool
    signature: str | None
    step: int | None
    last_metrics: dict[str, float] = field(default_factory=dict)


def run_repro(checkpoint: str, out_dir: str | Path, config: ReproConfig, *, fail_on: Signature | None = None,
              thresholds: Thresholds | None = None, device: str | None = None,
              termination_log: str | Path | None = None) -> RunResult:
    """Run `config.steps` RL steps on `checkpoint`, writing metrics.jsonl and summary.json into
    `out_dir`. Stops early once `fail_on` is detected, or when the loss or weights are NaN."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (METRICS_FILE, SUMMARY_FILE):  # a rerun into the same directory starts afresh
        (out / stale).unlink(missing_ok=True)
    detector = FailureDetector(thresholds or Thresholds(), extra=[fail_on] if fail_on and fail_on.metric else [])
    started = time.time()
    last: dict[str, float] = {}
    steps_done, stop_reason, device_used = 0, "completed", device
    try:
        with local_checkpoint(checkpoint) as path:
            loop = _Loop(path, config, pick_device(device))
            device_used = str(loop.device)
            for step in range(config.steps):
                last = loop.step(step)
                append_step(out / METRICS_FILE, step, last)
                steps_done = step + 1
                for name in detector.update(step, last):
                    onset = detector.onsets[name]
                    log.info("step %d: %s detected (%s)", onset.step, name, onset.detail)
                if fail_on and fail_on.name in detector.onsets:
                    stop_reason = f"reproduced {fail_on.name}"
                    break
                if "nan" in detector.onsets:
                    stop_reason = "loss or weights are NaN; later steps would be meaningless"
                    break
                log.info("step %d: reward %.3f grad_norm %.4g pg_loss %.4g", step, last["critic/rewards/mean"],
                         last["actor/grad_norm"], last["actor/pg_loss"])
    except BaseException as exc:  # the steps recorded so far stay readable, and say why they end
        stop_reason = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"error: {type(exc).__name__}: {exc}"
        raise
    finally:
        result = _result(detector, fail_on, steps_done, last)
        summary = {
            "checkpoint": checkpoint, "device": device_used, "steps_requested": config.steps,
            "steps_completed": steps_done, "stopped": stop_reason, "wall_s": round(time.time() - started, 3),
            "failures": result.failures,
            "first_failure": ({"signature": result.signature, "step": result.step} if result.signature else None),
            "fail_on": fail_on.name if fail_on else None, "reproduced": result.reproduced,
            "thresholds": detector.thresholds.__dict__, "config": config.to_dict(),
        }
        (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n")
        if termination_log:
            _write_termination_log(Path(termination_log), result)
    return result


def _result(detector: FailureDetector, fail_on: Signature | None, steps: int, last: dict) -> RunResult:
    failures = detector.to_dict()
    if fail_on:  # reproduced = the named failure happened
        onset = detector.onsets.get(fail_on.name)
        signature, step = (fail_on.name, onset.step) if onset else (None, None)
    else:  # no target: report the first failure of any kind
        first = detector.first()
        signature, step = (first[0], first[1].step) if first else (None, None)
    return RunResult(steps, failures, signature is not None, signature, step, last)


def _write_termination_log(path: Path, result: RunResult) -> None:
    # Kubernetes keeps at most 4 KB of a container's termination message.
    payload = {"reproduced": result.reproduced, "signature": result.signature, "step": result.step,
               "metrics": {k: finite_or_none(result.last_metrics.get(k)) for k in HEADLINE
                           if k in result.last_metrics}}
    text = json.dumps(payload, allow_nan=False)
    if len(text.encode()) > 4000:
        payload["metrics"] = {}
        text = json.dumps(payload, allow_nan=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _aggregate(updates: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from its mini-batch updates: means (as verl), but sums of counts and
    maxima of magnitudes, so that one bad update is not averaged away."""
    m = {key: float(np.mean([u[key] for u in updates])) for key in updates[0]}
    for key in ("numerics/nonfinite_grads", "numerics/nonfinite_activations", "numerics/skipped_steps",
                "numerics/loss_scale_backoffs"):
        m[key] = float(sum(u[key] for u in updates))
    for key in ("numerics/max_activation", "numerics/max_logit", "moe/router_logit_max"):
        m[key] = float(max(u[key] for u in updates))
    m["numerics/grad_overflow"] = float(m["numerics/nonfinite_grads"] > 0)
    return m


def _batch_metrics(batch: dict[str, torch.Tensor], max_new_tokens: int) -> dict[str, float]:
    scores, adv, lengths = batch["scores"], batch["adv"], batch["lengths"].float()
    return {
        "critic/score/mean": scores.mean().item(),
        "critic/rewards/mean": scores.mean().item(), "critic/rewards/max": scores.max().item(),
        "critic/rewards/min": scores.min().item(),
        "critic/advantages/mean": adv.mean().item(), "critic/advantages/max": adv.max().item(),
        "critic/advantages/min": adv.min().item(),
        "response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
        "response_length/min": lengths.min().item(),
        "response_length/clip_ratio": (lengths >= max_new_tokens).float().mean().item(),
    }


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp_min(1)


class ActivationWatch:
    """The residual stream after every decoder layer (the last one before the final norm):
    its largest finite magnitude, and how many values are not finite. In fp16/bf16 a value
    beyond the dtype's range (fp16: 65504) comes out as inf or, from a CPU matmul, NaN: an
    overflow in the forward pass, which no loss scaling can save."""

    def __init__(self, model: torch.nn.Module):
        self.recording = False
        self.max_abs, self.nonfinite = 0.0, 0
        for name, module in model.named_modules():
            if _DECODER_LAYER.search(name):
                module.register_forward_hook(self._hook)

    def _hook(self, _module, _inputs, output) -> None:
        if not self.recording:
            return
        h = (output[0] if isinstance(output, tuple) else output).detach()
        finite = torch.isfinite(h)
        if finite.any():
            self.max_abs = max(self.max_abs, h[finite].abs().max().item())
        self.nonfinite += int((~finite).sum())

    def start(self) -> None:
        self.max_abs, self.nonfinite, self.recording = 0.0, 0, True

    def stop(self) -> None:
        self.recording = False

    def metrics(self) -> dict[str, float]:
        largest = math.inf if self.nonfinite else self.max_abs
        return {"numerics/max_activation": largest, "numerics/nonfinite_activations": float(self.nonfinite)}


class _Loop:
    """Models, optimiser and per-step state of one run."""

    def __init__(self, path: Path, config: ReproConfig, device: torch.device):
        from transformers import AutoModelForCausalLM

        self.config, self.device = config, device
        random.seed(config.seed)
        np.random.seed(config.seed)
        torch.manual_seed(config.seed)
        self.policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        self.fp32_experts = getattr(self.policy.config, "_experts_implementation", None)
        self.codec = Codec(path, self.policy.config.vocab_size)
        top_k = getattr(self.policy.config, "num_experts_per_tok", None) or 1
        self.tap = RouterTap(self.policy, top_k)
        self.faults = FaultInjector(self.policy, self.tap.routers, config.faults, config.seed)
        self.activations = ActivationWatch(self.policy)
        self.params = [p for p in self.policy.parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in self.policy.named_parameters()}
        # Router weights are not dense in the underflow sense: with a renormalised top-k, the row
        # of an expert no token chose gets no gradient (exactly 0 in fp16, rounding noise in fp32).
        self.router_params = {id(p) for r in self.tap.routers for p in r.module.parameters()}
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=0.0)
        self.scaler = torch.amp.GradScaler(device.type, init_scale=config.init_loss_scale)

    def _experts_kernel(self, precision: str) -> None:
        """transformers' default experts kernel (grouped_mm) is not autocast-enabled: under fp16/bf16
        autocast the experts would still compute in fp32, hiding the overflows a half-precision job
        has (a super expert's massive activation). Half-precision steps use the eager kernel, whose
        linears autocast covers; fp32 steps keep the faster default, so they stay bitwise equal to
        the same run without an fp16 fault."""
        wanted = self.fp32_experts if precision == "fp32" else "eager"
        if self.fp32_experts is None or self.policy.config._experts_implementation == wanted:
            return
        for model in (self.policy, self.reference):
            model.set_experts_implementation(wanted)

    def _autocast(self, precision: str):
        if precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[precision])

    def step(self, step: int) -> dict[str, float]:
        cfg = self.config
        self.faults.step = step
        precision, scaled = cfg.precision_at(step)
        self._experts_kernel(precision)
        lr = cfg.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()

        batch = self._rollout(step, precision)
        t_gen = time.perf_counter()
        with torch.no_grad(), self._autocast(precision):
            old_logp = self._logp(self.policy, batch)[0]
            t_old = time.perf_counter()
            ref_logp = self._logp(self.reference, batch)[0]
        t_ref = time.perf_counter()

        updates = [self._update(batch, idx, old_logp[idx], ref_logp[idx], precision, scaled)
                   for idx in torch.arange(batch["seq"].shape[0]).chunk(cfg.mini_batches)]
        t_end = time.perf_counter()

        m = _aggregate(updates)
        m["numerics/half_precision"] = float(precision != "fp32")
        if scaled:
            m["numerics/loss_scale"] = float(self.scaler.get_scale())
        m["numerics/params_nonfinite"] = float(sum(int(not torch.isfinite(p).all()) for p in self.params))
        m.update(_batch_metrics(batch, cfg.max_new_tokens))
        m.update({
            "training/global_step": float(step), "actor/lr": lr, "actor/kl_coef": cfg.kl_coef,
            "timing_s/gen": t_gen - t0, "timing_s/old_log_prob": t_old - t_gen, "timing_s/ref": t_ref - t_old,
            "timing_s/update_actor": t_end - t_ref, "perf/time_per_step": t_end - t0,
            "perf/total_num_tokens": float(batch["attn"].sum().item()),
        })
        m["perf/throughput"] = m["perf/total_num_tokens"] / max(m["perf/time_per_step"], 1e-9)
        return m

    def _rollout(self, step: int, precision: str) -> dict[str, torch.Tensor]:
        cfg, codec = self.config, self.codec
        prompt_seed = cfg.seed if cfg.prompt_seed is None else cfg.prompt_seed
        prompts = make_prompts(cfg.task, prompt_seed, step, cfg.batch_size)
        encoded = [codec.encode(p.text) for p in prompts for _ in range(cfg.group_size)]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.full((len(encoded), width), codec.pad_id, dtype=torch.long)
        prompt_attn = torch.zeros_like(input_ids)
        for row, ids in enumerate(encoded):  # left padding: every answer starts at the same column
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            prompt_attn[row, width - len(ids):] = 1
        input_ids, prompt_attn = input_ids.to(self.device), prompt_attn.to(self.device)
        torch.manual_seed(cfg.seed * 1_000_003 + step)
        self.policy.eval()
        with torch.no_grad(), self._autocast(precision):
            out = self.policy.generate(
                input_ids=input_ids, attention_mask=prompt_attn, do_sample=True, temperature=cfg.temperature,
                top_k=0, top_p=1.0, max_new_tokens=cfg.max_new_tokens, min_new_tokens=1,
                eos_token_id=codec.eos_id, pad_token_id=codec.pad_id, remove_invalid_values=True)
        self.policy.train()
        response = out[:, width:]
        # The answer runs up to and including the first end-of-sequence token.
        is_eos = (response == codec.eos_id).long()
        resp_mask = ((is_eos.cumsum(-1) - is_eos) == 0).long()
        lengths = resp_mask.sum(-1)
        scores = torch.tensor([
            reward(codec.decode(response[i, : lengths[i]].tolist()), prompts[i // cfg.group_size].answer)
            for i in range(len(encoded))])
        grouped = scores.view(cfg.batch_size, cfg.group_size)
        adv = ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-6)).reshape(-1)
        attn = torch.cat([prompt_attn, resp_mask], dim=-1)
        return {"seq": out, "attn": attn, "positions": (attn.cumsum(-1) - 1).clamp_min(0),
                "resp_mask": resp_mask.float(), "prompt_len": torch.tensor(width), "lengths": lengths,
                "scores": scores, "adv": adv.to(self.device)}

    def _logp(self, model, batch, idx=None, **kwargs):
        """Log-probabilities of the answer tokens (and the forward output)."""
        sel = slice(None) if idx is None else idx
        seq = batch["seq"][sel]
        out = model(input_ids=seq, attention_mask=batch["attn"][sel], position_ids=batch["positions"][sel], **kwargs)
        width = int(batch["prompt_len"])
        logits = out.logits[:, width - 1: -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, seq[:, width:].unsqueeze(-1)).squeeze(-1)
        return logp, logits, out

    def _update(self, batch, idx, old_logp, ref_logp, precision: str, scaled: bool) -> dict[str, float]:
        cfg = self.config
        mask, adv = batch["resp_mask"][idx].to(self.device), batch["adv"][idx].unsqueeze(-1)
        self.tap.start(batch["attn"][idx])
        with self._autocast(precision):
            self.activations.start()
            logp, logits, _ = self._logp(self.policy, batch, idx)
            self.activations.stop()
        self.tap.stop()

        ratio = torch.exp(logp - old_logp)
        pg_losses = -adv * ratio
        pg_clipped = -adv * ratio.clamp(1 - cfg.clip_ratio, 1 + cfg.clip_ratio)
        pg_loss = _masked_mean(torch.maximum(pg_losses, pg_clipped), mask)
        log_ratio = (ref_logp - logp).clamp(-20, 20)
        kl_loss = _masked_mean((log_ratio.exp() - log_ratio - 1).clamp(-10, 10), mask)  # k3 estimator
        aux_loss, z_loss = self.tap.aux_losses()
        loss = pg_loss + cfg.kl_coef * kl_loss + cfg.router_aux_coef * aux_loss + cfg.router_z_coef * z_loss
        with torch.no_grad():
            probs = logits.softmax(-1)
            entropy = _masked_mean(-(probs * probs.clamp_min(1e-30).log()).sum(-1), mask)
            metrics = {
                "actor/pg_loss": pg_loss.item(), "actor/kl_loss": kl_loss.item(), "actor/entropy": entropy.item(),
                "actor/ppo_kl": _masked_mean(old_logp - logp, mask).item(),
                "actor/pg_clipfrac": _masked_mean((pg_clipped > pg_losses).float(), mask).item(),
                "moe/aux_loss": aux_loss.item(), "moe/z_loss": z_loss.item(),
                **self.activations.metrics(),
                "numerics/max_logit": logits.abs().max().item(),
                **self.tap.metrics(),
            }

        self.optimizer.zero_grad(set_to_none=True)
        (self.scaler.scale(loss) if scaled else loss).backward()
        if scaled:
            self.scaler.unscale_(self.optimizer)
        metrics.update(self._grad_stats())
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm).item()
        metrics["actor/grad_norm"] = grad_norm
        found_inf = metrics["numerics/nonfinite_grads"] > 0
        backoff = 0.0
        if scaled:
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skips the update when gradients overflowed
            self.scaler.update()
            backoff = float(self.scaler.get_scale() < before)
        elif not found_inf:
            self.optimizer.step()
        # Otherwise skip the update, as verl's actor does when grad_norm is not finite.
        metrics["numerics/skipped_steps"] = float(found_inf)
        metrics["numerics/loss_scale_backoffs"] = backoff
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def _grad_stats(self) -> dict[str, float]:
        nonfinite, zeros, total, dense_zeros, dense_total = 0, 0, 0, 0, 0
        layer_sq: dict[int, float] = {}
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad.detach()
            nonfinite += int((~torch.isfinite(g)).sum().item())
            zeros += int((g == 0).sum().item())
            total += g.numel()
            name = self.names[id(p)]
            # Dense weights get a gradient from every token, so in fp32 none of its elements is
            # exactly 0; zeros there are values flushed by fp16 underflow. (Unrouted experts, router
            # rows of unchosen experts and unused embedding rows are legitimately zero: left out.)
            if "experts" not in name and "embed" not in name and id(p) not in self.router_params:
                dense_zeros += int((g == 0).sum().item())
                dense_total += g.numel()
            match = _LAYER.search(name)
            if match:
                layer = int(match.group(1))
                layer_sq[layer] = layer_sq.get(layer, 0.0) + g.float().pow(2).sum().item()
        stats = {f"numerics/grad_norm/layer_{k}": math.sqrt(v) for k, v in sorted(layer_sq.items())}
        stats["numerics/nonfinite_grads"] = float(nonfinite)
        stats["numerics/grad_zero_frac"] = zeros / max(1, total)
        stats["numerics/dense_grad_zero_frac"] = dense_zeros / max(1, dense_total)
        return stats
