/* template_int.h - private to common/template/: what the engine's files share.
 *
 * common/template.h is the interface; this header is included only by the files of
 * common/template/ (lexer.c, parser.c, value.c, methods.c, filters.c, eval.c).  Every
 * name here starts with tsr_tpl_ (TSR_TPL_ for constants).
 *
 * Covered (jinja2 3.1 semantics, as transformers configures it):
 *   - lexing: {{ }}, {% %}, {# #}, "-"/"+" whitespace control, trim_blocks,
 *     lstrip_blocks, newline normalisation and the dropped trailing newline;
 *   - statements: if/elif/else, for (tuple targets, "if" filter, else, loop.*),
 *     break/continue, set (name, namespace attribute, tuple, block set), macro with
 *     defaults and keyword arguments, generation (passthrough);
 *   - expressions: literals, arithmetic with Python int/float rules, ~, comparisons,
 *     and/or/not, in, is-tests, conditional expressions, subscripts, slices,
 *     attributes, calls of the common str/dict methods, filters;
 *   - undefined values behave like jinja2's default Undefined.
 *   - call blocks ({% call(params) m(args) %}...{% endcall %} and caller() in the macro)
 *     and filter blocks ({% filter f(args) | g %}...{% endfilter %});
 * Not covered: raw, include/import/extends/block, with, varargs/kwargs in macros,
 * %-formatting of strings, Unicode case mapping beyond ASCII, generators (map, select and
 * the like give lists, so a template that tojson's one renders where jinja2 raises).
 * An unknown filter or test is a parse error, as in jinja2, except inside if statements
 * and conditional expressions, where jinja2 3 raises only if it runs.  A string from
 * |safe or |escape is a Markup for `+` (markupsafe escapes the other operand); other
 * operations drop the mark.
 *
 * Shape: the lexer (lexer.c) turns the normalised source into one token array
 * (whitespace control is applied there, exactly where jinja2's lexer applies it), a
 * recursive descent parser (parser.c) builds an AST in the template's arena, and a
 * tree-walking evaluator (eval.c) renders it, with the values and their Python
 * semantics in value.c, str/dict/list methods in methods.c, and filters and tests in
 * filters.c.  Every render has its own arena (capped), its own output buffer (capped),
 * a step counter and a depth counter, so a hostile template ends with TSR_E_LIMIT. */
#ifndef TSR_TEMPLATE_INT_H
#define TSR_TEMPLATE_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <jansson.h>

#include "arena.h"
#include "buf.h"
#include "template.h"

#define TSR_TPL_MAX_PARSE_DEPTH 200     /* nesting of expressions and blocks */
#define TSR_TPL_MAX_EVAL_NEST 4000      /* C recursion of the evaluator, all causes */
#define TSR_TPL_MAX_RANGE 100000        /* jinja2's sandbox MAX_RANGE */
#define TSR_TPL_DEF_MAX_OUTPUT ((size_t)64 << 20)
#define TSR_TPL_DEF_MAX_MEMORY ((size_t)256 << 20)
#define TSR_TPL_DEF_MAX_STEPS 50000000ull
#define TSR_TPL_DEF_MAX_DEPTH 64u

typedef struct tsr_tpl_str {
        const char *p;
        size_t n;
} tsr_tpl_str;

/* ---------------------------------------------------------------- values */

typedef enum tsr_tpl_val_type {
        TSR_TPL_VAL_UNDEF,
        TSR_TPL_VAL_NONE,
        TSR_TPL_VAL_BOOL,
        TSR_TPL_VAL_INT,
        TSR_TPL_VAL_FLOAT,
        TSR_TPL_VAL_STR,
        TSR_TPL_VAL_LIST,        /* list or tuple (tsr_tpl_list.tuple) */
        TSR_TPL_VAL_DICT,
        TSR_TPL_VAL_NS,          /* namespace(): a dict with attribute assignment */
        TSR_TPL_VAL_MACRO,
        TSR_TPL_VAL_BUILTIN,     /* a global function */
        TSR_TPL_VAL_METHOD,      /* bound method: obj.name, called later */
        TSR_TPL_VAL_LOOP,
} tsr_tpl_val_type;

typedef struct tsr_tpl_list tsr_tpl_list;
typedef struct tsr_tpl_dict tsr_tpl_dict;
typedef struct tsr_tpl_node tsr_tpl_node;
typedef struct tsr_tpl_frame tsr_tpl_frame;
typedef struct tsr_tpl_loop tsr_tpl_loop;
typedef struct tsr_tpl_val tsr_tpl_val;

struct tsr_tpl_val {
        uint8_t type;
        uint8_t markup;         /* TSR_TPL_VAL_STR: a markupsafe.Markup (from |safe or |escape) */
        union {
                bool b;
                int64_t i;
                double f;
                tsr_tpl_str s;
                tsr_tpl_list *l;
                tsr_tpl_dict *d;
                struct {
                        const tsr_tpl_node *n;
                        tsr_tpl_frame *f;
                } m;
                int builtin;
                struct {
                        tsr_tpl_val *self;
                        const char *name;
                } meth;
                tsr_tpl_loop *loop;
        } u;
};

struct tsr_tpl_list {
        tsr_tpl_val *v;
        size_t n, cap;
        bool tuple;
        bool gen;               /* a generator in jinja2 (map, select...): true even when empty,
                                 * no len(), not JSON; |list and the like copy it to a list */
};

struct tsr_tpl_dict {
        tsr_tpl_val *k;
        tsr_tpl_val *v;
        size_t n, cap;
};

struct tsr_tpl_loop {
        tsr_tpl_list *items;
        size_t index0;
        int depth;
};

static const tsr_tpl_val TSR_TPL_VAL_UNDEFINED = {.type = TSR_TPL_VAL_UNDEF};

static inline tsr_tpl_val tsr_tpl_val_none(void) {
        tsr_tpl_val v = {.type = TSR_TPL_VAL_NONE};
        return v;
}
static inline tsr_tpl_val tsr_tpl_val_bool(bool b) {
        tsr_tpl_val v = {.type = TSR_TPL_VAL_BOOL};
        v.u.b = b;
        return v;
}
static inline tsr_tpl_val tsr_tpl_val_int(int64_t i) {
        tsr_tpl_val v = {.type = TSR_TPL_VAL_INT};
        v.u.i = i;
        return v;
}
static inline tsr_tpl_val tsr_tpl_val_float(double f) {
        tsr_tpl_val v = {.type = TSR_TPL_VAL_FLOAT};
        v.u.f = f;
        return v;
}
static inline tsr_tpl_val tsr_tpl_val_str(const char *p, size_t n) {
        tsr_tpl_val v = {.type = TSR_TPL_VAL_STR};
        v.u.s.p = p;
        v.u.s.n = n;
        return v;
}
static inline tsr_tpl_val tsr_tpl_val_cstr(const char *p) { return tsr_tpl_val_str(p, strlen(p)); }

/* ---------------------------------------------------------------- AST */

typedef enum tsr_tpl_nkind {
        TSR_TPL_N_TEXT,
        TSR_TPL_N_OUTPUT,
        TSR_TPL_N_IF,
        TSR_TPL_N_FOR,
        TSR_TPL_N_SET,
        TSR_TPL_N_SETBLOCK,
        TSR_TPL_N_MACRO,        /* op: the body names `caller` (jinja2 then passes one) */
        TSR_TPL_N_FILTERBLOCK,  /* c: filter chain (innermost operand NULL), b: body */
        TSR_TPL_N_CALLBLOCK,    /* a: the call, b: the caller's body, names/kids: its parameters */
        TSR_TPL_N_BREAK,
        TSR_TPL_N_CONTINUE,
        TSR_TPL_N_BODY,
        TSR_TPL_N_CONST,
        TSR_TPL_N_NAME,
        TSR_TPL_N_GETATTR,
        TSR_TPL_N_GETITEM,
        TSR_TPL_N_SLICE,
        TSR_TPL_N_CALL,
        TSR_TPL_N_FILTER,
        TSR_TPL_N_TEST,
        TSR_TPL_N_NEG,
        TSR_TPL_N_POS,
        TSR_TPL_N_NOT,
        TSR_TPL_N_BIN,
        TSR_TPL_N_CMP,
        TSR_TPL_N_AND,
        TSR_TPL_N_OR,
        TSR_TPL_N_COND,
        TSR_TPL_N_LIST,
        TSR_TPL_N_TUPLE,
        TSR_TPL_N_DICT,
} tsr_tpl_nkind;

/* Comparison operators of TSR_TPL_N_CMP (and the tests that share them). */
enum {
        TSR_TPL_CMP_EQ,
        TSR_TPL_CMP_NE,
        TSR_TPL_CMP_LT,
        TSR_TPL_CMP_LE,
        TSR_TPL_CMP_GT,
        TSR_TPL_CMP_GE,
        TSR_TPL_CMP_IN,
        TSR_TPL_CMP_NOTIN
};

/* Set targets */
enum { TSR_TPL_TGT_NAME, TSR_TPL_TGT_ATTR, TSR_TPL_TGT_TUPLE };

struct tsr_tpl_node {
        uint8_t kind;
        uint8_t op;             /* TSR_TPL_N_BIN operator, TSR_TPL_N_SET target kind */
        uint8_t neg;            /* TSR_TPL_N_TEST: "is not" */
        uint8_t tuple;          /* TSR_TPL_N_FOR: target written as a tuple */
        int fid;                /* filter or test id */
        uint32_t off;           /* source offset, for messages */
        tsr_tpl_str name;
        tsr_tpl_str name2;
        tsr_tpl_val val;                /* TSR_TPL_N_CONST */
        tsr_tpl_node *a, *b, *c, *d;
        tsr_tpl_node **kids;
        uint32_t nkids;
        tsr_tpl_str *names;
        uint32_t nnames;
        uint32_t nkw;           /* trailing keyword arguments among kids (names[] holds them) */
        uint8_t *ops;           /* TSR_TPL_N_CMP: one per kid */
};

struct tsr_template {
        tsr_arena *arena;
        char *src;              /* normalised source: tokens and constants point into it */
        size_t len;
        tsr_tpl_node *root;
};

static inline bool tsr_tpl_str_eq(tsr_tpl_str a, const char *b) {
        return a.n == strlen(b) && memcmp(a.p, b, a.n) == 0;
}

/* ---------------------------------------------------------------- lexer */

typedef enum tsr_tpl_ttype {
        TSR_TPL_K_DATA,
        TSR_TPL_K_VAR_BEGIN,
        TSR_TPL_K_VAR_END,
        TSR_TPL_K_BLOCK_BEGIN,
        TSR_TPL_K_BLOCK_END,
        TSR_TPL_K_NAME,
        TSR_TPL_K_STRING,
        TSR_TPL_K_INT,
        TSR_TPL_K_FLOAT,
        TSR_TPL_K_OP,
        TSR_TPL_K_EOF,
} tsr_tpl_ttype;

typedef struct tsr_tpl_token {
        uint8_t type;
        uint32_t off;
        tsr_tpl_str s;                 /* NAME/OP: the text; STRING/DATA: the value */
        int64_t i;
        double f;
} tsr_tpl_token;

typedef struct tsr_tpl_parser {
        tsr_arena *a;
        const char *src;
        size_t len;
        tsr_tpl_token *toks;
        size_t ntoks, cap, pos;
        int depth;
        tsr_status st;
        char *err;
        size_t errlen;
        bool failed;
        bool saw_caller;        /* a name `caller` was parsed (in the current macro body) */
        /* jinja2 3 fails at compile time on an unknown filter or test only outside if
         * statements and conditional expressions ("soft" frames; a loop, macro, call,
         * filter or set block body is hard again); inside, only when it runs.  Unknown
         * ones are parsed with fid -1 and judged when the template is complete. */
        bool soft;
        struct {
                const tsr_tpl_node *n;
                bool soft;
        } unknown[32];
        size_t n_unknown;
} tsr_tpl_parser;

/* ---------------------------------------------------------------- render state */

struct tsr_tpl_frame {
        tsr_tpl_frame *parent;
        tsr_tpl_str *names;
        tsr_tpl_val *vals;
        size_t n, cap;
};

typedef struct tsr_tpl_sb {
        char *p;
        size_t n, cap;
} tsr_tpl_sb;

typedef struct tsr_tpl_rctx {
        tsr_arena *a;
        const tsr_template_opts *o;
        tsr_buf *out;           /* top-level output */
        tsr_tpl_sb *cap;        /* non-NULL while a macro or block set captures output */
        size_t max_output;
        uint64_t steps, max_steps;
        uint32_t depth, max_depth;
        uint32_t nest;
        tsr_tpl_dict *vars;            /* the JSON context */
        tsr_tpl_frame *root;
        tsr_status st;
        bool failed;
        char *err;
        size_t errlen;
} tsr_tpl_rctx;

/* The global functions (u.builtin of a TSR_TPL_VAL_BUILTIN), in the order of
 * builtin_names in value.c. */
enum { TSR_TPL_B_RANGE, TSR_TPL_B_NAMESPACE, TSR_TPL_B_DICT, TSR_TPL_B_RAISE, TSR_TPL_B_STRFTIME };

typedef struct tsr_tpl_args {
        tsr_tpl_val *pos;
        size_t npos;
        tsr_tpl_val *kw;
        const tsr_tpl_str *kwn;
        size_t nkw;
        tsr_tpl_val caller;             /* a call block's body (TSR_TPL_VAL_MACRO), or TSR_TPL_VAL_UNDEF */
} tsr_tpl_args;

typedef struct tsr_tpl_jopt {
        bool ensure_ascii;
        bool indent;            /* indent given (not None) */
        tsr_tpl_str ind;
        tsr_tpl_str item_sep, key_sep;
        bool sort_keys;
} tsr_tpl_jopt;

/* ---------------------------------------------------------------- value.c */

/* UTF-8 and Python whitespace over byte ranges.  tsr_tpl_utf8_next decodes invalid bytes
 * as themselves (Latin-1), so it never skips a byte or reads past n. */
uint32_t tsr_tpl_utf8_next(const char *s, size_t n, size_t *i);
size_t tsr_tpl_utf8_put(char *out, uint32_t c);
size_t tsr_tpl_utf8_len(const char *s, size_t n);
bool tsr_tpl_py_isspace(uint32_t c);
size_t tsr_tpl_rstrip_ws_len(const char *s, size_t n);
size_t tsr_tpl_lstrip_ws_len(const char *s, size_t n);

/* Render errors.  The first error wins: it sets c->failed, c->st and the message, and
 * later calls return c->st unchanged, so a caller may simply return what it got.
 * tsr_tpl_ralloc returns NULL with the error set (TSR_E_LIMIT past max_memory, else
 * TSR_E_NOMEM); the bool helpers below fail the same way, and their callers return
 * c->st.  tsr_tpl_step counts evaluation work against max_steps; tsr_tpl_nest_in counts
 * C recursion against TSR_TPL_MAX_EVAL_NEST (the caller decrements c->nest). */
tsr_status tsr_tpl_rerr(tsr_tpl_rctx *c, tsr_status st, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));
tsr_status tsr_tpl_oom(tsr_tpl_rctx *c);
void *tsr_tpl_ralloc(tsr_tpl_rctx *c, size_t n);
tsr_status tsr_tpl_step(tsr_tpl_rctx *c, uint64_t k);
tsr_status tsr_tpl_nest_in(tsr_tpl_rctx *c);

/* String building in the render arena, and output: tsr_tpl_emit writes to the capture
 * buffer while a macro or block set captures, else to the capped output. */
bool tsr_tpl_sb_add(tsr_tpl_rctx *c, tsr_tpl_sb *b, const char *s, size_t n);
bool tsr_tpl_sb_adds(tsr_tpl_rctx *c, tsr_tpl_sb *b, const char *s);
static inline bool tsr_tpl_sb_addc(tsr_tpl_rctx *c, tsr_tpl_sb *b, char ch) { return tsr_tpl_sb_add(c, b, &ch, 1); }
static inline tsr_tpl_val tsr_tpl_sb_val(tsr_tpl_sb *b) { return tsr_tpl_val_str(b->p ? b->p : "", b->n); }
tsr_status tsr_tpl_emit(tsr_tpl_rctx *c, const char *s, size_t n);

/* Lists, dicts (insertion-ordered, linear lookup) and variable frames, all in the arena. */
tsr_tpl_list *tsr_tpl_list_new(tsr_tpl_rctx *c, size_t cap);
bool tsr_tpl_list_push(tsr_tpl_rctx *c, tsr_tpl_list *l, tsr_tpl_val v);
static inline tsr_tpl_val tsr_tpl_val_list(tsr_tpl_list *l) {
        tsr_tpl_val v = {.type = TSR_TPL_VAL_LIST};
        v.u.l = l;
        return v;
}
static inline tsr_tpl_val tsr_tpl_val_dict(tsr_tpl_dict *d) {
        tsr_tpl_val v = {.type = TSR_TPL_VAL_DICT};
        v.u.d = d;
        return v;
}
tsr_tpl_dict *tsr_tpl_dict_new(tsr_tpl_rctx *c);
tsr_tpl_val *tsr_tpl_dict_find(tsr_tpl_rctx *c, const tsr_tpl_dict *d, tsr_tpl_val key);
tsr_tpl_val *tsr_tpl_dict_finds(const tsr_tpl_dict *d, const char *key, size_t n);
bool tsr_tpl_dict_set(tsr_tpl_rctx *c, tsr_tpl_dict *d, tsr_tpl_val key, tsr_tpl_val val);
bool tsr_tpl_frame_set(tsr_tpl_rctx *c, tsr_tpl_frame *f, tsr_tpl_str name, tsr_tpl_val val);
tsr_tpl_frame *tsr_tpl_frame_new(tsr_tpl_rctx *c, tsr_tpl_frame *parent);
tsr_tpl_val tsr_tpl_lookup(tsr_tpl_rctx *c, const tsr_tpl_frame *f, tsr_tpl_str name);

/* Python semantics of values: type names for messages, truth, ==, ordering. */
const char *tsr_tpl_type_name(tsr_tpl_val v);
tsr_status tsr_tpl_undef_err(tsr_tpl_rctx *c, tsr_tpl_val u);
bool tsr_tpl_truthy(tsr_tpl_val v);
bool tsr_tpl_is_num(tsr_tpl_val v);
static inline bool tsr_tpl_is_intlike(tsr_tpl_val v) { return v.type == TSR_TPL_VAL_BOOL || v.type == TSR_TPL_VAL_INT; }
static inline int64_t tsr_tpl_as_int(tsr_tpl_val v) { return v.type == TSR_TPL_VAL_BOOL ? (int64_t)v.u.b : v.u.i; }
static inline double tsr_tpl_as_dbl(tsr_tpl_val v) {
        return v.type == TSR_TPL_VAL_FLOAT ? v.u.f : (double)tsr_tpl_as_int(v);
}
bool tsr_tpl_val_eq(tsr_tpl_rctx *c, tsr_tpl_val a, tsr_tpl_val b);
tsr_status tsr_tpl_val_cmp(tsr_tpl_rctx *c, tsr_tpl_val a, tsr_tpl_val b, const char *op, int *r);

/* str(), repr(), tojson and the JSON context. */
bool tsr_tpl_repr_append(tsr_tpl_rctx *c, tsr_tpl_sb *b, tsr_tpl_val v);
bool tsr_tpl_str_append(tsr_tpl_rctx *c, tsr_tpl_sb *b, tsr_tpl_val v);
tsr_status tsr_tpl_to_str(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_str *out);
bool tsr_tpl_json_dump(tsr_tpl_rctx *c, tsr_tpl_sb *b, tsr_tpl_val v, const tsr_tpl_jopt *o, int level);
tsr_status tsr_tpl_from_json(tsr_tpl_rctx *c, const json_t *j, tsr_tpl_val *out, int depth);

/* Sorting (a stable merge sort, counted in steps) and the string operations filters and
 * methods share. */
int tsr_tpl_cmp_keys(tsr_tpl_rctx *c, tsr_tpl_val a, tsr_tpl_val b);
tsr_status tsr_tpl_sort_tv(tsr_tpl_rctx *c, tsr_tpl_val *v, size_t n,
                           int (*cmp)(tsr_tpl_rctx *, tsr_tpl_val, tsr_tpl_val, void *), void *u);
tsr_tpl_val tsr_tpl_str_dup(tsr_tpl_rctx *c, const char *p, size_t n);
tsr_tpl_val tsr_tpl_str_map(tsr_tpl_rctx *c, tsr_tpl_str s, int mode);
tsr_tpl_val tsr_tpl_jinja_title(tsr_tpl_rctx *c, tsr_tpl_str s);
tsr_tpl_str tsr_tpl_str_strip(tsr_tpl_str s, const tsr_tpl_str *chars, char which);
const char *tsr_tpl_memmem_s(tsr_tpl_str hay, size_t from, tsr_tpl_str needle);
tsr_status tsr_tpl_str_replace(tsr_tpl_rctx *c, tsr_tpl_str s, tsr_tpl_str old, tsr_tpl_str new_, int64_t count,
                               tsr_tpl_val *out);
tsr_status tsr_tpl_str_split(tsr_tpl_rctx *c, tsr_tpl_str s, const tsr_tpl_str *sep, int64_t maxsplit,
                             tsr_tpl_val *out);

/* Attribute and item access, slices, iteration, and call arguments (positional index i,
 * or keyword `name`). */
extern const char *const tsr_tpl_dict_methods[];
const char *tsr_tpl_find_name(const char *const *tab, tsr_tpl_str name);
tsr_tpl_val tsr_tpl_make_method(tsr_tpl_rctx *c, tsr_tpl_val self, const char *name);
tsr_tpl_val tsr_tpl_undef_named(tsr_tpl_str name);
tsr_status tsr_tpl_get_attr(tsr_tpl_rctx *c, tsr_tpl_val obj, tsr_tpl_str name, tsr_tpl_val *out);
tsr_status tsr_tpl_do_slice(tsr_tpl_rctx *c, tsr_tpl_val obj, tsr_tpl_val lo, tsr_tpl_val hi, tsr_tpl_val stp,
                            tsr_tpl_val *out);
tsr_status tsr_tpl_get_item(tsr_tpl_rctx *c, tsr_tpl_val obj, tsr_tpl_val key, tsr_tpl_val *out);
tsr_status tsr_tpl_iter_list(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_list **out);
tsr_status tsr_tpl_dict_items(tsr_tpl_rctx *c, tsr_tpl_dict *d, tsr_tpl_val *out);
bool tsr_tpl_arg_get(const tsr_tpl_args *a, size_t i, const char *name, tsr_tpl_val *out);
tsr_status tsr_tpl_arg_str(tsr_tpl_rctx *c, const tsr_tpl_args *a, size_t i, const char *name, const char *what,
                           tsr_tpl_str *out, bool *given);
tsr_status tsr_tpl_arg_int(tsr_tpl_rctx *c, const tsr_tpl_args *a, size_t i, const char *name, int64_t def,
                           int64_t *out);

/* ---------------------------------------------------------------- lexer.c */

/* Parse errors: "line L, column C: ..." into p->err, first error wins (p->failed). */
tsr_status tsr_tpl_perr(tsr_tpl_parser *p, size_t off, tsr_status st, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));
tsr_status tsr_tpl_push_tok(tsr_tpl_parser *p, tsr_tpl_token t);
bool tsr_tpl_is_ascii_ws(char c);
/* Tokenise p->src, which tsr_template_parse has normalised (newlines, trailing newline),
 * into p->toks; tsr_template_parse then appends the TSR_TPL_K_EOF token. */
tsr_status tsr_tpl_lex(tsr_tpl_parser *p);

/* ---------------------------------------------------------------- methods.c */

/* obj.m(args) for the methods get_attr hands out (tsr_tpl_make_method); anything else is
 * TSR_E_UNSUPPORTED. */
tsr_status tsr_tpl_call_str_method(tsr_tpl_rctx *c, tsr_tpl_str s, const char *m, const tsr_tpl_args *a,
                                   tsr_tpl_val *out);
tsr_status tsr_tpl_call_method(tsr_tpl_rctx *c, tsr_tpl_val self, const char *m, const tsr_tpl_args *a,
                               tsr_tpl_val *out);

/* ---------------------------------------------------------------- filters.c */

/* Filters and tests are checked at parse time, as jinja2 does ("No filter named ..."):
 * the parser stores the index _find returns (-1 for an unknown one, judged later) in
 * node.fid, and the evaluator passes it back to _run. */
int tsr_tpl_filter_find(tsr_tpl_str name);
tsr_status tsr_tpl_filter_run(tsr_tpl_rctx *c, int fid, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out);
int tsr_tpl_test_find(tsr_tpl_str name);
tsr_status tsr_tpl_test_run(tsr_tpl_rctx *c, int id, tsr_tpl_val v, const tsr_tpl_args *a, bool *out);
/* |escape, also for Markup + str; `in` of a test and of the operator */
tsr_status tsr_tpl_filter_escape(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out);
tsr_status tsr_tpl_test_in(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out);
tsr_status tsr_tpl_copy_list(tsr_tpl_rctx *c, tsr_tpl_list *src, tsr_tpl_list **out);

#endif
