"""calibrate and a calibrated build with the checkpoint and the statistics in object storage
(a real SeaweedFS on 127.0.0.1, the fixtures of tests/s3)."""

from __future__ import annotations

import json

import pytest

from moe_proxy.calibrate import statistics as cal
from moe_proxy.pruning.build import build_proxy
from tests.s3.conftest import aws_env, local_ckpt, prefix, s3_ckpt, seaweed  # noqa: F401 (fixtures)


def test_calibrate_and_build_through_s3(s3_ckpt, local_ckpt, seaweed, prefix, tmp_path):  # noqa: F811
    opts = {"endpoint_url": seaweed.endpoint_url}
    stats_uri = f"s3://proxy/{prefix}/stats"
    remote = cal.calibrate(s3_ckpt, stats_uri, samples=4, seq_len=16, store_options=opts)
    local = cal.calibrate(str(local_ckpt), str(tmp_path / "stats"), samples=4, seq_len=16)
    # Same bytes, same identity and the same statistics wherever the checkpoint lives.
    assert remote["source"]["identity"] == local["source"]["identity"]
    assert remote["layers"] == local["layers"]
    keys = {o["Key"] for o in seaweed.client().list_objects_v2(Bucket="proxy", Prefix=prefix)["Contents"]}
    assert keys == {f"{prefix}/stats/{cal.SUMMARY}", f"{prefix}/stats/{cal.TENSORS}"}
    m = build_proxy(s3_ckpt, f"s3://proxy/{prefix}/proxy", experts=8, method="saliency",
                    calibration=stats_uri, store_options=opts)
    assert m["calibration"]["uri"] == stats_uri
    body = seaweed.client().get_object(Bucket="proxy", Key=f"{prefix}/proxy/proxy-manifest.json")["Body"].read()
    assert json.loads(body)["layers"] == m["layers"]


def test_dataset_from_s3(s3_ckpt, seaweed, prefix, tmp_path):  # noqa: F811
    from moe_proxy.calibrate.tokens import read_documents
    from moe_proxy.errors import BadDataset

    opts = {"endpoint_url": seaweed.endpoint_url}
    seaweed.client().put_object(Bucket="proxy", Key=f"{prefix}/data.jsonl",
                                Body=b'{"text": "first"}\n{"prompt": [{"role": "user", "content": "hi"}]}\n')
    docs = read_documents(f"s3://proxy/{prefix}/data.jsonl", opts)
    assert docs == ["first", [{"role": "user", "content": "hi"}]]
    with pytest.raises(BadDataset, match="no such object"):
        read_documents(f"s3://proxy/{prefix}/missing.jsonl", opts)
    summary = cal.calibrate(s3_ckpt, str(tmp_path / "s"), dataset=f"s3://proxy/{prefix}/data.jsonl",
                            samples=2, seq_len=8, store_options=opts)
    assert "read as bytes" in summary["tokens"]["origin"]  # the tiny checkpoint ships no tokenizer
