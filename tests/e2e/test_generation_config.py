"""--generation-config (auto | vllm | DIR) and --override-generation-config through the
real launcher, router and worker: the defaults they give must reach sampling.

vLLM (ModelConfig.get_diff_sampling_param, vllm/config/model.py) fills a request's
unset temperature/top_p/top_k/min_p/repetition_penalty from the model's
generation_config.json (auto), from none (vllm) or from DIR/generation_config.json,
with the override laid on top in every mode; max_new_tokens is the max_tokens of a
request that gives none.  So a seeded request that leaves a field out must give
exactly the tokens of the same request with the default written out.

The model is the tiny random Llama of tests/fixtures/tiny-llama3-hf (f32), linked into
a folder of the test's own with a generation_config.json that has sampling keys."""
import json
import os
from pathlib import Path

import pytest
import requests

from conftest import LAUNCHER, SANITIZED, free_port, http_status, wait_until

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama3-hf" / "f32"
PROMPT = [1, 277, 14, 276, 299, 3]          # "Hello, world!" in the fixture's tokenizer
MAX_MODEL_LEN = 256                          # the fixture's max_position_embeddings
SEEDS = (11, 12, 13)
MODEL_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
TIMEOUT = 240 if SANITIZED else 60


@pytest.fixture
def model_dir(tmp_path):
    """The fixture's files (linked) with a generation_config.json that sets defaults."""
    d = tmp_path / "model"
    d.mkdir()
    for f in FIX.iterdir():
        if f.name != "generation_config.json":
            os.symlink(f, d / f.name)
    gen = json.loads((FIX / "generation_config.json").read_text())
    gen.update(MODEL_DEFAULTS, max_new_tokens=5)
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


@pytest.fixture
def start(spawn, model_dir):
    """start(*flags) -> base URL of a healthy `tessera serve` of model_dir."""

    def _start(*flags):
        port = free_port()
        proc = spawn([LAUNCHER, "serve", model_dir, "--host", "127.0.0.1", "--port", port,
                      "--served-model-name", "tiny", "--kv-cache-memory-bytes", "64M", "--dtype", "float32",
                      *flags])
        base = f"http://127.0.0.1:{port}"

        def ready():
            assert proc.p.poll() is None, proc.output()
            return http_status(base + "/health") == 200 and \
                requests.post(base + "/tokenize", json={"prompt": "x"}, timeout=5).status_code == 200
        wait_until(ready, timeout=TIMEOUT, interval=0.1, what="tiny HF model served")
        return base

    return _start


def complete(base, seed, **sampling):
    """A seeded completion of PROMPT; returns (text, completion_tokens)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "seed": seed, **sampling}
    r = requests.post(base + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    r = r.json()
    return r["choices"][0]["text"], r["usage"]["completion_tokens"]


def chat_tokens(base, **extra):
    """completion_tokens of a chat request that leaves max_tokens out."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True, "temperature": 0,
            **extra}
    r = requests.post(base + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    r = r.json()
    return r["usage"]["completion_tokens"], r["usage"]["prompt_tokens"], r["choices"][0]["finish_reason"]


def assert_omitted_is(base, explicit):
    """Every seed: the request without sampling fields == the one with `explicit`."""
    for seed in SEEDS:
        assert complete(base, seed) == complete(base, seed, **explicit), (seed, explicit)


def differs_for_some_seed(base, a, b):
    return any(complete(base, s, **a) != complete(base, s, **b) for s in SEEDS)


def test_auto_uses_the_models_file(start):
    base = start()
    assert_omitted_is(base, MODEL_DEFAULTS)
    # the comparison can tell the defaults apart: vLLM's neutral values sample otherwise
    assert differs_for_some_seed(base, MODEL_DEFAULTS, NEUTRAL)
    # max_new_tokens caps a chat request without max_tokens...
    assert chat_tokens(base)[0] == 5
    # ...not one that gives its own, and not completions (whose max_tokens defaults to 16)
    assert chat_tokens(base, max_tokens=9)[0] == 9
    r = requests.post(base + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "ignore_eos": True},
                      timeout=TIMEOUT).json()
    assert r["usage"]["completion_tokens"] == 16


def test_vllm_uses_neutral_defaults(start):
    base = start("--generation-config", "vllm")
    assert_omitted_is(base, NEUTRAL)
    n, prompt_tokens, finish = chat_tokens(base)       # no max_new_tokens: the rest of the context
    assert (n, finish) == (MAX_MODEL_LEN - prompt_tokens, "length")


def test_vllm_with_override(start):
    base = start("--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.0}')
    assert_omitted_is(base, {"temperature": 0.0})
    assert differs_for_some_seed(base, {"temperature": 0.0}, NEUTRAL)


def test_dir_replaces_the_models_file(start, tmp_path):
    gen_dir = tmp_path / "gen"
    gen_dir.mkdir()
    (gen_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    base = start("--generation-config", gen_dir)
    assert_omitted_is(base, {"temperature": 0.0})
    assert differs_for_some_seed(base, {"temperature": 0.0}, MODEL_DEFAULTS)
    assert chat_tokens(base)[0] == 3
    # the model's own top_k/top_p are not defaults any more: an explicit temperature
    # samples as with vLLM's neutral values for the rest
    for seed in SEEDS:
        assert complete(base, seed, temperature=1.0) == complete(base, seed, **NEUTRAL), seed


def test_dir_without_the_file_means_no_defaults(start, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    base = start("--generation-config", empty)
    assert_omitted_is(base, NEUTRAL)


def test_override_on_auto(start):
    # a value replaces the model's, null removes one (max_new_tokens), the rest stays
    base = start("--override-generation-config", '{"temperature": 0.0, "max_new_tokens": null}')
    assert_omitted_is(base, {"temperature": 0.0})
    n, prompt_tokens, finish = chat_tokens(base)
    assert (n, finish) == (MAX_MODEL_LEN - prompt_tokens, "length")
    for seed in SEEDS:
        assert complete(base, seed, temperature=1.0) == \
            complete(base, seed, temperature=1.0, **{k: v for k, v in MODEL_DEFAULTS.items() if k != "temperature"})


@pytest.mark.parametrize("flags, want", [
    (["--override-generation-config", "{bad"], "--override-generation-config: not valid JSON"),
    (["--override-generation-config", "[0.5]"], "--override-generation-config: expected a JSON object"),
    (["--override-generation-config", '{"top_k": "5"}'], "key 'top_k': expected an integer or null"),
    (["--generation-config", "{tmp}/missing"], "{tmp}/missing"),
    (["--generation-config", "{tmp}/bad"], "{tmp}/bad/generation_config.json: invalid JSON"),
])
def test_bad_flags_stop_serve_with_exit_2(spawn, model_dir, tmp_path, flags, want):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "generation_config.json").write_text('{"temperature": ')
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    port = free_port()
    proc = spawn([LAUNCHER, "serve", model_dir, "--host", "127.0.0.1", "--port", port, "--kv-cache-memory-bytes",
                  "64M", *flags])
    assert proc.wait(timeout=TIMEOUT) == 2, proc.output()
    assert want.replace("{tmp}", str(tmp_path)) in proc.output()
    assert http_status(f"http://127.0.0.1:{port}/health") is None
