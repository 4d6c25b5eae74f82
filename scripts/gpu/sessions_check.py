"""GPU check of the TITO session server (passed on an H200, 2026-12-04: benchmarks/results/gpu_h200_2026-12-04/).

On a CUDA host with this repository installed (miles-core, openai)::

    python scripts/gpu/sessions_check.py            # ~2 minutes on one GPU

It serves the tool-calling tiny Qwen2.5 model (``miles.testing.tool_model``, trained on the CPU first if
not cached) with the local engine on ``cuda`` in float32, runs a 50-turn episode through the session
server with the openai client, and checks: the live check passes, 0 append-only violations and 0
branches, the loss mask is 1 exactly on the tokens each response reported, and an HF forward of the same
weights on the GPU gives the engine's logprobs on every policy token within 1e-4 (GPU kernels differ
from the CPU's; the CPU test bounds the same quantity at 5e-5). Exits non-zero on the first failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

DEVICE = os.environ.get("MILES_GPU_CHECK_DEVICE", "cuda")
"""Where the checks run: ``cuda``; ``MILES_GPU_CHECK_DEVICE=cpu`` is a dry run of the script on the CPU."""

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


async def episode(url: str, sid: str, tools: list[Any]) -> list[dict[str, Any]]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="unused", max_retries=0)
    messages: list[Any] = [
        {"role": "system", "content": "You are a calculator agent. Call the calculator for every sum, then reply with ANSWER: <number>."},
        {"role": "user", "content": "What is 12 + 30?"},
    ]  # fmt: skip
    turns = []
    for k in range(50):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=tools, logprobs=True, max_tokens=64, extra_body={"return_token_ids": True}
        )  # fmt: skip
        choice = reply.choices[0]
        turns.append({"prompt": reply.model_extra["prompt_token_ids"], "output": choice.model_extra["token_ids"],
                      "logprobs": [e.logprob for e in choice.logprobs.content]})  # fmt: skip
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.message.tool_calls:
            for call in choice.message.tool_calls:
                messages.append({"role": "tool", "content": "42", "tool_call_id": call.id})
        else:
            messages.append({"role": "user", "content": f"What is {k + 3} + {2 * k + 5}?"})
    await client.close()
    return turns


async def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from miles.rollout.http_client import HttpEngineClient
    from miles.sessions.append_only import CALCULATOR_TOOL
    from miles.sessions.server import SessionServer
    from miles.sessions.session import SessionSampling
    from miles.settings.sessions import SessionSettings
    from miles.testing.engine import EngineProcess
    from miles.testing.tool_model import tool_model_for

    assert DEVICE != "cuda" or torch.cuda.is_available(), "needs a CUDA GPU"
    model_dir = tool_model_for("qwen2.5")
    with EngineProcess(model_dir, extra_args=["--device", DEVICE, "--dtype", "float32"], threads=4) as engine:
        async with HttpEngineClient([engine.url]) as client:
            server = await SessionServer.for_engines(client, SessionSettings())
            url = await server.start()
            try:
                assert server.live is not None and server.live.ok, server.live
                session = server.create_session(sampling=SessionSampling(temperature=0.7, seed=11, override=True))
                turns = await episode(url, session.id, [CALCULATOR_TOOL])
                (sample,) = session.samples()
            finally:
                await server.stop()
    info = sample.metadata["session"]
    assert info["append_only_violations"] == 0 and info["branches"] == 0 and info["turns"] == 50, info
    tokens: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for turn in turns:
        assert turn["prompt"][: len(tokens)] == tokens, "a prompt does not extend the record"
        suffix = turn["prompt"][len(tokens) :]
        tokens += suffix + turn["output"]
        mask += [0] * len(suffix) + [1] * len(turn["output"])
        logprobs += [0.0] * len(suffix) + turn["logprobs"]
    n = len(sample.prompt_ids)
    assert sample.tokens == tokens and sample.loss_mask == mask[n:], "the record differs from the responses"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE)
    with torch.no_grad():
        logits = model(torch.tensor([tokens], device=DEVICE)).logits[0].float()
    logp = torch.log_softmax(logits / 0.7, dim=-1)
    positions = [i for i, m in enumerate(mask) if m]
    trainer = logp[[p - 1 for p in positions], [tokens[p] for p in positions]].cpu().double()
    diff = (trainer - torch.tensor([logprobs[p] for p in positions], dtype=torch.float64)).abs()
    result = {"tokens": len(tokens), "policy_tokens": len(positions), "tool_calls": info["tool_calls"],
              "max_abs_diff": float(diff.max()), "p99_abs_diff": float(diff.quantile(0.99))}  # fmt: skip
    print(json.dumps(result))
    return 0 if result["max_abs_diff"] <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
