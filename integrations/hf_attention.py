"""transformers attention over a pool's paged KV: one ragged batch per forward, no gather.

``register()`` adds ``ATTENTION_NAME`` to transformers' ``AttentionInterface``.
``build_step`` packs a step's tokens into one row (``input_ids [1, total_tokens]``,
per-token positions) and makes its ``PagedStep``; ``paged_forward`` runs the
model over that row with its attention switched to ``ATTENTION_NAME`` and the
step current (a context variable of the calling thread, so a family whose
layers do not pass the forward's keyword arguments on still finds it). Each
attention layer then:

1. writes the new tokens' K/V into their slots of the layer's pool tensors
   (``store_kv``), and
2. runs ``paged_attention`` of the new queries over each sequence's blocks,
   with the ``scaling``, ``sliding_window`` and ``softcap`` the layer passes (a
   window no shorter than the step's longest context is dropped: it cannot
   bind, and without it the Triton path can run).

transformers builds no attention mask for an implementation it has no mask
function for, so a step costs no ``[tokens, context]`` mask either.

Requirements on the model: attention modules with a ``layer_idx`` that call the
attention interface with ``(query, key, value)`` as ``[1, heads, tokens,
head_dim]``, causal, without sinks. The engine does not trust a list of
families: ``hf_probe`` checks each model at construction.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvdaemon.client.attention import Impl, paged_attention, store_kv
from kvdaemon.errors import BadRequest

if TYPE_CHECKING:
    from kvdaemon.client.block_manager import BlockManager
    from kvdaemon.integrations.scheduler import Batch

ATTENTION_NAME = "kvdaemon_paged"


@dataclass
class PagedStep:
    """The index tensors of one forward (see ``kvdaemon.client.attention`` for their layouts)."""

    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [total_tokens]
    block_tables: torch.Tensor  # [batch, max_blocks]
    seq_lens: torch.Tensor  # [batch]
    query_start_loc: torch.Tensor  # [batch + 1]
    max_seq_len: int  # max(seq_lens) on the host: a window at least this long cannot bind
    impl: Impl = "auto"


_STEP: contextvars.ContextVar[PagedStep | None] = contextvars.ContextVar("kvdaemon_step", default=None)
"""The step of the ``paged_forward`` running in this thread (``None`` outside one)."""


def build_step(
    batch: Batch,
    manager: BlockManager,
    caches: tuple[list[torch.Tensor], list[torch.Tensor]],
    device: torch.device,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor, PagedStep, torch.Tensor]:
    """The model inputs of ``batch``: ``input_ids [1, T]``, ``position_ids [1, T]``, the
    ``PagedStep``, and ``logits_to_keep`` (the row of each request that completes its context).

    Every batch request is a sequence of ``manager`` holding its computed tokens
    plus this step's. Cost: O(tokens + blocks) Python work, five host-to-device copies.
    """
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    seq_lens: list[int] = []
    starts = [0]
    keep: list[int] = []
    for request, num_new in batch.items:
        start, end = request.num_computed, request.num_computed + num_new
        ids += request.token_ids[start:end]
        positions += range(start, end)
        slots += manager.slot_mapping(request.request_id, start, end)
        tables.append(manager.block_table(request.request_id))
        seq_lens.append(end)
        starts.append(starts[-1] + num_new)
        if end == request.num_tokens:
            keep.append(starts[-1] - 1)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]

    def tensor(values: list[Any]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    step = PagedStep(
        caches[0], caches[1], tensor(slots), tensor(padded), tensor(seq_lens), tensor(starts), max(seq_lens), impl
    )
    return tensor(ids)[None], tensor(positions)[None], step, tensor(keep)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Store this layer's new K/V and attend over the pool; ``([1, tokens, heads, head_dim], None)``."""
    step = _STEP.get()
    if step is None:
        raise BadRequest(
            f"attention implementation {ATTENTION_NAME!r} runs only inside kvdaemon's paged_forward"
        )
    if kwargs.get("s_aux") is not None or kwargs.get("is_causal", True) is False:
        raise BadRequest("the paged attention computes causal attention without sinks only")
    if query.shape[0] != 1:
        raise BadRequest(f"the engine packs a step into one row; got a batch of {query.shape[0]}")
    if sliding_window is not None and sliding_window >= step.max_seq_len:
        sliding_window = None  # cannot bind in this step: leaves the Triton path open
    layer = module.layer_idx
    k_cache, v_cache = step.k_caches[layer], step.v_caches[layer]
    store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, step.slot_mapping)
    out = paged_attention(
        query[0].transpose(0, 1), k_cache, v_cache, step.block_tables, step.seq_lens, step.query_start_loc,
        scaling, impl=step.impl, sliding_window=sliding_window, softcap=softcap,
    )
    return out.unsqueeze(0), None


def paged_forward(
    model: Any, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedStep, keep: torch.Tensor
) -> torch.Tensor:
    """The logits ``[len(keep), vocab]`` of rows ``keep`` of one forward of ``model`` over ``step``.

    The model's attention is ``ATTENTION_NAME`` during the call only; ``register()`` first.
    BadRequest if the model returns other rows than ``keep`` (it ignores ``logits_to_keep``).
    """
    config = model.config
    previous, config._attn_implementation = config._attn_implementation, ATTENTION_NAME
    token = _STEP.set(step)
    try:
        with torch.inference_mode():
            out = model(input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=keep)
    finally:
        _STEP.reset(token)
        config._attn_implementation = previous
    logits = out.logits[0]
    if logits.shape[0] != keep.numel():
        raise BadRequest(f"the model returned {logits.shape[0]} rows of logits for {keep.numel()} kept rows "
                         "(it ignores logits_to_keep)")
    return logits


def register() -> None:
    """Add ``ATTENTION_NAME`` to transformers' attention interface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
