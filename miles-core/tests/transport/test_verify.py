from __future__ import annotations

import pytest
import torch

from miles.errors import WeightVerificationError
from miles.transport.verify import compare_checksums, tensor_checksum


def test_checksum_is_exact_and_dtype_aware() -> None:
    t = torch.randn(4, 3)
    assert tensor_checksum(t) == tensor_checksum(t.clone())
    bumped = t.clone()
    bumped[2, 1] = torch.nextafter(bumped[2, 1], torch.tensor(float("inf")))
    assert tensor_checksum(bumped) != tensor_checksum(t)  # one ulp
    assert tensor_checksum(t, torch.bfloat16) == tensor_checksum(t.to(torch.bfloat16))
    assert tensor_checksum(t.reshape(3, 4)) != tensor_checksum(t)  # shape is part of it


def test_compare_names_the_skipped_tensor() -> None:
    served = {"a.weight": "1", "b.weight": "2", "c.weight": "3"}
    compare_checksums({"a.weight": "1", "b.weight": "2", "c.weight": "3"}, served, engine="e0")
    with pytest.raises(
        WeightVerificationError, match=r"engine e0: 1 tensor\(s\) were not updated by the push, e.g. 'b.weight'"
    ):
        compare_checksums({"a.weight": "1", "c.weight": "3"}, served, engine="e0")
    with pytest.raises(WeightVerificationError, match="tensor 'c.weight' differs"):
        compare_checksums({"a.weight": "1", "b.weight": "2", "c.weight": "x"}, served, engine="e0")
    with pytest.raises(WeightVerificationError, match="does not serve tensor 'd.weight'"):
        compare_checksums({**served, "d.weight": "4"}, served, engine="e0")


def test_tied_aliases_count_for_their_parameter() -> None:
    served = {"model.embed_tokens.weight": "E", "model.norm.weight": "N"}
    aliases = {"lm_head.weight": "model.embed_tokens.weight"}
    compare_checksums({"lm_head.weight": "E", "model.norm.weight": "N"}, served, engine="e0", aliases=aliases)
    compare_checksums(
        {"model.embed_tokens.weight": "E", "lm_head.weight": "E", "model.norm.weight": "N"},
        served,
        engine="e0",
        aliases=aliases,
    )
    with pytest.raises(WeightVerificationError, match="model.embed_tokens.weight"):
        compare_checksums({"lm_head.weight": "Z", "model.norm.weight": "N"}, served, engine="e0", aliases=aliases)
