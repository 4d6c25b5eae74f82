"""Rendezvous environment of trainer ranks."""

from __future__ import annotations

import socket

import pytest

from miles.launch.rendezvous import free_port, trainer_specs


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
    assert 0 < port < 65536


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
    ports = {s.env["MASTER_PORT"] for s in trainer_specs(["x"], 2)}
    assert len(ports) == 1 and int(ports.pop()) > 0
    assert "CUDA_VISIBLE_DEVICES" not in trainer_specs(["x"], 1)[0].env


def test_trainer_specs_reject_bad_shapes() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        trainer_specs(["x"], 0)
    with pytest.raises(ValueError, match="devices lists 1 ranks, world_size is 2"):
        trainer_specs(["x"], 2, devices=[[0]])
