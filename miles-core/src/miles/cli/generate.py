"""``miles generate`` and ``miles eval``: rollouts without training, against engines Miles launches."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from miles.cli.app import app
from miles.cli.train import resolve_run


@app.command()
def generate(
    config: Annotated[Path, typer.Argument(help="Settings file (.toml / .yaml).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Samples JSONL to write.")] = Path("samples.jsonl"),
    num_rollouts: Annotated[int, typer.Option("--num-rollouts", "-n", min=1, help="Rollouts to generate.")] = 1,
    data: Annotated[str | None, typer.Option("--data", help="Prompt file instead of data.path.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a setting (repeatable).")] = None,
) -> None:
    """Generate and score rollouts with the policy, write every sample (token-exact) to JSONL."""
    from miles.driver.evaluate import generate_rollouts

    settings = resolve_run(config, set_ or [], to_stderr=True)
    groups = _run_against_engines(
        settings,
        lambda pm, client: generate_rollouts(pm, settings, client, num_rollouts=num_rollouts, data_path=data, out=out),
    )
    Console().print(f"wrote {sum(len(g) for g in groups)} samples to {out}")


@app.command("eval")
def evaluate(
    config: Annotated[Path, typer.Argument(help="Settings file (.toml / .yaml).")],
    data: Annotated[str, typer.Option("--data", help="Eval prompt file.")],
    k: Annotated[
        list[int] | None, typer.Option("--k", help="pass@k to report (repeatable); samples per prompt = max k.")
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Evaluate this model directory instead of train.model_path.")
    ] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a setting (repeatable).")] = None,
) -> None:
    """pass@k and mean reward of a model on an eval set (one pass over it)."""
    from miles.driver.evaluate import eval_metrics, generate_rollouts

    ks = sorted(set(k or [1]))
    overrides = [*(set_ or []), f"rollout.n_samples_per_prompt={max(ks)}", "data.shuffle=false"]
    if model is not None:
        overrides.append(f"train.model_path={json.dumps(model)}")
    settings = resolve_run(config, overrides, to_stderr=True)
    with open(data, encoding="utf-8") as f:
        rows = sum(1 for line in f if line.strip())
    batch = settings.rollout.rollout_batch_size
    rollouts = max(1, -(-rows // batch))
    groups = _run_against_engines(
        settings, lambda pm, client: generate_rollouts(pm, settings, client, num_rollouts=rollouts, data_path=data)
    )
    metrics = eval_metrics(groups[:rows], ks=ks)
    typer.echo(json.dumps(metrics, indent=1))


def _run_against_engines(settings, job):  # type: ignore[no-untyped-def]
    """Launch the engines the settings describe, run ``job(pm, client)``, tear everything down."""
    from miles.driver.launch import launch_engines, make_launcher
    from miles.plugins.manager import PluginManager
    from miles.rollout.http_client import HttpEngineClient

    pm = PluginManager().load()
    with make_launcher(pm, settings) as launcher:
        urls = launch_engines(pm, settings, launcher)

        async def main():  # type: ignore[no-untyped-def]
            client = HttpEngineClient(urls)
            try:
                return await job(pm, client)
            finally:
                await client.close()

        return asyncio.run(main())
