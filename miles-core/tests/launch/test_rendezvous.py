"""Rendezvous environment of trainer ranks."""

from __future__ import annotations

import socket

import pytest

from miles.launch.rendezvous import RendezvousStore, trainer_specs


def test_trainer_specs_set_torchrun_variables() -> None:
    specs = trainer_specs(["python", "train.py"], 3, master_port=29555, env={"A": "1"}, devices=[[0], [1, 2], [3]])
    assert [s.name for s in specs] == ["trainer-0", "trainer-1", "trainer-2"]
    assert specs[1].argv == ["python", "train.py"]
    assert specs[1].env == {
        "A": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29555",
        "RANK": "1",
        "WORLD_SIZE": "3",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "3",
        "CUDA_VISIBLE_DEVICES": "1,2",
    }
    # without a port the launcher hosts the store and points the ranks at it
    assert not {"MASTER_ADDR", "MASTER_PORT"} & set(trainer_specs(["x"], 2)[0].env)
    assert "CUDA_VISIBLE_DEVICES" not in trainer_specs(["x"], 1)[0].env


def test_rendezvous_store_is_bound_before_the_ranks_are_told() -> None:
    """The store listens on its port the moment it exists: no other process can take the port between the
    launcher choosing it and the ranks joining (they connect as clients, as to torchrun's agent store)."""
    from datetime import timedelta

    import torch.distributed as dist

    rendezvous = RendezvousStore("127.0.0.1", timeout=30)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError):
            squatter.bind(("127.0.0.1", rendezvous.port))  # taken: by the store
    specs = trainer_specs(["x"], 2)
    rendezvous.join(specs)
    env = specs[1].env
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["MASTER_PORT"] == str(rendezvous.port)
    client = dist.TCPStore("127.0.0.1", int(env["MASTER_PORT"]), None, False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert rendezvous.store.get("k") == b"v"
    given = trainer_specs(["x"], 1, master_port=29555)
    rendezvous.join(given)
    assert given[0].env["MASTER_PORT"] == "29555"  # a rank told its own port keeps it


def test_trainer_specs_reject_bad_shapes() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        trainer_specs(["x"], 0)
    with pytest.raises(ValueError, match="devices lists 1 ranks, world_size is 2"):
        trainer_specs(["x"], 2, devices=[[0]])
