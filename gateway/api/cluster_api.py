"""The cluster's own endpoints: /health, /workers, a worker's role (`POST /workers/{id}/role`),
/flush_cache, and /metrics (`metrics_router`, served with --enable-metrics)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from pdserve.gateway.api.per_client import counted
from pdserve.gateway.api.request_body import read_body
from pdserve.gateway.api.state import gateway_state
from pdserve.gateway.cluster.role_switch import Switch, SwitchRefused
from pdserve.gateway.cluster.workers import WorkerInfo
from pdserve.gateway.errors import ApiError, error_body, parse_json_body
from pdserve.gateway.observe.metrics import CONTENT_TYPE
from pdserve.gateway.protocol import parse_body
from pdserve.gateway.request_models import LenientModel
from pdserve.protocol.gateway import Role

router = APIRouter()
metrics_router = APIRouter()

_ROLES: tuple[Role, ...] = ("prefill", "decode")


@router.get("/health")
async def health(request: Request) -> Response:
    registry = gateway_state(request).registry
    if registry.healthy():
        return Response(status_code=200)
    missing = [r for r in _ROLES if not registry.in_rotation(r)]
    return JSONResponse(error_body(503, f"no {' and no '.join(missing)} worker in rotation"), status_code=503)


@router.post("/flush_cache")
@router.get("/flush_cache", operation_id="flush_cache_get")  # one OpenAPI operation id per method
@counted
async def flush_cache(request: Request) -> Response:
    """SGLang's endpoint: empty every worker's prefix cache; refused (400, naming the workers)
    where requests are in flight."""
    refused = await gateway_state(request).control.flush_caches()
    if refused:
        msg = "; ".join(f"{wid}: {why}" for wid, why in refused.items())
        return JSONResponse(error_body(400, f"cache not flushed on: {msg}"), status_code=400)
    return Response("Cache flushed.\n", status_code=200)


@router.get("/workers")
async def workers(request: Request, include_down: bool = Query(False, alias="all")) -> dict[str, Any]:
    """Registered workers (healthy or draining); `?all=1` adds those lost recently (down)."""
    registry = gateway_state(request).registry
    listed = registry.all() + (registry.down(time.monotonic()) if include_down else [])
    switches = gateway_state(request).control.switches.pending
    return {"workers": [_worker(w, switches.get(w.worker_id)) for w in listed]}


class RoleBody(LenientModel):
    role: Role


@router.post("/workers/{worker_id}/role", status_code=202)
@counted
async def switch_role(worker_id: str, request: Request) -> dict[str, Any]:
    """Move a worker to the other role in place (gateway/cluster/role_switch.py): 202 once it is draining;
    404 for an unknown worker; 409 during another switch, for the role it has, or for the last worker
    of its role. `GET /workers` shows the switch until the worker registers in its new role."""
    state = gateway_state(request)
    raw = await read_body(request, 4096, state.cfg.request_body_timeout_s)
    body = parse_body(RoleBody, parse_json_body(raw) if raw.strip() else {})
    try:
        s = state.control.switch_role(worker_id, body.role)
    except SwitchRefused as e:
        raise ApiError(e.status, e.message, "role" if e.status == 409 else None) from None
    return {"worker_id": worker_id, "state": "switching"} | s.view()


def _worker(w: WorkerInfo, switch: Switch | None = None) -> dict[str, Any]:
    return {
        "worker_id": w.worker_id,
        "role": w.role,
        "state": "switching" if switch is not None else w.state,
        "epoch": w.reg.epoch,
        "switch": switch.view() if switch is not None else None,
        "restarts": w.restarts,
        "registered_at": w.registered_at,
        "draining": w.draining,
        "suspect": w.suspect,  # why the canaries took it out of rotation (gateway/autopilot/canary.py), or None
        "weight_version": w.weight_version,
        "bootstrap_addr": w.reg.bootstrap_addr,
        "clock_offset_s": w.clock.offset,
        "queued": w.queued,
        "running": w.running,
        "free_tokens": w.free_tokens,
        "max_total_tokens": w.reg.max_total_tokens,
        "tp_size": w.reg.tp_size,
        "inflight_requests": w.inflight_requests,
        # Prefill: pages its prefix cache holds, as the gateway's index knows them.
        "cached_blocks": len(w.prefix.blocks),
    }


@metrics_router.get("/metrics")
async def metrics_endpoint(request: Request) -> Response:
    return Response(gateway_state(request).metrics.render(), media_type=CONTENT_TYPE)
