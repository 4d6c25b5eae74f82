"""Miles on SGLang: rollout engine ``sglang`` (one ``sglang.launch_server`` per engine, SGLang's HTTP
protocol for generation, weight updates, memory release and sampled verification) and transport
``sglang_tensor`` (CUDA IPC to a colocated engine). See ``docs/how-to/sglang.md``."""

from __future__ import annotations

__version__ = "0.1.0"
