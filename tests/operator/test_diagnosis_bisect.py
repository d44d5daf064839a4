"""A Diagnosis's bisection mode (spec.checkpoints, #26 item 4): `moe-proxy bisect` on the cluster.

The decisions without a cluster: the probes follow the CLI's search (`investigate.bisect.search`) to
the same first bad checkpoint, a restart re-creates a recorded probe under its own name only,
and bad input is refused. Then end to end through kopf and the API emulator: a run of 4 tiny
checkpoints on SeaweedFS whose last 2 carry a planted massive activation (a dense MLP's output
beyond fp16's range, as tests/repro/test_bisect.py plants it); each probe's proxy is built from
its checkpoint (the transformer's part, played here with the same build) and its reproduction
runs as a local `moe-proxy repro` process; and an operator restart in the middle of a probe makes
no second ProxyModel nor run.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from moe_proxy.investigate.bisect import Probe, search
from proxymodel_operator.checkpoint_watch import CHECKPOINT_WATCHES
from proxymodel_operator.diagnosis_bisect import BUILDING, PROBE_ROLE, flying, in_flight, parse_bisection, progress, start
from proxymodel_operator.diagnosis_spec import InvalidDiagnosis
from proxymodel_operator.diagnosis_rows import RUN_DONE, RUN_RUNNING
from proxymodel_operator.diagnosis_runs import LABEL_DIAGNOSIS
from proxymodel_operator.diagnosis_status import DIAGNOSED, DIAGNOSIS_FAILED
from proxymodel_operator.outcome import RUNNING, SUCCEEDED, Outcome
from proxymodel_operator.resources import DIAGNOSES, JOBS, LABEL_ROLE, PROXYMODELS
from proxymodel_operator.settings import Settings
from proxymodel_operator.watch_decisions import LABEL_STEP

from ..repro.test_bisect import planted_run
from .controllers import CONTROLLERS
from .harness import ACCESS_KEY, BUCKET, SECRET_KEY, Operator, eventually, tiny_report
from .kubelet import Kubelet
from .test_diagnosis import TICK, registry  # noqa: F401 - the same operator: the ProxyModel handlers, the timer

NS = "team-bisect"
HF = "actor/huggingface"
TEMPLATE = {"spec": {"pruning": {"experts": 4},
                     "reproduction": {"runtime": "Job", "maxSteps": 1, "precision": "fp16",
                                      "failOn": {"signature": "overflow"},
                                      "accelerator": {"devices": 1, "devicesPerNode": 1}}}}


def checkpoints_spec(prefix: str, **extra) -> dict:
    return {"source": {"uri": prefix, "credentialsSecret": "s3-creds", "region": "us-east-1"},
            "pattern": f"global_step_*/{HF}", "template": TEMPLATE, **extra}


# --- the decisions, without a cluster ----------------------------------------------------------------


def _body(status: dict | None = None, **spec) -> dict:
    return {"apiVersion": "moeproxy.io/v1alpha1", "kind": "Diagnosis",
            "metadata": {"name": "bx", "namespace": NS, "generation": 1, "uid": "u-1"},
            "spec": {"checkpoints": checkpoints_spec(f"s3://{BUCKET}/run"), **spec}, "status": status or {}}


def _built(manifest: dict) -> dict:
    """The probe's ProxyModel once its transformer reported the proxy (its reproduction off)."""
    return {**manifest, "status": {"phase": "ProxyReady", "proxy": {
        "uri": f"s3://proxies/{manifest['metadata']['name']}/", "manifestSha256": "ab" * 32,
        "expertsPerLayer": {"after": 4, "topK": 2}}}}


def _apply(body: dict, decision) -> dict:
    body = json.loads(json.dumps(body))
    body["status"] = {**body["status"], **decision.status}
    return body


def _bisect_without_a_cluster(n: int, bad_from: int, restart_at: int | None = None, nan_at: frozenset = frozenset()):
    """Drive the decisions over `n` checkpoints (those from `bad_from` on reproduce at step 0,
    those in `nan_at` stop at step 0 on NaN before the failure could come):
    each tick's ProxyModel and run exist once created (`restart_at`: the probe number whose
    ProxyModel and run creations are lost once, as when the operator stops between the status
    write and the create). Returns the final body and every (kind, name) created."""
    listed = [{"step": 10 * (i + 1), "uri": f"s3://{BUCKET}/run/global_step_{10 * (i + 1)}/{HF}"} for i in range(n)]
    body = _body()
    b = parse_bisection(body["spec"])
    body = _apply(body, start({}, b, checkpoints_spec(f"s3://{BUCKET}/run"), listed, 1))
    made: dict[str, dict] = {}
    created: list[tuple[str, str]] = []
    lost = set()
    for _ in range(10 * n):
        probe = in_flight(body["status"])
        child = _built(made[probe["proxyModel"]]) if probe and probe["proxyModel"] in made else None
        seen = {}
        if probe and probe.get("workload") in made:
            reproduced = probe["index"] >= bad_from
            seen[probe["workload"]] = Outcome(SUCCEEDED, report={
                "reproduced": reproduced, "signature": "overflow" if reproduced else None,
                "step": 0 if reproduced else None, "steps_completed": 1} | (
                {"steps_completed": 1, "stopped": "loss or weights are NaN; later steps would be meaningless",
                 "also_seen": {"nan": 0}} if probe["index"] in nan_at else {}))
        decision = progress(body, child, seen, Settings())
        body = _apply(body, decision)
        for _, manifest in decision.create:
            name = manifest["metadata"]["name"]
            created.append((manifest["kind"], name))
            number = len(body["status"]["probes"])
            if number == restart_at and (manifest["kind"], name) not in lost:
                lost.add((manifest["kind"], name))  # the operator stopped before this create
                continue
            made[name] = manifest
        if body["status"].get("phase") in (DIAGNOSED, DIAGNOSIS_FAILED):
            return body, created, made
    raise AssertionError("the bisection did not finish")


@pytest.mark.parametrize("n, bad_from", [(8, 5), (8, 0), (4, 2), (2, 1), (9, 9)])
def test_the_probes_follow_the_clis_search_to_the_same_first_bad(n, bad_from):
    body, created, made = _bisect_without_a_cluster(n, bad_from)
    status = body["status"]
    steps = [10 * (i + 1) for i in range(n)]
    first, expected = search([SimpleNamespace(step=s, uri=f"u{s}") for s in steps],
                             lambda i: Probe(f"u{steps[i]}", steps[i], i >= bad_from, None, None), good_given=False)
    assert [p["index"] for p in status["probes"]] == [i for i, _ in expected]
    assert [p["reproduced"] for p in status["probes"]] == [p.reproduced for _, p in expected]
    assert status["phase"] == DIAGNOSED and status["monotone"] is True
    assert status["firstBad"] == ({"checkpoint": f"s3://{BUCKET}/run/global_step_{steps[first]}/{HF}",
                                   "step": steps[first]} if first is not None else None)
    # one ProxyModel and one run per probe, each made once, under deterministic names
    assert len(created) == len(set(created)) == 2 * len(expected)
    pm = made[f"bx-step-{steps[-1]}"]
    assert pm["spec"]["reproduction"]["enabled"] is False
    assert pm["spec"]["source"]["uri"] == f"s3://{BUCKET}/run/global_step_{steps[-1]}/{HF}"
    assert pm["metadata"]["labels"][LABEL_DIAGNOSIS] == "bx" and pm["metadata"]["labels"][LABEL_ROLE] == PROBE_ROLE
    assert [o["kind"] for o in pm["metadata"]["ownerReferences"]] == ["Diagnosis"]
    run = made[f"bx-step-{steps[-1]}-s0"]
    assert run["metadata"]["labels"][LABEL_DIAGNOSIS] == "bx" and run["spec"]["template"]["spec"]["containers"][0][
        "args"][1] == f"s3://proxies/bx-step-{steps[-1]}/"


def test_a_probe_stopped_by_nan_is_inconclusive_and_stepped_around_as_the_clis_search_does():
    """A run stopped on NaN before the failure asked for cannot say clean (it read clean before):
    the probe is inconclusive, the search steps around it as the CLI's does, status names it."""
    n, bad_from, nan_at = 8, 5, 3
    body, _, _ = _bisect_without_a_cluster(n, bad_from, nan_at=frozenset({nan_at}))
    status = body["status"]
    steps = [10 * (i + 1) for i in range(n)]
    first, expected = search([SimpleNamespace(step=s, uri=f"u{s}") for s in steps],
                             lambda i: Probe(f"u{steps[i]}", steps[i], None if i == nan_at else i >= bad_from,
                                             None, None), good_given=False)
    assert nan_at in [i for i, _ in expected]  # the planted NaN lies on the search's path
    assert [(p["index"], p["reproduced"]) for p in status["probes"]] == [(i, p.reproduced) for i, p in expected]
    row = next(p for p in status["probes"] if p["index"] == nan_at)
    assert row["state"] == "inconclusive" and row["note"] == "seed 0: stopped after 1 step by nan at step 0"
    assert status["firstBad"]["step"] == steps[first] == steps[bad_from]
    assert status["inconclusive"] == [{"step": steps[nan_at], "checkpoint": f"s3://{BUCKET}/run/global_step_"
                                       f"{steps[nan_at]}/{HF}", "why": row["note"]}]
    assert f"could not judge step {steps[nan_at]}" in status["message"]


def test_a_probe_lost_between_status_and_create_is_made_again_under_its_name():
    body, created, made = _bisect_without_a_cluster(8, 5, restart_at=2)
    second = body["status"]["probes"][1]
    assert second["proxyModel"] == "bx-step-40" and second["workload"] == "bx-step-40-s0"
    assert created.count(("ProxyModel", second["proxyModel"])) == 2  # lost once, made again: same name
    assert created.count(("Job", second["workload"])) == 2
    assert body["status"]["firstBad"]["step"] == 60 and body["status"]["phase"] == DIAGNOSED


def _first_probe_running(**spec) -> tuple[dict, dict, dict]:
    """A bisection over 3 checkpoints whose first probe (the last checkpoint's) runs: (the
    Diagnosis, the probe's ProxyModel, the probe)."""
    listed = [{"step": s, "uri": f"s3://{BUCKET}/run/s{s}"} for s in (10, 20, 30)]
    body = _body(**spec)
    body = _apply(body, start({}, parse_bisection(body["spec"]), checkpoints_spec(f"s3://{BUCKET}/run"), listed, 1))
    first = progress(body, None, {}, Settings())
    body = _apply(body, first)
    (_, pm), = first.create
    body = _apply(body, progress(body, _built(pm), {}, Settings()))
    return body, pm, in_flight(body["status"])


def test_a_probe_whose_run_fails_fails_the_bisection():
    body, pm, probe = _first_probe_running()
    assert probe["phase"] == RUN_RUNNING
    assert progress(body, _built(pm), {probe["workload"]: Outcome(RUNNING)}, Settings()).create == []
    failed = progress(body, _built(pm), {probe["workload"]: Outcome("Failed", "OOMKilled", "container exited")},
                      Settings())
    assert failed.status["phase"] == DIAGNOSIS_FAILED and "OOMKilled" in failed.status["message"]
    assert [c["reason"] for c in failed.status["conditions"] if c["type"] == "Failed"] == ["ProbeFailed"]


def _probe_ends(report: dict, **spec):
    """The first probe (the last checkpoint's) of a bisection whose run ends with `report`."""
    body, pm, probe = _first_probe_running(**spec)
    return progress(body, _built(pm), {probe["workload"]: Outcome(SUCCEEDED, report=report)}, Settings())


def test_a_probe_that_cannot_show_the_failure_asked_for_is_never_clean():
    """Collapse on a proxy keeping <= top-k experts: the probe's run could not judge (the CLI's
    rule: as a run that failed), so the probe is inconclusive, not clean, and with its one seed the
    bisection stops saying why (every probe's proxy keeps the template's experts)."""
    why = "experts <= top-k (moe/load_uniform_share 1): every token uses every expert"
    clean = {"reproduced": False, "signature": None, "step": None, "steps_completed": 1}
    failed = _probe_ends({**clean, "cannot_show": {"collapse": why}}, failOn={"signature": "collapse"})
    said = f"probe step 30: could not judge: collapse cannot show in this run: {why}"
    assert failed.status["phase"] == DIAGNOSIS_FAILED and failed.status["message"] == said
    (probe,) = failed.status["probes"]
    assert (probe["reproduced"], probe["state"], probe["note"]) == (None, "inconclusive", said.split(": ", 1)[1])
    assert [c["message"] for c in failed.status["conditions"] if c["type"] == "Failed"] == [said]
    assert ("Warning", "ProbeFailed", said) in failed.events
    # the same message, the failure asked for another one: a clean probe, as before
    judged = _probe_ends({**clean, "cannot_show": {"collapse": why}})  # the template's overflow
    (probe,) = judged.status["probes"]
    assert (probe["reproduced"], probe["state"]) == (False, "clean") and judged.status["phase"] != DIAGNOSIS_FAILED


@pytest.mark.parametrize("spec, text", [
    ({"proxyModel": "pm"}, "give one or the other"),
    ({"checkpoints": {"watch": "w", "source": {"uri": "s3://b/r"}}}, "not both"),
    ({"checkpoints": {"source": {"uri": "s3://b/r"}}}, "{watch: a CheckpointWatch"),
    ({"checkpoints": {"watch": "w", "good": 30, "bad": 20}}, "good 30 must come before bad 20"),
    ({"checkpoints": {"watch": "w"}, "failOn": {"signature": "boom"}}, "spec.failOn.signature"),
])
def test_bad_bisection_specs_are_refused(spec, text):
    body = {"checkpoints": checkpoints_spec("s3://b/r"), **spec}
    with pytest.raises(InvalidDiagnosis) as caught:
        parse_bisection(body)
    assert text in str(caught.value), caught.value


# --- end to end: kopf, the emulated API, SeaweedFS, local runs ------------------------------------------


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """4 checkpoints (verl layout) of the tiny Qwen3-MoE; steps 30 and 40 carry a dense MLP whose
    output overflows fp16 (tests/repro/test_bisect.py's plant)."""
    return planted_run(tmp_path_factory.mktemp("bisect-run"), (10, 20, 30, 40), (30, 40))


def _upload(s3, local_run, prefix: str) -> str:
    client = s3.client()
    for path in local_run.rglob("*"):
        if path.is_file():
            client.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.relative_to(local_run)}", Body=path.read_bytes())
    return f"s3://{BUCKET}/{prefix}"


def _status(cluster, name: str) -> dict:
    return (cluster.get(DIAGNOSES, NS, name) or {}).get("status") or {}


def _unfinished(cluster, name: str) -> list[dict]:
    return [j for j in cluster.objects_of("jobs", NS) if not any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in (j.get("status") or {}).get("conditions") or [])
        and (j["metadata"].get("name", "").startswith(f"{name}-step-"))]


async def _transform(cluster, job: dict, local_run, proxies) -> None:
    """The transformer's part: build the probe checkpoint's proxy (as moe-proxy build does) and
    report it."""
    from moe_proxy.pruning import build_proxy

    pm = cluster.get(PROXYMODELS, NS, job["metadata"]["name"].removesuffix("-transform-g1"))
    step = int(pm["metadata"]["labels"][LABEL_STEP])
    proxy = proxies / f"step-{step}"
    if not proxy.exists():
        await asyncio.to_thread(build_proxy, str(local_run / f"global_step_{step}" / HF), str(proxy), experts=4)
    await cluster.finish_pod(NS, job, "transformer", 0, tiny_report(proxy))
    await cluster.job_condition(NS, job["metadata"]["name"], "Complete")


async def _run(cluster, job: dict, node) -> dict:
    """The probe's reproduction, a local `moe-proxy repro`: its summary.json."""
    started = await CONTROLLERS["Job"].start(cluster, NS, job)
    kubelet = Kubelet(cluster, NS, node, hosts=started.hosts)
    ran = await asyncio.to_thread(kubelet.run, started.pods)
    pod = started.pods[0]
    assert ran[pod.name][started.container].exit_code == 0, ran[pod.name][started.container].output[-3000:]
    await kubelet.report(pod, ran[pod.name])
    await CONTROLLERS["Job"].finish(cluster, NS, job, True)
    return json.loads((node / pod.name / "run" / "summary.json").read_text())


async def _play(cluster, name: str, local_run, tmp_path, until) -> dict[int, dict]:
    """Be the cluster for the Diagnosis's workloads until `until()`: the summaries by step."""
    summaries: dict[int, dict] = {}
    while not until():
        jobs = await eventually(lambda: _unfinished(cluster, name) or until(), 60, "the next workload")
        for job in jobs if isinstance(jobs, list) else []:
            if job["metadata"]["name"].endswith("-transform-g1"):
                await _transform(cluster, job, local_run, tmp_path / "proxies")
            else:
                step = int(job["metadata"]["name"].split("-step-")[1].split("-")[0])
                summaries[step] = await _run(cluster, job, tmp_path / "node")
    return summaries


async def _secret(cluster) -> None:
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)


@pytest.mark.slow
async def test_a_bisection_finds_the_first_planted_checkpoint_end_to_end(cluster, s3, operator, local_run, tmp_path):
    prefix = _upload(s3, local_run, "bisect-e2e")
    await _secret(cluster)
    await cluster.create(DIAGNOSES, NS, {"metadata": {"name": "bx"}, "spec": {"checkpoints": checkpoints_spec(prefix)}})
    summaries = await _play(cluster, "bx", local_run, tmp_path, lambda: _status(cluster, "bx").get("phase")
                            in (DIAGNOSED, DIAGNOSIS_FAILED))
    status = _status(cluster, "bx")
    assert status["phase"] == DIAGNOSED, status.get("message")
    assert status["firstBad"] == {"checkpoint": f"{prefix}/global_step_30/{HF}", "step": 30}
    assert status["monotone"] is True and status["boundary"] == "confirmed: step 20, the checkpoint before, ran clean"
    # the CLI's search order (40, 20, 30, then 10 before the last clean one) and each probe's
    # verdict as its run's summary says
    assert [(p["step"], p["reproduced"], p["signature"], p["onset"]) for p in status["probes"]] == [
        (40, True, "overflow", 0), (20, False, None, None), (30, True, "overflow", 0), (10, False, None, None)]
    assert {s: summaries[s]["reproduced"] for s in summaries} == {40: True, 20: False, 30: True, 10: False}
    assert sorted(cluster.names(PROXYMODELS, NS)) == ["bx-step-10", "bx-step-20", "bx-step-30", "bx-step-40"]
    complete = next(c for c in status["conditions"] if c["type"] == "Complete")
    assert (complete["status"], complete["reason"]) == ("True", "FirstBadFound")
    wanted = {"BisectionStarted", "ProbeCreated", "RunCreated", "ProbeFinished", "BisectionComplete"}
    await eventually(lambda: wanted <= set(cluster.event_reasons(NS, "bx")),
                     what=lambda: f"Events {wanted}, not {cluster.event_reasons(NS, 'bx')}")


async def test_an_operator_restart_mid_probe_makes_no_second_proxymodel_or_run(cluster, checkpointwatch_resource, s3,
                                                                               operator_env, registry, local_run):
    """Through a CheckpointWatch: the bisection lists its prefix with its template; the operator
    stops while the first probe builds and again while its run runs."""
    prefix = _upload(s3, local_run, "bisect-restart")
    await _secret(cluster)
    await cluster.create(CHECKPOINT_WATCHES, NS, {"metadata": {"name": "w"}, "spec": {
        **checkpoints_spec(prefix)}})
    await cluster.create(DIAGNOSES, NS, {"metadata": {"name": "rx"}, "spec": {"checkpoints": {"watch": "w"}}})

    def posts(plural: str) -> int:
        return sum(c.verb == "create" and c.resource == plural and not c.by_test for c in cluster.emulator.calls)

    first = Operator(registry=registry)
    await first.start()
    pm = await eventually(lambda: cluster.get(PROXYMODELS, NS, "rx-step-40"), 30, "the first probe's ProxyModel")
    transformer = await eventually(lambda: cluster.get(JOBS, NS, "rx-step-40-transform-g1"), 30, "its transformer")
    await first.stop()
    first.check_handler_errors()
    assert _status(cluster, "rx")["probes"][0]["phase"] == BUILDING
    await cluster.finish_pod(NS, transformer, "transformer", 0, tiny_report("/nowhere/proxy"))
    await cluster.job_condition(NS, transformer["metadata"]["name"], "Complete")

    second = Operator(registry=registry)
    await second.start()
    run = await eventually(lambda: cluster.get(JOBS, NS, "rx-step-40-s0"), 30, "the first probe's run")
    await asyncio.sleep(5 * TICK)
    await second.stop()
    second.check_handler_errors()
    await cluster.finish_pod(NS, run, "reproduction", 0, json.dumps(
        {"reproduced": False, "signature": None, "step": None, "steps_completed": 1}))
    await cluster.job_condition(NS, "rx-step-40-s0", "Complete")

    third = Operator(registry=registry)
    await third.start()
    try:
        await eventually(lambda: _status(cluster, "rx").get("phase") == DIAGNOSED, 30, "the bisection over")
        await asyncio.sleep(5 * TICK)
    finally:
        await third.stop()
    third.check_handler_errors()
    status = _status(cluster, "rx")
    assert status.get("firstBad") is None and [(p["step"], p["phase"]) for p in status["probes"]] == [(40, RUN_DONE)]
    assert status["bisection"]["watch"] == "w" and pm["spec"]["pruning"] == {"experts": 4, "fillDead": True}
    assert (posts("proxymodels"), posts("jobs")) == (1, 2)  # its ProxyModel and its run, each once
    assert cluster.names(PROXYMODELS, NS) == ["rx-step-40"]


async def test_too_few_checkpoints_are_refused_with_a_reason(cluster, s3, operator, local_run):
    prefix = _upload(s3, local_run, "bisect-few")
    await _secret(cluster)
    await cluster.create(DIAGNOSES, NS, {"metadata": {"name": "fx"}, "spec": {
        "checkpoints": checkpoints_spec(prefix, good=40)}})
    await eventually(lambda: _status(cluster, "fx").get("phase") == DIAGNOSIS_FAILED, 30, "the refusal")
    accepted = next(c for c in _status(cluster, "fx")["conditions"] if c["type"] == "Accepted")
    assert (accepted["status"], accepted["reason"]) == ("False", "TooFewCheckpoints")
    assert "bisect needs at least 2" in accepted["message"]
    assert cluster.names(PROXYMODELS, NS) == []


# --- a round of probes side by side (#45 item 1) ----------------------------------------------------


def _bisect_in_rounds(n: int, bad_from: int, parallelism: int, unjudged: frozenset = frozenset(),
                      per_step: str | None = None, steps: int = 1):
    """As _bisect_without_a_cluster, with spec.parallelism: every probe in flight has its
    ProxyModel (built once created) and its run's outcome (a clean run completes its `steps`, a
    reproducing one stops at its failure, step 0). Returns the final body, what was created, and
    the largest number of probes in flight at once."""
    listed = [{"step": 10 * (i + 1), "uri": f"s3://{BUCKET}/run/global_step_{10 * (i + 1)}/{HF}"} for i in range(n)]
    body = _body(parallelism=parallelism, **({"steps": steps} if steps != 1 else {}))
    b = parse_bisection(body["spec"])
    body = _apply(body, start({}, b, checkpoints_spec(f"s3://{BUCKET}/run"), listed, 1))
    made: dict[str, dict] = {}
    created, widest = [], 0
    for _ in range(10 * n):
        current = flying(body["status"])
        widest = max(widest, len(current))
        children = {p["proxyModel"]: _built(made[p["proxyModel"]]) if p["proxyModel"] in made else None
                    for p in current}
        for child in children.values():  # its plan: device-hours per RL step (the proxy's devices x its step time)
            if child is not None and per_step is not None:
                child["status"]["plan"] = {"deviceHoursPerStep": {"total": {"original": "9", "proxy": per_step}}}
        seen = {}
        for p in current:
            if p.get("workload") in made:
                bad = p["index"] >= bad_from
                seen[p["workload"]] = Outcome(SUCCEEDED, report={
                    "reproduced": bad, "signature": "overflow" if bad else None, "step": 0 if bad else None,
                    "steps_completed": 1 if bad else steps} | (
                        {"stopped": "loss or weights are NaN", "also_seen": {"nan": 0}} if p["index"] in unjudged
                        else {}))
        decision = progress(body, None, seen, Settings(), children=children)
        body = _apply(body, decision)
        for _, manifest in decision.create:
            created.append((manifest["kind"], manifest["metadata"]["name"]))
            made[manifest["metadata"]["name"]] = manifest
        if body["status"].get("phase") in (DIAGNOSED, DIAGNOSIS_FAILED):
            return body, created, widest
    raise AssertionError("the bisection did not finish")


@pytest.mark.parametrize("n, bad_from, unjudged", [(8, 5, ()), (9, 5, ()), (8, 0, ()), (17, 9, ()), (8, 5, (3,)),
                                                   (8, 5, (1, 4)), (8, 99, ())])
def test_a_round_of_three_probes_finds_the_clis_first_bad(n, bad_from, unjudged):
    """spec.parallelism 3: the CLI's search at --parallel 3, round by round, to the first bad
    checkpoint one at a time finds; on 8 or 9 checkpoints in 2 search rounds where one at a time
    takes 3."""
    unjudged = frozenset(unjudged)
    steps = [10 * (i + 1) for i in range(n)]
    ckpts = [SimpleNamespace(step=s, uri=f"u{s}") for s in steps]

    def test(i):
        return Probe(f"u{steps[i]}", steps[i], None if i in unjudged else i >= bad_from, None, None)
    one_rounds, rounds = [], []
    one, _ = search(ckpts, test, good_given=False, rounds=one_rounds)
    first, expected = search(ckpts, test, good_given=False, parallel=3, rounds=rounds)
    assert first == one
    body, created, widest = _bisect_in_rounds(n, bad_from, 3, unjudged)
    s = body["status"]
    assert [p["index"] for p in s["probes"]] == [i for i, _ in expected]
    assert [[p["index"] for p in s["probes"] if p["round"] == k] for k in range(1, len(rounds) + 1)] == \
        [r for _, r in rounds]
    assert s["firstBad"] == ({"checkpoint": f"s3://{BUCKET}/run/global_step_{steps[first]}/{HF}",
                              "step": steps[first]} if first is not None else None)
    assert s["rounds"] == len(rounds) and widest == max(len(r) for _, r in rounds)
    assert len(created) == len(set(created)) == 2 * len(expected)  # each ProxyModel and run made once
    if (n, bad_from, unjudged) in ((8, 5, frozenset()), (9, 5, frozenset())):
        assert s["searchRounds"] == 2 and sum(k == "search" for k, _ in one_rounds) == 3
        assert widest == 3


def test_one_probe_a_round_is_the_clis_order_and_says_its_rounds():
    body, _, widest = _bisect_in_rounds(8, 5, 1)
    s = body["status"]
    assert [p["index"] for p in s["probes"]] == [7, 3, 5, 4, 6] and widest == 1
    assert s["rounds"] == 5 and s["searchRounds"] == 3 and s["deviceHours"] is None  # no plan in these ProxyModels


def test_the_rounds_device_hours_are_the_plans():
    """deviceHours, the CLI's rule (sizing.run_device_hours): each probe's ProxyModel plan's
    device-hours per RL step x the steps its run completed: 4 for a clean run, 1 for one that
    stopped at its failure (not the 4 planned)."""
    body, _, _ = _bisect_in_rounds(8, 5, 3, per_step="0.25", steps=4)
    s = body["status"]
    hours = [(p["index"], float(p["deviceHours"]), p["stepsCompleted"]) for p in s["probes"]]
    assert hours == [(i, 0.25 if i >= 5 else 1.0, 1 if i >= 5 else 4) for i, _, _ in hours] and len(hours) == 6
    assert float(s["deviceHours"]) == sum(h for _, h, _ in hours) < 0.25 * 4 * 6
