"""This process's node address, as its launcher tells it: where processes on other nodes reach a service
that this process starts (a rendezvous store, a data path)."""

from __future__ import annotations

import os

__all__ = ["LOOPBACK", "NODE_ADDRESS_ENV", "node_address"]

NODE_ADDRESS_ENV = "MILES_NODE_ADDRESS"
"""The environment variable a launcher sets, in each process it starts, to the address of that process's node
(the ``ray`` launcher: the node's IP, as Ray knows the node)."""
LOOPBACK = "127.0.0.1"


def node_address() -> str:
    """:data:`NODE_ADDRESS_ENV` if the launcher set it, else ``127.0.0.1`` (one host: the ``local``
    launcher, or a process started by hand)."""
    return os.environ.get(NODE_ADDRESS_ENV) or LOOPBACK
