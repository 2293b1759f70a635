"""``LocalPool``: what ``free`` and ``copy_blocks`` accept, and that a refusal changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdaemon.client.local_pool import LocalPool
from kvdaemon.errors import BadRequest

from tests.conftest import small_spec


def test_free_and_copy_blocks_refuse_what_is_not_a_list_of_allocated_ids() -> None:
    pool = LocalPool(small_spec(), 8)
    live = pool.alloc(2)
    pool.key_cache(0)[live[1]].fill_(2)
    for bad, match in ((live[0], "got int"), (None, "got NoneType"), (np.array(live), r"ndarray \(pass \.tolist"),
                       (torch.tensor(live), r"Tensor \(pass \.tolist"), (["x"], "'x' is not allocated"),
                       ([True], "True is not allocated"), ([live[0], 99], "99 is not allocated")):
        with pytest.raises(BadRequest, match=match):
            pool.free(bad)  # type: ignore[arg-type]
    assert pool.num_used_blocks == 2, "a refused free freed"
    for src, dst, match in ((live[0], [live[1]], "src must be a list of block ids, got int"),
                            ([live[0]], None, "dst must be a list of block ids, got NoneType"),
                            ([live[0]], [7], "block 7 is not an allocated block"),
                            ([-1], [live[1]], "block -1 is not an allocated block")):
        with pytest.raises(BadRequest, match=match):
            pool.copy_blocks(src, dst)  # type: ignore[arg-type]
    assert pool.key_cache(0)[live[1]].eq(2).all(), "a refused copy copied"
    pool.copy_blocks((live[1],), (live[0],))
    assert pool.key_cache(0)[live[0]].eq(2).all()
    pool.free(tuple(live))
    assert pool.num_used_blocks == 0
