"""What an SGLang run needs, checked before anything starts: SGLang installed and CUDA GPUs for every engine
— on this host (:func:`host_problems`), or on a cluster's nodes when the launcher places the engines across
nodes (:func:`node_problems`, from the nodes' resources) — or, on a CPU, SGLang with its CPU kernels and a CPU
they run on. Each problem names the field to change and the install line (or how to build the CPU
environment)."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from miles_sglang import cpu_host
from miles_sglang.settings import SGLANG_VERSION

if TYPE_CHECKING:
    from miles.settings.model import MilesSettings
    from miles_sglang.settings import SGLangEngineSettings

__all__ = [
    "INSTALL_LINE",
    "cpu_problems",
    "host_problems",
    "moe_problems",
    "node_problems",
    "places_on_nodes",
    "sglang_installed",
    "visible_gpus",
]

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


def moe_problems(model_path: str | None) -> list[str]:
    """Why SGLang's CPU path cannot take this run's weight pushes (empty when it can): SGLang 0.5.23 keeps a
    mixture-of-experts router's gate transposed after loading on a CPU (a Qwen3-MoE gate of ``[8, 128]`` is
    held as ``[128, 8]``), so ``/update_weights_from_distributed`` answers 400 at the first push and
    ``/update_weights_from_disk`` kills the scheduler; the run used to die after its first training step.
    Reads only the model's ``config.json``; a path that is not a model directory is left to the model checks."""
    from pathlib import Path

    from miles.models import is_moe_model

    if not model_path or not (Path(model_path) / "config.json").is_file():
        return []
    try:
        moe = is_moe_model(model_path)
    except (OSError, ValueError, TypeError):
        return []
    if not moe:
        return []
    return [
        f"train.model_path: {model_path} is a mixture-of-experts model, and SGLang {SGLANG_VERSION} cannot take "
        "weight pushes into one on a CPU (it keeps the router gates transposed after loading: the first push "
        'is refused); use rollout.engine = "local" for MoE models on a CPU, or SGLang on CUDA GPUs'
    ]


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
        problems = cpu_problems(options, installed=installed, kernels=kernels, missing_flags=missing_flags)
        return problems + moe_problems(settings.train.model_path)
    problems = []
    if not (sglang_installed() if installed is None else installed):
        problems.append(f"rollout.engine: 'sglang' is selected but SGLang is not installed: {INSTALL_LINE}")
    if places_on_nodes(settings):
        return problems  # the GPUs are the nodes', checked per node once the launcher lists them (node_problems)
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


def places_on_nodes(settings: MilesSettings) -> bool:
    """Whether the launcher places the engines on the nodes of a cluster it joins (``ray`` with an
    ``address``), not on this host: this host's GPUs are then not the engines'."""
    launcher = settings.cluster.launcher
    return launcher.name == "ray" and launcher.options.get("address") is not None


def node_problems(
    options: SGLangEngineSettings, settings: MilesSettings, nodes: Sequence[Mapping[str, float]]
) -> list[str]:
    """Why the fleet cannot be placed on ``nodes`` (each node's resources: ``GPU``, custom ones), empty when
    it can. Every engine needs ``tp_size`` GPUs on one node (SGLang's tensor parallelism stays within a
    node) on a node offering the launcher's ``engine_resources``; each trainer rank one GPU on a node offering
    ``trainer_resources`` (colocated: engine ``i`` shares rank ``i``'s GPU). Engines are placed first,
    largest first, each on the node with the fewest GPUs left that fits it; then the trainer ranks."""
    cluster = settings.cluster
    if cluster.device != "cuda":
        return []
    launcher = cluster.launcher.options
    tp = options.tp_size

    def offers(node: Mapping[str, float], wanted: object) -> bool:
        wanted = wanted if isinstance(wanted, Mapping) else {}
        return all(float(node.get(str(k), 0.0)) >= float(v) for k, v in wanted.items())

    gpus = [int(node.get("GPU", 0.0)) for node in nodes]
    engine_nodes = [i for i, node in enumerate(nodes) if offers(node, launcher.get("engine_resources"))]
    trainer_nodes = [i for i, node in enumerate(nodes) if offers(node, launcher.get("trainer_resources"))]
    listed = ", ".join(f"{g}" for g in gpus) or "none"
    largest = max((gpus[i] for i in engine_nodes), default=0)
    if not cluster.colocate and largest < tp:
        return [
            f"rollout.engine.tp_size: each engine needs {tp} GPUs on one node; the Ray cluster's nodes that may "
            f"hold engines have at most {largest} (GPUs per node: {listed})"
        ]
    free = list(gpus)
    engines = 0 if cluster.colocate else cluster.num_engines
    placed = 0
    for _ in range(engines):
        fits = [i for i in engine_nodes if free[i] >= tp]
        if not fits:
            break
        best = min(fits, key=lambda i: free[i])
        free[best] -= tp
        placed += 1
    ranks = 0
    for _ in range(cluster.trainer_ranks):
        fits = [i for i in trainer_nodes if free[i] >= 1]
        if not fits:
            break
        free[min(fits, key=lambda i: free[i])] -= 1
        ranks += 1
    if placed == engines and ranks == cluster.trainer_ranks:
        return []
    if cluster.colocate:
        return [
            f"cluster.trainer_ranks: {cluster.trainer_ranks} trainer ranks (each sharing its GPU with an engine) "
            f"need {cluster.trainer_ranks} GPUs; the Ray cluster's nodes have {listed}"
        ]
    return [
        f"cluster.num_engines: {cluster.num_engines} engines x rollout.engine.tp_size {tp} (on one node each) + "
        f"{cluster.trainer_ranks} trainer ranks need {cluster.num_engines * tp + cluster.trainer_ranks} GPUs; the "
        f"Ray cluster's nodes have {listed} GPUs: {placed} engines and {ranks} trainer ranks fit"
    ]
