"""ParkedMemory: the storages under a trainer's tensors leave for host memory and come back exactly, the
tensor objects (and views over the same storage) unchanged."""

from __future__ import annotations

import pytest
import torch

from miles.training.offload import ParkedMemory, device_bytes


def test_storages_leave_and_come_back_exactly_with_their_views() -> None:
    base = torch.randn(64, 32)
    view = base[8:24]  # the same storage: parked once
    other = torch.arange(100, dtype=torch.int64)
    state = {"exp_avg": torch.randn(64, 32), "step": torch.tensor(3.0)}
    before = {"base": base.clone(), "other": other.clone(), **{k: v.clone() for k, v in state.items()}}
    tensors = [base, view, other, *state.values()]
    resident = device_bytes(tensors)
    assert resident == (64 * 32 * 4) + 100 * 8 + 64 * 32 * 4 + 4

    parked = ParkedMemory()
    assert parked.park("state", [state["exp_avg"], state["step"]]) == 64 * 32 * 4 + 4
    assert parked.park("weights", [base, view, other]) == 64 * 32 * 4 + 100 * 8
    assert device_bytes(tensors) == 0 and parked.parked_bytes == resident
    assert parked.park("weights", [base]) == 0  # already parked: nothing more to move
    assert base.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    assert parked.holds("weights") and parked.holds("state")

    assert parked.restore("weights") == 64 * 32 * 4 + 100 * 8
    assert not parked.holds("weights") and parked.holds("state")
    assert torch.equal(base, before["base"]) and torch.equal(other, before["other"])
    assert torch.equal(view, before["base"][8:24]) and view.data_ptr() == base.data_ptr() + 8 * 32 * 4
    assert parked.restore() == 64 * 32 * 4 + 4
    assert all(torch.equal(state[k], before[k]) for k in state)
    assert device_bytes(tensors) == resident and parked.parked_bytes == 0


def test_only_the_named_device_is_parked() -> None:
    cpu = torch.ones(10)
    parked = ParkedMemory()
    assert parked.park("state", [cpu], device="cuda") == 0  # (a CPU-offloaded optimizer's state stays)
    assert cpu.untyped_storage().nbytes() == 40
    assert parked.park("state", [cpu], device="cpu") == 40


def test_a_parameter_mapped_from_a_file_gets_its_own_storage_and_a_tensor_is_left(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    save_file({"w": torch.ones(4, 4), "b": torch.ones(4)}, str(tmp_path / "m.safetensors"))
    loaded = load_file(str(tmp_path / "m.safetensors"))
    mapped = loaded["b"]
    weight = torch.nn.Parameter(loaded["w"])
    if mapped.untyped_storage().resizable():
        pytest.skip("safetensors gave resizable storages here")
    parked = ParkedMemory()
    assert parked.park("weights", [weight, mapped]) == 64  # the parameter, copied first; not the plain tensor
    assert mapped.untyped_storage().nbytes() and weight.untyped_storage().nbytes() == 0
    parked.restore()
    assert torch.equal(weight, torch.ones(4, 4))
