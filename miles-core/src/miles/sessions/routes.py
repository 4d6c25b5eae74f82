"""The HTTP routes of the session server (see :mod:`miles.sessions.server` for the API)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from miles.sessions.schema import RequestError, error_body
from miles.sessions.session import SessionSampling

if TYPE_CHECKING:
    from miles.sessions.service import SessionService

__all__ = ["add_routes", "create_app", "error_response", "json_body"]


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    override: bool = False


class _Create(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metadata: dict[str, Any] = Field(default_factory=dict)
    routing_key: str | None = None
    sampling: _Sampling | None = None


def create_app(server: SessionService) -> FastAPI:
    """The FastAPI application of ``server``."""
    app = FastAPI(title="miles sessions")
    add_routes(app, server)
    return app


async def json_body(request: HTTPRequest, *, optional: bool = False) -> Any:
    raw = await request.body()
    if not raw.strip():
        if optional:
            return {}
        raise RequestError("the request body is empty (expected a JSON object)", param="body")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"malformed JSON body: {exc}", param="body") from None


def error_response(exc: RequestError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status)


def _create_request(body: Any) -> _Create:
    try:
        return _Create.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise RequestError(f"{where}: {err['msg']}", param=where) from None


def add_routes(app: FastAPI, server: SessionService) -> None:
    """The session API's routes on ``app`` (see :mod:`miles.sessions.server`)."""

    @app.exception_handler(RequestError)
    async def _request_error(request: HTTPRequest, exc: RequestError) -> JSONResponse:
        return error_response(exc)

    @app.get("/health")
    async def health() -> Response:
        # 503 while the server starts (the live check runs on the engines before sessions are served)
        return Response(status_code=200 if server.ready else 503)

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return server.info()

    @app.post("/sessions")
    async def create(request: HTTPRequest) -> dict[str, Any]:
        body = _create_request(await json_body(request, optional=True))
        sampling = SessionSampling(**body.sampling.model_dump()) if body.sampling is not None else None
        session = server.create_session(sampling=sampling, routing_key=body.routing_key, metadata=body.metadata)
        return {"id": session.id}

    @app.get("/sessions/{session_id}")
    async def describe(session_id: str) -> dict[str, Any]:
        session = server.get(session_id)
        return {
            "id": session.id,
            "turns": len(session.turns),
            "trajectories": len(session.leaves()),
            "branches": session.branches,
            "append_only_violations": session.violations,
            "metadata": session.metadata,
        }

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def chat(session_id: str, request: HTTPRequest) -> dict[str, Any]:
        server.get(session_id)
        return await server.chat(session_id, await json_body(request))

    @app.get("/sessions/{session_id}/v1/models")
    async def models(session_id: str) -> dict[str, Any]:
        server.get(session_id)
        return {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "miles"}]}

    @app.get("/sessions/{session_id}/samples")
    async def samples(session_id: str) -> list[dict[str, Any]]:
        return [s.to_dict() for s in server.get(session_id).samples()]

    @app.delete("/sessions/{session_id}")
    async def delete(session_id: str) -> dict[str, Any]:
        server.delete(session_id)
        return {"id": session_id, "deleted": True}
