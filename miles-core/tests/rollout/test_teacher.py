"""Teacher scoring against a real local engine on loopback: teacher logprobs and top-k equal an independent
Hugging Face forward of the teacher; misconfiguration and a dead teacher are clear errors."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miles.algorithms.base import AlgorithmNeeds
from miles.errors import SettingsError
from miles.net import free_port
from miles.rollout.teacher import TeacherError, TeacherScorer, teacher_for
from miles.settings.model import TeacherSettings
from miles.testing.engine import EngineProcess
from miles.testing.models import serve_tiny_model
from miles.types import Sample


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with serve_tiny_model(tmp_path_factory.mktemp("teacher"), seed=1) as engine:
        yield engine


@pytest.fixture(scope="module")
def teacher_model(teacher: EngineProcess) -> Path:
    return Path(teacher.model_path)


def _samples() -> list[Sample]:
    return [
        Sample(prompt_ids=[5, 17, 33, 48], response_ids=[91, 120, 7], rollout_logprobs=[-1.0] * 3, loss_mask=[1] * 3),
        Sample(prompt_ids=[9, 250], response_ids=[300, 12, 64, 77, 4], rollout_logprobs=[-1.0] * 5, loss_mask=[1] * 5),
        Sample(prompt_ids=[9, 250], group_id=1),  # no response: nothing to score
    ]


def test_teacher_logprobs_and_topk_equal_an_hf_forward(teacher: EngineProcess, teacher_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    k, temperature = 4, 0.9
    scorer = TeacherScorer(TeacherSettings(url=teacher.url, top_k=k, temperature=temperature))
    samples = _samples()
    asyncio.run(scorer.score(samples))
    hf = AutoModelForCausalLM.from_pretrained(teacher_model, dtype=torch.float32)
    for sample in samples[:2]:
        sample.validate()
        with torch.no_grad():
            logits = hf(torch.tensor([sample.tokens])).logits[0].float()
        p = len(sample.prompt_ids)
        logp = torch.log_softmax(logits[p - 1 : -1] / temperature, dim=-1)
        ref = logp.gather(1, torch.tensor(sample.response_ids)[:, None])[:, 0]
        assert sample.teacher_logprobs is not None
        assert torch.allclose(torch.tensor(sample.teacher_logprobs), ref, atol=1e-5)
        assert sample.teacher_topk == k
        top = torch.topk(logp, k)
        assert torch.allclose(torch.tensor(sample.teacher_topk_logprobs), top.values, atol=1e-5)
        got_ids = torch.tensor(sample.teacher_topk_ids)
        assert torch.allclose(logp.gather(1, got_ids), top.values, atol=1e-5)  # ids carry those logprobs
    empty = samples[2]
    assert empty.teacher_logprobs == [] and empty.teacher_topk_ids == [] and empty.teacher_topk_logprobs == []
    # per-token only: no top-k fields
    plain = _samples()[:1]
    asyncio.run(TeacherScorer(TeacherSettings(url=teacher.url)).score(plain))
    assert plain[0].teacher_logprobs is not None and plain[0].teacher_topk_ids is None


def test_a_dead_teacher_is_an_error_naming_its_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    scorer = TeacherScorer(TeacherSettings(url=url, timeout=5.0))
    with pytest.raises(TeacherError, match=f"teacher {url} failed to score samples 0/0"):
        asyncio.run(scorer.score(_samples()[:1]))


def test_a_wrong_answer_is_an_error_naming_the_sample() -> None:
    scorer = TeacherScorer(TeacherSettings(url="http://127.0.0.1:1", top_k=2))
    sample = _samples()[0]
    answer = {"meta_info": {"input_token_logprobs": [[-1.0, 91, None], [-1.0, 121, None], [-1.0, 7, None]]}}
    with pytest.raises(TeacherError, match="sample 0/0: input_token_logprobs has 3 entries for 3 response tokens"):
        scorer.fill(sample, answer)
    answer["meta_info"]["input_token_logprobs"][1][1] = 120
    with pytest.raises(TeacherError, match="input_top_logprobs does not hold 2 entries"):
        scorer.fill(sample, answer)


def test_teacher_for_checks_the_algorithm_needs() -> None:
    assert teacher_for(TeacherSettings(), AlgorithmNeeds()) is None
    assert teacher_for(TeacherSettings(url="http://127.0.0.1:9"), None) is None  # evaluation: no teacher
    with pytest.raises(SettingsError, match="set rollout.teacher.url"):
        teacher_for(TeacherSettings(), AlgorithmNeeds(teacher_logprobs=True))
    with pytest.raises(SettingsError, match=r"rollout.teacher.top_k >= 8 \(it is 4\)"):
        teacher_for(TeacherSettings(url="http://127.0.0.1:9", top_k=4), AlgorithmNeeds(teacher_topk=8))
    scorer = teacher_for(TeacherSettings(url="http://127.0.0.1:9/", top_k=8), AlgorithmNeeds(teacher_topk=8))
    assert scorer is not None and scorer.url == "http://127.0.0.1:9"
    body = scorer.payload(_samples()[:2])  # one batched request
    assert body["sampling_params"]["max_new_tokens"] == 0 and body["logprob_start_len"] == [4, 2]
    assert body["top_logprobs_num"] == 8
    assert body["input_ids"] == [[5, 17, 33, 48, 91, 120, 7], [9, 250, 300, 12, 64, 77, 4]]
