"""An ASGI app served on a local socket from a thread of this process: the gateway and the dashboard use it.

The socket is bound before the server starts (`bind`), so port 0 yields the real port at once and a URL can be
handed out (to an agent's environment, to a log line) before anything serves it. `ThreadedServer` runs uvicorn
on that socket in a daemon thread, with the header timeout and connection cap of `guard.guarded_protocol`.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from lightning_sdk.errors import ServerError
from lightning_sdk.gateway.guard import connection_cap, guarded_protocol


def bind(host: str, port: int) -> socket.socket:
    """The listening socket on host:port (0: any free port), bound now; OSError if it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP (accepted ones inherit it);
    # without it a keep-alive connection's reply waits for the client's delayed ACK (~40 ms a request).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    """The URL this machine reaches the socket at (a wildcard address is reached through loopback)."""
    host, port = sock.getsockname()[:2]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ThreadedServer:
    """`app` served by uvicorn on `sock` in a daemon thread; `start()` returns once it accepts connections."""

    def __init__(self, app: Any, sock: socket.socket, *, name: str, max_connections: int = 2048):
        self.app, self.sock, self.name, self.max_connections = app, sock, name, max_connections
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 30) -> None:
        import uvicorn

        protocol = guarded_protocol(max_connections=connection_cap(self.max_connections))
        # A caller's X-Forwarded-For is not trusted (uvicorn trusts it from 127.0.0.1): request.client stays the
        # socket's peer, and the headers are not parsed on every call.
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False,
                                                     lifespan="off", http=protocol, proxy_headers=False,
                                                     server_header=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]}, name=self.name,
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._server.started:
                return
            if not self._thread.is_alive():
                break
            time.sleep(0.02)
        raise ServerError(f"{self.name} on {url_of(self.sock)} did not start within {timeout:.0f}s")

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None
