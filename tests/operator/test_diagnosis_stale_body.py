"""The Diagnosis timer says a thing once even when kopf's copy of the Diagnosis lags its own last
status write. Under load a watch event can arrive seconds late, and kopf then runs the timer with
the body it last saw: deciding from that alone, every such tick refused (or created, or judged)
again and posted its Event again (seen as 5 CandidateArgsIgnored Events for one refusal on a
loaded 2-core machine). Here the timer's handler runs twice on the same stale body, as kopf would
call it, against the API emulator, with the Event queue kopf's operator posts from."""

from __future__ import annotations

import asyncio
import copy
import logging

import kopf
import pytest_asyncio
from kopf._core.engines import posting  # the queue kopf's operator sets up and drains

from proxymodel_operator import diagnosis, kube
from proxymodel_operator.resources import DIAGNOSES
from proxymodel_operator.settings import Settings

NS = "team-stale"


@pytest_asyncio.fixture()
async def events():
    """kopf.event's queue, as a running operator has it."""
    queue: asyncio.Queue = asyncio.Queue()
    tokens = [posting.event_queue_var.set(queue), posting.event_queue_loop_var.set(asyncio.get_running_loop()),
              posting.settings_var.set(kopf.OperatorSettings())]
    yield queue
    for var, token in zip((posting.event_queue_var, posting.event_queue_loop_var, posting.settings_var), tokens):
        var.reset(token)


async def _tick(body: dict, memo: kopf.Memo) -> None:
    """The timer's handler, called with `body` as kopf would call it."""
    await diagnosis.reconcile(body=body, meta=body["metadata"], status=body.get("status") or {}, spec=body["spec"],
                              namespace=NS, name=body["metadata"]["name"], memo=memo,
                              logger=logging.getLogger("proxymodel_operator.test"))


async def test_a_tick_on_a_body_older_than_its_own_last_write_says_nothing_again(cluster, events):
    kube.configure(kopf.ConnectionInfo(server=str(cluster.emulator.url), token="emulator-token"))
    try:
        await cluster.create(DIAGNOSES, NS, {"metadata": {"name": "bad"}, "spec": {
            "proxyModel": "pm", "candidates": ["lower-lr", "more-cowbell"]}})
        stale = copy.deepcopy(cluster.get(DIAGNOSES, NS, "bad"))
        memo = kopf.Memo(settings=Settings())
        await _tick(stale, memo)
        status = cluster.get(DIAGNOSES, NS, "bad")["status"]
        assert status["phase"] == "Failed" and status["conditions"][0]["reason"] == "UnknownCandidate"
        await _tick(stale, memo)  # the watch has not delivered that write yet
        said = [events.get_nowait() for _ in range(events.qsize())]
        assert [(e.type, e.reason) for e in said] == [("Warning", "UnknownCandidate")]
        writes = [c for c in cluster.emulator.calls if c.resource == "diagnoses/status" and not c.by_test]
        assert len(writes) == 1
    finally:
        await kube.close()
