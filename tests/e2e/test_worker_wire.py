"""Speak the protocol to a real worker with pyzmq: garbage is dropped and the worker
keeps serving; Hello gets ModelInfo; Submit gets the engine's clear refusal."""
import random
import struct
import time

import pytest
import zmq

from conftest import SIM_WORKER, free_port_pair

# A few lines of protobuf encoding by hand, so the test depends on the wire format
# itself (field numbers of proto/tessera.proto), not on generated Python code.


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(num, wire, payload):
    key = varint((num << 3) | wire)
    if wire == 0:
        return key + varint(payload)
    return key + varint(len(payload)) + payload


def envelope(msg_field, body, version=1000):
    return field(1, 0, version) + field(msg_field, 2, body)


def read_fields(buf):
    """Decode one protobuf message level: {field: [values]} (bytes for wire type 2)."""
    out, i = {}, 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif wire == 5:
            v, i = buf[i:i + 4], i + 4
        elif wire == 1:
            v, i = buf[i:i + 8], i + 8
        else:
            raise ValueError(f"wire type {wire}")
        out.setdefault(num, []).append(v)
    return out


def _varint(buf, i):
    shift = n = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


HELLO, MODEL_INFO, SUBMIT, ERROR = 10, 11, 20, 23


@pytest.fixture
def worker(spawn, demo_model, worker_binary):
    """The real worker and the simulated one (tessera-sim-worker), the same wire."""
    port = free_port_pair()
    proc = spawn([worker_binary, demo_model, "--listen", f"tcp://127.0.0.1:{port}", "--served-model-name", "wire"])
    proc.port = port                                  # Status is published on port + 1
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"pytest-router")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    yield proc, sock
    sock.close()
    ctx.term()


def request(sock, frame, timeout_ms=5000):
    sock.send(frame)
    if not sock.poll(timeout_ms):
        raise AssertionError("no reply from the worker")
    return read_fields(sock.recv())


def hello(sock):
    reply = request(sock, envelope(HELLO, field(1, 2, b"pytest-router")), timeout_ms=20000)
    assert MODEL_INFO in reply, reply
    return read_fields(reply[MODEL_INFO][0])


def test_hello_gets_model_info(worker):
    _, sock = worker
    info = hello(sock)
    assert info[3] == [b"wire"]                  # served_model_names
    assert info[5] == [8192]                      # max_model_len
    assert info[6] == [16]                        # block_size
    assert 13 in info                             # the GGUF tokenizer is carried
    gguf = read_fields(info[13][0])
    assert gguf[1] == [b"gpt2"]                   # SmolLM2's tokenizer model
    assert len(gguf[3]) == 49152                  # every token string


def test_garbage_is_dropped_and_worker_keeps_serving(worker):
    proc, sock = worker
    hello(sock)
    rng = random.Random(7)
    frames = [b"", b"\x00", b"\xff" * 64, envelope(SUBMIT, b"\x0a\xff\xff\xff\xff\x0f"),  # huge declared length
              envelope(HELLO, b"", version=2000)]                                     # another major version
    frames += [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300))) for _ in range(300)]
    for f in frames:
        sock.send(f)
    sock.send_multipart([b"two", b"frames"])
    # Drain whatever errors came back, then check the worker still answers Hello.
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and sock.poll(100):
        sock.recv()
    assert proc.p.poll() is None
    hello(sock)
    out = proc.output()
    assert "dropped a frame" in out
    assert "protocol version 2.0" in out


OUTPUT = 22


def test_submit_streams_outputs_until_length(worker):
    """A Submit straight on the wire: one Output per engine step, 8 tokens, then
    finish_reason LENGTH with the prompt count reported once."""
    _, sock = worker
    hello(sock)
    submit = (field(1, 2, b"cmpl-test-0") + field(2, 2, varint(504) + varint(3365) + varint(28)) +
              field(4, 0, 8) + field(8, 0, (1 << 64) - 1) + field(9, 0, (1 << 64) - 1))
    sock.send(envelope(SUBMIT, submit))
    tokens, finish, prompt_tokens = [], 0, None
    deadline = time.monotonic() + 60
    while not finish and time.monotonic() < deadline:
        assert sock.poll(30000), "no Output from the worker"
        msg = read_fields(sock.recv())
        assert OUTPUT in msg, msg
        for raw in read_fields(msg[OUTPUT][0]).get(2, []):       # Output.outputs
            ro = read_fields(raw)
            assert ro[1] == [b"cmpl-test-0"]
            for packed in ro.get(2, []):                         # new_token_ids (packed)
                i = 0
                while i < len(packed):
                    v, i = _varint(packed, i)
                    tokens.append(v)
            if 8 in ro:
                prompt_tokens = ro[8][0]
            finish = ro.get(5, [0])[0]
    assert len(tokens) == 8
    assert all(0 <= t < 49152 for t in tokens)
    assert finish == 2                                           # FINISH_LENGTH
    assert prompt_tokens == 3


def test_invalid_submit_gets_invalid_error(worker):
    _, sock = worker
    hello(sock)
    submit = field(1, 2, b"cmpl-bad") + field(4, 0, 8)   # no prompt tokens
    reply = request(sock, envelope(SUBMIT, submit))
    err = read_fields(reply[ERROR][0])
    assert err[2] == [1]                          # ERROR_INVALID
    assert b"empty prompt" in err[3][0]


DRAIN = 40


def test_drain_refuses_new_submits_retryably(worker):
    """After Drain a Submit gets a retryable UNAVAILABLE Error (the router places it
    elsewhere), and the worker logs why."""
    proc, sock = worker
    hello(sock)
    sock.send(envelope(DRAIN, field(2, 2, b"pytest")))
    submit = field(1, 2, b"cmpl-drained") + field(2, 2, varint(504) + varint(28)) + field(4, 0, 4)
    reply = request(sock, envelope(SUBMIT, submit))
    err = read_fields(reply[ERROR][0])
    assert err[1] == [b"cmpl-drained"]
    assert err[2] == [3]                          # ERROR_UNAVAILABLE
    assert err[4] == [1]                          # retryable
    assert b"draining" in err[3][0]
    assert "drain requested" in proc.output()


HEARTBEAT, STATUS, ABORT = 42, 30, 21


def test_status_counts_and_acknowledges_submits(worker):
    """Status counts a Submit as waiting or running from the moment the worker has read
    it, and names, for each router that sends Heartbeats, the highest request id it has
    read (submit_acks): routers keep their own dispatches above it as pending and learn
    of every other router's from the counts (router/placement.h, herding)."""
    proc, sock = worker
    hello(sock)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{proc.port + 1}")
    try:
        sock.send(envelope(HEARTBEAT, field(1, 2, b"pytest-router") + field(2, 0, 250)))
        ids = [b"41", b"42", b"43"]
        prompt = varint(504) + varint(28)
        for rid in ids:   # long enough to be running when the Status is read; no logprobs
            sock.send(envelope(SUBMIT, field(1, 2, rid) + field(2, 2, prompt) + field(4, 0, 4000) + field(7, 0, 1) +
                               field(8, 0, (1 << 64) - 1) + field(9, 0, (1 << 64) - 1)))
        found = None
        deadline = time.monotonic() + 30
        while found is None and time.monotonic() < deadline:
            if not sub.poll(1000):
                continue
            msg = read_fields(sub.recv())
            st = read_fields(msg[STATUS][0])
            acks = [read_fields(a) for a in st.get(27, [])]
            mine = [a[2][0] for a in acks if a[1] == [b"pytest-router"]]
            if mine and mine[0] == 43:
                found = st
        assert found is not None, "no Status acknowledged request 43"
        # every Submit it acknowledges is counted, running or still waiting
        assert found.get(9, [0])[0] + found.get(10, [0])[0] == 3, found
        sock.send(envelope(ABORT, field(1, 2, b"41") + field(1, 2, b"42") + field(1, 2, b"43")))
    finally:
        sub.close()


def test_step_timing_measures_the_simulated_cost(spawn, demo_model):
    """The engine's step timing, against a worker whose cost is known: the simulated
    one sleeps prompt_tokens / 20,000 s per prefill and 20 ms + 0.1 ms per sequence per
    decode step.  A sleep never ends early, so the measured decode step is at least
    20 ms and the prefill rate at most 20,000 tokens/s; the other bounds are loose (a
    loaded machine only oversleeps).  No logprobs: prompt logprobs over a 1,000-token
    prompt cost the step 0.5 s here, and a step's time is what the rate measures."""
    port = free_port_pair()
    spawn([SIM_WORKER, demo_model, "--listen", f"tcp://127.0.0.1:{port}", "--sim-prefill-tokens-per-s", "20000",
           "--sim-decode-ms", "20", "--sim-decode-ms-per-seq", "0.1"])
    ctx = zmq.Context.instance()
    sock, sub = ctx.socket(zmq.DEALER), ctx.socket(zmq.SUB)
    for s in (sock, sub):
        s.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"pytest-router")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(f"tcp://127.0.0.1:{port}")
    sub.connect(f"tcp://127.0.0.1:{port + 1}")
    try:
        hello(sock)
        # three prefills of 1,000 distinct tokens (50 ms each), one after another's first
        # token, so that the median is over three samples; then 40 decode steps each
        for k in range(3):
            prompt = b"".join(varint(t) for t in range(500 + 1000 * k, 1500 + 1000 * k))
            sock.send(envelope(SUBMIT, field(1, 2, str(7 + k).encode()) + field(2, 2, prompt) + field(4, 0, 40) +
                               field(7, 0, 1) + field(8, 0, (1 << 64) - 1) + field(9, 0, (1 << 64) - 1)))  # no logprobs
            assert sock.poll(30000), "no Output"
            assert OUTPUT in read_fields(sock.recv())
        timing, deadline = None, time.monotonic() + 30
        while time.monotonic() < deadline:
            if sub.poll(1000):
                st = read_fields(read_fields(sub.recv())[STATUS][0])
                tps, dms = (struct.unpack("<f", st[f][0])[0] if f in st else 0.0 for f in (28, 29))
                if tps > 0 and dms > 0:
                    timing = (tps, dms)
                    if st.get(9, [0])[0] == 0 and st.get(10, [0])[0] == 0:
                        break           # the request finished: every step sampled
        assert timing is not None, "no Status carried the step timing"
        tps, dms = timing
        assert 2000 <= tps <= 20000 * 1.001, timing
        assert 20.0 <= dms <= 200.0, timing
    finally:
        sock.close()
        sub.close()
