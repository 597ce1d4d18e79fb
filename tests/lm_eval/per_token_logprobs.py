"""Per-token prompt log-probabilities: a running Tessera server vs transformers.

    python tests/lm_eval/per_token_logprobs.py --base-url http://127.0.0.1:P \\
        --model-name SmolLM2-135M-Instruct --gguf .cache/models/X.gguf --tokenizer DIR [--doc 0]

Scores one GSM8K reference solution the way lm-eval's loglikelihood_rolling does
(bos, then the text's tokens) with `echo: true, logprobs: 1`, and compares Tessera's
token_logprobs with transformers' logits for the same ids. It uses two log-softmaxes:
torch's float32 kernel, which is what lm-eval's hf model uses, and a float64 one of the
same float32 logits, which is the exact value of those logits. docs/accuracy.md
explains why both are needed."""
import argparse
import json
import os

import numpy as np
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "fixtures",
                       "gsm8k", "test.jsonl")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--doc", type=int, default=0)
    args = parser.parse_args()

    with open(FIXTURE, encoding="utf-8") as handle:
        doc = json.loads(handle.readlines()[args.doc])
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    ids = [tokenizer.bos_token_id] + tokenizer(doc["answer"])["input_ids"]

    reply = requests.post(args.base_url.rstrip("/") + "/v1/completions", timeout=1800, json={
        "model": args.model_name, "prompt": ids, "max_tokens": 1, "echo": True,
        "logprobs": 1, "temperature": 0}).json()
    served = np.array(reply["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)],
                      dtype=np.float64)

    torch.set_num_threads(1)
    gguf = os.path.abspath(args.gguf)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf),
                                                 gguf_file=os.path.basename(gguf),
                                                 dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    targets = torch.tensor(ids[1:])[:, None]
    references = {
        "torch float32 log_softmax": torch.log_softmax(logits, -1),
        "float64 log_softmax of the same logits": torch.log_softmax(logits.double(), -1),
    }
    for name, logprobs in references.items():
        difference = served - logprobs.gather(1, targets)[:, 0].double().numpy()
        print(f"Tessera - {name}: {len(difference)} tokens, mean {difference.mean():+.2e}, "
              f"min {difference.min():+.2e}, max {difference.max():+.2e}, "
              f"sum {difference.sum():+.2e}")


if __name__ == "__main__":
    main()
