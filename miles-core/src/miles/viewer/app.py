"""The viewer's HTTP app: one page and three JSON routes over a :class:`~miles.viewer.data.RunData`."""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse

from miles.viewer.data import RunData

__all__ = ["create_app"]


def create_app(data: RunData) -> FastAPI:
    """``GET /`` the page; ``/api/run`` the steps and curves; ``/api/steps/{step}`` one step's samples."""
    app = FastAPI(title="miles view", docs_url=None, redoc_url=None, openapi_url=None)
    page = files("miles.viewer").joinpath("page.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        return page

    @app.get("/api/run")
    async def run() -> dict[str, Any]:
        return data.summary()

    @app.get("/api/steps/{step}")
    async def step(step: int) -> dict[str, Any]:
        try:
            return data.step(step)
        except FileNotFoundError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from None

    return app
