"""The kit's delivery check against real engines: a correct transport passes (``disk_delta``), one that
drops a tensor from every push fails naming it, one that delivers but reports no checksums is told so (the
delivery is not blamed)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from miles.testing import check_transport_delivery
from miles.transport.disk import DiskTransport

pytestmark = pytest.mark.slow  # one engine process per check


class DroppingDisk(DiskTransport):
    """Leaves ``model.embed_tokens.weight`` out of every push: what the check exists to catch."""

    name = "dropping_disk"

    async def stage(self, buckets: Iterable[Any], **kwargs: Any) -> Any:
        kept = ([(n, t) for n, t in b if n != "model.embed_tokens.weight"] for b in buckets)
        return await super().stage(kept, **kwargs)


class SilentDisk(DiskTransport):
    """Delivers every tensor, and reports no checksums."""

    name = "silent_disk"

    async def push(self, buckets: Iterable[Any], *, version: str, dist: Any) -> Any:
        report = await super().push(buckets, version=version, dist=dist)
        report.checksums.clear()
        return report


def test_a_correct_transport_passes(tmp_path: Path) -> None:
    from miles.transport.disk_delta import DiskDeltaTransport

    facts = check_transport_delivery(
        DiskDeltaTransport, tmp_path, settings={"dir": str(tmp_path / "w")}, engine_dtype="bfloat16"
    )
    assert facts["verified_tensors"] > 0


def test_a_transport_that_drops_a_tensor_fails_by_name(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"dropping_disk.*a full push did not verify.*model.embed_tokens.weight"):
        check_transport_delivery(DroppingDisk, tmp_path, settings={"dir": str(tmp_path / "w")})


def test_a_transport_without_checksums_is_told_so_not_blamed_for_delivery(tmp_path: Path) -> None:
    with pytest.raises(AssertionError) as caught:
        check_transport_delivery(SilentDisk, tmp_path, settings={"dir": str(tmp_path / "w")})
    message = str(caught.value)
    assert "silent_disk" in message and "no checksums" in message
    assert "every tensor arrived" in message and "report.checksums" in message
    assert "did not verify" not in message and "not updated" not in message
