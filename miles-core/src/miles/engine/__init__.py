"""The local rollout engine (``miles serve``): a torch engine for HF causal LMs that speaks SGLang's
native HTTP protocol, with continuous batching, a radix prefix cache, exact fp32 logprobs and MoE
routed experts.

Modules: :mod:`~miles.engine.model_runner` (the model over KV buffers), :mod:`~miles.engine.sampling`,
:mod:`~miles.engine.radix_cache`, :mod:`~miles.engine.scheduler` (continuous batching),
:mod:`~miles.engine.parsing`, :mod:`~miles.engine.protocol_app` (the protocol's shared routes) and
:mod:`~miles.engine.server` (HTTP), the built-in route groups (:mod:`~miles.engine.weight_routes`,
:mod:`~miles.engine.weight_delta`, :mod:`~miles.engine.lora_routes`), :mod:`~miles.engine.launch`, and
:mod:`~miles.engine.plugin` (the ``local`` rollout-engine backend). Importing this package is cheap.

**The border.** The engine is extended only through hooks: a plugin adds routes with ``miles_engine_routes``
(miles-p2p's receiver, the core's own weight, ``disk_delta`` and LoRA routes). Code outside ``miles.engine``
(the backend packages, third-party plugins) imports only these declared public modules, whose names keep
their meaning across releases (a module that moves leaves a re-export for one release):

- :mod:`miles.engine.state`: :class:`~miles.engine.state.EngineState`, the local engine as a route sees it
  (running work on the scheduler thread, the served model, pausing, the weight version);
- :mod:`miles.engine.weights`: the served weights by HF name (``served_parameters``, ``parameter_aliases``,
  ``weights_checksum``);
- :mod:`miles.engine.responses`: SGLang's error shapes and the control-call wrapper ``admin``;
- :mod:`miles.engine.protocol_app`: the protocol-server skeleton another engine builds on (``ServedEngine``,
  ``create_protocol_app``; miles-diffusion's image engine);
- :mod:`miles.engine.faults`: fault injection for failover tests of a weight path;
- :mod:`miles.engine.invariant`: the batch-invariant ops the deterministic engine computes with (miles-fsdp's
  true on-policy forward computes with them too);
- :mod:`miles.engine.replay`: the deterministic engine's logprobs replayed outside it (miles-fsdp's true
  on-policy replica, for the models the invariant ops do not cover);
- :mod:`miles.engine.plugin`: the ``local`` backend (``LocalEngine``, ``LocalEngineSettings``);
- :mod:`miles.engine.process`: deprecated, re-exports :class:`miles.testing.engine.EngineProcess` (goes in 0.2).

Every other module is private; ``.importlinter`` (contract ``engine-border``) keeps the backend packages
out of them.
"""

from __future__ import annotations

__all__ = ["PUBLIC_MODULES"]

PUBLIC_MODULES: tuple[str, ...] = (
    "miles.engine.state",
    "miles.engine.weights",
    "miles.engine.responses",
    "miles.engine.protocol_app",
    "miles.engine.faults",
    "miles.engine.invariant",
    "miles.engine.replay",
    "miles.engine.plugin",
    "miles.engine.process",
)
"""The declared public modules of the local engine (listed in this package's docstring)."""
