"""Llama 4's chunked-local layers free the KV blocks behind their chunk (issue #14),
through the real worker on the tiny Llama 4 (tests/fixtures/tiny-llama4: 3 chunked
layers with attention_chunk_size 8, 1 full-attention layer, so 4 block tables per
request, each block one layer's K and V): transformers' recorded greedy goldens while
the chunked tables' blocks are freed, in a pool too small to hold every position of
every layer, and the capacity lines that say so."""
import os
import re

import pytest

from engine_client import EngineWorker
from test_llama4 import GOLDENS, TINY4

# One block: 1 layer x K and V x 2 kv heads x head_dim 16 x float32 x 16 tokens.
BLOCK_BYTES = 2 * 2 * 16 * 4 * 16


@pytest.fixture
def worker(spawn):
    started = []

    def _worker(*flags):
        w = EngineWorker(spawn, TINY4, "--dtype", "float32", *flags)
        started.append(w)
        return w

    yield _worker
    for w in started:
        w.close()


def blocks(n_tokens, bs=16):
    return -(-n_tokens // bs)


@pytest.mark.parametrize("block_size,extra", [("16", ()), ("8", ()), ("16", ("--async-scheduling",))])
def test_golden_in_a_pool_that_needs_the_freeing(worker, block_size, extra):
    """The 51-token golden prompt (7 chunks) and its 32 greedy tokens: 83 positions.
    Every position of all 4 layers takes 4 x ceil(83 / bs) blocks; the pool holds
    fewer (before issue #14, the same bytes held 4-layer blocks: 3 of 16 tokens, 48
    positions, and the request waited forever).  With prefill steps of 8 tokens the
    chunked tables hold 2 blocks at most (bs 16: chunk starts inside blocks; bs 8:
    on block edges), so it is admitted and finishes with transformers' tokens, never
    preempted, also with --async-scheduling (the next step scheduled before the last
    one's blocks are freed); the pool is all free after."""
    bs = int(block_size)
    ids, golden = GOLDENS[2]
    assert len(ids) == 51 and len(golden) == 32
    every_position = 4 * blocks(83, bs)
    with_freeing = blocks(83, bs) + 3 * 2 + 1
    assert with_freeing < every_position
    # prefix caching off: else a preempted request would resume from its cached full
    # blocks with empty chunked tables, which gets it through without the freeing
    w = worker("--block-size", block_size, "--num-gpu-blocks-override", str(with_freeing),
               "--max-num-batched-tokens", "8", "--max-model-len", "128", "--no-enable-prefix-caching", *extra)
    w.submit("long", ids, len(golden), logprobs=2)
    got = w.collect(["long"], timeout=30)["long"]
    assert got.error is None and got.finish == "length" and got.num_preemptions == 0
    assert got.tokens == golden
    s = w.wait_status(lambda s: s["num_running"] == 0 and s["kv_blocks_free"] == with_freeing,
                      what="every block free again")
    assert s["kv_blocks_total"] == with_freeing
    out = w.proc.output()
    assert "hybrid KV cache: 4 block tables per request" in out, out


def test_same_bytes_as_before_hold_the_request(worker):
    """--kv-cache-memory-bytes sized so that blocks of every layer (the layout before
    issue #14: 4 x BLOCK_BYTES a block) would hold 3 blocks = 48 positions, less than
    the 51-token prompt: the hybrid's 1-layer blocks (12 of them) run it to the
    golden, and the capacity lines count what a request holds."""
    ids, golden = GOLDENS[2]
    mem = 12 * BLOCK_BYTES
    assert mem // (4 * BLOCK_BYTES) * 16 < len(ids)
    w = worker("--kv-cache-memory-bytes", str(mem), "--max-num-batched-tokens", "8", "--max-model-len", "96",
               "--no-enable-prefix-caching")
    w.submit("long", ids, len(golden))
    got = w.collect(["long"], timeout=30)["long"]
    assert got.tokens == golden and got.num_preemptions == 0
    out = w.proc.output()
    # 96 tokens: 6 full blocks + 3 chunked tables of at most ceil((8 + 8) / 16) + 1 = 2
    m = re.search(r"# KV blocks: (\d+) \(block size 16, 4 block tables per request, at most (\d+) blocks for a "
                  r"request of max_model_len 96: ([\d.]+)x concurrency\)", out)
    assert m, out
    assert (int(m[1]), int(m[2]), m[3]) == (12, 12, "1.00")
    # vLLM's line: num_blocks // n_groups * block_size tokens
    assert "CPU KV cache size: 48 tokens, Maximum concurrency for 96 tokens per request: 1.00x" in out, out


def test_blocks_freed_while_generating(spawn):
    """The pool's count mid-generation, exactly: the forward of step 300 hangs (the
    TESSERA_TEST_HANG_AT_STEP hook), so the Status after it is scheduled stays.  With
    prefill steps of 8, steps 1-7 compute the 51-token prompt and step k >= 8 the
    position k + 43: 343 at step 300 (block 21 of 16 tokens, its chunk [336, 344)).  The
    full table holds blocks 0..21 (22), each chunked table block 21 only: 25 blocks in
    use, where keeping every position of every layer would be 4 x 22 = 88."""
    ids, _ = GOLDENS[2]
    w = EngineWorker(spawn, TINY4, "--dtype", "float32", "--max-num-batched-tokens", "8",
                     env=dict(os.environ, TESSERA_TEST_HANG_AT_STEP="300"))
    try:
        w.submit("long", ids, 400)
        # the hang's state is permanent; a Status sent just before it may lag a step
        hung = lambda s: s["num_running"] == 1 and "TESSERA_TEST_HANG_AT_STEP=300" in w.proc.output()
        s = w.wait_status(lambda s: hung(s) and s["kv_blocks_total"] - s["kv_blocks_free"] == 22 + 3 * 1,
                          timeout=10, what="25 blocks in use at step 300")
        assert w.status()["kv_blocks_free"] == s["kv_blocks_free"]
        assert not w.results["long"].done
    finally:
        w.close()
        w.proc.p.kill()         # its forward never returns: a SIGTERM would wait out the shutdown
