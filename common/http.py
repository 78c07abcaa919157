"""The one HTTP server of a process (beside its gRPC server): a table of routes, each a
function of the request. A stage server serves `/metrics`; the coordinator adds its
Prometheus service discovery (coordinator/http_server.py).

Plain HTTP, read-only GETs: the figures are the same ones any watcher of a job sees,
and Prometheus scrapes without credentials. Keep the port on the network that the
monitoring lives on.
"""

from __future__ import annotations

import logging
import threading
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger("interleaf.http")


@dataclass(frozen=True)
class Request:
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]


@dataclass(frozen=True)
class Response:
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    status: int = 200


Route = Callable[[Request], Response]


def metrics_route(registry: CollectorRegistry) -> Route:
    """Prometheus's exposition of `registry` (OpenMetrics when the scraper asks for it)."""
    def metrics(request: Request) -> Response:
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(registry), content_type)
    return metrics


class HttpServer:
    """Serves `routes` (path -> route) on bind:port (0: a free port) from a thread of its own."""

    def __init__(self, routes: dict[str, Route], bind: str, port: int):
        self.routes = routes

        class Handler(BaseHTTPRequestHandler):
            def do_GET(handler):  # noqa: N805 - the handler instance, beside the server's self
                url = urllib.parse.urlsplit(handler.path)
                route = self.routes.get(url.path)
                if route is None:
                    response = Response(f"no page {url.path}; there are {', '.join(sorted(self.routes))}\n".encode(),
                                        status=404)
                else:
                    request = Request(url.path, urllib.parse.parse_qs(url.query),
                                      {k.lower(): v for k, v in handler.headers.items()})
                    try:
                        response = route(request)
                    except Exception:  # one bad page must not take the server down
                        # The detail (paths, config values) stays in the log: this port is unauthenticated.
                        log.exception("GET %s", url.path)
                        response = Response(b"internal error; the detail is in the server's log\n", status=500)
                handler.send_response(response.status)
                handler.send_header("Content-Type", response.content_type)
                handler.send_header("Content-Length", str(len(response.body)))
                handler.end_headers()
                handler.wfile.write(response.body)

            def log_message(handler, format, *args):  # noqa: A002, N805 - the base class's names
                log.debug("%s %s", handler.address_string(), format % args)

        self._server = ThreadingHTTPServer((bind, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"http-{self.port}", daemon=True)

    def start(self) -> "HttpServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
