"""The torch path's reused gather buffers across ``torch.inference_mode`` and out of it."""

from __future__ import annotations

import threading

import torch

from kvdaemon.client.attention import paged_attention

from .test_attention import assert_close, make_batch


def test_attention_outside_inference_mode_after_a_call_inside_it() -> None:
    """A buffer made inside ``inference_mode`` (an engine's forward) is not written outside it."""
    batch = make_batch([(40, 1), (70, 1), (33, 33)])
    outcome: list[BaseException] = []

    def in_a_fresh_thread() -> None:  # fresh per-thread buffers: inference mode makes them first
        try:
            with torch.inference_mode():
                assert_close(paged_attention(*batch.args()), batch)
            assert_close(paged_attention(*batch.args()), batch)
            with torch.inference_mode():
                assert_close(paged_attention(*batch.args()), batch)
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=in_a_fresh_thread)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    if outcome:
        raise outcome[0]
