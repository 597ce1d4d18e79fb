/* template.c - a Jinja2 subset interpreter for chat templates.
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
 * Shape: the lexer turns the normalised source into one token array (whitespace
 * control is applied there, exactly where jinja2's lexer applies it), a recursive
 * descent parser builds an AST in the template's arena, and a tree-walking evaluator
 * renders it.  Every render has its own arena (capped), its own output buffer (capped),
 * a step counter and a depth counter, so a hostile template ends with TSR_E_LIMIT. */
#include "template.h"

#include <assert.h>
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arena.h"
#include "buf.h"

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

static tsr_tpl_val tsr_tpl_val_none(void) { tsr_tpl_val v = {.type = TSR_TPL_VAL_NONE}; return v; }
static tsr_tpl_val tsr_tpl_val_bool(bool b) { tsr_tpl_val v = {.type = TSR_TPL_VAL_BOOL}; v.u.b = b; return v; }
static tsr_tpl_val tsr_tpl_val_int(int64_t i) { tsr_tpl_val v = {.type = TSR_TPL_VAL_INT}; v.u.i = i; return v; }
static tsr_tpl_val tsr_tpl_val_float(double f) { tsr_tpl_val v = {.type = TSR_TPL_VAL_FLOAT}; v.u.f = f; return v; }
static tsr_tpl_val tsr_tpl_val_str(const char *p, size_t n) {
        tsr_tpl_val v = {.type = TSR_TPL_VAL_STR};
        v.u.s.p = p;
        v.u.s.n = n;
        return v;
}
static tsr_tpl_val tsr_tpl_val_cstr(const char *p) { return tsr_tpl_val_str(p, strlen(p)); }

/* ---------------------------------------------------------------- UTF-8 helpers */

/* Decode one code point at s[*i] (n bytes in all) and advance; invalid bytes decode as
 * themselves (Latin-1) so nothing is ever skipped or read past n. */
static uint32_t tsr_tpl_utf8_next(const char *s, size_t n, size_t *i) {
        const unsigned char *p = (const unsigned char *)s + *i;
        size_t left = n - *i;
        uint32_t c = p[0];

        if (c < 0x80 || left < 2) {
                (*i)++;
                return c;
        }
        if ((c & 0xe0) == 0xc0 && (p[1] & 0xc0) == 0x80) {
                *i += 2;
                return ((c & 0x1f) << 6) | (p[1] & 0x3f);
        }
        if ((c & 0xf0) == 0xe0 && left >= 3 && (p[1] & 0xc0) == 0x80 && (p[2] & 0xc0) == 0x80) {
                *i += 3;
                return ((c & 0x0f) << 12) | ((uint32_t)(p[1] & 0x3f) << 6) | (p[2] & 0x3f);
        }
        if ((c & 0xf8) == 0xf0 && left >= 4 && (p[1] & 0xc0) == 0x80 && (p[2] & 0xc0) == 0x80 &&
            (p[3] & 0xc0) == 0x80) {
                *i += 4;
                return ((c & 0x07) << 18) | ((uint32_t)(p[1] & 0x3f) << 12) | ((uint32_t)(p[2] & 0x3f) << 6) |
                       (p[3] & 0x3f);
        }
        (*i)++;
        return c;
}

static size_t tsr_tpl_utf8_put(char *out, uint32_t c) {
        if (c < 0x80) {
                out[0] = (char)c;
                return 1;
        }
        if (c < 0x800) {
                out[0] = (char)(0xc0 | (c >> 6));
                out[1] = (char)(0x80 | (c & 0x3f));
                return 2;
        }
        if (c < 0x10000) {
                out[0] = (char)(0xe0 | (c >> 12));
                out[1] = (char)(0x80 | ((c >> 6) & 0x3f));
                out[2] = (char)(0x80 | (c & 0x3f));
                return 3;
        }
        out[0] = (char)(0xf0 | (c >> 18));
        out[1] = (char)(0x80 | ((c >> 12) & 0x3f));
        out[2] = (char)(0x80 | ((c >> 6) & 0x3f));
        out[3] = (char)(0x80 | (c & 0x3f));
        return 4;
}

static size_t tsr_tpl_utf8_len(const char *s, size_t n) {
        size_t i = 0, k = 0;
        while (i < n) {
                tsr_tpl_utf8_next(s, n, &i);
                k++;
        }
        return k;
}

/* Python's str.isspace(), which str.strip() and str.split() use. */
static bool tsr_tpl_py_isspace(uint32_t c) {
        if (c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f))
                return true;
        if (c < 0x85)
                return false;
        return c == 0x85 || c == 0xa0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 ||
               c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

/* Byte length of the trailing whitespace code points of s[0..n). */
static size_t tsr_tpl_rstrip_ws_len(const char *s, size_t n) {
        size_t end = n;
        while (end > 0) {
                size_t st = end - 1, j;
                while (st > 0 && ((unsigned char)s[st] & 0xc0) == 0x80 && end - st < 4)
                        st--;
                j = st;
                if (!tsr_tpl_py_isspace(tsr_tpl_utf8_next(s, end, &j)) || j != end)
                        break;
                end = st;
        }
        return n - end;
}

static size_t tsr_tpl_lstrip_ws_len(const char *s, size_t n) {
        size_t i = 0;
        while (i < n) {
                size_t j = i;
                if (!tsr_tpl_py_isspace(tsr_tpl_utf8_next(s, n, &j)))
                        break;
                i = j;
        }
        return i;
}

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

/* Filters and tests, checked at parse time as jinja2 does ("No filter named ...").
 * Both are looked up in tables next to their functions (tsr_tpl_filter_find, tsr_tpl_test_find). */
static int tsr_tpl_filter_find(tsr_tpl_str name);

static int tsr_tpl_test_find(tsr_tpl_str name);

static bool tsr_tpl_str_eq(tsr_tpl_str a, const char *b) { return a.n == strlen(b) && memcmp(a.p, b, a.n) == 0; }

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

static void src_linecol(const char *s, size_t len, size_t off, unsigned *line, unsigned *col) {
        unsigned l = 1, c = 1;
        size_t i;
        if (off > len)
                off = len;
        for (i = 0; i < off; i++) {
                if (s[i] == '\n') {
                        l++;
                        c = 1;
                } else if (((unsigned char)s[i] & 0xc0) != 0x80) {
                        c++;
                }
        }
        *line = l;
        *col = c;
}

static tsr_status tsr_tpl_perr(tsr_tpl_parser *p, size_t off, tsr_status st, const char *fmt, ...)
        __attribute__((format(printf, 4, 5)));
static tsr_status tsr_tpl_perr(tsr_tpl_parser *p, size_t off, tsr_status st, const char *fmt, ...) {
        va_list ap;
        unsigned line, col;
        int k = 0;

        if (p->failed)
                return p->st;
        p->failed = true;
        p->st = st;
        if (!p->err || !p->errlen)
                return st;
        src_linecol(p->src, p->len, off, &line, &col);
        k = snprintf(p->err, p->errlen, "line %u, column %u: ", line, col);
        if (k >= 0 && (size_t)k < p->errlen) {
                va_start(ap, fmt);
                vsnprintf(p->err + k, p->errlen - (size_t)k, fmt, ap);
                va_end(ap);
        }
        return st;
}

static tsr_status tsr_tpl_push_tok(tsr_tpl_parser *p, tsr_tpl_token t) {
        if (p->ntoks == p->cap) {
                size_t nc = p->cap ? p->cap * 2 : 256;
                tsr_tpl_token *nt = tsr_arena_alloc(p->a, nc * sizeof(*nt));
                if (!nt)
                        return tsr_tpl_perr(p, t.off, TSR_E_NOMEM, "out of memory");
                if (p->ntoks)
                        memcpy(nt, p->toks, p->ntoks * sizeof(*nt));
                p->toks = nt;
                p->cap = nc;
        }
        p->toks[p->ntoks++] = t;
        return TSR_OK;
}

static bool tsr_tpl_is_ascii_ws(char c) {
        return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

static size_t skip_ws_re(const char *s, size_t n, size_t i) {
        /* Python's \s on str: every Unicode whitespace code point */
        while (i < n) {
                size_t j = i;
                if (!tsr_tpl_py_isspace(tsr_tpl_utf8_next(s, n, &j)))
                        break;
                i = j;
        }
        return i;
}

static int hexval(char c) {
        if (c >= '0' && c <= '9')
                return c - '0';
        if (c >= 'a' && c <= 'f')
                return c - 'a' + 10;
        if (c >= 'A' && c <= 'F')
                return c - 'A' + 10;
        return -1;
}

/* Decode a string literal body the way jinja2 does (Python's unicode-escape codec). */
static tsr_status lex_string_value(tsr_tpl_parser *p, const char *s, size_t n, size_t off, tsr_tpl_str *out) {
        char *o = tsr_arena_alloc(p->a, n + 1);
        size_t i = 0, k = 0;

        if (!o)
                return tsr_tpl_perr(p, off, TSR_E_NOMEM, "out of memory");
        while (i < n) {
                char c = s[i];
                if (c != '\\' || i + 1 >= n) {
                        o[k++] = c;
                        i++;
                        continue;
                }
                c = s[i + 1];
                i += 2;
                switch (c) {
                case '\n': break;
                case '\\': o[k++] = '\\'; break;
                case '\'': o[k++] = '\''; break;
                case '"': o[k++] = '"'; break;
                case 'a': o[k++] = '\a'; break;
                case 'b': o[k++] = '\b'; break;
                case 'f': o[k++] = '\f'; break;
                case 'n': o[k++] = '\n'; break;
                case 'r': o[k++] = '\r'; break;
                case 't': o[k++] = '\t'; break;
                case 'v': o[k++] = '\v'; break;
                case 'x': case 'u': case 'U': {
                        int want = c == 'x' ? 2 : c == 'u' ? 4 : 8, d;
                        uint32_t cp = 0;
                        for (d = 0; d < want; d++) {
                                int h = i + (size_t)d < n ? hexval(s[i + (size_t)d]) : -1;
                                if (h < 0)
                                        return tsr_tpl_perr(p, off, TSR_E_INVAL, "truncated \\%c escape in string", c);
                                cp = cp * 16 + (uint32_t)h;
                        }
                        if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
                                return tsr_tpl_perr(p, off, TSR_E_INVAL, "escape out of range in string");
                        i += (size_t)want;
                        k += tsr_tpl_utf8_put(o + k, cp);  /* at most 4 bytes from >= 4 source bytes */
                        break;
                }
                default:
                        if (c >= '0' && c <= '7') {
                                uint32_t cp = (uint32_t)(c - '0');
                                int d;
                                for (d = 0; d < 2 && i < n && s[i] >= '0' && s[i] <= '7'; d++)
                                        cp = cp * 8 + (uint32_t)(s[i++] - '0');
                                k += tsr_tpl_utf8_put(o + k, cp);
                        } else {
                                o[k++] = '\\';
                                o[k++] = c;
                        }
                }
        }
        o[k] = '\0';
        out->p = o;
        out->n = k;
        return TSR_OK;
}

static const char *const ops2[] = {"//", "**", "==", "!=", ">=", "<=", NULL};
static const char ops1[] = "+-/*%~[](){}><=.:|,;";

/* Lex the expression tokens of one tag starting at *pi, up to and including its end
 * marker; `block` says which end marker. */
static tsr_status lex_tag(tsr_tpl_parser *p, size_t *pi, bool block, bool *line_starting) {
        const char *s = p->src;
        size_t n = p->len, i = *pi;
        int depth = 0;
        char stack[TSR_TPL_MAX_PARSE_DEPTH];
        tsr_status st;
        size_t start = i;

        for (;;) {
                tsr_tpl_token t = {0};
                if (i >= n)
                        return tsr_tpl_perr(p, start, TSR_E_INVAL, "unexpected end of template, expected '%s'",
                                    block ? "%}" : "}}");
                if (depth == 0) {
                        const char *e = block ? "%}" : "}}";
                        size_t end = 0;
                        if (block && s[i] == '+' && i + 2 < n + 0 && memcmp(s + i + 1, e, 2) == 0) {
                                end = i + 3;
                        } else if (s[i] == '-' && i + 2 < n + 1 && i + 3 <= n && memcmp(s + i + 1, e, 2) == 0) {
                                end = skip_ws_re(s, n, i + 3);
                        } else if (i + 2 <= n && memcmp(s + i, e, 2) == 0) {
                                end = i + 2;
                                if (block && end < n && s[end] == '\n')
                                        end++;  /* trim_blocks */
                        }
                        if (end) {
                                t.type = block ? TSR_TPL_K_BLOCK_END : TSR_TPL_K_VAR_END;
                                t.off = (uint32_t)i;
                                if ((st = tsr_tpl_push_tok(p, t)) != TSR_OK)
                                        return st;
                                *line_starting = s[end - 1] == '\n';
                                *pi = end;
                                return TSR_OK;
                        }
                }
                if (tsr_tpl_is_ascii_ws(s[i])) {
                        i++;
                        continue;
                }
                t.off = (uint32_t)i;
                if (isdigit((unsigned char)s[i])) {
                        /* jinja2's float rule does not match right after a '.' ("x.0" is an
                         * item access), its integer rule does */
                        bool after_dot = i > 0 && s[i - 1] == '.';
                        /* float: digits (. digits)? e[+-]digits | digits . digits; else integer */
                        size_t j = i, k;
                        bool isf = false;
                        char num[64];
                        size_t m = 0;
                        while (j < n && (isdigit((unsigned char)s[j]) ||
                                         (s[j] == '_' && j + 1 < n && isdigit((unsigned char)s[j + 1]))))
                                j++;
                        k = j;
                        if (k + 1 < n && s[k] == '.' && isdigit((unsigned char)s[k + 1])) {
                                k += 1;
                                while (k < n && (isdigit((unsigned char)s[k]) ||
                                                 (s[k] == '_' && k + 1 < n && isdigit((unsigned char)s[k + 1]))))
                                        k++;
                                isf = true;
                        }
                        if (k < n && (s[k] == 'e' || s[k] == 'E')) {
                                size_t e = k + 1;
                                if (e < n && (s[e] == '+' || s[e] == '-'))
                                        e++;
                                if (e < n && isdigit((unsigned char)s[e])) {
                                        while (e < n && isdigit((unsigned char)s[e]))
                                                e++;
                                        k = e;
                                        isf = true;
                                }
                        }
                        if (!isf || after_dot)
                                k = j;
                        isf = isf && !after_dot;
                        for (j = i; j < k && m < sizeof(num) - 1; j++)
                                if (s[j] != '_')
                                        num[m++] = s[j];
                        num[m] = '\0';
                        if (k - i >= sizeof(num) - 1)
                                return tsr_tpl_perr(p, i, TSR_E_INVAL, "number literal too long");
                        if (isf) {
                                t.type = TSR_TPL_K_FLOAT;
                                t.f = strtod(num, NULL);
                        } else {
                                if (num[0] == '0' && m > 1 && num[1] != '0')
                                        return tsr_tpl_perr(p, i, TSR_E_INVAL, "invalid integer literal");
                                errno = 0;
                                t.type = TSR_TPL_K_INT;
                                t.i = strtoll(num, NULL, 10);
                                if (errno == ERANGE)
                                        return tsr_tpl_perr(p, i, TSR_E_INVAL, "integer literal too large");
                        }
                        i = k;
                } else if (isalpha((unsigned char)s[i]) || s[i] == '_') {
                        size_t j = i;
                        while (j < n && (isalnum((unsigned char)s[j]) || s[j] == '_'))
                                j++;
                        t.type = TSR_TPL_K_NAME;
                        t.s.p = s + i;
                        t.s.n = j - i;
                        i = j;
                } else if (s[i] == '\'' || s[i] == '"') {
                        char q = s[i];
                        size_t j = i + 1;
                        while (j < n && s[j] != q) {
                                if (s[j] == '\\' && j + 1 < n)
                                        j++;
                                j++;
                        }
                        if (j >= n)
                                return tsr_tpl_perr(p, i, TSR_E_INVAL, "unterminated string literal");
                        t.type = TSR_TPL_K_STRING;
                        if ((st = lex_string_value(p, s + i + 1, j - i - 1, i, &t.s)) != TSR_OK)
                                return st;
                        i = j + 1;
                } else {
                        size_t k, m = 0;
                        for (k = 0; ops2[k]; k++)
                                if (i + 2 <= n && memcmp(s + i, ops2[k], 2) == 0)
                                        m = 2;
                        if (!m && strchr(ops1, s[i]) && s[i])
                                m = 1;
                        if (!m)
                                return tsr_tpl_perr(p, i, TSR_E_INVAL, "unexpected character '%c'", s[i]);
                        t.type = TSR_TPL_K_OP;
                        t.s.p = s + i;
                        t.s.n = m;
                        if (m == 1 && (s[i] == '(' || s[i] == '[' || s[i] == '{')) {
                                if (depth >= TSR_TPL_MAX_PARSE_DEPTH)
                                        return tsr_tpl_perr(p, i, TSR_E_LIMIT, "brackets nested too deep");
                                stack[depth++] = s[i] == '(' ? ')' : s[i] == '[' ? ']' : '}';
                        } else if (m == 1 && (s[i] == ')' || s[i] == ']' || s[i] == '}')) {
                                if (depth == 0)
                                        return tsr_tpl_perr(p, i, TSR_E_INVAL, "unexpected '%c'", s[i]);
                                if (stack[depth - 1] != s[i])
                                        return tsr_tpl_perr(p, i, TSR_E_INVAL, "unexpected '%c', expected '%c'", s[i],
                                                    stack[depth - 1]);
                                depth--;
                        }
                        i += m;
                }
                if ((st = tsr_tpl_push_tok(p, t)) != TSR_OK)
                        return st;
        }
}

static tsr_status tsr_tpl_lex(tsr_tpl_parser *p) {
        const char *s = p->src;
        size_t n = p->len, pos = 0;
        bool line_starting = true;
        tsr_status st;

        while (pos < n) {
                size_t k = pos, text_end;
                char kind = 0, sign = 0;
                tsr_tpl_token t = {0};

                while (k + 1 < n && !(s[k] == '{' && (s[k + 1] == '{' || s[k + 1] == '%' || s[k + 1] == '#')))
                        k++;
                if (k + 1 >= n) {
                        t.type = TSR_TPL_K_DATA;
                        t.off = (uint32_t)pos;
                        t.s.p = s + pos;
                        t.s.n = n - pos;
                        return tsr_tpl_push_tok(p, t);
                }
                kind = s[k + 1];
                if (k + 2 < n && (s[k + 2] == '-' || s[k + 2] == '+'))
                        sign = s[k + 2];
                text_end = k;
                if (sign == '-') {
                        text_end -= tsr_tpl_rstrip_ws_len(s + pos, k - pos);
                } else if (sign != '+' && kind != '{') {
                        /* lstrip_blocks: drop spaces/tabs between the line start and the tag */
                        size_t l = k;
                        while (l > pos && s[l - 1] != '\n')
                                l--;
                        if ((l > pos || line_starting) && l < k && tsr_tpl_lstrip_ws_len(s + l, k - l) == k - l)
                                text_end = l;
                }
                if (text_end > pos) {
                        t.type = TSR_TPL_K_DATA;
                        t.off = (uint32_t)pos;
                        t.s.p = s + pos;
                        t.s.n = text_end - pos;
                        if ((st = tsr_tpl_push_tok(p, t)) != TSR_OK)
                                return st;
                }
                pos = k + 2 + (sign ? 1 : 0);
                if (kind == '#') {
                        size_t i = pos, end = 0;
                        for (; i + 1 < n; i++) {
                                if ((s[i] == '+' || s[i] == '-') && i + 2 < n && s[i + 1] == '#' && s[i + 2] == '}') {
                                        end = s[i] == '-' ? skip_ws_re(s, n, i + 3) : i + 3;
                                        break;
                                }
                                if (s[i] == '#' && s[i + 1] == '}') {
                                        end = i + 2;
                                        if (end < n && s[end] == '\n')
                                                end++;
                                        break;
                                }
                        }
                        if (!end)
                                return tsr_tpl_perr(p, k, TSR_E_INVAL, "missing end of comment tag");
                        line_starting = s[end - 1] == '\n';
                        pos = end;
                        continue;
                }
                t = (tsr_tpl_token){0};
                t.type = kind == '%' ? TSR_TPL_K_BLOCK_BEGIN : TSR_TPL_K_VAR_BEGIN;
                t.off = (uint32_t)k;
                if ((st = tsr_tpl_push_tok(p, t)) != TSR_OK)
                        return st;
                if ((st = lex_tag(p, &pos, kind == '%', &line_starting)) != TSR_OK)
                        return st;
        }
        return TSR_OK;
}

/* ---------------------------------------------------------------- parser */

static tsr_tpl_token *cur(tsr_tpl_parser *p) { return &p->toks[p->pos]; }
static tsr_tpl_token *peek(tsr_tpl_parser *p, size_t k) {
        return p->pos + k < p->ntoks ? &p->toks[p->pos + k] : &p->toks[p->ntoks - 1];
}
static bool t_op(const tsr_tpl_token *t, const char *op) {
        return t->type == TSR_TPL_K_OP && tsr_tpl_str_eq(t->s, op);
}
static bool t_name(const tsr_tpl_token *t, const char *nm) {
        return t->type == TSR_TPL_K_NAME && tsr_tpl_str_eq(t->s, nm);
}
static void adv(tsr_tpl_parser *p) {
        if (p->pos + 1 < p->ntoks)
                p->pos++;
}

static const char *tok_desc(const tsr_tpl_token *t) {
        switch (t->type) {
        case TSR_TPL_K_DATA: return "template data";
        case TSR_TPL_K_VAR_BEGIN: return "'{{'";
        case TSR_TPL_K_VAR_END: return "end of print statement";
        case TSR_TPL_K_BLOCK_BEGIN: return "'{%'";
        case TSR_TPL_K_BLOCK_END: return "end of statement block";
        case TSR_TPL_K_NAME: return "name";
        case TSR_TPL_K_STRING: return "string";
        case TSR_TPL_K_INT: return "integer";
        case TSR_TPL_K_FLOAT: return "float";
        case TSR_TPL_K_OP: return "operator";
        default: return "end of template";
        }
}

static tsr_tpl_node *mk(tsr_tpl_parser *p, tsr_tpl_nkind k, uint32_t off) {
        tsr_tpl_node *n = tsr_arena_calloc(p->a, 1, sizeof(*n));
        if (!n) {
                tsr_tpl_perr(p, off, TSR_E_NOMEM, "out of memory");
                return NULL;
        }
        n->kind = (uint8_t)k;
        n->off = off;
        return n;
}

/* Growable node-pointer vector in the arena (old copies are left behind: parse only). */
typedef struct nvec {
        tsr_tpl_node **v;
        tsr_tpl_str *names;
        uint32_t n, cap;
} nvec;

static bool nvec_push(tsr_tpl_parser *p, nvec *v, tsr_tpl_node *x, tsr_tpl_str name) {
        if (v->n == v->cap) {
                uint32_t nc = v->cap ? v->cap * 2 : 4;
                tsr_tpl_node **nv = tsr_arena_alloc(p->a, nc * sizeof(*nv));
                tsr_tpl_str *nn = tsr_arena_alloc(p->a, nc * sizeof(*nn));
                if (!nv || !nn) {
                        tsr_tpl_perr(p, cur(p)->off, TSR_E_NOMEM, "out of memory");
                        return false;
                }
                if (v->n) {
                        memcpy(nv, v->v, v->n * sizeof(*nv));
                        memcpy(nn, v->names, v->n * sizeof(*nn));
                }
                v->v = nv;
                v->names = nn;
                v->cap = nc;
        }
        v->v[v->n] = x;
        v->names[v->n] = name;
        v->n++;
        return true;
}

static bool expect_op(tsr_tpl_parser *p, const char *op) {
        if (p->failed)
                return false;
        if (!t_op(cur(p), op)) {
                tsr_tpl_perr(p, cur(p)->off, TSR_E_INVAL, "expected '%s', got %s", op, tok_desc(cur(p)));
                return false;
        }
        adv(p);
        return true;
}

static bool expect_type(tsr_tpl_parser *p, tsr_tpl_ttype ty, const char *what) {
        if (p->failed)
                return false;
        if (cur(p)->type != ty) {
                tsr_tpl_perr(p, cur(p)->off, TSR_E_INVAL, "expected %s, got %s", what, tok_desc(cur(p)));
                return false;
        }
        adv(p);
        return true;
}

static bool enter(tsr_tpl_parser *p) {
        if (p->failed)
                return false;
        if (++p->depth > TSR_TPL_MAX_PARSE_DEPTH) {
                tsr_tpl_perr(p, cur(p)->off, TSR_E_LIMIT, "template nests too deep");
                return false;
        }
        return true;
}

static tsr_tpl_node *parse_expr(tsr_tpl_parser *p, bool condexpr);
static tsr_tpl_node *parse_or(tsr_tpl_parser *p);
static tsr_tpl_node *parse_unary(tsr_tpl_parser *p, bool with_filter);
static tsr_tpl_node *parse_postfix(tsr_tpl_parser *p, tsr_tpl_node *n);
static tsr_tpl_node *parse_filter_expr(tsr_tpl_parser *p, tsr_tpl_node *n);
static tsr_tpl_node *parse_primary(tsr_tpl_parser *p);

static bool tuple_end(tsr_tpl_parser *p, const char *extra) {
        tsr_tpl_token *t = cur(p);
        if (t->type == TSR_TPL_K_VAR_END || t->type == TSR_TPL_K_BLOCK_END || t->type == TSR_TPL_K_EOF || t_op(t, ")"))
                return true;
        return extra && t_name(t, extra);
}

/* mode: 0 = full expression, 1 = no conditional expression, 2 = primary only */
static tsr_tpl_node *parse_tuple(tsr_tpl_parser *p, int mode, const char *extra_end, bool explicit_parens) {
        nvec v = {0};
        bool is_tuple = false;
        uint32_t off = cur(p)->off;
        tsr_tpl_node *n;

        for (;;) {
                tsr_tpl_node *x;
                if (v.n && !expect_op(p, ","))
                        return NULL;
                if (tuple_end(p, extra_end))
                        break;
                x = mode == 2 ? parse_primary(p) : parse_expr(p, mode == 0);
                if (!x || !nvec_push(p, &v, x, (tsr_tpl_str){0}))
                        return NULL;
                if (t_op(cur(p), ","))
                        is_tuple = true;
                else
                        break;
        }
        if (!is_tuple) {
                if (v.n)
                        return v.v[0];
                if (!explicit_parens) {
                        tsr_tpl_perr(p, cur(p)->off, TSR_E_INVAL, "expected an expression, got %s", tok_desc(cur(p)));
                        return NULL;
                }
        }
        if (!(n = mk(p, TSR_TPL_N_TUPLE, off)))
                return NULL;
        n->kids = v.v;
        n->nkids = v.n;
        return n;
}

static bool parse_call_args(tsr_tpl_parser *p, tsr_tpl_node *n) {
        nvec v = {0};
        uint32_t nkw = 0;
        bool need_comma = false;

        if (!expect_op(p, "("))
                return false;
        while (!t_op(cur(p), ")")) {
                if (need_comma) {
                        if (!expect_op(p, ","))
                                return false;
                        if (t_op(cur(p), ")"))
                                break;
                }
                if (t_op(cur(p), "*") || t_op(cur(p), "**")) {
                        tsr_tpl_perr(p, cur(p)->off, TSR_E_INVAL, "*args and **kwargs in calls are not supported");
                        return false;
                }
                if (cur(p)->type == TSR_TPL_K_NAME && t_op(peek(p, 1), "=")) {
                        tsr_tpl_str key = cur(p)->s;
                        tsr_tpl_node *x;
                        adv(p);
                        adv(p);
                        if (!(x = parse_expr(p, true)) || !nvec_push(p, &v, x, key))
                                return false;
                        nkw++;
                } else {
                        tsr_tpl_node *x;
                        if (nkw) {
                                tsr_tpl_perr(p, cur(p)->off, TSR_E_INVAL,
                                             "positional argument follows keyword argument");
                                return false;
                        }
                        if (!(x = parse_expr(p, true)) || !nvec_push(p, &v, x, (tsr_tpl_str){0}))
                                return false;
                }
                need_comma = true;
        }
        if (!expect_op(p, ")"))
                return false;
        n->kids = v.v;
        n->nkids = v.n;
        n->nkw = nkw;
        n->names = v.names ? v.names + (v.n - nkw) : NULL;
        n->nnames = nkw;
        return true;
}

static bool dotted_name(tsr_tpl_parser *p, tsr_tpl_str *out) {
        tsr_tpl_token *t = cur(p);
        if (t->type != TSR_TPL_K_NAME) {
                tsr_tpl_perr(p, t->off, TSR_E_INVAL, "expected a name, got %s", tok_desc(t));
                return false;
        }
        *out = t->s;
        adv(p);
        return true;
}

/* An unknown filter or test: an error now in a hard frame, else remembered (see parser). */
static bool note_unknown(tsr_tpl_parser *p, const tsr_tpl_node *n, const char *what) {
        if (p->n_unknown == sizeof(p->unknown) / sizeof(p->unknown[0])) {
                tsr_tpl_perr(p, n->off, TSR_E_INVAL, "no %s named '%.*s'", what, (int)n->name.n, n->name.p);
                return false;
        }
        p->unknown[p->n_unknown].n = n;
        p->unknown[p->n_unknown++].soft = p->soft;
        return true;
}

/* After the whole template: the unknown filters and tests outside soft frames. */
static void judge_unknown(tsr_tpl_parser *p) {
        size_t k;

        for (k = 0; k < p->n_unknown && !p->failed; k++)
                if (!p->unknown[k].soft)
                        tsr_tpl_perr(p, p->unknown[k].n->off, TSR_E_INVAL, "no %s named '%.*s'",
                             p->unknown[k].n->kind == TSR_TPL_N_TEST ? "test" : "filter", (int)p->unknown[k].n->name.n,
                             p->unknown[k].n->name.p);
}

/* One filter, its name at the current token: NAME or NAME(args), applied to `operand`. */
static tsr_tpl_node *parse_one_filter(tsr_tpl_parser *p, tsr_tpl_node *operand) {
        tsr_tpl_node *n = mk(p, TSR_TPL_N_FILTER, cur(p)->off);

        if (!n || !dotted_name(p, &n->name))
                return NULL;
        n->fid = tsr_tpl_filter_find(n->name);
        if (n->fid < 0 && !note_unknown(p, n, "filter"))
                return NULL;
        if (t_op(cur(p), "(") && !parse_call_args(p, n))
                return NULL;
        n->a = operand;
        return n;
}

static tsr_tpl_node *parse_filter(tsr_tpl_parser *p, tsr_tpl_node *operand) {
        while (t_op(cur(p), "|")) {
                adv(p);
                if (!(operand = parse_one_filter(p, operand)))
                        return NULL;
        }
        return operand;
}

static tsr_tpl_node *parse_test(tsr_tpl_parser *p, tsr_tpl_node *operand) {
        tsr_tpl_node *n = mk(p, TSR_TPL_N_TEST, cur(p)->off);
        tsr_tpl_token *t;

        if (!n)
                return NULL;
        adv(p);         /* is */
        if (t_name(cur(p), "not")) {
                n->neg = 1;
                adv(p);
        }
        n->off = cur(p)->off;
        if (!dotted_name(p, &n->name))
                return NULL;
        n->fid = tsr_tpl_test_find(n->name);
        if (n->fid < 0 && !note_unknown(p, n, "test"))
                return NULL;
        t = cur(p);
        if (t_op(t, "(")) {
                if (!parse_call_args(p, n))
                        return NULL;
        } else if ((t->type == TSR_TPL_K_NAME || t->type == TSR_TPL_K_STRING || t->type == TSR_TPL_K_INT ||
                    t->type == TSR_TPL_K_FLOAT || t_op(t, "[") || t_op(t, "{")) &&
                   !t_name(t, "else") && !t_name(t, "or") && !t_name(t, "and")) {
                tsr_tpl_node *arg;
                if (t_name(t, "is")) {
                        tsr_tpl_perr(p, t->off, TSR_E_INVAL, "cannot chain multiple tests with 'is'");
                        return NULL;
                }
                if (!(arg = parse_primary(p)) || !(arg = parse_postfix(p, arg)))
                        return NULL;
                if (!(n->kids = tsr_arena_alloc(p->a, sizeof(tsr_tpl_node *))))
                        return NULL;
                n->kids[0] = arg;
                n->nkids = 1;
        }
        n->a = operand;
        return n;
}

static tsr_tpl_node *parse_subscripted(tsr_tpl_parser *p) {
        tsr_tpl_node *sl, *parts[3] = {NULL, NULL, NULL};
        uint32_t off = cur(p)->off;

        if (t_op(cur(p), ":")) {
                adv(p);
        } else {
                tsr_tpl_node *x = parse_expr(p, true);
                if (!x || !t_op(cur(p), ":"))
                        return x;
                adv(p);
                parts[0] = x;
        }
        if (t_op(cur(p), ":")) {
                /* no stop */
        } else if (!t_op(cur(p), "]") && !t_op(cur(p), ",")) {
                if (!(parts[1] = parse_expr(p, true)))
                        return NULL;
        }
        if (t_op(cur(p), ":")) {
                adv(p);
                if (!t_op(cur(p), "]") && !t_op(cur(p), ",") && !(parts[2] = parse_expr(p, true)))
                        return NULL;
        }
        if (!(sl = mk(p, TSR_TPL_N_SLICE, off)))
                return NULL;
        sl->a = parts[0];
        sl->b = parts[1];
        sl->c = parts[2];
        return sl;
}

static tsr_tpl_node *parse_postfix(tsr_tpl_parser *p, tsr_tpl_node *n) {
        while (n && !p->failed) {
                tsr_tpl_token *t = cur(p);
                if (t_op(t, ".")) {
                        tsr_tpl_node *g;
                        adv(p);
                        t = cur(p);
                        if (t->type == TSR_TPL_K_NAME) {
                                if (!(g = mk(p, TSR_TPL_N_GETATTR, t->off)))
                                        return NULL;
                                g->name = t->s;
                        } else if (t->type == TSR_TPL_K_INT) {
                                tsr_tpl_node *c;
                                if (!(g = mk(p, TSR_TPL_N_GETITEM, t->off)) || !(c = mk(p, TSR_TPL_N_CONST, t->off)))
                                        return NULL;
                                c->val = tsr_tpl_val_int(t->i);
                                g->b = c;
                        } else {
                                tsr_tpl_perr(p, t->off, TSR_E_INVAL, "expected name or number after '.'");
                                return NULL;
                        }
                        adv(p);
                        g->a = n;
                        n = g;
                } else if (t_op(t, "[")) {
                        tsr_tpl_node *g = mk(p, TSR_TPL_N_GETITEM, t->off);
                        nvec v = {0};
                        if (!g)
                                return NULL;
                        adv(p);
                        while (!t_op(cur(p), "]")) {
                                tsr_tpl_node *x;
                                if (v.n && !expect_op(p, ","))
                                        return NULL;
                                if (!(x = parse_subscripted(p)) || !nvec_push(p, &v, x, (tsr_tpl_str){0}))
                                        return NULL;
                        }
                        if (!expect_op(p, "]"))
                                return NULL;
                        if (v.n == 1) {
                                g->b = v.v[0];
                        } else {
                                tsr_tpl_node *tu;
                                /* jinja2 parses x[a, b:c] but Python cannot compile a slice
                                 * inside a tuple, so from_string fails there too: refuse it
                                 * here rather than meet a slice node where a value belongs. */
                                for (size_t i = 0; i < v.n; i++) {
                                        if (v.v[i]->kind == TSR_TPL_N_SLICE) {
                                                tsr_tpl_perr(p, v.v[i]->off, TSR_E_INVAL,
                                                     "a slice cannot be part of a subscript tuple");
                                                return NULL;
                                        }
                                }
                                if (!(tu = mk(p, TSR_TPL_N_TUPLE, g->off)))
                                        return NULL;
                                tu->kids = v.v;
                                tu->nkids = v.n;
                                g->b = tu;
                        }
                        g->a = n;
                        n = g;
                } else if (t_op(t, "(")) {
                        tsr_tpl_node *c = mk(p, TSR_TPL_N_CALL, t->off);
                        if (!c || !parse_call_args(p, c))
                                return NULL;
                        c->a = n;
                        n = c;
                } else {
                        break;
                }
        }
        return p->failed ? NULL : n;
}

static tsr_tpl_node *parse_filter_expr(tsr_tpl_parser *p, tsr_tpl_node *n) {
        while (n && !p->failed) {
                tsr_tpl_token *t = cur(p);
                if (t_op(t, "|")) {
                        n = parse_filter(p, n);
                } else if (t_name(t, "is")) {
                        n = parse_test(p, n);
                } else if (t_op(t, "(")) {
                        tsr_tpl_node *c = mk(p, TSR_TPL_N_CALL, t->off);
                        if (!c || !parse_call_args(p, c))
                                return NULL;
                        c->a = n;
                        n = c;
                } else {
                        break;
                }
        }
        return p->failed ? NULL : n;
}

static tsr_tpl_node *parse_primary(tsr_tpl_parser *p) {
        tsr_tpl_token *t = cur(p);
        tsr_tpl_node *n = NULL;

        if (!enter(p))
                return NULL;
        if (t->type == TSR_TPL_K_NAME) {
                if (!(n = mk(p, TSR_TPL_N_CONST, t->off)))
                        return NULL;
                if (tsr_tpl_str_eq(t->s, "true") || tsr_tpl_str_eq(t->s, "True"))
                        n->val = tsr_tpl_val_bool(true);
                else if (tsr_tpl_str_eq(t->s, "false") || tsr_tpl_str_eq(t->s, "False"))
                        n->val = tsr_tpl_val_bool(false);
                else if (tsr_tpl_str_eq(t->s, "none") || tsr_tpl_str_eq(t->s, "None"))
                        n->val = tsr_tpl_val_none();
                else {
                        n->kind = TSR_TPL_N_NAME;
                        n->name = t->s;
                        if (tsr_tpl_str_eq(t->s, "caller"))
                                p->saw_caller = true;
                }
                adv(p);
        } else if (t->type == TSR_TPL_K_STRING) {
                tsr_tpl_str s = t->s;
                adv(p);
                while (cur(p)->type == TSR_TPL_K_STRING) {
                        /* adjacent literals concatenate, as in Python */
                        tsr_tpl_str s2 = cur(p)->s;
                        char *c = tsr_arena_alloc(p->a, s.n + s2.n + 1);
                        if (!c) {
                                tsr_tpl_perr(p, t->off, TSR_E_NOMEM, "out of memory");
                                return NULL;
                        }
                        memcpy(c, s.p, s.n);
                        memcpy(c + s.n, s2.p, s2.n);
                        c[s.n + s2.n] = '\0';
                        s.p = c;
                        s.n += s2.n;
                        adv(p);
                }
                if (!(n = mk(p, TSR_TPL_N_CONST, t->off)))
                        return NULL;
                n->val = tsr_tpl_val_str(s.p, s.n);
        } else if (t->type == TSR_TPL_K_INT || t->type == TSR_TPL_K_FLOAT) {
                if (!(n = mk(p, TSR_TPL_N_CONST, t->off)))
                        return NULL;
                n->val = t->type == TSR_TPL_K_INT ? tsr_tpl_val_int(t->i) : tsr_tpl_val_float(t->f);
                adv(p);
        } else if (t_op(t, "(")) {
                adv(p);
                if (!(n = parse_tuple(p, 0, NULL, true)) || !expect_op(p, ")"))
                        n = NULL;
        } else if (t_op(t, "[") || t_op(t, "{")) {
                bool is_dict = t_op(t, "{");
                nvec v = {0};
                if (!(n = mk(p, is_dict ? TSR_TPL_N_DICT : TSR_TPL_N_LIST, t->off)))
                        return NULL;
                adv(p);
                while (!t_op(cur(p), is_dict ? "}" : "]")) {
                        tsr_tpl_node *x;
                        if (v.n && !expect_op(p, ","))
                                return NULL;
                        if (t_op(cur(p), is_dict ? "}" : "]"))
                                break;
                        if (!(x = parse_expr(p, true)) || !nvec_push(p, &v, x, (tsr_tpl_str){0}))
                                return NULL;
                        if (is_dict) {
                                if (!expect_op(p, ":") || !(x = parse_expr(p, true)) ||
                                    !nvec_push(p, &v, x, (tsr_tpl_str){0}))
                                        return NULL;
                        }
                }
                if (!expect_op(p, is_dict ? "}" : "]"))
                        return NULL;
                n->kids = v.v;
                n->nkids = v.n;
        } else {
                tsr_tpl_perr(p, t->off, TSR_E_INVAL, "unexpected %s", tok_desc(t));
        }
        p->depth--;
        return p->failed ? NULL : n;
}

static tsr_tpl_node *parse_unary(tsr_tpl_parser *p, bool with_filter) {
        tsr_tpl_token *t = cur(p);
        tsr_tpl_node *n;

        if (!enter(p))
                return NULL;
        if (t_op(t, "-") || t_op(t, "+")) {
                tsr_tpl_node *x;
                adv(p);
                if (!(n = mk(p, t->s.p[0] == '-' ? TSR_TPL_N_NEG : TSR_TPL_N_POS, t->off)) ||
                    !(x = parse_unary(p, false)))
                        return NULL;
                n->a = x;
        } else {
                n = parse_primary(p);
        }
        n = parse_postfix(p, n);
        if (with_filter)
                n = parse_filter_expr(p, n);
        p->depth--;
        return n;
}

static tsr_tpl_node *mk_bin(tsr_tpl_parser *p, tsr_tpl_nkind k, uint8_t op, uint32_t off, tsr_tpl_node *l,
                            tsr_tpl_node *r) {
        tsr_tpl_node *n;
        if (!l || !r || !(n = mk(p, k, off)))
                return NULL;
        n->op = op;
        n->a = l;
        n->b = r;
        return n;
}

static tsr_tpl_node *parse_pow(tsr_tpl_parser *p) {
        tsr_tpl_node *n = parse_unary(p, true);
        while (n && t_op(cur(p), "**")) {
                uint32_t off = cur(p)->off;
                adv(p);
                n = mk_bin(p, TSR_TPL_N_BIN, 'P', off, n, parse_unary(p, true));
        }
        return n;
}

static tsr_tpl_node *parse_math2(tsr_tpl_parser *p) {
        tsr_tpl_node *n = parse_pow(p);
        for (;;) {
                tsr_tpl_token *t = cur(p);
                uint8_t op;
                if (!n)
                        return NULL;
                if (t_op(t, "*"))
                        op = '*';
                else if (t_op(t, "/"))
                        op = '/';
                else if (t_op(t, "//"))
                        op = 'F';
                else if (t_op(t, "%"))
                        op = '%';
                else
                        return n;
                adv(p);
                n = mk_bin(p, TSR_TPL_N_BIN, op, t->off, n, parse_pow(p));
        }
}

static tsr_tpl_node *parse_concat(tsr_tpl_parser *p) {
        tsr_tpl_node *n = parse_math2(p);
        while (n && t_op(cur(p), "~")) {
                uint32_t off = cur(p)->off;
                adv(p);
                n = mk_bin(p, TSR_TPL_N_BIN, '~', off, n, parse_math2(p));
        }
        return n;
}

static tsr_tpl_node *parse_math1(tsr_tpl_parser *p) {
        tsr_tpl_node *n = parse_concat(p);
        for (;;) {
                tsr_tpl_token *t = cur(p);
                if (!n)
                        return NULL;
                if (!t_op(t, "+") && !t_op(t, "-"))
                        return n;
                adv(p);
                n = mk_bin(p, TSR_TPL_N_BIN, (uint8_t)t->s.p[0], t->off, n, parse_concat(p));
        }
}

static tsr_tpl_node *parse_compare(tsr_tpl_parser *p) {
        tsr_tpl_node *first = parse_math1(p), *n;
        nvec v = {0};
        uint8_t ops[64];

        if (!first)
                return NULL;
        for (;;) {
                tsr_tpl_token *t = cur(p);
                int op = -1;
                tsr_tpl_node *x;
                if (t_op(t, "=="))
                        op = TSR_TPL_CMP_EQ;
                else if (t_op(t, "!="))
                        op = TSR_TPL_CMP_NE;
                else if (t_op(t, "<"))
                        op = TSR_TPL_CMP_LT;
                else if (t_op(t, "<="))
                        op = TSR_TPL_CMP_LE;
                else if (t_op(t, ">"))
                        op = TSR_TPL_CMP_GT;
                else if (t_op(t, ">="))
                        op = TSR_TPL_CMP_GE;
                else if (t_name(t, "in"))
                        op = TSR_TPL_CMP_IN;
                else if (t_name(t, "not") && t_name(peek(p, 1), "in")) {
                        op = TSR_TPL_CMP_NOTIN;
                        adv(p);
                }
                if (op < 0)
                        break;
                if (v.n >= sizeof(ops)) {
                        tsr_tpl_perr(p, t->off, TSR_E_LIMIT, "comparison chain too long");
                        return NULL;
                }
                adv(p);
                if (!(x = parse_math1(p)) || !nvec_push(p, &v, x, (tsr_tpl_str){0}))
                        return NULL;
                ops[v.n - 1] = (uint8_t)op;
        }
        if (!v.n)
                return first;
        if (!(n = mk(p, TSR_TPL_N_CMP, first->off)) || !(n->ops = tsr_arena_memdup(p->a, ops, v.n)))
                return NULL;
        n->a = first;
        n->kids = v.v;
        n->nkids = v.n;
        return n;
}

static tsr_tpl_node *parse_not(tsr_tpl_parser *p) {
        if (t_name(cur(p), "not")) {
                uint32_t off = cur(p)->off;
                tsr_tpl_node *n, *x;
                if (!enter(p))
                        return NULL;
                adv(p);
                if (!(x = parse_not(p)) || !(n = mk(p, TSR_TPL_N_NOT, off)))
                        return NULL;
                n->a = x;
                p->depth--;
                return n;
        }
        return parse_compare(p);
}

static tsr_tpl_node *parse_and(tsr_tpl_parser *p) {
        tsr_tpl_node *n = parse_not(p);
        while (n && t_name(cur(p), "and")) {
                uint32_t off = cur(p)->off;
                adv(p);
                n = mk_bin(p, TSR_TPL_N_AND, 0, off, n, parse_not(p));
        }
        return n;
}

static tsr_tpl_node *parse_or(tsr_tpl_parser *p) {
        tsr_tpl_node *n = parse_and(p);
        while (n && t_name(cur(p), "or")) {
                uint32_t off = cur(p)->off;
                adv(p);
                n = mk_bin(p, TSR_TPL_N_OR, 0, off, n, parse_and(p));
        }
        return n;
}

static tsr_tpl_node *parse_expr(tsr_tpl_parser *p, bool condexpr) {
        tsr_tpl_node *n;
        size_t first_unknown = p->n_unknown, k;
        bool soft = p->soft;

        if (!enter(p))
                return NULL;
        n = parse_or(p);
        if (n && condexpr && t_name(cur(p), "if")) {
                /* a conditional expression: all of it is a soft frame, expr1 included,
                 * which was parsed before the `if` showed what it was */
                for (k = first_unknown; k < p->n_unknown; k++)
                        p->unknown[k].soft = true;
                p->soft = true;
        }
        while (condexpr && n && !p->failed && t_name(cur(p), "if")) {
                tsr_tpl_node *c = mk(p, TSR_TPL_N_COND, cur(p)->off);
                if (!c)
                        break;
                adv(p);
                if (!(c->a = parse_or(p)))
                        break;
                if (t_name(cur(p), "else")) {
                        adv(p);
                        if (!(c->c = parse_expr(p, true)))
                                break;
                }
                c->b = n;
                n = c;
        }
        p->soft = soft;
        p->depth--;
        return p->failed ? NULL : n;
}

/* ---------------------------------------------------------------- statements */

typedef struct pstate {
        int loops;              /* enclosing for loops (in the current macro) */
} pstate;

static tsr_tpl_node *parse_body(tsr_tpl_parser *p, pstate *ps, const char *const *ends);

static bool is_end_name(tsr_tpl_parser *p, const char *const *ends) {
        size_t k;
        for (k = 0; ends && ends[k]; k++)
                if (t_name(cur(p), ends[k]))
                        return true;
        return false;
}

/* After a statement header: expect '%}' then parse the body up to one of `ends`,
 * leaving the stream on the end name. */
static tsr_tpl_node *parse_statements(tsr_tpl_parser *p, pstate *ps, const char *const *ends) {
        tsr_tpl_node *b;
        if (!expect_type(p, TSR_TPL_K_BLOCK_END, "end of statement block"))
                return NULL;
        b = parse_body(p, ps, ends);
        if (!b)
                return NULL;
        if (cur(p)->type == TSR_TPL_K_EOF) {
                tsr_tpl_perr(p, cur(p)->off, TSR_E_INVAL, "unexpected end of template, expected '%s'", ends[0]);
                return NULL;
        }
        return b;
}

/* Targets: a name, or names separated by commas (optionally in parentheses). */
static bool parse_targets(tsr_tpl_parser *p, tsr_tpl_node *n, const char *extra_end) {
        tsr_tpl_node *t = parse_tuple(p, 2, extra_end, false);
        uint32_t k;
        if (!t)
                return false;
        if (t->kind == TSR_TPL_N_NAME) {
                n->names = &t->name;
                n->nnames = 1;
                return true;
        }
        if (t->kind != TSR_TPL_N_TUPLE)
                goto bad;
        if (!(n->names = tsr_arena_alloc(p->a, (t->nkids ? t->nkids : 1) * sizeof(tsr_tpl_str)))) {
                tsr_tpl_perr(p, t->off, TSR_E_NOMEM, "out of memory");
                return false;
        }
        for (k = 0; k < t->nkids; k++) {
                if (t->kids[k]->kind != TSR_TPL_N_NAME)
                        goto bad;
                n->names[k] = t->kids[k]->name;
        }
        n->nnames = t->nkids;
        n->tuple = 1;
        return true;
bad:
        tsr_tpl_perr(p, t->off, TSR_E_INVAL, "cannot assign to this expression");
        return false;
}

static tsr_tpl_node *parse_for(tsr_tpl_parser *p, pstate *ps, uint32_t off) {
        static const char *const ends1[] = {"endfor", "else", NULL};
        static const char *const ends2[] = {"endfor", NULL};
        tsr_tpl_node *n = mk(p, TSR_TPL_N_FOR, off);

        if (!n || !parse_targets(p, n, "in"))
                return NULL;
        if (!t_name(cur(p), "in")) {
                tsr_tpl_perr(p, cur(p)->off, TSR_E_INVAL, "expected 'in'");
                return NULL;
        }
        adv(p);
        if (!(n->a = parse_tuple(p, 1, "recursive", false)))
                return NULL;
        if (t_name(cur(p), "if")) {
                adv(p);
                if (!(n->b = parse_expr(p, true)))
                        return NULL;
        }
        if (t_name(cur(p), "recursive")) {
                tsr_tpl_perr(p, cur(p)->off, TSR_E_UNSUPPORTED, "recursive loops are not supported");
                return NULL;
        }
        p->soft = false;        /* the loop body is a new frame (restored by parse_statement) */
        ps->loops++;
        if (!(n->c = parse_statements(p, ps, ends1)))
                return NULL;
        ps->loops--;
        if (t_name(cur(p), "else")) {
                adv(p);
                if (!(n->d = parse_statements(p, ps, ends2)))
                        return NULL;
        }
        adv(p);         /* endfor */
        return n;
}

static tsr_tpl_node *parse_if(tsr_tpl_parser *p, pstate *ps, uint32_t off) {
        static const char *const ends1[] = {"endif", "elif", "else", NULL};
        static const char *const ends2[] = {"endif", NULL};
        tsr_tpl_node *first = mk(p, TSR_TPL_N_IF, off), *n = first;

        if (!n)
                return NULL;
        p->soft = true;         /* restored by parse_statement */
        for (;;) {
                if (!(n->a = parse_tuple(p, 1, NULL, false)) || !(n->b = parse_statements(p, ps, ends1)))
                        return NULL;
                if (t_name(cur(p), "elif")) {
                        tsr_tpl_node *e = mk(p, TSR_TPL_N_IF, cur(p)->off);
                        if (!e)
                                return NULL;
                        adv(p);
                        n->c = e;
                        n = e;
                        continue;
                }
                if (t_name(cur(p), "else")) {
                        adv(p);
                        if (!(n->c = parse_statements(p, ps, ends2)))
                                return NULL;
                }
                adv(p);         /* endif */
                return first;
        }
}

static tsr_tpl_node *parse_set(tsr_tpl_parser *p, pstate *ps, uint32_t off) {
        static const char *const ends[] = {"endset", NULL};
        tsr_tpl_node *n = mk(p, TSR_TPL_N_SET, off);

        if (!n)
                return NULL;
        if (cur(p)->type == TSR_TPL_K_NAME && t_op(peek(p, 1), ".")) {
                n->op = TSR_TPL_TGT_ATTR;
                n->name = cur(p)->s;
                adv(p);
                adv(p);
                if (cur(p)->type != TSR_TPL_K_NAME) {
                        tsr_tpl_perr(p, cur(p)->off, TSR_E_INVAL, "expected an attribute name");
                        return NULL;
                }
                n->name2 = cur(p)->s;
                adv(p);
        } else {
                if (!parse_targets(p, n, NULL))
                        return NULL;
                n->op = n->tuple ? TSR_TPL_TGT_TUPLE : TSR_TPL_TGT_NAME;
                n->name = n->names[0];
        }
        if (t_op(cur(p), "=")) {
                adv(p);
                n->a = parse_tuple(p, 0, NULL, false);
                return n->a ? n : NULL;
        }
        if (n->op != TSR_TPL_TGT_NAME) {
                tsr_tpl_perr(p, cur(p)->off, TSR_E_UNSUPPORTED, "block set supports a plain name only");
                return NULL;
        }
        n->kind = TSR_TPL_N_SETBLOCK;
        p->soft = false;        /* restored by parse_statement */
        if (t_op(cur(p), "|") && !(n->c = parse_filter(p, NULL)))
                return NULL;
        if (!(n->b = parse_statements(p, ps, ends)))
                return NULL;
        adv(p);         /* endset */
        return n;
}

/* "(a, b=default, ...)": the parameters of a macro or a caller, into n->names/kids. */
static bool parse_params(tsr_tpl_parser *p, tsr_tpl_node *n) {
        nvec v = {0};
        bool have_default = false;

        if (!expect_op(p, "("))
                return false;
        while (!t_op(cur(p), ")")) {
                tsr_tpl_str nm;
                tsr_tpl_node *def = NULL;
                if (v.n && !expect_op(p, ","))
                        return false;
                if (cur(p)->type != TSR_TPL_K_NAME) {
                        tsr_tpl_perr(p, cur(p)->off, TSR_E_INVAL, "expected an argument name");
                        return false;
                }
                nm = cur(p)->s;
                adv(p);
                if (t_op(cur(p), "=")) {
                        adv(p);
                        if (!(def = parse_expr(p, true)))
                                return false;
                        have_default = true;
                } else if (have_default) {
                        tsr_tpl_perr(p, cur(p)->off, TSR_E_INVAL, "non-default argument follows default argument");
                        return false;
                }
                if (!nvec_push(p, &v, def, nm))
                        return false;
        }
        adv(p);
        n->kids = v.v;
        n->nkids = v.n;
        n->names = v.names;
        n->nnames = v.n;
        return true;
}

/* A macro or caller body: its own loop state; whether it names `caller` is recorded in
 * n->op (jinja2 passes a caller only to a macro whose body names it). */
static bool parse_callable_body(tsr_tpl_parser *p, tsr_tpl_node *n, const char *const *ends) {
        pstate inner = {0};
        bool outer = p->saw_caller;

        p->saw_caller = false;
        p->soft = false;        /* restored by parse_statement */
        n->b = parse_statements(p, &inner, ends);
        n->op = p->saw_caller;
        p->saw_caller = outer || p->saw_caller;
        if (!n->b)
                return false;
        adv(p);         /* the end tag */
        return true;
}

static tsr_tpl_node *parse_macro(tsr_tpl_parser *p, uint32_t off) {
        static const char *const ends[] = {"endmacro", NULL};
        tsr_tpl_node *n = mk(p, TSR_TPL_N_MACRO, off);

        if (!n)
                return NULL;
        if (cur(p)->type != TSR_TPL_K_NAME) {
                tsr_tpl_perr(p, cur(p)->off, TSR_E_INVAL, "expected a macro name");
                return NULL;
        }
        n->name = cur(p)->s;
        adv(p);
        if (!parse_params(p, n) || !parse_callable_body(p, n, ends))
                return NULL;
        return n;
}

/* {% call [(params)] callee(args) %}body{% endcall %}: the body becomes the macro
 * `caller` passed to the call. */
static tsr_tpl_node *parse_call_block(tsr_tpl_parser *p, uint32_t off) {
        static const char *const ends[] = {"endcall", NULL};
        tsr_tpl_node *n = mk(p, TSR_TPL_N_CALLBLOCK, off);

        if (!n)
                return NULL;
        if (t_op(cur(p), "(") && !parse_params(p, n))
                return NULL;
        if (!(n->a = parse_expr(p, true)))
                return NULL;
        if (n->a->kind != TSR_TPL_N_CALL) {
                tsr_tpl_perr(p, n->a->off, TSR_E_INVAL, "expected call");
                return NULL;
        }
        if (!parse_callable_body(p, n, ends))
                return NULL;
        n->op = 0;      /* a caller is never given a caller */
        return n;
}

/* {% filter f(args) | g %}body{% endfilter %} */
static tsr_tpl_node *parse_filter_block(tsr_tpl_parser *p, pstate *ps, uint32_t off) {
        static const char *const ends[] = {"endfilter", NULL};
        tsr_tpl_node *n = mk(p, TSR_TPL_N_FILTERBLOCK, off), *first;

        p->soft = false;        /* restored by parse_statement */
        if (!n || !(first = parse_one_filter(p, NULL)) || !(n->c = parse_filter(p, first)))
                return NULL;
        if (!(n->b = parse_statements(p, ps, ends)))
                return NULL;
        adv(p);         /* endfilter */
        return n;
}

static tsr_tpl_node *parse_statement(tsr_tpl_parser *p, pstate *ps) {
        tsr_tpl_token *t = cur(p);
        tsr_tpl_node *n = NULL;

        if (t->type != TSR_TPL_K_NAME) {
                tsr_tpl_perr(p, t->off, TSR_E_INVAL, "tag name expected");
                return NULL;
        }
        bool soft = p->soft;

        if (!enter(p))
                return NULL;
        adv(p);
        if (tsr_tpl_str_eq(t->s, "for")) {
                n = parse_for(p, ps, t->off);
        } else if (tsr_tpl_str_eq(t->s, "if")) {
                n = parse_if(p, ps, t->off);
        } else if (tsr_tpl_str_eq(t->s, "set")) {
                n = parse_set(p, ps, t->off);
        } else if (tsr_tpl_str_eq(t->s, "macro")) {
                n = parse_macro(p, t->off);
        } else if (tsr_tpl_str_eq(t->s, "call")) {
                n = parse_call_block(p, t->off);
        } else if (tsr_tpl_str_eq(t->s, "filter")) {
                n = parse_filter_block(p, ps, t->off);
        } else if (tsr_tpl_str_eq(t->s, "break") || tsr_tpl_str_eq(t->s, "continue")) {
                if (!ps->loops)
                        tsr_tpl_perr(p, t->off, TSR_E_INVAL, "'%.*s' outside of a loop", (int)t->s.n, t->s.p);
                else
                        n = mk(p, t->s.p[0] == 'b' ? TSR_TPL_N_BREAK : TSR_TPL_N_CONTINUE, t->off);
        } else if (tsr_tpl_str_eq(t->s, "generation")) {
                /* transformers' AssistantTracker: renders its body unchanged */
                static const char *const ends[] = {"endgeneration", NULL};
                if ((n = parse_statements(p, ps, ends)))
                        adv(p);
        } else {
                tsr_tpl_perr(p, t->off, TSR_E_INVAL, "unknown or unsupported tag '%.*s'", (int)t->s.n, t->s.p);
        }
        p->soft = soft;
        p->depth--;
        return p->failed ? NULL : n;
}

static tsr_tpl_node *parse_body(tsr_tpl_parser *p, pstate *ps, const char *const *ends) {
        nvec v = {0};
        tsr_tpl_node *body = mk(p, TSR_TPL_N_BODY, cur(p)->off);

        if (!body || !enter(p))
                return NULL;
        for (;;) {
                tsr_tpl_token *t = cur(p);
                tsr_tpl_node *n = NULL;
                if (t->type == TSR_TPL_K_EOF)
                        break;
                if (t->type == TSR_TPL_K_DATA) {
                        if (!(n = mk(p, TSR_TPL_N_TEXT, t->off)))
                                return NULL;
                        n->name = t->s;
                        adv(p);
                } else if (t->type == TSR_TPL_K_VAR_BEGIN) {
                        adv(p);
                        if (!(n = mk(p, TSR_TPL_N_OUTPUT, t->off)) || !(n->a = parse_tuple(p, 0, NULL, false)) ||
                            !expect_type(p, TSR_TPL_K_VAR_END, "end of print statement"))
                                return NULL;
                } else if (t->type == TSR_TPL_K_BLOCK_BEGIN) {
                        adv(p);
                        if (is_end_name(p, ends))
                                break;
                        if (cur(p)->type == TSR_TPL_K_NAME && !ends &&
                            (tsr_tpl_str_eq(cur(p)->s, "endif") || tsr_tpl_str_eq(cur(p)->s, "endfor") ||
                             tsr_tpl_str_eq(cur(p)->s, "endmacro") || tsr_tpl_str_eq(cur(p)->s, "else") ||
                             tsr_tpl_str_eq(cur(p)->s, "elif") || tsr_tpl_str_eq(cur(p)->s, "endset"))) {
                                tsr_tpl_perr(p, cur(p)->off, TSR_E_INVAL, "unexpected '%.*s'", (int)cur(p)->s.n,
                                     cur(p)->s.p);
                                return NULL;
                        }
                        if (!(n = parse_statement(p, ps)) ||
                            !expect_type(p, TSR_TPL_K_BLOCK_END, "end of statement block"))
                                return NULL;
                } else {
                        tsr_tpl_perr(p, t->off, TSR_E_INVAL, "unexpected %s", tok_desc(t));
                        return NULL;
                }
                if (!nvec_push(p, &v, n, (tsr_tpl_str){0}))
                        return NULL;
        }
        if (!ends && cur(p)->type != TSR_TPL_K_EOF) {
                tsr_tpl_perr(p, cur(p)->off, TSR_E_INVAL, "unexpected %s", tok_desc(cur(p)));
                return NULL;
        }
        if (ends && !is_end_name(p, ends)) {
                tsr_tpl_perr(p, cur(p)->off, TSR_E_INVAL, "unexpected end of template, expected '%s'", ends[0]);
                return NULL;
        }
        body->kids = v.v;
        body->nkids = v.n;
        p->depth--;
        return body;
}

tsr_status tsr_template_parse(const char *src, size_t len, tsr_template **ret, char *err, size_t errlen) {
        tsr_tpl_parser p = {0};
        tsr_template *t = NULL;
        pstate ps = {0};
        tsr_tpl_token eof = {0};
        size_t i, k = 0;
        char *s;

        if (err && errlen)
                err[0] = '\0';
        if (!src && len)
                return TSR_E_INVAL;
        if (len > UINT32_MAX - 8) {
                if (err && errlen)
                        snprintf(err, errlen, "template too large");
                return TSR_E_LIMIT;
        }
        t = calloc(1, sizeof(*t));
        if (!t || !(t->arena = tsr_arena_new(0, 0)) || !(s = tsr_arena_alloc(t->arena, len + 1))) {
                tsr_template_free(&t);
                return TSR_E_NOMEM;
        }
        /* jinja2 normalises \r\n and \r to \n and drops one trailing newline
         * (keep_trailing_newline is off) before lexing. */
        for (i = 0; i < len; i++) {
                if (src[i] == '\r') {
                        s[k++] = '\n';
                        if (i + 1 < len && src[i + 1] == '\n')
                                i++;
                } else {
                        s[k++] = src[i];
                }
        }
        if (k && s[k - 1] == '\n')
                k--;
        s[k] = '\0';
        t->src = s;
        t->len = k;
        p.a = t->arena;
        p.src = s;
        p.len = k;
        p.err = err;
        p.errlen = errlen;
        if (tsr_tpl_lex(&p) == TSR_OK) {
                eof.type = TSR_TPL_K_EOF;
                eof.off = (uint32_t)k;
                if (tsr_tpl_push_tok(&p, eof) == TSR_OK && (t->root = parse_body(&p, &ps, NULL)))
                        judge_unknown(&p);
        }
        if (p.failed || !t->root) {
                tsr_status st = p.failed ? p.st : TSR_E_INTERNAL;
                tsr_template_free(&t);
                return st;
        }
        *ret = t;
        return TSR_OK;
}

void tsr_template_free(tsr_template **t) {
        if (!t || !*t)
                return;
        tsr_arena_free(&(*t)->arena);
        free(*t);
        *t = NULL;
}

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

enum { TSR_TPL_B_RANGE, TSR_TPL_B_NAMESPACE, TSR_TPL_B_DICT, TSR_TPL_B_RAISE, TSR_TPL_B_STRFTIME };
static const char *const tsr_tpl_builtin_names[] = {"range", "namespace", "dict", "raise_exception", "strftime_now"};

typedef struct tsr_tpl_args {
        tsr_tpl_val *pos;
        size_t npos;
        tsr_tpl_val *kw;
        const tsr_tpl_str *kwn;
        size_t nkw;
        tsr_tpl_val caller;             /* a call block's body (TSR_TPL_VAL_MACRO), or TSR_TPL_VAL_UNDEF */
} tsr_tpl_args;

static tsr_status tsr_tpl_rerr(tsr_tpl_rctx *c, tsr_status st, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));
static tsr_status tsr_tpl_rerr(tsr_tpl_rctx *c, tsr_status st, const char *fmt, ...) {
        va_list ap;
        if (c->failed)
                return c->st;
        c->failed = true;
        c->st = st;
        if (c->err && c->errlen) {
                va_start(ap, fmt);
                vsnprintf(c->err, c->errlen, fmt, ap);
                va_end(ap);
        }
        return st;
}

static tsr_status tsr_tpl_oom(tsr_tpl_rctx *c) {
        if (tsr_arena_over_limit(c->a))
                return tsr_tpl_rerr(c, TSR_E_LIMIT, "template render used more than its memory limit");
        return tsr_tpl_rerr(c, TSR_E_NOMEM, "out of memory");
}

static void *tsr_tpl_ralloc(tsr_tpl_rctx *c, size_t n) {
        void *p = tsr_arena_alloc(c->a, n ? n : 1);
        if (!p)
                tsr_tpl_oom(c);
        return p;
}

static tsr_status tsr_tpl_step(tsr_tpl_rctx *c, uint64_t k) {
        c->steps += k;
        if (c->steps > c->max_steps)
                return tsr_tpl_rerr(c, TSR_E_LIMIT, "template render took more than %" PRIu64 " steps", c->max_steps);
        return TSR_OK;
}

static tsr_status tsr_tpl_nest_in(tsr_tpl_rctx *c) {
        if (++c->nest > TSR_TPL_MAX_EVAL_NEST)
                return tsr_tpl_rerr(c, TSR_E_LIMIT, "template render nested too deep");
        return TSR_OK;
}

static bool tsr_tpl_sb_add(tsr_tpl_rctx *c, tsr_tpl_sb *b, const char *s, size_t n) {
        if (c->failed)
                return false;
        if (n > c->max_output || b->n > c->max_output - n) {
                tsr_tpl_rerr(c, TSR_E_LIMIT, "template output larger than %zu bytes", c->max_output);
                return false;
        }
        if (b->n + n + 1 > b->cap) {
                size_t nc = b->cap ? b->cap : 32;
                char *np;
                while (nc < b->n + n + 1)
                        nc *= 2;
                if (!(np = tsr_tpl_ralloc(c, nc)))
                        return false;
                if (b->n)
                        memcpy(np, b->p, b->n);
                b->p = np;
                b->cap = nc;
        }
        if (n)
                memcpy(b->p + b->n, s, n);
        b->n += n;
        b->p[b->n] = '\0';
        return true;
}

static bool tsr_tpl_sb_adds(tsr_tpl_rctx *c, tsr_tpl_sb *b, const char *s) {
        return tsr_tpl_sb_add(c, b, s, strlen(s));
}
static bool tsr_tpl_sb_addc(tsr_tpl_rctx *c, tsr_tpl_sb *b, char ch) { return tsr_tpl_sb_add(c, b, &ch, 1); }
static tsr_tpl_val tsr_tpl_sb_val(tsr_tpl_sb *b) { return tsr_tpl_val_str(b->p ? b->p : "", b->n); }

static tsr_status tsr_tpl_emit(tsr_tpl_rctx *c, const char *s, size_t n) {
        tsr_status st;
        if (c->cap)
                return tsr_tpl_sb_add(c, c->cap, s, n) ? TSR_OK : c->st;
        st = tsr_buf_append(c->out, s, n);
        if (st == TSR_E_LIMIT)
                return tsr_tpl_rerr(c, st, "template output larger than %zu bytes", c->max_output);
        if (st != TSR_OK)
                return tsr_tpl_rerr(c, st, "out of memory");
        return TSR_OK;
}

static tsr_tpl_list *tsr_tpl_list_new(tsr_tpl_rctx *c, size_t cap) {
        tsr_tpl_list *l = tsr_tpl_ralloc(c, sizeof(*l));
        if (!l)
                return NULL;
        memset(l, 0, sizeof(*l));
        if (cap && !(l->v = tsr_tpl_ralloc(c, cap * sizeof(tsr_tpl_val))))
                return NULL;
        l->cap = cap;
        return l;
}

static bool tsr_tpl_list_push(tsr_tpl_rctx *c, tsr_tpl_list *l, tsr_tpl_val v) {
        if (l->n == l->cap) {
                size_t nc = l->cap ? l->cap * 2 : 4;
                tsr_tpl_val *nv = tsr_tpl_ralloc(c, nc * sizeof(tsr_tpl_val));
                if (!nv)
                        return false;
                if (l->n)
                        memcpy(nv, l->v, l->n * sizeof(tsr_tpl_val));
                l->v = nv;
                l->cap = nc;
        }
        l->v[l->n++] = v;
        return true;
}

static tsr_tpl_val tsr_tpl_val_list(tsr_tpl_list *l) {
        tsr_tpl_val v = {.type = TSR_TPL_VAL_LIST};
        v.u.l = l;
        return v;
}
static tsr_tpl_val tsr_tpl_val_dict(tsr_tpl_dict *d) {
        tsr_tpl_val v = {.type = TSR_TPL_VAL_DICT};
        v.u.d = d;
        return v;
}

static tsr_tpl_dict *tsr_tpl_dict_new(tsr_tpl_rctx *c) {
        tsr_tpl_dict *d = tsr_tpl_ralloc(c, sizeof(*d));
        if (d)
                memset(d, 0, sizeof(*d));
        return d;
}

static bool tsr_tpl_val_eq(tsr_tpl_rctx *c, tsr_tpl_val a, tsr_tpl_val b);

static tsr_tpl_val *tsr_tpl_dict_find(tsr_tpl_rctx *c, const tsr_tpl_dict *d, tsr_tpl_val key) {
        size_t i;
        for (i = 0; i < d->n; i++) {
                tsr_tpl_val k = d->k[i];
                if (key.type == TSR_TPL_VAL_STR && k.type == TSR_TPL_VAL_STR) {
                        if (k.u.s.n == key.u.s.n && memcmp(k.u.s.p, key.u.s.p, k.u.s.n) == 0)
                                return &d->v[i];
                } else if (tsr_tpl_val_eq(c, k, key)) {
                        return &d->v[i];
                }
        }
        return NULL;
}

static tsr_tpl_val *tsr_tpl_dict_finds(const tsr_tpl_dict *d, const char *key, size_t n) {
        size_t i;
        for (i = 0; i < d->n; i++)
                if (d->k[i].type == TSR_TPL_VAL_STR && d->k[i].u.s.n == n && memcmp(d->k[i].u.s.p, key, n) == 0)
                        return &d->v[i];
        return NULL;
}

static bool tsr_tpl_dict_set(tsr_tpl_rctx *c, tsr_tpl_dict *d, tsr_tpl_val key, tsr_tpl_val val) {
        tsr_tpl_val *slot = tsr_tpl_dict_find(c, d, key);
        if (slot) {
                *slot = val;
                return true;
        }
        if (d->n == d->cap) {
                size_t nc = d->cap ? d->cap * 2 : 4;
                tsr_tpl_val *nk = tsr_tpl_ralloc(c, nc * sizeof(tsr_tpl_val)),
                            *nv = tsr_tpl_ralloc(c, nc * sizeof(tsr_tpl_val));
                if (!nk || !nv)
                        return false;
                if (d->n) {
                        memcpy(nk, d->k, d->n * sizeof(tsr_tpl_val));
                        memcpy(nv, d->v, d->n * sizeof(tsr_tpl_val));
                }
                d->k = nk;
                d->v = nv;
                d->cap = nc;
        }
        d->k[d->n] = key;
        d->v[d->n] = val;
        d->n++;
        return true;
}

static bool tsr_tpl_frame_set(tsr_tpl_rctx *c, tsr_tpl_frame *f, tsr_tpl_str name, tsr_tpl_val val) {
        size_t i;
        for (i = 0; i < f->n; i++) {
                if (f->names[i].n == name.n && memcmp(f->names[i].p, name.p, name.n) == 0) {
                        f->vals[i] = val;
                        return true;
                }
        }
        if (f->n == f->cap) {
                size_t nc = f->cap ? f->cap * 2 : 8;
                tsr_tpl_str *nn = tsr_tpl_ralloc(c, nc * sizeof(tsr_tpl_str));
                tsr_tpl_val *nv = tsr_tpl_ralloc(c, nc * sizeof(tsr_tpl_val));
                if (!nn || !nv)
                        return false;
                if (f->n) {
                        memcpy(nn, f->names, f->n * sizeof(tsr_tpl_str));
                        memcpy(nv, f->vals, f->n * sizeof(tsr_tpl_val));
                }
                f->names = nn;
                f->vals = nv;
                f->cap = nc;
        }
        f->names[f->n] = name;
        f->vals[f->n] = val;
        f->n++;
        return true;
}

static tsr_tpl_frame *tsr_tpl_frame_new(tsr_tpl_rctx *c, tsr_tpl_frame *parent) {
        tsr_tpl_frame *f = tsr_tpl_ralloc(c, sizeof(*f));
        if (f) {
                memset(f, 0, sizeof(*f));
                f->parent = parent;
        }
        return f;
}

static tsr_tpl_val tsr_tpl_lookup(tsr_tpl_rctx *c, const tsr_tpl_frame *f, tsr_tpl_str name) {
        size_t i;
        tsr_tpl_val *v;
        for (; f; f = f->parent)
                for (i = f->n; i-- > 0;)
                        if (f->names[i].n == name.n && memcmp(f->names[i].p, name.p, name.n) == 0)
                                return f->vals[i];
        if ((v = tsr_tpl_dict_finds(c->vars, name.p, name.n)))
                return *v;
        for (i = 0; i < sizeof(tsr_tpl_builtin_names) / sizeof(tsr_tpl_builtin_names[0]); i++) {
                if (tsr_tpl_str_eq(name, tsr_tpl_builtin_names[i])) {
                        tsr_tpl_val b = {.type = TSR_TPL_VAL_BUILTIN};
                        b.u.builtin = (int)i;
                        return b;
                }
        }
        {
                tsr_tpl_val u = {.type = TSR_TPL_VAL_UNDEF};
                u.u.s = name;
                return u;
        }
}

static const char *tsr_tpl_type_name(tsr_tpl_val v) {
        switch (v.type) {
        case TSR_TPL_VAL_UNDEF: return "Undefined";
        case TSR_TPL_VAL_NONE: return "NoneType";
        case TSR_TPL_VAL_BOOL: return "bool";
        case TSR_TPL_VAL_INT: return "int";
        case TSR_TPL_VAL_FLOAT: return "float";
        case TSR_TPL_VAL_STR: return "str";
        case TSR_TPL_VAL_LIST: return v.u.l->gen ? "generator" : v.u.l->tuple ? "tuple" : "list";
        case TSR_TPL_VAL_DICT: return "dict";
        case TSR_TPL_VAL_NS: return "Namespace";
        case TSR_TPL_VAL_MACRO: return "Macro";
        case TSR_TPL_VAL_LOOP: return "LoopContext";
        default: return "builtin_function_or_method";
        }
}

static tsr_status tsr_tpl_undef_err(tsr_tpl_rctx *c, tsr_tpl_val u) {
        if (u.u.s.p && u.u.s.n)
                return tsr_tpl_rerr(c, TSR_E_INVAL, "'%.*s' is undefined", (int)u.u.s.n, u.u.s.p);
        return tsr_tpl_rerr(c, TSR_E_INVAL, "value is undefined");
}

static bool tsr_tpl_truthy(tsr_tpl_val v) {
        switch (v.type) {
        case TSR_TPL_VAL_UNDEF:
        case TSR_TPL_VAL_NONE: return false;
        case TSR_TPL_VAL_BOOL: return v.u.b;
        case TSR_TPL_VAL_INT: return v.u.i != 0;
        case TSR_TPL_VAL_FLOAT: return v.u.f != 0.0;
        case TSR_TPL_VAL_STR: return v.u.s.n != 0;
        case TSR_TPL_VAL_LIST: return v.u.l->gen || v.u.l->n != 0;
        case TSR_TPL_VAL_DICT: return v.u.d->n != 0;
        default: return true;
        }
}

static bool tsr_tpl_is_num(tsr_tpl_val v) {
        return v.type == TSR_TPL_VAL_BOOL || v.type == TSR_TPL_VAL_INT || v.type == TSR_TPL_VAL_FLOAT;
}
static bool tsr_tpl_is_intlike(tsr_tpl_val v) { return v.type == TSR_TPL_VAL_BOOL || v.type == TSR_TPL_VAL_INT; }
static int64_t tsr_tpl_as_int(tsr_tpl_val v) { return v.type == TSR_TPL_VAL_BOOL ? (int64_t)v.u.b : v.u.i; }
static double tsr_tpl_as_dbl(tsr_tpl_val v) { return v.type == TSR_TPL_VAL_FLOAT ? v.u.f : (double)tsr_tpl_as_int(v); }

static bool tsr_tpl_val_eq(tsr_tpl_rctx *c, tsr_tpl_val a, tsr_tpl_val b) {
        size_t i;
        if (tsr_tpl_is_num(a) && tsr_tpl_is_num(b)) {
                if (a.type == TSR_TPL_VAL_FLOAT || b.type == TSR_TPL_VAL_FLOAT)
                        return tsr_tpl_as_dbl(a) == tsr_tpl_as_dbl(b);
                return tsr_tpl_as_int(a) == tsr_tpl_as_int(b);
        }
        if (a.type != b.type)
                return false;
        switch (a.type) {
        case TSR_TPL_VAL_UNDEF:
        case TSR_TPL_VAL_NONE: return true;
        case TSR_TPL_VAL_STR: return a.u.s.n == b.u.s.n && memcmp(a.u.s.p, b.u.s.p, a.u.s.n) == 0;
        case TSR_TPL_VAL_LIST:
                if (a.u.l->tuple != b.u.l->tuple || a.u.l->n != b.u.l->n)
                        return false;
                if (a.u.l == b.u.l)
                        return true;
                if (tsr_tpl_nest_in(c) != TSR_OK)
                        return false;
                for (i = 0; i < a.u.l->n; i++)
                        if (!tsr_tpl_val_eq(c, a.u.l->v[i], b.u.l->v[i]))
                                break;
                c->nest--;
                return i == a.u.l->n;
        case TSR_TPL_VAL_DICT:
                if (a.u.d->n != b.u.d->n)
                        return false;
                if (a.u.d == b.u.d)
                        return true;
                if (tsr_tpl_nest_in(c) != TSR_OK)
                        return false;
                for (i = 0; i < a.u.d->n; i++) {
                        tsr_tpl_val *o = tsr_tpl_dict_find(c, b.u.d, a.u.d->k[i]);
                        if (!o || !tsr_tpl_val_eq(c, a.u.d->v[i], *o))
                                break;
                }
                c->nest--;
                return i == a.u.d->n;
        case TSR_TPL_VAL_NS: return a.u.d == b.u.d;
        case TSR_TPL_VAL_MACRO: return a.u.m.n == b.u.m.n;
        case TSR_TPL_VAL_BUILTIN: return a.u.builtin == b.u.builtin;
        case TSR_TPL_VAL_LOOP: return a.u.loop == b.u.loop;
        default: return false;
        }
}

/* Python ordering: returns TSR_OK and *r < 0, 0, > 0, or a TypeError. */
static tsr_status tsr_tpl_val_cmp(tsr_tpl_rctx *c, tsr_tpl_val a, tsr_tpl_val b, const char *op, int *r) {
        if (tsr_tpl_is_num(a) && tsr_tpl_is_num(b)) {
                if (a.type == TSR_TPL_VAL_FLOAT || b.type == TSR_TPL_VAL_FLOAT) {
                        double x = tsr_tpl_as_dbl(a), y = tsr_tpl_as_dbl(b);
                        *r = x < y ? -1 : x > y ? 1 : 0;
                } else {
                        int64_t x = tsr_tpl_as_int(a), y = tsr_tpl_as_int(b);
                        *r = x < y ? -1 : x > y ? 1 : 0;
                }
                return TSR_OK;
        }
        if (a.type == TSR_TPL_VAL_STR && b.type == TSR_TPL_VAL_STR) {
                /* UTF-8 byte order is code point order */
                size_t n = a.u.s.n < b.u.s.n ? a.u.s.n : b.u.s.n;
                int k = n ? memcmp(a.u.s.p, b.u.s.p, n) : 0;
                *r = k ? k : a.u.s.n < b.u.s.n ? -1 : a.u.s.n > b.u.s.n ? 1 : 0;
                return TSR_OK;
        }
        if (a.type == TSR_TPL_VAL_LIST && b.type == TSR_TPL_VAL_LIST && a.u.l->tuple == b.u.l->tuple) {
                size_t i;
                tsr_status st;
                if ((st = tsr_tpl_nest_in(c)) != TSR_OK)
                        return st;
                for (i = 0; i < a.u.l->n && i < b.u.l->n; i++) {
                        if (!tsr_tpl_val_eq(c, a.u.l->v[i], b.u.l->v[i])) {
                                st = tsr_tpl_val_cmp(c, a.u.l->v[i], b.u.l->v[i], op, r);
                                c->nest--;
                                return st;
                        }
                }
                c->nest--;
                *r = a.u.l->n < b.u.l->n ? -1 : a.u.l->n > b.u.l->n ? 1 : 0;
                return c->failed ? c->st : TSR_OK;
        }
        if (a.type == TSR_TPL_VAL_UNDEF)
                return tsr_tpl_undef_err(c, a);
        if (b.type == TSR_TPL_VAL_UNDEF)
                return tsr_tpl_undef_err(c, b);
        return tsr_tpl_rerr(c, TSR_E_INVAL, "'%s' not supported between instances of '%s' and '%s'", op,
                            tsr_tpl_type_name(a), tsr_tpl_type_name(b));
}

/* ---------------------------------------------------------------- str(), repr(), json */

/* Python's repr(float): the shortest digits that round-trip, in fixed notation when the
 * decimal exponent is in [-4, 16), with ".0" on integral values. */
static void fmt_float(double d, char *out, size_t outlen) {
        char tmp[40], digits[24];
        int prec, exp10 = 0, nd = 0;
        size_t k = 0, i;
        const char *e;

        if (isnan(d)) {
                snprintf(out, outlen, "nan");
                return;
        }
        if (isinf(d)) {
                snprintf(out, outlen, d < 0 ? "-inf" : "inf");
                return;
        }
        for (prec = 1; prec <= 17; prec++) {
                snprintf(tmp, sizeof(tmp), "%.*e", prec - 1, d);
                if (strtod(tmp, NULL) == d)
                        break;
        }
        /* tmp = [-]D[.DDD]e[+-]XX */
        for (i = 0; tmp[i] && tmp[i] != 'e'; i++)
                if (isdigit((unsigned char)tmp[i]) && nd < (int)sizeof(digits) - 1)
                        digits[nd++] = tmp[i];
        digits[nd] = '\0';
        e = strchr(tmp, 'e');
        exp10 = e ? atoi(e + 1) : 0;
        while (nd > 1 && digits[nd - 1] == '0')
                digits[--nd] = '\0';
        if (d < 0 || (d == 0 && signbit(d)))
                out[k++] = '-';
        if (exp10 >= -5 + 1 && exp10 < 16) {
                if (exp10 < 0) {
                        out[k++] = '0';
                        out[k++] = '.';
                        for (i = 0; i < (size_t)(-exp10 - 1); i++)
                                out[k++] = '0';
                        for (i = 0; i < (size_t)nd; i++)
                                out[k++] = digits[i];
                } else {
                        for (i = 0; i <= (size_t)exp10; i++)
                                out[k++] = i < (size_t)nd ? digits[i] : '0';
                        out[k++] = '.';
                        if ((size_t)nd > (size_t)exp10 + 1)
                                for (i = (size_t)exp10 + 1; i < (size_t)nd; i++)
                                        out[k++] = digits[i];
                        else
                                out[k++] = '0';
                }
                out[k] = '\0';
        } else {
                out[k++] = digits[0];
                if (nd > 1) {
                        out[k++] = '.';
                        for (i = 1; i < (size_t)nd; i++)
                                out[k++] = digits[i];
                }
                snprintf(out + k, outlen - k, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
        }
}

static bool repr_str(tsr_tpl_rctx *c, tsr_tpl_sb *b, tsr_tpl_str s) {
        bool has_sq = memchr(s.p, '\'', s.n) != NULL, has_dq = memchr(s.p, '"', s.n) != NULL;
        char q = has_sq && !has_dq ? '"' : '\'';
        size_t i = 0;

        if (!tsr_tpl_sb_addc(c, b, q))
                return false;
        while (i < s.n) {
                size_t st = i;
                uint32_t cp = tsr_tpl_utf8_next(s.p, s.n, &i);
                char esc[16];
                if (cp == (uint32_t)q || cp == '\\') {
                        esc[0] = '\\';
                        esc[1] = (char)cp;
                        if (!tsr_tpl_sb_add(c, b, esc, 2))
                                return false;
                } else if (cp == '\n' || cp == '\r' || cp == '\t') {
                        if (!tsr_tpl_sb_adds(c, b, cp == '\n' ? "\\n" : cp == '\r' ? "\\r" : "\\t"))
                                return false;
                } else if (cp < 0x20 || (cp >= 0x7f && cp <= 0xa0) || cp == 0xad) {
                        snprintf(esc, sizeof(esc), "\\x%02x", cp);
                        if (!tsr_tpl_sb_adds(c, b, esc))
                                return false;
                } else if (cp == 0x2028 || cp == 0x2029 || (cp >= 0x200b && cp <= 0x200f) || cp == 0xfeff) {
                        snprintf(esc, sizeof(esc), "\\u%04x", cp);
                        if (!tsr_tpl_sb_adds(c, b, esc))
                                return false;
                } else if (!tsr_tpl_sb_add(c, b, s.p + st, i - st)) {
                        return false;
                }
        }
        return tsr_tpl_sb_addc(c, b, q);
}

static bool tsr_tpl_str_append(tsr_tpl_rctx *c, tsr_tpl_sb *b, tsr_tpl_val v);

static bool tsr_tpl_repr_append(tsr_tpl_rctx *c, tsr_tpl_sb *b, tsr_tpl_val v) {
        if (v.type == TSR_TPL_VAL_STR)
                return repr_str(c, b, v.u.s);
        return tsr_tpl_str_append(c, b, v);
}

/* Python str() of a value, as jinja2 prints it. */
static bool tsr_tpl_str_append(tsr_tpl_rctx *c, tsr_tpl_sb *b, tsr_tpl_val v) {
        char num[48];
        size_t i;
        bool ok = true;

        switch (v.type) {
        case TSR_TPL_VAL_UNDEF: return true;
        case TSR_TPL_VAL_NONE: return tsr_tpl_sb_adds(c, b, "None");
        case TSR_TPL_VAL_BOOL: return tsr_tpl_sb_adds(c, b, v.u.b ? "True" : "False");
        case TSR_TPL_VAL_INT:
                snprintf(num, sizeof(num), "%" PRId64, v.u.i);
                return tsr_tpl_sb_adds(c, b, num);
        case TSR_TPL_VAL_FLOAT:
                fmt_float(v.u.f, num, sizeof(num));
                return tsr_tpl_sb_adds(c, b, num);
        case TSR_TPL_VAL_STR: return tsr_tpl_sb_add(c, b, v.u.s.p, v.u.s.n);
        case TSR_TPL_VAL_LIST:
                if (tsr_tpl_nest_in(c) != TSR_OK)
                        return false;
                ok = tsr_tpl_sb_addc(c, b, v.u.l->tuple ? '(' : '[');
                for (i = 0; ok && i < v.u.l->n; i++)
                        ok = (!i || tsr_tpl_sb_adds(c, b, ", ")) && tsr_tpl_repr_append(c, b, v.u.l->v[i]);
                if (ok && v.u.l->tuple && v.u.l->n == 1)
                        ok = tsr_tpl_sb_addc(c, b, ',');
                ok = ok && tsr_tpl_sb_addc(c, b, v.u.l->tuple ? ')' : ']');
                c->nest--;
                return ok;
        case TSR_TPL_VAL_DICT:
        case TSR_TPL_VAL_NS:
                if (tsr_tpl_nest_in(c) != TSR_OK)
                        return false;
                if (v.type == TSR_TPL_VAL_NS)
                        ok = tsr_tpl_sb_adds(c, b, "<Namespace ");
                ok = ok && tsr_tpl_sb_addc(c, b, '{');
                for (i = 0; ok && i < v.u.d->n; i++)
                        ok = (!i || tsr_tpl_sb_adds(c, b, ", ")) && tsr_tpl_repr_append(c, b, v.u.d->k[i]) &&
                             tsr_tpl_sb_adds(c, b, ": ") && tsr_tpl_repr_append(c, b, v.u.d->v[i]);
                ok = ok && tsr_tpl_sb_addc(c, b, '}');
                if (ok && v.type == TSR_TPL_VAL_NS)
                        ok = tsr_tpl_sb_addc(c, b, '>');
                c->nest--;
                return ok;
        case TSR_TPL_VAL_MACRO:
                return tsr_tpl_sb_adds(c, b, "<Macro '") && tsr_tpl_sb_add(c, b, v.u.m.n->name.p, v.u.m.n->name.n) &&
                       tsr_tpl_sb_adds(c, b, "'>");
        case TSR_TPL_VAL_LOOP: return tsr_tpl_sb_adds(c, b, "<LoopContext>");
        case TSR_TPL_VAL_METHOD:
                return tsr_tpl_sb_adds(c, b, "<built-in method ") && tsr_tpl_sb_adds(c, b, v.u.meth.name) &&
                       tsr_tpl_sb_adds(c, b, ">");
        default: return tsr_tpl_sb_adds(c, b, "<built-in function>");
        }
}

/* str(v) as a string value; strings come back without copying. */
static tsr_status tsr_tpl_to_str(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_str *out) {
        tsr_tpl_sb b = {0};
        if (v.type == TSR_TPL_VAL_STR) {
                *out = v.u.s;
                return TSR_OK;
        }
        if (v.type == TSR_TPL_VAL_UNDEF) {
                out->p = "";
                out->n = 0;
                return TSR_OK;
        }
        if (!tsr_tpl_str_append(c, &b, v))
                return c->failed ? c->st : tsr_tpl_oom(c);
        *out = tsr_tpl_sb_val(&b).u.s;
        return TSR_OK;
}

typedef struct tsr_tpl_jopt {
        bool ensure_ascii;
        bool indent;            /* indent given (not None) */
        tsr_tpl_str ind;
        tsr_tpl_str item_sep, key_sep;
        bool sort_keys;
} tsr_tpl_jopt;

static bool json_str(tsr_tpl_rctx *c, tsr_tpl_sb *b, tsr_tpl_str s, bool ensure_ascii) {
        size_t i = 0, run = 0;
        if (!tsr_tpl_sb_addc(c, b, '"'))
                return false;
        while (i < s.n) {
                unsigned char ch = (unsigned char)s.p[i];
                char esc[16];
                const char *e = NULL;
                if (ch >= 0x20 && ch != '"' && ch != '\\' && (ch < 0x7f || (!ensure_ascii && ch >= 0x7f))) {
                        i++;
                        run++;
                        continue;
                }
                if (run && !tsr_tpl_sb_add(c, b, s.p + i - run, run))
                        return false;
                run = 0;
                switch (ch) {
                case '"': e = "\\\""; break;
                case '\\': e = "\\\\"; break;
                case '\n': e = "\\n"; break;
                case '\r': e = "\\r"; break;
                case '\t': e = "\\t"; break;
                case '\b': e = "\\b"; break;
                case '\f': e = "\\f"; break;
                default: break;
                }
                if (e) {
                        i++;
                } else if (ch < 0x80) {
                        snprintf(esc, sizeof(esc), "\\u%04x", ch);
                        e = esc;
                        i++;
                } else {
                        uint32_t cp = tsr_tpl_utf8_next(s.p, s.n, &i);
                        if (cp >= 0x10000) {
                                cp -= 0x10000;
                                snprintf(esc, sizeof(esc), "\\u%04x\\u%04x", 0xd800 + (cp >> 10),
                                         0xdc00 + (cp & 0x3ff));
                        } else {
                                snprintf(esc, sizeof(esc), "\\u%04x", cp);
                        }
                        e = esc;
                }
                if (!tsr_tpl_sb_adds(c, b, e))
                        return false;
        }
        if (run && !tsr_tpl_sb_add(c, b, s.p + i - run, run))
                return false;
        return tsr_tpl_sb_addc(c, b, '"');
}

static bool json_newline(tsr_tpl_rctx *c, tsr_tpl_sb *b, const tsr_tpl_jopt *o, int level) {
        int k;
        if (!tsr_tpl_sb_addc(c, b, '\n'))
                return false;
        for (k = 0; k < level; k++)
                if (!tsr_tpl_sb_add(c, b, o->ind.p, o->ind.n))
                        return false;
        return true;
}

static int tsr_tpl_cmp_keys(tsr_tpl_rctx *c, tsr_tpl_val a, tsr_tpl_val b);
static tsr_status tsr_tpl_sort_tv(tsr_tpl_rctx *c, tsr_tpl_val *v, size_t n,
                                  int (*cmp)(tsr_tpl_rctx *, tsr_tpl_val, tsr_tpl_val, void *), void *u);

static int cmp_dict_keys(tsr_tpl_rctx *c, tsr_tpl_val a, tsr_tpl_val b, void *u) {
        const tsr_tpl_val *keys = u;
        return tsr_tpl_cmp_keys(c, keys[a.u.i], keys[b.u.i]);
}

static bool tsr_tpl_json_dump(tsr_tpl_rctx *c, tsr_tpl_sb *b, tsr_tpl_val v, const tsr_tpl_jopt *o, int level) {
        char num[48];
        size_t i;
        bool ok = true;

        switch (v.type) {
        case TSR_TPL_VAL_NONE: return tsr_tpl_sb_adds(c, b, "null");
        case TSR_TPL_VAL_BOOL: return tsr_tpl_sb_adds(c, b, v.u.b ? "true" : "false");
        case TSR_TPL_VAL_INT:
                snprintf(num, sizeof(num), "%" PRId64, v.u.i);
                return tsr_tpl_sb_adds(c, b, num);
        case TSR_TPL_VAL_FLOAT:
                if (isnan(v.u.f))
                        return tsr_tpl_sb_adds(c, b, "NaN");
                if (isinf(v.u.f))
                        return tsr_tpl_sb_adds(c, b, v.u.f < 0 ? "-Infinity" : "Infinity");
                fmt_float(v.u.f, num, sizeof(num));
                return tsr_tpl_sb_adds(c, b, num);
        case TSR_TPL_VAL_STR: return json_str(c, b, v.u.s, o->ensure_ascii);
        case TSR_TPL_VAL_LIST:
                if (v.u.l->gen) {
                        tsr_tpl_rerr(c, TSR_E_INVAL, "Object of type generator is not JSON serializable");
                        return false;
                }
                if (!v.u.l->n)
                        return tsr_tpl_sb_adds(c, b, "[]");
                if (tsr_tpl_nest_in(c) != TSR_OK)
                        return false;
                ok = tsr_tpl_sb_addc(c, b, '[') && (!o->indent || json_newline(c, b, o, level + 1));
                for (i = 0; ok && i < v.u.l->n; i++) {
                        if (i)
                                ok = tsr_tpl_sb_add(c, b, o->item_sep.p, o->item_sep.n) &&
                                     (!o->indent || json_newline(c, b, o, level + 1));
                        ok = ok && tsr_tpl_json_dump(c, b, v.u.l->v[i], o, level + 1);
                }
                ok = ok && (!o->indent || json_newline(c, b, o, level)) && tsr_tpl_sb_addc(c, b, ']');
                c->nest--;
                return ok;
        case TSR_TPL_VAL_DICT: {
                tsr_tpl_val *keys = v.u.d->k, *vals = v.u.d->v;
                size_t n = v.u.d->n;
                if (!n)
                        return tsr_tpl_sb_adds(c, b, "{}");
                if (tsr_tpl_nest_in(c) != TSR_OK)
                        return false;
                if (o->sort_keys) {
                        tsr_tpl_val *kk = tsr_tpl_ralloc(c, n * sizeof(tsr_tpl_val)),
                                    *vv = tsr_tpl_ralloc(c, n * sizeof(tsr_tpl_val)),
                                    *tmp = tsr_tpl_ralloc(c, n * sizeof(tsr_tpl_val));
                        if (!kk || !vv || !tmp)
                                return false;
                        for (i = 0; i < n; i++)
                                tmp[i] = tsr_tpl_val_int((int64_t)i);
                        if (tsr_tpl_sort_tv(c, tmp, n, cmp_dict_keys, keys) != TSR_OK)
                                return false;
                        for (i = 0; i < n; i++) {
                                kk[i] = keys[tmp[i].u.i];
                                vv[i] = vals[tmp[i].u.i];
                        }
                        keys = kk;
                        vals = vv;
                        if (c->failed)
                                return false;
                }
                ok = tsr_tpl_sb_addc(c, b, '{') && (!o->indent || json_newline(c, b, o, level + 1));
                for (i = 0; ok && i < n; i++) {
                        tsr_tpl_val k = keys[i];
                        if (i)
                                ok = tsr_tpl_sb_add(c, b, o->item_sep.p, o->item_sep.n) &&
                                     (!o->indent || json_newline(c, b, o, level + 1));
                        if (!ok)
                                break;
                        if (k.type == TSR_TPL_VAL_STR) {
                                ok = json_str(c, b, k.u.s, o->ensure_ascii);
                        } else if (k.type == TSR_TPL_VAL_NONE || k.type == TSR_TPL_VAL_BOOL ||
                                   k.type == TSR_TPL_VAL_INT || k.type == TSR_TPL_VAL_FLOAT) {
                                tsr_tpl_sb kb = {0};
                                ok = tsr_tpl_json_dump(c, &kb, k, o, level) &&
                                     json_str(c, b, tsr_tpl_sb_val(&kb).u.s, o->ensure_ascii);
                        } else {
                                tsr_tpl_rerr(c, TSR_E_INVAL, "keys must be str, int, float, bool or None, not %s",
                                             tsr_tpl_type_name(k));
                                ok = false;
                        }
                        ok = ok && tsr_tpl_sb_add(c, b, o->key_sep.p, o->key_sep.n) &&
                             tsr_tpl_json_dump(c, b, vals[i], o, level + 1);
                }
                ok = ok && (!o->indent || json_newline(c, b, o, level)) && tsr_tpl_sb_addc(c, b, '}');
                c->nest--;
                return ok;
        }
        default:
                tsr_tpl_rerr(c, TSR_E_INVAL, "Object of type %s is not JSON serializable", tsr_tpl_type_name(v));
                return false;
        }
}

static tsr_status tsr_tpl_from_json(tsr_tpl_rctx *c, const json_t *j, tsr_tpl_val *out, int depth) {
        size_t i;
        tsr_status st;

        if (depth > 512)
                return tsr_tpl_rerr(c, TSR_E_LIMIT, "context nests too deep");
        if ((st = tsr_tpl_step(c, 1)) != TSR_OK)
                return st;
        switch (json_typeof(j)) {
        case JSON_OBJECT: {
                const char *key;
                json_t *val;
                tsr_tpl_dict *d = tsr_tpl_dict_new(c);
                if (!d)
                        return c->st;
                json_object_foreach((json_t *)j, key, val) {
                        tsr_tpl_val k = tsr_tpl_val_cstr(key), v;
                        if ((st = tsr_tpl_from_json(c, val, &v, depth + 1)) != TSR_OK)
                                return st;
                        /* keys are unique in a jansson object: append without a lookup */
                        if (d->n == d->cap) {
                                size_t nc = d->cap ? d->cap * 2 : 4;
                                tsr_tpl_val *nk = tsr_tpl_ralloc(c, nc * sizeof(tsr_tpl_val)),
                                            *nv = tsr_tpl_ralloc(c, nc * sizeof(tsr_tpl_val));
                                if (!nk || !nv)
                                        return c->st;
                                if (d->n) {
                                        memcpy(nk, d->k, d->n * sizeof(tsr_tpl_val));
                                        memcpy(nv, d->v, d->n * sizeof(tsr_tpl_val));
                                }
                                d->k = nk;
                                d->v = nv;
                                d->cap = nc;
                        }
                        d->k[d->n] = k;
                        d->v[d->n] = v;
                        d->n++;
                }
                *out = tsr_tpl_val_dict(d);
                return TSR_OK;
        }
        case JSON_ARRAY: {
                tsr_tpl_list *l = tsr_tpl_list_new(c, json_array_size(j));
                if (!l)
                        return c->st;
                for (i = 0; i < json_array_size(j); i++) {
                        if ((st = tsr_tpl_from_json(c, json_array_get(j, i), &l->v[i], depth + 1)) != TSR_OK)
                                return st;
                        l->n++;
                }
                *out = tsr_tpl_val_list(l);
                return TSR_OK;
        }
        case JSON_STRING: *out = tsr_tpl_val_str(json_string_value(j), json_string_length(j)); return TSR_OK;
        case JSON_INTEGER: *out = tsr_tpl_val_int((int64_t)json_integer_value(j)); return TSR_OK;
        case JSON_REAL: *out = tsr_tpl_val_float(json_real_value(j)); return TSR_OK;
        case JSON_TRUE: *out = tsr_tpl_val_bool(true); return TSR_OK;
        case JSON_FALSE: *out = tsr_tpl_val_bool(false); return TSR_OK;
        default: *out = tsr_tpl_val_none(); return TSR_OK;
        }
}

/* ---------------------------------------------------------------- sorting, strings */

static int tsr_tpl_cmp_keys(tsr_tpl_rctx *c, tsr_tpl_val a, tsr_tpl_val b) {
        int r = 0;
        if (c->failed || tsr_tpl_val_cmp(c, a, b, "<", &r) != TSR_OK)
                return 0;
        return r;
}

/* Stable merge sort (Python's sort is stable); a comparison error stops it. */
static tsr_status tsr_tpl_sort_tv(tsr_tpl_rctx *c, tsr_tpl_val *v, size_t n,
                                  int (*cmp)(tsr_tpl_rctx *, tsr_tpl_val, tsr_tpl_val, void *), void *u) {
        tsr_tpl_val *tmp;
        size_t w, i;
        tsr_status st;

        if (n < 2)
                return TSR_OK;
        if (!(tmp = tsr_tpl_ralloc(c, n * sizeof(tsr_tpl_val))))
                return c->st;
        for (w = 1; w < n; w *= 2) {
                if ((st = tsr_tpl_step(c, n)) != TSR_OK)
                        return st;
                for (i = 0; i < n; i += 2 * w) {
                        size_t lo = i, mid = i + w < n ? i + w : n, hi = i + 2 * w < n ? i + 2 * w : n;
                        size_t a = lo, b = mid, k = lo;
                        while (a < mid && b < hi)
                                tmp[k++] = cmp(c, v[b], v[a], u) < 0 ? v[b++] : v[a++];
                        while (a < mid)
                                tmp[k++] = v[a++];
                        while (b < hi)
                                tmp[k++] = v[b++];
                }
                memcpy(v, tmp, n * sizeof(tsr_tpl_val));
                if (c->failed)
                        return c->st;
        }
        return TSR_OK;
}

static bool str_is_ascii(tsr_tpl_str s) {
        size_t i;
        for (i = 0; i < s.n; i++)
                if ((unsigned char)s.p[i] >= 0x80)
                        return false;
        return true;
}

/* Byte offsets of each code point of s, plus s.n at the end; NULL when s is ASCII. */
static tsr_status cp_offsets(tsr_tpl_rctx *c, tsr_tpl_str s, size_t **offs, size_t *ncp) {
        size_t i = 0, k = 0, *o;
        if (str_is_ascii(s)) {
                *offs = NULL;
                *ncp = s.n;
                return TSR_OK;
        }
        if (!(o = tsr_tpl_ralloc(c, (s.n + 1) * sizeof(size_t))))
                return c->st;
        while (i < s.n) {
                o[k++] = i;
                tsr_tpl_utf8_next(s.p, s.n, &i);
        }
        o[k] = s.n;
        *offs = o;
        *ncp = k;
        return TSR_OK;
}

static tsr_tpl_val tsr_tpl_str_dup(tsr_tpl_rctx *c, const char *p, size_t n) {
        char *d = tsr_tpl_ralloc(c, n + 1);
        if (!d)
                return TSR_TPL_VAL_UNDEFINED;
        memcpy(d, p, n);
        d[n] = '\0';
        return tsr_tpl_val_str(d, n);
}

/* ASCII case mapping; other code points pass through unchanged. */
static tsr_tpl_val tsr_tpl_str_map(tsr_tpl_rctx *c, tsr_tpl_str s, int mode) {
        tsr_tpl_val r = tsr_tpl_str_dup(c, s.p, s.n);
        char *d = (char *)r.u.s.p;
        size_t i;
        bool prev_cased = false, first = true;

        if (!d)
                return r;
        for (i = 0; i < s.n; i++) {
                unsigned char ch = (unsigned char)d[i];
                bool cased = isalpha(ch) != 0;
                switch (mode) {
                case 'l': d[i] = (char)tolower(ch); break;
                case 'u': d[i] = (char)toupper(ch); break;
                case 's': d[i] = (char)(islower(ch) ? toupper(ch) : tolower(ch)); break;
                case 'c': d[i] = (char)(first ? toupper(ch) : tolower(ch)); break;
                case 't': d[i] = (char)(prev_cased ? tolower(ch) : toupper(ch)); break;
                default: break;
                }
                prev_cased = cased || (ch >= 0x80 && prev_cased);
                if ((ch & 0xc0) != 0x80)
                        first = false;
        }
        return r;
}

/* jinja2's title filter: words start after runs of '-', whitespace, '(', '{', '[', '<'. */
static tsr_tpl_val tsr_tpl_jinja_title(tsr_tpl_rctx *c, tsr_tpl_str s) {
        tsr_tpl_val r = tsr_tpl_str_dup(c, s.p, s.n);
        char *d = (char *)r.u.s.p;
        size_t i = 0;
        bool start = true;

        if (!d)
                return r;
        while (i < s.n) {
                size_t st = i;
                uint32_t cp = tsr_tpl_utf8_next(s.p, s.n, &i);
                bool sep = cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' || tsr_tpl_py_isspace(cp);
                if (sep) {
                        start = true;
                        continue;
                }
                if (i - st == 1)
                        d[st] = (char)(start ? toupper((unsigned char)d[st]) : tolower((unsigned char)d[st]));
                start = false;
        }
        return r;
}

static bool in_chars(uint32_t cp, tsr_tpl_str chars) {
        size_t i = 0;
        while (i < chars.n)
                if (tsr_tpl_utf8_next(chars.p, chars.n, &i) == cp)
                        return true;
        return false;
}

/* Python str.strip family: which = 'l', 'r' or 'b'; chars NULL = whitespace. */
static tsr_tpl_str tsr_tpl_str_strip(tsr_tpl_str s, const tsr_tpl_str *chars, char which) {
        size_t a = 0, b = s.n;
        if (which != 'r') {
                while (a < b) {
                        size_t j = a;
                        uint32_t cp = tsr_tpl_utf8_next(s.p, b, &j);
                        if (chars ? !in_chars(cp, *chars) : !tsr_tpl_py_isspace(cp))
                                break;
                        a = j;
                }
        }
        if (which != 'l') {
                while (b > a) {
                        size_t st = b - 1, j;
                        uint32_t cp;
                        while (st > a && ((unsigned char)s.p[st] & 0xc0) == 0x80 && b - st < 4)
                                st--;
                        j = st;
                        cp = tsr_tpl_utf8_next(s.p, b, &j);
                        if (j != b || (chars ? !in_chars(cp, *chars) : !tsr_tpl_py_isspace(cp)))
                                break;
                        b = st;
                }
        }
        s.p += a;
        s.n = b - a;
        return s;
}

static const char *tsr_tpl_memmem_s(tsr_tpl_str hay, size_t from, tsr_tpl_str needle) {
        size_t i;
        if (needle.n == 0)
                return hay.p + from;
        if (needle.n > hay.n)
                return NULL;
        for (i = from; i + needle.n <= hay.n; i++)
                if (hay.p[i] == needle.p[0] && memcmp(hay.p + i, needle.p, needle.n) == 0)
                        return hay.p + i;
        return NULL;
}

static tsr_status tsr_tpl_str_replace(tsr_tpl_rctx *c, tsr_tpl_str s, tsr_tpl_str old, tsr_tpl_str new_, int64_t count,
                                      tsr_tpl_val *out) {
        tsr_tpl_sb b = {0};
        size_t i = 0;
        int64_t done = 0;

        if (old.n == 0) {
                /* Python inserts `new` before every code point and at the end */
                while ((count < 0 || done < count) && i <= s.n) {
                        size_t st = i;
                        if (!tsr_tpl_sb_add(c, &b, new_.p, new_.n))
                                return c->st;
                        done++;
                        if (i == s.n)
                                break;
                        tsr_tpl_utf8_next(s.p, s.n, &i);
                        if (!tsr_tpl_sb_add(c, &b, s.p + st, i - st))
                                return c->st;
                }
                if (i < s.n && !tsr_tpl_sb_add(c, &b, s.p + i, s.n - i))
                        return c->st;
                *out = tsr_tpl_sb_val(&b);
                return TSR_OK;
        }
        for (;;) {
                const char *hit = (count < 0 || done < count) ? tsr_tpl_memmem_s(s, i, old) : NULL;
                if (!hit) {
                        if (!tsr_tpl_sb_add(c, &b, s.p + i, s.n - i))
                                return c->st;
                        break;
                }
                if (!tsr_tpl_sb_add(c, &b, s.p + i, (size_t)(hit - s.p) - i) || !tsr_tpl_sb_add(c, &b, new_.p, new_.n))
                        return c->st;
                i = (size_t)(hit - s.p) + old.n;
                done++;
                if (tsr_tpl_step(c, 1) != TSR_OK)
                        return c->st;
        }
        *out = tsr_tpl_sb_val(&b);
        return TSR_OK;
}

static tsr_status tsr_tpl_str_split(tsr_tpl_rctx *c, tsr_tpl_str s, const tsr_tpl_str *sep, int64_t maxsplit,
                                    tsr_tpl_val *out) {
        tsr_tpl_list *l = tsr_tpl_list_new(c, 0);
        size_t i = 0;
        int64_t done = 0;

        if (!l)
                return c->st;
        if (sep) {
                if (!sep->n)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "empty separator");
                for (;;) {
                        const char *hit = (maxsplit < 0 || done < maxsplit) ? tsr_tpl_memmem_s(s, i, *sep) : NULL;
                        if (!hit) {
                                if (!tsr_tpl_list_push(c, l, tsr_tpl_val_str(s.p + i, s.n - i)))
                                        return c->st;
                                break;
                        }
                        if (!tsr_tpl_list_push(c, l, tsr_tpl_val_str(s.p + i, (size_t)(hit - s.p) - i)))
                                return c->st;
                        i = (size_t)(hit - s.p) + sep->n;
                        done++;
                }
        } else {
                for (;;) {
                        size_t st;
                        i += tsr_tpl_lstrip_ws_len(s.p + i, s.n - i);
                        if (i >= s.n)
                                break;
                        if (maxsplit >= 0 && done >= maxsplit) {
                                tsr_tpl_str rest = tsr_tpl_str_strip(tsr_tpl_val_str(s.p + i, s.n - i).u.s, NULL, 'r');
                                if (!tsr_tpl_list_push(c, l, tsr_tpl_val_str(rest.p, rest.n)))
                                        return c->st;
                                break;
                        }
                        st = i;
                        while (i < s.n) {
                                size_t j = i;
                                if (tsr_tpl_py_isspace(tsr_tpl_utf8_next(s.p, s.n, &j)))
                                        break;
                                i = j;
                        }
                        if (!tsr_tpl_list_push(c, l, tsr_tpl_val_str(s.p + st, i - st)))
                                return c->st;
                        done++;
                }
        }
        if (tsr_tpl_step(c, l->n) != TSR_OK)
                return c->st;
        *out = tsr_tpl_val_list(l);
        return TSR_OK;
}

/* ---------------------------------------------------------------- access */

static const char *const str_methods[] = {
        "strip", "lstrip", "rstrip", "split", "rsplit", "startswith", "endswith", "lower", "upper", "title",
        "capitalize", "swapcase", "casefold", "replace", "format", "join", "find", "rfind", "count", "index",
        "isdigit", "isalpha", "isalnum", "isspace", "islower", "isupper", "isnumeric", "isdecimal",
        "splitlines", "center", "zfill", "ljust", "rjust", NULL};
static const char *const tsr_tpl_dict_methods[] = {"items", "keys", "values", "get", "copy", NULL};
static const char *const dict_unsafe[] = {"pop", "popitem", "setdefault", "update", "clear", NULL};
static const char *const list_methods[] = {"index", "count", "copy", NULL};
static const char *const list_unsafe[] = {"append", "extend", "insert", "pop", "remove", "reverse", "sort", "clear",
                                          NULL};

static const char *tsr_tpl_find_name(const char *const *tab, tsr_tpl_str name) {
        size_t k;
        for (k = 0; tab[k]; k++)
                if (tsr_tpl_str_eq(name, tab[k]))
                        return tab[k];
        return NULL;
}

static tsr_tpl_val tsr_tpl_make_method(tsr_tpl_rctx *c, tsr_tpl_val self, const char *name) {
        tsr_tpl_val m = {.type = TSR_TPL_VAL_METHOD};
        tsr_tpl_val *s = tsr_tpl_ralloc(c, sizeof(tsr_tpl_val));
        if (!s)
                return TSR_TPL_VAL_UNDEFINED;
        *s = self;
        m.u.meth.self = s;
        m.u.meth.name = name;
        return m;
}

static tsr_tpl_val tsr_tpl_undef_named(tsr_tpl_str name) {
        tsr_tpl_val u = {.type = TSR_TPL_VAL_UNDEF};
        u.u.s = name;
        return u;
}

static tsr_status tsr_tpl_get_attr(tsr_tpl_rctx *c, tsr_tpl_val obj, tsr_tpl_str name, tsr_tpl_val *out) {
        const char *m;
        tsr_tpl_val *v;

        switch (obj.type) {
        case TSR_TPL_VAL_UNDEF: return tsr_tpl_undef_err(c, obj);
        case TSR_TPL_VAL_DICT:
                if ((m = tsr_tpl_find_name(tsr_tpl_dict_methods, name))) {
                        *out = tsr_tpl_make_method(c, obj, m);
                        return c->failed ? c->st : TSR_OK;
                }
                if (tsr_tpl_find_name(dict_unsafe, name)) {
                        *out = tsr_tpl_undef_named(name);
                        return TSR_OK;
                }
                v = tsr_tpl_dict_finds(obj.u.d, name.p, name.n);
                *out = v ? *v : tsr_tpl_undef_named(name);
                return TSR_OK;
        case TSR_TPL_VAL_NS:
                v = tsr_tpl_dict_finds(obj.u.d, name.p, name.n);
                *out = v ? *v : tsr_tpl_undef_named(name);
                return TSR_OK;
        case TSR_TPL_VAL_STR:
                if ((m = tsr_tpl_find_name(str_methods, name))) {
                        *out = tsr_tpl_make_method(c, obj, m);
                        return c->failed ? c->st : TSR_OK;
                }
                break;
        case TSR_TPL_VAL_LIST:
                if ((m = tsr_tpl_find_name(list_methods, name))) {
                        *out = tsr_tpl_make_method(c, obj, m);
                        return c->failed ? c->st : TSR_OK;
                }
                if (tsr_tpl_find_name(list_unsafe, name)) {
                        /* the immutable sandbox hides mutating methods */
                        *out = tsr_tpl_undef_named(name);
                        return TSR_OK;
                }
                break;
        case TSR_TPL_VAL_LOOP: {
                tsr_tpl_loop *l = obj.u.loop;
                int64_t len = (int64_t)l->items->n, i0 = (int64_t)l->index0;
                if (tsr_tpl_str_eq(name, "index"))
                        *out = tsr_tpl_val_int(i0 + 1);
                else if (tsr_tpl_str_eq(name, "index0"))
                        *out = tsr_tpl_val_int(i0);
                else if (tsr_tpl_str_eq(name, "revindex"))
                        *out = tsr_tpl_val_int(len - i0);
                else if (tsr_tpl_str_eq(name, "revindex0"))
                        *out = tsr_tpl_val_int(len - i0 - 1);
                else if (tsr_tpl_str_eq(name, "first"))
                        *out = tsr_tpl_val_bool(i0 == 0);
                else if (tsr_tpl_str_eq(name, "last"))
                        *out = tsr_tpl_val_bool(i0 == len - 1);
                else if (tsr_tpl_str_eq(name, "length"))
                        *out = tsr_tpl_val_int(len);
                else if (tsr_tpl_str_eq(name, "depth"))
                        *out = tsr_tpl_val_int(l->depth);
                else if (tsr_tpl_str_eq(name, "depth0"))
                        *out = tsr_tpl_val_int(l->depth - 1);
                else if (tsr_tpl_str_eq(name, "previtem"))
                        *out = i0 > 0 ? l->items->v[i0 - 1] : tsr_tpl_undef_named(name);
                else if (tsr_tpl_str_eq(name, "nextitem"))
                        *out = i0 + 1 < len ? l->items->v[i0 + 1] : tsr_tpl_undef_named(name);
                else if (tsr_tpl_str_eq(name, "cycle"))
                        *out = tsr_tpl_make_method(c, obj, "cycle");
                else
                        *out = tsr_tpl_undef_named(name);
                return c->failed ? c->st : TSR_OK;
        }
        default: break;
        }
        *out = tsr_tpl_undef_named(name);
        return TSR_OK;
}

static tsr_status slice_bounds(tsr_tpl_rctx *c, tsr_tpl_val lo, tsr_tpl_val hi, tsr_tpl_val stp, int64_t len,
                               int64_t *start, int64_t *stop, int64_t *stepv) {
        int64_t s, e, k = 1, lower, upper;
        tsr_tpl_val parts[3] = {lo, hi, stp};
        int i;

        for (i = 0; i < 3; i++)
                if (parts[i].type != TSR_TPL_VAL_NONE && !tsr_tpl_is_intlike(parts[i]))
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "slice indices must be integers or None");
        if (stp.type != TSR_TPL_VAL_NONE) {
                k = tsr_tpl_as_int(stp);
                if (k == 0)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "slice step cannot be zero");
                if (k == INT64_MIN)
                        k = -INT64_MAX;
        }
        lower = k > 0 ? 0 : -1;
        upper = k > 0 ? len : len - 1;
        if (lo.type == TSR_TPL_VAL_NONE) {
                s = k < 0 ? upper : lower;
        } else {
                s = tsr_tpl_as_int(lo);
                if (s < 0) {
                        s = s < -len ? lower : s + len;
                        if (s < lower)
                                s = lower;
                } else if (s > upper) {
                        s = upper;
                }
        }
        if (hi.type == TSR_TPL_VAL_NONE) {
                e = k < 0 ? lower : upper;
        } else {
                e = tsr_tpl_as_int(hi);
                if (e < 0) {
                        e = e < -len ? lower : e + len;
                        if (e < lower)
                                e = lower;
                } else if (e > upper) {
                        e = upper;
                }
        }
        *start = s;
        *stop = e;
        *stepv = k;
        return TSR_OK;
}

static tsr_status tsr_tpl_do_slice(tsr_tpl_rctx *c, tsr_tpl_val obj, tsr_tpl_val lo, tsr_tpl_val hi, tsr_tpl_val stp,
                                   tsr_tpl_val *out) {
        int64_t s, e, k, i, len;
        tsr_status st;

        if (obj.type == TSR_TPL_VAL_LIST) {
                tsr_tpl_list *l;
                len = (int64_t)obj.u.l->n;
                if ((st = slice_bounds(c, lo, hi, stp, len, &s, &e, &k)) != TSR_OK)
                        return st;
                if (!(l = tsr_tpl_list_new(c, 0)))
                        return c->st;
                l->tuple = obj.u.l->tuple;
                for (i = s; k > 0 ? i < e : i > e; i += k)
                        if (!tsr_tpl_list_push(c, l, obj.u.l->v[i]))
                                return c->st;
                if ((st = tsr_tpl_step(c, l->n)) != TSR_OK)
                        return st;
                *out = tsr_tpl_val_list(l);
                return TSR_OK;
        }
        if (obj.type == TSR_TPL_VAL_STR) {
                size_t *offs, ncp;
                tsr_tpl_sb b = {0};
                if ((st = cp_offsets(c, obj.u.s, &offs, &ncp)) != TSR_OK)
                        return st;
                len = (int64_t)ncp;
                if ((st = slice_bounds(c, lo, hi, stp, len, &s, &e, &k)) != TSR_OK)
                        return st;
                if (k == 1) {
                        size_t a = offs ? offs[s] : (size_t)s, z = offs ? offs[e > s ? e : s] : (size_t)(e > s ? e : s);
                        *out = tsr_tpl_val_str(obj.u.s.p + a, z - a);
                        return TSR_OK;
                }
                for (i = s; k > 0 ? i < e : i > e; i += k) {
                        size_t a = offs ? offs[i] : (size_t)i, z = offs ? offs[i + 1] : (size_t)i + 1;
                        if (!tsr_tpl_sb_add(c, &b, obj.u.s.p + a, z - a))
                                return c->st;
                }
                *out = tsr_tpl_sb_val(&b);
                return tsr_tpl_step(c, b.n);
        }
        if (obj.type == TSR_TPL_VAL_UNDEF)
                return tsr_tpl_undef_err(c, obj);
        *out = TSR_TPL_VAL_UNDEFINED;
        return TSR_OK;
}

static tsr_status tsr_tpl_get_item(tsr_tpl_rctx *c, tsr_tpl_val obj, tsr_tpl_val key, tsr_tpl_val *out) {
        tsr_tpl_val *v;
        tsr_status st;

        if (obj.type == TSR_TPL_VAL_UNDEF)
                return tsr_tpl_undef_err(c, obj);
        if (obj.type == TSR_TPL_VAL_DICT) {
                if ((v = tsr_tpl_dict_find(c, obj.u.d, key))) {
                        *out = *v;
                        return TSR_OK;
                }
        } else if (obj.type == TSR_TPL_VAL_LIST && tsr_tpl_is_intlike(key)) {
                int64_t i = tsr_tpl_as_int(key), n = (int64_t)obj.u.l->n;
                if (i < 0)
                        i += n;
                *out = i >= 0 && i < n ? obj.u.l->v[i] : TSR_TPL_VAL_UNDEFINED;
                return TSR_OK;
        } else if (obj.type == TSR_TPL_VAL_STR && tsr_tpl_is_intlike(key)) {
                size_t *offs, ncp;
                int64_t i = tsr_tpl_as_int(key);
                if ((st = cp_offsets(c, obj.u.s, &offs, &ncp)) != TSR_OK)
                        return st;
                if (i < 0)
                        i += (int64_t)ncp;
                if (i < 0 || i >= (int64_t)ncp) {
                        *out = TSR_TPL_VAL_UNDEFINED;
                        return TSR_OK;
                }
                *out = offs ? tsr_tpl_val_str(obj.u.s.p + offs[i], offs[i + 1] - offs[i])
                            : tsr_tpl_val_str(obj.u.s.p + i, 1);
                return TSR_OK;
        }
        if (key.type == TSR_TPL_VAL_STR && obj.type != TSR_TPL_VAL_DICT)
                return tsr_tpl_get_attr(c, obj, key.u.s, out);
        if (key.type == TSR_TPL_VAL_STR) {
                /* a dict without that key: jinja2 falls back to the attribute (methods) */
                const char *m = tsr_tpl_find_name(tsr_tpl_dict_methods, key.u.s);
                *out = m ? tsr_tpl_make_method(c, obj, m) : tsr_tpl_undef_named(key.u.s);
                return c->failed ? c->st : TSR_OK;
        }
        *out = TSR_TPL_VAL_UNDEFINED;
        return TSR_OK;
}

/* The values a for loop (or list(), join, ...) iterates over. */
static tsr_status tsr_tpl_iter_list(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_list **out) {
        tsr_tpl_list *l;
        size_t i;

        switch (v.type) {
        case TSR_TPL_VAL_LIST: *out = v.u.l; return TSR_OK;
        case TSR_TPL_VAL_UNDEF:
                *out = tsr_tpl_list_new(c, 0);
                return *out ? TSR_OK : c->st;
        case TSR_TPL_VAL_DICT:
                if (!(l = tsr_tpl_list_new(c, v.u.d->n)))
                        return c->st;
                for (i = 0; i < v.u.d->n; i++)
                        l->v[l->n++] = v.u.d->k[i];
                *out = l;
                return tsr_tpl_step(c, l->n);
        case TSR_TPL_VAL_STR: {
                size_t k = 0;
                if (!(l = tsr_tpl_list_new(c, v.u.s.n)))
                        return c->st;
                while (k < v.u.s.n) {
                        size_t st = k;
                        tsr_tpl_utf8_next(v.u.s.p, v.u.s.n, &k);
                        l->v[l->n++] = tsr_tpl_val_str(v.u.s.p + st, k - st);
                }
                *out = l;
                return tsr_tpl_step(c, l->n);
        }
        default: return tsr_tpl_rerr(c, TSR_E_INVAL, "'%s' object is not iterable", tsr_tpl_type_name(v));
        }
}

static tsr_status tsr_tpl_dict_items(tsr_tpl_rctx *c, tsr_tpl_dict *d, tsr_tpl_val *out) {
        tsr_tpl_list *l = tsr_tpl_list_new(c, d->n);
        size_t i;
        if (!l)
                return c->st;
        for (i = 0; i < d->n; i++) {
                tsr_tpl_list *pair = tsr_tpl_list_new(c, 2);
                if (!pair)
                        return c->st;
                pair->tuple = true;
                pair->v[0] = d->k[i];
                pair->v[1] = d->v[i];
                pair->n = 2;
                l->v[l->n++] = tsr_tpl_val_list(pair);
        }
        *out = tsr_tpl_val_list(l);
        return tsr_tpl_step(c, d->n);
}

static bool tsr_tpl_arg_get(const tsr_tpl_args *a, size_t i, const char *name, tsr_tpl_val *out) {
        size_t k;
        if (i < a->npos) {
                *out = a->pos[i];
                return true;
        }
        for (k = 0; name && k < a->nkw; k++) {
                if (tsr_tpl_str_eq(a->kwn[k], name)) {
                        *out = a->kw[k];
                        return true;
                }
        }
        return false;
}

static tsr_status tsr_tpl_arg_str(tsr_tpl_rctx *c, const tsr_tpl_args *a, size_t i, const char *name, const char *what,
                                  tsr_tpl_str *out, bool *given) {
        tsr_tpl_val v;
        *given = tsr_tpl_arg_get(a, i, name, &v) && v.type != TSR_TPL_VAL_NONE;
        if (!*given)
                return TSR_OK;
        if (v.type != TSR_TPL_VAL_STR)
                return tsr_tpl_rerr(c, TSR_E_INVAL, "%s must be a string, not %s", what, tsr_tpl_type_name(v));
        *out = v.u.s;
        return TSR_OK;
}

static tsr_status tsr_tpl_arg_int(tsr_tpl_rctx *c, const tsr_tpl_args *a, size_t i, const char *name, int64_t def,
                                  int64_t *out) {
        tsr_tpl_val v;
        if (!tsr_tpl_arg_get(a, i, name, &v) || v.type == TSR_TPL_VAL_NONE) {
                *out = def;
                return TSR_OK;
        }
        if (!tsr_tpl_is_intlike(v))
                return tsr_tpl_rerr(c, TSR_E_INVAL, "'%s' object cannot be interpreted as an integer",
                                    tsr_tpl_type_name(v));
        *out = tsr_tpl_as_int(v);
        return TSR_OK;
}

static tsr_status str_format(tsr_tpl_rctx *c, tsr_tpl_str fmt, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_tpl_sb b = {0};
        size_t i = 0, autoidx = 0;

        while (i < fmt.n) {
                char ch = fmt.p[i];
                if ((ch == '{' || ch == '}') && i + 1 < fmt.n && fmt.p[i + 1] == ch) {
                        if (!tsr_tpl_sb_addc(c, &b, ch))
                                return c->st;
                        i += 2;
                        continue;
                }
                if (ch == '{') {
                        size_t j = i + 1, k;
                        tsr_tpl_str field;
                        tsr_tpl_val v;
                        bool found = false;
                        while (j < fmt.n && fmt.p[j] != '}')
                                j++;
                        if (j >= fmt.n)
                                return tsr_tpl_rerr(c, TSR_E_INVAL, "Single '{' encountered in format string");
                        field.p = fmt.p + i + 1;
                        field.n = j - i - 1;
                        if (memchr(field.p, ':', field.n) || memchr(field.p, '!', field.n) ||
                            memchr(field.p, '.', field.n) || memchr(field.p, '[', field.n))
                                return tsr_tpl_rerr(c, TSR_E_UNSUPPORTED, "format specs are not supported");
                        if (field.n == 0) {
                                found = autoidx < a->npos;
                                if (found)
                                        v = a->pos[autoidx++];
                        } else if (isdigit((unsigned char)field.p[0])) {
                                size_t idx = (size_t)strtoul(field.p, NULL, 10);
                                found = idx < a->npos;
                                if (found)
                                        v = a->pos[idx];
                        } else {
                                for (k = 0; k < a->nkw && !found; k++) {
                                        if (a->kwn[k].n == field.n && memcmp(a->kwn[k].p, field.p, field.n) == 0) {
                                                v = a->kw[k];
                                                found = true;
                                        }
                                }
                        }
                        if (!found)
                                return tsr_tpl_rerr(c, TSR_E_INVAL, "format: no argument for '{%.*s}'", (int)field.n,
                                                    field.p);
                        if (!tsr_tpl_str_append(c, &b, v))
                                return c->st;
                        i = j + 1;
                        continue;
                }
                if (ch == '}')
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "Single '}' encountered in format string");
                if (!tsr_tpl_sb_addc(c, &b, ch))
                        return c->st;
                i++;
        }
        *out = tsr_tpl_sb_val(&b);
        return TSR_OK;
}

static tsr_status tsr_tpl_call_str_method(tsr_tpl_rctx *c, tsr_tpl_str s, const char *m, const tsr_tpl_args *a,
                                          tsr_tpl_val *out) {
        tsr_tpl_str arg, arg2;
        bool given, given2;
        tsr_status st;
        int64_t n;

        if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip")) {
                if ((st = tsr_tpl_arg_str(c, a, 0, "chars", "strip arg", &arg, &given)) != TSR_OK)
                        return st;
                arg2 = tsr_tpl_str_strip(s, given ? &arg : NULL, m[0] == 's' ? 'b' : m[0]);
                *out = tsr_tpl_val_str(arg2.p, arg2.n);
                return TSR_OK;
        }
        if (!strcmp(m, "split") || !strcmp(m, "rsplit")) {
                if ((st = tsr_tpl_arg_str(c, a, 0, "sep", "separator", &arg, &given)) != TSR_OK ||
                    (st = tsr_tpl_arg_int(c, a, 1, "maxsplit", -1, &n)) != TSR_OK)
                        return st;
                if (m[0] == 'r' && n >= 0)
                        return tsr_tpl_rerr(c, TSR_E_UNSUPPORTED, "rsplit with maxsplit is not supported");
                return tsr_tpl_str_split(c, s, given ? &arg : NULL, n, out);
        }
        if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
                tsr_tpl_val p;
                size_t k, cnt;
                bool hit = false;
                if (!tsr_tpl_arg_get(a, 0, NULL, &p))
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "%s() takes at least 1 argument (0 given)", m);
                cnt = p.type == TSR_TPL_VAL_LIST && p.u.l->tuple ? p.u.l->n : 1;
                for (k = 0; k < cnt && !hit; k++) {
                        tsr_tpl_val x = p.type == TSR_TPL_VAL_LIST && p.u.l->tuple ? p.u.l->v[k] : p;
                        if (x.type != TSR_TPL_VAL_STR)
                                return tsr_tpl_rerr(c, TSR_E_INVAL,
                                                    "%s first arg must be str or a tuple of str, not %s", m,
                                                    tsr_tpl_type_name(x));
                        if (x.u.s.n <= s.n)
                                hit = m[0] == 's' ? memcmp(s.p, x.u.s.p, x.u.s.n) == 0
                                                  : memcmp(s.p + s.n - x.u.s.n, x.u.s.p, x.u.s.n) == 0;
                }
                *out = tsr_tpl_val_bool(hit);
                return TSR_OK;
        }
        if (!strcmp(m, "lower") || !strcmp(m, "casefold")) {
                *out = tsr_tpl_str_map(c, s, 'l');
                return c->failed ? c->st : TSR_OK;
        }
        if (!strcmp(m, "upper") || !strcmp(m, "title") || !strcmp(m, "capitalize") || !strcmp(m, "swapcase")) {
                *out = tsr_tpl_str_map(c, s, m[0] == 'u' ? 'u' : m[0] == 't' ? 't' : m[0] == 'c' ? 'c' : 's');
                return c->failed ? c->st : TSR_OK;
        }
        if (!strcmp(m, "replace")) {
                if ((st = tsr_tpl_arg_str(c, a, 0, NULL, "replace arg 1", &arg, &given)) != TSR_OK ||
                    (st = tsr_tpl_arg_str(c, a, 1, NULL, "replace arg 2", &arg2, &given2)) != TSR_OK ||
                    (st = tsr_tpl_arg_int(c, a, 2, "count", -1, &n)) != TSR_OK)
                        return st;
                if (!given || !given2)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "replace expected at least 2 arguments");
                return tsr_tpl_str_replace(c, s, arg, arg2, n, out);
        }
        if (!strcmp(m, "format"))
                return str_format(c, s, a, out);
        if (!strcmp(m, "join")) {
                tsr_tpl_val it;
                tsr_tpl_list *l;
                tsr_tpl_sb b = {0};
                size_t k;
                if (!tsr_tpl_arg_get(a, 0, NULL, &it))
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "join() takes exactly one argument");
                if ((st = tsr_tpl_iter_list(c, it, &l)) != TSR_OK)
                        return st;
                for (k = 0; k < l->n; k++) {
                        if (l->v[k].type != TSR_TPL_VAL_STR)
                                return tsr_tpl_rerr(c, TSR_E_INVAL,
                                                    "sequence item %zu: expected str instance, %s found", k,
                                                    tsr_tpl_type_name(l->v[k]));
                        if ((k && !tsr_tpl_sb_add(c, &b, s.p, s.n)) ||
                            !tsr_tpl_sb_add(c, &b, l->v[k].u.s.p, l->v[k].u.s.n))
                                return c->st;
                }
                *out = tsr_tpl_sb_val(&b);
                return TSR_OK;
        }
        if (!strcmp(m, "find") || !strcmp(m, "rfind") || !strcmp(m, "index") || !strcmp(m, "count")) {
                const char *hit = NULL, *h;
                size_t from = 0;
                int64_t cnt = 0;
                if ((st = tsr_tpl_arg_str(c, a, 0, NULL, "substring", &arg, &given)) != TSR_OK)
                        return st;
                if (!given)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "%s() takes at least 1 argument", m);
                if (!strcmp(m, "count") && arg.n == 0) {
                        *out = tsr_tpl_val_int((int64_t)tsr_tpl_utf8_len(s.p, s.n) + 1);
                        return TSR_OK;
                }
                while ((h = tsr_tpl_memmem_s(s, from, arg))) {
                        if (!hit || m[0] == 'r')
                                hit = h;
                        cnt++;
                        if (m[0] == 'f' || m[0] == 'i')
                                break;
                        from = (size_t)(h - s.p) + (arg.n ? arg.n : 1);
                        if (from > s.n)
                                break;
                }
                if (m[0] == 'c') {
                        *out = tsr_tpl_val_int(cnt);
                } else if (!hit && m[0] == 'i') {
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "substring not found");
                } else {
                        *out = tsr_tpl_val_int(hit ? (int64_t)tsr_tpl_utf8_len(s.p, (size_t)(hit - s.p)) : -1);
                }
                return TSR_OK;
        }
        if (!strncmp(m, "is", 2)) {
                size_t k;
                bool ok = s.n > 0, any_cased = false;
                for (k = 0; k < s.n; k++) {
                        unsigned char ch = (unsigned char)s.p[k];
                        if (!strcmp(m, "isdigit") || !strcmp(m, "isnumeric") || !strcmp(m, "isdecimal"))
                                ok = ok && isdigit(ch);
                        else if (!strcmp(m, "isalpha"))
                                ok = ok && isalpha(ch);
                        else if (!strcmp(m, "isalnum"))
                                ok = ok && isalnum(ch);
                        else if (!strcmp(m, "isspace"))
                                ok = ok && tsr_tpl_is_ascii_ws((char)ch);
                        else if (!strcmp(m, "islower"))
                                ok = ok && !isupper(ch), any_cased = any_cased || islower(ch);
                        else if (!strcmp(m, "isupper"))
                                ok = ok && !islower(ch), any_cased = any_cased || isupper(ch);
                }
                if (!strcmp(m, "islower") || !strcmp(m, "isupper"))
                        ok = ok && any_cased;
                *out = tsr_tpl_val_bool(ok);
                return TSR_OK;
        }
        if (!strcmp(m, "splitlines")) {
                tsr_tpl_list *l = tsr_tpl_list_new(c, 0);
                size_t k = 0, st0 = 0;
                if (!l)
                        return c->st;
                while (k < s.n) {
                        if (s.p[k] == '\n' || s.p[k] == '\r') {
                                if (!tsr_tpl_list_push(c, l, tsr_tpl_val_str(s.p + st0, k - st0)))
                                        return c->st;
                                if (s.p[k] == '\r' && k + 1 < s.n && s.p[k + 1] == '\n')
                                        k++;
                                st0 = k + 1;
                        }
                        k++;
                }
                if (st0 < s.n && !tsr_tpl_list_push(c, l, tsr_tpl_val_str(s.p + st0, s.n - st0)))
                        return c->st;
                *out = tsr_tpl_val_list(l);
                return TSR_OK;
        }
        if (!strcmp(m, "center") || !strcmp(m, "ljust") || !strcmp(m, "rjust") || !strcmp(m, "zfill")) {
                int64_t width, len = (int64_t)tsr_tpl_utf8_len(s.p, s.n), pad, left, k;
                tsr_tpl_sb b = {0};
                if ((st = tsr_tpl_arg_int(c, a, 0, "width", 0, &width)) != TSR_OK)
                        return st;
                if (width > (int64_t)c->max_output)
                        return tsr_tpl_rerr(c, TSR_E_LIMIT, "padding width too large");
                pad = width > len ? width - len : 0;
                left = m[0] == 'c' ? pad / 2 + (pad & width & 1) : m[0] == 'l' ? 0 : pad;
                for (k = 0; k < left; k++)
                        if (!tsr_tpl_sb_addc(c, &b, m[0] == 'z' ? '0' : ' '))
                                return c->st;
                if (!tsr_tpl_sb_add(c, &b, s.p, s.n))
                        return c->st;
                for (k = left; k < pad; k++)
                        if (!tsr_tpl_sb_addc(c, &b, ' '))
                                return c->st;
                *out = tsr_tpl_sb_val(&b);
                return TSR_OK;
        }
        return tsr_tpl_rerr(c, TSR_E_UNSUPPORTED, "str.%s is not supported", m);
}

/* ---------------------------------------------------------------- tests and filters */

static tsr_status tsr_tpl_filter_run(tsr_tpl_rctx *c, int fid, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out);

/* bsearch comparator of a tsr_tpl_str key against a table row whose first member is its name:
 * byte order, as strcmp sorts the tables. */
static int name_cmp(const void *key, const void *elem) {
        const tsr_tpl_str *k = key;
        const char *name = *(const char *const *)elem;
        size_t n = strlen(name);
        size_t m = k->n < n ? k->n : n;
        int r = m ? memcmp(k->p, name, m) : 0;  /* an empty tsr_tpl_str may have p == NULL */
        if (r)
                return r;
        return k->n < n ? -1 : k->n > n;
}

/* Every jinja2 test takes the value and at most one argument: `x` is the first argument
 * (positional or keyword) or undefined, `have` says whether one was given. */
typedef tsr_status (*test_fn)(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out);

static tsr_status test_defined(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = v.type != TSR_TPL_VAL_UNDEF;
        return TSR_OK;
}

static tsr_status test_undefined(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = v.type == TSR_TPL_VAL_UNDEF;
        return TSR_OK;
}

static tsr_status test_none(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = v.type == TSR_TPL_VAL_NONE;
        return TSR_OK;
}

static tsr_status test_boolean(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = v.type == TSR_TPL_VAL_BOOL;
        return TSR_OK;
}

static tsr_status test_false(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = v.type == TSR_TPL_VAL_BOOL && !v.u.b;
        return TSR_OK;
}

static tsr_status test_true(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = v.type == TSR_TPL_VAL_BOOL && v.u.b;
        return TSR_OK;
}

static tsr_status test_integer(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = v.type == TSR_TPL_VAL_INT;
        return TSR_OK;
}

static tsr_status test_float(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = v.type == TSR_TPL_VAL_FLOAT;
        return TSR_OK;
}

static tsr_status test_number(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = tsr_tpl_is_num(v);
        return TSR_OK;
}

static tsr_status test_string(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = v.type == TSR_TPL_VAL_STR;
        return TSR_OK;
}

static tsr_status test_mapping(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = v.type == TSR_TPL_VAL_DICT;
        return TSR_OK;
}

static tsr_status test_iterable(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = v.type == TSR_TPL_VAL_STR || v.type == TSR_TPL_VAL_LIST || v.type == TSR_TPL_VAL_DICT ||
               v.type == TSR_TPL_VAL_UNDEF || v.type == TSR_TPL_VAL_LOOP;
        return TSR_OK;
}

static tsr_status test_sequence(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = v.type == TSR_TPL_VAL_STR || v.type == TSR_TPL_VAL_LIST || v.type == TSR_TPL_VAL_DICT ||
               v.type == TSR_TPL_VAL_UNDEF;
        return TSR_OK;
}

static tsr_status test_callable(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = v.type == TSR_TPL_VAL_MACRO || v.type == TSR_TPL_VAL_BUILTIN || v.type == TSR_TPL_VAL_METHOD;
        return TSR_OK;
}

static tsr_status test_escaped(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = false;
        return TSR_OK;
}

static tsr_status test_sameas(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        if (v.type != x.type)
                *out = false;
        else if (v.type == TSR_TPL_VAL_NONE || v.type == TSR_TPL_VAL_UNDEF)
                *out = true;
        else if (v.type == TSR_TPL_VAL_BOOL)
                *out = v.u.b == x.u.b;
        else if (v.type == TSR_TPL_VAL_LIST)
                *out = v.u.l == x.u.l;
        else if (v.type == TSR_TPL_VAL_DICT || v.type == TSR_TPL_VAL_NS)
                *out = v.u.d == x.u.d;
        else
                *out = tsr_tpl_val_eq(c, v, x);
        return TSR_OK;
}

static tsr_status test_eq(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = tsr_tpl_val_eq(c, v, x);
        return c->failed ? c->st : TSR_OK;
}

static tsr_status test_ne(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        *out = !tsr_tpl_val_eq(c, v, x);
        return c->failed ? c->st : TSR_OK;
}

/* lt, le, gt, ge: `op` is the operator's text, for tsr_tpl_val_cmp's message */
static tsr_status test_order(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, const char *op, bool *out) {
        tsr_status st;
        int r;

        if ((st = tsr_tpl_val_cmp(c, v, x, op, &r)) != TSR_OK)
                return st;
        *out = op[0] == '<' ? (op[1] ? r <= 0 : r < 0) : (op[1] ? r >= 0 : r > 0);
        return TSR_OK;
}

static tsr_status test_lt(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        return test_order(c, v, x, "<", out);
}

static tsr_status test_le(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        return test_order(c, v, x, "<=", out);
}

static tsr_status test_gt(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        return test_order(c, v, x, ">", out);
}

static tsr_status test_ge(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        return test_order(c, v, x, ">=", out);
}

/* also the `in` operator (contains) */
static tsr_status tsr_tpl_test_in(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        tsr_status st;
        size_t k;
        tsr_tpl_list *l;

        if (!have)
                return tsr_tpl_rerr(c, TSR_E_INVAL, "test 'in' needs an argument");
        if (x.type == TSR_TPL_VAL_STR) {
                if (v.type != TSR_TPL_VAL_STR)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "'in <string>' requires string as left operand, not %s",
                                    tsr_tpl_type_name(v));
                *out = tsr_tpl_memmem_s(x.u.s, 0, v.u.s) != NULL;
                return TSR_OK;
        }
        if (x.type == TSR_TPL_VAL_DICT) {
                *out = tsr_tpl_dict_find(c, x.u.d, v) != NULL;
                return TSR_OK;
        }
        if ((st = tsr_tpl_iter_list(c, x, &l)) != TSR_OK)
                return st;
        *out = false;
        for (k = 0; k < l->n && !*out; k++)
                *out = tsr_tpl_val_eq(c, v, l->v[k]);
        return tsr_tpl_step(c, l->n);
}

/* odd, even (divisor 0) and divisibleby */
static tsr_status test_divisible(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, int by, bool *out) {
        if (!tsr_tpl_is_intlike(v) && !(by == 0 && v.type == TSR_TPL_VAL_FLOAT))
                return v.type == TSR_TPL_VAL_UNDEF
                               ? tsr_tpl_undef_err(c, v)
                               : tsr_tpl_rerr(c, TSR_E_INVAL, "unsupported operand type(s) for %%: '%s' and 'int'",
                                              tsr_tpl_type_name(v));
        if (by == 0) {
                if (!tsr_tpl_is_num(x))
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "divisibleby needs a number");
                if (tsr_tpl_as_dbl(x) == 0)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "integer division or modulo by zero");
                if (tsr_tpl_is_intlike(v) && tsr_tpl_is_intlike(x))
                        *out = tsr_tpl_as_int(x) == -1 || tsr_tpl_as_int(v) % tsr_tpl_as_int(x) == 0;
                else
                        *out = fmod(tsr_tpl_as_dbl(v), tsr_tpl_as_dbl(x)) == 0;
                return TSR_OK;
        }
        *out = ((tsr_tpl_as_int(v) % 2) != 0) == (by == 1);
        return TSR_OK;
}

static tsr_status test_odd(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        return test_divisible(c, v, x, 1, out);
}

static tsr_status test_even(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        return test_divisible(c, v, x, 2, out);
}

static tsr_status test_divisibleby(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        return test_divisible(c, v, x, 0, out);
}

/* lower, upper: some cased letter, and none of the other case (ASCII only) */
static tsr_status test_case(tsr_tpl_rctx *c, tsr_tpl_val v, bool lower, bool *out) {
        tsr_status st;
        tsr_tpl_str s;
        size_t k;
        bool any = false, ok = true;

        if ((st = tsr_tpl_to_str(c, v, &s)) != TSR_OK)
                return st;
        for (k = 0; k < s.n; k++) {
                unsigned char ch = (unsigned char)s.p[k];
                if (lower ? isupper(ch) : islower(ch))
                        ok = false;
                if (isalpha(ch))
                        any = true;
        }
        *out = ok && any;
        return TSR_OK;
}

static tsr_status test_lower(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        return test_case(c, v, true, out);
}

static tsr_status test_upper(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
        return test_case(c, v, false, out);
}

/* Every test, sorted by name (strcmp order) for bsearch, as filters[] is; aliases are
 * rows with the same function. */
static const struct test_def {
        const char *name;
        test_fn fn;
} tests[] = {
        {"!=", test_ne},
        {"<", test_lt},
        {"<=", test_le},
        {"==", test_eq},
        {">", test_gt},
        {">=", test_ge},
        {"boolean", test_boolean},
        {"callable", test_callable},
        {"defined", test_defined},
        {"divisibleby", test_divisibleby},
        {"eq", test_eq},
        {"equalto", test_eq},
        {"escaped", test_escaped},
        {"even", test_even},
        {"false", test_false},
        {"float", test_float},
        {"ge", test_ge},
        {"greaterthan", test_gt},
        {"gt", test_gt},
        {"in", tsr_tpl_test_in},
        {"integer", test_integer},
        {"iterable", test_iterable},
        {"le", test_le},
        {"lessthan", test_lt},
        {"lower", test_lower},
        {"lt", test_lt},
        {"mapping", test_mapping},
        {"ne", test_ne},
        {"none", test_none},
        {"number", test_number},
        {"odd", test_odd},
        {"sameas", test_sameas},
        {"sequence", test_sequence},
        {"string", test_string},
        {"true", test_true},
        {"undefined", test_undefined},
        {"upper", test_upper},
};

static int tsr_tpl_test_find(tsr_tpl_str name) {
        const struct test_def *e;
#ifndef NDEBUG
        for (size_t k = 1; k < sizeof(tests) / sizeof(tests[0]); k++)
                assert(strcmp(tests[k - 1].name, tests[k].name) < 0);
#endif
        e = bsearch(&name, tests, sizeof(tests) / sizeof(tests[0]), sizeof(tests[0]), name_cmp);
        return e ? (int)(e - tests) : -1;
}

static tsr_status tsr_tpl_test_run(tsr_tpl_rctx *c, int id, tsr_tpl_val v, const tsr_tpl_args *a, bool *out) {
        tsr_tpl_val x = TSR_TPL_VAL_UNDEFINED;
        bool have = tsr_tpl_arg_get(a, 0, NULL, &x);
        return tests[id].fn(c, v, x, have, out);
}

/* Attribute path for map/selectattr/sort...: "a.b.0", each part through tsr_tpl_get_item. */
static tsr_status attr_path(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_str path, tsr_tpl_val *out) {
        size_t i = 0;
        tsr_status st;
        while (i <= path.n) {
                size_t j = i;
                tsr_tpl_str part;
                tsr_tpl_val key;
                bool digits = true;
                while (j < path.n && path.p[j] != '.')
                        j++;
                part.p = path.p + i;
                part.n = j - i;
                for (size_t k = 0; k < part.n; k++)
                        digits = digits && isdigit((unsigned char)part.p[k]);
                key = digits && part.n && part.n < 18 ? tsr_tpl_val_int(strtoll(part.p, NULL, 10))
                                                      : tsr_tpl_val_str(part.p, part.n);
                if ((st = tsr_tpl_get_item(c, v, key, &v)) != TSR_OK)
                        return st;
                i = j + 1;
        }
        *out = v;
        return TSR_OK;
}

typedef struct sortctx {
        bool case_sensitive;
        bool by_value;          /* dictsort by='value' */
        bool pairs;             /* items are (k, v) tuples */
        tsr_tpl_str attr;
        bool has_attr;
} sortctx;

static tsr_tpl_val fold_case(tsr_tpl_rctx *c, tsr_tpl_val v, bool case_sensitive) {
        if (!case_sensitive && v.type == TSR_TPL_VAL_STR)
                return tsr_tpl_str_map(c, v.u.s, 'l');
        return v;
}

static int cmp_sort(tsr_tpl_rctx *c, tsr_tpl_val a, tsr_tpl_val b, void *u) {
        sortctx *s = u;
        if (s->pairs) {
                a = a.u.l->v[s->by_value ? 1 : 0];
                b = b.u.l->v[s->by_value ? 1 : 0];
        } else if (s->has_attr) {
                if (attr_path(c, a, s->attr, &a) != TSR_OK || attr_path(c, b, s->attr, &b) != TSR_OK)
                        return 0;
        }
        return tsr_tpl_cmp_keys(c, fold_case(c, a, s->case_sensitive), fold_case(c, b, s->case_sensitive));
}

static tsr_status tsr_tpl_copy_list(tsr_tpl_rctx *c, tsr_tpl_list *src, tsr_tpl_list **out) {
        tsr_tpl_list *l = tsr_tpl_list_new(c, src->n);
        if (!l)
                return c->st;
        if (src->n)
                memcpy(l->v, src->v, src->n * sizeof(tsr_tpl_val));
        l->n = src->n;
        *out = l;
        return tsr_tpl_step(c, src->n);
}

/* select/reject/selectattr/rejectattr: args after the operand are
 * [attr,] [test name, test args...]. */
static tsr_status select_or_reject(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, bool with_attr, bool keep,
                                   tsr_tpl_val *out) {
        tsr_tpl_list *l, *res;
        size_t k, first = with_attr ? 1 : 0;
        tsr_tpl_str attr = {0};
        int tid = -1;
        tsr_tpl_args targs = {0};
        tsr_status st;

        /* jinja2's _select_or_reject yields nothing for a false value (None, undefined, an
         * empty sequence) without looking at its arguments */
        if (!tsr_tpl_truthy(v)) {
                if (!(res = tsr_tpl_list_new(c, 0)))
                        return c->st;
                res->gen = true;
                *out = tsr_tpl_val_list(res);
                return TSR_OK;
        }
        if (with_attr) {
                if (a->npos < 1 || a->pos[0].type != TSR_TPL_VAL_STR)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "selectattr/rejectattr need an attribute name");
                attr = a->pos[0].u.s;
        }
        if (a->npos > first) {
                if (a->pos[first].type != TSR_TPL_VAL_STR)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "test name must be a string");
                tid = tsr_tpl_test_find(a->pos[first].u.s);
                if (tid < 0)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "No test named '%.*s'.", (int)a->pos[first].u.s.n,
                                    a->pos[first].u.s.p);
                targs.pos = a->pos + first + 1;
                targs.npos = a->npos - first - 1;
        }
        if ((st = tsr_tpl_iter_list(c, v, &l)) != TSR_OK || !(res = tsr_tpl_list_new(c, 0)))
                return c->failed ? c->st : st;
        for (k = 0; k < l->n; k++) {
                tsr_tpl_val item = l->v[k], x = item;
                bool ok;
                if (with_attr && (st = attr_path(c, item, attr, &x)) != TSR_OK)
                        return st;
                if (tid >= 0) {
                        if ((st = tsr_tpl_test_run(c, tid, x, &targs, &ok)) != TSR_OK)
                                return st;
                } else {
                        ok = tsr_tpl_truthy(x);
                }
                if (ok == keep && !tsr_tpl_list_push(c, res, item))
                        return c->st;
        }
        res->gen = true;
        *out = tsr_tpl_val_list(res);
        return tsr_tpl_step(c, l->n);
}

static tsr_status filter_map(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_tpl_list *l, *res;
        size_t k;
        tsr_tpl_val attr, def = TSR_TPL_VAL_UNDEFINED;
        bool has_def = false;
        tsr_status st;
        int fid = -1;
        tsr_tpl_args fargs = {0};

        if (!tsr_tpl_truthy(v)) {       /* do_map: "if value:", as for select */
                if (!(res = tsr_tpl_list_new(c, 0)))
                        return c->st;
                res->gen = true;
                *out = tsr_tpl_val_list(res);
                return TSR_OK;
        }
        if ((st = tsr_tpl_iter_list(c, v, &l)) != TSR_OK || !(res = tsr_tpl_list_new(c, l->n)))
                return c->failed ? c->st : st;
        if (a->npos == 0 && tsr_tpl_arg_get(a, 99, "attribute", &attr)) {
                if (attr.type != TSR_TPL_VAL_STR)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "map attribute must be a string");
                has_def = tsr_tpl_arg_get(a, 99, "default", &def);
        } else {
                if (a->npos < 1 || a->pos[0].type != TSR_TPL_VAL_STR)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "map needs a filter name or attribute=");
                fid = tsr_tpl_filter_find(a->pos[0].u.s);
                if (fid < 0)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "No filter named '%.*s'.", (int)a->pos[0].u.s.n,
                                            a->pos[0].u.s.p);
                fargs.pos = a->pos + 1;
                fargs.npos = a->npos - 1;
                fargs.kw = a->kw;
                fargs.kwn = a->kwn;
                fargs.nkw = a->nkw;
        }
        for (k = 0; k < l->n; k++) {
                tsr_tpl_val x;
                if (fid < 0) {
                        if ((st = attr_path(c, l->v[k], attr.u.s, &x)) != TSR_OK)
                                return st;
                        if (x.type == TSR_TPL_VAL_UNDEF && has_def)
                                x = def;
                } else if ((st = tsr_tpl_filter_run(c, fid, l->v[k], &fargs, &x)) != TSR_OK) {
                        return st;
                }
                res->v[res->n++] = x;
        }
        res->gen = true;
        *out = tsr_tpl_val_list(res);
        return tsr_tpl_step(c, l->n);
}

static tsr_status filter_tojson(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_tpl_jopt o = {0};
        tsr_tpl_val x;
        tsr_tpl_sb b = {0};
        char *spaces;

        o.item_sep = tsr_tpl_val_cstr(", ").u.s;
        o.key_sep = tsr_tpl_val_cstr(": ").u.s;
        if (tsr_tpl_arg_get(a, 0, "ensure_ascii", &x))
                o.ensure_ascii = tsr_tpl_truthy(x);
        if (tsr_tpl_arg_get(a, 1, "indent", &x) && x.type != TSR_TPL_VAL_NONE) {
                o.indent = true;
                o.item_sep = tsr_tpl_val_cstr(",").u.s;
                if (x.type == TSR_TPL_VAL_STR) {
                        o.ind = x.u.s;
                } else if (tsr_tpl_is_intlike(x)) {
                        int64_t n = tsr_tpl_as_int(x);
                        if (n > 1024)
                                return tsr_tpl_rerr(c, TSR_E_LIMIT, "tojson indent too large");
                        if (n < 0)
                                n = 0;
                        if (!(spaces = tsr_tpl_ralloc(c, (size_t)n + 1)))
                                return c->st;
                        memset(spaces, ' ', (size_t)n);
                        o.ind.p = spaces;
                        o.ind.n = (size_t)n;
                } else {
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "tojson indent must be an int or a string");
                }
        }
        if (tsr_tpl_arg_get(a, 2, "separators", &x) && x.type != TSR_TPL_VAL_NONE) {
                if (x.type != TSR_TPL_VAL_LIST || x.u.l->n != 2 || x.u.l->v[0].type != TSR_TPL_VAL_STR ||
                    x.u.l->v[1].type != TSR_TPL_VAL_STR)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "tojson separators must be a pair of strings");
                o.item_sep = x.u.l->v[0].u.s;
                o.key_sep = x.u.l->v[1].u.s;
        }
        if (tsr_tpl_arg_get(a, 3, "sort_keys", &x))
                o.sort_keys = tsr_tpl_truthy(x);
        if (!tsr_tpl_json_dump(c, &b, v, &o, 0))
                return c->failed ? c->st : tsr_tpl_oom(c);
        *out = tsr_tpl_sb_val(&b);
        return tsr_tpl_step(c, b.n / 64);
}

static tsr_status to_number(tsr_tpl_rctx *c, tsr_tpl_val v, bool want_float, tsr_tpl_val def, tsr_tpl_val *out) {
        (void)c;
        if (v.type == TSR_TPL_VAL_INT || v.type == TSR_TPL_VAL_BOOL) {
                *out = want_float ? tsr_tpl_val_float((double)tsr_tpl_as_int(v)) : tsr_tpl_val_int(tsr_tpl_as_int(v));
        } else if (v.type == TSR_TPL_VAL_FLOAT) {
                if (want_float)
                        *out = v;
                else if (isfinite(v.u.f) && fabs(v.u.f) < 9.2e18)
                        *out = tsr_tpl_val_int((int64_t)v.u.f);
                else
                        *out = def;
        } else if (v.type == TSR_TPL_VAL_STR) {
                char buf[64], *end;
                tsr_tpl_str s = tsr_tpl_str_strip(v.u.s, NULL, 'b');
                size_t k, m = 0;
                if (s.n == 0 || s.n >= sizeof(buf)) {
                        *out = def;
                        return TSR_OK;
                }
                for (k = 0; k < s.n; k++)
                        if (s.p[k] != '_')
                                buf[m++] = s.p[k];
                buf[m] = '\0';
                if (!want_float) {
                        long long ll;
                        errno = 0;
                        ll = strtoll(buf, &end, 10);
                        if (!*end && errno == 0) {
                                *out = tsr_tpl_val_int(ll);
                                return TSR_OK;
                        }
                }
                {
                        double d = strtod(buf, &end);
                        if (*end || (isdigit((unsigned char)buf[0]) == 0 && buf[0] != '-' && buf[0] != '+' &&
                                     buf[0] != '.' && !isalpha((unsigned char)buf[0]))) {
                                *out = def;
                        } else if (want_float) {
                                *out = tsr_tpl_val_float(d);
                        } else if (isfinite(d) && fabs(d) < 9.2e18) {
                                *out = tsr_tpl_val_int((int64_t)d);
                        } else {
                                *out = def;
                        }
                }
        } else {
                *out = def;
        }
        return TSR_OK;
}

/* Length of the line break str.splitlines() sees at p (\n, \r\n, \r, \v, \f, \x1c-\x1e,
 * U+0085, U+2028, U+2029), or 0. */
static size_t py_linebreak(const char *p, size_t n) {
        unsigned char c0 = (unsigned char)p[0];

        if (c0 == '\r')
                return n > 1 && p[1] == '\n' ? 2 : 1;
        if (c0 == '\n' || c0 == '\v' || c0 == '\f' || (c0 >= 0x1c && c0 <= 0x1e))
                return 1;
        if (n > 1 && c0 == 0xC2 && (unsigned char)p[1] == 0x85)
                return 2;
        if (n > 2 && c0 == 0xE2 && (unsigned char)p[1] == 0x80 &&
            ((unsigned char)p[2] == 0xA8 || (unsigned char)p[2] == 0xA9))
                return 3;
        return 0;
}

static tsr_status filter_str(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out, bool markup) {
        tsr_status st;
        tsr_tpl_str s;

        if ((st = tsr_tpl_to_str(c, v, &s)) != TSR_OK)
                return st;
        *out = tsr_tpl_val_str(s.p, s.n);
        /* safe makes a Markup; string (soft_str) keeps one */
        out->markup = markup || (v.type == TSR_TPL_VAL_STR && v.markup);
        return TSR_OK;
}

static tsr_status filter_safe(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return filter_str(c, v, a, out, true);
}

static tsr_status filter_string(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return filter_str(c, v, a, out, false);
}

static tsr_status filter_trim(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_status st;
        tsr_tpl_str s, arg;
        bool given;

        if ((st = tsr_tpl_to_str(c, v, &s)) != TSR_OK ||
            (st = tsr_tpl_arg_str(c, a, 0, "chars", "trim chars", &arg, &given)) != TSR_OK)
                return st;
        s = tsr_tpl_str_strip(s, given ? &arg : NULL, 'b');
        *out = tsr_tpl_val_str(s.p, s.n);
        return TSR_OK;
}

static tsr_status filter_length(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        switch (v.type) {
        case TSR_TPL_VAL_STR: *out = tsr_tpl_val_int((int64_t)tsr_tpl_utf8_len(v.u.s.p, v.u.s.n)); return TSR_OK;
        case TSR_TPL_VAL_LIST:
                if (v.u.l->gen)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "object of type 'generator' has no len()");
                *out = tsr_tpl_val_int((int64_t)v.u.l->n);
                return TSR_OK;
        case TSR_TPL_VAL_DICT: *out = tsr_tpl_val_int((int64_t)v.u.d->n); return TSR_OK;
        case TSR_TPL_VAL_UNDEF: *out = tsr_tpl_val_int(0); return TSR_OK;
        default: return tsr_tpl_rerr(c, TSR_E_INVAL, "object of type '%s' has no len()", tsr_tpl_type_name(v));
        }
}

static tsr_status filter_default(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_tpl_val def = tsr_tpl_val_str("", 0), b = tsr_tpl_val_bool(false);

        tsr_tpl_arg_get(a, 0, "default_value", &def);
        tsr_tpl_arg_get(a, 1, "boolean", &b);
        *out = (v.type == TSR_TPL_VAL_UNDEF || (tsr_tpl_truthy(b) && !tsr_tpl_truthy(v))) ? def : v;
        return TSR_OK;
}

static tsr_status filter_case(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out, int mode) {
        tsr_status st;
        tsr_tpl_str s;

        if ((st = tsr_tpl_to_str(c, v, &s)) != TSR_OK)
                return st;
        *out = tsr_tpl_str_map(c, s, mode);
        return c->failed ? c->st : TSR_OK;
}

static tsr_status filter_upper(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return filter_case(c, v, a, out, 'u');
}

static tsr_status filter_lower(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return filter_case(c, v, a, out, 'l');
}

static tsr_status filter_capitalize(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return filter_case(c, v, a, out, 'c');
}

static tsr_status filter_title(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_status st;
        tsr_tpl_str s;

        if ((st = tsr_tpl_to_str(c, v, &s)) != TSR_OK)
                return st;
        *out = tsr_tpl_jinja_title(c, s);
        return c->failed ? c->st : TSR_OK;
}

static tsr_status filter_replace(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_status st;
        tsr_tpl_str s, arg, arg2;
        bool given, given2;
        int64_t n;

        if ((st = tsr_tpl_to_str(c, v, &s)) != TSR_OK ||
            (st = tsr_tpl_arg_str(c, a, 0, "old", "replace old", &arg, &given)) != TSR_OK ||
            (st = tsr_tpl_arg_str(c, a, 1, "new", "replace new", &arg2, &given2)) != TSR_OK ||
            (st = tsr_tpl_arg_int(c, a, 2, "count", -1, &n)) != TSR_OK)
                return st;
        if (!given || !given2)
                return tsr_tpl_rerr(c, TSR_E_INVAL, "replace needs old and new");
        return tsr_tpl_str_replace(c, s, arg, arg2, n, out);
}

static tsr_status filter_join(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_status st;
        tsr_tpl_str arg;
        tsr_tpl_list *l;
        bool given;
        size_t k;
        tsr_tpl_sb b = {0};
        tsr_tpl_val attr;
        bool has_attr = tsr_tpl_arg_get(a, 1, "attribute", &attr) && attr.type == TSR_TPL_VAL_STR;

        arg.p = "";
        arg.n = 0;
        if ((st = tsr_tpl_arg_str(c, a, 0, "d", "join separator", &arg, &given)) != TSR_OK ||
            (st = tsr_tpl_iter_list(c, v, &l)) != TSR_OK)
                return st;
        for (k = 0; k < l->n; k++) {
                tsr_tpl_val item = l->v[k];
                if (has_attr && (st = attr_path(c, item, attr.u.s, &item)) != TSR_OK)
                        return st;
                if ((k && !tsr_tpl_sb_add(c, &b, arg.p, arg.n)) || !tsr_tpl_str_append(c, &b, item))
                        return c->st;
        }
        *out = tsr_tpl_sb_val(&b);
        return tsr_tpl_step(c, l->n);
}

static tsr_status filter_end(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out, bool last) {
        tsr_status st;
        tsr_tpl_list *l;

        if ((st = tsr_tpl_iter_list(c, v, &l)) != TSR_OK)
                return st;
        *out = l->n ? l->v[last ? l->n - 1 : 0] : TSR_TPL_VAL_UNDEFINED;
        return TSR_OK;
}

static tsr_status filter_first(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return filter_end(c, v, a, out, false);
}

static tsr_status filter_last(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return filter_end(c, v, a, out, true);
}

static tsr_status filter_items(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        if (v.type == TSR_TPL_VAL_UNDEF) {
                *out = tsr_tpl_val_list(tsr_tpl_list_new(c, 0));
                return c->failed ? c->st : TSR_OK;
        }
        if (v.type != TSR_TPL_VAL_DICT)
                return tsr_tpl_rerr(c, TSR_E_INVAL, "Can only get item pairs from a mapping.");
        return tsr_tpl_dict_items(c, v.u.d, out);
}

static tsr_status filter_list(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_status st;
        tsr_tpl_list *l;

        if ((st = tsr_tpl_iter_list(c, v, &l)) != TSR_OK || (st = tsr_tpl_copy_list(c, l, &l)) != TSR_OK)
                return st;
        *out = tsr_tpl_val_list(l);
        return TSR_OK;
}

static tsr_status filter_reverse(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_status st;
        tsr_tpl_list *l;
        tsr_tpl_val x;
        size_t k;

        if (v.type == TSR_TPL_VAL_STR) {
                tsr_tpl_sb b = {0};
                size_t i = v.u.s.n;
                while (i > 0) {
                        size_t st0 = i - 1;
                        while (st0 > 0 && ((unsigned char)v.u.s.p[st0] & 0xc0) == 0x80 && i - st0 < 4)
                                st0--;
                        if (!tsr_tpl_sb_add(c, &b, v.u.s.p + st0, i - st0))
                                return c->st;
                        i = st0;
                }
                *out = tsr_tpl_sb_val(&b);
                return TSR_OK;
        }
        if ((st = tsr_tpl_iter_list(c, v, &l)) != TSR_OK || (st = tsr_tpl_copy_list(c, l, &l)) != TSR_OK)
                return st;
        for (k = 0; k < l->n / 2; k++) {
                x = l->v[k];
                l->v[k] = l->v[l->n - 1 - k];
                l->v[l->n - 1 - k] = x;
        }
        *out = tsr_tpl_val_list(l);
        return TSR_OK;
}

static tsr_status filter_select(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return select_or_reject(c, v, a, false, true, out);
}

static tsr_status filter_reject(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return select_or_reject(c, v, a, false, false, out);
}

static tsr_status filter_selectattr(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return select_or_reject(c, v, a, true, true, out);
}

static tsr_status filter_rejectattr(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return select_or_reject(c, v, a, true, false, out);
}

static tsr_status filter_unique(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_status st;
        tsr_tpl_list *l;
        size_t k;
        tsr_tpl_list *res;
        tsr_tpl_val cs = tsr_tpl_val_bool(false), attr;
        bool has_attr;

        tsr_tpl_arg_get(a, 0, "case_sensitive", &cs);
        has_attr = tsr_tpl_arg_get(a, 1, "attribute", &attr) && attr.type == TSR_TPL_VAL_STR;
        if ((st = tsr_tpl_iter_list(c, v, &l)) != TSR_OK || !(res = tsr_tpl_list_new(c, 0)))
                return c->failed ? c->st : st;
        {
                tsr_tpl_list *seen = tsr_tpl_list_new(c, 0);
                if (!seen)
                        return c->st;
                for (k = 0; k < l->n; k++) {
                        tsr_tpl_val key = l->v[k];
                        size_t j;
                        bool dup = false;
                        if (has_attr && (st = attr_path(c, key, attr.u.s, &key)) != TSR_OK)
                                return st;
                        key = fold_case(c, key, tsr_tpl_truthy(cs));
                        for (j = 0; j < seen->n && !dup; j++)
                                dup = tsr_tpl_val_eq(c, seen->v[j], key);
                        if ((st = tsr_tpl_step(c, seen->n)) != TSR_OK)
                                return st;
                        if (!dup && (!tsr_tpl_list_push(c, seen, key) || !tsr_tpl_list_push(c, res, l->v[k])))
                                return c->st;
                }
        }
        *out = tsr_tpl_val_list(res);
        return TSR_OK;
}

static tsr_status filter_sorted(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out, bool dict) {
        tsr_status st;
        tsr_tpl_list *l;
        tsr_tpl_val x;
        sortctx sc = {0};
        tsr_tpl_val rev = tsr_tpl_val_bool(false), cs = tsr_tpl_val_bool(false), attr, by;

        if (!dict) {
                tsr_tpl_arg_get(a, 0, "reverse", &rev);
                tsr_tpl_arg_get(a, 1, "case_sensitive", &cs);
                sc.has_attr = tsr_tpl_arg_get(a, 2, "attribute", &attr) && attr.type == TSR_TPL_VAL_STR;
                if (sc.has_attr)
                        sc.attr = attr.u.s;
                if ((st = tsr_tpl_iter_list(c, v, &l)) != TSR_OK || (st = tsr_tpl_copy_list(c, l, &l)) != TSR_OK)
                        return st;
        } else {
                tsr_tpl_arg_get(a, 0, "case_sensitive", &cs);
                if (tsr_tpl_arg_get(a, 1, "by", &by)) {
                        if (by.type == TSR_TPL_VAL_STR && tsr_tpl_str_eq(by.u.s, "value"))
                                sc.by_value = true;
                        else if (!(by.type == TSR_TPL_VAL_STR && tsr_tpl_str_eq(by.u.s, "key")))
                                return tsr_tpl_rerr(c, TSR_E_INVAL, "You can only sort by either \"key\" or \"value\"");
                }
                tsr_tpl_arg_get(a, 2, "reverse", &rev);
                if (v.type != TSR_TPL_VAL_DICT)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "dictsort needs a mapping");
                if ((st = tsr_tpl_dict_items(c, v.u.d, &x)) != TSR_OK)
                        return st;
                l = x.u.l;
                sc.pairs = true;
        }
        sc.case_sensitive = tsr_tpl_truthy(cs);
        if ((st = tsr_tpl_sort_tv(c, l->v, l->n, cmp_sort, &sc)) != TSR_OK)
                return st;
        if (tsr_tpl_truthy(rev) && l->n > 1) {
                /* Python sorts with reverse=True stably: equal items keep their order.
                 * An empty list may have no storage, and memcpy from NULL is undefined
                 * even for zero bytes. */
                tsr_tpl_val *tmp = tsr_tpl_ralloc(c, (l->n ? l->n : 1) * sizeof(tsr_tpl_val));
                size_t i = 0, j;
                if (!tmp)
                        return c->st;
                while (i < l->n) {
                        j = i + 1;
                        while (j < l->n && cmp_sort(c, l->v[i], l->v[j], &sc) == 0)
                                j++;
                        memcpy(tmp + (l->n - j), l->v + i, (j - i) * sizeof(tsr_tpl_val));
                        i = j;
                }
                memcpy(l->v, tmp, l->n * sizeof(tsr_tpl_val));
        }
        *out = tsr_tpl_val_list(l);
        return c->failed ? c->st : TSR_OK;
}

static tsr_status filter_sort(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return filter_sorted(c, v, a, out, false);
}

static tsr_status filter_dictsort(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return filter_sorted(c, v, a, out, true);
}

static tsr_status filter_number(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out,
                                bool want_float) {
        tsr_tpl_val def = want_float ? tsr_tpl_val_float(0.0) : tsr_tpl_val_int(0);

        tsr_tpl_arg_get(a, 0, "default", &def);
        return to_number(c, v, want_float, def, out);
}

static tsr_status filter_int(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return filter_number(c, v, a, out, false);
}

static tsr_status filter_float(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return filter_number(c, v, a, out, true);
}

static tsr_status filter_abs(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        if (v.type == TSR_TPL_VAL_FLOAT)
                *out = tsr_tpl_val_float(fabs(v.u.f));
        else if (tsr_tpl_is_intlike(v) && tsr_tpl_as_int(v) != INT64_MIN)
                *out = tsr_tpl_val_int(tsr_tpl_as_int(v) < 0 ? -tsr_tpl_as_int(v) : tsr_tpl_as_int(v));
        else
                return tsr_tpl_rerr(c, TSR_E_INVAL, "bad operand type for abs(): '%s'", tsr_tpl_type_name(v));
        return TSR_OK;
}

static tsr_status filter_round(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_status st;
        int64_t prec;
        tsr_tpl_val method = tsr_tpl_val_cstr("common");
        double d, m;

        if (!tsr_tpl_is_num(v))
                return tsr_tpl_rerr(c, TSR_E_INVAL, "round needs a number");
        if ((st = tsr_tpl_arg_int(c, a, 0, "precision", 0, &prec)) != TSR_OK)
                return st;
        tsr_tpl_arg_get(a, 1, "method", &method);
        if (prec > 300 || prec < -300)
                return tsr_tpl_rerr(c, TSR_E_INVAL, "round precision out of range");
        d = tsr_tpl_as_dbl(v);
        m = pow(10.0, (double)prec);
        if (method.type == TSR_TPL_VAL_STR && tsr_tpl_str_eq(method.u.s, "ceil"))
                d = ceil(d * m) / m;
        else if (method.type == TSR_TPL_VAL_STR && tsr_tpl_str_eq(method.u.s, "floor"))
                d = floor(d * m) / m;
        else if (method.type == TSR_TPL_VAL_STR && tsr_tpl_str_eq(method.u.s, "common"))
                d = nearbyint(d * m) / m;
        else
                return tsr_tpl_rerr(c, TSR_E_INVAL, "method must be common, ceil or floor");
        *out = tsr_tpl_val_float(d);
        return TSR_OK;
}

static tsr_status tsr_tpl_filter_escape(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_status st;
        tsr_tpl_str s;
        size_t k;
        tsr_tpl_sb b = {0};

        if (v.type == TSR_TPL_VAL_STR && v.markup) {  /* Markup is not escaped twice */
                *out = v;
                return TSR_OK;
        }
        if ((st = tsr_tpl_to_str(c, v, &s)) != TSR_OK)
                return st;
        for (k = 0; k < s.n; k++) {
                const char *e = NULL;
                switch (s.p[k]) {
                case '&': e = "&amp;"; break;
                case '<': e = "&lt;"; break;
                case '>': e = "&gt;"; break;
                case '"': e = "&#34;"; break;
                case '\'': e = "&#39;"; break;
                default: break;
                }
                if (e ? !tsr_tpl_sb_adds(c, &b, e) : !tsr_tpl_sb_addc(c, &b, s.p[k]))
                        return c->st;
        }
        *out = tsr_tpl_sb_val(&b);
        out->markup = 1;
        return TSR_OK;
}

static tsr_status filter_indent(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_status st;
        tsr_tpl_str s;
        tsr_tpl_sb b = {0};
        tsr_tpl_val w = tsr_tpl_val_int(4), first = tsr_tpl_val_bool(false), blank = tsr_tpl_val_bool(false);
        tsr_tpl_str ind;
        size_t i = 0;
        bool line0 = true;

        tsr_tpl_arg_get(a, 0, "width", &w);
        tsr_tpl_arg_get(a, 1, "first", &first);
        tsr_tpl_arg_get(a, 2, "blank", &blank);
        if ((st = tsr_tpl_to_str(c, v, &s)) != TSR_OK)
                return st;
        if (w.type == TSR_TPL_VAL_STR) {
                ind = w.u.s;
        } else if (tsr_tpl_is_intlike(w)) {
                int64_t n = tsr_tpl_as_int(w) < 0 ? 0 : tsr_tpl_as_int(w);
                char *sp;
                if (n > 1024)
                        return tsr_tpl_rerr(c, TSR_E_LIMIT, "indent width too large");
                if (!(sp = tsr_tpl_ralloc(c, (size_t)n + 1)))
                        return c->st;
                memset(sp, ' ', (size_t)n);
                ind.p = sp;
                ind.n = (size_t)n;
        } else {
                return tsr_tpl_rerr(c, TSR_E_INVAL, "indent width must be an int or a string");
        }
        if (tsr_tpl_truthy(first) && !tsr_tpl_sb_add(c, &b, ind.p, ind.n))
                return c->st;
        /* (s + "\n").splitlines(): Python's line breaks, and a break at the very end
         * leaves one more, empty, line; each line but the first is indented when it is
         * not blank (or always with blank=True); lines join with "\n". */
        for (;;) {
                size_t st0 = i, e, brk = 0;
                while (i < s.n && !(brk = py_linebreak(s.p + i, s.n - i)))
                        i++;
                e = i;
                i += brk;
                if (!line0 && !tsr_tpl_sb_addc(c, &b, '\n'))
                        return c->st;
                if (!line0 && (e > st0 || tsr_tpl_truthy(blank)) && !tsr_tpl_sb_add(c, &b, ind.p, ind.n))
                        return c->st;
                if (!tsr_tpl_sb_add(c, &b, s.p + st0, e - st0))
                        return c->st;
                line0 = false;
                if (!brk)
                        break;
        }
        *out = tsr_tpl_sb_val(&b);
        return TSR_OK;
}

static tsr_status filter_sum(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_status st;
        tsr_tpl_list *l;
        size_t k;
        tsr_tpl_val acc = tsr_tpl_val_int(0), attr;
        bool has_attr = tsr_tpl_arg_get(a, 0, "attribute", &attr) && attr.type == TSR_TPL_VAL_STR;

        tsr_tpl_arg_get(a, 1, "start", &acc);
        if ((st = tsr_tpl_iter_list(c, v, &l)) != TSR_OK)
                return st;
        for (k = 0; k < l->n; k++) {
                tsr_tpl_val item = l->v[k];
                if (has_attr && (st = attr_path(c, item, attr.u.s, &item)) != TSR_OK)
                        return st;
                if (!tsr_tpl_is_num(item) || !tsr_tpl_is_num(acc))
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "unsupported operand type(s) for +: '%s' and '%s'",
                                    tsr_tpl_type_name(acc), tsr_tpl_type_name(item));
                if (acc.type == TSR_TPL_VAL_FLOAT || item.type == TSR_TPL_VAL_FLOAT) {
                        acc = tsr_tpl_val_float(tsr_tpl_as_dbl(acc) + tsr_tpl_as_dbl(item));
                } else {
                        int64_t r;
                        if (__builtin_add_overflow(tsr_tpl_as_int(acc), tsr_tpl_as_int(item), &r))
                                return tsr_tpl_rerr(c, TSR_E_INVAL, "integer overflow");
                        acc = tsr_tpl_val_int(r);
                }
        }
        *out = acc;
        return tsr_tpl_step(c, l->n);
}

static tsr_status filter_extreme(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out, bool max) {
        tsr_status st;
        tsr_tpl_list *l;
        tsr_tpl_val x;
        size_t k;
        sortctx sc = {0};
        tsr_tpl_val cs = tsr_tpl_val_bool(false), attr;

        tsr_tpl_arg_get(a, 0, "case_sensitive", &cs);
        sc.case_sensitive = tsr_tpl_truthy(cs);
        sc.has_attr = tsr_tpl_arg_get(a, 1, "attribute", &attr) && attr.type == TSR_TPL_VAL_STR;
        if (sc.has_attr)
                sc.attr = attr.u.s;
        if ((st = tsr_tpl_iter_list(c, v, &l)) != TSR_OK)
                return st;
        if (!l->n) {
                *out = TSR_TPL_VAL_UNDEFINED;
                return TSR_OK;
        }
        x = l->v[0];
        for (k = 1; k < l->n; k++) {
                int r = cmp_sort(c, l->v[k], x, &sc);
                if (max ? r > 0 : r < 0)
                        x = l->v[k];
        }
        *out = x;
        return c->failed ? c->st : tsr_tpl_step(c, l->n);
}

static tsr_status filter_min(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return filter_extreme(c, v, a, out, false);
}

static tsr_status filter_max(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return filter_extreme(c, v, a, out, true);
}

static tsr_status filter_batch(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_status st;
        tsr_tpl_list *l;
        size_t k;
        int64_t n;
        tsr_tpl_val fill;
        bool has_fill = tsr_tpl_arg_get(a, 1, "fill_with", &fill) && fill.type != TSR_TPL_VAL_NONE;
        tsr_tpl_list *res, *cur_ = NULL;

        if ((st = tsr_tpl_arg_int(c, a, 0, "linecount", 1, &n)) != TSR_OK)
                return st;
        if (n <= 0)
                return tsr_tpl_rerr(c, TSR_E_INVAL, "batch size must be positive");
        if ((st = tsr_tpl_iter_list(c, v, &l)) != TSR_OK || !(res = tsr_tpl_list_new(c, 0)))
                return c->failed ? c->st : st;
        for (k = 0; k < l->n; k++) {
                if (!cur_ || (int64_t)cur_->n == n) {
                        if (!(cur_ = tsr_tpl_list_new(c, 0)) || !tsr_tpl_list_push(c, res, tsr_tpl_val_list(cur_)))
                                return c->st;
                }
                if (!tsr_tpl_list_push(c, cur_, l->v[k]))
                        return c->st;
        }
        while (has_fill && cur_ && (int64_t)cur_->n < n)
                if (!tsr_tpl_list_push(c, cur_, fill))
                        return c->st;
        *out = tsr_tpl_val_list(res);
        return tsr_tpl_step(c, l->n);
}

static tsr_status filter_wordcount(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_status st;
        tsr_tpl_str s;
        size_t k;
        int64_t words = 0;
        bool in = false;

        if ((st = tsr_tpl_to_str(c, v, &s)) != TSR_OK)
                return st;
        for (k = 0; k < s.n; k++) {
                unsigned char ch = (unsigned char)s.p[k];
                bool w = isalnum(ch) || ch == '_' || ch >= 0x80;
                if (w && !in)
                        words++;
                in = w;
        }
        *out = tsr_tpl_val_int(words);
        return TSR_OK;
}

static tsr_status filter_center(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_status st;
        tsr_tpl_str s;
        tsr_tpl_val x;
        tsr_tpl_args a2 = *a;

        if ((st = tsr_tpl_to_str(c, v, &s)) != TSR_OK)
                return st;
        if (!a2.npos && !a2.nkw) {
                x = tsr_tpl_val_int(80);
                a2.pos = &x;
                a2.npos = 1;
        }
        return tsr_tpl_call_str_method(c, s, "center", &a2, out);
}

static tsr_status filter_attr(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_tpl_val x;

        if (!tsr_tpl_arg_get(a, 0, "name", &x) || x.type != TSR_TPL_VAL_STR)
                return tsr_tpl_rerr(c, TSR_E_INVAL, "attr needs a name");
        if (v.type == TSR_TPL_VAL_DICT || v.type == TSR_TPL_VAL_NS) {
                /* getattr only: dict keys are not attributes */
                const char *m = v.type == TSR_TPL_VAL_DICT ? tsr_tpl_find_name(tsr_tpl_dict_methods, x.u.s) : NULL;
                tsr_tpl_val *val = v.type == TSR_TPL_VAL_NS ? tsr_tpl_dict_finds(v.u.d, x.u.s.p, x.u.s.n) : NULL;
                *out = m ? tsr_tpl_make_method(c, v, m) : val ? *val : tsr_tpl_undef_named(x.u.s);
                return c->failed ? c->st : TSR_OK;
        }
        return tsr_tpl_get_attr(c, v, x.u.s, out);
}

static tsr_status filter_format(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_status st;
        tsr_tpl_str s;
        tsr_tpl_val x;
        tsr_tpl_sb b = {0};
        size_t ai = 0, i;

        if ((st = tsr_tpl_to_str(c, v, &s)) != TSR_OK)
                return st;
        for (i = 0; i < s.n; i++) {
                if (s.p[i] != '%') {
                        if (!tsr_tpl_sb_addc(c, &b, s.p[i]))
                                return c->st;
                        continue;
                }
                if (i + 1 >= s.n)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "incomplete format");
                i++;
                if (s.p[i] == '%') {
                        if (!tsr_tpl_sb_addc(c, &b, '%'))
                                return c->st;
                } else if (s.p[i] == 's' || s.p[i] == 'd' || s.p[i] == 'i' || s.p[i] == 'r') {
                        if (ai >= a->npos)
                                return tsr_tpl_rerr(c, TSR_E_INVAL, "not enough arguments for format string");
                        x = a->pos[ai++];
                        if (s.p[i] != 's' && s.p[i] != 'r' && !tsr_tpl_is_num(x))
                                return tsr_tpl_rerr(c, TSR_E_INVAL, "%%d format: a real number is required, not %s",
                                            tsr_tpl_type_name(x));
                        if (s.p[i] != 's' && s.p[i] != 'r' && x.type == TSR_TPL_VAL_FLOAT)
                                x = tsr_tpl_val_int((int64_t)x.u.f);
                        if (s.p[i] == 'd' && x.type == TSR_TPL_VAL_BOOL)
                                x = tsr_tpl_val_int(x.u.b);
                        if (!(s.p[i] == 'r' ? tsr_tpl_repr_append(c, &b, x) : tsr_tpl_str_append(c, &b, x)))
                                return c->st;
                } else {
                        return tsr_tpl_rerr(c, TSR_E_UNSUPPORTED, "format: unsupported conversion '%%%c'", s.p[i]);
                }
        }
        *out = tsr_tpl_sb_val(&b);
        return TSR_OK;
}

typedef tsr_status (*filter_fn)(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out);

/* Every filter, sorted by name (strcmp order) for bsearch; an alias is one more row with
 * the same function.  A sorted const array rather than a hash: 42 rows take six compares,
 * lookups happen at parse time (and once per map() call), and the table needs no
 * initialisation and no mutable state, so parsed templates stay shareable between
 * threads.  Adding a filter is one function above and one row here. */
static const struct filter_def {
        const char *name;
        filter_fn fn;
} filters[] = {
        {"abs", filter_abs},
        {"attr", filter_attr},
        {"batch", filter_batch},
        {"capitalize", filter_capitalize},
        {"center", filter_center},
        {"count", filter_length},
        {"d", filter_default},
        {"default", filter_default},
        {"dictsort", filter_dictsort},
        {"e", tsr_tpl_filter_escape},
        {"escape", tsr_tpl_filter_escape},
        {"first", filter_first},
        {"float", filter_float},
        {"format", filter_format},
        {"indent", filter_indent},
        {"int", filter_int},
        {"items", filter_items},
        {"join", filter_join},
        {"last", filter_last},
        {"length", filter_length},
        {"list", filter_list},
        {"lower", filter_lower},
        {"map", filter_map},
        {"max", filter_max},
        {"min", filter_min},
        {"reject", filter_reject},
        {"rejectattr", filter_rejectattr},
        {"replace", filter_replace},
        {"reverse", filter_reverse},
        {"round", filter_round},
        {"safe", filter_safe},
        {"select", filter_select},
        {"selectattr", filter_selectattr},
        {"sort", filter_sort},
        {"string", filter_string},
        {"sum", filter_sum},
        {"title", filter_title},
        {"tojson", filter_tojson},
        {"trim", filter_trim},
        {"unique", filter_unique},
        {"upper", filter_upper},
        {"wordcount", filter_wordcount},
};

static int tsr_tpl_filter_find(tsr_tpl_str name) {
        const struct filter_def *e;
#ifndef NDEBUG
        for (size_t k = 1; k < sizeof(filters) / sizeof(filters[0]); k++)
                assert(strcmp(filters[k - 1].name, filters[k].name) < 0);
#endif
        e = bsearch(&name, filters, sizeof(filters) / sizeof(filters[0]), sizeof(filters[0]), name_cmp);
        return e ? (int)(e - filters) : -1;
}

static tsr_status tsr_tpl_filter_run(tsr_tpl_rctx *c, int fid, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return filters[fid].fn(c, v, a, out);
}

/* ---------------------------------------------------------------- calls */

static tsr_status exec_body(tsr_tpl_rctx *c, const tsr_tpl_node *body, tsr_tpl_frame *f, int *flow);
static tsr_status eval(tsr_tpl_rctx *c, const tsr_tpl_node *n, tsr_tpl_frame *f, tsr_tpl_val *out);

enum { FLOW_NORMAL, FLOW_BREAK, FLOW_CONTINUE };

static tsr_status tsr_tpl_call_method(tsr_tpl_rctx *c, tsr_tpl_val self, const char *m, const tsr_tpl_args *a,
                                      tsr_tpl_val *out) {
        tsr_status st;
        tsr_tpl_val x;
        size_t k;

        switch (self.type) {
        case TSR_TPL_VAL_STR: return tsr_tpl_call_str_method(c, self.u.s, m, a, out);
        case TSR_TPL_VAL_DICT:
                if (!strcmp(m, "items"))
                        return tsr_tpl_dict_items(c, self.u.d, out);
                if (!strcmp(m, "keys") || !strcmp(m, "values")) {
                        tsr_tpl_list *l = tsr_tpl_list_new(c, self.u.d->n);
                        if (!l)
                                return c->st;
                        for (k = 0; k < self.u.d->n; k++)
                                l->v[l->n++] = m[0] == 'k' ? self.u.d->k[k] : self.u.d->v[k];
                        *out = tsr_tpl_val_list(l);
                        return tsr_tpl_step(c, l->n);
                }
                if (!strcmp(m, "get")) {
                        tsr_tpl_val *v;
                        if (!tsr_tpl_arg_get(a, 0, NULL, &x))
                                return tsr_tpl_rerr(c, TSR_E_INVAL, "get expected at least 1 argument, got 0");
                        v = tsr_tpl_dict_find(c, self.u.d, x);
                        if (v)
                                *out = *v;
                        else if (!tsr_tpl_arg_get(a, 1, NULL, out))
                                *out = tsr_tpl_val_none();
                        return TSR_OK;
                }
                if (!strcmp(m, "copy")) {
                        tsr_tpl_dict *d = tsr_tpl_dict_new(c);
                        if (!d)
                                return c->st;
                        for (k = 0; k < self.u.d->n; k++)
                                if (!tsr_tpl_dict_set(c, d, self.u.d->k[k], self.u.d->v[k]))
                                        return c->st;
                        *out = tsr_tpl_val_dict(d);
                        return TSR_OK;
                }
                break;
        case TSR_TPL_VAL_LIST:
                if (!strcmp(m, "copy")) {
                        tsr_tpl_list *l;
                        if ((st = tsr_tpl_copy_list(c, self.u.l, &l)) != TSR_OK)
                                return st;
                        *out = tsr_tpl_val_list(l);
                        return TSR_OK;
                }
                if (!tsr_tpl_arg_get(a, 0, NULL, &x))
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "%s() takes exactly one argument", m);
                {
                        int64_t cnt = 0;
                        for (k = 0; k < self.u.l->n; k++) {
                                if (tsr_tpl_val_eq(c, self.u.l->v[k], x)) {
                                        if (m[0] == 'i') {
                                                *out = tsr_tpl_val_int((int64_t)k);
                                                return TSR_OK;
                                        }
                                        cnt++;
                                }
                        }
                        if (m[0] == 'i')
                                return tsr_tpl_rerr(c, TSR_E_INVAL, "value is not in list");
                        *out = tsr_tpl_val_int(cnt);
                        return tsr_tpl_step(c, self.u.l->n);
                }
        case TSR_TPL_VAL_LOOP:
                if (!a->npos)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "no items for cycling given");
                *out = a->pos[self.u.loop->index0 % a->npos];
                return TSR_OK;
        default: break;
        }
        return tsr_tpl_rerr(c, TSR_E_UNSUPPORTED, "method %s is not supported on %s", m, tsr_tpl_type_name(self));
}

static size_t default_strftime(char *out, size_t outlen, const char *format, void *user) {
        time_t now = time(NULL);
        struct tm tm;
        (void)user;
        if (!localtime_r(&now, &tm))
                return 0;
        return strftime(out, outlen, format, &tm);
}

static tsr_status call_builtin(tsr_tpl_rctx *c, int b, const tsr_tpl_args *a, tsr_tpl_val *out) {
        tsr_tpl_val x;
        size_t k;
        tsr_status st;

        switch (b) {
        case TSR_TPL_B_RANGE: {
                int64_t lo = 0, hi, stp = 1, n, i;
                tsr_tpl_list *l;
                if (a->nkw)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "range() takes no keyword arguments");
                if (a->npos < 1 || a->npos > 3)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "range expected 1 to 3 arguments, got %zu", a->npos);
                for (k = 0; k < a->npos; k++)
                        if (!tsr_tpl_is_intlike(a->pos[k]))
                                return a->pos[k].type == TSR_TPL_VAL_UNDEF
                                               ? tsr_tpl_undef_err(c, a->pos[k])
                                               : tsr_tpl_rerr(c, TSR_E_INVAL,
                                                              "'%s' object cannot be interpreted as an integer",
                                                              tsr_tpl_type_name(a->pos[k]));
                if (a->npos == 1) {
                        hi = tsr_tpl_as_int(a->pos[0]);
                } else {
                        lo = tsr_tpl_as_int(a->pos[0]);
                        hi = tsr_tpl_as_int(a->pos[1]);
                        if (a->npos == 3)
                                stp = tsr_tpl_as_int(a->pos[2]);
                }
                if (stp == 0)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "range() arg 3 must not be zero");
                if (stp > 0)
                        n = hi > lo ? (int64_t)(((uint64_t)hi - (uint64_t)lo - 1) / (uint64_t)stp + 1) : 0;
                else
                        n = lo > hi ? (int64_t)(((uint64_t)lo - (uint64_t)hi - 1) / ((uint64_t)(-(stp + 1)) + 1) + 1)
                                    : 0;
                if (n > TSR_TPL_MAX_RANGE || n < 0)
                        return tsr_tpl_rerr(c, TSR_E_LIMIT,
                                            "Range too big. The sandbox blocks ranges larger than MAX_RANGE (%d).",
                                            TSR_TPL_MAX_RANGE);
                if ((st = tsr_tpl_step(c, (uint64_t)n)) != TSR_OK || !(l = tsr_tpl_list_new(c, (size_t)n)))
                        return c->failed ? c->st : st;
                for (i = 0; i < n; i++)
                        l->v[l->n++] = tsr_tpl_val_int(lo + i * stp);
                *out = tsr_tpl_val_list(l);
                return TSR_OK;
        }
        case TSR_TPL_B_NAMESPACE:
        case TSR_TPL_B_DICT: {
                tsr_tpl_dict *d = tsr_tpl_dict_new(c);
                if (!d)
                        return c->st;
                if (a->npos > 1)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "%s expected at most 1 positional argument",
                                    b == TSR_TPL_B_DICT ? "dict" : "namespace");
                if (a->npos == 1) {
                        x = a->pos[0];
                        if (x.type == TSR_TPL_VAL_DICT || x.type == TSR_TPL_VAL_NS) {
                                for (k = 0; k < x.u.d->n; k++)
                                        if (!tsr_tpl_dict_set(c, d, x.u.d->k[k], x.u.d->v[k]))
                                                return c->st;
                        } else if (x.type == TSR_TPL_VAL_LIST) {
                                for (k = 0; k < x.u.l->n; k++) {
                                        tsr_tpl_val p = x.u.l->v[k];
                                        if (p.type != TSR_TPL_VAL_LIST || p.u.l->n != 2)
                                                return tsr_tpl_rerr(
                                                        c, TSR_E_INVAL,
                                                        "dictionary update sequence element #%zu has wrong length", k);
                                        if (!tsr_tpl_dict_set(c, d, p.u.l->v[0], p.u.l->v[1]))
                                                return c->st;
                                }
                        } else {
                                return tsr_tpl_rerr(c, TSR_E_INVAL, "'%s' object is not iterable",
                                                    tsr_tpl_type_name(x));
                        }
                }
                for (k = 0; k < a->nkw; k++)
                        if (!tsr_tpl_dict_set(c, d, tsr_tpl_val_str(a->kwn[k].p, a->kwn[k].n), a->kw[k]))
                                return c->st;
                if (b == TSR_TPL_B_NAMESPACE) {
                        for (k = 0; k < d->n; k++)
                                if (d->k[k].type == TSR_TPL_VAL_STR && d->k[k].u.s.n && d->k[k].u.s.p[0] == '_')
                                        return tsr_tpl_rerr(c, TSR_E_INVAL,
                                                    "Chat templates cannot store underscore-prefixed attributes on a "
                                                    "namespace, but got '%.*s'. Please rename the attribute.",
                                                    (int)d->k[k].u.s.n, d->k[k].u.s.p);
                        out->type = TSR_TPL_VAL_NS;
                        out->u.d = d;
                } else {
                        *out = tsr_tpl_val_dict(d);
                }
                return TSR_OK;
        }
        case TSR_TPL_B_RAISE: {
                tsr_tpl_str msg = {"", 0};
                /* transformers' raise_exception(message) has no default: called bare, Python
                 * raises a TypeError with this text (prefixed by the helper's qualname, which
                 * changes between transformers versions, so it is left out), and an empty
                 * message would otherwise reach the client. */
                if (!tsr_tpl_arg_get(a, 0, "message", &x))
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "raise_exception() missing 1 required positional argument: "
                                    "'message'");
                if ((st = tsr_tpl_to_str(c, x, &msg)) != TSR_OK)
                        return st;
                return tsr_tpl_rerr(c, TSR_E_INVAL, "%.*s", (int)msg.n, msg.p);
        }
        case TSR_TPL_B_STRFTIME: {
                char buf[256], fmt[256];
                size_t n;
                tsr_template_strftime_fn fn = c->o->strftime_now ? c->o->strftime_now : default_strftime;
                if (!tsr_tpl_arg_get(a, 0, "format", &x) || x.type != TSR_TPL_VAL_STR)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "strftime_now needs a format string");
                if (x.u.s.n >= sizeof(fmt) || memchr(x.u.s.p, '\0', x.u.s.n))
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "strftime_now format too long");
                memcpy(fmt, x.u.s.p, x.u.s.n);
                fmt[x.u.s.n] = '\0';
                n = fn(buf, sizeof(buf), fmt, c->o->strftime_user);
                if (n >= sizeof(buf))
                        n = 0;
                *out = tsr_tpl_str_dup(c, buf, n);
                return c->failed ? c->st : TSR_OK;
        }
        default: return tsr_tpl_rerr(c, TSR_E_INTERNAL, "unknown builtin");
        }
}

static tsr_status call_macro(tsr_tpl_rctx *c, tsr_tpl_val m, const tsr_tpl_args *a, tsr_tpl_val *out) {
        static const char caller_name[] = "caller";
        const tsr_tpl_node *mn = m.u.m.n;
        tsr_tpl_frame *f;
        tsr_tpl_sb buf = {0}, *saved;
        size_t k, j;
        int flow = FLOW_NORMAL;
        tsr_tpl_val caller = a->caller;
        tsr_status st;
        /* jinja2 names a call block's caller None */
        const char *q = mn->kind == TSR_TPL_N_CALLBLOCK ? "" : "'";
        tsr_tpl_str label = mn->kind == TSR_TPL_N_CALLBLOCK ? (tsr_tpl_str){"None", 4} : mn->name;

        if (a->npos > mn->nnames)
                return tsr_tpl_rerr(c, TSR_E_INVAL, "macro %s%.*s%s takes not more than %u argument(s)", q,
                                    (int)label.n, label.p, q, mn->nnames);
        for (k = 0; k < a->nkw; k++) {
                bool known = false;
                if (tsr_tpl_str_eq(a->kwn[k], caller_name) && mn->op) {
                        caller = a->kw[k];
                        continue;
                }
                for (j = 0; j < mn->nnames; j++)
                        if (a->kwn[k].n == mn->names[j].n && memcmp(a->kwn[k].p, mn->names[j].p, a->kwn[k].n) == 0)
                                known = j >= a->npos;
                if (!known && tsr_tpl_str_eq(a->kwn[k], caller_name))
                        return tsr_tpl_rerr(c, TSR_E_INVAL,
                                            "macro %s%.*s%s was invoked with two values for the special caller "
                                            "argument. This is most likely a bug.",
                                            q, (int)label.n, label.p, q);
                if (!known)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "macro %s%.*s%s takes no keyword argument '%.*s'", q,
                                            (int)label.n, label.p, q, (int)a->kwn[k].n, a->kwn[k].p);
        }
        if (caller.type != TSR_TPL_VAL_UNDEF && !mn->op)
                return tsr_tpl_rerr(c, TSR_E_INVAL,
                                    "macro %s%.*s%s was invoked with two values for the special caller argument. "
                                    "This is most likely a bug.",
                                    q, (int)label.n, label.p, q);
        if (c->depth >= c->max_depth)
                return tsr_tpl_rerr(c, TSR_E_LIMIT, "macro calls nested deeper than %u", c->max_depth);
        if (!(f = tsr_tpl_frame_new(c, m.u.m.f)))
                return c->st;
        for (k = 0; k < mn->nnames; k++) {
                tsr_tpl_val v = TSR_TPL_VAL_UNDEFINED;
                bool have = k < a->npos;
                if (have)
                        v = a->pos[k];
                for (j = 0; !have && j < a->nkw; j++) {
                        if (a->kwn[j].n == mn->names[k].n &&
                            memcmp(a->kwn[j].p, mn->names[k].p, a->kwn[j].n) == 0) {
                                v = a->kw[j];
                                have = true;
                        }
                }
                if (!have && mn->kids[k] && (st = eval(c, mn->kids[k], f, &v)) != TSR_OK)
                        return st;
                if (!have && !mn->kids[k])
                        v = tsr_tpl_undef_named(mn->names[k]);
                if (!tsr_tpl_frame_set(c, f, mn->names[k], v))
                        return c->st;
        }
        if (mn->op &&
            !tsr_tpl_frame_set(c, f, (tsr_tpl_str){caller_name, sizeof(caller_name) - 1},
                               caller.type != TSR_TPL_VAL_UNDEF ? caller
                                                                : tsr_tpl_undef_named((tsr_tpl_str){caller_name, 6})))
                return c->st;
        saved = c->cap;
        c->cap = &buf;
        c->depth++;
        st = exec_body(c, mn->b, f, &flow);
        c->depth--;
        c->cap = saved;
        if (st != TSR_OK)
                return st;
        *out = tsr_tpl_sb_val(&buf);
        return TSR_OK;
}

static tsr_status call_value(tsr_tpl_rctx *c, tsr_tpl_val fn, const tsr_tpl_args *a, tsr_tpl_val *out) {
        switch (fn.type) {
        case TSR_TPL_VAL_MACRO: return call_macro(c, fn, a, out);
        case TSR_TPL_VAL_BUILTIN: return call_builtin(c, fn.u.builtin, a, out);
        case TSR_TPL_VAL_METHOD: return tsr_tpl_call_method(c, *fn.u.meth.self, fn.u.meth.name, a, out);
        case TSR_TPL_VAL_UNDEF: return tsr_tpl_undef_err(c, fn);
        default: return tsr_tpl_rerr(c, TSR_E_INVAL, "'%s' object is not callable", tsr_tpl_type_name(fn));
        }
}

static tsr_status eval_args(tsr_tpl_rctx *c, const tsr_tpl_node *n, tsr_tpl_frame *f, tsr_tpl_args *a) {
        size_t k, npos = n->nkids - n->nkw;
        tsr_tpl_val *vals;
        tsr_status st;

        memset(a, 0, sizeof(*a));
        if (!n->nkids)
                return TSR_OK;
        if (!(vals = tsr_tpl_ralloc(c, n->nkids * sizeof(tsr_tpl_val))))
                return c->st;
        for (k = 0; k < n->nkids; k++)
                if ((st = eval(c, n->kids[k], f, &vals[k])) != TSR_OK)
                        return st;
        a->pos = vals;
        a->npos = npos;
        a->kw = vals + npos;
        a->kwn = n->names;
        a->nkw = n->nkw;
        return TSR_OK;
}

/* ---------------------------------------------------------------- expressions */

static tsr_status int_overflow(tsr_tpl_rctx *c) { return tsr_tpl_rerr(c, TSR_E_INVAL, "integer result out of range"); }

static tsr_status binop(tsr_tpl_rctx *c, int op, tsr_tpl_val l, tsr_tpl_val r, tsr_tpl_val *out) {
        static const char *const names[] = {['+'] = "+", ['-'] = "-", ['*'] = "*", ['/'] = "/", ['F'] = "//",
                                            ['%'] = "%", ['P'] = "**"};
        int64_t x, y, z;

        if (l.type == TSR_TPL_VAL_UNDEF)
                return tsr_tpl_undef_err(c, l);
        if (r.type == TSR_TPL_VAL_UNDEF)
                return tsr_tpl_undef_err(c, r);
        if (tsr_tpl_is_num(l) && tsr_tpl_is_num(r)) {
                if (l.type != TSR_TPL_VAL_FLOAT && r.type != TSR_TPL_VAL_FLOAT && op != '/') {
                        x = tsr_tpl_as_int(l);
                        y = tsr_tpl_as_int(r);
                        switch (op) {
                        case '+': if (__builtin_add_overflow(x, y, &z)) return int_overflow(c); break;
                        case '-': if (__builtin_sub_overflow(x, y, &z)) return int_overflow(c); break;
                        case '*': if (__builtin_mul_overflow(x, y, &z)) return int_overflow(c); break;
                        case 'F':
                        case '%':
                                if (y == 0)
                                        return tsr_tpl_rerr(c, TSR_E_INVAL, "integer division or modulo by zero");
                                if (x == INT64_MIN && y == -1) {
                                        if (op == 'F')
                                                return int_overflow(c);
                                        z = 0;
                                        break;
                                }
                                z = op == 'F' ? x / y : x % y;
                                if ((x % y != 0) && ((x < 0) != (y < 0)))
                                        z = op == 'F' ? z - 1 : z + y;
                                break;
                        case 'P':
                                if (y < 0) {
                                        if (x == 0)
                                                return tsr_tpl_rerr(c, TSR_E_INVAL,
                                                                    "0.0 cannot be raised to a negative power");
                                        *out = tsr_tpl_val_float(pow((double)x, (double)y));
                                        return TSR_OK;
                                }
                                z = 1;
                                while (y > 0) {
                                        if ((y & 1) && __builtin_mul_overflow(z, x, &z))
                                                return int_overflow(c);
                                        y >>= 1;
                                        if (y && __builtin_mul_overflow(x, x, &x))
                                                return int_overflow(c);
                                }
                                break;
                        default: return tsr_tpl_rerr(c, TSR_E_INTERNAL, "bad operator");
                        }
                        *out = tsr_tpl_val_int(z);
                        return TSR_OK;
                } else {
                        double a = tsr_tpl_as_dbl(l), b = tsr_tpl_as_dbl(r), d;
                        switch (op) {
                        case '+': d = a + b; break;
                        case '-': d = a - b; break;
                        case '*': d = a * b; break;
                        case '/':
                                if (b == 0)
                                        return tsr_tpl_rerr(c, TSR_E_INVAL, "division by zero");
                                d = a / b;
                                break;
                        case 'F':
                        case '%':
                                if (b == 0)
                                        return tsr_tpl_rerr(c, TSR_E_INVAL, "float modulo");
                                {
                                        /* CPython's float_divmod */
                                        double mod = fmod(a, b), div = (a - mod) / b, fl;
                                        if (mod != 0 && ((b < 0) != (mod < 0))) {
                                                mod += b;
                                                div -= 1.0;
                                        }
                                        fl = floor(div);
                                        if (div - fl > 0.5)
                                                fl += 1.0;
                                        d = op == 'F' ? fl : mod;
                                }
                                break;
                        case 'P':
                                if (a == 0 && b < 0)
                                        return tsr_tpl_rerr(c, TSR_E_INVAL, "0.0 cannot be raised to a negative power");
                                d = pow(a, b);
                                break;
                        default: return tsr_tpl_rerr(c, TSR_E_INTERNAL, "bad operator");
                        }
                        *out = tsr_tpl_val_float(d);
                        return TSR_OK;
                }
        }
        if (op == '+' && l.type == TSR_TPL_VAL_STR && r.type == TSR_TPL_VAL_STR) {
                tsr_tpl_sb b = {0};
                /* Markup + str and str + Markup escape the plain str (markupsafe) */
                if (l.markup != r.markup) {
                        tsr_tpl_args none = {0};
                        tsr_tpl_val *plain = l.markup ? &r : &l;
                        tsr_status est = tsr_tpl_filter_escape(c, *plain, &none, plain);
                        if (est != TSR_OK)
                                return est;
                }
                if (!tsr_tpl_sb_add(c, &b, l.u.s.p, l.u.s.n) || !tsr_tpl_sb_add(c, &b, r.u.s.p, r.u.s.n))
                        return c->st;
                *out = tsr_tpl_sb_val(&b);
                out->markup = l.markup || r.markup;
                return TSR_OK;
        }
        if (op == '+' && l.type == TSR_TPL_VAL_LIST && r.type == TSR_TPL_VAL_LIST && l.u.l->tuple == r.u.l->tuple) {
                tsr_tpl_list *n = tsr_tpl_list_new(c, l.u.l->n + r.u.l->n);
                if (!n)
                        return c->st;
                if (l.u.l->n)
                        memcpy(n->v, l.u.l->v, l.u.l->n * sizeof(tsr_tpl_val));
                if (r.u.l->n)
                        memcpy(n->v + l.u.l->n, r.u.l->v, r.u.l->n * sizeof(tsr_tpl_val));
                n->n = l.u.l->n + r.u.l->n;
                n->tuple = l.u.l->tuple;
                *out = tsr_tpl_val_list(n);
                return tsr_tpl_step(c, n->n);
        }
        if (op == '*' && ((l.type == TSR_TPL_VAL_STR || l.type == TSR_TPL_VAL_LIST) && tsr_tpl_is_intlike(r))) {
                int64_t times = tsr_tpl_as_int(r), i;
                if (l.type == TSR_TPL_VAL_STR) {
                        tsr_tpl_sb b = {0};
                        if (times > 0 && l.u.s.n && (uint64_t)times > c->max_output / l.u.s.n)
                                return tsr_tpl_rerr(c, TSR_E_LIMIT, "string repetition larger than the output limit");
                        /* '' * 10**12 is '' at once, not 10**12 empty appends (fuzz_template). */
                        if (l.u.s.n == 0)
                                times = 0;
                        for (i = 0; i < times; i++)
                                if (!tsr_tpl_sb_add(c, &b, l.u.s.p, l.u.s.n))
                                        return c->st;
                        *out = tsr_tpl_sb_val(&b);
                        return tsr_tpl_step(c, b.n / 64);
                } else {
                        tsr_tpl_list *n;
                        size_t k;
                        if (times > 0 && l.u.l->n && (uint64_t)times > (uint64_t)TSR_TPL_MAX_RANGE * 10 / l.u.l->n)
                                return tsr_tpl_rerr(c, TSR_E_LIMIT, "list repetition too large");
                        if (!(n = tsr_tpl_list_new(c, 0)))
                                return c->st;
                        n->tuple = l.u.l->tuple;
                        for (i = 0; i < times; i++)
                                for (k = 0; k < l.u.l->n; k++)
                                        if (!tsr_tpl_list_push(c, n, l.u.l->v[k]))
                                                return c->st;
                        *out = tsr_tpl_val_list(n);
                        return tsr_tpl_step(c, n->n);
                }
        }
        if (op == '*' && tsr_tpl_is_intlike(l) && (r.type == TSR_TPL_VAL_STR || r.type == TSR_TPL_VAL_LIST))
                return binop(c, op, r, l, out);
        if (op == '+' && l.type == TSR_TPL_VAL_STR)
                return tsr_tpl_rerr(c, TSR_E_INVAL, "can only concatenate str (not \"%s\") to str",
                                    tsr_tpl_type_name(r));
        if (op == '+' && l.type == TSR_TPL_VAL_LIST)
                return tsr_tpl_rerr(c, TSR_E_INVAL, "can only concatenate %s (not \"%s\") to %s", tsr_tpl_type_name(l),
                                    tsr_tpl_type_name(r), tsr_tpl_type_name(l));
        return tsr_tpl_rerr(c, TSR_E_INVAL, "unsupported operand type(s) for %s: '%s' and '%s'", names[op],
                            tsr_tpl_type_name(l), tsr_tpl_type_name(r));
}

static tsr_status contains(tsr_tpl_rctx *c, tsr_tpl_val needle, tsr_tpl_val hay, bool *out) {
        if (hay.type == TSR_TPL_VAL_UNDEF) {
                *out = false;
                return TSR_OK;
        }
        if (hay.type != TSR_TPL_VAL_STR && hay.type != TSR_TPL_VAL_LIST && hay.type != TSR_TPL_VAL_DICT)
                return tsr_tpl_rerr(c, TSR_E_INVAL, "argument of type '%s' is not iterable", tsr_tpl_type_name(hay));
        return tsr_tpl_test_in(c, needle, hay, true, out);
}

static tsr_status eval_inner(tsr_tpl_rctx *c, const tsr_tpl_node *n, tsr_tpl_frame *f, tsr_tpl_val *out) {
        tsr_status st;
        tsr_tpl_val l, r;
        tsr_tpl_args a;
        size_t k;

        switch (n->kind) {
        case TSR_TPL_N_CONST: *out = n->val; return TSR_OK;
        case TSR_TPL_N_NAME: *out = tsr_tpl_lookup(c, f, n->name); return TSR_OK;
        case TSR_TPL_N_GETATTR:
                if ((st = eval(c, n->a, f, &l)) != TSR_OK)
                        return st;
                return tsr_tpl_get_attr(c, l, n->name, out);
        case TSR_TPL_N_GETITEM:
                if ((st = eval(c, n->a, f, &l)) != TSR_OK)
                        return st;
                if (n->b->kind == TSR_TPL_N_SLICE) {
                        tsr_tpl_val parts[3] = {tsr_tpl_val_none(), tsr_tpl_val_none(), tsr_tpl_val_none()};
                        const tsr_tpl_node *pn[3] = {n->b->a, n->b->b, n->b->c};
                        for (k = 0; k < 3; k++)
                                if (pn[k] && (st = eval(c, pn[k], f, &parts[k])) != TSR_OK)
                                        return st;
                        return tsr_tpl_do_slice(c, l, parts[0], parts[1], parts[2], out);
                }
                if ((st = eval(c, n->b, f, &r)) != TSR_OK)
                        return st;
                return tsr_tpl_get_item(c, l, r, out);
        case TSR_TPL_N_CALL:
                if (n->a->kind == TSR_TPL_N_GETATTR) {
                        /* obj.method(...): skip building a bound method */
                        tsr_tpl_val self;
                        if ((st = eval(c, n->a->a, f, &self)) != TSR_OK ||
                            (st = tsr_tpl_get_attr(c, self, n->a->name, &l)) != TSR_OK)
                                return st;
                } else if ((st = eval(c, n->a, f, &l)) != TSR_OK) {
                        return st;
                }
                if ((st = eval_args(c, n, f, &a)) != TSR_OK)
                        return st;
                return call_value(c, l, &a, out);
        case TSR_TPL_N_FILTER:
                if (!n->a) {
                        /* block set filter: the operand is the captured body, passed in *out */
                        l = *out;
                } else if ((st = eval(c, n->a, f, &l)) != TSR_OK) {
                        return st;
                }
                if (n->fid < 0)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "No filter named '%.*s' found.", (int)n->name.n, n->name.p);
                if ((st = eval_args(c, n, f, &a)) != TSR_OK)
                        return st;
                return tsr_tpl_filter_run(c, n->fid, l, &a, out);
        case TSR_TPL_N_TEST: {
                bool b;
                if (n->fid < 0)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "No test named '%.*s' found.", (int)n->name.n, n->name.p);
                if ((st = eval(c, n->a, f, &l)) != TSR_OK || (st = eval_args(c, n, f, &a)) != TSR_OK ||
                    (st = tsr_tpl_test_run(c, n->fid, l, &a, &b)) != TSR_OK)
                        return st;
                *out = tsr_tpl_val_bool(n->neg ? !b : b);
                return TSR_OK;
        }
        case TSR_TPL_N_NEG:
        case TSR_TPL_N_POS:
                if ((st = eval(c, n->a, f, &l)) != TSR_OK)
                        return st;
                if (l.type == TSR_TPL_VAL_FLOAT) {
                        *out = tsr_tpl_val_float(n->kind == TSR_TPL_N_NEG ? -l.u.f : l.u.f);
                } else if (tsr_tpl_is_intlike(l)) {
                        if (n->kind == TSR_TPL_N_NEG && tsr_tpl_as_int(l) == INT64_MIN)
                                return int_overflow(c);
                        *out = tsr_tpl_val_int(n->kind == TSR_TPL_N_NEG ? -tsr_tpl_as_int(l) : tsr_tpl_as_int(l));
                } else if (l.type == TSR_TPL_VAL_UNDEF) {
                        return tsr_tpl_undef_err(c, l);
                } else {
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "bad operand type for unary %c: '%s'",
                                            n->kind == TSR_TPL_N_NEG ? '-' : '+', tsr_tpl_type_name(l));
                }
                return TSR_OK;
        case TSR_TPL_N_NOT:
                if ((st = eval(c, n->a, f, &l)) != TSR_OK)
                        return st;
                *out = tsr_tpl_val_bool(!tsr_tpl_truthy(l));
                return TSR_OK;
        case TSR_TPL_N_AND:
        case TSR_TPL_N_OR:
                if ((st = eval(c, n->a, f, &l)) != TSR_OK)
                        return st;
                if (tsr_tpl_truthy(l) == (n->kind == TSR_TPL_N_OR)) {
                        *out = l;
                        return TSR_OK;
                }
                return eval(c, n->b, f, out);
        case TSR_TPL_N_BIN:
                if ((st = eval(c, n->a, f, &l)) != TSR_OK || (st = eval(c, n->b, f, &r)) != TSR_OK)
                        return st;
                if (n->op == '~') {
                        tsr_tpl_sb b = {0};
                        if (!tsr_tpl_str_append(c, &b, l) || !tsr_tpl_str_append(c, &b, r))
                                return c->failed ? c->st : tsr_tpl_oom(c);
                        *out = tsr_tpl_sb_val(&b);
                        return TSR_OK;
                }
                return binop(c, n->op, l, r, out);
        case TSR_TPL_N_CMP:
                if ((st = eval(c, n->a, f, &l)) != TSR_OK)
                        return st;
                for (k = 0; k < n->nkids; k++) {
                        bool res;
                        int cr;
                        if ((st = eval(c, n->kids[k], f, &r)) != TSR_OK)
                                return st;
                        switch (n->ops[k]) {
                        case TSR_TPL_CMP_EQ: res = tsr_tpl_val_eq(c, l, r); break;
                        case TSR_TPL_CMP_NE: res = !tsr_tpl_val_eq(c, l, r); break;
                        case TSR_TPL_CMP_IN:
                        case TSR_TPL_CMP_NOTIN:
                                if ((st = contains(c, l, r, &res)) != TSR_OK)
                                        return st;
                                if (n->ops[k] == TSR_TPL_CMP_NOTIN)
                                        res = !res;
                                break;
                        default: {
                                static const char *const opn[] = {"==", "!=", "<", "<=", ">", ">="};
                                if ((st = tsr_tpl_val_cmp(c, l, r, opn[n->ops[k]], &cr)) != TSR_OK)
                                        return st;
                                res = n->ops[k] == TSR_TPL_CMP_LT ? cr < 0 : n->ops[k] == TSR_TPL_CMP_LE ? cr <= 0
                                    : n->ops[k] == TSR_TPL_CMP_GT ? cr > 0 : cr >= 0;
                        }
                        }
                        if (c->failed)
                                return c->st;
                        if (!res) {
                                *out = tsr_tpl_val_bool(false);
                                return TSR_OK;
                        }
                        l = r;
                }
                *out = tsr_tpl_val_bool(true);
                return TSR_OK;
        case TSR_TPL_N_COND:
                if ((st = eval(c, n->a, f, &l)) != TSR_OK)
                        return st;
                if (tsr_tpl_truthy(l))
                        return eval(c, n->b, f, out);
                if (n->c)
                        return eval(c, n->c, f, out);
                *out = TSR_TPL_VAL_UNDEFINED;
                return TSR_OK;
        case TSR_TPL_N_LIST:
        case TSR_TPL_N_TUPLE: {
                tsr_tpl_list *lst = tsr_tpl_list_new(c, n->nkids);
                if (!lst)
                        return c->st;
                lst->tuple = n->kind == TSR_TPL_N_TUPLE;
                for (k = 0; k < n->nkids; k++) {
                        if ((st = eval(c, n->kids[k], f, &lst->v[k])) != TSR_OK)
                                return st;
                        lst->n++;
                }
                *out = tsr_tpl_val_list(lst);
                return TSR_OK;
        }
        case TSR_TPL_N_DICT: {
                tsr_tpl_dict *d = tsr_tpl_dict_new(c);
                if (!d)
                        return c->st;
                for (k = 0; k + 1 < n->nkids; k += 2) {
                        if ((st = eval(c, n->kids[k], f, &l)) != TSR_OK ||
                            (st = eval(c, n->kids[k + 1], f, &r)) != TSR_OK)
                                return st;
                        if (l.type == TSR_TPL_VAL_LIST && !l.u.l->tuple)
                                return tsr_tpl_rerr(c, TSR_E_INVAL, "unhashable type: 'list'");
                        if (l.type == TSR_TPL_VAL_DICT)
                                return tsr_tpl_rerr(c, TSR_E_INVAL, "unhashable type: 'dict'");
                        if (!tsr_tpl_dict_set(c, d, l, r))
                                return c->st;
                }
                *out = tsr_tpl_val_dict(d);
                return tsr_tpl_step(c, n->nkids);
        }
        default: return tsr_tpl_rerr(c, TSR_E_INTERNAL, "unexpected node in expression");
        }
}

static tsr_status eval(tsr_tpl_rctx *c, const tsr_tpl_node *n, tsr_tpl_frame *f, tsr_tpl_val *out) {
        tsr_status st;
        if ((st = tsr_tpl_step(c, 1)) != TSR_OK || (st = tsr_tpl_nest_in(c)) != TSR_OK)
                return st;
        st = eval_inner(c, n, f, out);
        c->nest--;
        if (st == TSR_OK && c->failed)
                st = c->st;
        return st;
}

/* ---------------------------------------------------------------- statements */

static tsr_status assign_targets(tsr_tpl_rctx *c, tsr_tpl_frame *f, const tsr_tpl_node *n, tsr_tpl_val v) {
        tsr_tpl_list *l;
        uint32_t k;
        tsr_status st;

        if (!n->tuple)
                return tsr_tpl_frame_set(c, f, n->names[0], v) ? TSR_OK : c->st;
        if ((st = tsr_tpl_iter_list(c, v, &l)) != TSR_OK)
                return st;
        if (l->n != n->nnames)
                return tsr_tpl_rerr(c, TSR_E_INVAL, l->n > n->nnames ? "too many values to unpack (expected %u)"
                                                              : "not enough values to unpack (expected %u, got %zu)",
                            n->nnames, l->n);
        for (k = 0; k < n->nnames; k++)
                if (!tsr_tpl_frame_set(c, f, n->names[k], l->v[k]))
                        return c->st;
        return TSR_OK;
}

static tsr_status exec_for(tsr_tpl_rctx *c, const tsr_tpl_node *n, tsr_tpl_frame *f) {
        tsr_tpl_val it;
        tsr_tpl_list *items;
        tsr_tpl_loop *ls;
        tsr_tpl_frame *lf;
        size_t k;
        tsr_status st;
        int flow;

        if ((st = eval(c, n->a, f, &it)) != TSR_OK || (st = tsr_tpl_iter_list(c, it, &items)) != TSR_OK)
                return st;
        if (!(lf = tsr_tpl_frame_new(c, f)) || !(ls = tsr_tpl_ralloc(c, sizeof(*ls))))
                return c->st;
        if (n->b) {
                /* "for x in y if cond": filter first, so loop.length and loop.last see only
                 * the kept items, as jinja2 does */
                tsr_tpl_list *kept = tsr_tpl_list_new(c, 0);
                if (!kept)
                        return c->st;
                for (k = 0; k < items->n; k++) {
                        tsr_tpl_val cond;
                        lf->n = 0;
                        if ((st = assign_targets(c, lf, n, items->v[k])) != TSR_OK ||
                            (st = eval(c, n->b, lf, &cond)) != TSR_OK)
                                return st;
                        if (tsr_tpl_truthy(cond) && !tsr_tpl_list_push(c, kept, items->v[k]))
                                return c->st;
                }
                items = kept;
        }
        ls->items = items;
        ls->depth = 1;
        for (k = 0; k < items->n; k++) {
                tsr_tpl_val lv = {.type = TSR_TPL_VAL_LOOP};
                if ((st = tsr_tpl_step(c, 1)) != TSR_OK)
                        return st;
                lf->n = 0;      /* a fresh scope per iteration */
                ls->index0 = k;
                lv.u.loop = ls;
                if (!tsr_tpl_frame_set(c, lf, tsr_tpl_val_cstr("loop").u.s, lv))
                        return c->st;
                if ((st = assign_targets(c, lf, n, items->v[k])) != TSR_OK)
                        return st;
                flow = FLOW_NORMAL;
                if ((st = exec_body(c, n->c, lf, &flow)) != TSR_OK)
                        return st;
                if (flow == FLOW_BREAK)
                        break;
        }
        if (!items->n && n->d) {
                flow = FLOW_NORMAL;
                lf->n = 0;
                return exec_body(c, n->d, lf, &flow);
        }
        return TSR_OK;
}

static tsr_status exec_node(tsr_tpl_rctx *c, const tsr_tpl_node *n, tsr_tpl_frame *f, int *flow) {
        tsr_status st;
        tsr_tpl_val v;

        switch (n->kind) {
        case TSR_TPL_N_TEXT: return tsr_tpl_emit(c, n->name.p, n->name.n);
        case TSR_TPL_N_OUTPUT: {
                tsr_tpl_str s;
                if ((st = eval(c, n->a, f, &v)) != TSR_OK)
                        return st;
                if (v.type == TSR_TPL_VAL_STR)
                        return tsr_tpl_emit(c, v.u.s.p, v.u.s.n);
                if ((st = tsr_tpl_to_str(c, v, &s)) != TSR_OK)
                        return st;
                return tsr_tpl_emit(c, s.p, s.n);
        }
        case TSR_TPL_N_IF:
                while (n && n->kind == TSR_TPL_N_IF) {
                        if ((st = eval(c, n->a, f, &v)) != TSR_OK)
                                return st;
                        if (tsr_tpl_truthy(v))
                                return exec_body(c, n->b, f, flow);
                        n = n->c;
                        if (n && n->kind == TSR_TPL_N_IF && (st = tsr_tpl_step(c, 1)) != TSR_OK)
                                return st;
                }
                return n ? exec_body(c, n, f, flow) : TSR_OK;
        case TSR_TPL_N_FOR: return exec_for(c, n, f);
        case TSR_TPL_N_SET:
                if ((st = eval(c, n->a, f, &v)) != TSR_OK)
                        return st;
                if (n->op == TSR_TPL_TGT_ATTR) {
                        tsr_tpl_val ns = tsr_tpl_lookup(c, f, n->name);
                        if (ns.type != TSR_TPL_VAL_NS)
                                return tsr_tpl_rerr(c, TSR_E_INVAL, "cannot assign attribute on non-namespace object");
                        if (n->name2.n && n->name2.p[0] == '_')
                                return tsr_tpl_rerr(
                                        c, TSR_E_INVAL,
                                        "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                                        "but got '%.*s'. Please rename the attribute.",
                                        (int)n->name2.n, n->name2.p);
                        return tsr_tpl_dict_set(c, ns.u.d, tsr_tpl_val_str(n->name2.p, n->name2.n), v) ? TSR_OK : c->st;
                }
                return assign_targets(c, f, n, v);
        case TSR_TPL_N_SETBLOCK: {
                tsr_tpl_sb buf = {0}, *saved = c->cap;
                int inner = FLOW_NORMAL;
                c->cap = &buf;
                st = exec_body(c, n->b, f, &inner);
                c->cap = saved;
                if (st != TSR_OK)
                        return st;
                v = tsr_tpl_sb_val(&buf);
                if (n->c) {
                        /* filter chain with an empty innermost operand: feed the body in */
                        const tsr_tpl_node *chain[64];
                        size_t depth = 0, k;
                        const tsr_tpl_node *x;
                        for (x = n->c; x && depth < 64; x = x->a)
                                chain[depth++] = x;
                        if (x)
                                return tsr_tpl_rerr(c, TSR_E_LIMIT, "filter chain too long");
                        for (k = depth; k-- > 0;) {
                                tsr_tpl_args a;
                                tsr_tpl_val r;
                                if ((st = eval_args(c, chain[k], f, &a)) != TSR_OK ||
                                    (st = tsr_tpl_filter_run(c, chain[k]->fid, v, &a, &r)) != TSR_OK)
                                        return st;
                                v = r;
                        }
                }
                return tsr_tpl_frame_set(c, f, n->name, v) ? TSR_OK : c->st;
        }
        case TSR_TPL_N_MACRO: {
                tsr_tpl_val m = {.type = TSR_TPL_VAL_MACRO};
                m.u.m.n = n;
                m.u.m.f = f;
                return tsr_tpl_frame_set(c, f, n->name, m) ? TSR_OK : c->st;
        }
        case TSR_TPL_N_FILTERBLOCK: {
                /* the body renders in its own scope (jinja2's filter_frame), then goes
                 * through the chain; the result is output, and must be a string there */
                tsr_tpl_sb buf = {0}, *saved = c->cap;
                int inner = FLOW_NORMAL;
                tsr_tpl_frame *bf = tsr_tpl_frame_new(c, f);
                const tsr_tpl_node *chain[64];
                size_t depth = 0, k;
                const tsr_tpl_node *x;
                if (!bf)
                        return c->st;
                c->cap = &buf;
                st = exec_body(c, n->b, bf, &inner);
                c->cap = saved;
                if (st != TSR_OK)
                        return st;
                v = tsr_tpl_sb_val(&buf);
                for (x = n->c; x && depth < 64; x = x->a)
                        chain[depth++] = x;
                if (x)
                        return tsr_tpl_rerr(c, TSR_E_LIMIT, "filter chain too long");
                for (k = depth; k-- > 0;) {
                        tsr_tpl_args a;
                        tsr_tpl_val r;
                        if ((st = eval_args(c, chain[k], f, &a)) != TSR_OK ||
                            (st = tsr_tpl_filter_run(c, chain[k]->fid, v, &a, &r)) != TSR_OK)
                                return st;
                        v = r;
                }
                if (v.type != TSR_TPL_VAL_STR)
                        return tsr_tpl_rerr(c, TSR_E_INVAL, "sequence item 0: expected str instance, %s found",
                                            tsr_tpl_type_name(v));
                return tsr_tpl_emit(c, v.u.s.p, v.u.s.n);
        }
        case TSR_TPL_N_CALLBLOCK: {
                tsr_tpl_args a;
                tsr_tpl_val fn, r;
                tsr_tpl_str s;
                const tsr_tpl_node *call = n->a;
                if (call->a->kind == TSR_TPL_N_GETATTR) {
                        tsr_tpl_val self;
                        if ((st = eval(c, call->a->a, f, &self)) != TSR_OK ||
                            (st = tsr_tpl_get_attr(c, self, call->a->name, &fn)) != TSR_OK)
                                return st;
                } else if ((st = eval(c, call->a, f, &fn)) != TSR_OK) {
                        return st;
                }
                if ((st = eval_args(c, call, f, &a)) != TSR_OK)
                        return st;
                if (fn.type != TSR_TPL_VAL_MACRO)
                        return fn.type == TSR_TPL_VAL_UNDEF ? tsr_tpl_undef_err(c, fn)
                                                            : tsr_tpl_rerr(c, TSR_E_UNSUPPORTED, "call block on a %s",
                                                                           tsr_tpl_type_name(fn));
                a.caller = (tsr_tpl_val){.type = TSR_TPL_VAL_MACRO};
                a.caller.u.m.n = n;
                a.caller.u.m.f = f;
                if ((st = call_macro(c, fn, &a, &r)) != TSR_OK)
                        return st;
                if (r.type == TSR_TPL_VAL_STR)
                        return tsr_tpl_emit(c, r.u.s.p, r.u.s.n);
                if ((st = tsr_tpl_to_str(c, r, &s)) != TSR_OK)
                        return st;
                return tsr_tpl_emit(c, s.p, s.n);
        }
        case TSR_TPL_N_BREAK: *flow = FLOW_BREAK; return TSR_OK;
        case TSR_TPL_N_CONTINUE: *flow = FLOW_CONTINUE; return TSR_OK;
        case TSR_TPL_N_BODY: return exec_body(c, n, f, flow);
        default: return tsr_tpl_rerr(c, TSR_E_INTERNAL, "unexpected node in statement list");
        }
}

static tsr_status exec_body(tsr_tpl_rctx *c, const tsr_tpl_node *body, tsr_tpl_frame *f, int *flow) {
        uint32_t k;
        tsr_status st;

        if ((st = tsr_tpl_nest_in(c)) != TSR_OK)
                return st;
        for (k = 0; k < body->nkids; k++) {
                if ((st = tsr_tpl_step(c, 1)) != TSR_OK)
                        break;
                if ((st = exec_node(c, body->kids[k], f, flow)) != TSR_OK)
                        break;
                if (*flow != FLOW_NORMAL)
                        break;
        }
        c->nest--;
        return st;
}

tsr_status tsr_template_render(const tsr_template *t, const json_t *context, const tsr_template_opts *opts,
                               char **out, size_t *out_len, char *err, size_t errlen) {
        static const tsr_template_opts defaults = {0};
        tsr_template_opts o = opts ? *opts : defaults;
        tsr_tpl_rctx c = {0};
        tsr_buf buf;
        tsr_tpl_val ctx;
        tsr_status st;
        int flow = FLOW_NORMAL;
        uint8_t *data;
        size_t len;

        if (err && errlen)
                err[0] = '\0';
        if (!t || !out || !out_len)
                return TSR_E_INVAL;
        if (context && !json_is_object(context)) {
                if (err && errlen)
                        snprintf(err, errlen, "template context must be a JSON object");
                return TSR_E_INVAL;
        }
        if (!o.max_output)
                o.max_output = TSR_TPL_DEF_MAX_OUTPUT;
        if (!o.max_memory)
                o.max_memory = TSR_TPL_DEF_MAX_MEMORY;
        if (!o.max_steps)
                o.max_steps = TSR_TPL_DEF_MAX_STEPS;
        if (!o.max_depth)
                o.max_depth = TSR_TPL_DEF_MAX_DEPTH;
        c.o = &o;
        c.max_output = o.max_output;
        c.max_steps = o.max_steps;
        c.max_depth = o.max_depth;
        c.err = err;
        c.errlen = errlen;
        if (!(c.a = tsr_arena_new(64 << 10, o.max_memory)))
                return TSR_E_NOMEM;
        tsr_buf_init(&buf, o.max_output);
        c.out = &buf;
        st = TSR_OK;
        if (context) {
                st = tsr_tpl_from_json(&c, context, &ctx, 0);
                if (st == TSR_OK)
                        c.vars = ctx.u.d;
        } else if (!(c.vars = tsr_tpl_dict_new(&c))) {
                st = c.st;
        }
        if (st == TSR_OK && !(c.root = tsr_tpl_frame_new(&c, NULL)))
                st = c.st;
        if (st == TSR_OK)
                st = exec_body(&c, t->root, c.root, &flow);
        if (st == TSR_OK && !buf.data) {
                /* an empty render still hands back a NUL-terminated string */
                if ((st = tsr_buf_reserve(&buf, 0)) != TSR_OK)
                        tsr_tpl_rerr(&c, st, "out of memory");
                else
                        buf.data[0] = '\0';
        }
        tsr_arena_free(&c.a);
        if (st != TSR_OK) {
                tsr_buf_done(&buf);
                return st;
        }
        data = tsr_buf_steal(&buf, &len);
        *out = (char *)data;
        *out_len = len;
        return TSR_OK;
}
