"""Write a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json with the
chat template and the special tokens) from a GGUF's own tokenizer metadata, with the
`gguf` and `tokenizers` packages only: no torch, no download.

    python tests/lm_eval/gguf_tokenizer.py MODEL.gguf OUT_DIR

lm-eval's huggingface tokenizer backend (local-completions,
tokenizer_backend=huggingface) loads such a folder with transformers' AutoTokenizer.
transformers can read a GGUF's tokenizer itself (AutoTokenizer.from_pretrained(...,
gguf_file=...)), but that path imports torch; the test command stays without torch.
Only the byte-level BPE tokenizers (tokenizer.ggml.model "gpt2", e.g. SmolLM2) are
handled: the same layout transformers 5.23 writes from the same GGUF (the byte-level
pre-tokenizer without a prefix space, the vocabulary and merges as stored, control
tokens as special added tokens, no BOS added).  tests/e2e/test_lm_eval.py checks the
ids against Tessera's /tokenize and transformers' own (the goldens)."""
import json
import os
import sys

from gguf import GGUFReader, GGUFValueType
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

CONTROL = 3  # llama.cpp's token type for control (special) tokens


def _field(reader, name, default=None):
    field = reader.fields.get(name)
    if field is None:
        return default
    if field.types[0] == GGUFValueType.ARRAY:
        if field.types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [int(field.parts[i][0]) for i in field.data]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]][0].item()


def write_tokenizer(gguf_path, out_dir):
    reader = GGUFReader(gguf_path)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise SystemExit(f"{gguf_path}: tokenizer.ggml.model is {kind!r}; only byte-level "
                         "BPE ('gpt2') is handled")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in _field(reader, "tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                     byte_fallback=False, continuing_subword_prefix="",
                                     end_of_word_suffix=""))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                       trim_offsets=True, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True,
                                           use_regex=True)
    tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                  for token, kind in zip(tokens, types) if kind == CONTROL])

    def token_of(key):
        index = _field(reader, f"tokenizer.ggml.{key}")
        return None if index is None else tokens[index]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_of("bos_token_id"),
        "eos_token": token_of("eos_token_id"),
        "unk_token": token_of("unknown_token_id"),
        "pad_token": token_of("padding_token_id"),
        "add_bos_token": False,
        "model_max_length": 1 << 60,
    }
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
        json.dump({key: value for key, value in config.items() if value is not None},
                  handle, indent=1, ensure_ascii=False)
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.split("\n\n")[1])
    write_tokenizer(sys.argv[1], sys.argv[2])
