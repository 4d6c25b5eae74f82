"""Writing a Hugging Face checkpoint directory from a trainer's weights, the same for every backend.

A backend turns its sharded parameters into buckets of full HF-named tensors (a collective); this module
writes them: safetensors shards of about one bucket each (renamed to HF's ``model-00001-of-00003.safetensors`` names with
an index when there are several, ``model.safetensors`` otherwise), ``config.json``, and the tokenizer and
generation files copied from the model the run started from. Only weights files of an earlier export in the
same directory are replaced; nothing is pickled.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["TOKENIZER_FILES", "write_hf_checkpoint"]

log = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
"""Files copied from the source model next to the exported weights (those that exist): the tokenizer's, and a
vision-language model's image processor."""


def write_hf_checkpoint(
    buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
    path: str | Path,
    *,
    rank: int,
    config: Any,
    source_dir: str | None,
    generation_config: Any = None,
) -> None:
    """Write ``buckets`` (HF names -> full tensors) as a HF safetensors directory at ``path``.

    A collective when ``buckets`` is: every rank iterates it (so the backend's gathers run everywhere);
    rank 0 writes. ``config`` and ``generation_config`` are objects with ``save_pretrained`` (transformers'
    configs); the tokenizer files of ``source_dir`` are copied when it is a directory.
    """
    from safetensors.torch import save_file

    out = Path(path)
    shards: list[tuple[str, list[str]]] = []
    total = 0
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
            old.unlink(missing_ok=True)
    for bucket in buckets:
        if rank != 0:
            continue
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in bucket}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        file = f"shard-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        shards.append((file, list(tensors)))
    if rank != 0:
        return
    if len(shards) == 1:
        (out / shards[0][0]).rename(out / "model.safetensors")
    else:
        weight_map: dict[str, str] = {}
        for i, (file, names) in enumerate(shards):
            final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            (out / file).rename(out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    config.save_pretrained(out)
    if generation_config is not None:
        generation_config.save_pretrained(out)
    if source_dir is not None and Path(source_dir).is_dir():
        for name in TOKENIZER_FILES:
            if name == "generation_config.json" and generation_config is not None:
                continue  # the model's own generation config was written above
            src = Path(source_dir) / name
            if src.exists() and src.resolve() != (out / name).resolve():
                shutil.copy2(src, out / name)
    log.info("exported a Hugging Face checkpoint to %s (%d shard(s), %.1f MB)", out, len(shards), total / 1e6)
