"""GRPO on a vision-language policy through ``miles train``: a tiny Qwen2-VL built from a config, the "how many
red squares?" rows (PNG images beside the prompts), a real engine given each row's image, a trainer given its
pixel values; every push (vision tower included) verified, the trainer's logprobs equal to the engine's, in
the sync mode (one rank) and one-step-off (two FSDP2 ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.testing.runs import children_of_run, read_metrics, run_miles, write_run_config

pytest.importorskip("PIL")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from miles.testing.vlm import build_tiny_vlm, write_squares_task

    root = tmp_path_factory.mktemp("vlm-run")
    return build_tiny_vlm(root / "model", seed=0), write_squares_task(root / "data", 8, seed=0)


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_grpo_on_a_tiny_vlm_end_to_end(tmp_path: Path, task: tuple[Path, Path], mode: str) -> None:
    from safetensors import safe_open

    model, data = task
    run_dir = tmp_path / "run"
    # one_step_off on two FSDP2 ranks: the vision tower sharded, its pushes gathered and verified
    config = write_run_config(tmp_path, model, data, run_dir, ranks=1 if mode == "sync" else 2, rollouts=2)
    if mode != "sync":
        config.write_text(config.read_text().replace("temperature = 1.0", f'temperature = 1.0\nmode = "{mode}"'))
    out = run_miles("train", str(config))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    with safe_open(str(model / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
    assert any(n.startswith(("visual.", "model.visual.")) for n in names)
    for row in rows:
        # every tensor verified, the vision tower's among them
        assert row["weight_sync/verified"] == 1.0 and row["weight_sync/verified_tensors"] == len(names)
        if mode == "sync":  # the samples come from the weights being trained: same images, same logprobs
            assert 0.0 <= row["fidelity/train_rollout_logprob_abs_diff"] < 1e-4
    if mode == "sync":  # the export is a vision-language checkpoint an engine can serve: its image processor too
        from miles.data.vision import load_image_processor

        assert load_image_processor(run_dir / "hf").merge_size == 2
    assert children_of_run(run_dir) == []
