"""Structured outputs after the reasoning, end to end (issue #17): vLLM 0.12 leaves the
tokens before `</think>` free and constrains only what follows.  None of our fixture
vocabularies has a `</think>` token, so this test makes one: a copy of the tiny HF
Llama (tests/fixtures/tiny-llama3-hf) whose tokenizer.json turns two unused merge
results into the added tokens `<think>` and `</think>` (checked against HF
`tokenizers`).  The random model is led to `</think>` by a logit_bias and seeded
sampling, so the same request with and without a constraint shows:

* the reasoning is token for token what the unconstrained request produced (the mask
  is not applied before `</think>`; the unconstrained reasoning holds characters the
  regex would refuse);
* the content after it matches the regex, although the bias still favours
  `</think>` (the mask is applied after it);
* streamed deltas add up to the same reasoning and content."""
import json
import re
import shutil
from pathlib import Path

import openai
import pytest
import requests

from conftest import serve_model

TINY = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama3-hf" / "f32"
REGEX = "[0-9]{3}x"
MSGS = [{"role": "user", "content": "think first"}]


def _with_think_tokens(src, dst):
    """dst = src with `<think>` / `</think>` as added (non-special) tokens on the ids of
    the two last merge results, which no other merge uses; their merges are dropped so BPE
    never produces them from text.  Returns (think_start_id, think_end_id)."""
    shutil.copytree(src, dst)
    tj = json.loads((dst / "tokenizer.json").read_text())
    model = tj["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    used = {part for m in merges for part in m}
    results = ["".join(m) for m in merges]
    free = [t for t in reversed(results) if t not in used][:2]
    # ascending ids, at the top of the vocabulary: HF `tokenizers` gives an added token
    # that is not in the model's vocab the next free id, whatever the file says
    free.sort(key=lambda t: model["vocab"][t])
    assert [model["vocab"][t] for t in free] == [len(model["vocab"]) - 2, len(model["vocab"]) - 1]
    ids = []
    for tok, content in zip(free, ("<think>", "</think>")):
        tid = model["vocab"].pop(tok)
        merges = [m for m in merges if "".join(m) != tok]
        tj["added_tokens"].append({"id": tid, "content": content, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": False})
        ids.append(tid)
    model["merges"] = [list(m) for m in merges]
    (dst / "tokenizer.json").write_text(json.dumps(tj))
    return ids[0], ids[1]


@pytest.fixture(scope="module")
def think_server(tmp_path_factory):
    model = tmp_path_factory.mktemp("think") / "model"
    start_id, end_id = _with_think_tokens(TINY, model)
    base, proc = serve_model(tmp_path_factory, model, "--served-model-name", "tiny", "--kv-cache-memory-bytes", "64M",
                             "--dtype", "float32", "--reasoning-parser", "deepseek_r1")
    yield base, model, start_id, end_id
    proc.kill_group()


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_think_tokens_tokenize_as_hf(think_server):
    """The made tokenizer is one HF `tokenizers` reads the same way as Tessera."""
    from tokenizers import Tokenizer
    base, model, start_id, end_id = think_server
    hf = Tokenizer.from_file(str(model / "tokenizer.json"))
    for text in ("<think>kens ld</think>done", "a</think>b<think>c", "world</think>"):
        want = hf.encode(text, add_special_tokens=False).ids
        got = requests.post(base + "/tokenize", json={"model": "tiny", "prompt": text, "add_special_tokens": False},
                            timeout=10).json()["tokens"]
        assert got == want, text
    assert hf.encode("</think>", add_special_tokens=False).ids == [end_id]
    assert hf.encode("<think>", add_special_tokens=False).ids == [start_id]


def _ask(c, end_id, **kw):
    return c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=64, temperature=1.0, seed=7,
                                     logit_bias={str(end_id): 4.0}, **kw)


def test_structured_output_starts_after_think_end(think_server):
    base, _, _, end_id = think_server
    c = _client(base)
    free = _ask(c, end_id).choices[0].message
    # the seed leads to </think> after some free tokens that the regex would refuse
    assert free.reasoning_content and not re.fullmatch("[0-9x]*", free.reasoning_content), free
    assert free.content and not re.fullmatch(REGEX, free.content), free

    for so in ({"structured_outputs": {"regex": REGEX}}, {"guided_choice": ["123x", "456x"]}):
        r = _ask(c, end_id, extra_body=so)
        ch = r.choices[0]
        assert ch.message.reasoning_content == free.reasoning_content
        assert re.fullmatch(REGEX, ch.message.content), ch.message
        assert ch.finish_reason == "stop"
        if "guided_choice" in so:
            assert ch.message.content in ("123x", "456x")

    chunks = list(_ask(c, end_id, stream=True, extra_body={"structured_outputs": {"regex": REGEX}}))
    reasoning = "".join(getattr(x.choices[0].delta, "reasoning_content", None) or "" for x in chunks if x.choices)
    content = "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
    assert reasoning == free.reasoning_content
    assert re.fullmatch(REGEX, content)
    assert [x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason] == ["stop"]


def test_structured_output_n_samples_after_think_end(think_server):
    """n = 3: each sample reasons freely (its own seeded stream), then obeys the regex."""
    base, _, _, end_id = think_server
    r = _ask(_client(base), end_id, n=3, extra_body={"structured_outputs": {"regex": REGEX}})
    assert len(r.choices) == 3
    for ch in r.choices:
        assert re.fullmatch(REGEX, ch.message.content or ""), ch.message
        assert ch.finish_reason == "stop"
