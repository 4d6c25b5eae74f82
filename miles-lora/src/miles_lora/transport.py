"""The ``lora`` transport: pushes carry only the adapter's tensors.

Rank 0 writes the adapter of each version as a PEFT directory (``adapter_model.safetensors`` +
``adapter_config.json``) under ``{run_dir}/lora/``, has every engine load it with SGLang's
``/load_lora_adapter {lora_name, lora_path}`` and bump its weight version, and from then on the rollout
client sends ``lora_path`` with every generate request. With ``delivery = "tensors"`` nothing is written:
the adapter travels in the request (``/load_lora_adapter_from_tensors``, base64 safetensors; local
engines only). :meth:`LoraTransport.verify` asks each engine which adapters it serves (``/lora_adapters``)
and compares the checksums: an adapter an engine lacks is named, as is a tensor that differs.

SGLang engines (``EngineCapabilities.lora_adapters`` false) refuse to load a name they serve and have no
checksum route: each push unloads the previous version first (``/unload_lora_adapter``) and is verified
through ``GET /v1/models`` (the engine serves ``lora_name`` from this push's directory); SGLang reads the
adapter's files itself. Their ``/load_lora_adapter_from_tensors`` takes SGLang's own pickled payloads,
which Miles does not send: ``delivery = "tensors"`` is refused for them.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from miles.components import ComponentSettings
from miles.errors import SettingsError, WeightVerificationError
from miles.transport.base import WeightTransport
from miles.types import PushReport

if TYPE_CHECKING:
    from miles.rollout.client import EngineClient
    from miles.training.adapter import ModelAdapter
    from miles.training.trainer import DistContext, Trainer, WeightBucket

__all__ = ["LoraTransport", "LoraTransportSettings"]

log = logging.getLogger(__name__)


class LoraTransportSettings(ComponentSettings):
    """Settings of the ``lora`` transport."""

    delivery: Literal["disk", "tensors"] = "disk"
    """``disk``: write a PEFT adapter directory under ``{run_dir}/lora`` and have the engines load it
    (``/load_lora_adapter``; engines on this host or a shared file system); ``tensors``: send the adapter in
    the request (``/load_lora_adapter_from_tensors``, a base64 safetensors payload; engines anywhere)."""
    keep_versions: int = Field(2, ge=1)
    """Adapter directories kept under ``{run_dir}/lora`` (older ones are removed)."""


class LoraTransport(WeightTransport[LoraTransportSettings]):
    """Adapter-only pushes through SGLang's ``/load_lora_adapter`` (``[transport] name = "lora"``)."""

    name: ClassVar[str] = "lora"

    def __init__(self, settings: LoraTransportSettings, *, run_dir: str, model_path: str | None, engine_dtype: str):
        super().__init__(settings, run_dir=run_dir, model_path=model_path, engine_dtype=engine_dtype)
        self.root = Path(run_dir) / "lora"
        self.adapter: ModelAdapter[Any] | None = None
        self.client: EngineClient | None = None
        self.written: list[Path] = []

    @property
    def lora_name(self) -> str:
        assert self.adapter is not None
        return str(getattr(self.adapter.settings, "lora_name", self.adapter.name))

    def attach(self, trainer: Trainer) -> None:
        if trainer.adapter is None:
            raise SettingsError("transport 'lora' pushes adapters only: set train.adapter (name = \"lora\")")
        self.adapter = trainer.adapter

    @property
    def replaces(self) -> bool:
        """Whether the engines replace an adapter loaded again under its name and serve ``/lora_adapters``
        (the local engine); SGLang does neither."""
        return self.engine_capabilities is None or self.engine_capabilities.lora_adapters

    async def connect(self, client: EngineClient | None, dist: DistContext) -> None:
        if self.settings.delivery == "tensors" and not self.replaces:
            raise SettingsError(
                'transport.delivery = "tensors": SGLang\'s /load_lora_adapter_from_tensors takes its own pickled '
                'payloads, which Miles does not send; use delivery = "disk" (a directory the engines can read)'
            )
        self.client = client
        if dist.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)

            # a resumed run's earlier versions count towards keep_versions
            def version_of(path: Path) -> int:
                tail = path.name.rsplit("-v", 1)[-1]
                return int(tail) if tail.isdigit() else -1

            self.written = sorted(self.root.glob(f"{self.lora_name}-v*"), key=version_of)

    async def push(self, buckets: Iterable[WeightBucket], *, version: str, dist: DistContext) -> PushReport:
        """Gather the adapter (every rank iterates), write it, have every engine load it (rank 0)."""
        import torch
        from safetensors.torch import save_file

        from miles.transport.verify import tensor_checksum

        if self.adapter is None:
            raise RuntimeError("transport 'lora': push before attach()")
        start = time.perf_counter()
        report = PushReport(version=version)
        dtype = getattr(torch, self.engine_dtype)
        tensors: dict[str, torch.Tensor] = {}
        for bucket in buckets:
            if dist.rank == 0:
                tensors.update({n: t.detach().to("cpu", dtype).contiguous() for n, t in bucket})
        if dist.rank != 0:
            return report
        if not tensors:
            raise RuntimeError("transport 'lora': the trainer yielded no adapter tensors")
        target = self.root / f"{self.lora_name}-v{version}"
        config = {**self.adapter.adapter_config(), "base_model_name_or_path": self.model_path}
        if self.settings.delivery == "disk":
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            save_file(tensors, str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
            (target / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
            self.written = [p for p in self.written if p != target] + [target]
            while len(self.written) > self.settings.keep_versions:
                shutil.rmtree(self.written.pop(0), ignore_errors=True)
        report.num_tensors = len(tensors)
        report.num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        report.checksums = {n: tensor_checksum(t) for n, t in tensors.items()}
        if self.client is None:
            raise RuntimeError("transport 'lora': push on rank 0 before connect() gave it the engines")
        body: dict[str, Any] = {"lora_name": self.lora_name, "lora_path": str(target)}
        endpoint = "/load_lora_adapter"
        if self.settings.delivery == "tensors":
            import base64

            from safetensors.torch import save

            payload = base64.b64encode(save(tensors)).decode("ascii")
            endpoint = "/load_lora_adapter_from_tensors"
            body = {
                "lora_name": self.lora_name,
                "config_dict": config,
                "serialized_tensors": payload,
                "load_format": "safetensors",
                "lora_id": self._served_as(version),
            }
        for url in self.client.urls:
            if not self.replaces and self.lora_name in await self._served(self.client, url):
                await self.client.call(url, "/unload_lora_adapter", {"lora_name": self.lora_name})
            await self.client.call(url, endpoint, body)
            await self.client.call(url, "/update_weight_version", {"new_version": version})
        self.client.lora_path = self.lora_name  # rollouts from now on run the adapter
        report.seconds = time.perf_counter() - start
        report.metrics["weight_sync/adapter_bytes"] = float(report.num_bytes)
        log.info(
            "lora transport: %s v%s, %d tensors, %.2f MB in %.2fs",
            self.lora_name,
            version,
            report.num_tensors,
            report.num_bytes / 1e6,
            report.seconds,
        )
        return report

    def _served_as(self, version: str) -> str:
        """The ``lora_path`` an engine reports for ``version``: its directory, or its id (``tensors``)."""
        if self.settings.delivery == "tensors":
            return f"{self.lora_name}-v{version}"
        return str(self.root / f"{self.lora_name}-v{version}")

    @staticmethod
    async def _served(client: EngineClient, url: str) -> dict[str, str]:
        """The LoRA adapters an engine serves, by name, with where each came from (``GET /v1/models``)."""
        return {str(m["id"]): str(m.get("root")) for m in await client.models(url) if m.get("parent")}

    async def verify(self, client: EngineClient, report: PushReport) -> dict[str, float]:
        """Every engine serves this push's adapter, at the push's version, tensor for tensor (SGLang: from
        this push's directory, by its ``/v1/models``)."""
        from miles.transport.verify import compare_checksums

        if not self.replaces:
            return await self._verify_served(client, report)
        verified = 0
        for url in client.urls:
            served = {a["lora_name"]: a for a in (await client.call(url, "/lora_adapters", {}))["adapters"]}
            adapter = served.get(self.lora_name)
            if adapter is None:
                raise WeightVerificationError(
                    f"engine {url} does not serve LoRA adapter {self.lora_name!r} (version {report.version}): "
                    f"it never reached the engine (served: {sorted(served) or 'none'})"
                )
            expected = self._served_as(report.version)
            if adapter["lora_path"] != expected:
                raise WeightVerificationError(
                    f"engine {url} serves LoRA adapter {self.lora_name!r} from {adapter['lora_path']}, "
                    f"expected version {report.version} ({expected})"
                )
            compare_checksums(report.checksums, adapter["checksums"], engine=f"{url} (adapter {self.lora_name!r})")
            verified += len(adapter["checksums"])
        return {"weight_sync/verified_tensors": float(verified), "weight_sync/verified": 1.0}

    async def _verify_served(self, client: EngineClient, report: PushReport) -> dict[str, float]:
        """SGLang engines: each serves ``lora_name`` from this push's directory (its version's)."""
        expected = self._served_as(report.version)
        for url in client.urls:
            served = await self._served(client, url)
            path = served.get(self.lora_name)
            if path is None:
                raise WeightVerificationError(
                    f"engine {url} does not serve LoRA adapter {self.lora_name!r} (version {report.version}): "
                    f"it never reached the engine (served: {sorted(served) or 'none'})"
                )
            if path != expected:
                raise WeightVerificationError(
                    f"engine {url} serves LoRA adapter {self.lora_name!r} from {path}, expected version "
                    f"{report.version} ({expected})"
                )
        return {"weight_sync/verified_adapters": float(len(client.urls)), "weight_sync/verified": 1.0}
