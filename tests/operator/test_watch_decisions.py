"""What a CheckpointWatch decides after a listing (pure functions, no cluster): every,
startAfterStep, keepLast, maxConcurrent, names, and the ProxyModel it makes."""

from __future__ import annotations

from moe_proxy.checkpoint.listing import DENSE, MOE, PROXY, UNKNOWN, ListedCheckpoint
from proxymodel_operator.watch_decisions import MadeProxyModel, decide, in_use_by, proxymodel_for, proxymodel_name
from proxymodel_operator.watch_spec import parse_watch

SOURCE = {"uri": "s3://runs/grpo", "credentialsSecret": "creds"}


def watch(**spec):
    return parse_watch({"source": SOURCE, "template": {"spec": {"pruning": {"experts": 8}}}, **spec})


def ckpt(step: int, complete: bool = True, kind: str = MOE, reason: str | None = None) -> ListedCheckpoint:
    return ListedCheckpoint(step=step, uri=f"s3://runs/grpo/global_step_{step}", path=f"global_step_{step}",
                      complete=complete, kind=kind, reason=reason)


def child(step: int, phase: str | None = "ProxyReady") -> MadeProxyModel:
    return MadeProxyModel(f"w-step-{step}", step, phase, f"s3://runs/grpo/global_step_{step}")


def steps(items) -> list[int]:
    return [getattr(c, "step", c) for c in items]


def test_complete_sources_become_proxymodels_in_step_order():
    found = [ckpt(300), ckpt(100), ckpt(200, complete=False, reason="1 of 2 shards ... missing"),
             ckpt(400, kind=DENSE), ckpt(500, kind=PROXY), ckpt(600, complete=False, kind=UNKNOWN,
                                                                  reason="config.json missing")]
    d = decide(watch(), [], sorted(found, key=lambda c: c.step), None)
    assert steps(d.create) == [100, 300]
    assert steps(d.waiting) == [200, 600]  # retried next poll
    assert steps(d.skipped) == [400]  # reported; proxies are neither
    assert d.last_seen_step == 300 and d.pending == [] and d.delete == []


def test_made_steps_are_not_made_again():
    d = decide(watch(), [child(100)], [ckpt(100), ckpt(200)], None)
    assert steps(d.create) == [200] and d.last_seen_step == 200


def test_every_and_start_after_step():
    found = [ckpt(s) for s in (50, 100, 150, 200, 300, 320)]
    d = decide(watch(every=100, startAfterStep=50), [], found, None)
    assert steps(d.create) == [100, 200, 300]
    d = decide(watch(every=100), [child(250)], found, None)
    assert steps(d.create) == [50, 150]  # 200 and 300 are closer than 100 to 250 or 150


def test_a_watch_without_proxies_per_checkpoint_makes_none():
    d = decide(watch(proxyPerCheckpoint=False), [], [ckpt(100), ckpt(200)], None)
    assert d.create == [] and d.pending == [] and d.waiting == []


def test_keep_last_retires_oldest_and_skips_older_new_ones():
    d = decide(watch(keepLast=2), [child(100), child(200)], [ckpt(400)], None)
    assert steps(d.create) == [400] and steps(d.delete) == [100] and d.retired_through == 100
    # Four new at once with room for two: the two oldest are never made.
    d = decide(watch(keepLast=2), [], [ckpt(s) for s in (100, 200, 300, 400)], None)
    assert steps(d.create) == [300, 400] and d.delete == [] and d.retired_through == 200
    # Retired steps stay retired.
    d = decide(watch(keepLast=2), [child(300), child(400)], [ckpt(s) for s in (100, 200, 300, 400)], 200)
    assert d.create == [] and d.delete == [] and d.retired_through == 200


def test_keep_last_keeps_a_proxymodel_an_unfinished_diagnosis_uses_until_it_finishes():
    def diagnosis(phase: str, **status) -> dict:
        return {"metadata": {"generation": 1}, "spec": {},
                "status": {"phase": phase, "observedGeneration": 1, **status}}

    probing = diagnosis("Running", probes=[{"proxyModel": "w-step-100", "reused": "w-step-100"}])
    on_it = diagnosis("Running", candidatesOn={"proxyModel": "w-step-200"})
    done = diagnosis("Complete", probes=[{"proxyModel": "w-step-300"}])
    in_use = in_use_by([probing, on_it, done])
    assert in_use == {"w-step-100", "w-step-200"}
    d = decide(watch(keepLast=1), [child(100), child(200), child(300)], [ckpt(400)], None, in_use)
    assert steps(d.create) == [400] and steps(d.delete) == [300] and d.retired_through == 300
    # once the Diagnoses are over, the next poll retires them
    d = decide(watch(keepLast=1), [child(100), child(200), child(400)], [], 300, in_use_by([done]))
    assert steps(d.delete) == [100, 200]


def test_max_concurrent_counts_transforming_proxymodels():
    found = [ckpt(s) for s in (200, 300, 400)]
    d = decide(watch(maxConcurrent=2), [child(100, "Transforming")], found, None)
    assert steps(d.create) == [200] and d.pending == [300, 400]
    d = decide(watch(maxConcurrent=2), [child(100, "Reproducing")], found, None)
    assert steps(d.create) == [200, 300] and d.pending == [400]
    d = decide(watch(maxConcurrent=1), [child(100, None)], found, None)  # not started yet: holds a slot
    assert d.create == [] and d.pending == [200, 300, 400]


def test_names_fit_63_characters():
    assert proxymodel_name("grpo", 300) == "grpo-step-300"
    long = "qwen3-235b-a22b-grpo-math-reasoning-long-context-experiment-number-seven"
    name = proxymodel_name(long, 123456)
    assert len(name) <= 63 and name.endswith("-step-123456")
    assert proxymodel_name(long + "x", 123456) != name  # the hash keeps them apart


def test_proxymodel_manifest():
    w = parse_watch({"source": {**SOURCE, "endpoint": "http://minio:9000"}, "deleteProxyData": True,
                     "template": {"metadata": {"labels": {"team": "rl"}, "annotations": {"note": "x"}},
                                  "spec": {"pruning": {"experts": 8}, "destination": {"uri": "s3://proxies/grpo"}}}})
    body = {"apiVersion": "moeproxy.io/v1alpha1", "kind": "CheckpointWatch",
            "metadata": {"name": "grpo", "namespace": "rl", "uid": "u-1", "labels": {}}}
    pxm = proxymodel_for(body, w, 300, "s3://runs/grpo/global_step_300")
    assert pxm["metadata"]["name"] == "grpo-step-300" and pxm["metadata"]["namespace"] == "rl"
    key = pxm["metadata"]["labels"].pop("moeproxy.io/content-key")  # proxy_key's (tests/operator/test_proxy_key.py)
    assert pxm["metadata"]["labels"] == {"team": "rl", "moeproxy.io/checkpoint-watch": "grpo",
                                         "moeproxy.io/step": "300"} and len(key) == 16
    assert pxm["metadata"]["annotations"]["moeproxy.io/checkpoint-uri"] == "s3://runs/grpo/global_step_300"
    assert pxm["spec"]["source"] == {"uri": "s3://runs/grpo/global_step_300", "credentialsSecret": "creds",
                                     "endpoint": "http://minio:9000"}
    assert pxm["spec"]["destination"] == {"uri": "s3://proxies/grpo/grpo-step-300/"}
    assert pxm["spec"]["cleanup"] == {"deleteProxy": True}
    assert pxm["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert w.template_spec["destination"] == {"uri": "s3://proxies/grpo"}  # the template is not changed


def test_a_template_the_proxymodel_would_refuse_is_refused_by_the_watch():
    import pytest

    from proxymodel_operator.watch_spec import InvalidWatch

    with pytest.raises(InvalidWatch, match="spec.template: spec.pruning: give exactly one of"):
        parse_watch({"source": SOURCE, "template": {"spec": {"pruning": {"experts": 8, "keepRatio": 0.5}}}})
    with pytest.raises(InvalidWatch, match="spec.stepRegex"):
        parse_watch({"source": SOURCE, "stepRegex": "step_(", "template": {"spec": {"pruning": {"experts": 8}}}})


def test_the_status_a_poll_writes():
    """status_after: the ProxyModels that exist, steps the API server refused pending again, and
    skipped steps accumulated over polls (the newest few)."""
    from proxymodel_operator.watch_decisions import MAX_LISTED, newly_skipped, status_after

    found = [ckpt(100), ckpt(200, complete=False, reason="1 of 2 shards missing"), ckpt(300, kind=DENSE,
                                                                                        reason="dense")]
    d = decide(watch(maxConcurrent=1), [], found, None)
    before = {"lastSeenStep": 50, "skipped": [{"step": s, "kind": DENSE, "reason": "dense"} for s in range(MAX_LISTED)]}
    out = status_after(before, d, [child(100, None)], not_made=[])
    assert out["proxies"] == 1 and out["proxyModels"][0]["phase"] == "Pending"
    assert out["lastSeenStep"] == 100 and out["pending"] == [] and out["pendingSummary"] == ""
    assert out["waiting"] == [{"step": 200, "reason": "1 of 2 shards missing"}]
    assert len(out["skipped"]) == MAX_LISTED and out["skipped"][-1]["step"] == 300  # the newest kept
    refused = status_after({}, d, [], not_made=[100])
    assert refused["pending"] == [100] and refused["pendingSummary"] == "100" and refused["proxies"] == 0
    assert steps(newly_skipped(d, set())) == [300] and newly_skipped(d, {300}) == []
