"""The token strings and EOS id of a GGUF model as JSON (for probe.c)."""
import json
import sys

from gguf import GGUFReader

r = GGUFReader(sys.argv[1])
f = r.fields["tokenizer.ggml.tokens"]
tokens = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
eos = int(r.fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
json.dump(tokens, open(sys.argv[2], "w"))
print(eos)
