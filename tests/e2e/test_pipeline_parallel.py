"""Pipeline parallelism inside one worker (issue #20): `tessera serve MODEL -pp N` runs
one rank thread per stage, each holding only its layers, and answers exactly as -pp 1
does: the same text and the same logprob floats (bitwise), greedy and seeded, alone and
batched, because the stages only move bytes (tests/unit/test_parallel.c compares the
logits themselves).  Then the refusals (-tp not dividing the heads, -pp over the layer
count, a bad VLLM_PP_LAYER_PARTITION, -dp), a comm failure in the middle of a step
(the in-flight request ends with an error, the worker stays up and serves the next one
on a new group), and a clean SIGTERM exit.  Tensor parallelism inside one worker too:
-tp 2, -tp 4 and -tp 2 -pp 2 (four rank threads) --dtype float32 on the tiny HF Llama 3
answer bitwise as -tp 1 -pp 1.  The hybrid families (issue #14): the tiny Llama 4
(chunked-local KV groups) and the tiny NemotronH (Mamba state slots) at -pp 2 and 3
answer bitwise as -pp 1, alone and in a concurrent batch; the tiny Llama 4 at -tp 2, -tp
4 and -tp 2 -pp 2 --dtype float32 (its MoE experts split by columns) as -tp 1, and the
tiny NemotronH at -tp 2 and -tp 2 -pp 2 (its Mamba heads, B/C groups and state split)."""
import json
import os
import re
import signal
import subprocess
import threading
import time

import openai
import pytest
import requests

from conftest import (DEMO_MODEL, LAUNCHER, REPO, Proc, free_port, group_alive, http_status, skip_because,
                      wait_until)

MODEL = "smol"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


TINY = REPO / "tests" / "fixtures" / "tiny-llama3-hf" / "f32"   # 4 heads, 2 KV heads, float32
TINY_LLAMA4 = REPO / "tests" / "fixtures" / "tiny-llama4"              # 4 layers: 3 chunked (chunk 8), 1 full
TINY_NEMOTRON_H = REPO / "tests" / "fixtures" / "tiny-nemotron-h"      # 6 layers 'ME*M-E'


STARTED = []     # every server start() made, for _reap


@pytest.fixture(autouse=True)
def _reap():
    """A test that fails between start() and stop_cleanly() leaves no server behind."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.p.poll() is None or group_alive(proc.pid):
            proc.kill_group()


def start(tmp_path, name, *flags, env=None, model=None):
    if model is None and not DEMO_MODEL.exists():
        skip_because("not-fetched", f"demo model absent ({DEMO_MODEL}); scripts/fetch-model.sh fetches it")
    port = free_port()
    proc = Proc([LAUNCHER, "serve", model or DEMO_MODEL, "--host", "127.0.0.1", "--port", port,
                 "--served-model-name", MODEL, "--max-model-len", "1024" if model is None else "256",
                 "--max-num-seqs", "8",
                 "--kv-cache-memory-bytes", "128M", *flags],
                tmp_path / f"{name}.log", env=dict(os.environ, **(env or {})))
    STARTED.append(proc)
    base = f"http://127.0.0.1:{port}"

    def ready():
        if proc.p.poll() is not None:
            raise AssertionError(proc.output())
        return http_status(base + "/health") == 200
    wait_until(ready, timeout=120, interval=0.1, what=f"{name} ready")
    return proc, openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)


def concurrently(n, one, gap=0.0):
    """one(i) for every i < n at once (threads: the requests meet in the engine's
    batches), or each started `gap` seconds after the one before (so later ones arrive
    while earlier ones decode: with -pp they go into another micro-batch); their results,
    in order."""
    out = [None] * n

    def run(i):
        out[i] = one(i)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
        time.sleep(gap)
    for t in threads:
        t.join()
    return out


def answers(client):
    """Every kind of request we compare: greedy and seeded completions with top-5
    logprobs, a greedy chat, and the prompts again concurrently (one batch)."""
    out = []
    for p in PROMPTS:
        for kw in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 1234}):
            r = client.completions.create(model=MODEL, prompt=p, max_tokens=16, logprobs=5, **kw)
            c = r.choices[0]
            out.append((p, str(kw), c.text, c.finish_reason, c.logprobs.token_logprobs, c.logprobs.top_logprobs))
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],
                                       max_tokens=16, temperature=0, logprobs=True, top_logprobs=3)
    out.append(("chat", r.choices[0].message.content,
                [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
                 for t in r.choices[0].logprobs.content]))

    def one(i):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=16, temperature=0.7, seed=i,
                                      logprobs=2)
        return r.choices[0].text, r.choices[0].logprobs.token_logprobs
    out.append(("batch", concurrently(len(PROMPTS), one)))

    def longer(i):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=32, logprobs=2,
                                      extra_body={"ignore_eos": True}, **({"temperature": 0.7, "seed": i} if i % 2 else
                                                                          {"temperature": 0}))
        return r.choices[0].text, r.choices[0].logprobs.token_logprobs
    out.append(("staggered", concurrently(6, longer, gap=0.02)))
    return out


LONG = " ".join(f"item {i}," for i in range(120))   # ~480 tokens: 8 chunks of 64


def long_answers(client):
    """Prompts of several chunks (--max-num-batched-tokens 64): greedy with prompt
    logprobs (every chunk's rows), then three staggered, so with micro-batches a prompt's
    next chunk goes into the model behind the one before it (and beside another's)."""
    r = client.completions.create(model=MODEL, prompt=LONG, max_tokens=8, temperature=0, logprobs=1,
                                  extra_body={"prompt_logprobs": 1})
    out = [(r.choices[0].text, r.choices[0].logprobs.token_logprobs,
            json.dumps(r.model_extra.get("prompt_logprobs") or r.choices[0].model_extra.get("prompt_logprobs")))]

    def one(i):
        r = client.completions.create(model=MODEL, prompt=f"{i}: {LONG}", max_tokens=8, logprobs=2,
                                      **({"temperature": 0.7, "seed": i} if i % 2 else {"temperature": 0}))
        return r.choices[0].text, r.choices[0].logprobs.token_logprobs
    out.append(("staggered long", concurrently(3, one, gap=0.02)))
    return out


def answers_ids(client, prompts):
    """Completions of token-id prompts, each request alone then all at once: greedy (24
    tokens, past Llama 4's chunk of 8) and seeded sampling, with top-5 logprobs."""
    out = []
    kws = ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 1234})
    for ids in prompts:
        for kw in kws:
            r = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, logprobs=5,
                                          extra_body={"ignore_eos": True}, **kw)
            c = r.choices[0]
            out.append((ids, str(kw), c.text, c.logprobs.token_logprobs, c.logprobs.top_logprobs))

    def one(i):
        r = client.completions.create(model=MODEL, prompt=prompts[i // 2], max_tokens=24, logprobs=2,
                                      extra_body={"ignore_eos": True}, **kws[i % 2])
        return r.choices[0].text, r.choices[0].logprobs.token_logprobs
    out.append(("batch", concurrently(2 * len(prompts), one)))
    out.append(("staggered", concurrently(2 * len(prompts), one, gap=0.02)))
    return out


@pytest.mark.parametrize("folder,model,splits", [
    ("tiny-llama4", TINY_LLAMA4, (("2", "0..1, 2..3"), ("3", "0..0, 1..2, 3..3"))),
    ("tiny-nemotron-h", TINY_NEMOTRON_H / "model", (("2", "0..2, 3..5"), ("3", "0..1, 2..3, 4..5"))),
])
def test_hybrid_families_pp_answer_as_pp1(tmp_path, folder, model, splits):
    """`tessera serve <tiny llama4 | tiny nemotron_h> -pp 2` and `-pp 3` (vLLM's split;
    NemotronH's last stage at 3, '-E', keeps no state at all) answer greedy and seeded
    completions with the same text and logprob floats as -pp 1, alone and in a
    concurrent batch: the stages only move bytes, each holding its layers' KV (the whole
    model's block tables) and state slots.  With micro-batches (up to pp steps in flight)
    and a budget of 8 tokens a step, so a prompt's chunks follow each other into the
    stages (Llama 4's chunked-local tables, NemotronH's state slots across chunks)."""
    golden = json.loads(((model.parent if folder == "tiny-nemotron-h" else model) / "golden.json").read_text())
    prompts = [p["ids"] for p in golden["prompts"]]
    budget = ("--max-num-batched-tokens", "8")
    proc, client = start(tmp_path, f"{folder}-pp1", *budget, model=model)
    want = answers_ids(client, prompts)
    stop_cleanly(proc)
    assert all(w[2] for w in want[:-2]), want       # every request answered
    for pp, layers in splits:
        proc, client = start(tmp_path, f"{folder}-pp{pp}", *budget, "-pp", pp, model=model,
                             env={"TESSERA_PP_MAX_IN_FLIGHT": pp})           # micro-batches
        log = proc.output()
        assert f"pipeline parallel: {pp} stages (ranks) in this process, layers [{layers}]" in log, log[-3000:]
        got = answers_ids(client, prompts)
        for w, g in zip(want, got):
            assert w == g, (folder, pp, w, g)
        # micro-batches on; whether the tiny model's 5 ms requests overlapped is timing
        assert_micro_batches(proc, pp)
        stop_cleanly(proc)


def stop_cleanly(proc):
    """SIGTERM to `tessera serve`: it, its router and its worker (with every rank thread)
    exit 0."""
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.output()[-3000:]
    log = proc.output()
    assert "engine stopped" in log and "worker exited with status 0" in log, log[-3000:]


def assert_micro_batches(proc, pp):
    """Micro-batches are on (up to pp steps in flight), and several steps were in flight
    at once: a prompt longer than the step budget (every caller has one) goes in chunk
    behind chunk, whatever the timing.  Whether the staggered requests shared steps is
    timing (tests/unit/test_engine.c's "pipeline micro-batches" groups and
    test_parallel.c's steps in flight are the deterministic checks of the rest)."""
    log = proc.output()
    assert f"pipeline micro-batches: up to {pp} steps in flight" in log, log[-3000:]
    assert "pipeline micro-batches: 2 steps in flight at once" in log, log[-3000:]


def test_pp2_pp3_answer_as_pp1(tmp_path):
    """-pp 2 (one step at a time, the default; with --async-scheduling, where stage 0
    runs on the engine's step thread; with micro-batches, TESSERA_PP_MAX_IN_FLIGHT) and
    -pp 3 split 8,12,10 by VLLM_PP_LAYER_PARTITION with micro-batches, against -pp 1.
    Chunked prefill (a budget of 64 tokens) in every run, so long prompts' chunks follow
    each other into the pipeline."""
    budget = ("--max-num-batched-tokens", "64")
    proc, client = start(tmp_path, "pp1", *budget)
    want = answers(client) + long_answers(client)
    stop_cleanly(proc)
    assert want[-2][2] != "null", want[-2]      # the prompt logprobs came back
    assert want[0][2] and " Paris" in want[0][2]       # a real model answers
    micro = {"TESSERA_PP_MAX_IN_FLIGHT": "3"}
    for name, flags, env in (("pp2", ("-pp", "2"), None),                                  # one step at a time
                             ("pp2-async", ("-pp", "2", "--async-scheduling"), None),   # forward on the step thread
                             ("pp2-micro", ("-pp", "2"), micro),                        # capped at pp: 2 in flight
                             ("pp3-uneven", ("--pipeline-parallel-size", "3"),
                              dict(micro, VLLM_PP_LAYER_PARTITION="8,12,10"))):
        proc, client = start(tmp_path, name, *budget, *flags, env=env)
        log = proc.output()
        assert "pipeline parallel:" in log, log[-2000:]
        if env and "VLLM_PP_LAYER_PARTITION" in env:
            assert "layers [0..7, 8..19, 20..29] (VLLM_PP_LAYER_PARTITION)" in log, log[-2000:]
        got = answers(client) + long_answers(client)
        for w, g in zip(want, got):
            assert w == g, (name, w, g)
        if env:
            assert_micro_batches(proc, flags[-1])
        else:
            assert "micro-batches" not in log, log[-2000:]
        stop_cleanly(proc)


def compare_tp(tmp_path, label, model, stage_layers, collect, grid=(("1", "1"), ("2", "1"), ("4", "1"), ("2", "2"))):
    """`model` served at each (-tp, -pp[, more flags]) of `grid` (by default -tp 1, -tp 2,
    -tp 4 and -tp 2 -pp 2) --dtype float32 (stage s holding layers stage_layers[s]):
    collect(client) from each, every one equal to the first's (-tp 1), which is returned."""
    want = None
    for tp, pp, *more in grid:
        env = dict(m.split("=", 1) for m in more if m.startswith("TESSERA_"))    # an entry's environment
        more = [m for m in more if not m.startswith("TESSERA_")]
        name = f"{label}tp{tp}pp{pp}{'-'.join([''] + [f.strip('-') for f in more])}{'-micro' if env else ''}"
        proc, client = start(tmp_path, name, "--dtype", "float32", "-tp", tp, "-pp", pp, *more, model=model, env=env)
        log = proc.output()
        if pp != "1":
            assert "pipeline parallel: 2 stages x tensor parallel: 2 ranks each = 4 rank threads" in log, log[-3000:]
            for rank, (stage, tp_rank) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
                assert (f"rank {rank}: pipeline stage {stage} of 2, tensor parallel rank {tp_rank} of 2: "
                        f"layers {stage_layers[stage]}") in log, log[-3000:]
        elif tp != "1":
            assert f"tensor parallel rank {int(tp) - 1} of {tp}" in log, log[-3000:]
        got = collect(client)
        stop_cleanly(proc)
        if want is None:
            want = got
        else:
            for w, g in zip(want, got):
                assert w == g, (name, w, g)
    return want


def test_tp2_tp4_tp2pp2_answer_as_tp1(tmp_path):
    """Tensor parallelism in one worker (rank threads over the comm layer's local backend):
    -tp 2 and -tp 4 (4 > the 2 KV heads: each KV head on two ranks) on the tiny HF Llama 3,
    with --dtype float32, answer bitwise as -tp 1 --dtype float32: o_proj and down_proj
    are 8 canonical partial sums added in the comm layer's fixed tree at every -tp (R7).
    -tp 2 -pp 2: four rank threads (rank = stage x 2 + tp rank), each stage's two ranks
    a TP group of their own, stage 1's ranks receiving from their counterparts; and with
    micro-batches (two steps in the grid at once)."""
    compare_tp(tmp_path, "", TINY, ("0..0", "1..1"), answers,
               grid=(("1", "1"), ("2", "1"), ("4", "1"), ("2", "2"), ("2", "2", "TESSERA_PP_MAX_IN_FLIGHT=2")))


def test_llama4_tp2_tp4_tp2pp2_answer_as_tp1(tmp_path):
    """Tensor parallelism for Llama 4: -tp 2, -tp 4 (4 > the 2 KV heads: replicated) and
    -tp 2 -pp 2 --dtype float32 on the tiny Llama 4 answer greedy and seeded completions
    of its golden prompts (24 tokens: past the chunked layers' chunk of 8) with the same
    text and logprob floats as -tp 1 --dtype float32, alone and in a concurrent batch.
    Every expert's, the shared expert's and the dense MLP's columns are split, the router
    replicated; each MoE block adds its shared and routed partials per canonical slice
    and reduces once (R7)."""
    golden = json.loads((TINY_LLAMA4 / "golden.json").read_text())
    prompts = [p["ids"] for p in golden["prompts"]]
    want = compare_tp(tmp_path, "llama4-", TINY_LLAMA4, ("0..1", "2..3"), lambda c: answers_ids(c, prompts))
    assert all(w[2] for w in want[:-2]), want       # every request answered


def test_llama4_expert_parallel_answers_as_tp1(tmp_path):
    """--enable-expert-parallel on the tiny Llama 4 (4 experts): -tp 2 (two experts a rank),
    -tp 4 (one) and -tp 2 -pp 2 answer its golden prompts with the same text and logprob
    floats as -tp 1 without it (the MoE block's all-reduce of every choice's per-slice
    partials, then the tensor-parallel sum in expert order); each rank logs its experts.
    On the dense tiny Llama 3 the flag changes nothing (a log line says so, as vLLM)."""
    golden = json.loads((TINY_LLAMA4 / "golden.json").read_text())
    prompts = [p["ids"] for p in golden["prompts"]]
    ep = "--enable-expert-parallel"
    compare_tp(tmp_path, "llama4-", TINY_LLAMA4, ("0..1", "2..3"), lambda c: answers_ids(c, prompts),
               grid=(("1", "1"), ("2", "1", ep), ("4", "1", ep), ("2", "2", ep)))
    log = (tmp_path / "llama4-tp4pp1-enable-expert-parallel.log").read_text()
    for r in range(4):
        assert f"expert parallel rank {r} of 4: routed experts {r}..{r} of 4 (1 local)" in log, log[-3000:]
    proc, client = start(tmp_path, "dense-ep", "--dtype", "float32", "-tp", "2", ep, model=TINY)
    assert "--enable-expert-parallel: model family llama has no MoE layers, so it changes nothing" in \
        proc.output(), proc.output()[-3000:]
    stop_cleanly(proc)


def test_nemotron_h_tp2_tp2pp2_answer_as_tp1(tmp_path):
    """Tensor parallelism for NemotronH: -tp 2 and -tp 2 -pp 2 --dtype float32 on the tiny
    NemotronH ('ME*M-E') answer greedy and seeded completions of its golden prompts with
    the same text and logprob floats as -tp 1 --dtype float32, alone and in a concurrent
    batch.  A rank holds 4 of the 8 Mamba heads with their one B/C group (its in_proj
    rows, conv channels, A / D / dt_bias, gated-norm weights and state slots' channels),
    2 of the 4 attention heads and 1 of the 2 KV heads, and its columns of every expert,
    the shared expert and the dense MLP; out_proj, o_proj and the down projections sum 8
    canonical partials in the comm layer's fixed tree (R7).  -tp 4 does not divide the 2
    groups (test_refused)."""
    golden = json.loads((TINY_NEMOTRON_H / "golden.json").read_text())
    prompts = [p["ids"] for p in golden["prompts"]]
    want = compare_tp(tmp_path, "nemotron-h-", TINY_NEMOTRON_H / "model", ("0..2", "3..5"),
                      lambda c: answers_ids(c, prompts), grid=(("1", "1"), ("2", "1"), ("2", "2")))
    assert all(w[2] for w in want[:-2]), want       # every request answered


def test_bf16_tp_without_dtype_float32(tmp_path):
    """`-tp N` with bf16 weights (what vLLM serves a bf16 checkpoint with; no --dtype
    float32): the tiny Llama 3 at -tp 2 and -tp 4 --dtype bfloat16 give the same text and
    logprob floats (each rank converts its float32 split; every canonical slice's partial
    is the bf16 matmul's), the log says bfloat16; and Llama 4 at -tp 2 with --dtype auto
    serves."""
    want = compare_tp(tmp_path, "bf16-", TINY, ("0..0", "1..1"), answers,
                      grid=(("2", "1", "--dtype", "bfloat16"), ("4", "1", "--dtype", "bfloat16")))
    assert all(w[4] for w in want[:-3]), want           # every completion has its logprobs
    log = (tmp_path / "bf16-tp2pp1-dtype-bfloat16.log").read_text()
    assert "matmul weights held as bfloat16" in log, log[-3000:]
    proc, client = start(tmp_path, "llama4-auto-tp2", "-tp", "2", model=TINY_LLAMA4)
    r = client.completions.create(model=MODEL, prompt=[1, 5, 9], max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4
    stop_cleanly(proc)


def test_nemotron_h_expert_parallel_answers_as_tp1(tmp_path):
    """--enable-expert-parallel on the tiny NemotronH (8 experts, top-2): -tp 2 (experts
    0-3 and 4-7) and -tp 2 -pp 2 answer as -tp 1 without it (text and logprob floats)."""
    golden = json.loads((TINY_NEMOTRON_H / "golden.json").read_text())
    prompts = [p["ids"] for p in golden["prompts"]]
    ep = "--enable-expert-parallel"
    compare_tp(tmp_path, "nemotron-h-", TINY_NEMOTRON_H / "model", ("0..2", "3..5"),
               lambda c: answers_ids(c, prompts), grid=(("1", "1"), ("2", "1", ep), ("2", "2", ep)))
    log = (tmp_path / "nemotron-h-tp2pp1-enable-expert-parallel.log").read_text()
    for r in range(2):
        assert f"expert parallel rank {r} of 2: routed experts {4 * r}..{4 * r + 3} of 8 (4 local)" in log, \
            log[-3000:]


@pytest.mark.parametrize("flags,env,words", [
    (("-tp", "2"), None, "Total number of attention heads (9) must be divisible by tensor parallel size (2)."),
    (("-tp", "3"), None, "argument --tensor-parallel-size: 3 must divide 8"),
    (("-tp", "3", "--dtype", "float32"), None, "argument --tensor-parallel-size: 3 must divide 8"),
    (("-pp", "31"), None, "--pipeline-parallel-size 31 is greater than the model's 30 hidden layers"),
    (("-tp", "2", "-pp", "2"), None,
     "Total number of attention heads (9) must be divisible by tensor parallel size (2)."),
    (("-tp", "2", "-pp", "3", "--dtype", "float32", "tiny"), None,
     "--pipeline-parallel-size 3 is greater than the model's 2 hidden layers"),
    (("-tp", "3", "-pp", "2", "--dtype", "float32", "tiny"), None,
     "Total number of attention heads (4) must be divisible by tensor parallel size (3)."),
    (("-tp", "8", "--dtype", "float32", "tiny-llama4"), None,
     "Total number of attention heads (4) must be divisible by tensor parallel size (8)."),
    (("-tp", "3", "-pp", "2", "--dtype", "float32", "tiny-llama4"), None,
     "Total number of attention heads (4) must be divisible by tensor parallel size (3)."),
    (("-tp", "4", "--dtype", "float32", "tiny-nemotron-h"), None,
     "If tensor parallel world size does not divide num_groups, then num_groups must equal 1. "
     "(n_groups 2, tensor parallel size 4)"),
    (("-tp", "4", "-pp", "2", "--dtype", "float32", "tiny-nemotron-h"), None,
     "If tensor parallel world size does not divide num_groups, then num_groups must equal 1."),
    (("-tp", "3", "--dtype", "float32", "tiny-nemotron-h"), None,
     "Total number of attention heads (4) must be divisible by tensor parallel size (3)."),
    (("-pp", "3"), {"VLLM_PP_LAYER_PARTITION": "8,12"}, "len(partition_list)=2 does not match pp_size=3."),
    (("-pp", "2"), {"VLLM_PP_LAYER_PARTITION": "10,10"},
     "sum(partition_list)=20 does not match num_hidden_layers=30."),
    (("-dp", "2"), None, "argument --data-parallel-size: 2 is not supported: a worker is one replica"),
])
def test_refused(tmp_path, flags, env, words):
    """Refused at start-up, before any socket: `tessera serve` exits 2 with the line."""
    model = DEMO_MODEL
    tiny = {"tiny": TINY,           # the tiny HF Llama 3 (2 layers, 4 heads, 2 KV heads)
            "tiny-llama4": TINY_LLAMA4, "tiny-nemotron-h": TINY_NEMOTRON_H / "model"}
    if flags[-1] in tiny:
        flags, model = flags[:-1], tiny[flags[-1]]
    elif not DEMO_MODEL.exists():
        skip_because("not-fetched", f"demo model absent ({DEMO_MODEL}); scripts/fetch-model.sh fetches it")
    r = subprocess.run([str(LAUNCHER), "serve", str(model), "--port", str(free_port()), *flags],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, **(env or {})))
    assert r.returncode == 2, r.stdout + r.stderr
    assert words in r.stdout + r.stderr, r.stdout + r.stderr


def test_comm_abort_mid_step_fails_the_request_and_serves_on(tmp_path):
    """TESSERA_TEST_PP_ABORT_AT_STEP=3: the last stage aborts the pipeline's comm in the
    third step, as a failing rank would.  The streaming request in flight has had two
    tokens; it ends with an error instead of a third, never a hang.  The worker stays up:
    the next requests run on a new group (epoch 2) and answer as before the failure."""
    proc, client = start(tmp_path, "abort", "-pp", "2", env={"TESSERA_TEST_PP_ABORT_AT_STEP": "3"})
    texts = []
    with pytest.raises(openai.APIError):
        for ev in client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                            stream=True):
            texts.append(ev.choices[0].text)
    assert len(texts) == 2, texts                  # steps 1 and 2 produced a token each
    log = proc.output()
    assert "pipeline: step 3 failed in the comm (cancelled)" in log and "finishing it with an error" in log, log
    a = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    b = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.choices[0].text.startswith("".join(texts))
    assert a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 16
    r = requests.get(client.base_url.scheme + "://" + client.base_url.host + ":" + str(client.base_url.port)
                     + "/health", timeout=5)
    assert r.status_code == 200
    stop_cleanly(proc)


def test_tp2pp2_comm_abort_then_serves_and_exits_cleanly(tmp_path):
    """The same failure with -tp 2 -pp 2 (four rank threads, three local groups: the grid's
    and each stage's TP group): both ranks of the last stage abort in step 3, the request
    fails (the tiny tokenizer's first tokens may still be held back by the detokenizer,
    so the router answers 500 or ends the stream with an error), the next request runs on
    a new grid (epoch 2) and answers as an undisturbed one, and SIGTERM stops every rank
    thread (exit 0)."""
    proc, client = start(tmp_path, "tp2pp2-abort", "--dtype", "float32", "-tp", "2", "-pp", "2", model=TINY,
                         env={"TESSERA_TEST_PP_ABORT_AT_STEP": "3"})
    texts = []
    with pytest.raises(openai.APIError):
        for ev in client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}):
            texts.append(ev.choices[0].text)
    assert len(texts) <= 2, texts                 # steps 1 and 2 made two tokens, step 3 failed
    log = proc.output()
    assert "pipeline: step 3 failed in the comm (cancelled)" in log and "(epoch 2) serves the next step" in log, log
    assert "pipeline rank 3 (stage 1, tp rank 1): step 3: cancelled" in log, log[-3000:]
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.choices[0].text.startswith("".join(texts))
    assert a.usage.completion_tokens == 16
    stop_cleanly(proc)


def test_sigterm_mid_stream_exits_cleanly(tmp_path):
    """SIGTERM while a -pp 3 worker streams: the stream ends (finished or with an error,
    never a hang), and `tessera serve` with its worker and all three rank threads exits 0
    within the shutdown grace."""
    proc, client = start(tmp_path, "sigterm", "-pp", "3")
    got, done = [], threading.Event()

    def stream():
        try:
            for ev in client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=400, temperature=0,
                                                extra_body={"ignore_eos": True}, stream=True):
                got.append(ev.choices[0].text)
        except Exception:   # an error event or a closed connection: either ends the stream
            pass
        done.set()
    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: len(got) >= 2, timeout=60, what="two streamed tokens")
    stop_cleanly(proc)
    assert done.wait(30), "the stream did not end after the server stopped"
    t.join(5)
    assert len(got) < 400


def test_model_info_reports_tp_and_pp(spawn):
    """ModelInfo (the worker's answer to Hello, what a router reads) carries the parallel
    sizes: 1 and 1 without, 2 and 2 for -tp 2 -pp 2; and a Submit on the wire gets the
    same tokens and logprob floats (prompt logprobs too) from both workers."""
    from engine_client import EngineWorker
    got = {}
    for tp, pp in ((1, 1), (2, 2)):
        w = EngineWorker(spawn, str(TINY), "--dtype", "float32", "-tp", str(tp), "-pp", str(pp),
                         "--kv-cache-memory-bytes", "64M", "--max-model-len", "256")
        try:
            assert w.info[20] == [tp] and w.info[21] == [pp], w.info     # tensor_/pipeline_parallel_size
            r = w.run("a", [1, 17, 42, 128, 250, 3, 9], 12, temperature=0.8, seed=7, logprobs=3, prompt_logprobs=2)
            assert r.error is None and r.finish == "length" and len(r.tokens) == 12, r
            assert len(r.logprobs) == 12 and len(r.prompt_logprobs) == 6, r
            got[(tp, pp)] = (r.tokens, r.logprobs, r.prompt_logprobs)
        finally:
            w.close()
    assert got[(1, 1)] == got[(2, 2)]


def tied_copy(src, dst):
    """`src` with tie_word_embeddings true (every config level that has it) and no
    lm_head tensor: the output matrix is the embedding table."""
    import shutil

    from safetensors.numpy import load_file, save_file
    dst.mkdir()
    for f in src.iterdir():
        if not f.name.endswith(".safetensors") and f.is_file():
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    for c in (cfg, cfg.get("text_config") or {}):
        if "tie_word_embeddings" in c:
            c["tie_word_embeddings"] = True
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update({k: v for k, v in load_file(f).items() if not k.endswith("lm_head.weight")})
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("family", ["llama4", "nemotron_h"])
def test_tied_last_stage_reads_its_lm_head_rows(tmp_path, family):
    """A tied model at -tp 2 -pp 2: the last stage does not embed, so each of its ranks
    reads only its vocabulary rows of the embedding table, as its lm_head share (issue
    #20); the answers are those of -tp 1 -pp 1, text and logprob floats (--dtype
    float32: R7's canonical sums)."""
    src, layers = ((TINY_LLAMA4, ("0..1", "2..3")) if family == "llama4"
                   else (TINY_NEMOTRON_H / "model", ("0..2", "3..5")))
    golden = json.loads(((TINY_LLAMA4 if family == "llama4" else TINY_NEMOTRON_H) / "golden.json").read_text())
    prompts = [p["ids"] for p in golden["prompts"]]
    model = tied_copy(src, tmp_path / f"{family}-tied")
    want = compare_tp(tmp_path, f"{family}-tied-", model, layers, lambda c: answers_ids(c, prompts),
                      grid=(("1", "1"), ("2", "2")))
    assert all(w[2] for w in want[:-2]), want
    log = (tmp_path / f"{family}-tied-tp2pp2.log").read_text()
    for rank in (2, 3):         # stage 1: the tied lm_head's share, read from the file
        assert re.search(rf"rank {rank}: pipeline stage 1 of 2, .*the share of its layers, read straight from the "
                         rf"file", log), log[-3000:]
