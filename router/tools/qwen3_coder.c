/* qwen3_coder.c - vLLM's `qwen3_coder` parser, the XML format of Qwen3-Coder and
 * Nemotron-3-Nano:
 *
 *   [content]<tool_call>
 *   <function=get_weather>
 *   <parameter=city>
 *   Paris
 *   </parameter>
 *   </function>
 *   </tool_call>
 *
 * Calls are the <function=...> blocks inside <tool_call> blocks (or in the whole text
 * when there is none); a parameter runs to </parameter>, the next <parameter=, the
 * </function> or the end, one leading and one trailing newline removed.  Values are
 * converted by the type the request's tool schema gives the parameter, as vLLM does
 * (strings stay strings; int/float/bool parsed, falling back to the string; objects
 * and arrays via json.loads, then a Python literal, then the string; "null" is null
 * for any type).  content is the text before the first <tool_call> (or <function=),
 * null when empty. */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/openai.h"
#include "router/tools/parsers.h"

#define OPEN "<tool_call>"
#define FUNC "<function="

static tsr_tools_re call_re = TSR_TOOLS_RE("<tool_call>(.*?)</tool_call>|<tool_call>(.*?)$", PCRE2_DOTALL);
static tsr_tools_re func_re = TSR_TOOLS_RE("<function=(.*?)</function>|<function=(.*)$", PCRE2_DOTALL);
static tsr_tools_re param_re = TSR_TOOLS_RE(
        "<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", PCRE2_DOTALL);

/* ---- the schema type of a parameter ---- */

/* vLLM's _get_arguments_config: the `properties` of the named tool's parameters (or
 * the parameters object itself when it has none). */
static json_t *arg_config(json_t *tools, const char *fname, size_t flen) {
        json_t *t;
        size_t i;
        json_array_foreach(tools, i, t) {
                json_t *f = json_object_get(t, "function"), *p;
                const char *nm = json_string_value(json_object_get(f, "name"));
                if (!nm || strlen(nm) != flen || memcmp(nm, fname, flen) != 0)
                        continue;
                p = json_object_get(f, "parameters");
                if (!json_is_object(p))
                        return NULL;
                return json_is_object(json_object_get(p, "properties")) ? json_object_get(p, "properties") : p;
        }
        return NULL;
}

static bool starts(const char *s, const char *p) { return strncmp(s, p, strlen(p)) == 0; }

static bool in_list(const char *s, const char *const *l) {
        for (; *l; l++)
                if (strcmp(s, *l) == 0)
                        return true;
        return false;
}

/* Python's str.strip() on ASCII whitespace, then the text as a NUL-terminated copy. */
static char *stripped(const char *v, size_t n) {
        while (n && isspace((unsigned char)*v))
                v++, n--;
        while (n && isspace((unsigned char)v[n - 1]))
                n--;
        return strndup(v, n);
}

/* int(): sign, digits with single underscores between them.  Canonical digits out. */
static bool py_int(const char *v, size_t n, tsr_buf *out) {
        char *s = stripped(v, n), *p;
        bool neg = false, ok = true;
        tsr_buf d;
        if (!s)
                return false;
        p = s;
        if (*p == '+' || *p == '-')
                neg = *p++ == '-';
        tsr_buf_init(&d, 1 << 20);
        if (!isdigit((unsigned char)*p))
                ok = false;
        for (; ok && *p; p++) {
                if (isdigit((unsigned char)*p))
                        tsr_buf_append(&d, p, 1);
                else if (!(*p == '_' && isdigit((unsigned char)p[1]) && p > s && isdigit((unsigned char)p[-1])))
                        ok = false;
        }
        if (ok) {
                const char *q = (char *)d.data;
                while (q[0] == '0' && q[1])
                        q++;
                if (neg && strcmp(q, "0") != 0)
                        tsr_buf_append(out, "-", 1);
                tsr_buf_append_str(out, q);
        }
        tsr_buf_done(&d);
        free(s);
        return ok;
}

/* float(), then an integral value written as an int (vLLM's f - int(f) != 0 test);
 * inf and nan fail int() there, so they stay strings. */
static bool py_float(const char *v, size_t n, tsr_buf *out) {
        char *s = stripped(v, n), *end, *w, *r;
        double f;
        bool ok;
        if (!s)
                return false;
        /* underscores between digits are allowed by float(); strtod does not know them */
        for (w = r = s; *r; r++)
                if (!(*r == '_' && r > s && isdigit((unsigned char)r[-1]) && isdigit((unsigned char)r[1])))
                        *w++ = *r;
        *w = '\0';
        /* strtod also reads hex floats, which float() does not */
        ok = *s && !strpbrk(s, "xX") && (f = strtod(s, &end), *end == '\0') && isfinite(f);
        if (ok) {
                char buf[400];
                if (f == floor(f) && fabs(f) < 1e300) {
                        snprintf(buf, sizeof(buf), "%.0f", f);
                        tsr_buf_append_str(out, strcmp(buf, "-0") == 0 ? "0" : buf);
                } else {
                        tsr_oai_py_float_repr(f, buf, sizeof(buf));
                        tsr_buf_append_str(out, buf);
                }
        }
        free(s);
        return ok;
}

/* One parameter's value as JSON text, converted the way _convert_param_value does. */
static tsr_status convert(json_t *config, const char *pname, size_t plen, const char *v, size_t n, tsr_buf *out) {
        static const char *const str_types[] = {"string", "str", "text", "varchar", "char", "enum", NULL};
        static const char *const bool_types[] = {"boolean", "bool", "binary", NULL};
        char type[64] = "string", *key;
        json_t *pc, *ty;

        if (n == 4 && strncasecmp(v, "null", 4) == 0)
                return tsr_buf_append(out, "null", 4);
        if (!(key = strndup(pname, plen)))
                return TSR_E_NOMEM;
        pc = config ? json_object_get(config, key) : NULL;
        free(key);
        if (!pc)
                return tsr_canon_string(out, v, n, false);
        if (json_is_object(pc) && (ty = json_object_get(pc, "type"))) {
                /* str(type).strip().lower(); a non-string type (a list) matches no name */
                const char *ts = json_string_value(ty);
                size_t k = 0;
                if (ts) {
                        char *st = stripped(ts, strlen(ts));
                        for (; st && st[k] && k < sizeof(type) - 1; k++)
                                type[k] = (char)tolower((unsigned char)st[k]);
                        type[k] = '\0';
                        free(st);
                } else {
                        snprintf(type, sizeof(type), "<%s>", json_is_array(ty) ? "list" : "other");
                }
        }
        if (in_list(type, str_types))
                return tsr_canon_string(out, v, n, false);
        size_t mark = out->len;
        if (starts(type, "int") || starts(type, "uint") || starts(type, "long") || starts(type, "short") ||
            starts(type, "unsigned")) {
                if (py_int(v, n, out))
                        return TSR_OK;
                out->len = mark;
                return tsr_canon_string(out, v, n, false);
        }
        if (starts(type, "num") || starts(type, "float")) {
                if (py_float(v, n, out))
                        return TSR_OK;
                out->len = mark;
                return tsr_canon_string(out, v, n, false);
        }
        if (in_list(type, bool_types))
                return tsr_buf_append_str(out, n == 4 && strncasecmp(v, "true", 4) == 0 ? "true" : "false");
        if (strcmp(type, "object") == 0 || strcmp(type, "array") == 0 || strcmp(type, "arr") == 0 ||
            starts(type, "dict") || starts(type, "list")) {
                const tsr_canon_opts jo = {0};
                if (tsr_canon_whole(v, n, &jo, out))
                        return TSR_OK;
        }
        /* ast.literal_eval, else the string */
        const tsr_canon_opts po = {.py = true, .allow_neg = true};
        if (tsr_canon_whole(v, n, &po, out))
                return TSR_OK;
        return tsr_canon_string(out, v, n, false);
}

/* ---- parsing ---- */

typedef struct param {
        size_t ks, ke;                /* the name in the text */
        size_t vo;                    /* offset of the value in `vals` */
        size_t vl;
} param;

/* One <function=...> body s[0..n) (after "<function="): the call as far as it goes.
 * complete: the function was closed (or the output is final). */
static tsr_status one_function(const tsr_tools_ctx *ctx, const char *s, size_t n, bool complete, bool final,
                               tsr_tools_result *out, bool *ok) {
        const char *gt = memchr(s, '>', n);
        tsr_buf args, vals;
        param *ps = NULL;
        size_t np = 0, from, ov[2];
        tsr_status st = TSR_OK;
        json_t *config;

        if (!gt) {
                *ok = final ? false : true;   /* str.index raises: the extraction fails */
                return TSR_OK;
        }
        config = arg_config(ctx->tools, s, (size_t)(gt - s));
        tsr_buf_init(&args, (size_t)64 << 20);
        tsr_buf_init(&vals, (size_t)64 << 20);
        from = (size_t)(gt - s) + 1;
        for (;;) {
                int m = tsr_tools_re_match(&param_re, s, n, from, 0, ov, 2);
                size_t ms, me, gl;
                const char *body, *pgt;
                if (m <= 0)
                        break;
                ms = ov[0];
                me = ov[1];
                from = me > from ? me : from + 1;
                /* a parameter cut by the end of a stream in progress may still grow */
                if (!final && !complete && me >= n - (n && s[n - 1] == '\n' ? 1 : 0) &&
                    !(me >= 12 && memcmp(s + me - 12, "</parameter>", 12) == 0))
                        break;
                body = s + ms + strlen("<parameter=");
                gl = me - (ms + strlen("<parameter="));
                if (gl >= 12 && memcmp(body + gl - 12, "</parameter>", 12) == 0)
                        gl -= 12;
                pgt = memchr(body, '>', gl);
                if (!pgt) {
                        if (final)
                                *ok = false;
                        break;
                }
                size_t ks = (size_t)(body - s), ke = (size_t)(pgt - s);
                const char *v = pgt + 1;
                size_t vl = gl - (size_t)(v - body);
                if (vl && v[0] == '\n')
                        v++, vl--;
                if (vl && v[vl - 1] == '\n')
                        vl--;
                param *g = realloc(ps, (np + 1) * sizeof(*g));
                if (!g) {
                        st = TSR_E_NOMEM;
                        break;
                }
                ps = g;
                /* a repeated name keeps its first place and takes the last value (a dict) */
                size_t at = np;
                for (size_t k = 0; k < np; k++)
                        if (ps[k].ke - ps[k].ks == ke - ks && memcmp(s + ps[k].ks, s + ks, ke - ks) == 0)
                                at = k;
                size_t vo = vals.len;
                if ((st = convert(config, s + ks, ke - ks, v, vl, &vals)) != TSR_OK)
                        break;
                ps[at] = (param){.ks = ks, .ke = ke, .vo = vo, .vl = vals.len - vo};
                if (at == np)
                        np++;
        }
        if (st == TSR_OK && *ok) {
                tsr_buf_append(&args, "{", 1);
                for (size_t k = 0; k < np; k++) {
                        if (k)
                                tsr_buf_append(&args, ", ", 2);
                        tsr_canon_string(&args, s + ps[k].ks, ps[k].ke - ps[k].ks, false);
                        tsr_buf_append(&args, ": ", 2);
                        tsr_buf_append(&args, vals.data + ps[k].vo, ps[k].vl);
                }
                if (complete || final)
                        tsr_buf_append(&args, "}", 1);
                st = tsr_tools_result_add(out, s, (size_t)(gt - s), (char *)args.data, args.len);
        }
        free(ps);
        tsr_buf_done(&args);
        tsr_buf_done(&vals);
        return st;
}

/* The <function=...> blocks of s[0..n), in order. */
static tsr_status functions(const tsr_tools_ctx *ctx, const char *s, size_t n, bool final, tsr_tools_result *out,
                            bool *ok) {
        size_t from = 0, ov[6];
        tsr_status st = TSR_OK;
        while (*ok && st == TSR_OK) {
                int m = tsr_tools_re_match(&func_re, s, n, from, 0, ov, 6);
                bool closed;
                if (m <= 0) {
                        if (m < 0)
                                *ok = false;
                        break;
                }
                closed = ov[2] != (size_t)PCRE2_UNSET;
                size_t a = closed ? ov[2] : ov[4], b = closed ? ov[3] : ov[5];
                st = one_function(ctx, s + a, b - a, closed, final, out, ok);
                if (!final && !closed)
                        break;
                from = ov[1] > from ? ov[1] : from + 1;
        }
        return st;
}

tsr_status tsr_tools_parse_qwen3_coder(const tsr_tools_ctx *ctx, const char *text, size_t len, bool final,
                                       tsr_tools_result *out) {
        const char *open = memmem(text, len, OPEN, strlen(OPEN)), *fn = memmem(text, len, FUNC, strlen(FUNC));
        tsr_status st = TSR_OK;
        bool ok = true;
        size_t ov[6], from = 0;

        memset(out, 0, sizeof(*out));
        if (!final) {
                size_t h1 = tsr_tools_holdback(text, len, OPEN), h2 = tsr_tools_holdback(text, len, FUNC);
                out->safe_content = open && (!fn || open < fn) ? (size_t)(open - text)
                                    : fn                       ? (size_t)(fn - text)
                                                               : len - (h1 > h2 ? h1 : h2);
        }
        if (!fn)
                goto as_content;
        if (!open) {
                st = functions(ctx, text, len, final, out, &ok);
        } else {
                while (ok && st == TSR_OK) {
                        int m = tsr_tools_re_match(&call_re, text, len, from, 0, ov, 6);
                        if (m <= 0) {
                                if (m < 0)
                                        ok = false;
                                break;
                        }
                        bool closed = ov[2] != (size_t)PCRE2_UNSET;
                        size_t a = closed ? ov[2] : ov[4], b = closed ? ov[3] : ov[5];
                        st = functions(ctx, text + a, b - a, final, out, &ok);
                        from = ov[1] > from ? ov[1] : from + 1;
                }
        }
        if (st != TSR_OK)
                return st;
        if (!final)
                return TSR_OK;
        if (ok && out->n_calls)
                return tsr_tools_result_called(out, text, open ? (size_t)(open - text) : (size_t)(fn - text));
as_content:
        return final ? tsr_tools_result_all_content(out, text, len) : TSR_OK;
}
