"""`tessera bench serve` (deploy/bench_serve.c) against a live `tessera serve` with the
demo SmolLM2 model.  The expected block layout and JSON keys are read from vLLM 0.33.0's
vllm/benchmarks/serve.py (benchmark(), process_one_metric(), main_async()); every
statistic is recomputed here with numpy from the per-request arrays of the JSON."""
import json
import re
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from conftest import BUILD, DEMO_MODEL, LAUNCHER, REPO, serve_demo

MODEL = "smol"
BENCH_TIMEOUT = 600   # a loaded 2-core machine runs SmolLM2 at a few tokens/s per request

# serve.py's print order: (label, kind) with kind "int" for "{:<40} {:<10}" and
# "f2" for "{:<40} {:<10.2f}"; None marks lines printed only under a condition.
HEAD = "============ Serving Benchmark Result ============"
TAIL = "=" * 50


def block_lines(stdout):
    lines = stdout.splitlines()
    start = lines.index(HEAD)
    end = lines.index(TAIL, start + 1)
    return lines[start:end + 1]


def expected_labels(max_concurrency, rate, goodput, metrics, percentiles):
    rows = [("Successful requests:", "int"), ("Failed requests:", "int")]
    if max_concurrency is not None:
        rows.append(("Maximum request concurrency:", "int"))
    if rate is not None:
        rows.append(("Request rate configured (RPS):", "f2"))
    rows += [("Benchmark duration (s):", "f2"), ("Total input tokens:", "int"),
             ("Total generated tokens:", "int"), ("Request throughput (req/s):", "f2")]
    if goodput:
        rows.append(("Request goodput (req/s):", "f2"))
    rows += [("Output token throughput (tok/s):", "f2"), ("Peak output token throughput (tok/s):", "f2"),
             ("Peak concurrent requests:", "f2"), ("Total token throughput (tok/s):", "f2")]
    sections = [("ttft", "TTFT", "Time to First Token"),
                ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                ("itl", "ITL", "Inter-token Latency"),
                ("e2el", "E2EL", "End-to-end Latency")]
    for attr, name, header in sections:
        if attr not in metrics:
            continue
        rows.append(("{s:{c}^{n}}".format(s=header, n=50, c="-"), "header"))
        rows.append((f"Mean {name} (ms):", "f2"))
        rows.append((f"Median {name} (ms):", "f2"))
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            rows.append((f"P{word} {name} (ms):", "f2"))
    return rows


def check_block(stdout, **kw):
    """Every line of the block exactly as Python's str.format would lay it out."""
    lines = block_lines(stdout)
    rows = expected_labels(**kw)
    assert lines[0] == HEAD and lines[-1] == TAIL
    body = lines[1:-1]
    assert [r[0] if r[1] == "header" else r[0] for r in rows] == \
        [line if line.startswith("-") else line[:40].rstrip() for line in body], "\n".join(lines)
    values = {}
    for (label, kind), line in zip(rows, body):
        if kind == "header":
            assert line == label
            continue
        raw = line[41:]
        assert line[:41] == "{:<40} ".format(label)
        if kind == "int":
            v = int(raw)
            assert line == "{:<40} {:<10}".format(label, v)
        else:
            v = float(raw)
            assert re.fullmatch(r"-?\d+\.\d\d *", raw), line
            assert line == "{:<40} {:<10.2f}".format(label, v)
        values[label] = v
    return values


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base, proc = serve_demo(tmp_path_factory, "--max-num-seqs", "16", name=MODEL, kv_cache="512M")
    yield base, int(base.rsplit(":", 1)[1]), proc
    proc.kill_group()


def bench(*flags, timeout=BENCH_TIMEOUT):
    return subprocess.run([str(LAUNCHER), "bench", "serve", *map(str, flags)], capture_output=True, text=True,
                          timeout=timeout)


def one_json(result_dir):
    files = list(Path(result_dir).glob("*.json"))
    assert len(files) == 1, files
    return files[0], json.loads(files[0].read_text())


# ------------------------------------------------------------------ flags (no server)

@pytest.mark.parametrize("flags, message", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--num-prompts"], "expected one argument"),
    (["--num-prompts", "ten"], "invalid int value: 'ten'"),
    (["--request-rate", "fast"], "invalid float value: 'fast'"),
    (["--backend", "tgi"], "--backend"),
    (["--dataset-name", "sharegpt"], "--dataset-name"),
    (["--max-concurrency", "0"], "--max-concurrency must be greater than 0"),
    (["--random-range-ratio", "1.5"], "[0, 1)"),
    (["--ramp-up-strategy", "linear"], "not supported by tessera bench serve"),
    (["--goodput", "itl:5"], "Invalid metric name"),
    (["--percentile-metrics", "ttft,foo"], "unknown metric 'foo'"),
    (["--backend", "openai-chat"], "must end with one of: {'chat/completions'}"),
    (["--header", "novalue"], "KEY=VALUE"),
    (["--metric-percentiles", "99,abc"], "'abc' is not a number"),
    (["--ignore-eos=1"], "ignored explicit argument"),
])
def test_bad_flags_exit_2(flags, message):
    assert LAUNCHER.exists(), f"{LAUNCHER} not built"
    r = bench(*flags, "--port", "1", timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr, r.stderr
    assert "usage: tessera bench serve" in r.stderr


def test_help_and_launcher_usage():
    assert LAUNCHER.exists(), f"{LAUNCHER} not built"
    r = bench("--help", timeout=60)
    assert r.returncode == 0 and "--max-concurrency" in r.stdout
    r = subprocess.run([str(LAUNCHER), "bench"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "tessera bench serve" in r.stderr


# ------------------------------------------------------------------ live runs

def test_completions_block_json_and_concurrency(server, tmp_path):
    base, port, _ = server
    n, out_len, in_len, conc = 6, 6, 24, 2
    running = []
    stop = threading.Event()

    def watch():   # the server's own view of the running batch
        while not stop.is_set():
            try:
                text = requests.get(base + "/metrics", timeout=5).text
                m = re.search(r'^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$', text, re.M)
                if m:
                    running.append(float(m.group(1)))
            except requests.RequestException:
                pass
            time.sleep(0.05)
    t = threading.Thread(target=watch)
    t.start()
    try:
        r = bench("--port", port, "--model", MODEL, "--tokenizer", DEMO_MODEL, "--num-prompts", n,
                  "--random-input-len", in_len, "--random-output-len", out_len, "--max-concurrency", conc,
                  "--ignore-eos", "--temperature", "0", "--seed", "3",
                  "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99.5",
                  "--goodput", "ttft:3600000", "--save-result", "--save-detailed", "--result-dir", tmp_path / "res")
    finally:
        stop.set()
        t.join()
    assert r.returncode == 0, r.stderr
    values = check_block(r.stdout, max_concurrency=conc, rate=None, goodput=True,
                         metrics=["ttft", "tpot", "itl", "e2el"], percentiles=[50, 90, 99.5])
    assert values["Successful requests:"] == n
    assert values["Failed requests:"] == 0
    assert values["Maximum request concurrency:"] == conc
    assert values["Total generated tokens:"] == n * out_len
    assert "100%|" in r.stderr                     # the progress bar

    path, d = one_json(tmp_path / "res")
    # vLLM's default name: {backend}-{rate}qps-concurrency{C}-{basename(model)}-{YYYYmmdd-HHMMSS}.json
    assert re.fullmatch(rf"openai-infqps-concurrency{conc}-{MODEL}-\d{{8}}-\d{{6}}\.json", path.name), path.name
    head = ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
            "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
            "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
            "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls",
            "latencies", "start_times", "queue_times", "generated_texts", "errors", "max_output_tokens_per_s",
            "max_concurrent_requests", "rtfx"]
    assert list(d)[:len(head)] == head
    assert d["backend"] == d["endpoint_type"] == "openai" and d["label"] is None
    assert d["model_id"] == MODEL and d["tokenizer_id"] == str(DEMO_MODEL)
    assert d["request_rate"] == "inf" and d["burstiness"] == 1.0 and d["max_concurrency"] == conc
    assert d["num_prompts"] == n and d["completed"] == n and d["failed"] == 0
    assert d["output_lens"] == [out_len] * n and d["total_output_tokens"] == n * out_len
    assert all(isinstance(x, int) for x in d["input_lens"]) and sum(d["input_lens"]) == d["total_input_tokens"]
    assert all(x == in_len for x in d["input_lens"])          # server-counted prompt tokens
    assert d["errors"] == [""] * n and all(isinstance(s, str) and s for s in d["generated_texts"])
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput",
                "max_output_tokens_per_s", "rtfx", "request_goodput"):
        assert isinstance(d[key], float), key
    assert isinstance(d["max_concurrent_requests"], int)
    assert all(len(itl) == out_len - 1 for itl in d["itls"])   # one chunk per token after the first

    # every statistic from the per-request arrays, as calculate_metrics() computes it
    ttfts, lat = np.array(d["ttfts"]), np.array(d["latencies"])
    tpots = (lat - ttfts) / (np.array(d["output_lens"]) - 1)
    itls = [x for per in d["itls"] for x in per]
    dur = d["duration"]
    assert d["request_throughput"] == pytest.approx(n / dur, rel=1e-12)
    assert d["output_throughput"] == pytest.approx(n * out_len / dur, rel=1e-12)
    assert d["total_token_throughput"] == pytest.approx((d["total_input_tokens"] + n * out_len) / dur, rel=1e-12)
    assert d["request_goodput"] == pytest.approx(n / dur, rel=1e-12)   # an SLO every request meets
    for attr, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", lat)):
        assert d[f"mean_{attr}_ms"] == pytest.approx(np.mean(vals) * 1000, rel=1e-9)
        assert d[f"median_{attr}_ms"] == pytest.approx(np.median(vals) * 1000, rel=1e-9)
        assert d[f"std_{attr}_ms"] == pytest.approx(np.std(vals) * 1000, rel=1e-9, abs=1e-9)
        for p in (50, 90, 99.5):
            word = str(int(p)) if int(p) == p else str(p)
            assert d[f"p{word}_{attr}_ms"] == pytest.approx(np.percentile(vals, p) * 1000, rel=1e-9)
    assert values["Mean TTFT (ms):"] == pytest.approx(d["mean_ttft_ms"], abs=0.006)
    assert values["P99.5 ITL (ms):"] == pytest.approx(d["p99.5_itl_ms"], abs=0.006)
    assert values["Benchmark duration (s):"] == pytest.approx(dur, abs=0.006)

    # --max-concurrency: never more than `conc` requests between send and last token ...
    starts = np.array(d["start_times"])
    events = sorted([(s, 1) for s in starts] + [(s + l, -1) for s, l in zip(starts, lat)],
                    key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, step in events:
        live += step
        peak = max(peak, live)
    assert peak == conc
    # ... and the server never saw more than that running at once
    assert running and max(running) <= conc
    # queued requests waited for a slot (client queue time > 0 for the later ones)
    assert max(d["queue_times"]) > 0


def test_poisson_rate_and_default_json(server, tmp_path):
    base, port, _ = server
    n, rate = 6, 4.0
    r = bench("--port", port, "--model", MODEL, "--tokenizer", DEMO_MODEL, "--num-prompts", n,
              "--random-input-len", 8, "--random-output-len", 3, "--request-rate", rate, "--seed", "1",
              "--disable-tqdm", "--save-result", "--result-dir", tmp_path, "--result-filename", "r.json")
    assert r.returncode == 0, r.stderr
    assert "Traffic request rate: 4.0" in r.stdout
    assert "Burstiness factor: 1.0 (Poisson process)" in r.stdout
    values = check_block(r.stdout, max_concurrency=None, rate=rate, goodput=False,
                         metrics=["ttft", "tpot", "itl"], percentiles=[99])
    assert values["Request rate configured (RPS):"] == 4.0
    assert values["Successful requests:"] == n
    assert "%|" not in r.stderr                    # --disable-tqdm
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["request_rate"] == 4.0 and d["max_concurrency"] is None and d["request_goodput"] is None
    # without --save-detailed the per-request arrays go, as in vLLM (latencies/queue_times stay)
    for gone in ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors"):
        assert gone not in d
    assert len(d["latencies"]) == n and len(d["queue_times"]) == n
    assert "p99_ttft_ms" in d and "mean_e2el_ms" not in d
    # arrivals were spread over about n/rate s (the schedule is rescaled to end at n/rate),
    # not sent at once: the run cannot be shorter than the last arrival
    assert d["duration"] >= 0.9 * n / rate


def test_chat_backend_and_server_tokenizer(server, tmp_path):
    """openai-chat against /v1/chat/completions, and no local tokenizer: the dataset is built
    with the server's /tokenize and /detokenize."""
    base, port, _ = server
    n, out_len = 3, 4
    r = bench("--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", base,
              "--model", MODEL, "--num-prompts", n, "--random-input-len", 12, "--random-output-len", out_len,
              "--ignore-eos", "--temperature", "0", "--disable-tqdm", "--save-result", "--save-detailed",
              "--result-dir", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "server's /tokenize" in r.stdout
    values = check_block(r.stdout, max_concurrency=None, rate=None, goodput=False,
                         metrics=["ttft", "tpot", "itl"], percentiles=[99])
    assert values["Successful requests:"] == n
    assert values["Total generated tokens:"] == n * out_len
    path, d = one_json(tmp_path)
    assert path.name.startswith(f"openai-chat-infqps-{MODEL}-")
    assert d["backend"] == "openai-chat" and d["output_lens"] == [out_len] * n
    assert all(len(itl) == out_len - 1 for itl in d["itls"])   # the role chunk is not a token


def test_dataset_and_schedule_are_numpys(server, tmp_path):
    """vLLM draws the random dataset from numpy.random.default_rng(seed) and the arrival
    gaps from the legacy np.random.seed(seed) stream; tessera bench serve reproduces both,
    so numpy here predicts the per-request lengths and the send schedule."""
    base, port, _ = server
    n, seed, rate, in_len, out_len, ratio = 6, 11, 4.0, 16, 4, 0.5
    r = bench("--port", port, "--model", MODEL, "--tokenizer", DEMO_MODEL, "--num-prompts", n, "--seed", seed,
              "--random-input-len", in_len, "--random-output-len", out_len, "--random-range-ratio", ratio,
              "--request-rate", rate, "--ignore-eos", "--temperature", "0", "--disable-tqdm",
              "--save-result", "--save-detailed", "--result-dir", tmp_path)
    assert r.returncode == 0, r.stderr
    _, d = one_json(tmp_path)
    # datasets/utils.py get_sampling_params (SmolLM2 adds no special tokens)
    rng = np.random.default_rng(seed)
    want_in = rng.integers(int(np.floor(in_len * (1 - ratio))), int(np.ceil(in_len * (1 + ratio))) + 1, size=n)
    want_out = rng.integers(max(1, int(np.floor(out_len * (1 - ratio)))), int(np.ceil(out_len * (1 + ratio))) + 1,
                            size=n)
    assert d["output_lens"] == want_out.tolist()          # --ignore-eos: exactly max_tokens
    if "WARNING: across all generated prompts" not in r.stdout:
        assert d["input_lens"] == want_in.tolist()        # server-counted prompt tokens
    # serve.py get_request: gamma gaps from np.random.seed(seed), cumulative, rescaled to n/rate
    np.random.seed(seed)
    gaps = np.cumsum([np.random.gamma(shape=1.0, scale=1.0 / rate) for _ in range(n)])
    due = gaps * (n / rate) / gaps[-1]
    starts = np.array(d["start_times"])
    # never sent before its arrival time (measured from the first request; 0.2 s for a late first send)
    assert np.all(starts - starts[0] >= due - due[0] - 0.2), (starts - starts[0], due - due[0])
    assert d["duration"] >= due[-1] - 0.2


def test_multi_turn_waits_for_the_previous_turn(server, tmp_path):
    """multi_turn is a closed loop per session: a turn is sent no earlier than its
    session's previous turn has finished (a user waits for the answer).  At
    --request-rate inf every arrival is due at once, so only that rule spaces them."""
    base, port, _ = server
    sessions, turns, out_len = 3, 3, 4
    r = bench("--port", port, "--model", MODEL, "--tokenizer", DEMO_MODEL, "--dataset-name", "multi_turn",
              "--num-prompts", sessions * turns, "--multi-turn-turns", turns, "--multi-turn-user-len", 6,
              "--multi-turn-session-prefix-len", 10, "--random-prefix-len", 8, "--random-output-len", out_len,
              "--request-rate", "inf", "--temperature", "0", "--seed", "5", "--disable-tqdm",
              "--save-result", "--save-detailed", "--result-dir", tmp_path)
    assert r.returncode == 0, r.stderr
    _, d = one_json(tmp_path)
    assert d["completed"] == sessions * turns and d["output_lens"] == [out_len] * (sessions * turns)
    starts = np.array(d["start_times"])
    ends = starts + np.array(d["latencies"])
    # prompts grow round by round: 8 + 10 + 6 ids, then + 4 + 6 per turn
    lens = np.array(d["input_lens"]).reshape(turns, sessions)
    assert np.all(lens[1:].min(axis=1) > lens[:-1].max(axis=1)), lens
    # the dataset is in rounds of one turn per session; whatever the order inside a round,
    # each turn of round k+1 has its own predecessor in round k that ended before it
    # started, so the j-th earliest start of round k+1 is no earlier than the j-th earliest
    # end of round k (Hall's condition for that matching)
    for k in range(turns - 1):
        prev_ends = np.sort(ends[k * sessions:(k + 1) * sessions])
        next_starts = np.sort(starts[(k + 1) * sessions:(k + 2) * sessions])
        assert np.all(next_starts >= prev_ends - 1e-3), (k, prev_ends, next_starts)
    # while round 0 went out at once
    assert np.ptp(starts[:sessions]) < 0.5, starts


class RecordingProxy:
    """A pass-through HTTP proxy in front of the server that keeps each request's body
    by its x-request-id, so a test sees the prompts the client really sent, and the text
    the server streamed back for it.  It relays a response whole (timing is not under
    test) and, with drop_usage, strips the usage from a stream, as a server that reports
    none would send it."""

    def __init__(self, upstream, drop_usage=False):
        import http.server

        self.bodies, self.texts = {}, {}
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                rid = self.headers.get("x-request-id")
                proxy.bodies[rid] = json.loads(body)
                r = requests.post(upstream + self.path, data=body, headers={"Content-Type": "application/json"},
                                  timeout=BENCH_TIMEOUT)
                out = r.content
                if r.status_code == 200:
                    proxy.texts[rid] = proxy.streamed_text(out)
                if drop_usage and r.status_code == 200:
                    out = b"".join(proxy.without_usage(ev) for ev in out.split(b"\n\n") if ev.strip())
                self.send_response(r.status_code)
                self.send_header("Content-Type", r.headers.get("Content-Type", "text/event-stream"))
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @staticmethod
    def streamed_text(stream):
        """The text of a completions or chat stream: its choices' text / delta.content."""
        text = []
        for event in stream.split(b"\n\n"):
            event = event.strip()
            if event.startswith(b"data: {"):
                for c in json.loads(event[6:]).get("choices") or []:
                    text.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
        return "".join(text)

    @staticmethod
    def without_usage(event):
        if event.startswith(b"data: {"):
            d = json.loads(event[6:])
            if d.get("usage") and not d.get("choices"):
                return b""
            d.pop("usage", None)
            event = b"data: " + json.dumps(d).encode()
        return event + b"\n\n"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def server_count(base, text):
    """The server tokenizer's count of text (no special tokens added)."""
    return requests.post(f"{base}/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False},
                         timeout=30).json()["count"]


def multi_turn_through_proxy(server, tmp_path, sessions, turns, *flags, tokenizer=DEMO_MODEL, all_answered=True):
    """`tessera bench serve` multi_turn through a RecordingProxy that drops the usage:
    (the request bodies sent, in dataset order; the texts the server streamed back for
    them; the --save-detailed JSON).  The client aligns its prompts to the server's
    tokenizer exactly when `tokenizer` is not the served model's.  all_answered: every
    turn got text back (else an empty answer is resent as the dataset's stand-in)."""
    base, _, _ = server
    proxy = RecordingProxy(base, drop_usage=True)
    try:
        r = bench("--port", proxy.port, "--model", MODEL, "--tokenizer", tokenizer, "--dataset-name", "multi_turn",
                  "--num-prompts", sessions * turns, "--multi-turn-turns", turns, "--multi-turn-user-len", 6,
                  "--random-prefix-len", 8, "--random-output-len", 4, "--request-rate", "inf",
                  "--temperature", "0", "--seed", "5", "--disable-tqdm", "--request-id-prefix", "mt-",
                  "--save-result", "--save-detailed", "--result-dir", tmp_path, *flags)
    finally:
        proxy.close()
    assert r.returncode == 0, r.stderr
    assert ("re-aligning prompts" in r.stdout) == (tokenizer != DEMO_MODEL), r.stdout
    _, d = one_json(tmp_path)
    assert d["completed"] == sessions * turns and (all(d["generated_texts"]) or not all_answered), d
    ids = [f"mt-{i}" for i in range(sessions * turns)]
    return [proxy.bodies[i] for i in ids], [proxy.texts[i] for i in ids], d


def multi_turn_prompts(server, tmp_path, sessions, turns, *flags):
    """multi_turn_through_proxy for the completions backend: (the prompts sent; the JSON)."""
    bodies, _, d = multi_turn_through_proxy(server, tmp_path, sessions, turns, *flags)
    return [b["prompt"] for b in bodies], d


def test_multi_turn_resends_the_generated_answer(server, tmp_path):
    """As vLLM's multi-turn benchmark (send_turn keeps the server's answer as the next
    turn's context), a turn's prompt is the previous turn's prompt as sent, then the
    text the server generated for it, then new user text; not the dataset's stand-in
    reply.  A proxy records the prompts.  It also drops the usage chunk, so each input
    length is the client's own count of the prompt it sent, which must match the
    server's tokenizer on that prompt.  --multi-turn-dataset-replies sends the stand-ins."""
    base, _, _ = server
    sessions, turns = 3, 3
    prompts, d = multi_turn_prompts(server, tmp_path / "resend", sessions, turns)
    gen = d["generated_texts"]
    # every turn of rounds 1.. extends exactly one turn of the round before with that
    # turn's generated answer, and every turn of a round is extended once
    for k in range(1, turns):
        extended = []
        for i in range(k * sessions, (k + 1) * sessions):
            prev = [j for j in range((k - 1) * sessions, k * sessions) if prompts[i].startswith(prompts[j] + gen[j])]
            assert len(prev) == 1, (i, prompts[i], [prompts[j] + gen[j] for j in range((k - 1) * sessions, k * sessions)])
            assert len(prompts[i]) > len(prompts[prev[0]] + gen[prev[0]])     # and then the user's text
            extended += prev
        assert sorted(extended) == list(range((k - 1) * sessions, k * sessions))
    assert d["input_lens"] == [server_count(base, p) for p in prompts]

    # the opt-out: each turn still extends its predecessor's prompt, but not with the answer
    prompts, d = multi_turn_prompts(server, tmp_path / "stand-in", sessions, turns, "--multi-turn-dataset-replies")
    gen = d["generated_texts"]
    for i in range(sessions, sessions * turns):
        k = i // sessions
        prev = [j for j in range((k - 1) * sessions, k * sessions) if prompts[i].startswith(prompts[j])]
        assert len(prev) == 1 and not prompts[i].startswith(prompts[prev[0]] + gen[prev[0]]), i


CHAT = ("--backend", "openai-chat", "--endpoint", "/v1/chat/completions")


def conversation(body):
    """A chat body's messages as (role, text) pairs, a content's text parts joined."""
    def text(c):
        return c if isinstance(c, str) else "".join(p["text"] for p in c if p["type"] == "text")
    return [(m["role"], text(m["content"])) for m in body["messages"]]


def test_chat_multi_turn_sends_the_conversation(server, tmp_path):
    """openai-chat sends a multi_turn turn as a chat client keeps the conversation (vLLM's
    multi-turn benchmark appends each answer it got back to its `messages`): the session's
    first prompt as a user message, then for every later turn the text the server streamed
    back for the turn before as an assistant message and the turn's own user text as a
    user message; not the history flattened into one user message.  The dataset is the
    same whatever the backend, so the completions backend's stand-in prompts (what the
    dataset holds) tell the user texts apart from the answers."""
    base, _, _ = server
    sessions, turns = 3, 3
    n = sessions * turns
    flat, _ = multi_turn_prompts(server, tmp_path / "flat", sessions, turns, "--multi-turn-dataset-replies")
    bodies, streamed, d = multi_turn_through_proxy(server, tmp_path / "chat", sessions, turns, *CHAT)
    convs = [conversation(b) for b in bodies]
    assert streamed == d["generated_texts"] and all(streamed)
    for i, conv in enumerate(convs):
        assert [role for role, _ in conv] == ["user", "assistant"] * (i // sessions) + ["user"], (i, conv)
    assert [conv[0][1] for conv in convs[:sessions]] == flat[:sessions]     # a first turn: its prompt, whole
    for k in range(1, turns):
        extended = []
        for i in range(k * sessions, (k + 1) * sessions):
            # the conversation of one turn of the round before, then its answer as
            # streamed, then this turn's user text, which the dataset's prompt ends with
            prev = [j for j in range((k - 1) * sessions, k * sessions) if convs[i][:-2] == convs[j]]
            assert len(prev) == 1, (i, convs[i])
            j = prev[0]
            assert convs[i][-2] == ("assistant", streamed[j]), (i, j)
            assert flat[i].startswith(flat[j]) and flat[i].endswith(convs[i][-1][1]), (i, j)
            extended.append(j)
        assert sorted(extended) == list(range((k - 1) * sessions, k * sessions))
    # the client's count of a prompt the server's usage did not give (the proxy drops
    # it) is the server tokenizer's count of the conversation's text
    assert d["input_lens"] == [server_count(base, "".join(t for _, t in conv)) for conv in convs]

    # --multi-turn-dataset-replies: the same user messages, the dataset's stand-in replies
    # as the assistant's, so that the conversation's text is the dataset's prompt
    bodies, _, _ = multi_turn_through_proxy(server, tmp_path / "chat-stand-in", sessions, turns, *CHAT,
                                            "--multi-turn-dataset-replies")
    stand_in = [conversation(b) for b in bodies]
    for i in range(n):
        assert [role for role, _ in stand_in[i]] == [role for role, _ in convs[i]], i
        assert [m for m in stand_in[i] if m[0] == "user"] == [m for m in convs[i] if m[0] == "user"], i
        assert "".join(t for _, t in stand_in[i]) == flat[i], i


def test_multi_turn_aligned_to_the_server_tokenizer(server, tmp_path):
    """A --tokenizer that counts the first prompt differently from the server's makes the
    client cut prompts to the server's count (align_to_server; this one's text takes more
    SmolLM2 tokens).  The first turns are cut; a later turn still is the previous turn's
    prompt as sent, then the answer (the server's, or the dataset's stand-in), then its own
    user text, for the completions and the chat backend alike, and every input length the
    client reports (the proxy drops the usage) is the server's count of what it sent."""
    base, _, _ = server
    sessions, turns = 2, 3
    n = sessions * turns
    tok = REPO / "tests" / "fixtures" / "tokenizers" / "metaspace_bf.tokenizer.json"
    # user texts long enough that the sessions' first turns still differ once cut
    runs = {name: multi_turn_through_proxy(server, tmp_path / name, sessions, turns, "--multi-turn-user-len", 24,
                                           *flags, tokenizer=tok, all_answered=False)
            for name, flags in (("flat", ("--multi-turn-dataset-replies",)),
                                ("chat-stand-in", (*CHAT, "--multi-turn-dataset-replies")),
                                ("resend", ()), ("chat", CHAT))}
    flat = [b["prompt"] for b in runs["flat"][0]]
    resent, gen = [b["prompt"] for b in runs["resend"][0]], runs["resend"][2]["generated_texts"]
    stand_in = [conversation(b) for b in runs["chat-stand-in"][0]]
    convs, streamed = [conversation(b) for b in runs["chat"][0]], runs["chat"][1]
    for h in range(sessions):       # a first turn: its aligned prompt, whatever the backend
        assert flat[h] == resent[h] == stand_in[h][0][1] == convs[h][0][1], h
    for i in range(sessions, n):
        k = i // sessions
        # the chat stand-in conversation tells the previous turn, the stand-in reply and
        # the user text apart
        prev = [j for j in range((k - 1) * sessions, k * sessions) if stand_in[i][:-2] == stand_in[j]]
        assert len(prev) == 1, (i, stand_in[i])
        (j,), ((r1, reply), (r2, user)) = prev, stand_in[i][-2:]
        assert (r1, r2) == ("assistant", "user"), i
        assert flat[i] == flat[j] + reply + user == "".join(t for _, t in stand_in[i]), i
        # an answer with no text is resent as the stand-in (turn_answer)
        assert resent[i] == resent[j] + (gen[j] or reply) + user, i
        assert convs[i] == convs[j] + [("assistant", streamed[j] or reply), ("user", user)], i
    texts = {"flat": flat, "chat-stand-in": ["".join(t for _, t in c) for c in stand_in], "resend": resent,
             "chat": ["".join(t for _, t in c) for c in convs]}
    for name, sent in texts.items():
        assert runs[name][2]["input_lens"] == [server_count(base, t) for t in sent], name


def test_chat_single_turn_sends_one_user_message(server, tmp_path):
    """A single-turn dataset keeps vLLM's openai-chat payload: one user message holding
    the prompt as one text part, as the completions backend sends it as `prompt`."""
    base, _, _ = server
    sent = {}
    for backend in (("--backend", "openai"), CHAT):
        proxy = RecordingProxy(base)
        try:
            r = bench("--port", proxy.port, "--model", MODEL, "--tokenizer", DEMO_MODEL, "--num-prompts", 2,
                      "--random-input-len", 12, "--random-output-len", 2, "--temperature", "0", "--seed", "7",
                      "--disable-tqdm", "--request-id-prefix", "st-", *backend)
        finally:
            proxy.close()
        assert r.returncode == 0, r.stderr
        sent[backend[1]] = [proxy.bodies[f"st-{i}"] for i in range(2)]
    for chat, completion in zip(sent["openai-chat"], sent["openai"]):
        assert chat["messages"] == [{"role": "user", "content": [{"type": "text", "text": completion["prompt"]}]}]


# ------------------------------------------------------------------ vLLM's own client
VLLM_VENV = REPO / ".venv-vllm"     # scripts/test.sh: vllm --no-deps + tests/requirements-vllm.txt
CROSSCHECK = REPO / "deploy" / "bench_vllm_crosscheck.py"


def test_vllm_client_crosscheck(server, tmp_path):
    """vLLM's `vllm bench serve` (its serve.py, unmodified, through
    deploy/bench_vllm_crosscheck.py) and `tessera bench serve`, same flags, same server,
    same tokenizer files: the same requests (input lengths), the same greedy outputs
    byte for byte, the same result-block lines in the same order and the same JSON keys
    in the same order."""
    py = VLLM_VENV / "bin" / "python"
    assert py.exists(), f"{py} missing: scripts/test.sh makes it (pip install --no-deps vllm)"
    base, port, _ = server
    tok = tmp_path / "tok"
    r = subprocess.run([py, CROSSCHECK, "tokenizer", DEMO_MODEL, tok], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    flags = ["--backend", "openai", "--port", str(port), "--model", MODEL, "--tokenizer", str(tok),
             "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
             "--random-range-ratio", "0.5", "--num-prompts", "8", "--temperature", "0", "--seed", "5",
             "--save-result", "--save-detailed"]
    out = {}
    for who, cmd in (("vllm", [py, CROSSCHECK, "serve"]), ("tessera", [LAUNCHER, "bench", "serve"])):
        d = tmp_path / who
        r = subprocess.run([str(c) for c in cmd] + flags + ["--result-dir", str(d)], capture_output=True,
                           text=True, timeout=BENCH_TIMEOUT)
        assert r.returncode == 0, f"{who}: {r.stdout[-3000:]}{r.stderr[-3000:]}"
        block = r.stdout[r.stdout.index("============ Serving Benchmark Result"):]
        labels = [ln.split(":")[0].strip() for ln in block.splitlines() if ":" in ln]
        out[who] = (labels, one_json(d)[1])
    (v_labels, v), (t_labels, t) = out["vllm"], out["tessera"]
    assert t_labels == v_labels
    assert list(t.keys()) == list(v.keys())
    assert t["input_lens"] == v["input_lens"] and len(v["input_lens"]) == 8
    assert t["output_lens"] == v["output_lens"]
    assert t["generated_texts"] == v["generated_texts"]
    assert t["completed"] == v["completed"] == 8


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_bench_engine_rows(kv):
    """tessera-bench-engine (deploy/bench_engine.c) on the tiny Llama: a row per batch and
    the prefill, each with a positive rate.  Its prompts once used token ids up to 4000
    whatever the vocabulary, so on this 300-token model every forward failed and the
    table said 0.0 tok/s with exit 0; a failed run is now an error."""
    model = REPO / "tests" / "fixtures" / "tiny-llama3-hf" / "f32"
    out = subprocess.run([BUILD / "deploy" / "tessera-bench-engine", model, "--dtypes", "float32",
                          "--batches", "1,2", "--steps", "4", "--prefill", "16", "--context", "64",
                          "--repeat", "1", "--threads", "1", "--no-bandwidth", "--kv-cache-dtype", kv],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^\| float32 \| 1 \| (decode batch \d+|prefill \d+ tokens) \| ([0-9.]+) \|", out.stdout, re.M)}
    assert set(rows) == {"decode batch 1", "decode batch 2", "prefill 16 tokens"}, out.stdout
    assert all(v > 0 for v in rows.values()), rows
    assert f"KV cache {'fp8_e4m3' if kv == 'fp8' else 'f32'}, context 64" in out.stdout, out.stdout


@pytest.mark.parametrize("model,family", [("tiny-llama4", "llama4"), ("tiny-nemotron-h/model", "nemotron_h"),
                                          ("tiny-llama3-hf/f32", "llama")])
def test_bench_family_rows(model, family):
    """tessera-bench-family (deploy/bench_family.c) through the worker's runner: the
    family the worker would pick, a row per batch and the prefill, each with a positive
    rate; Llama 4's chunked-attention table and NemotronH's state slots included."""
    out = subprocess.run([BUILD / "deploy" / "tessera-bench-family", REPO / "tests" / "fixtures" / model,
                          "--threads", "1", "--batches", "1,3", "--steps", "3", "--prefill", "20", "--repeat", "1",
                          "--dtype", "float32"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f": family {family} (" in out.stdout, out.stdout
    rows = {m.group(1): float(m.group(2)) for m in
            re.finditer(rf"^\| {family} \| float32 \| 1 \| (decode batch \d+|prefill \d+ tokens) \| ([0-9.]+) \|$",
                         out.stdout, re.M)}
    assert set(rows) == {"decode batch 1", "decode batch 3", "prefill 20 tokens"}, out.stdout
    assert all(v > 0 for v in rows.values()), rows
