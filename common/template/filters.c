/* filters.c - jinja2's tests and filters, each one function in a sorted table. */
#include "template_int.h"

#include <assert.h>
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>

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

/* Every jinja2 test takes the value and at most one argument: `x` is the first positional
 * argument or undefined, `have` says whether one was given. */
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
tsr_status tsr_tpl_test_in(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_val x, bool have, bool *out) {
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

int tsr_tpl_test_find(tsr_tpl_str name) {
        const struct test_def *e;
#ifndef NDEBUG
        for (size_t k = 1; k < sizeof(tests) / sizeof(tests[0]); k++)
                assert(strcmp(tests[k - 1].name, tests[k].name) < 0);
#endif
        e = bsearch(&name, tests, sizeof(tests) / sizeof(tests[0]), sizeof(tests[0]), name_cmp);
        return e ? (int)(e - tests) : -1;
}

tsr_status tsr_tpl_test_run(tsr_tpl_rctx *c, int id, tsr_tpl_val v, const tsr_tpl_args *a, bool *out) {
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

tsr_status tsr_tpl_copy_list(tsr_tpl_rctx *c, tsr_tpl_list *src, tsr_tpl_list **out) {
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

tsr_status tsr_tpl_filter_escape(tsr_tpl_rctx *c, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
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

int tsr_tpl_filter_find(tsr_tpl_str name) {
        const struct filter_def *e;
#ifndef NDEBUG
        for (size_t k = 1; k < sizeof(filters) / sizeof(filters[0]); k++)
                assert(strcmp(filters[k - 1].name, filters[k].name) < 0);
#endif
        e = bsearch(&name, filters, sizeof(filters) / sizeof(filters[0]), sizeof(filters[0]), name_cmp);
        return e ? (int)(e - filters) : -1;
}

tsr_status tsr_tpl_filter_run(tsr_tpl_rctx *c, int fid, tsr_tpl_val v, const tsr_tpl_args *a, tsr_tpl_val *out) {
        return filters[fid].fn(c, v, a, out);
}
