"""The plugin module the ``shm_transport`` entry point names: it registers the ``shm`` transport.

``miles plugins list`` imports every plugin module, so this one stays cheap: the transport module imports
torch only inside its methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import miles
from miles_shm_transport.transport import ShmTransport

if TYPE_CHECKING:
    from miles.components import Register


@miles.hookimpl
def miles_register_transports(register: Register) -> None:
    """Register the ``shm`` transport."""
    register(ShmTransport)
