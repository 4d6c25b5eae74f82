from __future__ import annotations

import json
import math
import re
import struct

import pytest

from miles.types import Sample, SampleGroup, SampleStatus, TensorData, WeightSpan, group_samples


def _full_sample() -> Sample:
    experts = struct.pack("<12i", *range(12))
    return Sample(
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5],
        rollout_logprobs=[-0.1234567890123456789, -2.5e-300],
        loss_mask=[1, 0],
        reward=0.7071067811865476,
        reward_parts={"math": 1.0, "length": -0.2928932188134524},
        status=SampleStatus.TRUNCATED,
        status_reason="length",
        group_id=7,
        index=3,
        prompt="What is 2+3?",
        response="5 ✓",
        label={"answer": "5"},
        weight_versions=[WeightSpan(0, 1, 4), WeightSpan(1, 2, 5)],
        request_spans=[(0, 1), (1, 2)],
        prompt_messages=[{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 2+3?"}],
        routed_experts=experts,
        routed_experts_shape=(2, 3, 2),
        teacher_logprobs=[-0.5, -1.0 / 3.0],
        teacher_topk_ids=[[4, 9], [5, 0]],
        teacher_topk_logprobs=[[-0.1, -2.0 / 3.0], [-1e-300, -7.25]],
        metadata={"source": "prompts.jsonl:3", "tools": [{"name": "calc"}]},
        response_tensors={"latents": TensorData("float32", (2, 2), struct.pack("<4f", 0.1, -2.0, 1e-30, 3.5))},
    )


def test_sample_round_trip_is_exact() -> None:
    sample = _full_sample()
    sample.validate()
    line = sample.to_json()
    back = Sample.from_json(line)
    assert back == sample
    assert back.rollout_logprobs[0].hex() == sample.rollout_logprobs[0].hex()
    assert back.routed_experts == sample.routed_experts
    assert back.response_tensors == sample.response_tensors
    assert json.loads(line)["status"] == "truncated"
    assert back.oldest_weight_version == 4
    assert back.tokens == [1, 2, 3, 4, 5]
    assert back.teacher_topk == 2
    assert back.teacher_topk_logprobs is not None and back.teacher_topk_logprobs[0][1].hex() == (-2.0 / 3.0).hex()


def test_sample_round_trip_keeps_non_finite_logprobs() -> None:
    sample = Sample(prompt_ids=[1], response_ids=[2], rollout_logprobs=[-math.inf], loss_mask=[1])
    assert Sample.from_json(sample.to_json()).rollout_logprobs == [-math.inf]


def test_to_dict_detaches_from_sample() -> None:
    sample = _full_sample()
    data = sample.to_dict()
    data["metadata"]["tools"].append("x")
    assert sample.metadata["tools"] == [{"name": "calc"}]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"loss_mask": [1]}, "Sample.loss_mask has 1 entries, response_ids has 2"),
        ({"rollout_logprobs": [0.0]}, "Sample.rollout_logprobs has 1 entries"),
        ({"teacher_logprobs": [0.0, 0.0, 0.0]}, "Sample.teacher_logprobs has 3 entries"),
        ({"routed_experts_shape": (2, 3, 3)}, "shape (2, 3, 3) needs 72"),
        ({"teacher_topk_ids": None}, "teacher_topk_ids and teacher_topk_logprobs must be set together"),
        ({"teacher_topk_ids": [[4, 9]], "teacher_topk_logprobs": [[0.0, 0.0]]}, "teacher_topk_ids has 1 rows"),
        ({"teacher_topk_ids": [[4, 9], [5]]}, "row 1 has 1 / 2 entries; every row needs the same k"),
        ({"teacher_topk_ids": [[], []], "teacher_topk_logprobs": [[], []]}, "row 0 has 0 / 0 entries"),
        ({"request_spans": [(0, 3)]}, "Sample.request_spans: [0, 3) is not an ordered, non-overlapping span"),
        ({"request_spans": [(0, 2), (1, 2)]}, "Sample.request_spans: [1, 2) is not an ordered"),
    ],
)
def test_validate_names_the_field(change: dict[str, object], message: str) -> None:
    sample = _full_sample()
    for key, value in change.items():
        setattr(sample, key, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        sample.validate()


def test_from_dict_rejects_unknown_fields() -> None:
    with pytest.raises(ValueError, match="unknown Sample field.*respons_ids"):
        Sample.from_dict({"prompt_ids": [1], "respons_ids": [2]})
    with pytest.raises(ValueError, match="prompt_ids"):
        Sample.from_dict({"response_ids": [2]})


def test_group_samples_orders_groups_and_indices() -> None:
    samples = [Sample([1], group_id=g, index=i, reward=float(g * 10 + i)) for g, i in [(2, 1), (1, 0), (2, 0), (1, 1)]]
    groups = group_samples(samples)
    assert [g.group_id for g in groups] == [2, 1]
    assert [s.index for s in groups[0]] == [0, 1]
    assert groups[0].rewards == [20.0, 21.0]
    again = SampleGroup.from_dict(json.loads(json.dumps(groups[1].to_dict())))
    assert again == groups[1]


def test_tensor_data_checks_its_size_and_sample_checks_the_rows() -> None:
    with pytest.raises(ValueError, match=r"shape \(2, 2\) and dtype float32 needs 16 bytes, got 4"):
        TensorData("float32", (2, 2), b"\0" * 4)
    with pytest.raises(ValueError, match="dtype 'complex64'"):
        TensorData("complex64", (1,), b"\0" * 8)
    sample = Sample([1], [2, 3], [0.0, 0.0], [1, 1], response_tensors={"x": TensorData("int64", (3,), b"\0" * 24)})
    with pytest.raises(ValueError, match=r"response_tensors\['x'\] has shape \(3,\), response_ids has 2"):
        sample.validate()
