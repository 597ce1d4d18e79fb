"""A small router stand-in for engine tests: it speaks the wire protocol
(proto/tessera.proto) to a real tessera-worker over ZeroMQ, the way the router does
(DEALER to the worker's ROUTER, SUB to its Status PUB), with the hand-written protobuf
codec of test_worker_wire.py, so what is tested is the wire format itself.

    w = EngineWorker(spawn, model, "--max-num-batched-tokens", "256")
    w.submit("a", prompt_ids, max_tokens=16, logprobs=5)
    res = w.collect(["a"])["a"]          # Result: tokens, logprobs, finish, cached...
    w.status()                           # the latest Status as a dict
"""
import contextlib
import signal
import struct
import time
from dataclasses import dataclass, field as dc_field

import zmq

from conftest import WORKER, free_port_pair
from test_worker_wire import _varint, envelope, field, read_fields, varint

HELLO, MODEL_INFO, SUBMIT, ABORT, OUTPUT, ERROR, STATUS = 10, 11, 20, 21, 22, 23, 30
FINISH = {0: None, 1: "stop", 2: "length", 3: "abort", 4: "error"}


def _i64(v):
    """int32/int64 fields: negative values go on the wire as 10-byte two's complement."""
    return v & ((1 << 64) - 1)


def _f32(num, v):
    return varint((num << 3) | 5) + struct.pack("<f", v)


def _uints(vals):
    """Packed or not, a repeated varint field arrives as a list of raw values."""
    out = []
    for v in vals:
        if isinstance(v, int):
            out.append(v)
            continue
        i = 0
        while i < len(v):
            n, i = _varint(v, i)
            out.append(n)
    return out


def _floats(vals):
    out = []
    for v in vals:
        out += list(struct.unpack(f"<{len(v) // 4}f", v))
    return out


@dataclass
class TokenLp:
    logprob: float
    rank: int
    top_ids: list
    top_logprobs: list


def _token_lp(raw):
    f = read_fields(raw)
    return TokenLp(logprob=_floats(f.get(1, [b"\0\0\0\0"]))[0], rank=f.get(2, [0])[0],
                   top_ids=_uints(f.get(3, [])), top_logprobs=_floats(f.get(4, [])))


@dataclass
class Result:
    tokens: list = dc_field(default_factory=list)
    logprobs: list = dc_field(default_factory=list)          # TokenLp per generated token
    prompt_logprobs: list = dc_field(default_factory=list)   # TokenLp for prompt positions 1..
    finish: str = None
    num_prompt_tokens: int = None
    cached: int = None
    num_preemptions: int = 0
    num_generated: int = None                                # of the finishing Output
    stop_token_id: int = None                                # finish "stop" by a stop_token_id
    error: tuple = None                                      # (code, message, retryable)

    @property
    def done(self):
        return self.finish is not None or self.error is not None


class EngineWorker:
    def __init__(self, spawn, model, *flags, env=None, binary=WORKER):
        port = free_port_pair()
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.proc = spawn([binary, model, "--listen", self.endpoint, "--status-interval-ms", "50", *flags], env=env)
        # The process-wide context, never terminated here: a test that fails before
        # close() leaves its sockets to the garbage collector, and a context of its own
        # would then be terminated by its finalizer while they are open, which blocks
        # pytest forever (zmq_ctx_term waits for every socket to close).
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, b"engine-test")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://127.0.0.1:{port + 1}")
        self.results = {}
        self.last_status = None
        self.cached_hashes = set()   # the worker's prefix cache, rebuilt from Status events
        self.max_step_outputs = 0    # most requests one Output (one engine step) carried
        self.info = self._hello()

    def close(self):
        self.sock.close()
        self.sub.close()

    def _hello(self, timeout=120):
        # Hello until ModelInfo: the worker binds only after loading the model.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.p.poll() is None, self.proc.output()
            self.sock.send(envelope(HELLO, field(1, 2, b"engine-test")))
            if self.sock.poll(1000):
                msg = read_fields(self.sock.recv())
                if MODEL_INFO in msg:
                    return read_fields(msg[MODEL_INFO][0])
        raise AssertionError("no ModelInfo from the worker:\n" + self.proc.output()[-3000:])

    @contextlib.contextmanager
    def paused(self):
        """Submits sent inside arrive together: the worker is stopped (SIGSTOP) while
        they queue in its socket and continued after, so its io thread reads them in one
        burst.  Without it a fast tiny model starts on the first Submits before the
        client has sent the rest, and how many run in one step depends on the load."""
        self.proc.p.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.proc.p.send_signal(signal.SIGCONT)

    def submit(self, rid, prompt, max_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=None, logprobs=-1,
               prompt_logprobs=-1, ignore_eos=True, stop_token_ids=(), min_tokens=0):
        sp = (_f32(1, temperature) + _f32(2, top_p) + field(3, 0, _i64(top_k)) + _f32(5, 1.0))
        if seed is not None:
            sp += field(8, 0, 1) + field(9, 0, seed)
        body = (field(1, 2, rid.encode()) + field(2, 2, b"".join(varint(t) for t in prompt)) + field(3, 2, sp) +
                field(4, 0, max_tokens) + field(8, 0, _i64(logprobs)) + field(9, 0, _i64(prompt_logprobs)))
        if stop_token_ids:
            body += field(6, 2, b"".join(varint(t) for t in stop_token_ids))
        if ignore_eos:
            body += field(7, 0, 1)
        if min_tokens:
            body += field(5, 0, min_tokens)
        self.results[rid] = Result()
        self.sock.send(envelope(SUBMIT, body))

    def abort(self, rid):
        self.sock.send(envelope(ABORT, field(1, 2, rid.encode()) + field(2, 2, b"test")))

    def pump(self, timeout_ms):
        """Read what the worker sent within timeout_ms into self.results."""
        if not self.sock.poll(timeout_ms):
            return False
        while self.sock.poll(0):
            msg = read_fields(self.sock.recv())
            if OUTPUT in msg:
                outs = read_fields(msg[OUTPUT][0]).get(2, [])
                self.max_step_outputs = max(self.max_step_outputs, len(outs))
                for raw in outs:
                    ro = read_fields(raw)
                    r = self.results.setdefault(ro[1][0].decode(), Result())
                    r.tokens += _uints(ro.get(2, []))
                    r.logprobs += [_token_lp(x) for x in ro.get(3, [])]
                    r.prompt_logprobs += [_token_lp(x) for x in ro.get(4, [])]
                    if 8 in ro:
                        r.num_prompt_tokens = ro[8][0]
                        r.cached = ro.get(9, [0])[0]
                    if ro.get(5, [0])[0]:
                        r.finish = FINISH[ro[5][0]]
                        r.num_preemptions = ro.get(14, [0])[0]
                        r.num_generated = ro.get(10, [0])[0]
                        if ro.get(7, [0])[0]:
                            r.stop_token_id = ro.get(6, [0])[0]
            elif ERROR in msg:
                e = read_fields(msg[ERROR][0])
                rid = e.get(1, [b""])[0].decode()
                r = self.results.setdefault(rid, Result())
                r.error = (e.get(2, [0])[0], e.get(3, [b""])[0].decode(), bool(e.get(4, [0])[0]))
        return True

    def collect(self, ids, timeout=120):
        deadline = time.monotonic() + timeout
        while not all(self.results[i].done for i in ids):
            assert time.monotonic() < deadline, (
                f"{sum(not self.results[i].done for i in ids)} of {len(ids)} requests unfinished after {timeout} s")
            assert self.proc.p.poll() is None, self.proc.output()[-3000:]
            self.pump(1000)
        return {i: self.results[i] for i in ids}

    def run(self, rid, prompt, max_tokens, **kw):
        self.submit(rid, prompt, max_tokens, **kw)
        return self.collect([rid])[rid]

    def status(self, timeout=10):
        """The newest Status (fields by proto name), after draining what is queued."""
        deadline = time.monotonic() + timeout
        fresh = None
        while fresh is None or self.sub.poll(0):
            assert time.monotonic() < deadline, "no Status from the worker"
            if self.sub.poll(200):
                fresh = read_fields(self.sub.recv())
                self._apply_events(read_fields(fresh[STATUS][0]))
        s = read_fields(fresh[STATUS][0])
        g = lambda n: s.get(n, [0])[0]
        self.last_status = dict(state=g(5), kv_blocks_total=g(6), kv_blocks_free=g(7), kv_blocks_active=g(8),
                                num_running=g(9), num_waiting=g(10), num_preemptions_total=g(20),
                                prefix_cache_queries_total=g(21), prefix_cache_hits_total=g(22),
                                state_slots_total=g(25), state_slots_free=g(26), kv_bytes_total=g(30),
                                kv_bytes_used=g(31))
        return self.last_status

    def _apply_events(self, s):
        """Status.events (BlockHashEvent: 1 kind, 2 packed hashes) applied in order, as a
        router's mirror does."""
        for raw in s.get(13, []):
            ev = read_fields(raw)
            kind, hashes = ev.get(1, [0])[0], _uints(ev.get(2, []))
            if kind == 2:                       # ALL_CLEARED
                self.cached_hashes.clear()
            elif kind == 1:                     # REMOVED
                self.cached_hashes.difference_update(hashes)
            else:                               # STORED
                self.cached_hashes.update(hashes)

    def wait_status(self, pred, timeout=30, what="status"):
        deadline = time.monotonic() + timeout
        while True:
            s = self.status()
            if pred(s):
                return s
            assert time.monotonic() < deadline, f"timed out waiting for {what}: last {s}"


def greedy_until_tie(w, prompts, greedy, margins, tie=1e-3):
    """Each prompt's greedy continuation up to its first step whose reference top-1 /
    top-2 margin is under `tie` (where rounding may pick either), asked of worker `w`
    alone and then all at once: both must give it.  Returns the tokens checked."""
    wants = []
    for ids, g, mg in zip(prompts, greedy, margins):
        k = next((i for i, m in enumerate(mg) if m < tie), len(g))
        wants.append((ids, g[:k]))
    alone = [w.run(f"a{i}", ids, len(want)) for i, (ids, want) in enumerate(wants)]
    for i, (ids, want) in enumerate(wants):
        assert alone[i].tokens == want, i
    with w.paused():
        for i, (ids, want) in enumerate(wants):
            w.submit(f"b{i}", ids, len(want))
    batch = w.collect([f"b{i}" for i in range(len(wants))])
    for i in range(len(wants)):
        assert batch[f"b{i}"].tokens == alone[i].tokens, i
    return sum(len(want) for _, want in wants)
