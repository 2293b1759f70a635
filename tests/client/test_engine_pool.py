"""``EnginePool``: both pools an engine runs over satisfy it, and something else does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvdaemon.client.engine_pool import EnginePool
from kvdaemon.client.local_pool import LocalPool

from tests.conftest import RunningDaemon, small_spec

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_daemon_pool_and_a_local_pool_are_engine_pools(kvd: RunningDaemon) -> None:
    with kvd.client() as client:
        pool = client.register("engine-pool", small_spec())
        try:
            assert isinstance(pool, EnginePool)
        finally:
            pool.close()
    assert isinstance(LocalPool(small_spec(), 4), EnginePool)


def test_a_pool_without_the_engine_surface_is_not_one() -> None:
    class BlocksOnly:
        block_size, blocks_per_page = 16, 1

        def alloc(self, n: int) -> list[int]:
            return list(range(n))

        def free(self, block_ids: list[int]) -> None:
            pass

        def copy_blocks(self, src: list[int], dst: list[int]) -> None:
            pass

    assert not isinstance(BlocksOnly(), EnginePool)


def test_importing_the_protocol_does_not_import_torch() -> None:
    code = "import sys, kvdaemon.client.engine_pool; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
