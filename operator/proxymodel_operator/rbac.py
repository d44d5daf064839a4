"""Every Kubernetes API call the operator makes, as (apiGroup, resource, verbs).

This is the single list: the Helm chart's ClusterRole is rendered from it (issue 5), and the
operator's own API client (`kube.py`) refuses any call that is not listed here, so the
chart can never fall behind the code. The tests record every request the operator sends to
the API emulator and check each one against this list.
"""

from __future__ import annotations

from dataclasses import dataclass

from .runtimes import RUNTIMES


@dataclass(frozen=True)
class Permission:
    api_group: str  # "" is the core group
    resource: str  # plural, with "/subresource" where one is used
    verbs: tuple[str, ...]
    why: str
    # The chart values that need it (charts/generate_rbac.py); empty: always granted.
    features: tuple[str, ...] = ()


WORKLOAD_VERBS = ("get", "list", "watch", "create", "delete")

PERMISSIONS: tuple[Permission, ...] = (
    # The custom resource itself: kopf watches it, stores its progress in annotations,
    # adds/removes the finalizer, and writes status through the status subresource.
    Permission("moeproxy.io", "proxymodels", ("get", "list", "watch", "patch"),
               "watch ProxyModels; kopf progress annotations and finalizer"),
    Permission("moeproxy.io", "proxymodels/status", ("get", "patch"),
               "write status (phase, conditions, proxy summary, plan, outcome)"),
    # Child workloads, one per runtime of the table (the transformer's Jobs are batch/v1 Jobs):
    # created, followed, and deleted when a new generation replaces them.
    # Each granted only with its chart value on (runtimes.<feature>; batch/v1 Jobs always).
    *(Permission(r.resource.group, r.resource.plural, WORKLOAD_VERBS, r.why, (r.feature,) if r.feature else ())
      for r in RUNTIMES.values()),
    # The headless Service that gives an Indexed reproduction Job's pods stable host names
    # (`<job>-<index>.<job>`, the master at index 0): created with the Job (one that exists is
    # read back), owned by the ProxyModel, deleted with the Jobs of an older spec. Never watched.
    Permission("", "services", ("get", "list", "create", "delete"),
               "the headless Service of a multi-node reproduction Job (pod host names for the rendezvous)"),
    # Pods of those Jobs: the termination message carries the result; waiting/terminated
    # reasons carry the real failure (OOMKilled, ImagePullBackOff, Unschedulable).
    Permission("", "pods", ("get", "list", "watch"),
               "read the Jobs' results and failure reasons from their pods"),
    # The source checkpoint's config.json is read before any Job is created (architecture,
    # expert count, plan). Only the Secret the ProxyModel names is read, and only in memory.
    Permission("", "secrets", ("get",),
               "S3 credentials named by spec.source.credentialsSecret, for the preflight read"),
    # CheckpointWatch (issue 11; only with the chart's checkpointWatch.enabled): kopf's timer on
    # each watch, its status, and the ProxyModels it makes and retires (keepLast). It reads the
    # Secret a watch names with the `get` above.
    Permission("moeproxy.io", "checkpointwatches", ("get", "list", "watch", "patch"),
               "a timer per CheckpointWatch lists its checkpoint prefix", features=("checkpointWatch",)),
    Permission("moeproxy.io", "checkpointwatches/status", ("get", "patch"),
               "write status (last step seen, ProxyModels made, pending, conditions)",
               features=("checkpointWatch",)),
    Permission("moeproxy.io", "proxymodels", ("create", "delete"),
               "a ProxyModel per new complete checkpoint; retention deletes the oldest",
               features=("checkpointWatch",)),
    # Those ProxyModels are owned by their watch with blockOwnerDeletion, which clusters with the
    # OwnerReferencesPermissionEnforcement admission plugin (OpenShift) allow only with this.
    Permission("moeproxy.io", "checkpointwatches/finalizers", ("update",),
               "own the ProxyModels it makes (blockOwnerDeletion)", features=("checkpointWatch",)),
    # The watched run (issue 43; spec.metrics and spec.onFailure): one Diagnosis per incident, owned
    # by the watch (its finalizers grant above), stopped past its budget; its webhook's Secret is
    # read with the `get` above.
    Permission("moeproxy.io", "diagnoses", ("create", "delete"), "a CheckpointWatch's incident: its one "
               "Diagnosis, deleted (with its runs) once it starts more than the incident's budget",
               features=("checkpointWatch",)),
    # Diagnosis (issue 26): kopf's timer on each, its status, and the runs it creates (the
    # reproduction workloads and Services above, read back with their pods; the ProxyModel with
    # the `get` above). The runs are owned by the Diagnosis with blockOwnerDeletion.
    Permission("moeproxy.io", "diagnoses", ("get", "list", "watch", "patch"),
               "a timer per Diagnosis starts its runs and reads their verdicts"),
    Permission("moeproxy.io", "diagnoses/status", ("get", "patch"),
               "write status (runs per candidate and seed, verdicts, fixedBy, conditions)"),
    Permission("moeproxy.io", "diagnoses/finalizers", ("update",),
               "own the reproduction workloads it creates (blockOwnerDeletion)"),
    # A bisection (spec.checkpoints) makes a ProxyModel per probe (owned by the Diagnosis) and
    # lists the prefix with the Secret's `get`. Reading a CheckpointWatch it names is the
    # CheckpointWatch grants' `get` (checkpointWatch.enabled: without it there is no such CRD).
    Permission("moeproxy.io", "proxymodels", ("create",), "a Diagnosis's bisection: a ProxyModel per probe"),
    # Events on the ProxyModel (kopf.event) and kopf's own handler warnings (core v1 Events).
    Permission("", "events", ("create",), "Events on ProxyModels and Diagnoses"),
    # kopf's runtime discovery: namespaces when MOEPROXY_NAMESPACES holds glob patterns, and
    # CRDs to notice the Volcano/AscendJob resources when they are installed later.
    Permission("", "namespaces", ("list", "watch"), "kopf: follow watched namespaces"),
    Permission("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch"),
               "kopf: discover the ProxyModel resource"),
)


def allowed(api_group: str, resource: str, verb: str) -> bool:
    """True when (api_group, resource, verb) is one of PERMISSIONS."""
    return any(p.api_group == api_group and p.resource == resource and verb in p.verbs
               for p in PERMISSIONS)

