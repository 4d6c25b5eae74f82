"""The ``diffusion`` rollout-engine backend: starts ``python -m miles_diffusion.engine`` (no torch here)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.errors import SettingsError
from miles.rollout.backend import EngineCapabilities, EngineLaunch, RolloutEngine
from miles_diffusion.engine.options import ImageEngineOptions, ImageServeOptions, to_argv

if TYPE_CHECKING:
    from miles.settings.model import MilesSettings

__all__ = ["ImageEngine"]


class ImageEngine(RolloutEngine[ImageEngineOptions]):
    """Miles' image engine: diffusers pipelines sampled with Flow-GRPO's SDE, per-step log-probs."""

    name = "diffusion"
    capabilities = EngineCapabilities(update_weights_from_disk=True, miles_weight_routes=False, token_logprobs=False)

    @classmethod
    def check_settings(cls, options: ImageEngineOptions, settings: MilesSettings) -> None:
        """Refuse what the image engine cannot serve: colocation (no memory release) and transports that
        need ``/update_weights_from_distributed``."""
        if settings.cluster.colocate:
            raise SettingsError("cluster.colocate: the diffusion engine does not release memory; use colocate = false")
        if settings.transport.name != "disk":
            raise SettingsError(
                f'transport: the diffusion engine loads weights from disk only (transport = "disk"), got {settings.transport.name!r}'
            )

    def launch(
        self,
        *,
        model_path: str,
        host: str,
        port: int,
        device: str,
        dtype: str,
        devices: list[int],
        rank: int = 0,
        seed: int = 0,
        colocate: bool = False,
    ) -> EngineLaunch:
        # every image's seed comes with its request (sampling_seed), so the engine's rank and seed do not matter
        where: dict[str, Any] = {"model": Path(model_path), "host": host, "port": port, "device": device}
        where["dtype"] = "float32" if dtype in ("", "auto") else dtype
        serve = ImageServeOptions.model_construct(**self.settings.model_dump(), **where)
        env = {}
        if device == "cuda" and devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
        return EngineLaunch(
            argv=[sys.executable, "-m", "miles_diffusion.engine", *to_argv(serve)], url=f"http://{host}:{port}", env=env
        )
