"""Batch-invariant ops: what the deterministic local engine computes with, and what the trainer's true on-policy
forward computes with, so that both get the same numbers bit for bit.

A declared public module of the local engine (see :mod:`miles.engine`): miles-fsdp's ``train.true_on_policy``
runs the trainer's differentiable forward through these functions, the local engine with
``enable_deterministic_inference`` runs its prefill and decode steps through them. Every function here gives a
token's row the same bits whatever else is in the call: how many rows (one decode step of one request, a batch
of requests, a packed training micro-batch of many sequences), where the row sits, whether the token is
computed in a prefill over its sequence or in a decode step over its KV cache. All are differentiable
(autograd through torch ops; the GEMM has its own backward).

What makes each one invariant (measured on torch 2.13's CPU kernels; :func:`invariance_problem` re-checks the
GEMM kinds on the machine it runs on, and the engine and the trainer refuse to start where it fails):

- **GEMM** (:func:`linear`): oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, what the engine and the
  trainer's ``onednn_linear`` run anyway) computes a row the same for every row count of at least 2 and for
  every thread count; a call of fewer than :data:`MIN_ROWS` rows is padded with zero rows. (MKL's sgemm, behind
  ``F.linear``, changes a row's sum order with the row count and, for some shapes, the thread count.)
- **Attention** (:func:`attention`): the keys are cut into fixed chunks of :data:`KEY_CHUNK` positions counted
  from position 0; scores, the exact maximum over all of a query's keys, ``exp``, and per chunk ``P . V`` and the
  sum of ``P``, accumulated over the chunks in order 0, 1, 2 ...; positions after the query (and a cache's unused
  tail) weigh exactly 0, so the chunks past a query's position add exact zeros. A query's output is therefore the
  same in a causal prefill over its whole sequence as in a decode step over its cache. The scores and ``P . V``
  run on the GEMM above, one call per sequence and KV head (and chunk for ``P . V``): a batched ``torch.matmul``
  runs MKL, which on an AMD EPYC summed a query's row in an order that depended on the other rows of the call (a
  decode step's query got other bits than in a prefill). A lone query row (one query of a model without grouped
  heads) is padded (the GEMM sums a lone row in another order).
- **RMSNorm** (:func:`rms_norm`): Hugging Face's formula; the mean of squares reduces each row alone (rows are
  padded as for the GEMM, so a lone long row is never split across threads).
- **SiLU** (:func:`silu`): ``x / (1 + exp(-x))``. ``F.silu`` computes the tail of a tensor that does not fill
  a vector register with a scalar formula that rounds differently, so a token's activation would depend on
  where it lands in the tensor; ``exp``, the negation, the sum and the division round the same both ways.
- **MoE blocks** (:func:`route`, :func:`experts`, :func:`install_moe`; Qwen2-MoE and Qwen3-MoE): the router's
  logits through :func:`linear`, its softmax in float32 (each row reduced alone), the model's top-k, the top-k
  weights renormalised with their sum taken in slot order; each expert computes its tokens with :func:`linear`
  and :func:`silu` (a token's rows do not depend on which other tokens chose the expert), and a token's expert
  outputs are added in slot order (the model's ``index_add_`` adds them in expert order, into a buffer shared
  by every token). Qwen2-MoE's shared expert is a dense MLP on the same ops, its gate a sigmoid written out.
- **Rotary embedding, residual adds, log-softmax over the vocabulary**: the models' own ops already are
  (element-wise products and sums round exactly; ``cos``, ``sin`` and ``exp`` agree between the vector and the
  scalar paths; ``log_softmax`` reduces each row alone).

Changing :data:`KEY_CHUNK` on one side only changes the attention's sum order: the numbers then differ (what
the tests use to show that the equality they check can fail).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "KEY_CHUNK",
    "MIN_QUERIES",
    "MIN_ROWS",
    "MOE_MODEL_TYPES",
    "attention",
    "engine_unsupported",
    "experts",
    "install_moe",
    "invariance_problem",
    "linear",
    "rms_norm",
    "route",
    "sigmoid",
    "silu",
]

MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
"""The MoE models whose expert blocks :func:`install_moe` computes with these ops."""

MIN_ROWS = 2
"""Fewest rows a GEMM or a norm is called with (a lone row is padded with a zero row: oneDNN's GEMM sums a
lone row in another order, and a reduction with one output splits it across threads)."""
MIN_QUERIES = 2
"""Fewest query rows (queries x heads per KV head) per sequence an attention call computes (fewer are padded)."""
KEY_CHUNK = 64
"""Key positions per attention chunk: the unit of the attention's fixed summation order."""


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` (2-D) with zero rows appended up to ``rows``."""
    return torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])]) if x.shape[0] < rows else x


def _forward_gemm(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x2.shape[0]
    return _gemm(_pad_rows(x2, MIN_ROWS), weight, bias)[:rows]


class _InvariantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        w = weight.detach()
        y = _forward_gemm(x2, w, None if bias is None else bias.detach())
        ctx.save_for_backward(x2, w)
        ctx.has_bias = bias is not None
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, w = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1]).contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _gemm(g2, w.t()).reshape(*grad.shape[:-1], w.shape[1])
        if ctx.needs_input_grad[1]:
            grad_w = _gemm(g2.t(), x2.t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with every row's result independent of the other rows (float32 / bfloat16 on
    CPU; the backward's GEMMs are oneDNN's too, without the invariance, which gradients do not need)."""
    if x.numel() == 0:
        return torch.nn.functional.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        out: torch.Tensor = _InvariantLinear.apply(x, weight, bias)
        return out
    x2 = x.reshape(-1, x.shape[-1])
    y = _forward_gemm(x2, weight.detach(), None if bias is None else bias.detach())
    return y.reshape(*x.shape[:-1], y.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm (``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``, statistics in float32),
    each row reduced alone."""
    shape, dtype = x.shape, x.dtype
    x2 = x.reshape(-1, shape[-1])
    rows = x2.shape[0]
    h = _pad_rows(x2, MIN_ROWS).to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return (weight * h.to(dtype))[:rows].reshape(shape)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` as ``x / (1 + exp(-x))``: the same bits wherever ``x`` sits in the tensor."""
    return x / (1 + torch.exp(-x))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))``: the same bits wherever ``x`` sits (as :func:`silu`)."""
    return 1 / (1 + torch.exp(-x))


Select = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
"""How a router picks its experts from the float32 probabilities ``[tokens, experts]``: ``(values, indices)``
``[tokens, k]`` (``torch.topk``'s, or a replay's: the experts the engine chose, their probabilities gathered)."""


def _topk(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, indices = torch.topk(probs, k, dim=-1)
    return values, indices


def _slot_sum(t: torch.Tensor) -> torch.Tensor:
    """``t.sum(1)`` over a ``[tokens, k, ...]`` tensor, added slot by slot in order 0, 1 ... (an element-wise
    sum: a token's result does not depend on the others')."""
    total = t[:, 0]
    for slot in range(1, t.shape[1]):
        total = total + t[:, slot]
    return total


def route(
    hidden: torch.Tensor, weight: torch.Tensor, top_k: int, *, normalise: bool, select: Select | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Qwen-MoE router: ``(logits, top-k weights in the logits' dtype, expert indices)`` for ``hidden``
    ``[tokens, hidden]`` (Hugging Face's ``TopKRouter`` formula; ``select`` picks the experts, default the top-k)."""
    logits = linear(hidden, weight)
    probs = torch.softmax(logits.float(), dim=-1)
    values, indices = (select or _topk)(probs, top_k)
    if normalise:
        values = values / _slot_sum(values[..., None])
    return logits, values.to(logits.dtype), indices


def experts(
    hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The experts' weighted outputs summed per token: ``hidden`` ``[tokens, hidden]``, ``indices`` / ``weights``
    ``[tokens, k]`` (a router's), ``gate_up`` ``[experts, 2 x inter, hidden]`` and ``down`` ``[experts, hidden,
    inter]`` (Hugging Face's fused expert weights). Differentiable in ``hidden``, ``weights`` and the weights."""
    tokens, k = indices.shape
    out = hidden.new_zeros(tokens, k, hidden.shape[-1])
    for e in torch.unique(indices).tolist():  # each expert once, its tokens in one call
        rows, slots = torch.nonzero(indices == e, as_tuple=True)
        g, u = linear(hidden[rows], gate_up[e]).chunk(2, dim=-1)
        y = linear(silu(g) * u, down[e]) * weights[rows, slots, None]
        out = out.index_put((rows, slots), y.to(out.dtype))
    return _slot_sum(out)


def install_moe(block: Any, *, router: bool = True) -> None:
    """Make a Hugging Face Qwen2-MoE / Qwen3-MoE sparse MoE block (``model.layers[i].mlp``) compute with these ops:
    its router (``block.gate``, through :func:`route`; unless not ``router``: the trainer's routing replay
    routes through :func:`route` itself), its experts (:func:`experts`) and Qwen2-MoE's shared expert and its
    gate. The router is still called as a module, so its forward hooks (the engine's record of the routed
    experts) keep firing."""
    gate, fused = block.gate, block.experts

    def gate_forward(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = hidden.reshape(-1, gate.hidden_dim)
        return route(hidden, gate.weight, int(gate.top_k), normalise=bool(gate.norm_topk_prob))

    def experts_forward(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return experts(hidden, indices, weights, fused.gate_up_proj, fused.down_proj)

    fused.forward = experts_forward
    if router:
        gate.forward = gate_forward
    shared = getattr(block, "shared_expert", None)
    if shared is None:
        return
    shared_gate = block.shared_expert_gate

    def block_forward(hidden: torch.Tensor) -> torch.Tensor:
        b, t, h = hidden.shape
        x = hidden.reshape(-1, h)
        own = linear(
            silu(linear(x, shared.gate_proj.weight)) * linear(x, shared.up_proj.weight), shared.down_proj.weight
        )
        _, weights, indices = block.gate(x)
        routed = block.experts(x, indices, weights)
        return (routed + sigmoid(linear(x, shared_gate.weight)) * own).reshape(b, t, h)

    block.forward = block_forward


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float, *, chunk: int | None = None
) -> torch.Tensor:
    """Causal attention of ``B`` independent sequences, each query over the keys at positions ``0..q_pos``.

    :param q: ``[B, heads, n, head_dim]`` queries.
    :param k: ``[B, kv_heads, S, head_dim]`` keys at positions ``0..S-1`` (``S > max(q_pos)``; positions past a
        query's own are never weighed, whatever they hold, as long as it is finite); ``v`` likewise.
    :param q_pos: int64 ``[B, n]``: each query's position.
    :param chunk: key positions per chunk (default :data:`KEY_CHUNK`).
    :returns: ``[B, heads, n, head_dim]``.
    """
    chunk = KEY_CHUNK if chunk is None else chunk
    b, heads, n, dim = q.shape
    kv_heads, span = k.shape[1], k.shape[2]
    group = heads // kv_heads
    rows = max(n, -(-MIN_QUERIES // group))  # the GEMM sums a lone row in another order
    if rows > n:  # padded queries attend position 0 (always a key); their outputs are dropped
        q = torch.cat([q, q.new_zeros(b, heads, rows - n, dim)], dim=2)
        q_pos = torch.cat([q_pos, q_pos.new_zeros(b, rows - n)], dim=1)
    chunks = -(-span // chunk)
    padded = chunks * chunk
    if padded > span:
        pad = (0, 0, 0, padded - span)
        k, v = torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad)
    # every operand contiguous in one layout, whatever the caller's strides (a KV cache's, a transposed view's)
    qg = q.contiguous().reshape(b, kv_heads, group * rows, dim)  # a head group is a block of query rows
    kc, vc = k.contiguous(), v.contiguous()
    # scores on oneDNN's GEMM, one per sequence and KV head: a query's row of scores takes the same bits whatever
    # the rows and keys beside it (MKL's batched matmul sums it in an order that depends on them on some CPUs)
    scores = _gemms(qg.reshape(-1, group * rows, dim), kc.reshape(-1, padded, dim))
    scores = scores.reshape(b, kv_heads, group * rows, chunks, chunk).transpose(2, 3) * scale
    after = torch.arange(padded, device=q.device)[None, None, :] > q_pos[:, :, None]  # [B, rows, padded]
    after = after.reshape(b, 1, 1, rows, chunks, chunk).expand(b, 1, group, rows, chunks, chunk)
    after = after.reshape(b, 1, group * rows, chunks, chunk).transpose(2, 3)
    scores = scores.masked_fill(after, float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=(2, 4), keepdim=True)).contiguous()
    vt = vc.reshape(b, kv_heads, chunks, chunk, dim).transpose(-1, -2)  # per chunk: V^T [dim, chunk]
    # per chunk: P . V on the GEMM as well, [B, kv_heads, chunks, group x rows, dim]
    values = _gemms(weights.reshape(-1, group * rows, chunk), vt.reshape(-1, dim, chunk).contiguous())
    values = values.reshape(b, kv_heads, chunks, group * rows, dim)
    sums = weights.sum(dim=-1, keepdim=True)  # per chunk: the weights' sum (each row reduced alone)
    acc, total = values[:, :, 0], sums[:, :, 0]
    for c in range(1, chunks):  # chunk by chunk, in order: the fixed summation order
        acc, total = acc + values[:, :, c], total + sums[:, :, c]
    return (acc / total).reshape(b, heads, rows, dim)[:, :, :n]


def _gemms(xs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``xs[i] @ weights[i].T`` for each ``i``, one :func:`linear` call each (a batched matmul is not invariant)."""
    return torch.stack([linear(x, w) for x, w in zip(xs, weights, strict=True)])


def engine_unsupported(
    config: Any, device: torch.device, dtype: torch.dtype, *, quantization: str | None
) -> str | None:
    """Why the local engine cannot compute this model with these ops, or ``None``: they cover dense decoders
    and Qwen2-MoE / Qwen3-MoE with SiLU MLPs and RMSNorms in float32 on CPU (vision towers, quantized projections
    and bfloat16 are not covered yet)."""
    text = config.get_text_config()
    if device.type != "cpu":
        return f"they run on CPU only (the engine runs on {device})"
    if dtype != torch.float32:
        return f"they cover float32 (the engine serves {dtype})"
    if quantization is not None or getattr(config, "vision_config", None) is not None:
        return "quantized projections and vision-language models are not covered"
    if (getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0)) and (
        text.model_type not in MOE_MODEL_TYPES
    ):
        return f"the MoE blocks of {text.model_type!r} are not covered ({', '.join(MOE_MODEL_TYPES)} are)"
    if getattr(text, "hidden_act", "silu") != "silu":
        return f"the activation {text.hidden_act!r} is not covered (silu is)"
    return invariance_problem()


@functools.cache
def invariance_problem() -> str | None:
    """``None`` when this machine's GEMM and batched matmul give a row the same bits whatever the row count and
    position, else what differs (a probe of a few milliseconds, once per process)."""
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn), whose GEMM the batch-invariant ops use"
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(67, 96, generator=g), torch.randn(80, 96, generator=g)
    try:
        whole = linear(x, w)
        for rows in (1, 2, 17, 40):
            if not torch.equal(linear(x[:rows], w), whole[:rows]):
                return f"oneDNN's GEMM gives a row other bits in a call of {rows} rows than in one of 67"
    except (RuntimeError, NotImplementedError) as exc:
        return f"oneDNN's GEMM does not run here ({str(exc).splitlines()[0]})"
    q, kv = torch.randn(1, 4, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    pos = torch.arange(40)[None]
    whole = attention(q, kv, kv, pos, 0.25, chunk=16)
    for at in (0, 5, 39):
        one = attention(
            q[:, :, at : at + 1], kv[:, :, : at + 1], kv[:, :, : at + 1], pos[:, at : at + 1], 0.25, chunk=16
        )
        if not torch.equal(one, whole[:, :, at : at + 1]):
            return f"the batched matmul gives a query other bits alone than in a prefill (position {at})"
    return None
