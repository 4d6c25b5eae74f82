"""Reading rows from files and turning them into :class:`~miles.data.base.Prompt` objects.

Each reader yields ``(row, where)`` pairs, ``where`` being ``file:line`` (JSONL), ``file:row`` (Parquet,
1-based) or ``dir[split]:row`` (HF datasets), so that a bad row is reported where a person can find it.
Heavy libraries (``pyarrow``, ``datasets``) are imported only by the reader that needs them.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any

from miles.components import Requirement
from miles.data.base import Prompt
from miles.errors import DataError

__all__ = [
    "DATASETS",
    "PYARROW",
    "expand_paths",
    "iter_hf_rows",
    "iter_jsonl_rows",
    "iter_parquet_rows",
    "row_to_prompt",
]

PYARROW = Requirement("pyarrow", extra="parquet")
"""What the ``parquet`` source reads with."""
DATASETS = Requirement("datasets", extra="hf")
"""What the ``hf`` source reads with."""

log = logging.getLogger(__name__)

Row = tuple[dict[str, Any], str]


def expand_paths(path: str, suffixes: tuple[str, ...]) -> list[str]:
    """``path`` itself when it is a file; every file with one of ``suffixes`` (sorted) in a directory."""
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(suffixes))
        if not files:
            raise DataError(f"{path}: directory holds no {' / '.join(suffixes)} files")
        return files
    raise DataError(f"{path}: no such file or directory (data.path)")


def iter_jsonl_rows(path: str) -> Iterator[Row]:
    """Rows of a JSONL file (or a directory of them); blank lines are skipped."""
    for file in expand_paths(path, (".jsonl", ".json")):
        name = os.path.basename(file)
        with open(file, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                where = f"{name}:{lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
                yield row, where


def _require(requirement: Requirement, module: str, source: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(
            f"data source {source!r} needs the {requirement.module!r} package: {requirement.install}"
        ) from None


def iter_parquet_rows(path: str, batch_size: int = 4096) -> Iterator[Row]:
    """Rows of a Parquet file (or a directory of them), read in record batches with ``pyarrow``."""
    pq = _require(PYARROW, "pyarrow.parquet", "parquet")
    for file in expand_paths(path, (".parquet",)):
        name = os.path.basename(file)
        try:
            reader = pq.ParquetFile(file)
        except Exception as exc:  # pyarrow raises ArrowInvalid and friends
            raise DataError(f"{name}: not a readable Parquet file ({exc})") from None
        index = 0
        for batch in reader.iter_batches(batch_size=batch_size):
            for row in batch.to_pylist():
                index += 1
                yield row, f"{name}:{index}"


def iter_hf_rows(path: str, *, split: str, cache_dir: str | None) -> Iterator[Row]:
    """Rows of a local Hugging Face data set: a ``save_to_disk`` directory, or JSON / CSV / Parquet files.

    Never touches the hub: directories are read with ``load_from_disk`` and files with the packaged
    builders (``json``, ``csv``, ``parquet``) over ``data_files``.
    """
    datasets = _require(DATASETS, "datasets", "hf")
    if os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, marker)) for marker in ("dataset_dict.json", "state.json")
    ):
        loaded = datasets.load_from_disk(path)
    elif os.path.exists(path):
        files = expand_paths(path, (".jsonl", ".json", ".csv", ".parquet"))
        kinds = {os.path.splitext(f)[1] for f in files}
        builder = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
        builders = {builder[k] for k in kinds}
        if len(builders) != 1:
            raise DataError(f"{path}: mixes file formats {sorted(kinds)}; use one format per data set")
        loaded = datasets.load_dataset(builders.pop(), data_files={split: files}, cache_dir=cache_dir)
    else:
        raise DataError(f"{path}: no such file or directory (data.path); the hf source reads local data only")
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{path}: no split {split!r} (available: {', '.join(loaded)}); set data.source.split")
        loaded = loaded[split]
    name = f"{os.path.basename(os.path.normpath(path))}[{split}]"
    for index, row in enumerate(loaded, start=1):
        yield dict(row), f"{name}:{index}"


def _check_messages(messages: list[Any], where: str, key: str) -> None:
    if not messages:
        raise DataError(f"{where}: empty prompt (key {key!r} holds an empty message list)")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: {key}[{i}] must be a message object, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise DataError(f"{where}: {key}[{i}] needs a string 'role'")
        if not isinstance(content, (str, list)):
            raise DataError(f"{where}: {key}[{i}] needs a 'content' string (or a list of parts)")


def row_to_prompt(row: dict[str, Any], where: str, *, prompt_key: str, label_key: str) -> Prompt:
    """Validate one row: the prompt is a non-empty string or a list of chat messages.

    The label (``label_key``) is optional; every other key of the row goes to ``metadata``.
    """
    if prompt_key not in row:
        raise DataError(
            f"{where}: missing key {prompt_key!r} (data.prompt_key; row keys: {', '.join(map(str, row)) or 'none'})"
        )
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: empty prompt (key {prompt_key!r})")
    elif isinstance(prompt, list):
        _check_messages(prompt, where, prompt_key)
    else:
        raise DataError(
            f"{where}: key {prompt_key!r} must be a string or a list of chat messages, got {type(prompt).__name__}"
        )
    metadata = {k: v for k, v in row.items() if k not in (prompt_key, label_key)}
    return Prompt(prompt=prompt, label=row.get(label_key), metadata=metadata, source=where)
