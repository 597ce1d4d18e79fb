/* eval.c - the tree-walking evaluator: calls, expressions, statements and
 * tsr_template_render. */
#include "template_int.h"

#include <math.h>
#include <stdio.h>
#include <time.h>

/* ---------------------------------------------------------------- calls */

static tsr_status exec_body(tsr_tpl_rctx *c, const tsr_tpl_node *body, tsr_tpl_frame *f, int *flow);
static tsr_status eval(tsr_tpl_rctx *c, const tsr_tpl_node *n, tsr_tpl_frame *f, tsr_tpl_val *out);

enum { FLOW_NORMAL, FLOW_BREAK, FLOW_CONTINUE };

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
