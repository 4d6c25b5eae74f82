"""GPU check of the ``ray`` launcher's device placement (issue 21), on one machine with one or more GPUs.

Starts a one-node Ray cluster through the launcher (``cluster.launcher.address`` unset) and checks:

- disaggregated (needs 2 GPUs): trainer rank 0 and engine 0 each see exactly one GPU
  (``CUDA_VISIBLE_DEVICES`` from Ray), and not the same one;
- colocated (1 GPU is enough): trainer rank 0 and engine 0 share one bundle's GPU and see the same
  device (same UUID); trainer rank 0 gets ``LOCAL_RANK=0``.

Each process prints its ``CUDA_VISIBLE_DEVICES``, ``LOCAL_RANK`` and ``torch.cuda.get_device_properties(0).uuid``;
the script compares them and exits non-zero on a mismatch.

    python scripts/gpu/ray_launcher_check.py

Not run yet: the one GPU machine lent so far could not carry Ray's wheels.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from pathlib import Path

PROBE = (
    "import json, os, sys, time, torch\n"
    "print('PROBE ' + json.dumps({'cvd': os.environ.get('CUDA_VISIBLE_DEVICES'), "
    "'local_rank': os.environ.get('LOCAL_RANK'), 'count': torch.cuda.device_count(), "
    "'uuid': str(torch.cuda.get_device_properties(0).uuid)}), flush=True)\n"
    "time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)\n"
)


def _probe(log_path: str) -> dict[str, object]:
    line = next(line for line in Path(log_path).read_text().splitlines() if line.startswith("PROBE "))
    return dict(json.loads(line[len("PROBE ") :]))


def check(colocate: bool) -> list[str]:
    from miles.launch.base import ProcessSpec
    from miles.launch.ray_launcher import RayLauncher, RayLauncherSettings
    from miles.launch.rendezvous import trainer_specs

    failures: list[str] = []
    with RayLauncher(RayLauncherSettings(handle_signals=False), run_dir=tempfile.mkdtemp()) as launcher:
        launcher.reserve(trainer_ranks=1, num_engines=1, colocate=colocate, device="cuda", gpus_per_engine=1)
        # the "engine" is the probe started in engine 0's actor (no health URL needed)
        engine = launcher._start_member(
            ProcessSpec(name="engine-0", argv=[sys.executable, "-c", PROBE, "20"]), "engine", 0
        )
        launcher.start_trainers(trainer_specs([sys.executable, "-c", PROBE], 1))
        launcher.wait_trainers(timeout=120)
        trainer = _probe(launcher.trainers[0].log_path)
        for _ in range(200):
            if "PROBE " in Path(engine.log_path).read_text():
                break
            time.sleep(0.1)
        eng = _probe(engine.log_path)
    print(f"colocate={colocate}: trainer {trainer}; engine {eng}")
    if trainer["count"] != 1 or eng["count"] != 1:
        failures.append(f"colocate={colocate}: each process must see one GPU ({trainer['count']}, {eng['count']})")
    if trainer["local_rank"] != "0":
        failures.append(f"colocate={colocate}: trainer LOCAL_RANK {trainer['local_rank']!r}, expected '0'")
    same = trainer["uuid"] == eng["uuid"]
    if same != colocate:
        failures.append(f"colocate={colocate}: trainer and engine {'share' if same else 'do not share'} a GPU")
    return failures


def main() -> int:
    import torch

    logging.basicConfig(level=logging.INFO)
    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("no CUDA device")
        return 2
    failures = check(colocate=True)
    if gpus >= 2:
        failures += check(colocate=False)
    else:
        print("disaggregated check skipped: it needs 2 GPUs")
    for failure in failures:
        print("FAIL", failure)
    print("ok" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
