"""Load and abuse at the connection level, against one live router + worker (the demo
model): 1,000 concurrent streams, slowloris, clients that never read, and a keep-alive
soak with RSS and fd counts read from /proc.  The router's connection series
(tessera:router_connections*) are checked along the way.

Bounds are generous (a loaded 2-core machine) and no test asserts a speed; the soak's
numbers for 10,000 requests are in docs/testing.md (tests/load/soak.py)."""
import asyncio
import resource
import socket
import sys
import time
from pathlib import Path

import pytest
import requests

from conftest import DEMO_MODEL, pid_alive, skip_because, wait_until
from hostile import fd_count, metric_sum, metric_value, rss_kb, start_served

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "load"))
import soak  # noqa: E402

N_STREAMS = 1000
HEADER_TIMEOUT_S = 10   # tsr_http_server_opts_default: header_timeout_ms (no flag sets it)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not DEMO_MODEL.exists():
        skip_because("not-fetched", f"demo model absent ({DEMO_MODEL}); scripts/fetch-model.sh fetches it")
    # 1,000 client sockets here and as many in the router (which inherits the limit).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 8192)
    if want < 2 * N_STREAMS + 200:
        skip_because("rlimit-nofile", f"RLIMIT_NOFILE hard limit {hard} is too low for {N_STREAMS} connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    served, proc = start_served(tmp_path_factory.mktemp("load"), DEMO_MODEL, *soak.SERVE_FLAGS)
    yield served
    proc.kill_group()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def metrics(server):
    return requests.get(server.base + "/metrics", timeout=60).text


def dropped(text, reason):
    for line in text.splitlines():
        if line.startswith(f'tessera:router_connections_dropped_total{{reason="{reason}"}} '):
            return float(line.split()[1])
    return 0.0


def stream_request(prompt, max_tokens, extra=""):
    body = ('{"prompt": "%s", "max_tokens": %d, "stream": true, "temperature": 0%s}' % (prompt, max_tokens, extra)).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


async def one_stream(port, i, sem_connect):
    """Open, send a streaming completion, read the chunked SSE body to its end."""
    for attempt in range(5):
        try:
            async with sem_connect:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            break
        except OSError:
            if attempt == 4:
                raise
            await asyncio.sleep(0.5 * (attempt + 1))
    try:
        writer.write(stream_request(f"Number {i % 50}", 1 + i % 2))
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        assert b"transfer-encoding: chunked" in head.lower()
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += data[:-2]
        return body
    finally:
        writer.close()


def test_1000_concurrent_streams(server):
    before = metrics(server)
    accepted0 = metric_value(before, "tessera:router_connections_accepted_total")

    async def run():
        # Connects are spread a little (the listen backlog is 511); all 1,000 are open
        # and waiting on the worker at once.
        sem = asyncio.Semaphore(200)
        return await asyncio.wait_for(
                asyncio.gather(*(one_stream(server.port, i, sem) for i in range(N_STREAMS)), return_exceptions=True),
                timeout=600)

    results = asyncio.run(run())
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, f"{len(failures)} of {N_STREAMS} failed, e.g. {failures[:3]!r}"
    for body in results:
        events = [e for e in body.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]", body[-200:]
        assert len(events) >= 2
    after = metrics(server)
    assert metric_value(after, "tessera:router_connections_accepted_total") >= accepted0 + N_STREAMS
    assert dropped(after, "cap") == 0
    assert pid_alive(server.router_pid()) and pid_alive(server.worker_pid())
    # Every one of them is closed again (only the scrape's own connection may remain).
    wait_until(lambda: metric_value(metrics(server), "tessera:router_connections") <= 2, timeout=60,
               what="router_connections back to ~0")


def test_slowloris_closed_at_header_timeout(server):
    drops0 = dropped(metrics(server), "header_timeout")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nX-Slow: " + b"a" * 200
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    t0 = time.monotonic()
    got = b""
    closed_at = None
    try:
        s.setblocking(False)
        for byte in head:
            # One byte every 0.25 s: the head would take 60 s, far past the 10 s timeout.
            try:
                s.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic()
                break
            deadline = time.monotonic() + 0.25
            while time.monotonic() < deadline:
                try:
                    chunk = s.recv(4096)
                except BlockingIOError:
                    time.sleep(0.02)
                    continue
                except ConnectionResetError:
                    chunk = b""
                if not chunk:
                    closed_at = time.monotonic()
                    break
                got += chunk
            if closed_at:
                break
    finally:
        s.close()
    assert closed_at is not None, "the router kept a slowloris connection open for a minute"
    elapsed = closed_at - t0
    assert HEADER_TIMEOUT_S - 0.5 <= elapsed < HEADER_TIMEOUT_S + 30, elapsed
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    assert b"Request headers not received within" in got
    wait_until(lambda: dropped(metrics(server), "header_timeout") >= drops0 + 1, timeout=30,
               what="router_connections_dropped{reason=header_timeout}")


def test_slow_readers_memory_capped(server):
    """100 clients start a long stream and never read it: the router's memory stays
    bounded, and other clients are served meanwhile."""
    router = server.router_pid()
    requests.post(server.base + "/v1/completions", json={"prompt": "warm", "max_tokens": 2}, timeout=120)
    rss0 = rss_kb(router)
    done0 = metric_sum(metrics(server), "vllm:request_success_total")
    socks = []
    try:
        for i in range(100):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # the kernel holds little for us
            s.settimeout(30)
            s.connect(("127.0.0.1", server.port))
            s.sendall(stream_request(f"Tell a long story {i}", 16, ', "ignore_eos": true'))
            socks.append(s)
        # Others are served while the 100 sit on their unread streams.
        r = requests.post(server.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=300)
        assert r.status_code == 200, r.text
        assert requests.get(server.base + "/health", timeout=60).status_code == 200
        # Let the streams run to their end (the worker finishes them; the router keeps
        # what the kernel would not take).
        wait_until(lambda: metric_sum(metrics(server), "vllm:request_success_total") >= done0 + 101, timeout=600,
                   interval=1.0, what="the router to finish the 100 streams")
        grown_kb = rss_kb(router) - rss0
        # 100 streams of 16 tokens are ~300 KiB of SSE in all; 64 MiB is a generous cap
        # that still catches an unbounded buffer (the cap is 8 MiB per connection).
        assert grown_kb < 64 * 1024, f"router RSS grew by {grown_kb} KiB with 100 slow readers"
        assert metric_value(metrics(server), "tessera:router_connections") >= 100
    finally:
        for s in socks:
            s.close()
    wait_until(lambda: metric_value(metrics(server), "tessera:router_connections") <= 2, timeout=60,
               what="the slow readers' connections to close")
    assert pid_alive(router) and pid_alive(server.worker_pid())


def test_keepalive_soak(server):
    pids = {"router": server.router_pid(), "worker": server.worker_pid()}
    result = soak.soak(server.base, pids, n=2000, warmup=soak.TEST_WARMUP)
    print(result)
    assert result["errors"] == 0, result["first_errors"]
    for name in pids:
        assert abs(result["rss_drift"][name]) < 0.10, result
        assert result["after"][name]["fds"] <= result["before"][name]["fds"], result
    assert fd_count(pids["router"]) <= result["before"]["router"]["fds"]
