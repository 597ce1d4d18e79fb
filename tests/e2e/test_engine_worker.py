"""The engine through the real worker process: a pyzmq stand-in for the router
(engine_client.py) submits on the wire and reads Output, Error and Status back.

"Right tokens" means: identical to the same request run alone (token ids and logprob
floats, bitwise: the CPU backend promises batch invariance), and equal to the
transformers goldens of tests/fixtures where they exist.  Models: the committed tiny
Llama-3 checkpoint (tests/fixtures/tiny-llama3-hf, float32) for the core cases, the
shared stories260K for a second real model (skipped when ../shared is absent), and
SmolLM2 where a case needs generation slow enough to act in the middle of it."""
import hashlib
import json
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, REPO, SANITIZED, skip_because, wait_until
from engine_client import EngineWorker

TINY = REPO / "tests" / "fixtures" / "tiny-llama3-hf"
TINY_GOLDEN = json.loads((TINY / "golden.json").read_text())
FORWARD = REPO / "tests" / "fixtures" / "forward"
STORIES = FIXTURES / "models" / "stories260K.gguf"
F32 = ("--dtype", "float32")


@pytest.fixture
def worker(spawn):
    started = []

    def _worker(model, *flags):
        w = EngineWorker(spawn, model, *F32, *flags)
        started.append(w)
        return w

    yield _worker
    for w in started:
        w.close()


@pytest.fixture
def conformant(spawn, worker_binary):
    """Like `worker`, for the protocol conformance cases that the simulated worker
    (tessera-sim-worker) must pass as the real one does: run once with each."""
    started = []

    def _worker(model, *flags):
        w = EngineWorker(spawn, model, *F32, *flags, binary=worker_binary)
        started.append(w)
        return w

    yield _worker
    for w in started:
        w.close()


@pytest.fixture
def tiny():
    return TINY / "f32"


@pytest.fixture
def tiny_long(tmp_path):
    """The tiny checkpoint with an 8192-token context.  Only config.json's
    max_position_embeddings changes: the weights do not depend on it, and the llama3
    RoPE scaling is keyed by original_max_position_embeddings (64), which stays."""
    d = tmp_path / "tiny-long"
    d.mkdir()
    for f in (TINY / "f32").iterdir():
        if f.name != "config.json":
            (d / f.name).symlink_to(f)
    cfg = json.loads((TINY / "f32" / "config.json").read_text())
    cfg["max_position_embeddings"] = 8192
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture
def stories():
    if not STORIES.exists():
        skip_because("no-shared-fixtures", f"{STORIES} absent")
    return STORIES


def tiny_golden_prompts():
    g = TINY_GOLDEN["variants"]["f32"]["greedy"]
    return [(p["ids"], g[i]) for i, p in enumerate(TINY_GOLDEN["prompts"])]


def stories_golden_prompts():
    d = json.loads((FORWARD / "stories260K.json").read_text())
    return [(p["ids"], p["greedy"]) for p in d["prompts"]]


def random_prompt(rng, n, vocab):
    return [rng.randrange(3, vocab) for _ in range(n)]


def same(a, b):
    """Bitwise: the same token ids, the same logprob floats (and top lists)."""
    assert a.tokens == b.tokens
    assert len(a.logprobs) == len(b.logprobs)
    for x, y in zip(a.logprobs, b.logprobs):
        assert (x.logprob, x.rank, x.top_ids, x.top_logprobs) == (y.logprob, y.rank, y.top_ids, y.top_logprobs)


def log_softmax(rows):
    rows = rows.astype(np.float64)
    m = rows.max(axis=-1, keepdims=True)
    return rows - m - np.log(np.exp(rows - m).sum(axis=-1, keepdims=True))


# ---------------------------------------------------------------- 64 at once


@pytest.mark.parametrize("budget", ["2048", "96"])
@pytest.mark.parametrize("which", ["tiny", "stories"])
def test_64_concurrent_mixed_lengths(worker, request, which, budget):
    """64 requests of mixed prompt lengths and max_tokens, submitted at once (with a
    small token budget too: chunked prefills mixed with decodes), each equal to itself
    run alone (tokens and logprobs, bitwise) and, for the golden prompts, to
    transformers' greedy continuation."""
    model = request.getfixturevalue(which)
    goldens = tiny_golden_prompts() if which == "tiny" else stories_golden_prompts()
    vocab, ctx = (300, 256) if which == "tiny" else (512, 512)
    rng = random.Random(64)
    reqs = [(ids, len(g), g) for ids, g in goldens]
    while len(reqs) < 64:
        n = rng.choice([1, 2, 5, 16, 17, 33, 64, 100, 150])
        reqs.append((random_prompt(rng, n, vocab), rng.randint(1, min(48, ctx - n - 1)), None))
    w = worker(model, "--max-num-batched-tokens", budget)
    alone = [w.run(f"alone{i}", p, m, logprobs=3) for i, (p, m, _) in enumerate(reqs)]
    assert w.max_step_outputs == 1
    with w.paused():
        for i, (p, m, _) in enumerate(reqs):
            w.submit(f"batch{i}", p, m, logprobs=3)
    batch = w.collect([f"batch{i}" for i in range(64)])
    assert w.max_step_outputs >= 16   # they really ran together
    for i, (p, m, golden) in enumerate(reqs):
        b = batch[f"batch{i}"]
        assert b.finish == "length" and len(b.tokens) == m, (i, b)
        same(b, alone[i])
        if golden is not None:
            assert b.tokens == golden, f"golden prompt {i}"
    s = w.wait_status(lambda s: s["num_running"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"],
                      what="idle with every block free")
    assert s["num_waiting"] == 0


# ---------------------------------------------------------------- chunked prefill


def test_chunked_prefill_5000_token_prompt(worker, tiny_long):
    """A 5,000-token prompt prefilled in one step and in 20 chunks of 256 tokens: the
    same continuation, the same logprobs, and the same prompt logprobs at all 4,999
    scored positions (bitwise)."""
    rng = random.Random(5000)
    prompt = random_prompt(rng, 5000, 300)
    one = worker(tiny_long, "--max-num-batched-tokens", "8192", "--max-model-len", "8192")
    chunked = worker(tiny_long, "--max-num-batched-tokens", "256", "--max-model-len", "8192")
    a = one.run("a", prompt, 8, logprobs=5, prompt_logprobs=1)
    b = chunked.run("b", prompt, 8, logprobs=5, prompt_logprobs=1)
    assert len(a.tokens) == 8 and a.num_prompt_tokens == 5000
    same(a, b)
    assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == 4999
    assert [(x.logprob, x.rank, x.top_ids, x.top_logprobs) for x in a.prompt_logprobs] == \
           [(x.logprob, x.rank, x.top_ids, x.top_logprobs) for x in b.prompt_logprobs]
    # Without prompt logprobs (so the prefix cache is read and written as usual).
    same(one.run("a2", prompt, 8, logprobs=5), chunked.run("b2", prompt, 8, logprobs=5))


# ---------------------------------------------------------------- preemption


def test_preemption_with_tiny_kv_cache_is_token_exact(worker, tiny):
    """32 requests into a KV cache of 40 blocks (8 KiB each on this model: 320 KiB)
    that would need ~200: requests are preempted and recomputed, and every result is
    still bitwise what it is alone on a roomy worker."""
    rng = random.Random(40)
    reqs = [(random_prompt(rng, rng.randint(20, 70), 300), rng.randint(20, 40)) for _ in range(32)]
    roomy = worker(tiny)
    alone = [roomy.run(f"a{i}", p, m, logprobs=2) for i, (p, m) in enumerate(reqs)]
    small = worker(tiny, "--kv-cache-memory", str(40 * 8192))
    assert small.status()["kv_blocks_total"] == 40
    for i, (p, m) in enumerate(reqs):
        small.submit(f"s{i}", p, m, logprobs=2)
    got = small.collect([f"s{i}" for i in range(32)])
    for i in range(32):
        same(got[f"s{i}"], alone[i])
    assert sum(r.num_preemptions for r in got.values()) > 0
    s = small.wait_status(lambda s: s["num_running"] == 0 and s["kv_blocks_free"] == 40, what="idle")
    assert s["num_preemptions_total"] > 0


# ---------------------------------------------------------------- prefix cache


def test_prefix_cache_hit_on_repeated_prompt(conformant, tiny):
    rng = random.Random(7)
    prompt = random_prompt(rng, 100, 300)
    w = conformant(tiny)
    first = w.run("first", prompt, 12, logprobs=4)
    second = w.run("second", prompt, 12, logprobs=4)
    assert first.cached == 0
    assert second.cached == 96            # every full 16-token block of the prompt
    same(first, second)
    # the counters travel in the next Status (every 100 ms): poll, not one read
    wait_until(lambda: w.status()["prefix_cache_hits_total"] >= 96, timeout=10, what="the hits in Status")


def test_status_events_carry_the_prompt_block_hashes(conformant, tiny):
    """The STORED events of Status name exactly the chained block hashes of the
    prompt's full blocks (common/block_hash.h: sha256 by default), which is what a
    router's placement mirror relies on."""
    rng = random.Random(8)
    prompt = random_prompt(rng, 70, 300)
    w = conformant(tiny)
    w.status()                                    # subscribed: events from here on
    w.run("p", prompt, 4)
    parent, chain = 0x9E3779B97F4A7C15, []
    for b in range(len(prompt) // 16):
        m = parent.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in prompt[b * 16:(b + 1) * 16])
        parent = int.from_bytes(hashlib.sha256(m).digest()[:8], "little")
        chain.append(parent)
    wait_until(lambda: w.status() and set(chain) <= w.cached_hashes, timeout=10, what="STORED events of the prompt")


def test_n4_siblings_share_the_prompt_kv(worker, tiny_long):
    """n = 4 arrives as four Submits with one prompt and seeds seed+0..3 (how the
    router fans it out).  The prompt (2,000 tokens) takes 8 steps of 256 to prefill;
    the siblings arrive during the first and wait for it instead of starting beside
    it, then read all 124 full blocks the lookup may use (every block but the one
    holding the last prompt token) from the prefix cache.  Each is bitwise what it is
    alone on a worker without prefix caching."""
    rng = random.Random(4)
    prompt = random_prompt(rng, 2000, 300)
    flags = ("--max-num-batched-tokens", "256", "--max-model-len", "8192")
    ref = worker(tiny_long, "--no-enable-prefix-caching", *flags)
    alone = [ref.run(f"ref{k}", prompt, 16, temperature=0.9, seed=77 + k, logprobs=1) for k in range(4)]
    w = worker(tiny_long, *flags)
    for k in range(4):
        w.submit(f"n{k}", prompt, 16, temperature=0.9, seed=77 + k, logprobs=1)
    got = w.collect([f"n{k}" for k in range(4)])
    assert sorted(got[f"n{k}"].cached for k in range(4)) == [0, 1984, 1984, 1984]
    for k in range(4):
        same(got[f"n{k}"], alone[k])
    assert len({tuple(got[f"n{k}"].tokens) for k in range(4)}) > 1   # four samples, not one


# ---------------------------------------------------------------- abort


def test_abort_mid_generation_frees_blocks(conformant, demo_model):
    w = conformant(demo_model)
    total = w.status()["kv_blocks_total"]
    w.submit("long", [504, 2365, 6354, 16438], 2000)
    wait_until(lambda: w.pump(200) and len(w.results["long"].tokens) >= 2, timeout=60, what="first tokens")
    w.wait_status(lambda s: s["kv_blocks_free"] < total and s["num_running"] == 1, what="the request running")
    w.abort("long")
    s = w.wait_status(lambda s: s["num_running"] == 0 and s["kv_blocks_free"] == total, what="blocks back")
    assert s["kv_blocks_active"] == 0
    w.pump(200)
    r = w.results["long"]
    assert r.finish is None and len(r.tokens) < 2000   # aborted requests get no final Output


# ---------------------------------------------------------------- sampling


def test_seeded_sampling_reproducible(worker, tiny):
    """A seeded request gives the same tokens (and logprobs) alone and among 20 others,
    seeded and unseeded; another seed gives another sample."""
    rng = random.Random(11)
    prompt = random_prompt(rng, 30, 300)
    w = worker(tiny)
    kw = dict(temperature=1.0, top_p=0.95, logprobs=2)
    alone = w.run("alone", prompt, 32, seed=1234, **kw)
    for i in range(20):
        w.submit(f"other{i}", random_prompt(rng, rng.randint(1, 80), 300), 32,
                 seed=(i if i % 2 else None), **kw)
    w.submit("again", prompt, 32, seed=1234, **kw)
    w.submit("other_seed", prompt, 32, seed=1235, **kw)
    got = w.collect(["again", "other_seed"] + [f"other{i}" for i in range(20)])
    same(got["again"], alone)
    assert got["other_seed"].tokens != alone.tokens


# ---------------------------------------------------------------- logprobs


def check_logprobs(w, ids, ref_rows, tol=1e-4):
    """prompt_logprobs (positions 1..n-1) and the first sampled token's logprobs, with
    their top 20, against log_softmax of the reference logits rows (n, vocab)."""
    r = w.run("lp", ids, 1, logprobs=20, prompt_logprobs=20)
    ref = log_softmax(ref_rows)
    assert len(r.prompt_logprobs) == len(ids) - 1
    scored = [(ids[p], ref[p - 1], r.prompt_logprobs[p - 1]) for p in range(1, len(ids))]
    scored.append((r.tokens[0], ref[len(ids) - 1], r.logprobs[0]))
    for tok, row, lp in scored:
        assert abs(lp.logprob - row[tok]) < tol
        # 1-based rank: 1 + how many tokens score higher (near-ties may fall either way)
        assert 1 + int((row > row[tok] + tol).sum()) <= lp.rank <= 1 + int((row > row[tok] - tol).sum())
        assert len(lp.top_ids) == 20
        assert np.allclose(lp.top_logprobs, row[lp.top_ids], atol=tol, rtol=0)
        assert np.allclose(lp.top_logprobs, np.sort(row)[::-1][:20], atol=tol, rtol=0)
    assert r.tokens[0] == int(np.argmax(ref[len(ids) - 1]))


def test_logprobs_equal_log_softmax_of_reference_tiny(worker, tiny):
    rows = np.fromfile(TINY / TINY_GOLDEN["variants"]["f32"]["logits_file"], dtype="<f4").reshape(-1, 300)
    w = worker(tiny)
    at = 0
    for p in TINY_GOLDEN["prompts"]:
        n = len(p["ids"])
        check_logprobs(w, p["ids"], rows[at:at + n])
        at += n


def test_logprobs_equal_log_softmax_of_reference_stories(worker, stories):
    d = json.loads((FORWARD / "stories260K.json").read_text())
    w = worker(stories)
    for p in d["prompts"]:
        rows = np.fromfile(FORWARD / p["logits_file"], dtype="<f4").reshape(len(p["ids"]), -1)
        check_logprobs(w, p["ids"], rows)


def test_smollm2_batch_matches_goldens(worker, demo_model):
    """The realistic model: four golden prompts at once, greedy, equal to transformers'
    continuation (first 12 tokens) and to the same request alone (bitwise)."""
    d = json.loads((FORWARD / "smollm2.json").read_text())
    prompts = [p for p in d["greedy_prompts"] if len(p["ids"]) < 12][:4]
    w = worker(demo_model)
    alone = w.run("alone", prompts[0]["ids"], 12, logprobs=2)
    for i, p in enumerate(prompts):
        w.submit(f"g{i}", p["ids"], 12, logprobs=2)
    got = w.collect([f"g{i}" for i in range(len(prompts))])
    for i, p in enumerate(prompts):
        assert got[f"g{i}"].tokens == p["greedy"][:12], i
    same(got["g0"], alone)


# ---------------------------------------------------------------- shutdown


@pytest.mark.slow_under_sanitizers
def test_sigterm_lets_inflight_finish_within_shutdown_timeout(conformant, demo_model):
    """--shutdown-timeout 60: after SIGTERM a new Submit gets a retryable UNAVAILABLE
    Error (the router retries it elsewhere), the running request still gets all its
    tokens, and the worker exits 0."""
    w = conformant(demo_model, "--shutdown-timeout", "60")
    w.submit("inflight", [504, 2365, 6354, 16438], 48)
    wait_until(lambda: w.pump(200) and len(w.results["inflight"].tokens) >= 1, timeout=60, what="first token")
    w.proc.p.send_signal(signal.SIGTERM)
    w.wait_status(lambda s: s["state"] == 2, what="Status DRAINING")
    w.submit("late", [504, 2365], 4)
    r = w.collect(["inflight", "late"])
    assert r["late"].error is not None and r["late"].error[0] == 3 and r["late"].error[2]   # UNAVAILABLE, retryable
    assert r["inflight"].finish == "length" and len(r["inflight"].tokens) == 48
    assert w.proc.wait(timeout=30) == 0


def test_sigterm_aborts_what_outlasts_the_shutdown_timeout(conformant, demo_model):
    """--shutdown-timeout 2 and a request of 2,000 tokens: it runs on after SIGTERM,
    then ends with finish_reason abort; a request still waiting for a seat (nothing
    produced) is handed back with a retryable Error; the worker exits 0."""
    w = conformant(demo_model, "--shutdown-timeout", "2", "--max-num-seqs", "1")
    w.submit("long", [504, 2365, 6354, 16438], 2000)
    w.submit("queued", [504, 2365, 6354], 2000)
    wait_until(lambda: w.pump(200) and len(w.results["long"].tokens) >= 1, timeout=60, what="first token")
    w.proc.p.send_signal(signal.SIGTERM)
    at_signal = len(w.results["long"].tokens)
    r = w.collect(["long", "queued"], timeout=60)
    assert r["long"].finish == "abort" and len(r["long"].tokens) < 2000
    if not SANITIZED:   # at ~30x slower a 2 s grace may see no further step
        assert len(r["long"].tokens) > at_signal   # it ran on after the signal
    assert r["queued"].error is not None and r["queued"].error[0] == 3 and r["queued"].error[2]
    assert w.proc.wait(timeout=30) == 0
    assert "shutdown timeout" in w.proc.output()


# ---------------------------------------------------------------- through the router


def test_router_n4_prefills_the_prompt_once(serve):
    """`n` = 4 through tessera serve: the router fans it out as four Submits and the
    worker prefills the prompt once; the prefix-cache counters (/metrics, from the
    worker's Status) show the three siblings hitting the prompt's full blocks.  (Here
    the siblings often reach the engine after the first one's one-step prefill anyway;
    test_n4_siblings_share_the_prompt_kv is the case where only the wait gives hits.)"""
    import requests
    s = serve("--served-model-name", "smol", "--kv-cache-memory-bytes", "64M")
    wait_until(lambda: requests.post(s.base + "/tokenize", json={"prompt": "x"}, timeout=5).status_code == 200,
               timeout=30, what="tokenizer ready")
    prompt = ("The history of the Roman Empire is long and full of turns: kings, a republic, "
              "civil wars, emperors good and bad, and finally a slow division and decline")
    body = {"model": "smol", "prompt": prompt, "max_tokens": 4, "n": 4, "temperature": 0.8, "seed": 3}
    r = requests.post(s.base + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["choices"]) == 4
    n_prompt = out["usage"]["prompt_tokens"]
    full_blocks = (n_prompt - 1) // 16
    assert full_blocks >= 2

    def hits():
        for line in requests.get(s.base + "/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0
    wait_until(lambda: hits() >= 3 * 16 * full_blocks, timeout=10, what="prefix-cache hits in /metrics")
