"""SGLang's ``/generate`` answers read as typed values: the weight versions a partial rollout was sampled under
(SGLang 0.5.23 reports them as ``meta_info.weight_versions``; Miles read only its own engine's
``weight_version_spans`` and took every SGLang sample for one sampled wholly under its last version)."""

from __future__ import annotations

from miles.rollout.manager import sample_from_output
from miles.rollout.protocol import GenerateOutput
from miles.types import Sample, WeightSpan

# meta_info of a request SGLang 0.5.23 paused with mode "retract" after 5 tokens, while version "1" was loaded
# (``utils/weight_versions.py: add_weight_versions_to_meta_info``; recorded from a real server, trimmed)
RETRACTED = {
    "text": "",
    "output_ids": [293, 293, 306, 264, 306, 310, 12, 99],
    "meta_info": {
        "id": "a1",
        "finish_reason": {"type": "length", "length": 8},
        "prompt_tokens": 9,
        "completion_tokens": 8,
        "cached_tokens": 0,
        "weight_version": "1",
        "weight_versions": [{"version": "0", "start": 0, "end": 5}, {"version": "1", "start": 5, "end": 8}],
        "output_token_logprobs": [[-1.0, t, None] for t in [293, 293, 306, 264, 306, 310, 12, 99]],
        "num_retractions": 1,
    },
}


def test_sglangs_weight_versions_are_the_spans_of_a_partial_rollout() -> None:
    out = GenerateOutput.from_json(RETRACTED)
    assert out.weight_version_spans == [(0, 5, "0"), (5, 8, "1")]
    sample = sample_from_output(Sample(prompt_ids=[1, 2, 3]), out)
    assert sample.weight_versions == [WeightSpan(0, 5, 0), WeightSpan(5, 8, 1)]
    assert sample.oldest_weight_version == 0  # (staleness counts from the oldest: it was 1, the last)


def test_one_version_throughout_is_one_span() -> None:
    whole = {
        **RETRACTED,
        "meta_info": {**RETRACTED["meta_info"], "weight_versions": [{"version": "1", "start": 0, "end": 8}]},
    }
    sample = sample_from_output(Sample(prompt_ids=[1, 2, 3]), GenerateOutput.from_json(whole))
    assert sample.weight_versions == [WeightSpan(0, 8, 1)]
    bare = {**RETRACTED, "meta_info": {k: v for k, v in RETRACTED["meta_info"].items() if k != "weight_versions"}}
    out = GenerateOutput.from_json(bare)  # an engine that reports only its current version
    assert out.weight_version_spans is None
    assert sample_from_output(Sample(prompt_ids=[1]), out).weight_versions == [WeightSpan(0, 8, 1)]


def test_a_sample_names_the_engine_that_served_it() -> None:
    """The engine client names the engine in ``meta_info["engine_url"]`` (the router's ``x-smg-routed-worker-id``
    behind smg); the sample keeps it, so a run's sample dumps show where each group was served."""
    out = GenerateOutput.from_json(RETRACTED)
    out.meta_info["engine_url"] = "http://127.0.0.1:30001"
    sample = sample_from_output(Sample(prompt_ids=[1, 2, 3], metadata={"routing_key": "group-3"}), out)
    assert sample.metadata == {
        "routing_key": "group-3",
        "cached_tokens": 0,
        "prompt_tokens": 9,
        "engine_url": "http://127.0.0.1:30001",
    }
