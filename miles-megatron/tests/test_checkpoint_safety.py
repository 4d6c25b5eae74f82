"""The pickles of a distributed checkpoint are read with a restricted unpickler before Megatron loads them."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from miles_megatron.checkpoint_safety import UnsafeCheckpointError, check_checkpoint_files


class _Calls:
    """Pickles as a call of ``os.getcwd`` (harmless, but code all the same)."""

    def __reduce__(self) -> tuple[object, tuple[()]]:
        import os

        return (os.getcwd, ())


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A real torch distributed checkpoint (``.metadata`` + shards) and a Megatron-style ``common.pt``."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "ckpt"
    dcp.save(
        {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)},
        checkpoint_id=path,
        no_dist=True,
    )
    torch.save({"optimizer": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]}, "step": 3}, path / "common.pt")
    return path


def test_a_real_checkpoint_passes(checkpoint: Path) -> None:
    check_checkpoint_files(checkpoint)


def test_metadata_naming_code_is_refused(checkpoint: Path) -> None:
    (checkpoint / ".metadata").write_bytes(pickle.dumps({"planted": _Calls()}))
    with pytest.raises(
        UnsafeCheckpointError, match=r"\.metadata: refusing to load the checkpoint: its pickle names posix\.getcwd"
    ):
        check_checkpoint_files(checkpoint)


def test_common_pt_naming_code_is_refused(checkpoint: Path) -> None:
    torch.save({"planted": _Calls()}, checkpoint / "common.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"common\.pt: refusing to load the checkpoint"):
        check_checkpoint_files(checkpoint)


def test_switching_weights_only_off_process_wide_is_refused(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(UnsafeCheckpointError, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set"):
        check_checkpoint_files(checkpoint)
