"""The HTTP server of an OpenAI-compatible app (``reflow.serving.openai_api``): uvicorn on a thread of its own,
bound to loopback unless told otherwise, each run with its own API key.

    server = EndpointServer(app, host="127.0.0.1", port=0)   # port 0: a free one
    base_url = server.start()                                # "http://127.0.0.1:PORT/v1", once it listens
    server.stop()
"""

from __future__ import annotations

import secrets
import threading
import time

import uvicorn


def new_api_key() -> str:
    """A key for one run: 32 random bytes, URL-safe."""
    return secrets.token_urlsafe(32)


def uvicorn_config(app, host: str, port: int) -> uvicorn.Config:
    # (a stop waits at most 5 s for open connections: a client that never reads does not hold the process; no
    # proxy headers: nothing sits in front of this server, and their check parsed the client's address per call)
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                          timeout_graceful_shutdown=5, proxy_headers=False)


class EndpointServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self.server = uvicorn.Server(uvicorn_config(app, host, port))
        # (uvicorn leaves signals alone off the main thread: the process keeps its own handlers)
        self.thread = threading.Thread(target=self.server.run, name="reflow-endpoint", daemon=True)
        self.port: int | None = None

    def start(self, timeout_s: float = 30.0) -> str:
        """Start serving; returns the API's base URL once the socket listens."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the endpoint did not start on {self.host} (is the port taken?)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the endpoint did not start on {self.host} within {timeout_s:.0f}s")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host  # (an IPv6 address goes in brackets)
        return f"http://{host}:{self.port}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()
