"""The ``sglang`` rollout engine: one SGLang server per engine, spoken to over SGLang's HTTP protocol.

Everything after the launch is the core's: the engine client (generation through the router, control
calls to each engine), the ``broadcast`` transport (``/init_weights_update_group`` +
``/update_weights_from_distributed`` over NCCL), the ``disk`` transport (``/update_weights_from_disk``),
memory release around training when colocated (``/release_memory_occupation`` /
``/resume_memory_occupation`` with SGLang's tags ``kv_cache`` and ``weights``), and sampled verification
through ``/get_weights_by_name`` (SGLang has no route for checksums of HF-named tensors). LoRA runs
(``train.adapter``) launch with SGLang's LoRA flags and push adapters with miles-lora's ``lora`` transport
(``/load_lora_adapter``, ``lora_path`` per request). This module only turns settings into the launch
command and refuses runs this host cannot serve.

On a CPU (``cluster.device = "cpu"``) the same command takes SGLang's CPU backend: ``--device cpu``, its
``SGLANG_USE_CPU_ENGINE=1`` switch in the environment, no overlap scheduling. That needs SGLang with its CPU
kernels, which no package index carries: ``scripts/sglang/cpu_env.py`` builds that environment
(``docs/how-to/sglang-cpu.md``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from miles.errors import SettingsError
from miles.rollout.backend import EngineCapabilities, EngineLaunch, RolloutEngine
from miles_sglang.checks import host_problems, node_problems
from miles_sglang.command import CPU_ENV, ENGINE_ENV, EnginePlacement, launch_argv
from miles_sglang.serve import keyed_launch
from miles_sglang.settings import SGLangEngineSettings

if TYPE_CHECKING:
    from miles.settings.model import MilesSettings

__all__ = ["SGLangEngine", "pause_problems"]


def pause_problems(settings: MilesSettings) -> list[str]:
    """Why SGLang cannot take the run's weight pushes while it generates (empty when it can).

    In the async modes the engines are paused around each push (``rollout.pause_mode``). SGLang 0.5.23's
    ``in_place`` pause keeps the paused requests in its running batch, and every weight update ends with a
    flush of the prefix cache (its KV was computed by the old weights), which SGLang refuses while requests
    are running (``Scheduler.flush_cache``: ``is_fully_idle``); the update call then fails ("Weights were
    updated, but the cache was not flushed because requests are still running or queued") and the run stops
    at its first push. ``retract`` moves them to the waiting queue, which a paused flush ignores."""
    rollout = settings.rollout
    if rollout.mode == "sync" or rollout.pause_mode != "in_place":
        return []
    return [
        f"rollout.pause_mode: 'in_place' cannot pause SGLang for a weight push with rollout.mode = "
        f"{rollout.mode!r}: SGLang keeps the paused requests running and refuses the push's cache flush "
        "(the update fails with 'requests are still running or queued'); use pause_mode 'retract' (requests "
        "resume under the new weights, their KV recomputed) or 'abort' (they are sent again)"
    ]


class SGLangEngine(RolloutEngine[SGLangEngineSettings]):
    """SGLang servers (``python -m sglang.launch_server``) on CUDA GPUs, ``tp_size`` GPUs each, or on the CPU."""

    name = "sglang"
    capabilities = EngineCapabilities(
        update_weights_from_disk=True,
        update_weights_from_distributed=True,
        update_weights_from_tensor=True,
        release_memory=True,
        routed_experts=True,
        weights_checksum=False,
        miles_weight_routes=False,
        lora_adapters=False,
    )

    @classmethod
    def check_settings(cls, options: SGLangEngineSettings, settings: MilesSettings) -> None:
        """Refuse, before anything starts, a run SGLang cannot serve (:func:`pause_problems`) or this host
        cannot (SGLang or its CPU kernels missing, no or too few GPUs, a CPU without AVX-512 BF16); on a cluster
        the GPUs are checked per node instead (:meth:`placement_problems`)."""
        problems = pause_problems(settings) + host_problems(options, settings)
        if problems:
            raise SettingsError("\n".join(problems))

    def placement_problems(self, nodes: Sequence[Mapping[str, float]], settings: MilesSettings) -> list[str]:
        """On a cluster: ``tp_size`` GPUs on one node per engine, one per trainer rank (:func:`node_problems`)."""
        return node_problems(self.settings, settings, nodes)

    @property
    def gpus_per_engine(self) -> int:
        return self.settings.tp_size

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
        """``sglang.launch_server`` on ``devices`` (the first is ``--base-gpu-id``; SGLang takes ``tp_size``
        consecutive GPUs from there) or, with ``device="cpu"``, on the CPU; seeded ``seed + rank``, ready when
        ``/health_generate`` answers. GPU ids are as the engine's process sees them: host-wide with the
        ``local`` launcher, from 0 with ``ray`` (each actor sees its own GPUs only)."""
        if device not in ("cuda", "cpu"):
            raise SettingsError(f"cluster.device: rollout.engine 'sglang' serves on 'cuda' or 'cpu', got {device!r}")
        on_cpu = device == "cpu"
        if on_cpu and dtype in ("float32", "float"):
            raise SettingsError(
                "rollout.engine_dtype: SGLang's CPU kernels have no float32 path (its first forward fails in "
                'rmsnorm); serve bfloat16 on a CPU: rollout.engine_dtype = "bfloat16"'
            )
        if on_cpu and dtype in ("auto", ""):  # its CPU kernels' dtype: a float32 checkpoint "as is" fails too
            dtype = "bfloat16"
        if not on_cpu and len(devices) != self.settings.tp_size:
            raise SettingsError(
                f"rollout.engine.tp_size: engine {rank} was placed on GPUs {devices}, expected {self.settings.tp_size}"
            )
        # torch_memory_saver pages CUDA memory out: on a CPU only when asked for (and then refused by the checks)
        default_saver = colocate and not on_cpu
        memory_saver = default_saver if self.settings.enable_memory_saver is None else self.settings.enable_memory_saver
        where = EnginePlacement(
            model_path=model_path,
            host=host,
            port=port,
            base_gpu_id=None if on_cpu else devices[0],
            seed=seed + rank,
            dtype=dtype or "auto",
            memory_saver=memory_saver,
            device=device,
        )
        settings = self.settings
        if self.records_routed_experts and not settings.enable_return_routed_experts:  # routing replay needs it
            settings = settings.model_copy(update={"enable_return_routed_experts": True})
        return EngineLaunch(
            argv=keyed_launch(launch_argv(settings, where, self.adapter)),  # the run's keys: miles_sglang.serve
            url=f"http://{host}:{port}",
            env={**ENGINE_ENV, **(CPU_ENV if on_cpu else {})},
            health_path="/health_generate",
        )
