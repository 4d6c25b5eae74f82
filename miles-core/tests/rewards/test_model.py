"""The ``model`` reward against real servers over loopback HTTP: the reward-model server
(``python -m miles.rewards.model_server``) with a tiny classifier and a tiny process reward model, scores
checked against the model run here; and a tiny judge on a real local engine process, whose verdicts are known
in advance (:func:`~miles.testing.reward_models.build_modulo_judge`): numbers become rewards, an answer that is
no verdict fails its sample with the answer quoted."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles.net import free_port
from miles.rewards.model import ModelReward, RewardModelSettings
from miles.rewards.scoring import score_samples
from miles.testing.engine import EngineProcess
from miles.testing.reward_models import build_modulo_judge, build_tiny_classifier, modulo_verdict
from miles.types import Sample, SampleStatus

PROMPTS = ["What is 3 + 4?", "Name a colour.", "What is the time?", "Say one word."]
RESPONSES = ["7", "The answer is 7, because 3 plus 4 is seven.", "blue", "one two", "it is noon", "word", "a"]


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


class ModelServer:
    def __init__(self, model: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "miles.rewards.model_server", "--model", str(model), "--port", str(self.port)]
        self.proc = subprocess.Popen([*argv, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.communicate()[0][-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("the reward model server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.communicate(timeout=30)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    root = tmp_path_factory.mktemp("reward_models")
    classifier = build_tiny_classifier(root / "classifier", seed=1)
    prm = build_tiny_classifier(root / "prm", kind="process", num_labels=2, seed=2)
    judge = build_modulo_judge(root / "judge")
    started = [
        ModelServer(classifier, "--kind", "classifier", "--batch-size", "3"),
        ModelServer(prm, "--kind", "process", "--label", "1", "--transform", "probability", "--input-format", "text"),
    ]
    engine = EngineProcess(judge, log_path=root / "judge.log").start(wait=False)
    try:
        for server in started:
            server.wait()
        engine.wait_ready()
        yield {"classifier": (classifier, started[0].url), "prm": (prm, started[1].url), "judge": (judge, engine.url)}
    finally:
        for server in started:
            server.stop()
        engine.stop()


def test_classifier_scores_are_the_models_own_batched(servers: dict[str, tuple[Path, str]]) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path, url = servers["classifier"]
    reward = ModelReward(RewardModelSettings(kind="classifier", model_path=str(path), url=url, batch_size=4))
    scored = samples()
    asyncio.run(score_samples(scored, [("rm", reward, 1.0)], timeout=60.0))
    asyncio.run(reward.close())
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
    sample = Sample(
        prompt_ids=[1], response_ids=[2], status=SampleStatus.COMPLETED, prompt="Q: 3+4? ", response=response
    )
    asyncio.run(score_samples([sample], [("prm", reward, 1.0)], timeout=60.0))
    asyncio.run(reward.close())
    assert sample.status == SampleStatus.COMPLETED, sample.status_reason
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
    asyncio.run(score_samples(scored, [("judge", reward, 1.0)], timeout=60.0))
    asyncio.run(reward.close())
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

    # a judge whose answers never name a label: every sample fails with the reason, the scoring goes on
    labels = ModelReward(RewardModelSettings(**common, template=template, labels={"yes": 1.0, "no": 0.0}))  # type: ignore[arg-type]
    scored = samples()
    asyncio.run(score_samples(scored, [("judge", labels, 1.0)], timeout=60.0))
    asyncio.run(labels.close())
    assert all(s.status == SampleStatus.FAILED for s in scored)
    assert all("names none of the labels yes, no" in s.status_reason for s in scored)
