"""The NemotronH family through the real worker (engine_client.py speaks the wire):
the tiny random NemotronHForCausalLM of tests/fixtures/tiny-nemotron-h (pattern
"ME*M-E", written by make_tiny_nemotron_h.py) returns transformers' greedy tokens,
alone and among 32 concurrent requests, with chunked prefill and under preemption;
every request's recurrent-state slot comes back (Status state_slots_free) after
finishing, preemption and abort.  "Same" means bitwise: token ids and logprob floats.

bfloat16 (issue #14): a BF16 copy of the fixture (as a bf16 NemotronH ships: every
tensor bf16 but the router's, which transformers keeps in float32) written at test time
and served with --dtype bfloat16 (bf16 linears), float32 (upcast) and auto.

ModelOpt FP8 and NVFP4 (issue #15): tests/fixtures/tiny-nemotron-h-fp8 served through the
router with --quantization modelopt / fp8, its greedy tokens the W8A8 emulation's, and
tests/fixtures/tiny-nemotron-h-nvfp4 with modelopt_fp4 (the W4A4 emulation's); a
disagreeing --quantization and an FP8 folder announced as NVFP4 refused at start."""
import hashlib
import json
import os
import random
import re
import struct
import subprocess

import pytest

import numpy as np

import openai
import requests

from conftest import BUILD, LAUNCHER, REPO, WORKER, free_port, free_port_pair, http_status, wait_until
from engine_client import EngineWorker, greedy_until_tie
from test_hf_model import completion_text

MODEL = REPO / "tests" / "fixtures" / "tiny-nemotron-h"
GOLDEN = json.loads((MODEL / "golden.json").read_text())
VOCAB = GOLDEN["vocab_size"]
# one state slot: 2 Mamba layers x (3 conv rows x 128 + 8 heads x 8 x 16 state) floats
SLOT_BYTES = 2 * (3 * 128 + 8 * 8 * 16) * 4
# one KV block of 16 tokens: 1 attention layer x K and V x 2 kv heads x 16 x float32
BLOCK_BYTES = 2 * 2 * 16 * 16 * 4


@pytest.fixture
def worker(spawn):
    started = []

    def _worker(*flags, env=None):
        w = EngineWorker(spawn, MODEL / "model", "--dtype", "float32", *flags, env=env)
        started.append(w)
        return w

    yield _worker
    for w in started:
        w.close()


def goldens():
    return [(p["ids"], g) for p, g in zip(GOLDEN["prompts"], GOLDEN["greedy"])]


def mixed(n, seed):
    rng = random.Random(seed)
    reqs = [(ids, len(g), g) for ids, g in goldens()]
    while len(reqs) < n:
        k = rng.choice([1, 2, 3, 4, 5, 9, 17, 40, 90])
        reqs.append(([rng.randrange(3, VOCAB) for _ in range(k)], rng.randint(1, 40), None))
    return reqs


def same(a, b):
    assert a.tokens == b.tokens
    assert [(x.logprob, x.rank, x.top_ids, x.top_logprobs) for x in a.logprobs] == \
           [(x.logprob, x.rank, x.top_ids, x.top_logprobs) for x in b.logprobs]


def close(a, b, tol=1e-4):
    """The same tokens and ranks, the logprobs within tol: the same values computed with
    the scan in another order (the chunked form where the other ran the recurrence)."""
    assert a.tokens == b.tokens
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert (x.rank, x.top_ids) == (y.rank, y.top_ids)
        assert abs(x.logprob - y.logprob) <= tol
        assert all(abs(u - v) <= tol for u, v in zip(x.top_logprobs, y.top_logprobs, strict=True))


def all_free(w):
    return w.wait_status(lambda s: s["num_running"] == 0 and s["num_waiting"] == 0
                         and s["state_slots_free"] == s["state_slots_total"]
                         and s["kv_blocks_free"] == s["kv_blocks_total"], what="idle, every slot and block free")


# The device path too: TESSERA_KERNELS=devlike puts the weights, KV blocks and state slots
# on a backend whose memory counts as a device's (the path NemotronH takes on a GPU, on the
# reference kernels); a device may order a sum differently in a batch, so there the
# logprobs agree within 1e-4.
@pytest.mark.parametrize("budget,kernels", [("2048", None), ("8", None), ("2048", "devlike")],
                         ids=["2048", "8", "devlike"])
def test_golden_alone_and_32_concurrent(worker, budget, kernels):
    """Each golden prompt alone gives transformers' 32 greedy tokens; then 32 mixed
    requests at once (with budget 8: prefill chunks of a few tokens across the conv
    window, mixed with decodes) are each bitwise what they are alone."""
    if kernels:
        w = worker("--max-num-batched-tokens", budget, "--kv-cache-memory-bytes", "16M",
                   env=dict(os.environ, TESSERA_KERNELS=kernels))
        assert "device: cpu-devlike" in w.proc.output(), w.proc.output()[-3000:]
    else:
        w = worker("--max-num-batched-tokens", budget)
    s = w.status()
    assert s["state_slots_total"] == 256 and s["state_slots_free"] == 256   # max_num_seqs
    reqs = mixed(32, 14)
    alone = [w.run(f"a{i}", p, m, logprobs=2) for i, (p, m, _) in enumerate(reqs)]
    for (p, m, g), a in zip(reqs, alone):
        assert a.finish == "length" and len(a.tokens) == m
        if g is not None:
            assert a.tokens == g
    with w.paused():                            # they arrive together (a loaded machine
        for i, (p, m, _) in enumerate(reqs):    # once let them trickle in one by one)
            w.submit(f"b{i}", p, m, logprobs=2)
    got = w.collect([f"b{i}" for i in range(32)])
    assert w.max_step_outputs >= 4             # they ran together (budget 8: at most 8 a step)
    for i in range(32):
        (close if kernels else same)(got[f"b{i}"], alone[i])
    all_free(w)


@pytest.mark.parametrize("mode", [(), ("--async-scheduling",)], ids=["sync", "async"])
def test_preemption_and_slot_bound_admission(worker, mode):
    """--kv-cache-memory for 8 state slots and 26 blocks of 16 tokens: at most 8
    requests run at once and the blocks run out, so requests are preempted (their slot
    given back) and recomputed; every result is still bitwise the roomy worker's, with
    the step thread of --async-scheduling too."""
    rng = random.Random(15)
    reqs = [(ids, len(g), g) for ids, g in goldens()]
    reqs += [([rng.randrange(3, VOCAB) for _ in range(rng.randint(40, 120))], rng.randint(30, 60), None)
             for _ in range(21)]
    roomy = worker()
    alone = [roomy.run(f"a{i}", p, m, logprobs=2) for i, (p, m, _) in enumerate(reqs)]
    budget = 8 * SLOT_BYTES * 2 + 26 * BLOCK_BYTES - 8 * SLOT_BYTES   # slots take at most half
    small = worker("--kv-cache-memory", str(budget), *mode)
    s = small.status()
    assert s["state_slots_total"] == 8 and s["kv_blocks_total"] == 26
    for i, (p, m, _) in enumerate(reqs):
        small.submit(f"s{i}", p, m, logprobs=2)
    got = small.collect([f"s{i}" for i in range(len(reqs))])
    for i in range(len(reqs)):
        same(got[f"s{i}"], alone[i])
    assert small.max_step_outputs <= 8
    assert sum(r.num_preemptions for r in got.values()) > 0
    s = all_free(small)
    assert s["num_preemptions_total"] > 0


def patched(tmp_path, name, **changes):
    """The fixture's folder (files linked) with config.json fields changed."""
    d = tmp_path / name
    d.mkdir()
    for f in (MODEL / "model").iterdir():
        if f.name != "config.json":
            (d / f.name).symlink_to(f)
    cfg = json.loads((MODEL / "model" / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture
def long_model(tmp_path):
    """The fixture with an 8192-token context (config.json's max_position_embeddings
    only: the weights do not depend on it, there is no positional encoding)."""
    return patched(tmp_path, "tiny-nemotron-h-long", max_position_embeddings=8192)


def test_kv_bytes_count_the_state(spawn, long_model):
    """Status' KV memory by bytes (what the router's vllm:kv_cache_usage_perc reads) counts
    the attention blocks and the state slots a running request holds: idle, nothing used
    of every block and slot; with one request generating (for thousands of tokens),
    exactly its blocks and its one slot; after its abort, nothing again."""
    w = EngineWorker(spawn, long_model, "--dtype", "float32")
    s = w.status()
    B, S = s["kv_blocks_total"], s["state_slots_total"]
    assert s["kv_bytes_total"] == B * BLOCK_BYTES + S * SLOT_BYTES and s["kv_bytes_used"] == 0
    w.submit("long", [5, 6, 7], 8000)
    while not w.results["long"].tokens:
        w.pump(1000)
    s = w.wait_status(lambda s: s["num_running"] == 1, what="one running")
    used_blocks = s["kv_blocks_total"] - s["kv_blocks_free"]
    assert used_blocks >= 1 and s["state_slots_free"] == S - 1
    assert s["kv_bytes_used"] == used_blocks * BLOCK_BYTES + SLOT_BYTES
    w.abort("long")
    all_free(w)
    assert w.status()["kv_bytes_used"] == 0
    w.close()


def test_abort_frees_the_slot(spawn, long_model):
    """One state slot: a request waits while another generates (for thousands of
    tokens); aborting the first gives it the slot, and it returns its golden tokens."""
    w = EngineWorker(spawn, long_model, "--dtype", "float32", "--max-num-seqs", "1")
    s = w.status()
    assert s["state_slots_total"] == 1
    ids, g = goldens()[1]
    w.submit("long", [5, 6, 7], 8000)
    while not w.results["long"].tokens:        # it runs, holding the one slot
        w.pump(1000)
    w.submit("next", ids, len(g))
    w.abort("long")
    got = w.collect(["next"])
    assert got["next"].tokens == g
    assert not w.results["long"].done          # aborted: no finishing Output
    all_free(w)
    w.close()


def test_prefix_caching_off_by_default(worker):
    """vLLM leaves prefix caching off for hybrid Mamba models unless asked: the worker
    says so, serves, and reads nothing from a cache."""
    w = worker()
    ids, g = goldens()[2]
    first = w.run("x", ids, 4)
    second = w.run("y", ids, 4)
    assert first.tokens == second.tokens == g[:4]
    assert second.cached == 0
    assert "prefix caching disabled" in w.proc.output()
    assert w.status()["state_slots_total"] == 256


@pytest.mark.parametrize("mode", [(), ("--async-scheduling",), ("-tp", "2")], ids=["sync", "async", "tp2"])
def test_prefix_caching_of_the_state(worker, mode):
    """--enable-prefix-caching (vLLM's experimental Mamba prefix caching): the state is
    kept at every state block a step passes (the fixture's chunk_size 8 rounded up to the
    16-token block), so a request sharing a prefix starts from a copy of it.  Each golden
    prompt a second time hits its full blocks below the last token and gives bitwise the
    first run (tokens and logprobs); a next turn (prompt + the answer + more) hits blocks
    whose state its predecessor kept while decoding (the same values to rounding: that
    state ran the answer's tokens one at a time, the uncached worker runs them as prompt,
    in the scan's chunked form); 32 mixed requests sharing stems, 24
    tokens a step (chunks that end anywhere), are each bitwise what an uncached worker
    gives; at the end every slot and block is free again (kept states are not held).
    --mamba-block-size 32 keeps every other one: hits end on multiples of 32.  With -tp 2
    each rank keeps and copies its own heads' share of every state."""
    plain = worker()
    cached = worker("--enable-prefix-caching", *mode)
    out = cached.proc.output()
    assert "prefix caching on for a hybrid model" in out and "kept every 16 tokens" in out, out
    assert cached.status()["state_slots_total"] == 512      # 2 x max_num_seqs: running + kept
    for i, (ids, g) in enumerate(goldens()):
        a = cached.run(f"g{i}", ids, len(g), logprobs=2)
        b = cached.run(f"h{i}", ids, len(g), logprobs=2)
        assert a.tokens == g and b.tokens == g
        same(a, b)
        assert b.cached == (len(ids) - 1) // 16 * 16
    # a next turn: the 51-token golden, its 32 tokens, then 9 more
    ids, g = goldens()[2]
    turn = ids + g + [7, 8, 9, 10, 11, 12, 13, 14, 15]
    want = plain.run("t-plain", turn, 12, logprobs=2)
    got = cached.run("t", turn, 12, logprobs=2)
    close(got, want)    # the kept state ran the answer by the recurrence, a fresh prompt by chunks
    assert got.cached == (len(ids) + len(g) - 1) // 16 * 16 == 80   # the state at 80 was kept decoding
    rng = random.Random(16)
    stems = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (20, 37, 64)]
    reqs = []
    for i in range(32):
        p = stems[i % 3] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))]
        reqs.append((p, rng.randint(1, 24)))
    alone = [plain.run(f"p{i}", p, m, logprobs=2) for i, (p, m) in enumerate(reqs)]
    small = worker("--enable-prefix-caching", "--max-num-batched-tokens", "24", *mode)
    with small.paused():
        for i, (p, m) in enumerate(reqs):
            small.submit(f"c{i}", p, m, logprobs=2)
    got = small.collect([f"c{i}" for i in range(32)])
    for i in range(32):
        same(got[f"c{i}"], alone[i])
    assert sum(r.cached for r in got.values()) > 0
    all_free(small)
    all_free(cached)
    coarse = worker("--enable-prefix-caching", "--mamba-block-size", "32", *mode)
    for i, (ids, g) in enumerate(goldens()):
        coarse.run(f"g{i}", ids, 4)
        b = coarse.run(f"h{i}", ids, 4, logprobs=2)
        assert b.tokens == g[:4]
        assert b.cached == (len(ids) - 1) // 32 * 32


def bf16_copy(tmp_path):
    """The fixture's folder with model.safetensors rewritten as BF16 (round to nearest
    even) but golden.json's keep_f32 tensors; its tensor bytes hash as the fixture
    script's copy did (the one transformers' bf16 goldens come from)."""
    keep = tuple(GOLDEN["bf16"]["keep_f32"])
    src = (MODEL / "model" / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", src[:8])[0]
    header = json.loads(src[8:8 + n])
    out, blobs, off = {"__metadata__": {"format": "pt"}}, {}, 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32"
        a, b = t["data_offsets"]
        x = np.frombuffer(src[8 + n + a:8 + n + b], dtype="<u4")
        if name.endswith(keep):
            blob, dt = x.tobytes(), "F32"
        else:   # no NaN in the fixture: RNE on the bits
            blob, dt = ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype("<u2").tobytes(), "BF16"
        out[name] = {"dtype": dt, "shape": t["shape"], "data_offsets": [off, off + len(blob)]}
        blobs[name] = blob
        off += len(blob)
    h = hashlib.sha256()
    for name in sorted(blobs):
        h.update(blobs[name])
    assert h.hexdigest() == GOLDEN["bf16"]["data_sha256"]
    d = tmp_path / "tiny-nemotron-h-bf16"
    d.mkdir()
    for f in (MODEL / "model").iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (d / f.name).symlink_to(f)
    cfg = json.loads((MODEL / "model" / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(cfg))
    text = json.dumps(out, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs[k] for k in out
                                                                                           if k in blobs))
    return d


def test_bf16_checkpoint_served(spawn, tmp_path):
    """The BF16 folder with --dtype bfloat16: ModelInfo and the log say bfloat16, the
    resident weights are the bf16 linears' bytes, the state slots stay float32 (vLLM's
    mamba_ssm_cache_dtype float32; conv state: nemotron_h.c, tsr_nemotron_h_kv_groups);
    each golden prompt's greedy tokens agree with transformers' fp32 ones as far as
    the unit test's rule requires (until an fp32 margin under 0.1), and the 32 mixed
    requests at once, with a budget of 8 (chunked prefill), are each bitwise what they
    are alone."""
    d = bf16_copy(tmp_path)
    w = EngineWorker(spawn, d, "--dtype", "bfloat16", "--max-num-batched-tokens", "8")
    assert w.info[22][0] == b"bfloat16"                     # ModelInfo.dtype
    out = w.proc.output()
    assert "matmul weights held as bfloat16" in out, out
    assert f"# state slots: 256 ({SLOT_BYTES / 1e6:.2f} MB each)" in out, out
    res = re.search(r"loaded (\d+) tensors \(([\d.]+) MB in the file, ([\d.]+) MB as float32, ([\d.]+) MB resident\)", out)
    assert res, out
    file_mb, f32_mb, resident_mb = (float(x) for x in res.groups()[1:])
    assert file_mb < f32_mb and resident_mb < f32_mb, res.group(0)
    reqs = mixed(32, 17)
    alone = [w.run(f"a{i}", p, m, logprobs=2) for i, (p, m, _) in enumerate(reqs)]
    for (p, m, g), a, margins in zip(reqs, alone, GOLDEN["greedy_margin"]):
        must = next((k for k, x in enumerate(margins) if x < 0.1), len(margins))
        assert a.tokens[:must] == g[:must]
    with w.paused():                            # they arrive together (ci105, on a loaded
        for i, (p, m, _) in enumerate(reqs):    # machine, ran at most 3 in a step without it)
            w.submit(f"b{i}", p, m, logprobs=2)
    got = w.collect([f"b{i}" for i in range(32)])
    assert w.max_step_outputs >= 4
    for i in range(32):
        same(got[f"b{i}"], alone[i])
    all_free(w)
    w.close()


def in_process_bf16_greedy():
    """The bf16 greedy continuations of the golden prompts from the in-process forward on
    the reference kernels: tests/unit/test_nemotron_h (test_bf16_greedy) prints them."""
    exe = BUILD / "tests" / "unit" / "test_nemotron_h"
    env = {**os.environ, "TSR_SOURCE_ROOT": str(REPO), "CMOCKA_MESSAGE_OUTPUT": "stdout"}
    r = subprocess.run([exe], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = {int(p): json.loads(t) for p, t in re.findall(r"bf16 greedy of prompt (\d+): (\[[\d, ]*\])", r.stdout)}
    assert sorted(got) == list(range(len(GOLDEN["prompts"]))), r.stdout[-3000:]
    return got


def test_bf16_greedy_equals_in_process(spawn, tmp_path):
    """Served from the BF16 folder with --dtype bfloat16, each golden prompt's 32 greedy
    tokens are the in-process forward's, alone and all four at once with a budget of 5
    (prefill chunks across the conv window).  TESSERA_KERNELS=avx2 caps the fast kernels
    where their bf16 matmul is bitwise the reference (the in-process run's kernels); on
    AVX512_BF16 / AMX the order differs by design (kernels.h)."""
    want = in_process_bf16_greedy()
    d = bf16_copy(tmp_path)
    w = EngineWorker(spawn, d, "--dtype", "bfloat16", "--max-num-batched-tokens", "5",
                     env={**os.environ, "TESSERA_KERNELS": "avx2"})
    assert w.info[22][0] == b"bfloat16"
    for i, (ids, g) in enumerate(goldens()):
        assert w.run(f"a{i}", ids, len(g)).tokens == want[i], f"prompt {i}"
    with w.paused():
        for i, (ids, g) in enumerate(goldens()):
            w.submit(f"b{i}", ids, len(g))
    got = w.collect([f"b{i}" for i in range(len(want))])
    for i in range(len(want)):
        assert got[f"b{i}"].tokens == want[i], f"prompt {i} batched"
    all_free(w)
    w.close()


def test_bf16_checkpoint_dtype_flags(spawn, tmp_path):
    """--dtype float32 upcasts the BF16 folder (ModelInfo float32, resident = the
    float32 bytes); --dtype bfloat16 on the float32 fixture converts it; --dtype auto
    follows the CPU (bfloat16 where it has AVX512_BF16, else float32: runner.c), and
    the log's kernels line says which."""
    d = bf16_copy(tmp_path)
    up = EngineWorker(spawn, d, "--dtype", "float32")
    assert up.info[22][0] == b"float32"
    assert "matmul weights held as bfloat16" not in up.proc.output()
    ids, g = goldens()[0]
    assert up.run("u", ids, 4).tokens[:1] == g[:1]
    up.close()
    down = EngineWorker(spawn, MODEL / "model", "--dtype", "bfloat16")
    assert down.info[22][0] == b"bfloat16"
    assert down.run("d", ids, 4).tokens[:1] == g[:1]
    down.close()
    auto = EngineWorker(spawn, d, "--dtype", "auto")
    m = re.search(r"kernels: cpu-fast, isa (\S+), .*dtype (\w+) \(--dtype auto\)", auto.proc.output())
    assert m, auto.proc.output()
    assert auto.info[22][0] == m.group(2).encode()
    assert m.group(2) == ("bfloat16" if m.group(1) in ("avx512_bf16", "amx_bf16") else "float32")
    auto.close()


FP8 = REPO / "tests" / "fixtures" / "tiny-nemotron-h-fp8"
NVFP4 = REPO / "tests" / "fixtures" / "tiny-nemotron-h-nvfp4"


def quant_resident_bytes(fixture):
    """What the worker keeps of a quantized fixture, from its safetensors header alone: an
    F8_E4M3 weight one byte an element, an NVFP4 one (U8, two codes a byte) 9 bytes per
    16 elements, every other tensor it reads widened to float32, the scales held inside
    their weights."""
    raw = (fixture / "model" / "model.safetensors").read_bytes()
    hdr = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    total = 0
    for name, t in hdr.items():
        if name == "__metadata__" or name.endswith(("_scale", "_scale_2")):
            continue
        n = int(np.prod(t["shape"])) if t["shape"] else 1
        total += n if t["dtype"] == "F8_E4M3" else n * 2 // 16 * 9 if t["dtype"] == "U8" else 4 * n
    return total


@pytest.mark.parametrize("fixture,flag,pp,tp", [(FP8, "modelopt", "1", "1"), (FP8, "fp8", "1", "1"),
                                                (FP8, None, "1", "1"), (NVFP4, "modelopt_fp4", "1", "1"),
                                                (NVFP4, None, "2", "1"), (FP8, "modelopt", "1", "2")],
                         ids=["fp8-modelopt", "fp8-fp8", "fp8", "nvfp4-flag", "nvfp4-pp2", "fp8-tp2"])
def test_modelopt_served(spawn, fixture, flag, pp, tp):
    """The ModelOpt FP8 and NVFP4 NemotronH (make_tiny_nemotron_h_fp8.py /
    make_tiny_nemotron_h_nvfp4.py: the Nano recipe) through `tessera serve` with the
    deployment's --quantization: every prompt's greedy 32 tokens are the W8A8 / W4A4
    emulation's, and the load line and /metrics report the quantized weights' resident
    bytes (-pp 2: each stage loads its layers as stored; the load line adds them up; -tp 2:
    each rank its share of the fp8 linears, the greedy tokens the same)."""
    port = free_port()
    quant = ["--quantization", flag] if flag else []
    proc = spawn([LAUNCHER, "serve", fixture / "model", "--host", "127.0.0.1", "--port", port, "--served-model-name",
                  "tiny", "--kv-cache-memory-bytes", "64M", "--dtype", "float32", "-pp", pp, "-tp", tp, *quant])
    base = f"http://127.0.0.1:{port}"

    def ready():
        assert proc.p.poll() is None, proc.output()
        return http_status(base + "/health") == 200
    wait_until(ready, timeout=60, interval=0.1, what=f"{fixture.name} served")
    golden = json.loads((fixture / "golden.json").read_text())
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    for prompt, want in zip(golden["prompts"], golden["greedy"]):
        r = client.completions.create(model="tiny", prompt=prompt["ids"], temperature=0, max_tokens=len(want),
                                      extra_body={"ignore_eos": True, "skip_special_tokens": False})
        assert r.choices[0].text == completion_text(base, want), prompt["text"]
        assert r.usage.completion_tokens == 32
    out = proc.output()
    assert ("quantization: modelopt_fp4 (ModelOpt NVFP4" if fixture == NVFP4 else
            "quantization: modelopt (ModelOpt FP8") in out, out
    if tp != "1":       # test_parallel.c has the ranks' bytes
        return
    want_bytes = quant_resident_bytes(fixture)
    loaded = re.search(r"loaded \d+ tensors \(.*?([0-9.]+) MB resident\)", out)
    assert loaded and float(loaded.group(1)) == pytest.approx(want_bytes / 1e6, abs=0.05), out

    def gauge():
        text = requests.get(base + "/metrics", timeout=5).text
        return re.search(r'^tessera:worker_weight_bytes\{worker="[^"]+"\} ([0-9.e+]+)$', text, re.M)
    assert float(wait_until(gauge, timeout=10, what="tessera:worker_weight_bytes").group(1)) == want_bytes


def ep_patched(tmp_path):
    """tiny-nemotron-h-fp8 with the input scales make_tiny_nemotron_h_fp8_ep.py lists
    (experts 4..7 of every MoE layer x 0.75) written over the file's float32 scalars."""
    d = tmp_path / "fp8-ep"
    d.mkdir()
    for f in (FP8 / "model").iterdir():
        if f.name != "model.safetensors":
            (d / f.name).symlink_to(f)
    raw = bytearray((FP8 / "model" / "model.safetensors").read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    patch = json.loads((FP8 / "golden.json").read_text())["expert_parallel"]["patched_input_scales"]
    assert len(patch) == 16
    for name, v in patch.items():
        t = hdr[name]
        assert t["dtype"] == "F32" and t["shape"] == [], name
        off = 8 + n + t["data_offsets"][0]
        assert struct.unpack("<f", raw[off:off + 4])[0] > v, name
        raw[off:off + 4] = struct.pack("<f", v)
    (d / "model.safetensors").write_bytes(bytes(raw))
    return d


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-expert-parallel"])
def test_fp8_expert_parallel_scales(spawn, tmp_path, ep):
    """--enable-expert-parallel on ModelOpt FP8 experts: each rank quantizes its experts'
    inputs with the max input_scale of its own experts, as vLLM's FusedMoE does under
    expert parallelism (it registers only the local experts' scales), not the max over
    all of them.  On a copy whose experts 4..7 have smaller input scales, -tp 2 gives the
    committed emulation's greedy tokens (experts 0..3 hold the global max) and -tp 2
    --enable-expert-parallel the emulation with rank 1's own max
    (make_tiny_nemotron_h_fp8_ep.py: 107 of the 128 tokens differ)."""
    golden = json.loads((FP8 / "golden.json").read_text())
    want = golden["expert_parallel"]["greedy"] if ep else golden["greedy"]
    assert golden["expert_parallel"]["greedy"] != golden["greedy"]
    w = EngineWorker(spawn, ep_patched(tmp_path), "--dtype", "float32", "-tp", "2",
                     *(["--enable-expert-parallel"] if ep else []))
    for i, (p, g) in enumerate(zip(golden["prompts"], want)):
        assert w.run(f"p{i}", p["ids"], len(g)).tokens == g, f"prompt {i}"
    w.close()


WIDE_NVFP4 = REPO / "tests" / "fixtures" / "wide-nemotron-h-nvfp4"


@pytest.mark.parametrize("flags", [[], ["--enable-expert-parallel"]], ids=["tp2", "tp2-expert-parallel"])
def test_nvfp4_tensor_and_expert_parallel(spawn, flags):
    """ModelOpt NVFP4 split over two ranks: the wide fixture (make_wide_nemotron_h_nvfp4.py,
    every quantized linear's K whole NVFP4 blocks per rank) at -tp 2, and with
    --enable-expert-parallel, where each rank holds four experts whole and quantizes
    their inputs with the max input_scale over all eight (vLLM's global-scale NVFP4 MoE),
    gives the W4A4 emulation's greedy tokens, 32 per prompt."""
    golden = json.loads((WIDE_NVFP4 / "golden.json").read_text())
    w = EngineWorker(spawn, WIDE_NVFP4 / "model", "--dtype", "float32", "-tp", "2", *flags)
    for i, (p, g) in enumerate(zip(golden["prompts"], golden["greedy"])):
        assert w.run(f"p{i}", p["ids"], len(g)).tokens == g, f"prompt {i}"
    w.close()


def refused(spawn, model, *flags):
    p = spawn([WORKER, model, "--listen", f"tcp://127.0.0.1:{free_port_pair()}", *flags])
    assert p.wait(timeout=60) == 2
    out = p.output()
    assert "listening on" not in out and "loaded " not in out, out
    return out


def test_modelopt_refusals(spawn, tmp_path):
    """Refused at start, with a line naming what is supported, never served as something
    else: the FP8 and NVFP4 NemotronH with a --quantization that disagrees, and the FP8
    weights under a config announcing NVFP4 (the first F8_E4M3 linear named).
    (--kv-cache-dtype fp8 works for it: test_kv_cache_dtype.py.)"""
    out = refused(spawn, FP8 / "model", "--quantization", "modelopt_fp4")
    assert "argument --quantization: 'modelopt_fp4' does not match the checkpoint" in out, out
    out = refused(spawn, NVFP4 / "model", "--quantization", "modelopt")
    assert "argument --quantization: 'modelopt' does not match the checkpoint" in out, out
    d = tmp_path / "nvfp4"
    d.mkdir()
    for f in (FP8 / "model").iterdir():
        if f.name != "config.json":
            (d / f.name).symlink_to(f)
    cfg = json.loads((FP8 / "model" / "config.json").read_text())
    cfg["quantization_config"].update(quant_algo="NVFP4", group_size=16)
    (d / "config.json").write_text(json.dumps(cfg))
    out = refused(spawn, d)
    assert "tensor 'backbone.layers.1.mixer.shared_experts.up_proj.weight': dtype F8_E4M3, which does not match " \
        "the announced quant_algo (NVFP4)" in out and str(d) in out, out


def test_attention_free_pattern_serves(spawn, tmp_path):
    """A pattern without attention ("ME": the fixture's first two layers) has no KV
    blocks to size: the state slots alone bound the work, and 12 concurrent requests
    are each bitwise what they are alone."""
    d = patched(tmp_path, "tiny-nemotron-h-me", hybrid_override_pattern="ME", num_hidden_layers=2)
    w = EngineWorker(spawn, d, "--dtype", "float32", "--max-num-seqs", "4")
    s = w.status()
    assert s["state_slots_total"] == 4 and s["kv_blocks_total"] == 4 * 512 // 16
    reqs = mixed(12, 16)
    alone = [w.run(f"a{i}", p, m, logprobs=1) for i, (p, m, _) in enumerate(reqs)]
    for i, (p, m, _) in enumerate(reqs):
        w.submit(f"b{i}", p, m, logprobs=1)
    got = w.collect([f"b{i}" for i in range(12)])
    for i in range(12):
        assert len(got[f"b{i}"].tokens) == reqs[i][1]
        same(got[f"b{i}"], alone[i])
    assert w.max_step_outputs <= 4
    all_free(w)
    w.close()


GGUF_DIR = REPO / "tests" / "fixtures" / "tiny-nemotron-h-gguf"
GGUF_GOLDEN = json.loads((GGUF_DIR / "golden.json").read_text())


@pytest.mark.parametrize("flags", [(), ("-tp", "2"), ("-tp", "2", "--enable-expert-parallel")],
                         ids=["tp1", "tp2", "tp2-ep"])
def test_gguf_served(spawn, flags):
    """llama.cpp's F16 GGUF of the fixture (nemotron_h_moe) through the real worker:
    transformers' greedy continuations of the same weights up to each prompt's first
    near-tie (margin under 1e-4), alone and four at once, at one rank, at -tp 2 (each
    rank reading its share of the file: its heads' ssm_a and D, its groups of the gated
    norm, its columns of every expert stack) and with expert parallelism."""
    model = GGUF_DIR / GGUF_GOLDEN["gguf"]
    w = EngineWorker(spawn, model, "--dtype", "float32", *flags)
    greedy_until_tie(w, [p["ids"] for p in GGUF_GOLDEN["prompts"]], GGUF_GOLDEN["greedy"],
                     GGUF_GOLDEN["greedy_margin"], tie=1e-4)
    w.close()
    if flags:
        assert "its share read straight from the file" in w.proc.output(), w.proc.output()


DENSE_GGUF_DIR = REPO / "tests" / "fixtures" / "tiny-nemotron-h-dense-gguf"
DENSE_GGUF_GOLDEN = json.loads((DENSE_GGUF_DIR / "golden.json").read_text())


@pytest.mark.parametrize("flags", [(), ("-tp", "2")], ids=["tp1", "tp2"])
def test_gguf_dense_served(spawn, flags):
    """llama.cpp's F16 GGUF of a tiny dense NemotronH (general.architecture nemotron_h,
    pattern "M*M-M-": no expert anywhere; make_tiny_nemotron_h_dense_gguf.py) through the
    real worker: transformers' greedy continuations of the same weights up to each
    prompt's first near-tie (margin under 1e-3, as tests/unit/test_nemotron_h.c
    test_gguf_dense: none in these 128 tokens), alone and four at once, at one rank and
    at -tp 2 (each rank reading its share of the file)."""
    w = EngineWorker(spawn, DENSE_GGUF_DIR / DENSE_GGUF_GOLDEN["gguf"], "--dtype", "float32", *flags)
    assert greedy_until_tie(w, [p["ids"] for p in DENSE_GGUF_GOLDEN["prompts"]], DENSE_GGUF_GOLDEN["greedy"],
                            DENSE_GGUF_GOLDEN["greedy_margin"]) == 128
    w.close()
    if flags:
        assert "its share read straight from the file" in w.proc.output(), w.proc.output()


G1 = REPO / "tests" / "fixtures" / "tiny-nemotron-h-g1"


def test_one_group_tp(spawn, tmp_path):
    """One Mamba group (n_groups 1, tests/fixtures/tiny-nemotron-h-g1; the tokenizer linked
    from tiny-nemotron-h): -tp 2 and -tp 4 split the heads, replicate the group (as vLLM)
    and sum the gated norm's squares across the ranks; every prompt's greedy tokens are
    transformers', and tokens and logprobs are bitwise those of -tp 1."""
    d = tmp_path / "g1"
    d.mkdir()
    for f in (G1 / "model").iterdir():
        (d / f.name).symlink_to(f)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).symlink_to(MODEL / "model" / f)
    golden = json.loads((G1 / "golden.json").read_text())
    runs = {}
    for tp in ("1", "2", "4"):
        w = EngineWorker(spawn, d, "--dtype", "float32", "-tp", tp)
        runs[tp] = [w.run(f"p{i}", p["ids"], len(g), logprobs=2) for i, (p, g) in
                    enumerate(zip(golden["prompts"], golden["greedy"]))]
        w.close()
    for i, g in enumerate(golden["greedy"]):
        assert runs["1"][i].tokens == g, i
        same(runs["2"][i], runs["1"][i])
        same(runs["4"][i], runs["1"][i])

