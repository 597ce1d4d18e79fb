/* value.c - the render context (errors, limits, arena), values (lists, dicts,
 * frames), str()/repr()/tojson, conversions, string helpers and attribute/item access. */
#include "template_int.h"

#include <ctype.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

/* ---------------------------------------------------------------- UTF-8 helpers */

/* Decode one code point at s[*i] (n bytes in all) and advance; invalid bytes decode as
 * themselves (Latin-1) so nothing is ever skipped or read past n. */
uint32_t tsr_tpl_utf8_next(const char *s, size_t n, size_t *i) {
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

size_t tsr_tpl_utf8_put(char *out, uint32_t c) {
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

size_t tsr_tpl_utf8_len(const char *s, size_t n) {
        size_t i = 0, k = 0;
        while (i < n) {
                tsr_tpl_utf8_next(s, n, &i);
                k++;
        }
        return k;
}

/* Python's str.isspace(), which str.strip() and str.split() use. */
bool tsr_tpl_py_isspace(uint32_t c) {
        if (c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f))
                return true;
        if (c < 0x85)
                return false;
        return c == 0x85 || c == 0xa0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 ||
               c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

/* Byte length of the trailing whitespace code points of s[0..n). */
size_t tsr_tpl_rstrip_ws_len(const char *s, size_t n) {
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

size_t tsr_tpl_lstrip_ws_len(const char *s, size_t n) {
        size_t i = 0;
        while (i < n) {
                size_t j = i;
                if (!tsr_tpl_py_isspace(tsr_tpl_utf8_next(s, n, &j)))
                        break;
                i = j;
        }
        return i;
}

/* ---------------------------------------------------------------- render state */

/* The globals, in the order of TSR_TPL_B_* (template_int.h): tsr_tpl_lookup turns a name
 * into its index, which call_builtin in eval.c switches on. */
static const char *const builtin_names[] = {"range", "namespace", "dict", "raise_exception", "strftime_now"};

tsr_status tsr_tpl_rerr(tsr_tpl_rctx *c, tsr_status st, const char *fmt, ...) {
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

tsr_status tsr_tpl_oom(tsr_tpl_rctx *c) {
        if (tsr_arena_over_limit(c->a))
                return tsr_tpl_rerr(c, TSR_E_LIMIT, "template render used more than its memory limit");
        return tsr_tpl_rerr(c, TSR_E_NOMEM, "out of memory");
}

void *tsr_tpl_ralloc(tsr_tpl_rctx *c, size_t n) {
        void *p = tsr_arena_alloc(c->a, n ? n : 1);
        if (!p)
                tsr_tpl_oom(c);
        return p;
}

tsr_status tsr_tpl_step(tsr_tpl_rctx *c, uint64_t k) {
        c->steps += k;
        if (c->steps > c->max_steps)
                return tsr_tpl_rerr(c, TSR_E_LIMIT, "template render took more than %" PRIu64 " steps", c->max_steps);
        return TSR_OK;
}

tsr_status tsr_tpl_nest_in(tsr_tpl_rctx *c) {
        if (++c->nest > TSR_TPL_MAX_EVAL_NEST)
                return tsr_tpl_rerr(c, TSR_E_LIMIT, "template render nested too deep");
        return TSR_OK;
}

bool tsr_tpl_sb_add(tsr_tpl_rctx *c, tsr_tpl_sb *b, const char *s, size_t n) {
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

bool tsr_tpl_sb_adds(tsr_tpl_rctx *c, tsr_tpl_sb *b, const char *s) {
        return tsr_tpl_sb_add(c, b, s, strlen(s));
}

tsr_status tsr_tpl_emit(tsr_tpl_rctx *c, const char *s, size_t n) {
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

tsr_tpl_list *tsr_tpl_list_new(tsr_tpl_rctx *c, size_t cap) {
        tsr_tpl_list *l = tsr_tpl_ralloc(c, sizeof(*l));
        if (!l)
                return NULL;
        memset(l, 0, sizeof(*l));
        if (cap && !(l->v = tsr_tpl_ralloc(c, cap * sizeof(tsr_tpl_val))))
                return NULL;
        l->cap = cap;
        return l;
}

bool tsr_tpl_list_push(tsr_tpl_rctx *c, tsr_tpl_list *l, tsr_tpl_val v) {
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

tsr_tpl_dict *tsr_tpl_dict_new(tsr_tpl_rctx *c) {
        tsr_tpl_dict *d = tsr_tpl_ralloc(c, sizeof(*d));
        if (d)
                memset(d, 0, sizeof(*d));
        return d;
}


tsr_tpl_val *tsr_tpl_dict_find(tsr_tpl_rctx *c, const tsr_tpl_dict *d, tsr_tpl_val key) {
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

tsr_tpl_val *tsr_tpl_dict_finds(const tsr_tpl_dict *d, const char *key, size_t n) {
        size_t i;
        for (i = 0; i < d->n; i++)
                if (d->k[i].type == TSR_TPL_VAL_STR && d->k[i].u.s.n == n && memcmp(d->k[i].u.s.p, key, n) == 0)
                        return &d->v[i];
        return NULL;
}

bool tsr_tpl_dict_set(tsr_tpl_rctx *c, tsr_tpl_dict *d, tsr_tpl_val key, tsr_tpl_val val) {
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

bool tsr_tpl_frame_set(tsr_tpl_rctx *c, tsr_tpl_frame *f, tsr_tpl_str name, tsr_tpl_val val) {
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

tsr_tpl_frame *tsr_tpl_frame_new(tsr_tpl_rctx *c, tsr_tpl_frame *parent) {
        tsr_tpl_frame *f = tsr_tpl_ralloc(c, sizeof(*f));
        if (f) {
                memset(f, 0, sizeof(*f));
                f->parent = parent;
        }
        return f;
}

tsr_tpl_val tsr_tpl_lookup(tsr_tpl_rctx *c, const tsr_tpl_frame *f, tsr_tpl_str name) {
        size_t i;
        tsr_tpl_val *v;
        for (; f; f = f->parent)
                for (i = f->n; i-- > 0;)
                        if (f->names[i].n == name.n && memcmp(f->names[i].p, name.p, name.n) == 0)
                                return f->vals[i];
        if ((v = tsr_tpl_dict_finds(c->vars, name.p, name.n)))
                return *v;
        for (i = 0; i < sizeof(builtin_names) / sizeof(builtin_names[0]); i++) {
                if (tsr_tpl_str_eq(name, builtin_names[i])) {
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

const char *tsr_tpl_type_name(tsr_tpl_val v) {
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

tsr_status tsr_tpl_undef_err(tsr_tpl_rctx *c, tsr_tpl_val u) {
        if (u.u.s.p && u.u.s.n)
                return tsr_tpl_rerr(c, TSR_E_INVAL, "'%.*s' is undefined", (int)u.u.s.n, u.u.s.p);
        return tsr_tpl_rerr(c, TSR_E_INVAL, "value is undefined");
}

bool tsr_tpl_truthy(tsr_tpl_val v) {
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

bool tsr_tpl_is_num(tsr_tpl_val v) {
        return v.type == TSR_TPL_VAL_BOOL || v.type == TSR_TPL_VAL_INT || v.type == TSR_TPL_VAL_FLOAT;
}

bool tsr_tpl_val_eq(tsr_tpl_rctx *c, tsr_tpl_val a, tsr_tpl_val b) {
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
tsr_status tsr_tpl_val_cmp(tsr_tpl_rctx *c, tsr_tpl_val a, tsr_tpl_val b, const char *op, int *r) {
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


bool tsr_tpl_repr_append(tsr_tpl_rctx *c, tsr_tpl_sb *b, tsr_tpl_val v) {
        if (v.type == TSR_TPL_VAL_STR)
                return repr_str(c, b, v.u.s);
        return tsr_tpl_str_append(c, b, v);
}

/* Python str() of a value, as jinja2 prints it. */
bool tsr_tpl_str_append(tsr_tpl_rctx *c, tsr_tpl_sb *b, tsr_tpl_val v) {
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
tsr_status tsr_tpl_to_str(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_str *out) {
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


static int cmp_dict_keys(tsr_tpl_rctx *c, tsr_tpl_val a, tsr_tpl_val b, void *u) {
        const tsr_tpl_val *keys = u;
        return tsr_tpl_cmp_keys(c, keys[a.u.i], keys[b.u.i]);
}

bool tsr_tpl_json_dump(tsr_tpl_rctx *c, tsr_tpl_sb *b, tsr_tpl_val v, const tsr_tpl_jopt *o, int level) {
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

tsr_status tsr_tpl_from_json(tsr_tpl_rctx *c, const json_t *j, tsr_tpl_val *out, int depth) {
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

int tsr_tpl_cmp_keys(tsr_tpl_rctx *c, tsr_tpl_val a, tsr_tpl_val b) {
        int r = 0;
        if (c->failed || tsr_tpl_val_cmp(c, a, b, "<", &r) != TSR_OK)
                return 0;
        return r;
}

/* Stable merge sort (Python's sort is stable); a comparison error stops it. */
tsr_status tsr_tpl_sort_tv(tsr_tpl_rctx *c, tsr_tpl_val *v, size_t n,
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

tsr_tpl_val tsr_tpl_str_dup(tsr_tpl_rctx *c, const char *p, size_t n) {
        char *d = tsr_tpl_ralloc(c, n + 1);
        if (!d)
                return TSR_TPL_VAL_UNDEFINED;
        memcpy(d, p, n);
        d[n] = '\0';
        return tsr_tpl_val_str(d, n);
}

/* ASCII case mapping; other code points pass through unchanged. */
tsr_tpl_val tsr_tpl_str_map(tsr_tpl_rctx *c, tsr_tpl_str s, int mode) {
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
tsr_tpl_val tsr_tpl_jinja_title(tsr_tpl_rctx *c, tsr_tpl_str s) {
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
tsr_tpl_str tsr_tpl_str_strip(tsr_tpl_str s, const tsr_tpl_str *chars, char which) {
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

const char *tsr_tpl_memmem_s(tsr_tpl_str hay, size_t from, tsr_tpl_str needle) {
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

tsr_status tsr_tpl_str_replace(tsr_tpl_rctx *c, tsr_tpl_str s, tsr_tpl_str old, tsr_tpl_str new_, int64_t count,
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

tsr_status tsr_tpl_str_split(tsr_tpl_rctx *c, tsr_tpl_str s, const tsr_tpl_str *sep, int64_t maxsplit,
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
const char *const tsr_tpl_dict_methods[] = {"items", "keys", "values", "get", "copy", NULL};
static const char *const dict_unsafe[] = {"pop", "popitem", "setdefault", "update", "clear", NULL};
static const char *const list_methods[] = {"index", "count", "copy", NULL};
static const char *const list_unsafe[] = {"append", "extend", "insert", "pop", "remove", "reverse", "sort", "clear",
                                          NULL};

const char *tsr_tpl_find_name(const char *const *tab, tsr_tpl_str name) {
        size_t k;
        for (k = 0; tab[k]; k++)
                if (tsr_tpl_str_eq(name, tab[k]))
                        return tab[k];
        return NULL;
}

tsr_tpl_val tsr_tpl_make_method(tsr_tpl_rctx *c, tsr_tpl_val self, const char *name) {
        tsr_tpl_val m = {.type = TSR_TPL_VAL_METHOD};
        tsr_tpl_val *s = tsr_tpl_ralloc(c, sizeof(tsr_tpl_val));
        if (!s)
                return TSR_TPL_VAL_UNDEFINED;
        *s = self;
        m.u.meth.self = s;
        m.u.meth.name = name;
        return m;
}

tsr_tpl_val tsr_tpl_undef_named(tsr_tpl_str name) {
        tsr_tpl_val u = {.type = TSR_TPL_VAL_UNDEF};
        u.u.s = name;
        return u;
}

tsr_status tsr_tpl_get_attr(tsr_tpl_rctx *c, tsr_tpl_val obj, tsr_tpl_str name, tsr_tpl_val *out) {
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

tsr_status tsr_tpl_do_slice(tsr_tpl_rctx *c, tsr_tpl_val obj, tsr_tpl_val lo, tsr_tpl_val hi, tsr_tpl_val stp,
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

tsr_status tsr_tpl_get_item(tsr_tpl_rctx *c, tsr_tpl_val obj, tsr_tpl_val key, tsr_tpl_val *out) {
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
tsr_status tsr_tpl_iter_list(tsr_tpl_rctx *c, tsr_tpl_val v, tsr_tpl_list **out) {
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

tsr_status tsr_tpl_dict_items(tsr_tpl_rctx *c, tsr_tpl_dict *d, tsr_tpl_val *out) {
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

bool tsr_tpl_arg_get(const tsr_tpl_args *a, size_t i, const char *name, tsr_tpl_val *out) {
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

tsr_status tsr_tpl_arg_str(tsr_tpl_rctx *c, const tsr_tpl_args *a, size_t i, const char *name, const char *what,
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

tsr_status tsr_tpl_arg_int(tsr_tpl_rctx *c, const tsr_tpl_args *a, size_t i, const char *name, int64_t def,
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
