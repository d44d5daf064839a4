"""Everything `moe-proxy repro` takes, declared once as options models: the RL settings
(config.ReproConfig), how the run reports and stops (RunOptions, metrics' FailOnOption, the shared
OutputOptions), where its ranks run (PlacementOptions) and the faults it injects on purpose
(FaultOptions). `repro_settings(flags)` turns a flag list into the run's settings: the CLI,
diagnose, bisect and the operator all read repro flags through it, so none needs a parser of
its own or another command's. Torch-free.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from moe_proxy.errors import InvalidReproConfig
from moe_proxy.metrics.detect import FailOnOption
from moe_proxy.options import OutputOptions, add_arguments, from_args, option, parse_flags
from moe_proxy.rl.config import OP_FAULT_MODES, Faults, RankFault, ReproConfig

_PLACED = "the operator places the ranks from spec.reproduction.accelerator"
_LAB = "fault injection checks a proxy in the fidelity lab; a user's run has its own failure"


@dataclass
class RunOptions:
    """Where a run computes and what it trains on, besides its RL settings."""

    device: str | None = option(None, "str", "cpu, cuda, npu, ... (default: NPU, else CUDA, else CPU)",
                                cli_only="spec.reproduction.accelerator")
    prompts: str | None = option(None, "str", "verl RL data (parquet or JSON lines, local or s3://): each row's chat "
                                 "`prompt` and `reward_model.ground_truth`, answers scored by exact match (default: "
                                 "the built-in arithmetic task)", metavar="FILE",
                                 cli_only="not yet a ProxyModel field: a user's own data runs through "
                                 "spec.reproduction.args or template")


@dataclass
class PlacementOptions:
    """One run over several ranks and nodes (policy and reference sharded with FSDP2)."""

    nproc_per_node: int | None = option(None, "int", "start P ranks on this node (one per device; any number on the "
                                        "CPU) through torch.distributed.run. Under torchrun (RANK/WORLD_SIZE set) the "
                                        "process joins that job instead", metavar="P", cli_only=_PLACED)
    nnodes: int = option(1, "int", "nodes in the run", metavar="N", cli_only=_PLACED)
    node_rank: int = option(0, "int", "this node's rank, 0..N-1", metavar="R", cli_only=_PLACED)
    master_addr: str | None = option(None, "str", "node 0's address (required with --nnodes > 1)", metavar="A",
                                     cli_only=_PLACED)
    master_port: int = option(29500, "int", "node 0's rendezvous port (with --master-addr)", metavar="Q",
                              cli_only=_PLACED)
    dist_timeout: float | None = option(None, "float", "a collective waiting longer ends the run, naming the rank "
                                        "that is missing (default 600)", metavar="SECONDS",
                                        cli_only="the operator's default; a hung rank is named in status")

    def check(self) -> None:
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise InvalidReproConfig(f"--nproc-per-node {self.nproc_per_node}: at least 1 rank per node")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise InvalidReproConfig(f"--nnodes {self.nnodes} --node-rank {self.node_rank}: the node rank must be "
                                     f"in 0..{self.nnodes - 1}")


@dataclass
class FaultOptions:
    """Faults injected on purpose (off by default), as the flags spell them."""

    fault_fp16_no_scaling: int | None = option(None, "int", "fp16 without loss scaling from STEP", metavar="STEP",
                                               cli_only=_LAB)
    fault_lr_spike: str | None = option(None, "str", "multiply the lr of STEP (default x100)",
                                        metavar="STEP[:FACTOR]", cli_only=_LAB)
    fault_router_scale: str | None = option(None, "str", "scale router logits from STEP (default x10)",
                                            metavar="STEP[:FACTOR]", cli_only=_LAB)
    fault_op: str | None = option(None, "str", "perturb MODULE's output from STEP, e.g. model.layers.1.mlp@5",
                                  metavar="MODULE@STEP", cli_only=_LAB)
    fault_op_mode: str = option("scale", "str", "scale: output x value; noise: + value x N(0, std(output)); nan: "
                                "one element made NaN", choices=OP_FAULT_MODES, cli_only=_LAB)
    fault_op_value: float = option(100.0, "float", "factor (scale) or relative std (noise)", cli_only=_LAB)
    fault_rank_exit: str | None = option(None, "str", "kill rank RANK (SIGKILL) when STEP starts",
                                         metavar="RANK@STEP", cli_only=_LAB)
    fault_rank_hang: str | None = option(None, "str", "rank RANK stops answering when STEP starts",
                                         metavar="RANK@STEP", cli_only=_LAB)

    def faults(self) -> Faults:
        lr_step, lr_factor = _step_factor(self.fault_lr_spike, 100.0, "--fault-lr-spike")
        router_step, router_factor = _step_factor(self.fault_router_scale, 10.0, "--fault-router-scale")
        op_module, op_step = None, None
        if self.fault_op:
            op_module, _, step = self.fault_op.rpartition("@")
            if not op_module or not step.isdigit():
                raise InvalidReproConfig(f"--fault-op {self.fault_op!r}: expected MODULE@STEP")
            op_step = int(step)
        return Faults(fp16_no_scaling_step=self.fault_fp16_no_scaling, lr_spike_step=lr_step,
                      lr_spike_factor=lr_factor, router_scale_step=router_step, router_scale_factor=router_factor,
                      op_module=op_module, op_step=op_step, op_mode=self.fault_op_mode, op_value=self.fault_op_value)

    def rank_fault(self) -> RankFault | None:
        if self.fault_rank_exit and self.fault_rank_hang:
            raise InvalidReproConfig("--fault-rank-exit and --fault-rank-hang: one rank fault at a time")
        return (RankFault.parse(self.fault_rank_exit, "exit") if self.fault_rank_exit else
                RankFault.parse(self.fault_rank_hang, "hang") if self.fault_rank_hang else None)


def _step_factor(text: str | None, default: float, flag: str) -> tuple[int | None, float]:
    if text is None:
        return None, default
    step, _, factor = text.partition(":")
    try:
        return int(step), float(factor) if factor else default
    except ValueError:
        raise InvalidReproConfig(f"{flag} {text!r}: expected STEP or STEP:FACTOR") from None


# The shared output flags repro has (how it reports: a pod's log has no terminal).
OUTPUT = ("no_progress", "termination_log")


@dataclass
class ReproSettings:
    """A reproduction as its flags give it, each part checked."""

    config: ReproConfig
    run: RunOptions
    fail_on: str | None
    output: OutputOptions
    placement: PlacementOptions
    rank_fault: RankFault | None


def add_repro_arguments(parser) -> None:
    """repro's flags, grouped as its help shows them."""
    add_arguments(parser, ReproConfig, only=("steps", "seed"))
    add_arguments(parser, RunOptions, only=("device",))
    add_arguments(parser, FailOnOption)
    add_arguments(parser, OutputOptions, only=OUTPUT, helps={
        "no_progress": "no progress bars (transformers' weight loading; the launched ranks inherit it)",
        "termination_log": "also write {reproduced, signature, step, metrics} JSON here (Kubernetes' "
                           "/dev/termination-log)"})
    add_arguments(parser, RunOptions, only=("prompts",))
    add_arguments(parser.add_argument_group("distributed (one run over all ranks; policy and reference sharded "
                                            "with FSDP2)"), PlacementOptions)
    add_arguments(parser.add_argument_group("RL settings (a ProxyModel's spec.reproduction fields)"), ReproConfig,
                  skip=("steps", "seed"))
    add_arguments(parser.add_argument_group("fault injection (off by default)"), FaultOptions)


# Every options model repro's flags come from (with OutputOptions' OUTPUT), for a caller that
# passes them on (options.add_pass_through).
REPRO_MODELS = (ReproConfig, RunOptions, FailOnOption, PlacementOptions, FaultOptions)


def settings_from_args(args: argparse.Namespace) -> ReproSettings:
    """The run's settings from repro's parsed flags; a bad combination raises InvalidReproConfig."""
    faults = from_args(FaultOptions, args)
    placement = from_args(PlacementOptions, args)
    placement.check()
    return ReproSettings(config=from_args(ReproConfig, args, faults=faults.faults()), run=from_args(RunOptions, args),
                         fail_on=args.fail_on, output=from_args(OutputOptions, args), placement=placement,
                         rank_fault=faults.rank_fault())


def repro_settings(flags: list[str]) -> ReproSettings:
    """The settings `moe-proxy repro CKPT --out DIR <flags>` would run with; a bad flag or value
    raises InvalidOptions / InvalidReproConfig (one line), before anything runs."""
    return settings_from_args(parse_flags(flags, add_repro_arguments))
