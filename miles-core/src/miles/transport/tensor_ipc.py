"""Tensors handed to another process of the same host without sending their data: the payload Miles' engine
takes in ``/update_weights_from_tensor``.

A payload is JSON: for each tensor its name, dtype, shape, stride and offset, and a *handle* of its storage —
a CUDA IPC handle on a GPU (with the GPU's UUID, since the trainer and a colocated engine may see it under
different indices), the shared-memory file that holds it on a CPU (PyTorch's ``file_system`` sharing: any
process of the host can open it). A few hundred bytes a tensor, and no pickle on either side: the receiving
process maps each storage with PyTorch's own functions and copies it into its parameters; the sender keeps
the tensors alive until the receiver has answered.

SGLang takes the same route with a pickled payload of its own serializer
(:class:`miles_sglang.tensor_transport.TensorTransport` makes it; Miles never reads one).
"""

from __future__ import annotations

import base64
import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["dump_handles", "load_handles"]

FIELD = "serialized_named_tensors"


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode("ascii")


def _bytes(value: str | None) -> bytes | None:
    return None if value is None else base64.b64decode(value)


def _handle(tensor: torch.Tensor) -> dict[str, Any]:
    """The storage handle of ``tensor`` (which the caller keeps alive)."""
    import torch
    from torch.multiprocessing import reductions

    if tensor.is_cuda:
        _, args = reductions.reduce_tensor(tensor)  # (PyTorch keeps the storage's IPC bookkeeping)
        device, handle, size, offset, counter, counter_offset, event, sync = args[6:10] + args[11:15]
        return {
            "kind": "cuda",
            "device_uuid": str(torch.cuda.get_device_properties(device).uuid),
            "handle": _b64(handle),
            "bytes": size,
            "offset_bytes": offset,
            "ref_counter_handle": _b64(counter),
            "ref_counter_offset": counter_offset,
            "event_handle": _b64(event),
            "event_sync_required": sync,
        }
    manager, handle, size = tensor.untyped_storage()._share_filename_cpu_()
    return {"kind": "shm", "manager": os.fsdecode(manager), "handle": os.fsdecode(handle), "bytes": size}


def dump_handles(named: list[tuple[str, torch.Tensor]]) -> str:
    """The JSON payload of ``named`` (detached tensors the caller keeps alive until the receiver has copied
    them; on a CPU their storage moves to shared memory, so pass copies, never live parameters)."""
    entries = [
        {
            "name": name,
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "offset": t.storage_offset(),
            "storage": _handle(t),
        }
        for name, t in named
    ]
    return json.dumps(entries)


def _cuda_index(uuid: str) -> int:
    import torch

    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise ValueError(f"{FIELD}: no GPU of this process has the UUID {uuid}")


def _open(entry: dict[str, Any]) -> torch.Tensor:
    import torch
    from torch.multiprocessing import reductions

    dtype = getattr(torch, str(entry["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{FIELD}: {entry['name']!r} has no dtype {entry['dtype']!r}")
    shape, stride, offset = torch.Size(entry["shape"]), tuple(entry["stride"]), int(entry["offset"])
    storage = entry["storage"]
    if storage["kind"] == "cuda":
        return reductions.rebuild_cuda_tensor(
            torch.Tensor, shape, stride, offset, torch.TypedStorage, dtype, _cuda_index(storage["device_uuid"]),
            _bytes(storage["handle"]), int(storage["bytes"]), int(storage["offset_bytes"]), False,
            _bytes(storage["ref_counter_handle"]), int(storage["ref_counter_offset"]),
            _bytes(storage["event_handle"]), bool(storage["event_sync_required"]),
        )  # fmt: skip
    if storage["kind"] == "shm":
        shared = torch.UntypedStorage._new_shared_filename_cpu(
            os.fsencode(storage["manager"]), os.fsencode(storage["handle"]), int(storage["bytes"])
        )
        return torch.empty(0, dtype=dtype).set_(shared, offset, shape, stride)
    raise ValueError(f"{FIELD}: {entry['name']!r} has a storage of unknown kind {storage['kind']!r}")


def load_handles(payload: str) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` list of a payload, each tensor mapped from the sender's memory (copy it before
    answering). Anything but Miles' list of tensor handles is refused, naming the field."""
    try:
        entries = json.loads(payload)
    except ValueError as exc:
        raise ValueError(f"{FIELD}: not JSON ({exc}); Miles' engine takes Miles' tensor handles") from None
    if not isinstance(entries, list):
        raise ValueError(f"{FIELD}: expected a list of tensor handles")
    out = []
    for entry in entries:
        try:
            out.append((str(entry["name"]), _open(entry)))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{FIELD}: a tensor handle without {exc}") from None
        except RuntimeError as exc:
            raise ValueError(f"{FIELD}: cannot open {entry.get('name')!r} ({exc})") from None
    return out
