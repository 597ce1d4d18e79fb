"""Many clients at once through one router: the official async openai SDK with 32
concurrent streams (each stream's text equals the same request answered whole), and
1,000 idle TCP connections that neither block other clients nor leak descriptors."""
import asyncio
import os
import resource
import socket
import time

import openai
import pytest
import requests

from conftest import http_status, skip_because, wait_until

MODEL = "smol"


@pytest.fixture
def smol(serve):
    s = serve("--served-model-name", MODEL, "--max-model-len", "1024", "--kv-cache-memory-bytes", "256M")
    wait_until(lambda: requests.post(s.base + "/tokenize", json={"prompt": "x"}, timeout=5).status_code == 200,
               timeout=60, interval=0.1, what="tokenizer ready")
    return s


@pytest.mark.slow_under_sanitizers      # 32 generations on the ASan build take minutes
def test_async_sdk_32_concurrent_streams(smol):
    n, max_tokens = 32, 12
    prompts = [f"Write the number {i} in words, then count on." for i in range(n)]
    client = openai.AsyncOpenAI(base_url=smol.base + "/v1", api_key="x", max_retries=0, timeout=300)

    async def whole(p):
        r = await client.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True})
        return r.choices[0].text, r.usage.completion_tokens

    async def streamed(p):
        text, finish, usage = "", None, None
        stream = await client.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        return text, finish, usage

    async def main():
        streams = await asyncio.gather(*(streamed(p) for p in prompts))
        wholes = await asyncio.gather(*(whole(p) for p in prompts))
        await client.close()
        return streams, wholes

    streams, wholes = asyncio.run(main())
    for (text, finish, usage), (full, n_tokens) in zip(streams, wholes):
        assert finish == "length"
        assert usage.completion_tokens == max_tokens == n_tokens
        assert text == full             # greedy and batch invariant: same text alone or among 31
    assert len({t for t, _, _ in streams}) > 1


def open_fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def accepted_total(session, base):
    # one keep-alive connection for every scrape, so the scrapes add at most one
    text = session.get(base + "/metrics", timeout=10).text
    line = [l for l in text.splitlines() if l.startswith("tessera:router_connections_accepted_total")][0]
    return float(line.rsplit(" ", 1)[1])


def test_1000_idle_connections(smol):
    """Held open without a byte sent, 1,000 connections are all accepted and do not
    stop the router from answering; they are closed at the header timeout (10 s) or by
    us, and every descriptor comes back.  Accepted is counted by the router's
    tessera:router_connections_accepted_total, not by a momentary fd count: on a
    loaded machine the first ones may already hit the header timeout before the last
    is accepted."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1200:
        skip_because("rlimit-nofile", f"RLIMIT_NOFILE hard limit {hard} is below 1,200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    router = smol.router_pid()
    host, port = "127.0.0.1", smol.port
    baseline = open_fds(router)
    scraper = requests.Session()
    accepted0 = accepted_total(scraper, smol.base)
    idle = []
    try:
        for _ in range(1000):
            idle.append(socket.create_connection((host, port), timeout=30))
        wait_until(lambda: accepted_total(scraper, smol.base) >= accepted0 + 1000, timeout=60,
                   what="1,000 idle connections accepted")
        # ...and the router still answers other clients at once
        t0 = time.monotonic()
        r = requests.post(smol.base + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < 10
    finally:
        for s in idle:
            s.close()
        scraper.close()
    # every descriptor comes back
    wait_until(lambda: open_fds(router) <= baseline + 2, timeout=30, what="router fds back to baseline")


def test_health_200_means_requests_are_served(serve):
    """A client that waits for /health 200 (as for vLLM) gets its first completion
    served, not a 503 "still loading": health waits for the router's tokenizer too."""
    s = serve(wait=False)
    wait_until(lambda: http_status(s.base + "/health") == 200, timeout=90, interval=0.02, what="/health 200")
    r = requests.post(s.base + "/v1/completions", timeout=60,
                      json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
