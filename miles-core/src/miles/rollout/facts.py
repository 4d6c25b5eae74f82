"""What the trainer must know about how each response was sampled, gathered at rollout time.

Two facts travel with every :class:`~miles.types.Sample`:

- **logit masks** (:func:`logit_masks`): the token ids the engine set to ``-inf`` before it sampled, and
  reported the logprob of, each response position — EOS and ``stop_token_ids`` before ``min_new_tokens``
  (the local engine's rule, and SGLang's min-new-tokens penalizer). The reported logprob is that of the
  renormalised distribution, so a trainer that scores the unmasked one is off by ``log(1 - p(EOS))`` at
  every masked position; the trainer applies the same mask (:mod:`miles.training.logit_masks`).
- **routed experts** (MoE models): the experts the engine's routers chose for every token, asked for on
  every ``/generate`` call by :class:`RoutedExpertsClient`, so that custom rollout functions get them too.

Top-k, top-p and min-p change which token is drawn but not the reported logprob (both engines report the
distribution before truncation), and neither engine applies a logit bias here: nothing to record for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from miles.rollout.client import EngineClient
from miles.types import LogitMask

if TYPE_CHECKING:
    from miles.models import RoutedLayout
    from miles.rollout.protocol import GenerateOutput, PauseMode, SamplingParams

__all__ = ["RoutedExpertsClient", "logit_masks", "shape_routed_experts"]


def logit_masks(
    params: SamplingParams, eos_token_ids: Sequence[int], *, start: int = 0, length: int
) -> list[LogitMask]:
    """The masks the engine applied to one ``/generate`` call's ``length`` output tokens, placed at response
    position ``start`` (a later turn of a multi-turn response starts after the earlier turns' tokens).

    Before ``min_new_tokens`` output tokens the engine masks the model's EOS ids and ``stop_token_ids``
    (``ignore_eos`` does not lift the mask); none afterwards.
    """
    masked = min(params.min_new_tokens, length)
    ids = tuple(sorted({*(int(t) for t in eos_token_ids), *(int(t) for t in params.stop_token_ids)}))
    if masked <= 0 or not ids:
        return []
    return [LogitMask(ids, start, start + masked)]


def shape_routed_experts(output: GenerateOutput, layout: RoutedLayout | None) -> GenerateOutput:
    """``output`` with its routed experts as ``[tokens, moe layers, topk]`` int32 and their shape in
    ``meta_info["routed_experts_shape"]``, as Miles' own engine sends them.

    SGLang (0.5.23, ``tokenizer_manager.py``) sends a flat base64 int32 array of every token but the last
    (``prompt + output - 1`` rows: ``batch_result_processor.py``) x ``num_hidden_layers`` x
    ``num_experts_per_tok``, dense layers included, and no shape: it is read with the model's ``layout`` and
    its MoE layers kept. Raises :class:`~miles.errors.EngineError` when the array cannot be read that way (a
    run never trains on routing it cannot place)."""
    import numpy as np

    from miles.errors import EngineError

    if output.routed_experts is None or output.meta_info.get("routed_experts_shape") is not None:
        return output
    if layout is None:
        raise EngineError(
            "routed_experts: the engine sent them without a shape and no router layout was given to read them "
            "with (miles.models.routed_layout of the policy; a dense model's config names no MoE layers)"
        )
    flat = np.frombuffer(output.routed_experts, dtype=np.int32)
    per_token = layout.num_layers * layout.topk
    if flat.size % per_token:
        raise EngineError(
            f"routed_experts: {flat.size} int32 values are not whole rows of {layout.num_layers} layers x "
            f"{layout.topk} experts (the model's config)"
        )
    rows = flat.size // per_token
    moe = np.ascontiguousarray(flat.reshape(rows, layout.num_layers, layout.topk)[:, list(layout.moe_layers), :])
    meta = {**output.meta_info, "routed_experts_shape": [rows, len(layout.moe_layers), layout.topk]}
    return replace(output, routed_experts=moe.tobytes(), meta_info=meta)


class RoutedExpertsClient(EngineClient):
    """An :class:`EngineClient` that asks every ``/generate`` for the routed experts (MoE runs: routing
    replay and the routing-agreement metric), in one shape whatever the engine
    (:func:`shape_routed_experts`), and otherwise forwards to ``inner``.

    :param layout: the policy's routers (:func:`miles.models.routed_layout`), to read an engine that sends
        no shape (SGLang)."""

    def __init__(self, inner: EngineClient, layout: RoutedLayout | None = None) -> None:
        self.inner = inner
        self.layout = layout

    @property
    def urls(self) -> Sequence[str]:
        return self.inner.urls

    @property
    def lora_path(self) -> str | None:
        """The inner client's: an adapter set through this wrapper reaches every request (LoRA on an MoE)."""
        return self.inner.lora_path

    @lora_path.setter
    def lora_path(self, value: str | None) -> None:
        self.inner.lora_path = value

    @property
    def return_sampling_mask(self) -> bool:
        """The inner client's (sampling-mask replay of an MoE policy)."""
        return self.inner.return_sampling_mask

    @return_sampling_mask.setter
    def return_sampling_mask(self, value: bool) -> None:
        self.inner.return_sampling_mask = value

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams,
        *,
        return_logprob: bool = True,
        return_routed_experts: bool = True,
        routing_key: str | None = None,
        rid: str | None = None,
        image_data: Sequence[str] | None = None,
    ) -> list[GenerateOutput]:
        """:meth:`EngineClient.generate` with ``return_routed_experts`` always on, shaped."""
        outputs = await self.inner.generate(
            input_ids,
            sampling_params,
            return_logprob=return_logprob,
            return_routed_experts=True,
            routing_key=routing_key,
            rid=rid,
            **({"image_data": image_data} if image_data else {}),
        )
        return [shape_routed_experts(output, self.layout) for output in outputs]

    async def abort(self, rid: str | None = None) -> None:
        await self.inner.abort(rid)

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        await self.inner.pause_generation(mode)

    async def continue_generation(self) -> None:
        await self.inner.continue_generation()

    async def flush_cache(self) -> None:
        await self.inner.flush_cache()

    async def model_info(self) -> list[dict[str, Any]]:
        return await self.inner.model_info()

    async def server_info(self) -> list[dict[str, Any]]:
        return await self.inner.server_info()

    async def models(self, url: str) -> list[dict[str, Any]]:
        return await self.inner.models(url)

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        await self.inner.update_weights_from_disk(model_path, weight_version)

    async def call(self, url: str, endpoint: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self.inner.call(url, endpoint, payload)

    async def update_weight_version(self, weight_version: str) -> None:
        await self.inner.update_weight_version(weight_version)

    async def health(self) -> list[bool]:
        return await self.inner.health()

    async def close(self) -> None:
        """Nothing of its own: the inner client is closed by its owner."""
