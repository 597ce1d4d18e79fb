/* lexer.c - template source to tokens: data, tags with their whitespace control
 * (trim_blocks, lstrip_blocks, "-" and "+"), names, operators, string and number
 * literals; and the parse-error message with its line and column (tsr_tpl_perr).
 * tsr_template_parse (parser.c) normalises newlines before calling tsr_tpl_lex. */
#include "template_int.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

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

tsr_status tsr_tpl_perr(tsr_tpl_parser *p, size_t off, tsr_status st, const char *fmt, ...) {
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

tsr_status tsr_tpl_push_tok(tsr_tpl_parser *p, tsr_tpl_token t) {
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

bool tsr_tpl_is_ascii_ws(char c) {
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

tsr_status tsr_tpl_lex(tsr_tpl_parser *p) {
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
