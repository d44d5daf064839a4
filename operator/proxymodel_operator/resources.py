"""The Kubernetes resources the operator touches, and the labels it puts on its children."""

from __future__ import annotations

from dataclasses import dataclass

GROUP = "moeproxy.io"
VERSION = "v1alpha1"


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        """The REST path of the collection in `namespace`, or of one object (and subresource)."""
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        path = f"{base}/namespaces/{namespace}/{self.plural}"
        if name:
            path += f"/{name}"
        if subresource:
            path += f"/{subresource}"
        return path


PROXYMODELS = Resource(GROUP, VERSION, "proxymodels", "ProxyModel")
DIAGNOSES = Resource(GROUP, VERSION, "diagnoses", "Diagnosis")
JOBS = Resource("batch", "v1", "jobs", "Job")
VOLCANO_JOBS = Resource("batch.volcano.sh", "v1alpha1", "jobs", "Job")
ASCEND_JOBS = Resource("mindxdl.gitee.com", "v1", "ascendjobs", "AscendJob")
RAY_JOBS = Resource("ray.io", "v1", "rayjobs", "RayJob")
TRAIN_JOBS = Resource("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob")
JOB_SETS = Resource("jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet")
PODS = Resource("", "v1", "pods", "Pod")
SECRETS = Resource("", "v1", "secrets", "Secret")
SERVICES = Resource("", "v1", "services", "Service")

# Labels on every child workload and on its pods (through the pod templates).
LABEL_PROXYMODEL = f"{GROUP}/proxymodel"  # the owning ProxyModel's name
LABEL_ROLE = f"{GROUP}/role"  # transformer | reproduction
LABEL_CHILD = f"{GROUP}/child"  # the child workload's name: finds its pods
LABEL_GENERATION = f"{GROUP}/generation"  # the ProxyModel generation it was built for
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
