"""``miles train`` with ``cluster.launcher = "ray"`` on a two-node Ray cluster on this host.

``ray.cluster_utils.Cluster`` starts a head node (2 CPUs and the custom resource ``trainer_node``) and a
worker node (its own raylet, 2 CPUs and ``engine_node``); the launcher's bundles ask for those resources, so
the two trainer ranks land on the head node and the engine on the worker node, and a reward model's server,
in a placement group of its own, where Ray finds room (the worker node's second CPU). Real GRPO on a tiny
Qwen2 scored by a tiny classifier, weight pushes verified, a trainer actor and an engine actor killed mid-run
(the engine restarted in a new actor, or, without restarts left, the run stopped), an exact resume, a reward
server whose bundle no node offers refused before any engine starts. One cluster for the module (Ray costs
~12 s and ~0.5 GiB to start).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A head node with ``trainer_node: 2`` and a worker node (2 CPUs) with ``engine_node: 1``, on 127.0.0.1.

    Hermetic: Ray's session files go to a fresh short temp dir (``RAY_TMPDIR``; unix sockets limit path
    lengths), token auth uses a token from the environment (nothing written to ``~/.ray``), and addresses
    stay on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` stops Ray from swapping 127.0.0.1 for the
    host's IP)."""
    ray_tmp = tempfile.mkdtemp(prefix="mr", dir="/tmp")
    token_file = Path.home() / ".ray" / "auth_token"
    had_token = token_file.exists()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TMPDIR", ray_tmp)
        mp.setenv("RAY_AUTH_MODE", "token")
        mp.setenv("RAY_AUTH_TOKEN", uuid.uuid4().hex)
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        import ray
        from ray.cluster_utils import Cluster

        head_args = {"num_cpus": 2, "resources": {"trainer_node": 2}, "include_dashboard": False}
        cluster = Cluster(initialize_head=True, head_node_args={**head_args, "node_ip_address": "127.0.0.1"})
        worker = cluster.add_node(num_cpus=2, resources={"engine_node": 1}, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="miles", log_to_driver=False)
        cluster.trainer_node_id = cluster.head_node.node_id  # type: ignore[attr-defined]
        cluster.engine_node_id = worker.node_id  # type: ignore[attr-defined]
        try:
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(ray_tmp, ignore_errors=True)
    assert had_token or not token_file.exists(), f"Ray wrote {token_file}"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", "qwen2", seed=0)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.reward_models import build_tiny_classifier

    return build_tiny_classifier(tmp_path_factory.mktemp("rm") / "classifier", seed=1)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "label": str(a + b)}
        for a in range(3, 9)
        for b in range(2, 6)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


REWARD_MEMORY_MB = 64
"""Memory of the reward server's bundle (asked of Ray, not a limit on the process)."""


def write_config(
    tmp_path: Path,
    address: str,
    model: Path,
    data: Path,
    run_dir: Path,
    *,
    rollouts: int,
    engine_restarts: int = 1,
    reward_model: Path | None = None,
    reward_memory_mb: int = REWARD_MEMORY_MB,
) -> Path:
    """The run's settings; with ``reward_model``, a classifier reward model too, its server in a Ray bundle of its
    own (1 CPU, ``reward_memory_mb`` MiB), sent one sample per request (its scores then do not depend on how the
    samples were batched)."""
    config = tmp_path / f"{run_dir.name}.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [cluster]
            trainer_ranks = 2
            num_engines = 1

            [cluster.launcher]
            name = "ray"
            address = "{address}"
            trainer_resources = {{ trainer_node = 1 }}
            engine_resources = {{ engine_node = 1 }}
            terminate_timeout = 5

            [data]
            path = "{data}"

            [rollout]
            rollout_batch_size = 4
            n_samples_per_prompt = 4
            max_new_tokens = 6
            temperature = 1.0
            engine_restarts = {engine_restarts}

            [rollout.engine]
            name = "local"
            enable_deterministic_inference = true

            [train]
            model_path = "{model}"
            num_rollouts = {rollouts}
            global_batch_size = 8
            lr = 1e-3

            [algorithm]
            name = "grpo"

            [[reward.functions]]
            name = "length_penalty"
            max_length = 6
            buffer_length = 4
            mode = "linear"

            [precision]
            name = "fp32"

            [checkpoint]
            save_interval = 1

            [log]
            run_dir = "{run_dir}"
            """
        )
    )
    if reward_model is not None:
        reward = (
            f'[[reward.functions]]\nname = "model"\nkind = "classifier"\nmodel_path = "{reward_model}"\n'
            f"memory_mb = {reward_memory_mb}\nbatch_size = 1\n\n[checkpoint]"
        )
        config.write_text(config.read_text().replace("[checkpoint]", reward))
    return config


def train(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "miles", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def kill_actor_when(config: Path, run_dir: Path, process: str, when: Path) -> subprocess.CompletedProcess[str]:
    """Run ``miles train config`` and ``ray.kill`` the actor owning ``process`` once ``when`` holds something
    (``metrics.jsonl`` exists, empty, from the trainers' start, which overlaps the engines')."""
    import ray

    proc = train(str(config))
    placement = run_dir / "logs" / "placement.json"
    deadline = time.monotonic() + 300
    killed = False
    try:
        while not killed and proc.poll() is None and time.monotonic() < deadline:
            if when.exists() and when.stat().st_size > 0 and placement.exists():
                name = json.loads(placement.read_text())[process]["actor"]
                ray.kill(ray.get_actor(name, namespace="miles"), no_restart=True)
                killed = True
            time.sleep(0.05)
        out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed, f"{process} was never killed (run ended with {proc.returncode}): {out.stderr[-3000:]}"
    return out


def live_processes(path: Path) -> list[str]:
    """Live processes whose command lines name ``path``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(path) in cmdline:
                found.append(f"pid {entry.name}: {cmdline}")
    return found


def leftovers(run_dir: Path) -> list[str]:
    """Live processes of the run (command lines naming its directory) and Ray actors of the run."""
    import ray

    found = live_processes(run_dir)
    prefix = run_dir.name + "-"
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(prefix):
            found.append(f"actor {actor['name']}")
    return found


def wait_resources_free(cluster: Any) -> None:
    """Every CPU is free again (the run's placement group was removed)."""
    import ray

    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, f"still reserved: {ray.available_resources()}"
        time.sleep(0.2)


def metrics(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_across_two_nodes_a_killed_trainer_actor_and_an_exact_resume(
    ray_cluster: Any, tmp_path: Path, tiny_model: Path, prompts: Path
) -> None:
    address = ray_cluster.address
    full_dir = tmp_path / "full"
    out = finish(train(str(write_config(tmp_path, address, tiny_model, prompts, full_dir, rollouts=2))))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = metrics(full_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["weight_sync/verified"] == 1.0 and row["weight_sync/verified_tensors"] > 0
        assert 0.0 <= row["fidelity/train_rollout_logprob_abs_diff"] < 1e-4
    placement = json.loads((full_dir / "logs" / "placement.json").read_text())
    assert placement["trainer-0"]["node_id"] == placement["trainer-1"]["node_id"] == ray_cluster.trainer_node_id
    assert placement["engine-0"]["node_id"] == ray_cluster.engine_node_id
    assert leftovers(full_dir) == []
    wait_resources_free(ray_cluster)

    # trainer rank 1's actor killed after the step-1 checkpoint: the message names the rank, its actor and
    # node with its log's tail; nothing is left; --resume gives the uninterrupted run's last step exactly
    part_dir = tmp_path / "part"
    config = write_config(tmp_path, address, tiny_model, prompts, part_dir, rollouts=2)
    out = kill_actor_when(config, part_dir, "trainer-1", part_dir / "checkpoints" / "step_000001" / "driver.json")
    assert out.returncode != 0, out.stdout[-2000:] + out.stderr[-2000:]
    said = " ".join(out.stderr.split())
    assert "trainer rank 1 (trainer-1) failed: killed by SIGKILL: its Ray actor" in said, said[-3000:]
    assert "died (" in said and "; all other processes were terminated; last lines of" in said, said[-3000:]
    assert "/trainer-1' on node 127.0.0.1" in said and ray_cluster.trainer_node_id[:16] in said, said[-3000:]
    assert "last lines of" in said and "trainer-1.log" in said, said[-3000:]
    assert leftovers(part_dir) == []
    wait_resources_free(ray_cluster)
    assert [r["step"] for r in metrics(part_dir)] == [1]
    out = finish(train(str(config), "--resume", str(part_dir)))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    resumed = metrics(part_dir)
    assert resumed[-1]["step"] == 2
    compared = [key for key in rows[-1] if not any(s in key for s in ("time/", "seconds", "per_second"))]
    assert "fidelity/train_rollout_logprob_abs_diff" in compared
    for key in compared:
        assert resumed[-1][key] == rows[-1][key], key
    assert leftovers(part_dir) == []
    wait_resources_free(ray_cluster)


def check_reward_server(cluster: Any, run_dir: Path, placement: dict[str, Any], classifier: Path, steps: int) -> None:
    """The reward model's server ran in a placement group of its own — one bundle of 1 CPU and its memory, on the
    node where Ray found room (the head's CPUs hold the trainer ranks), its actor holding that bundle — its log
    in the run directory; it scored every sample as the same model scores them in this process (the server the
    ``local`` launcher starts runs this same code)."""
    from ray.util.placement_group import placement_group_table

    from miles.rewards.model_server import ModelScorer

    bundle = {"CPU": 1.0, "memory": float(REWARD_MEMORY_MB * 2**20)}
    server = placement["reward-model"]
    groups = [g for g in placement_group_table().values() if g["name"].startswith(f"{run_dir.name}-")]
    (own,) = [g for g in groups if g["placement_group_id"] == server["placement_group"]]
    assert list(own["bundles"].values()) == [bundle] and own["state"] == "REMOVED", own
    assert list(own["bundles_to_node_id"].values()) == [cluster.engine_node_id], own
    assert server["node_id"] == cluster.engine_node_id and server["resources"] == bundle, server
    assert server["placement_group"] not in {
        p["placement_group"] for name, p in placement.items() if name != "reward-model"
    }
    assert len(groups) == 2  # (the trainer ranks' and the engines'; the reward server's)
    functions = json.loads((run_dir / "settings.json").read_text())["reward"]["functions"]
    (url,) = [f["url"] for f in functions if f["name"] == "model"]
    assert url.startswith("http://127.0.0.1:"), functions
    assert f"serving on {url[len('http://') :]}" in (run_dir / "logs" / "reward-model.log").read_text()
    scorer = ModelScorer(str(classifier), kind="classifier", batch_size=1)
    for step in range(1, steps + 1):
        lines = (run_dir / "samples" / f"rollout_{step:06d}.jsonl").read_text().splitlines()
        samples = [json.loads(line) for line in lines]
        items = [{"prompt": s["prompt"], "messages": s["prompt_messages"], "response": s["response"]} for s in samples]
        expected = scorer.score(items)
        assert [s["reward_parts"]["model"] for s in samples] == pytest.approx(expected, abs=1e-5)
        assert len(set(expected)) > 1


def test_a_reward_server_whose_bundle_no_node_offers_is_refused_before_any_engine_starts(
    ray_cluster: Any, tmp_path: Path, tiny_model: Path, prompts: Path, classifier: Path
) -> None:
    run_dir = tmp_path / "unplaceable"
    config = write_config(
        tmp_path, ray_cluster.address, tiny_model, prompts, run_dir, rollouts=1, reward_model=classifier,
        reward_memory_mb=2**30,
    )  # fmt: skip
    begin = time.monotonic()
    out = finish(train(str(config)), timeout=120)
    assert out.returncode != 0, out.stdout[-2000:] + out.stderr[-2000:]
    said = " ".join(out.stderr.split())
    asked = "the reward server of reward.functions[1] (model): no node of the Ray cluster offers the bundle it asks "
    assert asked + "for (CPU 1, memory 1048576 GiB); node 127.0.0.1: " in said, said[-3000:]
    assert time.monotonic() - begin < 60  # at once, not after cluster.launcher.placement_timeout (120 s)
    assert sorted(p.name for p in (run_dir / "logs").glob("*.log")) == [], "something started"
    assert leftovers(run_dir) == []
    wait_resources_free(ray_cluster)


def test_a_killed_engine_actor_stops_the_run_naming_it(
    ray_cluster: Any, tmp_path: Path, tiny_model: Path, prompts: Path
) -> None:
    run_dir = tmp_path / "engine_dies"
    # no restart allowed (rollout.engine_restarts = 0): the run's only engine is gone, so the run stops
    config = write_config(tmp_path, ray_cluster.address, tiny_model, prompts, run_dir, rollouts=20, engine_restarts=0)
    out = kill_actor_when(config, run_dir, "engine-0", run_dir / "metrics.jsonl")
    assert out.returncode != 0, out.stdout[-2000:] + out.stderr[-2000:]
    said = " ".join(out.stderr.split())
    assert "engine-0 exited (killed by SIGKILL) while the trainers ran" in said, said[-3000:]
    assert "/engine-0' on node 127.0.0.1" in said and ray_cluster.engine_node_id[:16] in said, said[-3000:]
    assert "died (" in said and "; all other processes were terminated; last lines of" in said, said[-3000:]
    assert "engine-0.log" in said, said[-3000:]
    assert leftovers(run_dir) == []
    wait_resources_free(ray_cluster)


class Gate:
    """A reward server on loopback (the ``remote`` reward, weight 0): it answers 0, except that while
    :attr:`closed` is set it holds every answer, and so the run's next step, until it is cleared."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.closed = threading.Event()
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                while gate.closed.is_set():
                    time.sleep(0.05)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "3")
                self.end_headers()
                self.wfile.write(b"0.0")

            def log_message(self, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 64  # a step's 16 reward requests connect at once (the default backlog is 5)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"

    def close(self) -> None:
        self.closed.clear()
        self.server.shutdown()
        self.server.server_close()


def serves(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


RESTART_STEPS = 5


def test_a_killed_engine_actor_is_restarted_in_a_new_actor_and_rejoins(
    ray_cluster: Any, tmp_path: Path, tiny_model: Path, prompts: Path, classifier: Path
) -> None:
    """2 engines on the worker node (``rollout.engine_restarts = 1``); engine-1's actor killed once step 2 is
    logged: its requests go to engine-0, the launcher starts engine-1 again in a new actor in its bundle (same
    node, same URL), and it rejoins at the next weight push. The run is held (a reward server that waits)
    until the restarted engine serves, so that it rejoins however slow the machine. Scored by a classifier
    reward model whose server runs in a Ray bundle of its own (:func:`check_reward_server`)."""
    import ray

    run_dir = tmp_path / "restart"
    config = write_config(
        tmp_path, ray_cluster.address, tiny_model, prompts, run_dir, rollouts=RESTART_STEPS, reward_model=classifier
    )
    gate = Gate()
    text = config.read_text().replace("num_engines = 1", "num_engines = 2")
    text = text.replace("engine_resources = { engine_node = 1 }", "engine_resources = { engine_node = 0.5 }")
    text = text.replace("terminate_timeout = 5", "terminate_timeout = 5\nengine_cpus = 0.5")
    text = text.replace("save_interval = 1", "save_interval = 100")
    text = text.replace(
        "[checkpoint]",
        f'[[reward.functions]]\nname = "remote"\nweight = 0.0\nurl = "{gate.url}"\nrequest_timeout = 600\n'
        "max_retries = 0\n\n[reward]\ntimeout = 600\n\n[checkpoint]",
    )
    config.write_text(text)
    proc = train(str(config))
    placement = run_dir / "logs" / "placement.json"
    first: dict[str, Any] = {}
    deadline = time.monotonic() + 400
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            steps = len(metrics(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0
            if not first and steps >= 2:
                first = json.loads(placement.read_text())["engine-1"]
                gate.closed.set()  # (the kill's step waits for the restart: it rejoins at the next push)
                ray.kill(ray.get_actor(first["actor"], namespace="miles"), no_restart=True)
            if first and gate.closed.is_set():
                try:  # (the launcher rewrites placement.json as it restarts the engine)
                    now = json.loads(placement.read_text())["engine-1"]
                except ValueError:
                    continue
                url = json.loads((run_dir / "fleet.json").read_text())["engine_urls"][1]
                if now["process_pid"] != first["process_pid"] and serves(url):
                    gate.closed.clear()
            time.sleep(0.1)
        out = finish(proc, timeout=max(1.0, deadline - time.monotonic()))
    finally:
        gate.close()
        if proc.poll() is None:
            proc.kill()
    assert first and not gate.closed.is_set(), out.stderr[-3000:]
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    said = " ".join(out.stderr.split())
    assert "engine-1 exited (killed by SIGKILL) while the trainers ran: restarting it (restart 1 of 1" in said, said
    again = json.loads(placement.read_text())["engine-1"]
    assert again["node_id"] == first["node_id"] == ray_cluster.engine_node_id  # its bundle, on the engine node
    assert again["process_pid"] != first["process_pid"]
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "rejoined at weight version" in trainer_log, trainer_log[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, RESTART_STEPS + 1))
    assert all(r["weight_sync/verified"] == 1.0 for r in rows)
    assert rows[-1]["rollout/engines_serving"] == 2.0
    check_reward_server(ray_cluster, run_dir, json.loads(placement.read_text()), classifier, RESTART_STEPS)
    seen: set[tuple[int, int]] = set()
    for step in range(1, RESTART_STEPS + 1):
        lines = (run_dir / "samples" / f"rollout_{step:06d}.jsonl").read_text().splitlines()
        ids = {(s["group_id"], s["index"]) for s in map(json.loads, lines)}
        assert len(lines) == len(ids) == 16 and not ids & seen
        seen |= ids
        failed = [line for line in lines if json.loads(line)["status"] == "failed"]
        assert not failed, f"step {step}: {failed[0][-1500:]}"
    assert leftovers(run_dir) == []
    wait_resources_free(ray_cluster)


ALL_REDUCE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print("sum", t.item(), "rank", dist.get_rank(), "local", os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"])
dist.barrier()
dist.destroy_process_group()
"""


def test_colocated_bundles_a_gloo_group_a_service_s_bundle_and_placement_errors(
    ray_cluster: Any, tmp_path: Path
) -> None:
    """In process, on the test's own Ray session (the launcher leaves it connected): colocated engine 0
    shares trainer rank 0's bundle; two trainer actors form a gloo group from rank 0's address; a service
    declared to the launcher runs in a bundle of its own, and again there once it exited; a placement the
    cluster cannot grant and an impossible colocation are refused naming the settings."""
    import ray

    from miles.errors import LaunchError
    from miles.launch.base import ProcessSpec, ServiceNeeds
    from miles.launch.ray_launcher import RayLauncher, RayLauncherSettings
    from miles.launch.rendezvous import trainer_specs
    from miles.rollout.backend import EngineLaunch

    settings = RayLauncherSettings(
        address=ray_cluster.address,
        trainer_resources={"trainer_node": 1},
        trainer_cpus=0.5,
        engine_cpus=0.5,
        placement_timeout=30,
        handle_signals=False,
        poll_interval=0.1,
    )
    run_dir = tmp_path / "colocated"
    with RayLauncher(settings, run_dir=str(run_dir)) as launcher:
        launcher.reserve(trainer_ranks=2, num_engines=1, colocate=True, device="cpu", gpus_per_engine=1)
        host, port = launcher.engine_address(0, "127.0.0.1")
        server = [sys.executable, "-m", "http.server", str(port), "--bind", host]
        launcher.start_engines([EngineLaunch(argv=server, url=f"http://{host}:{port}", health_path="/")], timeout=60)
        launcher.start_trainers(trainer_specs([sys.executable, "-c", ALL_REDUCE], 2))
        assert launcher.wait_trainers(timeout=120) == 0
        logs = [Path(t.log_path).read_text() for t in launcher.trainers]
    assert "sum 3.0 rank 0 local 0 2" in logs[0] and "sum 3.0 rank 1 local 1 2" in logs[1], logs
    placement = json.loads((run_dir / "logs" / "placement.json").read_text())
    assert {p["node_id"] for p in placement.values()} == {ray_cluster.trainer_node_id}
    assert leftovers(run_dir) == [] and ray.is_initialized()
    wait_resources_free(ray_cluster)

    with pytest.raises(LaunchError, match=r"cluster.num_engines \(2\) must be <= cluster.trainer_ranks \(1\)"):
        RayLauncher(settings, run_dir=str(tmp_path / "bad")).reserve(
            trainer_ranks=1, num_engines=2, colocate=True, device="cpu", gpus_per_engine=1
        )
    # a declared service: a placement group of its own (0.5 CPU), its process in an actor there; once it exited
    # it starts again in a new actor in the same bundle (the old one reaped first, giving the bundle back)
    service_dir = tmp_path / "service"
    with RayLauncher(settings, run_dir=str(service_dir)) as launcher:
        assert launcher.place_service("reward-x", ServiceNeeds("the reward server of x", cpus=0.5)) == []
        host, (port,) = launcher.service_address("reward-x", "127.0.0.1")
        spec = ProcessSpec(name="reward-x", argv=[sys.executable, "-c", f"print('served on', {port})"])
        pids = []
        for _ in range(2):
            process = launcher.start_process(spec)
            deadline = time.monotonic() + 60
            while process.exit_status() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert process.exit_status() == 0
            pids.append(launcher.placement["reward-x"]["process_pid"])
            group = launcher.placement["reward-x"]["placement_group"]
            assert launcher.placement["reward-x"]["resources"] == {"CPU": 0.5}
        assert pids[0] != pids[1] and host == "127.0.0.1"
        assert f"served on {port}" in (service_dir / "logs" / "reward-x.log").read_text()
        assert group not in {launcher.placement[p]["placement_group"] for p in launcher.placement if p != "reward-x"}
    assert leftovers(service_dir) == []
    wait_resources_free(ray_cluster)

    ungrantable = settings.model_copy(update={"engine_resources": {"gpu_node": 1.0}, "placement_timeout": 2.0})
    refused = r"did not grant 3 bundles .*gpu_node.* within 2 s.*engine_resources"
    with (
        RayLauncher(ungrantable, run_dir=str(tmp_path / "ungrantable")) as launcher,
        pytest.raises(LaunchError, match=refused),
    ):
        launcher.reserve(trainer_ranks=2, num_engines=1, colocate=False, device="cpu", gpus_per_engine=1)
    wait_resources_free(ray_cluster)


ONE_NODE = """
import json, logging, sys, time
from miles.launch.base import ProcessSpec, ServiceNeeds
from miles.launch.ray_launcher import RayLauncher, RayLauncherSettings
from miles.launch.rendezvous import trainer_specs

logging.basicConfig(level=logging.INFO)
settings = RayLauncherSettings(temp_dir=sys.argv[1], handle_signals=False, poll_interval=0.1, placement_timeout=20)
with RayLauncher(settings, run_dir=sys.argv[2]) as launcher:
    launcher.place_service("reward-x", ServiceNeeds("the reward server of x"))  # (declared before the reservation)
    launcher.reserve(trainer_ranks=1, num_engines=0, colocate=False, device="cpu", gpus_per_engine=0)
    host, (port,) = launcher.service_address("reward-x", "127.0.0.1")
    server = launcher.start_process(ProcessSpec(name="reward-x", argv=[sys.executable, "-c", "print('served')"]))
    launcher.start_trainers(trainer_specs([sys.executable, "-c", "print('rank 0 ran')"], 1))
    assert launcher.wait_trainers(timeout=60) == 0
    while server.exit_status() is None:
        time.sleep(0.1)
    print(json.dumps(launcher.placement["trainer-0"]))
"""


def test_without_an_address_a_one_node_cluster_on_loopback_is_started_and_stopped(tmp_path: Path) -> None:
    """A driver of its own (one Ray session per process): the launcher starts Ray on 127.0.0.1, with room for the
    trainer rank's bundle and a declared service's (1 CPU each), and stops it."""
    ray_tmp = tempfile.mkdtemp(prefix="mq", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    # token auth with the token in the environment: nothing is written to ~/.ray
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=uuid.uuid4().hex, RAY_USAGE_STATS_ENABLED="0")
    try:
        out = subprocess.run(
            [sys.executable, "-c", ONE_NODE, ray_tmp, str(tmp_path / "run")],
            capture_output=True,
            text=True,
            env={**env, "OMP_NUM_THREADS": "1"},
            timeout=120,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert json.loads(out.stdout.strip().splitlines()[-1])["ip"] == "127.0.0.1"
        assert "rank 0 ran" in (tmp_path / "run" / "logs" / "trainer-0.log").read_text()
        assert "served" in (tmp_path / "run" / "logs" / "reward-x.log").read_text()
        assert "'CPU': 2.0" in out.stderr  # (the cluster it started: what the bundles need)
        assert "started a one-node Ray cluster on 127.0.0.1" in out.stderr
        assert live_processes(Path(ray_tmp)) == []  # raylet, GCS, workers: their command lines name the session dir
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
