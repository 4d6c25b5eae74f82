"""Tensor handles between processes of one host (``miles.transport.tensor_ipc``) and the ``tensor_ipc``
transport's settings check. The push itself, two colocated engines each fed by its trainer rank:
tests/integration/test_train.py."""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
from typing import Any

import pytest
import torch

from miles.errors import SettingsError
from miles.settings.model import MilesSettings
from miles.transport.colocated import TensorIpcTransport, TensorIpcTransportSettings
from miles.transport.tensor_ipc import dump_handles, load_handles

READ = """
import json, sys
from miles.transport.tensor_ipc import load_handles
print(json.dumps({name: t.float().tolist() for name, t in load_handles(sys.stdin.read())}))
"""


def test_another_process_of_the_host_reads_the_tensors_by_handle() -> None:
    """A process the sender did not start opens the payload's tensors (shared memory by file name), in their
    dtype and shape, views included; the payload is a few hundred bytes, not the data."""
    import json

    weight = torch.randn(64, 32).to(torch.bfloat16)
    named = [("w", weight), ("row", weight[3:5].contiguous()), ("bias", torch.arange(5, dtype=torch.float32))]
    payload = dump_handles(named)
    assert len(payload) < 2000 < weight.numel() * weight.element_size()
    out = subprocess.run([sys.executable, "-c", READ], input=payload, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    for name, tensor in named:
        assert got[name] == tensor.float().tolist(), name


def test_anything_but_miles_handles_is_refused_naming_the_field() -> None:
    """The payload is JSON read with PyTorch's own storage functions, never unpickled: a pickled payload
    (what SGLang's serializer makes, here one that would call ``os.system``) is refused naming the field, and
    nothing runs; so are handles missing a key or naming an unknown dtype or storage."""
    import json

    evil = base64.b64encode(pickle.dumps(os.system)).decode()
    with pytest.raises(ValueError, match="serialized_named_tensors: not JSON"):
        load_handles(evil)
    with pytest.raises(ValueError, match="expected a list of tensor handles"):
        load_handles('{"w": 1}')
    with pytest.raises(ValueError, match="a tensor handle without 'storage'"):
        load_handles(json.dumps([{"name": "w", "dtype": "float32", "shape": [1], "stride": [1], "offset": 0}]))
    entry = json.loads(dump_handles([("w", torch.ones(2))]))[0]
    with pytest.raises(ValueError, match="'w' has no dtype 'int99'"):
        load_handles(json.dumps([{**entry, "dtype": "int99"}]))
    with pytest.raises(ValueError, match="'w' has a storage of unknown kind 'disk'"):
        load_handles(json.dumps([{**entry, "storage": {**entry["storage"], "kind": "disk"}}]))


def settings(**cluster: Any) -> MilesSettings:
    data = {
        "cluster": {"colocate": True, "num_engines": 2, "trainer_ranks": 2, **cluster},
        "transport": {"name": "tensor_ipc"},
        "train": {"model_path": None},
    }
    return MilesSettings.model_validate(data)


def test_the_settings_pair_each_engine_with_a_trainer_rank() -> None:
    TensorIpcTransport.check_settings(TensorIpcTransportSettings(), settings())
    with pytest.raises(SettingsError) as info:
        TensorIpcTransport.check_settings(TensorIpcTransportSettings(), settings(colocate=False, num_engines=3))
    message = str(info.value)
    assert "cluster.colocate: transport 'tensor_ipc' hands each engine the tensors of the trainer rank" in message
    assert "3 engines x rollout.engine.tp_size 1 must equal cluster.trainer_ranks (2)" in message
    megatron = settings()
    megatron.train.backend.name = "megatron"
    with pytest.raises(SettingsError, match="train.backend: transport 'tensor_ipc' needs every trainer rank"):
        TensorIpcTransport.check_settings(TensorIpcTransportSettings(), megatron)
