"""Settings: one validated tree, from a TOML/YAML file, ``MILES_*`` environment variables and ``--set``."""

from miles.settings.loader import load_settings
from miles.settings.model import MilesSettings, PluginSpec

__all__ = ["MilesSettings", "PluginSpec", "load_settings"]
