"""The local engine serving LoRA adapters over real HTTP, SGLang's protocol: two PEFT adapters and the base
model in one batch, each request with its own adapter's logprobs (against PEFT forwards), unload, bad input."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from miles.testing.engine import EngineProcess

pytestmark = [pytest.mark.timeout(300)]

PROMPTS = [[5, 17, 33, 48, 91, 120, 7], [250, 300, 12, 64, 77], [9, 8, 7, 6, 5, 4, 3, 2]]


def save_random_adapter(model_dir: Path, out: Path, seed: int, targets: list[str]) -> Path:
    """A PEFT LoRA adapter with random A and B (so it changes the model), saved by PEFT itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out)
    return out


def peft_logprobs(model_dir: Path, adapter: Path | None, tokens: list[int], n_prompt: int) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits[n_prompt - 1 : -1], dim=-1)
    return logp.gather(1, torch.tensor(tokens[n_prompt:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from miles.testing.models import build_tiny_model

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lora_engine")
    model = build_tiny_model(root / "model", "qwen2", seed=0)
    a = save_random_adapter(
        model, root / "a", 1, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    b = save_random_adapter(model, root / "b", 2, ["q_proj", "v_proj", "down_proj"])
    with EngineProcess(model, extra_args=["--attention-backend", "sdpa"], log_path=root / "engine.log") as engine:
        yield {"engine": engine, "model": model, "a": a, "b": b}


def post(engine: EngineProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(engine.url + path, json=body, timeout=120)


def test_two_adapters_and_the_base_in_one_batch(setup: dict[str, Any]) -> None:
    engine = setup["engine"]
    for name in ("a", "b"):
        r = post(engine, "/load_lora_adapter", {"lora_name": name, "lora_path": str(setup[name])})
        assert r.status_code == 200 and r.json()["success"], r.text
    names = ["a", "b", None]
    body = {
        "input_ids": PROMPTS,
        "lora_path": names,
        "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True,
    }
    r = post(engine, "/generate", body)
    assert r.status_code == 200, r.text
    worst = 0.0
    for prompt, name, out in zip(PROMPTS, names, r.json(), strict=True):
        got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
        adapter = setup[name] if name else None
        want = peft_logprobs(setup["model"], adapter, prompt + out["output_ids"], len(prompt))
        worst = max(worst, float((got - want).abs().max()))
        if name is not None:  # the adapter matters: the base model gives other values
            base = peft_logprobs(setup["model"], None, prompt + out["output_ids"], len(prompt))
            assert float((base - want).abs().max()) > 1e-3
    assert worst <= 1e-5
    # the same prompt under each adapter, in one batch, gives each adapter's values (no cache sharing)
    same = {**body, "input_ids": [PROMPTS[0]] * 3, "sampling_params": {**body["sampling_params"], "max_new_tokens": 4}}
    outs = post(engine, "/generate", same).json()
    for name, out in zip(names, outs, strict=True):
        got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
        want = peft_logprobs(setup["model"], setup[name] if name else None, PROMPTS[0] + out["output_ids"], 7)
        assert float((got - want).abs().max()) <= 1e-5


def test_adapter_listing_unload_and_bad_input(setup: dict[str, Any]) -> None:
    engine = setup["engine"]
    post(engine, "/load_lora_adapter", {"lora_name": "tmp", "lora_path": str(setup["b"])})
    listed = httpx.get(engine.url + "/lora_adapters").json()["adapters"]
    assert "tmp" in {a["lora_name"] for a in listed}
    tmp = next(a for a in listed if a["lora_name"] == "tmp")
    assert len(tmp["checksums"]) == 2 * 3 * 2  # 3 modules x 2 layers x (A, B)
    # SGLang's (OpenAI's) GET /v1/models: the base model, then each adapter with the path it came from
    models = httpx.get(engine.url + "/v1/models").json()["data"]
    assert (
        models[0]["parent"] is None
        and {"id": "tmp", "root": tmp["lora_path"]}.items() <= next(m for m in models if m["id"] == "tmp").items()
    )
    assert post(engine, "/unload_lora_adapter", {"lora_name": "tmp"}).status_code == 200
    assert "tmp" not in {m["id"] for m in httpx.get(engine.url + "/v1/models").json()["data"]}
    r = post(engine, "/generate", {"input_ids": PROMPTS[0], "lora_path": "tmp", "sampling_params": {}})
    assert r.status_code == 400 and "'tmp' is not loaded" in r.text
    r = post(engine, "/unload_lora_adapter", {"lora_name": "tmp"})
    assert r.status_code == 400 and not r.json()["success"]
    r = post(engine, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(setup["model"])})
    assert r.status_code == 400 and "adapter_config.json" in r.json()["message"]
    r = post(engine, "/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and "lora_path" in r.json()["message"]


def test_lora_transport_pushes_and_verification_names_a_missing_adapter(setup: dict[str, Any], tmp_path: Path) -> None:
    import asyncio

    from miles_lora.adapter import LoraAdapter
    from miles_lora.settings import LoraSettings
    from miles_lora.transport import LoraTransport, LoraTransportSettings
    from safetensors.torch import load_file

    from miles.errors import WeightVerificationError
    from miles.rollout.http_client import HttpEngineClient
    from miles.training.trainer import DistContext

    engine = setup["engine"]
    tensors = load_file(str(setup["a"] / "adapter_model.safetensors"))
    adapter = LoraAdapter(LoraSettings(r=4, alpha=8, lora_name="run1"))

    async def scenario() -> None:
        transport = LoraTransport(
            LoraTransportSettings(), run_dir=str(tmp_path), model_path=str(setup["model"]), engine_dtype="float32"
        )
        transport.adapter = adapter
        async with HttpEngineClient([engine.url], max_retries=1) as client:
            await transport.connect(client, DistContext())
            with pytest.raises(WeightVerificationError, match=r"does not serve LoRA adapter 'run1'.*never reached"):
                await transport.verify(client, _report("1", tensors))
            report = await transport.push([list(tensors.items())], version="1", dist=DistContext())
            assert report.num_tensors == len(tensors) and client.lora_path == "run1"
            assert (await transport.verify(client, report))["weight_sync/verified"] == 1.0
            # another adapter under that name on the engine: the differing tensor is named
            await client.call(engine.url, "/load_lora_adapter", {"lora_name": "run1", "lora_path": str(setup["b"])})
            with pytest.raises(WeightVerificationError, match="run1"):
                await transport.verify(client, report)
            # a second run's adapter on the same engine and base: both served, each verified
            other = LoraTransport(  # delivered in the request body, not through a file
                LoraTransportSettings(delivery="tensors"),
                run_dir=str(tmp_path / "2"),
                model_path=None,
                engine_dtype="float32",
            )
            other.adapter = LoraAdapter(LoraSettings(r=4, alpha=8, lora_name="run2"))
            await other.connect(client, DistContext())
            report2 = await other.push([list(tensors.items())], version="5", dist=DistContext())
            report1 = await transport.push([list(tensors.items())], version="2", dist=DistContext())
            assert (await other.verify(client, report2))["weight_sync/verified"] == 1.0
            assert not (tmp_path / "2" / "lora" / "run2-v5").exists()
            assert (await transport.verify(client, report1))["weight_sync/verified"] == 1.0

    asyncio.run(scenario())


def _report(version: str, tensors: dict[str, torch.Tensor]) -> Any:
    from miles.transport.verify import tensor_checksum
    from miles.types import PushReport

    return PushReport(version=version, checksums={n: tensor_checksum(t) for n, t in tensors.items()})
