"""``precision = "auto"`` and ``transport = "auto"`` applied to a run's settings: :mod:`miles.defaults` gives
the rules and the machine's facts; here each choice is made against the installed plugins (a transport
candidate is taken only when it, and the rollout engine, accept the run: their requirements and
``check_settings``), and every choice is returned with its reason for ``miles train`` and ``--dry-run`` to
print. :func:`miles.compose.build_run` calls :func:`choose_automatic` before it resolves the components.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles.components import ComponentKind, missing_requirements
from miles.errors import MilesError, SettingsError

if TYPE_CHECKING:
    from pydantic import BaseModel

    from miles.defaults import Choice, MachineFacts
    from miles.plugins.manager import PluginManager
    from miles.settings.model import MilesSettings

__all__ = ["choose_automatic"]


def choose_automatic(
    settings: MilesSettings, pm: PluginManager, kinds: tuple[ComponentKind, ...], machine: MachineFacts | None
) -> dict[str, Choice]:
    """Replace ``precision = "auto"`` and ``transport = "auto"`` in ``settings`` with the names
    :mod:`miles.defaults` chooses (and ``rollout.engine_dtype = "auto"`` with ``bfloat16`` where ``auto`` trains
    in float32 on a CPU whose bfloat16 GEMMs are slow: :func:`~miles.defaults.choose_engine_dtype`); return every
    choice (those set by the user too) with its reason."""
    from miles.defaults import AUTO, Choice, MachineFacts, choose_engine_dtype, choose_precision
    from miles.settings.loader import sources_of
    from miles.settings.model import PluginSpec

    source_of = sources_of(settings).of
    out: dict[str, Choice] = {}
    if ComponentKind.PRECISION in kinds:
        spec = settings.precision
        if spec.name == AUTO:
            on_cpu = settings.cluster.device == "cpu"
            facts = machine if machine is not None else MachineFacts.of_this_host(measure_gemms=on_cpu)
            asked: dict[str, Any] = {
                "device": settings.cluster.device,
                "cpu_flags": facts.cpu_flags,
                "true_on_policy": settings.train.true_on_policy,
                "engine_dtype": settings.rollout.engine_dtype,
                "bf16_gemm_speedup": facts.bf16_gemm_speedup,
            }
            choice = choose_precision(**asked)
            if ComponentKind.TRAINER in kinds:
                choice = _accepted_by_trainer(settings, pm, choice)
            out["precision"] = choice
            settings.precision = PluginSpec(name=choice.value, **spec.options)
            engine_dtype = choose_engine_dtype(precision=choice.value, **asked)
            if engine_dtype is not None:
                out["engine_dtype"] = engine_dtype
                settings.rollout.engine_dtype = engine_dtype.value
        else:
            out["precision"] = Choice("precision", spec.name, _as_set(source_of("precision")))
    if ComponentKind.TRANSPORT in kinds:
        if settings.transport.name == AUTO:
            out["transport"] = _choose_transport(settings, pm)
        else:
            out["transport"] = Choice("transport", settings.transport.name, _as_set(source_of("transport")))
    return out


def _accepted_by_trainer(settings: MilesSettings, pm: PluginManager, choice: Choice) -> Choice:
    """``choice``, or ``fp32`` where the trainer (``train.backend``'s ``check_settings``) refuses ``choice`` and
    accepts ``fp32``; the reason then quotes the refusal. Where it refuses both, ``choice`` stays and the run's
    own checks report it."""
    from miles.defaults import Choice
    from miles.settings.model import PluginSpec

    trainer = _component(pm, ComponentKind.TRAINER, settings.train.backend)
    if choice.value == "fp32" or trainer is None:
        return choice

    def refusal(name: str) -> str | None:
        return _refused_by(*trainer, settings.model_copy(update={"precision": PluginSpec(name=name)}))

    why = refusal(choice.value)
    if why is None or refusal("fp32") is not None:
        return choice
    name = settings.train.backend.name
    return Choice("precision", "fp32", f"auto: {choice.value} refused by train.backend {name!r}: {why}")


def _component(pm: PluginManager, kind: ComponentKind, value: Any) -> tuple[Any, BaseModel] | None:
    """The component ``value`` selects and its options, or ``None`` (an error build_run's own resolution reports)."""
    try:
        entry, options = pm.resolve(kind, value, field=kind.field)
    except MilesError:
        return None
    return entry.component, options


def _refused_by(component: Any, options: BaseModel | None, trial: MilesSettings) -> str | None:
    """Why ``component``'s ``check_settings`` refuses ``trial`` (``None``: it accepts it, or has no check)."""
    check = getattr(component, "check_settings", None)
    if check is None:
        return None
    try:
        check(options, trial)
    except MilesError as exc:
        return str(exc)
    return None


def _as_set(source: str | None) -> str:
    return f"as set ({source})" if source else "the default"


def _choose_transport(settings: MilesSettings, pm: PluginManager) -> Choice:
    """``transport = "auto"``: the first of :func:`miles.defaults.transport_candidates` that the transport and the
    rollout engine accept (their ``check_settings``); ``settings.transport`` becomes it."""
    from miles.defaults import Choice, TransportFacts, transport_candidates
    from miles.settings.model import TransportSpec

    spec = settings.transport
    if spec.options:
        raise SettingsError(
            f"transport: 'auto' chooses the transport and its options; {', '.join(sorted(spec.options))} "
            "belong to a named transport: set transport.name too"
        )

    launcher = _component(pm, ComponentKind.LAUNCHER, settings.cluster.launcher)
    engine = _component(pm, ComponentKind.ROLLOUT_ENGINE, settings.rollout.engine)
    precision = _component(pm, ComponentKind.PRECISION, settings.precision)
    transports = pm.registry(ComponentKind.TRANSPORT)
    facts = TransportFacts(
        device=settings.cluster.device,
        num_engines=settings.cluster.num_engines,
        colocate=settings.cluster.colocate,
        engines_on_trainer_host=launcher is not None and not _may_span_hosts(*launcher),
        p2p_installed="p2p" in transports,
        engine_serves_p2p=engine is not None
        and getattr(engine[0], "capabilities", None) is not None
        and engine[0].capabilities.miles_weight_routes,
        precision_sends_slices=precision is None or precision[0].converts_shards(),
        adapter=settings.train.adapter is not None,
        lora_installed="lora" in transports,
    )
    common = spec.model_dump(exclude={"name"})
    refused: list[str] = []
    candidates = transport_candidates(facts)
    for candidate in candidates:
        chosen = TransportSpec(name=candidate.name, **common, **candidate.options)
        problem = _refusal(pm, settings.model_copy(update={"transport": chosen}), engine)
        if problem is None or candidate is candidates[-1]:
            settings.transport = chosen
            reason = candidate.reason + (f"; refused: {'; '.join(refused)}" if refused else "")
            return Choice("transport", candidate.name, reason)
        refused.append(f"{candidate.name} ({problem})")
    raise AssertionError("unreachable: the last candidate is always taken")


def _may_span_hosts(launcher: Any, options: BaseModel) -> bool:
    """Whether the launcher may place engines on other hosts (one that cannot tell: yes)."""
    ask = getattr(launcher, "may_span_hosts", None)
    return True if ask is None else bool(ask(options))


def _refusal(pm: PluginManager, trial: MilesSettings, engine: tuple[Any, BaseModel] | None) -> str | None:
    """Why ``trial.transport`` cannot serve the run (its requirements, its ``check_settings`` or the engine's),
    or ``None``."""
    try:
        entry, options = pm.resolve(ComponentKind.TRANSPORT, trial.transport, field="transport")
        missing = missing_requirements(entry.component, options)
        if missing:
            return "; ".join(str(r.missing_error(entry.name)) for r in missing)
    except MilesError as exc:
        return str(exc)
    for component, own in ((entry.component, options), engine or (None, None)):
        why = _refused_by(component, own, trial)
        if why is not None:
            return why
    return None
