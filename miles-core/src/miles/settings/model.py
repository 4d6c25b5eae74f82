"""The settings tree. Every field's docstring is its documentation (CLI help and the reference page).

Components are chosen with a :class:`PluginSpec`: either a bare name (``algorithm = "grpo"``) or a table
whose ``name`` picks the component and whose other keys are validated by that component's own
``Settings`` model (``[algorithm] name = "grpo"  clip_eps_high = 0.28``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from miles.settings.sessions import SessionSettings
from miles.settings.signals import SignalSettings
from miles.types import PauseMode

__all__ = [
    "AlgorithmSpec",
    "CheckpointSettings",
    "ClusterSettings",
    "DataSettings",
    "LogSettings",
    "MilesSettings",
    "PluginSpec",
    "RewardFunctionSpec",
    "RewardSettings",
    "RolloutSettings",
    "RouterSettings",
    "TeacherSettings",
    "TrainSettings",
    "TransportSpec",
]


def _default_component_names(model: type[BaseModel], data: Any) -> Any:
    """A component table given without ``name`` (``--set train.backend.fused_logprobs=true`` with no
    ``[train.backend]`` in the file) keeps the field's default component: its keys are that component's options."""
    if not isinstance(data, dict):
        return data
    for key, field in model.model_fields.items():
        value = data.get(key)
        if isinstance(value, dict) and "name" not in value and field.default_factory is not None:
            default = field.default_factory()  # type: ignore[call-arg]
            if isinstance(default, PluginSpec):
                data = {**data, key: {"name": default.name, **value}}
    return data


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _component_defaults(cls, data: Any) -> Any:
        return _default_component_names(cls, data)


class PluginSpec(BaseModel):
    """A component chosen by name; every other key belongs to the component's own settings model."""

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)

    name: str
    """Registered name of the component (see ``miles plugins list``)."""

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @property
    def options(self) -> dict[str, Any]:
        """The component's own keys (validated by its ``Settings`` model when the run is resolved)."""
        return dict(self.model_extra or {})


class AlgorithmSpec(PluginSpec):
    """The RL objective; its other keys are the algorithm's settings."""


class TransportSpec(PluginSpec):
    """The weight transport; its other keys are the transport's settings."""

    bucket_bytes: int = Field(256 << 20, ge=1)
    """Size of the weight buckets the trainer gathers and the transport sends one at a time."""
    verify: bool = True
    """After every push, check that the engines serve what was sent (how: ``verify_with``)."""
    verify_with: Literal["auto", "checksums", "rows", "logprobs"] = "auto"
    """How a push is verified. ``checksums``: every tensor, bit for bit (``/weights_checksum``, Miles' own
    engine). ``rows``: the leading rows of every tensor, bit for bit (SGLang's ``/get_weights_by_name``,
    which SGLang serves for Llama-like models only). ``logprobs``: each engine's logprobs of a fixed probe
    sequence equal the trainer's within ``verify_logprob_tolerance`` (any model an engine serves; a tensor a
    push missed shows for sure only after ``randomize_engines_first``). ``auto``: checksums where the engine
    serves them, else rows where it answers them for this model, else logprobs (said once in the log)."""
    verify_logprob_tolerance: float | None = Field(None, gt=0)
    """``logprobs`` verification: the largest mean |engine - trainer| logprob over the probe's tokens
    (default 0.02 for float32 engines, 0.1 for lower precisions)."""
    randomize_engines_first: bool = False
    """Test mode: overwrite the engines' weights with random values before every push, so verification
    proves every tensor was really sent (needs ``rollout.engine.enable_debug_endpoints``)."""


class RewardFunctionSpec(PluginSpec):
    """One reward function of a (possibly weighted) combination."""

    weight: float = 1.0
    """Weight of this function in the combined reward."""


class ClusterSettings(_Section):
    """Where processes run."""

    launcher: PluginSpec = Field(default_factory=lambda: PluginSpec(name="local"))
    """How processes are placed: ``local`` (this host) or ``ray``."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Device of trainer ranks and engines; ``cpu`` uses gloo, ``cuda`` NCCL."""
    trainer_ranks: int = Field(1, ge=1)
    """Number of trainer processes (data-parallel world size for FSDP)."""
    num_engines: int = Field(1, ge=0)
    """Number of rollout-engine servers (0 for SFT, which needs none)."""
    colocate: bool = False
    """Engines and trainer share devices: each side gives its memory back while the other works, in one
    phase order (:mod:`miles.driver.colocate`)."""
    offload_trainer: bool | None = None
    """Colocated: move the trainer's optimizer state, gradients, reference model and then its weights to host
    memory while the engines roll out. Default: on CUDA (where the GPU is shared); on a CPU it frees nothing
    (the copies are host memory too) and runs only when set, to exercise the path."""
    host: str = "127.0.0.1"
    """Address services bind to."""
    api_key: SecretStr | None = Field(None, exclude=True)
    """The run's API key: every service of the run (engines, router, session server) requires
    ``Authorization: Bearer <key>``, and every client of the run sends it. Default: the environment variable
    ``MILES_API_KEY``; unset there too, ``miles train`` makes a random one when a service of the run listens
    beyond loopback (``host`` or ``rollout.sessions.host`` not loopback, or engines on other nodes), and none
    on loopback. It reaches the processes of the run through their environment: never a command line,
    ``settings.json``, a log or a metric. Prefer the environment variable to this file."""
    admin_api_key: SecretStr | None = Field(None, exclude=True)
    """A second key for the control routes of engines and router (weights, pause, memory, flush, abort, LoRA,
    debug), as SGLang's ``--admin-api-key``: with it, those routes need this key and the others ``api_key``,
    so an agent holding the API key cannot push weights. Default: the environment variable
    ``MILES_ADMIN_API_KEY``; unset: ``api_key`` opens every route."""
    engine_startup_timeout: float = Field(300.0, gt=0)
    """Seconds to wait for an engine to answer ``/health``."""
    trainer_startup_timeout: float = Field(600.0, gt=0)
    """Seconds the trainer ranks may take to load their models before a colocated run's engines start (they
    start after the trainer, on the same devices)."""
    trainer_malloc: Literal["keep", "system"] = "keep"
    """On CPU, how the trainer processes' glibc malloc treats freed memory. ``keep``: every block comes from
    the heap and freed memory stays mapped for the next step (``GLIBC_TUNABLES`` with
    ``glibc.malloc.mmap_max=0`` and no trimming). A step's large tensors (the logits, the tied embedding's
    gradient) are then not mapped afresh and page-faulted in, zero page by zero page, at every step: a
    SmolLM2 train step 1.3-2x faster on 2 cores. RSS stays at the step's peak. ``system``: glibc's defaults.
    ``GLIBC_TUNABLES`` or ``MALLOC_*`` set in the environment win over either."""
    engine_malloc: Literal["keep", "system"] = "system"
    """On CPU, the same choice for the local engine processes (``miles serve`` started by ``miles train``).
    ``system`` (glibc's defaults) by default: the engine's decode measured no faster with ``keep``, and its RSS
    grows less (``docs/reliability.md``, "Soak"). ``GLIBC_TUNABLES`` or ``MALLOC_*`` set in the environment win
    over either."""


class DataSettings(_Section):
    """Where prompts come from."""

    source: PluginSpec = Field(default_factory=lambda: PluginSpec(name="jsonl"))
    """Data-source plugin: ``jsonl``, ``parquet`` ..."""
    path: str | None = None
    """Prompt file (JSONL: one object a line)."""
    prompt_key: str = "prompt"
    """Key of the prompt (text, or a list of chat messages)."""
    label_key: str = "label"
    """Key of the label handed to rewards (reference answer ...)."""
    apply_chat_template: bool = True
    """Apply the tokenizer's chat template to the prompt, once, when it is read."""
    system_prompt: str | None = None
    """Optional system message prepended before the chat template is applied."""
    shuffle: bool = True
    """Shuffle each epoch (deterministically, from ``seed``)."""
    seed: int = 1234
    """Seed of the shuffle."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Drop prompts longer than this many tokens (``None``: keep all)."""
    eval_path: str | None = None
    """Eval prompt file (same format as ``path``), used every ``train.eval_interval`` steps."""
    image_key: str = "images"
    """Key of a row's images (a list of file paths, ``file://`` URLs or base64; a vision-language policy
    only), placed by the prompt's ``{"type": "image"}`` parts or, for a text prompt, before its text."""
    max_image_pixels: int = Field(4096 * 4096, ge=1)
    """Refuse images with more pixels (width x height) than this, when the data is loaded."""


class TeacherSettings(_Section):
    """A teacher model that scores every rollout sample (on-policy distillation).

    Any server speaking SGLang's ``/generate`` works (``miles serve --model TEACHER --port P`` or SGLang
    itself); it must share the policy's tokenizer. Each finished sample is sent once with
    ``max_new_tokens = 0``, ``return_logprob`` and ``logprob_start_len`` = its prompt length; the answer
    fills ``Sample.teacher_logprobs`` (and, with ``top_k``, the teacher's top-k ids and logprobs).
    """

    url: str | None = None
    """Base URL of the teacher server (``http://127.0.0.1:30001``); unset: no teacher scoring."""
    top_k: int = Field(0, ge=0)
    """Also fetch the teacher's ``top_k`` most likely tokens per response position (``top_logprobs_num``);
    must be at least the algorithm's ``distill_topk`` for ``distill_mode = "topk"``."""
    temperature: float = Field(1.0, gt=0.0)
    """Temperature of the teacher's distribution (1: the teacher's own)."""
    max_concurrency: int = Field(32, ge=1)
    """Scoring requests in flight at once."""
    batch_size: int = Field(16, ge=1)
    """Sequences in one (batched) scoring request."""
    timeout: float = Field(600.0, gt=0.0)
    """Seconds one scoring request may take."""


class RouterSettings(_Section):
    """The router in front of the engines: ``rollout.router = "smg"`` or a ``[rollout.router]`` table.

    Generation goes through the router with the request's group or session id in a header; control calls
    (pause, weights, memory, flush, version, checksums) go to every engine directly.
    """

    name: Literal["none", "smg"] = "none"
    """``none``: the engine client routes itself (consistent hashing on the routing key); ``smg``: the
    SGLang Model Gateway (``pip install smg``), started by the launcher: on ``cluster.host`` of the driver's
    host, or with the ``ray`` launcher on a node of the cluster (``cluster.launcher.router_resources``)."""
    policy: Literal[
        "manual", "consistent_hashing", "cache_aware", "prefix_hash", "round_robin", "power_of_two", "random"
    ] = "manual"
    """smg's policy. ``manual`` pins each routing key (group, session) to one engine, chosen by
    ``assignment_mode`` at its first request; ``consistent_hashing`` hashes the key; ``cache_aware``
    routes by prefix overlap and keeps a key where its first request went (smg's routing-key override);
    ``prefix_hash``, ``round_robin``, ``power_of_two`` and ``random`` ignore the key."""
    assignment_mode: Literal["random", "min_load", "min_group"] = "min_group"
    """How ``manual`` places a new key: on the engine holding the fewest keys (``min_group``: 8 groups in
    flight over 2 engines split 4/4), the fewest requests in flight (``min_load``) or at random."""
    routing_key_header: str = "x-session-id"
    """Header carrying the routing key (smg ``--routing-key-headers``)."""
    health_check_interval: int = Field(10, ge=1)
    """Seconds between smg's health checks of each engine (``/health``)."""
    startup_timeout: float = Field(60.0, gt=0)
    """Seconds to wait for the router to report every engine healthy."""
    extra_args: list[str] = Field(default_factory=list)
    """More ``smg launch`` flags, passed as given (e.g. ``["--cache-threshold", "0.5"]``)."""

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value


class RolloutSettings(_Section):
    """Generation."""

    engine: PluginSpec = Field(default_factory=lambda: PluginSpec(name="local"))
    """Rollout-engine backend: ``local`` (``miles serve``) or ``sglang``."""
    router: RouterSettings = Field(default_factory=RouterSettings)
    """Router in front of the engines: ``none`` (the client routes) or ``smg`` (see ``[rollout.router]``)."""
    engine_restarts: int = Field(1, ge=0)
    """Times the launcher restarts each engine that dies while the trainers run. Its requests in flight are
    re-sent to the other engines at once, with the same seeds, whatever this is; a restarted engine serves
    again once the next weight push has reached it. Past the budget the run goes on with the engines left,
    and stops when none is left. Ignored with a router (it would send traffic to a restarted engine before
    it has the trainer's weights)."""
    function: str | PluginSpec | None = None
    """Custom rollout function: a registered name or ``package.module:function`` (default: single-turn); a
    table (``[rollout.function] name = "openenv"  env = "..."``) gives a registered function its settings."""
    mode: Literal["sync", "one_step_off", "fully_async"] = "sync"
    """``sync``: generate then train; ``one_step_off``: overlap one batch; ``fully_async``: a producer."""
    rollout_batch_size: int = Field(8, ge=1)
    """Prompts per rollout."""
    n_samples_per_prompt: int = Field(4, ge=1)
    """Samples per prompt (the group size)."""
    max_new_tokens: int = Field(128, ge=1)
    """Maximum response tokens."""
    min_new_tokens: int = Field(0, ge=0)
    """Minimum response tokens (EOS is suppressed before that)."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature (0 = greedy); the trainer applies the same one to its logits."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling."""
    top_k: int = -1
    """Top-k sampling (-1: off)."""
    replay_sampling_mask: bool = False
    """Sampling-mask replay: the engines return each token's kept set under ``top_k`` / ``top_p`` (SGLang's
    ``return_sampling_mask``) and its behaviour logprob (under the kept set, renormalised), which becomes the
    sample's rollout logprob; the trainer renormalises its own logprobs over the same set (loss, ratio, KL,
    mismatch metrics). Without it the engine draws from the truncated set while the trainer scores the whole
    vocabulary."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Token ids that end a response like EOS (masked out, with EOS, before ``min_new_tokens``)."""
    max_staleness: int = Field(1, ge=0)
    """Async modes: drop/retry samples whose oldest weight version is this far behind the trainer."""
    stale_policy: Literal["drop", "retry"] = "drop"
    """What happens to a sample over ``max_staleness``."""
    buffer_groups: int = Field(16, ge=1)
    """Async modes: capacity of the rollout buffer, in groups."""
    pause_mode: PauseMode = "retract"
    """How engines treat requests in flight during a weight update."""
    overlap_weight_commit: bool = True
    """Async modes, with a transport that stages weights (``disk``): the engines load and verify version
    ``k`` while the trainer already trains step ``k + 1``, so only writing the weights stays on the
    trainer's critical path. Verification still runs after every push; its metrics (and a mismatch, which
    stops the run naming the tensor) arrive with the next step. ``false``: push and verify in line."""
    engine_dtype: str = "auto"
    """Dtype engines serve in (``auto``: the precision recipe's; ``bfloat16`` where ``precision = "auto"`` trains
    in float32 on a CPU with bfloat16 units whose bfloat16 GEMMs are slow, since decoding reads the weights)."""
    teacher: TeacherSettings = Field(default_factory=TeacherSettings)
    """On-policy distillation: the teacher server that scores each sample (``[rollout.teacher]``)."""
    sessions: SessionSettings = Field(default_factory=SessionSettings)
    """Agentic rollouts: the TITO session server agents talk to (``[rollout.sessions]``)."""

    @property
    def function_name(self) -> str | None:
        """The rollout function ``function`` selects, by name, whether given bare or as a table (``None``: the
        default single-turn generate)."""
        function = self.function
        return function.name if isinstance(function, PluginSpec) else function


class TrainSettings(_Section):
    """Training."""

    backend: PluginSpec = Field(default_factory=lambda: PluginSpec(name="fsdp"))
    """Trainer backend: ``fsdp`` or ``megatron``; other keys are the backend's settings."""
    adapter: PluginSpec | None = None
    """Train adapters instead of the full weights (``name = "lora"`` with miles-lora; other keys are the
    adapter's settings). Only adapter parameters are trained and pushed to the engines."""
    model_path: str | None = None
    """Initial policy: a Hugging Face model directory (safetensors) or a ``.gguf`` file."""
    num_rollouts: int = Field(1, ge=1)
    """How many rollouts (and their training steps) the run makes."""
    global_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step (default: all samples of a rollout, i.e. one step per rollout)."""
    max_tokens_per_micro_batch: int = Field(4096, ge=1)
    """Token budget of one micro-batch (dynamic batch size)."""
    lr: float = Field(1e-6, gt=0.0)
    """Peak learning rate (AdamW)."""
    min_lr: float = Field(0.0, ge=0.0)
    """Final learning rate of the cosine decay (equal to ``lr``: constant after warm-up)."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warm-up."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_eps: float = Field(1e-8, gt=0.0)
    """AdamW epsilon."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Gradient-norm clip (0: off)."""
    seed: int = 1234
    """Seed of model init (when built from a config), dropout and sampling in the driver."""
    eval_interval: int | None = Field(None, ge=1)
    """Evaluate on ``data.eval_path`` every this many steps (and after the last one)."""
    eval_pass_k: list[int] = Field(default_factory=lambda: [1])
    """pass@k values reported by evaluation; each eval prompt is sampled ``max(eval_pass_k)`` times."""

    routing_replay: bool = False
    """MoE rollout routing replay (R3): the trainer's routers use the experts the engine routed each token to
    (recorded per token at rollout), the gate weights staying differentiable, so training and rollout run
    the same experts. Routed experts are recorded for every MoE run (the ``fidelity/routing_agreement``
    metric, replay on or off); this switch makes the trainer replay them."""
    true_on_policy: bool = False
    """Compute the trainer's logprobs exactly as the engine computed them (bit for bit: the same matmuls,
    kernels, attention over each request's own positions, and rounding), so every policy token's trainer
    logprob equals its rollout logprob. Needs the local engine with ``enable_deterministic_inference`` on the
    CPU kernels; combinations that cannot be exact are refused with the setting named."""

    steps_per_rollout: int = Field(1, ge=1, exclude=True)
    """Derived: optimizer steps per rollout (``rollout_batch_size x n_samples / global_batch_size``)."""


class RewardSettings(_Section):
    """Scoring."""

    functions: list[RewardFunctionSpec] = Field(default_factory=list)
    """Reward functions and weights; the sample's reward is the weighted sum, parts are logged."""
    timeout: float = Field(30.0, gt=0.0)
    """Seconds a reward function may take for one sample before the sample is marked failed."""
    max_concurrency: int = Field(64, ge=1)
    """Samples scored at once."""


class LogSettings(_Section):
    """Metrics and logs."""

    run_dir: str = "runs/miles"
    """Output directory of the run (metrics, samples, checkpoints, plots)."""
    loggers: list[PluginSpec] = Field(default_factory=lambda: [PluginSpec(name="jsonl")])
    """Metrics loggers: ``jsonl``, ``tensorboard``, ``wandb`` ..."""
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level."""
    logprob_diff_warn: float = Field(0.05, ge=0.0)
    """Warn when the mean |train - rollout| logprob difference exceeds this."""
    signals: SignalSettings = Field(default_factory=SignalSettings)
    """Per-step checks that the run's signals are alive (``[log.signals]``): a uniform or constant teacher
    or reference, a constant or unrelated reward, a push that left the engines' policy unchanged, a zero
    gradient with non-zero advantages."""
    trainer_logprobs: Literal["when_computed", "always", "never"] = "when_computed"
    """Keep the trainer's per-token logprobs (before the step's update) next to each step's samples
    (``samples/trainer_logprobs_<step>.jsonl``, shown token by token by ``miles view``): ``when_computed``
    whenever the algorithm computes them anyway (several optimizer steps per rollout, async modes);
    ``always`` computes them in every step (one more forward when one on-policy step per rollout would skip
    it); ``never``."""


class CheckpointSettings(_Section):
    """Saving and resuming."""

    save_interval: int | None = Field(None, ge=1)
    """Save every this many training steps (``None``: only at the end when ``save_final``)."""
    save_final: bool = True
    """Save a checkpoint when the run ends."""
    dir: str | None = None
    """Checkpoint directory (default: ``<run_dir>/checkpoints``)."""
    keep_last: int | None = Field(None, ge=1)
    """Keep the newest this many complete checkpoints: older ones are removed after each save (``None``:
    keep every one; a checkpoint of a 135M-parameter model with its optimizer is about 1.6 GB)."""
    export_hf: bool = True
    """Export a Hugging Face safetensors directory (``<run_dir>/hf``) at the end of the run (the size of the
    model's weights: 0.5 GB for SmolLM2-135M in float32)."""


class MilesSettings(BaseSettings):
    """The whole configuration of a run."""

    model_config = SettingsConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        env_prefix="MILES_",
        env_nested_delimiter="__",
        validate_assignment=True,
    )

    cluster: ClusterSettings = Field(default_factory=ClusterSettings)
    """Where processes run."""
    data: DataSettings = Field(default_factory=DataSettings)
    """Where prompts come from."""
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    """Generation."""
    train: TrainSettings = Field(default_factory=TrainSettings)
    """Training."""
    algorithm: AlgorithmSpec = Field(default_factory=lambda: AlgorithmSpec(name="grpo"))
    """The RL objective: ``grpo``, ``gspo``, ``ppo``, ``reinforce_pp``, ``sft`` ..."""
    reward: RewardSettings = Field(default_factory=RewardSettings)
    """Scoring."""
    transport: TransportSpec = Field(default_factory=lambda: TransportSpec(name="auto"))
    """How weights reach the engines: ``auto`` (the default: chosen for the run), ``disk``, ``broadcast``,
    ``p2p`` ... ``auto`` takes ``p2p`` over shared memory written into the engines' weights when every engine is a
    local engine on the trainer's host on a CPU and miles-p2p is installed; ``broadcast`` otherwise; ``disk``
    where that is refused. The choice is printed with its reason at start."""
    precision: PluginSpec = Field(default_factory=lambda: PluginSpec(name="auto"))
    """Precision recipe: ``auto`` (the default: chosen from the machine), ``fp32``, ``bf16`` ... ``auto`` takes
    ``bf16`` on CUDA and on a CPU with bfloat16 units (``avx512_bf16`` / ``amx_bf16``) whose bfloat16 GEMMs,
    measured at start, run at least 1.25x float32's; ``fp32`` elsewhere (with the engines serving bfloat16 where
    the CPU has the units), and with ``train.true_on_policy`` or ``rollout.engine_dtype = "float32"``. The choice
    is printed with its reason at start."""
    log: LogSettings = Field(default_factory=LogSettings)
    """Metrics and logs."""
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    """Saving and resuming."""

    _sources: Any = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _component_defaults(cls, data: Any) -> Any:
        return _default_component_names(cls, data)

    @model_validator(mode="after")
    def _derive(self) -> MilesSettings:
        """Compute and check derived values (the batch invariant) before anything starts."""
        rollout, train = self.rollout, self.train
        samples = rollout.rollout_batch_size * rollout.n_samples_per_prompt
        gbs = train.global_batch_size if train.global_batch_size is not None else samples
        if samples % gbs:
            raise ValueError(
                f"train.global_batch_size: {gbs} must divide rollout.rollout_batch_size x "
                f"rollout.n_samples_per_prompt = {rollout.rollout_batch_size} x {rollout.n_samples_per_prompt} "
                f"= {samples} (rollout_batch_size x n_samples_per_prompt = global_batch_size x steps_per_rollout)"
            )
        if rollout.mode == "one_step_off" and rollout.max_staleness < 1:
            raise ValueError("rollout.max_staleness: one_step_off trains on batches one version old; set it >= 1")
        if rollout.mode == "fully_async" and rollout.buffer_groups < rollout.rollout_batch_size:
            raise ValueError(
                f"rollout.buffer_groups: {rollout.buffer_groups} is smaller than rollout.rollout_batch_size = "
                f"{rollout.rollout_batch_size}; the trainer could never take a batch"
            )
        if self.cluster.colocate and rollout.mode != "sync":
            raise ValueError(
                f"cluster.colocate: engines and trainer cannot share devices in rollout.mode = {rollout.mode!r} (use sync)"
            )
        if rollout.replay_sampling_mask and rollout.top_k <= 0 and rollout.top_p >= 1.0:
            raise ValueError(
                "rollout.replay_sampling_mask: nothing is truncated (rollout.top_k = -1, rollout.top_p = 1.0): the "
                "kept set would be the whole vocabulary; set top_k or top_p, or turn replay off"
            )
        if rollout.replay_sampling_mask and train.true_on_policy:
            raise ValueError(
                "rollout.replay_sampling_mask: train.true_on_policy reproduces the engine's untruncated logprobs; "
                "use one of the two"
            )
        if train.eval_interval is not None and self.data.eval_path is None:
            raise ValueError("train.eval_interval: needs data.eval_path (the eval prompt file)")
        if gbs % self.cluster.trainer_ranks:
            raise ValueError(
                f"train.global_batch_size: {gbs} is not divisible by cluster.trainer_ranks = "
                f"{self.cluster.trainer_ranks}"
            )
        train.global_batch_size = gbs
        train.steps_per_rollout = samples // gbs
        return self
