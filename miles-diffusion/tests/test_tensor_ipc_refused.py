"""A transport needing an engine capability the image engine lacks is refused before anything starts."""

from __future__ import annotations

import pytest

from miles.compose import build_run
from miles.errors import SettingsError
from miles.settings.model import MilesSettings


def test_an_engine_without_the_route_is_refused_naming_both_fields() -> None:
    """The image engine serves no ``/update_weights_from_tensor``: refused before anything starts (the
    capability ``update_weights_from_tensor``), where the first push would have failed with a 404."""
    config = MilesSettings.model_validate(
        {
            "cluster": {"colocate": True, "num_engines": 2, "trainer_ranks": 2},
            "rollout": {"engine": {"name": "diffusion"}},
            "transport": {"name": "tensor_ipc"},
            "train": {"model_path": None},
        }
    )
    with pytest.raises(
        SettingsError, match="transport.name: 'tensor_ipc' needs engines that serve update_weights_from_tensor"
    ):
        build_run(config)
