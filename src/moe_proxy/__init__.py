"""moe-proxy: structure-preserving expert pruning of MoE LLM checkpoints.

A proxy keeps every layer, hidden size, attention block, router mechanism, shared expert and
the tokenizer of the original, and only fewer routed experts per MoE layer, so that RL
post-training failures of the original can be reproduced on a fraction of the accelerators.
"""

__version__ = "0.1.0"

# The torch-free line: every module the operator and the header-only commands (`--help`,
# `inspect`, `plan`, `checkpoints`) may import. Each imports without torch, transformers,
# scikit-learn or scipy (tests/house/test_torch_free.py blocks them and imports each); every
# other module may need them. Commands import their implementation when they run.
TORCH_FREE = (
    "moe_proxy",
    "moe_proxy.reports",  # exit codes and termination messages: the CLI-operator contract
    "moe_proxy.errors",
    "moe_proxy.options",  # every stage's options, declared once
    "moe_proxy.architectures",  # the one place that knows model types
    "moe_proxy.checkpoint.params",  # parameter counts from config.json or from headers
    "moe_proxy.sizing",  # accelerators for RL on the original and the proxy
    "moe_proxy.step_cost",  # an RL step's time by phase
    "moe_proxy.storage",
    "moe_proxy.storage.s3",  # boto3, not torch
    "moe_proxy.storage.materialize",
    "moe_proxy.checkpoint.reader",  # config, index and safetensors headers
    "moe_proxy.checkpoint.reads",  # the build's read path
    "moe_proxy.checkpoint.layout",
    "moe_proxy.checkpoint.listing",  # the listing (`checkpoints`, the operator's CheckpointWatch)
    "moe_proxy.checkpoint.summary",  # `inspect`
    "moe_proxy.pruning.writer",
    "moe_proxy.pruning.config",
    "moe_proxy.rl",
    "moe_proxy.rl.config",
    "moe_proxy.rl.source",  # a run's checkpoint, checked before torch loads
    "moe_proxy.metrics",
    "moe_proxy.metrics.compare",  # numpy only
    "moe_proxy.metrics.plots",  # matplotlib when a plot is drawn
    "moe_proxy.metrics.detect",
    "moe_proxy.metrics.metrics_io",
    "moe_proxy.metrics.readers",  # every format, local or s3:// (tensorboard, not torch)
    "moe_proxy.metrics.sources",
    "moe_proxy.metrics.watch",
    "moe_proxy.metrics.incident",  # the operator's watched run
    "moe_proxy.investigate",
    "moe_proxy.investigate.catalogue",  # diagnose's candidate fixes: repro flags
    "moe_proxy.investigate.diagnose",  # runs are child processes: torch loads in them
    "moe_proxy.investigate.processes",
    "moe_proxy.investigate.bisect",
    "moe_proxy.investigate.triage",  # the loop: detect, bisect, diagnose, report
    "moe_proxy.cli",
    "moe_proxy.commands",
    "moe_proxy.commands._common",
    "moe_proxy.commands.build",
    "moe_proxy.commands.calibrate",
    "moe_proxy.commands.checkpoints",
    "moe_proxy.commands.compare",
    "moe_proxy.commands.diagnose",
    "moe_proxy.commands.bisect",
    "moe_proxy.commands.triage",
    "moe_proxy.commands.inspect",
    "moe_proxy.commands.plan",
    "moe_proxy.commands.repro",
    "moe_proxy.commands.verify",
    "moe_proxy.commands.watch",
)
