"""What a transformers model's attention computes, found by running it, not by reading its config.

Two probes, each a few tiny forwards of the model itself:

- ``probe_layout(model)`` runs one forward of ``LAYOUT_TOKENS`` tokens with a
  recording attention function in place of the model's own (through
  transformers' ``AttentionInterface``, the way the engine swaps in the paged
  attention). Every call reports its module's ``layer_idx``, the K/V it was given
  (``[batch, kv_heads, tokens, head_dim]``, dtype) and the options the layer
  passes (``sliding_window``, ``softcap``, attention sinks, ``is_causal``). The
  result, an ``AttentionLayout``, is what the model's attention actually holds:
  a family that ignores a config field (GPTNeoX and ``num_key_value_heads``)
  cannot mislead it. ``BadRequest`` when the layout cannot be determined: no
  attention call reached the interface, a layer called twice or never, layers
  whose K/V differ, K and V of different head dims.
- ``check_paged(model, layout, block_size, impl, max_model_len)`` runs
  ``probe_length`` tokens through the paged attention exactly as the engine
  does (``build_step`` over a scratch ``LocalPool``: two prefill chunks, then
  two one-token decodes) and compares every position's logits with the model's
  own forward (its own attention implementation) over the same tokens. Where a
  sliding window is short enough (``WINDOW_PROBE_MAX``, and within
  ``max_model_len``), the probe runs past it, so the window binds.
  ``BadRequest`` naming the family and the reason when a paged forward fails (a
  model that ignores ``logits_to_keep``, an ``impl`` that cannot compute an
  option) or when the logits differ by more than the dtype's tolerance.

Both are refusals at construction: a model that passes runs token-exact (up to
float ties), one that fails never starts a request. Cost: ``probe_layout`` one
forward of 3 tokens; ``check_paged`` four small paged forwards and one reference
forward of ``probe_length`` tokens (about ``2 * block_size + 5``, or the window
plus ``block_size + 5``), a scratch cache of that many tokens.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdaemon.client.block_manager import BlockManager
from kvdaemon.client.local_pool import LocalPool
from kvdaemon.client.spec import KVSpec
from kvdaemon.errors import BadRequest
from kvdaemon.integrations import hf_attention
from kvdaemon.integrations.request import Request
from kvdaemon.integrations.scheduler import Batch

PROBE_NAME = "kvdaemon_probe"
LAYOUT_TOKENS = 3
WINDOW_PROBE_MAX = 512
"""Sliding windows up to this many tokens are made to bind in ``check_paged``."""
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 6e-2}
"""Largest logit difference accepted, relative to the largest logit (at least 1)."""


@dataclass
class _Call:
    """One attention call seen by the recorder."""

    layer_idx: int | None
    num_heads: int
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    dtype: torch.dtype
    sliding_window: int | None
    softcap: float | None
    sinks: bool
    causal: bool


@dataclass
class _Recording:
    calls: list[_Call] = field(default_factory=list)


_RECORDING: contextvars.ContextVar[_Recording | None] = contextvars.ContextVar("kvdaemon_probe", default=None)


@dataclass(frozen=True)
class AttentionLayout:
    """The KV layout and per-layer options of a model's attention, as observed by ``probe_layout``."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_windows: tuple[int | None, ...]
    softcaps: tuple[float | None, ...]
    sinks: bool
    causal: bool

    def kv_spec(self, block_size: int, dtype: Any = None) -> KVSpec:
        """The pool layout for this model (``dtype``: the K/V dtype the model computes, unless given)."""
        return KVSpec(
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            block_size=block_size, dtype=self.dtype if dtype is None else dtype,
        )

    def unsupported(self) -> list[str]:
        """Why the paged attention cannot compute this attention (empty when it can)."""
        reasons = []
        if self.sinks:
            reasons.append("its attention uses sinks (s_aux), which the paged attention does not compute")
        if not self.causal:
            reasons.append("its attention is not causal")
        if self.num_heads % self.num_kv_heads:
            reasons.append(f"{self.num_heads} query heads do not share {self.num_kv_heads} KV heads evenly")
        return reasons


def family_of(model: Any) -> str:
    """``ClassName (model_type 'x')``: how refusals name a model."""
    return f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', '?')!r})"


def refusal(model: Any, reason: str) -> BadRequest:
    """The error for a model the engine cannot serve exactly."""
    return BadRequest(f"{family_of(model)} cannot run on kvdaemon's paged attention: {reason}")


# --- the layout probe -------------------------------------------------------------------------


def _record(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *_args: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Record one attention call; zeros of the output's shape ``[batch, tokens, heads, v_dim]``."""
    recording = _RECORDING.get()
    if recording is None:
        raise BadRequest(f"attention implementation {PROBE_NAME!r} runs only inside kvdaemon's layout probe")
    recording.calls.append(_Call(
        layer_idx=getattr(module, "layer_idx", None), num_heads=query.shape[1],
        key_shape=tuple(key.shape), value_shape=tuple(value.shape), dtype=key.dtype,
        sliding_window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux") is not None,
        causal=bool(kwargs.get("is_causal", getattr(module, "is_causal", True))),
    ))
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


def probe_layout(model: Any) -> AttentionLayout:
    """The layout of ``model``'s attention, from one recorded forward; BadRequest if it cannot be found
    (or if ``model`` is not a transformers model: a ``torch.nn.Module`` with a ``config`` and parameters)."""
    _check_model(model)
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise refusal(model, "it is an encoder-decoder; the engine serves decoder-only models")
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE_NAME, _record)
    device = next(model.parameters()).device
    ids = torch.arange(LAYOUT_TOKENS, device=device)[None]
    recording = _Recording()
    token = _RECORDING.set(recording)
    previous, config._attn_implementation = config._attn_implementation, PROBE_NAME
    try:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)
    except Exception as exc:  # any failure of a foreign model's forward is a refusal
        raise refusal(
            model, f"its forward fails when its attention implementation is switched ({type(exc).__name__}: "
            f"{exc}): it does not dispatch through transformers' AttentionInterface"
        ) from exc
    finally:
        config._attn_implementation = previous
        _RECORDING.reset(token)
    return _layout_of(model, recording.calls)


def _check_model(model: Any) -> None:
    """BadRequest unless ``model`` is a transformers model (a module with a config and parameters)."""
    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        if next(model.parameters(), None) is None:
            raise BadRequest(f"{type(model).__name__} has no parameters: a transformers model is needed")
        return
    what = type(model).__name__
    hint = (" (a config: build the model from it first, e.g. AutoModelForCausalLM.from_config(config))"
            if hasattr(model, "to_dict") and hasattr(model, "model_type") else "")
    raise BadRequest(f"a transformers model (e.g. AutoModelForCausalLM.from_pretrained(...)) is needed, "
                     f"got {what}{hint}")


def _layout_of(model: Any, calls: list[_Call]) -> AttentionLayout:
    """Check the recorded calls describe one uniform layout; the layout."""
    if not calls:
        raise refusal(model, "its attention does not dispatch through transformers' AttentionInterface")
    layers = [call.layer_idx for call in calls]
    if None in layers:
        raise refusal(model, "its attention modules have no layer_idx")
    if sorted(layers) != list(range(len(layers))):
        raise refusal(
            model, f"attention ran in layers {sorted(layers)} of one forward; the engine needs one call "
            "in each layer 0..n-1 (no shared or skipped layers)"
        )
    first = calls[0]
    for call in calls:
        if (call.num_heads, call.key_shape, call.value_shape, call.dtype) != (
            first.num_heads, first.key_shape, first.value_shape, first.dtype
        ):
            raise refusal(model, f"its layers differ in K/V layout ({first.key_shape} vs {call.key_shape})")
    if first.key_shape[1] != first.value_shape[1] or first.key_shape[3] != first.value_shape[3]:
        raise refusal(model, f"its K {list(first.key_shape)} and V {list(first.value_shape)} differ in layout")
    by_layer = sorted(calls, key=lambda call: call.layer_idx or 0)
    return AttentionLayout(
        num_layers=len(calls), num_heads=first.num_heads,
        num_kv_heads=first.key_shape[1], head_dim=first.key_shape[3], dtype=first.dtype,
        sliding_windows=tuple(call.sliding_window for call in by_layer),
        softcaps=tuple(call.softcap for call in by_layer),
        sinks=any(call.sinks for call in calls), causal=all(call.causal for call in calls),
    )


# --- the paged probe ----------------------------------------------------------------------------


def probe_length(layout: AttentionLayout, block_size: int, max_model_len: int | None) -> int:
    """Tokens of the paged probe: three blocks and more, past the shortest window up to ``WINDOW_PROBE_MAX``.

    Never more than ``max_model_len`` (the longest sequence the engine will run), nor fewer than 5.
    """
    length = 2 * block_size + 5
    windows = [w for w in layout.sliding_windows if w is not None and w <= WINDOW_PROBE_MAX]
    if windows:
        length = max(length, min(windows) + block_size + 5)
    return length if max_model_len is None else max(5, min(length, max_model_len))


def check_paged(
    model: Any,
    layout: AttentionLayout,
    block_size: int,
    impl: hf_attention.Impl = "auto",
    max_model_len: int | None = None,
) -> None:
    """BadRequest unless the paged attention reproduces ``model``'s logits (see the module docstring).

    The probe runs no longer a sequence than ``max_model_len``.
    """
    if model.training:
        raise refusal(model, "the model is in training mode (dropout); call model.eval() first")
    if reasons := layout.unsupported():
        raise refusal(model, "; ".join(reasons))
    hf_attention.register()
    device = next(model.parameters()).device
    num_tokens = probe_length(layout, block_size, max_model_len)
    vocab = model.config.vocab_size  # the ids the engine accepts
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (num_tokens,), generator=generator).tolist()
    kept, paged = _paged_logits(model, layout.kv_spec(block_size), tokens, device, impl)
    with torch.inference_mode():
        own = model(input_ids=torch.tensor([tokens], device=device), use_cache=False).logits[0, kept]
    difference = float((paged.float() - own.float()).abs().max())
    bound = TOLERANCE.get(layout.dtype, 1e-3) * max(1.0, float(own.float().abs().max()))
    if not difference <= bound:  # NaN fails too
        raise refusal(
            model, f"over a {num_tokens}-token probe its logits through the paged attention differ from its "
            f"own by {difference:.3g} (tolerance {bound:.3g}): its attention computes something the paged "
            "attention does not"
        )


def _paged_logits(
    model: Any, spec: KVSpec, tokens: list[int], device: torch.device, impl: hf_attention.Impl
) -> tuple[list[int], torch.Tensor]:
    """``tokens`` through the paged attention in four steps: the positions kept, their logits.

    A prefill chunk keeps all its rows but the first, so a model that ignores
    ``logits_to_keep`` is caught.
    """
    num_tokens = len(tokens)
    pool = LocalPool(spec, -(-num_tokens // spec.block_size), device=device)
    manager = BlockManager(pool, enable_prefix_cache=False)
    manager.add_sequence(0, tokens)
    caches = ([pool.key_cache(i) for i in range(spec.num_layers)],
              [pool.value_cache(i) for i in range(spec.num_layers)])
    request = Request(0, tokens, 1, frozenset(), 0.0)
    cuts = [0, num_tokens // 2, num_tokens - 2, num_tokens - 1, num_tokens]
    kept: list[int] = []
    rows = []
    for start, end in zip(cuts, cuts[1:]):
        request.num_computed = start
        input_ids, positions, step, _ = hf_attention.build_step(
            Batch([(request, end - start)]), manager, caches, device, impl)
        keep = list(range(1 if end - start > 1 else 0, end - start))
        try:
            rows.append(hf_attention.paged_forward(
                model, input_ids, positions, step, torch.tensor(keep, device=device)))
        except Exception as exc:  # any failure of a foreign model under the paged attention is a refusal
            raise refusal(model, f"a forward through the paged attention failed ({type(exc).__name__}: {exc})"
                          ) from exc
        kept += [start + i for i in keep]
    return kept, torch.cat(rows)
