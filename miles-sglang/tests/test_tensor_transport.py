"""The ``sglang_tensor`` transport where CUDA is absent: its settings check, the request it sends per bucket,
and the walk over buckets that every rank makes (the push itself needs a GPU: scripts/gpu/sglang_check.sh)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from miles.errors import SettingsError
from miles.settings.model import MilesSettings
from miles.training.trainer import DistContext
from miles_sglang.settings import TensorTransportSettings
from miles_sglang.tensor_transport import TENSOR_REQUEST_FIELDS, TensorTransport, _with_last, tensor_payload


def settings_for(**overrides: Any) -> MilesSettings:
    data: dict[str, Any] = {
        "cluster": {"device": "cuda", "colocate": True, "num_engines": 1},
        "rollout": {"engine": {"name": "sglang"}},
        "transport": "sglang_tensor",
    }
    for key, value in overrides.items():
        section, _, field = key.partition("__")
        data[section][field] = value
    return MilesSettings.model_validate(data)


def test_check_settings_accepts_one_colocated_engine_only() -> None:
    TensorTransport.check_settings(TensorTransportSettings(), settings_for())
    cases = {
        "cluster.colocate: transport 'sglang_tensor' shares GPU memory": settings_for(cluster__colocate=False),
        "cluster.device: transport 'sglang_tensor' moves CUDA tensors, got 'cpu'": settings_for(
            cluster__device="cpu", cluster__colocate=False
        ),
        "cluster.num_engines: transport 'sglang_tensor' serves one engine": settings_for(cluster__num_engines=2),
        "needs rollout.engine = 'sglang', got 'local'": settings_for(rollout__engine="local"),
    }
    for message, settings in cases.items():
        with pytest.raises(SettingsError, match=message.replace("(", r"\(")):
            TensorTransport.check_settings(TensorTransportSettings(), settings)
    tp2 = settings_for(rollout__engine={"name": "sglang", "tp_size": 2})
    with pytest.raises(SettingsError, match="tp_size = 1"):
        TensorTransport.check_settings(TensorTransportSettings(), tp2)


def test_payload_per_bucket_and_the_last_one_carries_the_version() -> None:
    middle = tensor_payload("QUJD", last=False, version="3", flush_cache=True)
    assert middle == {"serialized_named_tensors": ["QUJD"], "load_format": None, "flush_cache": False}
    last = tensor_payload("QUJD", last=True, version="3", flush_cache=True)
    assert last == {
        "serialized_named_tensors": ["QUJD"],
        "load_format": None,
        "flush_cache": True,
        "weight_version": "3",
    }
    assert set(last) == set(TENSOR_REQUEST_FIELDS)


def test_buckets_are_walked_with_the_last_one_marked() -> None:
    a, b, c = [("a", 1)], [("b", 2)], [("c", 3)]
    assert list(_with_last([a, [], b, c, []])) == [(a, False), (b, False), (c, True)]  # type: ignore[list-item]
    assert list(_with_last([[], []])) == []


def test_other_ranks_walk_every_bucket_and_send_nothing() -> None:
    transport = TensorTransport(TensorTransportSettings(), run_dir="/tmp", model_path=None, engine_dtype="bfloat16")
    walked: list[int] = []

    def buckets() -> Any:
        for i in range(3):
            walked.append(i)
            yield []

    report = asyncio.run(transport.push(buckets(), version="1", dist=DistContext(rank=1, world_size=2)))
    assert walked == [0, 1, 2] and report.num_tensors == 0
    with pytest.raises(RuntimeError, match="push before connect"):
        asyncio.run(transport.push(iter([]), version="1", dist=DistContext(rank=0, world_size=2)))
