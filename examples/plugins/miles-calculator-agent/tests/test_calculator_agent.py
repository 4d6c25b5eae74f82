"""The calculator environment: the tool, the answer parser, the reward, the plugin's conformance, and
episodes through the openai client against a real session server and engine."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import miles_calculator_agent.plugin as plugin
import pytest
from miles_calculator_agent import CALCULATOR_TOOL, CalculatorAnswer, calculate, final_answer

from miles.testing import check_light_import, check_plugin, check_reward, check_rollout_function
from miles.types import Sample


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2 + 3", "5"),
        ("12 * (3 + 4)", "84"),
        ("7 / 2", "3.5"),
        ("-4 ** 2", "-16"),
        ("2 ** 10", "1024"),
        (" 15 / 3 ", "5"),
    ],
)
def test_calculator_evaluates_arithmetic(expression: str, value: str) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [("__import__('os').system('true')", "not arithmetic"), ("1 / 0", "division by zero"), ("2 ** 1000", "too large"),
     ("", "invalid syntax"), ("x + 1", "not arithmetic")],
)  # fmt: skip
def test_calculator_refuses_everything_else(expression: str, error: str) -> None:
    result = calculate(expression)
    assert result.startswith("error:") and error in result


def test_final_answer() -> None:
    assert final_answer("ANSWER: 42") == "42"
    assert final_answer("first ANSWER: 1, then ANSWER: -7.5") == "-7.5"
    assert final_answer("no number here") is None and final_answer(None) is None


def _sample(answer: Any, label: Any, calls: int = 0) -> Sample:
    return Sample(prompt_ids=[1], label=label, metadata={"answer": answer, "calculator_calls": calls})


def test_reward_scores_the_final_answer() -> None:
    values = check_reward(
        CalculatorAnswer,
        samples=[_sample("42", "42"), _sample("41", "42"), _sample(None, "42"), _sample("x", "42"), _sample("3.0", 3)],
    )
    assert values == [1.0, 0.0, 0.0, 0.0, 1.0]
    shaped = check_reward(CalculatorAnswer, settings={"tool_bonus": 0.1}, samples=[_sample("41", "42", calls=2)])
    assert shaped == [0.1]


def test_plugin_conforms_and_imports_cheaply() -> None:
    entries = check_plugin(
        plugin,
        name="calculator_agent",
        expect=[("rollout_function", "calculator_agent"), ("reward", "calculator_answer")],
    )
    check_rollout_function(next(e for e in entries if e.name == "calculator_agent").component, name="calculator_agent")
    check_light_import("miles_calculator_agent.plugin", forbidden=("torch", "transformers", "openai"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from miles.testing.engine import EngineProcess
    from miles.testing.tool_model import tool_model_for

    model = tool_model_for("qwen2.5")  # a tiny model fine-tuned to call the calculator (cached)
    with EngineProcess(model, log_path=tmp_path_factory.mktemp("logs") / "engine.log") as proc:
        yield proc


class _Prompts:
    def __init__(self, prompts: list[Any]) -> None:
        self.prompts = prompts

    def next_batch(self, n: int) -> list[Any]:
        return self.prompts[:n]


@pytest.mark.slow
def test_episodes_call_the_calculator_through_the_session_server(engine: Any) -> None:
    from miles_calculator_agent.episode import SYSTEM_PROMPT
    from transformers import AutoTokenizer

    from miles.data.base import Prompt
    from miles.rollout.http_client import HttpEngineClient
    from miles.rollout.manager import RolloutManager
    from miles.settings.model import RolloutSettings

    tokenizer = AutoTokenizer.from_pretrained(Path(engine.model_path))
    questions = [("What is 12 + 30?", "42"), ("What is 7 + 8?", "15")]
    prompts = _Prompts([
        Prompt(q, label=a, prompt_ids=tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}], add_generation_prompt=True,
            tokenize=True, return_dict=False))
        for q, a in questions
    ])  # fmt: skip
    reward = CalculatorAnswer(CalculatorAnswer.Settings())

    async def score(samples: Sequence[Sample]) -> None:
        for s in samples:
            s.reward = await reward.score(s)

    async def run() -> Any:
        settings = RolloutSettings(rollout_batch_size=2, n_samples_per_prompt=4, max_new_tokens=64, temperature=0.7)
        async with HttpEngineClient([engine.url]) as client:
            manager = RolloutManager(client, settings, scorer=score, rollout_function=plugin.CALCULATOR_AGENT, seed=3)
            try:
                return await manager.rollout(prompts)
            finally:
                await manager.close()

    result = asyncio.run(run())
    samples = result.samples
    assert len(samples) == 8
    for s in samples:
        s.validate()
        assert s.reward is not None and s.metadata["session"]["append_only_violations"] == 0
        # the session's first prompt: the system prompt, the tool definitions and the question, as the
        # template renders them (the data pipeline's prompt_ids have no tools: the session's replace them)
        question = next(q for q, a in questions if a == s.label)
        assert s.prompt_ids == tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
            tools=[CALCULATOR_TOOL], add_generation_prompt=True, tokenize=True, return_dict=False,
        )  # fmt: skip
        tools = [m for m in s.metadata["messages"] if m["role"] == "tool"]
        assert len(tools) == s.metadata["calculator_calls"]
    assert sum(s.metadata["calculator_calls"] for s in samples) >= 4  # the policy really calls the tool
    assert result.metrics["sessions/tool_calls_per_episode_mean"] > 0.5
    assert result.metrics["sessions/append_only_violations"] == 0.0
