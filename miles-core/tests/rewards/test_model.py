"""The ``model`` reward against real servers over loopback HTTP: the reward-model server's application
(:mod:`miles.rewards.model_server`) with a tiny classifier and a tiny process reward model, scores checked
against the model run here; and a tiny judge on a real local engine, whose verdicts are known in advance
(:func:`~miles.testing.reward_models.build_modulo_judge`): numbers become rewards, an answer that is no verdict
fails its sample with the answer quoted. The servers run on threads of this process (each process costs ~10 s
of imports here); ``tests/integration/test_reward_models.py`` has the launcher start them as processes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from miles.rewards.base import Reward
from miles.rewards.model import ModelReward, RewardModelSettings
from miles.rewards.scoring import score_samples
from miles.testing.reward_models import build_modulo_judge, build_tiny_classifier, modulo_verdict
from miles.types import Sample, SampleStatus

PROMPTS = ["What is 3 + 4?", "Name a colour.", "What is the time?", "Say one word."]
RESPONSES = ["7", "The answer is 7, because 3 plus 4 is seven.", "blue", "one two", "the sum", "word", "a", "red"]


def samples() -> list[Sample]:
    return [
        Sample(
            prompt_ids=[1],
            response_ids=[2],
            status=SampleStatus.COMPLETED,
            prompt=PROMPTS[i % len(PROMPTS)],
            prompt_messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            response=response,
            index=i,
        )
        for i, response in enumerate(RESPONSES)
    ]


def score(scored: list[Sample], name: str, reward: Reward[Any]) -> None:
    """Score ``scored`` with ``reward`` and close it, in one event loop (its HTTP client lives in it)."""

    async def main() -> None:
        try:
            await score_samples(scored, [(name, reward, 1.0)], timeout=60.0)
        finally:
            await reward.close()

    asyncio.run(main())


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on a thread, on a port the OS picks; its URL."""
    import uvicorn

    from miles.net import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, str]]]:
    from miles.engine.launch import InProcessEngine
    from miles.engine.options import ServeOptions
    from miles.rewards.model_server import ModelScorer, create_app

    root = tmp_path_factory.mktemp("reward_models")
    classifier = build_tiny_classifier(root / "classifier", seed=1)
    prm = build_tiny_classifier(root / "prm", kind="process", num_labels=2, seed=2)
    judge = build_modulo_judge(root / "judge")
    cls_scorer = ModelScorer(str(classifier), kind="classifier", batch_size=3)
    prm_scorer = ModelScorer(str(prm), kind="process", label="1", transform="probability", input_format="text")
    with ExitStack() as stack:
        cls_url = stack.enter_context(serving(create_app(cls_scorer)))
        prm_url = stack.enter_context(serving(create_app(prm_scorer)))
        engine = stack.enter_context(InProcessEngine(ServeOptions(model=judge, host="127.0.0.1", port=0)))
        yield {"classifier": (classifier, cls_url), "prm": (prm, prm_url), "judge": (judge, engine.url)}


def test_classifier_scores_are_the_models_own_batched(servers: dict[str, tuple[Path, str]]) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path, url = servers["classifier"]
    reward = ModelReward(RewardModelSettings(kind="classifier", model_path=str(path), url=url, batch_size=4))
    scored = samples()
    score(scored, "rm", reward)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    for s in scored:
        assert s.status == SampleStatus.COMPLETED, s.status_reason
        messages = [*s.prompt_messages, {"role": "assistant", "content": s.response}]  # type: ignore[misc]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        with torch.inference_mode():
            want = float(model(**ids).logits[0, 0])
        assert s.reward == pytest.approx(want, abs=1e-4), (s.response, s.reward, want)
    assert len({s.reward for s in scored}) == len(scored)  # a real model: every input its own score


def test_process_reward_scores_each_step_at_its_end(servers: dict[str, tuple[Path, str]]) -> None:
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    path, url = servers["prm"]
    settings = RewardModelSettings(
        kind="process", model_path=str(path), url=url, label=1, aggregate="min", step_tag=";"
    )
    reward = ModelReward(settings)
    response = "3 plus 4\n\nis 7\n\nso the answer is 7"
    sample, too_long = (
        Sample(prompt_ids=[1], response_ids=[2], status=SampleStatus.COMPLETED, prompt="Q: 3+4? ", response=text)
        for text in (response, "one step " * 600)  # (the model has 1024 positions)
    )
    score([sample, too_long], "prm", reward)  # (one batch)
    assert sample.status == SampleStatus.COMPLETED, sample.status_reason
    assert too_long.status == SampleStatus.FAILED and "more than max_length = 1024" in too_long.status_reason
    # the model is causal: a step's score is the last position's output of the text up to that step's tag
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForTokenClassification.from_pretrained(path).eval()
    steps, want = response.split("\n\n"), []
    for k in range(1, len(steps) + 1):
        text = "Q: 3+4? " + "".join(step + ";" for step in steps[:k])
        with torch.inference_mode():
            logits = model(**tokenizer(text, return_tensors="pt")).logits[0, -1]
        want.append(float(torch.softmax(logits, dim=-1)[1]))
    assert sample.reward_parts["prm/steps"] == 3.0
    assert sample.reward == pytest.approx(min(want), abs=1e-5)
    assert sample.reward_parts["prm/step_mean"] == pytest.approx(sum(want) / 3, abs=1e-5)


def test_judge_on_a_local_engine_numbers_and_garbage(servers: dict[str, tuple[Path, str]]) -> None:
    from transformers import AutoTokenizer

    path, url = servers["judge"]
    common = dict(kind="judge", model_path=str(path), url=url, chat_template=False, max_new_tokens=1, batch_size=3)
    template = "Q: {prompt} A: {response}"
    reward = ModelReward(RewardModelSettings(**common, template=template, score_range=(0, 1)))  # type: ignore[arg-type]
    scored = samples()
    score(scored, "judge", reward)
    tokenizer = AutoTokenizer.from_pretrained(path)
    verdicts = [
        modulo_verdict(tokenizer(template.format(prompt=s.prompt, response=s.response))["input_ids"]) for s in scored
    ]
    assert set(verdicts) == {"0", "1", "x"}, verdicts  # (numbers and garbage both asked of the engine)
    for s, verdict in zip(scored, verdicts, strict=True):
        assert s.metadata["judge_verdict"] == verdict
        if verdict == "x":
            assert s.status == SampleStatus.FAILED and s.reward is None
            assert "reward 'judge' raised VerdictError: the judge's answer 'x' holds no number" in s.status_reason
        else:
            assert s.status == SampleStatus.COMPLETED and s.reward == float(verdict)

    # a prompt past the judge's context (1024 positions less the answer's token) fails alone, before the engine
    long = Sample(prompt_ids=[1], response_ids=[2], status=SampleStatus.COMPLETED, response="word " * 1100)
    fits = samples()[verdicts.index("1")]
    again = ModelReward(RewardModelSettings(**common, template=template, score_range=(0, 1)))  # type: ignore[arg-type]
    score([long, fits], "judge", again)
    assert long.status == SampleStatus.FAILED and "tokens, over 1023" in long.status_reason
    assert fits.status == SampleStatus.COMPLETED and fits.reward == 1.0

    # a judge whose answers never name a label: every sample fails with the reason, the scoring goes on
    labels = ModelReward(RewardModelSettings(**common, template=template, labels={"yes": 1.0, "no": 0.0}))  # type: ignore[arg-type]
    scored = samples()
    score(scored, "judge", labels)
    assert all(s.status == SampleStatus.FAILED for s in scored)
    assert all("names none of the labels yes, no" in s.status_reason for s in scored)
