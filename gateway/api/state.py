"""What every handler reaches: the gateway's parts, held by the app (`gateway_state(request)`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from fastapi import Request

from pdserve.gateway.api.responses_store import ResponseStore

if TYPE_CHECKING:
    from pdserve.gateway.api.dashboard import RecentRequests
    from pdserve.gateway.api.serving import Admission
    from pdserve.gateway.autopilot.canary import Canaries
    from pdserve.gateway.autopilot.elastic import ElasticController
    from pdserve.gateway.cluster.control import ControlPlane
    from pdserve.gateway.cluster.weights import WeightUpdates
    from pdserve.gateway.cluster.workers import WorkerRegistry
    from pdserve.gateway.config import GatewayConfig
    from pdserve.gateway.generation.generation import Generations
    from pdserve.gateway.generation.tracing import Tracing
    from pdserve.gateway.observe.metrics import GatewayMetrics
    from pdserve.gateway.text.structured import Constraints
    from pdserve.gateway.text.tokenizer import Tokenizer


@dataclass
class GatewayState:
    """Everything the handlers reach through `gateway_state(request)`; built by `server.create_app`."""

    cfg: GatewayConfig
    tokenizer: Tokenizer
    registry: WorkerRegistry
    control: ControlPlane
    metrics: GatewayMetrics
    generations: Generations
    admission: Admission
    started: int
    model_name: str  # what clients send as `model` (--served-model-name, else the model's own name)
    constraints: Constraints  # structured output: validates json_schema / regex / ebnf
    recent: RecentRequests  # finished requests, for /dashboard
    tracing: Tracing | None  # OpenTelemetry export (--enable-trace)
    weights: WeightUpdates  # live weight updates over every worker
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses with `store`
    elastic: ElasticController | None = None  # --elastic
    canaries: Canaries | None = None  # --canary-interval


def gateway_state(request: Request) -> GatewayState:
    """The state of the gateway app that `request` came to."""
    return cast(GatewayState, request.app.state.gw)
