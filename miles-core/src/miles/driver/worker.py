"""The trainer-rank process: ``python -m miles.driver.worker RUN_DIR``.

Started by the launcher once per rank with the ``torch.distributed`` rendezvous variables set. Reads the
resolved settings and the launch description (engine URLs, resume point) from the run directory, joins
the process group (gloo on CPU, NCCL on GPU) and runs the :class:`~miles.driver.loop.TrainingLoop`.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import NoReturn

from miles.errors import MilesError

log = logging.getLogger("miles.worker")


def _dist_context() -> object:
    import torch

    from miles.training.trainer import DistContext

    device = os.environ.get("MILES_DEVICE", "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    return DistContext(
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        local_rank=local_rank,
        device=device,
    )


async def _run(run_dir: Path) -> None:
    import torch.distributed as dist

    from miles.compose import build_run
    from miles.driver.loop import TrainingLoop, run_to_completion
    from miles.rollout.router import FLEET_FILE, EngineFleet
    from miles.settings.model import MilesSettings
    from miles.startup import freeze_startup_objects

    settings = MilesSettings.model_validate(json.loads((run_dir / "settings.json").read_text()))
    launch = json.loads((run_dir / "launch.json").read_text())
    ctx = _dist_context()
    backend = "nccl" if ctx.device == "cuda" else "gloo"  # type: ignore[attr-defined]
    dist.init_process_group(backend=backend)
    run = build_run(settings)
    # the engines are announced once they answer (their URLs are final then); rank 0 loads its model meanwhile
    wait = settings.cluster.engine_startup_timeout + settings.rollout.router.startup_timeout + 60
    fleet = (lambda: EngineFleet.announced(run_dir / FLEET_FILE, timeout=wait)) if launch.get("engines") else None
    loop = TrainingLoop(run, ctx, fleet=fleet, resume=launch.get("resume"))  # type: ignore[arg-type]
    freeze_startup_objects()  # the exit's last garbage collection no longer walks every import-time object
    try:
        await run_to_completion(loop)
    finally:
        if dist.is_initialized():
            if loop.completed:
                dist.barrier()  # gloo teardown aborts now and then without it
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m miles.driver.worker RUN_DIR")
    logging.basicConfig(
        level=os.environ.get("MILES_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(levelname)s %(name)s: %(message)s",
    )
    for client in ("httpx", "httpx2"):  # one line per request is noise at RL rates (openai 3 logs through httpx2)
        logging.getLogger(client).setLevel(logging.WARNING)
    threads = os.environ.get("MILES_TORCH_THREADS")
    if threads:
        from miles.torch_threads import set_torch_threads

        set_torch_threads(int(threads))
    code = 0
    try:
        asyncio.run(_run(Path(args[0])))
    except MilesError as exc:
        log.error("%s", exc)
        code = exc.exit_code
    except Exception:
        log.error("training failed:\n%s", traceback.format_exc())
        code = 1
    _leave(code)


def _leave(code: int) -> NoReturn:
    """End the rank's process with ``code`` once its work is done as the interpreter's exit does (executors
    stopped, threads joined, exit handlers run, logs and streams flushed), then without its finalization.

    Finalization stops a thread that is still in native code when it next takes the GIL (a daemon thread in a
    torch op, a gloo worker thread dropping the last reference to a tensor) by unwinding it, and C++ answers
    that with ``std::terminate``: a rank whose every step and checkpoint was written ended on SIGABRT now and
    then ("terminate called without an active exception", two gloo ranks of a multi-node LoRA run in CI).
    """
    threading._shutdown()  # type: ignore[attr-defined]  # the exit's first step: executors told to stop, threads joined
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
