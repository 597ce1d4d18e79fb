/* canon.c - one JSON value or Python literal rewritten as Python's json.dumps writes
 * it, from complete or truncated input (see tools.h).  vLLM's parsers do
 * json.dumps(json.loads(text)) or json.dumps(<Python literal>); the arguments string a
 * client gets is that rewrite, so it is reproduced here byte for byte: ", " and ": "
 * separators, floats as Python's repr, NaN/Infinity, ensure_ascii escapes.  On
 * truncated input only what the complete value will surely start with is written
 * (numbers and keywords wait for their end), which is what the stream sends.
 * Recursive descent with a depth cap; any thread. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/openai.h"
#include "router/tools/tools.h"

#define MAX_DEPTH 64
enum { DONE = 1, MORE = 0, BAD = -1 };

typedef struct cz {
        const char *s;
        size_t n, i;
        const tsr_canon_opts *o;
        tsr_buf *out;
        int depth;
} cz;

static int put(cz *c, const char *p, size_t n) { return tsr_buf_append(c->out, p, n) == TSR_OK ? DONE : BAD; }

size_t tsr_canon_skip_ws(const char *s, size_t n, size_t i, bool py) {
        for (; i < n; i++) {
                char ch = s[i];
                if (ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r')
                        continue;
                if (py && ch == '#') {   /* a comment runs to the end of the line */
                        while (i < n && s[i] != '\n')
                                i++;
                        if (i == n)
                                return n;
                        continue;
                }
                if (py && ch == '\\' && i + 1 < n && s[i + 1] == '\n') {   /* explicit line joining */
                        i++;
                        continue;
                }
                break;
        }
        return i;
}

static void ws(cz *c) { c->i = tsr_canon_skip_ws(c->s, c->n, c->i, c->o->py); }

/* ---- strings ---- */

static int put_cp(tsr_buf *out, uint32_t cp, bool ascii) {
        char tmp[16];
        size_t k = 0;
        switch (cp) {
        case '"': return tsr_buf_append(out, "\\\"", 2) == TSR_OK ? DONE : BAD;
        case '\\': return tsr_buf_append(out, "\\\\", 2) == TSR_OK ? DONE : BAD;
        case '\n': return tsr_buf_append(out, "\\n", 2) == TSR_OK ? DONE : BAD;
        case '\r': return tsr_buf_append(out, "\\r", 2) == TSR_OK ? DONE : BAD;
        case '\t': return tsr_buf_append(out, "\\t", 2) == TSR_OK ? DONE : BAD;
        case '\b': return tsr_buf_append(out, "\\b", 2) == TSR_OK ? DONE : BAD;
        case '\f': return tsr_buf_append(out, "\\f", 2) == TSR_OK ? DONE : BAD;
        default: break;
        }
        if (cp < 0x20 || (cp >= 0xD800 && cp <= 0xDFFF) || (ascii && cp > 0x7E)) {
                /* Control characters always, lone surrogates (Python keeps them in a str;
                 * raw they would not be UTF-8) and, with ensure_ascii, all non-ASCII as
                 * \uXXXX, astral code points as a surrogate pair; 0x7F stays raw. */
                if (cp > 0xFFFF) {
                        uint32_t v = cp - 0x10000;
                        k = (size_t)snprintf(tmp, sizeof(tmp), "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
                } else {
                        k = (size_t)snprintf(tmp, sizeof(tmp), "\\u%04x", cp);
                }
                return tsr_buf_append(out, tmp, k) == TSR_OK ? DONE : BAD;
        }
        if (cp < 0x80) {
                tmp[k++] = (char)cp;
        } else if (cp < 0x800) {
                tmp[k++] = (char)(0xC0 | (cp >> 6));
                tmp[k++] = (char)(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
                tmp[k++] = (char)(0xE0 | (cp >> 12));
                tmp[k++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                tmp[k++] = (char)(0x80 | (cp & 0x3F));
        } else {
                tmp[k++] = (char)(0xF0 | (cp >> 18));
                tmp[k++] = (char)(0x80 | ((cp >> 12) & 0x3F));
                tmp[k++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                tmp[k++] = (char)(0x80 | (cp & 0x3F));
        }
        return tsr_buf_append(out, tmp, k) == TSR_OK ? DONE : BAD;
}

/* One UTF-8 code point at s[*i]: MORE when cut, BAD when invalid (U+FFFD then, as the
 * detokenizer would have produced). */
static int utf8_next(const char *s, size_t n, size_t *i, uint32_t *cp) {
        const unsigned char *u = (const unsigned char *)s + *i;
        size_t left = n - *i, len;
        if (u[0] < 0x80) {
                *cp = u[0];
                len = 1;
        } else if ((u[0] & 0xE0) == 0xC0) {
                len = 2;
                *cp = u[0] & 0x1F;
        } else if ((u[0] & 0xF0) == 0xE0) {
                len = 3;
                *cp = u[0] & 0x0F;
        } else if ((u[0] & 0xF8) == 0xF0) {
                len = 4;
                *cp = u[0] & 0x07;
        } else {
                *cp = 0xFFFD;
                *i += 1;
                return DONE;
        }
        if (left < len)
                return MORE;
        for (size_t k = 1; k < len; k++) {
                if ((u[k] & 0xC0) != 0x80) {
                        *cp = 0xFFFD;
                        *i += 1;
                        return DONE;
                }
                *cp = (*cp << 6) | (u[k] & 0x3F);
        }
        *i += len;
        return DONE;
}

tsr_status tsr_canon_string(tsr_buf *out, const char *s, size_t n, bool ascii) {
        size_t i = 0;
        uint32_t cp;
        if (tsr_buf_append(out, "\"", 1) != TSR_OK)
                return TSR_E_NOMEM;
        while (i < n) {
                if (utf8_next(s, n, &i, &cp) == MORE) {
                        cp = 0xFFFD;
                        i = n;
                }
                if (put_cp(out, cp, ascii) != DONE)
                        return TSR_E_NOMEM;
        }
        return tsr_buf_append(out, "\"", 1) == TSR_OK ? TSR_OK : TSR_E_NOMEM;
}

static int hexval(char ch) {
        if (ch >= '0' && ch <= '9')
                return ch - '0';
        if (ch >= 'a' && ch <= 'f')
                return ch - 'a' + 10;
        if (ch >= 'A' && ch <= 'F')
                return ch - 'A' + 10;
        return -1;
}

/* k hex digits at s[i]: MORE when cut, BAD when not hex. */
static int hexn(const char *s, size_t n, size_t i, int k, uint32_t *v) {
        *v = 0;
        for (int j = 0; j < k; j++) {
                int h;
                if (i + (size_t)j >= n)
                        return MORE;
                if ((h = hexval(s[i + (size_t)j])) < 0)
                        return BAD;
                *v = (*v << 4) | (uint32_t)h;
        }
        return DONE;
}

/* A string literal at c->i (at its quote).  JSON: "..." with json.loads' escapes, no
 * raw control characters.  Python: '...' or "..." (optionally u/r-prefixed; b-strings
 * are not JSON-serialisable, as vLLM's json.dumps would fail), no raw newlines.  Each
 * decoded character is written as it is read: on a cut, what was written stays. */
static int str_lit(cz *c) {
        bool raw = false;
        char q;
        int rc;
        if (c->o->py) {
                if (c->i < c->n && (c->s[c->i] == 'r' || c->s[c->i] == 'R' || c->s[c->i] == 'u' || c->s[c->i] == 'U')) {
                        raw = c->s[c->i] == 'r' || c->s[c->i] == 'R';
                        c->i++;
                        if (c->i == c->n)
                                return MORE;
                }
                q = c->s[c->i];
                if (q != '\'' && q != '"')
                        return BAD;
                /* Triple-quoted strings: not produced by these models' formats; refused
                 * rather than misread. */
                if (c->i + 2 < c->n && c->s[c->i + 1] == q && c->s[c->i + 2] == q)
                        return BAD;
        } else {
                q = '"';
                if (c->s[c->i] != '"')
                        return BAD;
        }
        c->i++;
        if ((rc = put(c, "\"", 1)) != DONE)
                return rc;
        while (c->i < c->n) {
                char ch = c->s[c->i];
                uint32_t cp;
                if (ch == q) {
                        c->i++;
                        return put(c, "\"", 1);
                }
                if ((unsigned char)ch < 0x20 && (!c->o->py || ch == '\n' || ch == '\r'))
                        return BAD;   /* json.loads(strict=True); a Python one-line string */
                if (ch != '\\' || raw) {
                        if (raw && ch == '\\') {
                                /* r'..': the backslash stays, and it keeps a following quote in */
                                if (c->i + 1 >= c->n)
                                        return MORE;
                                if ((rc = put_cp(c->out, '\\', c->o->ascii)) != DONE)
                                        return rc;
                                c->i++;
                                if ((rc = utf8_next(c->s, c->n, &c->i, &cp)) != DONE)
                                        return rc;
                                if ((rc = put_cp(c->out, cp, c->o->ascii)) != DONE)
                                        return rc;
                                continue;
                        }
                        if ((rc = utf8_next(c->s, c->n, &c->i, &cp)) != DONE)
                                return rc;
                        if ((rc = put_cp(c->out, cp, c->o->ascii)) != DONE)
                                return rc;
                        continue;
                }
                /* an escape */
                if (c->i + 1 >= c->n)
                        return MORE;
                ch = c->s[c->i + 1];
                size_t used = 2;
                switch (ch) {
                case '"': cp = '"'; break;
                case '\\': cp = '\\'; break;
                case '/': if (c->o->py) goto py_unknown; cp = '/'; break;
                case 'b': cp = '\b'; break;
                case 'f': cp = '\f'; break;
                case 'n': cp = '\n'; break;
                case 'r': cp = '\r'; break;
                case 't': cp = '\t'; break;
                case 'u': {
                        uint32_t v, lo;
                        if ((rc = hexn(c->s, c->n, c->i + 2, 4, &v)) != DONE)
                                return rc;
                        used = 6;
                        cp = v;
                        if (v >= 0xD800 && v <= 0xDBFF) {
                                /* a high surrogate: json.loads joins it with a following \uDC00-\uDFFF */
                                size_t j = c->i + 6;
                                if (j + 1 >= c->n)
                                        return MORE;
                                if (c->s[j] == '\\' && c->s[j + 1] == 'u') {
                                        if ((rc = hexn(c->s, c->n, j + 2, 4, &lo)) == MORE)
                                                return MORE;
                                        if (rc == DONE && lo >= 0xDC00 && lo <= 0xDFFF) {
                                                cp = 0x10000 + ((v - 0xD800) << 10) + (lo - 0xDC00);
                                                used = 12;
                                        }
                                }
                        }
                        break;
                }
                default:
                        if (!c->o->py)
                                return BAD;
py_unknown:
                        switch (ch) {
                        case '\'': cp = '\''; break;
                        case 'a': cp = 7; break;
                        case 'v': cp = 11; break;
                        case '\n': cp = 0; used = 2; goto skip;   /* line continuation */
                        case 'x': {
                                uint32_t v;
                                if ((rc = hexn(c->s, c->n, c->i + 2, 2, &v)) != DONE)
                                        return rc;
                                cp = v;
                                used = 4;
                                break;
                        }
                        case 'U': {
                                uint32_t v;
                                if ((rc = hexn(c->s, c->n, c->i + 2, 8, &v)) != DONE)
                                        return rc;
                                if (v > 0x10FFFF)
                                        return BAD;
                                cp = v;
                                used = 10;
                                break;
                        }
                        default:
                                if (ch >= '0' && ch <= '7') {
                                        uint32_t v = 0;
                                        size_t k = 0;
                                        while (k < 3 && c->i + 1 + k < c->n && c->s[c->i + 1 + k] >= '0' &&
                                               c->s[c->i + 1 + k] <= '7')
                                                v = v * 8 + (uint32_t)(c->s[c->i + 1 + k++] - '0');
                                        if (k < 3 && c->i + 1 + k >= c->n)
                                                return MORE;
                                        cp = v;
                                        used = 1 + k;
                                        break;
                                }
                                /* an unknown escape keeps its backslash (Python) */
                                if ((rc = put_cp(c->out, '\\', c->o->ascii)) != DONE)
                                        return rc;
                                c->i++;
                                continue;
                        }
                }
                if ((rc = put_cp(c->out, cp, c->o->ascii)) != DONE)
                        return rc;
skip:
                c->i += used;
        }
        return MORE;
}

/* ---- numbers and keywords ---- */

/* A number: written once it has ended (a following character, or the end of a final
 * input is not known here: the caller's input end is MORE). */
static int number(cz *c) {
        size_t st = c->i, j = c->i;
        bool neg = false, is_float = false;
        char buf[512];
        size_t k = 0;
        if (j < c->n && c->s[j] == '-') {
                if (c->o->py && !c->o->allow_neg)
                        return BAD;
                neg = true;
                j++;
                if (c->o->py)
                        j = tsr_canon_skip_ws(c->s, c->n, j, true);
                if (j == c->n)
                        return MORE;
                if (!c->o->py && c->s[j] == 'I') {
                        static const char inf[] = "Infinity";
                        for (size_t m = 0; m < 8; m++, j++) {
                                if (j == c->n)
                                        return MORE;
                                if (c->s[j] != inf[m])
                                        return BAD;
                        }
                        c->i = j;
                        return put(c, "-Infinity", 9);
                }
        }
        if (j >= c->n)
                return MORE;
        if (!(c->s[j] >= '0' && c->s[j] <= '9') && !(c->o->py && c->s[j] == '.'))
                return BAD;
        if (neg)
                buf[k++] = '-';
        /* integer part */
        size_t int_start = j;
        while (j < c->n && ((c->s[j] >= '0' && c->s[j] <= '9') || (c->o->py && c->s[j] == '_'))) {
                if (c->s[j] != '_' && k < sizeof(buf) - 1)
                        buf[k++] = c->s[j];
                j++;
        }
        if (!c->o->py && j - int_start > 1 && c->s[int_start] == '0')
                return BAD;   /* json.loads: no leading zeros */
        if (j < c->n && c->s[j] == '.') {
                is_float = true;
                if (k < sizeof(buf) - 1)
                        buf[k++] = '.';
                j++;
                size_t fs = j;
                while (j < c->n && ((c->s[j] >= '0' && c->s[j] <= '9') || (c->o->py && c->s[j] == '_'))) {
                        if (c->s[j] != '_' && k < sizeof(buf) - 1)
                                buf[k++] = c->s[j];
                        j++;
                }
                if (!c->o->py && j == fs) {
                        if (j == c->n)
                                return MORE;
                        return BAD;
                }
        }
        if (j < c->n && (c->s[j] == 'e' || c->s[j] == 'E')) {
                is_float = true;
                if (k < sizeof(buf) - 1)
                        buf[k++] = 'e';
                j++;
                if (j < c->n && (c->s[j] == '+' || c->s[j] == '-')) {
                        if (k < sizeof(buf) - 1)
                                buf[k++] = c->s[j];
                        j++;
                }
                size_t es = j;
                while (j < c->n && c->s[j] >= '0' && c->s[j] <= '9') {
                        if (k < sizeof(buf) - 1)
                                buf[k++] = c->s[j];
                        j++;
                }
                if (j == es)
                        return j == c->n ? MORE : BAD;
        }
        if (j == c->n)
                return MORE;   /* it may go on */
        if (c->o->py && ((c->s[j] >= 'a' && c->s[j] <= 'z') || (c->s[j] >= 'A' && c->s[j] <= 'Z')))
                return BAD;    /* 0x.., 1j, ...: not JSON values */
        (void)st;
        buf[k] = '\0';
        c->i = j;
        if (!is_float) {
                /* Python int: digits as written, leading zeros and "-0" normalised */
                const char *d = buf + (neg ? 1 : 0);
                while (d[0] == '0' && d[1])
                        d++;
                if (neg && strcmp(d, "0") != 0 && put(c, "-", 1) != DONE)
                        return BAD;
                return put(c, d, strlen(d));
        }
        double v = strtod(buf, NULL);
        if (isinf(v))
                return put(c, v < 0 ? "-Infinity" : "Infinity", v < 0 ? 9 : 8);
        char r[64];
        tsr_oai_py_float_repr(v, r, sizeof(r));
        return put(c, r, strlen(r));
}

/* A keyword: `word` must follow completely and then end. */
static int keyword(cz *c, const char *word, const char *as) {
        size_t wl = strlen(word);
        for (size_t m = 0; m < wl; m++) {
                if (c->i + m == c->n)
                        return MORE;
                if (c->s[c->i + m] != word[m])
                        return BAD;
        }
        if (c->o->py) {
                char nx;
                if (c->i + wl == c->n)
                        return MORE;   /* `Truex` would be a name */
                nx = c->s[c->i + wl];
                if ((nx >= 'a' && nx <= 'z') || (nx >= 'A' && nx <= 'Z') || (nx >= '0' && nx <= '9') || nx == '_')
                        return BAD;
        }
        c->i += wl;
        return put(c, as, strlen(as));
}

/* ---- containers ---- */

static int value(cz *c);

static int container(cz *c, char open, char close) {
        bool first = true, obj = open == '{';
        int rc;
        if (++c->depth > MAX_DEPTH)
                return BAD;
        c->i++;
        if ((rc = put(c, &open, 1)) != DONE)
                return rc;
        for (;;) {
                ws(c);
                if (c->i == c->n)
                        return MORE;
                if (c->s[c->i] == close) {
                        c->i++;
                        c->depth--;
                        return put(c, &close, 1);
                }
                if (!first) {
                        if (c->s[c->i] != ',')
                                return BAD;
                        c->i++;
                        ws(c);
                        if (c->i == c->n)
                                return MORE;
                        if (c->s[c->i] == close) {
                                if (!c->o->py)
                                        return BAD;   /* a trailing comma is Python only */
                                continue;
                        }
                        if ((rc = put(c, ", ", 2)) != DONE)
                                return rc;
                }
                first = false;
                if (obj) {
                        /* keys: strings; Python also takes int keys (json.dumps writes them as strings) */
                        char kc = c->s[c->i];
                        if (kc == '"' || (c->o->py && (kc == '\'' || kc == 'r' || kc == 'u'))) {
                                if ((rc = str_lit(c)) != DONE)
                                        return rc;
                        } else if (c->o->py && kc >= '0' && kc <= '9') {
                                size_t mark = c->out->len;
                                if ((rc = number(c)) != DONE) {
                                        c->out->len = mark;
                                        return rc;
                                }
                                /* wrap the written integer in quotes */
                                if (memchr(c->out->data + mark, '.', c->out->len - mark) ||
                                    memchr(c->out->data + mark, 'e', c->out->len - mark))
                                        return BAD;   /* float keys: rare, not reproduced */
                                char digits[512];
                                size_t dl = c->out->len - mark;
                                if (dl >= sizeof(digits))
                                        return BAD;
                                memcpy(digits, c->out->data + mark, dl);
                                c->out->len = mark;
                                if (put(c, "\"", 1) != DONE || put(c, digits, dl) != DONE || put(c, "\"", 1) != DONE)
                                        return BAD;
                        } else {
                                return BAD;
                        }
                        ws(c);
                        if (c->i == c->n)
                                return MORE;
                        if (c->s[c->i] != ':')
                                return BAD;
                        c->i++;
                        if ((rc = put(c, ": ", 2)) != DONE)
                                return rc;
                        ws(c);
                        if (c->i == c->n)
                                return MORE;
                }
                if ((rc = value(c)) != DONE)
                        return rc;
        }
}

static int value(cz *c) {
        ws(c);
        if (c->i == c->n)
                return MORE;
        char ch = c->s[c->i];
        if (ch == '{')
                return container(c, '{', '}');
        if (ch == '[')
                return container(c, '[', ']');
        if (ch == '"' || (c->o->py && ch == '\''))
                return str_lit(c);
        if (ch == '-' || (ch >= '0' && ch <= '9') || (c->o->py && ch == '.'))
                return number(c);
        if (c->o->py) {
                if (ch == 'T')
                        return keyword(c, "True", "true");
                if (ch == 'F')
                        return keyword(c, "False", "false");
                if (ch == 'N')
                        return keyword(c, "None", "null");
                if ((ch == 'r' || ch == 'R' || ch == 'u' || ch == 'U') && c->i + 1 < c->n &&
                    (c->s[c->i + 1] == '\'' || c->s[c->i + 1] == '"'))
                        return str_lit(c);
                if ((ch == 'r' || ch == 'R' || ch == 'u' || ch == 'U') && c->i + 1 == c->n)
                        return MORE;
                return BAD;
        }
        if (ch == 't')
                return keyword(c, "true", "true");
        if (ch == 'f')
                return keyword(c, "false", "false");
        if (ch == 'n')
                return keyword(c, "null", "null");
        if (ch == 'N')
                return keyword(c, "NaN", "NaN");
        if (ch == 'I')
                return keyword(c, "Infinity", "Infinity");
        return BAD;
}

bool tsr_canon_whole(const char *s, size_t n, const tsr_canon_opts *o, tsr_buf *out) {
        /* A copy with a newline after it, so that a number at the very end has ended. */
        char *t = malloc(n + 2);
        size_t pos = 0, mark = out->len;
        bool ok;
        if (!t)
                return false;
        memcpy(t, s, n);
        t[n] = '\n';
        t[n + 1] = '\0';
        ok = tsr_canon_value(t, n + 1, &pos, o, out) == DONE && tsr_canon_skip_ws(t, n + 1, pos, o->py) == n + 1;
        free(t);
        if (!ok)
                out->len = mark;
        return ok;
}

int tsr_canon_value(const char *s, size_t n, size_t *pos, const tsr_canon_opts *o, tsr_buf *out) {
        cz c = {.s = s, .n = n, .i = *pos, .o = o, .out = out, .depth = 0};
        int rc = value(&c);
        if (rc == DONE)
                *pos = c.i;
        return rc;
}
