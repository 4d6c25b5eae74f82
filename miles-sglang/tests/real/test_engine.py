"""The ``sglang`` rollout engine on a CPU, end to end: the session's server was started from
:meth:`SGLangEngine.launch` by the core's :class:`~miles.launch.local.LocalLauncher` (``conftest.server``),
and Miles' engine client (:class:`~miles.rollout.http_client.HttpEngineClient`) generates and updates
weights through it."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from miles.rollout.http_client import HttpEngineClient
from miles.rollout.protocol import SamplingParams

PROMPT = [3, 141, 59, 26, 5, 358, 97, 93, 23]
STEPS = 12


def test_the_server_runs_sglangs_cpu_command(server: Any, tiny_llamas: Any) -> None:
    """What the engine launched is SGLang's documented CPU command (``SGLANG_USE_CPU_ENGINE=1 python -m
    sglang.launch_server --device cpu --disable-overlap-schedule --max-total-tokens N ...``, run through
    ``miles_sglang.serve``, which adds the run's keys from the environment) plus Miles' flags; the server
    reports the launch weight version."""
    spec = server.launcher.engines[0].spec
    argv, env = spec.argv, spec.env
    assert argv[:3] == [sys.executable, "-m", "miles_sglang.serve"] and env["SGLANG_USE_CPU_ENGINE"] == "1"
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--device"] == "cpu" and flags["--model-path"] == str(tiny_llamas.first)
    assert "--disable-overlap-schedule" in argv and "--base-gpu-id" not in argv
    assert argv[argv.index("--max-total-tokens") + 1] == "4096"
    (info,) = asyncio.run(_model_info(server.url))
    assert info["weight_version"] == "0"  # --weight-version 0: a restart is told by it


async def _model_info(url: str) -> list[dict[str, Any]]:
    async with HttpEngineClient([url]) as client:
        return await client.model_info()


async def _generate(url: str, prompt: list[int], steps: int) -> Any:
    async with HttpEngineClient([url]) as client:
        (out,) = await client.generate(
            prompt, SamplingParams(max_new_tokens=steps, temperature=0.0, ignore_eos=True), return_logprob=True
        )
        return out


def test_the_engine_client_generates_what_transformers_does(server: Any, tiny_llamas: Any, reference: Any) -> None:
    out = asyncio.run(_generate(server.url, PROMPT, STEPS))
    assert len(out.output_ids) == len(out.output_logprobs) == STEPS
    reference.check_greedy(tiny_llamas.first, PROMPT, out.output_ids, out.output_logprobs)
    assert out.finish_reason.type == "length" and out.finish_reason.length == STEPS
    assert out.prompt_tokens == len(PROMPT) and out.completion_tokens == STEPS
    assert out.meta_info["engine_url"] == server.url


def test_the_engine_client_updates_weights_from_disk(server: Any, tiny_llamas: Any, reference: Any) -> None:
    async def push_and_generate(model: Any, version: str) -> Any:
        async with HttpEngineClient([server.url]) as client:
            await client.update_weights_from_disk(str(model), version)
            (info,) = await client.model_info()
            assert (info["model_path"], info["weight_version"]) == (str(model), version)
            return await _generate(server.url, PROMPT, STEPS)

    for model, version in ((tiny_llamas.second, "1"), (tiny_llamas.first, "2")):
        out = asyncio.run(push_and_generate(model, version))
        assert out.weight_version == version
        reference.check_greedy(model, PROMPT, out.output_ids, out.output_logprobs)
