"""The tokenising pipeline with the tiny ChatML tokenizer, saved and reloaded like a run loads it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from miles.components import ComponentKind
from miles.compose import build_run
from miles.data.base import Prompt
from miles.data.factory import create_data_source
from miles.data.pipeline import PromptPipeline
from miles.data.sources import JsonlDataSource
from miles.errors import DataError, SettingsError
from miles.plugins.manager import PluginManager
from miles.settings.model import DataSettings, MilesSettings

CHAT = [{"role": "user", "content": "What is 2+3?"}]


def prompt(value: Any, where: str = "p.jsonl:1") -> Prompt:
    return Prompt(prompt=value, source=where)


def reference_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def test_chat_template_is_applied_once_with_generation_prompt(tokenizer: Any) -> None:
    pipeline = PromptPipeline(tokenizer)
    chat, text = pipeline([prompt(CHAT), prompt("What is 2+3?", "p.jsonl:2")])
    assert chat.prompt_ids == reference_ids(tokenizer, CHAT)
    assert text.prompt_ids == chat.prompt_ids  # a plain-text prompt is one user message
    decoded = tokenizer.decode(chat.prompt_ids)
    assert decoded == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert (chat.prompt, text.prompt) == (CHAT, "What is 2+3?")  # the prompt itself is untouched
    assert all(isinstance(i, int) for i in chat.prompt_ids)


def test_batched_tokenisation_equals_one_by_one(tokenizer: Any) -> None:
    prompts = [prompt([{"role": "user", "content": f"add {i} and {i * 7}"}], f"p.jsonl:{i}") for i in range(11)]
    out = PromptPipeline(tokenizer, batch_size=4)(prompts)
    assert [p.prompt_ids for p in out] == [reference_ids(tokenizer, p.prompt) for p in prompts]  # type: ignore[arg-type]


def test_system_prompt_goes_first_unless_the_row_has_one(tokenizer: Any) -> None:
    pipeline = PromptPipeline(tokenizer, system_prompt="Be brief.")
    plain, own = pipeline([prompt(CHAT), prompt([{"role": "system", "content": "Mine."}, *CHAT])])
    expected = [{"role": "system", "content": "Be brief."}, *CHAT]
    assert plain.prompt == expected and plain.prompt_ids == reference_ids(tokenizer, expected)
    assert tokenizer.decode(plain.prompt_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert tokenizer.decode(own.prompt_ids).startswith("<|im_start|>system\nMine.<|im_end|>\n")


def test_plain_text_without_template(tokenizer: Any) -> None:
    pipeline = PromptPipeline(tokenizer, apply_chat_template=False)
    (out,) = pipeline([prompt("What is 2+3?")])
    assert out.prompt_ids == tokenizer("What is 2+3?")["input_ids"]
    assert tokenizer.decode(out.prompt_ids) == "What is 2+3?"
    with pytest.raises(DataError, match=r"p.jsonl:4: chat messages need data.apply_chat_template = true"):
        pipeline([prompt(CHAT, "p.jsonl:4")])


def test_long_prompts_are_dropped_and_counted(tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    prompts = [prompt("hi"), prompt("the answer is " * 30), prompt("sum"), prompt("what " * 40)]
    lengths = [len(reference_ids(tokenizer, [{"role": "user", "content": p.prompt}])) for p in prompts]  # type: ignore[dict-item]
    limit = max(lengths[0], lengths[2])
    assert limit < min(lengths[1], lengths[3])
    pipeline = PromptPipeline(tokenizer, max_prompt_tokens=limit)
    with caplog.at_level(logging.WARNING, logger="miles.data.pipeline"):
        kept = pipeline(prompts)
    assert [p.prompt for p in kept] == ["hi", "sum"] and pipeline.dropped == 2
    assert "dropped 2 of 4 prompts longer than data.max_prompt_tokens" in caplog.text


def test_misconfiguration_names_the_field(tokenizer: Any, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(str(tmp_path))
    no_template = AutoTokenizer.from_pretrained(str(tmp_path))
    no_template.chat_template = None
    with pytest.raises(SettingsError, match="data.apply_chat_template: the tokenizer has no chat template"):
        PromptPipeline(no_template)
    with pytest.raises(SettingsError, match="data.system_prompt: needs data.apply_chat_template"):
        PromptPipeline(tokenizer, apply_chat_template=False, system_prompt="x")


def test_create_data_source_from_settings(tokenizer: Any, tmp_path: Path) -> None:
    rows = [{"q": f"What is {i}+1?", "a": i + 1} for i in range(6)] + [{"q": "long " * 80, "a": 0}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    settings = DataSettings(
        path=str(path), prompt_key="q", label_key="a", system_prompt="Answer.", max_prompt_tokens=40, seed=5
    )
    manager = PluginManager(entry_points=False).load()
    run = build_run(MilesSettings(data=settings), manager, kinds=[ComponentKind.DATA_SOURCE])
    source = run.data_source(tokenizer)
    assert isinstance(source, JsonlDataSource) and len(source) == 6 and source.dropped == 1
    batch = source.next_batch(6)
    assert sorted(p.label for p in batch) == [1, 2, 3, 4, 5, 6]
    for p in batch:
        expected = [{"role": "system", "content": "Answer."}, {"role": "user", "content": f"What is {p.label - 1}+1?"}]
        assert p.prompt_ids == reference_ids(tokenizer, expected)
    with pytest.raises(SettingsError, match="data.max_prompt_tokens: needs a tokenizer"):
        create_data_source(run["data.source"].create, settings, tokenizer=None)
    with pytest.raises(SettingsError, match="data.path: not set"):
        create_data_source(run["data.source"].create, DataSettings(), tokenizer=tokenizer)
    with pytest.raises(SettingsError, match="data.source: unknown data source 'csv'"):
        build_run(
            MilesSettings(data=DataSettings(path=str(path), source="csv")), manager, kinds=[ComponentKind.DATA_SOURCE]
        )


def test_the_run_reads_a_pipeline_directorys_prompt_tokenizer(tokenizer: Any, tmp_path: Path) -> None:
    """A diffusers pipeline directory (``model_index.json``) keeps its prompt tokenizer in ``tokenizer/``."""
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    manager = PluginManager(entry_points=False).load()
    settings = MilesSettings(train={"model_path": str(tmp_path)})
    run = build_run(settings, manager, kinds=[ComponentKind.DATA_SOURCE])
    assert run.tokenizer("What is 2+3?")["input_ids"] == tokenizer("What is 2+3?")["input_ids"]
