"""The session service: per session, the exact token record behind OpenAI's chat API (no HTTP).

:class:`SessionService` owns the sessions, renders each request's new messages as a suffix of the stored
tokens and generates the assistant's reply on the engines; :class:`miles.sessions.server.SessionServer`
serves it over HTTP (the routes are :mod:`miles.sessions.routes`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import TYPE_CHECKING, Any, TypeVar

from miles.errors import EngineError, SettingsError
from miles.rollout.protocol import SamplingParams
from miles.sessions.append_only import IMAGE_PROBES, PROBES, TemplateReport, check_append_only
from miles.sessions.images import SessionVision, read_image_parts
from miles.sessions.messages import template_messages, tools_key
from miles.sessions.parsers import choose_parsers
from miles.sessions.schema import RequestError, completion, parse_chat_request
from miles.sessions.session import AppendOnlyViolation, Session, SessionSampling, Turn
from miles.sessions.templates import ChatRenderer, TemplateRenderError, resolve_template
from miles.settings.sessions import SessionSettings

if TYPE_CHECKING:
    from miles.rollout.client import EngineClient
    from miles.rollout.protocol import GenerateOutput

__all__ = ["SessionService", "TemplateNotAppendOnly"]

log = logging.getLogger(__name__)

_S = TypeVar("_S", bound="SessionService")


class TemplateNotAppendOnly(SettingsError):
    """The chat template failed the CPU render check and no fixed template is configured."""

    def __init__(self, report: TemplateReport) -> None:
        super().__init__(
            f"rollout.sessions.chat_template: {report.summary()}. Sessions need an append-only template: set "
            "rollout.sessions.chat_template to a fixed one (a .jinja file, or 'qwen3' for Qwen3); "
            "see docs/how-to/agents.md"
        )
        self.report = report


def _seed(base: int, turn: int) -> int:
    from miles.rollout.manager import derive_seed

    return derive_seed(base, turn)


class SessionService:
    """Sessions over a set of engines: the token record and the chat turn, without HTTP (served by
    :class:`miles.sessions.server.SessionServer`).

    :param client: the engines (generation goes through :meth:`EngineClient.generate`).
    :param tokenizer: the policy's tokenizer.
    :param context_length: the engines' context length (``settings.context_length`` wins).
    :param vision: a vision-language policy's image processor and placeholder token (user messages may then
        hold image parts, :mod:`miles.sessions.images`); ``None``: a text policy, which refuses them.
    :raises TemplateNotAppendOnly: the chat template fails the CPU render check.
    """

    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        settings: SessionSettings | None = None,
        *,
        context_length: int | None = None,
        vision: SessionVision | None = None,
    ) -> None:
        self.client = client
        self.settings = settings = settings or SessionSettings()
        template, name = resolve_template(settings.chat_template, tokenizer)
        self.renderer = ChatRenderer(
            tokenizer,
            template,
            name=name,
            template_kwargs=settings.chat_template_kwargs,
            end_tokens=settings.end_tokens,
        )
        self.vision = vision
        self.report = check_append_only(self.renderer, PROBES + IMAGE_PROBES if vision is not None else PROBES)
        if not self.report.ok:
            raise TemplateNotAppendOnly(self.report)
        if vision is not None:
            vision.check_template(self.renderer)
        log.info("%s", self.report.summary())
        self.tool_parser, self.reasoning_parser = choose_parsers(
            template, settings.tool_parser, settings.reasoning_parser
        )
        self.context_length = settings.context_length or context_length or 1 << 20
        self.sessions: dict[str, Session] = {}
        self.live_status: dict[str, Any] | None = None
        """The live check's outcome (``ok``, ``summary``) once it ran."""
        self.ready = True
        """Whether sessions are served (``GET /health`` answers 503 until then)."""

    @classmethod
    async def for_engines(cls: type[_S], client: EngineClient, settings: SessionSettings | None = None) -> _S:
        """A server for the engines behind ``client``, with the tokenizer their ``/model_info`` names (and, for
        a vision-language model, its image processor)."""
        from transformers import AutoTokenizer

        from miles.data.vision import is_vision_model

        info = (await client.model_info())[0]
        path = info.get("tokenizer_path") or info.get("model_path")
        if not path:
            raise SettingsError("rollout.sessions: the engine's /model_info names no tokenizer_path")
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, path)
        context = info.get("context_length")
        model = info.get("model_path") or path
        vision = None
        if is_vision_model(model):
            limit = (settings or SessionSettings()).max_image_pixels
            vision = await asyncio.to_thread(SessionVision.for_model, model, max_image_pixels=limit)
        return cls(client, tokenizer, settings, context_length=int(context) if context else None, vision=vision)

    # -- sessions ----------------------------------------------------------------------------------
    def create_session(
        self,
        *,
        sampling: SessionSampling | None = None,
        routing_key: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Session:
        if len(self.sessions) >= self.settings.max_sessions:
            raise RequestError(f"too many open sessions ({len(self.sessions)}); delete finished ones", status=503)
        sid = uuid.uuid4().hex
        session = Session(
            self.renderer,
            session_id=sid,
            sampling=sampling,
            routing_key=routing_key,
            metadata=metadata,
            tool_parser=self.tool_parser,
            reasoning_parser=self.reasoning_parser,
            image_token_id=self.vision.image_token_id if self.vision is not None else None,
        )
        self.sessions[sid] = session
        return session

    def get(self, session_id: str) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise RequestError(
                f"unknown session {session_id!r}", status=404, param="session_id", kind="not_found_error"
            ) from None

    def delete(self, session_id: str) -> None:
        self.get(session_id)
        del self.sessions[session_id]

    # -- one turn ----------------------------------------------------------------------------------
    async def chat(self, session_id: str, body: Any) -> dict[str, Any]:
        """Serve one chat-completions request of a session (raises :class:`RequestError`)."""
        session = self.get(session_id)
        request = parse_chat_request(body)
        raw, images = read_image_parts(request.message_dicts())
        if images and self.vision is None:
            raise RequestError(
                f"{images[0].where}: the policy is not a vision-language model (its config has no vision_config); "
                "image parts need one",
                param=images[0].where,
            )
        messages = template_messages(raw)
        tools = list(body["tools"]) if request.tools else None
        kwargs = request.chat_template_kwargs or {}
        key = tools_key(tools, kwargs)
        async with session.lock:
            parent, new, branch = session.match(messages, key)
            if not new:
                raise RequestError(
                    "messages: nothing after the assistant's last reply; add a user or tool message", param="messages"
                )
            if new[-1]["role"] == "assistant":
                raise RequestError(
                    f"messages[{len(messages) - 1}]: the conversation ends with an assistant message; "
                    "a session generates the assistant's reply",
                    param=f"messages[{len(messages) - 1}]",
                )
            try:
                append, template_ids = session.plan(parent, new, tools=tools, template_kwargs=kwargs)
            except AppendOnlyViolation as exc:
                raise RequestError(
                    str(exc), status=409, param=f"messages[{exc.message_index}]", kind="append_only_violation"
                ) from None
            except TemplateRenderError as exc:
                raise RequestError(f"messages: {exc}", param="messages") from None
            first_new = len(messages) - len(new)
            new_images = [image for image in images if image.message >= first_new]
            if self.vision is not None:  # each placeholder made the image's token count (images checked)
                append = self.vision.expand(append, new_images, first_new=first_new)
            prompt = (parent.sequence() if parent is not None else []) + append
            room = self.context_length - len(prompt)
            if room < 1:
                reason = f"context length {self.context_length} reached ({len(prompt)} tokens)"
                if parent is not None:
                    parent.truncated = reason
                return completion(
                    completion_id=f"chatcmpl-{session.id}-full",
                    model=request.model,
                    message={"role": "assistant", "content": ""},
                    finish_reason="length",
                    prompt_tokens=len(prompt),
                    completion_tokens=0,
                    cached_tokens=0,
                    extra={"session_id": session.id, "turn": None, "branch": branch, "reason": reason},
                )
            session.images.update((image.digest, SessionVision.data_url(image)) for image in new_images)
            turn = session.add_turn(
                parent,
                new,
                key=key,
                prompt_ids=append,
                template_ids=template_ids,
                branch=branch,
                images=[image.digest for image in new_images],
            )
            try:
                output = await self._generate(session, request, prompt, room, turn)
            except BaseException:
                session.discard(turn)
                if branch:
                    session.branches -= 1
                raise
            session.record(turn, output)
        return self._answer(session, request, turn, prompt, output, branch)

    def _params(self, session: Session, request: Any, room: int, index: int) -> SamplingParams:
        s = session.sampling
        temperature = s.temperature if s.override or request.temperature is None else request.temperature
        top_p = s.top_p if s.override or request.top_p is None else request.top_p
        limits = [request.limit or self.settings.max_tokens, room]
        if s.max_tokens is not None:
            limits.append(s.max_tokens)
        seed = _seed(s.seed, index) if s.seed is not None else request.seed
        return SamplingParams(
            max_new_tokens=min(limits),
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=s.top_k,
            stop=list(request.stop_list),
            sampling_seed=seed,
        )

    async def _generate(
        self, session: Session, request: Any, prompt: list[int], room: int, turn: Turn
    ) -> GenerateOutput:
        params = self._params(session, request, room, len(session.turns) - 1)
        images = session.image_data(turn)
        extra: dict[str, Any] = {"image_data": images} if images else {}  # (a plugin's client may not take it)
        if self.vision is not None:  # SGLang's form: one placeholder per image, expanded by the engine
            prompt = self.vision.engine_prompt(prompt, len(images))
        try:
            outputs = await self.client.generate(
                prompt,
                params,
                return_logprob=True,
                return_routed_experts=self.settings.return_routed_experts,
                routing_key=session.routing_key if self.settings.affinity else None,
                **extra,
            )
        except EngineError as exc:
            raise RequestError(f"engine: {exc}", status=502, kind="engine_error") from None
        output = outputs[0]
        if output.finish_reason.type == "abort":
            raise RequestError(
                f"generation aborted by the engine: {output.finish_reason.message or 'abort'}; retry the request",
                status=503,
                kind="engine_error",
            )
        return output

    def _answer(
        self, session: Session, request: Any, turn: Turn, prompt: list[int], output: GenerateOutput, branch: bool
    ) -> dict[str, Any]:
        logprobs = None
        if request.logprobs:
            texts = self.renderer.token_texts(turn.output_ids)
            logprobs = [
                {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                for t, lp in zip(texts, turn.output_logprobs, strict=True)
            ]
        finish = "length" if turn.finish == "length" else ("tool_calls" if turn.reply.get("tool_calls") else "stop")
        return completion(
            completion_id=f"chatcmpl-{session.id}-{turn.id}",
            model=request.model,
            message=turn.reply,
            finish_reason=finish,
            prompt_tokens=len(prompt),
            completion_tokens=len(turn.output_ids),
            cached_tokens=turn.cached_tokens,
            logprobs=logprobs,
            token_ids=(prompt, list(turn.output_ids)) if request.return_token_ids else None,
            extra={
                "session_id": session.id,
                "turn": turn.id,
                "branch": branch,
                "weight_version": output.weight_version,
                "engine": output.meta_info.get("engine_url"),
            },
        )

    def info(self) -> dict[str, Any]:
        """What ``GET /info`` answers: the template, its checks, the parsers, the context length, whether user
        messages may hold images."""
        return {
            "template": self.renderer.name,
            "append_only": {"ok": self.report.ok, "summary": self.report.summary(), "skipped": self.report.skipped},
            "live_check": self.live_status,
            "tool_parser": self.tool_parser,
            "reasoning_parser": self.reasoning_parser,
            "context_length": self.context_length,
            "images": self.vision is not None,
            "sessions": len(self.sessions),
        }
