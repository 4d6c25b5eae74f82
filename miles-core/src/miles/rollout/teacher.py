"""Teacher scoring for on-policy distillation: every finished sample is scored by a teacher server.

Like slime's on-policy distillation, each sample's tokens (prompt + response) go to the teacher's
``/generate`` (SGLang's protocol) as a scoring-only request: ``max_new_tokens = 0``, ``return_logprob``,
``logprob_start_len`` = the prompt length and, for top-k distillation, ``top_logprobs_num = k``. The
samples of one call (a group) travel as one batched request (``input_ids`` and ``logprob_start_len`` as
lists, up to ``batch_size`` sequences each), at most ``max_concurrency`` requests at a time. The
teacher's ``input_token_logprobs`` are then exactly one logprob per response token (``teacher_logprobs``)
and ``input_top_logprobs`` the teacher's top-k at each response position (``teacher_topk_ids`` /
``teacher_topk_logprobs``). The teacher must use the policy's tokenizer: the token ids are sent as is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from miles.auth import ServiceKeys
from miles.errors import SettingsError
from miles.rollout.http_client import HttpEngineClient

if TYPE_CHECKING:
    from miles.algorithms.base import AlgorithmNeeds
    from miles.settings.model import TeacherSettings
    from miles.types import Sample

__all__ = ["TeacherError", "TeacherScorer", "teacher_for"]

log = logging.getLogger(__name__)


class TeacherError(RuntimeError):
    """The teacher server failed to score a sample, or answered something that does not fit it."""


class TeacherScorer:
    """Fills ``teacher_logprobs`` (and, with ``top_k``, the teacher's top-k fields) of samples."""

    def __init__(self, settings: TeacherSettings) -> None:
        if not settings.url:
            raise SettingsError("rollout.teacher.url is not set")
        self.url = settings.url.rstrip("/")
        self.settings = settings

    def payload(self, samples: Sequence[Sample]) -> dict[str, Any]:
        """The scoring-only batched ``/generate`` body of ``samples``."""
        body: dict[str, Any] = {
            "input_ids": [s.tokens for s in samples],
            "sampling_params": {"max_new_tokens": 0, "temperature": self.settings.temperature},
            "return_logprob": True,
            "logprob_start_len": [len(s.prompt_ids) for s in samples],
        }
        if self.settings.top_k > 0:
            body["top_logprobs_num"] = self.settings.top_k
        return body

    def fill(self, sample: Sample, answer: dict[str, Any]) -> None:
        """Put one ``/generate`` answer into ``sample``; :class:`TeacherError` when it does not fit."""
        where = f"teacher {self.url}, sample {sample.group_id}/{sample.index}"
        meta = answer.get("meta_info") if isinstance(answer, dict) else None
        if not isinstance(meta, dict) or not isinstance(meta.get("input_token_logprobs"), list):
            raise TeacherError(f"{where}: the answer has no meta_info.input_token_logprobs")
        entries = meta["input_token_logprobs"]
        n = sample.response_length
        if len(entries) != n or [int(e[1]) for e in entries] != sample.response_ids:
            raise TeacherError(
                f"{where}: input_token_logprobs has {len(entries)} entries for {n} response tokens or other token "
                "ids (does the teacher use the policy's tokenizer and honour logprob_start_len?)"
            )
        sample.teacher_logprobs = [float(e[0]) for e in entries]
        k = self.settings.top_k
        if k <= 0:
            return
        tops = meta.get("input_top_logprobs")
        if not isinstance(tops, list) or len(tops) != n or any(not isinstance(t, list) or len(t) < k for t in tops):
            raise TeacherError(f"{where}: input_top_logprobs does not hold {k} entries for each of {n} tokens")
        sample.teacher_topk_ids = [[int(e[1]) for e in top[:k]] for top in tops]
        sample.teacher_topk_logprobs = [[float(e[0]) for e in top[:k]] for top in tops]

    async def score(self, samples: Sequence[Sample]) -> None:
        """Score every sample with a response; a failure raises :class:`TeacherError` naming the teacher."""
        todo = [s for s in samples if s.response_length > 0]
        for s in samples:
            if s.response_length == 0:
                s.teacher_logprobs = []
                s.teacher_topk_ids = [] if self.settings.top_k > 0 else None
                s.teacher_topk_logprobs = [] if self.settings.top_k > 0 else None
        if not todo:
            return
        gate = asyncio.Semaphore(self.settings.max_concurrency)
        # the run's API key, for a teacher started with it (``MILES_API_KEY=... miles serve``); never the admin key
        key = ServiceKeys.from_env().api_key
        async with HttpEngineClient([self.url], timeout=self.settings.timeout, api_key=key) as client:

            async def one(batch: Sequence[Sample]) -> None:
                names = ", ".join(f"{s.group_id}/{s.index}" for s in batch)
                async with gate:
                    try:
                        answer = await client.call(self.url, "/generate", self.payload(batch))
                    except Exception as exc:
                        raise TeacherError(f"teacher {self.url} failed to score samples {names}: {exc}") from exc
                answers: Any = answer.get("result")  # a batched request is answered with a list
                if not isinstance(answers, list) or len(answers) != len(batch):
                    raise TeacherError(f"teacher {self.url}: expected {len(batch)} answers for samples {names}")
                for sample, answer in zip(batch, answers, strict=True):
                    self.fill(sample, answer)

            size = self.settings.batch_size
            await asyncio.gather(*(one(todo[i : i + size]) for i in range(0, len(todo), size)))
        log.debug("teacher %s scored %d samples", self.url, len(todo))


def teacher_for(settings: TeacherSettings, needs: AlgorithmNeeds | None) -> TeacherScorer | None:
    """The scorer the run needs, or ``None``; a :class:`~miles.errors.SettingsError` naming the setting when the algorithm needs
    a teacher that is not configured (or one with too small a ``top_k``)."""
    wants_tokens = needs is not None and needs.teacher_logprobs
    wants_topk = needs.teacher_topk if needs is not None else 0
    if (wants_tokens or wants_topk > 0) and not settings.url:
        raise SettingsError(
            "the algorithm needs teacher logprobs: set rollout.teacher.url to a teacher server "
            "(e.g. `miles serve --model TEACHER --port 30001` and url = 'http://127.0.0.1:30001')"
        )
    if wants_topk > settings.top_k:
        raise SettingsError(
            f"the algorithm needs the teacher's top-{wants_topk} per token: set rollout.teacher.top_k >= "
            f"{wants_topk} (it is {settings.top_k})"
        )
    return TeacherScorer(settings) if settings.url and needs is not None else None
