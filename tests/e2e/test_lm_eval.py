"""EleutherAI's lm-evaluation-harness (PyPI lm-eval 0.4.13, unchanged, run as a
subprocess) against `tessera serve` on the demo SmolLM2 model (docs/accuracy.md).

* test_loglikelihood_matches_transformers: `--model local-completions` on
  tessera_ll_local (tests/lm_eval/, a committed JSON file; 40 loglikelihood requests:
  token-id prompts, echo, logprobs, max_tokens 1) with the server in float32; the run
  completes and reports acc, and every log-likelihood lm-eval logged equals
  transformers' float32 value for the same (context, continuation) within 1e-3
  (tests/fixtures/lm_eval/goldens.json, tests/fixtures/make_lm_eval_goldens.py).
* test_gsm8k_generation_completions_and_chat: gsm8k_local (lm-eval's gsm8k task over
  ../shared/fixtures/gsm8k/test.jsonl) with --limit 20 (2-shot, 64 new tokens: see
  NUM_FEWSHOT) through local-completions and through local-chat-completions
  --apply_chat_template; both complete and report exact_match in [0, 1] for both
  filters, with 20 logged samples.

lm-eval tokenizes with its huggingface backend from a tokenizer folder written from the
GGUF without torch (tests/lm_eval/gguf_tokenizer.py); both tests check that its ids are
Tessera's /tokenize ids for the prompts sent.  Nothing is downloaded (HF_*_OFFLINE)."""
import glob
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import requests

from conftest import FIXTURES, REPO, skip_because

import gguf  # noqa: E402,F401  (tests/requirements.txt installs all three: a missing one fails)
import lm_eval  # noqa: E402,F401
import transformers  # noqa: E402
# Loaded by path, not through sys.path: tests/lm_eval also holds a module named utils.
_spec = importlib.util.spec_from_file_location(
    "gguf_tokenizer", REPO / "tests" / "lm_eval" / "gguf_tokenizer.py")
gguf_tokenizer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gguf_tokenizer)

# lm-eval runs take minutes even on the normal build; the sanitized one is ~30x slower
pytestmark = pytest.mark.slow_under_sanitizers

SERVED = "SmolLM2-135M-Instruct"
GOLDENS = REPO / "tests" / "fixtures" / "lm_eval" / "goldens.json"
GSM8K = FIXTURES / "gsm8k" / "test.jsonl"
TOLERANCE = 1e-3
# The gsm8k runs are shortened to keep the test command light (two 20-document runs in
# a few minutes on a loaded 2-core CPU): 2 few-shot examples instead of the task's 5
# (prompts of ~400 tokens instead of ~900; prefill dominates) and 64 generated tokens
# instead of 256.  The task, its stop strings, filters and exact_match are unchanged;
# scripts/lm-eval.sh runs it in full.
NUM_FEWSHOT = 2
MAX_GEN_TOKS = 64
TIMEOUT = 1500


@pytest.fixture
def tokenizer_dir(demo_model, tmp_path):
    return gguf_tokenizer.write_tokenizer(str(demo_model), str(tmp_path / "tokenizer"))


@pytest.fixture
def hf_tokenizer(tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def start(serve, *flags):
    # --status-interval-ms 1000: a router descheduled for a while on a loaded machine
    # must not call a busy worker down (docs/accuracy.md, "Problems found").
    return serve("--served-model-name", SERVED, "--status-interval-ms", "1000", *flags)


def run_lm_eval(tmp_path, name, model, model_args, tasks, *extra):
    out = tmp_path / name
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", HF_HOME=str(tmp_path / "hf-home"))
    args = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args",
            ",".join(f"{k}={v}" for k, v in model_args.items()), "--tasks", tasks,
            "--include_path", str(REPO / "tests" / "lm_eval"), "--log_samples",
            "--output_path", str(out), *extra]
    # The task files name their data relative to the repository root.
    started = time.monotonic()
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, f"lm_eval {name} exited {done.returncode}:\n{done.stderr[-6000:]}"
    results = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))
    assert results, f"lm_eval {name} wrote no results_*.json under {out}"
    with open(results[-1], encoding="utf-8") as handle:
        report = json.load(handle)
    samples = {}
    for path in glob.glob(str(out / "**" / "samples_*.jsonl"), recursive=True):
        task = os.path.basename(path)[len("samples_"):].rsplit("_", 1)[0]
        with open(path, encoding="utf-8") as handle:
            samples[task] = [json.loads(line) for line in handle if line.strip()]
    print(f"lm_eval {name} ({time.monotonic() - started:.0f} s): "
          + json.dumps(report["results"], sort_keys=True))
    return report, samples


def tessera_ids(base, text):
    reply = requests.post(base + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                          timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def completions_args(served, tokenizer_dir):
    return {"model": SERVED, "base_url": served.base + "/v1/completions",
            "tokenizer_backend": "huggingface", "tokenizer": tokenizer_dir,
            "num_concurrent": 4, "max_length": 2048, "timeout": TIMEOUT, "max_retries": 1}


def test_loglikelihood_matches_transformers(serve, tmp_path, tokenizer_dir, hf_tokenizer):
    with open(GOLDENS, encoding="utf-8") as handle:
        goldens = {(pair["context"], pair["continuation"]): pair
                   for pair in json.load(handle)["pairs"]}
    served = start(serve, "--dtype", "float32")

    # The ids lm-eval will send (its tokenizer) are Tessera's own and transformers'.
    for (context, continuation), pair in goldens.items():
        moved = len(context) - len(context.rstrip())
        whole = pair["context_ids"] + pair["continuation_ids"]
        assert hf_tokenizer(context + continuation, add_special_tokens=False).input_ids == whole
        assert tessera_ids(served.base, context + continuation) == whole, (context, continuation)
        assert tessera_ids(served.base, context[:len(context) - moved]) == pair["context_ids"]

    report, samples = run_lm_eval(tmp_path, "loglikelihood", "local-completions",
                                  completions_args(served, tokenizer_dir), "tessera_ll_local")
    result = report["results"]["tessera_ll_local"]
    for metric in ("acc,none", "acc_norm,none"):
        assert 0.0 <= result[metric] <= 1.0, result
    records = samples["tessera_ll_local"]
    assert len(records) == 12

    compared, worst = 0, 0.0
    for record in records:
        for index, response in enumerate(record["resps"]):
            request = record["arguments"][f"gen_args_{index}"]
            pair = goldens[(request["arg_0"], request["arg_1"])]
            received = float(response[0][0])
            difference = abs(received - pair["loglikelihood"])
            worst = max(worst, difference)
            assert difference <= TOLERANCE, (
                f"doc {record['doc_id']} {request['arg_1']!r}: lm-eval received {received}, "
                f"transformers {pair['loglikelihood']}")
            compared += 1
    assert compared == len(goldens) == 40
    print(f"{compared} log-likelihoods within {TOLERANCE} of transformers; largest "
          f"difference {worst:.2e}")


def test_gsm8k_generation_completions_and_chat(serve, tmp_path, tokenizer_dir, hf_tokenizer):
    if not GSM8K.exists():
        skip_because("no-shared-fixtures", f"{GSM8K} is absent")
    served = start(serve)
    common = ("--limit", "20", "--num_fewshot", str(NUM_FEWSHOT),
              "--gen_kwargs", f"max_gen_toks={MAX_GEN_TOKS}")

    report, samples = run_lm_eval(tmp_path, "completions", "local-completions",
                                  completions_args(served, tokenizer_dir), "gsm8k_local",
                                  *common)
    check_exact_match(report, samples)
    # The prompts lm-eval tokenized and sent as ids are what Tessera itself makes of them.
    for record in samples["gsm8k_local"][:5]:
        prompt = record["arguments"]["gen_args_0"]["arg_0"]
        assert hf_tokenizer(prompt, add_special_tokens=False).input_ids == \
            tessera_ids(served.base, prompt), record["doc_id"]

    report, samples = run_lm_eval(
        tmp_path, "chat", "local-chat-completions",
        {"model": SERVED, "base_url": served.base + "/v1/chat/completions",
         "num_concurrent": 4, "timeout": TIMEOUT, "max_retries": 1},
        "gsm8k_local", "--apply_chat_template", *common)
    check_exact_match(report, samples)


def check_exact_match(report, samples):
    result = report["results"]["gsm8k_local"]
    for name in ("exact_match,strict-match", "exact_match,flexible-extract"):
        assert isinstance(result[name], float) and 0.0 <= result[name] <= 1.0, result
    # 20 documents, each logged once per filter.
    assert len({record["doc_id"] for record in samples["gsm8k_local"]}) == 20
