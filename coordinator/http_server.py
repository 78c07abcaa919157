"""The coordinator's HTTP port (--http-port): its route table.

- `/metrics`: the coordinator's Prometheus metrics (coordinator/metrics.py);
- `/sd`: Prometheus HTTP service discovery
  (https://prometheus.io/docs/prometheus/latest/http_sd/): one target group per
  registered stage server that is heartbeating (a DEAD one is left out: scraping it
  would fail), its metrics endpoint (the host of its gRPC address, the metrics port it
  registered with) labelled with its id, gRPC address, host and device, so one scrape
  job (`http_sd_configs`) finds every server, however many come and go;
- `/` and `/status.json`: the status page (coordinator/status_page.py).
"""

from __future__ import annotations

import json
from typing import Callable

from interleaf.coordinator import status_page
from interleaf.coordinator.metrics import CoordinatorMetrics
from interleaf.coordinator.registry import Registry
from interleaf.common.http import HttpServer, Request, Response, Route, metrics_route


def service_discovery(servers: Registry) -> list[dict]:
    groups = []
    for entry in servers.servers():
        if not entry.metrics_port or entry.state == "DEAD":
            continue
        host = entry.address.rsplit(":", 1)[0]
        groups.append({"targets": [f"{host}:{entry.metrics_port}"],
                       "labels": {"server_id": entry.server_id, "server_address": entry.address,
                                  "server_host": entry.host, "device": entry.device}})
    return groups


def routes(metrics: CoordinatorMetrics, servers: Registry, address: str = "",
           draw_trace: Callable | None = None) -> dict[str, Route]:
    expose = metrics_route(metrics.registry)

    def scrape(request: Request) -> Response:
        metrics.update()
        return expose(request)

    def discover(request: Request) -> Response:
        return Response(json.dumps(service_discovery(servers)).encode(), "application/json")

    return {"/metrics": scrape, "/sd": discover,
            **status_page.routes(servers, metrics.jobs, address, draw_trace)}


def serve_http(metrics: CoordinatorMetrics, servers: Registry, bind: str, port: int, address: str = "",
               draw_trace: Callable | None = None) -> HttpServer:
    """`address`: the coordinator's gRPC address, for the page's title; `draw_trace`:
    draws a traced step as a matplotlib Figure, for the page's timeline."""
    return HttpServer(routes(metrics, servers, address, draw_trace), bind, port).start()
