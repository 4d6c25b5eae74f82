"""Weight-sync verification: what the engines serve must equal what the trainer sent, tensor by tensor.

Checksums are SHA-256 over a tensor's bytes in the dtype the engine serves, so a push verifies exactly
(not approximately). After every push the engines report their weight version and a checksum per tensor
(``/weights_checksum``, a Miles endpoint of the local engine); a tensor the engine serves but the trainer
never sent, a missing tensor or a differing checksum stops the run with the tensor's name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

from miles.errors import WeightVerificationError

if TYPE_CHECKING:
    import torch

    from miles.rollout.client import EngineClient

__all__ = ["compare_checksums", "tensor_checksum", "verify_engines"]


def tensor_checksum(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """SHA-256 (hex, 16 chars) of the tensor's bytes after casting to ``dtype`` (default: its own)."""
    import torch

    t = tensor.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    t = t.cpu().contiguous()
    digest = hashlib.sha256(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")  # no copy
    digest.update(str(tuple(t.shape)).encode())
    return digest.hexdigest()[:16]


def compare_checksums(
    sent: Mapping[str, str], served: Mapping[str, str], *, engine: str, aliases: Mapping[str, str] | None = None
) -> None:
    """Raise :class:`WeightVerificationError` naming the first tensors that differ.

    :param aliases: ``{alias: canonical}`` names the engine serves through another parameter (tied
        embeddings): a tensor sent under the alias counts for the canonical parameter.
    """
    aliases = aliases or {}
    resolved: dict[str, str] = {}
    for name, checksum in sent.items():
        target = aliases.get(name, name)
        if target in resolved and resolved[target] != checksum and name in aliases:
            continue  # both names of a tied pair sent; the canonical one decides
        resolved[target] = checksum
    sent = resolved
    never_sent = sorted(set(served) - set(sent))
    if never_sent:
        raise WeightVerificationError(
            f"engine {engine}: {len(never_sent)} tensor(s) were not updated by the push, e.g. {never_sent[0]!r}"
            + (f" (and {', '.join(repr(n) for n in never_sent[1:4])})" if len(never_sent) > 1 else "")
        )
    unknown = sorted(set(sent) - set(served))
    if unknown:
        raise WeightVerificationError(f"engine {engine} does not serve tensor {unknown[0]!r} that the trainer sent")
    differ = sorted(name for name in sent if sent[name] != served[name])
    if differ:
        raise WeightVerificationError(
            f"engine {engine}: tensor {differ[0]!r} differs from what the trainer sent"
            + (f" ({len(differ)} tensors differ)" if len(differ) > 1 else "")
        )


async def verify_engines(
    client: EngineClient, *, version: str, checksums_by_dtype: Mapping[str, Mapping[str, str]]
) -> dict[str, float]:
    """Ask every engine for its weight version and checksums and compare with what was sent.

    :param checksums_by_dtype: the trainer's checksums per engine dtype name (``"float32"`` ...).
    :returns: metrics (``weight_sync/verified_tensors``).
    """
    verified = 0
    for url in client.urls:
        report = await client.call(url, "/weights_checksum", {})
        served_version = str(report.get("weight_version"))
        if served_version != version:
            raise WeightVerificationError(
                f"engine {url} serves weight version {served_version!r}, expected {version!r}"
            )
        dtype = str(report["dtype"])
        if dtype not in checksums_by_dtype:
            raise WeightVerificationError(f"engine {url} serves dtype {dtype}; no trainer checksums for it")
        compare_checksums(checksums_by_dtype[dtype], report["checksums"], engine=url, aliases=report.get("aliases"))
        verified += len(report["checksums"])
    return {"weight_sync/verified_tensors": float(verified), "weight_sync/verified": 1.0}
