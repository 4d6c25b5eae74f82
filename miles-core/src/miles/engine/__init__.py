"""The local rollout engine (``miles serve``): a torch engine for HF causal LMs that speaks SGLang's
native HTTP protocol, with continuous batching, a radix prefix cache, exact fp32 logprobs and MoE
routed experts.

Modules: :mod:`~miles.engine.model_runner` (the model over KV buffers), :mod:`~miles.engine.sampling`,
:mod:`~miles.engine.radix_cache`, :mod:`~miles.engine.scheduler` (continuous batching),
:mod:`~miles.engine.parsing` and :mod:`~miles.engine.server` (HTTP), :mod:`~miles.engine.launch`, and
:mod:`~miles.engine.plugin` (the ``local`` rollout-engine backend). Importing this package is cheap.
"""
