"""SGLang's server endpoints besides /generate: /health_generate, /get_server_info (/server_info),
/get_model_info and /abort_request. (/flush_cache lives with the cluster's endpoints, in cluster_api.py.)"""

from __future__ import annotations

import asyncio
import time
import uuid
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import field_validator

from pdserve.gateway.api.per_client import counted
from pdserve.gateway.api.request_body import read_body
from pdserve.gateway.api.serving import collect
from pdserve.gateway.api.state import GatewayState, gateway_state
from pdserve.gateway.config import public_config
from pdserve.gateway.errors import ApiError, error_body, parse_json_body
from pdserve.gateway.generation.generation import GenInput
from pdserve.gateway.protocol import parse_body
from pdserve.gateway.request_models import LenientModel, check_rid
from pdserve.sampling_params import SamplingParams

router = APIRouter()

# /health_generate gives up after this long (SGLang's default health check timeout).
HEALTH_GENERATE_TIMEOUT_S = 20.0


# /abort_request's body: a rid and a few flags.
ABORT_BODY_BYTES = 64 << 10


class AbortBody(LenientModel):
    rid: str = ""
    _rid = field_validator("rid")(check_rid)
    abort_all: bool = False
    abort_message: str | None = None
    finished_reason: dict[str, Any] | None = None


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Two greedy tokens through a prefill and a decode worker (the first may come from the prefill alone,
    the second comes from the decode): 200 when they come back in time, else 503."""
    gw = gateway_state(request)
    tok = gw.tokenizer
    prompt = tok.encode("Hi") or [tok.eos_token_id or 0]
    inp = GenInput(
        rid=f"health-generate-{uuid.uuid4().hex[:8]}",
        input_ids=prompt,
        sampling=SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True),
        max_new_tokens_given=True,
        received_ts=time.time(),
    )
    try:
        [inp] = gw.generations.prepare([inp], "text")
        await asyncio.wait_for(collect(gw.generations, inp), HEALTH_GENERATE_TIMEOUT_S)
    except ApiError as e:
        return JSONResponse(error_body(503, f"health generation failed: {e.message}"), status_code=503)
    except TimeoutError:
        msg = f"health generation did not finish within {HEALTH_GENERATE_TIMEOUT_S:g} s"
        return JSONResponse(error_body(503, msg), status_code=503)
    return Response(status_code=200)


def _version() -> str | None:
    try:
        return version("pdserve")
    except PackageNotFoundError:
        return None


def _architecture(gw: GatewayState) -> str | None:
    for w in gw.registry.all():
        arch = w.reg.fingerprint.get("architecture")
        if arch:
            return str(arch)
    return None


@router.get("/get_model_info")
async def model_info(request: Request) -> dict[str, Any]:
    gw = gateway_state(request)
    arch = _architecture(gw)
    return {
        "model_path": gw.cfg.model_path or gw.model_name,
        "tokenizer_path": gw.cfg.model_path or gw.model_name,
        "served_model_name": gw.model_name,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": gw.weights.version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": arch,
        "architectures": [arch] if arch else None,
    }


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request) -> dict[str, Any]:
    """The gateway's settings (SGLang's server args where they exist, secrets left out) and each
    worker's state."""
    gw = gateway_state(request)
    limits = gw.registry.limits()
    decodes = gw.registry.in_rotation("decode")
    return {
        **public_config(gw.cfg),
        "served_model_name": gw.model_name,
        "tokenizer_path": gw.cfg.model_path or gw.model_name,
        "version": _version(),
        "disaggregation_mode": "gateway",
        "context_length": limits.context_length if limits else None,
        "max_total_num_tokens": sum(w.reg.max_total_tokens for w in decodes) or None,
        "internal_states": [
            {
                "worker_id": w.worker_id,
                "role": w.role,
                "state": w.state,
                "queued": w.queued,
                "running": w.running,
                "free_tokens": w.free_tokens,
                "max_total_num_tokens": w.reg.max_total_tokens,
                "avg_spec_accept_length": w.avg_spec_accept_length,
            }
            for w in gw.registry.all()
        ],
    }


@router.post("/abort_request")
@counted
async def abort_request(request: Request) -> Response:
    """Abort request `rid` (its n samples too), or every request with `abort_all`; their clients get an
    error (a streamed one ends with an `abort` finish reason)."""
    gw = gateway_state(request)
    raw = await read_body(request, ABORT_BODY_BYTES, gw.cfg.request_body_timeout_s)
    body = parse_body(AbortBody, parse_json_body(raw))
    if not body.abort_all and not body.rid:
        raise ApiError(400, "give rid or abort_all", "rid")
    hit = gw.control.abort_rids(None if body.abort_all else body.rid)
    return JSONResponse({"aborted": hit})
