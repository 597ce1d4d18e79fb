#!/usr/bin/env python3
"""make_corpus.py - write the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/).

Python 3 standard library only: protobuf Envelopes and GGUF files are encoded by hand
here, following proto/tessera.proto and the GGUF spec, so the seeds need no generated
code and no package.  Seeds are small on purpose (the whole corpus stays well under
300 KB): libFuzzer mutates small inputs faster, and a seed only has to reach a code
path, not be realistic.

Run it from anywhere; it rewrites every file it owns (names are stable, so the git diff
shows what changed):
    python3 tests/fuzz/make_corpus.py
Each target's input format is described at the top of its tests/fuzz/fuzz_<target>.c.
"""

import json
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")

# ------------------------------------------------------------------ protobuf encoding
# Only what tessera.proto uses: varints (uint32/64, int32/64, bool, enum), fixed32
# floats, and length-delimited strings, bytes, sub-messages and packed repeats.


def varint(x):
    if x < 0:
        x += 1 << 64  # int32/int64 negatives are ten-byte two's complement
    out = bytearray()
    while True:
        b = x & 0x7F
        x >>= 7
        if x:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def key(field, wire_type):
    return varint(field << 3 | wire_type)


def f_varint(field, x):
    return key(field, 0) + varint(int(x))


def f_float(field, x):
    return key(field, 5) + struct.pack("<f", x)


def f_bytes(field, b):
    if isinstance(b, str):
        b = b.encode()
    return key(field, 2) + varint(len(b)) + b


def f_packed(field, xs):
    return f_bytes(field, b"".join(varint(x) for x in xs))


def f_packed_float(field, xs):
    return f_bytes(field, b"".join(struct.pack("<f", x) for x in xs))


def msg(*fields):
    return b"".join(fields)


VERSION = 1000  # TSR_PROTO_VERSION for 1.0

# Envelope oneof field numbers (tessera.proto).
HELLO, MODEL_INFO, SUBMIT, ABORT, OUTPUT, ERROR = 10, 11, 20, 21, 22, 23
STATUS, DRAIN, SHUTDOWN, JOIN, PLAN, STAGE_DONE = 30, 40, 41, 50, 51, 52


def envelope(which, body, version=VERSION):
    return msg(f_varint(1, version), f_bytes(which, body))


def sampling(temperature=0.7, top_p=0.9, top_k=40, logit_bias=()):
    fields = [f_float(1, temperature), f_float(2, top_p), f_varint(3, top_k), f_float(4, 0.05),
              f_float(5, 1.1), f_float(6, 0.5), f_float(7, -0.5), f_varint(8, 1), f_varint(9, 1234)]
    for tok, bias in logit_bias:
        fields.append(f_bytes(10, msg(f_varint(1, tok), f_float(2, bias))))
    return msg(*fields)


def submit(request_id="req-1", prompt=(1, 15043, 3186, 29991), **kw):
    fields = [f_bytes(1, request_id), f_packed(2, prompt)]
    if kw.get("sampling", True):
        fields.append(f_bytes(3, sampling(logit_bias=kw.get("logit_bias", ((5, 2.5), (7, -100.0))))))
    fields += [f_varint(4, kw.get("max_tokens", 16)), f_varint(5, kw.get("min_tokens", 0)),
               f_packed(6, [2, 32000]), f_varint(7, 0), f_varint(8, kw.get("logprobs", 5)),
               f_varint(9, kw.get("prompt_logprobs", -1)), f_varint(10, -3),
               f_varint(11, 1700000000000000000), f_varint(12, 0), f_varint(13, 1)]
    return msg(*fields)


def token_logprobs(lp, rank, top):
    return msg(f_float(1, lp), f_varint(2, rank), f_packed(3, [t for t, _ in top]),
               f_packed_float(4, [p for _, p in top]))


def request_output(request_id, tokens, finish=0, logprobs=True):
    fields = [f_bytes(1, request_id), f_packed(2, tokens)]
    if logprobs:
        for i, t in enumerate(tokens):
            fields.append(f_bytes(3, token_logprobs(-0.5 - i, 1, [(t, -0.5 - i), (t + 1, -2.0)])))
    fields += [f_varint(5, finish), f_varint(8, 4), f_varint(9, 0), f_varint(10, len(tokens))]
    if finish:
        fields += [f_varint(6, 2), f_varint(7, 1), f_varint(11, 1000), f_varint(12, 20000),
                   f_varint(13, 300000), f_varint(14, 0)]
    return msg(*fields)


def model_info_hf():
    tok = json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []}})
    gen = msg(f_varint(1, 1), f_float(2, 0.7), f_varint(3, 1), f_float(4, 0.9), f_varint(5, 1), f_varint(6, 20),
              f_varint(11, 1), f_varint(12, 128))
    return msg(f_bytes(1, "worker-a"), f_varint(2, 77), f_bytes(3, "tiny"), f_bytes(3, "tiny-alias"),
               f_bytes(4, "/models/tiny"), f_varint(5, 512), f_varint(6, 16), f_packed(7, [2, 0]),
               f_varint(8, 1), f_varint(9, 300), f_varint(10, 0x1234567890ABCDEF),
               f_bytes(12, msg(f_bytes(1, tok), f_bytes(2, '{"chat_template": "{{ x }}"}'))),
               f_bytes(14, "{% for m in messages %}{{ m.content }}{% endfor %}"), f_bytes(15, gen),
               f_bytes(16, msg(f_bytes(1, "sha256"), f_varint(2, 0))), f_varint(17, 1024), f_varint(18, 8),
               f_varint(19, 2048), f_varint(20, 1), f_varint(21, 1), f_bytes(22, "float32"), f_bytes(23, "cpu"),
               f_bytes(24, "LlamaForCausalLM"), f_bytes(25, "tcp://127.0.0.1:5556"), f_varint(26, 1),
               f_bytes(27, "0.1.0"), f_varint(28, 20), f_varint(29, 1), f_varint(30, 100))


def model_info_gguf():
    g = msg(f_bytes(1, "gpt2"), f_bytes(2, "smollm"), *[f_bytes(3, t) for t in ("<s>", "</s>", "a", "b", "ab")],
            f_packed_float(4, [0.0, 0.0, -1.0, -2.0, -3.0]), f_packed(5, [3, 3, 1, 1, 1]), f_bytes(6, "a b"),
            f_varint(7, 0), f_varint(8, 1), f_varint(9, -1), f_varint(10, -1), f_varint(11, 1),
            f_varint(12, 0), f_varint(13, 0))
    return msg(f_bytes(1, "worker-g"), f_varint(2, 5), f_bytes(3, "tiny-gguf"), f_varint(5, 256),
               f_varint(6, 32), f_packed(7, [1]), f_varint(8, 0), f_varint(9, 5), f_bytes(13, g),
               f_varint(26, 0))


def status():
    ev_stored = msg(f_varint(1, 0), f_packed(2, [11, 12, 13]), f_varint(3, 10))
    ev_removed = msg(f_varint(1, 1), f_packed(2, [12]))
    return msg(f_bytes(1, "worker-a"), f_varint(2, 77), f_varint(3, 9), f_varint(4, 1700000000000000000),
               f_varint(5, 1), f_varint(6, 1024), f_varint(7, 1000), f_varint(8, 24), f_varint(9, 3),
               f_varint(10, 1), f_varint(11, 8), f_varint(12, 300), f_bytes(13, ev_stored),
               f_bytes(13, ev_removed), f_bytes(13, msg(f_varint(1, 2))), f_bytes(14, "tcp://127.0.0.1:5555"),
               f_varint(15, 1), f_varint(20, 1), f_varint(21, 10), f_varint(22, 4), f_varint(23, 400),
               f_varint(24, 100))


def wire_seeds():
    valid = {
        "hello": envelope(HELLO, msg(f_bytes(1, "router-1"), f_bytes(2, "0.1.0"), f_varint(3, 99))),
        "hello_empty": envelope(HELLO, b""),
        "model_info_hf": envelope(MODEL_INFO, model_info_hf()),
        "model_info_gguf": envelope(MODEL_INFO, model_info_gguf()),
        "submit": envelope(SUBMIT, submit()),
        "submit_greedy": envelope(SUBMIT, submit("r2", [1] * 40, sampling=False, logprobs=-1, max_tokens=1)),
        "abort": envelope(ABORT, msg(f_bytes(1, "req-1"), f_bytes(1, "req-2"), f_bytes(2, "client gone"))),
        "abort_all": envelope(ABORT, msg(f_varint(3, 1))),
        "output": envelope(OUTPUT, msg(f_varint(1, 42), f_bytes(2, request_output("req-1", [450, 4996])),
                                       f_bytes(2, request_output("req-2", [13], finish=1, logprobs=False)))),
        "error": envelope(ERROR, msg(f_bytes(1, "req-1"), f_varint(2, 4), f_bytes(3, "prompt too long"),
                                     f_varint(4, 1))),
        "status": envelope(STATUS, status()),
        "drain": envelope(DRAIN, msg(f_varint(1, 30000), f_bytes(2, "maintenance"))),
        "shutdown": envelope(SHUTDOWN, msg(f_varint(1, 5000))),
        "join": envelope(JOIN, msg(f_varint(1, 1), f_varint(2, 4), f_varint(3, 4), f_varint(4, 1),
                                   f_bytes(5, "tcp://10.0.0.2:6000"), f_varint(6, 3))),
        "plan": envelope(PLAN, msg(f_varint(1, 7), f_bytes(2, bytes(range(128))),
                                   f_bytes(3, msg(f_varint(1, 0), f_packed(2, [1, 2, 3]), f_packed(3, [0, 1, 2]),
                                                  f_packed(4, [5]), f_varint(5, 1))),
                                   f_packed(4, [3, 4]))),
        "stage_done": envelope(STAGE_DONE, msg(f_varint(1, 7), f_varint(2, 1), f_varint(3, 1),
                                               f_packed(4, [42, 43]), f_bytes(5, ""))),
        # A minor version above ours, and a field number this side does not know.
        "minor_version_unknown_field": envelope(HELLO, msg(f_bytes(1, "r")), version=1007) + f_varint(999, 5),
    }
    invalid = {
        "bad_major_version": envelope(HELLO, msg(f_bytes(1, "r")), version=2000),
        "no_message": msg(f_varint(1, VERSION)),
        "submit_empty_prompt": envelope(SUBMIT, msg(f_bytes(1, "r"), f_varint(4, 1))),
        "submit_min_over_max": envelope(SUBMIT, submit(max_tokens=2, min_tokens=3)),
        "submit_bad_top_p": envelope(SUBMIT, msg(f_bytes(1, "r"), f_packed(2, [1]), f_varint(4, 1),
                                                 f_bytes(3, msg(f_float(2, 1.5))))),
        "submit_ctrl_char_id": envelope(SUBMIT, submit("req\x01", max_tokens=1)),
        "output_logprob_mismatch": envelope(OUTPUT, msg(f_bytes(2, msg(
            f_bytes(1, "r"), f_packed(2, [1, 2]), f_bytes(3, token_logprobs(-1.0, 1, [])))))),
        "status_free_over_total": envelope(STATUS, msg(f_bytes(1, "w"), f_varint(6, 4), f_varint(7, 5))),
        "model_info_no_name": envelope(MODEL_INFO, msg(f_bytes(1, "w"), f_varint(5, 1), f_varint(6, 16))),
        "truncated_submit": envelope(SUBMIT, submit())[:-7],
        "huge_declared_length": key(SUBMIT, 2) + varint(1 << 40) + b"\x0a\x01r",
    }
    out = {}
    for name, env in valid.items():
        out["valid_" + name] = b"\x00" + env
    for name, env in invalid.items():
        out["invalid_" + name] = b"\x00" + env
    # The same frames under a small max_len (selector bit 7) and a 7-byte error buffer
    # (bit 6), so both limits are reached from the first run.
    out["maxlen_fits_hello"] = bytes([0x80 | 0x3F]) + valid["hello"]
    out["maxlen_over_submit"] = bytes([0x80 | 0x08]) + valid["submit"]
    out["smallerr_bad_major"] = b"\x40" + invalid["bad_major_version"]
    out["smallerr_submit_min_over_max"] = b"\x40" + invalid["submit_min_over_max"]
    return out


# ------------------------------------------------------------------ GGUF encoding
# GGUF v2/v3: little-endian header, key/values, tensor infos, padding to the alignment,
# tensor data (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
SCALAR_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
              U64: "<Q", I64: "<q", F64: "<d"}
# ggml type: (tag, elements per block, bytes per block)
GGML = {"F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q8_0": (8, 32, 34), "I8": (24, 1, 1),
        "BF16": (30, 1, 2)}


def g_str(s):
    if isinstance(s, str):
        s = s.encode()
    return struct.pack("<Q", len(s)) + s


def g_value(t, v):
    """Encode a value of GGUF type t; arrays are (elem_type, [values])."""
    if t == STR:
        return g_str(v)
    if t == ARR:
        et, xs = v
        return struct.pack("<IQ", et, len(xs)) + b"".join(g_value(et, x) for x in xs)
    return struct.pack(SCALAR_FMT[t], v)


def gguf(kvs, tensors=(), version=3, alignment=32):
    """kvs: [(key, type, value)]; tensors: [(name, ggml type name, dims)], data filled with a ramp."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)))
    for k, t, v in kvs:
        out += g_str(k) + struct.pack("<I", t) + g_value(t, v)
    offset, datas = 0, []
    for name, tname, dims in tensors:
        tag, be, bb = GGML[tname]
        n = 1
        for d in dims:
            n *= d
        nbytes = n // be * bb
        out += g_str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", tag, offset)
        datas.append((offset, bytes((i * 7 + 3) & 0xFF for i in range(nbytes))))
        offset += (nbytes + alignment - 1) // alignment * alignment
    if tensors:
        out += b"\x00" * (-len(out) % alignment)
        base = len(out)
        for off, d in datas:
            out += b"\x00" * (base + off - len(out)) + d
    return bytes(out)


def tiny_llama_kvs(arch="llama", n_tokens=8, model="llama"):
    tokens = ["<unk>", "<s>", "</s>", "\u2581a", "\u2581b", "a", "b", "<0x0A>"][:n_tokens]
    kvs = [("general.architecture", STR, arch), ("general.name", STR, "tiny"),
           (arch + ".context_length", U32, 256), (arch + ".embedding_length", U32, 64),
           (arch + ".block_count", U32, 2), (arch + ".feed_forward_length", U32, 176),
           (arch + ".attention.head_count", U32, 4), (arch + ".attention.head_count_kv", U32, 2),
           (arch + ".rope.freq_base", F32, 10000.0),
           (arch + ".attention.layer_norm_rms_epsilon", F32, 1e-5),
           ("tokenizer.ggml.model", STR, model), ("tokenizer.ggml.tokens", ARR, (STR, tokens)),
           ("tokenizer.ggml.scores", ARR, (F32, [0.0] * 3 + [-1.0 * i for i in range(len(tokens) - 3)])),
           ("tokenizer.ggml.token_type", ARR, (I32, [2, 3, 3] + [1] * (len(tokens) - 3))),
           ("tokenizer.ggml.bos_token_id", U32, 1), ("tokenizer.ggml.eos_token_id", U32, 2),
           ("tokenizer.ggml.unknown_token_id", U32, 0), ("tokenizer.ggml.add_bos_token", BOOL, True),
           ("tokenizer.chat_template", STR, "{% for m in messages %}{{ m['content'] }}{% endfor %}")]
    if model == "gpt2":
        kvs += [("tokenizer.ggml.merges", ARR, (STR, ["a b", "\u2581 a"])), ("tokenizer.ggml.pre", STR, "smollm"),
                ("tokenizer.ggml.eot_token_id", U32, 2)]
    return kvs


def gguf_seeds():
    every_type = [("t.u8", U8, 200), ("t.i8", I8, -5), ("t.u16", U16, 60000), ("t.i16", I16, -300),
                  ("t.u32", U32, 4000000000), ("t.i32", I32, -70000), ("t.f32", F32, 1.5), ("t.bool", BOOL, True),
                  ("t.str", STR, "hello"), ("t.u64", U64, 1 << 63), ("t.i64", I64, -(1 << 62)),
                  ("t.f64", F64, -2.25), ("t.arr_i32", ARR, (I32, [1, -2, 3])),
                  ("t.arr_str", ARR, (STR, ["x", "", "yz"])), ("t.arr_empty", ARR, (U8, [])),
                  ("t.arr_arr", ARR, (ARR, [(U16, [1, 2]), (STR, ["n"]), (ARR, [(BOOL, [False])])]))]
    tensors = [("token_embd.weight", "F32", [8, 4]), ("blk.0.attn_q.weight", "Q4_0", [32, 2]),
               ("blk.0.ffn.weight", "F16", [4, 3, 2]), ("scalar", "F32", []), ("empty", "I8", [0, 5]),
               ("output_norm.weight", "BF16", [8])]
    llama = gguf(tiny_llama_kvs(), [("token_embd.weight", "F32", [64, 8]), ("output_norm.weight", "F32", [64])])
    out = {
        "valid_every_type": gguf(every_type, tensors),
        "valid_v2_align64": gguf([("general.alignment", U32, 64)] + every_type[:4], tensors[:2], version=2,
                                 alignment=64),
        "valid_no_tensors": gguf(every_type[:8]),
        "valid_header_only": gguf([]),
        "valid_tiny_llama": llama,
        "valid_tiny_gpt2_q8": gguf(tiny_llama_kvs(model="gpt2"), [("blk.0.attn_k.weight", "Q8_0", [32, 2])]),
        "valid_nested_arrays": gguf([("deep", ARR, (ARR, [(ARR, [(ARR, [(U8, [1])])])]))]),
        "invalid_magic": b"GGUX" + llama[4:],
        "invalid_version4": llama[:4] + struct.pack("<I", 4) + llama[8:],
        "invalid_big_endian_version": llama[:4] + struct.pack(">I", 3) + llama[8:],
        "invalid_dup_key": gguf([("k", U8, 1), ("k", U8, 2)]),
        "invalid_alignment_3": gguf([("general.alignment", U32, 3)]),
        "invalid_tensor_past_end": gguf([], [("t", "F32", [4])])[:-4],
        "invalid_q4_dims": gguf([], [("t", "Q4_0", [33])]),
    }
    # Truncated copies of the richest file: cut inside the header, the keys, the tensor
    # infos and the data.
    full = out["valid_every_type"]
    for cut in (3, 12, 23, 40, 120, len(full) // 2, len(full) - 40, len(full) - 1):
        out["truncated_every_type_%04d" % cut] = full[:cut]
    return out


# ------------------------------------------------------------------ YAML and argv

def config_seeds():
    yaml = {
        "valid_worker": "model: /models/tiny\nserved-model-name: [tiny, tiny-alias]\nmax-model-len: 4k\n"
                        "dtype: float32\nblock-size: 16\ngpu-memory-utilization: 0.85\n"
                        "tensor-parallel-size: 1\nenable-prefix-caching: true\nkv-cache-memory-bytes: 2GiB\n"
                        "listen: tcp://127.0.0.1:5555\nseed: 42\nmax-num-seqs: 8\nmax-num-batched-tokens: 2048\n",
        "valid_router": "host: 127.0.0.1\nport: 8000\napi-key:\n  - k1\n  - k2\nworker:\n"
                        "  - tcp://127.0.0.1:5555\n  - tcp://127.0.0.1:5557\nresponse-role: assistant\n"
                        "max-request-body: 32M\nlog-level: debug\nenable-request-id-headers: true\n",
        "valid_underscores": "max_model_len: 1K\nno-enable-chunked-prefill: true\nswap_space: 4\n"
                             "scheduling_policy: priority\nprefix_caching_hash_algo: xxhash\n",
        "valid_false_dropped": "enforce-eager: false\ntrust-remote-code: true\n",
        "valid_flow_map": "{port: 9000, host: '::1', served-model-name: x}\n",
        "valid_anchors": "chat-template: &t '{{ messages }}'\ntool-call-parser: *t\nenable-auto-tool-choice: true\n",
        "invalid_unknown_key": "tensor-parallel-sise: 2\n",
        "invalid_block_size": "block-size: 17\n",
        "invalid_list_for_int": "port: [1, 2]\n",
        "invalid_top_level_list": "- model\n- x\n",
        "invalid_syntax": "model: [unclosed\n",
        "invalid_tab_indent": "worker:\n\t- x\n",
        "invalid_nested_map": "model: {path: x}\n",
        "invalid_tp_pp_product": "tensor-parallel-size: 64\npipeline-parallel-size: 64\n",
        "invalid_empty": "",
        "invalid_bad_utf8": "model: \"\xff\xfe\"\n",
    }
    argv = {
        "argv_worker": (["/models/tiny", "--served-model-name", "a", "b", "--max-model-len=2k", "-tp", "1",
                         "--block-size", "32", "--no-enable-prefix-caching", "--kv-cache-memory", "1G"], True),
        "argv_router": (["--host", "0.0.0.0", "--port=8001", "--worker", "tcp://h:1", "tcp://h:2",
                         "--api-key", "--secret", "--enable-log-requests"], False),
        "argv_help": (["--help"], False),
        "argv_version": (["--version", "x"], True),
        "argv_config": (["--config", "/nonexistent/tessera.yaml"], False),
        "argv_dashdash": (["--", "--model"], True),
        "argv_bad_choice": (["--dtype", "int3"], True),
        "argv_missing_value": (["--port"], False),
        "argv_bool_with_value": (["--enforce-eager=yes"], True),
        "argv_two_models": (["m1", "--model", "m2"], True),
    }
    out = {}
    for name, text in yaml.items():
        out["yaml_" + name] = b"\x00" + text.encode("latin-1")
    for name, (args, allow_model) in argv.items():
        out[name] = bytes([1 | (2 if allow_model else 0)]) + b"\x00".join(a.encode() for a in args)
    return out


# ------------------------------------------------------------------ HF folders

def model_meta_seeds():
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512, "vocab_size": 300, "rope_theta": 10000.0,
              "rms_norm_eps": 1e-05, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    gen = {"bos_token_id": 1, "eos_token_id": [2, 0], "temperature": 0.7, "top_p": 0.9, "top_k": 20,
           "min_p": 0.05, "repetition_penalty": 1.05, "max_new_tokens": 128}
    tok_cfg = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "{{ messages[0]['content'] }}"}
    tok_cfg_list = {"chat_template": [{"name": "tool_use", "template": "{{ tools }}"},
                                      {"name": "default", "template": "{{ messages }}"}]}
    multimodal = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
                  "text_config": {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 8,
                                  "head_dim": 16, "eos_token_id": [200001, 200007], "max_position_embeddings": 4096,
                                  "layer_norm_epsilon": 1e-6}}
    tokenizer = {"version": "1.0", "added_tokens": [{"id": 0, "content": "<s>", "special": True}],
                 "model": {"type": "BPE", "vocab": {"<s>": 0, "a": 1, "b": 2, "ab": 3}, "merges": ["a b"]}}

    def folder(*pieces):
        return b"\x00".join(p if isinstance(p, bytes) else json.dumps(p).encode() for p in pieces)

    out = {
        "hf_config_only": folder(config),
        "hf_full": folder(config, gen, tok_cfg, tokenizer, b"{{ fallback }}"),
        "hf_template_list": folder(config, gen, tok_cfg_list),
        "hf_jinja_fallback": folder(config, b"", b"{}", tokenizer, b"{% if x %}y{% endif %}"),
        "hf_text_config": folder(multimodal, {"eos_token_id": 200008}),
        "hf_eos_null": folder({"eos_token_id": None, "architectures": None, "bos_token_id": None}),
        "invalid_not_object": folder([1, 2, 3]),
        "invalid_json": b'{"hidden_size": 64,',
        "invalid_negative_eos": folder({"eos_token_id": [-1]}),
        "invalid_big_u32": folder({"hidden_size": 1 << 33}),
        "invalid_dup_keys": b'{"vocab_size": 1, "vocab_size": 2}',
        "invalid_gen_negative_max": folder(config, {"max_new_tokens": -5}),
        "invalid_template_type": folder(config, {}, {"chat_template": 42}),
        "invalid_nul_in_string": folder({"model_type": "ll\u0000ama"}),
    }
    # GGUF files go down model_meta's GGUF path (the target checks the magic).
    out["gguf_tiny_llama"] = gguf(tiny_llama_kvs(), [("token_embd.weight", "F32", [64, 8])])
    out["gguf_tiny_gpt2"] = gguf(tiny_llama_kvs(model="gpt2"), [("output.weight", "F32", [64, 8])])
    out["gguf_no_tokenizer"] = gguf(tiny_llama_kvs()[:10])
    out["gguf_eos_out_of_range"] = gguf([kv if kv[0] != "tokenizer.ggml.eos_token_id"
                                         else (kv[0], U32, 999) for kv in tiny_llama_kvs()])
    return out


# ------------------------------------------------------------------ tokenizer and templates
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "fixtures")

TOKENIZER_TEXTS = [
    "", " ", "\n", "hello world", "The quick brown fox jumps over the lazy dog. It's 3:45pm; we're late.",
    "I'M SHOUTING, You're Whispering. Don't stop. O'Neil's caf\u00e9 served cr\u00e8me br\u00fbl\u00e9e.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; i++) {\r\n\tsum += a[i];\t// dot\r\n}",
    "Numbers: 0 7 42 123 4567 89012 3141592653589793 1,000,000.00 -17e-3 0x1F",
    "   leading and trailing   \n\n\n\t\t tabs\t and  double  spaces \r\n\r\n",
    "\u4e2d\u6587\u6587\u672c\u3002\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \ud55c\uad6d\uc5b4 \u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd \u0928\u092e\u0938\u094d\u0924\u0947",
    "Emoji: \U0001f600 \U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f3f3\ufe0f\u200d\U0001f308 1\ufe0f\u20e3",
    "e\u0301 a\u0308 Z\u0351\u036ba\u0310l\u0300g\u0312o\u0308 \u00a0nbsp\u2003em\u3000\u200bzw\u2028ls\u0085nel \ufeff\ufffd",
    "<|begin_of_text|>hello<|eot_id|>", "a<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "a [USER] b", "[USER]x", "the fox, foxes, firefox fox", "<|python_tag|> fox [USER]<|eom_id|>",
    "can't won't 'S 'LL \u2019s \x00\x01\x7f",
]


def tokenizer_seeds():
    """Byte 0 even: text (valid UTF-8 and a few broken sequences); odd: little-endian
    16-bit ids, taken from the llama3_style goldens (bit 1: skip_special_tokens)."""
    seeds = {}
    for i, s in enumerate(TOKENIZER_TEXTS):
        seeds["text_%02d" % i] = b"\x00" + s.encode("utf-8")
    for i, b in enumerate([b"\xff", b"ab\xc3", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"x\xe2\x82 y"]):
        seeds["text_invalid_%d" % i] = b"\x00" + b
    with open(os.path.join(FIXTURES, "tokenizers", "llama3_style.golden.json"), encoding="utf-8") as f:
        g = json.load(f)
    for i, (ids, _, _) in enumerate(g["decode"][:24]):
        seeds["ids_%02d" % i] = bytes([1 | (i & 1) << 1]) + b"".join(struct.pack("<H", x) for x in ids)
    # Split UTF-8 across byte tokens (ByteLevel maps every byte to one token), and ids past
    # the vocabulary.
    seeds["ids_split_utf8"] = b"\x01" + struct.pack("<6H", 227, 106, 106, 194, 194, 243)
    seeds["ids_out_of_range"] = b"\x03" + struct.pack("<4H", 64, 712, 0xFFFF, 65)
    return seeds


# Small chat templates written for the fuzzer: the constructs the real ones lean on
# (loops over messages, namespace, macros, tojson, string methods, raise_exception).
CHAT_TEMPLATES = [
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{{- bos_token }}{%- for m in messages %}{%- if m['role'] == 'system' %}{{- m['content'] | trim }}"
    "{%- elif m.content is string %}[{{ m.role | upper }}] {{ m.content }}{{ eos_token }}"
    "{%- else %}{%- for p in m.content %}{{ p.text | default('') }}{%- endfor %}{%- endif %}{%- endfor %}",
    "{%- set ns = namespace(sys='', n=0) %}{%- for m in messages %}{%- if m.role == 'system' %}"
    "{%- set ns.sys = m.content %}{%- else %}{%- set ns.n = ns.n + 1 %}{%- endif %}{%- endfor %}"
    "{{ ns.sys }}|{{ ns.n }}|{{ messages | length }}|{{ messages[-1].role }}",
    "{%- if tools %}{%- for t in tools %}{{ t | tojson(indent=2) }}\n{%- endfor %}{%- endif %}"
    "{%- for m in messages if m.tool_calls is defined %}{%- for c in m.tool_calls %}"
    "<tool_call>{{ c.function.name }}{{ c.function.arguments | tojson }}</tool_call>{%- endfor %}{%- endfor %}",
    "{% macro render(m, i) %}{{ i }}:{{ m.role[:3] }}{% if m.content is string %}={{ m.content.split(' ')"
    " | join('_') }}{% endif %}{% endmacro %}{% for m in messages %}{{ render(m, loop.index0) }}"
    "{% if not loop.last %},{% endif %}{% else %}none{% endfor %}",
    "{% for m in messages %}{% if m.role == 'assistant' and '</think>' in m.content %}"
    "{{ m.content.split('</think>')[-1].lstrip() }}{% elif m.role not in ['user', 'system', 'assistant', 'tool'] %}"
    "{{ raise_exception('bad role ' ~ m.role) }}{% endif %}{% endfor %}"
    "{{ strftime_now('%d %b %Y') }}{{ (enable_thinking | default(true)) | string | lower }}",
    "{{ messages | map(attribute='role') | unique | list | tojson }}{{ messages | selectattr('role', 'equalto', "
    "'user') | list | length }}{{ {'b': 1, 'a': 2} | dictsort }}{{ '%s-%d' % ('x', n) }}{{ x * 2 // 1 }}"
    "{{ 'abc'.replace('b', 'B').title().center(9) if n is number else none }}{{ range(3) | sum }}",
    "{% set d = dict(a=1, b=[1, 2]) %}{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}"
    "{{ d.b[1:] }}{{ 'x'.join(['1', '2']) }}{{ none is none }}{{ (1, 2) | first }}{{ [3, 1] | sort | last }}"
    "{%- filter upper %}low{% endfilter %}{{ 'a\\tb' | indent(2, true) }}{{ 7 % 3 }}{{ 2 ** 10 }}",
]


def template_seeds():
    """Template source, NUL, JSON context.  The focused language cases of the template
    goldens (tests/fixtures/templates/goldens.json, written by this project's
    make_template_goldens.py) with their contexts, plus the chat templates above with no
    context (the harness then supplies its fixed chat)."""
    seeds = {}
    for i, s in enumerate(CHAT_TEMPLATES):
        seeds["chat_%02d" % i] = s.encode("utf-8")
    with open(os.path.join(FIXTURES, "templates", "goldens.json"), encoding="utf-8") as f:
        g = json.load(f)
    for u in g["unit"]:
        ctx = json.dumps(u.get("context") or {}, ensure_ascii=False, separators=(",", ":"))
        seeds["unit_" + u["name"]] = u["template"].encode("utf-8") + b"\x00" + ctx.encode("utf-8")
    seeds["syntax_unclosed_if"] = b"{% if x %}never closed"
    seeds["syntax_bad_filter"] = b"{{ x | nosuchfilter }}"
    seeds["limit_recursion"] = b"{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
    seeds["limit_loops"] = b"{% for i in range(1000) %}{% for j in range(1000) %}{{ i }}{% endfor %}{% endfor %}"
    seeds["ctx_not_object"] = b"{{ messages }}\x00[1, 2]"
    return seeds


def http_seeds():
    """Raw HTTP/1.1 requests as a client writes them (fuzz_http.c): the OpenAI bodies
    the router validates, framing variants (chunked, pipelined, 100-continue), and
    requests at the edges of the target's small limits (4 KiB body, 16 headers)."""

    def post(path, body, extra=b"", te_chunked=False):
        if te_chunked:
            chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:7], body[7:]) if p)
            return (b"POST %s HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
                    b"Transfer-Encoding: chunked\r\n%s\r\n%s0\r\n\r\n" % (path, extra, chunks))
        return (b"POST %s HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
                % (path, len(body), extra) + body)

    comp = json.dumps({"model": "m", "prompt": "Hi", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9,
                       "top_k": 5, "stop": ["\n", "x"], "logit_bias": {"7": 3}, "seed": 1, "n": 2,
                       "logprobs": 2, "echo": True}).encode()
    chat = json.dumps({"messages": [{"role": "system", "content": "s"},
                                    {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                       "max_completion_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
                       "logprobs": True, "top_logprobs": 2,
                       "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                       "tool_choice": {"type": "function", "function": {"name": "f"}}}).encode()
    seeds = {}
    seeds["completions"] = post(b"/v1/completions", comp)
    seeds["completions_ids"] = post(b"/v1/completions", b'{"prompt":[[1,2,3],[4]],"max_tokens":1,"echo":true,"prompt_logprobs":1}')
    seeds["chat"] = post(b"/v1/chat/completions", chat)
    seeds["chat_chunked"] = post(b"/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}]}', te_chunked=True)
    seeds["bad_values"] = post(b"/v1/completions", b'{"prompt":"a","n":0,"temperature":-1,"top_p":2,"stream_options":{"x":1}}')
    seeds["bad_json"] = post(b"/v1/completions", b'{"prompt": [1, 2, {"a": [[[[')
    seeds["pipelined"] = (b"GET /health HTTP/1.1\r\nHost: h\r\n\r\n" + post(b"/v1/completions", b'{"prompt":"x"}')
                          + b"GET /v1/models?x=1 HTTP/1.0\r\n\r\n")
    seeds["expect_continue"] = post(b"/v1/completions", b'{"prompt":"x"}', extra=b"Expect: 100-continue\r\n")
    seeds["too_big"] = b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5000\r\n\r\n{"
    seeds["many_headers"] = b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(17)) + b"\r\n"
    seeds["upgrade"] = b"GET /ws HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\nrest"
    seeds["smuggle"] = b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    seeds["partial"] = b"POST /v1/completions HTTP/1.1\r\nContent-Length: 10\r\n\r\n{\"pr"
    return seeds


def write(target, seeds):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    for name in os.listdir(d):  # names this script no longer makes would linger
        os.unlink(os.path.join(d, name))
    total = 0
    for name, data in sorted(seeds.items()):
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
        total += len(data)
    print("%-12s %3d seeds, %6d bytes" % (target, len(seeds), total))
    return total


def main():
    total = write("wire", wire_seeds())
    total += write("gguf", gguf_seeds())
    total += write("config_yaml", config_seeds())
    total += write("model_meta", model_meta_seeds())
    total += write("tokenizer", tokenizer_seeds())
    total += write("template", template_seeds())
    total += write("http", http_seeds())
    print("total %d bytes" % total)
    if total > 300 * 1024:
        sys.exit("make_corpus.py: the corpus is over 300 KB; keep seeds small")


if __name__ == "__main__":
    main()
