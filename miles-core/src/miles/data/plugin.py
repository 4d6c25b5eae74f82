"""The built-in ``data`` plugin: registers the ``jsonl``, ``parquet``, ``hf`` and ``reasoning_gym`` data sources.

Cheap to import: the sources import ``pyarrow`` / ``datasets`` / ``reasoning_gym`` only when they read.
"""

from __future__ import annotations

from miles.components import Register
from miles.data.reasoning_gym import ReasoningGymDataSource
from miles.data.sources import HFDataSource, JsonlDataSource, ParquetDataSource
from miles.markers import hookimpl


@hookimpl
def miles_register_data_sources(register: Register) -> None:
    register(JsonlDataSource)
    register(ParquetDataSource)
    register(HFDataSource)
    register(ReasoningGymDataSource)
