"""A lean forward for a shape-invariant Qwen2 (draft or target): the same ops as transformers', fewer calls.

Why: one drafted token of the demo draft (Qwen2.5-Coder 0.5B, w8a8, one thread, AMD EPYC) costs
~28 ms, of which its 97 int8 matmuls called alone take ~20.5 ms; most of the rest is the Python
and dispatch cost of ~7,400 aten ops and ~370 module calls per forward
(docs/bench/formats/PROFILE.md section 12). transformers' generic forward pays, per forward, a
causal-mask builder, output-capturing and keyword-deprecation wrappers, and per layer ~15 module
calls and five contiguous copies of the fused projections' columns (:class:`FusedSlice`).

What: :func:`install` wraps a loaded model's ``forward``. The calls the engine makes run
:func:`lean_forward` (:func:`decode_one` for a plain decode step):

- one sequence (``input_ids`` ``[1, M]``, a :class:`transformers.DynamicCache`, no mask, no position
  ids): a decode step (M = 1), a verify block, a prefill chunk;
- a packed forward of several sequences (:func:`specdec.engine.kv_cache.feed_many`: its cache
  view, position ids and 4-D mask), since session 24 (:data:`MULTI_POSITION`) with one-sequence
  blocks and chunks: the demo target (w8a8, 2 threads, Zen 4) 8 sessions x 1 position 0.90-0.95x,
  8 x 5 0.96x, one block of 5 0.93-0.94x, a 36-token prefill 0.97-0.99x the time of
  transformers' forward (two A/B runs in one process, same tokens; docs/bench/batching/lean-s24/);

always without embeddings or labels, in inference mode, ``logits_to_keep`` an int or a 1-D index
tensor. Every other call (transformers' ``generate``, which passes a 2-D mask; a model in
training mode) runs transformers' forward as before. :func:`lean_forward` runs the exact op sequence
of transformers' Qwen2 decoder (RMSNorm, projections, rotary, cache append, attention, residuals,
SiLU-gated MLP, final norm, output layer over the kept positions), calling the same modules'
kernels on the same values, so its logits and the keys and values it caches are bitwise those of
transformers' forward (tests/test_lean_decode.py, every weight format, one sequence and packed;
and the demo draft in the section-12 run). It only skips work that does not change a value:
wrapper layers, the mask builder, copies of the fused projections' columns (it takes views of the
one fused product), module dispatch. So hooks registered on the decoder layers, attention, MLP or
norm modules do not fire for the calls it takes (nothing in specdec registers any).

Attention is :func:`specdec.engine.invariant.rowwise_attention`, the call transformers makes
through the registered interface for a model made shape-invariant (looked up there as transformers
does, so a wrapper registered in its place sees these calls too). A packed forward passes its
4-D mask as given (transformers returns a given 4-D mask unchanged). One sequence passes no mask:
transformers passes none for a decode step or a first prefill, and for a block or chunk after a
cached prefix the causal boolean mask its sdpa mask builder makes, whose visible key range per
row is exactly the causal range row-wise attention takes without a mask
(:func:`specdec.engine.invariant._row_ranges`); so rows get the same key ranges and the same
calls, in the one-call-per-row and the one-call-per-sequence form alike (tests). A model whose
attention is not that (float32, not invariant) is not wrapped.

Exactness does not rest on the draft's use of this module: the draft only proposes, and the target
verifies. The target's use keeps the target's logits bitwise (the tests above), so every output
stays the target alone's; the draft's stays bitwise too, so that a draft's proposals and q do not
depend on which code path ran them.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

#: :func:`install` also routes multi-position calls to :func:`lean_forward`: one sequence's verify
#: blocks and prefill chunks, and packed forwards of several sequences; False: plain one-position
#: decode steps only (sessions 12-23).
MULTI_POSITION = True
#: models :func:`install` wraps (transformers class names)
ARCHITECTURES = ("Qwen2ForCausalLM",)


def _rms(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``Qwen2RMSNorm.forward``, op for op."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _group(module: nn.Module, names: tuple[str, ...]):
    """``(fused linear, bounds)`` when ``names`` are the :class:`FusedSlice` parts, in order, of one
    fused linear; else None (the projections are called one by one)."""
    from specdec.models.fused import FusedSlice

    parts = [getattr(module, n) for n in names]
    if not all(isinstance(p, FusedSlice) for p in parts):
        return None
    fused = parts[0].fused
    if any(p.fused is not fused for p in parts) or [p.index for p in parts] != list(range(len(names))) \
            or len(fused.bounds) != len(names):
        return None
    return fused.linear, fused.bounds


def _projections(module: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of ``module.<name>(x)`` for each name: column views of one fused product when
    fused (the same values as the :class:`FusedSlice` copies), else each projection's call."""
    group = getattr(module, "_specdec_lean_group", None)
    if group is None:
        group = _group(module, names) or False
        module._specdec_lean_group = group
    if group is False:
        return [getattr(module, n)(x) for n in names]
    linear, bounds = group
    y = linear(x)
    return [y[..., lo:hi] for lo, hi in bounds]


@torch.inference_mode()
def decode_one(model: nn.Module, input_ids: torch.Tensor, cache) -> torch.Tensor:
    """One decode position of a shape-invariant Qwen2 causal LM: ``[1, 1]`` ids -> ``[1, 1, V]``
    logits in the model's activation dtype; appends the position's keys and values to ``cache``.

    :func:`lean_forward` of one position (see module doc).
    """
    return lean_forward(model, input_ids, cache)


@torch.inference_mode()
def lean_forward(model: nn.Module, input_ids: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, logits_to_keep: int | torch.Tensor = 1) -> torch.Tensor:
    """transformers' ``Qwen2ForCausalLM.forward`` over one row of M positions, op for op, without
    its wrappers: a decode step (M = 1), a verify block or prefill chunk of one sequence, or a
    packed forward of several sequences (:func:`specdec.engine.kv_cache.feed_many`).

    Args:
        model: a shape-invariant Qwen2 causal LM (:func:`eligible`).
        input_ids: ``[1, M]`` int64 token ids.
        cache: the sequence's ``DynamicCache`` (positions ``past .. past + M - 1``), or a packed
            forward's cache view (then ``position_ids`` and ``attention_mask`` are given).
        position_ids: ``[1, M]`` int64 positions (None: after the cache's length).
        attention_mask: None (causal over the cache and the new positions) or the packed
            forward's 4-D mask ``[1, 1, M, keys]``, passed to row-wise attention as transformers
            passes it.
        logits_to_keep: an int n (the last n positions; 0: all) or a 1-D int64 tensor of the
            positions whose logits are computed, as transformers takes it.

    Returns:
        ``[1, n, V]`` logits in the model's activation dtype; the new positions' keys and values
        are appended to ``cache``.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from specdec.engine.invariant import ATTENTION_NAME

    # the function registered under the model's attention name (row-wise attention, or a wrapper a
    # profiler registered in its place, e.g. benchmarks.batching_profile), looked up as transformers does
    attention = ALL_ATTENTION_FUNCTIONS[ATTENTION_NAME]
    inner = model.model
    m = input_ids.shape[1]
    h = inner.embed_tokens(input_ids)  # [1, M, H]
    if position_ids is None:
        past = cache.get_seq_length()
        position_ids = (torch.arange(m, device=h.device) + past).unsqueeze(0)
    cos, sin = inner.rotary_emb(h, position_ids)  # [1, M, d] each, in h's dtype
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for layer in inner.layers[: model.config.num_hidden_layers]:
        attn = layer.self_attn
        residual = h
        x = _rms(layer.input_layernorm, h)
        q, k, v = _projections(attn, ("q_proj", "k_proj", "v_proj"), x)
        q = q.view(1, m, -1, attn.head_dim).transpose(1, 2)
        k = k.view(1, m, -1, attn.head_dim).transpose(1, 2)
        v = v.view(1, m, -1, attn.head_dim).transpose(1, 2)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        k, v = cache.update(k, v, attn.layer_idx)
        out, _ = attention(attn, q, k, v, attention_mask, scaling=attn.scaling, dropout=0.0)
        out = attn.o_proj(out.reshape(1, m, -1).contiguous())
        h = residual + out
        residual = h
        x = _rms(layer.post_attention_layernorm, h)
        mlp = layer.mlp
        gate, up = _projections(mlp, ("gate_proj", "up_proj"), x)
        h = residual + mlp.down_proj(mlp.act_fn(gate) * up)
    h = _rms(inner.norm, h)
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return model.lm_head(h[:, keep, :])


def _lean_call(model, input_ids, attention_mask, position_ids, cache, inputs_embeds, logits_to_keep, kwargs) -> bool:
    """Whether a forward call is one :func:`lean_forward` takes (see :func:`install`)."""
    from transformers import DynamicCache

    from specdec.engine.kv_cache import _PackedCacheView

    if (input_ids is None or inputs_embeds is not None or kwargs or input_ids.dim() != 2 or input_ids.shape[0] != 1
            or model.training or not torch.is_inference_mode_enabled()):
        return False
    if isinstance(logits_to_keep, bool) or not (
            (isinstance(logits_to_keep, int) and logits_to_keep >= 0)
            or (isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.dim() == 1
                and not logits_to_keep.is_floating_point())):
        return False
    if type(cache) is DynamicCache and attention_mask is None and position_ids is None:
        return input_ids.shape[1] == 1 or MULTI_POSITION  # one sequence's decode step, block or prefill chunk
    # a packed forward of several sequences (feed_many): its own position ids and 4-D mask
    return (MULTI_POSITION and type(cache) is _PackedCacheView and position_ids is not None
            and tuple(position_ids.shape) == tuple(input_ids.shape) and attention_mask is not None
            and attention_mask.dim() == 4)


def eligible(model: nn.Module) -> str | None:
    """Why :func:`install` would not wrap ``model`` (None: it would)."""
    from specdec.engine.invariant import ATTENTION_NAME

    if type(model).__name__ not in ARCHITECTURES:
        return f"architecture {type(model).__name__} (lean decode knows {', '.join(ARCHITECTURES)})"
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        return "attention is not the shape-invariant row-wise attention"
    if getattr(model.model, "has_sliding_layers", False):
        return "sliding-window layers"
    return None


def install(model: nn.Module) -> bool:
    """Route ``model``'s forward calls that the engine makes (one sequence's decode steps, blocks and
    prefill chunks; packed forwards) to :func:`lean_forward` (see module doc and :func:`_lean_call`).

    Idempotent. Returns whether the model is wrapped (False, with the reason logged at debug
    level, for a model :func:`eligible` refuses).
    """
    if getattr(model, "_specdec_lean_decode", False):
        return True
    why = eligible(model)
    if why:
        log.debug("lean decode not installed: %s", why)
        return False
    from transformers.modeling_outputs import CausalLMOutputWithPast

    original = model.forward

    def forward(input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        if labels is None and use_cache is not False and _lean_call(
                model, input_ids, attention_mask, position_ids, cache, inputs_embeds, logits_to_keep, kwargs):
            one_step = input_ids.shape[1] == 1 and position_ids is None
            if one_step and isinstance(logits_to_keep, int) and logits_to_keep in (0, 1):  # a plain decode step
                logits = decode_one(model, input_ids, cache)
            else:
                logits = lean_forward(model, input_ids, cache, position_ids, attention_mask, logits_to_keep)
            return CausalLMOutputWithPast(logits=logits, cache=cache)
        return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                        inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                        logits_to_keep=logits_to_keep, **kwargs)

    model.forward = forward
    model._specdec_lean_decode = True
    return True


def uninstall(model: nn.Module) -> None:
    """Undo :func:`install` (the model's class forward again)."""
    if getattr(model, "_specdec_lean_decode", False):
        del model.forward
        model._specdec_lean_decode = False
