"""GPU check of the weight transports (issue 25): a local engine on the GPU, trainer weights on the GPU.

Runs the conformance kit's delivery check (randomized engine weights, a verified push, a left-out tensor
caught by name) for each transport whose data path works with one GPU, and prints one line each:

- ``disk_delta``: deltas of CUDA tensors copied to the host, applied by the engine into its CUDA weights;
- ``p2p`` over ``shm``: device-to-host casts into the shared buffer, the engine's commit copies host-to-device;
- ``p2p`` over ``mooncake`` (when ``mooncake`` imports): the same through the Transfer Engine over TCP;
- ``shm`` (the example plugin, when installed): files in ``/dev/shm``, loaded onto the GPU.

The NCCL paths (``broadcast`` and ``p2p`` over ``torch``) need two GPUs: NCCL refuses two processes on one
device. ``write_into_weights`` needs CPU weights (a GPU engine refuses it; CUDA IPC would be its GPU form).

    python scripts/gpu/check_weight_transports.py            # exits non-zero if a check fails

Run on one H200 (2026-12-04): disk_delta and p2p over shm passed (benchmarks/results/gpu_h200_2026-12-04/).
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

DEVICE = os.environ.get("MILES_GPU_CHECK_DEVICE", "cuda")
"""Where the checks run: ``cuda``; ``MILES_GPU_CHECK_DEVICE=cpu`` is a dry run of the script on the CPU."""


def main() -> int:
    import torch

    from miles.testing import check_transport_delivery
    from miles.transport.disk_delta import DiskDeltaTransport

    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    cases: list[tuple[str, Any, dict[str, Any]]] = [("disk_delta", DiskDeltaTransport, {})]
    try:
        from miles_p2p.transport import P2PTransport

        cases.append(("p2p shm", P2PTransport, {"datapath": "shm"}))
        try:
            import mooncake.engine  # noqa: F401

            cases.append(("p2p mooncake", P2PTransport, {"datapath": "mooncake"}))
        except ImportError:
            print("p2p mooncake: skipped (mooncake not installed)")
    except ImportError:
        print("p2p: skipped (miles-p2p not installed)")
    try:
        from miles_shm_transport.transport import ShmTransport

        cases.append(("shm example", ShmTransport, {}))
    except ImportError:
        print("shm example: skipped (not installed)")
    failed = 0
    for label, cls, settings in cases:
        with tempfile.TemporaryDirectory(prefix="miles-gpu-transport-") as tmp:
            if label == "disk_delta":
                settings = {"dir": str(Path(tmp) / "w")}
            try:
                facts = check_transport_delivery(
                    cls,
                    tmp,
                    settings=settings,
                    engine_dtype="bfloat16",
                    engine_args=["--device", DEVICE],
                    trainer_device=DEVICE,
                )
                print(
                    f"{label}: ok ({facts['verified_tensors']:.0f} tensors verified, push {facts['push_seconds']:.3f} s)"
                )
            except Exception:
                failed += 1
                print(f"{label}: FAILED\n{traceback.format_exc()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
