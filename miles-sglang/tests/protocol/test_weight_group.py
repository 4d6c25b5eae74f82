"""The weight-update group against SGLang's own code: an engine process runs SGLang's
``init_custom_process_group`` (taken from the installed wheel's source, as its
``/init_weights_update_group`` calls it: ``tcp://`` rendezvous, the group's name as the store prefix) and
joins the group Miles' trainer side builds with :func:`~miles.transport.broadcast.make_process_group`;
a broadcast then arrives (gloo here; NCCL uses the same key layout under ``cuda/``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from miles.net import free_port
from miles.transport.broadcast import make_process_group
from miles_sglang.sglang_source import SGLangSource

SGLANG_SIDE = textwrap.dedent(
    """
    import ast, datetime, sys, torch
    path, port, name, own = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    tree = ast.parse(open(path).read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "init_custom_process_group")
    scope = {"torch_release": tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), scope)
    # SGLang's scheduler has a default process group of its own (its TP world)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{own}", rank=0, world_size=1)
    group = scope["init_custom_process_group"](
        backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1, group_name=name,
        timeout=datetime.timedelta(seconds=60),
    )
    t = torch.zeros(6)
    torch.distributed.broadcast(t, src=0, group=group)
    print(" ".join(str(int(v)) for v in t.tolist()), flush=True)
    # leave the groups before exiting, as an engine's shutdown does: a gloo group torn down by the interpreter's
    # exit while its threads still run aborts the process ("terminate called without an active exception")
    torch.distributed.destroy_process_group(group)
    torch.distributed.destroy_process_group()
    """
)


def test_an_sglang_engine_joins_the_trainers_group_and_receives(source: SGLangSource) -> None:
    common = source.root / "srt" / "utils" / "common.py"
    assert source.defines("sglang.srt.utils.common", "init_custom_process_group")
    port, own = free_port(), free_port()
    name = "miles_weights-0123456789abcdef0123456789abcdef"
    engine = subprocess.Popen(
        [sys.executable, "-c", SGLANG_SIDE, str(common), str(port), name, str(own)], stdout=subprocess.PIPE, text=True
    )
    try:
        group, _store = make_process_group(
            "gloo", host="127.0.0.1", port=port, rank=0, world_size=2, timeout=60, is_master=True, group_name=name
        )
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([torch.arange(6, dtype=torch.float32)], opts).wait()
        out, _ = engine.communicate(timeout=60)
    finally:
        if engine.poll() is None:
            engine.kill()
    assert engine.returncode == 0
    assert out.split() == ["0", "1", "2", "3", "4", "5"]
