"""A loopback HTTP/1.1 proxy in front of a test's S3 server that loses chosen answers: the request reaches the server
and is applied, but the client's connection is closed before the answer is sent back (what a connection cut on the
way back does). The client (botocore) then retries the request as it was, which is how a conditional PUT the
server applied comes back refused (HTTP 412).

    with LostAnswerProxy(server_url, method="PUT", path_part="locks/run.lease", lose={1}) as proxy:
        ... use proxy.url as the endpoint ...
        proxy.lost  # [(n, request line, server's status)] of the answers lost

Requests are matched by method and a substring of their path, counted from 1 in arrival order; `lose` names the
counts whose answer is lost, `hold` those kept from the server until `release_held()` (a request in flight while
the test changes the store). Bodies are forwarded by Content-Length or chunked encoding; `Expect: 100-continue` is
answered by the proxy itself.
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlparse


class _Stream:
    """Buffered reads of one socket: lines, exact byte counts, an HTTP head, a body."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def _fill(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise EOFError
        self.buf += data

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def head(self) -> tuple[bytes, dict[bytes, bytes], list[bytes]]:
        lines = [self.line()]
        while lines[-1]:
            lines.append(self.line())
        headers = {}
        for line in lines[1:-1]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return lines[0], headers, lines[1:-1]

    def body(self, headers: dict[bytes, bytes]) -> bytes:
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            out = b""
            while True:
                size_line = self.line()
                out += size_line + b"\r\n"
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    while True:  # trailers, then the empty line
                        trailer = self.line()
                        out += trailer + b"\r\n"
                        if not trailer:
                            return out
                out += self.exact(size + 2)
        return self.exact(int(headers.get(b"content-length", b"0")))


class LostAnswerProxy:
    """The proxy (module docstring); a context manager that serves on a free loopback port."""

    def __init__(self, server_url: str, method: str, path_part: str, lose: set[int] = frozenset(),
                 hold: set[int] = frozenset()):
        target = urlparse(server_url)
        self.target = (target.hostname, target.port)
        self.method, self.path_part, self.lose, self.hold = method.encode(), path_part.encode(), set(lose), set(hold)
        self.lost: list[tuple[int, str, str]] = []
        self.held = threading.Event()  # set once a held request has arrived
        self._released = threading.Event()
        self._count, self._lock = 0, threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> "LostAnswerProxy":
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._released.set()
        self._listener.close()

    def release_held(self) -> None:
        """Let the held requests go on to the server."""
        self._released.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.target)
        c, u = _Stream(client), _Stream(upstream)
        try:
            while True:
                request_line, headers, header_lines = c.head()
                method, path = request_line.split(b" ")[:2]
                n = self._number(method, path)
                if headers.get(b"expect", b"").lower() == b"100-continue":
                    header_lines = [h for h in header_lines if not h.lower().startswith(b"expect:")]
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = c.body(headers)
                if n is not None and n in self.hold:
                    self.held.set()
                    self._released.wait()
                upstream.sendall(b"\r\n".join([request_line, *header_lines]) + b"\r\n\r\n" + body)
                status_line, answer_headers, answer_lines = u.head()
                body = b"" if method == b"HEAD" else u.body(answer_headers)
                if n is not None and n in self.lose:
                    self.lost.append((n, request_line.decode(errors="replace"), status_line.decode()))
                    return  # the server applied it; the answer goes nowhere
                client.sendall(b"\r\n".join([status_line, *answer_lines]) + b"\r\n\r\n" + body)
        except (EOFError, OSError):
            pass
        finally:
            client.close()
            upstream.close()

    def _number(self, method: bytes, path: bytes) -> int | None:
        if method != self.method or self.path_part not in path:
            return None
        with self._lock:
            self._count += 1
            return self._count
