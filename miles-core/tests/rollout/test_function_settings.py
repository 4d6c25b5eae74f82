"""``rollout.function`` as a table: a registered rollout function that is a component gets its own settings
(validated, errors naming the field), and the server it declares is started through the launcher like a
reward's, its URL written back into its settings. A real local launcher and a real server process."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from pydantic import Field

from miles.auth import ServiceKeys
from miles.components import Component, ComponentKind, ComponentSettings, Requirement
from miles.compose import build_run
from miles.errors import MissingExtraError, SettingsError
from miles.host.reward_servers import start_reward_servers
from miles.launch.local import LocalLauncher
from miles.plugins.builtin import BUILTIN_PLUGINS
from miles.plugins.manager import PluginManager
from miles.rewards.base import RewardServer
from miles.settings.model import MilesSettings, PluginSpec
from miles.testing import registering

KINDS = (ComponentKind.ROLLOUT_FUNCTION,)


class EchoSettings(ComponentSettings):
    """Settings of the ``echo_env`` rollout function."""

    turns: int = Field(2, ge=1)
    """Turns per episode."""
    url: str | None = None
    """Its server (set by the launcher)."""
    module: str = "tiny_health_server"
    """The server module."""


class EchoEnv(Component[EchoSettings]):
    """A configurable rollout function that declares a server."""

    name: ClassVar[str] = "echo_env"

    async def __call__(self, client: Any, sample: Any, sampling_params: Any) -> Any:
        return sample

    def server(self) -> RewardServer | None:
        if self.settings.url is not None:
            return None
        return RewardServer(model_path="echo", module=self.settings.module, startup_timeout=30.0)


class NeedsMissing(EchoEnv):
    name: ClassVar[str] = "needs_missing"
    requires: ClassVar[tuple[Requirement, ...]] = (Requirement("no_such_module_xyz", extra="xyz"),)


async def plain(client: Any, sample: Any, sampling_params: Any) -> Any:
    return sample


def _plugins() -> PluginManager:
    pm = PluginManager(builtins=BUILTIN_PLUGINS, entry_points=False).load()
    pm.register(registering("miles_register_rollout_functions", EchoEnv, NeedsMissing), "echo_plugin")
    pm.register(registering("miles_register_rollout_functions", _named(plain, "plain")), "plain_plugin")
    return pm


def _named(fn: Any, name: str) -> Any:
    class Wrapped:
        def __init__(self) -> None:
            self.name = name

        async def __call__(self, client: Any, sample: Any, sampling_params: Any) -> Any:
            return await fn(client, sample, sampling_params)

    return Wrapped()


def _run(function: Any) -> Any:
    settings = MilesSettings.model_validate({"rollout": {"function": function}})
    return build_run(settings, _plugins(), kinds=KINDS)


def test_a_registered_component_gets_its_settings_from_the_table() -> None:
    run = _run({"name": "echo_env", "turns": 5})
    function = run.rollout_function
    assert isinstance(function, EchoEnv) and function.settings == EchoSettings(turns=5)
    assert isinstance(run.settings.rollout.function, PluginSpec)
    plain_name = _run("plain")  # a bare name still selects a registered function, and stays a string
    assert plain_name.settings.rollout.function == "plain" and callable(plain_name.rollout_function)
    assert isinstance(_run("echo_env").rollout_function, EchoEnv)  # (defaults)
    table = _run({"name": "plain"})  # a table without settings selects a plain function too
    assert table.settings.rollout.function_name == "plain" == plain_name.settings.rollout.function_name
    assert run.settings.rollout.function_name == "echo_env" and MilesSettings().rollout.function_name is None


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ({"name": "echo_env", "turns": 0}, r"rollout\.function\.turns"),
        ({"name": "echo_env", "tunrs": 3}, r"rollout\.function\.tunrs"),
        ({"name": "plain", "turns": 3}, r"rollout\.function\.turns"),
        ({"name": "miles.rollout.manager:single_turn", "turns": 3}, r"rollout\.function: .* takes no settings"),
        ({"name": "no_such_function"}, r"rollout\.function.*no_such_function"),
    ],
)
def test_bad_settings_of_a_rollout_function_name_the_field(function: Any, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        _run(function)


def test_a_missing_requirement_names_the_field_and_the_extra() -> None:
    with pytest.raises(MissingExtraError, match=r"rollout\.function: rollout function 'needs_missing'.*xyz"):
        _run("needs_missing")


def test_the_server_a_rollout_function_declares_is_started_and_its_url_set(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "tiny_health_server.py").write_text(
        textwrap.dedent(
            """
            import argparse, http.server
            parser = argparse.ArgumentParser()
            for flag in ("--model", "--host", "--port", "--device", "--dtype"):
                parser.add_argument(flag)
            args = parser.parse_args()

            class Health(http.server.BaseHTTPRequestHandler):
                def do_GET(self):
                    self.send_response(200 if self.path == "/health" else 404)
                    self.end_headers()

            http.server.HTTPServer((args.host, int(args.port)), Health).serve_forever()
            """
        )
    )
    run = _run({"name": "echo_env", "turns": 3})
    settings = run.settings
    with LocalLauncher(run_dir=str(tmp_path / "run")) as launcher:
        servers = start_reward_servers(run, launcher, settings, keys=ServiceKeys(), env={"PYTHONPATH": str(tmp_path)})
        with caplog.at_level("INFO", logger="miles.host.reward_servers"):
            servers.wait()
        (started,) = servers.started
        assert f"environment server env-echo_env (rollout.function) is up at {started.url}" in caplog.text
        assert started.field == "rollout.function" and started.name == "env-echo_env"
        assert httpx.get(started.url + "/health", timeout=5).status_code == 200
        spec = settings.rollout.function
        assert isinstance(spec, PluginSpec) and spec.options == {"turns": 3, "url": started.url}
        function = run.rollout_function
        assert isinstance(function, EchoEnv) and function.settings.url == started.url and function.server() is None
        assert started.process.exit_status() is None
        assert sys.executable in started.spec.argv[0]
    assert started.process.exit_status() is not None  # stopped with the launcher
    assert (tmp_path / "run" / "logs" / "env-echo_env.log").exists()
