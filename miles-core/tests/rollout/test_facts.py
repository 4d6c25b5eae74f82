"""The MoE client wrapper: an adapter set on it is the inner client's, which puts it in every request."""

from __future__ import annotations

import asyncio

from miles.rollout.facts import RoutedExpertsClient
from miles.rollout.http_client import HttpEngineClient


def test_lora_path_set_through_the_wrapper_is_the_inner_clients() -> None:
    inner = HttpEngineClient(["http://127.0.0.1:9"])
    client = RoutedExpertsClient(inner)
    assert client.lora_path is None
    client.lora_path = "policy"  # what the lora transport does after a push
    assert inner.lora_path == "policy" and client.lora_path == "policy"
    asyncio.run(inner.close())
