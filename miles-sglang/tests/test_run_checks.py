"""What a run tells its SGLang fleet before anything starts: the weight transports it can take (those needing
routes only Miles' own engine serves are refused, naming the transport and the engine: they used to fail at
the first push with a 404), and the routed experts routing replay needs."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.compose import build_run
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


@pytest.mark.parametrize("transport", ["broadcast", "disk", "sglang_tensor"])
def test_sglang_protocol_transports_are_not_refused_for_their_routes(transport: str) -> None:
    config = settings(transport)
    config.cluster.colocate = True
    try:
        build_run(config)
    except SettingsError as exc:  # (this host has no GPU: the engine's own host check still speaks)
        assert "loads weights through routes only" not in str(exc) and "needs engines that serve" not in str(exc)


def test_tensor_ipc_with_sglang_is_refused_naming_sglang_tensor() -> None:
    config = settings("tensor_ipc")
    config.cluster.colocate = True
    with pytest.raises(SettingsError) as info:
        build_run(config)
    assert "use transport 'sglang_tensor' with rollout.engine 'sglang'" in str(info.value)


def test_a_run_that_records_routed_experts_launches_sglang_with_them() -> None:
    """Routing replay needs SGLang's ``--enable-return-routed-experts``: the composition root tells the engine
    (``records_routed_experts``) and the launch command carries it without a setting (it never did)."""
    from miles_sglang.engine import SGLangEngine
    from miles_sglang.settings import SGLangEngineSettings

    engine = SGLangEngine(SGLangEngineSettings())
    where = {"model_path": "/m", "host": "127.0.0.1", "port": 30001, "device": "cuda", "dtype": "bfloat16"}
    assert "--enable-return-routed-experts" not in engine.launch(**where, devices=[0]).argv
    engine.records_routed_experts = True
    assert "--enable-return-routed-experts" in engine.launch(**where, devices=[0]).argv


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_an_in_place_pause_is_refused_in_the_async_modes_naming_both_fields(mode: str) -> None:
    """SGLang 0.5.23 keeps ``in_place``-paused requests running and refuses the push's cache flush while they
    run: the first push of an async run failed. Refused before anything starts; ``tests/real`` shows the
    refusal on a real SGLang server."""
    config = settings("disk")
    config.rollout.mode = mode
    config.rollout.pause_mode = "in_place"
    with pytest.raises(SettingsError) as info:
        build_run(config)
    message = str(info.value)
    assert f"rollout.pause_mode: 'in_place' cannot pause SGLang for a weight push with rollout.mode = '{mode}'" in (
        message
    )
    for allowed in ("retract", "abort"):
        config.rollout.pause_mode = allowed
        try:
            build_run(config)
        except SettingsError as exc:  # (the host checks still speak here: no GPU)
            assert "rollout.pause_mode" not in str(exc)


def test_an_in_place_pause_in_sync_mode_is_not_refused() -> None:
    """Sync runs never pause: nothing generates during a push."""
    config = settings("disk")
    config.rollout.pause_mode = "in_place"
    try:
        build_run(config)
    except SettingsError as exc:
        assert "rollout.pause_mode" not in str(exc)


def test_a_moe_model_on_a_cpu_is_refused_naming_the_model(tmp_path: Path) -> None:
    """SGLang's CPU path keeps an MoE router's gate transposed after loading, so the first weight push failed
    after a whole rollout and training step (``tests/real``: the run through ``miles train``). Refused before
    anything starts; a dense model and an MoE model on CUDA GPUs are not."""
    import json

    for name, extra in (("moe", {"num_experts": 8, "num_experts_per_tok": 2}), ("dense", {})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "qwen3", **extra}))
    config = settings("disk")
    config.cluster.device = "cpu"
    config.train.model_path = str(tmp_path / "moe")
    with pytest.raises(SettingsError) as info:
        build_run(config)
    assert f"train.model_path: {tmp_path / 'moe'} is a mixture-of-experts model" in str(info.value)
    for device, name in (("cpu", "dense"), ("cuda", "moe")):
        config.cluster.device = device
        config.train.model_path = str(tmp_path / name)
        try:
            build_run(config)
        except SettingsError as exc:  # (the host checks still speak: no SGLang, no GPU here)
            assert "mixture-of-experts" not in str(exc)
