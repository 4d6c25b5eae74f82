"""The built-in data sources: ``jsonl``, ``parquet`` and ``hf`` (local Hugging Face data sets).

All three load the whole file once (validating every row and tokenising it through the pipeline), then
serve an endless stream: epoch ``e`` visits every prompt once, in an order shuffled from ``seed + e``.
The position is two integers (epoch, offset), so a resumed run sees exactly the prompts the
uninterrupted run would have seen.
"""

from __future__ import annotations

import logging
import os
import random
from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from miles.components import ComponentSettings, SettingsT
from miles.data.base import DataSource, Prompt
from miles.data.rows import DATASETS, PYARROW, Row, iter_hf_rows, iter_jsonl_rows, iter_parquet_rows, row_to_prompt
from miles.data.vision import check_row_images, is_vision_model
from miles.errors import DataError, SettingsError

if TYPE_CHECKING:
    from miles.settings.model import MilesSettings

__all__ = ["FileDataSource", "HFDataSource", "HFSourceSettings", "JsonlDataSource", "ParquetDataSource"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1


class FileDataSource(DataSource[SettingsT]):
    """A data source over a finite table of rows, read once, served endlessly across epochs."""

    def prepare(self) -> None:
        """Read every row through the pipeline (once)."""
        path, pipeline = self.path, self.pipeline
        prompts = [
            row_to_prompt(row, where, prompt_key=self.prompt_key, label_key=self.label_key)
            for row, where in self.rows()
        ]
        read = len(prompts)
        if pipeline is not None:
            prompts = pipeline(prompts)
        if not prompts:
            why = f" (all {read} dropped by the pipeline)" if read else ""
            raise DataError(f"{path}: no prompts{why}")
        self.prompts: list[Prompt] = prompts
        """Every prompt of the data set, in file order."""
        self.dropped = read - len(prompts)
        """Rows dropped by the pipeline (too long)."""
        self.epoch = 0
        self.offset = 0
        self._order = self._epoch_order(0)
        log.info("%s source %s: %d prompts (%d dropped)", self.name, path, len(prompts), self.dropped)

    @abstractmethod
    def rows(self) -> Iterator[Row]:
        """``(row, "file:line")`` pairs of the data set, in file order."""

    def __len__(self) -> int:
        return len(self.prompts)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts (copies, with their own ``metadata`` dict), crossing epochs as needed."""
        if n < 1:
            raise ValueError(f"next_batch needs n >= 1, got {n}")
        batch: list[Prompt] = []
        while len(batch) < n:
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order(self.epoch)
                log.info("data source %s: epoch %d", self.path, self.epoch)
            take = min(n - len(batch), len(self._order) - self.offset)
            # copies: a consumer annotating a prompt's metadata must not change the next epoch's
            batch.extend(
                replace(self.prompts[i], metadata=dict(self.prompts[i].metadata))
                for i in self._order[self.offset : self.offset + take]
            )
            self.offset += take
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.prompts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("epoch", "offset", "num_prompts"):
            if not isinstance(state.get(key), int):
                raise DataError(f"data source state: missing or invalid {key!r} in {state!r}")
        if state["num_prompts"] != len(self.prompts):
            raise DataError(
                f"{self.path}: the checkpoint was taken over {state['num_prompts']} prompts, the data now has "
                f"{len(self.prompts)}; resuming would not replay the same prompts"
            )
        if (state.get("seed", self.seed), state.get("shuffle", self.shuffle)) != (self.seed, self.shuffle):
            raise DataError(
                f"{self.path}: the checkpoint used seed={state.get('seed')} shuffle={state.get('shuffle')}, "
                f"the settings say seed={self.seed} shuffle={self.shuffle} (data.seed / data.shuffle)"
            )
        if not 0 <= state["offset"] <= len(self.prompts) or state["epoch"] < 0:
            raise DataError(f"data source state: epoch/offset out of range in {state!r}")
        self.epoch, self.offset = state["epoch"], state["offset"]
        self._order = self._epoch_order(self.epoch)


class JsonlDataSource(FileDataSource[ComponentSettings]):
    """Prompts from a JSONL file (or a directory of them): one JSON object a line."""

    name = "jsonl"

    @classmethod
    def check_settings(cls, options: ComponentSettings, settings: MilesSettings) -> None:
        """Before anything starts: ``data.path`` (and ``data.eval_path``) exist and every row parses and has
        a prompt; the error names the field, where its value came from, and the file and line."""
        from miles.settings.loader import sources_of

        data = settings.data
        model = settings.train.model_path
        vision = model is not None and is_vision_model(model)
        for field, path in (("data.path", data.path), ("data.eval_path", data.eval_path)):
            if path is None:
                continue
            source = sources_of(settings).of(field)
            base_dir = os.path.dirname(os.path.abspath(path)) if os.path.isfile(path) else path
            try:
                for row, where in iter_jsonl_rows(path):
                    prompt = row_to_prompt(row, where, prompt_key=data.prompt_key, label_key=data.label_key)
                    if vision:  # every image decoded once, before any engine starts
                        check_row_images(
                            prompt, image_key=data.image_key, base_dir=base_dir, max_pixels=data.max_image_pixels
                        )
            except DataError as exc:
                raise SettingsError(f"{field} ({source}): {exc}" if source else f"{field}: {exc}") from None

    def rows(self) -> Iterator[Row]:
        return iter_jsonl_rows(self.path)


class ParquetDataSource(FileDataSource[ComponentSettings]):
    """Prompts from a Parquet file (or a directory of them), read with ``pyarrow``."""

    name = "parquet"
    requires = (PYARROW,)

    def rows(self) -> Iterator[Row]:
        return iter_parquet_rows(self.path)


class HFSourceSettings(ComponentSettings):
    """Settings of the ``hf`` data source."""

    split: str = "train"
    """Split to read (a ``DatasetDict`` directory, or the split name given to loose files)."""
    cache_dir: str | None = None
    """Cache directory of ``datasets`` when it converts loose files (default: its own)."""


class HFDataSource(FileDataSource[HFSourceSettings]):
    """Prompts from a local Hugging Face data set (``save_to_disk`` directory or files); never the hub."""

    name = "hf"
    requires = (DATASETS,)

    def rows(self) -> Iterator[Row]:
        settings = self.settings
        return iter_hf_rows(self.path, split=settings.split, cache_dir=settings.cache_dir)
