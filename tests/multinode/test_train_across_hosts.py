"""``miles train`` with the ``ray`` launcher on a Ray cluster across namespace hosts: the head node on host a
(``trainer_node``), a worker node on host b (``engine_node``), one on host c (``router_node``). Both trainer
ranks run on a, the engine on b, listening on b's address; the driver runs on a (where it reaches the head).
Real GRPO on a tiny Qwen2, every push verified, for every transport: ``disk`` (the run directory: a path
every host sees), ``broadcast`` (its store on trainer rank 0's node address, which the launcher hands to
rank 0: on 127.0.0.1, the old default, the engine on b could never reach it), ``p2p`` over Mooncake TCP and
over torch (the store on rank 0's node, each rank's Mooncake endpoint on its own), ``disk_delta`` and
``lora``; the smg router on host c's node with every request through it; a run stopped after its step-2
checkpoint resumes to the uninterrupted run's step 3, bit for bit; a transport directory each node sees as
its own (a node-local disk) is refused before anything starts; a run with keys (issue 46) whose services
listen beyond loopback keeps them off every command line and out of the run directory. One cluster for the
module (its start dominates).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.testing.hosts import NamespaceHosts
from miles.testing.ray_cluster import RayCluster
from miles.testing.runs import (
    children_of_run,
    hf_weights,
    paced_reward,
    read_metrics,
    run_miles,
    write_run_config,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


LAUNCHER = """
[cluster.launcher]
name = "ray"
address = "{address}"
trainer_resources = {{ trainer_node = 1 }}
engine_resources = {{ engine_node = 1 }}
router_resources = {{ router_node = 1 }}
terminate_timeout = 5

[rollout.engine]
name = "local"
enable_deterministic_inference = true
"""


def write_config(
    tmp_path: Path,
    cluster: RayCluster,
    model: Path,
    data: Path,
    run_dir: Path,
    transport: str,
    options: str = "",
    *,
    rollouts: int = 2,
    extra: str = "",
) -> Path:
    """``rollouts`` steps of GRPO with 2 trainer ranks (on host a) and one engine (on host b) on ``cluster``;
    TOML ``extra`` appended (a ``[cluster.launcher]`` key goes in ``LAUNCHER``'s table: use ``launcher``)."""
    tables = LAUNCHER.format(address=cluster.address) + extra
    return write_run_config(
        tmp_path, model, data, run_dir, tables, ranks=2, transport=transport, transport_options=options,
        rollouts=rollouts,
    )  # fmt: skip


def train_on_head(
    cluster: RayCluster, config: Path, timeout: float = 400, *, resume: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``miles train config`` on the head's host (the driver must reach the head), to its end."""
    return stop_on_head(cluster, config, timeout=timeout, resume=resume)


def stop_on_head(
    cluster: RayCluster, config: Path, *, when: Path | None = None, timeout: float = 400, resume: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``miles train config`` on the head's host, stopped with SIGTERM (as a scheduler stops a job) as soon as
    ``when`` exists (``None``: left to its end)."""
    argv = [sys.executable, "-m", "miles", "train", str(config), *(["--resume", resume] if resume else [])]
    proc = cluster.head.popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**cluster.environ(), "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    try:
        if when is not None:
            deadline = time.monotonic() + timeout
            while proc.poll() is None and not when.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


RUN_ACTORS = """
import json, sys, time, ray
ray.init(namespace="miles", log_to_driver=False)
deadline = time.monotonic() + 30
while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
    time.sleep(0.2)
actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(sys.argv[1])]
print(json.dumps({"actors": actors, "free": ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]}))
"""


def leftovers(cluster: RayCluster, run_dir: Path) -> list[str]:
    """The run's processes still alive anywhere on the machine (command lines naming its directory), its Ray
    actors, and CPUs of the cluster still reserved."""
    found = [f"pid {pid}" for pid in children_of_run(run_dir)]
    out = cluster.driver(RUN_ACTORS, run_dir.name + "-", timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    state = json.loads(out.stdout.strip().splitlines()[-1])
    found += [f"actor {name}" for name in state["actors"]]
    if not state["free"]:
        found.append("CPUs still reserved")
    return found


def check_run(
    cluster: RayCluster, run_dir: Path, out: subprocess.CompletedProcess[str], steps: int = 2
) -> list[dict[str, float]]:
    """``steps`` verified steps, trainer ranks on host a, the engine on host b at b's address, nothing left;
    returns the metrics."""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        assert row["weight_sync/verified"] == 1.0 and row["weight_sync/verified_tensors"] > 0, row
        assert 0.0 <= row["fidelity/train_rollout_logprob_abs_diff"] < 1e-4, row
    a, b = cluster.hosts[:2]
    placement = json.loads((run_dir / "logs" / "placement.json").read_text())
    assert placement["trainer-0"]["ip"] == placement["trainer-1"]["ip"] == a.address, placement
    assert placement["trainer-0"]["node_id"] == cluster.node_ids["a"]
    assert placement["engine-0"]["ip"] == b.address and placement["engine-0"]["node_id"] == cluster.node_ids["b"]
    (url,) = json.loads((run_dir / "fleet.json").read_text())["engine_urls"]
    assert url.startswith(f"http://{b.address}:"), url
    assert leftovers(cluster, run_dir) == []
    return rows


SEAM = """
import json, logging, sys
from miles.launch.ray_launcher import RayLauncher, RayLauncherSettings
from miles.launch.rendezvous import trainer_specs
from miles.rollout.backend import EngineLaunch

logging.basicConfig(level=logging.INFO)
RANK = (
    "import json, os; from miles.transport.broadcast import BroadcastTransport, BroadcastTransportSettings; "
    "t = BroadcastTransport(BroadcastTransportSettings(), run_dir='.', model_path=None, engine_dtype='float32'); "
    "print('MASTER', json.dumps(t.master_address))"
)
settings = RayLauncherSettings(
    address=sys.argv[1], trainer_resources={"trainer_node": 1}, engine_resources={"engine_node": 1},
    trainer_cpus=0.5, engine_cpus=0.5, handle_signals=False, poll_interval=0.1,
)
with RayLauncher(settings, run_dir=sys.argv[2]) as launcher:
    launcher.reserve(trainer_ranks=1, num_engines=1, colocate=False, device="cpu", gpus_per_engine=1)
    host, port = launcher.engine_address(0, "127.0.0.1")
    server = [sys.executable, "-m", "http.server", str(port), "--bind", host]
    launcher.start_engines([EngineLaunch(argv=server, url=f"http://{host}:{port}", health_path="/")], timeout=120)
    launcher.start_trainers(trainer_specs([sys.executable, "-c", RANK], 1))
    assert launcher.wait_trainers(timeout=120) == 0
    print(json.dumps({"engine": [host, port], "placement": launcher.placement}))
"""


def test_broadcast_master_address_is_the_trainer_nodes_when_the_engine_is_elsewhere(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    """The launcher hands trainer rank 0 its node's address (``MILES_NODE_ADDRESS``), and broadcast's store
    address defaults to it: host a's address, while the engine listens on host b's (the old default,
    127.0.0.1, is an address the engine's host has too, but rank 0's store is not there)."""
    run_dir = tmp_path / "seam"
    out = ray_cluster.driver(SEAM, ray_cluster.address, str(run_dir), timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    said = json.loads(out.stdout.strip().splitlines()[-1])
    a, b = ray_cluster.hosts[:2]
    assert said["engine"][0] == b.address and said["placement"]["engine-0"]["ip"] == b.address
    assert said["placement"]["trainer-0"]["ip"] == a.address
    rank_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert f'MASTER "{a.address}"' in rank_log, rank_log[-2000:]
    assert leftovers(ray_cluster, run_dir) == []


def test_broadcast_transport_rendezvouses_on_trainer_rank_0s_node(
    ray_cluster: RayCluster, tmp_path: Path, tiny_model: Path, arithmetic_prompts: Path
) -> None:
    run_dir = tmp_path / "broadcast"
    # (a rendezvous that the engine cannot reach fails in 60 s rather than the default 600)
    config = write_config(tmp_path, ray_cluster, tiny_model, arithmetic_prompts, run_dir, "broadcast", "timeout = 60")
    out = train_on_head(ray_cluster, config)
    check_run(ray_cluster, run_dir, out)
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert f"with 1 engines at {ray_cluster.head.address}:" in trainer_log, trainer_log[-3000:]


# -- p2p, disk_delta, the router on a node of its own, and an exact resume after a stop --------------------
CHECKPOINTED = """
[checkpoint]
save_interval = 2
"""

ROUTED = """
[rollout.router]
name = "smg"
"""


def compared(row: dict[str, float]) -> dict[str, float]:
    """What a resumed step must reproduce bit for bit: everything but timings and the weight path's own
    figures (the resumed run may push by another transport)."""
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(("time/", "weight_sync/", "rollout/routed"))
        and "seconds" not in k
        and "per_second" not in k
    }


@pytest.fixture(scope="module")
def uninterrupted(
    ray_cluster: RayCluster, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, arithmetic_prompts: Path
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """Three steps pushed by ``p2p`` over Mooncake TCP, checkpointed at step 2: the reference of the resume."""
    tmp_path = tmp_path_factory.mktemp("mooncake")
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path, ray_cluster, tiny_model, arithmetic_prompts, run_dir, "p2p", 'datapath = "mooncake"\ntimeout = 60',
        rollouts=3, extra=CHECKPOINTED,
    )  # fmt: skip
    return run_dir, train_on_head(ray_cluster, config)


def test_p2p_over_mooncake_tcp_across_hosts(
    ray_cluster: RayCluster, uninterrupted: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    """Each trainer rank's Mooncake endpoint advertises its node's address (host a), the engine's its own
    (host b): every chunk crosses the link, every push is verified chunk by chunk and tensor by tensor."""
    run_dir, out = uninterrupted
    rows = check_run(ray_cluster, run_dir, out, steps=3)
    assert all(row["weight_sync/chunks"] > 0 for row in rows)
    assert "(mooncake)" in (run_dir / "logs" / "trainer-0.log").read_text()


def test_a_stopped_run_resumes_bit_exact_through_p2p_torch_and_the_router_on_its_own_node(
    ray_cluster: RayCluster,
    tmp_path: Path,
    tiny_model: Path,
    arithmetic_prompts: Path,
    uninterrupted: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """The run of :func:`uninterrupted` pushing by ``disk_delta`` (its directory under the shared run
    directory), stopped by SIGTERM once its step-2 checkpoint is written: nothing is left on any node. Resumed
    pushing by ``p2p`` over torch (the group's store on rank 0's node, host a) with the smg router on host c's
    node, its step 3 is the uninterrupted run's, bit for bit (rollouts, logprobs, rewards, losses, grad norms
    and the exported weights), and every request of it went through the router."""
    import torch

    reference_dir, reference_out = uninterrupted
    assert reference_out.returncode == 0, reference_out.stderr[-3000:]
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path, ray_cluster, tiny_model, arithmetic_prompts, run_dir, "disk_delta", rollouts=3, extra=CHECKPOINTED
    )
    out = stop_on_head(ray_cluster, config, when=run_dir / "checkpoints" / "step_000002" / "driver.json")
    assert out.returncode != 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["weight_sync/verified"] == 1.0 for r in rows)
    assert rows[1]["weight_sync/full_snapshots"] == 0.0, rows  # step 2 went as a delta against step 1
    assert leftovers(ray_cluster, run_dir) == []

    config = write_config(
        tmp_path, ray_cluster, tiny_model, arithmetic_prompts, run_dir, "p2p", "timeout = 60", rollouts=3,
        extra=CHECKPOINTED + ROUTED,
    )  # fmt: skip
    out = train_on_head(ray_cluster, config, resume=str(run_dir))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert resumed[-1]["weight_sync/verified"] == 1.0
    expected = read_metrics(reference_dir)[-1]
    assert "fidelity/train_rollout_logprob_abs_diff" in compared(expected)
    assert compared(resumed[-1]) == compared(expected)
    ours, theirs = hf_weights(run_dir / "hf"), hf_weights(reference_dir / "hf")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    c = ray_cluster.hosts[2]
    placement = json.loads((run_dir / "logs" / "placement.json").read_text())
    assert placement["router"]["ip"] == c.address and placement["router"]["node_id"] == ray_cluster.node_ids["c"]
    fleet = json.loads((run_dir / "fleet.json").read_text())
    assert fleet["router_url"].startswith(f"http://{c.address}:"), fleet
    # every sample of step 3 (4 prompts x 4 samples) went through the router on c
    assert resumed[-1]["rollout/routed_requests"] == 16.0
    assert leftovers(ray_cluster, run_dir) == []


def test_lora_adapters_across_hosts(
    ray_cluster: RayCluster, tmp_path: Path, tiny_model: Path, arithmetic_prompts: Path
) -> None:
    """miles-lora: each push carries the adapter only (``delivery = "tensors"``: in the request, so the engine
    needs no shared directory), verified on the engine on host b."""
    run_dir = tmp_path / "lora"
    adapter = """
[train.adapter]
name = "lora"
r = 4
alpha = 8
"""
    config = write_config(
        tmp_path, ray_cluster, tiny_model, arithmetic_prompts, run_dir, "lora", 'delivery = "tensors"', extra=adapter
    )
    rows = check_run(ray_cluster, run_dir, train_on_head(ray_cluster, config))
    n_lora = 2 * 7 * 2  # layers x target modules x (A, B)
    assert all(row["weight_sync/verified_tensors"] == n_lora for row in rows), rows


def test_a_transport_directory_no_other_node_sees_is_refused_before_anything_starts(
    ray_cluster: RayCluster, tmp_path: Path, tiny_model: Path, arithmetic_prompts: Path
) -> None:
    """``transport.dir`` on each node's own disk (:attr:`RayCluster.node_local_dir`): trainer rank 0's node
    writes a marker there that the engine's node does not see; the run stops at once with exit 2, naming the
    field and the engine's node, and leaves nothing behind."""
    run_dir = tmp_path / "refused"
    weights = ray_cluster.node_local_dir / "weights"
    config = write_config(tmp_path, ray_cluster, tiny_model, arithmetic_prompts, run_dir, "disk", f'dir = "{weights}"')
    out = train_on_head(ray_cluster, config, timeout=180)
    said = " ".join(out.stderr.split())
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"transport.dir: {weights} is not a directory every node of the run shares" in said, said[-3000:]
    assert f"engine-0 (node {ray_cluster.hosts[1].address}" in said, said[-3000:]
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "logs" / "engine-0.log").exists()
    assert leftovers(ray_cluster, run_dir) == []


# -- engines that join and leave while the run goes on, one on a node that joined the cluster for it ----------
def test_an_engine_on_a_node_that_joined_mid_run_replaces_one_and_no_sample_is_lost(
    ray_cluster: RayCluster, namespace_hosts: NamespaceHosts, tmp_path: Path, tiny_model: Path, arithmetic_prompts: Path
) -> None:
    """A run pushing by ``disk`` (the run directory: every host sees it) starts with its engine on host b;
    host d's node joins the cluster while it starts (``late_node``). Once the engines are announced, ``miles
    fleet add --resources '{"late_node": 1}'`` starts an engine on d, which loads the next push (a full
    version from the shared directory) and serves, and ``miles fleet remove engine-0`` then drains and stops
    b's (both asked at once: one request at a time). Every step generates all its groups, every push is
    verified, the last steps' samples come from d's engine, and nothing is left on any node. (A remote reward
    paces the steps, 2 s each, until both changes are done, so they are done mid-run whatever the load.)"""
    run_dir = tmp_path / "fleet"
    gate = tmp_path / "changes-done"
    # in host a, where trainer rank 0 scores (its own ports: any is free there)
    server, paced = paced_reward(gate, port=28765, popen=ray_cluster.head.popen)
    steps = 30
    config = write_config(
        tmp_path, ray_cluster, tiny_model, arithmetic_prompts, run_dir, "disk", rollouts=steps, extra=paced
    )
    d = namespace_hosts[3]
    proc = ray_cluster.head.popen(
        [sys.executable, "-m", "miles", "train", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**ray_cluster.environ(), "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    try:
        ray_cluster.add_node(d, num_cpus=2, resources={"late_node": 2})  # (the run is starting meanwhile)
        deadline = time.monotonic() + 300
        while proc.poll() is None and not (run_dir / "fleet.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        add = run_miles("fleet", "add", str(run_dir), "--resources", '{"late_node": 1}', "--no-wait")
        remove = run_miles("fleet", "remove", str(run_dir), "engine-0", "--timeout", "300")
        gate.touch()
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        for process in (proc, server):
            if process.poll() is None:
                process.kill()
                process.communicate()
    said = stdout[-3000:] + stderr[-5000:]
    assert add.returncode == 0, add.stdout + add.stderr + said
    assert remove.returncode == 0, remove.stdout + remove.stderr + said
    assert proc.returncode == 0, said
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["weight_sync/verified"] == 1.0 and r["rollout/groups_generated"] == 4 for r in rows), rows
    assert all(r["rollout/failed_fraction"] == 0.0 for r in rows), rows
    assert sum(r.get("fleet/engines_added", 0.0) for r in rows) == 1.0
    assert sum(r.get("fleet/engines_removed", 0.0) for r in rows) == 1.0
    placement = json.loads((run_dir / "logs" / "placement.json").read_text())
    assert placement["engine-0"]["ip"] == ray_cluster.hosts[1].address
    assert placement["engine-1"]["ip"] == d.address and placement["engine-1"]["node_id"] == ray_cluster.node_ids["d"]
    (url,) = json.loads((run_dir / "fleet.json").read_text())["engine_urls"]
    assert url.startswith(f"http://{d.address}:"), url
    served = [
        [json.loads(line)["metadata"]["engine_url"] for line in dump.read_text().splitlines()]
        for dump in sorted((run_dir / "samples").glob("rollout_*.jsonl"))
    ]
    assert [len(s) for s in served] == [16] * steps  # every sample of every step
    assert set(served[-1]) == {url} and url not in served[0], served
    assert leftovers(ray_cluster, run_dir) == []


def test_keyed_run_across_hosts_with_the_router_on_a_routable_address(
    ray_cluster: RayCluster, tmp_path: Path, tiny_model: Path, arithmetic_prompts: Path
) -> None:
    """Issue 46: a run whose services all listen beyond loopback — the engine on host b's address, smg on host
    a's (``cluster.host``) — with an API key and an admin key given in the environment of ``miles train``.
    The run trains and verifies every push through them; while it runs no process of this machine has a key
    on its command line; afterwards nothing in the run directory (settings.json, logs, metrics, samples,
    checkpoints) holds a key."""
    import threading

    from miles.auth import ServiceKeys

    keys = ServiceKeys("train-api-key-0c4f1d92", "train-admin-key-7be3a016")
    run_dir = tmp_path / "keyed"
    a = ray_cluster.hosts[0]
    # (actor calls get more time than the default 30 s: this run starts the most processes on a shared machine)
    # (smg on cluster.host, not on c's node: no router_resources)
    extra = (
        LAUNCHER.format(address=ray_cluster.address)
        .replace("router_resources = { router_node = 1 }\n", "")
        .replace("terminate_timeout = 5", "terminate_timeout = 5\ncall_timeout = 120")
    )
    assert "router_resources" not in extra
    extra += '\n[rollout.router]\nname = "smg"\nstartup_timeout = 120\n'
    config = write_run_config(
        tmp_path, tiny_model, arithmetic_prompts, run_dir, extra, ranks=2, transport="disk", rollouts=2
    )
    seen: list[str] = []
    done = threading.Event()

    def scan_command_lines() -> None:
        while not done.wait(0.5):
            for entry in Path("/proc").iterdir():
                try:
                    cmdline = (entry / "cmdline").read_bytes().decode(errors="replace") if entry.name.isdigit() else ""
                except OSError:
                    continue
                seen.extend(cmdline.replace("\0", " ") for key in keys.secrets() if key in cmdline)

    scanner = threading.Thread(target=scan_command_lines, daemon=True)
    scanner.start()
    env = {**ray_cluster.environ(), **keys.env(), "OMP_NUM_THREADS": "1"}
    proc = ray_cluster.head.popen(
        [sys.executable, "-m", "miles", "train", str(config), "--set", f"cluster.host={a.address}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        stdout, stderr = proc.communicate(timeout=500)
    finally:
        done.set()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    scanner.join()
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    check_run(ray_cluster, run_dir, out)
    fleet = json.loads((run_dir / "fleet.json").read_text())
    assert fleet["router_url"].startswith(f"http://{a.address}:"), fleet
    assert not seen, seen[:3]
    assert not any(key in stdout + stderr for key in keys.secrets())
    holding = [
        str(path.relative_to(run_dir))
        for path in run_dir.rglob("*")
        if path.is_file() and any(key.encode() in path.read_bytes() for key in keys.secrets())
    ]
    assert not holding, holding
    files = {p.name for p in run_dir.rglob("*") if p.is_file()}
    assert {"settings.json", "metrics.jsonl", "router.log", "engine-0.log", "trainer-0.log"} <= files, files
    assert any(p.parent.name == "samples" for p in run_dir.rglob("*") if p.is_file())
