"""The rollout engine: samples each step's answers and reports what an inference engine reports,
the log-probability of every sampled token and (here, for MoE) the experts each token went to.

By default it samples with the trainer's own model under the trainer's autocast (one copy of the
weights, as before). With `--rollout-precision` or `--rollout-kernels` it holds a copy of its own,
in its own dtype (weights cast, as vLLM or SGLang load bf16 weights) and experts kernel, synced
from the policy before every rollout (as verl syncs its engine after each update). With
`--rollout-staleness N` the copy is synced from the policy as it was N steps before (kept as
snapshots of the weights, N + 1 of them): asynchronous RL, whose engine samples step s's answers
while the trainer is still making the updates of steps s - N..s - 1. In a
distributed run the copy is sharded like the policy (FSDP2, one unit per decoder layer) and the
sync copies each rank's own shards: no rank holds the whole model. The copy never trains.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from moe_proxy.rl.config import ReproConfig
from moe_proxy.rl.distributed import Comm, local, reshard, shard
from moe_proxy.rl.faults import FaultInjector
from moe_proxy.rl.precision import DTYPES, autocast, compute_in_fp32, fp32_modules
from moe_proxy.rl.routers import find_routers
from moe_proxy.rl.routing import RoutingRecorder

KERNELS = {"eager": "eager", "grouped": "grouped_mm"}  # --rollout-kernels -> transformers' name


@dataclass
class Rollout:
    """One step's samples, all ranks' rows (gathered): what the trainer needs of the engine."""

    response: torch.Tensor  # [rows, max_new_tokens] sampled token ids (padded past the end)
    logp: torch.Tensor  # [rows, max_new_tokens] the engine's log-probability of each sampled token
    routing: dict[int, torch.Tensor]  # layer -> [rows, positions, k]: experts chosen, prompt and answer


class RolloutEngine:
    def __init__(self, policy: torch.nn.Module, path, config: ReproConfig, comm: Comm, seed: int):
        from moe_proxy.rl.sharded_load import meta_model

        self.policy, self.config, self.comm = policy, config, comm
        self.separate = config.separate_rollout()
        self.faults = None
        if not self.separate:
            self.model = policy
        else:
            self.model = meta_model(path, DTYPES[config.rollout_precision or config.precision])
            routers = find_routers(self.model)
            kept = fp32_modules(self.model, routers, config.router_dtype, config.lm_head_dtype)
            for module in kept:
                module.float()
            # The same injected faults as the policy: a faulty kernel is one in both engines.
            self.faults = FaultInjector(self.model, routers, config.faults, seed)
            self.model.requires_grad_(False)
            shard(self.model, comm)
            self.model.to_empty(device=comm.device)
            for module in kept:
                compute_in_fp32(module)  # also casts the half-precision inputs its fp32 weights need
            with torch.no_grad():
                buffers = dict(self.model.named_buffers())
                for name, buffer in policy.named_buffers():  # rotary tables and correction biases, as trained
                    buffers[name].data = buffer.detach().clone()
            self.snapshots: list[dict[str, torch.Tensor]] = []  # the policy's weights, oldest first
            self.sync()
        self.recorder = RoutingRecorder(find_routers(self.model))

    @torch.no_grad()
    def sync(self) -> None:
        """Copy the policy's weights into the engine's copy, in the copy's dtype, shard by shard:
        the policy's weights as they are now, or with --rollout-staleness N as they were N syncs
        (steps) before; the first N steps sample with the starting weights."""
        if not self.separate:
            return
        weights = {name: local(param.detach()) for name, param in self.policy.named_parameters()}
        if self.config.rollout_staleness:
            self.snapshots.append({name: t.clone() for name, t in weights.items()})
            del self.snapshots[:-(self.config.rollout_staleness + 1)]
            weights = self.snapshots[0]
        mine = dict(self.model.named_parameters())
        for name, tensor in weights.items():
            local(mine[name]).copy_(tensor)

    def set_kernels(self, trainer_kernels: str | None) -> None:
        """The copy's experts kernel: --rollout-kernels, else the one the trainer uses this step."""
        wanted = KERNELS.get(self.config.rollout_kernels or "", trainer_kernels)
        if self.separate and wanted and self.model.config._experts_implementation != wanted:
            self.model.set_experts_implementation(wanted)

    def generate(self, input_ids: torch.Tensor, prompt_attn: torch.Tensor, blocks: list[torch.Tensor],
                 seeds: list[int], sampler, codec, precision: str, step: int) -> Rollout:
        """Sample this rank's block of rows (`blocks[rank]`), then gather every rank's."""
        from transformers import LogitsProcessorList

        cfg, comm = self.config, self.comm
        mine = blocks[comm.rank]
        if self.faults is not None:
            self.faults.step = step
        self.sync()
        self.model.eval()
        numerics = contextlib.nullcontext() if self.separate else autocast(precision, comm.device)
        self.recorder.start(len(mine))
        try:
            with torch.no_grad(), numerics:
                out = self.model.generate(
                    input_ids=input_ids[mine], attention_mask=prompt_attn[mine], do_sample=False,
                    logits_processor=LogitsProcessorList([sampler(seeds, cfg.temperature)]),
                    max_new_tokens=cfg.max_new_tokens, min_new_tokens=1, eos_token_id=codec.eos_id,
                    pad_token_id=codec.pad_id, remove_invalid_values=True, return_dict_in_generate=True,
                    output_logits=True, synced_gpus=comm.distributed)  # every rank runs forward until all end
        finally:
            routing = self.recorder.stop()
            if self.separate and comm.distributed:
                reshard(self.model)  # so that the next sync copies shards into shards
            if not self.separate:
                self.policy.train()
        width = input_ids.shape[1]
        response = out.sequences[:, width:]
        # The engine's log-probabilities are of its raw logits (vLLM's default), as the trainer's are.
        logp = torch.stack([torch.log_softmax(step_logits.float(), -1) for step_logits in out.logits], 1)
        logp = logp.gather(-1, response.unsqueeze(-1)).squeeze(-1)
        pad = cfg.max_new_tokens - response.shape[1]
        response = torch.nn.functional.pad(response, (0, pad), value=codec.pad_id)
        logp = torch.nn.functional.pad(logp, (0, pad), value=0.0)
        counts = [len(block) for block in blocks]
        return Rollout(comm.gather_rows(response, counts), comm.gather_rows(logp, counts),
                       {layer: comm.gather_rows(idx, counts) for layer, idx in routing.items()})
