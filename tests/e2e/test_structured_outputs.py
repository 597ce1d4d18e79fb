"""Structured outputs (issue #17) through the official openai SDK on the demo SmolLM2:
`response_format`, `structured_outputs` and the older `guided_*` fields, on
/v1/chat/completions and /v1/completions, streamed or not, with n > 1.  Every output
of the schema table must parse and validate with `jsonschema` (formats checked too):
the mask, not the 135M model, is what makes them valid.  The grammar engine itself is
unit-tested in tests/unit/test_grammar.c; one server for the module keeps it short."""
import concurrent.futures
import json
import re
import threading

import jsonschema
import openai
import pytest
import requests

from conftest import http_status, serve_demo

MODEL = "smol"
S = {"type": "string", "maxLength": 16}     # bounded strings keep every answer short

SCHEMAS = [
    ("flat", {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}),
    ("nested", {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": S, "address": {
            "type": "object", "properties": {"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
                   "required": ["name", "address"], "additionalProperties": False}},
                "required": ["person"], "additionalProperties": False}),
    ("int-array", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
                   "maxItems": 4}),
    ("enum", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
              "additionalProperties": False}),
    ("number-bounds", {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                                         "y": {"type": "number", "minimum": 0.5, "maximum": 1.5}},
                       "required": ["x", "y"], "additionalProperties": False}),
    ("exclusive-bounds", {"type": "object", "properties": {
        "n": {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 7}}, "required": ["n"],
                          "additionalProperties": False}),
    ("pattern", {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                 "required": ["code"], "additionalProperties": False}),
    # "examples" is an annotation (the grammar ignores it) the prompt shows the model: with
    # the exp of issue #21 SmolLM2's greedy email looped on "example.com/..." without '@'
    ("email", {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 24,
                                                          "examples": ["ann@example.com"]}},
               "required": ["email"], "additionalProperties": False}),
    ("date", {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"],
              "additionalProperties": False}),
    ("uuid", {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"],
              "additionalProperties": False}),
    ("ipv4", {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}}, "required": ["ip"],
              "additionalProperties": False}),
    ("date-time", {"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}},
                   "required": ["at"], "additionalProperties": False}),
    ("ref-defs", {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                        "y": {"type": "integer"}},
                                      "required": ["x", "y"], "additionalProperties": False}},
                  "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
                  "required": ["a", "b"], "additionalProperties": False}),
    ("anyOf-scalar", {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, S]}},
                      "required": ["v"], "additionalProperties": False}),
    ("anyOf-objects", {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "maximum": 9}},
         "required": ["kind", "lives"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
         "required": ["kind", "good"], "additionalProperties": False}]}),
    ("boolean", {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                 "additionalProperties": False}),
    ("array-of-objects", {"type": "object", "properties": {"items": {
        "type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                             "tag": {"enum": ["new", "old"]}},
            "required": ["id", "tag"], "additionalProperties": False}}},
                          "required": ["items"], "additionalProperties": False}),
    ("const", {"type": "object", "properties": {"version": {"const": 2}, "name": S}, "required": ["version", "name"],
               "additionalProperties": False}),
    ("nullable", {"type": "object", "properties": {"nick": {"type": ["string", "null"], "maxLength": 8}},
                  "required": ["nick"], "additionalProperties": False}),
    ("deep", {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": ["c"],
        "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
              "required": ["a"], "additionalProperties": False}),
    ("string-lengths", {"type": "object", "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 6}},
                        "required": ["word"], "additionalProperties": False}),
    ("optional-props", {"type": "object", "properties": {"a": {"type": "integer"}, "b": S}, "required": ["a"],
                        "additionalProperties": False}),
    ("top-enum-array", {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1, "maxItems": 3}),
    ("top-string-enum", {"enum": ["alpha", "beta", "gamma"]}),
    ("top-integer", {"type": "integer", "minimum": 10, "maximum": 20}),
    ("tuple", {"type": "array", "prefixItems": [S, {"type": "integer"}, {"type": "boolean"}], "items": False}),
    ("number-enum", {"type": "object", "properties": {"size": {"enum": [1, 2, 4, 8]}}, "required": ["size"],
                     "additionalProperties": False}),
    ("pattern-items", {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"}, "minItems": 1,
                       "maxItems": 3}),
    ("mixed", {"type": "object", "properties": {"title": S, "done": {"type": "boolean"},
                                                "priority": {"enum": ["low", "high"]},
                                                "score": {"type": "number", "minimum": 0, "maximum": 1}},
               "required": ["title", "done", "priority", "score"], "additionalProperties": False}),
    ("ref-array", {"$defs": {"tag": {"type": "string", "enum": ["a", "b", "c"]}}, "type": "object",
                   "properties": {"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 2,
                                           "maxItems": 2}},
                   "required": ["tags"], "additionalProperties": False}),
    ("nested-anyOf", {"type": "object", "properties": {"result": {"anyOf": [
        {"type": "object", "properties": {"error": S}, "required": ["error"], "additionalProperties": False},
        {"type": "object", "properties": {"value": {"type": "integer"}}, "required": ["value"],
         "additionalProperties": False}]}}, "required": ["result"], "additionalProperties": False}),
    ("empty-array-allowed", {"type": "object", "properties": {"list": {"type": "array", "items": {"type": "integer"},
                                                                       "maxItems": 2}},
                             "required": ["list"], "additionalProperties": False}),
]


def _serve(tmp_path_factory, *flags):
    return serve_demo(tmp_path_factory, *flags, name=MODEL)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base, proc = _serve(tmp_path_factory)
    yield base
    proc.kill_group()


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


def _validate(schema, text):
    value = json.loads(text)
    cls = jsonschema.validators.validator_for(schema)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)
    return value


def _ask(c, name, schema, **kw):
    """response_format json_schema, greedy.  The table asks for JSON without free
    whitespace (structured_outputs.disable_any_whitespace, an option beside
    response_format): with vLLM's default any-whitespace grammar a 135M model may
    spend its whole budget on newlines inside a valid prefix."""
    prompt = f"Reply with a JSON value for '{name}' that matches this schema: {json.dumps(schema)}"
    return c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}}, **kw)


def test_schema_table(server):
    """≥ 30 schemas, 8 at a time (continuous batching mixes their masks in one step)."""
    assert len(SCHEMAS) >= 30
    c = _client(server)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda ns: _ask(c, *ns), SCHEMAS))
    bad = []
    for (name, schema), r in zip(SCHEMAS, results):
        ch = r.choices[0]
        try:
            assert ch.finish_reason == "stop", f"finish_reason {ch.finish_reason}"
            _validate(schema, ch.message.content)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            bad.append(f"{name}: {ch.message.content!r}: {str(e)[:200]}")
    assert not bad, "\n".join(bad)


def test_json_object_and_structured_outputs_json(server):
    c = _client(server)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A JSON object with a key a."}],
                                  max_tokens=60, temperature=0, response_format={"type": "json_object"},
                                  extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:   # cut by max_tokens: still the start of an object, and no free whitespace
        assert r.choices[0].message.content.startswith("{")
    schema = SCHEMAS[0][1]
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person."}], max_tokens=80,
                                  temperature=0, extra_body={"structured_outputs": {"json": schema}})
    assert r.choices[0].finish_reason == "stop"
    _validate(schema, r.choices[0].message.content)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person."}], max_tokens=80,
                                  temperature=0, extra_body={"guided_json": schema})
    _validate(schema, r.choices[0].message.content)


def test_regex_and_choice(server):
    c = _client(server)
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    for body in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        r = c.completions.create(model=MODEL, prompt="A ticket code:", max_tokens=20, temperature=0, extra_body=body)
        assert r.choices[0].finish_reason == "stop"
        assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text
    choices = ["Paris", "London", "a city \"quoted\"\n"]
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capital of France?"}],
                                      max_tokens=20, temperature=0, extra_body=body)
        assert r.choices[0].message.content in choices
        assert r.choices[0].finish_reason == "stop"
    r = c.completions.create(model=MODEL, prompt="Say a then b:", max_tokens=20, temperature=0,
                             extra_body={"structured_outputs": {"grammar": 'root ::= "a"+ "b"'}})
    assert re.fullmatch(r"a+b", r.choices[0].text), r.choices[0].text


def test_n4_and_seed(server):
    """n = 4 samples at temperature 1, each its own matcher; a seeded request repeats."""
    c = _client(server)
    schema = SCHEMAS[0][1]
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "A person as JSON."}], max_tokens=80,
              temperature=1.0, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    r = c.chat.completions.create(n=4, **kw)
    assert len(r.choices) == 4
    for ch in r.choices:
        if ch.finish_reason == "stop":
            _validate(schema, ch.message.content)
        else:
            assert ch.finish_reason == "length"
    assert sum(ch.finish_reason == "stop" for ch in r.choices) >= 2
    a = c.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = c.chat.completions.create(seed=1234, **kw).choices[0].message.content
    assert a == b
    r = c.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, temperature=1.0, n=4, seed=7,
                             extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert all(ch.text in ("yes", "no", "maybe") for ch in r.choices)


def test_stream(server):
    c = _client(server)
    name, schema = SCHEMAS[16]
    full = _ask(c, name, schema).choices[0].message.content
    chunks = list(_ask(c, name, schema, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full
    _validate(schema, text)
    assert chunks[-1].choices[0].finish_reason == "stop"
    stream = c.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=0, stream=True,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", "".join(ch.choices[0].text for ch in stream))


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}},
     r"^Failed to transform json schema into a grammar: "),
    ({"structured_outputs": {"regex": "(unclosed"}}, r"^Failed to transform regex into a grammar: "),
    ({"structured_outputs": {"choice": []}}, r"Choice list must not be empty"),
    ({"structured_outputs": {"grammar": "root ::= "}}, r"^Invalid grammar specification: "),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     r"^You can only use one kind of structured outputs constraint"),
    ({"structured_outputs": {"json": "{not json"}}, r"^Failed to transform json schema into a grammar: "),
]


def test_bad_inputs_and_a_concurrent_request(server):
    """Bad specs are a 400 with vLLM's body while a normal request runs on, undisturbed."""
    c = _client(server)
    messages = [{"role": "user", "content": "Count from one to twenty in words."}]
    want = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0).choices[0]
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("r", c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, temperature=0).choices[0]))
    t.start()
    for extra, pattern in BAD:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, **extra}
        resp = requests.post(server + "/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["type"] == "BadRequestError" and err["code"] == 400
        assert re.search(pattern, err["message"]), err["message"]
    t.join(timeout=300)
    assert got["r"].message.content == want.message.content
    assert got["r"].finish_reason == want.finish_reason
    assert http_status(server + "/health") == 200


def test_async_scheduling_same_outputs(server, tmp_path_factory):
    """--async-scheduling samples step N on its step thread while N+1 is scheduled: the
    matchers must see the same tokens in the same order, so greedy outputs are the
    synchronous server's, byte for byte, in a batch of 8."""
    base, proc = _serve(tmp_path_factory, "--async-scheduling")
    try:
        picks = SCHEMAS[:8]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            sync = list(pool.map(lambda ns: _ask(_client(server), *ns).choices[0].message.content, picks))
            asyn = list(pool.map(lambda ns: _ask(_client(base), *ns).choices[0].message.content, picks))
        assert asyn == sync
        for (_, schema), text in zip(picks, asyn):
            _validate(schema, text)
    finally:
        proc.kill_group()
