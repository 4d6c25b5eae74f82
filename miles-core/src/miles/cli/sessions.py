"""``miles sessions``: the TITO session server on its own, and the append-only check of a chat template."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from miles.cli.app import app
from miles.errors import SettingsError

sessions_app = typer.Typer(
    help="TITO sessions: token-exact multi-turn rollouts behind OpenAI's chat API.", no_args_is_help=True
)
app.add_typer(sessions_app, name="sessions")

log = logging.getLogger(__name__)

_Template = Annotated[
    str | None,
    typer.Option(help="Chat template: a .jinja file or a fixed template's name (qwen3); default the tokenizer's."),
]
_TemplateKwargs = Annotated[
    str | None, typer.Option(help="Template variables as JSON, e.g. '{\"enable_thinking\": false}'.")
]


def _kwargs(value: str | None) -> dict[str, Any]:
    if value is None:
        return {}
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise SettingsError(f"--chat-template-kwargs: not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise SettingsError("--chat-template-kwargs: expected a JSON object")
    return parsed


def _settings(**values: Any) -> Any:
    from miles.settings.sessions import SessionSettings

    try:
        return SessionSettings(**values)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        raise SettingsError(f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']}") from None


@sessions_app.command("serve")
def serve(
    engine_url: Annotated[list[str], typer.Option("--engine-url", help="Base URL of an engine (repeat for several).")],
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 30100,
    chat_template: _Template = None,
    chat_template_kwargs: _TemplateKwargs = None,
    tool_parser: Annotated[str, typer.Option(help="auto, hermes, llama3_json or none.")] = "auto",
    reasoning_parser: Annotated[str, typer.Option(help="auto, think or none.")] = "auto",
    max_tokens: Annotated[int, typer.Option(help="A turn's max_tokens when the request sets none.")] = 1024,
    context_length: Annotated[int | None, typer.Option(help="Longest session (default: the engine's).")] = None,
    live_check: Annotated[bool, typer.Option(help="Check a short session against /generate at start.")] = True,
    affinity: Annotated[bool, typer.Option(help="Route all turns of a session to one engine.")] = True,
    router_url: Annotated[
        str | None,
        typer.Option(help="A router (smg) that generation goes through, the session id as its routing key."),
    ] = None,
) -> None:
    """Serve sessions over running engines: OpenAI's chat API at /sessions/{id}/v1, exact tokens recorded."""
    settings = _settings(
        host=host,
        port=port,
        chat_template=chat_template,
        chat_template_kwargs=_kwargs(chat_template_kwargs),
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
        max_tokens=max_tokens,
        context_length=context_length,
        live_check=live_check,
        affinity=affinity,
    )
    asyncio.run(_serve(engine_url, settings, router_url=router_url))


async def _serve(urls: list[str], settings: Any, *, router_url: str | None = None) -> None:
    from miles.auth import ServiceKeys
    from miles.rollout.http_client import HttpEngineClient
    from miles.sessions.server import SessionServer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    keys = ServiceKeys.from_env()
    async with HttpEngineClient(
        urls, router_url=router_url, api_key=keys.api_key, admin_api_key=keys.admin_api_key
    ) as client:
        server = await SessionServer.for_engines(client, settings)
        url = await server.start()
        typer.echo(f"sessions on {url} ({server.report.summary()})", err=True)
        try:
            await stop.wait()
        finally:
            await server.stop()


@sessions_app.command("check")
def check(
    tokenizer: Annotated[Path, typer.Option(help="A Hugging Face tokenizer (or model) directory.")],
    chat_template: _Template = None,
    chat_template_kwargs: _TemplateKwargs = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Run the append-only render check on a chat template (exit 1 when it fails)."""
    from dataclasses import asdict

    if not tokenizer.is_dir():  # (the options first: a mistake is told before transformers loads, in ~1 s)
        raise SettingsError(f"--tokenizer: {tokenizer} is not a directory")
    template_kwargs = _kwargs(chat_template_kwargs)

    from transformers import AutoTokenizer

    from miles.sessions.append_only import check_append_only
    from miles.sessions.templates import ChatRenderer, resolve_template

    tok = AutoTokenizer.from_pretrained(tokenizer)
    template, name = resolve_template(chat_template, tok)
    report = check_append_only(ChatRenderer(tok, template, name=name, template_kwargs=template_kwargs))
    if as_json:
        typer.echo(json.dumps(asdict(report), indent=2))
    else:
        typer.echo(report.summary())
    if not report.ok:
        raise typer.Exit(1)
