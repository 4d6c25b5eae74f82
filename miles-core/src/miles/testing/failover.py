"""Helpers of the engine-failover tests: keyed, seeded requests in flight, and the check that a fault changed
no answer (``miles-core/tests/rollout/test_failover.py``, ``tests/integration/test_router.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from miles.rollout.http_client import HttpEngineClient
from miles.rollout.protocol import GenerateOutput, SamplingParams

__all__ = ["assert_same_answers", "generate_keyed"]


async def generate_keyed(client: HttpEngineClient, keys: Sequence[str]) -> list[GenerateOutput]:
    """One request per routing key, all in flight at once: prompt ``[1, 2, 3, i]``, 48 tokens sampled at
    temperature 1 with seed ``100 + i``, so the same call gives the same answers on any healthy engine."""
    params = [
        SamplingParams(max_new_tokens=48, ignore_eos=True, temperature=1.0, sampling_seed=100 + i)
        for i in range(len(keys))
    ]
    outs = await asyncio.gather(
        *(
            client.generate([1, 2, 3, i], p, routing_key=key)
            for i, (key, p) in enumerate(zip(keys, params, strict=True))
        )
    )
    return [o[0] for o in outs]


def assert_same_answers(
    again: Sequence[GenerateOutput], reference: Sequence[GenerateOutput], *, served_by: str
) -> None:
    """Every request answered once, with the tokens and (to 1e-5) the logprobs the healthy fleet produced for
    it, all by the engine ``served_by``."""
    assert [o.output_ids for o in again] == [o.output_ids for o in reference]
    for o, r in zip(again, reference, strict=True):
        assert len(o.output_logprobs) == len(r.output_logprobs)
        assert all(abs(a - b) <= 1e-5 for a, b in zip(o.output_logprobs, r.output_logprobs, strict=True)), (
            o.output_logprobs,
            r.output_logprobs,
        )
    assert {o.meta_info["engine_url"] for o in again} == {served_by}
