"""The metrics of a run, from any framework: read them (`metrics_io` for verl's JSONL,
`readers` and `profiles` for other formats and names), detect failure signatures (`detect`),
judge the run (`verdict`), follow a running one (`watch`, the sidecar), compare runs
(`compare`) and plot them (`plots`).

Imports nothing from the RL run (`moe_proxy.rl` writes through this package, never the other
way), so a sidecar or the operator reads and judges metrics without the runner; torch-free."""
