"""The ``lora`` adapter: PEFT LoRA on the policy, the base model as the KL reference, adapter-only
weights for the engines and a streaming merge for Hugging Face exports.

Parameter names: the wrapped model's are PEFT's (``base_model.model.<hf name>`` with ``.base_layer`` /
``.lora_A.default`` / ``.lora_B.default`` inside a targeted linear); the adapter's tensors travel and are
saved under PEFT's file naming (the adapter name dropped: ``...q_proj.lora_A.weight``), as
``adapter_model.safetensors`` holds them and SGLang loads them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar

from miles.errors import SettingsError
from miles.training.adapter import LowRankSpec, ModelAdapter
from miles_lora.settings import LoraSettings

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["ADAPTER", "LoraAdapter", "peft_file_name"]

log = logging.getLogger(__name__)

ADAPTER = "default"
"""PEFT's adapter name inside the trainer's model."""
_PREFIX = "base_model.model."


def peft_file_name(name: str) -> str | None:
    """A wrapped model's parameter name as PEFT saves it, for LoRA tensors (``None`` for the others)."""
    for part in ("lora_A", "lora_B"):
        tag = f".{part}.{ADAPTER}."
        if tag in name:
            return name.replace(tag, f".{part}.")
    return None


class LoraAdapter(ModelAdapter[LoraSettings]):
    """LoRA with PEFT (``[train.adapter] name = "lora"``)."""

    name: ClassVar[str] = "lora"

    @property
    def scaling(self) -> float:
        return self.settings.alpha / self.settings.r

    def peft_config(self) -> Any:
        from peft import LoraConfig

        s = self.settings
        inits: dict[str, bool | str] = {"default": True, "gaussian": "gaussian", "random": False}
        init = inits[s.init]
        return LoraConfig(
            r=s.r,
            lora_alpha=s.alpha,
            lora_dropout=s.dropout,
            target_modules=list(s.target_modules),
            init_lora_weights=init,
            bias="none",
            task_type="CAUSAL_LM",
        )

    def apply(self, model: nn.Module) -> nn.Module:
        """``get_peft_model``: base weights frozen, one LoRA pair per targeted linear layer."""
        from peft import get_peft_model

        present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        missing = [t for t in self.settings.target_modules if t not in present]
        if missing:
            raise SettingsError(
                f"train.adapter.target_modules: {', '.join(missing)} not found in {type(model).__name__}"
            )
        peft_model = get_peft_model(model, self.peft_config())
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in peft_model.parameters())
        log.info(
            "LoRA r=%d on %s: %d of %d parameters trainable",
            self.settings.r,
            self.settings.target_modules,
            trainable,
            total,
        )
        return peft_model

    def disabled(self, model: nn.Module) -> AbstractContextManager[Any]:
        """PEFT's ``disable_adapter()``: the base model, computed by the same (sharded) modules."""
        context: AbstractContextManager[Any] = model.disable_adapter()
        return context

    def adapter_name(self, name: str) -> str | None:
        return peft_file_name(name)

    def low_rank(self) -> LowRankSpec:
        """These settings for trainers that build the LoRA layers themselves (``megatron``)."""
        s = self.settings
        return LowRankSpec(
            r=s.r, alpha=float(s.alpha), dropout=s.dropout, target_modules=tuple(s.target_modules), init=s.init
        )

    def adapter_config(self) -> dict[str, Any]:
        """``adapter_config.json`` as PEFT writes it (sets as sorted lists)."""
        config = self.peft_config().to_dict()
        out: dict[str, Any] = json.loads(json.dumps(config, default=lambda v: sorted(v)))
        return out

    def merged(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Base weights with ``W + (alpha / r) B A`` merged in, in HF naming.

        PEFT registers a targeted linear's ``base_layer`` before its ``lora_A`` / ``lora_B``, so at most
        one layer's three tensors are held at a time.
        """
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in named:
            hf = name.removeprefix(_PREFIX)
            for part, tag in (
                ("base", ".base_layer.weight"),
                ("A", f".lora_A.{ADAPTER}.weight"),
                ("B", f".lora_B.{ADAPTER}.weight"),
            ):
                if hf.endswith(tag):
                    module = hf[: -len(tag)]
                    parts = pending.setdefault(module, {})
                    parts[part] = tensor
                    if len(parts) == 3:
                        del pending[module]
                        yield f"{module}.weight", self.low_rank().merge(parts["base"], parts["A"], parts["B"])
                    break
            else:
                yield hf.replace(".base_layer.", "."), tensor
        if pending:
            raise RuntimeError(f"LoRA merge: incomplete layers {sorted(pending)}")
