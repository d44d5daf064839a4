"""The pure parts: spec parsing, child manifests, and reading a child's verdict. The Job
arguments are checked against the real `moe-proxy build` / `moe-proxy repro` parsers, so the
operator and the CLI cannot drift apart."""

from __future__ import annotations

import argparse
import json

import pytest

from proxymodel_operator.children import MAX_NAME, child_name, s3_env
from proxymodel_operator.outcome import FAILED, RUNNING, SUCCEEDED, outcome
from proxymodel_operator.reproduction import repro_args, reproduction_workload
from proxymodel_operator.resources import ASCEND_JOBS, JOBS, VOLCANO_JOBS
from proxymodel_operator.settings import Settings, SettingsError, from_env
from proxymodel_operator.spec import InvalidSpec, parse
from proxymodel_operator.transformer_job import build_args, transformer_job

SPEC = {
    "source": {"uri": "s3://ckpt/dsv3/step-800", "endpoint": "https://s3.internal", "region": "eu-west-1",
               "credentialsSecret": "creds"},
    "pruning": {"experts": 32, "method": "cluster", "features": "weights", "clustering": "agglomerative",
                "topK": 6, "pin": ["3:17", "10:5"], "seed": 3},
    "reproduction": {"runtime": "Job", "maxSteps": 40, "precision": "fp16",
                     "failOn": {"signature": "threshold", "metric": "actor/grad_norm", "value": "1e4", "steps": 3}},
}


def _parse(spec: dict = SPEC, **settings) -> object:
    return parse(spec, "ns", "pm", Settings(**settings))


def _cli(module: str, args: list[str]) -> argparse.Namespace:
    import importlib

    parser = argparse.ArgumentParser()
    importlib.import_module(f"moe_proxy.commands.{module}").add_parser(parser.add_subparsers())
    return parser.parse_args(args)


def test_transformer_args_are_what_moe_proxy_build_parses():
    spec = _parse()
    args = _cli("build", build_args(spec))
    assert (args.src, args.dst) == ("s3://ckpt/dsv3/step-800", "s3://ckpt/dsv3/step-800-proxies/ns/pm/")
    assert (args.experts, args.method, args.features, args.clustering, args.top_k, args.seed) == \
        (32, "cluster", "weights", "agglomerative", 6, 3)
    assert args.pin == ["3:17,10:5"] and args.endpoint_url == "https://s3.internal"
    assert args.termination_log == "/dev/termination-log"
    ratio = _parse({**SPEC, "pruning": {"keepRatio": 0.125}})
    assert _cli("build", build_args(ratio)).keep_ratio == 0.125


def test_repro_args_are_what_moe_proxy_repro_parses():
    from moe_proxy.metrics.detect import Signature

    args = _cli("repro", repro_args(_parse(), "s3://b/proxy"))
    assert (args.checkpoint, args.steps, args.precision) == ("s3://b/proxy", 40, "fp16")
    signature = Signature.parse(args.fail_on)  # the repro's own parser accepts our rendering
    assert (signature.metric, signature.op, signature.value, signature.patience) == ("actor/grad_norm", ">", 1e4, 3)
    for name in ("overflow", "nan", "collapse"):
        spec = _parse({**SPEC, "reproduction": {"failOn": {"signature": name}}})
        assert Signature.parse(spec.reproduction.fail_on.cli()).name == name


def test_credentials_only_by_reference():
    env = s3_env(_parse().source)
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e}
    assert refs == {"AWS_ACCESS_KEY_ID": {"name": "creds", "key": "AWS_ACCESS_KEY_ID"},
                    "AWS_SECRET_ACCESS_KEY": {"name": "creds", "key": "AWS_SECRET_ACCESS_KEY"},
                    "AWS_SESSION_TOKEN": {"name": "creds", "key": "AWS_SESSION_TOKEN", "optional": True}}
    plain = {e["name"]: e["value"] for e in env if "value" in e}
    assert plain == {"AWS_REGION": "eu-west-1", "AWS_DEFAULT_REGION": "eu-west-1",
                     "AWS_ENDPOINT_URL": "https://s3.internal"}
    assert not any("valueFrom" in e for e in s3_env(_parse({**SPEC, "source": {"uri": "s3://abc/b"}}).source))


def test_child_names_are_deterministic_and_short():
    assert child_name("pm", "transformer", 3) == "pm-transform-g3"
    long = "x" * 60
    a, b = child_name(long, "reproduction", 12), child_name(long + "y", "reproduction", 12)
    assert len(a) <= MAX_NAME and len(b) <= MAX_NAME and a != b and a.endswith("-repro-g12")
    assert child_name(long, "reproduction", 12) == a


def test_job_shape_and_user_settings():
    spec = _parse({**SPEC, "transformer": {"image": "my/img:1", "backoffLimit": 3, "activeDeadlineSeconds": 600,
                                           "nodeSelector": {"pool": "cpu"}, "serviceAccountName": "builder",
                                           "env": [{"name": "AWS_REGION", "value": "override"}]},
                   "ttlSecondsAfterFinished": 60, "queueName": "lq"})
    job = transformer_job("pm", "ns", 2, spec)
    pod = job["spec"]["template"]["spec"]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "lq"
    assert (job["spec"]["backoffLimit"], job["spec"]["activeDeadlineSeconds"], job["spec"]["ttlSecondsAfterFinished"]) \
        == (3, 600, 60)
    assert (pod["restartPolicy"], pod["nodeSelector"], pod["serviceAccountName"]) == ("Never", {"pool": "cpu"}, "builder")
    container = pod["containers"][0]
    assert container["image"] == "my/img:1" and container["terminationMessagePolicy"] == "File"
    env = {e["name"]: e for e in container["env"]}
    assert env["AWS_REGION"]["value"] == "override"  # the user's env wins, once
    assert [e["name"] for e in container["env"]].count("AWS_REGION") == 1


def test_user_template_gets_the_proxy_and_the_devices():
    template = {"spec": {"containers": [
        {"name": "verl", "image": "verl:1", "env": [{"name": "MOEPROXY_MAX_STEPS", "value": "7"}]},
        {"name": "sidecar", "image": "s:1"}]}}
    spec = _parse({**SPEC, "reproduction": {"runtime": "AscendJob", "template": template,
                                            "accelerator": {"devices": 32, "devicesPerNode": 16}}})
    job = reproduction_workload("pm", "ns", 1, spec, "s3://b/proxy", "cd" * 32, 32)
    assert job["apiVersion"] == "mindxdl.gitee.com/v1" and job["spec"]["replicaSpecs"]["Worker"]["replicas"] == 1
    pod = job["spec"]["replicaSpecs"]["Master"]["template"]
    main, sidecar = pod["spec"]["containers"]
    assert main["name"] == "ascend"  # AscendJob requires it
    assert main["resources"]["limits"] == {"huawei.com/Ascend910": 16} == main["resources"]["requests"]
    env = {e["name"]: e for e in main["env"]}
    assert env["MOEPROXY_PROXY_URI"]["value"] == "s3://b/proxy" and env["MOEPROXY_MAX_STEPS"]["value"] == "7"
    assert env["ASCEND_VISIBLE_DEVICES"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['huawei.com/Ascend910']"
    assert "MOEPROXY_PROXY_URI" in {e["name"] for e in sidecar["env"]} and "resources" not in sidecar
    assert pod["metadata"]["labels"]["moeproxy.io/child"] == "pm-repro-g1"
    assert template["spec"]["containers"][0]["name"] == "verl"  # the spec itself is not modified


@pytest.mark.parametrize("spec, message", [
    ({**SPEC, "destination": {"uri": "s3://ckpt/dsv3/step-800/out"}}, "overlaps the source"),
    ({**SPEC, "destination": {"uri": "s3://ckpt/dsv3"}}, "overlaps the source"),
    ({**SPEC, "pruning": {"experts": 4, "keepRatio": 0.5}}, "exactly one"),
    ({**SPEC, "pruning": {"experts": 4, "pin": ["3"]}}, "LAYER:EXPERT"),
    ({**SPEC, "source": {"uri": "https://bucket/x"}}, "expected s3://"),
    ({**SPEC, "reproduction": {"accelerator": {"devices": 12}}}, "whole nodes"),
    ({**SPEC, "reproduction": {"accelerator": {"devices": "lots"}}}, "whole number"),
    ({**SPEC, "reproduction": {"failOn": {"signature": "threshold"}}}, "needs `metric`"),
    ({**SPEC, "reproduction": {"template": {"spec": {}}}}, "needs spec.containers"),
])
def test_specs_that_cannot_work_name_the_field(spec, message):
    with pytest.raises(InvalidSpec, match=message):
        _parse(spec)


def test_settings_from_environment():
    s = from_env({"MOEPROXY_NAMESPACES": "a, b", "MOEPROXY_ACCELERATOR": "nvidia.com/gpu",
                  "MOEPROXY_DEVICES_PER_NODE": "4", "MOEPROXY_PREFLIGHT": "false"})
    assert (s.namespaces, s.accelerator, s.devices_per_node, s.preflight, s.cluster_wide) == \
        (("a", "b"), "nvidia.com/gpu", 4, False, False)
    assert from_env({}).cluster_wide
    with pytest.raises(SettingsError, match="MOEPROXY_DEVICES_PER_NODE"):
        from_env({"MOEPROXY_DEVICES_PER_NODE": "eight"})
    with pytest.raises(SettingsError, match="MOEPROXY_S3_ENDPOINT"):
        from_env({"MOEPROXY_S3_ENDPOINT": "minio:9000"})


def _pod(terminated: dict | None = None, waiting: dict | None = None, unschedulable: bool = False) -> dict:
    state = {"terminated": terminated} if terminated else {"waiting": waiting} if waiting else {"running": {}}
    status: dict = {"containerStatuses": [{"name": "c", "state": state}]}
    if unschedulable:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": "0/4 nodes have 8 huawei.com/Ascend910"}]
    return {"metadata": {"name": "p"}, "status": status}


FAILED_JOB = {"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}}
DONE_JOB = {"status": {"conditions": [{"type": "Complete", "status": "True"}]}}


def test_verdicts_prefer_the_most_specific_reason():
    error = json.dumps({"error": "UnsupportedArchitecture", "message": "jamba is not supported"})
    assert outcome(JOBS, FAILED_JOB, [_pod({"exitCode": 2, "reason": "Error", "message": error})]).reason \
        == "UnsupportedArchitecture"
    assert outcome(JOBS, FAILED_JOB, [_pod({"exitCode": 137, "reason": "OOMKilled"})]).reason == "OOMKilled"
    assert outcome(JOBS, FAILED_JOB, [_pod({"exitCode": 1, "reason": "Error", "message": "Traceback..."})]).reason \
        == "BackoffLimitExceeded"
    stuck = outcome(JOBS, {}, [_pod(waiting={"reason": "ImagePullBackOff", "message": "not found"})])
    assert (stuck.state, stuck.reason) == (FAILED, "ImagePullBackOff")
    assert outcome(JOBS, {}, [_pod(waiting={"reason": "ContainerCreating"})]) .state == RUNNING
    pending = outcome(JOBS, {}, [_pod(unschedulable=True)])
    assert (pending.state, pending.reason) == (RUNNING, "Unschedulable")


def test_success_reports_and_other_runtimes():
    report = {"reproduced": True, "signature": "nan", "step": 4, "metrics": {}}
    done = outcome(JOBS, DONE_JOB, [_pod({"exitCode": 0, "reason": "Completed", "message": json.dumps(report)})])
    assert (done.state, done.report) == (SUCCEEDED, report)
    huge = json.dumps({"x": "y" * 5000})
    assert outcome(JOBS, DONE_JOB, [_pod({"exitCode": 0, "message": huge})]).report == {}
    assert outcome(VOLCANO_JOBS, {"status": {"state": {"phase": "Completed"}}}, []).state == SUCCEEDED
    assert outcome(VOLCANO_JOBS, {"status": {"state": {"phase": "Failed"}}}, []).reason == "VolcanoJobFailed"
    ascend = {"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "PodGroupPending"}]}}
    assert outcome(ASCEND_JOBS, ascend, []).reason == "PodGroupPending"
    assert outcome(ASCEND_JOBS, {"status": {"conditions": [{"type": "Succeeded", "status": "True"}]}}, []).state \
        == SUCCEEDED
