"""SGLang's weight endpoints (admin: gateway/api/auth.py): update from disk, from a trainer's torch.distributed
group, the group's life, the version, and pausing generation. The work is in gateway/cluster/weights.py."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Request
from pydantic import Field

from pdserve.gateway.api.per_client import counted
from pdserve.gateway.api.request_body import read_body
from pdserve.gateway.api.state import gateway_state
from pdserve.gateway.errors import ApiError, parse_json_body
from pdserve.gateway.protocol import parse_body
from pdserve.gateway.request_models import LenientModel

router = APIRouter()


class UpdateFromDiskBody(LenientModel):
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    # The prefix cache is always invalidated at a version change (its KV is the old weights'), so
    # flush_cache=false is accepted and changes nothing.
    flush_cache: bool = True
    abort_all_requests: bool = False


class InitGroupBody(LenientModel):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "nccl"


class UpdateFromDistributedBody(LenientModel):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    load_format: str | None = None


class DestroyGroupBody(LenientModel):
    group_name: str = "weight_update_group"


class PauseBody(LenientModel):
    mode: Literal["abort", "in_place", "retract"] = "abort"


# A weights command is a few paths and names: its body has no reason to be large (413 past this).
WEIGHTS_BODY_BYTES = 64 << 10


Body = TypeVar("Body", bound=LenientModel)


async def _body(request: Request, model: type[Body]) -> Body:
    cfg = gateway_state(request).cfg
    raw = await read_body(request, WEIGHTS_BODY_BYTES, cfg.request_body_timeout_s)
    return parse_body(model, parse_json_body(raw) if raw.strip() else {})


@router.post("/update_weights_from_disk")
@counted
async def update_weights_from_disk(request: Request) -> dict[str, Any]:
    b = await _body(request, UpdateFromDiskBody)
    if b.load_format not in (None, "auto", "safetensors", "gguf"):
        raise ApiError(
            400, f"load_format {b.load_format!r} is not supported (auto, safetensors, gguf)", "load_format"
        )
    if not b.model_path.strip():
        raise ApiError(400, "model_path is empty", "model_path")
    updates = gateway_state(request).weights
    return await updates.from_disk(b.model_path, b.load_format, b.weight_version, b.abort_all_requests)


@router.post("/init_weights_update_group")
@counted
async def init_weights_update_group(request: Request) -> dict[str, Any]:
    b = await _body(request, InitGroupBody)
    updates = gateway_state(request).weights
    return await updates.init_group(
        b.master_address, b.master_port, b.rank_offset, b.world_size, b.group_name, b.backend
    )


_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})


@router.post("/update_weights_from_distributed")
@counted
async def update_weights_from_distributed(request: Request) -> dict[str, Any]:
    b = await _body(request, UpdateFromDistributedBody)
    if not b.names or not len(b.names) == len(b.dtypes) == len(b.shapes):
        raise ApiError(400, "names, dtypes and shapes must be non-empty and of the same length", "names")
    for d in b.dtypes:
        if d.removeprefix("torch.") not in _DTYPES:
            raise ApiError(400, f"dtype {d!r} is not one of {', '.join(sorted(_DTYPES))}", "dtypes")
    if any(n < 0 for s in b.shapes for n in s):
        raise ApiError(400, "shapes must be non-negative", "shapes")
    updates = gateway_state(request).weights
    return await updates.from_distributed(
        b.group_name, b.names, b.dtypes, b.shapes, b.weight_version, b.abort_all_requests
    )


@router.post("/destroy_weights_update_group")
@counted
async def destroy_weights_update_group(request: Request) -> dict[str, Any]:
    b = await _body(request, DestroyGroupBody)
    return await gateway_state(request).weights.destroy_group(b.group_name)


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict[str, Any]:
    return {"weight_version": gateway_state(request).weights.version}


@router.post("/pause_generation")
@counted
async def pause_generation(request: Request) -> dict[str, Any]:
    """`abort` (SGLang's default) aborts what is in flight, then pauses; `in_place` keeps every request
    where it is (its next step waits for /continue_generation)."""
    b = await _body(request, PauseBody)
    if b.mode == "retract":
        raise ApiError(400, "mode 'retract' is not supported; use 'in_place' or 'abort'", "mode")
    return await gateway_state(request).weights.pause(abort=b.mode == "abort")


@router.post("/continue_generation")
@counted
async def continue_generation(request: Request) -> dict[str, Any]:
    return await gateway_state(request).weights.resume()
