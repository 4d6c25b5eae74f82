"""The server of classifier and process reward models: ``python -m miles.rewards.model_server``.

``miles train`` starts it for a ``model`` reward of kind ``classifier`` or ``process`` (its flags come from the
reward's settings, :meth:`miles.rewards.model.ModelReward.server`). Routes:

- ``GET /health``: 200 once the model is loaded (the server listens only then);
- ``POST /score`` ``{"items": [...]}``: a classifier item is ``{"prompt", "messages", "response"}``, a process
  item ``{"prompt", "messages", "steps": [...], "step_tag"}``; the answer is ``{"results": [...]}``, one per item:
  a number (classifier), a list of numbers, one per step (process), or ``{"error": "..."}`` for an item that
  cannot be scored (too long). Items are scored in micro-batches of ``--batch-size`` with padding, one forward
  at a time.

With ``MILES_API_KEY`` in its environment every route but ``/health`` needs it (:mod:`miles.auth`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

__all__ = ["ModelScorer", "create_app", "main"]

log = logging.getLogger("miles.rewards.model_server")


class ModelScorer:
    """A sequence- or token-classification model with its tokenizer, scoring formatted prompt/response pairs."""

    def __init__(
        self,
        model_path: str,
        *,
        kind: str,
        device: str = "cpu",
        dtype: str = "auto",
        label: str | None = None,
        transform: str = "logit",
        input_format: str = "auto",
        max_length: int | None = None,
        batch_size: int = 16,
    ) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

        self.kind, self.transform, self.max_length, self.batch_size = kind, transform, max_length, batch_size
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.truncation_side = "left"  # a response's end decides its score
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        auto = AutoModelForSequenceClassification if kind == "classifier" else AutoModelForTokenClassification
        kwargs: dict[str, Any] = {} if dtype == "auto" else {"dtype": getattr(torch, dtype)}
        self.model = auto.from_pretrained(model_path, **kwargs).to(self.device).eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if self.max_length is None:  # (never past the positions the model has)
            self.max_length = getattr(self.model.config, "max_position_embeddings", None)
        self.num_labels = int(self.model.config.num_labels)
        self.label = self._label_index(label)
        self.chat = input_format == "chat" or (input_format == "auto" and bool(self.tokenizer.chat_template))

    def _label_index(self, label: str | None) -> int | None:
        if label is None:
            return None
        if label.lstrip("-").isdigit():
            return int(label)
        return int(self.model.config.label2id[label])

    def format(self, item: dict[str, Any], response: str) -> str:
        """Prompt and ``response`` as the model reads them (its chat template, or the texts one after the other)."""
        if not self.chat:
            return f"{item.get('prompt', '')}{response}"
        messages = list(item.get("messages") or [{"role": "user", "content": item.get("prompt", "")}])
        messages.append({"role": "assistant", "content": response})
        text: str = self.tokenizer.apply_chat_template(messages, tokenize=False)
        return text

    def values(self, logits: Any) -> Any:
        """The reward of each row of ``logits`` (``[..., num_labels]``)."""
        import torch

        if self.label is None:
            raw = logits[..., 0]
            return torch.sigmoid(raw) if self.transform == "probability" else raw
        if self.transform == "probability":
            return torch.softmax(logits.float(), dim=-1)[..., self.label]
        return logits[..., self.label]

    def score(self, items: list[dict[str, Any]]) -> list[Any]:
        """One result per item (see the module's docstring)."""
        results: list[Any] = []
        for start in range(0, len(items), self.batch_size):
            chunk = items[start : start + self.batch_size]
            results.extend(self._classify(chunk) if self.kind == "classifier" else self._process(chunk))
        return results

    def _classify(self, items: list[dict[str, Any]]) -> list[Any]:
        import torch

        texts = [self.format(item, str(item.get("response", ""))) for item in items]
        encoded = self.tokenizer(
            texts,
            padding=True,
            truncation=self.max_length is not None,
            max_length=self.max_length,
            return_tensors="pt",
            add_special_tokens=not self.chat,
        ).to(self.device)
        with torch.inference_mode():
            logits = self.model(**encoded).logits
        return [float(v) for v in self.values(logits.float()).tolist()]

    def _process(self, items: list[dict[str, Any]]) -> list[Any]:
        import torch

        texts: list[str] = []
        ends: list[list[int]] = []  # the character offset where each step (with its tag) ends
        for item in items:
            steps, tag = [str(s) for s in item.get("steps", [])], str(item.get("step_tag", "\n\n"))
            content = "".join(step + tag for step in steps)
            text = self.format(item, content)
            base = text.rfind(content)
            offset, step_ends = base, []
            for step in steps:
                offset += len(step) + len(tag)
                step_ends.append(offset)
            texts.append(text)
            ends.append(step_ends)
        special = not self.chat
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=special)["input_ids"]]
        fits = [i for i, n in enumerate(lengths) if self.max_length is None or n <= self.max_length]
        results: list[Any] = [
            {"error": f"the input has {n} tokens, more than max_length = {self.max_length}"} for n in lengths
        ]
        if not fits:
            return results
        encoded = self.tokenizer(
            [texts[i] for i in fits],
            padding=True,
            return_tensors="pt",
            return_offsets_mapping=True,
            add_special_tokens=special,
        )
        offsets = encoded.pop("offset_mapping").tolist()
        mask = encoded["attention_mask"].tolist()
        positions: list[list[int]] = []
        for row, i in enumerate(fits):
            spans = [(j, s) for j, (s, e) in enumerate(offsets[row]) if e > s and mask[row][j]]
            positions.append([max((j for j, s in spans if s < end), default=0) for end in ends[i]])
        with torch.inference_mode():
            logits = self.model(**encoded.to(self.device)).logits.float()
        values = self.values(logits)
        for row, i in enumerate(fits):
            results[i] = [float(values[row, j]) for j in positions[row]]
        return results


def create_app(scorer: ModelScorer) -> FastAPI:
    """The FastAPI application over ``scorer``."""
    app = FastAPI(title="miles reward model")
    lock = asyncio.Lock()  # one forward at a time

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/score")
    async def score(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "the body is not JSON"}, status_code=400)
        items = body.get("items") if isinstance(body, dict) else None
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            return JSONResponse({"error": "expected {'items': [{...}, ...]}"}, status_code=400)
        key = "steps" if scorer.kind == "process" else "response"
        bad = [i for i, item in enumerate(items) if key not in item]
        if bad:
            return JSONResponse({"error": f"items {bad[:10]} have no {key!r}"}, status_code=400)
        async with lock:
            try:
                results = await asyncio.to_thread(scorer.score, items)
            except Exception as exc:  # (a malformed item, a model error): the caller's samples fail with it
                log.exception("scoring %d items failed", len(items))
                return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=400)
        return {"results": results}

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles.rewards.model_server", description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--kind", choices=("classifier", "process"), required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--label", default=None)
    parser.add_argument("--transform", choices=("logit", "probability"), default="logit")
    parser.add_argument("--input-format", choices=("auto", "chat", "text"), default="auto")
    parser.add_argument("--max-length", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("MILES_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    threads = os.environ.get("MILES_TORCH_THREADS")
    if threads:
        from miles.torch_threads import set_torch_threads

        set_torch_threads(int(threads))
    import uvicorn

    from miles.auth import ServiceKeys, check_bind, install_auth

    keys = ServiceKeys.from_env()
    check_bind(args.host, keys, service="the reward model server", setting="cluster.api_key")
    device = "cuda" if args.device == "cuda" else args.device
    scorer = ModelScorer(
        args.model,
        kind=args.kind,
        device=device,
        dtype=args.dtype,
        label=args.label,
        transform=args.transform,
        input_format=args.input_format,
        max_length=args.max_length,
        batch_size=args.batch_size,
    )
    app = create_app(scorer)
    install_auth(app, keys, error=lambda message: {"error": message})
    log.info("reward model %s (%s) serving on %s:%d", args.model, args.kind, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
