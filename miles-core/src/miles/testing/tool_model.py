"""A tiny model that calls tools: a config-built HF model fine-tuned in-process (seconds on a CPU) to
answer arithmetic questions with calculator tool calls in one chat format.

A randomly initialised model never writes a well-formed tool call, so multi-turn agent tests would never
see one. This one is trained on conversations rendered with the given tokenizer's template (or an
override): each question is answered by a tool call (two for "a + b and c + d" questions, in formats
that allow several), each tool result by ``ANSWER: n``, optionally after a ``<think>`` block. Sampled
at temperature 1 it writes parseable calls most of the time, so sessions get real tool-call turns,
consecutive tool messages and thinking blocks — all sampled by the policy.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Literal

__all__ = ["EXPRESSIONS", "ToolFormat", "build_tool_calling_model", "conversation", "reply_text", "tool_model_for"]

ToolFormat = Literal["hermes", "llama3_json"]

SYSTEM = "You are a calculator agent. Call the calculator for every sum, then reply with ANSWER: <number>."


def _call_text(fmt: ToolFormat, expression: str) -> str:
    if fmt == "llama3_json":
        return json.dumps({"name": "calculator", "parameters": {"expression": expression}})
    return (
        "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "\n</tool_call>"
    )


def reply_text(fmt: ToolFormat, expressions: list[str] | None, answer: str = "", *, thinking: bool = False) -> str:
    """The text the model is trained to write: tool calls for ``expressions``, else ``ANSWER: answer``."""
    body = "\n".join(_call_text(fmt, e) for e in expressions) if expressions else f"ANSWER: {answer}"
    if thinking:
        thought = "I will use the calculator." if expressions else "The calculator answered."
        return f"<think>\n{thought}\n</think>\n\n{body}"
    return body


EXPRESSIONS = ("2 + 3", "7 * 6", "12 - 5", "9 + 10", "8 * 8", "15 / 3")
"""What the model learns to send to the calculator (a few fixed strings: easy to learn exactly)."""


def conversation(
    rng: random.Random, fmt: ToolFormat, questions: int, *, thinking: bool = False
) -> list[dict[str, Any]]:
    """A training conversation: ``questions`` rounds of question, tool call(s), tool result(s), answer."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for _ in range(questions):
        calls = [rng.choice(EXPRESSIONS) for _ in range(2 if fmt == "hermes" and rng.random() < 0.3 else 1)]
        question = " and ".join(f"{rng.randint(2, 99)} + {rng.randint(2, 99)}" for _ in calls)
        messages.append({"role": "user", "content": f"What is {question}?"})
        messages.append({"role": "assistant", "content": reply_text(fmt, calls, thinking=thinking)})
        results = [str(rng.randint(2, 99)) for _ in calls]
        for result in results:
            messages.append({"role": "tool", "content": result, "tool_call_id": "call"})
        messages.append({"role": "assistant", "content": reply_text(fmt, None, ", ".join(results), thinking=thinking)})
    return messages


_DECISION_TOKENS, _DECISION_WEIGHT = 8, 6
"""The first tokens of a reply decide between a tool call and an answer: they weigh more in the loss."""

_SAMPLED_NEGATIVES = 2048
"""Above this many tokens beyond those of the training data, the softmax of the loss runs over the data's
tokens plus this many others drawn afresh each step (a sampled softmax): SmolLM2's 49,152-token vocabulary
would otherwise make the head and its softmax ~90% of the build (300 steps x ~1,000 target tokens x 49,152
logits). Every token the data holds is in every step's softmax; the others are each pushed down ~12 times
over the 300 steps, which keeps them far below the trained tokens when the engine samples the full
vocabulary."""


def _supervised(renderer: Any, messages: list[dict[str, Any]], tools: list[Any]) -> tuple[list[int], list[int]]:
    """Token ids of the conversation and the loss weight of each token: the assistant replies (through
    their end token), their first tokens more."""
    full = renderer.ids(messages, tools=tools)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(renderer.ids(messages[:i], tools=tools, add_generation_prompt=True))
        turn = renderer.ids(messages[: i + 1], tools=tools)
        end = max((j for j in range(start, len(turn)) if turn[j] in renderer.end_ids), default=len(turn) - 1) + 1
        for j in range(start, end):
            mask[j] = _DECISION_WEIGHT if j < start + _DECISION_TOKENS else 1
    return full, mask


def build_tool_calling_model(
    path: str | os.PathLike[str],
    tokenizer: Any,
    *,
    chat_template: str | None = None,
    tool_format: ToolFormat = "hermes",
    thinking: bool = False,
    arch: Literal["qwen2", "llama"] = "qwen2",
    seed: int = 0,
    steps: int = 300,
    conversations: int = 32,
    questions: int = 10,
    batch: int = 2,
    lr: float = 3e-3,
    max_position_embeddings: int = 8192,
) -> Path:
    """Fine-tune a tiny ``arch`` model to call the calculator; save it with ``tokenizer`` to ``path``.

    Deterministic given ``seed`` (one thread). ``chat_template`` (e.g. a fixed template) is saved as the
    tokenizer's. Returns the directory.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from miles.sessions.append_only import CALCULATOR_TOOL
    from miles.sessions.templates import ChatRenderer
    from miles.testing.models import tiny_config

    out = Path(path)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    renderer = ChatRenderer(tokenizer)
    rng = random.Random(seed)
    data = [
        _supervised(renderer, conversation(rng, tool_format, questions, thinking=thinking), [CALCULATOR_TOOL])
        for _ in range(conversations)
    ]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = tiny_config(
        arch,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    seen = torch.tensor(sorted({t for ids, _ in data for t in ids} | set(renderer.end_ids)))
    sampled = config.vocab_size > len(seen) + _SAMPLED_NEGATIVES
    negatives = torch.Generator().manual_seed(seed)
    for step in range(steps):
        rows = [data[(step * batch + i) % len(data)] for i in range(batch)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in rows])
        weights = torch.tensor([r[1] + [0] * (width - len(r[1])) for r in rows], dtype=torch.float32)[:, 1:]
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
        targets = weights > 0
        labels = ids[:, 1:][targets]
        if sampled:  # the data's tokens and fresh negatives (sorted, so a label's column is a search away)
            drawn = torch.randint(0, config.vocab_size, (_SAMPLED_NEGATIVES,), generator=negatives)
            columns = torch.unique(torch.cat([seen, drawn]))
            logits = hidden[targets] @ model.lm_head.weight[columns].t()
            labels = torch.searchsorted(columns, labels)
        else:
            logits = model.lm_head(hidden[targets])
        losses = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
        loss = (losses * weights[targets]).sum() / weights[targets].sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = pad
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "tool_model.json").write_text(
        json.dumps({"final_loss": float(loss.detach()), "steps": steps, "format": tool_format})
    )
    return out


_VERSION = "4"


def tool_model_for(family: str, *, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The tool-calling tiny model of a chat family, built once and cached (~1-3 min on 2 cores).

    :param family: ``qwen2.5``, ``qwen3`` (trained and saved with the fixed append-only Qwen3 template,
        thinking before every reply), ``llama3.1`` (:data:`miles.testing.chat_templates.FAMILIES`) or
        ``smollm2`` (SmolLM2's real tokenizer and template).
    :param cache_dir: default ``~/.cache/miles/tool-models``; the entry is keyed by everything the model
        depends on (tokenizer, template, training settings, this module's version), so it never goes stale.
    """
    import hashlib
    import shutil

    import torch

    from miles.sessions.templates import FIXED_TEMPLATES
    from miles.testing.chat_templates import FAMILIES, build_chat_tokenizer, smollm2_tokenizer

    if family == "smollm2":
        tokenizer, fmt, thinking, template = smollm2_tokenizer(), "hermes", False, None
    elif family in FAMILIES:
        spec = FAMILIES[family]
        tokenizer, fmt, thinking = build_chat_tokenizer(family), spec.tool_parser, spec.thinking
        template = FIXED_TEMPLATES.get(family)
    else:
        raise KeyError(f"unknown chat family {family!r} (known: {', '.join([*FAMILIES, 'smollm2'])})")
    arch: Literal["qwen2", "llama"] = "llama" if family.startswith("llama") else "qwen2"
    key = hashlib.sha256(
        json.dumps(
            [
                _VERSION,
                family,
                torch.__version__,
                sorted(tokenizer.get_vocab().items()),
                template or tokenizer.chat_template,
                fmt,
                thinking,
                arch,
            ],
        ).encode()
    ).hexdigest()[:16]
    root = Path(cache_dir or Path.home() / ".cache" / "miles" / "tool-models")
    out = root / f"{family}-{key}"
    if (out / "tool_model.json").exists():
        return out
    tmp = root / f"{family}-{key}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    build_tool_calling_model(tmp, tokenizer, chat_template=template, tool_format=fmt, thinking=thinking, arch=arch)  # type: ignore[arg-type]
    try:
        tmp.rename(out)
    except OSError:  # another process cached it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out
