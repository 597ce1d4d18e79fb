"""--async-scheduling through the real worker process: the engine schedules step N+1
while a step thread computes step N (forward and sampling), with one placeholder per
token N will sample.  What a router sees must not change: for the same requests, in
the same order, a worker with the flag and one without give the same tokens, logprob
floats (bitwise), prompt logprobs, finish reasons, stop token ids and num_generated;
max_tokens is exact (a request that ends in step N never computes N+1's token); every
KV block is free again afterwards.  The engine's unit tests (tests/unit/test_engine.c)
run every scheduler case both ways with a fake model; these run the real model."""
import random
import signal

import pytest

from conftest import wait_until
from test_engine_worker import (FORWARD, random_prompt, same, stories, tiny, tiny_long,  # noqa: F401 (fixtures)
                                worker)

ASYNC = "--async-scheduling"


def same_result(a, b, what):
    """Everything an Output carries, sync vs async."""
    same(a, b)
    assert (a.finish, a.num_generated, a.stop_token_id, a.error) == (b.finish, b.num_generated, b.stop_token_id,
                                                                     b.error), what
    assert len(a.prompt_logprobs) == len(b.prompt_logprobs), what
    for x, y in zip(a.prompt_logprobs, b.prompt_logprobs):
        assert (x.logprob, x.rank, x.top_ids, x.top_logprobs) == (y.logprob, y.rank, y.top_ids, y.top_logprobs)


def idle_and_free(w):
    s = w.wait_status(lambda s: s["num_running"] == 0 and s["num_waiting"] == 0 and
                      s["kv_blocks_free"] == s["kv_blocks_total"], what="idle with every block free")
    assert s["kv_blocks_active"] == 0
    return s


def mixed_requests(rng, vocab, ctx, n=64):
    """(prompt, max_tokens, kind) of mixed lengths; kind picks the sampling options."""
    reqs = []
    for i in range(n):
        plen = rng.choice([1, 2, 5, 16, 17, 33, 64, 100, 150])
        max_tokens = 1 if i % 8 == 2 else rng.randint(2, min(48, ctx - plen - 1))
        reqs.append((random_prompt(rng, plen, vocab), max_tokens, i % 8))
    return reqs


def submit_kind(w, rid, prompt, max_tokens, kind, stop=None):
    kw = dict(logprobs=3)
    if kind == 1:
        kw.update(temperature=0.9, top_p=0.95, seed=1000 + len(prompt) + max_tokens, logprobs=1)
    elif kind == 5 and len(prompt) > 1:
        kw.update(prompt_logprobs=2)
    elif kind == 6:
        kw.update(ignore_eos=False)                    # the model's EOS may end it
    elif kind == 7:
        kw.update(temperature=1.0, logprobs=0)         # unseeded: keyed by the admission order
    if stop is not None:
        kw.update(stop_token_ids=[stop[0]], min_tokens=stop[1])
    w.submit(rid, prompt, max_tokens, **kw)


@pytest.mark.parametrize("budget", ["2048", "96"])
@pytest.mark.parametrize("which", ["tiny", "stories"])
def test_64_concurrent_same_with_and_without_async(worker, request, which, budget):
    """64 mixed requests at once on a worker with --async-scheduling and one without:
    greedy, seeded and unseeded sampling, max_tokens 1, logprobs, prompt logprobs, EOS;
    then again with stop_token_ids taken from the first round's tokens (some under
    min_tokens, which masks them), so requests end by a stop id mid-batch."""
    model = request.getfixturevalue(which)
    vocab, ctx = (300, 256) if which == "tiny" else (512, 512)
    reqs = mixed_requests(random.Random(4096), vocab, ctx)
    sync = worker(model, "--max-num-batched-tokens", budget)
    asy = worker(model, "--max-num-batched-tokens", budget, ASYNC)
    ids = [f"a{i}" for i in range(len(reqs))]
    for w in (sync, asy):
        with w.paused():   # all 64 at once: without it, how many share a step depends on the load
            for rid, (p, m, kind) in zip(ids, reqs):
                submit_kind(w, rid, p, m, kind)
    a, b = sync.collect(ids), asy.collect(ids)
    assert asy.max_step_outputs >= 16   # they really ran together
    for rid, (p, m, kind) in zip(ids, reqs):
        same_result(a[rid], b[rid], rid)
        r = b[rid]
        assert len(r.tokens) == r.num_generated <= m, rid
        if kind == 6:   # EOS honoured: "stop" at any length, "length" only at max_tokens
            assert r.finish == "stop" or (r.finish == "length" and len(r.tokens) == m), rid
        else:
            assert r.finish == "length" and len(r.tokens) == m, rid
    # Round 2: stop ids that do occur.  Kind 3: the token at index 4 (ends there or
    # earlier); kind 4: the first token, under min_tokens 3 (masked for 3 tokens).
    stops = {}
    for rid, (p, m, kind) in zip(ids, reqs):
        toks = a[rid].tokens
        if kind == 3 and len(toks) > 4:
            stops[rid] = (toks[4], 0)
        elif kind == 4 and len(toks) > 4:
            stops[rid] = (toks[0], 3)
    ids2 = [f"b{i}" for i in range(len(reqs))]
    for w in (sync, asy):
        for rid, rid1, (p, m, kind) in zip(ids2, ids, reqs):
            submit_kind(w, rid, p, m, kind, stops.get(rid1))
    a2, b2 = sync.collect(ids2), asy.collect(ids2)
    n_stopped = 0
    for rid, rid1, (p, m, kind) in zip(ids2, ids, reqs):
        same_result(a2[rid], b2[rid], rid)
        r = b2[rid]
        assert len(r.tokens) == r.num_generated <= m, rid
        if rid1 in stops and r.finish == "stop":
            n_stopped += 1
            assert r.stop_token_id == stops[rid1][0] and r.tokens[-1] == r.stop_token_id, rid
            assert len(r.tokens) > stops[rid1][1], rid   # min_tokens masked it for that many tokens
    assert n_stopped >= 4
    for w in (sync, asy):
        idle_and_free(w)


def test_preemption_with_tiny_kv_cache_same_with_async(worker, tiny):
    """32 requests into 40 KV blocks (~200 needed): preempted and recomputed, with
    async scheduling preempting requests whose step is still running; every result is
    bitwise the synchronous one and every block comes back."""
    rng = random.Random(40)
    reqs = [(random_prompt(rng, rng.randint(20, 70), 300), rng.randint(20, 40)) for _ in range(32)]
    got = []
    for flags in ((), (ASYNC,)):
        w = worker(tiny, "--kv-cache-memory", str(40 * 8192), *flags)
        assert w.status()["kv_blocks_total"] == 40
        for i, (p, m) in enumerate(reqs):
            w.submit(f"s{i}", p, m, logprobs=2)
        got.append(w.collect([f"s{i}" for i in range(32)]))
        s = idle_and_free(w)
        assert s["num_preemptions_total"] > 0
    for i, (p, m) in enumerate(reqs):
        same_result(got[0][f"s{i}"], got[1][f"s{i}"], i)
        assert len(got[1][f"s{i}"].tokens) == m
    assert sum(r.num_preemptions for r in got[1].values()) > 0


def test_prefix_cache_hits_with_async(worker, tiny, tiny_long):
    """A repeated prompt hits every full block; n = 4 siblings that arrive during the
    first one's 8-step prefill wait for it and hit its 124 readable blocks, as without
    the flag, and sample the same (seeded) tokens as alone on a cache-less worker."""
    rng = random.Random(7)
    prompt = random_prompt(rng, 100, 300)
    w = worker(tiny, ASYNC)
    first = w.run("first", prompt, 12, logprobs=4)
    second = w.run("second", prompt, 12, logprobs=4)
    assert (first.cached, second.cached) == (0, 96)
    same(first, second)

    prompt = random_prompt(random.Random(4), 2000, 300)
    flags = ("--max-num-batched-tokens", "256", "--max-model-len", "8192")
    ref = worker(tiny_long, "--no-enable-prefix-caching", *flags)
    alone = [ref.run(f"ref{k}", prompt, 16, temperature=0.9, seed=77 + k, logprobs=1) for k in range(4)]
    w = worker(tiny_long, ASYNC, *flags)
    for k in range(4):
        w.submit(f"n{k}", prompt, 16, temperature=0.9, seed=77 + k, logprobs=1)
    got = w.collect([f"n{k}" for k in range(4)])
    assert sorted(got[f"n{k}"].cached for k in range(4)) == [0, 1984, 1984, 1984]
    for k in range(4):
        same(got[f"n{k}"], alone[k])
    idle_and_free(w)


def test_abort_mid_generation_frees_blocks_with_async(worker, demo_model):
    """Aborts reach the engine thread while the step thread computes the request's step:
    it is freed when that step returns, gets no final Output, and every block is back."""
    w = worker(demo_model, ASYNC)
    total = w.status()["kv_blocks_total"]
    for k in range(3):
        w.submit(f"long{k}", [504, 2365, 6354, 16438 + k], 2000)
    wait_until(lambda: w.pump(200) and all(len(w.results[f"long{k}"].tokens) >= 2 for k in range(3)),
               timeout=60, what="first tokens")
    for k in range(3):
        w.abort(f"long{k}")
    s = w.wait_status(lambda s: s["num_running"] == 0 and s["kv_blocks_free"] == total, what="blocks back")
    assert s["kv_blocks_active"] == 0
    w.pump(200)
    for k in range(3):
        r = w.results[f"long{k}"]
        assert r.finish is None and len(r.tokens) < 2000


def test_smollm2_goldens_with_async(worker, demo_model):
    """The realistic model with the flag: four golden prompts at once equal
    transformers' greedy continuation, and the same requests without the flag."""
    import json
    d = json.loads((FORWARD / "smollm2.json").read_text())
    prompts = [p for p in d["greedy_prompts"] if len(p["ids"]) < 12][:4]
    got = []
    for flags in ((), (ASYNC,)):
        w = worker(demo_model, *flags)
        for i, p in enumerate(prompts):
            w.submit(f"g{i}", p["ids"], 12, logprobs=2)
        got.append(w.collect([f"g{i}" for i in range(len(prompts))]))
    for i, p in enumerate(prompts):
        assert got[1][f"g{i}"].tokens == p["greedy"][:12], i
        same_result(got[0][f"g{i}"], got[1][f"g{i}"], i)


@pytest.mark.slow_under_sanitizers
def test_sigterm_drain_with_async(worker, demo_model):
    """SIGTERM with --shutdown-timeout 60: the running request gets all its tokens (the
    step in flight is applied before the engine stops), a late Submit is refused
    (retryable), the worker exits 0."""
    w = worker(demo_model, "--shutdown-timeout", "60", ASYNC)
    w.submit("inflight", [504, 2365, 6354, 16438], 48)
    wait_until(lambda: w.pump(200) and len(w.results["inflight"].tokens) >= 1, timeout=60, what="first token")
    w.proc.p.send_signal(signal.SIGTERM)
    w.wait_status(lambda s: s["state"] == 2, what="Status DRAINING")
    w.submit("late", [504, 2365], 4)
    r = w.collect(["inflight", "late"])
    assert r["late"].error is not None and r["late"].error[0] == 3 and r["late"].error[2]
    assert r["inflight"].finish == "length" and len(r["inflight"].tokens) == 48
    assert w.proc.wait(timeout=30) == 0


def test_sigterm_timeout_aborts_with_async(worker, demo_model):
    """--shutdown-timeout 2: the long request ends with finish abort after the step in
    flight returns, the queued one is handed back (retryable Error), exit 0."""
    w = worker(demo_model, "--shutdown-timeout", "2", "--max-num-seqs", "1", ASYNC)
    w.submit("long", [504, 2365, 6354, 16438], 2000)
    w.submit("queued", [504, 2365, 6354], 2000)
    wait_until(lambda: w.pump(200) and len(w.results["long"].tokens) >= 1, timeout=60, what="first token")
    w.proc.p.send_signal(signal.SIGTERM)
    r = w.collect(["long", "queued"], timeout=60)
    assert r["long"].finish == "abort" and len(r["long"].tokens) < 2000
    assert r["long"].num_generated == len(r["long"].tokens)
    assert r["queued"].error is not None and r["queued"].error[0] == 3 and r["queued"].error[2]
    assert w.proc.wait(timeout=30) == 0
    assert "shutdown timeout" in w.proc.output()
