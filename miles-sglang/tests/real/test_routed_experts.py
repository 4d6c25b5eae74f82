"""Routing replay (R3) from real SGLang 0.5.23 on this CPU: a tiny Qwen3-MoE served with
``--enable-return-routed-experts`` (what Miles adds to SGLang's launch when a run records routed experts),
``/generate`` asked for them as Miles' client asks, and SGLang's flat base64 rows read with the model's layout
(:func:`miles.rollout.facts.shape_routed_experts`) into what the trainer replays. The experts it reports for
each token are the ones transformers' routers choose on the same tokens (the same checkpoint, bfloat16), so the
rows are placed right: token by token, layer by layer.

(Training an MoE model on SGLang's CPU path is refused at start: it takes no weight update of one. Its
generation, and the routing it reports, work: that is what this module checks.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import MAX_TOTAL_TOKENS, SERVED_DTYPE, Server, _serving

PROMPT = [1, 17, 42, 99, 7, 256, 311, 5, 64, 128]
STEPS = 12
TIE = 0.02
"""Router logits closer than this (bfloat16) at the k-th choice may be ordered either way by two kernels."""


@pytest.fixture(scope="module")
def moe_server(tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from miles.net import free_port
    from miles_sglang.engine import SGLangEngine
    from miles_sglang.settings import SGLangEngineSettings

    settings = SGLangEngineSettings(
        max_total_tokens=MAX_TOTAL_TOKENS, log_level="warning", enable_return_routed_experts=True
    )
    launch = SGLangEngine(settings).launch(
        model_path=str(tiny_moe), host="127.0.0.1", port=free_port(), device="cpu", dtype=SERVED_DTYPE,
        devices=[], seed=1234,
    )  # fmt: skip
    assert "--enable-return-routed-experts" in launch.argv
    with _serving(launch, tmp_path_factory.mktemp("moe-server")) as running:
        yield running


def hf_routing(model_dir: Path, tokens: list[int]) -> tuple[Any, Any]:
    """Transformers' routers on ``tokens`` (bfloat16): each token's top-k experts per layer, and the gap
    between its k-th and (k+1)-th router logits."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    logits = torch.stack([layer.float().reshape(len(tokens), -1) for layer in out.router_logits], dim=1)
    ranked = logits.sort(dim=-1, descending=True)
    chosen = ranked.indices[..., :k].sort(dim=-1).values  # [tokens, layers, k]
    gap = ranked.values[..., k - 1] - ranked.values[..., k]  # [tokens, layers]
    return chosen, gap


def test_sglangs_routed_experts_are_the_routers_choices_token_by_token(moe_server: Server, tiny_moe: Path) -> None:
    import torch

    from miles.models import RoutedLayout
    from miles.rollout.facts import shape_routed_experts
    from miles.rollout.protocol import GenerateOutput

    resp = moe_server.post(
        "/generate",
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True,
            "return_routed_experts": True,
        },
    )
    assert resp.status_code == 200, resp.text + moe_server.log()
    body = resp.json()
    assert isinstance(body["meta_info"].get("routed_experts"), str), body["meta_info"].keys()  # base64, no shape
    layout = RoutedLayout.of_config(json.loads((tiny_moe / "config.json").read_text()))
    assert layout is not None and layout.moe_layers == (0, 1) and layout.topk == 2
    shaped = shape_routed_experts(GenerateOutput.from_json(body), layout)
    tokens = PROMPT + body["output_ids"]
    rows = len(tokens) - 1  # every token but the last, prompt included
    assert shaped.meta_info["routed_experts_shape"] == [rows, 2, 2]
    assert shaped.routed_experts is not None
    served = torch.frombuffer(bytearray(shaped.routed_experts), dtype=torch.int32).reshape(rows, 2, 2)
    served = served.sort(dim=-1).values.long()
    assert int(served.min()) >= 0 and int(served.max()) < 8

    chosen, gap = hf_routing(tiny_moe, tokens[:-1])
    same = (served == chosen).all(dim=-1)  # [tokens, layers]
    clear = gap > TIE
    assert bool(same[clear].all()), (
        f"SGLang's experts differ from the routers' where the choice is clear, at (token, layer) "
        f"{(~same & clear).nonzero().tolist()}: served {served[~same & clear].tolist()}, "
        f"transformers {chosen[~same & clear].tolist()}"
    )
    assert float(same.float().mean()) >= 0.9, float(same.float().mean())
    assert int(clear.sum()) >= rows  # (most choices are clear: the check has teeth)
    # read one token off (how a reader that forgot the prompt's rows or the last token would place them), the
    # rows disagree with the routers: the comparison above places each row
    assert float((served[1:] == chosen[:-1]).all(dim=-1).float().mean()) < 0.5
