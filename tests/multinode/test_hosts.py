"""The test bed itself: namespace hosts are separate hosts (own loopback, own ports, an address the others
reach, a host name that resolves to it, one shared file system), torch.distributed works across them, and
everything is torn down: on close, when the owner is killed (its janitor), and at the next start (the sweep)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from miles.testing.hosts import NETNS_ETC, TEMP_ROOT, NamespaceHosts, sweep_stale

SERVER = textwrap.dedent(
    """
    import socket, sys
    server = socket.create_server(("0.0.0.0", int(sys.argv[1])))  # every address of its host, loopback too
    print("listening", flush=True)
    while True:
        conn, _ = server.accept()
        conn.sendall(b"hello from " + socket.gethostbyname(socket.gethostname()).encode())
        conn.close()
    """
)

CLIENT = textwrap.dedent(
    """
    import json, socket, sys
    answers = {}
    for host in sys.argv[2:]:
        try:
            with socket.create_connection((host, int(sys.argv[1])), timeout=2) as conn:
                answers[host] = conn.recv(100).decode()
        except OSError as exc:
            answers[host] = type(exc).__name__
    print(json.dumps(answers))
    """
)


def test_a_host_reaches_another_by_its_address_never_through_loopback(namespace_hosts: NamespaceHosts) -> None:
    a, b, c, *_ = namespace_hosts
    assert len({a.address, b.address, c.address}) == 3
    server = a.popen([sys.executable, "-c", SERVER, "7000"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        out = b.python(CLIENT, "7000", "127.0.0.1", a.address)
        assert out.returncode == 0, out.stderr
        answers = json.loads(out.stdout)
        # b's own loopback has nothing on that port; a's address reaches a's server, whose host name is a's
        assert answers == {"127.0.0.1": "ConnectionRefusedError", a.address: f"hello from {a.address}"}
        # a itself reaches it through its loopback; the test's own host (outside every namespace) does not
        assert json.loads(a.python(CLIENT, "7000", "127.0.0.1").stdout) == {"127.0.0.1": f"hello from {a.address}"}
        outside = subprocess.run(
            [sys.executable, "-c", CLIENT, "7000", a.address], capture_output=True, text=True, timeout=30
        )
        assert not json.loads(outside.stdout)[a.address].startswith("hello"), outside.stdout
    finally:
        server.kill()
        server.communicate()


def test_hosts_share_the_file_system_and_each_resolves_its_host_name_to_itself(
    namespace_hosts: NamespaceHosts,
) -> None:
    shared = namespace_hosts.temp_dir / "written-by-b"
    code = "import socket, sys; open(sys.argv[1], 'w').write(socket.gethostbyname(socket.gethostname()))"
    for host in namespace_hosts:
        assert host.python(code, str(shared)).returncode == 0
        assert shared.read_text() == host.address
        names = host.python("import socket; print(socket.gethostbyname('miles-host-a'))").stdout.strip()
        assert names == namespace_hosts[0].address


ALL_REDUCE = textwrap.dedent(
    """
    import sys, datetime, torch, torch.distributed as dist
    rank = int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"tcp://{sys.argv[1]}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print("sum", t.item(), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_a_gloo_group_spans_two_hosts(namespace_hosts: NamespaceHosts) -> None:
    """Rank 0 on host a, rank 1 on host b: the store on a's address, gloo pairs on each host's own address."""
    a, b = namespace_hosts[0], namespace_hosts[1]
    init = f"{a.address}:29500"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [
        host.popen([sys.executable, "-c", ALL_REDUCE, init, str(rank)], stdout=subprocess.PIPE, text=True, env=env)
        for rank, host in enumerate((a, b))
    ]
    outs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert [r.returncode for r in ranks] == [0, 0], outs
    assert all("sum 3.0" in out for out in outs), outs


DAEMON = textwrap.dedent(
    """
    import os, sys, time
    if os.fork() == 0:  # a daemon: its parent exits, it lives on in the host (as Ray's daemons do)
        os.setsid()
        if os.fork() == 0:
            open(sys.argv[1], "w").write(str(os.getpid()))
            time.sleep(1000)
        os._exit(0)
    os.wait()
    """
)

OWNER = textwrap.dedent(
    """
    import sys, time
    from miles.testing.hosts import NamespaceHosts
    hosts = NamespaceHosts(2, janitor=sys.argv[1] == "janitor").open()
    hosts[1].popen(["sleep", "1000"])
    print(hosts.prefix, hosts[1].pids()[0], flush=True)
    time.sleep(1000)
    """
)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"


def _leftovers(prefix: str) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    found = [n for n in names if n.startswith(prefix + "-")]
    found += [str(p) for p in NETNS_ETC.glob(prefix + "-*")] + [str(p) for p in TEMP_ROOT.glob(prefix)]
    return found


def _wait_until(check: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.usefixtures("namespace_hosts")  # (skips, saying why, where namespaces cannot be made)
def test_close_ends_every_process_in_the_hosts_daemons_included(tmp_path: Path) -> None:
    with NamespaceHosts(2) as hosts:
        prefix = hosts.prefix
        pid_file = tmp_path / "daemon.pid"
        assert hosts[1].run([sys.executable, "-c", DAEMON, str(pid_file)], timeout=60).returncode == 0
        assert _wait_until(lambda: pid_file.exists() and pid_file.read_text(), 30)
        daemon = int(pid_file.read_text())
        sleeper = hosts[0].popen(["sleep", "1000"])
        assert daemon in hosts[1].pids() and sleeper.pid in hosts[0].pids()
        assert (NETNS_ETC / hosts[0].netns / "hosts").exists() and hosts.temp_dir.is_dir()
    assert sleeper.returncode == -signal.SIGTERM
    assert _wait_until(lambda: _gone(daemon), 10)
    assert _leftovers(prefix) == []


@pytest.mark.usefixtures("namespace_hosts")
@pytest.mark.parametrize("janitor", [True, False], ids=["janitor", "sweep"])
def test_a_killed_owner_leaves_nothing(janitor: bool) -> None:
    """The owner killed with SIGKILL: its janitor tears its hosts down at once; without a janitor (killed
    too), the next set's start sweeps them."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, "janitor" if janitor else "none"], stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    prefix, sleeper = owner.stdout.readline().split()
    owner.stdout.close()
    assert _leftovers(prefix) != []
    owner.kill()
    owner.wait()
    if janitor:
        assert _wait_until(lambda: not _leftovers(prefix), 30), _leftovers(prefix)
    else:
        time.sleep(1)
        assert _leftovers(prefix) != [] and not _gone(int(sleeper))
        assert prefix in sweep_stale()
        assert _leftovers(prefix) == []
    assert _wait_until(lambda: _gone(int(sleeper)), 10)
