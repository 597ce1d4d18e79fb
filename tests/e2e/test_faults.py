"""Fault injection with real processes (docs/testing.md, "Fault injection"):
a router killed -9 under load (the worker reaps its requests), a worker killed -9
under 32 concurrent streams, a worker SIGSTOPped and SIGCONTed, garbage on the
worker's ZeroMQ socket, and a model file that cannot load.

Every wait polls with a deadline; the deadlines are generous because this runs on a
loaded 2-core machine, but each one bounds a hang."""
import json
import os
import random
import re
import signal
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest
import requests
import zmq

from conftest import LAUNCHER, ROUTER, SANITIZED, WORKER, free_port, free_port_pair, http_status, wait_until
from test_worker_wire import envelope, field, read_fields, varint

SUBMIT, ABORT, STATUS, HEARTBEAT = 20, 21, 30, 42
MODEL = "smol"


# ----------------------------------------------------------------- harness


class StatusWatch:
    """A SUB on a worker's Status socket, decoded by hand from the wire format: the
    worker's own view (running, waiting, KV blocks, generated tokens), independent of
    any router."""

    def __init__(self, status_port):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(f"tcp://127.0.0.1:{status_port}")
        self.last = None

    def latest(self, wait_ms=300):
        """The newest Status received (after reading everything queued), or None."""
        got = self.sock.poll(wait_ms)
        while got:
            env = read_fields(self.sock.recv())
            if STATUS in env:
                st = read_fields(env[STATUS][0])
                self.last = {name: st.get(num, [0])[0] for name, num in
                             (("total", 6), ("free", 7), ("active", 8), ("running", 9), ("waiting", 10),
                              ("seq", 3), ("generated", 24))}
            got = self.sock.poll(0)
        return self.last

    def close(self):
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def watches():
    opened = []

    def _watch(status_port):
        w = StatusWatch(status_port)
        opened.append(w)
        return w

    yield _watch
    for w in opened:
        w.close()


def start_worker(spawn, model, *flags):
    port = free_port_pair()
    proc = spawn([WORKER, model, "--listen", f"tcp://127.0.0.1:{port}", "--served-model-name", MODEL,
                  "--kv-cache-memory-bytes", "64M", *flags])
    return proc, port


def start_router(spawn, worker_ports, *flags):
    http = free_port()
    args = [ROUTER, "--host", "127.0.0.1", "--port", http, *flags]
    for p in worker_ports:
        args += ["--worker", f"tcp://127.0.0.1:{p}"]
    proc = spawn(args)
    base = f"http://127.0.0.1:{http}"
    return proc, base


def worker_up(base):
    """{endpoint: 0|1} from tessera:worker_up in /metrics."""
    try:
        text = requests.get(base + "/metrics", timeout=5).text
    except requests.RequestException:
        return {}
    return {m.group(1): int(float(m.group(2)))
            for m in re.finditer(r'^tessera:worker_up\{worker="([^"]*)"\} (\S+)$', text, re.M)}


def metric(base, name):
    text = requests.get(base + "/metrics", timeout=5).text
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_serving(router, base, n_workers, timeout=90):
    """Every worker live at the router and the tokenizer built."""
    def ready():
        assert router.p.poll() is None, router.output()
        up = worker_up(base)
        if len(up) != n_workers or not all(up.values()):
            return False
        try:
            return requests.post(base + "/tokenize", json={"model": MODEL, "prompt": "x"}, timeout=5).status_code == 200
        except requests.RequestException:
            return False
    wait_until(ready, timeout=timeout, interval=0.1, what=f"{n_workers} worker(s) live and tokenizer ready")


def complete(base, max_tokens=8, prompt="The capital of France is"):
    r = requests.post(base + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == max_tokens
    return body


class Stream:
    """One streamed /v1/completions read on a thread.  outcome: "done" ([DONE] after a
    finish_reason), "error" (an error event, then [DONE]), "closed" (we closed it),
    or "broken: ..." (anything else: a bug)."""

    def __init__(self, base, max_tokens, prompt="Once upon a time", deadline_s=180):
        self.base, self.max_tokens, self.prompt = base, max_tokens, prompt
        self.chunks = 0            # data events carrying text before the end
        self.finish = None
        self.error = None
        self.outcome = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(deadline_s,), daemon=True)
        self.thread.start()

    def _run(self, deadline_s):
        try:
            with requests.post(self.base + "/v1/completions", stream=True, timeout=(10, deadline_s), json={
                    "model": MODEL, "prompt": self.prompt, "max_tokens": self.max_tokens, "ignore_eos": True,
                    "temperature": 0, "stream": True}) as r:
                if r.status_code != 200:
                    self.outcome = f"broken: HTTP {r.status_code} {r.text[:200]}"
                    return
                for line in r.iter_lines():
                    if self.stop.is_set():
                        self.outcome = "closed"
                        return
                    if not line:
                        continue
                    if line == b"data: [DONE]":
                        self.outcome = ("error" if self.error else "done" if self.finish else
                                        "broken: [DONE] without finish_reason")
                        return
                    body = json.loads(line[len(b"data: "):])
                    if "error" in body:
                        self.error = body["error"]
                        continue
                    choice = body["choices"][0]
                    if choice.get("text"):
                        self.chunks += 1
                    if choice.get("finish_reason"):
                        self.finish = choice["finish_reason"]
                self.outcome = "broken: stream ended without [DONE]"
        except Exception as e:   # noqa: BLE001 - classify, the test asserts
            self.outcome = f"broken: {type(e).__name__}: {e}"

    def join(self, timeout):
        self.thread.join(timeout)
        return not self.thread.is_alive()


# ----------------------------------------------------------------- 1. router killed -9


def test_worker_reaps_requests_of_a_killed_router(spawn, demo_model, watches):
    """Router A (4 long streams) and router B (1 long stream) share a worker.  kill -9
    A: the worker aborts A's requests within a few seconds (Status: running 1, B's
    only), B's stream goes on; once B's client leaves too, every KV block is free.  A
    new router then serves normally on the same worker."""
    worker, wport = start_worker(spawn, demo_model)
    status = watches(wport + 1)
    ra, base_a = start_router(spawn, [wport])
    rb, base_b = start_router(spawn, [wport])
    wait_serving(ra, base_a, 1)
    wait_serving(rb, base_b, 1)

    streams_a = [Stream(base_a, 2000, prompt=f"Story number {i}:") for i in range(4)]
    stream_b = Stream(base_b, 2000, prompt="A long poem about the sea:")
    wait_until(lambda: (status.latest() or {}).get("running", 0) == 5 and all(s.chunks >= 1 for s in streams_a)
               and stream_b.chunks >= 1, timeout=60, interval=0.05, what="5 streams generating on the worker")
    used = status.latest()
    assert used["free"] < used["total"]

    os.kill(ra.pid, signal.SIGKILL)
    t0 = time.monotonic()
    # 3 s of silence, then the engine drops them at its next step (slow under ASan).
    wait_until(lambda: (lambda s: s["running"] == 1 and s["waiting"] == 0)(status.latest()),
               timeout=60 if SANITIZED else 20, interval=0.05, what="the killed router's 4 requests reaped")
    print(f"killed router's requests reaped after {time.monotonic() - t0:.1f}s")
    assert re.search(r"router router-\S+ silent for \d+\.\d s \(deadline 3\.0 s\): aborting all its requests",
                     worker.output()), worker.output()[-3000:]

    # B was not touched: its stream still grows.
    before = stream_b.chunks
    wait_until(lambda: stream_b.chunks > before + 3, timeout=30, what="router B's stream still streaming")
    assert stream_b.outcome is None
    stream_b.stop.set()
    assert stream_b.join(30)
    wait_until(lambda: (lambda s: s["running"] == 0 and s["waiting"] == 0 and s["active"] == 0
                        and s["free"] == s["total"])(status.latest()),
               timeout=20, interval=0.05, what="every KV block free")
    for s in streams_a:
        assert s.join(30), "a client of the killed router hung"
        assert s.outcome.startswith("broken:")   # its server vanished mid-stream

    rc, base_c = start_router(spawn, [wport])
    wait_serving(rc, base_c, 1)
    complete(base_c, max_tokens=12)
    assert worker.p.poll() is None


def test_router_stalled_past_the_deadline_is_told_and_recovers(spawn, demo_model, watches):
    """SIGSTOP a router mid-stream for longer than the worker's heartbeat deadline: the
    worker reaps its request (every KV block free again).  SIGCONT: the router does
    not take its own stall for dead workers; the worker tells it that its requests
    were aborted (Error ROUTER_REAPED), so the stream ends with an error event instead
    of waiting forever for Outputs that will never come, and the router serves the
    next request on the same worker."""
    worker, wport = start_worker(spawn, demo_model)
    status = watches(wport + 1)
    router, base = start_router(spawn, [wport])
    wait_serving(router, base, 1)
    stream = Stream(base, 2000, prompt="A story that never ends:")
    wait_until(lambda: (status.latest() or {}).get("running") == 1 and stream.chunks >= 1, timeout=60,
               interval=0.05, what="the stream generating")
    os.kill(router.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: (lambda s: s["running"] == 0 and s["free"] == s["total"])(status.latest()), timeout=20,
                   interval=0.05, what="the stalled router's request reaped")
        assert "aborting all its requests" in worker.output()
    finally:
        os.kill(router.pid, signal.SIGCONT)
    assert stream.join(30), "the stream hung after its router came back"
    assert stream.outcome == "error", stream.outcome
    assert stream.error["code"] == 502, stream.error
    wait_until(lambda: "speaks again after being reaped" in worker.output(), timeout=10, what="worker notice")
    out = router.output()
    assert re.search(r"this worker aborted every request of router router-\S+: no heartbeat for \d+\.\d s", out), out[-3000:]
    assert "router loop stalled for" in out
    assert "is down" not in out          # its own stall was not blamed on the worker
    complete(base)
    assert worker_up(base) == {f"tcp://127.0.0.1:{wport}": 1}


# ----------------------------------------------------------------- 2. worker killed -9 under load


def test_kill_one_of_two_workers_under_32_streams(spawn, demo_model, watches):
    """32 concurrent streaming clients over two workers; the victim runs at most 2
    sequences, so it holds queued requests (no token yet) and running ones (mid
    stream) when it is killed -9.  The router stays up; every stream ends within the
    deadline: the queued ones are retried on the survivor and complete, the running
    ones end with an error event, and nothing else happens.  Round robin puts half the
    streams on the victim: a load-aware policy sends it no more than it runs at once
    when the survivor keeps up (ci44 saw exactly 2 there, no queue, and the wait below
    timed out)."""
    victim, vport = start_worker(spawn, demo_model, "--max-num-seqs", "2")
    survivor, sport = start_worker(spawn, demo_model)
    vstatus = watches(vport + 1)
    router, base = start_router(spawn, [vport, sport], "--routing-policy", "round_robin")
    wait_serving(router, base, 2)
    retries0 = metric(base, "tessera:request_retries_total") or metric(base, "tessera:request_retries")

    streams = [Stream(base, 16, prompt=f"Write item {i} of a shopping list:", deadline_s=240) for i in range(32)]
    wait_until(lambda: (lambda s: s is not None and s["running"] >= 1 and s["waiting"] >= 1 and s["generated"] >= 2)(
        vstatus.latest(50)), timeout=120, interval=0.01, what="the victim streaming with a queue behind")
    os.kill(victim.pid, signal.SIGKILL)

    deadline = time.monotonic() + 240
    for s in streams:
        assert s.join(max(1, deadline - time.monotonic())), "a stream hung after the worker died"
    outcomes = [s.outcome for s in streams]
    done = [s for s in streams if s.outcome == "done"]
    failed = [s for s in streams if s.outcome == "error"]
    assert len(done) + len(failed) == 32, outcomes
    for s in done:
        assert s.finish == "length"
    for s in failed:
        assert s.chunks >= 1, "a request with no token yet was failed instead of retried"
        assert s.error["code"] == 502 and "worker" in s.error["message"], s.error
    # Only sequences running on the victim had tokens to lose: at most --max-num-seqs.
    assert len(failed) <= 2, [s.error for s in failed]
    retries = (metric(base, "tessera:request_retries_total") or metric(base, "tessera:request_retries")) - retries0
    assert retries >= 1, "the victim's queued requests were not retried"
    print(f"32 streams: {len(done)} completed, {len(failed)} ended with an error event, {retries:.0f} retried")

    assert router.p.poll() is None
    assert http_status(base + "/health") == 200
    assert worker_up(base)[f"tcp://127.0.0.1:{vport}"] == 0
    complete(base)


# ----------------------------------------------------------------- 3. SIGSTOP / SIGCONT


def test_sigstopped_worker_is_avoided_then_comes_back(spawn, demo_model, watches):
    """SIGSTOP one of two workers while each runs a long stream: within 3 s the router
    shows it down (tessera:worker_up 0, /health still 200 thanks to the other), the
    stream on it ends with an error event, and new requests all complete while it is
    still stopped (so none went there, and none needed a retry).  SIGCONT: it is live
    again, the abandoned stream no longer runs on it (the router aborted it), and it
    takes new work."""
    wa, pa = start_worker(spawn, demo_model)
    wb, pb = start_worker(spawn, demo_model)
    sa, sb = watches(pa + 1), watches(pb + 1)
    router, base = start_router(spawn, [pa, pb], "--routing-policy", "round_robin")
    wait_serving(router, base, 2)
    ep_a, ep_b = f"tcp://127.0.0.1:{pa}", f"tcp://127.0.0.1:{pb}"

    streams = [Stream(base, 2000, prompt="An endless story:"), Stream(base, 2000, prompt="A long song:")]
    wait_until(lambda: (sa.latest() or {}).get("running") == 1 and (sb.latest() or {}).get("running") == 1
               and all(s.chunks >= 1 for s in streams), timeout=60, interval=0.05,
               what="one long stream on each worker")
    os.kill(wa.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        wait_until(lambda: worker_up(base).get(ep_a) == 0, timeout=3, interval=0.05, what="worker A down at the router")
        print(f"SIGSTOPped worker seen down after {time.monotonic() - t0:.2f}s")
        assert worker_up(base).get(ep_b) == 1
        assert http_status(base + "/health") == 200
        wait_until(lambda: any(s.outcome == "error" for s in streams), timeout=10, what="stream on A ended")
        on_a = next(s for s in streams if s.outcome == "error")
        on_b = next(s for s in streams if s is not on_a)
        assert on_a.error["code"] == 502
        assert on_b.outcome is None

        on_b.stop.set()                  # its client leaves: B goes idle
        assert on_b.join(30)
        wait_until(lambda: (lambda s: s["running"] == 0 and s["waiting"] == 0)(sb.latest()), timeout=20,
                   interval=0.05, what="worker B idle")
        retries0 = metric(base, "tessera:request_retries_total") or metric(base, "tessera:request_retries")
        generated_b = sb.latest()["generated"]
        for i in range(4):
            complete(base, max_tokens=6, prompt=f"Question {i}:")
        assert (metric(base, "tessera:request_retries_total") or metric(base, "tessera:request_retries")) == retries0
        # B generated exactly those 4 x 6 tokens (its Status follows within 100 ms).
        wait_until(lambda: sb.latest()["generated"] == generated_b + 4 * 6, timeout=10,
                   what="the 4 requests' tokens counted on worker B")
        assert wa.p.poll() is None and worker_up(base).get(ep_a) == 0
    finally:
        os.kill(wa.pid, signal.SIGCONT)

    wait_until(lambda: worker_up(base).get(ep_a) == 1, timeout=20, interval=0.05, what="worker A live again")
    # The stream abandoned on A (max_tokens 2000) must not keep running there.
    wait_until(lambda: (lambda s: s["running"] == 0 and s["waiting"] == 0 and s["free"] == s["total"])(sa.latest()),
               timeout=20, interval=0.05, what="worker A's abandoned request aborted")
    generated_a = sa.latest()["generated"]
    for i in range(4):
        complete(base, max_tokens=6, prompt=f"After the pause {i}:")
    wait_until(lambda: sa.latest()["generated"] > generated_a, timeout=10, what="worker A takes work again")


# ----------------------------------------------------------------- 4. garbage on the worker's socket


def test_garbage_on_worker_socket_is_logged_and_dropped(spawn, demo_model, watches):
    """A pyzmq DEALER sends the worker one malformed frame of each kind; each is
    logged (one line per frame, asserted) and dropped.  Then 300 random frames.  The
    worker keeps serving real requests through a router all along."""
    worker, wport = start_worker(spawn, demo_model)
    status = watches(wport + 1)
    router, base = start_router(spawn, [wport])
    wait_serving(router, base, 1)
    complete(base)

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"fuzzer")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{wport}")
    try:
        good_submit = (field(1, 2, b"fuzz-1") + field(2, 2, varint(504) + varint(3365) + varint(28)) +
                       field(4, 0, 8))
        probes = [
            ("empty frame", [b""], "protocol version 0.0"),
            ("random bytes", [bytes(range(256)) * 2], "is not a valid Envelope"),
            ("truncated protobuf", [envelope(SUBMIT, good_submit)[:-5]], "is not a valid Envelope"),
            ("huge declared length", [envelope(SUBMIT, b"\x0a\xff\xff\xff\xff\x0f")], "is not a valid Envelope"),
            ("other major version", [envelope(SUBMIT, good_submit, version=2000)], "protocol version 2.0"),
            ("version 0", [envelope(SUBMIT, good_submit, version=7)], "protocol version 0.7"),
            ("multi-frame junk", [b"\x08\xe8\x07", b"junk", b"more junk"], "dropped a multi-frame message"),
            ("invalid field", [envelope(SUBMIT, field(1, 2, b"fuzz-2") + field(4, 0, 8))], "empty prompt"),
            ("bad heartbeat", [envelope(HEARTBEAT, field(1, 2, b"fuzzer") + field(2, 0, 0))],
             "heartbeat: interval_ms 0 out of range"),
            ("wrong direction", [envelope(STATUS, field(1, 2, b"w") + field(6, 0, 4) + field(7, 0, 4))],
             "dropped an unexpected status message"),
        ]
        for what, frames, needle in probes:
            before = worker.output().count(needle)
            sock.send_multipart(frames)
            wait_until(lambda: worker.output().count(needle) > before, timeout=10, what=f"log line for {what}")
            assert worker.p.poll() is None, what
        # Valid envelopes about requests the worker never saw: ignored quietly (Abort is idempotent).
        sock.send(envelope(ABORT, field(1, 2, b"no-such-request") + field(1, 2, b"nor-this")))
        sock.send(envelope(ABORT, field(3, 0, 1)))
        complete(base)

        rng = random.Random(11)
        for _ in range(300):
            kind = rng.randrange(4)
            if kind == 0:
                sock.send(bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200))))
            elif kind == 1:
                sock.send_multipart([bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 20)))
                                     for _ in range(rng.randint(2, 4))])
            elif kind == 2:
                body = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
                sock.send(envelope(rng.choice([10, 20, 21, 22, 30, 40, 42, 99]), body))
            else:
                frame = bytearray(envelope(SUBMIT, good_submit))
                frame[rng.randrange(len(frame))] = rng.getrandbits(8)
                sock.send(bytes(frame))
        # Some mutated Submits are valid and run: Abort{all_from_router} (FIFO after
        # them on this pipe) takes every one of them back, and the worker is idle again.
        # A Hello after it: its ModelInfo reply proves the io thread read everything
        # before (one pipe, in order); Errors and Outputs on the way are dropped.
        sock.send(envelope(ABORT, field(3, 0, 1)))
        sock.send(envelope(10, field(1, 2, b"fuzzer")))
        deadline = time.monotonic() + 60
        while True:
            assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), "no ModelInfo after the blast"
            if 11 in read_fields(sock.recv()):
                break
        seq0 = status.latest()["seq"]
        wait_until(lambda: (lambda s: s["seq"] > seq0 + 1 and s["running"] == 0 and s["waiting"] == 0)(
            status.latest()), timeout=60, interval=0.05, what="the fuzzer's requests aborted")
        while sock.poll(200):
            sock.recv_multipart()
        for _ in range(3):
            complete(base, max_tokens=10)
        assert worker.p.poll() is None and router.p.poll() is None
        assert "dropped" in worker.output()
    finally:
        sock.close()
        ctx.term()


# ----------------------------------------------------------------- 5. a model that cannot load


def test_truncated_model_fails_clearly(spawn, tmp_path, demo_model):
    """A partly downloaded GGUF (the real file cut at 3 MB): the worker exits 2 naming
    the file and what is wrong; `tessera serve` reports it and exits 2 without a
    restart loop.  (test_skeleton covers a file with a garbage header.)"""
    cut = tmp_path / "cut-short.gguf"
    with open(demo_model, "rb") as f:
        cut.write_bytes(f.read(3 << 20))

    w = spawn([WORKER, cut, "--listen", f"tcp://127.0.0.1:{free_port_pair()}"])
    assert w.wait(timeout=60) == 2
    out = w.output()
    assert "cannot load model" in out and str(cut) in out and "outside the file" in out, out
    assert "tensor 'token_embd.weight'" in out, out     # the first tensor whose bytes are missing

    s = spawn([LAUNCHER, "serve", cut, "--host", "127.0.0.1", "--port", free_port()])
    assert s.wait(timeout=60) == 2
    out = s.output()
    assert str(cut) in out and "restarting cannot help" in out, out
    assert out.count("cannot load model") == 1, "the launcher restarted a worker that cannot load"


def test_llama_with_unsupported_dtype_exits_before_binding(spawn, tmp_path):
    """A Llama checkpoint whose tensor has a dtype the loader does not take (I32 here;
    F32, F16 and BF16 are) is a startup error naming the file, the tensor and the
    dtype: exit 2 before the sockets are bound, not a worker serving metadata only
    (that is for model families without a runner)."""
    src = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama3-hf" / "f32"
    model = tmp_path / "i32-llama"
    shutil.copytree(src, model)
    name = "model.layers.0.input_layernorm.weight"
    shard = model / json.loads((model / "model.safetensors.index.json").read_text())["weight_map"][name]
    blob = shard.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    assert header[name]["dtype"] == "F32"
    header[name]["dtype"] = "I32"          # same 4 bytes an element: only the dtype is wrong
    text = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(text)) + text + blob[8 + n:])

    port = free_port_pair()
    w = spawn([WORKER, model, "--listen", f"tcp://127.0.0.1:{port}"])
    assert w.wait(timeout=60) == 2
    out = w.output()
    assert "cannot load model" in out and shard.name in out and name in out and "I32" in out, out
    assert "listening on" not in out and "metadata only" not in out, out
