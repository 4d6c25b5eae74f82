"""The built-in ``data`` plugin: registers the ``jsonl``, ``parquet`` and ``hf`` data sources.

Cheap to import: the sources import ``pyarrow`` / ``datasets`` only when they read a file.
"""

from __future__ import annotations

from miles.components import Register
from miles.data.sources import HFDataSource, JsonlDataSource, ParquetDataSource
from miles.markers import hookimpl


@hookimpl
def miles_register_data_sources(register: Register) -> None:
    register(JsonlDataSource)
    register(ParquetDataSource)
    register(HFDataSource)
