"""Example data for the conformance checks: samples a reward must score, groups an algorithm must
train on. Real :class:`~miles.types.Sample` objects with aligned per-token lists."""

from __future__ import annotations

from typing import Any

from miles.types import Sample, SampleGroup, SampleStatus

__all__ = ["example_groups", "example_samples"]


def example_samples() -> list[Sample]:
    """A few completed samples a reward must score without raising: an ordinary answer, an empty
    response, non-ASCII text, a sample without a label, a truncated one."""

    def sample(i: int, prompt: str, response: str, label: Any, status: SampleStatus = SampleStatus.COMPLETED) -> Sample:
        n = max(1, len(response.split())) if response else 0
        return Sample(
            prompt_ids=[1, 2, 3, 4 + i],
            response_ids=[10 + k for k in range(n)],
            rollout_logprobs=[-0.5] * n,
            loss_mask=[1] * n,
            status=status,
            group_id=0,
            index=i,
            prompt=prompt,
            response=response,
            label=label,
        )

    return [
        sample(0, "What is 6 x 7?", "6 x 7 = 42. The answer is \\boxed{42}.", "42"),
        sample(1, "What is 6 x 7?", "", "42"),
        sample(2, "Wie viel ist 6 mal 7?", "Die Antwort ist zweiundvierzig (42) ✓", "42"),
        sample(3, "Say hello.", "Hello there!", None),
        sample(4, "Count to ten.", "one two three four five", "ten", SampleStatus.TRUNCATED),
    ]


def example_groups(num_groups: int = 2, group_size: int = 4, seed: int = 0) -> list[SampleGroup]:
    """Scored sample groups with varied response lengths, rewards, logprobs and a masked (tool) span."""
    import random

    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        samples = []
        for i in range(group_size):
            n = rng.randint(2, 9)
            mask = [1] * n
            if n > 4 and i % 2:
                mask[1:3] = [0, 0]  # tokens the environment inserted
            samples.append(
                Sample(
                    prompt_ids=[rng.randint(5, 100) for _ in range(rng.randint(2, 6))],
                    response_ids=[rng.randint(5, 100) for _ in range(n)],
                    rollout_logprobs=[0.0 if m == 0 else -rng.uniform(0.05, 3.0) for m in mask],
                    loss_mask=mask,
                    reward=float(rng.random() > 0.5) if g % 2 == 0 else rng.uniform(-1, 1),
                    status=SampleStatus.COMPLETED,
                    group_id=g,
                    index=i,
                    teacher_logprobs=[-rng.uniform(0.05, 3.0) for _ in range(n)],
                )
            )
        groups.append(SampleGroup(g, samples))
    return groups
