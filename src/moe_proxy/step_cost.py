"""What one RL step costs, phase by phase, on a given accelerator: the time model behind
`moe-proxy plan`'s device-hours (sizing.py) and bench/rl_cost.py's check against measured steps.
Torch-free: config.json figures and arithmetic only.

Every phase runs on all of a side's devices, one after the other (verl's colocated hybrid
engine; overlap of communication with compute is not counted, so the all-to-all is an upper
bound). Compute runs at `mfu` of peak, memory traffic at `hbm_efficiency` of the bandwidth:

- rollout prefill: 2 x active params FLOPs per prompt token, plus attention (QK^T and AV over
  the context so far);
- rollout decode, `response_tokens` steps: each reads the non-expert weights, every routed
  expert some sequence of the batch picked (n x (1 - (1 - k/n)^batch) per layer for uniform
  routing: with large batches nearly all of them) and the KV cache of the batch; the step takes
  the longer of that traffic and its FLOPs. The rollout engine is split into replicas of the
  fewest whole nodes that hold the weights; each decodes its share of the sequences and reads
  its own copy of the weights;
- old-log-prob and reference passes: one forward each over prompt + response; with one update
  per step the old policy is the policy itself and its log-probs come from the update's own
  forward (as in repro, verl and TRL), so there is no old-log-prob pass;
- training: forward + backward (3 forwards' FLOPs), plus one forward more with activation
  recomputation;
- optimizer, `updates` times per step: every sharded byte of weights, gradients and Adam states
  read, weights and states written, over HBM;
- weight sync: each rollout device receives its shard of the weights, the part from other
  nodes over the inter-node link;
- expert-parallel all-to-all: each token's hidden state to its k experts and back (2 x k x H
  elements per MoE layer per pass: rollout, log-prob passes, forward, backward, recompute),
  over the inter-node link for the part of the experts on other nodes (experts spread over
  min(experts, devices) devices), the intra-node link for the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Accelerator:
    resource: str  # Kubernetes extended resource name
    memory_gb: float  # per device, decimal GB as vendors state it
    peak_tflops: float  # dense 16-bit
    hbm_tbps: float  # memory bandwidth, TB/s
    intra_gbps: float = 0.0  # intra-node link per device, one direction, GB/s (inf: shared memory)
    inter_gbps: float = 0.0  # inter-node link per device, one direction, GB/s
    name: str = ""  # the product, as docs/performance.md lists it


@dataclass(frozen=True)
class StepShape:
    """The shape of one RL step (defaults: a typical GRPO step, e.g. 64 prompts x 8 answers)."""

    sequences: int = 512  # rollouts per step (prompts x group size)
    prompt_tokens: int = 512
    response_tokens: int = 1536
    updates: int = 4  # optimizer steps per RL step (PPO mini-batches)
    recompute: bool = True  # full activation checkpointing: one more forward in training
    reference: bool = True  # a frozen reference policy's forward (KL term)
    mfu: float = 0.3  # achieved fraction of peak FLOP/s in compute-bound phases
    hbm_efficiency: float = 0.7  # achieved fraction of HBM bandwidth in memory-bound phases

    @property
    def tokens(self) -> int:
        return self.sequences * (self.prompt_tokens + self.response_tokens)


@dataclass(frozen=True)
class ModelShape:
    """What the phases need of one model (original or proxy), from config.json."""

    params_total: int
    params_active: int
    expert_params: int  # one routed expert (its projections and router row)
    experts: int  # routed experts per MoE layer
    top_k: int
    moe_layers: int
    layers: int
    hidden: int
    attention_width: int  # heads x (qk head dim + v head dim): attention FLOPs per context token / 2
    kv_elements: int  # KV-cache elements per token per layer
    bytes_per_param: int  # weights and activations
    optimizer_bytes: int  # per parameter: Adam states (and fp32 master copy)


@dataclass(frozen=True)
class Phases:
    """Seconds per RL step, by phase, on the side's devices."""

    rollout_prefill: float
    rollout_decode: float
    old_log_prob: float
    reference: float
    train: float
    optimizer: float
    weight_sync: float
    all_to_all: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    def items(self) -> list[tuple[str, float]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self)]


def touched_experts(experts: int, k: int, batch: int) -> float:
    """Expected distinct experts of one layer that `batch` tokens pick, top-k each, routed uniformly."""
    return experts * (1 - (1 - min(k, experts) / experts) ** batch)


def rollout_devices(m: ModelShape, devices: int, per_node: int, usable_bytes: float) -> int:
    """Devices of one rollout replica: the fewest whole nodes (or devices, under one node) whose
    usable memory holds the weights, at most all `devices`."""
    need = max(1, math.ceil(m.params_total * m.bytes_per_param / usable_bytes))
    if need > per_node:
        need = math.ceil(need / per_node) * per_node
    return min(devices, need)


def phases(m: ModelShape, w: StepShape, acc: Accelerator, devices: int, per_node: int, usable_bytes: float) -> Phases:
    flops = devices * acc.peak_tflops * 1e12 * w.mfu  # all devices, FLOP/s
    hbm = acc.hbm_tbps * 1e12 * w.hbm_efficiency  # one device, B/s
    p, r = w.prompt_tokens, w.response_tokens

    def forward(tokens_per_seq: int, seqs: int) -> float:  # FLOPs of a causal forward over whole sequences
        return seqs * (2 * m.params_active * tokens_per_seq + 2 * m.layers * m.attention_width * tokens_per_seq ** 2 / 2)

    # decode: replicas of `d_r` devices, each with its share of the sequences and its own weights
    d_r = rollout_devices(m, devices, per_node, usable_bytes)
    batch = math.ceil(w.sequences / max(1, devices // d_r))
    context = p + r / 2  # the mean over the decode steps
    backbone = m.params_total - m.moe_layers * m.experts * m.expert_params
    read = (backbone + m.moe_layers * touched_experts(m.experts, m.top_k, batch) * m.expert_params) * m.bytes_per_param
    read += batch * context * m.layers * m.kv_elements * m.bytes_per_param
    step_flops = batch * (2 * m.params_active + 2 * m.layers * m.attention_width * context)
    replica_flops = d_r * acc.peak_tflops * 1e12 * w.mfu
    decode = r * max(read / (d_r * hbm), step_flops / replica_flops)

    full = forward(p + r, w.sequences)
    optimizer_bytes = m.params_total * (3 * m.bytes_per_param + 2 * m.optimizer_bytes)

    # weight sync: a rollout device's shard, the part held on other nodes over the inter-node link
    local = min(1.0, per_node / devices)
    shard = m.params_total * m.bytes_per_param / d_r
    sync = shard * (local / _bps(acc.intra_gbps) + (1 - local) / _bps(acc.inter_gbps)) if devices > 1 else 0.0

    # all-to-all: experts over min(experts, devices) devices on `nodes` nodes
    ep = min(m.experts, devices)
    nodes = math.ceil(ep / per_node)
    old = w.updates > 1  # one update: the old log-probs are the update's own forward's
    passes = 1 + old + w.reference + 2 + w.recompute  # rollout, old, ref, fwd + bwd, recompute
    volume = passes * w.tokens * m.moe_layers * 2 * m.top_k * m.hidden * m.bytes_per_param / devices
    a2a = volume * ((1 - 1 / nodes) / _bps(acc.inter_gbps) + max(0.0, 1 / nodes - 1 / ep) / _bps(acc.intra_gbps))

    return Phases(
        rollout_prefill=forward(p, w.sequences) / flops,
        rollout_decode=decode,
        old_log_prob=full / flops if old else 0.0,
        reference=full / flops if w.reference else 0.0,
        train=(3 + w.recompute) * full / flops,
        optimizer=w.updates * optimizer_bytes / devices / hbm,
        weight_sync=sync,
        all_to_all=a2a,
    )


def _bps(gbps: float) -> float:
    """A link's bytes per second; an unknown link (0) is taken as infinitely fast."""
    return gbps * 1e9 if gbps > 0 else math.inf
