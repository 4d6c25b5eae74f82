"""``miles serve``: run the local rollout engine (SGLang's HTTP protocol) for a HF causal LM.

The flags are :class:`~miles.engine.options.ServeOptions`' fields (``miles serve --help`` lists them);
the command is the same as ``python -m miles.engine``, which the ``local`` backend launches.
"""

from __future__ import annotations

import typer

from miles.cli.app import app


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def serve(ctx: typer.Context) -> None:
    """Serve a model with the local engine (continuous batching, radix prefix cache, exact logprobs);
    ``miles serve --help`` lists the flags."""
    from miles.engine.launch import main

    main(list(ctx.args))
