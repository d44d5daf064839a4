"""The RL run (`moe-proxy repro`): GRPO-style steps on an original or proxy checkpoint. Owns
the runner (`runner`), the rollout copy (`rollout`), the policy loss (`policy_loss`), the
routers and routing replay (`routers`, `routing`), precision (`precision`), one run over W ranks
(`distributed`, `launch`, `device`; models loaded straight into their FSDP2 shards:
`sharded_load`), the run's settings (`config`), prompts (`task`), fault injection (`faults`)
and the run's checkpoint (`source`). Per-step metrics are named as verl names them; writing
them and judging the run is `moe_proxy.metrics`' job.

Imports nothing itself, so the torch-free parts (`config`, `source`) stay importable without
torch: take names from the submodules (`rl.runner.run_repro`)."""
