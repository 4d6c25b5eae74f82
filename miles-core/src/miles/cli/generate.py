"""``miles generate`` and ``miles eval``: rollouts without training, against engines Miles launches."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from rich.console import Console

from miles.cli.app import app
from miles.cli.train import resolve_run
from miles.compose import ROLLOUT_KINDS

if TYPE_CHECKING:
    from miles.compose import Run
    from miles.rollout.client import EngineClient

T = TypeVar("T")


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

    run = resolve_run(config, set_ or [], to_stderr=True, kinds=ROLLOUT_KINDS)
    groups = _run_against_engines(
        run, lambda client: generate_rollouts(run, client, num_rollouts=num_rollouts, data_path=data, out=out)
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
    run = resolve_run(config, overrides, to_stderr=True, kinds=ROLLOUT_KINDS)
    with open(data, encoding="utf-8") as f:
        rows = sum(1 for line in f if line.strip())
    batch = run.settings.rollout.rollout_batch_size
    rollouts = max(1, -(-rows // batch))
    groups = _run_against_engines(
        run, lambda client: generate_rollouts(run, client, num_rollouts=rollouts, data_path=data)
    )
    metrics = eval_metrics(groups[:rows], ks=ks)
    typer.echo(json.dumps(metrics, indent=1))


def _run_against_engines(run: Run, job: Callable[[EngineClient], Awaitable[T]]) -> T:
    """Launch the engines the settings describe, run ``job(client)``, tear everything down."""
    from miles.host.train import launch_fleet

    run.materialize_model()
    with run.launcher() as launcher:
        fleet = launch_fleet(run, launcher)

        async def main() -> T:
            client = fleet.client()
            try:
                return await job(client)
            finally:
                await client.close()

        return asyncio.run(main())
