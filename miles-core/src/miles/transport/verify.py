"""Weight-sync verification: what the engines serve must equal what the trainer sent, tensor by tensor.

Checksums are XXH3-128 (the ``xxhash`` library) over a tensor's bytes in the dtype the engine serves, so a
push verifies exactly (not approximately). XXH3 is a non-cryptographic hash: it finds any transport error,
dropped slice or stale tensor (a 128-bit digest), at 15-20 GB/s per core where SHA-256 ran at 1.2 GB/s and,
on both sides of every push, cost more than the push itself; verification guards against faults, not against
an adversary who can already write the engines' weights. After every push the engines report their weight version and a checksum per tensor
(``/weights_checksum``, a Miles endpoint of the local engine); a tensor the engine serves but the trainer
never sent, a missing tensor or a differing checksum stops the run with the tensor's name.

Engines without a checksum route (SGLang) are verified by sampling (:func:`verify_sampled`): while the
push streams by, :class:`WeightSampler` keeps the first rows of every tensor in the engines' dtype; the
engines answer SGLang's ``/get_weights_by_name`` with the first rows of what they serve, and the two must
be equal bit for bit. That proves every tensor the trainer sent arrived under its name, with its shape
and dtype, in the version reported; it does not see the rest of a tensor's rows, nor parameters the
engine serves but the trainer never sent (SGLang cannot list them).

SGLang answers ``/get_weights_by_name`` only for models whose class has the method (Llama-like ones; not
Qwen2, Qwen3 or Qwen3-MoE), and it answers with the parameter as it holds it: on a CPU with AMX its linear
layers are repacked for its kernels (VNNI blocks), so the first rows it reports are not the checkpoint's. Rows
are used only where every engine answers, for a tensor of each kind, exactly the checkpoint's first rows
(:func:`reference_rows`, :func:`rows_problem`). Otherwise the engines are verified by what they compute
(:func:`verify_logprobs`): their logprobs of a fixed probe sequence must equal the trainer's within a
tolerance. That needs no support from the model, and proves the engine serves weights that compute what the
trainer's compute; a tensor a push missed shows for sure only when the engines were filled with random
values first (``transport.randomize_engines_first``), since one step's change can be within the tolerance.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from miles.errors import WeightVerificationError

if TYPE_CHECKING:
    import torch

    from miles.rollout.client import EngineClient

BucketT = TypeVar("BucketT", bound=Sequence[tuple[str, Any]])

__all__ = [
    "PROBE_TEXT",
    "WeightSampler",
    "compare_checksums",
    "default_logprob_tolerance",
    "engine_probe_logprobs",
    "reference_rows",
    "rows_problem",
    "tensor_checksum",
    "verify_engines",
    "verify_logprobs",
    "verify_sampled",
]


def tensor_checksum(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """XXH3-128 (hex, 32 chars) of the tensor's bytes after casting to ``dtype`` (default: its own) and of its
    shape."""
    import torch
    import xxhash

    t = tensor.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    t = t.cpu().contiguous()
    digest = xxhash.xxh3_128(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")  # no copy
    digest.update(str(tuple(t.shape)).encode())
    return digest.hexdigest()


def compare_checksums(
    sent: Mapping[str, str], served: Mapping[str, str], *, engine: str, aliases: Mapping[str, str] | None = None
) -> None:
    """Raise :class:`WeightVerificationError` naming the first tensors that differ.

    :param aliases: ``{alias: canonical}`` names the engine serves through another parameter (tied
        embeddings): a tensor sent under the alias counts for the canonical parameter.
    """
    aliases = aliases or {}
    resolved: dict[str, str] = {}
    for name, checksum in sent.items():
        target = aliases.get(name, name)
        if target in resolved and resolved[target] != checksum and name in aliases:
            continue  # both names of a tied pair sent; the canonical one decides
        resolved[target] = checksum
    sent = resolved
    never_sent = sorted(set(served) - set(sent))
    if never_sent:
        raise WeightVerificationError(
            f"engine {engine}: {len(never_sent)} tensor(s) were not updated by the push, e.g. {never_sent[0]!r}"
            + (f" (and {', '.join(repr(n) for n in never_sent[1:4])})" if len(never_sent) > 1 else "")
        )
    unknown = sorted(set(sent) - set(served))
    if unknown:
        raise WeightVerificationError(f"engine {engine} does not serve tensor {unknown[0]!r} that the trainer sent")
    differ = sorted(name for name in sent if sent[name] != served[name])
    if differ:
        raise WeightVerificationError(
            f"engine {engine}: tensor {differ[0]!r} differs from what the trainer sent"
            + (f" ({len(differ)} tensors differ)" if len(differ) > 1 else "")
        )


async def verify_engines(
    client: EngineClient, *, version: str, checksums_by_dtype: Mapping[str, Mapping[str, str]]
) -> dict[str, float]:
    """Ask every engine for its weight version and checksums and compare with what was sent.

    :param checksums_by_dtype: the trainer's checksums per engine dtype name (``"float32"`` ...).
    :returns: metrics (``weight_sync/verified_tensors``).
    """
    verified = 0
    for url in client.urls:
        report = await client.call(url, "/weights_checksum", {})
        served_version = str(report.get("weight_version"))
        if served_version != version:
            raise WeightVerificationError(
                f"engine {url} serves weight version {served_version!r}, expected {version!r}"
            )
        dtype = str(report["dtype"])
        if dtype not in checksums_by_dtype:
            raise WeightVerificationError(f"engine {url} serves dtype {dtype}; no trainer checksums for it")
        compare_checksums(checksums_by_dtype[dtype], report["checksums"], engine=url, aliases=report.get("aliases"))
        verified += len(report["checksums"])
    return {"weight_sync/verified_tensors": float(verified), "weight_sync/verified": 1.0}


class WeightSampler:
    """Keeps the first ``rows`` rows of every tensor of a push, as the engines serve them (cast to the
    engines' dtype, then to float32: what ``/get_weights_by_name`` answers)."""

    def __init__(self, engine_dtype: str, *, rows: int = 4) -> None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.engine_dtype = engine_dtype
        self.rows = rows
        self.samples: dict[str, torch.Tensor] = {}
        """``{name: first rows}`` of the last push observed."""

    def observe(self, buckets: Iterable[BucketT]) -> Iterator[BucketT]:
        """Yield ``buckets`` unchanged, sampling each tensor on the way (a new push starts a new record)."""
        import torch

        dtype = getattr(torch, self.engine_dtype)
        self.samples = {}
        for bucket in buckets:
            for name, tensor in bucket:
                head = tensor.detach()[: self.rows] if tensor.dim() else tensor.detach().reshape(1)
                self.samples[name] = head.to(dtype).to(device="cpu", dtype=torch.float32).clone()
            yield bucket


async def verify_sampled(
    client: EngineClient, *, version: str, samples: Mapping[str, torch.Tensor]
) -> dict[str, float]:
    """Check every engine reports ``version`` (``/model_info``) and serves the sampled rows of every
    tensor (``/get_weights_by_name``) exactly.

    :returns: metrics (``weight_sync/verified_tensors``, ``weight_sync/verified``).
    """
    import asyncio

    import torch

    from miles.errors import EngineError

    infos = await client.model_info()
    for url, info in zip(client.urls, infos, strict=True):
        served_version = str(info.get("weight_version"))
        if served_version != version:
            raise WeightVerificationError(
                f"engine {url} serves weight version {served_version!r}, expected {version!r}"
            )

    limit = asyncio.Semaphore(16)  # requests in flight per engine

    async def check(url: str, name: str, expected: torch.Tensor) -> None:
        rows = expected.shape[0] if expected.dim() else 1
        try:
            async with limit:
                answer = await client.call(url, "/get_weights_by_name", {"name": name, "truncate_size": rows})
        except EngineError as exc:
            raise WeightVerificationError(f"engine {url} cannot report tensor {name!r}: {exc}") from None
        served = torch.tensor(answer.get("result", answer) if isinstance(answer, dict) else answer)
        if served.shape != expected.shape:
            raise WeightVerificationError(
                f"engine {url}: tensor {name!r} has leading rows of shape {tuple(served.shape)}, "
                f"the trainer sent {tuple(expected.shape)}"
            )
        if not torch.equal(served.to(torch.float32), expected):
            worst = float((served.to(torch.float32) - expected).abs().max())
            raise WeightVerificationError(
                f"engine {url}: tensor {name!r} differs from what the trainer sent (max |diff| {worst:.3g} "
                f"in its first {rows} rows)"
            )

    for url in client.urls:
        await asyncio.gather(*(check(url, name, t) for name, t in samples.items()))
    return {
        "weight_sync/verified_tensors": float(len(samples) * len(client.urls)),
        "weight_sync/verified": 1.0,
    }


PROBE_TEXT = "Weights check: the quick brown fox jumps over the lazy dog; 1 2 3 4 5 6 7 8 9 10."
"""The probe of ``logprobs`` verification, tokenized by the policy's tokenizer (the same in every run)."""


def default_logprob_tolerance(engine_dtype: str) -> float:
    """The largest mean |engine - trainer| logprob of the probe a push passes with (``logprobs``
    verification): kernels differ between engine and trainer by about 1e-3 in float32, 1e-2 in bfloat16, while
    a tensor left random or stale by a push moves the logprobs by whole units."""
    return 0.02 if engine_dtype == "float32" else 0.1


def reference_rows(model_path: str | None, engine_dtype: str, *, rows: int = 2) -> dict[str, torch.Tensor]:
    """The first ``rows`` rows, as engines serving the checkpoint at ``model_path`` report them (cast to
    ``engine_dtype``, then to float32), of the tensors that show how an engine lays its parameters out: every
    tensor outside the decoder layers and every tensor of the first one. Empty when ``model_path`` is not a
    folder of safetensors files (a GGUF file, a package: the engines were launched from a converted copy)."""
    import re
    from pathlib import Path

    import torch
    from safetensors import safe_open

    if model_path is None or not Path(model_path).is_dir():
        return {}
    dtype = getattr(torch, engine_dtype)
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in sorted(f.keys()):
                layer = re.search(r"\.layers\.(\d+)\.", name)
                if layer is not None and layer.group(1) != "0":
                    continue
                tensor = f.get_slice(name)
                shape = tensor.get_shape()
                head = tensor[: min(rows, shape[0])] if shape else f.get_tensor(name).reshape(1)
                out[name] = head.to(dtype).to(torch.float32)
    return out


async def rows_problem(client: EngineClient, reference: Mapping[str, torch.Tensor]) -> str | None:
    """Why sampled rows cannot verify pushes to these engines (``None``: they can): an engine that answers no
    ``/get_weights_by_name`` for one of ``reference``'s tensors (SGLang for Qwen2, Qwen3 and others: their model
    classes have no such method), or answers other values than the checkpoint's (a parameter kept in another
    layout: SGLang on a CPU with AMX repacks its linear layers). Asked before the first push, while the engines
    serve the checkpoint ``reference`` was read from (:func:`reference_rows`)."""
    import torch

    from miles.errors import EngineError

    if not reference:
        return "no safetensors checkpoint to compare the engines' answers with"
    for url in client.urls:
        for name, expected in reference.items():
            rows = expected.shape[0] if expected.dim() else 1
            try:
                answer = await client.call(url, "/get_weights_by_name", {"name": name, "truncate_size": rows})
            except EngineError as exc:
                return f"engine {url} answers no /get_weights_by_name for {name!r} ({exc})"
            served = torch.tensor(answer.get("result", answer) if isinstance(answer, dict) else answer)
            if served.shape != expected.shape or not torch.equal(served.to(torch.float32), expected):
                return (
                    f"engine {url} answers /get_weights_by_name for {name!r} with other values than the checkpoint's "
                    "(it holds the tensor in another layout)"
                )
    return None


async def engine_probe_logprobs(client: EngineClient, url: str, probe: Sequence[int]) -> list[float]:
    """One engine's logprobs of ``probe[1:]`` given the tokens before each (``/generate`` with the prompt's
    logprobs from position 0, temperature 1; ``max_new_tokens = 0``, SGLang's scoring-only request: one
    prefill, no decode step)."""
    payload = {
        "input_ids": list(probe),
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    answer = await client.call(url, "/generate", payload)
    rows = answer["meta_info"]["input_token_logprobs"]
    values = [row[0] for row in rows]
    if len(values) == len(probe) and values[0] is None:  # the first token has none
        values = values[1:]
    if len(values) != len(probe) - 1 or any(v is None for v in values):
        raise WeightVerificationError(
            f"engine {url} answered {len(rows)} prompt logprobs for a {len(probe)}-token probe"
        )
    return [float(v) for v in values]


async def verify_logprobs(
    client: EngineClient,
    *,
    version: str,
    probe: Sequence[int],
    expected: Sequence[float],
    tolerance: float,
) -> dict[str, float]:
    """Check every engine reports ``version`` (``/model_info``) and gives the probe the logprobs the trainer
    gives it (``expected``, of ``probe[1:]``), within ``tolerance`` on average.

    :returns: metrics (``weight_sync/verified``, ``weight_sync/verified_logprob_diff``: the largest mean
        difference over the engines).
    """
    infos = await client.model_info()
    for url, info in zip(client.urls, infos, strict=True):
        served_version = str(info.get("weight_version"))
        if served_version != version:
            raise WeightVerificationError(
                f"engine {url} serves weight version {served_version!r}, expected {version!r}"
            )
    worst = 0.0
    for url in client.urls:
        served = await engine_probe_logprobs(client, url, probe)
        diffs = [abs(a - b) for a, b in zip(served, expected, strict=True)]
        mean = sum(diffs) / len(diffs)
        if mean > tolerance:
            at = max(range(len(diffs)), key=diffs.__getitem__)
            raise WeightVerificationError(
                f"engine {url}: its logprobs of the probe differ from the trainer's by {mean:.3g} on average "
                f"(tolerance {tolerance:g}; largest {diffs[at]:.3g} at token {at + 1}): it does not serve the "
                f"weights of version {version}"
            )
        worst = max(worst, mean)
    return {"weight_sync/verified": 1.0, "weight_sync/verified_logprob_diff": worst}
