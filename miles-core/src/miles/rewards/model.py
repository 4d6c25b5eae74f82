"""The ``model`` reward: a reward model as a role of the run, of one of three kinds.

- ``classifier``: an ``AutoModelForSequenceClassification`` scores prompt + response; the reward is the scalar
  head's output or the chosen ``label``'s logit or probability;
- ``process``: a process reward model (``AutoModelForTokenClassification``) scores every step of the response
  (split on ``step_separator``, each step followed by ``step_tag``); the reward aggregates the steps (``min``,
  ``mean``, ``last``, ``product``) and the parts log their count, minimum and mean;
- ``judge``: a generative model is asked with ``template`` and its verdict is read from its answer (a number,
  or a label of ``labels``, :mod:`miles.rewards.verdicts`); an answer without a verdict fails the sample with
  the answer quoted.

Unless ``url`` names a running server, ``miles train`` starts one for the run through the launcher, as its own
process (:class:`~miles.rewards.base.RewardServer`): the classifier and process kinds on
:mod:`miles.rewards.model_server`, the judge on a rollout engine (``engine``: the local engine by default, or
SGLang) started like a policy engine but never sent weights. On CUDA each server gets a GPU of its own after
the trainer ranks' and the engines' (``colocate = true``: the first GPU of the run); the ``ray`` launcher puts
each server in a placement group of its own (``cpus``, ``memory_mb``, ``resources``, and its GPU on CUDA).
Samples are sent in batches of up to ``batch_size`` (the scoring of a group arrives together; a partial batch
leaves after ``batch_wait`` seconds), each request bounded by ``request_timeout`` and each sample by
``reward.timeout``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from miles.components import ComponentSettings
from miles.errors import SettingsError
from miles.rewards.base import Reward, RewardOutput, RewardServer
from miles.rewards.text import RegexPattern
from miles.rewards.verdicts import VerdictParser, check_template
from miles.settings.model import PluginSpec
from miles.types import Sample

if TYPE_CHECKING:
    import httpx

    from miles.settings.model import MilesSettings

__all__ = ["DEFAULT_JUDGE_TEMPLATE", "ModelReward", "RewardModelError", "RewardModelSettings"]

log = logging.getLogger(__name__)

DEFAULT_JUDGE_TEMPLATE = (
    "You are grading a response to a question.\n\nQuestion:\n{prompt}\n\nResponse:\n{response}\n\n"
    "Rate the response from 0 (wrong or useless) to 10 (correct and helpful). Answer with the number only."
)
"""The judge's default question (with ``score_range = [0, 10]`` and ``normalize = true``)."""

_JUDGE_ONLY = (
    *("engine", "template", "system_prompt", "chat_template", "max_new_tokens", "temperature", "labels"),
    *("pattern", "score_range", "normalize"),
)
_SCORED_ONLY = ("label", "transform", "input_format")
_PROCESS_ONLY = ("step_separator", "step_tag", "aggregate")


class RewardModelError(RuntimeError):
    """The reward model's server failed or answered something unusable."""


class RewardModelSettings(ComponentSettings):
    """Settings of the ``model`` reward (``[[reward.functions]] name = "model"``)."""

    kind: Literal["classifier", "process", "judge"]
    """``classifier`` (sequence classification), ``process`` (a score per step) or ``judge`` (a generative
    model's verdict)."""
    model_path: str
    """The reward model: a Hugging Face directory (``config.json``, safetensors, tokenizer)."""
    url: str | None = None
    """A server already running for it (``http://host:port``); unset: the run starts one through its launcher."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the started server runs (``auto``: ``cluster.device``)."""
    colocate: bool = False
    """On CUDA: share the run's first GPU instead of taking a GPU of its own (after the trainer ranks' and the
    engines'); the ``local`` launcher only."""
    cpus: float = Field(1.0, gt=0.0)
    """CPUs of the started server's Ray bundle (``ray`` launcher)."""
    memory_mb: int | None = Field(None, ge=1)
    """MiB of memory its Ray bundle reserves (``ray`` launcher); unset: none reserved."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources of its bundle (``ray`` launcher): ``{reward_node = 1}`` puts it on a node offering
    them."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype the server loads the model in (``auto``: the model's own)."""
    batch_size: int = Field(16, ge=1)
    """Samples in one request to the server."""
    batch_wait: float = Field(0.005, ge=0.0)
    """Seconds a partial batch waits for more samples before it is sent."""
    request_timeout: float = Field(120.0, gt=0.0)
    """Seconds one request may take (each sample is also bounded by ``reward.timeout``)."""
    startup_timeout: float = Field(300.0, gt=0.0)
    """Seconds the started server may take to answer ``/health``."""
    restarts: int = Field(1, ge=0)
    """Times the started server is started again (same address) when it exits while the run goes on."""
    max_length: int | None = Field(None, ge=1)
    """Classifier: tokens kept of each input (its end); judge and process: a longer input fails its sample
    (default: the model's ``max_position_embeddings``, less ``max_new_tokens`` for a judge)."""

    # classifier / process
    label: int | str | None = None
    """Classifier / process: the label whose score is the reward (its index or its name in the model's
    ``id2label``); unset: the model's single output (``num_labels = 1``)."""
    transform: Literal["logit", "probability"] = "logit"
    """Classifier / process: the raw output, or a probability (softmax over the labels; a sigmoid of a single
    output)."""
    input_format: Literal["auto", "chat", "text"] = "auto"
    """Classifier / process: how prompt and response are shown to the model: its tokenizer's chat template (the
    prompt's messages, then the response as the assistant's), or the prompt text followed by the response
    (``auto``: the chat template when the tokenizer has one)."""

    # process
    step_separator: str = "\n\n"
    """Process: what separates the steps of a response."""
    step_tag: str | None = None
    """Process: the text put after each step, at whose last token the step is scored (default: the separator)."""
    aggregate: Literal["min", "mean", "last", "product"] = "min"
    """Process: how the step scores make the reward."""

    # judge
    engine: PluginSpec = Field(default_factory=lambda: PluginSpec(name="local"))
    """Judge: the rollout engine that serves it (``local`` or ``sglang``; its other keys are that engine's
    settings)."""
    template: str = DEFAULT_JUDGE_TEMPLATE
    """Judge: the question, a format string naming ``{response}`` and optionally ``{prompt}`` and ``{label}``."""
    system_prompt: str | None = None
    """Judge: a system message before the question (with ``chat_template``)."""
    chat_template: bool = True
    """Judge: ask through the judge tokenizer's chat template (when it has one); ``false``: the plain template."""
    max_new_tokens: int = Field(16, ge=1)
    """Judge: tokens its answer may take."""
    temperature: float = Field(0.0, ge=0.0)
    """Judge: sampling temperature (0: greedy)."""
    labels: dict[str, float] | None = None
    """Judge: the verdict is a word, scored by this table (``{yes = 1.0, no = 0.0}``); unset: a number."""
    pattern: RegexPattern | None = None
    """Judge: a regular expression whose first group (or whole match) holds the verdict (``Score: (\\d+)``)."""
    score_range: tuple[float, float] | None = (0.0, 10.0)
    """Judge: the numbers a verdict may be (a verdict outside fails the sample); ``None``: any number."""
    normalize: bool = True
    """Judge: map ``score_range`` onto ``[0, 1]``."""

    @field_validator("template")
    @classmethod
    def _template(cls, value: str) -> str:
        return check_template(value)

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and (not value or any(not k.strip() for k in value)):
            raise ValueError("needs at least one non-empty label")
        return value

    @field_validator("score_range")
    @classmethod
    def _range(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not value[0] < value[1]:
            raise ValueError(f"[{value[0]:g}, {value[1]:g}] is empty: the low end must be below the high end")
        return value

    @field_validator("step_separator")
    @classmethod
    def _separator(cls, value: str) -> str:
        if not value:
            raise ValueError("must not be empty")
        return value

    @model_validator(mode="after")
    def _fits_kind(self) -> RewardModelSettings:
        wrong = {"judge": _SCORED_ONLY + _PROCESS_ONLY, "classifier": _JUDGE_ONLY + _PROCESS_ONLY}
        wrong["process"] = _JUDGE_ONLY
        for name in wrong[self.kind]:
            if name in self.model_fields_set:
                raise ValueError(f"{name}: not a setting of kind = {self.kind!r}")
        if self.kind != "judge" and self.url is None:
            self._check_labels()
        elif self.url is None and not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(f"model_path: {self.model_path} is not a Hugging Face model directory (no config.json)")
        return self

    def _check_labels(self) -> None:
        config_file = Path(self.model_path) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model_path: {self.model_path} is not a Hugging Face model directory (no config.json)")
        config = json.loads(config_file.read_text())
        id2label = config.get("id2label") or {}
        count = int(config.get("num_labels", len(id2label) or 2))
        names = [str(id2label.get(str(i), f"LABEL_{i}")) for i in range(count)]
        if self.label is None and count != 1:
            raise ValueError(
                f"label: the model has {count} labels ({', '.join(names)}): name the one whose score is the reward"
            )
        if isinstance(self.label, int) and not 0 <= self.label < count:
            raise ValueError(f"label: {self.label} is not a label index of the model (0 .. {count - 1})")
        if isinstance(self.label, str) and self.label not in names:
            raise ValueError(f"label: {self.label!r} is not one of the model's labels ({', '.join(names)})")


class _Batcher:
    """Collects concurrent :meth:`submit` calls into batches for ``send`` (one result or exception per item)."""

    def __init__(self, send: Callable[[list[Sample]], Awaitable[list[Any]]], *, size: int, wait: float) -> None:
        self.send, self.size, self.wait = send, size, wait
        self._pending: list[tuple[Sample, asyncio.Future[Any]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, sample: Sample) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((sample, future))
        if len(self._pending) >= self.size:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.wait, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[Sample, asyncio.Future[Any]]]) -> None:
        live = [(s, f) for s, f in batch if not f.done()]  # (a sample past reward.timeout was cancelled)
        if not live:
            return
        try:
            results = await self.send([s for s, _ in live])
        except Exception as exc:
            for _, future in live:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), result in zip(live, results, strict=True):
            if future.done():
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def close(self) -> None:
        self._flush()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _aggregate(steps: Sequence[float], how: str) -> float:
    if how == "min":
        return min(steps)
    if how == "mean":
        return sum(steps) / len(steps)
    if how == "last":
        return steps[-1]
    return math.prod(steps)


def _judge_prompt_limit(settings: RewardModelSettings) -> int | None:
    """The judge's context (``max_position_embeddings`` of its ``config.json``) less ``max_new_tokens``."""
    try:
        config = json.loads((Path(settings.model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    positions = config.get("max_position_embeddings") or (config.get("text_config") or {}).get(
        "max_position_embeddings"
    )
    return int(positions) - settings.max_new_tokens if isinstance(positions, int) else None


class ModelReward(Reward[RewardModelSettings]):
    """A reward model (classifier, process reward model or generative judge) served for the run."""

    name = "model"

    def __init__(self, settings: RewardModelSettings) -> None:
        super().__init__(settings)
        self._client: httpx.AsyncClient | None = None
        self._batcher: _Batcher | None = None
        self._tokenizer: Any = None
        self._tokenizer_lock: asyncio.Lock | None = None
        self._prompt_limit: int | None = None
        """The judge's longest prompt: ``max_length``, or its context less ``max_new_tokens``."""
        self.parser = VerdictParser(settings.labels, settings.pattern, settings.score_range, settings.normalize)

    @classmethod
    def check_settings(cls, options: RewardModelSettings, settings: MilesSettings) -> None:
        """Before anything starts: a server the run would start on a GPU needs a launcher that gives it one of its
        own: ``local`` (the next GPU of this host, or the first with ``colocate``) or ``ray`` (a GPU in its own
        bundle, so not the first GPU of the run: no ``colocate``)."""
        if options.url is not None:
            return
        device = settings.cluster.device if options.device == "auto" else options.device
        launcher = settings.cluster.launcher.name
        if device != "cuda" or launcher == "local":
            return
        if launcher != "ray":
            raise SettingsError(
                f"reward.functions: the {options.kind} reward model {options.model_path!r} would start on a GPU "
                f"(device = {options.device!r}, cluster.device = {settings.cluster.device!r}), which the "
                f'{launcher!r} launcher does not reserve for it: set its device = "cpu", or url to a server you '
                "start on a GPU node"
            )
        if options.colocate:
            raise SettingsError(
                f"reward.functions: colocate: the {options.kind} reward model {options.model_path!r} would share "
                "the run's first GPU, which the 'ray' launcher does not give (it places each reward server in a "
                "bundle with a GPU of its own): drop colocate"
            )

    def server(self) -> RewardServer | None:
        s = self.settings
        if s.url is not None:
            return None
        common: dict[str, Any] = dict(
            model_path=s.model_path,
            device=s.device,
            colocate=s.colocate,
            cpus=s.cpus,
            memory=None if s.memory_mb is None else s.memory_mb * 2**20,
            resources=dict(s.resources),
            dtype=s.dtype,
            startup_timeout=s.startup_timeout,
            restarts=s.restarts,
        )
        if s.kind == "judge":
            return RewardServer(engine={"name": s.engine.name, **s.engine.options}, **common)
        args = ["--kind", s.kind, "--transform", s.transform, "--input-format", s.input_format]
        args += ["--batch-size", str(s.batch_size)]
        if s.label is not None:
            args += ["--label", str(s.label)]
        if s.max_length is not None:
            args += ["--max-length", str(s.max_length)]
        return RewardServer(module="miles.rewards.model_server", args=tuple(args), **common)

    # -- scoring ---------------------------------------------------------------------------------
    async def score(self, sample: Sample) -> float | RewardOutput:
        if self._batcher is None:
            s = self.settings
            send = self._judge if s.kind == "judge" else self._classify
            self._batcher = _Batcher(send, size=s.batch_size, wait=s.batch_wait)
        result: float | RewardOutput = await self._batcher.submit(sample)
        return result

    def _url(self) -> str:
        if self.settings.url is None:
            raise RewardModelError(
                "the reward model has no server: url is unset and the run did not start one (run it through "
                "miles train / generate / eval, or set url)"
            )
        return self.settings.url.rstrip("/")

    def _http(self) -> httpx.AsyncClient:
        import httpx

        from miles.auth import ServiceKeys

        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.settings.request_timeout),
                headers=ServiceKeys.from_env().headers(),
                trust_env=False,
            )
        return self._client

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        import httpx

        url = self._url() + path
        for attempt in range(3):
            try:
                response = await self._http().post(url, json=body)
                break
            except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
                if attempt == 2:
                    raise RewardModelError(f"{url}: {type(exc).__name__}: {exc}") from None
                await asyncio.sleep(0.5 * 2**attempt)
            except httpx.TimeoutException:
                raise RewardModelError(f"{url} did not answer within {self.settings.request_timeout:g} s") from None
        if response.status_code != 200:
            raise RewardModelError(f"{url} answered HTTP {response.status_code}: {response.text[:300]}")
        try:
            return response.json()
        except ValueError:
            raise RewardModelError(f"{url} answered a body that is not JSON: {response.text[:200]!r}") from None

    async def _classify(self, samples: list[Sample]) -> list[Any]:
        s = self.settings
        items: list[dict[str, Any]] = []
        for sample in samples:
            item: dict[str, Any] = {"prompt": sample.prompt, "messages": sample.prompt_messages}
            if s.kind == "process":
                steps = [p for p in sample.response.split(s.step_separator) if p.strip()] or [sample.response]
                item.update(steps=steps, step_tag=s.step_separator if s.step_tag is None else s.step_tag)
            else:
                item["response"] = sample.response
            items.append(item)
        answer = await self._post("/score", {"items": items})
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or len(results) != len(samples):
            raise RewardModelError(f"{self._url()}/score: expected {len(samples)} results, got {str(answer)[:200]}")
        out: list[Any] = []
        for result in results:
            if isinstance(result, dict) and "error" in result:
                out.append(RewardModelError(str(result["error"])))
            elif s.kind == "process":
                scores = [float(v) for v in result]
                parts = {"steps": float(len(scores)), "step_min": min(scores), "step_mean": sum(scores) / len(scores)}
                out.append(RewardOutput(_aggregate(scores, s.aggregate), parts))
            else:
                out.append(float(result))
        return out

    # -- the judge ---------------------------------------------------------------------------------
    async def _judge_tokenizer(self) -> Any:
        if self._tokenizer_lock is None:
            self._tokenizer_lock = asyncio.Lock()
        async with self._tokenizer_lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.settings.model_path)
                self._prompt_limit = self.settings.max_length or _judge_prompt_limit(self.settings)
        return self._tokenizer

    def judge_prompt(self, sample: Sample, tokenizer: Any) -> list[int]:
        """The token ids the judge is asked with for ``sample``."""
        s = self.settings
        label = "" if sample.label is None else sample.label
        text = s.template.format(prompt=sample.prompt, response=sample.response, label=label)
        if s.chat_template and getattr(tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": s.system_prompt}] if s.system_prompt else []
            messages.append({"role": "user", "content": text})
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        return [int(i) for i in ids]

    async def _judge(self, samples: list[Sample]) -> list[Any]:
        s = self.settings
        tokenizer = await self._judge_tokenizer()
        prompts: list[list[int]] = []
        out: list[Any] = []
        for sample in samples:
            ids = self.judge_prompt(sample, tokenizer)
            if not ids:
                out.append(RewardModelError("the judge's prompt is empty (template and response gave no tokens)"))
            elif self._prompt_limit is not None and len(ids) > self._prompt_limit:
                out.append(RewardModelError(f"the judge's prompt has {len(ids)} tokens, over {self._prompt_limit}"))
            else:
                prompts.append(ids)
                out.append(None)
        if prompts:
            body = {
                "input_ids": prompts,
                "sampling_params": {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature},
            }
            answer = await self._post("/generate", body)
            answers = answer if isinstance(answer, list) else [answer]
            if len(answers) != len(prompts):
                raise RewardModelError(f"{self._url()}/generate: {len(answers)} answers for {len(prompts)} prompts")
            verdicts = iter(answers)
            for i, sample in enumerate(samples):
                if out[i] is None:
                    text = str(next(verdicts).get("text", ""))
                    sample.metadata["judge_verdict"] = text
                    try:
                        out[i] = self.parser.parse(text)
                    except ValueError as exc:
                        out[i] = exc
        return out

    async def close(self) -> None:
        if self._batcher is not None:
            await self._batcher.close()
            self._batcher = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None
