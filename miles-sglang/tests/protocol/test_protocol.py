"""Everything Miles sends an engine, held against SGLang's own source (the pinned wheel, installed without its
dependencies): the launch flags of the ``sglang`` engine (LoRA's included), and every request the engine
client, the ``disk`` / ``broadcast`` / ``sglang_tensor`` / ``lora`` transports, memory release and sampled
verification make — recorded from real calls to a local engine, which serves the same routes. A renamed flag, route or field
in SGLang fails here."""

from __future__ import annotations

import asyncio
import types
import typing
from pathlib import Path

import pytest

from miles.errors import SettingsError, WeightVerificationError
from miles.rollout.client import MEMORY_TAGS
from miles.rollout.protocol import SamplingParams
from miles.testing.engine import EngineProcess
from miles.training.adapter import LowRankSpec
from miles.training.trainer import DistContext
from miles.types import PauseMode
from miles_sglang.engine import SGLangEngine
from miles_sglang.protocol_check import Call, argv_problems, request_problems, session_problems
from miles_sglang.settings import SGLANG_VERSION, SGLangEngineSettings
from miles_sglang.sglang_source import SGLangSource
from miles_sglang.tensor_transport import tensor_payload

from .conftest import RecordingClient

pytestmark = pytest.mark.slow


def test_the_installed_sglang_is_the_pinned_release(source: SGLangSource) -> None:
    assert source.version == SGLANG_VERSION
    assert len(source.flags) > 300 and len(source.routes) > 50  # the source was really read


def test_every_launch_flag_is_an_sglang_flag(source: SGLangSource) -> None:
    extra = ["--chunked-prefill-size", "4096"]
    settings = SGLangEngineSettings(
        tp_size=2,
        mem_fraction_static=0.7,
        context_length=4096,
        max_running_requests=64,
        enable_deterministic_inference=True,
        enable_return_routed_experts=True,
        attention_backend="fa3",
        log_level="warning",
        extra_args=extra,
    )
    for dtype in ("bfloat16", "float16", "float32", "auto"):
        argv = SGLangEngine(settings).launch(
            model_path="/m", host="127.0.0.1", port=30000, device="cuda", dtype=dtype, devices=[2, 3],
            rank=1, seed=5, colocate=True,
        ).argv  # fmt: skip
        assert argv_problems(argv, source) == []
    # the user's extra_args are SGLang flags too (checked here for the example the docs give)
    assert argv_problems(extra, source) == []
    # and so are the flags miles_sglang.serve adds from the environment (the run's keys)
    from miles.auth import ServiceKeys
    from miles_sglang.serve import key_argv

    assert key_argv(ServiceKeys("k", "a")) == ["--api-key=k", "--admin-api-key=a"]
    assert argv_problems(key_argv(ServiceKeys("k", "a")), source) == []
    # a generated key may start with "-" (or "--"): it stays the flag's value, never read as a flag
    assert argv_problems(key_argv(ServiceKeys("--k", "-a")), source) == []
    assert argv_problems(["--tp-size=two"], source) == ["--tp-size 'two': SGLang expects int"]


def test_renamed_flags_and_fields_are_caught(source: SGLangSource) -> None:
    """The checks fail for what SGLang does not declare (they are not vacuous)."""
    assert argv_problems(["--tensor-parallel", "2"], source) == [
        f"--tensor-parallel: not a flag of SGLang {source.version}"
    ]
    assert argv_problems(["--skip-server-warmup", "yes"], source)[0].startswith("--skip-server-warmup: a switch")
    assert argv_problems(["--tp-size"], source) == ["--tp-size: SGLang expects a value"]
    assert argv_problems(["--tp-size", "two"], source) == ["--tp-size 'two': SGLang expects int"]
    assert "SGLang accepts" in argv_problems(["--dtype", "fp32"], source)[0]
    assert argv_problems(["--disable-cuda-graph"], source)[0].endswith(f"deprecated in SGLang {source.version}")
    bad = Call("POST", "e", "/update_weights_from_distributed", {"names": [], "dtype": [], "shapes": []})
    assert request_problems(bad, source) == [
        "POST /update_weights_from_distributed: 'dtype' is not a field of SGLang's UpdateWeightsFromDistributedReqInput",
        "POST /update_weights_from_distributed: SGLang's UpdateWeightsFromDistributedReqInput requires 'dtypes'",
    ]
    sampling = Call("POST", "e", "/generate", {"input_ids": [1], "sampling_params": {"temp": 1.0}})
    assert request_problems(sampling, source) == [
        "POST /generate: sampling_params['temp'] is not a field of SGLang's SamplingParams"
    ]
    assert request_problems(Call("POST", "e", "/weights_update", {}), source)[0].endswith("has no such route")
    assert request_problems(Call("GET", "e", "/update_weights_from_disk", None), source)[0].endswith("POST only")
    outside = [Call("POST", "e", "/update_weights_from_distributed", {})]
    assert session_problems(outside) == [
        "e: /update_weights_from_distributed outside /begin_weight_update ... /end_weight_update"
    ]
    left_open = [Call("POST", "e", "/begin_weight_update", {})]
    assert session_problems(left_open) == ["e: a weight-update session was left open"]


def hf_buckets(model: Path, size: int = 4) -> list[list[tuple[str, typing.Any]]]:
    """The model's parameters by HF module name, in buckets (what a trainer's ``iter_weights`` yields)."""
    from transformers import AutoModelForCausalLM

    items = sorted((n, p.detach()) for n, p in AutoModelForCausalLM.from_pretrained(model).named_parameters())
    return [items[i : i + size] for i in range(0, len(items), size)]


async def exercise(client: RecordingClient, model: Path, run_dir: Path) -> None:
    """What a run does to its engines, through the code that does it."""
    from miles.transport.broadcast import BroadcastTransport, BroadcastTransportSettings
    from miles.transport.disk import DiskTransport, DiskTransportSettings
    from miles.transport.verify import WeightSampler, verify_sampled

    params = SamplingParams(
        max_new_tokens=3, min_new_tokens=1, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, stop=["\n\n"],
        stop_token_ids=[2], ignore_eos=False, n=2, sampling_seed=7, skip_special_tokens=False, no_stop_trim=True,
    )  # fmt: skip
    await client.generate([5, 6, 7, 8], params, return_routed_experts=True, routing_key="group-1", rid="r-1")
    await client.abort("r-1")
    await client.abort()
    for mode in typing.get_args(PauseMode):
        await client.pause_generation(mode)
        await client.continue_generation()
    await client.flush_cache()
    await client.model_info()
    await client.update_weight_version("3")
    # colocated runs: release and resume around training (the loop's own calls: miles.driver.colocate)
    await client.release_memory(MEMORY_TAGS)
    await client.resume_memory(("weights",))
    await client.resume_memory(("kv_cache", "cuda_graph"))
    dist = DistContext(rank=0, world_size=1, device="cpu")
    # disk transport: /update_weights_from_disk
    disk = DiskTransport(DiskTransportSettings(), run_dir=str(run_dir), model_path=str(model), engine_dtype="float32")
    await disk.connect(client, dist)
    await disk.push(iter(hf_buckets(model)), version="4", dist=dist)
    # broadcast transport: a real gloo group with the engine, its session, buckets and version
    broadcast = BroadcastTransport(
        BroadcastTransportSettings(timeout=120), run_dir=str(run_dir), model_path=str(model), engine_dtype="float32"
    )
    await broadcast.connect(client, dist)
    sampler = WeightSampler("float32")
    await broadcast.push(sampler.observe(iter(hf_buckets(model))), version="5", dist=dist)
    # sampled verification, as for SGLang engines: /model_info and /get_weights_by_name
    metrics = await verify_sampled(client, version="5", samples=sampler.samples)
    assert metrics["weight_sync/verified"] == 1.0
    await broadcast.close()


def test_every_request_miles_sends_is_sglangs(
    engine: EngineProcess, moe_model: Path, tmp_path: Path, source: SGLangSource
) -> None:
    async def main() -> list[Call]:
        client = RecordingClient([engine.url])
        try:
            await exercise(client, moe_model, tmp_path)
        finally:
            await client.close()
        return client.calls

    calls = asyncio.run(main())
    # the sglang_tensor transport cannot run without CUDA: its requests are checked as it builds them
    calls += [
        Call("POST", engine.url, "/begin_weight_update", {}),
        Call("POST", engine.url, "/update_weights_from_tensor", tensor_payload(["QUJD"], last=False, version="6", flush_cache=True)),
        Call("POST", engine.url, "/update_weights_from_tensor", tensor_payload(["QUJD"], last=True, version="6", flush_cache=True)),
        Call("POST", engine.url, "/end_weight_update", {}),
    ]  # fmt: skip
    endpoints = {c.endpoint for c in calls}
    expected = {
        "/generate", "/abort_request", "/pause_generation", "/continue_generation", "/flush_cache", "/model_info",
        "/update_weight_version", "/release_memory_occupation", "/resume_memory_occupation",
        "/update_weights_from_disk", "/init_weights_update_group", "/begin_weight_update",
        "/update_weights_from_distributed", "/end_weight_update", "/destroy_weights_update_group",
        "/get_weights_by_name", "/update_weights_from_tensor", "/server_info",
    }  # fmt: skip
    assert endpoints == expected, endpoints ^ expected
    problems = [p for call in calls for p in request_problems(call, source)] + session_problems(calls)
    assert problems == [], "\n".join(problems)


def test_memory_tags_and_pause_modes_are_sglangs(source: SGLangSource) -> None:
    constants = source.constants("sglang.srt.constants")
    assert {"kv_cache", "weights"} <= {constants["GPU_MEMORY_TYPE_KV_CACHE"], constants["GPU_MEMORY_TYPE_WEIGHTS"]}
    modes = source.field_literals("sglang.srt.managers.io_struct", "PauseGenerationReqInput", "mode")
    assert modes is not None and set(typing.get_args(PauseMode)) == set(modes)


def test_the_tensor_serializer_miles_imports_exists(source: SGLangSource) -> None:
    assert source.defines("sglang.srt.utils.common", "MultiprocessingSerializer")
    assert source.defines("sglang.srt.utils.patch_torch", "monkey_patch_torch_reductions")


def test_the_routes_the_engine_waits_on_exist(source: SGLangSource) -> None:
    launch = SGLangEngine(SGLangEngineSettings()).launch(
        model_path="/m", host="127.0.0.1", port=1, device="cuda", dtype="bfloat16", devices=[0]
    )
    assert "GET" in source.routes[launch.health_path].methods
    assert "POST" in source.routes["/flush_cache"].methods  # the launcher flushes each engine once it is up


ADAPTER = LowRankSpec(
    r=8,
    alpha=16.0,
    dropout=0.0,
    target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
)


def test_lora_launch_flags_are_sglangs(source: SGLangSource) -> None:
    def argv(settings: SGLangEngineSettings, adapter: LowRankSpec | None) -> list[str]:
        engine = SGLangEngine(settings)
        engine.adapter = adapter
        return engine.launch(
            model_path="/m", host="127.0.0.1", port=30000, device="cuda", dtype="bfloat16", devices=[0]
        ).argv

    plain = argv(SGLangEngineSettings(), None)
    assert not any(a.startswith("--") and "lora" in a for a in plain)
    # a LoRA run: SGLang is told the rank and the projections up front (adapters are loaded at run time)
    served = argv(SGLangEngineSettings(), ADAPTER)
    assert served[served.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in served
    assert served[served.index("--lora-target-modules") + 1 :][:7] == list(ADAPTER.target_modules)
    tuned = SGLangEngineSettings(
        max_lora_rank=16, lora_target_modules=["all"], max_loras_per_batch=4, max_loaded_loras=8, lora_backend="triton"
    )
    for args in (served, argv(tuned, ADAPTER), argv(SGLangEngineSettings(enable_lora=True, max_lora_rank=4, lora_target_modules=["q_proj", "v_proj"]), None)):  # fmt: skip
        assert argv_problems(args, source) == []
    # the checker holds list flags too: a projection SGLang does not know, an unknown backend
    assert argv_problems(["--lora-target-modules", "q_proj", "qkv"], source)[0].startswith(
        "--lora-target-modules 'qkv': SGLang accepts"
    )
    assert "SGLang accepts" in argv_problems(["--lora-backend", "punica"], source)[0]
    for settings, message in (
        (SGLangEngineSettings(enable_lora=False), "rollout.engine.enable_lora = false"),
        (SGLangEngineSettings(max_lora_rank=4), r"rollout.engine.max_lora_rank = 4 is below train.adapter.r = 8"),
        (SGLangEngineSettings(lora_target_modules=["q_proj"]), "rollout.engine.lora_target_modules lacks k_proj"),
    ):
        with pytest.raises(SettingsError, match=message):
            argv(settings, ADAPTER)
    with pytest.raises(SettingsError, match="needs rollout.engine.max_lora_rank and lora_target_modules"):
        argv(SGLangEngineSettings(enable_lora=True), None)


def _peft_adapter(model: Path) -> tuple[typing.Any, list[tuple[str, typing.Any]]]:
    """The ``lora`` adapter on the model's attention (random values) and its tensors as a trainer yields them."""
    from miles_lora.adapter import LoraAdapter, peft_file_name
    from miles_lora.settings import LoraSettings
    from transformers import AutoModelForCausalLM

    adapter = LoraAdapter(LoraSettings(r=4, init="random", target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    wrapped = adapter.apply(AutoModelForCausalLM.from_pretrained(model))
    tensors = [(name, p.detach()) for n, p in wrapped.named_parameters() if (name := peft_file_name(n)) is not None]
    return adapter, tensors


def test_lora_requests_are_sglangs(
    engine: EngineProcess, moe_model: Path, tmp_path: Path, source: SGLangSource
) -> None:
    """The ``lora`` transport as it drives SGLang engines (no ``/lora_adapters``, no replacing a served name),
    recorded against a local engine: each push unloads the served version, loads the new directory, bumps the
    version; verification reads ``/v1/models``; rollouts send ``lora_path``."""
    from miles_lora.transport import LoraTransport, LoraTransportSettings

    adapter, tensors = _peft_adapter(moe_model)
    dist = DistContext(rank=0, world_size=1, device="cpu")

    async def main() -> list[Call]:
        client = RecordingClient([engine.url])
        transport = LoraTransport(
            LoraTransportSettings(), run_dir=str(tmp_path), model_path=str(moe_model), engine_dtype="float32"
        )
        transport.engine_capabilities = SGLangEngine.capabilities
        transport.attach(types.SimpleNamespace(adapter=adapter))  # type: ignore[arg-type]
        try:
            await client.continue_generation()  # a run's memory release (an earlier test) leaves it paused
            await transport.connect(client, dist)
            for version in ("1", "2"):
                report = await transport.push(iter([tensors]), version=version, dist=dist)
                metrics = await transport.verify(client, report)
                assert metrics == {"weight_sync/verified_adapters": 1.0, "weight_sync/verified": 1.0}
            await client.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=2), rid="r-2")
            # a stale version is named: the engine serves version 2's directory
            report.version = "1"
            with pytest.raises(WeightVerificationError, match="expected version 1"):
                await transport.verify(client, report)
            await client.call(engine.url, "/unload_lora_adapter", {"lora_name": "policy"})
            with pytest.raises(WeightVerificationError, match="never reached the engine"):
                await transport.verify(client, report)
            # SGLang's tensor route takes its own pickled payloads: refused by name
            tensors_transport = LoraTransport(
                LoraTransportSettings(delivery="tensors"),
                run_dir=str(tmp_path),
                model_path=None,
                engine_dtype="float32",
            )
            tensors_transport.engine_capabilities = SGLangEngine.capabilities
            with pytest.raises(SettingsError, match='transport.delivery = "tensors"'):
                await tensors_transport.connect(client, dist)
        finally:
            await client.close()
        return client.calls

    calls = asyncio.run(main())
    assert [c.endpoint for c in calls if c.endpoint != "/v1/models"] == [
        "/continue_generation", "/load_lora_adapter", "/update_weight_version",
        "/unload_lora_adapter", "/load_lora_adapter", "/update_weight_version",
        "/generate", "/unload_lora_adapter",
    ]  # fmt: skip
    generate = next(c for c in calls if c.endpoint == "/generate")
    assert generate.payload is not None and generate.payload["lora_path"] == "policy"
    problems = [p for call in calls for p in request_problems(call, source)]
    assert problems == [], "\n".join(problems)


def test_the_environment_miles_sets_is_sglangs(source: SGLangSource) -> None:
    """Every variable Miles puts in an engine's environment is one SGLang 0.5.23 reads: ``/health`` as a liveness
    check (an ``Envs`` field of ``sglang.srt.environ``, false with ``0``) and the CPU switch (read with
    ``os.getenv`` in ``sglang.srt.platforms``)."""
    import ast

    from miles_sglang.command import CPU_ENV, ENGINE_ENV

    def fields(module: str) -> set[str]:
        return {
            target.id
            for node in ast.walk(source.tree(module))
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }

    def strings(module: str) -> set[str]:
        return {
            node.value
            for node in ast.walk(source.tree(module))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
        }

    assert set(ENGINE_ENV) <= fields("sglang.srt.environ")
    assert set(CPU_ENV) <= strings("sglang.srt.platforms")


def test_image_data_of_a_vision_language_rollout_is_sglangs(
    source: SGLangSource, engine: EngineProcess, tmp_path: Path
) -> None:
    """A vision-language rollout (the default rollout function on a sample whose row had an image) sends its
    image as SGLang's ``image_data``: recorded from a real call, to this module's text engine, which refuses
    it by name."""
    pytest.importorskip("PIL")
    from miles.data.vision import IMAGES
    from miles.rollout.http_errors import EngineHTTPError
    from miles.rollout.manager import single_turn
    from miles.testing.vlm import squares_image
    from miles.types import Sample

    squares_image({"red": 2}).save(tmp_path / "red.png")

    async def main() -> list[Call]:
        client = RecordingClient([engine.url])
        try:
            sample = Sample(prompt_ids=[5, 6, 7], metadata={IMAGES: [str(tmp_path / "red.png")]})
            with pytest.raises(EngineHTTPError, match="image_data: the served model is not a vision-language model"):
                await single_turn(client, sample, SamplingParams(max_new_tokens=2))
        finally:
            await client.close()
        return client.calls

    calls = asyncio.run(main())
    generate = next(c for c in calls if c.endpoint == "/generate")
    assert generate.payload is not None and generate.payload["image_data"][0].startswith("data:image;base64,")
    problems = [p for call in calls for p in request_problems(call, source)]
    assert problems == [], "\n".join(problems)
