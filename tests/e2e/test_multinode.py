"""A replica over two nodes (issue #20, worker/parallel/nodes.h): `tessera serve MODEL -pp 2
--nnodes 2 --node-rank 0 --master-addr A --master-port P` on node 0 (worker + router) and
the same with `--node-rank 1 --headless` on node 1 (a follower worker, no router), as
vllm serve is started on two machines.  Each node loads only its stage; the step plan
and the activations cross between the processes; the answers are the same text and
logprob floats as -pp 1 in one process (rows without logprobs come back from the last
node as their token, drawn there as node 0 would; also with three nodes, two stages per node, -tp 2
inside each node, the Llama 4 and NemotronH families, and --async-scheduling).  Then the failures: a follower killed under a
streaming load (every stream ends, none hangs; the replica reports itself unhealthy and
answers 503; a new follower makes it serve again, on a new group, with the prefix cache
reset; with --async-scheduling too), a follower restarted by its launcher while node 0 is idle (served again with no
failed request once it is back), a follower of another model refused naming the field,
a node whose peer never comes (a clear error, exit non-zero), the flags vLLM would refuse
or this build does not run, node 0's launcher never giving its worker the master port, and
the same two nodes in two network namespaces."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import requests

import conftest
from conftest import DEMO_MODEL, LAUNCHER, WORKER, free_port, http_status, skip_because, wait_until


class Proc(conftest.Proc):
    """conftest.Proc, remembered until the test ends: a test that fails before it stops
    its nodes must not leave them serving (stop_every_node)."""
    live = []

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        Proc.live.append(self)


@pytest.fixture(autouse=True)
def stop_every_node():
    yield
    live, Proc.live = Proc.live, []
    for p in live:
        p.kill_group()

MODEL = "smol"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
COMMON = ["--served-model-name", MODEL, "--max-model-len", "1024", "--max-num-seqs", "8",
          "--kv-cache-memory-bytes", "128M"]
ENV = dict(os.environ, TESSERA_NODE_JOIN_TIMEOUT="60")


def need_model():
    if not DEMO_MODEL.exists():
        skip_because("not-fetched", f"demo model absent ({DEMO_MODEL}); scripts/fetch-model.sh fetches it")


def node_flags(rank, master_port, master="127.0.0.1", pp=2, nnodes=2):
    return ["-pp", str(pp), "--nnodes", str(nnodes), "--node-rank", str(rank), "--master-addr", master,
            "--master-port", str(master_port)] + (["--headless"] if rank else [])


def ns_prefix(ns):
    return ["ip", "netns", "exec", ns] if ns else []


def leader(tmp_path, name, master_port, *extra, master="127.0.0.1", ns=None, model=DEMO_MODEL, wait=True,
           common=COMMON, pp=2, nnodes=2, env=None):
    port = free_port()
    proc = Proc([*ns_prefix(ns), LAUNCHER, "serve", model, "--host", "127.0.0.1", "--port", port, *common,
                 *node_flags(0, master_port, master, pp, nnodes), *extra], tmp_path / f"{name}.log",
                env=dict(ENV, **(env or {})))
    base = f"http://127.0.0.1:{port}"

    def ready():
        if proc.p.poll() is not None:
            raise AssertionError(proc.output()[-3000:])
        return http_status(base + "/health") == 200
    if wait and not ns:
        try:
            wait_until(ready, timeout=120, interval=0.1, what=f"{name} ready")
        except AssertionError as e:
            raise AssertionError(f"{e}; {every_last_line()}\n{every_log_tail()}") from None
    return proc, base


def every_log_tail(chars=4000):
    """The end of every live node's log: a replica that never gets ready is stuck on
    one of its nodes (a launcher restarts a worker that failed to meet, so no process
    exits)."""
    return "\n".join(f"--- {Path(p.log_path).name} ---\n{log_of(p)[-chars:]}" for p in Proc.live)


def every_last_line():
    """Each node's last log line, for the one line a CI summary shows."""
    def last(p):
        lines = log_of(p).strip().splitlines()
        return lines[-1] if lines else "(empty)"
    return "; ".join(f"{Path(p.log_path).name} ends {last(p)!r}" for p in Proc.live)


def log_of(p):
    """A node's log so far, also once it has been stopped (its log file closed)."""
    return p.output() if not p.log.closed else Path(p.log_path).read_text(errors="replace")


def follower(tmp_path, name, master_port, *extra, master="127.0.0.1", ns=None, model=DEMO_MODEL, launcher=True,
             common=COMMON):
    args = [LAUNCHER, "serve", model] if launcher else [WORKER, model]
    return Proc([*ns_prefix(ns), *args, *common, *node_flags(1, master_port, master), *extra],
                tmp_path / f"{name}.log", env=ENV)


def single(tmp_path, *extra, model=DEMO_MODEL, common=COMMON):
    port = free_port()
    proc = Proc([LAUNCHER, "serve", model, "--host", "127.0.0.1", "--port", port, *common, *extra],
                tmp_path / "single.log", env=ENV)
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: http_status(base + "/health") == 200, timeout=120, interval=0.1, what="pp1 ready")
    return proc, base


def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)


def answers(base):
    """Greedy and seeded completions with top-5 logprobs, then the prompts at once, then
    six longer ones started 20 ms apart (later ones arrive while earlier ones decode)."""
    c = client(base)
    out = []
    for p in PROMPTS:
        for kw in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 1234}):
            r = c.completions.create(model=MODEL, prompt=p, max_tokens=16, logprobs=5, **kw)
            ch = r.choices[0]
            out.append((p, str(kw), ch.text, ch.logprobs.token_logprobs, ch.logprobs.top_logprobs))
    got = [None] * len(PROMPTS)

    def one(i):
        r = c.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=16, temperature=0.7, seed=i, logprobs=2)
        got[i] = (r.choices[0].text, r.choices[0].logprobs.token_logprobs)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.append(("batch", got))
    staggered = [None] * 6

    def longer(i):
        kw = {"temperature": 0.7, "seed": i} if i % 2 else {"temperature": 0}
        r = c.completions.create(model=MODEL, prompt=PROMPTS[i % 3], max_tokens=32, logprobs=2,
                                 extra_body={"ignore_eos": True}, **kw)
        staggered[i] = (r.choices[0].text, r.choices[0].logprobs.token_logprobs)
    threads = [threading.Thread(target=longer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    for t in threads:
        t.join()
    out.append(("staggered", staggered))
    # without logprobs: across nodes the last node sends such a row back as its token
    # (the first maximum; a seeded draw as node 0's sampler draws it), not the row
    for p in PROMPTS:
        for kw, extra in (({"temperature": 0}, {}), ({"temperature": 0.8, "top_p": 0.9, "seed": 7}, {"top_k": 40})):
            r = c.completions.create(model=MODEL, prompt=p, max_tokens=24, extra_body={"ignore_eos": True, **extra},
                                     **kw)
            out.append((p, str(kw), "no logprobs", r.choices[0].text))
    # a logit bias and min_tokens' EOS mask shape the token: across nodes they go with
    # the plan and the last node still answers the token (with its logprobs where asked)
    bias = {"28": 6.0, "30": 4.0, "1792": -100.0}
    for p in PROMPTS[:2]:
        for kw, lp in (({"temperature": 0}, 3), ({"temperature": 0.8, "seed": 11}, None)):
            r = c.completions.create(model=MODEL, prompt=p, max_tokens=12, logit_bias=bias, logprobs=lp,
                                     extra_body={"ignore_eos": True}, **kw)
            ch = r.choices[0]
            out.append((p, str(kw), "logit_bias", ch.text, ch.logprobs.token_logprobs if lp else None))
        # EOS (id 2) pushed up: masked below min_tokens, then taken at once (counted, as
        # vLLM counts it)
        r = c.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0, logit_bias={"2": 100.0},
                                 extra_body={"min_tokens": 5})
        ch = r.choices[0]
        assert ch.finish_reason == "stop" and r.usage.completion_tokens == 6, r
        out.append((p, "min_tokens", ch.text))
    # penalties: the request's tokens so far go with the plan, the last node samples
    for p in PROMPTS[:2]:
        for kw, extra in (({"temperature": 0, "presence_penalty": 1.0}, {}),
                          ({"temperature": 0.8, "seed": 5, "frequency_penalty": 0.7}, {}),
                          ({"temperature": 0}, {"repetition_penalty": 1.3})):
            r = c.completions.create(model=MODEL, prompt=p, max_tokens=12, logprobs=2,
                                     extra_body={"ignore_eos": True, **extra}, **kw)
            ch = r.choices[0]
            out.append((p, str(kw), str(extra), ch.text, ch.logprobs.token_logprobs))
    # a grammar (structured_outputs): across nodes its mask goes with the plan and the last
    # node masks the row before it samples and gathers the logprobs (the regex cannot end
    # within max_tokens: a row at the grammar's end would come back whole)
    for p in PROMPTS[:2]:
        for kw in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}):
            r = c.completions.create(model=MODEL, prompt=p, max_tokens=12, logprobs=2,
                                     extra_body={"structured_outputs": {"regex": "[a-z ,]{60,90}"}}, **kw)
            ch = r.choices[0]
            assert re.fullmatch("[a-z ,]+", ch.text) and ch.finish_reason == "length", ch
            out.append((p, str(kw), "grammar", ch.text, ch.logprobs.token_logprobs))
    # lm-eval's loglikelihood shape (echo + logprobs, one token): across nodes the prompt
    # rows come back as their prompt logprobs, the last (sampled) row whole
    for p in PROMPTS:
        r = requests.post(base + "/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 1,
                                                          "temperature": 0, "logprobs": 3, "echo": True}, timeout=60)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) > 2, lp
        out.append((p, "echo", lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
    return out


def rows_as_token(log, with_logprobs=False):
    """How many logits rows node 0's log says came back from the last node as their token
    (with_logprobs: of those, how many with their logprobs)."""
    m = re.search(r"logits rows from the last node: (\d+) as their token \((\d+) with its logprobs\)", log)
    assert m, log[-3000:]
    return int(m.group(2 if with_logprobs else 1))


def rows_whole(log):
    """How many logits rows node 0's log says came back from the last node whole."""
    m = re.search(r"logits rows from the last node: \d+ as their token \(\d+ with its logprobs\), (\d+) whole", log)
    assert m, log[-3000:]
    return int(m.group(1))


def rows_prompt_lp(log):
    """How many prompt rows node 0's log says came back from the last node as their prompt
    logprobs."""
    m = re.search(r"logits rows from the last node: .*?, \d+ whole, (\d+) as their prompt logprobs", log)
    assert m, log[-3000:]
    return int(m.group(1))


def greedy(base, prompt=PROMPTS[0]):
    r = requests.post(base + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 16,
                                                      "temperature": 0, "logprobs": 1}, timeout=60)
    return r.status_code, r.json()


def stop(proc):
    """SIGTERM to the process group; every process exits 0."""
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(60) == 0, proc.output()[-3000:]
    proc.kill_group()


def two_nodes(tmp_path, *extra, env=None):
    """Node 1 then node 0 on loopback, and node 0's greedy answer."""
    need_model()
    mp = free_port()
    f = follower(tmp_path, "node1", mp, *extra)
    lead, base = leader(tmp_path, "node0", mp, *extra, env=env)
    code, before = greedy(base)
    assert code == 200, before
    return mp, f, lead, base, before


@pytest.mark.parametrize("extra,env", [([], None), (["--async-scheduling"], None),
                                       ([], {"TESSERA_PP_MAX_IN_FLIGHT": "1"})], ids=["micro", "async", "one-step"])
def test_two_nodes_answer_as_one_process(tmp_path, extra, env):
    """By default with micro-batches (up to two steps in the nodes at once: with the
    requests of the last batch started 20 ms apart, node 0 runs stage 0 of one while node
    1 runs the other); with --async-scheduling (the Llama 3.3 70B recipe's: node 0's step
    thread runs one step at a time while its engine thread schedules the next); and one
    step at a time (TESSERA_PP_MAX_IN_FLIGHT=1); the same answers."""
    need_model()
    proc, base = single(tmp_path)
    want = answers(base)
    stop(proc)
    mp = free_port()
    f = follower(tmp_path, "node1", mp, *extra)
    lead, base = leader(tmp_path, "node0", mp, *extra, env=env)
    got = answers(base)
    for w, g in zip(want, got):
        assert w == g, (w, g)
    log0, log1 = lead.output(), f.output()
    assert f"async scheduling {'on' if extra else 'off'}" in log0, log0[-3000:]
    if not extra and not env:
        assert "pipeline micro-batches: up to 2 steps in flight" in log0, log0[-3000:]
        print("two steps in flight at once:", "pipeline micro-batches: 2 steps in flight at once" in log0)
    else:
        assert "pipeline micro-batches: up to" not in log0, log0[-3000:]
        if extra:
            assert "pipeline micro-batches off: --async-scheduling runs one step at a time" in log0, log0[-3000:]
    assert "this one (node rank 0, the leader) runs stage 0: layers [0..14, 15..29]" in log0, log0[-3000:]
    assert "the 2 nodes met" in log0 and "node rank 1: " in log0, log0[-3000:]
    assert "headless: node rank 1 of 2" in log1 and "serving pipeline stage 1" in log1, log1[-3000:]
    # each node holds its stage: the embedding on node 0, the final norm and lm_head on node 1
    assert "layers 0..14 + embedding" in log0 and "layers 15..29 + final norm and lm_head" in log1
    assert "tessera-router" not in log1     # no router on a headless node
    stop(lead)
    log0 = Path(lead.log_path).read_text(errors="replace")
    assert rows_as_token(log0) >= 6 * 24 + 6 * 32       # those without logprobs, and the staggered ones
    # with logprobs (top 2 or 5) the answer is the token and its logprobs, as node 0's
    # sampler computes them: the staggered requests' 6 x 32 rows at least
    assert rows_as_token(log0, with_logprobs=True) >= 6 * 32, log0[-2000:]
    # only the echo requests' sampled rows (one each) came back whole: the logit_bias,
    # min_tokens, penalty and grammar requests' rows as tokens, the echo requests' prompt
    # rows as their prompt logprobs (greedy()'s rows are tokens too)
    assert rows_whole(log0) == len(PROMPTS), log0[-2000:]
    assert rows_prompt_lp(log0) >= 3 * 4, log0[-2000:]
    # node 0 gone cleanly: the follower goes back to the rendezvous; SIGTERM ends it with 0
    wait_until(lambda: "meeting node 0 again" in f.output(), timeout=30, interval=0.1, what="follower rejoins")
    stop(f)


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TINY_COMMON = ["--served-model-name", MODEL, "--max-model-len", "256", "--max-num-seqs", "8",
               "--kv-cache-memory-bytes", "64M", "--dtype", "float32"]


def id_answers(base):
    """Greedy and seeded completions of token-id prompts (12 tokens, top-3 logprobs),
    then both prompts at once."""
    c = client(base)
    out = []
    prompts = ([1, 2, 3, 4, 5], [9, 8, 7])
    for p in prompts:
        for kw in ({"temperature": 0}, {"temperature": 0.9, "seed": 11}):
            r = c.completions.create(model=MODEL, prompt=p, max_tokens=12, logprobs=3,
                                     extra_body={"ignore_eos": True}, **kw)
            ch = r.choices[0]
            out.append((ch.text, ch.logprobs.token_logprobs, ch.logprobs.top_logprobs))
    r = c.completions.create(model=MODEL, prompt=list(prompts), max_tokens=12, temperature=0, logprobs=1,
                             extra_body={"ignore_eos": True})
    out.append([(ch.text, ch.logprobs.token_logprobs) for ch in r.choices])
    return out


@pytest.mark.parametrize("fixture,tp,split", [
    ("tiny-llama3-hf/f32", "2", ("0..0", "1..1")),
    ("tiny-llama4", "2", ("0..1", "2..3")),
    ("tiny-llama4", "1", ("0..1", "2..3")),
    ("tiny-nemotron-h/model", "1", ("0..2", "3..5")),
    ("tiny-nemotron-h/model", "2", ("0..2", "3..5")),
], ids=["llama-tp2", "llama4-tp2", "llama4", "nemotron_h", "nemotron_h-tp2"])
def test_families_over_two_nodes(tmp_path, fixture, tp, split):
    """-pp 2 --nnodes 2 --dtype float32 on the tiny Llama 4 (MoE; a full-attention and a
    chunked-local block table per request: both cross in the plan) and the tiny NemotronH
    (Mamba state slots), and with -tp 2 on the tiny HF Llama 3, the tiny Llama 4 and the
    tiny NemotronH: each node runs its stage (with -tp 2 on two tensor-parallel rank
    threads: the heads (Mamba heads and B/C groups too) and the experts' columns split, the row-parallel layers in R7's canonical split and the comm's
    fixed tree), the nodes hand the activations on; the answers are bitwise those of one
    process at -tp 1 --dtype float32."""
    model = FIXTURES / fixture
    proc, base = single(tmp_path, model=model, common=TINY_COMMON)
    want = id_answers(base)
    stop(proc)
    mp = free_port()
    f = follower(tmp_path, "node1", mp, "-tp", tp, model=model, common=TINY_COMMON)
    lead, base = leader(tmp_path, "node0", mp, "-tp", tp, model=model, common=TINY_COMMON)
    assert id_answers(base) == want
    log0, log1 = lead.output(), f.output()
    on_tp = " on its tensor-parallel rank threads" if tp != "1" else ""
    assert f"runs stage 0{on_tp}: layers [{split[0]}, {split[1]}]" in log0, log0[-3000:]
    stage1 = (f"pipeline stage 1 of 2, tensor parallel rank 1 of 2: layers {split[1]} + final norm and lm_head"
              if tp != "1" else f"pipeline stage 1 of 2: layers {split[1]} + final norm and lm_head")
    assert stage1 in log1, log1[-3000:]
    stop(lead)
    f.kill_group()


def prefix_answers(base):
    """A 40-id prompt twice and once with 10 more ids (greedy, top-3 logprobs, ignore_eos),
    and the prefix-cache hit counter after them."""
    c = client(base)
    stem = [(7 * i + 3) % 290 + 5 for i in range(40)]
    out = []
    for p in (stem, stem, stem + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]):
        r = c.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0, logprobs=3,
                                 extra_body={"ignore_eos": True})
        ch = r.choices[0]
        out.append((ch.text, ch.logprobs.token_logprobs, ch.logprobs.top_logprobs, r.usage.prompt_tokens))
    metrics = requests.get(base + "/metrics", timeout=30).text
    hits = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))
    return out, hits


def test_hybrid_prefix_caching_over_two_nodes(tmp_path):
    """--enable-prefix-caching on the tiny NemotronH across two nodes (-pp 2 --nnodes 2):
    the states kept for hits are saved and restored by each node for its own Mamba
    layers (the step plan carries every chunk's restore and saves); a prompt twice and
    once extended give bitwise the answers of one process with the same flags, and the
    second and third read their first 32 ids from the cache."""
    model = FIXTURES / "tiny-nemotron-h/model"
    common = TINY_COMMON + ["--enable-prefix-caching"]
    proc, base = single(tmp_path, model=model, common=common)
    want, want_hits = prefix_answers(base)
    stop(proc)
    assert want_hits == 32 + 32, want_hits      # 2 of the 40 ids' full blocks, twice
    mp = free_port()
    f = follower(tmp_path, "node1", mp, model=model, common=common)
    lead, base = leader(tmp_path, "node0", mp, model=model, common=common)
    got, hits = prefix_answers(base)
    assert got == want
    assert hits == want_hits
    stop(lead)
    f.kill_group()


@pytest.mark.parametrize("pp,nnodes,logs", [
    (3, 3, ["runs stage 0: layers [0..9, 10..19, 20..29]", "runs stage 1:", "runs stage 2:"]),
    (4, 2, ["runs stages 0..1: layers [0..6, 7..14, 15..22, 23..29]", "runs stages 2..3:"]),
], ids=["3-nodes", "2-stages-per-node"])
def test_more_nodes_and_stages(tmp_path, pp, nnodes, logs):
    """Three nodes (a middle follower receives from node 1 and sends to node 2), and four
    stages on two nodes (each node runs its two stages as rank threads, the second node's
    first stage starting from node 0's output): the answers of one process."""
    need_model()
    proc, base = single(tmp_path)
    want = answers(base)
    stop(proc)
    mp = free_port()
    fs = [Proc([LAUNCHER, "serve", DEMO_MODEL, *COMMON, *node_flags(r, mp, pp=pp, nnodes=nnodes)],
               tmp_path / f"node{r}.log", env=ENV) for r in range(1, nnodes)]
    lead, base = leader(tmp_path, "node0", mp, pp=pp, nnodes=nnodes)
    got = answers(base)
    for w, g in zip(want, got):
        assert w == g, (w, g)
    outs = [lead.output()] + [f.output() for f in fs]
    for out, line in zip(outs, logs):
        assert line in out, out[-3000:]
    stop(lead)
    for f in fs:
        f.kill_group()


@pytest.mark.parametrize("extra,env", [([], None), (["--async-scheduling"], None),
                                       ([], {"TESSERA_PP_MAX_IN_FLIGHT": "1"})], ids=["micro", "async", "one-step"])
def test_follower_killed_under_load_then_replaced(tmp_path, extra, env):
    """With micro-batches (the default) the new group goes in only once no step is in
    the nodes, with --async-scheduling once the step thread's step has ended (engine.h's
    kv_generation); and one step at a time."""
    mp, f, lead, base, before = two_nodes(tmp_path, *extra, env=env)
    ends, chunks = [], [0] * 4

    def stream(i):
        try:
            s = client(base).completions.create(model=MODEL, prompt=PROMPTS[i % 3], max_tokens=400, stream=True,
                                                temperature=0, extra_body={"ignore_eos": True})
            for _ in s:
                chunks[i] += 1
            ends.append(("done", chunks[i]))
        except Exception as e:      # an error event or status: the stream ended, which is the point
            ends.append(("error", type(e).__name__))
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: min(chunks) >= 3, timeout=60, interval=0.05, what="every stream under way")
    os.killpg(f.pid, signal.SIGKILL)      # the follower's launcher and worker: nothing restarts it
    t0 = time.monotonic()
    for t in threads:
        t.join(timeout=60)
    assert all(not t.is_alive() for t in threads), "a stream hung after the follower died"
    # none could finish its 400 tokens: each ended with an error (event or status)
    assert len(ends) == 4 and all(e[0] == "error" or e[1] < 400 for e in ends), ends
    log0 = lead.output()
    assert "replica group 1 failed (closed)" in log0, log0[-3000:]
    # the replica reports itself unhealthy: /health 503, requests 503 (no live replica)
    wait_until(lambda: http_status(base + "/health") == 503, timeout=10, interval=0.1, what="replica down")
    assert time.monotonic() - t0 < 15
    code, body = greedy(base)
    assert code == 503, body
    # a new follower: the nodes meet again (a new epoch), the same answer, the cache reset
    f2 = follower(tmp_path, "node1-new", mp, *extra)
    wait_until(lambda: http_status(base + "/health") == 200, timeout=60, interval=0.1, what="replica back")
    code, after = greedy(base)
    assert code == 200 and after["choices"][0]["text"] == before["choices"][0]["text"], (before, after)
    assert after["choices"][0]["logprobs"]["token_logprobs"] == before["choices"][0]["logprobs"]["token_logprobs"]
    log0 = lead.output()
    assert "the 2 nodes met again (epoch" in log0 and "replica group 2 (epoch" in log0, log0[-3000:]
    assert "prefix cache reset" in log0, log0[-3000:]
    stop(lead)
    f2.kill_group()


def test_follower_killed_while_idle_is_noticed(tmp_path):
    """Node 0 idle, its follower killed (nothing restarts it): node 0's engine drives the
    group's sockets while it waits for work (tsr_nodes_idle), so the replica reports
    itself unhealthy within a few seconds, before any request comes."""
    mp, f, lead, base, before = two_nodes(tmp_path)
    os.killpg(f.pid, signal.SIGKILL)
    t0 = time.monotonic()
    wait_until(lambda: http_status(base + "/health") == 503, timeout=10, interval=0.05, what="replica down")
    print(f"noticed in {time.monotonic() - t0:.2f} s")
    log0 = lead.output()
    assert "replica group 1 failed (closed)" in log0, log0[-3000:]
    code, body = greedy(base)
    assert code == 503, body
    stop(lead)


def test_follower_restarted_while_idle_serves_on(tmp_path):
    mp, f, lead, base, before = two_nodes(tmp_path)
    worker = subprocess.run(["pgrep", "-f", f"tessera-worker.*--node-rank 1 .*--master-port {mp}"],
                            capture_output=True, text=True).stdout.split()
    assert len(worker) == 1, worker
    os.kill(int(worker[0]), signal.SIGKILL)    # its launcher restarts it (0.5 s backoff)
    wait_until(lambda: "the 2 nodes met again" in lead.output(), timeout=60, interval=0.1, what="rejoined")
    # the router hears of the rejoined replica through its next status (ci109: a request
    # sent between the two got 503 "no live worker")
    wait_until(lambda: http_status(base + "/health") == 200, timeout=30, interval=0.05, what="router sees it live")
    code, after = greedy(base)
    assert code == 200 and after["choices"][0] == before["choices"][0], (before, after)
    log0 = lead.output()
    # node 0 ended the group the follower had left: on the restarted follower's hello, or
    # earlier, when its idle poll saw the old one go (whichever came first)
    assert ("a node is meeting the others again: replica group 1 is over" in log0 or
            "replica group 1 failed (closed)" in log0), log0[-3000:]
    assert "handed back" not in log0 and "finishing it with an error" not in log0, log0[-3000:]
    stop(lead)
    f.kill_group()


@pytest.mark.parametrize("extra", [["--async-scheduling"], []], ids=["async", "micro"])
def test_follower_restarted_under_load(tmp_path, extra):
    """Clients keep sending while the follower's worker is killed twice (its launcher
    restarts it): node 0's engine thread schedules ahead of its step thread (async), or
    keeps two steps in the nodes (micro-batches, the default), and each new group goes in
    only with no step in flight.  Every request ends (a stream, an error event or a 503:
    no hang), node 0 stays up, and the replica answers as before once the nodes have met
    again."""
    mp, f, lead, base, before = two_nodes(tmp_path, *extra)
    done = threading.Event()
    ends = []

    def load(i):
        while not done.is_set():
            try:
                s = client(base).completions.create(model=MODEL, prompt=PROMPTS[i % 3], max_tokens=64,
                                                    stream=True, temperature=0, extra_body={"ignore_eos": True})
                n = sum(1 for _ in s)
                ends.append(("done", n))
            except Exception as e:     # an error event or status (the replica down): the point
                ends.append(("error", type(e).__name__))
                time.sleep(0.05)
    threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for rejoin in (1, 2):
        wait_until(lambda: sum(e[0] == "done" for e in ends) >= 3 * rejoin, timeout=60, interval=0.05,
                   what="streams completing")
        worker = subprocess.run(["pgrep", "-f", f"tessera-worker.*--node-rank 1 .*--master-port {mp}"],
                                capture_output=True, text=True).stdout.split()
        assert len(worker) == 1, worker
        os.kill(int(worker[0]), signal.SIGKILL)    # its launcher restarts it (0.5 s backoff)
        wait_until(lambda: lead.output().count("the 2 nodes met again") >= rejoin, timeout=60, interval=0.1,
                   what=f"rejoin {rejoin}")
    wait_until(lambda: http_status(base + "/health") == 200, timeout=60, interval=0.1, what="replica back")
    n_before = len(ends)
    wait_until(lambda: sum(e[0] == "done" for e in ends[n_before:]) >= 3, timeout=60, interval=0.05,
               what="streams completing on the new group")
    done.set()
    for t in threads:
        t.join(timeout=60)
    assert all(not t.is_alive() for t in threads), "a client hung"
    assert lead.p.poll() is None, lead.output()[-3000:]
    code, after = greedy(base)
    assert code == 200 and after["choices"][0] == before["choices"][0], (before, after)
    log0 = lead.output()
    assert f"async scheduling {'on' if extra else 'off'}" in log0 and "replica group 3 (epoch" in log0, log0[-3000:]
    stop(lead)
    f.kill_group()


def test_follower_of_another_model_is_refused(tmp_path):
    need_model()
    other = tmp_path / "other.gguf"
    other.symlink_to(DEMO_MODEL)
    mp = free_port()
    f = follower(tmp_path, "node1", mp, model=other, launcher=False)
    lead = Proc([WORKER, DEMO_MODEL, "--listen", f"tcp://127.0.0.1:{free_port(2)}", *COMMON, *node_flags(0, mp)],
                tmp_path / "node0.log", env=ENV)
    assert lead.wait(60) == 2, lead.output()[-3000:]
    assert f.wait(60) == 2, f.output()[-3000:]
    for log in (lead.output(), f.output()):
        assert ("node rank 1 (host " in log and "has another configuration: 'model=SmolLM2-135M-Instruct.Q4_1.gguf'"
                " on node 0, 'model=other.gguf' there") in log, log[-3000:]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_node_whose_peer_never_comes_exits_non_zero(tmp_path, rank):
    need_model()
    mp = free_port()
    extra = ["--listen", f"tcp://127.0.0.1:{free_port(2)}"] if rank == 0 else []
    p = Proc([WORKER, DEMO_MODEL, *COMMON, *node_flags(rank, mp), *extra], tmp_path / "node.log",
             env=dict(ENV, TESSERA_NODE_JOIN_TIMEOUT="2"))
    assert p.wait(60) == 1, p.output()[-3000:]
    log = p.output()
    want = "node rank 1 did not join within 2000 ms" if rank == 0 else "no answer from node 0 at tcp://127.0.0.1:"
    assert want in log, log[-3000:]


@pytest.mark.parametrize("flags,msg", [
    (["--nnodes", "2"], "argument --nnodes: 2 must divide --pipeline-parallel-size (1): each node runs as many "
                        "pipeline stages"),
    (["--nnodes", "3", "-pp", "4"], "argument --nnodes: 3 must divide --pipeline-parallel-size (4)"),
    (["--nnodes", "2", "-pp", "2", "--node-rank", "1"], "argument --node-rank: 1 runs a follower node: pass --headless"),
    (["--nnodes", "2", "-pp", "2", "--node-rank", "2", "--headless"], "argument --node-rank: 2 must be less than --nnodes 2"),
    (["--headless"], "argument --headless: runs a follower node of a multi-node replica"),
])
def test_bad_flags(tmp_path, flags, msg):
    need_model()
    r = subprocess.run([LAUNCHER, "serve", DEMO_MODEL, *flags], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and msg in r.stderr, (r.returncode, r.stderr)


@pytest.fixture
def narrow_port_namespace():
    """A network namespace whose ephemeral range starts at 10004 (the setting is per
    namespace): a launcher draws its worker's two ports below that range, so from
    10000..10002 only."""
    assert os.geteuid() == 0, "network namespaces need root (the project's machines run tests as root)"
    ns = f"tsr-ports{os.getpid() % 10000}"
    try:
        for cmd in (["ip", "netns", "add", ns], ["ip", "-n", ns, "link", "set", "lo", "up"],
                    ["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.ip_local_port_range=10004 60999"]):
            subprocess.run(cmd, check=True, capture_output=True, timeout=10)
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def test_the_launcher_never_draws_the_master_port(tmp_path, narrow_port_namespace):
    """Node 0's launcher draws its worker's ports while --master-port is still free (its
    worker binds it only to meet the others).  With 10001 the master port and room for
    three pairs (10000, 10001, 10002), the only pair without it is 10002/10003: the nodes
    meet every time (drawn on the master port, node 0's worker could not bind it and was
    restarted for ever, as CI once saw with a replica that never got ready)."""
    need_model()
    ns, mp = narrow_port_namespace, 10001
    for attempt in range(3):        # a launcher that ignored the master port met 1 time in 3
        f = Proc([*ns_prefix(ns), WORKER, DEMO_MODEL, *COMMON, *node_flags(1, mp)], tmp_path / f"node1-{attempt}.log",
                 env=ENV)
        lead = Proc([*ns_prefix(ns), LAUNCHER, "serve", DEMO_MODEL, "--host", "127.0.0.1", "--port", "9000", *COMMON,
                     *node_flags(0, mp)], tmp_path / f"node0-{attempt}.log", env=ENV)
        try:
            wait_until(lambda: "the 2 nodes met" in lead.output(), timeout=60, interval=0.1,
                       what=f"the nodes to meet (attempt {attempt})")
        except AssertionError as e:
            raise AssertionError(f"{e}; {every_last_line()}\n{every_log_tail()}") from None
        assert "(worker at tcp://127.0.0.1:10002)" in lead.output(), lead.output()[-3000:]
        stop(lead)
        f.kill_group()


def test_two_nodes_in_two_network_namespaces(tmp_path, two_namespaces):
    """Node 0 in one namespace, node 1 in another, reached only over the veth pair at
    their own addresses: the answer is the one of one process."""
    need_model()
    proc, base = single(tmp_path)
    code, want = greedy(base)
    stop(proc)
    ns, addrs = two_namespaces
    mp = free_port()
    f = follower(tmp_path, "node1", mp, master=addrs[0], ns=ns[1])
    lead, base = leader(tmp_path, "node0", mp, master=addrs[0], ns=ns[0], wait=False)
    query = ("import json, sys, time, requests\n"
             "for _ in range(1200):\n"
             "    try:\n"
             f"        if requests.get('{base}/health', timeout=5).status_code == 200: break\n"
             "    except Exception: pass\n"
             "    time.sleep(0.1)\n"
             f"r = requests.post('{base}/v1/completions', json={{'model': '{MODEL}', 'prompt': {PROMPTS[0]!r}, "
             "'max_tokens': 16, 'temperature': 0, 'logprobs': 1}, timeout=60)\n"
             "print(json.dumps([r.status_code, r.json()]))\n")
    r = subprocess.run(["ip", "netns", "exec", ns[0], sys.executable, "-c", query], capture_output=True, text=True,
                       timeout=200)
    assert r.returncode == 0, (r.stderr, lead.output()[-3000:], f.output()[-3000:])
    code, got = json.loads(r.stdout)
    assert code == 200 and got["choices"][0]["text"] == want["choices"][0]["text"], (want, got)
    assert got["choices"][0]["logprobs"]["token_logprobs"] == want["choices"][0]["logprobs"]["token_logprobs"]
    log0, log1 = lead.output(), f.output()
    assert "joined from host" in log0 and f"(data endpoint tcp://{addrs[1]}:" in log0, log0[-3000:]
    stop(lead)
    stop(f)
