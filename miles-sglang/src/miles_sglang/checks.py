"""What an SGLang run needs from its host, checked before anything starts: SGLang installed, CUDA GPUs
for every engine. Each problem names the field to change and the install line."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from miles_sglang.settings import SGLANG_VERSION

if TYPE_CHECKING:
    from miles.settings.model import MilesSettings
    from miles_sglang.settings import SGLangEngineSettings

__all__ = ["INSTALL_LINE", "host_problems", "sglang_installed", "visible_gpus"]

INSTALL_LINE = f'pip install "miles-sglang[sglang]"  (SGLang {SGLANG_VERSION} with its CUDA torch; GPU hosts only)'


def sglang_installed() -> bool:
    """Whether ``sglang`` can be imported here (looked up, not imported: importing it loads CUDA)."""
    return importlib.util.find_spec("sglang") is not None


def visible_gpus() -> int:
    """CUDA GPUs this process sees (``torch.cuda.device_count()``; 0 on a CPU build of torch)."""
    import torch

    return int(torch.cuda.device_count())


def host_problems(
    options: SGLangEngineSettings, settings: MilesSettings, *, installed: bool | None = None, gpus: int | None = None
) -> list[str]:
    """Why an SGLang fleet cannot start on this host (empty when it can).

    :param installed: override the SGLang lookup (tests); :param gpus: override the GPU count.
    """
    problems = []
    if not (sglang_installed() if installed is None else installed):
        problems.append(f"rollout.engine: 'sglang' is selected but SGLang is not installed: {INSTALL_LINE}")
    cluster = settings.cluster
    if cluster.device != "cuda":
        problems.append(
            f"cluster.device: rollout.engine 'sglang' serves on CUDA GPUs only, got {cluster.device!r} "
            '(set cluster.device = "cuda", or use rollout.engine = "local" on a CPU)'
        )
        return problems
    count = visible_gpus() if gpus is None else gpus
    engines = cluster.num_engines * options.tp_size
    # trainer rank r uses GPU r; engines share those GPUs when colocated and follow them otherwise
    need = max(engines, cluster.trainer_ranks) if cluster.colocate else engines + cluster.trainer_ranks
    if count == 0:
        problems.append(
            "cluster.device: 'cuda' is selected but this host has no CUDA GPU "
            "(torch.cuda.device_count() is 0: a CPU-only host, a CPU build of torch or CUDA_VISIBLE_DEVICES='')"
        )
    elif need > count:
        trainers = "sharing the trainer ranks' GPUs" if cluster.colocate else f"+ {cluster.trainer_ranks} trainer ranks"
        problems.append(
            f"cluster.num_engines: {cluster.num_engines} engines x rollout.engine.tp_size {options.tp_size} "
            f"{trainers} need {need} GPUs; this host has {count}"
        )
    return problems
