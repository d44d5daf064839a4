"""The operator's settings: the one place that reads MOEPROXY_* environment variables.

`from_env` runs once at start-up (the startup handler puts the result in kopf's `memo`, and
every handler takes it from there). Every name the Helm chart sets is a constant here (ENV_*,
listed in ALL_ENV), so the chart (issue 5) and the code agree. Nothing here is secret:
credentials live in the Secrets that ProxyModels name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# Names of the environment variables.
ENV_NAMESPACES = "MOEPROXY_NAMESPACES"  # comma-separated; empty or unset = cluster-wide
ENV_TRANSFORMER_IMAGE = "MOEPROXY_TRANSFORMER_IMAGE"  # default image of the transformer Job
ENV_REPRO_IMAGE = "MOEPROXY_REPRO_IMAGE"  # default image of the reproduction Job
ENV_ACCELERATOR = "MOEPROXY_ACCELERATOR"  # default accelerator resource name
ENV_DEVICES_PER_NODE = "MOEPROXY_DEVICES_PER_NODE"  # default accelerators per node
ENV_DEVICE_MEMORY_GB = "MOEPROXY_DEVICE_MEMORY_GB"  # default memory per accelerator (GB)
ENV_S3_ENDPOINT = "MOEPROXY_S3_ENDPOINT"  # default S3 endpoint URL when a ProxyModel names none
ENV_S3_REGION = "MOEPROXY_S3_REGION"  # default S3 region when a ProxyModel names none
ENV_PREFLIGHT = "MOEPROXY_PREFLIGHT"  # "false" skips reading config.json before creating Jobs
ENV_LIVENESS = "MOEPROXY_LIVENESS"  # kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz
ENV_LOG_FORMAT = "MOEPROXY_LOG_FORMAT"  # plain | full | json
ENV_CHECKPOINT_WATCH = "MOEPROXY_CHECKPOINT_WATCH"  # "true" serves CheckpointWatches (chart: checkpointWatch.enabled)
ENV_RUNTIMES = "MOEPROXY_RUNTIMES"  # the reproduction runtimes served, comma-separated; empty = all (chart: runtimes.*)
ENV_TRAINING_RUNTIME = "MOEPROXY_TRAINING_RUNTIME"  # a TrainJob's default ClusterTrainingRuntime
# Not set by the chart: how often each CheckpointWatch's timer wakes (seconds; tests shorten it).
ENV_CHECKPOINT_TICK = "MOEPROXY_CHECKPOINT_TICK"
# Not set by the chart: how often each Diagnosis's timer looks at its runs (seconds; tests shorten it).
ENV_DIAGNOSIS_TICK = "MOEPROXY_DIAGNOSIS_TICK"
# Not set by the chart: how often a refused ProxyModel's dependencies (its Secret, its source's
# config.json) are looked at again (seconds; tests shorten it).
ENV_RECHECK_INTERVAL = "MOEPROXY_RECHECK_INTERVAL"

# What the chart sets.
ALL_ENV = (ENV_NAMESPACES, ENV_TRANSFORMER_IMAGE, ENV_REPRO_IMAGE, ENV_ACCELERATOR,
           ENV_DEVICES_PER_NODE, ENV_DEVICE_MEMORY_GB, ENV_S3_ENDPOINT, ENV_S3_REGION,
           ENV_PREFLIGHT, ENV_LIVENESS, ENV_LOG_FORMAT, ENV_CHECKPOINT_WATCH, ENV_RUNTIMES, ENV_TRAINING_RUNTIME)

DEFAULT_IMAGE = "ghcr.io/moe-proxy/moe-proxy:0.1.0"
DEFAULT_ACCELERATOR = "huawei.com/Ascend910"


class SettingsError(ValueError):
    """An environment variable holds a value the operator cannot use."""


@dataclass(frozen=True)
class Settings:
    namespaces: tuple[str, ...] = ()  # empty = every namespace
    transformer_image: str = DEFAULT_IMAGE
    repro_image: str = DEFAULT_IMAGE
    accelerator: str = DEFAULT_ACCELERATOR
    devices_per_node: int = 8
    device_memory_gb: float = 64.0  # Ascend 910B
    s3_endpoint: str = ""
    s3_region: str = ""
    preflight: bool = True
    liveness: str = "http://0.0.0.0:8080/healthz"
    log_format: str = "json"
    checkpoint_watch: bool = False  # the chart grants its RBAC only when this is on
    runtimes: tuple[str, ...] = ()  # the reproduction runtimes served (the chart grants their RBAC); empty = all
    training_runtime: str = "torch-distributed"  # a TrainJob's ClusterTrainingRuntime unless it names one
    checkpoint_tick: float = 30.0  # the CRD's smallest pollInterval: polls fall on 30 s ticks
    diagnosis_tick: float = 10.0  # a Diagnosis's runs are looked at this often
    recheck_interval: float = 120.0  # a refusal's Secret and source are looked at again this often

    @property
    def cluster_wide(self) -> bool:
        return not self.namespaces


def _int(env: dict[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected a whole number") from None
    if value < 1:
        raise SettingsError(f"{name}={raw!r}: must be at least 1")
    return value


def _float(env: dict[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected a number") from None
    if value <= 0:
        raise SettingsError(f"{name}={raw!r}: must be positive")
    return value


def _runtimes(env: dict[str, str]) -> tuple[str, ...]:
    from .runtimes import RUNTIMES  # the table (settings is imported before it elsewhere)

    names = tuple(n.strip() for n in env.get(ENV_RUNTIMES, "").split(",") if n.strip())
    unknown = [n for n in names if n not in RUNTIMES]
    if unknown:
        raise SettingsError(f"{ENV_RUNTIMES}={','.join(names)!r}: unknown {', '.join(unknown)}; "
                            f"expected some of {', '.join(RUNTIMES)}")
    return names


def from_env(env: dict[str, str] | None = None) -> Settings:
    """Settings from `env` (default: os.environ); a bad value raises SettingsError naming it."""
    env = dict(os.environ if env is None else env)
    namespaces = tuple(ns.strip() for ns in env.get(ENV_NAMESPACES, "").split(",") if ns.strip())
    preflight = env.get(ENV_PREFLIGHT, "true").strip().lower()
    if preflight not in ("true", "false", "1", "0", "yes", "no"):
        raise SettingsError(f"{ENV_PREFLIGHT}={preflight!r}: expected true or false")
    checkpoint_watch = env.get(ENV_CHECKPOINT_WATCH, "false").strip().lower() or "false"
    if checkpoint_watch not in ("true", "false", "1", "0", "yes", "no"):
        raise SettingsError(f"{ENV_CHECKPOINT_WATCH}={checkpoint_watch!r}: expected true or false")
    log_format = env.get(ENV_LOG_FORMAT, "json").strip() or "json"
    if log_format not in ("plain", "full", "json"):
        raise SettingsError(f"{ENV_LOG_FORMAT}={log_format!r}: expected plain, full or json")
    endpoint = env.get(ENV_S3_ENDPOINT, "").strip()
    if endpoint and not endpoint.startswith(("http://", "https://")):
        raise SettingsError(f"{ENV_S3_ENDPOINT}={endpoint!r}: must start with http:// or https://")
    return Settings(
        namespaces=namespaces,
        transformer_image=env.get(ENV_TRANSFORMER_IMAGE, "").strip() or DEFAULT_IMAGE,
        repro_image=env.get(ENV_REPRO_IMAGE, "").strip() or DEFAULT_IMAGE,
        accelerator=env.get(ENV_ACCELERATOR, "").strip() or DEFAULT_ACCELERATOR,
        devices_per_node=_int(env, ENV_DEVICES_PER_NODE, 8),
        device_memory_gb=_float(env, ENV_DEVICE_MEMORY_GB, 64.0),
        s3_endpoint=endpoint,
        s3_region=env.get(ENV_S3_REGION, "").strip(),
        preflight=preflight in ("true", "1", "yes"),
        liveness=env.get(ENV_LIVENESS, "").strip() or "http://0.0.0.0:8080/healthz",
        log_format=log_format,
        checkpoint_watch=checkpoint_watch in ("true", "1", "yes"),
        runtimes=_runtimes(env),
        training_runtime=env.get(ENV_TRAINING_RUNTIME, "").strip() or Settings.training_runtime,
        checkpoint_tick=_float(env, ENV_CHECKPOINT_TICK, Settings.checkpoint_tick),
        diagnosis_tick=_float(env, ENV_DIAGNOSIS_TICK, Settings.diagnosis_tick),
        recheck_interval=_float(env, ENV_RECHECK_INTERVAL, Settings.recheck_interval),
    )
