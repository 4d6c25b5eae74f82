"""Fixtures of the checks against real SGLang on this CPU (``tox -e sglang-real``, run with the python of the
environment ``scripts/sglang/cpu_env.py`` builds).

Every module here is skipped, with the reason, where SGLang, its CPU kernels or the CPU instructions they
need are missing. Servers are started through the core's :class:`~miles.launch.local.LocalLauncher`: each
in its own process group, reaped with its scheduler and detokenizer processes when the module ends, however
its tests ended (and killed by the kernel should this process die first).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from miles.launch.local import LocalLauncher
from miles.rollout.backend import EngineLaunch
from miles_sglang import cpu_host


def _skip_reason() -> str | None:
    missing = [m for m in ("sglang", cpu_host.KERNEL_PACKAGE) if importlib.util.find_spec(m) is None]
    if missing:
        return (
            f"{' and '.join(missing)} not installed: run these tests with the python of the SGLang CPU "
            "environment (tox -e sglang-real, or python scripts/sglang/cpu_env.py run -- -m pytest ...)"
        )
    flags = cpu_host.missing_cpu_flags()
    if flags:
        return f"this CPU ({cpu_host.cpu_model()}) lacks {', '.join(flags)}, which SGLang's CPU kernels need"
    return None


SKIP_REASON = _skip_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SKIP_REASON is None:
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


MAX_TOTAL_TOKENS = 4096
"""KV cache of each test server (SGLang would otherwise size it from free RAM)."""
STARTUP_TIMEOUT = 300.0
"""Seconds a server may take to answer ``/health_generate`` (20-26 s on 2 idle cores; CI shares them)."""


@dataclass
class TinyModels:
    """Two tiny Llama checkpoints of one tokenizer, with different weights (seeds 0 and 1)."""

    first: Path
    second: Path


@pytest.fixture(scope="session")
def tiny_llamas(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    from miles.testing.models import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    # head size 32: the CPU attention kernels need a multiple of 32
    dims: dict[str, Any] = {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256}
    return TinyModels(
        first=build_tiny_model(root / "llama-0", "llama", seed=0, **dims),
        second=build_tiny_model(root / "llama-1", "llama", seed=1, **dims),
    )


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE: 8 experts, top-2, both layers sparse, head size 32 (the CPU kernels' multiple)."""
    from miles.testing.models import build_tiny_model

    dims: dict[str, Any] = {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256}
    return build_tiny_model(
        tmp_path_factory.mktemp("moe") / "qwen3-moe", "qwen3_moe", seed=0, num_experts=8, num_experts_per_tok=2, **dims
    )


SERVED_DTYPE = "bfloat16"
"""The dtype the test servers serve: the CPU kernels have no float32 path (``rmsnorm_kernel`` refuses
``Float``), so the checkpoints (float32) are served in bfloat16, and transformers runs them in bfloat16 too."""

NEAR_TIE = 0.01
"""Where transformers' best two next tokens are closer than this (logprob), bfloat16 rounding may pick either."""


@dataclass
class Scored:
    """Transformers' view of a completion: at each step the token's logprob, the best token and its logprob."""

    logprobs: list[float]
    best: list[int]
    best_logprobs: list[float]


class Reference:
    """Transformers on the same checkpoints, in the served dtype (:data:`SERVED_DTYPE`)."""

    def __init__(self) -> None:
        self._models: dict[Path, Any] = {}

    def _model(self, path: Path) -> Any:
        if path not in self._models:
            import torch
            from transformers import AutoModelForCausalLM

            torch.set_num_threads(1)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, SERVED_DTYPE))
            self._models[path] = model.eval()
        return self._models[path]

    def score(self, path: Path, prompt: list[int], completion: list[int]) -> Scored:
        """Teacher-forced: one forward over ``prompt + completion``."""
        import torch

        with torch.no_grad():
            logits = self._model(path)(torch.tensor([prompt + completion])).logits[0].double()
        steps = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        best = steps.max(dim=-1)
        chosen = steps.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)
        return Scored(logprobs=chosen.tolist(), best=best.indices.tolist(), best_logprobs=best.values.tolist())

    def check_greedy(self, path: Path, prompt: list[int], tokens: list[int], logprobs: list[float]) -> None:
        """``tokens`` are transformers' greedy continuation of ``prompt`` (each one its best next token, a
        near-tie aside) and ``logprobs`` its logprobs within 1e-2."""
        scored = self.score(path, prompt, tokens)
        for i, (token, best) in enumerate(zip(tokens, scored.best, strict=True)):
            lead = scored.best_logprobs[i] - scored.logprobs[i]
            assert token == best or lead < NEAR_TIE, (
                f"step {i}: SGLang chose {token}, transformers {best} ({lead:.4f} more likely)"
            )
        diffs = [abs(a - b) for a, b in zip(logprobs, scored.logprobs, strict=True)]
        assert max(diffs) < 1e-2, f"logprobs differ from transformers' by up to {max(diffs):.4f}"


@pytest.fixture(scope="session")
def reference() -> Reference:
    return Reference()


@dataclass
class Server:
    """A running SGLang server."""

    url: str
    launcher: LocalLauncher

    def post(self, path: str, payload: dict[str, Any], *, timeout: float = 120.0) -> httpx.Response:
        return httpx.post(self.url + path, json=payload, timeout=timeout, trust_env=False)

    def get(self, path: str, *, timeout: float = 60.0) -> httpx.Response:
        return httpx.get(self.url + path, timeout=timeout, trust_env=False)

    def log(self) -> str:
        return self.launcher.engines[0].log_tail(200)

    def process_ids(self) -> list[int]:
        """The server and every process it started (its process group)."""
        pgid = self.launcher.engines[0].pid
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.getpgid(int(entry.name)) == pgid:
                        found.append(int(entry.name))
                except ProcessLookupError:
                    pass
        return found


@contextmanager
def _serving(launch: EngineLaunch, run_dir: Path) -> Iterator[Server]:
    """Start ``launch`` and wait for ``/health_generate``; stop and reap its process group on leaving."""
    launcher = LocalLauncher(run_dir=str(run_dir))
    with launcher:
        (url,) = launcher.start_engines([launch], timeout=STARTUP_TIMEOUT)
        yield Server(url=url, launcher=launcher)


@pytest.fixture(scope="session")
def serve_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``serve_model(path)``: a context manager that serves another checkpoint as :func:`server` serves the
    first tiny Llama (the same command, :data:`SERVED_DTYPE`, :data:`MAX_TOTAL_TOKENS`), for modules that need
    their own model."""
    from miles.net import free_port
    from miles_sglang.engine import SGLangEngine
    from miles_sglang.settings import SGLangEngineSettings

    def serve(model_path: Path) -> Any:
        settings = SGLangEngineSettings(max_total_tokens=MAX_TOTAL_TOKENS, log_level="warning")
        launch = SGLangEngine(settings).launch(
            model_path=str(model_path), host="127.0.0.1", port=free_port(), device="cpu", dtype=SERVED_DTYPE,
            devices=[], seed=1234,
        )  # fmt: skip
        return _serving(launch, tmp_path_factory.mktemp("server"))

    return serve


@pytest.fixture(scope="session")
def server(tiny_llamas: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One SGLang server for the whole session (each start costs 20-26 s on idle cores, minutes on busy ones,
    and 2-3 GB), serving the first tiny Llama, started the way Miles starts it: the command of
    :meth:`SGLangEngine.launch` on a CPU (``test_engine.py`` checks it is SGLang's documented CPU command)
    run by the local launcher. Tests that load other weights put the first checkpoint back."""
    from miles.net import free_port
    from miles_sglang.engine import SGLangEngine
    from miles_sglang.settings import SGLangEngineSettings

    settings = SGLangEngineSettings(max_total_tokens=MAX_TOTAL_TOKENS, log_level="warning")
    launch = SGLangEngine(settings).launch(
        model_path=str(tiny_llamas.first),
        host="127.0.0.1",
        port=free_port(),
        device="cpu",
        dtype=SERVED_DTYPE,
        devices=[],
        seed=1234,
    )
    with _serving(launch, tmp_path_factory.mktemp("server")) as running:
        yield running
