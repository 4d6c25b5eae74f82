"""The ``broadcast`` transport against a real local engine: its group's keys sit under a name holding a
secret of the run, so a process that reaches the store's port without the name cannot join or receive
the weights, while the engine (told the name over HTTP) joins, receives and serves them."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from miles.net import free_port
from miles.rollout.http_client import HttpEngineClient
from miles.testing.engine import EngineProcess
from miles.training.trainer import DistContext
from miles.transport.broadcast import BroadcastTransport, BroadcastTransportSettings, group_ranks
from miles.transport.verify import verify_engines

ROGUE = textwrap.dedent(
    """
    import sys, torch
    from miles.transport.broadcast import make_process_group
    port, name = int(sys.argv[1]), sys.argv[2]
    try:
        group, _ = make_process_group("gloo", host="127.0.0.1", port=port, rank=1, world_size=2, timeout=8,
                                      is_master=False, group_name=name)
        from torch.distributed import BroadcastOptions
        t = torch.zeros(1)
        group.broadcast([t], BroadcastOptions()).wait()
        print("JOINED", flush=True)
    except Exception as exc:
        print("REFUSED", type(exc).__name__, flush=True)
    """
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.models import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("broadcast-model") / "qwen2", "qwen2", seed=0)


@pytest.fixture(scope="module")
def engine(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    log = tmp_path_factory.mktemp("broadcast-logs") / "engine.log"
    with EngineProcess(model, extra_args=["--attention-backend", "sdpa"], log_path=log) as process:
        yield process


def test_only_processes_told_the_secret_name_join_the_group(engine: EngineProcess, model: Path) -> None:
    from safetensors.torch import load_file

    port = free_port()
    settings = BroadcastTransportSettings(master_port=port, timeout=60)
    # a process on this host that knows the port and the configured name, but not the run's secret
    rogue = subprocess.Popen(
        [sys.executable, "-c", ROGUE, str(port), settings.group_name], stdout=subprocess.PIPE, text=True
    )
    state = {k: v + 0.25 for k, v in load_file(str(model / "model.safetensors")).items()}

    async def run() -> None:
        async with HttpEngineClient([engine.url]) as client:
            transport = BroadcastTransport(settings, run_dir=".", model_path=str(model), engine_dtype="float32")
            await transport.connect(client, DistContext())
            try:
                assert re.fullmatch(r"miles_weights-[0-9a-f]{32}", transport.group_name)
                report = await transport.push([list(state.items())], version="5", dist=DistContext())
                await verify_engines(client, version="5", checksums_by_dtype={"float32": report.checksums})
            finally:
                await transport.close()

    asyncio.run(run())
    out, _ = rogue.communicate(timeout=60)
    assert out.split()[0] == "REFUSED", out
    info = httpx.get(engine.url + "/model_info", timeout=30).json()
    assert info["weight_version"] == "5"
    # the engine's log never shows the secret
    assert re.search(r"miles_weights-[0-9a-f]{32}", Path(str(engine.log_path)).read_text()) is None


def test_group_ranks_count_every_tp_rank_of_an_sglang_engine() -> None:
    # two SGLang engines of tp_size 2 and a local engine (its /server_info has no tp_size)
    assert group_ranks([{"tp_size": 2}, {"tp_size": 2}, {}]) == ([1, 3, 5], 6)
    assert group_ranks([{}, {}]) == ([1, 2], 3)


def test_the_store_address_defaults_to_the_node_address_the_launcher_hands_rank_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Trainer rank 0 hosts the group's store, so engines on other nodes must reach it at rank 0's node
    address, which the ``ray`` launcher puts in ``MILES_NODE_ADDRESS`` (not at ``127.0.0.1``, where an engine
    on another node finds its own loopback). Without a launcher's word: ``127.0.0.1``; the setting overrides."""
    from miles.node_address import NODE_ADDRESS_ENV

    def master(**settings: str) -> str:
        options = BroadcastTransportSettings(**settings)
        return BroadcastTransport(options, run_dir=".", model_path=None, engine_dtype="float32").master_address

    monkeypatch.delenv(NODE_ADDRESS_ENV, raising=False)
    assert master() == "127.0.0.1"
    monkeypatch.setenv(NODE_ADDRESS_ENV, "10.213.0.1")
    assert master() == "10.213.0.1"
    assert master(master_address="10.213.0.7") == "10.213.0.7"


def test_colocation_on_cuda_is_refused_naming_both_fields() -> None:
    """Trainer rank 0 and engine 0 on one GPU would be two NCCL ranks on one device: refused before anything
    starts (it was accepted and the docs recommended it)."""
    from miles.compose import build_run
    from miles.errors import SettingsError
    from miles.settings.model import MilesSettings

    chosen = {"transport": {"name": "broadcast"}, "train": {"model_path": None}}
    colocated = {"cluster": {"colocate": True, "device": "cuda"}, **chosen}
    with pytest.raises(
        SettingsError, match=r"transport.name: 'broadcast' cannot serve cluster.colocate = true on CUDA"
    ):
        build_run(MilesSettings.model_validate(colocated))
    for cluster in ({"colocate": True, "device": "cpu"}, {"colocate": False, "device": "cuda"}):
        try:
            build_run(MilesSettings.model_validate({"cluster": cluster, **chosen}))
        except SettingsError as exc:  # (no model, no trainer backend here: only those may be said)
            assert "broadcast" not in str(exc)
