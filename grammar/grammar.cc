// grammar.cc - xgrammar behind grammar.h.  Every xgrammar call is inside a try: C++
// exceptions (xgrammar throws on a schema, regex or grammar it refuses) stop here and
// become TSR_E_INVAL / TSR_E_NOMEM and a message.  Nothing here logs (common/'s rule):
// the caller decides what a refusal means.
#include "grammar/grammar.h"

#include <dlpack/dlpack.h>
#include <picojson.h>
#include <xgrammar/xgrammar.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <vector>

struct tsr_grammar_vocab {
        xgrammar::TokenizerInfo info;
        xgrammar::GrammarCompiler compiler;
        size_t vocab_size;
};

struct tsr_grammar_compiled {
        xgrammar::CompiledGrammar g;
};

struct tsr_grammar_matcher {
        xgrammar::GrammarMatcher m;
        size_t n_accepted;
};

static void say(char *err, size_t errlen, const char *what) {
        if (err && errlen)
                std::snprintf(err, errlen, "%s", what);
}

// xgrammar prefixes its messages with the throwing source line ("[12:00:00] /path/x.cc:42: "):
// a client needs the sentence, not our build path.
static void say_exc(char *err, size_t errlen, const std::exception &e) {
        const char *w = e.what(), *p = std::strstr(w, ".cc:");
        if (p) {
                p = std::strchr(p + 4, ':');
                if (p) {
                        w = p + 1;
                        while (*w == ' ')
                                w++;
                }
        }
        say(err, errlen, w);
        if (err && errlen) {   // and without its trailing newline
                size_t n = std::strlen(err);
                while (n && (err[n - 1] == '\n' || err[n - 1] == ' '))
                        err[--n] = '\0';
        }
}

// Run f (which returns a tsr_status) with xgrammar's exceptions turned into statuses:
// out of memory, or TSR_E_INVAL with xgrammar's message.
template <class F> static tsr_status guarded(char *err, size_t errlen, F &&f) {
        try {
                return f();
        } catch (const std::bad_alloc &) {
                say(err, errlen, "out of memory");
                return TSR_E_NOMEM;
        } catch (const std::exception &e) {
                say_exc(err, errlen, e);
                return TSR_E_INVAL;
        }
}

// One EBNF string literal for `s` (xgrammar's EBNF escapes, GBNF's): quote, backslash
// and control characters escaped; other UTF-8 as is.
static void ebnf_literal(std::string &out, const std::string &s) {
        char buf[8];
        out += '"';
        for (unsigned char c : s) {
                switch (c) {
                case '"': out += "\\\""; break;
                case '\\': out += "\\\\"; break;
                case '\n': out += "\\n"; break;
                case '\r': out += "\\r"; break;
                case '\t': out += "\\t"; break;
                default:
                        if (c < 0x20 || c == 0x7f) {
                                std::snprintf(buf, sizeof(buf), "\\x%02x", c);
                                out += buf;
                        } else {
                                out += static_cast<char>(c);
                        }
                }
        }
        out += '"';
}

// A choice list (JSON array of strings) as the grammar vLLM builds for it:
// root ::= "a" | "b" | ...  Throws std::invalid_argument for anything else.
static std::string choice_ebnf(const std::string &text) {
        picojson::value v;
        std::string perr = picojson::parse(v, text);
        if (!perr.empty() || !v.is<picojson::array>())
                throw std::invalid_argument("choice must be a JSON array of strings");
        const picojson::array &a = v.get<picojson::array>();
        if (a.empty())
                throw std::invalid_argument("Choice list must not be empty");
        std::string out = "root ::= ";
        for (size_t i = 0; i < a.size(); i++) {
                if (!a[i].is<std::string>())
                        throw std::invalid_argument("choice must be a list of strings");
                if (i)
                        out += " | ";
                ebnf_literal(out, a[i].get<std::string>());
        }
        return out;
}

static const char *const json_object_schema = "{\"type\": \"object\"}";

extern "C" tsr_status tsr_grammar_check(const tsr_grammar_spec *spec, char *err, size_t errlen) {
        return guarded(err, errlen, [&]() {
                std::string text(spec->text ? spec->text : "", spec->text ? spec->len : 0);
                switch (spec->kind) {
                case TSR_GRAMMAR_JSON_SCHEMA:
                        (void)xgrammar::Grammar::FromJSONSchema(text, spec->any_whitespace);
                        break;
                case TSR_GRAMMAR_JSON_OBJECT:
                        break;
                case TSR_GRAMMAR_REGEX:
                        (void)xgrammar::Grammar::FromRegex(text);
                        break;
                case TSR_GRAMMAR_CHOICE:
                        (void)xgrammar::Grammar::FromEBNF(choice_ebnf(text));
                        break;
                case TSR_GRAMMAR_EBNF:
                        (void)xgrammar::Grammar::FromEBNF(text);
                        break;
                default:
                        say(err, errlen, "unknown structured output kind");
                        return TSR_E_INVAL;
                }
                return TSR_OK;
        });
}

extern "C" tsr_status tsr_grammar_detect_hf(const char *tokenizer_json, size_t len, tsr_grammar_vocab_type *type,
                                            bool *add_prefix_space) {
        try {
                std::string meta = xgrammar::TokenizerInfo::DetectMetadataFromHF(std::string(tokenizer_json, len));
                picojson::value v;
                if (!picojson::parse(v, meta).empty() || !v.is<picojson::object>())
                        return TSR_E_INVAL;
                const picojson::object &o = v.get<picojson::object>();
                auto t = o.find("vocab_type"), a = o.find("add_prefix_space");
                if (t == o.end() || !t->second.is<double>())
                        return TSR_E_INVAL;
                int k = static_cast<int>(t->second.get<double>());
                if (k < TSR_GRAMMAR_VOCAB_RAW || k > TSR_GRAMMAR_VOCAB_BYTE_LEVEL)
                        return TSR_E_INVAL;
                *type = static_cast<tsr_grammar_vocab_type>(k);
                *add_prefix_space = a != o.end() && a->second.is<bool>() && a->second.get<bool>();
                return TSR_OK;
        } catch (const std::exception &) {
                return TSR_E_INVAL;
        }
}

extern "C" tsr_status tsr_grammar_vocab_new(const char *const *tokens, size_t n_tokens, size_t vocab_size,
                                            tsr_grammar_vocab_type type, bool add_prefix_space,
                                            const uint32_t *stop_ids, size_t n_stop, int threads,
                                            tsr_grammar_vocab **ret, char *err, size_t errlen) {
        if (vocab_size < n_tokens || vocab_size > INT32_MAX) {
                say(err, errlen, "vocab_size below the tokenizer's token count");
                return TSR_E_INVAL;
        }
        return guarded(err, errlen, [&]() {
                std::vector<std::string> v(n_tokens);
                for (size_t i = 0; i < n_tokens; i++)
                        if (tokens[i])
                                v[i] = tokens[i];
                std::vector<int32_t> stops;
                for (size_t i = 0; i < n_stop; i++)
                        if (stop_ids[i] < vocab_size)
                                stops.push_back(static_cast<int32_t>(stop_ids[i]));
                xgrammar::TokenizerInfo info(v, static_cast<xgrammar::VocabType>(type), static_cast<int>(vocab_size),
                                             stops, add_prefix_space);
                // xgrammar's cache of compiled grammars: keyed by the spec and its options,
                // capped at 256 MiB (least recently used out first).
                *ret = new tsr_grammar_vocab{info, xgrammar::GrammarCompiler(info, threads > 0 ? threads : 1, true,
                                                                              256ll << 20),
                                             vocab_size};
                return TSR_OK;
        });
}

extern "C" void tsr_grammar_vocab_free(tsr_grammar_vocab **v) {
        if (v) {
                delete *v;
                *v = nullptr;
        }
}

extern "C" size_t tsr_grammar_vocab_size(const tsr_grammar_vocab *v) { return v->vocab_size; }

extern "C" tsr_status tsr_grammar_compile(tsr_grammar_vocab *v, const tsr_grammar_spec *spec,
                                          tsr_grammar_compiled **ret, char *err, size_t errlen) {
        return guarded(err, errlen, [&]() {
                std::string text(spec->text ? spec->text : "", spec->text ? spec->len : 0);
                xgrammar::GrammarCompiler &c = v->compiler;
                std::optional<xgrammar::CompiledGrammar> g;
                switch (spec->kind) {
                case TSR_GRAMMAR_JSON_SCHEMA:
                        g = c.CompileJSONSchema(text, spec->any_whitespace);
                        break;
                case TSR_GRAMMAR_JSON_OBJECT:
                        g = c.CompileJSONSchema(json_object_schema, spec->any_whitespace);
                        break;
                case TSR_GRAMMAR_REGEX:
                        g = c.CompileRegex(text);
                        break;
                case TSR_GRAMMAR_CHOICE:
                        g = c.CompileGrammar(choice_ebnf(text));
                        break;
                case TSR_GRAMMAR_EBNF:
                        g = c.CompileGrammar(text);
                        break;
                default:
                        say(err, errlen, "unknown structured output kind");
                        return TSR_E_INVAL;
                }
                *ret = new tsr_grammar_compiled{*g};
                return TSR_OK;
        });
}

extern "C" void tsr_grammar_compiled_free(tsr_grammar_compiled **g) {
        if (g) {
                delete *g;
                *g = nullptr;
        }
}

extern "C" tsr_grammar_matcher *tsr_grammar_matcher_new(const tsr_grammar_compiled *g) {
        try {
                // max_rollback_tokens -1: every step can be undone (a dropped step, a preemption).
                return new tsr_grammar_matcher{xgrammar::GrammarMatcher(g->g, std::nullopt, false, -1), 0};
        } catch (const std::exception &) {
                return nullptr;
        }
}

extern "C" void tsr_grammar_matcher_free(tsr_grammar_matcher **m) {
        if (m) {
                delete *m;
                *m = nullptr;
        }
}

extern "C" size_t tsr_grammar_mask_words(size_t vocab) { return (vocab + 31) / 32; }

extern "C" tsr_status tsr_grammar_fill_mask(tsr_grammar_matcher *m, uint32_t *mask, size_t vocab) {
        int64_t shape[1] = {static_cast<int64_t>(tsr_grammar_mask_words(vocab))};
        DLTensor t{};
        t.data = mask;
        t.device = DLDevice{kDLCPU, 0};
        t.ndim = 1;
        t.dtype = xgrammar::GetBitmaskDLType();
        t.shape = shape;
        if (m->m.IsTerminated())
                return TSR_E_INVAL;
        try {
                m->m.FillNextTokenBitmask(&t);
                return TSR_OK;
        } catch (const std::exception &) {
                return TSR_E_INVAL;
        }
}

extern "C" tsr_status tsr_grammar_accept(tsr_grammar_matcher *m, uint32_t token) {
        try {
                if (token > INT32_MAX || !m->m.AcceptToken(static_cast<int32_t>(token)))
                        return TSR_E_INVAL;
                m->n_accepted++;
                return TSR_OK;
        } catch (const std::exception &) {
                return TSR_E_INVAL;
        }
}

extern "C" size_t tsr_grammar_n_accepted(const tsr_grammar_matcher *m) { return m->n_accepted; }

extern "C" tsr_status tsr_grammar_rollback(tsr_grammar_matcher *m, size_t n) {
        if (n > m->n_accepted)
                return TSR_E_INVAL;
        if (n == 0)
                return TSR_OK;
        try {
                m->m.Rollback(static_cast<int>(n));
                m->n_accepted -= n;
                return TSR_OK;
        } catch (const std::exception &) {
                return TSR_E_INVAL;
        }
}

extern "C" bool tsr_grammar_terminated(const tsr_grammar_matcher *m) { return m->m.IsTerminated(); }

extern "C" void tsr_grammar_apply_mask(float *logits, size_t vocab, const uint32_t *mask) {
        // Most words of a constrained step are all clear or all set: whole words first.
        for (size_t w = 0; w * 32 < vocab; w++) {
                uint32_t bits = mask[w];
                size_t end = w * 32 + 32 < vocab ? w * 32 + 32 : vocab;
                if (bits == 0xffffffffu)
                        continue;
                if (bits == 0) {
                        for (size_t i = w * 32; i < end; i++)
                                logits[i] = -INFINITY;
                        continue;
                }
                for (size_t i = w * 32; i < end; i++)
                        if (!(bits >> (i % 32) & 1u))
                                logits[i] = -INFINITY;
        }
}

extern "C" bool tsr_grammar_mask_only(const uint32_t *mask, size_t vocab, const uint32_t *ids, size_t n_ids) {
        bool any = false;
        for (size_t w = 0; w * 32 < vocab; w++) {
                uint32_t bits = mask[w];
                if (w * 32 + 32 > vocab)
                        bits &= (1u << (vocab % 32)) - 1u;
                while (bits) {
                        size_t i = w * 32 + static_cast<size_t>(__builtin_ctz(bits));
                        bool listed = false;
                        for (size_t k = 0; k < n_ids && !listed; k++)
                                listed = ids[k] == i;
                        if (!listed)
                                return false;
                        any = true;
                        bits &= bits - 1;
                }
        }
        return any;
}
