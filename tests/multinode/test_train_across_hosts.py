"""``miles train`` with the ``ray`` launcher on a Ray cluster across two namespace hosts: the head node on host
a (``trainer_node``), a worker node on host b (``engine_node``). Both trainer ranks run on a, the engine on b,
listening on b's address; the driver runs on a (where it reaches the head). Real GRPO on a tiny Qwen2, every
push verified, for the ``disk`` transport (the run directory: a path both hosts see) and ``broadcast``
(its store on trainer rank 0's node address, which the launcher hands to rank 0: on 127.0.0.1, the old
default, the engine on b could never reach it). One cluster for the module (its start dominates)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.testing.ray_cluster import RayCluster
from miles.testing.runs import children_of_run, read_metrics, write_run_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


LAUNCHER = """
[cluster.launcher]
name = "ray"
address = "{address}"
trainer_resources = {{ trainer_node = 1 }}
engine_resources = {{ engine_node = 1 }}
terminate_timeout = 5

[rollout.engine]
name = "local"
enable_deterministic_inference = true
"""


def write_config(
    tmp_path: Path, cluster: RayCluster, model: Path, data: Path, run_dir: Path, transport: str, options: str = ""
) -> Path:
    """Two steps of GRPO with 2 trainer ranks (on host a) and one engine (on host b) on ``cluster``."""
    extra = LAUNCHER.format(address=cluster.address)
    return write_run_config(
        tmp_path, model, data, run_dir, extra, ranks=2, transport=transport, transport_options=options, rollouts=2
    )


def train_on_head(cluster: RayCluster, config: Path, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    """``miles train config`` on the head's host (the driver must reach the head), to its end."""
    proc = cluster.head.popen(
        [sys.executable, "-m", "miles", "train", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**cluster.environ(), "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    try:
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


def check_run(cluster: RayCluster, run_dir: Path, out: subprocess.CompletedProcess[str]) -> None:
    """Two verified steps, trainer ranks on host a, the engine on host b at b's address, nothing left."""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["weight_sync/verified"] == 1.0 and row["weight_sync/verified_tensors"] > 0, row
        assert 0.0 <= row["fidelity/train_rollout_logprob_abs_diff"] < 1e-4, row
    a, b = cluster.hosts
    placement = json.loads((run_dir / "logs" / "placement.json").read_text())
    assert placement["trainer-0"]["ip"] == placement["trainer-1"]["ip"] == a.address, placement
    assert placement["trainer-0"]["node_id"] == cluster.node_ids["a"]
    assert placement["engine-0"]["ip"] == b.address and placement["engine-0"]["node_id"] == cluster.node_ids["b"]
    (url,) = json.loads((run_dir / "fleet.json").read_text())["engine_urls"]
    assert url.startswith(f"http://{b.address}:"), url
    assert leftovers(cluster, run_dir) == []


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
    a, b = ray_cluster.hosts
    assert said["engine"][0] == b.address and said["placement"]["engine-0"]["ip"] == b.address
    assert said["placement"]["trainer-0"]["ip"] == a.address
    rank_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert f'MASTER "{a.address}"' in rank_log, rank_log[-2000:]
    assert leftovers(ray_cluster, run_dir) == []


def test_disk_transport_across_hosts(
    ray_cluster: RayCluster, tmp_path: Path, tiny_model: Path, arithmetic_prompts: Path
) -> None:
    run_dir = tmp_path / "disk"
    out = train_on_head(
        ray_cluster, write_config(tmp_path, ray_cluster, tiny_model, arithmetic_prompts, run_dir, "disk")
    )
    check_run(ray_cluster, run_dir, out)


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
    extra = LAUNCHER.format(address=ray_cluster.address).replace(
        "terminate_timeout = 5", "terminate_timeout = 5\ncall_timeout = 120"
    )
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
