"""A TCP proxy between the S3 client and SeaweedFS that counts bytes and injects faults.

Each request (a client chunk that starts with an HTTP request line) draws one fate from a
seeded RNG: pass through, "drop" (forward the request, then reset the connection after a
random number of response bytes: mid-body, between responses, or before any), "delay" (hold
the response back, sometimes past the client's read timeout), "500" (answer 500
InternalError without forwarding, and close) or "corrupt" (flip one byte of the request
body on its way to the server). A faulted request is always followed by a
healthy one, so every request gets through within two tries while faults keep coming.
`stall_after_up` freezes the parts of multipart uploads (UploadPart requests) once that many
bytes went up, to freeze a build mid-upload before killing it; other requests (commits, small
objects such as a build's journal) still pass, so what the build finished is recorded.
"""

from __future__ import annotations

import random
import re
import socket
import struct
import threading
import time
from collections import Counter

REQUEST_LINE = re.compile(rb"^(GET|PUT|POST|HEAD|DELETE) /")
_BODY = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code><Message>injected</Message></Error>'
ERROR_500 = (
    b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)


class FaultProxy:
    def __init__(self, upstream_port: int, faults: dict[str, float] | None = None, seed: int = 0,
                 delay: tuple[float, float] = (0.2, 1.5), drop_max: int = 128 << 10):
        self.upstream = ("127.0.0.1", upstream_port)
        self.faults = dict(faults or {})  # fate -> probability per connection
        self.rng = random.Random(seed)
        self.delay, self.drop_max = delay, drop_max
        self.bytes_down = 0  # server -> client, all connections
        self.bytes_up = 0  # client -> server
        self.fates: Counter[str] = Counter()
        self.methods: Counter[str] = Counter()  # requests by HTTP method
        self.stall_after_up: int | None = None
        self.lock = threading.Lock()
        self.last_faulted = False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = False
        self.threads: list[threading.Thread] = []

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "FaultProxy":
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.closed = True
        self.listener.close()

    def _fate(self) -> str:
        with self.lock:
            fate = "ok"
            if not self.last_faulted:
                r, acc = self.rng.random(), 0.0
                for name, p in self.faults.items():
                    acc += p
                    if r < acc:
                        fate = name
                        break
            self.last_faulted = fate != "ok"
            self.fates[fate] += 1
            return fate

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        # What the current request's fate asks of the response direction.
        state = {"budget": None, "hold": 0.0, "corrupt": False}
        up = threading.Thread(target=self._pump_up, args=(client, server, state), daemon=True)
        up.start()
        self._pump_down(server, client, state)
        up.join(timeout=5)

    def _pump_up(self, client: socket.socket, server: socket.socket, state: dict) -> None:
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                if m := REQUEST_LINE.match(data):
                    with self.lock:
                        self.methods[m.group(1).decode()] += 1
                    fate = self._fate()
                    if fate == "500":
                        client.sendall(ERROR_500)
                        break
                    state["budget"] = self.rng.randint(0, self.drop_max) if fate == "drop" else None
                    state["hold"] = self.rng.uniform(*self.delay) if fate == "delay" else 0.0
                    state["corrupt"] = fate == "corrupt"
                    state["part"] = b"partNumber=" in data.split(b"\r\n", 1)[0]
                if state["corrupt"]:
                    flipped = _flip_body_byte(data)
                    state["corrupt"] = flipped is None  # no body byte yet: flip a later one
                    data = flipped or data
                while (self.stall_after_up is not None and state.get("part") and not self.closed
                       and self.bytes_up + len(data) > self.stall_after_up):
                    time.sleep(0.05)  # frozen until the test kills the client (or closes the proxy)
                with self.lock:
                    self.bytes_up += len(data)
                server.sendall(data)
        except OSError:
            pass
        finally:
            _close(server)
            _close(client)

    def _pump_down(self, server: socket.socket, client: socket.socket, state: dict) -> None:
        try:
            while True:
                data = server.recv(65536)
                if not data:
                    break
                if state["hold"]:
                    time.sleep(state["hold"])
                    state["hold"] = 0.0
                budget = state["budget"]
                if budget is not None and len(data) >= budget:
                    self._send_down(client, data[:budget])
                    _reset(client)
                    return
                if budget is not None:
                    state["budget"] = budget - len(data)
                self._send_down(client, data)
        except OSError:
            pass
        finally:
            _close(client)
            _close(server)

    def _send_down(self, client: socket.socket, data: bytes) -> None:
        with self.lock:
            self.bytes_down += len(data)
        client.sendall(data)


def _flip_body_byte(data: bytes) -> bytes | None:
    """`data` with its last body byte flipped (a chunk that starts with a request line has its
    headers first); None when the chunk holds no body byte: flip in a later one."""
    body_at = data.find(b"\r\n\r\n") + 4 if REQUEST_LINE.match(data) else 0
    if len(data) <= body_at:
        return None
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


def _reset(s: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): what a dropped connection looks like to the client."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    s.close()
