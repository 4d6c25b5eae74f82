"""What an SGLang run needs from its host, checked before anything starts: SGLang installed and CUDA GPUs
for every engine, or, on a CPU, SGLang with its CPU kernels and a CPU they run on. Each problem names the
field to change and the install line (or how to build the CPU environment)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from miles_sglang import cpu_host
from miles_sglang.settings import SGLANG_VERSION

if TYPE_CHECKING:
    from miles.settings.model import MilesSettings
    from miles_sglang.settings import SGLangEngineSettings

__all__ = ["INSTALL_LINE", "cpu_problems", "host_problems", "sglang_installed", "visible_gpus"]

INSTALL_LINE = f'pip install "miles-sglang[sglang]"  (SGLang {SGLANG_VERSION} with its CUDA torch; GPU hosts only)'


def sglang_installed() -> bool:
    """Whether ``sglang`` can be imported here (looked up, not imported: importing it loads CUDA)."""
    return importlib.util.find_spec("sglang") is not None


def visible_gpus() -> int:
    """CUDA GPUs this process sees (``torch.cuda.device_count()``; 0 on a CPU build of torch)."""
    import torch

    return int(torch.cuda.device_count())


def cpu_problems(
    options: SGLangEngineSettings,
    *,
    installed: bool | None = None,
    kernels: bool | None = None,
    missing_flags: list[str] | None = None,
) -> list[str]:
    """Why SGLang cannot serve on this CPU (empty when it can): SGLang or its CPU kernels (``sgl_kernel``)
    missing, a CPU without the instructions the kernels are compiled for, options SGLang's CPU path refuses.

    :param installed: override the SGLang lookup; :param kernels: the kernel lookup; :param missing_flags:
        the CPU flags found missing (tests).
    """
    problems = []
    sglang = sglang_installed() if installed is None else installed
    has_kernels = cpu_host.kernels_installed() if kernels is None else kernels
    if not (sglang and has_kernels):
        what = "SGLang" if not sglang else f"SGLang's CPU kernels ({cpu_host.KERNEL_PACKAGE})"
        problems.append(
            f"rollout.engine: 'sglang' on a CPU (cluster.device = \"cpu\") needs SGLang with its CPU kernels; "
            f"{what} is not installed here: {cpu_host.BUILD_HINT}"
        )
    missing = cpu_host.missing_cpu_flags() if missing_flags is None else missing_flags
    if missing:
        problems.append(
            f"cluster.device: SGLang's CPU kernels need {', '.join(missing)}, which this CPU "
            f'({cpu_host.cpu_model()}) lacks; use rollout.engine = "local" here'
        )
    if options.enable_memory_saver:
        problems.append(
            "rollout.engine.enable_memory_saver: SGLang's memory saver (torch_memory_saver) pages CUDA memory; "
            "leave it unset on a CPU"
        )
    if options.enable_deterministic_inference:
        problems.append(
            "rollout.engine.enable_deterministic_inference: SGLang 0.5.23 refuses it with its CPU attention "
            "backends (seeded sampling does not reproduce on a CPU)"
        )
    return problems


def host_problems(
    options: SGLangEngineSettings,
    settings: MilesSettings,
    *,
    installed: bool | None = None,
    gpus: int | None = None,
    kernels: bool | None = None,
    missing_flags: list[str] | None = None,
) -> list[str]:
    """Why an SGLang fleet cannot start on this host (empty when it can).

    :param installed: override the SGLang lookup (tests); :param gpus: override the GPU count;
        :param kernels: and :param missing_flags: override the CPU checks (:func:`cpu_problems`).
    """
    cluster = settings.cluster
    if cluster.device == "cpu":
        return cpu_problems(options, installed=installed, kernels=kernels, missing_flags=missing_flags)
    problems = []
    if not (sglang_installed() if installed is None else installed):
        problems.append(f"rollout.engine: 'sglang' is selected but SGLang is not installed: {INSTALL_LINE}")
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
