"""The built-in data sources over real files: reading, shuffling, epochs, resume, bad rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from miles.components import ComponentKind, ComponentSettings
from miles.data.base import Prompt
from miles.data.sources import HFDataSource, HFSourceSettings, JsonlDataSource, ParquetDataSource
from miles.errors import DataError, MilesError
from miles.plugins.builtin import BUILTIN_PLUGINS
from miles.plugins.manager import PluginManager

ROWS: list[dict[str, Any]] = [
    {"prompt": f"What is {i}+{i}?", "label": str(2 * i), "difficulty": i % 3, "tags": ["math"]} for i in range(20)
]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def jsonl(path: Path, *, seed: int = 7, shuffle: bool = True, **kwargs: Any) -> JsonlDataSource:
    return JsonlDataSource(ComponentSettings(), path=str(path), seed=seed, shuffle=shuffle, **kwargs)


def labels(batch: list[Prompt]) -> list[str]:
    return [p.label for p in batch]


def test_jsonl_rows_become_prompts_with_label_metadata_and_source(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        json.dumps({"question": "hi", "answer": 3, "id": "a"})
        + "\n\n"
        + json.dumps({"question": [{"role": "user", "content": "yo"}], "id": "b"})
        + "\n",
        encoding="utf-8",
    )
    source = jsonl(path, shuffle=False, prompt_key="question", label_key="answer")
    first, second = source.next_batch(2)
    assert (first.prompt, first.label, first.metadata, first.source) == ("hi", 3, {"id": "a"}, "prompts.jsonl:1")
    assert second.prompt == [{"role": "user", "content": "yo"}]
    assert (second.label, second.metadata, second.source) == (None, {"id": "b"}, "prompts.jsonl:3")
    assert first.prompt_ids is None  # no pipeline: nothing tokenised


def test_directory_of_jsonl_files_reads_in_name_order(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "b.jsonl", ROWS[10:])
    write_jsonl(tmp_path / "a.jsonl", ROWS[:10])
    source = jsonl(tmp_path, shuffle=False)
    assert labels(source.next_batch(20)) == [r["label"] for r in ROWS]
    assert source.prompts[10].source == "b.jsonl:1"


def test_parquet_equals_jsonl_including_chat_messages(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        *ROWS,
        {
            "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            "label": "x",
            "difficulty": 0,
            "tags": [],
        },
    ]
    # Parquet needs one type per column: keep chat rows in their own file.
    pq.write_table(pa.Table.from_pylist(rows[:-1]), tmp_path / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[-1:]), tmp_path / "part-1.parquet")
    write_jsonl(tmp_path / "all.jsonl", rows)
    from_parquet = ParquetDataSource(ComponentSettings(), path=str(tmp_path), seed=3, shuffle=True)
    from_jsonl = jsonl(tmp_path / "all.jsonl", seed=3)
    a, b = from_parquet.next_batch(21), from_jsonl.next_batch(21)
    assert [(p.prompt, p.label, p.metadata) for p in a] == [(p.prompt, p.label, p.metadata) for p in b]
    assert from_parquet.prompts[20].source == "part-1.parquet:1"
    assert from_parquet.prompts[20].prompt == rows[-1]["prompt"]


def test_hf_source_reads_save_to_disk_directory_and_loose_files(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "ds"))
    write_jsonl(tmp_path / "loose.jsonl", ROWS)
    from_dir = HFDataSource(HFSourceSettings(), path=str(tmp_path / "ds"), seed=1, shuffle=False)
    assert labels(from_dir.next_batch(20)) == [r["label"] for r in ROWS]
    assert from_dir.prompts[4].metadata == {"difficulty": 1, "tags": ["math"]}
    assert from_dir.prompts[4].source == "ds[train]:5"
    loose = HFDataSource(
        HFSourceSettings(cache_dir=str(tmp_path / "cache")), path=str(tmp_path / "loose.jsonl"), seed=1, shuffle=False
    )
    assert labels(loose.next_batch(20)) == [r["label"] for r in ROWS]
    with pytest.raises(DataError, match=r"no split 'test' \(available: train\)"):
        HFDataSource(HFSourceSettings(split="test"), path=str(tmp_path / "ds"), seed=1, shuffle=False)


def test_missing_optional_package_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import now raises ImportError
    (tmp_path / "x.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"needs the 'pyarrow' package: pip install \"miles-core\[parquet\]\"$"):
        ParquetDataSource(ComponentSettings(), path=str(tmp_path / "x.parquet"), seed=0, shuffle=False)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"needs the 'datasets' package: pip install \"miles-core\[hf\]\""):
        HFDataSource(HFSourceSettings(), path=str(tmp_path), seed=0, shuffle=False)


def test_shuffle_is_deterministic_per_seed_and_reshuffles_each_epoch(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    epoch0, epoch1 = labels(jsonl(path).next_batch(20)), labels(jsonl(path).next_batch(40)[20:])
    assert epoch0 == labels(jsonl(path).next_batch(20))  # same seed, same order
    assert epoch0 != labels(jsonl(path, seed=8).next_batch(20))  # another seed, another order
    assert epoch0 != [r["label"] for r in ROWS]  # actually shuffled
    assert sorted(epoch0) == sorted(epoch1) == sorted(r["label"] for r in ROWS)  # each epoch: every row once
    assert epoch0 != epoch1  # reshuffled from seed + epoch
    assert labels(jsonl(path, seed=8).next_batch(20)) == epoch1  # seed 7 epoch 1 == seed 8 epoch 0
    assert labels(jsonl(path, shuffle=False).next_batch(25)) == [r["label"] for r in ROWS + ROWS[:5]]


def test_batches_wrap_epochs_and_cover_each_prompt_once_per_epoch(tmp_path: Path) -> None:
    source = jsonl(write_jsonl(tmp_path / "p.jsonl", ROWS))
    seen = [p.label for _ in range(9) for p in source.next_batch(7)]  # 63 prompts = 3 epochs + 3
    assert len(source) == 20 and source.epoch == 3 and source.offset == 3
    for e in range(3):
        assert sorted(seen[20 * e : 20 * (e + 1)]) == sorted(r["label"] for r in ROWS)
    with pytest.raises(ValueError, match="n >= 1"):
        source.next_batch(0)


@pytest.mark.parametrize("first_reads", [[3], [7, 13], [20], [19, 20, 5]])
def test_state_dict_resume_replays_exactly(tmp_path: Path, first_reads: list[int]) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    reference = jsonl(path)
    for n in first_reads:
        reference.next_batch(n)
    state = json.loads(json.dumps(reference.state_dict()))  # it travels as JSON in checkpoints
    resumed = jsonl(path)
    resumed.load_state_dict(state)
    for n in (6, 20, 11, 33):
        assert labels(resumed.next_batch(n)) == labels(reference.next_batch(n))
    assert resumed.state_dict() == reference.state_dict()


def test_state_from_other_data_or_seed_is_refused(tmp_path: Path) -> None:
    source = jsonl(write_jsonl(tmp_path / "p.jsonl", ROWS))
    source.next_batch(5)
    state = source.state_dict()
    smaller = jsonl(write_jsonl(tmp_path / "q.jsonl", ROWS[:-1]))
    with pytest.raises(DataError, match="taken over 20 prompts, the data now has 19"):
        smaller.load_state_dict(state)
    with pytest.raises(DataError, match=r"seed=7 .*seed=9"):
        jsonl(tmp_path / "p.jsonl", seed=9).load_state_dict(state)
    with pytest.raises(DataError, match="missing or invalid 'offset'"):
        source.load_state_dict({"epoch": 0, "num_prompts": 20})


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "ok"', r"prompts.jsonl:3: invalid JSON"),
        ('["prompt"]', r"prompts.jsonl:3: expected a JSON object, got list"),
        ('{"question": "x"}', r"prompts.jsonl:3: missing key 'prompt'"),
        ('{"prompt": 42}', r"prompts.jsonl:3: key 'prompt' must be a string or a list of chat messages, got int"),
        ('{"prompt": "   "}', r"prompts.jsonl:3: empty prompt"),
        ('{"prompt": []}', r"prompts.jsonl:3: empty prompt"),
        ('{"prompt": [{"content": "x"}]}', r"prompts.jsonl:3: prompt\[0\] needs a string 'role'"),
        ('{"prompt": [{"role": "user", "content": 5}]}', r"prompts.jsonl:3: prompt\[0\] needs a 'content' string"),
    ],
)
def test_bad_row_names_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n' + bad_line + '\n{"prompt": "c"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=message) as info:
        jsonl(path)
    assert isinstance(info.value, MilesError) and info.value.exit_code == 2


def test_bad_parquet_row_and_missing_path(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "a"}, {"prompt": None}]), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d.parquet:2: key 'prompt' must be a string .* got NoneType"):
        ParquetDataSource(ComponentSettings(), path=str(tmp_path / "d.parquet"), seed=0, shuffle=False)
    with pytest.raises(DataError, match=r"nope.jsonl: no such file or directory \(data.path\)"):
        jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(DataError, match="empty.jsonl: no prompts"):
        jsonl(tmp_path / "empty.jsonl")


def test_builtin_plugin_registers_the_sources() -> None:
    manager = PluginManager(builtins=[b for b in BUILTIN_PLUGINS if b[0] == "data"], entry_points=False).load()
    registry = manager.registry(ComponentKind.DATA_SOURCE)
    assert {name: registry.get(name).component for name in ("jsonl", "parquet", "hf")} == {
        "jsonl": JsonlDataSource,
        "parquet": ParquetDataSource,
        "hf": HFDataSource,
    }
    assert registry.get("hf").plugin == "data"


def test_consumers_mutating_a_batch_do_not_change_later_epochs(tmp_path: Path) -> None:
    source = jsonl(write_jsonl(tmp_path / "p.jsonl", ROWS[:3]), shuffle=False)
    for prompt in source.next_batch(3):
        prompt.metadata["seen"] = True
        prompt.label = "changed"
    again = source.next_batch(3)
    assert [p.label for p in again] == ["0", "2", "4"] and all("seen" not in p.metadata for p in again)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf"])
def test_builtin_sources_pass_the_conformance_kit(tmp_path: Path, kind: str) -> None:
    from miles.testing import check_data_source

    if kind == "jsonl":
        check_data_source(JsonlDataSource, write_jsonl(tmp_path / "p.jsonl", ROWS[:5]))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS[:5]), tmp_path / "p.parquet")
        check_data_source(ParquetDataSource, tmp_path / "p.parquet")
    else:
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_list(ROWS[:5]).save_to_disk(str(tmp_path / "ds"))
        check_data_source(HFDataSource, tmp_path / "ds")
