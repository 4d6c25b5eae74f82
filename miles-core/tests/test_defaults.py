"""Defaults chosen from the machine (:mod:`miles.defaults`): each choice from the facts it is given, and
``build_run`` replacing ``auto`` before any component is resolved."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.components import ComponentKind
from miles.compose import Run, build_run
from miles.defaults import (
    BF16_TRAIN_SPEEDUP,
    SPIN_COUNT,
    MachineFacts,
    TransportFacts,
    choose_engine_dtype,
    choose_precision,
    measure_bf16_gemm_speedup,
    split_threads,
    transport_candidates,
)
from miles.errors import SettingsError
from miles.plugins.manager import PluginManager
from miles.settings.model import MilesSettings, PluginSpec, TransportSpec

SAPPHIRE_RAPIDS = frozenset(
    ["fpu", "sse2", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"]
)
ICE_LAKE = frozenset(["fpu", "sse2", "avx2", "avx512f", "avx512_vnni"])  # AVX-512 without bf16 units
ZEN4 = frozenset(["fpu", "sse2", "avx2", "avx512f", "avx512_bf16"])  # AMD EPYC 9004: AVX-512 BF16, no AMX
XEON_NO_AMX = frozenset(["fpu", "sse2", "avx2", "avx512f", "avx512_bf16", "avx512_fp16"])  # AMX not exposed


# -------------------------------------------------------------------------------------------- precision
@pytest.mark.parametrize(
    ("flags", "expected", "named"),
    [(SAPPHIRE_RAPIDS, "bf16", "avx512_bf16, amx_bf16"), (ZEN4, "bf16", "avx512_bf16"), (ICE_LAKE, "fp32", "no ")],
)
def test_precision_is_bf16_where_the_cpu_has_bf16_units(flags: frozenset[str], expected: str, named: str) -> None:
    choice = choose_precision(device="cpu", cpu_flags=flags)
    assert (choice.field, choice.value) == ("precision", expected)
    assert named in choice.reason


def test_precision_on_cuda_is_bf16_whatever_the_cpu() -> None:
    choice = choose_precision(device="cuda", cpu_flags=ICE_LAKE)
    assert choice.value == "bf16" and "CUDA" in choice.reason


def test_fidelity_sensitive_settings_keep_float32() -> None:
    on_policy = choose_precision(device="cpu", cpu_flags=SAPPHIRE_RAPIDS, true_on_policy=True)
    assert on_policy.value == "fp32" and "train.true_on_policy" in on_policy.reason
    fp32_engine = choose_precision(device="cuda", cpu_flags=SAPPHIRE_RAPIDS, engine_dtype="float32")
    assert fp32_engine.value == "fp32" and "rollout.engine_dtype = float32" in fp32_engine.reason
    bf16_engine = choose_precision(device="cpu", cpu_flags=SAPPHIRE_RAPIDS, engine_dtype="bfloat16")
    assert bf16_engine.value == "bf16"


def test_measured_bf16_gemms_decide_whether_to_train_in_bf16_and_the_engines_still_serve_bf16() -> None:
    """A CPU with bfloat16 units trains in bf16 where its bf16 GEMMs, measured, beat float32's by
    :data:`BF16_TRAIN_SPEEDUP` (AMX: 2.4x); where they do not (a Xeon whose AMX is not exposed: 0.55-0.65x), the
    trainer computes in float32 and the engines serve bfloat16, since decoding reads the weights."""
    fast = choose_precision(device="cpu", cpu_flags=SAPPHIRE_RAPIDS, bf16_gemm_speedup=2.4)
    assert fast.value == "bf16" and "bf16 GEMMs run at 2.40x float32's here (measured at start)" in fast.reason
    slow = choose_precision(device="cpu", cpu_flags=XEON_NO_AMX, bf16_gemm_speedup=0.6)
    assert slow.value == "fp32"
    assert slow.reason == (
        "auto: the CPU has bfloat16 units (avx512_bf16), but bf16 GEMMs run at 0.60x float32's here (measured at "
        f"start), below the {BF16_TRAIN_SPEEDUP}x that bf16 training needs: the trainer computes in float32"
    )
    engine = choose_engine_dtype(device="cpu", cpu_flags=XEON_NO_AMX, precision="fp32", bf16_gemm_speedup=0.6)
    assert engine is not None and (engine.field, engine.value) == ("rollout.engine_dtype", "bfloat16")
    assert "half the bytes" in engine.reason
    # the engines keep the recipe's dtype everywhere else
    kept = [
        dict(device="cpu", cpu_flags=XEON_NO_AMX, precision="fp32", bf16_gemm_speedup=None),  # not measured
        dict(device="cpu", cpu_flags=SAPPHIRE_RAPIDS, precision="bf16", bf16_gemm_speedup=2.4),
        dict(device="cpu", cpu_flags=ICE_LAKE, precision="fp32", bf16_gemm_speedup=0.3),  # no units
        dict(device="cpu", cpu_flags=XEON_NO_AMX, precision="fp32", bf16_gemm_speedup=0.6, true_on_policy=True),
        dict(device="cpu", cpu_flags=XEON_NO_AMX, precision="fp32", bf16_gemm_speedup=0.6, engine_dtype="float32"),
        dict(device="cuda", cpu_flags=XEON_NO_AMX, precision="fp32", bf16_gemm_speedup=0.6),
    ]
    assert [choose_engine_dtype(**facts) for facts in kept] == [None] * len(kept)  # type: ignore[arg-type]
    # the flags alone, unmeasured, and the fidelity settings, decide as before
    assert choose_precision(device="cpu", cpu_flags=XEON_NO_AMX).value == "bf16"
    on_policy = choose_precision(device="cpu", cpu_flags=XEON_NO_AMX, true_on_policy=True, bf16_gemm_speedup=3.0)
    assert on_policy.value == "fp32"


def test_this_hosts_bf16_gemm_speedup_is_measured() -> None:
    """The measurement runs the real GEMMs of this host in both dtypes (a rate ratio: positive and finite)."""
    speedup = measure_bf16_gemm_speedup(rounds=2)
    assert speedup is not None and 0.01 < speedup < 100


def test_a_bf16_gemm_that_fails_leaves_the_choice_to_the_flags(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A torch build without a bfloat16 GEMM kernel (injected: torch's linear raising NotImplementedError, as
    torch does for a dtype without a kernel, where oneDNN is absent) gives no measurement, with the error in the
    log, and the CPU flags decide as before."""
    import torch

    linear = torch.nn.functional.linear

    def no_bf16(x: torch.Tensor, w: torch.Tensor, *args: object) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            raise NotImplementedError("\"addmm_impl_cpu_\" not implemented for 'BFloat16'")
        return linear(x, w, *args)

    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    monkeypatch.setattr(torch.nn.functional, "linear", no_bf16)
    with caplog.at_level("WARNING", logger="miles.defaults"):
        assert measure_bf16_gemm_speedup(rounds=1) is None
    assert "timing bfloat16 GEMMs against float32 failed" in caplog.text and "BFloat16" in caplog.text
    assert choose_precision(device="cpu", cpu_flags=XEON_NO_AMX, bf16_gemm_speedup=None).value == "bf16"


def test_machine_facts_read_the_first_processor_of_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu avx512f amx_bf16\n\n"
        "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n"
    )
    facts = MachineFacts.of_this_host(cpuinfo)
    assert facts.cpu_model == "Intel(R) Xeon(R) Platinum 8480+"
    assert facts.cpu_flags == {"fpu", "avx512f", "amx_bf16"}
    assert facts.cores >= 1
    missing = MachineFacts.of_this_host(tmp_path / "absent")
    assert (
        missing.cpu_flags == frozenset() and choose_precision(device="cpu", cpu_flags=missing.cpu_flags).value == "fp32"
    )


# -------------------------------------------------------------------------------------------- transport
ONE_HOST = TransportFacts(p2p_installed=True, engine_serves_p2p=True)


def test_transport_is_p2p_into_the_engines_weights_on_one_host() -> None:
    first = transport_candidates(ONE_HOST)[0]
    assert first.name == "p2p" and dict(first.options) == {"datapath": "shm", "write_into_weights": True}
    assert [c.name for c in transport_candidates(ONE_HOST)] == ["p2p", "broadcast", "disk"]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"p2p_installed": False}, "miles-p2p is not installed"),
        ({"engines_on_trainer_host": False}, "engines run on other hosts"),
        ({"device": "cuda"}, "the weights live on the GPU"),
        ({"colocate": True}, "colocated engines release the weights"),
        ({"engine_serves_p2p": False}, "the rollout engine does not serve p2p's routes"),
        ({"precision_sends_slices": False}, "converts whole tensors only"),
        ({"adapter": True}, "train.adapter is set"),
    ],
)
def test_transport_falls_back_to_broadcast_then_disk(change: dict[str, object], why: str) -> None:
    facts = TransportFacts(**{**ONE_HOST.__dict__, **change})  # type: ignore[arg-type]
    candidates = transport_candidates(facts)
    assert [c.name for c in candidates] == ["broadcast", "disk"]
    assert why in candidates[0].reason


def test_a_run_without_engines_keeps_disk() -> None:
    (only,) = transport_candidates(TransportFacts(num_engines=0, p2p_installed=True, engine_serves_p2p=True))
    assert only.name == "disk" and "cluster.num_engines = 0" in only.reason


def test_an_adapter_goes_by_the_lora_transport_where_installed() -> None:
    facts = TransportFacts(p2p_installed=True, engine_serves_p2p=True, adapter=True, lora_installed=True)
    assert [c.name for c in transport_candidates(facts)] == ["lora", "broadcast", "disk"]


# ---------------------------------------------------------------------------------------------- threads
def test_sync_gives_each_side_every_core_and_async_modes_split_them() -> None:
    sync = split_threads(mode="sync", cores=16, trainer_ranks=2, num_engines=2, environ={})
    # the two engines decode at the same time: they split the cores as the trainer ranks do
    assert (sync.trainer, sync.engine) == (8, 8) and "take turns" in sync.reason
    assert "(the 2 trainer ranks and the 2 engines each split them)" in sync.reason
    one = split_threads(mode="sync", cores=16, trainer_ranks=1, num_engines=1, environ={})
    assert (one.trainer, one.engine) == (16, 16)
    both = split_threads(mode="fully_async", cores=16, trainer_ranks=2, num_engines=2, environ={})
    assert (both.trainer, both.engine) == (4, 4) and "split the 16 cores" in both.reason
    tiny = split_threads(mode="one_step_off", cores=2, trainer_ranks=2, num_engines=2, environ={})
    assert (tiny.trainer, tiny.engine) == (1, 1)
    # a run without engines (SFT): the trainer ranks take the cores
    sft = split_threads(mode="sync", cores=4, trainer_ranks=2, num_engines=0, environ={})
    assert (sft.trainer, sft.spin) == (2, True)


def test_threads_spin_briefly_only_where_the_busy_threads_fit_in_the_cores() -> None:
    sync = split_threads(mode="sync", cores=2, trainer_ranks=1, num_engines=1, environ={})
    assert sync.spin and sync.wait_env({}) == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    assert f"spin briefly between operations (GOMP_SPINCOUNT={SPIN_COUNT}): 2 busy at once for 2 cores" in sync.line()
    # a machine that was busy when the run started: passive, whatever the split
    assert sync.wait_env({}, busy=True) == {"OMP_WAIT_POLICY": "PASSIVE"}
    # four processes of one thread each on two cores run at once: oversubscribed
    tiny = split_threads(mode="one_step_off", cores=2, trainer_ranks=2, num_engines=2, environ={})
    assert not tiny.spin and tiny.wait_env({}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert "wait passively: 4 threads busy at once for 2 cores" in tiny.line()
    fits = split_threads(mode="fully_async", cores=16, trainer_ranks=2, num_engines=2, environ={})
    assert fits.spin
    # the user's thread counts: 3 per process, two engines decoding at once on 4 cores do not fit
    user = split_threads(mode="sync", cores=4, trainer_ranks=1, num_engines=2, environ={"MILES_TORCH_THREADS": "3"})
    assert (user.engine, user.spin) == (3, False)
    pools = split_threads(mode="sync", cores=2, trainer_ranks=1, num_engines=1, environ={"OMP_NUM_THREADS": "2"})
    assert not pools.spin and "the pools' size is set from outside" in pools.line()
    # what the user set for the wait wins: nothing is added
    assert sync.wait_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {} and sync.wait_env({"GOMP_SPINCOUNT": "7"}) == {}


def test_the_users_thread_count_wins_and_cuda_leaves_threads_alone() -> None:
    user = split_threads(mode="sync", cores=16, trainer_ranks=1, num_engines=1, environ={"MILES_TORCH_THREADS": "3"})
    assert (user.trainer, user.engine) == (3, 3) and "MILES_TORCH_THREADS=3" in user.reason
    cuda = split_threads(mode="sync", cores=16, trainer_ranks=1, num_engines=1, device="cuda", environ={})
    assert cuda.trainer is None and cuda.line().startswith("threads: on CUDA")


# ----------------------------------------------------------------------------------------- build_run
def _build(settings: MilesSettings, machine: MachineFacts | None = None) -> Run:
    """``build_run`` over the built-in plugins alone, for the components ``auto`` replaces (no model needed)."""
    manager = PluginManager(entry_points=False).load()
    return build_run(settings, manager, kinds=[ComponentKind.PRECISION, ComponentKind.TRANSPORT], machine=machine)


def test_build_run_replaces_auto_before_resolving() -> None:
    settings = MilesSettings(precision=PluginSpec(name="auto"), transport=TransportSpec(name="auto"))
    run = _build(settings, MachineFacts(cpu_flags=SAPPHIRE_RAPIDS))
    assert settings.precision.name == "bf16" and run["precision"].registration.name == "bf16"
    # the built-ins alone (no miles-p2p registered): broadcast, saying why not p2p
    assert settings.transport.name == "broadcast" and run["transport"].registration.name == "broadcast"
    assert "miles-p2p is not installed" in run.choices["transport"].reason
    again = MilesSettings(precision=PluginSpec(name="auto"))
    _build(again, MachineFacts(cpu_flags=ICE_LAKE))
    assert again.precision.name == "fp32"
    # "auto" is what a run that names neither gets
    unnamed = MilesSettings()
    run = _build(unnamed, MachineFacts(cpu_flags=SAPPHIRE_RAPIDS))
    assert (unnamed.precision.name, unnamed.transport.name) == ("bf16", "broadcast")
    assert run.choices["precision"].reason.startswith("auto: the CPU has bfloat16 units")
    assert "engine_dtype" not in run.choices and run.engine_dtype == "bfloat16"
    # bf16 units whose GEMMs are slow: the trainer in float32, the engines in bfloat16
    slow = MilesSettings()
    run = _build(slow, MachineFacts(cpu_flags=XEON_NO_AMX, bf16_gemm_speedup=0.6))
    assert (slow.precision.name, slow.rollout.engine_dtype, run.engine_dtype) == ("fp32", "bfloat16", "bfloat16")
    assert run.choices["engine_dtype"].line().startswith("rollout.engine_dtype = bfloat16: auto: the trainer")
    # a dtype the user set is kept
    kept = MilesSettings(rollout={"engine_dtype": "float32"})
    run = _build(kept, MachineFacts(cpu_flags=XEON_NO_AMX, bf16_gemm_speedup=0.6))
    assert (kept.precision.name, run.engine_dtype) == ("fp32", "float32") and "engine_dtype" not in run.choices


def test_colocated_on_cuda_auto_takes_tensor_ipc_else_disk_where_broadcast_is_refused() -> None:
    """Colocated local engines on CUDA read each trainer rank's tensors in place (``tensor_ipc``); where the
    engines do not pair with the trainer ranks it is refused, so is ``broadcast`` (NCCL refuses two ranks of one
    GPU), and ``disk`` is taken, with both refusals said."""
    colocated = {"device": "cuda", "colocate": True, "num_engines": 2, "trainer_ranks": 2}
    settings = MilesSettings(transport=TransportSpec(name="auto"), cluster=colocated)
    run = _build(settings)
    assert settings.transport.name == "tensor_ipc" and "CUDA IPC" in run.choices["transport"].reason
    settings = MilesSettings(
        transport=TransportSpec(name="auto", bucket_bytes=1 << 20), cluster={**colocated, "num_engines": 1}
    )
    run = _build(settings)
    assert settings.transport.name == "disk" and settings.transport.bucket_bytes == 1 << 20
    reason = run.choices["transport"].reason
    assert "refused: tensor_ipc (cluster.num_engines: transport 'tensor_ipc' pairs each engine TP rank" in reason
    assert "broadcast (transport.name: 'broadcast' cannot serve cluster.colocate = true on CUDA" in reason


def test_choices_set_by_the_user_are_kept_and_said_so() -> None:
    settings = MilesSettings(precision=PluginSpec(name="fp32"), transport=TransportSpec(name="disk"))
    run = _build(settings, MachineFacts(cpu_flags=SAPPHIRE_RAPIDS))
    assert (run.choices["precision"].value, run.choices["transport"].value) == ("fp32", "disk")
    assert run.choices["precision"].reason == "the default"


def test_auto_transport_refuses_a_named_transports_options() -> None:
    settings = MilesSettings(transport=TransportSpec(name="auto", datapath="torch"))
    with pytest.raises(SettingsError, match=r"transport: 'auto' chooses the transport and its options; datapath"):
        _build(settings)
