"""Miles: plugin-based reinforcement-learning post-training for language models.

The public facade: :data:`hookimpl` to write plugins, :data:`__version__`, and the data model.
"""

from miles._version import __version__
from miles.markers import hookimpl
from miles.types import Sample, SampleGroup, SampleStatus, WeightSpan

__all__ = ["Sample", "SampleGroup", "SampleStatus", "WeightSpan", "__version__", "hookimpl"]
