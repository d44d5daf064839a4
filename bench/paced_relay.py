"""A loopback relay that makes a local S3 endpoint behave like a remote object store.

Real object stores answer a request after tens of milliseconds and give one connection
roughly 50-150 MB/s; a pod's network interface caps all its connections together. SeaweedFS
on 127.0.0.1 does none of that. `PacedRelay` sits between a client and the endpoint and adds:

- first-byte latency: each request (a client chunk that starts with an HTTP request line) is
  held `latency` seconds before it is forwarded, so its response cannot start earlier;
- a per-connection bandwidth cap, each direction on its own (TCP connections are duplex);
- an aggregate cap per relay, each direction on its own: one relay per simulated pod stands
  for that pod's network interface (full duplex, like a NIC).

Caps are token buckets that may run into debt: a chunk of n bytes is forwarded once the
bucket has paid for it, so over any interval T a direction carries at most rate x T + burst
bytes (burst: `burst_s` seconds' worth, at least one chunk). The aggregate bucket serves
waiting connections first come, first served.

Backpressure is TCP's own: the relay reads a bounded chunk, forwards it, and reads the next
only after the write drained, so a capped client slows the server's sends, as on a real link.

The relay runs an asyncio loop on its own thread (`with PacedRelay(...) as relay:`), binds
127.0.0.1 only, and counts what a pod's interface would: bytes each way, requests, connections,
seconds of requests in flight, and its own CPU seconds.

    with PacedRelay(seaweed.endpoint_url, latency=0.03, conn_mbps=50, pod_mbps=200) as relay:
        store = open_store("s3://bucket/ckpt", endpoint_url=relay.endpoint_url)
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

REQUEST_LINE = re.compile(rb"^(GET|PUT|POST|HEAD|DELETE) /")
MB = 1e6  # bandwidths are in MB/s, decimal, as links are quoted


class Bucket:
    """A token bucket in bytes/s that may run into debt; take() waits until the debt is paid.
    An asyncio.Lock is FIFO, so concurrent takers are served in arrival order."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = burst, time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate) - n
            self.stamp = now
            if self.tokens < 0:
                await asyncio.sleep(-self.tokens / self.rate)


@dataclass
class Stats:
    bytes_down: int = 0  # server -> client
    bytes_up: int = 0  # client -> server
    requests: int = 0
    connections: int = 0
    peak_connections: int = 0
    busy_s: float = 0.0  # sum over requests of (request line seen -> its last response byte)
    last_byte: float | None = None  # time.monotonic() of the last byte relayed either way
    # One entry per request: [time.monotonic() of its request line, method, bytes up, bytes down].
    log: list[list] = field(default_factory=list)

    def methods(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, method, _, _ in self.log:
            out[method] = out.get(method, 0) + 1
        return out


class PacedRelay:
    def __init__(self, upstream: str, latency: float = 0.0, conn_mbps: float | None = None,
                 pod_mbps: float | None = None, burst_s: float = 0.02, name: str = "relay"):
        """`upstream`: the endpoint URL (http://127.0.0.1:PORT); `latency` in seconds; caps in
        MB/s (None: no cap)."""
        url = urlsplit(upstream)
        self.upstream = (url.hostname or "127.0.0.1", url.port or 80)
        self.latency, self.name = latency, name
        self.conn_rate = conn_mbps * MB if conn_mbps else None
        self.pod_rate = pod_mbps * MB if pod_mbps else None
        rates = [r for r in (self.conn_rate, self.pod_rate) if r]
        # Read size: about 1/4 of the smallest cap's burst, so pacing stays smooth at low rates.
        self.chunk = int(max(4096, min([64 << 10] + [r * burst_s / 4 for r in rates])))
        self.burst_s = burst_s
        self.stats = Stats()
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _bucket(self, rate: float | None) -> Bucket | None:
        return Bucket(rate, max(rate * self.burst_s, self.chunk)) if rate else None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> "PacedRelay":
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, "127.0.0.1", 0, limit=self.chunk))
            self.port = self._server.sockets[0].getsockname()[1]
            # One pair of buckets per relay (the pod's interface), created on the relay's loop.
            self._pod = (self._bucket(self.pod_rate), self._bucket(self.pod_rate))
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=f"paced-relay-{self.name}", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def close(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> "PacedRelay":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def cpu_seconds(self) -> float:
        """CPU time of the relay's thread (it is all the relay's work)."""
        return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))

    # ---------------------------------------------------------------- relaying

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        s = self.stats
        s.connections += 1
        open_now = len(self._tasks)
        s.peak_connections = max(s.peak_connections, open_now)
        try:
            server_r, server_w = await asyncio.open_connection(*self.upstream, limit=self.chunk)
        except OSError:
            client_w.close()
            self._tasks.discard(task)
            return
        conn = {"started": None, "last_down": None, "entry": [0.0, "", 0, 0]}  # its current request
        up = asyncio.ensure_future(self._pump(client_r, server_w, self._bucket(self.conn_rate), self._pod[1],
                                              conn, upward=True))
        try:
            await self._pump(server_r, client_w, self._bucket(self.conn_rate), self._pod[0], conn, upward=False)
        except asyncio.CancelledError:
            pass  # the relay is closing (a top-level task: nobody awaits its result)
        finally:
            up.cancel()
            await asyncio.gather(up, return_exceptions=True)
            self._end_request(conn)
            for w in (client_w, server_w):
                w.close()
            self._tasks.discard(task)

    def _end_request(self, conn: dict) -> None:
        if conn["started"] is not None and conn["last_down"] is not None and conn["last_down"] > conn["started"]:
            self.stats.busy_s += conn["last_down"] - conn["started"]
        conn["started"] = conn["last_down"] = None

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn_bucket: Bucket | None,
                    pod_bucket: Bucket | None, conn: dict, upward: bool) -> None:
        s = self.stats
        try:
            while data := await reader.read(self.chunk):
                now = time.monotonic()
                if upward and (m := REQUEST_LINE.match(data)):
                    self._end_request(conn)  # no pipelining: the previous response is complete
                    conn["started"] = now
                    conn["entry"] = [now, m.group(1).decode(), 0, 0]
                    s.log.append(conn["entry"])
                    s.requests += 1
                    if self.latency:
                        await asyncio.sleep(self.latency)
                for b in (conn_bucket, pod_bucket):
                    if b is not None:
                        await b.take(len(data))
                writer.write(data)
                await writer.drain()
                s.last_byte = time.monotonic()
                if upward:
                    s.bytes_up += len(data)
                    conn["entry"][2] += len(data)
                else:
                    s.bytes_down += len(data)
                    conn["entry"][3] += len(data)
                    conn["last_down"] = s.last_byte
        except OSError:
            pass
        finally:
            if upward:
                writer.close()  # the client went away: so does the server side
