/* parser.c - tokens to the AST (recursive descent), tsr_template_parse and
 * tsr_template_free. */
#include "template_int.h"

#include <stdio.h>
#include <stdlib.h>

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
