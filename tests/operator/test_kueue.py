"""Kueue: a queue name on a ProxyModel, a Diagnosis or a CheckpointWatch's template puts the label
`kueue.x-k8s.io/queue-name` on every workload made from it, each created suspended where its
runtime has `suspend` (batch/v1 Job, JobSet, RayJob, TrainJob) so that Kueue admits it. Volcano
Jobs and AscendJobs are admitted by Volcano's own queues (spec.reproduction.queue) instead: the
two admission layers are not stacked on one workload."""

from __future__ import annotations

import pytest

from proxymodel_operator.diagnosis_bisect import probe_proxymodel
from proxymodel_operator.reproduction import reproduction_workload
from proxymodel_operator.resources import KUEUE_QUEUE_LABEL
from proxymodel_operator.runtimes import RUNTIMES
from proxymodel_operator.settings import Settings
from proxymodel_operator.spec import parse
from proxymodel_operator.transformer_job import transformer_job
from proxymodel_operator.watch_decisions import proxymodel_for
from proxymodel_operator.watch_spec import parse_watch

from .harness import proxymodel

KUEUE = [name for name, r in RUNTIMES.items() if r.kueue]


def test_kueue_runtimes_are_those_with_suspend():
    assert KUEUE == ["Job", "RayJob", "TrainJob", "JobSet"]


def _workloads(pm_spec: dict) -> tuple[dict, dict]:
    spec = parse(pm_spec, "team-a", "q3", Settings())
    build = transformer_job("q3", "team-a", 1, spec)
    run = reproduction_workload("q3", "team-a", 1, spec, "s3://ckpt/proxy/", "ab" * 32, 8)
    return build, run


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_a_proxymodels_queue_labels_and_suspends_its_workloads(runtime):
    body = proxymodel("q3", queueName="team-queue", reproduction={"runtime": runtime, "accelerator": {"devices": 8}})
    build, run = _workloads(body["spec"])
    assert build["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-queue" and build["spec"]["suspend"] is True
    if runtime in KUEUE:
        assert run["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-queue" and run["spec"]["suspend"] is True
    else:  # Volcano's queues admit these
        assert KUEUE_QUEUE_LABEL not in run["metadata"]["labels"] and "suspend" not in run["spec"]


def test_without_a_queue_nothing_is_suspended():
    build, run = _workloads(proxymodel("q3", reproduction={"runtime": "JobSet", "accelerator": {"devices": 8}})["spec"])
    assert "suspend" not in build["spec"] and "suspend" not in run["spec"]
    assert KUEUE_QUEUE_LABEL not in build["metadata"]["labels"] | run["metadata"]["labels"]


def test_a_checkpointwatch_templates_queue_reaches_its_proxymodels_workloads():
    w = parse_watch({"source": {"uri": "s3://runs/grpo", "credentialsSecret": "creds"},
                     "template": {"spec": {"pruning": {"experts": 8}, "queueName": "rl-queue",
                                           "reproduction": {"runtime": "RayJob", "accelerator": {"devices": 8}}}}})
    body = {"apiVersion": "moeproxy.io/v1alpha1", "kind": "CheckpointWatch",
            "metadata": {"name": "grpo", "namespace": "rl", "uid": "u-1", "labels": {}}}
    pxm = proxymodel_for(body, w, 300, "s3://runs/grpo/global_step_300")
    assert pxm["spec"]["queueName"] == "rl-queue"
    build, run = _workloads(pxm["spec"])
    for workload in (build, run):
        assert workload["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "rl-queue" and workload["spec"]["suspend"]


def test_a_bisections_queue_reaches_its_probes_builds():
    raw = {"source": {"uri": "s3://runs/grpo", "credentialsSecret": "creds"},
           "template": {"spec": {"pruning": {"experts": 8}, "queueName": "template-queue"}}}
    body = {"apiVersion": "moeproxy.io/v1alpha1", "kind": "Diagnosis",
            "metadata": {"name": "bis", "namespace": "rl", "uid": "u-2", "labels": {}},
            "spec": {"queueName": "diag-queue", "checkpoints": raw}}
    probe = probe_proxymodel(body, raw, {"step": 300, "uri": "s3://runs/grpo/global_step_300"}, Settings())
    assert probe["spec"]["queueName"] == "diag-queue"
    build, _ = _workloads(probe["spec"])
    assert build["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "diag-queue"
