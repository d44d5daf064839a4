"""A Diagnosis candidate's args reach the command its runs run. A framework's container that runs
`sh -c SCRIPT` drops arguments after the script (they become the script's $0, $1, ...): where the
script passes "$@" on, the operator adds a $0 of its own before the candidate's args, so they
arrive as the script's "$@"; where it does not (or the container has neither command nor args),
the Diagnosis is refused at admission with the reason, and no run starts. Through kopf and the API
emulator, with the runs as local processes (the test kubelet), as in test_diagnosis.py."""

from __future__ import annotations

import asyncio
import sys

import pytest
import yaml

from proxymodel_operator import reproduction
from proxymodel_operator.diagnosis_matrix import decide
from proxymodel_operator.diagnosis_runs import LABEL_DIAGNOSIS
from proxymodel_operator.resources import DIAGNOSES, JOBS, PROXYMODELS
from proxymodel_operator.settings import Settings

from ..checkpoints.crd_schema import ROOT
from .controllers import CONTROLLERS
from .diagnoses import diagnosis_status, with_diagnoses
from .harness import ACCESS_KEY, SECRET_KEY, eventually, proxymodel, tiny_report
from .kubelet import Kubelet

NS = "team-tmpl"
TICK = 0.3
# A framework that logs verl's JSON lines: a NaN loss at step 3, unless it is given `fix=1` (a Hydra override).
FRAMEWORK = """\
import json, os, sys
with open(os.environ["VERL_FILE_LOGGER_PATH"], "a") as f:
    for step in range(1, 5):
        nan = step == 3 and "fix=1" not in sys.argv[1:]
        f.write(json.dumps({"step": step, "data": {"actor/pg_loss": float("nan") if nan else 1.0 / step}}) + "\\n")
"""


@pytest.fixture()
def registry():
    return with_diagnoses(TICK)


def _status(cluster, name: str) -> dict:
    return diagnosis_status(cluster, NS, name)


def _runs(cluster, name: str) -> list[dict]:
    return [j for j in cluster.objects_of("jobs", NS) if (j["metadata"].get("labels") or {}).get(LABEL_DIAGNOSIS) == name]


async def _framework(cluster, tmp_path, name: str, script: str, built: bool = True) -> dict:
    """A ProxyModel whose template runs `sh -c SCRIPT`, its proxy built unless `built` is false
    (then its transformer Job is returned, running)."""
    template = {"spec": {"containers": [{"name": "verl", "image": "verl:test", "command": ["sh", "-c"],
                                         "args": [script]}]}}
    await cluster.create(PROXYMODELS, NS, proxymodel(name, reproduction={
        "runtime": "Job", "maxSteps": 4, "template": template, "failOn": {"signature": "nan"},
        "accelerator": {"devices": 1, "devicesPerNode": 1}}))
    transformer = await eventually(lambda: cluster.get(JOBS, NS, f"{name}-transform-g1"), 30, "transformer Job")
    if built:
        await _built(cluster, tmp_path, transformer)
    return transformer


async def _built(cluster, tmp_path, transformer: dict) -> None:
    await cluster.finish_pod(NS, transformer, "transformer", 0, tiny_report(tmp_path / "proxy"))
    await cluster.job_condition(NS, transformer["metadata"]["name"], "Complete")


async def _run(cluster, tmp_path, job: dict) -> None:
    """The Job's pod runs here (the test kubelet) and the Job ends."""
    started = await CONTROLLERS["Job"].start(cluster, NS, job)
    kubelet = Kubelet(cluster, NS, tmp_path / "node", hosts=[])
    ran = await asyncio.to_thread(kubelet.run, started.pods)
    await kubelet.report(started.pods[0], ran[started.pods[0].name])
    await CONTROLLERS["Job"].finish(cluster, NS, job, True)


@pytest.mark.parametrize("container, extra, args", [
    ({"command": ["python", "train.py"], "args": ["a=1"]}, ["x=1"], ["a=1", "x=1"]),
    ({"command": ["bash", "run.sh"]}, ["x=1"], ["x=1"]),  # a script file gets them as $1...
    ({"command": ["bash", "-c"], "args": ['python t.py "$@"']}, ["x=1"], ['python t.py "$@"', "$0", "x=1"]),
    ({"command": ["/bin/bash", "-o", "pipefail", "-ec", "python t.py $*"]}, ["x=1"], ["$0", "x=1"]),
    ({"command": ["sh", "-c", 'exec "$@"', "zero", "python"], "args": ["t.py"]}, ["x=1"], ["t.py", "x=1"]),
    ({"command": ["sh", "-c", "python t.py"]}, [], []),  # nothing to add: nothing to refuse
])
def test_args_go_where_the_command_takes_them(container, extra, args):
    """("$0": the operator's own $0 for the script, reproduction.SHELL_ZERO)"""
    args = [reproduction.SHELL_ZERO if a == "$0" else a for a in args]
    assert reproduction.appended(container, extra) == args


@pytest.mark.parametrize("container, text", [
    ({"command": ["bash", "-c"], "args": ["python t.py"]}, "`bash -c SCRIPT`, whose script reads no arguments"),
    ({"command": ["/bin/sh", "-lc", "python t.py ${X}"]}, "`sh -c SCRIPT`"),
    ({"image": "verl"}, "neither command nor args: added args would replace the image's CMD"),
])
def test_args_that_would_be_dropped_are_refused(container, text):
    with pytest.raises(reproduction.ArgsIgnored) as caught:
        reproduction.appended(container, ["x=1"])
    assert text in str(caught.value)


def test_the_verl_examples_script_takes_a_candidates_args():
    example = yaml.safe_load((ROOT / "examples" / "proxymodel-verl-template.yaml").read_text())
    container = example["spec"]["reproduction"]["template"]["spec"]["containers"][0]
    assert reproduction.appended(container, ["actor.optim.lr=1e-7"])[-2:] == [reproduction.SHELL_ZERO,
                                                                              "actor.optim.lr=1e-7"]


def test_a_repro_command_run_through_sh_c_that_cannot_take_the_seed_is_refused():
    """spec.reproduction.workload.command: every run adds `--seed S`, which such a script drops."""
    body = proxymodel("pm", reproduction={"runtime": "Job", "maxSteps": 4, "failOn": {"signature": "nan"},
                                          "accelerator": {"devices": 1, "devicesPerNode": 1},
                                          "command": ["sh", "-c"], "args": ["moe-proxy repro /p --steps 4"]})
    body["metadata"]["namespace"] = NS
    body["status"] = {"phase": "Reproducing", "proxy": {"uri": "s3://ckpt/p/", "manifestSha256": "ab" * 32}}
    d = {"metadata": {"name": "dx", "namespace": NS, "generation": 1},
         "spec": {"proxyModel": "pm", "candidates": [{"name": "env-only", "env": [{"name": "X", "value": "1"}]}]}}
    decision = decide(d, body, {}, Settings())
    accepted = next(c for c in decision.status["conditions"] if c["type"] == "Accepted")
    assert (decision.status["phase"], accepted["reason"]) == ("Failed", "CandidateArgsIgnored")
    assert accepted["message"].startswith("every run adds --seed 0 to the args of the first container")
    assert not decision.create


async def test_a_candidates_args_reach_a_sh_c_script_that_passes_them_on(cluster, operator, tmp_path):
    framework = tmp_path / "framework.py"
    framework.write_text(FRAMEWORK)
    script = f'exec {sys.executable} {framework} "$@"'
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    await _framework(cluster, tmp_path, "fw", script)
    await cluster.create(DIAGNOSES, NS, {"metadata": {"name": "fx"}, "spec": {
        "proxyModel": "fw", "seeds": 1, "parallelism": 2, "candidates": [{"name": "fix", "args": ["fix=1"]}]}})
    for name in ("fx-baseline-s0", "fx-fix-s0"):  # the baseline's run first, then the candidate's
        job = await eventually(lambda: cluster.get(JOBS, NS, name), 20, name)
        await _run(cluster, tmp_path, job)
    await eventually(lambda: _status(cluster, "fx").get("phase") == "Complete", 30, "the diagnosis complete")
    status = _status(cluster, "fx")
    assert (status["baseline"]["verdict"], status["baseline"]["runs"][0]["step"]) == ("reproduced", 3)
    assert [(c["name"], c["verdict"]) for c in status["candidates"]] == [("fix", "fixed")]
    container = cluster.get(JOBS, NS, "fx-fix-s0")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == [script, reproduction.SHELL_ZERO, "fix=1"]


async def test_a_candidates_args_that_a_sh_c_script_would_drop_are_refused_at_admission(cluster, operator, tmp_path):
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    transformer = await _framework(cluster, tmp_path, "fw", "exec python3 /app/main_ppo.py trainer.steps=4",
                                   built=False)
    await cluster.create(DIAGNOSES, NS, {"metadata": {"name": "dropped"}, "spec": {
        "proxyModel": "fw", "candidates": [{"name": "env", "env": [{"name": "FIX", "value": "1"}]},
                                           {"name": "fix", "args": ["fix=1"]}]}})
    # env patches alone: accepted, its runs start once the proxy is built
    await cluster.create(DIAGNOSES, NS, {"metadata": {"name": "env-only"}, "spec": {
        "proxyModel": "fw", "candidates": [{"name": "env", "env": [{"name": "FIX", "value": "1"}]}]}})
    # refused at once, while the proxy is still being built (hours, for a real model)
    await eventually(lambda: _status(cluster, "dropped").get("phase") == "Failed", 20, "the refusal")
    assert cluster.status(NS, "fw").get("phase") == "Transforming"
    await _built(cluster, tmp_path, transformer)
    accepted = next(c for c in _status(cluster, "dropped")["conditions"] if c["type"] == "Accepted")
    assert (accepted["status"], accepted["reason"]) == ("False", "CandidateArgsIgnored")
    assert accepted["message"].startswith("candidate 'fix' adds fix=1 to the args of the first container")
    assert "`sh -c SCRIPT`, whose script reads no arguments" in accepted["message"] and '"$@"' in accepted["message"]
    await eventually(lambda: _runs(cluster, "env-only"), 20, "the env-only diagnosis's runs")
    await eventually(lambda: "CandidateArgsIgnored" in cluster.event_reasons(NS, "dropped"), 10, "the Event")
    await asyncio.sleep(3 * TICK)  # later ticks (and kopf's Event queue) add nothing: said once
    assert cluster.event_reasons(NS, "dropped").count("CandidateArgsIgnored") == 1 and _runs(cluster, "dropped") == []
