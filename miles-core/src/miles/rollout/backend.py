"""Rollout-engine backends: how to start one engine server of a given kind.

A backend (``local`` in miles-core, ``sglang`` in miles-sglang) turns settings into the command line of
one server; the launcher places and runs those commands and owns the processes; everything afterwards
goes through the HTTP protocol and the :class:`~miles.rollout.client.EngineClient`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from miles.components import Component, SettingsT
from miles.errors import SettingsError

if TYPE_CHECKING:
    from miles.settings.model import MilesSettings
    from miles.training.adapter import LowRankSpec

__all__ = ["EngineCapabilities", "EngineLaunch", "RolloutEngine"]


@dataclass(frozen=True)
class EngineCapabilities:
    """What a kind of engine supports beyond ``/generate``."""

    update_weights_from_disk: bool = True
    update_weights_from_distributed: bool = False
    update_weights_from_tensor: bool = False
    """Serves ``/update_weights_from_tensor``: a colocated trainer's tensors by handle (CUDA IPC; shared memory
    on a CPU), one payload per TP rank, as SGLang does (:mod:`miles.transport.tensor_ipc`)."""
    release_memory: bool = False
    routed_experts: bool = False
    weights_checksum: bool = True
    """Serves Miles' ``/weights_checksum`` (every tensor verified by SHA-256); without it a push is verified
    by sampling rows through SGLang's ``/get_weights_by_name``."""
    miles_weight_routes: bool = True
    """Serves the weight routes of Miles' own engine beyond SGLang's protocol (``/p2p/*`` sessions,
    ``/update_weights_from_delta``) that the transports naming them in ``engine_routes`` need."""
    lora_adapters: bool = True
    """Serves Miles' ``/lora_adapters`` (each LoRA adapter's tensors by SHA-256) and replaces an adapter
    loaded again under its name. Without it (SGLang) the ``lora`` transport unloads the previous version
    first and verifies a push by the adapter's name and path in ``/v1/models``."""
    token_logprobs: bool = True
    """Answers ``/generate`` with token ids and per-token logprobs, of the prompt too (``return_logprob``,
    ``logprob_start_len``): a text engine. The image engine does not (no logprob probe reaches it)."""
    in_process: bool = False
    """Can serve from inside the calling process (:meth:`RolloutEngine.start_in_process`: ``miles train
    --debug``)."""


@dataclass
class EngineLaunch:
    """Everything a launcher needs to start one engine server and know when it is up."""

    argv: list[str]
    """Command line, ``argv[0]`` an executable (typically ``sys.executable``)."""
    url: str
    """Base URL the server will listen on (``http://127.0.0.1:PORT``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables (e.g. ``CUDA_VISIBLE_DEVICES``)."""
    health_path: str = "/health"
    """Path polled until it answers 200."""
    rebind: Callable[[str, int], EngineLaunch] | None = field(default=None, repr=False, compare=False)
    """The same engine on another address (host, port): a launcher starts it there when the engine's port was
    taken before it could bind (:func:`miles.net.address_in_use`). ``None``: the launch is final."""


class RolloutEngine(Component[SettingsT], ABC):
    """A kind of engine server. Registered with ``miles_register_rollout_engines``."""

    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities()
    adapter: LowRankSpec | None = None
    """The LoRA adapter the run trains (``train.adapter``), set by the composition root before
    :meth:`launch`: an engine that must be told at launch what adapters it will serve (SGLang's
    ``--enable-lora``, ``--max-lora-rank``, ``--lora-target-modules``) reads it."""

    records_routed_experts: bool = False
    """Whether the run asks every ``/generate`` for the routed experts (MoE routing replay), set by the
    composition root before :meth:`launch`: an engine that must be told at launch (SGLang's
    ``--enable-return-routed-experts``) reads it."""

    def placement_problems(self, nodes: Sequence[Mapping[str, float]], settings: MilesSettings) -> list[str]:
        """Why the run's engines cannot be placed on ``nodes`` (the cluster's machines, each as the resources it
        offers: ``GPU``, ``CPU``, custom ones; :meth:`~miles.launch.base.Launcher.nodes`), each problem naming
        the field to change; empty when they can. Asked before anything starts when the launcher places
        processes on a cluster (on one host, :meth:`check_settings`-style checks of this host apply).
        Default: no constraint beyond the launcher's own.

        .. versionadded:: 0.1
        """
        return []

    @property
    def gpus_per_engine(self) -> int:
        """GPUs one engine uses on CUDA (its tensor-parallel size); the launcher places that many."""
        return 1

    @abstractmethod
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
        """The command that serves ``model_path`` on ``host:port``.

        :param device: ``cpu`` or ``cuda``.
        :param devices: device indices this engine may use (empty on CPU; :attr:`gpus_per_engine` of them).
        :param rank: this engine's index in the fleet (``0 .. cluster.num_engines - 1``).
        :param seed: the run's seed (``train.seed``); an engine seeds its sampler with ``seed + rank``.
        :param colocate: engines share devices with the trainer (``cluster.colocate``).
        """

    def start_in_process(
        self, *, model_path: str, host: str, device: str, dtype: str, allowed_weight_dirs: Sequence[str] = ()
    ) -> AbstractContextManager[str]:
        """Serve ``model_path`` from inside this process (``miles train --debug``, so a debugger stops in the
        engine too): a context manager whose value is the engine's base URL (a port the OS picks on
        ``host``); leaving it stops the engine. Only engines whose :attr:`capabilities` say ``in_process``
        can; the others refuse with a :class:`~miles.errors.SettingsError` naming ``rollout.engine``.

        :param dtype: the dtype to serve (``Run.engine_dtype``).
        :param allowed_weight_dirs: more directories weight updates may load from (the run's).
        """
        raise SettingsError(
            f"rollout.engine: --debug runs the engine in this process, which engine {self.name!r} cannot "
            "(the local engine can)"
        )
