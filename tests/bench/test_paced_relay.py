"""The paced relay paces: first bytes wait for the latency, a connection stays under its cap,
and the relay's aggregate cap holds across connections. A small HTTP/1.1 server on
127.0.0.1 stands for the object store; sizes and latencies are small, so each test takes
about a second. Bounds that pacing guarantees are strict; "it is not just slow" bounds are loose
(the machine may be loaded)."""

from __future__ import annotations

import http.client
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from .conftest import load_bench_module

PacedRelay = load_bench_module("paced_relay").PacedRelay
MB = 1e6


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: several requests on one connection

    def do_GET(self):  # GET /N answers N bytes
        n = int(self.path.strip("/"))
        self.send_response(200)
        self.send_header("Content-Length", str(n))
        self.end_headers()
        self.wfile.write(b"x" * n)

    def do_PUT(self):  # reads the body, answers its length
        got = len(self.rfile.read(int(self.headers["Content-Length"])))
        body = str(got).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def upstream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def get(relay: PacedRelay, n: int, conn: http.client.HTTPConnection | None = None) -> tuple[float, float, int]:
    """(seconds to the response's first byte, seconds to its last, bytes) of GET /n."""
    conn = conn or http.client.HTTPConnection("127.0.0.1", relay.port)
    t0 = time.perf_counter()
    conn.request("GET", f"/{n}")
    resp = conn.getresponse()  # returns once the status line and headers are in
    first = time.perf_counter() - t0
    body = resp.read()
    return first, time.perf_counter() - t0, len(body)


def test_binds_loopback_only(upstream):
    with PacedRelay(upstream) as relay:
        assert relay._server.sockets[0].getsockname()[0] == "127.0.0.1"
        assert get(relay, 10)[2] == 10


def test_first_byte_waits_for_the_latency_on_every_request(upstream):
    with PacedRelay(upstream, latency=0.15) as relay:
        conn = http.client.HTTPConnection("127.0.0.1", relay.port)
        firsts = [get(relay, 1000, conn)[0] for _ in range(3)]  # one keep-alive connection
        assert relay.stats.connections == 1 and relay.stats.requests == 3
    assert min(firsts) >= 0.15, firsts
    assert max(firsts) < 1.0, firsts  # the latency, not something else (loose: a loaded machine)


def test_a_connection_stays_under_its_cap_both_ways(upstream):
    cap, n = 4, 2_000_000  # MB/s, bytes: half a second
    with PacedRelay(upstream, conn_mbps=cap) as relay:
        _, seconds, got = get(relay, n)
        burst = relay.chunk + cap * MB * relay.burst_s  # what a bucket may send ahead of its rate
        conn = http.client.HTTPConnection("127.0.0.1", relay.port)
        t0 = time.perf_counter()
        conn.request("PUT", "/up", body=b"y" * n)
        assert conn.getresponse().read() == str(n).encode()
        up_seconds = time.perf_counter() - t0
    assert got == n
    for s in (seconds, up_seconds):
        assert s >= (n - burst) / (cap * MB), s  # never faster than the cap
        assert n / s > 0.3 * cap * MB, s  # and it is the cap that sets the pace, roughly


def test_the_relays_aggregate_cap_holds_over_several_connections(upstream):
    conn_cap, pod_cap, n, k = 4, 4, 1_000_000, 4  # 4 connections that could do 16 MB/s together
    with PacedRelay(upstream, conn_mbps=conn_cap, pod_mbps=pod_cap) as relay:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(k) as pool:
            results = list(pool.map(lambda _: get(relay, n), range(k)))
        seconds = time.perf_counter() - t0
        burst = relay.chunk + pod_cap * MB * relay.burst_s
        assert relay.stats.peak_connections == k
        assert relay.stats.bytes_down >= k * n
    assert seconds >= (k * n - burst) / (pod_cap * MB), seconds  # the interface cap, not 4 x the connection's
    assert k * n / seconds > 0.3 * pod_cap * MB, seconds
    # The aggregate is shared: every connection got well under its own cap, none was starved.
    rates = [n / r[1] for r in results]
    assert max(rates) < 0.75 * conn_cap * MB, rates
    assert min(rates) > 0.1 * conn_cap * MB, rates


def test_counts_what_an_interface_carries(upstream):
    with PacedRelay(upstream, latency=0.01) as relay:
        conn = http.client.HTTPConnection("127.0.0.1", relay.port)
        get(relay, 5000, conn)
        conn.request("PUT", "/x", body=b"z" * 3000)
        conn.getresponse().read()
        conn.close()
        time.sleep(0.05)
        s = relay.stats
        assert s.methods() == {"GET": 1, "PUT": 1}
        assert s.bytes_down > 5000 and s.bytes_up > 3000  # bodies plus HTTP headers
        assert [e[1] for e in s.log] == ["GET", "PUT"] and s.log[0][3] > 5000 and s.log[1][2] > 3000
        assert s.busy_s >= 2 * 0.01  # each request was in flight at least its latency
        assert relay.cpu_seconds() > 0
