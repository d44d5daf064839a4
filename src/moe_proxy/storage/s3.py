"""`s3://bucket/prefix` as a Store: ranged reads and streamed multipart writes, through boto3.

Credentials and region come from boto3's standard chain (environment variables, shared
config/credentials files and AWS_PROFILE, web identity / IRSA, container or instance roles).
The endpoint is `endpoint_url` (the CLI's --endpoint-url), AWS_ENDPOINT_URL(_S3) or the
shared config file's endpoint_url; any endpoint that is not AWS gets path-style addressing,
which on-premise stores (MinIO, Ceph RGW, OBS, SeaweedFS) need.

Transient faults (5xx, timeouts, refused or dropped connections) are retried by botocore's
"standard" retry mode, with exponential backoff and jitter. The one fault botocore cannot
retry, a connection dropped while a response body is being read, is retried here by asking
again for the missing bytes only.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from urllib.parse import urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError as BotoConnectionError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
)
from s3transfer.utils import S3_RETRYABLE_DOWNLOAD_ERRORS

from moe_proxy import __version__
from moe_proxy.errors import AccessDenied, CorruptCheckpoint, EndpointUnreachable, ObjectNotFound, StorageError
from moe_proxy.storage.inflight import MAX_STREAMS, SHARED, Transfer

log = logging.getLogger(__name__)

# botocore's DEBUG log prints every request's headers, and the Authorization header names the
# access key: keep boto's own chatter out of `moe-proxy -v` unless someone configured it.
for _name in ("botocore", "boto3", "s3transfer", "urllib3"):
    if logging.getLogger(_name).level == logging.NOTSET:
        logging.getLogger(_name).setLevel(logging.WARNING)

# Multipart part size: S3 wants >= 5 MiB (but the last). Small parts keep the tail of each file
# short, where fewer parts are left in flight than fill the link; a very large file's parts double
# every 2,500 (S3Writer), so 10,000 parts hold 300 GiB.
PART_SIZE = 8 << 20
MAX_PARTS = 10_000  # S3's limit per upload
READ_CHUNK = 8 << 20  # response bodies are read in pieces of this size
NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
DENIED = {"403", "AccessDenied", "Forbidden", "AllAccessDisabled", "AccountProblem"}
BAD_TOKEN = {"ExpiredToken", "InvalidToken", "TokenRefreshRequired"}
BAD_DIGEST = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch"}
CHANGED = {"PreconditionFailed", "412", "InvalidRange", "416"}  # a ranged If-Match read of a replaced object


def parse_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix/` -> ("bucket", "some/prefix")."""
    if not uri.startswith("s3://"):
        raise StorageError(f"not an s3:// URI: {uri!r}")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not bucket:
        raise StorageError(f"{uri!r} names no bucket: use s3://bucket/prefix")
    return bucket, prefix.strip("/")


def _is_aws(url: str) -> bool:
    return (urlparse(url).hostname or "").endswith((".amazonaws.com", ".amazonaws.com.cn"))


def _code(exc: BaseException | None) -> str:
    """The S3 error code of a botocore ClientError ("" for anything else)."""
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


class S3Store:
    """A checkpoint directory under an S3 prefix (see the module docstring).

    Options (all optional, passed through open_store): endpoint_url, region, addressing_style
    ("path" or "virtual"), checksum ("sha256", or "md5" for older stores; default
    $MOE_PROXY_S3_CHECKSUM), part_size, transfer (an inflight.Transfer: upload streams and the
    byte budget upload parts share with the build's reads; default inflight.SHARED),
    max_concurrency (parts in flight per file, at most; default: the budget alone bounds them,
    so upload memory is at most the budget plus one part buffering), max_attempts (per request,
    first try included), connect_timeout / read_timeout in seconds, credentials (a dict of
    AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN to use instead of boto3's chain).
    """

    def __init__(
        self,
        uri: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        addressing_style: str | None = None,
        part_size: int = PART_SIZE,
        max_concurrency: int | None = None,
        transfer: Transfer | None = None,
        max_attempts: int = 5,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        checksum: str | None = None,
        credentials: dict[str, str] | None = None,
    ):
        self.bucket, self.prefix = parse_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.part_size, self.max_concurrency, self.max_attempts = part_size, max_concurrency, max_attempts
        self.transfer = transfer or SHARED
        self._uploads: ThreadPoolExecutor | None = None  # all this store's writers' parts, `streams` at once
        self._uploads_lock = threading.Lock()
        # What each PUT and part carries: SHA256 (x-amz-checksum-sha256) by default; MD5
        # (Content-MD5, checked against the ETag) for stores that predate S3's flexible checksums.
        self.checksum_algorithm = (checksum or os.environ.get("MOE_PROXY_S3_CHECKSUM") or "sha256").lower()
        if self.checksum_algorithm not in ("sha256", "md5"):
            raise StorageError(f"checksum must be sha256 or md5, got {self.checksum_algorithm!r} (MOE_PROXY_S3_CHECKSUM)")
        config = Config(
            retries={"mode": "standard", "max_attempts": max_attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            # Room for every read and upload in flight (connections open only when used).
            max_pool_connections=max(10, 2 * (max_concurrency or 0), 2 * MAX_STREAMS + 8),
            # We send our own checksum with every PUT and part (below); this keeps botocore from
            # adding CRC trailers that some S3-compatible stores reject.
            request_checksum_calculation="when_required",
            user_agent_extra=f"moe-proxy/{__version__}",
        )
        # Explicit keys (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN: the operator's,
        # from a Secret) instead of boto3's chain; held by boto3 only, never logged.
        keys = credentials or {}
        self.session = boto3.session.Session(
            region_name=region, aws_access_key_id=keys.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=keys.get("AWS_SECRET_ACCESS_KEY"), aws_session_token=keys.get("AWS_SESSION_TOKEN"))
        self.client = self.session.client("s3", endpoint_url=endpoint_url, config=config)
        # The endpoint may come from the option, AWS_ENDPOINT_URL(_S3) or the shared config file;
        # whichever it was, a store that is not AWS gets path-style addressing.
        if addressing_style is None and not _is_aws(self.client.meta.endpoint_url):
            addressing_style = "path"
        if addressing_style:
            config = config.merge(Config(s3={"addressing_style": addressing_style}))
            self.client = self.session.client("s3", endpoint_url=endpoint_url, config=config)
        self.bytes_downloaded = 0  # response-body bytes of this store's GETs (threads read at once)
        self._count_lock = threading.Lock()
        self._bucket_checked = False

    # ------------------------------------------------------------ names and errors

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _call(self, operation: str, name: str | None = None, **params):
        """Call one S3 operation (botocore retries transient faults), mapping failures to
        moe-proxy's StorageError family."""
        if name is not None:
            params["Key"] = self._key(name)
        try:
            return getattr(self.client, operation)(Bucket=self.bucket, **params)
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, operation, name) from exc

    def _credential_source(self) -> str:
        # The *kind* of source (env, shared-credentials-file, assume-role-with-web-identity, ...),
        # never a value.
        creds = self.session.get_credentials()
        return getattr(creds, "method", None) or "none found"

    def _error(self, exc: Exception, operation: str, name: str | None) -> StorageError:
        where = f"s3://{self.bucket}/{self._key(name)}" if name is not None else self.uri
        endpoint = self.client.meta.endpoint_url
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return AccessDenied(
                f"{where}: no usable AWS credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                f"AWS_PROFILE, or a web identity token (IRSA)"
            )
        if isinstance(exc, (BotoConnectionError, HTTPClientError)):  # refused, timed out, dropped
            return EndpointUnreachable(
                f"{where}: the object store at {endpoint} did not answer {operation} after "
                f"{self.max_attempts} attempts ({type(exc).__name__}); check --endpoint-url / "
                f"AWS_ENDPOINT_URL and the network"
            )
        if not isinstance(exc, ClientError):
            return StorageError(f"{where}: {operation} failed: {type(exc).__name__}: {exc}")
        error = exc.response.get("Error", {})
        code, status = _code(exc), exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        source = self._credential_source()
        if code == "NoSuchBucket":
            return ObjectNotFound(f"{where}: bucket {self.bucket!r} does not exist at {endpoint}")
        if code in NOT_FOUND:
            return ObjectNotFound(f"{where}: no such object")
        if code == "InvalidAccessKeyId":
            return AccessDenied(
                f"{where}: the store does not know this access key (credentials from: {source}); "
                f"check AWS_ACCESS_KEY_ID / AWS_PROFILE and --endpoint-url"
            )
        if code == "SignatureDoesNotMatch":
            return AccessDenied(
                f"{where}: request signature rejected: the secret key does not match the access key "
                f"(credentials from: {source}); check AWS_SECRET_ACCESS_KEY / AWS_PROFILE"
            )
        if code in BAD_TOKEN:
            return AccessDenied(f"{where}: the session token is expired or invalid (credentials from: {source})")
        if code in BAD_DIGEST:
            return StorageError(f"{where}: the store received other bytes than were sent ({code}: checksum "
                                f"mismatch, corrupted in transit); nothing was stored, rerun to resume")
        if code in DENIED:
            return AccessDenied(f"{where}: access denied for {operation} (credentials from: {source})")
        return StorageError(f"{where}: {operation} failed: {code} (HTTP {status}): {error.get('Message', '')}")

    def _check_bucket(self) -> None:
        """HEAD answers a bare 404 both for a missing key and a missing bucket; tell them apart
        once, so a wrong bucket name is reported as such."""
        if self._bucket_checked:
            return
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if _code(exc) in NOT_FOUND | {"NoSuchBucket"}:
                raise ObjectNotFound(f"{self.uri}: bucket {self.bucket!r} does not exist at "
                                     f"{self.client.meta.endpoint_url}") from exc
            # 403 and the like: we may read objects without being allowed to HEAD the bucket.
        except BotoCoreError as exc:
            raise self._error(exc, "head_bucket", None) from exc
        self._bucket_checked = True

    def _head(self, name: str, **params) -> dict | None:
        try:
            return self._call("head_object", name, **params)
        except ObjectNotFound:
            self._check_bucket()
            return None
        except AccessDenied as exc:
            # A HEAD answer has no body, so its 403 does not say why (unknown key, wrong
            # secret, policy); a one-byte GET gets the store's reason.
            if _code(exc.__cause__) == "403":
                try:
                    self._call("get_object", name, Range="bytes=0-0")
                except AccessDenied:
                    raise  # the store's reason
                except StorageError:
                    pass
            raise

    # ------------------------------------------------------------ reading

    def exists(self, name: str) -> bool:
        return self._head(name) is not None

    def size(self, name: str) -> int:
        head = self._head(name)
        if head is None:
            raise ObjectNotFound(f"s3://{self.bucket}/{self._key(name)}: no such object")
        return int(head["ContentLength"])

    def entry(self, name: str) -> tuple[int, str] | None:
        """(size, ETag) of one object, as list_entries gives them, from one HEAD; None when there is none."""
        head = self._head(name)
        return None if head is None else (int(head["ContentLength"]), str(head.get("ETag", "")))

    def checksum(self, name: str) -> str | None:
        """The SHA256 checksum the store keeps for the object (of the whole object, or
        "<sha256 of part sha256s>-<parts>" for a multipart upload), without downloading it;
        falls back to the ETag where the store keeps no SHA256."""
        head = self._head(name, ChecksumMode="ENABLED")
        if head is None:
            return None
        return head.get("ChecksumSHA256") or head.get("ETag")

    def read_range(self, name: str, start: int, length: int, if_match: str | None = None) -> bytes:
        """Bytes [start, start + length); `if_match`: only of the object version with that ETag
        (a changed object fails with PreconditionFailed, a StorageError)."""
        if length == 0:
            return b""
        chunks: list[bytes] = []
        got, etag, drops = 0, if_match, 0
        while got < length:
            first, last = start + got, start + length - 1
            # After a drop, ask only for the missing bytes, and only of the same object version.
            resp = self._call("get_object", name, Range=f"bytes={first}-{last}", **({"IfMatch": etag} if etag else {}))
            etag = resp.get("ETag")
            expected = int(resp["ContentLength"])
            try:
                for chunk in resp["Body"].iter_chunks(READ_CHUNK):
                    chunks.append(chunk)
                    got += len(chunk)
                    with self._count_lock:
                        self.bytes_downloaded += len(chunk)
            except S3_RETRYABLE_DOWNLOAD_ERRORS as exc:
                drops += 1
                if drops >= self.max_attempts:
                    raise EndpointUnreachable(
                        f"s3://{self.bucket}/{self._key(name)}: the connection dropped {drops} times while "
                        f"reading bytes {first}..{last} ({type(exc).__name__})"
                    ) from exc
                log.debug("%s: connection dropped mid-read (%s), resuming at byte %d", name, exc, start + got)
                time.sleep(min(0.05 * 2**drops, 2))  # the backoff botocore uses for transient errors
                continue
            if expected < last - first + 1:
                raise CorruptCheckpoint(
                    f"s3://{self.bucket}/{self._key(name)}: wanted bytes {start}..{start + length} but the "
                    f"object ends at {first + expected} (truncated?)"
                )
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def read_if_unchanged(self, name: str, start: int, length: int, etag: str | None) -> bytes | None:
        """read_range of the object version `etag` (from a listing) only; None when the object was
        replaced, shortened or deleted since (a follower's next listing sees the new version)."""
        try:
            return self.read_range(name, start, length, if_match=etag or None)
        except (ObjectNotFound, CorruptCheckpoint):
            return None
        except StorageError as exc:
            if _code(exc.__cause__) in CHANGED:
                return None
            raise

    def read_bytes(self, name: str) -> bytes:
        return self.read_range(name, 0, self.size(name))

    def list(self) -> list[str]:
        return list(self.list_sizes())

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """Objects under this store's prefix whose names start with `prefix`, with their sizes
        (the listing carries them: one request per 1,000 objects)."""
        return {name: size for name, (size, _) in self.list_entries(prefix).items()}

    def list_entries(self, prefix: str = "") -> dict[str, tuple[int, str]]:
        """As list_sizes, each with (size, ETag): the ETag changes when the object is replaced."""
        base = f"{self.prefix}/" if self.prefix else ""
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base + prefix)
            return dict(sorted((o["Key"][len(base) :], (int(o["Size"]), str(o.get("ETag", ""))))
                               for page in pages for o in page.get("Contents", [])))
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, "list_objects_v2", None) from exc

    # ------------------------------------------------------------ writing

    def writer(self, name: str) -> "S3Writer":
        self.abort_incomplete_uploads(name)
        return S3Writer(self, name)

    def upload_pool(self) -> ThreadPoolExecutor:
        with self._uploads_lock:
            if self._uploads is None:
                self._uploads = ThreadPoolExecutor(self.transfer.streams, thread_name_prefix="s3-upload")
            return self._uploads

    def delete(self, name: str) -> None:
        self._call("delete_object", name)

    def discard_incomplete(self) -> int:
        return self.abort_incomplete_uploads()

    def abort_incomplete_uploads(self, name: str | None = None) -> int:
        """Abort multipart uploads left by interrupted attempts, for `name` or the whole prefix.
        Their parts are invisible but billed; a store that will not list them is skipped."""
        prefix = self._key(name) if name is not None else (f"{self.prefix}/" if self.prefix else "")
        aborted = 0
        try:
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix):
                for up in page.get("Uploads", []):
                    if name is None or up["Key"] == prefix:
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                        log.info("aborted an incomplete upload of s3://%s/%s from an interrupted attempt",
                                 self.bucket, up["Key"])
                        aborted += 1
        except ClientError as exc:
            error = self._error(exc, "list_multipart_uploads", name)
            if not isinstance(error, AccessDenied):
                raise error from exc
            log.debug("not allowed to list incomplete uploads under %s: skipped", prefix)
        except BotoCoreError as exc:
            raise self._error(exc, "list_multipart_uploads", name) from exc
        return aborted


class S3Writer:
    """One object being uploaded, bytes pushed in with write(). Full parts go up as a
    multipart upload while the caller keeps producing, on the store's upload pool: each part
    holds its bytes of the transfer budget from being cut until the store acknowledged it
    (and at most max_concurrency parts per file are in flight where that is set), so memory
    stays bounded; a file smaller than one part is a single PUT. Every
    PUT and part carries its SHA256 (or MD5), which the store checks on receipt, and commit
    checks the store's checksum of the whole object. Nothing is visible under the key before
    commit."""

    def __init__(self, store: S3Store, name: str):
        self.store, self.name = store, name
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.md5 = store.checksum_algorithm == "md5"
        self.digests: dict[int, bytes] = {}  # part number -> its SHA256 (or MD5)
        self.parts: list[Future] = []  # -> {"PartNumber", "ETag"[, "ChecksumSHA256"]}
        self.sizes: list[int] = []  # bytes of the budget each part holds
        self.checked = 0  # parts[:checked] are known to have gone up
        self.budget = store.transfer.budget

    def write(self, data: bytes | memoryview) -> int:
        self.buffer += data
        while len(self.buffer) >= (size := self.store.part_size << min(3, len(self.parts) // 2500)):
            self._reserve(size)
            with memoryview(self.buffer) as view:
                part = bytes(view[:size])  # one copy, not two
            del self.buffer[:size]
            self._send(part)
        return len(data)

    def _reserve(self, n: int) -> None:
        """Bounded memory: wait for the oldest part in flight where this file has max_concurrency
        of them, then for n bytes of the budget (freed as other parts are acknowledged)."""
        limit = self.store.max_concurrency
        in_flight = [f for f in self.parts if not f.done()]
        while self.checked < len(self.parts) and self.parts[self.checked].done():
            self.parts[self.checked].result()  # a part that failed stops the write now, not at commit
            self.checked += 1
        if limit and len(in_flight) >= limit:
            in_flight[0].result()
        self.budget.acquire(n)

    def _send(self, part: bytes) -> None:
        """Upload `part`, whose bytes are already reserved in the budget."""
        store = self.store
        try:
            if self.upload_id is None:
                algorithm = {} if self.md5 else {"ChecksumAlgorithm": "SHA256"}
                self.upload_id = store._call("create_multipart_upload", self.name, **algorithm)["UploadId"]
            number = len(self.parts) + 1
            if number > MAX_PARTS:
                raise StorageError(f"{self.name}: more than {MAX_PARTS} parts; use a larger part_size")
            self.parts.append(store.upload_pool().submit(self._upload_part, number, part))
        except BaseException:
            self.budget.release(len(part))
            raise
        self.sizes.append(len(part))

    def _checksum(self, number: int, data: bytes) -> dict:
        """The request parameter that makes the store verify `data` (part `number`) on receipt."""
        digest = (hashlib.md5 if self.md5 else hashlib.sha256)(data).digest()
        self.digests[number] = digest
        return {"ContentMD5": _b64(digest)} if self.md5 else {"ChecksumSHA256": _b64(digest)}

    def _upload_part(self, number: int, part: bytes) -> dict:
        try:
            # Hashed here, on the upload thread (hashlib releases the GIL), not on the writer's:
            # the one thread that cuts every part would otherwise hash every byte a second time.
            checksum = self._checksum(number, part)
            r = self.store._call("upload_part", self.name, UploadId=self.upload_id, PartNumber=number,
                                 Body=part, **checksum)
        finally:
            self.budget.release(len(part))
        return {"PartNumber": number, "ETag": r["ETag"], **({} if self.md5 else checksum)}

    def _expected(self) -> str:
        """What the store must report for the whole object: for n parts, the SHA256 of the parts'
        SHA256s "-n", or the ETag, MD5 of the parts' MD5s "-n"; for one PUT, the MD5 ETag."""
        digests = [self.digests[k] for k in sorted(self.digests)]
        n = len(digests)
        if not self.md5:
            return f"{_b64(hashlib.sha256(b''.join(digests)).digest())}-{n}"
        return f'"{digests[0].hex()}"' if self.upload_id is None else f'"{hashlib.md5(b"".join(digests)).hexdigest()}-{n}"'

    def commit(self) -> None:
        store = self.store
        if self.upload_id is None:
            data = bytes(self.buffer)
            r = store._call("put_object", self.name, Body=data, **self._checksum(1, data))
            if self.md5 and r.get("ETag") not in (None, self._expected()):
                raise StorageError(f"s3://{store.bucket}/{store._key(self.name)}: the store's ETag {r['ETag']} "
                                   f"differs from the MD5 of the data sent ({self._expected()})")
            return
        try:
            if self.buffer:
                self._reserve(len(self.buffer))
                self._send(bytes(self.buffer))  # the last part may be short
                self.buffer.clear()
            parts = [f.result() for f in self.parts]
        except BaseException:
            self.abort()  # a part failed even after retries: leave no upload behind
            raise
        expected = self._expected()
        try:
            r = store._call("complete_multipart_upload", self.name, UploadId=self.upload_id,
                            MultipartUpload={"Parts": parts})
            got = r.get("ETag" if self.md5 else "ChecksumSHA256")
        except StorageError as exc:
            # A retried complete whose first attempt succeeded finds no upload any more: the
            # object is there if its checksum is ours.
            if _code(exc.__cause__) != "NoSuchUpload" or store.checksum(self.name) != expected:
                raise
            got = expected
        if got is not None and got != expected:
            store.delete(self.name)  # visible but wrong: never leave it under a real name
            raise StorageError(f"s3://{store.bucket}/{store._key(self.name)}: the store's checksum {got} of the "
                               f"uploaded object differs from the data sent ({expected}); deleted it")

    def abort(self) -> None:
        """Throw the partial upload away. Never raises: it runs while another error propagates,
        and an upload it fails to abort is aborted by the next attempt's writer()."""
        for f, n in zip(self.parts, self.sizes):
            if f.cancel():  # never ran: its bytes are still reserved
                self.budget.release(n)
        wait(self.parts)
        if self.upload_id is not None:
            try:
                self.store._call("abort_multipart_upload", self.name, UploadId=self.upload_id)
            except StorageError as exc:
                log.warning("could not abort the incomplete upload of %s (%s); the next attempt will", self.name, exc)
        self.buffer.clear()
