#!/usr/bin/env bash
# README command 1: install dependencies, build, fetch the demo model and serve it
# with `tessera serve` on http://127.0.0.1:8000.  Extra arguments go to tessera serve
# (vLLM's flag names), e.g. ./scripts/serve.sh --port 8001 --api-key secret
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
MODEL="$(./scripts/fetch-model.sh)"
exec ./build/deploy/tessera serve "$MODEL" --served-model-name SmolLM2-135M-Instruct \
    --host 127.0.0.1 --port 8000 "$@"
