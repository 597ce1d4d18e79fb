"""Llama 4 text through the real worker and through `tessera serve`: the tiny random
Llama 4 of tests/fixtures/tiny-llama4 (make_tiny_llama4.py; the nested
Llama4ForConditionalGeneration checkpoint layout, MoE + shared expert, chunked attention
with chunks of 8, a NoPE layer with temperature tuning) must give transformers' greedy
continuations in float32, alone, among concurrent requests, with chunked prefill in
small steps, and from the prefix cache.  Each request among others is also bitwise
itself alone (token ids and logprob floats: the CPU backend's batch invariance, MoE
routing included)."""
import json
import os
import random
import struct

import pytest
import requests

from conftest import LAUNCHER, REPO, WORKER, free_port, free_port_pair, http_status, wait_until
from engine_client import EngineWorker, greedy_until_tie

TINY4 = REPO / "tests" / "fixtures" / "tiny-llama4"
GOLDEN = json.loads((TINY4 / "golden.json").read_text())
GOLDENS = [(p["ids"], g) for p, g in zip(GOLDEN["prompts"], GOLDEN["greedy"])]
# llama.cpp's converter's F16 GGUF of the same recipe with llama.cpp's fixed Llama 4 values
# (make_tiny_llama4_gguf.py), and transformers' greedy continuations of its weights
TINY4_GGUF_DIR = REPO / "tests" / "fixtures" / "tiny-llama4-gguf"
GGUF_GOLDEN = json.loads((TINY4_GGUF_DIR / "golden.json").read_text())
TINY4_GGUF = TINY4_GGUF_DIR / GGUF_GOLDEN["gguf"]
GGUF_GOLDENS = [(p["ids"], g) for p, g in zip(GGUF_GOLDEN["prompts"], GGUF_GOLDEN["greedy"])]


@pytest.fixture
def worker(spawn):
    started = []

    def _worker(*flags, dtype="float32", env=None):
        w = EngineWorker(spawn, TINY4, "--dtype", dtype, *flags, env=env)
        started.append(w)
        return w

    yield _worker
    for w in started:
        w.close()


def same(a, b):
    assert a.tokens == b.tokens
    assert [(x.logprob, x.top_ids, x.top_logprobs) for x in a.logprobs] == \
        [(y.logprob, y.top_ids, y.top_logprobs) for y in b.logprobs]


def close(a, b, tol=1e-4):
    """The same tokens and top ids, the logprobs within tol."""
    assert a.tokens == b.tokens
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.top_ids == y.top_ids and abs(x.logprob - y.logprob) <= tol
        assert all(abs(u - v) <= tol for u, v in zip(x.top_logprobs, y.top_logprobs, strict=True))


# The device path too: TESSERA_KERNELS=devlike puts the weights and KV cache on a backend
# whose memory counts as a device's (the path Llama 4 takes on a GPU, on the reference
# kernels); a device may order a sum differently in a batch, so there the logprobs agree
# within 1e-4.
@pytest.mark.parametrize("kernels", [None, "devlike"], ids=["cpu", "devlike"])
def test_golden_alone_and_concurrent(worker, kernels):
    """The goldens one at a time, then the goldens among 13 random requests submitted
    at once: every golden token-exact, every request bitwise itself alone."""
    rng = random.Random(4)
    reqs = [(ids, len(g), g) for ids, g in GOLDENS]
    for n in (1, 7, 8, 9, 17, 24, 33, 40, 64, 100, 3, 15, 31):
        reqs.append(([rng.randrange(3, 300) for _ in range(n)], rng.randint(1, 40), None))
    if kernels:
        w = worker("--kv-cache-memory-bytes", "16M", env=dict(os.environ, TESSERA_KERNELS=kernels))
        assert "device: cpu-devlike" in w.proc.output(), w.proc.output()[-3000:]
    else:
        w = worker()
    alone = [w.run(f"alone{i}", p, m, logprobs=3) for i, (p, m, _) in enumerate(reqs)]
    for i, (p, m, g) in enumerate(reqs):
        assert alone[i].finish == "length" and len(alone[i].tokens) == m
        if g is not None:
            assert alone[i].tokens == g, f"golden prompt {i}"
    with w.paused():                        # they arrive together and share steps
        for i, (p, m, _) in enumerate(reqs):
            w.submit(f"batch{i}", p, m, logprobs=3)
    batch = w.collect([f"batch{i}" for i in range(len(reqs))])
    assert w.max_step_outputs >= 8
    for i in range(len(reqs)):
        (close if kernels else same)(batch[f"batch{i}"], alone[i])


def test_bf16_batched_is_bitwise_alone(worker):
    """--dtype bfloat16 (matmul weights rounded to bf16): the goldens' first tokens, and
    each request among the others bitwise itself alone (MoE routing included)."""
    w = worker(dtype="bfloat16")
    alone = [w.run(f"alone{i}", ids, 16, logprobs=3) for i, (ids, _) in enumerate(GOLDENS)]
    for i, (ids, g) in enumerate(GOLDENS):
        assert alone[i].tokens[0] == g[0], f"golden prompt {i}"
    with w.paused():
        for i, (ids, _) in enumerate(GOLDENS):
            w.submit(f"batch{i}", ids, 16, logprobs=3)
    batch = w.collect([f"batch{i}" for i in range(len(GOLDENS))])
    for i in range(len(GOLDENS)):
        same(batch[f"batch{i}"], alone[i])


@pytest.mark.parametrize("budget", ["5", "12"])
def test_golden_with_chunked_prefill(worker, budget):
    """A token budget of 5 or 12 per step cuts every prompt into prefill chunks that
    start inside attention chunks (8) and KV blocks (16): still the goldens."""
    w = worker("--max-num-batched-tokens", budget, "--max-num-seqs", "4")
    with w.paused():
        for i, (ids, g) in enumerate(GOLDENS):
            w.submit(f"g{i}", ids, len(g), logprobs=2)
    got = w.collect([f"g{i}" for i in range(len(GOLDENS))])
    for i, (ids, g) in enumerate(GOLDENS):
        assert got[f"g{i}"].tokens == g, f"golden prompt {i}"


def test_golden_from_the_prefix_cache(worker):
    """The 51-token golden prompt twice: the second run reads its 3 full blocks from the
    prefix cache (positions 0..47, across 6 attention chunks) and gives the same tokens
    and logprobs; so does a prompt sharing only the first 2 blocks."""
    ids, g = GOLDENS[2]
    assert len(ids) == 51
    w = worker()
    first = w.run("first", ids, len(g), logprobs=3)
    second = w.run("second", ids, len(g), logprobs=3)
    assert first.tokens == g
    assert first.cached == 0 and second.cached == 48
    same(first, second)
    other = ids[:32] + [7, 8, 9, 10, 11]
    ref = worker("--no-enable-prefix-caching").run("ref", other, 20, logprobs=3)
    hit = w.run("hit", other, 20, logprobs=3)
    assert hit.cached == 32
    same(hit, ref)


def completion_text(base, ids):
    """vLLM's completion text for ids: the longest prefix whose decode does not end in U+FFFD."""
    for k in range(len(ids), -1, -1):
        text = requests.post(base + "/detokenize", json={"tokens": ids[:k]}, timeout=5).json()["prompt"]
        if not text.endswith("\ufffd"):
            return text
    return ""


def test_serve_completions_with_prompt_ids(spawn):
    """`tessera serve` (router + worker) on the folder: /v1/completions with prompt
    token ids returns transformers' greedy continuation."""
    port = free_port()
    proc = spawn([LAUNCHER, "serve", TINY4, "--host", "127.0.0.1", "--port", port, "--served-model-name", "tiny4",
                  "--kv-cache-memory-bytes", "64M", "--dtype", "float32"])
    base = f"http://127.0.0.1:{port}"

    def ready():
        assert proc.p.poll() is None, proc.output()
        return http_status(base + "/health") == 200
    wait_until(ready, timeout=60, interval=0.1, what="tiny Llama 4 served")
    info = requests.get(base + "/v1/models", timeout=5).json()["data"][0]
    assert info["id"] == "tiny4" and info["max_model_len"] == 512
    for ids, want in GOLDENS:
        r = requests.post(base + "/v1/completions", json={"model": "tiny4", "prompt": ids, "temperature": 0,
                                                          "max_tokens": len(want), "ignore_eos": True,
                                                          "skip_special_tokens": False}, timeout=60).json()
        assert r["usage"]["completion_tokens"] == len(want)
        assert r["choices"][0]["text"] == completion_text(base, want)
    assert "vision tower and projector tensors not loaded" in proc.output()


def gguf_str(x):
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


def test_llama4_gguf_without_its_keys_is_refused(spawn, tmp_path):
    """A GGUF whose general.architecture is llama4 but which lacks the model's keys finds
    the Llama 4 family and is refused at start-up naming the file and the key: exit 2
    before the sockets are bound, not served as metadata only."""
    kvs = [("general.architecture", 8, gguf_str("llama4")),
           ("tokenizer.ggml.model", 8, gguf_str("gpt2")),
           ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 3) + gguf_str("a") + gguf_str("b") + gguf_str("ab")),
           ("tokenizer.ggml.merges", 9, struct.pack("<IQ", 8, 1) + gguf_str("a b")),
           ("llama4.context_length", 4, struct.pack("<I", 512))]
    model = tmp_path / "scout-q4.gguf"
    model.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) +
                      b"".join(gguf_str(k) + struct.pack("<I", t) + v for k, t, v in kvs))
    w = spawn([WORKER, model, "--listen", f"tcp://127.0.0.1:{free_port_pair()}"])
    assert w.wait(timeout=60) == 2
    out = w.output()
    assert f"{model}: metadata key 'llama4.embedding_length' missing" in out, out
    assert "listening on" not in out and "metadata only" not in out, out


@pytest.mark.parametrize("flags", [(), ("-tp", "2"), ("-tp", "2", "--enable-expert-parallel")],
                         ids=["tp1", "tp2", "tp2-ep"])
def test_gguf_gives_the_golden(spawn, flags):
    """llama.cpp's F16 GGUF of a tiny Llama 4 (general.architecture llama4: gate and up
    expert stacks apart, rope_freqs, llama.cpp's fixed chunk / NoPE / temperature values)
    gives transformers' greedy continuations of the same weights, at one rank, at -tp 2
    (each rank reading its rows of every stack) and with expert parallelism."""
    w = EngineWorker(spawn, TINY4_GGUF, "--dtype", "float32", *flags)
    for i, (ids, want) in enumerate(GGUF_GOLDENS):
        assert w.run(f"p{i}", ids, len(want)).tokens == want, (flags, i)
    w.close()
    out = w.proc.output()
    if flags:
        assert "its share read straight from the file" in out, out


def test_serve_gguf(spawn):
    """`tessera serve model.gguf`: the tokenizer and chat template come from the GGUF
    (tiny-hf's vocabulary as the converter wrote it, no BOS added: the file does not ask
    for one), /tokenize gives the prompts' ids after the fixture's BOS, and
    /v1/completions on those ids returns transformers' greedy continuation."""
    port = free_port()
    proc = spawn([LAUNCHER, "serve", TINY4_GGUF, "--host", "127.0.0.1", "--port", port, "--served-model-name",
                  "tiny4gguf", "--kv-cache-memory-bytes", "64M", "--dtype", "float32"])
    base = f"http://127.0.0.1:{port}"

    def ready():
        assert proc.p.poll() is None, proc.output()
        return http_status(base + "/health") == 200
    wait_until(ready, timeout=60, interval=0.1, what="tiny Llama 4 GGUF served")
    info = requests.get(base + "/v1/models", timeout=5).json()["data"][0]
    assert info["id"] == "tiny4gguf" and info["max_model_len"] == 512
    for p, (ids, want) in zip(GGUF_GOLDEN["prompts"], GGUF_GOLDENS):
        tok = requests.post(base + "/tokenize", json={"model": "tiny4gguf", "prompt": p["text"]}, timeout=5).json()
        assert tok["tokens"] == ids[1:], (p["text"], tok)
        r = requests.post(base + "/v1/completions", json={"model": "tiny4gguf", "prompt": ids, "temperature": 0,
                                                          "max_tokens": len(want), "ignore_eos": True,
                                                          "skip_special_tokens": False}, timeout=60).json()
        assert r["usage"]["completion_tokens"] == len(want), r
        assert r["choices"][0]["text"] == completion_text(base, want)


def per_expert_copy(dst):
    """The tiny Llama 4 with its routed experts as one linear per expert
    (experts.<e>.{gate,up,down}_proj.weight, vLLM's make_expert_params_mapping names, the
    layout of ModelOpt's NVFP4 export) instead of the BMM stacks, in float32: the same
    numbers, so the same greedy continuations."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file
    dst.mkdir()
    for f in TINY4.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    out = {}
    for name, t in load_file(TINY4 / "model.safetensors").items():
        if name.endswith("experts.gate_up_proj"):            # [E, dim, 2I]
            pre, half = name[:-len("gate_up_proj")], t.shape[2] // 2
            for e in range(t.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = np.ascontiguousarray(t[e][:, :half].T)
                out[f"{pre}{e}.up_proj.weight"] = np.ascontiguousarray(t[e][:, half:].T)
        elif name.endswith("experts.down_proj"):              # [E, I, dim]
            pre = name[:-len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = np.ascontiguousarray(t[e].T)
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("layout", ["stacks", "per_expert"])
@pytest.mark.parametrize("flags", [(), ("-tp", "2"), ("-tp", "2", "--enable-expert-parallel"), ("-tp", "4")],
                         ids=["tp1", "tp2", "tp2-ep", "tp4"])
def test_rank_shares_give_the_golden(spawn, tmp_path, layout, flags):
    """Tensor- and expert-parallel ranks read only their share of each tensor from the
    file (issue #20: BMM stacks by each expert's column and row ranges, per-expert
    linears by rows / columns, an expert-parallel rank only its experts): every layout
    and split gives transformers' greedy continuations, and each rank's load line says it
    read its share."""
    path = TINY4 if layout == "stacks" else per_expert_copy(tmp_path / "per-expert")
    w = EngineWorker(spawn, path, "--dtype", "float32", *flags)
    for i, (ids, want) in enumerate(GOLDENS):
        assert w.run(f"p{i}", ids, len(want)).tokens == want, (layout, flags, i)
    w.close()
    if flags:
        out = w.proc.output()
        assert "its share read straight from the file" in out, out


Q8_GOLDEN = GGUF_GOLDEN["q8_0"]


@pytest.mark.parametrize("flags", [(), ("-tp", "2")], ids=["tp1", "tp2"])
def test_gguf_q8_0_gives_the_golden(spawn, flags):
    """The same model's Q8_0 GGUF (issue #14: a block format; every matrix Q8_0, widened
    to float32 on load) gives transformers' greedy continuations of exactly its
    dequantized values, up to each prompt's first near-tie (a reference margin under
    1e-3, as tests/unit/test_llama4.c test_gguf_q8_0: 72 of the 96 tokens), alone and
    three at once, at one rank and at -tp 2 (each rank reading its share of the blocks:
    the experts' down stacks by 16 columns of each 32-element block)."""
    w = EngineWorker(spawn, TINY4_GGUF_DIR / Q8_GOLDEN["gguf"], "--dtype", "float32", *flags)
    assert greedy_until_tie(w, [p["ids"] for p in GGUF_GOLDEN["prompts"]], Q8_GOLDEN["greedy"],
                            Q8_GOLDEN["greedy_margin"]) == 72
    w.close()
    if flags:
        assert "its share read straight from the file" in w.proc.output(), w.proc.output()
