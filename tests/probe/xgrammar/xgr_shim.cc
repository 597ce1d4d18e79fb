// xgr_shim.cc - xgrammar behind the C functions of xgr_shim.h.  Every C++ exception
// stops here and becomes a NULL / 0 and a message: nothing unwinds into C.
#include "xgr_shim.h"

#include <dlpack/dlpack.h>
#include <xgrammar/xgrammar.h>

#include <cstdio>
#include <exception>
#include <optional>
#include <string>
#include <vector>

struct tsr_xgr_compiler {
        xgrammar::TokenizerInfo info;
        xgrammar::GrammarCompiler compiler;
};
struct tsr_xgr_grammar {
        xgrammar::CompiledGrammar g;
};
struct tsr_xgr_matcher {
        xgrammar::GrammarMatcher m;
};

static void say(char *err, size_t errlen, const char *what) {
        if (err && errlen)
                std::snprintf(err, errlen, "%s", what);
}

extern "C" tsr_xgr_compiler *tsr_xgr_compiler_new(const char *const *vocab, int n_vocab, int vocab_type,
                                                  const int32_t *stop_ids, int n_stop, int threads, char *err,
                                                  size_t errlen) {
        try {
                std::vector<std::string> v(vocab, vocab + n_vocab);
                std::vector<int32_t> stops(stop_ids, stop_ids + n_stop);
                xgrammar::TokenizerInfo info(v, static_cast<xgrammar::VocabType>(vocab_type), n_vocab, stops, false);
                return new tsr_xgr_compiler{info, xgrammar::GrammarCompiler(info, threads, true, -1)};
        } catch (const std::exception &e) {
                say(err, errlen, e.what());
                return nullptr;
        }
}

extern "C" void tsr_xgr_compiler_free(tsr_xgr_compiler *c) { delete c; }

extern "C" tsr_xgr_grammar *tsr_xgr_compile_json_schema(tsr_xgr_compiler *c, const char *schema, char *err,
                                                       size_t errlen) {
        try {
                return new tsr_xgr_grammar{c->compiler.CompileJSONSchema(schema, false, std::nullopt, std::nullopt, true)};
        } catch (const std::exception &e) {
                say(err, errlen, e.what());
                return nullptr;
        }
}

extern "C" void tsr_xgr_grammar_free(tsr_xgr_grammar *g) { delete g; }

extern "C" tsr_xgr_matcher *tsr_xgr_matcher_new(const tsr_xgr_grammar *g) {
        try {
                return new tsr_xgr_matcher{xgrammar::GrammarMatcher(g->g)};
        } catch (const std::exception &) {
                return nullptr;
        }
}

extern "C" void tsr_xgr_matcher_free(tsr_xgr_matcher *m) { delete m; }

extern "C" int tsr_xgr_bitmask_words(int n_vocab) { return xgrammar::GetBitmaskSize(n_vocab); }

extern "C" int tsr_xgr_fill_bitmask(tsr_xgr_matcher *m, int32_t *mask, int n_vocab) {
        int64_t shape[1] = {xgrammar::GetBitmaskSize(n_vocab)};
        DLTensor t{};
        t.data = mask;
        t.device = DLDevice{kDLCPU, 0};
        t.ndim = 1;
        t.dtype = xgrammar::GetBitmaskDLType();
        t.shape = shape;
        t.strides = nullptr;
        t.byte_offset = 0;
        try {
                return m->m.FillNextTokenBitmask(&t) ? 1 : 0;
        } catch (const std::exception &) {
                return 0;
        }
}

extern "C" int tsr_xgr_accept(tsr_xgr_matcher *m, int32_t token) {
        try {
                return m->m.AcceptToken(token) ? 1 : 0;
        } catch (const std::exception &) {
                return 0;
        }
}

extern "C" int tsr_xgr_terminated(const tsr_xgr_matcher *m) { return m->m.IsTerminated() ? 1 : 0; }
