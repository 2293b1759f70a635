"""transformers attention over a pool's paged KV: one ragged batch per forward, no gather.

``register()`` adds ``ATTENTION_NAME`` to transformers' ``AttentionInterface``;
a model switched to it (``model.set_attn_implementation(ATTENTION_NAME)``) calls
``paged_attention_forward`` in every attention layer. ``build_step`` packs a
step's tokens into one row (``input_ids [1, total_tokens]``, per-token
positions) and makes the ``PagedStep`` the engine passes as the
``kvdaemon_step`` keyword, which transformers forwards to the attention
function. Each layer then:

1. writes the new tokens' K/V into their slots of the layer's pool tensors
   (``store_kv``), and
2. runs ``paged_attention`` of the new queries over each sequence's blocks.

transformers builds no attention mask for an implementation it has no mask
function for, so a step costs no ``[tokens, context]`` mask either.

Requirements on the model (checked by the engine): attention modules with a
``layer_idx`` that call the attention interface with ``(query, key, value)`` as
``[1, heads, tokens, head_dim]`` (Llama, Qwen2, Mistral and most decoder-only
families of transformers 5), no sliding window, no logit soft-capping.
"""

from __future__ import annotations

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
    impl: Impl = "auto"


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

    step = PagedStep(caches[0], caches[1], tensor(slots), tensor(padded), tensor(seq_lens), tensor(starts), impl)
    return tensor(ids)[None], tensor(positions)[None], step, tensor(keep)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kvdaemon_step: PagedStep | None = None,
    **_kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Store this layer's new K/V and attend over the pool; ``([1, tokens, heads, head_dim], None)``."""
    if kvdaemon_step is None:
        raise BadRequest(
            f"attention implementation {ATTENTION_NAME!r} runs only inside kvdaemon's Engine "
            "(the forward had no kvdaemon_step)"
        )
    if query.shape[0] != 1:
        raise BadRequest(f"the engine packs a step into one row; got a batch of {query.shape[0]}")
    layer = module.layer_idx
    k_cache, v_cache = kvdaemon_step.k_caches[layer], kvdaemon_step.v_caches[layer]
    store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, kvdaemon_step.slot_mapping)
    out = paged_attention(
        query[0].transpose(0, 1), k_cache, v_cache, kvdaemon_step.block_tables, kvdaemon_step.seq_lens,
        kvdaemon_step.query_start_loc, scaling, impl=kvdaemon_step.impl,
    )
    return out.unsqueeze(0), None


def register() -> None:
    """Add ``ATTENTION_NAME`` to transformers' attention interface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def check_model(model: Any) -> None:
    """BadRequest unless ``model`` is a decoder whose attention this module can serve."""
    config = model.config
    problems = []
    if getattr(config, "is_encoder_decoder", False):
        problems.append("it is an encoder-decoder")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        problems.append("it uses sliding-window attention")
    for name in ("attn_logit_softcapping", "attn_logit_soft_capping"):
        if getattr(config, name, None):
            problems.append("it soft-caps attention logits")
    if not getattr(model, "_can_set_attn_implementation", lambda: False)():
        problems.append("it does not dispatch through transformers' AttentionInterface")
    if problems:
        raise BadRequest(f"{type(model).__name__} cannot run on the paged engine: {'; '.join(problems)}")
