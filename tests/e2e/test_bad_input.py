"""Hostile and malformed requests against a live router + worker (the demo SmolLM2 model):
each row of TABLE is sent on its own connection and must get exactly the status, error
type and message listed (vLLM's where vLLM has one: ../shared/reference/vllm-surface.md
§3 "Errors"), never a 5xx, and neither process may die.  docs/testing.md lists the table.

One server serves the whole module; the API-key rows start a second one."""
import json
import re

import pytest
import requests

from conftest import DEMO_MODEL, pid_alive, skip_because
from hostile import error_of, post_bytes, raw_request, start_served

C = "/v1/completions"
CH = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not DEMO_MODEL.exists():
        skip_because("not-fetched", f"demo model absent ({DEMO_MODEL}); scripts/fetch-model.sh fetches it")
    served, proc = start_served(tmp_path_factory.mktemp("bad_input"), DEMO_MODEL)
    served.max_model_len = requests.get(served.base + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    served.model = requests.get(served.base + "/v1/models", timeout=30).json()["data"][0]["id"]
    yield served
    proc.kill_group()


def comp(**kw):
    body = {"prompt": "Hi", "max_tokens": 1}
    body.update(kw)
    return json.dumps(body).encode()


def chat(**kw):
    body = {"messages": MSG, "max_tokens": 1}
    body.update(kw)
    return json.dumps(body).encode()


def nested(depth):
    return ('{"prompt":"Hi","max_tokens":1,"x":' + "[" * depth + "]" * depth + "}").encode()


# Expectations: ("vllm", type, message) = vLLM's error body with exactly this type and a
# message that is equal (str) or matches (re.Pattern); ("detail", text) = FastAPI's
# {"detail": text}; ("unauthorized",) = {"error": "Unauthorized"}; ("ok",) = 200 and a
# normal completion / chat completion.
BR, BRE = "Bad Request", "BadRequestError"


def R(pattern):
    return re.compile(pattern, re.S)


# (id, path, body bytes or callable(server) -> bytes, status, expectation, extra headers)
TABLE = [
        # -- JSON syntax --
        ("invalid-json", C, b'{"prompt": "Hi", ', 400, ("vllm", BR, R(r"^JSON decode error: ")), b""),
        ("empty-body", C, b"", 400, ("vllm", BR, R(r"^JSON decode error: ")), b""),
        ("json-array-body", C, b'[1, 2]', 400, ("vllm", BR, "Input should be a valid dictionary or object"), b""),
        ("json-string-body", CH, b'"hello"', 400, ("vllm", BR, "Input should be a valid dictionary or object"), b""),
        ("trailing-garbage", C, comp() + b"xyz", 400, ("vllm", BR, R(r"^JSON decode error: ")), b""),
        ("nan-literal", C, b'{"prompt":"Hi","temperature":NaN}', 400, ("vllm", BR, R(r"^JSON decode error: ")), b""),
        ("non-utf8-body", C, b'{"prompt":"Hi \xff\xfe there","max_tokens":1}', 400,
         ("vllm", BR, R(r"^JSON decode error: .*(UTF-8|byte)")), b""),
        ("non-utf8-key", C, b'{"prompt":"Hi","\xc3\x28":1}', 400, ("vllm", BR, R(r"^JSON decode error: ")), b""),
        ("lone-surrogate-escape", C, b'{"prompt":"Hi \\ud800","max_tokens":1}', 400,
         ("vllm", BR, R(r"^JSON decode error: .*[Uu]nicode")), b""),
        # Python's json takes "\u0000"; jansson refuses NUL in strings (Tessera passes
        # prompts as C strings): a documented difference, 400 not 5xx.
        ("nul-escape", C, b'{"prompt":"Hi \\u0000 there","max_tokens":1}', 400,
         ("vllm", BR, R(r"^JSON decode error: .*NUL")), b""),
        ("nested-10k", C, nested(10000), 400, ("vllm", BR, R(r"^JSON decode error: .*depth")), b""),
        ("nested-100", C, nested(100), 400, ("vllm", BR, "the request body is nested deeper than 64 levels"), b""),
        ("duplicate-key-last-wins-ok", C, b'{"prompt":"Hi","max_tokens":-1,"max_tokens":1}', 200, ("ok",), b""),
        ("duplicate-key-last-wins-bad", C, b'{"prompt":"Hi","max_tokens":1,"max_tokens":-1}', 400,
         ("vllm", BRE, "max_tokens must be at least 1, got -1."), b""),
        ("huge-integer", C, b'{"prompt":"Hi","max_tokens":100000000000000000000000}', 400,
         ("vllm", BR, R(r"^JSON decode error: ")), b""),
        # -- wrong types --
        ("prompt-number", C, comp(prompt=5), 400, ("vllm", BR, R(r"^prompt: Input should be ")), b""),
        ("prompt-object", C, comp(prompt={"a": 1}), 400, ("vllm", BR, R(r"^prompt: Input should be ")), b""),
        ("prompt-mixed-list", C, comp(prompt=["a", [1, 2]]), 400, ("vllm", BR, R(r"^prompt: Input should be ")), b""),
        ("prompt-float-ids", C, comp(prompt=[1.5, 2]), 400, ("vllm", BR, R(r"^prompt: Input should be ")), b""),
        ("max_tokens-string", C, comp(max_tokens="5"), 400, ("vllm", BR, "max_tokens: Input should be a valid integer"), b""),
        ("max_tokens-fraction", C, comp(max_tokens=1.5), 400,
         ("vllm", BR, "max_tokens: Input should be a valid integer, got a number with a fractional part"), b""),
        ("temperature-string", C, comp(temperature="hot"), 400, ("vllm", BR, "temperature: Input should be a valid number"), b""),
        ("top_p-list", C, comp(top_p=[1]), 400, ("vllm", BR, "top_p: Input should be a valid number"), b""),
        ("top_k-string", C, comp(top_k="1"), 400, ("vllm", BR, "top_k: Input should be a valid integer"), b""),
        ("n-string", C, comp(n="2"), 400, ("vllm", BR, "n: Input should be a valid integer"), b""),
        ("stream-string", C, comp(stream="yes"), 400, ("vllm", BR, "stream: Input should be a valid boolean"), b""),
        ("stop-number", C, comp(stop=5), 400, ("vllm", BR, "stop: Input should be a string or a list of strings"), b""),
        ("stop-list-of-numbers", C, comp(stop=[1, 2]), 400, ("vllm", BR, "stop: Input should be a string or a list of strings"), b""),
        ("model-number", C, comp(model=7), 400, ("vllm", BR, "model: Input should be a valid string"), b""),
        ("seed-string", C, comp(seed="x"), 400, ("vllm", BR, "seed: Input should be a valid integer"), b""),
        ("logit_bias-list", C, comp(logit_bias=[1, 2]), 400, ("vllm", BR, "logit_bias: Input should be a valid dictionary"), b""),
        ("stream_options-string", C, comp(stream=True, stream_options="x"), 400,
         ("vllm", BR, "stream_options: Input should be a valid dictionary"), b""),
        ("messages-string", CH, chat(messages="hello"), 400, ("vllm", BR, "messages: Input should be a valid list"), b""),
        ("messages-missing", CH, b'{"max_tokens":1}', 400, ("vllm", BR, R(r"^messages: Input should be ")), b""),
        ("message-not-object", CH, chat(messages=["hi"]), 400, ("vllm", BR, R(r"^messages: Input should be ")), b""),
        ("message-no-role", CH, chat(messages=[{"content": "hi"}]), 400, ("vllm", BR, R(r"^messages: Input should be ")), b""),
        ("message-role-number", CH, chat(messages=[{"role": 1, "content": "hi"}]), 400,
         ("vllm", BR, R(r"^messages: Input should be ")), b""),
        ("content-number", CH, chat(messages=[{"role": "user", "content": 42}]), 400,
         ("vllm", BR, R(r"^messages: Input should be ")), b""),
        ("content-part-no-type", CH, chat(messages=[{"role": "user", "content": [{"text": "hi"}]}]), 400,
         ("vllm", BR, R(r"^messages: Input should be ")), b""),
        ("content-part-image", CH,
         chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400,
         ("vllm", BRE, "message 0: content part type 'image_url' is not supported by this text-only model"), b""),
        ("tools-not-list", CH, chat(tools={"a": 1}), 400, ("vllm", BR, "tools: Input should be a valid list"), b""),
        ("logprobs-chat-string", CH, chat(logprobs="yes"), 400, ("vllm", BR, "logprobs: Input should be a valid boolean"), b""),
        # -- values (SamplingParams._verify_args and the protocol validators) --
        ("max_tokens-negative", C, comp(max_tokens=-1), 400, ("vllm", BRE, "max_tokens must be at least 1, got -1."), b""),
        ("max_tokens-zero", C, comp(max_tokens=0), 400, ("vllm", BRE, "max_tokens must be at least 1, got 0."), b""),
        ("max_tokens-huge", C, comp(max_tokens=10**12), 400, ("vllm", BRE, R(r"maximum context length")), b""),
        ("chat-max_tokens-huge", CH, chat(max_tokens=10**12), 400, ("vllm", BRE, R(r"'max_tokens' or 'max_completion_tokens' is too large")), b""),
        ("n-zero", C, comp(n=0), 400, ("vllm", BRE, "n must be at least 1, got 0."), b""),
        ("n-negative", C, comp(n=-3), 400, ("vllm", BRE, "n must be at least 1, got -3."), b""),
        ("n-huge", C, comp(n=10**6), 400, ("vllm", BRE, "n must be at most 128, got 1000000."), b""),
        ("n-greedy", C, comp(n=2, temperature=0), 400, ("vllm", BRE, "n must be 1 when using greedy sampling, got 2."), b""),
        ("temperature-negative", C, comp(temperature=-1), 400, ("vllm", BRE, "temperature must be non-negative, got -1.0."), b""),
        ("temperature-negative-chat", CH, chat(temperature=-0.5), 400, ("vllm", BRE, "temperature must be non-negative, got -0.5."), b""),
        ("top_p-above-1", C, comp(top_p=1.5), 400, ("vllm", BRE, "top_p must be in (0, 1], got 1.5."), b""),
        ("top_p-zero", C, comp(top_p=0), 400, ("vllm", BRE, "top_p must be in (0, 1], got 0.0."), b""),
        ("top_k-below-minus-1", C, comp(top_k=-2), 400, ("vllm", BRE, "top_k must be 0 (disable), or at least 1, got -2."), b""),
        ("min_p-above-1", C, comp(min_p=2), 400, ("vllm", BRE, "min_p must be in [0, 1], got 2.0."), b""),
        ("presence_penalty-3", C, comp(presence_penalty=3), 400, ("vllm", BRE, "presence_penalty must be in [-2, 2], got 3.0."), b""),
        ("frequency_penalty-minus-3", C, comp(frequency_penalty=-3), 400,
         ("vllm", BRE, "frequency_penalty must be in [-2, 2], got -3.0."), b""),
        ("repetition_penalty-zero", C, comp(repetition_penalty=0), 400,
         ("vllm", BRE, "repetition_penalty must be greater than zero, got 0.0."), b""),
        ("min_tokens-above-max", C, comp(max_tokens=2, min_tokens=5), 400,
         ("vllm", BRE, "min_tokens must be less than or equal to max_tokens=2, got 5."), b""),
        ("logprobs-21", C, comp(logprobs=21), 400,
         ("vllm", BRE, "Requested sample logprobs of 21, which is greater than max allowed: 20"), b""),
        ("chat-top_logprobs-21", CH, chat(logprobs=True, top_logprobs=21), 400,
         ("vllm", BRE, "Requested sample logprobs of 21, which is greater than max allowed: 20"), b""),
        ("top_logprobs-without-logprobs", CH, chat(top_logprobs=5), 400,
         ("vllm", BRE, "when using `top_logprobs`, `logprobs` must be set to true."), b""),
        ("prompt_logprobs-with-stream", C, comp(stream=True, prompt_logprobs=1), 400,
         ("vllm", BRE, "`prompt_logprobs` are not available when `stream=True`."), b""),
        ("stream_options-without-stream", C, comp(stream_options={"include_usage": True}), 400,
         ("vllm", BRE, "Stream options can only be defined when `stream=True`."), b""),
        ("stream_options-empty-without-stream-ok", C, comp(stream_options={}), 200, ("ok",), b""),
        ("stop-empty-string", C, comp(stop=["a", ""]), 400, ("vllm", BRE, "stop cannot contain an empty string."), b""),
        ("stop-five-strings-ok", C, comp(stop=["a", "b", "c", "d", "e"]), 200, ("ok",), b""),
        ("logit_bias-value-clamped-ok", C, comp(logit_bias={"1": 1e9, "2": -1e9}), 200, ("ok",), b""),
        ("logit_bias-key-not-int", C, comp(logit_bias={"abc": 1}), 400,
         ("vllm", BRE, "logit_bias contains key(s) that cannot be converted to integer token IDs: ['abc']"), b""),
        ("logit_bias-key-out-of-vocab", C, comp(logit_bias={"999999": 1}), 400,
         ("vllm", BRE, R(r"^token_id\(s\) \[999999\] in logit_bias contain out-of-vocab token ids\. Vocabulary size: \d+$")), b""),
        ("suffix", C, comp(suffix="x"), 400, ("vllm", BRE, "suffix is not currently supported"), b""),
        # -- fields that would change the output but are not implemented: refused, never dropped --
        ("response_format-text-ok", CH, chat(response_format={"type": "text"}), 200, ("ok",), b""),
        # structured outputs (issue #17): valid specs run, bad ones are a 400 from the router
        ("response_format-json_object-ok", CH, chat(response_format={"type": "json_object"}), 200, ("ok",), b""),
        ("response_format-json_schema-ok", CH,
         chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
         200, ("ok",), b""),
        ("response_format-json_object-completions-ok", C, comp(response_format={"type": "json_object"}), 200,
         ("ok",), b""),
        ("response_format-structural_tag", CH, chat(response_format={"type": "structural_tag"}), 400,
         ("vllm", BRE, "response_format type 'structural_tag' is not supported yet (supported: 'text', "
                       "'json_object', 'json_schema')"), b""),
        ("response_format-string", CH, chat(response_format="json"), 400,
         ("vllm", BR, "response_format: Input should be an object with a string `type`"), b""),
        ("response_format-bad-schema", CH,
         chat(response_format={"type": "json_schema", "json_schema": {
             "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}), 400,
         ("vllm", BRE, R(r"^Failed to transform json schema into a grammar: ")), b""),
        ("structured_outputs-choice-ok", C, comp(structured_outputs={"choice": ["a", "b"]}), 200, ("ok",), b""),
        ("structured_outputs-choice-empty", C, comp(structured_outputs={"choice": []}), 400,
         ("vllm", BRE, "Failed to transform choices into a grammar: Choice list must not be empty"), b""),
        ("structured_outputs-two-kinds", C, comp(structured_outputs={"regex": "a", "choice": ["a"]}), 400,
         ("vllm", BRE, "You can only use one kind of structured outputs constraint but multiple are specified"), b""),
        ("structured_outputs-and-response_format", CH,
         chat(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}), 400,
         ("vllm", BRE, "You can only use one kind of structured outputs constraint but multiple are specified"), b""),
        ("structured_outputs-whitespace_pattern", C, comp(structured_outputs={"regex": "a", "whitespace_pattern": " "}),
         400, ("vllm", BRE, "structured_outputs.whitespace_pattern is not supported yet: the xgrammar backend does "
                            "not take a whitespace pattern"), b""),
        ("guided_json-ok", CH, chat(guided_json={"type": "object"}), 200, ("ok",), b""),
        ("guided_regex-invalid", C, comp(guided_regex="([a-z]+"), 400,
         ("vllm", BRE, R(r"^Failed to transform regex into a grammar: ")), b""),
        ("guided_choice-ok", CH, chat(guided_choice=["yes", "no"]), 200, ("ok",), b""),
        ("guided_grammar-invalid", C, comp(guided_grammar="root ::= "), 400,
         ("vllm", BRE, R(r"^Invalid grammar specification: ")), b""),
        ("logits_processors", C, comp(logits_processors=["my.module.Proc"]), 400,
         ("vllm", BRE, "logits_processors is not supported yet: custom logits processors are not implemented"), b""),
        ("return_tokens_as_token_ids", CH, chat(logprobs=True, return_tokens_as_token_ids=True), 400,
         ("vllm", BRE, "return_tokens_as_token_ids is not supported yet: tokens are returned as text"), b""),
        ("use_beam_search", C, comp(use_beam_search=True), 400,
         ("vllm", BRE, "use_beam_search is not supported yet: beam search is not implemented"), b""),
        ("parallel_tool_calls-ok", CH, chat(parallel_tool_calls=False), 200, ("ok",), b""),
        ("prompt-empty-string", C, comp(prompt=""), 400, ("vllm", BRE, R(r"(Prompt cannot be empty\.|must be provided and non-empty)")), b""),
        ("prompt-empty-list", C, comp(prompt=[]), 400,
         ("vllm", BRE, "Either prompt or prompt_embeds must be provided and non-empty."), b""),
        ("messages-empty", CH, chat(messages=[]), 400, ("vllm", BRE, "messages must contain at least one message."), b""),
        ("unknown-role-accepted", CH, chat(messages=[{"role": "wizard", "content": "Hi"}]), 200, ("ok",), b""),
        ("both-generation-flags", CH, chat(add_generation_prompt=True, continue_final_message=True), 400,
         ("vllm", BRE, "Cannot set both `continue_final_message` and `add_generation_prompt` to True."), b""),
        ("tool_choice-unknown-name", CH,
         chat(tools=[{"type": "function", "function": {"name": "f"}}],
              tool_choice={"type": "function", "function": {"name": "g"}}), 400,
         ("vllm", BRE, "The tool specified in `tool_choice` does not match any of the specified `tools`"), b""),
        ("prompt-id-out-of-vocab", C, comp(prompt=[1, 999999]), 400, ("vllm", BRE, "Token id 999999 is out of vocabulary"), b""),
        ("prompt-id-negative", C, comp(prompt=[1, -5]), 400, ("vllm", BRE, "token id -5 in the prompt is out of range"), b""),
        ("prompt-longer-than-context", C, lambda s: comp(prompt=[1] * (s.max_model_len + 1), max_tokens=1), 400,
         ("vllm", BRE, R(r"maximum context length|longer than the maximum model length")), b""),
        ("max_tokens-beyond-context", C, lambda s: comp(max_tokens=s.max_model_len), 400,
         ("vllm", BRE, R(r"maximum context length")), b""),
        ("unknown-model", C, comp(model="no-such-model"), 404, ("vllm", "NotFoundError", "The model `no-such-model` does not exist."), b""),
        ("unknown-model-chat", CH, chat(model="gpt-4"), 404, ("vllm", "NotFoundError", "The model `gpt-4` does not exist."), b""),
        # -- big strings --
        ("10MB-prompt", C, lambda s: comp(prompt="hello world " * (10 * 2**20 // 12)), 400,
         ("vllm", BRE, R(r"maximum context length|longer than the maximum model length")), b""),
        ("10MB-ignored-field-ok", C, lambda s: comp(user="x" * (10 * 2**20)), 200, ("ok",), b""),
        ("10MB-stop-string", C, lambda s: comp(stop=["x" * (10 * 2**20)]), 400,
         ("vllm", BRE, R(r"^a stop string of \d+ bytes is longer than the 4096 allowed$")), b""),
        # -- /tokenize and /detokenize --
        ("tokenize-invalid-json", "/tokenize", b'{"prompt": ', 400, ("vllm", BR, R(r"^JSON decode error: ")), b""),
        ("tokenize-not-object", "/tokenize", b'[1]', 400, ("vllm", BR, R(r"^JSON decode error: ")), b""),
        ("detokenize-out-of-vocab", "/detokenize", b'{"tokens": [1, 999999]}', 400,
         ("vllm", BRE, "token id at position 1 is out of vocabulary"), b""),
        ("detokenize-negative", "/detokenize", b'{"tokens": [-1]}', 400,
         ("vllm", BRE, "token id at position 0 is out of vocabulary"), b""),
        ("detokenize-wrong-type", "/detokenize", b'{"tokens": "abc"}', 400, ("vllm", BR, "tokens: Input should be a valid list"), b""),
        # -- content type --
        ("content-type-text", C, comp(), 400, ("vllm", BR, "Unsupported Media Type: Only 'application/json' is allowed"),
         "text/plain"),
        ("content-type-missing", C, comp(), 400, ("vllm", BR, "Unsupported Media Type: Only 'application/json' is allowed"),
         None),
]


def send_table_row(server, path, body, content_type):
    if callable(body):
        body = body(server)
    if content_type is None:
        data = (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    elif isinstance(content_type, str):
        data = post_bytes(path, body, content_type=content_type)
    else:
        data = post_bytes(path, body, extra=content_type)
    return raw_request(server.port, data, timeout=120)


def check_expectation(status, body, want_status, want, path):
    assert status is not None, "connection closed without a response"
    assert status < 500, (status, body[:500])
    assert status == want_status, (status, body[:500])
    kind = want[0]
    if kind == "ok":
        doc = json.loads(body)
        assert doc["object"] == ("text_completion" if path == C else "chat.completion")
        assert len(doc["choices"]) >= 1
        return
    if kind == "detail":
        assert json.loads(body) == {"detail": want[1]}
        return
    if kind == "unauthorized":
        assert json.loads(body) == {"error": "Unauthorized"}
        return
    doc = json.loads(body)
    assert set(doc) == {"error"}, doc
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == want_status
    assert err["type"] == want[1], err
    if isinstance(want[2], re.Pattern):
        assert want[2].search(err["message"]), err["message"]
    else:
        assert err["message"] == want[2], err["message"]


@pytest.mark.parametrize("row", TABLE, ids=[r[0] for r in TABLE])
def test_bad_request_body(server, row):
    _, path, body, want_status, want, ctype = row
    status, _, resp = send_table_row(server, path, body, "application/json" if ctype == b"" else ctype)
    check_expectation(status, resp, want_status, want, path)


# -- HTTP level: methods, paths, framing, limits (raw bytes) --
HTTP_TABLE = [
        ("get-on-completions", b"GET /v1/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", 405,
         ("detail", "Method Not Allowed")),
        ("get-on-chat", b"GET /v1/chat/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", 405,
         ("detail", "Method Not Allowed")),
        ("delete-on-models", b"DELETE /v1/models HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", 405,
         ("detail", "Method Not Allowed")),
        ("post-on-health", b"POST /health HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", 405,
         ("detail", "Method Not Allowed")),
        ("unknown-path", b"GET /v1/nope HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", 404, ("detail", "Not Found")),
        ("unknown-path-post", post_bytes("/v2/completions", comp()), 404, ("detail", "Not Found")),
        ("path-traversal", b"GET /../../etc/passwd HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", 404,
         ("detail", "Not Found")),
        ("bad-content-length", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n{}", 400,
         ("vllm", BR, "Invalid HTTP request received.")),
        ("negative-content-length", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: -5\r\n\r\n{}", 400,
         ("vllm", BR, "Invalid HTTP request received.")),
        ("two-content-lengths", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400,
         ("vllm", BR, "Invalid HTTP request received.")),
        ("content-length-and-chunked",
         b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400,
         ("vllm", BR, "Invalid HTTP request received.")),
        ("bad-chunk-size", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400,
         ("vllm", BR, "Invalid HTTP request received.")),
        ("garbage-request-line", b"\x00\x01\x02 hello\r\n\r\n", 400, ("vllm", BR, "Invalid HTTP request received.")),
        ("bad-method", b"FROB /v1/completions HTTP/1.1\r\nHost: t\r\n\r\n", 400, ("vllm", BR, "Invalid HTTP request received.")),
        ("bad-http-version", b"GET /health HTTP/9.9\r\nHost: t\r\n\r\n", 400, ("vllm", BR, "Invalid HTTP request received.")),
        ("non-utf8-header-value", b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Bin: \xff\xfe\x80\r\nConnection: close\r\n\r\n", 200,
         ("models",)),
        ("oversized-body-413", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
         b"Content-Length: 99999999999\r\n\r\n{", 413, ("vllm", "Request Entity Too Large", "Request body too large")),
        ("oversized-chunked-body-413", None, 413, ("vllm", "Request Entity Too Large", "Request body too large")),
        ("too-many-headers-431", b"GET /health HTTP/1.1\r\nHost: t\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(150))
         + b"\r\n", 431, ("vllm", "Request Header Fields Too Large", "Request header fields too large")),
        ("too-large-header-431", b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (70 * 1024) + b"\r\n\r\n", 431,
         ("vllm", "Request Header Fields Too Large", "Request header fields too large")),
        ("too-long-url-431", b"GET /" + b"a" * (70 * 1024) + b" HTTP/1.1\r\nHost: t\r\n\r\n", 431,
         ("vllm", "Request Header Fields Too Large", "Request header fields too large")),
]


def chunked_oversized():
    # 33 MiB in 1 MiB chunks, past the 32 MiB default --max-request-body.
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"%x\r\n" % (1 << 20) + b"a" * (1 << 20) + b"\r\n"
    return head + chunk * 33 + b"0\r\n\r\n"


@pytest.mark.parametrize("row", HTTP_TABLE, ids=[r[0] for r in HTTP_TABLE])
def test_bad_http(server, row):
    name, data, want_status, want = row
    if data is None:
        data = chunked_oversized()
    status, headers, body = raw_request(server.port, data, timeout=120)
    assert status is not None, "connection closed without a response"
    assert status == want_status, (status, body[:300])
    if want[0] == "models":
        assert json.loads(body)["object"] == "list"
        return
    check_expectation(status, body, want_status, want, None)
    if want_status in (400, 413, 431):
        assert headers.get("connection") == "close"   # the server's own errors close


def test_api_key(tmp_path_factory):
    if not DEMO_MODEL.exists():
        skip_because("not-fetched", f"demo model absent ({DEMO_MODEL}); scripts/fetch-model.sh fetches it")
    served, proc = start_served(tmp_path_factory.mktemp("api_key"), DEMO_MODEL, "--api-key", "s3cret", name="keyed",
                                  headers={"Authorization": "Bearer s3cret"})
    try:
        url = served.base + C
        body = {"prompt": "Hi", "max_tokens": 1}
        cases = [
                ({}, 401), ({"Authorization": "Bearer wrong"}, 401), ({"Authorization": "Bearer s3cre"}, 401),
                ({"Authorization": "Bearer s3cretX"}, 401), ({"Authorization": "Basic s3cret"}, 401),
                ({"Authorization": "s3cret"}, 401), ({"Authorization": "Bearer "}, 401),
                ({"Authorization": "bearer s3cret"}, 200), ({"Authorization": "Bearer s3cret"}, 200),
        ]
        for headers, want in cases:
            r = requests.post(url, json=body, headers=headers, timeout=60)
            assert r.status_code == want, (headers, r.status_code, r.text)
            if want == 401:
                assert r.json() == {"error": "Unauthorized"}
        # Only /v1 is guarded, as in vLLM.
        assert requests.get(served.base + "/health", timeout=30).status_code == 200
        assert requests.get(served.base + "/metrics", timeout=30).status_code == 200
        assert requests.get(served.base + "/v1/models", timeout=30).status_code == 401
        assert pid_alive(served.router_pid()) and pid_alive(served.worker_pid())
    finally:
        proc.kill_group()


def test_survives_and_serves(server):
    """After the whole table (module order: this runs last), the processes are alive and
    a normal request still succeeds, with no 5xx counted by the router."""
    router, worker = server.router_pid(), server.worker_pid()
    assert router and worker and pid_alive(router) and pid_alive(worker)
    r = requests.post(server.base + C, json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
                      timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    r = requests.post(server.base + CH, json={"messages": MSG, "max_tokens": 4, "stream": True}, timeout=120, stream=True)
    assert r.status_code == 200
    lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]"
    assert server.router_pid() == router and server.worker_pid() == worker
    assert server.proc.p.poll() is None
