"""The Diagnosis's decisions, without a cluster: parsing and refusals, the baseline from the
ProxyModel, run names and manifests, at most `parallelism` running, what a restart finds, and
verdicts by the CLI's rule."""

from __future__ import annotations

import json

import pytest

from moe_proxy.investigate.catalogue import CATALOGUE
from moe_proxy.reports import TERMINATION_LOG_LIMIT, encode, repro_report
from moe_proxy.investigate.diagnose import SeedRun, against, cost_of, verdict
from moe_proxy.metrics.verdict import HEADLINE, SERIES_BYTES, cost_series, series_rows
from proxymodel_operator.diagnosis_spec import InvalidDiagnosis, parse_diagnosis
from proxymodel_operator.diagnosis_matrix import decide
from proxymodel_operator.diagnosis_rows import RUN_DONE, RUN_ERROR, RUN_PENDING, RUN_RUNNING, recorded_running, seed_run
from proxymodel_operator.diagnosis_runs import LABEL_DIAGNOSIS, run_name
from proxymodel_operator.diagnosis_status import DIAGNOSED, DIAGNOSING, DIAGNOSIS_FAILED, WAITING_FOR_PROXY
from proxymodel_operator.outcome import FAILED, RUNNING, SUCCEEDED, Outcome
from proxymodel_operator.resources import KUEUE_QUEUE_LABEL, LABEL_ROLE
from proxymodel_operator.runtimes import RUNTIMES
from proxymodel_operator.settings import Settings

from .harness import proxymodel

NS = "team-d"
SETTINGS = Settings()


def built(name: str = "pm", **reproduction) -> dict:
    """A ProxyModel whose proxy is built (its reproduction running)."""
    body = proxymodel(name, reproduction={"runtime": "Job", "maxSteps": 4, "lr": 0.1,
                                          "failOn": {"signature": "divergence"},
                                          "accelerator": {"devices": 1, "devicesPerNode": 1}, **reproduction})
    body["metadata"]["namespace"] = NS
    body["status"] = {"phase": "Reproducing", "proxy": {
        "uri": "s3://ckpt/proxies/pm/", "manifestSha256": "ab" * 32, "expertsPerLayer": {"after": 4, "topK": 2}}}
    return body


def diagnosis(spec: dict, status: dict | None = None, name: str = "dx") -> dict:
    return {"metadata": {"name": name, "namespace": NS, "generation": 1, "uid": "u-1"},
            "spec": {"proxyModel": "pm", **spec}, "status": status or {}}


def apply(body: dict, decision) -> dict:
    body = json.loads(json.dumps(body))
    body["status"] = {**body.get("status", {}), **decision.status}
    return body


def args_of(manifest: dict) -> list[str]:
    return manifest["spec"]["template"]["spec"]["containers"][0]["args"]


def test_parse_defaults_and_custom_candidates():
    d = parse_diagnosis({"proxyModel": "pm", "candidates": ["lower-lr", {"name": "mine", "args": ["--lr", "1e-6"]}]})
    assert (d.seeds, d.parallelism, d.steps, d.fail_on) == (2, 1, None, None)
    assert [c.name for c in d.candidates] == ["lower-lr", "mine"] and d.candidates[1].args == ("--lr", "1e-6")


@pytest.mark.parametrize("spec, reason, text", [
    ({"candidates": ["lower-lr", "no-such-fix"]}, "UnknownCandidate", "the catalogue has fp32, bf16"),
    ({"candidates": []}, "InvalidSpec", "at least one"),
    ({"candidates": ["lower-lr", "lower-lr"]}, "InvalidSpec", "used twice"),
    ({"candidates": [{"name": "baseline", "args": ["--lr", "1"]}]}, "InvalidSpec", "reserved"),
    ({"candidates": [{"name": "x", "args": "--lr 3"}]}, "InvalidSpec", "a list of strings"),
    ({"candidates": ["fp32"], "seeds": 0}, "InvalidSpec", "spec.seeds"),
    ({"candidates": ["fp32"], "failOn": {"signature": "boom"}}, "InvalidSpec", "spec.failOn.signature"),
])
def test_bad_specs_are_refused_with_a_reason(spec, reason, text):
    with pytest.raises(InvalidDiagnosis) as caught:
        parse_diagnosis({"proxyModel": "pm", **spec})
    assert caught.value.reason == reason and text in str(caught.value)
    decision = decide(diagnosis(spec), built(), {}, SETTINGS)
    assert decision.status["phase"] == DIAGNOSIS_FAILED and not decision.create
    accepted = next(c for c in decision.status["conditions"] if c["type"] == "Accepted")
    assert (accepted["status"], accepted["reason"]) == ("False", reason)
    assert decision.events[0][:2] == ("Warning", reason)
    # said once: a second look at the same refusal posts no Event
    assert decide(apply(diagnosis(spec), decision), built(), {}, SETTINGS).events == []


def test_a_missing_proxymodel_waits_and_a_template_one_is_refused():
    missing = decide(diagnosis({"candidates": ["fp32"]}), None, {}, SETTINGS)
    assert missing.status["phase"] == WAITING_FOR_PROXY and not missing.create
    assert [c["reason"] for c in missing.status["conditions"]] == ["ProxyModelNotFound"]
    template = {"spec": {"containers": [{"name": "verl", "image": "verl:test", "command": ["python"]}]}}
    refused = decide(diagnosis({"candidates": ["fp32", {"name": "mine", "env": [{"name": "X", "value": "1"}]}]}),
                     built(template=template), {}, SETTINGS)
    assert refused.status["phase"] == DIAGNOSIS_FAILED
    assert refused.events[0][1] == "TemplateNeedsPatches"
    assert "fp32: verl: actor.fsdp_config.mixed_precision" in refused.events[0][2]  # where frameworks set it
    failed = built()
    failed["status"] = {"phase": "Failed", "message": "transformer failed: OOMKilled"}
    assert decide(diagnosis({"candidates": ["fp32"]}), failed, {}, SETTINGS).events[0][1] == "ProxyModelFailed"


def test_waits_while_the_proxy_is_being_built():
    building = built()
    building["status"] = {"phase": "Transforming"}
    decision = decide(diagnosis({"candidates": ["fp32"]}), building, {}, SETTINGS)
    assert decision.status["phase"] == WAITING_FOR_PROXY and not decision.create
    running = next(c for c in decision.status["conditions"] if c["type"] == "Running")
    assert (running["status"], running["reason"]) == ("False", "WaitingForProxy")


def test_start_records_every_run_and_creates_parallelism_of_them_baseline_first():
    pm = built(queueName="team-queue")
    pm["spec"]["queueName"] = "team-queue"
    body = diagnosis({"candidates": ["lower-lr", {"name": "mine", "args": ["--warmup-steps", "2"]}],
                      "parallelism": 2, "steps": 3})
    decision = decide(body, pm, {}, SETTINGS)
    s = decision.status
    assert s["phase"] == DIAGNOSING and s["seeds"] == [0, 1] and s["steps"] == 3 and s["failOn"] == "divergence"
    assert [r["phase"] for r in s["baseline"]["runs"]] == [RUN_RUNNING, RUN_RUNNING]
    assert all(r["phase"] == RUN_PENDING for c in s["candidates"] for r in c["runs"])
    assert s["candidates"][0]["args"] == ["--lr", "0.01"]  # the catalogue's lr / 10 of the ProxyModel's 0.1
    names = [m["metadata"]["name"] for _, m in decision.create]
    assert names == ["dx-baseline-s0", "dx-baseline-s1"] == recorded_running(s)
    job = decision.create[1][1]
    args = args_of(job)
    assert args[:2] == ["repro", "s3://ckpt/proxies/pm/"] and args[-2:] == ["--seed", "1"]
    assert args[args.index("--steps") + 1] == "3" and args[args.index("--fail-on") + 1] == "divergence"
    labels = job["metadata"]["labels"]
    assert labels[LABEL_DIAGNOSIS] == "dx" and labels[LABEL_ROLE] == "diagnosis"
    assert labels[KUEUE_QUEUE_LABEL] == "team-queue"
    assert "moeproxy.io/proxymodel" not in labels  # never taken for the ProxyModel's own children
    assert s["progress"] == "0/6"

    # the first baseline run finishes: one candidate run starts (2 at a time), in order
    body = apply(body, decision)
    report = {"reproduced": True, "signature": "divergence", "step": 1}
    nxt = decide(body, pm, {"dx-baseline-s0": Outcome(SUCCEEDED, report=report),
                            "dx-baseline-s1": Outcome(RUNNING)}, SETTINGS)
    assert [m["metadata"]["name"] for _, m in nxt.create] == ["dx-lower-lr-s0"]
    assert args_of(nxt.create[0][1])[-4:] == ["--lr", "0.01", "--seed", "0"]
    row = nxt.status["baseline"]["runs"][0]
    assert (row["phase"], row["reproduced"], row["step"]) == (RUN_DONE, True, 1)
    assert nxt.status["progress"] == "1/6" and nxt.status["running"] == 2


def _finish_all(body, pm, outcomes):
    """Decide until nothing runs, every run finishing with outcomes[(variant, seed)]."""
    for _ in range(20):
        running = recorded_running(body["status"])
        if not running and body["status"].get("phase") in (DIAGNOSED, DIAGNOSIS_FAILED):
            return body
        seen = {}
        for w in running:
            variant, seed = w.removeprefix("dx-").rsplit("-s", 1)
            seen[w] = outcomes[(variant, int(seed))]
        body = apply(body, decide(body, pm, seen, SETTINGS))
    raise AssertionError("never finished")


def _done(step=None, **extra):
    return Outcome(SUCCEEDED, report={"reproduced": step is not None, "signature": "divergence" if step is not None
                                      else None, "step": step, **extra})


def test_verdicts_are_the_clis():
    pm = built()
    body = diagnosis({"candidates": ["lower-lr", "warmup", "z-loss"], "parallelism": 3, "allSeeds": True})
    outcomes = {("baseline", 0): _done(1), ("baseline", 1): _done(3),
                ("lower-lr", 0): _done(), ("lower-lr", 1): _done(),
                ("warmup", 0): _done(2), ("warmup", 1): _done(3),
                ("z-loss", 0): Outcome(FAILED, "OOMKilled", "container exited with code 137"),
                ("z-loss", 1): _done()}
    body = apply(body, decide(body, pm, {}, SETTINGS))
    body = _finish_all(body, pm, outcomes)
    s = body["status"]
    assert s["phase"] == DIAGNOSED and s["fixedBy"] == "lower-lr" and s["progress"] == "8/8"
    assert s["baseline"]["verdict"] == "reproduced"
    got = {c["name"]: (c["verdict"], c["note"]) for c in s["candidates"]}
    # the CLI's rule on the same runs
    base = {0: SeedRun(True, "divergence", 1, 2), 1: SeedRun(True, "divergence", 3, 4)}
    assert got["lower-lr"] == verdict(base, {0: SeedRun(False, steps=4), 1: SeedRun(False, steps=4)}, 4)
    assert got["lower-lr"][0] == "fixed"
    assert got["warmup"] == ("reproduced", "seed 0 step 2, seed 1 step 3")
    assert got["z-loss"][0] == "error" and "OOMKilled" in got["z-loss"][1]
    complete = next(c for c in s["conditions"] if c["type"] == "Complete")
    assert (complete["status"], complete["reason"]) == ("True", "FixFound")
    # finished: nothing more to do
    assert decide(body, pm, {}, SETTINGS).status == {}


def test_a_baseline_that_never_runs_fails_the_diagnosis():
    pm = built()
    body = diagnosis({"candidates": ["fp32"], "seeds": 1, "parallelism": 2})
    body = apply(body, decide(body, pm, {}, SETTINGS))
    error = Outcome(FAILED, "ImagePullBackOff", "no such image")
    body = _finish_all(body, pm, {("baseline", 0): error, ("fp32", 0): _done()})
    assert body["status"]["phase"] == DIAGNOSIS_FAILED and body["status"]["baseline"]["verdict"] == "error"
    assert next(c for c in body["status"]["conditions"] if c["type"] == "Failed")["reason"] == "BaselineFailed"


def test_a_run_recorded_but_never_created_is_created_under_the_same_name():
    """The operator stopped between writing status and creating the workload."""
    pm = built()
    body = diagnosis({"candidates": ["fp32"], "seeds": 1})
    body = apply(body, decide(body, pm, {}, SETTINGS))
    again = decide(body, pm, {}, SETTINGS)  # the workload is not there
    assert [m["metadata"]["name"] for _, m in again.create] == ["dx-baseline-s0"]
    assert not any(r["phase"] == RUN_RUNNING for r in again.status["candidates"][0]["runs"])  # still one at a time
    # and when it is there, nothing is created
    assert decide(body, pm, {"dx-baseline-s0": Outcome(RUNNING)}, SETTINGS).create == []


def test_a_run_that_reported_no_verdict_is_an_error_and_steps_completed_is_read_when_there():
    pm = built()
    body = diagnosis({"candidates": ["fp32"], "seeds": 1, "parallelism": 2})
    body = apply(body, decide(body, pm, {}, SETTINGS))
    body = _finish_all(body, pm, {("baseline", 0): _done(1),
                                  ("fp32", 0): _done(None, steps_completed=2, stopped="nan")})
    fp32 = body["status"]["candidates"][0]
    # past the baseline's onset (step 1), then stopped: a cure with a failure of its own, said
    assert fp32["verdict"] == "fixed-but" and "seed 0 stopped after 2 of 4 steps (nan)" in fp32["note"]
    assert seed_run(fp32["runs"][0]).steps == 2
    no_report = decide(diagnosis({"candidates": ["fp32"]}), pm, {}, SETTINGS)
    body = apply(diagnosis({"candidates": ["fp32"], "seeds": 1}), no_report)
    after = decide(body, pm, {"dx-baseline-s0": Outcome(SUCCEEDED)}, SETTINGS)
    assert after.status["baseline"]["runs"][0]["phase"] == RUN_ERROR


def test_run_names_are_dns_labels_of_63_characters_at_most():
    assert run_name("dx", "lower-lr", 0) == "dx-lower-lr-s0"
    long = run_name("d" * 60, "Z_Loss", 12)
    assert len(long) <= 63 and long.endswith("-s12") and long == long.lower()
    assert run_name("d" * 60, "Z_Loss", 12) != run_name("d" * 60, "Z-Loss", 12)
    assert len(run_name("d" * 60, "x", 1, reserve=4)) <= 59


def test_every_catalogue_candidate_makes_a_run():
    pm = built()
    body = diagnosis({"candidates": list(CATALOGUE), "seeds": 1, "parallelism": len(CATALOGUE) + 1})
    body = apply(body, decide(body, pm, {}, SETTINGS))  # the baseline first; it reproduces: every candidate
    decision = decide(body, pm, {"dx-baseline-s0": _done(1)}, SETTINGS)
    assert len(decision.create) == len(CATALOGUE)
    for (_, manifest), name in zip(decision.create, CATALOGUE):
        assert args_of(manifest)[-2:] == ["--seed", "0"]
        assert manifest["metadata"]["labels"]["moeproxy.io/variant"] == name


def test_a_spec_change_after_the_runs_started_is_said_once_and_not_run():
    pm = built()
    body = diagnosis({"candidates": ["fp32"], "seeds": 1})
    body = apply(body, decide(body, pm, {}, SETTINGS))
    body["metadata"]["generation"] = 2
    body["spec"].update(candidates=["z-loss"], steps=2, parallelism=3)
    changed = decide(body, pm, {"dx-baseline-s0": Outcome(RUNNING)}, SETTINGS)
    assert changed.status == {"observedGeneration": 2} and changed.events[0][1] == "SpecChangeIgnored"
    body = apply(body, changed)
    after = decide(body, pm, {"dx-baseline-s0": _done(1)}, SETTINGS)
    assert [m["metadata"]["name"] for _, m in after.create] == ["dx-fp32-s0"]
    assert args_of(after.create[0][1])[-4:] == ["--precision", "fp32", "--seed", "0"]
    args = args_of(after.create[0][1])
    assert args[args.index("--steps") + 1] == "4" and len(after.create) == 1  # the recorded steps and parallelism


def test_a_proxymodel_whose_own_reproduction_failed_still_gives_its_proxy():
    pm = built()
    pm["status"].update(phase="Failed", conditions=[{"type": "ProxyReady", "status": "True", "reason": "ProxyBuilt"}])
    decision = decide(diagnosis({"candidates": ["fp32"]}), pm, {}, SETTINGS)
    assert decision.status["phase"] == DIAGNOSING and len(decision.create) == 1


def test_candidate_flags_repro_refuses_are_refused_before_anything_runs_as_the_cli_does():
    decision = decide(diagnosis({"candidates": ["fp32", {"name": "bad", "args": ["--lr", "-1"]}]}), built(), {},
                      SETTINGS)
    assert decision.status["phase"] == DIAGNOSIS_FAILED and not decision.create
    assert decision.events[0][1] == "CandidateRefused"
    assert "candidate 'bad' (--lr -1): repro refuses it: argument --lr: -1: must be above 0" in decision.events[0][2]
    unknown = decide(diagnosis({"candidates": [{"name": "typo", "args": ["--learning-rate", "1"]}]}), built(), {},
                     SETTINGS)
    assert "unrecognized arguments: --learning-rate 1" in unknown.status["message"]
    for args, text in ((["--seed", "3"], "the diagnosis's own"), (["lr", "3"], "args are repro flags")):
        own = decide(diagnosis({"candidates": [{"name": "x", "args": args}]}), built(), {}, SETTINGS)
        assert own.events[0][1] == "CandidateRefused" and text in own.events[0][2]


def test_a_template_proxymodel_runs_env_and_args_patches_of_its_first_container():
    template = {"spec": {"containers": [{"name": "verl", "image": "verl:test", "command": ["python", "-m", "verl"],
                                         "args": ["trainer.total_epochs=1"]}]}}
    body = diagnosis({"candidates": [{"name": "fix", "env": [{"name": "FIX", "value": "1"}]},
                                     {"name": "low-lr", "args": ["actor.optim.lr=1e-7"]}], "seeds": 1,
                      "parallelism": 3})
    pm = built(template=template)
    first = decide(body, pm, {}, SETTINGS)  # the baseline first; once it reproduced, the candidates
    decision = decide(apply(body, first), pm, {"dx-baseline-s0": _done(1)}, SETTINGS)
    assert decision.status["phase"] == DIAGNOSING and (len(first.create), len(decision.create)) == (1, 2)
    pods = {m["metadata"]["name"]: m["spec"]["template"]["spec"] for _, m in first.create + decision.create}
    first = {n: p["containers"][0] for n, p in pods.items()}
    assert first["dx-low-lr-s0"]["args"] == ["trainer.total_epochs=1", "actor.optim.lr=1e-7"]
    assert first["dx-baseline-s0"]["args"] == ["trainer.total_epochs=1"]  # no --seed: MOEPROXY_SEED instead
    env = {n: {e["name"]: e.get("value") for e in c["env"]} for n, c in first.items()}
    assert env["dx-fix-s0"]["FIX"] == "1" and "FIX" not in env["dx-baseline-s0"]
    assert {e["MOEPROXY_SEED"] for e in env.values()} == {"0"}
    watcher = pods["dx-fix-s0"]["initContainers"][0]  # the verdict's sidecar, on the Diagnosis's failOn
    assert watcher["args"][watcher["args"].index("--fail-on") + 1] == "divergence"
    assert {c["changes"].get("unchecked") for c in decision.status["candidates"]} == {True}


def test_a_candidate_that_changes_nothing_says_so_as_the_cli_does():
    pm = built()
    body = diagnosis({"candidates": ["lower-lr", "grad-clip"], "seeds": 1, "parallelism": 3})
    body = apply(body, decide(body, pm, {}, SETTINGS))
    rows = {c["name"]: c for c in body["status"]["candidates"]}
    assert rows["lower-lr"]["changes"] == {"lr": pytest.approx(0.01)} and rows["grad-clip"]["changes"] == {}
    body = _finish_all(body, pm, {("baseline", 0): _done(1), ("lower-lr", 0): _done(), ("grad-clip", 0): _done(1)})
    said = {c["name"]: (c["verdict"], c["note"]) for c in body["status"]["candidates"]}["grad-clip"]
    assert said == ("no-change", "changes none of the baseline's settings; its runs end as the baseline's "
                                 "(seed 0 step 1)")


@pytest.mark.parametrize("runtime", ["Job", "VolcanoJob", "AscendJob"])
def test_a_multi_node_run_is_the_proxymodels_workload_with_its_service_first(runtime):
    pm = built(runtime=runtime, accelerator={"devices": 4, "devicesPerNode": 2})
    decision = decide(diagnosis({"candidates": ["fp32"], "seeds": 1}, name="d" * 58), pm, {}, SETTINGS)
    kinds = [(r.kind, m["metadata"]["name"]) for r, m in decision.create]
    job = kinds[-1][1]
    assert kinds[0] == (("Service", job) if runtime == "Job" else kinds[-1])  # the pods' host names need it first
    reserve = {"Job": len("-1"), "VolcanoJob": len("-worker-1"), "AscendJob": len("-worker-1")}[runtime]
    assert len(job) + reserve <= 63 and job.endswith("-s0")
    manifest = decision.create[-1][1]
    container = RUNTIMES[runtime].pod_templates(manifest["spec"])[0]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--nnodes") + 1] == "2" and args[-2:] == ["--seed", "0"]


def _series_outcome(step, rewards, losses, times):
    rows = {i: {"critic/rewards/mean": r, "actor/pg_loss": l, "perf/time_per_step": t}
            for i, (r, l, t) in enumerate(zip(rewards, losses, times))}
    return _done(step, steps_completed=len(rows), series=cost_series(rows)), rows


def test_each_candidates_cost_is_the_clis_from_its_runs_termination_messages():
    """The cost columns of `moe-proxy diagnose` (diagnose.cost_of / against: mean reward and
    loss up to and including the baseline's first onset, over the seeds; time per step with its
    standard deviation), from the series the
    runs' termination messages carry; status keeps the figures, not the series."""
    pm = built()
    body = diagnosis({"candidates": ["lower-lr"], "parallelism": 2})
    nan = float("nan")
    runs = {("baseline", 0): _series_outcome(2, [0.1, 0.2, 0.3, nan], [1.0, 2.0, 3.0, nan], [1.0, 1.0, 1.0, 1.0]),
            ("baseline", 1): _series_outcome(3, [0.3, 0.2, 0.1, 0.0], [1.5, 1.5, 1.5, 9.0], [2.0, 2.0, 2.0, 2.0]),
            ("lower-lr", 0): _series_outcome(None, [0.0, 0.1, 0.1, 0.1], [0.5, 0.5, 0.7, 0.5], [3.0] * 4),
            ("lower-lr", 1): _series_outcome(None, [0.0, 0.0, 0.1, 0.2], [0.25, 0.5, 0.5, 0.5], [3.0] * 4)}
    body = apply(body, decide(body, pm, {}, SETTINGS))
    body = _finish_all(body, pm, {k: outcome for k, (outcome, _) in runs.items()})
    s = body["status"]
    base = cost_of([runs[("baseline", 0)][1], runs[("baseline", 1)][1]], (0, 2))  # the first onset: step 2
    assert (base["window_first"], base["window_last"]) == (0, 2)
    assert base["reward_mean"] == pytest.approx(0.2) and base["time_per_step_s"] == 1.5
    assert base["time_per_step_sd"] == pytest.approx(0.5345, abs=1e-4)  # four steps at 1 s, four at 2 s
    assert s["baseline"]["cost"] == pytest.approx(base)
    lower = s["candidates"][0]["cost"]
    assert lower == pytest.approx(against(cost_of([runs[("lower-lr", 0)][1], runs[("lower-lr", 1)][1]], (0, 2)),
                                          base))
    assert lower["reward_vs_baseline"] == pytest.approx(0.05 - 0.2) and lower["time_vs_baseline"] == 2.0
    assert "series" not in json.dumps(s)


def test_the_cost_series_fits_the_termination_message_of_a_long_run():
    """1000 steps do not fit at one a step: every 16th step is kept, and the whole message stays
    under the kubelet's 4096 bytes; the rows read back are the steps kept."""
    rows = {i: {**{k: 1.0 for k in HEADLINE}, "critic/rewards/mean": 0.123456 + i, "actor/pg_loss": -1.23456e-3 * i,
                "perf/time_per_step": 2.5} for i in range(1000)}
    series = cost_series(rows)
    assert series["stride"] == 16 and "steps" not in series
    full = cost_series(rows, budget=10**6)
    every_8th = {**full, "stride": 8, **{k: full[k][::8] for k in ("reward", "loss", "time")}}
    assert full["stride"] == 1 and len(json.dumps(every_8th, separators=(",", ":"))) > SERIES_BYTES
    back = series_rows(series)
    assert sorted(back) == list(range(0, 1000, 16)) and back[16]["critic/rewards/mean"] == pytest.approx(16.12)
    message = encode({**repro_report(True, "overflow", 999, {k: 1.0 for k in HEADLINE}, 1000, "reproduced overflow"),
                      "series": series})
    assert len(message.encode()) <= TERMINATION_LOG_LIMIT and json.loads(message)["series"] == series
    # steps logged unevenly (a framework logging every 10th step from 10) are listed
    uneven = series_rows(cost_series({10: {"actor/pg_loss": 1.0}, 20: {"actor/pg_loss": 2.0}, 40: {}}))
    assert uneven == {10: {"actor/pg_loss": 1.0}, 20: {"actor/pg_loss": 2.0}}


def test_a_candidate_that_reproduced_on_one_seed_starts_no_other_and_stops_those_running():
    """#45 item 2: `reproduced` needs one seed. Its pending runs are not started (no workload is
    made for them) and its running ones deleted, once status says so; the baseline and a
    no-change candidate run every seed; allSeeds runs the full matrix."""
    pm = built()
    spec = {"candidates": ["warmup", {"name": "same", "args": ["--lr", "0.1"]}], "seeds": 4, "parallelism": 3}
    outcomes = {**{(v, s): _done(1) for v in ("baseline", "same") for s in range(4)},
                ("warmup", 0): _done(2), **{("warmup", s): _done() for s in (1, 2, 3)}}
    body = apply(diagnosis(spec), decide(diagnosis(spec), pm, {}, SETTINGS))
    made, deleted = [], []
    for _ in range(20):
        running = recorded_running(body["status"])
        if not running and body["status"].get("phase") == DIAGNOSED:
            break
        seen = {}
        for w in running:  # warmup's seed 1 is still running when its seed 0 reproduced
            variant, seed = w.removeprefix("dx-").rsplit("-s", 1)
            seen[w] = Outcome(RUNNING) if (variant, seed) == ("warmup", "1") else outcomes[(variant, int(seed))]
        decision = decide(body, pm, seen, SETTINGS)
        made += [m["metadata"]["name"] for _, m in decision.create]
        deleted += [w for _, w in decision.delete]
        body = apply(body, decision)
    s = body["status"]
    warmup = next(c for c in s["candidates"] if c["name"] == "warmup")
    assert [r["phase"] for r in warmup["runs"]] == [RUN_DONE, "NotRun", "NotRun", "NotRun"]
    assert [r.get("message") for r in warmup["runs"][1:]] == ["stopped: reproduced on seed 0",
                                                              "not run: reproduced on seed 0",
                                                              "not run: reproduced on seed 0"]
    assert "dx-warmup-s2" not in made and "dx-warmup-s3" not in made and deleted == ["dx-warmup-s1"]
    assert warmup["verdict"] == "reproduced" and warmup["note"] == (
        "delayed: seed 0 step 2; seed 1 stopped: reproduced on seed 0; seed 2 not run: reproduced on seed 0; "
        "seed 3 not run: reproduced on seed 0")
    same = next(c for c in s["candidates"] if c["name"] == "same")
    assert same["verdict"] == "no-change" and all(r["phase"] == RUN_DONE for r in same["runs"])
    assert s["progress"] == "12/12" and s["phase"] == DIAGNOSED

    # allSeeds: every run of every candidate
    spec["allSeeds"] = True
    body = apply(diagnosis(spec), decide(diagnosis(spec), pm, {}, SETTINGS))
    body = _finish_all(body, pm, outcomes)
    warmup = next(c for c in body["status"]["candidates"] if c["name"] == "warmup")
    assert [r["phase"] for r in warmup["runs"]] == [RUN_DONE] * 4 and warmup["note"] == "delayed: seed 0 step 2"
