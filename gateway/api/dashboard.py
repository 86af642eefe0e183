"""The timeline page: `/dashboard` (static HTML + JavaScript from the package, nothing fetched from
elsewhere) and `/dashboard/data`, the JSON it polls: the workers with their state, load, KV pool use
and cache hit rate, and the recent finished requests with their phases and spans on the gateway's
clock (request_trace.py). Neither shows prompt or output text; both need the admin key when one is
set (auth.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from pdserve.gateway.api.state import gateway_state
from pdserve.gateway.cluster.workers import WorkerInfo, WorkerRegistry
from pdserve.gateway.generation.request_trace import PHASES, RequestTrace

log = logging.getLogger(__name__)

router = APIRouter()


class RecentRequests:
    """The last `maxlen` finished requests (a bounded ring)."""

    def __init__(self, maxlen: int) -> None:
        self._ring: deque[RequestTrace] = deque(maxlen=max(1, maxlen))

    def add(self, t: RequestTrace) -> None:
        self._ring.append(t)

    def __iter__(self) -> Any:
        return iter(list(self._ring))

    def __len__(self) -> int:
        return len(self._ring)


def _worker_json(w: WorkerInfo, hits: dict[str, list[int]]) -> dict[str, Any]:
    total = w.reg.max_total_tokens
    cached, prompt = hits.get(w.worker_id, [0, 0])
    return {
        "worker_id": w.worker_id,
        "role": w.role,
        "state": w.state,
        "queued": w.queued,
        "running": w.running,
        "inflight_requests": w.inflight_requests,
        "pool_used": (total - w.free_tokens) / total if total > 0 else 0.0,
        "max_total_tokens": total,
        "clock_offset_s": w.clock.offset,
        # Over the recent requests whose prompt this worker computed: prompt tokens found in its cache.
        "cache_hit_rate": cached / prompt if prompt > 0 else None,
    }


def dashboard_data(
    registry: WorkerRegistry, recent: RecentRequests, elastic: dict[str, Any] | None = None
) -> dict[str, Any]:
    reqs = list(recent)
    hits: dict[str, list[int]] = {}
    for t in reqs:
        h = hits.setdefault(t.prefill_worker or t.decode_worker, [0, 0])
        h[0] += t.cached_tokens
        h[1] += t.prompt_tokens
    workers = registry.all() + registry.down(time.monotonic())
    return {
        "now": time.time(),
        "phases": list(PHASES),
        "workers": [_worker_json(w, hits) for w in workers],
        "requests": [t.to_json() for t in reversed(reqs)],  # newest first
        "elastic": elastic,  # the controller's signals and decisions (--elastic), else null
    }


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page() -> HTMLResponse:
    html = resources.files("pdserve.gateway.api").joinpath("static/dashboard.html").read_text("utf-8")
    return HTMLResponse(html, headers={"Cache-Control": "no-cache"})


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def encode_dashboard_data(data: dict[str, Any]) -> bytes:
    """`data` as JSON, each request on its own: one that cannot be encoded (text that is not UTF-8, a
    value that is not a number) is left out with a warning, and the page still gets the rest."""
    requests = []
    for t in data["requests"]:
        try:
            requests.append(_encode(t))
        except (ValueError, TypeError) as e:  # UnicodeEncodeError is a ValueError
            log.warning("dashboard: left out request %r: %s", str(t.get("rid", "?"))[:64], type(e).__name__)
    head = _encode({k: v for k, v in data.items() if k != "requests"})
    return head[:-1] + b',"requests":[' + b",".join(requests) + b"]}"


@router.get("/dashboard/data", include_in_schema=False)
async def dashboard_json(request: Request) -> Response:
    gw = gateway_state(request)
    elastic = gw.elastic.view() if gw.elastic is not None else None
    data = encode_dashboard_data(dashboard_data(gw.registry, gw.recent, elastic))
    return Response(data, media_type="application/json")
