/* methods.c - the Python methods a template may call on str, dict, list and loop
 * values, and str.format. */
#include "template_int.h"

#include <ctype.h>

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

tsr_status tsr_tpl_call_str_method(tsr_tpl_rctx *c, tsr_tpl_str s, const char *m, const tsr_tpl_args *a,
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

tsr_status tsr_tpl_call_method(tsr_tpl_rctx *c, tsr_tpl_val self, const char *m, const tsr_tpl_args *a,
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
