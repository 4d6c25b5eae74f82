"""Which weight transports an SGLang fleet can take: those needing routes only Miles' own engine serves are
refused before anything starts, naming the transport and the engine (they used to fail at the first push
with a 404)."""

from __future__ import annotations

import pytest

from miles.driver.run import build_run
from miles.errors import SettingsError
from miles.settings.model import MilesSettings


def settings(transport: str) -> MilesSettings:
    return MilesSettings.model_validate(
        {"rollout": {"engine": {"name": "sglang"}}, "transport": {"name": transport}, "train": {"model_path": None}}
    )


def test_disk_delta_is_refused_with_sglang_naming_both_fields() -> None:
    with pytest.raises(SettingsError) as info:
        build_run(settings("disk_delta"))
    message = str(info.value)
    assert "transport.name: 'disk_delta' loads weights through routes only Miles' own engine serves" in message
    assert "/update_weights_from_delta" in message and "rollout.engine 'sglang' does not serve them" in message


@pytest.mark.parametrize("transport", ["broadcast", "disk"])
def test_sglang_protocol_transports_are_not_refused_for_their_routes(transport: str) -> None:
    try:
        build_run(settings(transport))
    except SettingsError as exc:  # (this host has no GPU: the engine's own host check still speaks)
        assert "loads weights through routes only" not in str(exc)
