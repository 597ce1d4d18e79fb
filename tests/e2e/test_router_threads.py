"""--router-threads N: N event loops on one port (SO_REUSEPORT), each a router of its
own to the workers, one metrics registry.  Requests spread over the loops all
succeed, /metrics counts each once (the engine series are fed by one loop only: the
prompt-token total equals the sum of the responses' usage), and SIGTERM stops them all."""
import concurrent.futures
import os
import re
import signal

import requests

from conftest import wait_until


def value(text, prefix):
    lines = [l for l in text.splitlines() if l.startswith(prefix)]
    return sum(float(l.rsplit(" ", 1)[1]) for l in lines)


def test_three_loops_share_the_port(serve):
    s = serve("--router-threads", "3", "--served-model-name", "smol")
    # /health is 200 only once every loop has a live worker and its tokenizer: a
    # completion right after it must not meet a loop still loading (CI saw a 503 when
    # this waited for one /tokenize, which reached one loop only)
    wait_until(lambda: requests.get(s.base + "/health", timeout=5).status_code == 200,
               timeout=60, interval=0.1, what="every loop ready")
    router = s.router_pid()
    names = {open(f"/proc/{router}/task/{t}/comm").read().strip() for t in os.listdir(f"/proc/{router}/task")}
    assert {"loop1", "loop2"} <= names, names
    log = s.proc.output()
    assert len(re.findall(r"listening on http://127\.0\.0\.1:\d+ \(SO_REUSEPORT\)", log)) == 3
    # the worker sees three routers
    wait_until(lambda: len(set(re.findall(r"hello from router (\S+)", s.proc.output()))) >= 3, timeout=30,
               what="three router identities at the worker")

    before = requests.get(s.base + "/metrics", timeout=5).text

    def one(i):
        # a new connection each: SO_REUSEPORT spreads connections, not requests
        with requests.Session() as c:
            r = c.post(s.base + "/v1/completions", timeout=120,
                       json={"model": "smol", "prompt": f"Count to {i}:", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        prompt_tokens = sum(pool.map(one, range(24)))

    def settled():
        after = requests.get(s.base + "/metrics", timeout=5).text
        got = value(after, 'vllm:prompt_tokens_total{') - value(before, 'vllm:prompt_tokens_total{')
        return after if got >= prompt_tokens else None
    after = wait_until(settled, timeout=10, what="prompt tokens counted")
    assert value(after, 'vllm:prompt_tokens_total{') - value(before, 'vllm:prompt_tokens_total{') == prompt_tokens
    assert value(after, 'vllm:request_success_total{') - value(before, 'vllm:request_success_total{') == 24
    assert value(after, 'tessera:placement_decisions_total{') - value(before, 'tessera:placement_decisions_total{') == 24
    assert value(after, 'tessera:router_connections_accepted_total') >= \
        value(before, 'tessera:router_connections_accepted_total') + 24

    os.kill(s.proc.p.pid, signal.SIGTERM)
    assert s.proc.wait(60) == 0
    assert "exit" in s.proc.output()
