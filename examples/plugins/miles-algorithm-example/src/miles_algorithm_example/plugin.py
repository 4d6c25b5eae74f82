"""The plugin module the ``algorithm_example`` entry point names: it registers ``median_grpo``.

``miles plugins list`` imports every plugin module, so this one stays cheap: the algorithm module imports
torch only inside its functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import miles
from miles_algorithm_example.algorithm import MedianGRPO

if TYPE_CHECKING:
    from miles.components import Register


@miles.hookimpl
def miles_register_algorithms(register: Register) -> None:
    """Register the ``median_grpo`` algorithm."""
    register(MedianGRPO)
