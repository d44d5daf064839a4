"""The dataclasses a ProxyModel's spec is read into (spec.parse, with the operator's defaults
applied): what the rest of the operator builds its children and workloads from.

Apart from spec.py so that runtimes.py, whose workloads are built from a ProxyModelSpec, and
spec.py, which checks spec.reproduction.runtime against runtimes' table, need not import each
other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_proxy.options import PruningOptions, TokenOptions
from moe_proxy.rl.config import ReproConfig

# The CamelCase reason each failure signature shows in status and Events.
SIGNATURE_REASONS = {
    "overflow": "GradientOverflow", "underflow": "GradientUnderflow", "nan": "NaN",
    "divergence": "Divergence", "collapse": "RoutingCollapse", "threshold": "MetricThreshold",
}


@dataclass(frozen=True)
class Source:
    uri: str
    endpoint: str  # "" = the operator's default, else the AWS default
    region: str
    credentials_secret: str  # "" = pods use their own identity (IRSA, node role)


@dataclass(frozen=True)
class Pruning:
    """spec.pruning: the build's options (the one model the CLI has, moe_proxy.options), and
    what only the operator decides around them."""

    options: PruningOptions
    # Default true with spec.calibration (the fidelity lab's winner): parse() resolves it, and
    # options.reconstruct (None until then).
    sequential: bool = False  # calibrate behind this proxy's pruned earlier layers (calibrate --experts N)
    max_experts: int | None = None  # `experts: auto`: the largest count the plan sized devices for
    notes: tuple[str, ...] = ()  # what the defaults could not do (status.plan.notes), e.g. one-pass statistics

    @property
    def experts(self) -> int | None:
        """The count to keep; None with `experts: auto` (max_kl set) or a keep ratio."""
        return None if self.options.auto else self.options.experts

    @property
    def auto(self) -> bool:
        return self.options.auto

    def __getattr__(self, name: str):  # the build's options read as fields: p.method, p.keep_ratio, ...
        if name == "options":
            raise AttributeError(name)
        return getattr(self.options, name)


@dataclass(frozen=True)
class Workload:
    """Where and how a child's pods run: spec.transformer for the transformer's Jobs,
    spec.reproduction for the reproduction workload (their CRD fields: shared_fields.WorkloadFields,
    under these names)."""

    image: str
    image_pull_policy: str | None = None
    resources: dict = field(default_factory=dict)
    node_selector: dict = field(default_factory=dict)
    tolerations: list = field(default_factory=list)
    service_account: str | None = None
    backoff_limit: int = 0
    active_deadline_seconds: int | None = None
    env: list = field(default_factory=list)
    command: list | None = None
    args: list | None = None

    def deadline(self) -> dict:
        """activeDeadlineSeconds for the workload's spec, when one is set (every runtime has the field)."""
        return {"activeDeadlineSeconds": self.active_deadline_seconds} if self.active_deadline_seconds else {}


@dataclass(frozen=True)
class FailOn:
    signature: str
    metric: str | None = None
    operator: str = ">"
    value: float | None = None
    steps: int = 1
    stop_on_reproduce: bool = False  # a user's framework is ended once the watcher's verdict is in

    def cli(self) -> str:
        """The `moe-proxy repro --fail-on` form: a built-in name or METRIC>VALUE[:STEPS]."""
        if self.signature != "threshold":
            return self.signature
        return f"{self.metric}{self.operator}{self.value:g}" + (f":{self.steps}" if self.steps > 1 else "")

    @property
    def reason(self) -> str:
        return SIGNATURE_REASONS[self.signature]


@dataclass(frozen=True)
class AcceleratorRequest:
    resource: str
    devices_per_node: int
    devices: int | None  # None = planned (`auto`)
    memory_gb: float | None  # None = the accelerator's (planner) or the operator default


@dataclass(frozen=True)
class Reproduction:
    enabled: bool
    runtime: str  # a key of runtimes.RUNTIMES
    workload: Workload
    accelerator: AcceleratorRequest
    config: ReproConfig = field(default_factory=lambda: ReproConfig(steps=50, precision="bf16"))  # the RL run
    fail_on: FailOn | None = None
    template: dict | None = None  # the user's own pod template (verl, MindSpeed-RL, ...)
    scheduler_name: str | None = None
    volcano_queue: str | None = None
    # a ReadWriteMany claim every pod mounts at the run directory (a framework logging off node 0)
    shared_volume_claim: str | None = None
    training_runtime: str = "torch-distributed"  # the TrainJob's ClusterTrainingRuntime

    @property
    def max_steps(self) -> int:
        return self.config.steps

    @property
    def precision(self) -> str:
        return self.config.precision


@dataclass(frozen=True)
class ProxyModelSpec:
    source: Source
    destination: str
    pruning: Pruning
    transformer: Workload
    reproduction: Reproduction
    suspend: bool = False
    ttl_seconds_after_finished: int | None = None
    queue_name: str | None = None  # Kueue LocalQueue: the label on every child workload, created suspended
    calibration: TokenOptions | None = None  # spec.calibration: the tokens `moe-proxy calibrate` runs
    workers: int = 1  # spec.transformer.parallelism: pods sharing the build (an Indexed Job when > 1)

    def admission(self) -> dict:
        """`suspend: true` for a workload Kueue admits (its queue-name label), else nothing."""
        return {"suspend": True} if self.queue_name else {}

    @property
    def calibration_uri(self) -> str:
        """Beside the proxy, never inside it (a build refuses a non-empty foreign destination)."""
        return self.destination.rstrip("/") + "-calibration/"

