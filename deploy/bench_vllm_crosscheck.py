"""Run vLLM's own `vllm bench serve` client against a Tessera server, for comparing it
with `tessera bench serve` (docs/benchmarks.md, "tessera bench serve").

    python deploy/bench_vllm_crosscheck.py tokenizer MODEL.gguf OUT_DIR
        writes a Hugging Face tokenizer folder from the GGUF's tokenizer.ggml.* metadata
        (byte-level BPE with the GPT-2 split, control tokens special), so that vLLM's
        client (transformers) and Tessera's (--tokenizer OUT_DIR) load the same thing;
    python deploy/bench_vllm_crosscheck.py serve [vllm bench serve flags]
        runs vllm/benchmarks/serve.py from the installed vllm wheel, unmodified.

Needs a venv with `pip install --no-deps vllm` plus aiohttp tqdm numpy "transformers<5.21"
pillow pybase64 msgspec cbor2 psutil pyzmq gguf tokenizers.  torch is not installed, so two
shims keep the import from reaching it; neither is on the benchmark's code path:
  - `vllm` is registered as a bare package, so vllm/__init__.py (env_override, which
    imports torch) does not run;
  - torch, vllm.lora, vllm.multimodal, vllm.inputs, vllm.config and vllm.distributed are
    placeholder modules: they are imported for type annotations, the logger's rank
    check, and the LoRA / multimodal datasets, which the random text dataset never uses.
The dataset, the aiohttp/SSE client, the metrics and the printing are vLLM's."""
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


def make_tokenizer(gguf_path, out_dir):
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    reader = gguf.GGUFReader(gguf_path)

    def field(name):
        f = reader.fields.get(name)
        if f is None:
            return None
        is_str = f.types[-1] == gguf.GGUFValueType.STRING
        vals = [bytes(f.parts[i]).decode() if is_str else f.parts[i][0].item() for i in f.data]
        return vals if f.types[0] == gguf.GGUFValueType.ARRAY else vals[0]

    if field("tokenizer.ggml.model") != "gpt2":
        sys.exit("only byte-level BPE ('gpt2') GGUF tokenizers are handled here")
    tokens, types_ = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, ty in enumerate(types_) if ty == 3]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    kw = {}
    for key, name in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        i = field("tokenizer.ggml." + name)
        if i is not None:
            kw[key] = tokens[i]
    PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=special, **kw).save_pretrained(out_dir)


class _Anything(type):
    def __getattr__(cls, name):
        return _Anything(name, (), {})

    def __call__(cls, *a, **k):
        return _Anything("x", (), {})

    def __getitem__(cls, k):
        return cls

    def __or__(cls, o):
        return cls
    __ror__ = __or__


class _Placeholder(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    PREFIXES = ("torch", "vllm.lora", "vllm.multimodal", "vllm.inputs", "vllm.config", "vllm.distributed")

    def find_spec(self, name, path, target=None):
        if any(name == p or name.startswith(p + ".") for p in self.PREFIXES):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Placeholder(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0"
        return m

    def exec_module(self, module):
        pass


def run_vllm_bench(argv):
    sys.meta_path.insert(0, _PlaceholderFinder())
    spec = importlib.util.find_spec("vllm")
    pkg = types.ModuleType("vllm")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["vllm"] = pkg
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "tokenizer":
        make_tokenizer(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 2 and sys.argv[1] == "serve":
        run_vllm_bench(sys.argv[2:])
    else:
        sys.exit(__doc__)
