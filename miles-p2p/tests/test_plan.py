"""The route plan: chunks tile every tensor for every engine, replicas are sent once and balanced, tied
aliases resolve, and layouts that cannot be matched are errors that name the tensor."""

from __future__ import annotations

import pytest

from miles_p2p.plan import ALIGN, EngineLayout, PlanError, SliceInfo, layout_key, make_plan


def rows(rank: int, name: str, shape: tuple[int, ...], start: int, stop: int) -> SliceInfo:
    return SliceInfo(rank, name, shape, (start,) + (0,) * (len(shape) - 1), (stop - start, *shape[1:]))


ENGINE = {
    "embed.weight": ("bfloat16", (10, 4)),
    "norm.weight": ("bfloat16", (4,)),
    "proj.weight": ("float32", (3, 4)),
}


def fsdp_layout() -> list[SliceInfo]:
    """Two ranks, FSDP2-style: rows split with torch.chunk sizes (the last rank may hold fewer or none)."""
    return [
        rows(0, "embed.weight", (10, 4), 0, 5),
        rows(1, "embed.weight", (10, 4), 5, 10),
        rows(0, "norm.weight", (4,), 0, 2),
        rows(1, "norm.weight", (4,), 2, 4),
        rows(0, "proj.weight", (3, 4), 0, 2),
        rows(1, "proj.weight", (3, 4), 2, 3),
    ]


def test_every_rank_sends_its_rows_to_every_engine() -> None:
    engines = [EngineLayout("http://a", ENGINE), EngineLayout("http://b", ENGINE)]
    plan = make_plan(fsdp_layout(), engines)
    assert len(plan.routes) == 12 and plan.tensors == 3
    assert plan.tensor_bytes == 10 * 4 * 2 + 4 * 2 + 3 * 4 * 4
    for e in range(2):
        mine = plan.for_engine(e)
        assert {r.src for r in mine} == {0, 1}
        covered: dict[str, int] = {}
        end = 0
        for r in sorted(mine, key=lambda r: r.offset):
            assert r.offset % ALIGN == 0 and r.offset >= end
            end = r.offset + r.nbytes
            covered[r.name] = covered.get(r.name, 0) + r.nbytes
        assert covered == {"embed.weight": 80, "norm.weight": 8, "proj.weight": 48}
        assert plan.buffer_bytes[e] == end
        # each rank's chunks lie together in the buffer
        srcs = [r.src for r in sorted(mine, key=lambda r: r.offset)]
        assert srcs == sorted(srcs)
    route = next(r for r in plan.for_rank(1) if r.name == "proj.weight" and r.engine == 0)
    assert (route.offsets, route.shape, route.slice_offsets, route.slice_at) == ((2, 0), (1, 4), (0, 0), (2, 0))
    assert len({r.id for r in plan.routes}) == len(plan.routes)


def test_replicas_are_sent_once_balancing_ranks_and_tied_aliases_resolve() -> None:
    layout = [SliceInfo(r, n, s, (0,) * len(s), s) for r in (0, 1) for n, (_, s) in ENGINE.items()]
    engine = EngineLayout(
        "http://a",
        {k: v for k, v in ENGINE.items() if k != "proj.weight"} | {"head": ENGINE["proj.weight"]},
        aliases={"proj.weight": "head"},
    )
    plan = make_plan(layout, [engine])
    assert sorted(r.name for r in plan.routes) == ["embed.weight", "head", "norm.weight"]
    assert {r.src for r in plan.routes} == {0, 1}  # the three replicas are spread over both ranks
    head = next(r for r in plan.routes if r.name == "head")
    assert head.source_name == "proj.weight"


def test_tensor_parallel_engine_parts_get_the_intersections() -> None:
    parts = {"embed.weight": ((0, 2), (10, 2))}  # an engine holding columns 2:4 only
    engine = EngineLayout("http://tp1", ENGINE, parts=parts)
    plan = make_plan(fsdp_layout(), [engine])
    embed = sorted((r for r in plan.routes if r.name == "embed.weight"), key=lambda r: r.src)
    assert [(r.offsets, r.shape, r.slice_offsets) for r in embed] == [
        ((0, 0), (5, 2), (0, 2)),
        ((5, 0), (5, 2), (0, 2)),
    ]
    assert embed[0].nbytes == 5 * 2 * 2


def test_layouts_that_do_not_match_name_the_tensor() -> None:
    engines = [EngineLayout("http://a", ENGINE)]
    missing = [s for s in fsdp_layout() if not (s.name == "norm.weight" and s.rank == 1)]
    with pytest.raises(PlanError, match=r"tensor 'norm.weight': the trainer ranks hold 2 of its 4 elements"):
        make_plan(missing, engines)
    overlap = [*fsdp_layout(), rows(1, "embed.weight", (10, 4), 4, 6)]
    with pytest.raises(PlanError, match="tensor 'embed.weight': trainer slices at .* overlap"):
        make_plan(overlap, engines)
    extra = [*fsdp_layout(), rows(0, "lora.weight", (2, 2), 0, 2)]
    with pytest.raises(PlanError, match="engine http://a does not serve tensor 'lora.weight'"):
        make_plan(extra, engines)
    with pytest.raises(PlanError, match="serves tensor 'proj.weight' that no trainer rank holds"):
        make_plan([s for s in fsdp_layout() if s.name != "proj.weight"], engines)
    wrong = [rows(0, "norm.weight", (5,), 0, 5), *[s for s in fsdp_layout() if s.name != "norm.weight"]]
    with pytest.raises(PlanError, match="tensor 'norm.weight': trainer rank 0 has shape \\[5\\], the engines \\[4\\]"):
        make_plan(wrong, engines)


def test_the_key_changes_with_either_layout() -> None:
    a, b = EngineLayout("http://a", ENGINE), EngineLayout("http://b", ENGINE)
    key = layout_key(fsdp_layout(), [a])
    assert key == layout_key(fsdp_layout(), [a])
    assert key != layout_key(fsdp_layout(), [a, b])  # an engine joined
    assert key != layout_key(fsdp_layout()[:-1], [a])
    assert make_plan(fsdp_layout(), [a]).key == key
