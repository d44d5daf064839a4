"""Diagnosis through kopf and the API emulator: its runs are the ProxyModel's reproduction
workloads, run here as local `moe-proxy repro` processes (the Job controller and the kubelet of
`controllers.py` / `kubelet.py`), at most `parallelism` at a time, and the verdicts in status are
those `moe-proxy diagnose` gives for the same runs. Also: an operator restart makes no second
workload, and bad input is refused with a reason."""

from __future__ import annotations

import asyncio
import json

import pytest

from moe_proxy.investigate.diagnose import SeedRun, against, cost_of, verdict
from moe_proxy.metrics.readers import read_metrics
from moe_proxy.metrics.verdict import cost_series, series_rows
from proxymodel_operator import diagnosis
from proxymodel_operator.diagnosis_runs import LABEL_DIAGNOSIS
from proxymodel_operator.resources import DIAGNOSES, JOBS, PROXYMODELS

from .controllers import CONTROLLERS
from .harness import (ACCESS_KEY, SECRET_KEY, Operator, eventually, proxymodel, registry_copy, tiny_proxy_in,
                      tiny_report)
from .kubelet import Kubelet

NS = "team-diag"
TICK = 0.3
STEPS = 4


@pytest.fixture()
def registry():
    """The ProxyModel handlers and the Diagnosis timer."""
    registry = registry_copy()
    diagnosis.register(TICK, registry)
    return registry


@pytest.fixture(scope="module")
def tiny_proxy(tmp_path_factory):
    """The tiny Qwen3-MoE proxy (8 -> 4 experts): at lr 0.1 it diverges at step 1."""
    return tiny_proxy_in(tmp_path_factory.mktemp("diagnosis"))


async def _built_proxymodel(cluster, name: str, proxy) -> None:
    """A ProxyModel whose transformer reported `proxy`: its reproduction is the baseline
    (`moe-proxy repro --steps 4 --lr 0.1 --fail-on divergence`, one device)."""
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    await cluster.create(PROXYMODELS, NS, proxymodel(name, reproduction={
        "runtime": "Job", "maxSteps": STEPS, "lr": 0.1, "precision": "fp32", "failOn": {"signature": "divergence"},
        "accelerator": {"devices": 1, "devicesPerNode": 1}}))
    transformer = await eventually(lambda: cluster.get(JOBS, NS, f"{name}-transform-g1"), 30, "transformer Job")
    await cluster.finish_pod(NS, transformer, "transformer", 0, tiny_report(proxy))
    await cluster.job_condition(NS, transformer["metadata"]["name"], "Complete")
    await eventually(lambda: cluster.status(NS, name).get("phase") == "Reproducing", 30, "the proxy built")


def _status(cluster, name: str) -> dict:
    return (cluster.get(DIAGNOSES, NS, name) or {}).get("status") or {}


def _condition(cluster, name: str, kind: str) -> dict:
    return next((c for c in _status(cluster, name).get("conditions") or [] if c["type"] == kind), {})


def _runs(cluster, name: str) -> list[dict]:
    """The Diagnosis's workloads, oldest first."""
    return [j for j in cluster.objects_of("jobs", NS)
            if (j["metadata"].get("labels") or {}).get(LABEL_DIAGNOSIS) == name]


def _finished(job: dict) -> bool:
    return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
               for c in (job.get("status") or {}).get("conditions") or [])


def _summary_run(summary: dict) -> SeedRun:
    """A run's summary.json as `moe-proxy diagnose` reads it (diagnose.seed_outcome)."""
    first = summary.get("first_failure") or {}
    reproduced = bool(summary.get("reproduced"))
    return SeedRun(reproduced, first.get("signature") if reproduced else None,
                   first.get("step") if reproduced else None,
                   int(summary.get("steps_completed", 0)), summary.get("stopped", ""))


@pytest.mark.slow
async def test_a_diagnosis_runs_its_matrix_parallelism_at_a_time_with_the_clis_verdicts(cluster, operator,
                                                                                         tiny_proxy, tmp_path):
    await cluster.create(DIAGNOSES, NS, {"metadata": {"name": "dx"}, "spec": {
        "proxyModel": "pm", "seeds": 1, "parallelism": 2,
        "candidates": ["lower-lr", {"name": "again", "args": ["--lr", "0.1"]}]}})
    # no ProxyModel yet: it waits, and says why
    await eventually(lambda: _condition(cluster, "dx", "Accepted").get("reason") == "ProxyModelNotFound", 10,
                     "the missing ProxyModel said")
    await _built_proxymodel(cluster, "pm", tiny_proxy)

    summaries: dict[str, dict] = {}
    metrics: dict[str, dict] = {}
    most = 0
    for _ in range(6):
        await eventually(lambda: any(not _finished(j) for j in _runs(cluster, "dx"))
                         or _status(cluster, "dx").get("phase") == "Complete", 30, "the next runs")
        await asyncio.sleep(3 * TICK)  # a tick more: the operator would have made more by now
        live = [j for j in _runs(cluster, "dx") if not _finished(j)]
        most = max(most, len(live))
        assert len(live) <= 2, [j["metadata"]["name"] for j in live]
        if not live:
            break
        started = [(job, await CONTROLLERS["Job"].start(cluster, NS, job)) for job in live]
        kubelets = [Kubelet(cluster, NS, tmp_path / "node", hosts=s.hosts) for _, s in started]
        ran = await asyncio.gather(*(asyncio.to_thread(k.run, s.pods) for k, (_, s) in zip(kubelets, started)))
        for kubelet, (job, s), results in zip(kubelets, started, ran):
            pod = s.pods[0]
            result = results[pod.name][s.container]
            assert result.exit_code == 0, result.output[-3000:]
            summaries[job["metadata"]["name"]] = json.loads((tmp_path / "node" / pod.name / "run" /
                                                             "summary.json").read_text())
            metrics[job["metadata"]["name"]] = read_metrics(tmp_path / "node" / pod.name / "run" / "metrics.jsonl")
            await kubelet.report(pod, results[pod.name])
            await CONTROLLERS["Job"].finish(cluster, NS, job, True)
    await eventually(lambda: _status(cluster, "dx").get("phase") == "Complete", 30, "the diagnosis complete")
    assert most == 2 and sorted(summaries) == ["dx-again-s0", "dx-baseline-s0", "dx-lower-lr-s0"]

    status = _status(cluster, "dx")
    job = cluster.get(JOBS, NS, "dx-lower-lr-s0")
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-4:] == ["--lr", "0.01", "--seed", "0"] and args[args.index("--lr") + 1] == "0.1"
    assert [o["kind"] for o in job["metadata"]["ownerReferences"]] == ["Diagnosis"]

    # the CLI's verdicts on the same runs
    runs = {name: {0: _summary_run(s)} for name, s in summaries.items()}
    base = runs["dx-baseline-s0"]
    assert (base[0].reproduced, base[0].signature, base[0].step) == (True, "divergence", 1)
    # `again` is the baseline under another name: the CLI's no-change
    expected = {c: verdict(base, runs[f"dx-{c}-s0"], STEPS, changed=c != "again") for c in ("lower-lr", "again")}
    assert expected["lower-lr"][0] == "fixed" and expected["again"][0] == "no-change"
    assert {c["name"]: (c["verdict"], c["note"]) for c in status["candidates"]} == expected
    assert status["fixedBy"] == "lower-lr" and status["baseline"]["verdict"] == "reproduced"
    # the CLI's cost columns from the same runs' metrics as the termination messages carry them (4 digits:
    # a standard deviation of nearly equal times is not within 1e-3 of the full-precision one), and the
    # means within that rounding of the full-precision metrics
    def carried(run: str) -> dict:
        return series_rows(cost_series(metrics[run]))

    base_cost = cost_of([carried("dx-baseline-s0")], (0, 1))
    assert status["baseline"]["cost"] == pytest.approx(base_cost)
    for c in status["candidates"]:
        run = f"dx-{c['name']}-s0"
        assert c["cost"] == pytest.approx(against(cost_of([carried(run)], (0, 1)), base_cost))
        full = cost_of([metrics[run]], (0, 1))
        assert [c["cost"][k] for k in ("reward_mean", "loss_mean", "time_per_step_s")] == pytest.approx(
            [full[k] for k in ("reward_mean", "loss_mean", "time_per_step_s")], rel=1e-3)
        assert c["cost"]["reward_mean"] is not None and c["cost"]["time_per_step_s"] > 0
    assert "series" not in json.dumps(status)  # status keeps the figures, not the steps
    assert status["progress"] == "3/3"
    row = status["baseline"]["runs"][0]
    assert (row["seed"], row["reproduced"], row["signature"], row["step"], row["workload"]) == \
        (0, True, "divergence", 1, "dx-baseline-s0")
    assert _condition(cluster, "dx", "Complete")["reason"] == "FixFound"
    wanted = {"DiagnosisStarted", "RunCreated", "CandidateJudged", "DiagnosisComplete"}
    await eventually(lambda: wanted <= set(cluster.event_reasons(NS, "dx")),
                     what=lambda: f"Events {wanted}, not {cluster.event_reasons(NS, 'dx')}")


async def _finish_fake(cluster, job: dict, reproduced: bool, step: int | None = None) -> None:
    """The run's pod ended with this verdict (no process: what the kubelet would write)."""
    report = {"reproduced": reproduced, "signature": "divergence" if reproduced else None, "step": step,
              "metrics": {}}
    await cluster.finish_pod(NS, job, "reproduction", 0, json.dumps(report))
    await cluster.job_condition(NS, job["metadata"]["name"], "Complete")


async def test_an_operator_restart_makes_no_second_workload(cluster, operator_env, registry):
    first = Operator(registry=registry)
    await first.start()
    await cluster.create(DIAGNOSES, NS, {"metadata": {"name": "rx"}, "spec": {
        "proxyModel": "pm", "seeds": 1, "parallelism": 1, "candidates": ["lower-lr", "z-loss"]}})
    await _built_proxymodel(cluster, "pm", "/nowhere/proxy")
    baseline = await eventually(lambda: cluster.get(JOBS, NS, "rx-baseline-s0"), 20, "the baseline run")
    await first.stop()
    first.check_handler_errors()
    created_before = sum(c.verb == "create" and c.resource == "jobs" and not c.by_test for c in cluster.emulator.calls)

    # while no operator runs, the baseline run ends
    await _finish_fake(cluster, baseline, True, 1)
    second = Operator(registry=registry)
    await second.start()
    try:
        lower = await eventually(lambda: cluster.get(JOBS, NS, "rx-lower-lr-s0"), 20, "the next run")
        await asyncio.sleep(5 * TICK)
        assert [j["metadata"]["name"] for j in _runs(cluster, "rx")] == ["rx-baseline-s0", "rx-lower-lr-s0"]
        await _finish_fake(cluster, lower, False)
        z = await eventually(lambda: cluster.get(JOBS, NS, "rx-z-loss-s0"), 20, "the last run")
        await _finish_fake(cluster, z, True, 2)
        await eventually(lambda: _status(cluster, "rx").get("phase") == "Complete", 20, "the diagnosis complete")
        await asyncio.sleep(3 * TICK)
    finally:
        await second.stop()
    second.check_handler_errors()
    created = sum(c.verb == "create" and c.resource == "jobs" and not c.by_test for c in cluster.emulator.calls)
    assert created - created_before == 2  # lower-lr and z-loss: the baseline never again
    assert [j["metadata"]["name"] for j in _runs(cluster, "rx")] == ["rx-baseline-s0", "rx-lower-lr-s0",
                                                                     "rx-z-loss-s0"]
    status = _status(cluster, "rx")
    assert {c["name"]: c["verdict"] for c in status["candidates"]} == {"lower-lr": "fixed", "z-loss": "reproduced"}
    assert status["fixedBy"] == "lower-lr"


async def test_bad_input_is_refused_with_a_reason(cluster, operator):
    await cluster.create(DIAGNOSES, NS, {"metadata": {"name": "bad"}, "spec": {
        "proxyModel": "pm", "candidates": ["lower-lr", "more-cowbell"]}})
    await eventually(lambda: _status(cluster, "bad").get("phase") == "Failed", 10, "the refusal")
    accepted = _condition(cluster, "bad", "Accepted")
    assert (accepted["status"], accepted["reason"]) == ("False", "UnknownCandidate")
    assert all(name in accepted["message"] for name in ("'more-cowbell'", "lower-lr", "z-loss"))
    events = await eventually(lambda: [e for e in cluster.objects_of("events", NS)
                                       if e.get("involvedObject", {}).get("name") == "bad"], 10, "its Event")
    assert [(e["type"], e["reason"]) for e in events] == [("Warning", "UnknownCandidate")]
    assert _runs(cluster, "bad") == []


FRAMEWORK = """\
import json, os, time
with open(os.environ["VERL_FILE_LOGGER_PATH"], "a") as f:
    for step in range(1, 6):
        nan = step == 3 and os.environ.get("FIX") != "1"
        f.write(json.dumps({"step": step, "data": {"actor/pg_loss": float("nan") if nan else 1.0 / step,
                                                   "actor/grad_norm": 1.0}}) + "\\n")
        f.flush()
        time.sleep(0.2)
"""


@pytest.mark.slow
async def test_a_frameworks_diagnosis_runs_env_patches_and_the_sidecar_gives_the_verdicts(cluster, operator, tmp_path):
    """A ProxyModel with its own framework (spec.reproduction.template): candidates patch its first
    container, and each run's `moe-proxy watch` sidecar gives its verdict."""
    script = tmp_path / "framework.py"
    script.write_text(FRAMEWORK)
    template = {"spec": {"containers": [{"name": "verl", "image": "verl:test", "command": ["python", str(script)]}]}}
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    await cluster.create(PROXYMODELS, NS, proxymodel("fw", reproduction={
        "runtime": "Job", "maxSteps": 5, "template": template, "failOn": {"signature": "nan"},
        "accelerator": {"devices": 1, "devicesPerNode": 1}}))
    transformer = await eventually(lambda: cluster.get(JOBS, NS, "fw-transform-g1"), 30, "transformer Job")
    await cluster.finish_pod(NS, transformer, "transformer", 0, tiny_report(tmp_path / "proxy"))
    await cluster.job_condition(NS, "fw-transform-g1", "Complete")
    await cluster.create(DIAGNOSES, NS, {"metadata": {"name": "fx"}, "spec": {
        "proxyModel": "fw", "seeds": 1, "parallelism": 3,
        "candidates": [{"name": "fix", "env": [{"name": "FIX", "value": "1"}]}, {"name": "noop", "args": ["--x"]}]}})
    kubelet = Kubelet(cluster, NS, tmp_path / "node", hosts=[])
    for count in (1, 3):  # the baseline first; once it reproduced, both candidates at once
        jobs = await eventually(lambda: len(_runs(cluster, "fx")) == count and _runs(cluster, "fx"), 20, "the runs")
        started = [(job, await CONTROLLERS["Job"].start(cluster, NS, job)) for job in jobs if not _finished(job)]
        ran = await asyncio.to_thread(kubelet.run, [p for _, s in started for p in s.pods])
        for job, s in started:
            await kubelet.report(s.pods[0], ran[s.pods[0].name])
            await CONTROLLERS["Job"].finish(cluster, NS, job, True)
    await eventually(lambda: _status(cluster, "fx").get("phase") == "Complete", 30, "the diagnosis complete")
    status = _status(cluster, "fx")
    base = status["baseline"]["runs"][0]
    assert (status["baseline"]["verdict"], base["signature"], base["step"]) == ("reproduced", "nan", 3)
    assert {c["name"]: c["verdict"] for c in status["candidates"]} == {"fix": "fixed", "noop": "reproduced"}
    assert status["fixedBy"] == "fix"
