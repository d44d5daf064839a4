"""S3Store against a real SeaweedFS: ranged reads, streamed multipart writes, checksums,
stale-upload cleanup, bounded memory."""

from __future__ import annotations

import base64
import hashlib
import os
import tracemalloc
from concurrent.futures import wait

import pytest

from moe_proxy.errors import StorageError
from moe_proxy.storage import open_store, write_bytes

from .faultproxy import FaultProxy
from .helpers import PART, incomplete_uploads


def store(seaweed, prefix, **options):
    return open_store(f"s3://proxy/{prefix}/", endpoint_url=seaweed.endpoint_url, **options)


def test_small_file_is_one_put_with_its_sha256(seaweed, prefix):
    s = store(seaweed, prefix)
    assert s.uri == f"s3://proxy/{prefix}"
    write_bytes(s, "config.json", b'{"a": 1}')
    assert s.exists("config.json") and not s.exists("other.json")
    assert s.size("config.json") == 8
    assert s.read_bytes("config.json") == b'{"a": 1}'
    assert s.read_range("config.json", 2, 3) == b'a":'
    assert s.checksum("config.json") == base64.b64encode(hashlib.sha256(b'{"a": 1}').digest()).decode()
    assert s.list() == ["config.json"]
    s.delete("config.json")
    assert s.list() == [] and not s.exists("config.json")


@pytest.mark.parametrize("checksum", ["sha256", "md5"])
def test_multipart_upload_streams_parts_and_checks_the_whole(seaweed, prefix, checksum):
    data = os.urandom(2 * PART + 12345)
    s = store(seaweed, prefix, part_size=PART, max_concurrency=2, checksum=checksum)
    w = s.writer("sub/shard.safetensors")
    for i in range(0, len(data), 777_777):  # odd-sized writes, as a shard writer produces them
        w.write(memoryview(data)[i : i + 777_777])
    # Parts went up while writing: an upload is open before commit, and nothing is visible yet.
    assert [u["Key"] for u in incomplete_uploads(seaweed, "proxy", prefix)] == [f"{prefix}/sub/shard.safetensors"]
    assert not s.exists("sub/shard.safetensors")
    w.commit()
    assert incomplete_uploads(seaweed, "proxy", prefix) == []
    assert s.size("sub/shard.safetensors") == len(data)
    parts = [data[:PART], data[PART : 2 * PART], data[2 * PART :]]
    if checksum == "sha256":  # the sha256 of the 3 parts' sha256s, as the store computed it
        inner = b"".join(hashlib.sha256(p).digest() for p in parts)
        assert s.checksum("sub/shard.safetensors") == base64.b64encode(hashlib.sha256(inner).digest()).decode() + "-3"
    else:  # the ETag: md5 of the parts' md5s
        inner = b"".join(hashlib.md5(p).digest() for p in parts)
        assert s.checksum("sub/shard.safetensors") == f'"{hashlib.md5(inner).hexdigest()}-3"'
    for start, n in [(0, 8), (PART - 5, 10), (2 * PART, 12345), (123, 2 * PART)]:
        assert s.read_range("sub/shard.safetensors", start, n) == data[start : start + n]
    assert s.list() == ["sub/shard.safetensors"]


def test_md5_mode_single_put(seaweed, prefix, monkeypatch):
    """For stores without S3's flexible checksums: Content-MD5, checked against the ETag."""
    monkeypatch.setenv("MOE_PROXY_S3_CHECKSUM", "md5")
    s = store(seaweed, prefix)
    write_bytes(s, "config.json", b"{}")
    assert s.checksum("config.json") == f'"{hashlib.md5(b"{}").hexdigest()}"'
    assert s.read_bytes("config.json") == b"{}"


@pytest.mark.parametrize("checksum", ["sha256", "md5"])
def test_a_part_corrupted_in_transit_is_rejected_and_nothing_is_left(seaweed, prefix, checksum):
    """A byte flipped on the way: the store checks the part's checksum and refuses it, the
    writer aborts the upload, and no object appears."""
    port = int(seaweed.endpoint_url.rsplit(":", 1)[1])
    with FaultProxy(port, {"corrupt": 1.0}) as net:  # every other request: one body byte flipped
        s = open_store(f"s3://proxy/{prefix}", endpoint_url=net.endpoint_url, part_size=PART, checksum=checksum)
        w = s.writer("shard")
        with pytest.raises(StorageError, match="BadDigest: checksum mismatch, corrupted in transit"):
            for _ in range(3):
                w.write(os.urandom(PART))
            w.commit()
        w.abort()
    assert net.fates["corrupt"] >= 1
    assert not store(seaweed, prefix).exists("shard")
    assert incomplete_uploads(seaweed, "proxy", prefix) == []


def test_abort_leaves_nothing(seaweed, prefix):
    s = store(seaweed, prefix, part_size=PART)
    w = s.writer("shard")
    w.write(os.urandom(PART + 10))
    w.abort()
    assert not s.exists("shard")
    assert incomplete_uploads(seaweed, "proxy", prefix) == []


def test_stale_upload_of_a_killed_attempt_is_aborted(seaweed, prefix):
    s = store(seaweed, prefix, part_size=PART)
    killed = s.writer("shard")
    killed.write(os.urandom(PART + 10))  # one part uploaded, then the process "dies": no abort
    wait(killed.parts)  # its part is up (uploads run on the store's shared pool)
    assert len(incomplete_uploads(seaweed, "proxy", prefix)) == 1
    w = s.writer("shard")  # the rerun's writer clears what the dead one left
    assert incomplete_uploads(seaweed, "proxy", prefix) == []
    w.write(b"fresh")
    w.commit()
    assert s.read_bytes("shard") == b"fresh"


def test_prefix_wide_cleanup_of_incomplete_uploads(seaweed, prefix):
    s = store(seaweed, prefix, part_size=PART)
    for name in ("a", "b/c"):
        s.writer(name).write(os.urandom(PART))
    assert s.abort_incomplete_uploads() == 2
    assert incomplete_uploads(seaweed, "proxy", prefix) == []


def test_upload_memory_is_bounded_by_parts_in_flight(seaweed, prefix):
    """40 MiB streamed through a writer with 5 MiB parts, 2 in flight: Python's peak allocation
    stays near (2 in flight + 1 buffering + 1 being cut) parts, far below the file size."""
    s = store(seaweed, prefix, part_size=PART, max_concurrency=2)
    chunk = os.urandom(1 << 20)
    tracemalloc.start()
    try:
        w = s.writer("big")
        h = hashlib.sha256()
        for _ in range(40):
            w.write(chunk)
            h.update(chunk)
        w.commit()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert s.size("big") == 40 << 20
    assert peak < 6 * PART, f"peak {peak / 2**20:.1f} MiB"
    got = hashlib.sha256(s.read_range("big", 0, 40 << 20)).hexdigest()
    assert got == h.hexdigest()


def test_counts_downloaded_bytes(seaweed, prefix):
    s = store(seaweed, prefix)
    write_bytes(s, "f", b"x" * 1000)
    s.read_range("f", 10, 100)
    s.read_bytes("f")
    assert s.bytes_downloaded == 1100


@pytest.mark.parametrize("uri", ["s3://", "s3:///key"])
def test_uri_without_bucket_is_refused(uri):
    with pytest.raises(StorageError, match="names no bucket"):
        open_store(uri)
