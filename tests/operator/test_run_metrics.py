"""run_metrics on SeaweedFS: the run's metrics followed poll after poll by the watch's RunWatcher
(poll() -> the earliest watched failure, last_step, finished; after_step, the recovery rule's
still_failing_after) and run_metrics.poll around it (a rewind read again from the start)."""

from __future__ import annotations

import json
import uuid

from proxymodel_operator.run_metrics import poll, watcher_for

from .harness import ACCESS_KEY, BUCKET, SECRET_KEY

CLEAN = {"actor/pg_loss": 0.1, "actor/grad_norm": 1.0}


class Log:
    def __init__(self, s3):
        self.client, self.key, self.lines = s3.client(), f"metrics/{uuid.uuid4().hex[:8]}/metrics.jsonl", []
        self.uri = f"s3://{BUCKET}/{self.key}"

    def log(self, step: int, **values) -> None:
        self.lines.append(json.dumps({"step": step, "data": {**CLEAN, **values}}))
        self.client.put_object(Bucket=BUCKET, Key=self.key, Body="".join(f"{x}\n" for x in self.lines).encode())


def _options(s3) -> dict:
    return {"endpoint_url": s3.endpoint_url, "region": "us-east-1",
            "credentials": {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}}


def test_a_run_followed_poll_after_poll(s3):
    log = Log(s3)
    w = watcher_for(log.uri, ["nan", "actor/grad_norm>100:2"], None, None, 9, _options(s3), None)
    assert w.poll() is None and w.last_step is None  # nothing logged yet
    for step in range(1, 6):
        log.log(step)
    assert w.poll() is None and w.last_step == 5
    log.log(6, **{"actor/grad_norm": 500.0})
    log.log(7, **{"actor/grad_norm": 600.0})
    failure = w.poll()
    assert (failure.step, failure.signature, failure.seen) == (6, "actor/grad_norm>100:2", 7)
    log.log(8, **{"actor/pg_loss": None})  # a NaN later: the earliest failure stands
    assert w.poll() == failure and w.still_failing_after(failure) == [False] and w.finished is None
    log.log(9)
    polled = poll(w, lambda: None)
    assert (polled.watcher, polled.failure, polled.hits, polled.rewound) == (w, failure, [False, False], False)
    assert w.finished == "step 9 logged (spec.metrics.lastStep)"
    # a watcher past that incident sees only later steps: the NaN at 8
    after = watcher_for(log.uri, ["nan", "actor/grad_norm>100:2"], None, None, None, _options(s3), 7)
    assert after.poll().step == 8 and after.last_step == 9  # the steps up to 7 read, not fed


def test_shorter_metrics_are_read_again_from_the_start(s3):
    log = Log(s3)
    for step in range(1, 5):
        log.log(step)

    def fresh():
        return watcher_for(log.uri, ["nan"], None, None, None, _options(s3), None)

    w = fresh()
    polled = poll(w, fresh)
    assert (polled.watcher, polled.watcher.last_step, polled.rewound) == (w, 4, False)
    log.lines = log.lines[:2]
    log.log(3, **{"actor/pg_loss": None})
    polled = poll(w, fresh)
    assert polled.rewound and polled.watcher is not w
    assert polled.failure.step == 3 and polled.watcher.last_step == 3 and polled.hits == []
