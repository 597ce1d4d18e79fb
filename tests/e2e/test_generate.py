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
    from conftest import DEMO_MODEL, LAUNCHER, Proc, free_port
    if not DEMO_MODEL.exists():
        pytest.skip("demo model not fetched")
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc = Proc([LAUNCHER, "serve", DEMO_MODEL, "--host", "127.0.0.1", "--port", port,
                 "--served-model-name", MODEL, "--max-model-len", "2048", "--max-num-seqs", "16",
                 "--kv-cache-memory-bytes", "512M"], log)
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


def test_metrics_count_requests(server, client):
    base, _ = server
    before = requests.get(base + "/metrics", timeout=5).text
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
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
