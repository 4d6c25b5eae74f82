"""Tiny reward models built from a config (no hub), for tests and examples of the ``model`` reward.

- :func:`build_tiny_classifier`: a random ``Qwen2ForSequenceClassification`` (or, ``kind = "process"``, a
  ``Qwen2ForTokenClassification``) with the test tokenizer; ``constant = True`` zeroes its head, so it scores
  every input 0 (a degenerate reward model);
- :func:`build_modulo_judge`: a causal LM whose greedy answer to any prompt is one fixed token chosen by the
  prompt's last token id — ``answers[last_id % len(answers)]`` — so a judge's verdicts are known in advance
  (and, with an answer that is no verdict, some of them are garbage).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

__all__ = ["build_modulo_judge", "build_tiny_classifier", "modulo_verdict"]


def build_tiny_classifier(
    path: str | os.PathLike[str],
    *,
    kind: Literal["classifier", "process"] = "classifier",
    num_labels: int = 1,
    seed: int = 0,
    constant: bool = False,
) -> Path:
    """A random tiny sequence (or token) classifier with the test tokenizer, saved as safetensors; returns its
    directory. Deterministic given ``seed``."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    from miles.testing.models import build_tokenizer, tiny_config

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = tiny_config(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    config.num_labels = num_labels
    torch.manual_seed(seed)
    auto = AutoModelForSequenceClassification if kind == "classifier" else AutoModelForTokenClassification
    model = auto.from_config(config)
    if constant:
        with torch.no_grad():
            for p in model.score.parameters():
                p.zero_()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def build_modulo_judge(path: str | os.PathLike[str], answers: Sequence[str] = ("1", "0", "x")) -> Path:
    """A tiny Qwen2 whose greedy next token after any prompt is ``answers[last_token_id % len(answers)]`` (each
    answer one token of the test tokenizer); returns its directory.

    Its layers add nothing to the residual stream (output projections zero), so the last position's hidden
    state is its token's embedding, ``10 x e_(id % k)``; the head maps ``e_j`` to answer ``j``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from miles.testing.models import build_tokenizer, tiny_config

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    ids = [tokenizer.convert_tokens_to_ids(a) for a in answers]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(f"every answer must be one token of the test tokenizer: {list(answers)}")
    config = tiny_config(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model = AutoModelForCausalLM.from_config(config)
    k = len(answers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        embed = model.get_input_embeddings().weight
        embed.zero_()
        embed[torch.arange(embed.shape[0]), torch.arange(embed.shape[0]) % k] = 10.0
        head = model.get_output_embeddings().weight
        head.zero_()
        for j, token in enumerate(ids):
            head[token, j] = 5.0
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def modulo_verdict(prompt_ids: Sequence[int], answers: Sequence[str] = ("1", "0", "x")) -> str:
    """What :func:`build_modulo_judge`'s model answers to ``prompt_ids`` (computed, not asked)."""
    return answers[int(prompt_ids[-1]) % len(answers)]
