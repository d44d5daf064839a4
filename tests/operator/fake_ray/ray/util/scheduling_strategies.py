"""ray.util.scheduling_strategies as LAUNCHER uses it."""

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeAffinitySchedulingStrategy:
    node_id: str
    soft: bool
