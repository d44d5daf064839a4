"""kopf reports every handler that returns as "succeeded" and has no outcome for a refusal
(its PermanentError is logged at ERROR and, posted as an Event, would add one at every restart;
its TemporaryError repeats an error at each retry). The refusal is a status outcome the handler
returns with, so the operator rewrites kopf's report lines about a refused ProxyModel
(`handlers.REFUSALS`, a filter on kopf's object logger): this checks that rewrite line by line."""

from __future__ import annotations

import logging

import pytest

from proxymodel_operator.handlers import REFUSALS


def _record(message: str, name: str) -> logging.LogRecord:
    record = logging.LogRecord("kopf.objects", logging.INFO, __file__, 1, message, (), None)
    record.k8s_ref = {"namespace": "ns", "name": name}
    return record


@pytest.fixture()
def refused():
    REFUSALS.refusing[("ns", "bad")] = "NotMoE"
    yield
    REFUSALS.refusing.pop(("ns", "bad"), None)


def test_kopf_lines_about_a_refused_proxymodel_say_refused(refused):
    for handler in ("pipeline", "pipeline/validate", "rejudge"):
        record = _record(f"Handler '{handler}' succeeded.", "bad")
        assert REFUSALS.filter(record)  # rewritten, never dropped
        refused_line = f"Handler '{handler}' refused the ProxyModel: NotMoE (see its Accepted condition)."
        assert record.getMessage() == refused_line
    summary = _record("Creation is processed: 1 succeeded; 0 failed.", "bad")
    REFUSALS.filter(summary)
    assert summary.getMessage() == "Creation is processed: the ProxyModel is refused (NotMoE)."
    assert ("ns", "bad") not in REFUSALS.refusing  # the summary is the last line of that handling


def test_lines_about_other_objects_and_other_handlers_are_left_alone(refused):
    for message, name in [("Handler 'pipeline' succeeded.", "good"),
                          ("Creation is processed: 1 succeeded; 0 failed.", "good"),
                          ("Handler 'delete_proxy' succeeded.", "bad")]:
        record = _record(message, name)
        REFUSALS.filter(record)
        assert record.getMessage() == message
