"""Reading a judge's verdict (numbers, labels, a pattern, the score range), the judge template's check, and the
``model`` reward's settings refused at start with the field named."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.components import ComponentKind
from miles.errors import SettingsError
from miles.plugins.manager import PluginManager
from miles.rewards.verdicts import VerdictError, VerdictParser, check_template


def test_numbers_in_range_normalised() -> None:
    parser = VerdictParser(score_range=(0.0, 10.0), normalize=True)
    assert parser.parse("7") == 0.7
    assert parser.parse("Score: 8.5/10, well argued") == 0.85
    assert parser.parse("  0 ") == 0.0
    with pytest.raises(VerdictError, match=r"verdict 12 .* is outside \[0, 10\]"):
        parser.parse("12")
    with pytest.raises(VerdictError, match="holds no number"):
        parser.parse("I cannot judge this")
    assert VerdictParser().parse("-2.5e1 points") == -25.0


def test_pattern_picks_the_verdict_out_of_the_answer() -> None:
    parser = VerdictParser(pattern=r"Score:\s*(\d+)")
    assert parser.parse("Step 1 is right, 3 of 4 steps... Score: 9") == 9.0
    with pytest.raises(VerdictError, match="does not match pattern"):
        parser.parse("3 of 4 steps are right")


def test_labels_whole_words_any_case_first_named() -> None:
    parser = VerdictParser(labels={"yes": 1.0, "no": 0.0, "partly": 0.5})
    assert parser.parse("Yes, the answer is right.") == 1.0
    assert parser.parse("NO") == 0.0
    assert parser.parse("Partly. Not yes.") == 0.5
    with pytest.raises(VerdictError, match="names none of the labels yes, no, partly"):
        parser.parse("nope, yesterday's answer")
    longest = VerdictParser(labels={"bad": 0.0, "not bad": 0.7})
    assert longest.parse("not bad at all") == 0.7


def test_template_check() -> None:
    assert check_template("Q: {prompt}\nA: {response}\nRef: {label} {{literal}}")
    with pytest.raises(ValueError, match=r"names \{answer\}"):
        check_template("{answer} {response}")
    with pytest.raises(ValueError, match=r"does not name \{response\}"):
        check_template("{prompt}")
    with pytest.raises(ValueError, match="not a format template"):
        check_template("{response} {")


def problems(tmp_path: Path, **reward: object) -> str:
    from miles.compose import build_run
    from miles.settings.model import MilesSettings, RewardSettings

    manager = PluginManager(entry_points=False, disabled=(), only=())
    settings = MilesSettings(reward=RewardSettings(functions=[{"name": "model", **reward}]))
    with pytest.raises(SettingsError) as caught:
        build_run(settings, manager, kinds=[ComponentKind.REWARD])
    return " ".join(str(caught.value).split())


@pytest.fixture(scope="module")
def two_label_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles.testing.reward_models import build_tiny_classifier

    return build_tiny_classifier(tmp_path_factory.mktemp("rm") / "cls", num_labels=2)


def test_bad_settings_are_refused_naming_the_field(tmp_path: Path, two_label_classifier: Path) -> None:
    said = problems(tmp_path, kind="classifier", model_path=str(tmp_path / "nowhere"))
    assert "reward.functions[0]" in said and "model_path:" in said and "no config.json" in said, said
    said = problems(tmp_path, kind="classifier", model_path=str(two_label_classifier))
    assert "label: the model has 2 labels (LABEL_0, LABEL_1)" in said, said
    said = problems(tmp_path, kind="classifier", model_path=str(two_label_classifier), label="GOOD")
    assert "label: 'GOOD' is not one of the model's labels" in said, said
    said = problems(tmp_path, kind="classifier", model_path=str(two_label_classifier), label=1, labels={"y": 1})
    assert "labels: not a setting of kind = 'classifier'" in said, said
    said = problems(tmp_path, kind="judge", model_path=str(two_label_classifier), template="{prompt}")
    assert "reward.functions[0].template" in said and "does not name {response}" in said, said
    said = problems(tmp_path, kind="judge", model_path=str(two_label_classifier), score_range=[5, 1])
    assert "reward.functions[0].score_range" in said and "is empty" in said, said
    said = problems(tmp_path, kind="oracle", model_path=str(two_label_classifier))
    assert "reward.functions[0].kind" in said, said


def test_a_judge_engine_that_does_not_exist_is_refused_before_anything_starts(
    tmp_path: Path, two_label_classifier: Path
) -> None:
    from miles.auth import ServiceKeys
    from miles.compose import build_run
    from miles.host.reward_servers import start_reward_servers
    from miles.launch.local import LocalLauncher
    from miles.settings.model import MilesSettings, RewardSettings

    manager = PluginManager(entry_points=False, disabled=(), only=())
    judge = {"name": "model", "kind": "judge", "model_path": str(two_label_classifier), "engine": "vllm"}
    settings = MilesSettings(reward=RewardSettings(functions=[judge]), cluster={"num_engines": 0})
    run = build_run(settings, manager, kinds=[ComponentKind.REWARD])
    with LocalLauncher(run_dir=str(tmp_path)) as launcher:
        with pytest.raises(SettingsError, match=r"reward\.functions\[0\]\.engine.*vllm"):
            start_reward_servers(run, launcher, settings, keys=ServiceKeys(None, None), env={})
        assert launcher.processes == []


def test_a_reward_server_on_a_gpu_needs_a_launcher_that_gives_it_one(two_label_classifier: Path) -> None:
    """On a GPU, the ``local`` launcher gives a reward server the next GPU of the host (or the first, with
    ``colocate``), the ``ray`` launcher a GPU in a bundle of its own (so no ``colocate``); any other launcher
    is refused before anything starts, unless the server is on the CPU or behind ``url``."""
    from miles.compose import build_run
    from miles.settings.model import MilesSettings, RewardSettings

    manager = PluginManager(entry_points=False, disabled=(), only=())
    base = {"name": "model", "kind": "classifier", "model_path": str(two_label_classifier), "label": 1}

    def resolve(cluster: dict[str, object], **reward: object) -> None:
        settings = MilesSettings(reward=RewardSettings(functions=[{**base, **reward}]), cluster=cluster)
        build_run(settings, manager, kinds=[ComponentKind.REWARD])

    ray, other = {"device": "cuda", "launcher": {"name": "ray"}}, {"device": "cuda", "launcher": {"name": "slurm"}}
    resolve(ray)
    resolve({"device": "cuda"})
    resolve({"device": "cuda"}, colocate=True)  # (local: GPU 0, with trainer rank 0)
    with pytest.raises(SettingsError, match=r"reward\.functions: colocate: .* 'ray' launcher does not give"):
        resolve(ray, colocate=True)
    with pytest.raises(SettingsError, match=r"reward\.functions: the classifier reward model .* on a GPU .* 'slurm'"):
        resolve(other)
    resolve(other, device="cpu")
    resolve(other, url="http://127.0.0.1:9")


def test_a_launcher_that_places_servers_gets_each_one_s_needs_before_it_reserves(
    tmp_path: Path, two_label_classifier: Path
) -> None:
    """:func:`declare_servers` tells the launcher each server's needs (the ``ray`` launcher records a bundle
    for it: its CPUs, memory, custom resources and, on CUDA, one GPU, seen by its process as device 0); a
    launcher that does not place them (``local``) numbers its GPU after the run's."""
    from miles.compose import build_run
    from miles.host.reward_servers import declare_servers
    from miles.launch.local import LocalLauncher
    from miles.launch.ray_launcher import RayLauncher
    from miles.settings.model import MilesSettings, RewardSettings

    manager = PluginManager(entry_points=False, disabled=(), only=())
    reward = {"name": "model", "kind": "classifier", "model_path": str(two_label_classifier), "label": 1}
    placed = {**reward, "cpus": 2, "memory_mb": 512, "resources": {"reward_node": 1}}
    cluster = {"device": "cuda", "trainer_ranks": 2, "num_engines": 0, "launcher": {"name": "ray"}}
    settings = MilesSettings(reward=RewardSettings(functions=[placed, {**reward, "device": "cpu"}]), cluster=cluster)
    run = build_run(settings, manager, kinds=[ComponentKind.REWARD])
    launcher = RayLauncher(run_dir=str(tmp_path / "ray"))
    declared = declare_servers(run, launcher, settings)
    assert [(d.name, d.device, d.devices) for d in declared] == [
        ("reward-model", "cuda", [0]),
        ("reward-model_2", "cpu", []),
    ]
    assert launcher._services == {
        "reward-model": (
            {"CPU": 2.0, "reward_node": 1.0, "memory": 512.0 * 2**20, "GPU": 1.0},
            "the reward server of reward.functions[0] (model)",
        ),
        "reward-model_2": ({"CPU": 1.0}, "the reward server of reward.functions[1] (model_2)"),
    }
    settings.cluster.launcher.name = "local"
    local = declare_servers(run, LocalLauncher(run_dir=str(tmp_path / "local")), settings)
    assert [(d.name, d.device, d.devices) for d in local] == [
        ("reward-model", "cuda", [2]),
        ("reward-model_2", "cpu", []),
    ]


def test_reward_servers_get_a_gpu_of_their_own_after_the_run_s_or_share_the_first() -> None:
    from miles.host.reward_servers import server_device
    from miles.rewards.base import RewardServer
    from miles.settings.model import MilesSettings

    settings = MilesSettings(cluster={"device": "cuda", "trainer_ranks": 2, "num_engines": 2})
    own, shared = RewardServer(model_path="m"), RewardServer(model_path="m", colocate=True)
    assert server_device(own, settings, gpus_per_engine=2, own=0) == ("cuda", [6])  # 2 ranks + 2 x 2 engine GPUs
    assert server_device(own, settings, gpus_per_engine=2, own=1) == ("cuda", [7])
    assert server_device(shared, settings, gpus_per_engine=2, own=1) == ("cuda", [0])
    assert server_device(RewardServer(model_path="m", device="cpu"), settings, gpus_per_engine=2, own=0) == ("cpu", [])
    settings.cluster.colocate = True  # engines on the trainer's GPUs: the servers start right after the ranks'
    assert server_device(own, settings, gpus_per_engine=2, own=0) == ("cuda", [2])
    settings.cluster.device = "cpu"
    assert server_device(own, settings, gpus_per_engine=2, own=0) == ("cpu", [])
