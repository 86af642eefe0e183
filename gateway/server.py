"""The gateway process: FastAPI app (HTTP) + control plane (zmq), one asyncio loop.

`create_app(cfg)` builds everything in-process (tests drive it with an ASGI client); its lifespan
starts and stops the control plane. `run(cfg)` serves it with uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from pdserve.gateway.api import (
    anthropic_api,
    cluster_api,
    dashboard,
    native_api,
    openai_api,
    responses_api,
    sglang_api,
    tokenize_api,
    weights_api,
)
from pdserve.gateway.api.auth import ApiKeyMiddleware, ApiKeys
from pdserve.gateway.api.connections import IdleTimeoutProtocol, raise_open_files_limit
from pdserve.gateway.api.dashboard import RecentRequests
from pdserve.gateway.api.openapi import install_openapi
from pdserve.gateway.api.serving import Admission
from pdserve.gateway.api.state import GatewayState
from pdserve.gateway.autopilot.canary import CANARY_PROMPT, Canaries
from pdserve.gateway.autopilot.elastic import ElasticController
from pdserve.gateway.cluster.control import ControlPlane
from pdserve.gateway.cluster.weights import WeightUpdates
from pdserve.gateway.cluster.workers import RoutingPolicy, WorkerRegistry
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.errors import install_error_handlers
from pdserve.gateway.generation.generation import Generations
from pdserve.gateway.generation.tracing import Tracing
from pdserve.gateway.observe.metrics import GatewayMetrics
from pdserve.gateway.text.structured import Constraints
from pdserve.gateway.text.tokenizer import Tokenizer
from pdserve.model_source import model_name
from pdserve.port_file import write_port_file

log = logging.getLogger(__name__)


def _gateway_state(cfg: GatewayConfig, tok: Tokenizer) -> GatewayState:
    """The gateway's parts, wired together (nothing started yet)."""
    registry = WorkerRegistry(
        RoutingPolicy(
            prefill=cfg.prefill_policy,
            decode=cfg.decode_policy,
            cache_weight=cfg.cache_weight,
            load_weight=cfg.load_weight,
            min_prefill_tokens=cfg.disaggregation_min_prefill_tokens,
            max_prefill_queue=cfg.disaggregation_max_prefill_queue,
        )
    )
    metrics = GatewayMetrics()
    control = ControlPlane(cfg, registry, metrics)
    recent = RecentRequests(cfg.dashboard_requests)
    tracing = (
        Tracing(cfg.otlp_traces_endpoint, cfg.otlp_traces_protocol, model_name(cfg.model_path))
        if cfg.enable_trace
        else None
    )
    elastic = (
        ElasticController(
            cfg.elastic,
            registry,
            lambda: recent,
            control.switch_role,
            lambda: bool(control.switches.pending),
        )
        if cfg.elastic is not None
        else None
    )
    canaries = (
        Canaries(
            cfg.canary_interval_s,
            # Its own Generations and metrics: canaries never count in the user's metrics or dashboard.
            Generations(cfg, tok, registry, control, GatewayMetrics()),
            registry,
            metrics,
            tok.encode(CANARY_PROMPT),
        )
        if cfg.canary_interval_s > 0
        else None
    )
    return GatewayState(
        cfg=cfg,
        tokenizer=tok,
        registry=registry,
        control=control,
        metrics=metrics,
        generations=Generations(cfg, tok, registry, control, metrics, tracing, recent.add),
        admission=Admission(
            cfg.max_pending_generations, cfg.max_requests_per_client, metrics, cfg.max_inflight_body_bytes
        ),
        started=int(time.time()),
        model_name=cfg.served_model_name or model_name(cfg.model_path),
        constraints=Constraints(cfg.grammar_backend, tok, cfg.grammar_compile_timeout_s),
        recent=recent,
        tracing=tracing,
        weights=WeightUpdates(control, registry),
        elastic=elastic,
        canaries=canaries,
    )


def create_app(cfg: GatewayConfig, tokenizer: Tokenizer | None = None) -> FastAPI:
    """Build the gateway app; pass `tokenizer` to reuse one already loaded."""
    gw = _gateway_state(cfg, tokenizer or Tokenizer.load(cfg.model_path))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gw.control.start()
        elastic = asyncio.create_task(gw.elastic.run(), name="elastic") if gw.elastic is not None else None
        canaries = (
            asyncio.create_task(gw.canaries.run(), name="canaries") if gw.canaries is not None else None
        )
        if cfg.port_file:
            write_port_file(cfg.port_file, {"port": cfg.port, "control_port": gw.control.bound_port or 0})
        try:
            yield
        finally:
            for task in (elastic, canaries):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await gw.control.stop()
            gw.constraints.close()
            if gw.tracing is not None:
                gw.tracing.shutdown()  # what is queued is exported

    app = FastAPI(title="pdserve gateway", lifespan=lifespan)
    app.state.gw = gw
    keys = ApiKeys(cfg.api_key, cfg.admin_api_key, cfg.protect_health, cfg.protect_metrics)
    app.add_middleware(ApiKeyMiddleware, keys=keys)
    install_error_handlers(app)
    install_openapi(app)
    app.include_router(native_api.router)
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(tokenize_api.router)
    app.include_router(sglang_api.router)
    app.include_router(dashboard.router)
    app.include_router(weights_api.router)
    app.include_router(cluster_api.router)
    if cfg.enable_metrics:
        app.include_router(cluster_api.metrics_router)
    return app


def run(cfg: GatewayConfig) -> None:
    """Serve until interrupted."""
    import uvicorn

    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Bound here rather than by uvicorn, so that with --port 0 the port is known before the app
    # starts (the port file names it) and nobody can take it in between.
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.create_server((cfg.host, cfg.port), family=family, backlog=2048)
    cfg = dataclasses.replace(cfg, port=sock.getsockname()[1])
    log.info("open-files limit %d (one per connection)", raise_open_files_limit())
    app = create_app(cfg)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=cfg.log_level,
            http=IdleTimeoutProtocol,
            # Annotated int by uvicorn, which hands it to loop.call_later: a float is kept as it is.
            timeout_keep_alive=cfg.idle_timeout_s,  # type: ignore[arg-type]
        )
    )
    server.run(sockets=[sock])


if __name__ == "__main__":
    import argparse

    from pdserve.gateway.config import add_cli_args, config_from_args

    parser = argparse.ArgumentParser("pdserve gateway")
    add_cli_args(parser)
    run(config_from_args(parser.parse_args()))
