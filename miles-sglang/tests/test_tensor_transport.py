"""The ``sglang_tensor`` transport where CUDA is absent: its settings check and the request it sends per bucket
(the push itself needs a GPU: scripts/gpu/sglang_check.sh; the same push to Miles' engine on a CPU, by
``tensor_ipc``: tests/integration/test_train.py)."""

from __future__ import annotations

from typing import Any

import pytest

from miles.errors import SettingsError
from miles.settings.model import MilesSettings
from miles_sglang.settings import TensorTransportSettings
from miles_sglang.tensor_transport import TENSOR_REQUEST_FIELDS, TensorTransport, tensor_payload


def settings_for(**overrides: Any) -> MilesSettings:
    data: dict[str, Any] = {
        "cluster": {"device": "cuda", "colocate": True, "num_engines": 1, "trainer_ranks": 1},
        "rollout": {"engine": {"name": "sglang"}},
        "transport": "sglang_tensor",
    }
    for key, value in overrides.items():
        section, _, field = key.partition("__")
        data[section][field] = value
    return MilesSettings.model_validate(data)


def test_check_settings_pairs_each_engine_tp_rank_with_a_trainer_rank() -> None:
    """Any number of engines and any TP size (one engine and ``tp_size = 1`` were all it served), as long as
    each engine TP rank has the trainer rank on its GPU."""
    for engines, tp, ranks in ((1, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 4)):
        config = settings_for(cluster__num_engines=engines, cluster__trainer_ranks=ranks)
        config.rollout.engine = config.rollout.engine.model_validate({"name": "sglang", "tp_size": tp})
        TensorTransport.check_settings(TensorTransportSettings(), config)
    cases = {
        "cluster.colocate: transport 'sglang_tensor' hands each engine": settings_for(cluster__colocate=False),
        "2 engines x rollout.engine.tp_size 1 must equal cluster.trainer_ranks \\(1\\)": settings_for(
            cluster__num_engines=2
        ),
        "needs rollout.engine = 'sglang', got 'local'": settings_for(rollout__engine="local"),
    }
    for message, settings in cases.items():
        with pytest.raises(SettingsError, match=message):
            TensorTransport.check_settings(TensorTransportSettings(), settings)


def test_payload_per_bucket_and_the_last_one_carries_the_version() -> None:
    middle = tensor_payload(["QUJD", "REVG"], last=False, version="3", flush_cache=True)
    assert middle == {"serialized_named_tensors": ["QUJD", "REVG"], "load_format": None, "flush_cache": False}
    last = tensor_payload(["QUJD"], last=True, version="3", flush_cache=True)
    assert last == {
        "serialized_named_tensors": ["QUJD"],
        "load_format": None,
        "flush_cache": True,
        "weight_version": "3",
    }
    assert set(last) == set(TENSOR_REQUEST_FIELDS)
