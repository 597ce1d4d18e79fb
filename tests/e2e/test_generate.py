"""Generation through the whole system: the official openai SDK -> router (template,
tokenizer, SSE) -> worker (scheduler, SmolLM2 forward on the CPU) and back."""
import json
import socket

import openai
import pytest
import requests

from conftest import http_status, wait_until

MODEL = "smol"


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    """One `tessera serve` for the module (loading SmolLM2 takes a few seconds)."""
    from conftest import DEMO_MODEL, LAUNCHER, Proc, free_port, skip_because
    if not DEMO_MODEL.exists():
        skip_because("not-fetched", f"demo model absent ({DEMO_MODEL}); scripts/fetch-model.sh fetches it")
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc = Proc([LAUNCHER, "serve", DEMO_MODEL, "--host", "127.0.0.1", "--port", port,
                 "--served-model-name", MODEL, "--max-model-len", "2048", "--max-num-seqs", "16",
                 "--kv-cache-memory-bytes", "512M",
                 "--dtype", "float32"], log)   # compared with float32 transformers goldens
    base = f"http://127.0.0.1:{port}"

    def ready():
        if proc.p.poll() is not None:
            raise AssertionError(proc.output())
        if http_status(base + "/health") != 200:
            return False
        r = requests.post(base + "/tokenize", json={"prompt": "x"}, timeout=5)
        return r.status_code == 200
    wait_until(ready, timeout=120, interval=0.1, what="server ready")
    yield base, proc
    proc.kill_group()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_completion_greedy_is_deterministic(client):
    a = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    b = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 12
    assert a.usage.prompt_tokens == 5
    assert a.usage.total_tokens == 17
    assert a.id.startswith("cmpl-") and a.object == "text_completion" and a.model == MODEL
    assert "Paris" in a.choices[0].text


def test_chat_with_sdk(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],
                                       max_tokens=24, temperature=0)
    m = r.choices[0].message
    assert m.role == "assistant" and isinstance(m.content, str) and m.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens > 10      # the chat template wraps the message


def test_stream_equals_non_stream(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=30,
              temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    # vLLM's shape: role chunk first, text deltas, a finish chunk, then the usage chunk.
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1


def test_completion_stream_raw_sse(server):
    base, _ = server
    with requests.post(base + "/v1/completions", json={"model": MODEL, "prompt": "Once upon a time",
                                                       "max_tokens": 8, "temperature": 0, "stream": True},
                       stream=True, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == b"data: [DONE]"
    bodies = [json.loads(e[6:]) for e in events[:-1]]
    assert all(b["object"] == "text_completion" and b["usage"] is None for b in bodies)
    assert bodies[-1]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(b["choices"][0]["text"] for b in bodies)
    plain = requests.post(base + "/v1/completions", json={"model": MODEL, "prompt": "Once upon a time",
                                                          "max_tokens": 8, "temperature": 0}, timeout=60).json()
    assert streamed == plain["choices"][0]["text"]


def test_stop_string_cuts_and_reports(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0)
    text = base.choices[0].text
    assert "," in text
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[","])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text.split(",")[0]     # cut before the stop string
    assert r.choices[0].model_extra.get("stop_reason") == ","
    metrics = requests.get(str(client.base_url).replace("/v1/", "/metrics"), timeout=5).text
    assert 'tessera:request_aborts_total{cause="stop_string"}' in metrics


def test_n_and_multiple_prompts(server):
    base, _ = server
    r = requests.post(base + "/v1/completions", json={"model": MODEL, "prompt": ["Hi", "Hello there"],
                                                      "max_tokens": 4, "n": 2, "temperature": 0.8, "seed": 7},
                      timeout=60).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["usage"]["completion_tokens"] == 16
    again = requests.post(base + "/v1/completions", json={"model": MODEL, "prompt": ["Hi", "Hello there"],
                                                          "max_tokens": 4, "n": 2, "temperature": 0.8, "seed": 7},
                          timeout=60).json()
    assert [c["text"] for c in r["choices"]] == [c["text"] for c in again["choices"]]   # seeded


def test_token_id_prompts_like_lm_eval(server):
    base, _ = server
    ids = requests.post(base + "/tokenize", json={"prompt": "The quick brown fox"}, timeout=10).json()["tokens"]
    r = requests.post(base + "/v1/completions", json={"model": MODEL, "prompt": [ids, ids[:2]], "max_tokens": 3,
                                                      "temperature": 0}, timeout=60).json()
    assert len(r["choices"]) == 2
    text = requests.post(base + "/v1/completions", json={"model": MODEL, "prompt": "The quick brown fox",
                                                         "max_tokens": 3, "temperature": 0}, timeout=60).json()
    assert r["choices"][0]["text"] == text["choices"][0]["text"]


def test_errors_are_vllm_shaped(server):
    base, _ = server
    r = requests.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": -1}, timeout=10)
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "temperature must be non-negative, got -1.0.",
                                  "type": "BadRequestError", "param": "temperature", "code": 400}}
    r = requests.post(base + "/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user",
                                                                                          "content": "x"}]}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["message"] == "The model `gpt-4` does not exist."
    r = requests.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi " * 3000, "max_tokens": 4},
                      timeout=30)
    assert r.status_code == 400 and "maximum context length is" in r.json()["error"]["message"]
    r = requests.post(base + "/v1/completions", data="{not json", headers={"content-type": "application/json"},
                      timeout=10)
    assert r.status_code == 400
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0).completions.create(
            model=MODEL, prompt="x", max_tokens=4, logprobs=50)


def test_disconnect_mid_stream_frees_kv(server):
    base, _ = server
    s = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    body = json.dumps({"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 1500, "stream": True,
                       "ignore_eos": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(65536)
    s.close()

    def running():
        text = requests.get(base + "/metrics", timeout=5).text
        line = [l for l in text.splitlines() if l.startswith("vllm:num_requests_running{")][0]
        return float(line.rsplit(" ", 1)[1])
    wait_until(lambda: running() == 0.0, timeout=10, what="request aborted after the client left")
    text = requests.get(base + "/metrics", timeout=5).text
    aborts = [l for l in text.splitlines() if l.startswith('tessera:request_aborts_total{cause="client_disconnected"}')]
    assert aborts and float(aborts[0].rsplit(" ", 1)[1]) >= 1


def test_metrics_count_requests(server, client):
    base, _ = server
    before = requests.get(base + "/metrics", timeout=5).text
    usage = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0).usage
    after = requests.get(base + "/metrics", timeout=5).text

    def value(text, prefix):
        for line in text.splitlines():
            if line.startswith(prefix):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(prefix)
    key = 'vllm:request_success_total{engine="0",finished_reason="length",model_name="smol"}'
    assert value(after, key) == value(before, key) + 1
    assert value(after, 'vllm:time_to_first_token_seconds_count{engine="0",model_name="smol"}') > \
        value(before, 'vllm:time_to_first_token_seconds_count{engine="0",model_name="smol"}')
    # iteration_tokens_total: one sample per engine step (the request ran alone: 3 steps,
    # one token each); its sum counts the prompt once, in the step that ended its prefill
    it = 'vllm:iteration_tokens_total_%s{engine="0",model_name="smol"}'
    assert value(after, it % "count") - value(before, it % "count") == 3
    assert value(after, it % "sum") - value(before, it % "sum") == usage.prompt_tokens + usage.completion_tokens


GOLDENS = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures" / "forward" / "smollm2.json"


def test_greedy_matches_transformers_through_the_server(server):
    """The 10 greedy continuations transformers produced for SmolLM2 from the same GGUF
    (tests/fixtures/make_forward_goldens.py), reproduced through HTTP: prompt token ids
    in, and the completion text must equal the golden ids decoded by /detokenize (the
    tokenizer itself is checked against HF in the unit suite).

    All ten run at once, so they share engine steps: continuous batching must not change
    a single token (the CPU backend computes each sequence independently of the batch)."""
    from concurrent.futures import ThreadPoolExecutor
    base, _ = server
    goldens = json.loads(GOLDENS.read_text())["greedy_prompts"]

    def run(g):
        return requests.post(base + "/v1/completions", json={"model": MODEL, "prompt": g["ids"], "temperature": 0,
                                                             "max_tokens": len(g["greedy"]), "ignore_eos": True,
                                                             "skip_special_tokens": False}, timeout=600).json()
    with ThreadPoolExecutor(len(goldens)) as pool:
        results = list(pool.map(run, goldens))
    for g, r in zip(goldens, results):
        want_text = requests.post(base + "/detokenize", json={"tokens": g["greedy"]}, timeout=10).json()["prompt"]
        assert r["choices"][0]["text"] == want_text, g["text"]
        assert r["usage"]["completion_tokens"] == len(g["greedy"])


def _tokenize(base, text):
    return requests.post(base + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                         timeout=10).json()["tokens"]


def _lm_eval_parse(resp, ctxlens):
    """lm-eval's parse_logprobs for local-completions: choices by index, the echoed
    prompt's continuation slice [ctxlen:-1] (the last element is the 1 generated token)."""
    out = []
    for choice, ctxlen in zip(sorted(resp["choices"], key=lambda c: c["index"]), ctxlens):
        lp = choice["logprobs"]
        logprobs = lp["token_logprobs"][ctxlen:-1]
        tops = lp["top_logprobs"][ctxlen:-1]
        is_greedy = all(isinstance(top, dict) and tok == max(top, key=top.get)
                        for tok, top in zip(lp["tokens"][ctxlen:-1], tops))
        out.append((sum(logprobs), is_greedy))
    return out


def test_loglikelihood_like_lm_eval(server):
    """The exact body lm-eval's local-completions sends for loglikelihood, parsed as
    lm-eval parses it, checked for self-consistency across three engine paths: the echoed
    prompt (prompt logprobs over chunked prefill), a generation step, and the choice's
    vLLM prompt_logprobs list."""
    base, _ = server
    pairs = [("The capital of France is", " Paris"), ("One, two, three,", " four, five")]
    ctxs = [_tokenize(base, c) for c, _ in pairs]
    conts = [_tokenize(base, x) for _, x in pairs]
    body = {"model": MODEL, "prompt": [c + x for c, x in zip(ctxs, conts)], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}
    r = requests.post(base + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    resp = r.json()
    assert [c["index"] for c in resp["choices"]] == [0, 1]
    for choice, ids in zip(resp["choices"], body["prompt"]):
        lp = choice["logprobs"]
        assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
        n = len(ids) + 1                                   # the prompt, then the generated token
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["text_offset"][0] == 0
        for i in range(1, n):
            assert lp["text_offset"][i] == lp["text_offset"][i - 1] + len(lp["tokens"][i - 1])
            v, top = lp["token_logprobs"][i], lp["top_logprobs"][i]
            assert v <= 0 and isinstance(top, dict) and 1 <= len(top) <= 2
            assert top[lp["tokens"][i]] == v               # the token itself is always a key
            assert max(top.values()) >= v
        # (a) the generated (greedy) token: rank 1, so its logprob is the dict's maximum
        assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())
        assert choice["text"] == "".join(lp["tokens"])
        # the choice's vLLM-shaped prompt_logprobs agree with the echoed list
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for i in range(1, len(ids)):
            entry = plp[i][str(ids[i])]
            assert entry["logprob"] == lp["token_logprobs"][i] and entry["decoded_token"] == lp["tokens"][i]
            assert entry["rank"] >= 1
    assert resp["usage"]["completion_tokens"] == 2
    parsed = _lm_eval_parse(resp, [len(c) for c in ctxs])
    assert parsed[0][1] is True                            # " Paris" is SmolLM2's greedy answer
    assert all(ll < 0 for ll, _ in parsed)
    # (c) a second request computes the same continuation sums (no prefix-cache read, same math)
    again = _lm_eval_parse(requests.post(base + "/v1/completions", json=body, timeout=120).json(),
                           [len(c) for c in ctxs])
    for (a, ga), (b, gb) in zip(parsed, again):
        assert abs(a - b) < 1e-5 and ga == gb
    # (b) the logprob of a prompt token via echo equals the one a generation step reports
    # for the same token at the same context
    ctx = ctxs[1]
    gen = requests.post(base + "/v1/completions", json={"model": MODEL, "prompt": ctx, "max_tokens": 1,
                                                        "temperature": 0, "logprobs": 3}, timeout=60).json()
    glp = gen["choices"][0]["logprobs"]
    assert glp["text_offset"] == [0] and len(glp["tokens"]) == 1
    assert len(glp["top_logprobs"][0]) == 3                # rank 1 token plus two more
    g_tok, g_lp = glp["tokens"][0], glp["token_logprobs"][0]
    g_id = _tokenize(base, g_tok)
    assert len(g_id) == 1                                  # " four": its text re-tokenizes to itself
    echo = requests.post(base + "/v1/completions", json={"model": MODEL, "prompt": ctx + g_id, "max_tokens": 1,
                                                         "temperature": 0, "logprobs": 1, "echo": True},
                         timeout=60).json()["choices"][0]["logprobs"]
    assert echo["tokens"][len(ctx)] == g_tok
    assert abs(echo["token_logprobs"][len(ctx)] - g_lp) < 1e-4


def test_logprobs_match_transformers_goldens(server):
    """Independent numbers: the goldens hold transformers' full last-position logits and
    per-position top-20 logits for SmolLM2 (tests/fixtures/make_forward_goldens.py).
    log_softmax preserves logit differences, so the echoed logprob of prompt token t minus
    the rank-1 alternative's must equal their logit difference at position t-1; and the
    generated token's logprob must equal log_softmax of the full last-position logits."""
    import math
    import struct
    base, _ = server
    goldens = json.loads(GOLDENS.read_text())
    for gi, g in enumerate(goldens["logit_prompts"][:3]):
        ids = g["ids"]
        r = requests.post(base + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1,
                                                          "temperature": 0, "logprobs": 1, "echo": True},
                          timeout=120).json()
        lp = r["choices"][0]["logprobs"]
        checked = 0
        for t in range(1, len(ids)):
            top20 = dict((i, v) for i, v in g["top20"][t - 1])
            tol = 2e-3 * g["max_abs"][t - 1]
            best_id = g["top20"][t - 1][0][0]
            if ids[t] not in top20 or len(lp["top_logprobs"][t]) != 2:
                continue
            # the two keys: the prompt token and the rank-1 token (when they differ)
            (k1, v1), = [(k, v) for k, v in lp["top_logprobs"][t].items() if k != lp["tokens"][t]]
            best_text = requests.post(base + "/detokenize", json={"tokens": [best_id]}, timeout=10).json()["prompt"]
            if k1 != best_text:
                continue                                   # a near-tie resolved differently: skip
            assert abs((lp["token_logprobs"][t] - v1) - (top20[ids[t]] - top20[best_id])) < tol, (gi, t)
            checked += 1
        assert checked >= 3, gi
        raw = (GOLDENS.parent / g["last_logits_file"]).read_bytes()
        last = struct.unpack(f"<{len(raw) // 4}f", raw)
        m = max(last)
        lse = m + math.log(sum(math.exp(x - m) for x in last))
        want = max(last) - lse                             # the greedy token's logprob
        assert abs(lp["token_logprobs"][-1] - want) < 2e-3 * g["max_abs"][-1], gi


def test_echo_max_tokens_zero_returns_prompt_only(server):
    base, _ = server
    ids = _tokenize(base, "The capital of France")
    for stream in (False, True):
        body = {"model": MODEL, "prompt": ids, "max_tokens": 0, "logprobs": 0, "echo": True, "temperature": 0,
                "stream": stream}
        if stream:
            r = requests.post(base + "/v1/completions", json=body, stream=True, timeout=60)
            events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                      if line.startswith("data: ") and line != "data: [DONE]"]
            assert len(events) == 1
            choice = events[0]["choices"][0]
        else:
            resp = requests.post(base + "/v1/completions", json=body, timeout=60).json()
            assert resp["usage"]["completion_tokens"] == 1  # vLLM counts the one token it ran
            choice = resp["choices"][0]
        assert choice["text"] == "The capital of France"
        assert choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == len(ids)
        assert choice["logprobs"]["token_logprobs"][0] is None


def test_stream_logprobs_follow_the_text(server):
    base, _ = server
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 2,
            "stream": True}
    full = requests.post(base + "/v1/completions", json=dict(body, stream=False), timeout=60).json()["choices"][0]
    r = requests.post(base + "/v1/completions", json=body, stream=True, timeout=60)
    chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines(decode_unicode=True)
              if line.startswith("data: ") and line != "data: [DONE]"]
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
    assert tokens == full["logprobs"]["tokens"] and offsets == full["logprobs"]["text_offset"]
    assert [v for c in chunks for v in c["logprobs"]["token_logprobs"]] == full["logprobs"]["token_logprobs"]
    assert "".join(c["text"] for c in chunks) == full["text"]


def test_chat_logprobs_with_sdk(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],
                                       max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob  # greedy: rank 1
        assert c.logprob <= 0 and c.bytes == list(c.token.encode())
        assert [a.logprob for a in c.top_logprobs] == sorted((a.logprob for a in c.top_logprobs), reverse=True)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],
                                                 max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
                                                 stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert r.choices[0].logprobs is not None
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           temperature=0)
    assert plain.choices[0].logprobs is None


def test_request_ids_follow_vllm(server):
    """id = prefix + X-Request-Id, else + the body's request_id, else random hex."""
    base, _ = server
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    r = requests.post(base + "/v1/completions", json=body, headers={"X-Request-Id": "hdr-1"}, timeout=30).json()
    assert r["id"] == "cmpl-hdr-1"
    r = requests.post(base + "/v1/completions", json={**body, "request_id": "body-2"}, timeout=30).json()
    assert r["id"] == "cmpl-body-2"
    r = requests.post(base + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "Hi"}]}, timeout=30).json()
    assert r["id"].startswith("chatcmpl-") and len(r["id"]) == len("chatcmpl-") + 32
