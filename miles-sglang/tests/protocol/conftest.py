"""Fixtures of the protocol checks (``tox -e sglang-protocol``): SGLang's source (the wheel installed without
its dependencies) and a local engine whose requests from Miles are recorded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.rollout.http_client import HttpEngineClient
from miles.testing.engine import EngineProcess
from miles.testing.fixtures import engines_may_load_test_weights  # noqa: F401  (autouse)
from miles_sglang.protocol_check import Call
from miles_sglang.sglang_source import SGLangSource


@pytest.fixture(scope="session")
def source() -> SGLangSource:
    return SGLangSource.read()


class RecordingClient(HttpEngineClient):
    """The engine client Miles uses, keeping every request it sends (``calls``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[Call] = []

    async def _send(
        self,
        method: str,
        url: str,
        endpoint: str,
        payload: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        self.calls.append(Call(method, url, endpoint, payload))
        return await super()._send(method, url, endpoint, payload, headers)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from miles.testing.models import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("model") / "moe", "qwen2_moe", seed=0)


@pytest.fixture(scope="module")
def engine(moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    log = tmp_path_factory.mktemp("logs") / "engine.log"
    with EngineProcess(moe_model, log_path=log) as process:
        yield process
