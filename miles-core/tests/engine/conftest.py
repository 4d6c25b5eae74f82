"""Fixtures of the local-engine tests: tiny models built once per session, engine processes, HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miles.testing.engine import EngineProcess


@pytest.fixture(scope="session")
def engine_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny checkpoints: ``qwen2`` (seed 0), ``qwen2_b`` (same shapes, seed 1), ``qwen2_moe``."""
    from miles.testing.models import build_tiny_model

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("engine-models")
    return {
        "qwen2": build_tiny_model(root / "qwen2", "qwen2", seed=0),
        "qwen2_b": build_tiny_model(root / "qwen2_b", "qwen2", seed=1),
        "qwen2_moe": build_tiny_model(root / "qwen2_moe", "qwen2_moe", seed=0),
        "qwen3_moe": build_tiny_model(root / "qwen3_moe", "qwen3_moe", seed=0),
        "llama": build_tiny_model(root / "llama", "llama", seed=0),
    }


def start_engine(model: Path, log: Path, *extra: str) -> Iterator[EngineProcess]:
    with EngineProcess(model, extra_args=list(extra), log_path=log) as engine:
        yield engine


def hf_logprobs(model_dir: Path, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """``logp[i]`` = log-probability of ``tokens[i]`` given ``tokens[:i]`` (fp32, independent HF forward)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    out = torch.full((len(tokens),), float("nan"))
    out[1:] = logp[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return out


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    """``n`` greedy tokens by repeated full HF forwards (no cache, no EOS handling)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]
