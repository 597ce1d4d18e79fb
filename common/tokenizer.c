/* tokenizer.c - BPE tokenizer compatible with Hugging Face `tokenizers`, and the
 * incremental detokenizer.  See tokenizer.h for what is supported.
 *
 * Encode follows HF's pipeline: split the text on added tokens (leftmost-longest, the
 * non-normalized ones on the raw text, then the normalized ones on each normalized
 * piece), run the pre-tokenizer stages depth-first on each piece (depth = number of
 * stages, fixed at load, so nothing recurses with the input), run BPE on every final
 * piece with a binary heap over merge ranks, then the post-processor template.
 *
 * Decode is written once, as a streaming pipeline (tsr_detok); the one-shot decode is a
 * detok pushed every id and flushed, so streamed deltas equal the full decode by
 * construction.  Stages before the first Fuse/ByteLevel see one token at a time, as HF's
 * decode_chain does; stages after it see one growing string and hold back only what a
 * later byte could still change. */
#include "tokenizer.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>
#include <xxhash.h>

#define MAX_STAGES 32           /* pre-tokenizer / normalizer / decoder steps after flattening */
#define MAX_NEST 8              /* Sequence inside Sequence */
#define CACHE_SLOTS 4096        /* per-call BPE word cache (direct mapped) */
#define CACHE_WORD_MAX 48       /* longer words are not cached */
#define CACHE_POOL_MAX (1u << 20)
#define CACHE_MIN_INPUT 4096

static const char GPT2_PATTERN[] =
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char LLAMA3_PATTERN[] =
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
        "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char O200K_PATTERN[] =
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char TEKKEN_PATTERN[] =
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
        "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
        "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/* ------------------------------------------------------------------ small helpers */

/* Growable arrays; every size_t product is checked so that a huge input fails with
 * TSR_E_NOMEM instead of wrapping. */
static tsr_status grow(void **p, size_t *cap, size_t need, size_t elem) {
        size_t ncap;
        void *np;

        if (need <= *cap)
                return TSR_OK;
        ncap = *cap ? *cap : 16;
        while (ncap < need) {
                if (ncap > SIZE_MAX / 2)
                        return TSR_E_NOMEM;
                ncap *= 2;
        }
        if (ncap > SIZE_MAX / elem)
                return TSR_E_NOMEM;
        np = realloc(*p, ncap * elem);
        if (!np)
                return TSR_E_NOMEM;
        *p = np;
        *cap = ncap;
        return TSR_OK;
}

typedef struct ids_vec {
        uint32_t *v;
        size_t n, cap;
} ids_vec;

static tsr_status ids_push(ids_vec *a, uint32_t id) {
        if (a->n == a->cap && grow((void **)&a->v, &a->cap, a->n + 1, sizeof(uint32_t)) != TSR_OK)
                return TSR_E_NOMEM;
        a->v[a->n++] = id;
        return TSR_OK;
}

typedef struct sbuf {
        char *p;
        size_t n, cap;
} sbuf;

static tsr_status sb_add(sbuf *b, const void *s, size_t n) {
        if (n > SIZE_MAX - b->n - 1)
                return TSR_E_NOMEM;
        if (grow((void **)&b->p, &b->cap, b->n + n + 1, 1) != TSR_OK)
                return TSR_E_NOMEM;
        if (n)
                memcpy(b->p + b->n, s, n);
        b->n += n;
        b->p[b->n] = '\0';
        return TSR_OK;
}

static char *xstrndup(const char *s, size_t n) {
        char *p = malloc(n + 1);

        if (!p)
                return NULL;
        memcpy(p, s, n);
        p[n] = '\0';
        return p;
}

/* Length of the UTF-8 sequence at s[0..n) if it is valid (strict: no overlongs,
 * surrogates or code points past U+10FFFF), else 0. */
static size_t utf8_valid_len(const uint8_t *s, size_t n) {
        uint8_t c = s[0];

        if (c < 0x80)
                return 1;
        if (c >= 0xC2 && c <= 0xDF)
                return n >= 2 && (s[1] & 0xC0) == 0x80 ? 2 : 0;
        if (c >= 0xE0 && c <= 0xEF) {
                uint8_t lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
                return n >= 3 && s[1] >= lo && s[1] <= hi && (s[2] & 0xC0) == 0x80 ? 3 : 0;
        }
        if (c >= 0xF0 && c <= 0xF4) {
                uint8_t lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
                return n >= 4 && s[1] >= lo && s[1] <= hi && (s[2] & 0xC0) == 0x80 &&
                                       (s[3] & 0xC0) == 0x80 ? 4 : 0;
        }
        return 0;
}

static bool utf8_valid(const char *s, size_t n) {
        const uint8_t *p = (const uint8_t *)s;
        size_t i = 0, k;

        while (i < n) {
                if (p[i] < 0x80) {
                        i++;
                        continue;
                }
                k = utf8_valid_len(p + i, n - i);
                if (!k)
                        return false;
                i += k;
        }
        return true;
}

/* Decode one code point of valid UTF-8; returns its length. */
static size_t utf8_dec(const char *s, uint32_t *cp) {
        const uint8_t *p = (const uint8_t *)s;

        if (p[0] < 0x80) {
                *cp = p[0];
                return 1;
        }
        if (p[0] < 0xE0) {
                *cp = (uint32_t)(p[0] & 0x1F) << 6 | (p[1] & 0x3F);
                return 2;
        }
        if (p[0] < 0xF0) {
                *cp = (uint32_t)(p[0] & 0x0F) << 12 | (uint32_t)(p[1] & 0x3F) << 6 | (p[2] & 0x3F);
                return 3;
        }
        *cp = (uint32_t)(p[0] & 0x07) << 18 | (uint32_t)(p[1] & 0x3F) << 12 |
              (uint32_t)(p[2] & 0x3F) << 6 | (p[3] & 0x3F);
        return 4;
}

static size_t utf8_enc(uint32_t cp, char *o) {
        if (cp < 0x80) {
                o[0] = (char)cp;
                return 1;
        }
        if (cp < 0x800) {
                o[0] = (char)(0xC0 | cp >> 6);
                o[1] = (char)(0x80 | (cp & 0x3F));
                return 2;
        }
        if (cp < 0x10000) {
                o[0] = (char)(0xE0 | cp >> 12);
                o[1] = (char)(0x80 | (cp >> 6 & 0x3F));
                o[2] = (char)(0x80 | (cp & 0x3F));
                return 3;
        }
        o[0] = (char)(0xF0 | cp >> 18);
        o[1] = (char)(0x80 | (cp >> 12 & 0x3F));
        o[2] = (char)(0x80 | (cp >> 6 & 0x3F));
        o[3] = (char)(0x80 | (cp & 0x3F));
        return 4;
}

/* Start of the last code point of valid UTF-8 s[0..n), n > 0. */
static size_t utf8_last(const char *s, size_t n) {
        size_t i = n - 1;

        while (i > 0 && ((uint8_t)s[i] & 0xC0) == 0x80)
                i--;
        return i;
}

/* Rust char::is_whitespace (Unicode White_Space), used by added-token lstrip/rstrip. */
static bool is_uspace(uint32_t c) {
        return (c >= 9 && c <= 13) || c == 32 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
               (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
               c == 0x205F || c == 0x3000;
}

/* GPT-2's bytes_to_unicode: printable bytes stand for themselves, the other 68 are
 * shifted to U+0100.. in byte order, so every byte has a visible one-char spelling. */
static uint32_t byte_to_cp(unsigned b) {
        unsigned n = 0, i;

        if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255))
                return b;
        for (i = 0; i < b; i++)
                if (!((i >= 33 && i <= 126) || (i >= 161 && i <= 172) || (i >= 174 && i <= 255)))
                        n++;
        return 256 + n;
}

/* ------------------------------------------------------------------ hash maps */

/* String → id map; keys live in the owner's string table (strs/lens indexed by value). */
typedef struct strmap {
        uint32_t *slot;         /* value + 1, 0 = empty */
        size_t cap;             /* power of two */
} strmap;

static uint64_t hstr(const char *s, size_t n) { return XXH3_64bits(s, n); }

static tsr_status strmap_init(strmap *m, size_t n) {
        size_t cap = 16;

        while (cap < n * 2 + 16)
                cap *= 2;
        m->slot = calloc(cap, sizeof(uint32_t));
        if (!m->slot)
                return TSR_E_NOMEM;
        m->cap = cap;
        return TSR_OK;
}

/* Returns the slot index holding `s`, or the empty slot where it would go. */
static size_t strmap_find(const strmap *m, char *const *strs, const uint32_t *lens, const char *s, size_t n) {
        size_t i = (size_t)hstr(s, n) & (m->cap - 1);

        for (;;) {
                uint32_t v = m->slot[i];
                if (!v)
                        return i;
                if (lens[v - 1] == n && memcmp(strs[v - 1], s, n) == 0)
                        return i;
                i = (i + 1) & (m->cap - 1);
        }
}

static int64_t strmap_get(const strmap *m, char *const *strs, const uint32_t *lens, const char *s, size_t n) {
        size_t i;

        if (!m->slot)
                return -1;
        i = strmap_find(m, strs, lens, s, n);
        return m->slot[i] ? (int64_t)m->slot[i] - 1 : -1;
}

/* u64 → (a, b) map, for merges ((left << 32 | right) → rank, merged id) and the
 * added-token trie ((node << 8 | byte) → child). */
typedef struct u64map {
        uint64_t *key;
        uint32_t *a, *b;
        uint8_t *used;
        size_t cap, n;
} u64map;

static uint64_t mix64(uint64_t x) {
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdULL;
        x ^= x >> 33;
        x *= 0xc4ceb9fe1a85ec53ULL;
        x ^= x >> 33;
        return x;
}

static tsr_status u64map_init(u64map *m, size_t n) {
        size_t cap = 16;

        while (cap < n * 2 + 16)
                cap *= 2;
        m->key = calloc(cap, sizeof(uint64_t));
        m->a = calloc(cap, sizeof(uint32_t));
        m->b = calloc(cap, sizeof(uint32_t));
        m->used = calloc(cap, 1);
        m->cap = cap;
        m->n = 0;
        return m->key && m->a && m->b && m->used ? TSR_OK : TSR_E_NOMEM;
}

static void u64map_done(u64map *m) {
        free(m->key);
        free(m->a);
        free(m->b);
        free(m->used);
        memset(m, 0, sizeof(*m));
}

static bool u64map_get(const u64map *m, uint64_t k, uint32_t *a, uint32_t *b) {
        size_t i;

        if (!m->cap)
                return false;
        i = (size_t)mix64(k) & (m->cap - 1);
        while (m->used[i]) {
                if (m->key[i] == k) {
                        *a = m->a[i];
                        if (b)
                                *b = m->b[i];
                        return true;
                }
                i = (i + 1) & (m->cap - 1);
        }
        return false;
}

/* Insert or overwrite (HF builds its merge table with a HashMap: a later duplicate wins). */
static tsr_status u64map_put(u64map *m, uint64_t k, uint32_t a, uint32_t b) {
        size_t i;

        if ((m->n + 1) * 2 > m->cap) {
                u64map nm;
                size_t j;
                if (u64map_init(&nm, m->cap) != TSR_OK) {
                        u64map_done(&nm);
                        return TSR_E_NOMEM;
                }
                for (j = 0; j < m->cap; j++)
                        if (m->used[j])
                                (void)u64map_put(&nm, m->key[j], m->a[j], m->b[j]);
                u64map_done(m);
                *m = nm;
        }
        i = (size_t)mix64(k) & (m->cap - 1);
        while (m->used[i] && m->key[i] != k)
                i = (i + 1) & (m->cap - 1);
        if (!m->used[i])
                m->n++;
        m->used[i] = 1;
        m->key[i] = k;
        m->a[i] = a;
        m->b[i] = b;
        return TSR_OK;
}

/* ------------------------------------------------------------------ the tokenizer */

typedef enum norm_kind { NORM_PREPEND, NORM_REPLACE, NORM_UNICODE } norm_kind;

typedef struct norm_op {
        norm_kind kind;
        char *a, *b;            /* PREPEND: a = text; REPLACE: a → b */
        size_t alen, blen;
        int uflags;             /* UNICODE: utf8proc_option_t for NFC, NFD, NFKC or NFKD */
} norm_op;

typedef enum split_beh {
        BEH_REMOVED,
        BEH_ISOLATED,
        BEH_MERGED_PREV,
        BEH_MERGED_NEXT,
        BEH_CONTIGUOUS,
} split_beh;

typedef enum pre_kind { PRE_SPLIT, PRE_METASPACE, PRE_BYTELEVEL } pre_kind;

typedef struct pre_op {
        pre_kind kind;
        pcre2_code *re;         /* SPLIT with a regex (Digits too); BYTELEVEL with use_regex */
        char *lit;              /* SPLIT with a literal pattern */
        size_t litlen;
        split_beh beh;
        bool invert;
        char repl[8];           /* METASPACE replacement, UTF-8 */
        size_t repllen;
        int prepend;            /* METASPACE: 0 never, 1 first, 2 always */
        bool split;             /* METASPACE */
        bool add_prefix_space;  /* BYTELEVEL */
} pre_op;

typedef enum dec_kind { DEC_REPLACE, DEC_STRIP, DEC_METASPACE, DEC_BYTEFALLBACK, DEC_BYTELEVEL, DEC_FUSE } dec_kind;

typedef struct dec_op {
        dec_kind kind;
        char *a, *b;            /* REPLACE a → b; STRIP a = content char; METASPACE a = replacement */
        size_t alen, blen;
        size_t start, stop;     /* STRIP */
        bool prepend;           /* METASPACE: prepend_scheme != never */
} dec_op;

typedef struct added_tok {
        char *content;
        uint32_t len;
        uint32_t id;
        bool special, lstrip, rstrip, normalized, single_word;
        char *match;            /* what is searched for: content, normalized if `normalized` */
        size_t matchlen;
} added_tok;

/* Added-token trie: nodes numbered from 0 (root); edges in a u64map. */
typedef struct trie {
        u64map edge;            /* (node << 8 | byte) → child */
        int32_t *term;          /* [n_nodes] added_tok index or -1 */
        size_t n_nodes, cap_nodes;
        bool first[256];
} trie;

struct tsr_tokenizer {
        /* model vocab: ids [0, n_vocab) */
        size_t n_vocab;
        char **vstr;            /* NULL for holes */
        uint32_t *vlen;
        strmap vmap;
        u64map merges;          /* (left << 32 | right) → (rank, merged id) */
        bool byte_fallback, ignore_merges, fuse_unk;
        int64_t unk_id;
        int32_t fallback_tok[256];      /* "<0xNN>" ids, -1 if absent */
        int32_t byte_tok[256];          /* id of the byte-level char of each byte, -1 if absent */
        char bl_str[256][3];            /* byte-level spelling of each byte */
        uint8_t bl_len[256];
        int16_t bl_inv[324];            /* code point → byte, -1 if not a byte-level char */

        /* added tokens */
        added_tok *added;
        size_t n_added;
        char **astr;            /* [n_added] content, for amap */
        uint32_t *alen;
        strmap amap;
        trie raw_trie, norm_trie;

        size_t n_ids;           /* id space: max over vocab and added ids, + 1 */
        int32_t *added_of;      /* [n_ids] index into added, -1 if not an added token */

        norm_op norm[MAX_STAGES];
        size_t n_norm;
        pre_op pre[MAX_STAGES];
        size_t n_pre;
        bool byte_level;        /* the last pre-tokenizer is ByteLevel: BPE sees bytes */
        dec_op dec[MAX_STAGES];
        size_t n_dec;

        /* post-processor "single" template: entries of ids, or UINT32_MAX for the sequence */
        uint32_t *tmpl;
        size_t n_tmpl;
        bool has_tmpl;

        int64_t bos_id, eos_id;
        bool add_bos, add_eos;
        pcre2_code *word_re;    /* [\p{L}\p{N}_] for single_word */
};

static void trie_done(trie *tr) {
        u64map_done(&tr->edge);
        free(tr->term);
        memset(tr, 0, sizeof(*tr));
}

static tsr_status trie_add(trie *tr, const char *s, size_t n, int32_t idx) {
        uint32_t node = 0, child;
        size_t i;

        if (!tr->n_nodes) {
                if (u64map_init(&tr->edge, 64) != TSR_OK ||
                    grow((void **)&tr->term, &tr->cap_nodes, 1, sizeof(int32_t)) != TSR_OK)
                        return TSR_E_NOMEM;
                tr->term[0] = -1;
                tr->n_nodes = 1;
        }
        if (!n)
                return TSR_OK;
        tr->first[(uint8_t)s[0]] = true;
        for (i = 0; i < n; i++) {
                uint64_t k = (uint64_t)node << 8 | (uint8_t)s[i];
                if (!u64map_get(&tr->edge, k, &child, NULL)) {
                        if (grow((void **)&tr->term, &tr->cap_nodes, tr->n_nodes + 1, sizeof(int32_t)) != TSR_OK)
                                return TSR_E_NOMEM;
                        child = (uint32_t)tr->n_nodes++;
                        tr->term[child] = -1;
                        if (u64map_put(&tr->edge, k, child, 0) != TSR_OK)
                                return TSR_E_NOMEM;
                }
                node = child;
        }
        if (tr->term[node] < 0)
                tr->term[node] = idx;
        return TSR_OK;
}

/* Longest added token starting at s[0]; returns its length (0 if none) and index. */
static size_t trie_longest(const trie *tr, const char *s, size_t n, int32_t *idx) {
        uint32_t node = 0, child;
        size_t i, best = 0;

        if (!tr->n_nodes || !n || !tr->first[(uint8_t)s[0]])
                return 0;
        for (i = 0; i < n; i++) {
                if (!u64map_get(&tr->edge, (uint64_t)node << 8 | (uint8_t)s[i], &child, NULL))
                        break;
                node = child;
                if (tr->term[node] >= 0) {
                        best = i + 1;
                        *idx = tr->term[node];
                }
        }
        return best;
}

void tsr_tokenizer_free(tsr_tokenizer **tp) {
        tsr_tokenizer *t;
        size_t i;

        if (!tp || !*tp)
                return;
        t = *tp;
        if (t->vstr)
                for (i = 0; i < t->n_vocab; i++)
                        free(t->vstr[i]);
        free(t->vstr);
        free(t->vlen);
        free(t->vmap.slot);
        u64map_done(&t->merges);
        for (i = 0; i < t->n_added; i++) {
                if (t->added[i].match != t->added[i].content)
                        free(t->added[i].match);
                free(t->added[i].content);
        }
        free(t->added);
        free(t->astr);
        free(t->alen);
        free(t->amap.slot);
        trie_done(&t->raw_trie);
        trie_done(&t->norm_trie);
        free(t->added_of);
        for (i = 0; i < t->n_norm; i++) {
                free(t->norm[i].a);
                free(t->norm[i].b);
        }
        for (i = 0; i < t->n_pre; i++) {
                pcre2_code_free(t->pre[i].re);
                free(t->pre[i].lit);
        }
        for (i = 0; i < t->n_dec; i++) {
                free(t->dec[i].a);
                free(t->dec[i].b);
        }
        free(t->tmpl);
        pcre2_code_free(t->word_re);
        free(t);
        *tp = NULL;
}

static tsr_status compile_re_opt(const char *pat, size_t len, uint32_t opt, pcre2_code **ret, char *err,
                                 size_t errlen) {
        int ec;
        PCRE2_SIZE off;
        pcre2_code *re;

        re = pcre2_compile((PCRE2_SPTR)pat, len, PCRE2_UTF | PCRE2_UCP | opt, &ec, &off, NULL);
        if (!re) {
                PCRE2_UCHAR msg[160];
                pcre2_get_error_message(ec, msg, sizeof(msg));
                tsr_errf(err, errlen, "regex '%.*s': %s at offset %zu", (int)(len > 200 ? 200 : len), pat,
                       (const char *)msg, (size_t)off);
                return TSR_E_UNSUPPORTED;
        }
        /* JIT is a speed-up only: where it is unavailable pcre2_match interprets. */
        (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
        *ret = re;
        return TSR_OK;
}

static tsr_status compile_re(const char *pat, size_t len, pcre2_code **ret, char *err, size_t errlen) {
        return compile_re_opt(pat, len, 0, ret, err, errlen);
}

/* ------------------------------------------------------------------ encode */

typedef struct cache_slot {
        uint64_t h;
        uint32_t woff, wlen, ioff, n;   /* word in cpool, ids in ipool */
        bool used;
} cache_slot;

typedef struct enc_ctx {
        const tsr_tokenizer *t;
        ids_vec out;
        pcre2_match_data *md;
        pcre2_match_context *mctx;
        /* BPE scratch, reused across words */
        uint32_t *sym, *heap_rank, *heap_pos, *heap_new;
        int32_t *prev, *next;
        size_t cap_sym, cap_heap, n_heap;
        sbuf scratch;
        /* word cache */
        cache_slot *cache;
        sbuf cpool;
        ids_vec ipool;
} enc_ctx;

/* Heap of candidate merges, smallest (rank, pos) on top: HF applies the lowest rank
 * first and, between equal ranks, the leftmost. */
static bool heap_less(const enc_ctx *c, size_t i, size_t j) {
        return c->heap_rank[i] < c->heap_rank[j] ||
               (c->heap_rank[i] == c->heap_rank[j] && c->heap_pos[i] < c->heap_pos[j]);
}

static void heap_swap(enc_ctx *c, size_t i, size_t j) {
        uint32_t r = c->heap_rank[i], p = c->heap_pos[i], w = c->heap_new[i];

        c->heap_rank[i] = c->heap_rank[j];
        c->heap_pos[i] = c->heap_pos[j];
        c->heap_new[i] = c->heap_new[j];
        c->heap_rank[j] = r;
        c->heap_pos[j] = p;
        c->heap_new[j] = w;
}

static tsr_status heap_push(enc_ctx *c, uint32_t rank, uint32_t pos, uint32_t nid) {
        size_t i, cap = c->cap_heap;

        if (c->n_heap == c->cap_heap) {
                if (grow((void **)&c->heap_rank, &cap, c->n_heap + 1, sizeof(uint32_t)) != TSR_OK)
                        return TSR_E_NOMEM;
                cap = c->cap_heap;
                if (grow((void **)&c->heap_pos, &cap, c->n_heap + 1, sizeof(uint32_t)) != TSR_OK)
                        return TSR_E_NOMEM;
                cap = c->cap_heap;
                if (grow((void **)&c->heap_new, &cap, c->n_heap + 1, sizeof(uint32_t)) != TSR_OK)
                        return TSR_E_NOMEM;
                c->cap_heap = cap;
        }
        i = c->n_heap++;
        c->heap_rank[i] = rank;
        c->heap_pos[i] = pos;
        c->heap_new[i] = nid;
        while (i > 0 && heap_less(c, i, (i - 1) / 2)) {
                heap_swap(c, i, (i - 1) / 2);
                i = (i - 1) / 2;
        }
        return TSR_OK;
}

static void heap_pop(enc_ctx *c) {
        size_t i = 0;

        c->n_heap--;
        if (!c->n_heap)
                return;
        heap_swap(c, 0, c->n_heap);
        for (;;) {
                size_t l = 2 * i + 1, r = l + 1, m = i;
                if (l < c->n_heap && heap_less(c, l, m))
                        m = l;
                if (r < c->n_heap && heap_less(c, r, m))
                        m = r;
                if (m == i)
                        break;
                heap_swap(c, i, m);
                i = m;
        }
}

static tsr_status sym_reserve(enc_ctx *c, size_t n) {
        size_t cap;

        if (n <= c->cap_sym)
                return TSR_OK;
        cap = c->cap_sym;
        if (grow((void **)&c->sym, &cap, n, sizeof(uint32_t)) != TSR_OK)
                return TSR_E_NOMEM;
        cap = c->cap_sym;
        if (grow((void **)&c->prev, &cap, n, sizeof(int32_t)) != TSR_OK)
                return TSR_E_NOMEM;
        cap = c->cap_sym;
        if (grow((void **)&c->next, &cap, n, sizeof(int32_t)) != TSR_OK)
                return TSR_E_NOMEM;
        c->cap_sym = cap;
        return TSR_OK;
}

static tsr_status push_pair(enc_ctx *c, uint32_t pos) {
        uint32_t rank, nid;
        int32_t nx = c->next[pos];

        if (nx < 0)
                return TSR_OK;
        if (!u64map_get(&c->t->merges, (uint64_t)c->sym[pos] << 32 | c->sym[nx], &rank, &nid))
                return TSR_OK;
        return heap_push(c, rank, pos, nid);
}

/* BPE over one pre-token.  `s` is the text as the model sees it, except that with a
 * ByteLevel pre-tokenizer it is the raw bytes (the mapping is applied through byte_tok). */
static tsr_status bpe_word(enc_ctx *c, const char *s, size_t n) {
        const tsr_tokenizer *t = c->t;
        size_t i, ns = 0;
        bool last_unk = false;
        uint64_t h = 0;
        cache_slot *cs = NULL;
        int64_t id;

        if (!n)
                return TSR_OK;
        if (c->cache && n <= CACHE_WORD_MAX) {
                h = hstr(s, n);
                cs = &c->cache[h & (CACHE_SLOTS - 1)];
                if (cs->used && cs->h == h && cs->wlen == n && memcmp(c->cpool.p + cs->woff, s, n) == 0) {
                        for (i = 0; i < cs->n; i++)
                                if (ids_push(&c->out, c->ipool.v[cs->ioff + i]) != TSR_OK)
                                        return TSR_E_NOMEM;
                        return TSR_OK;
                }
        }
        if (t->ignore_merges) {
                const char *w = s;
                size_t wn = n;
                if (t->byte_level) {
                        c->scratch.n = 0;
                        for (i = 0; i < n; i++)
                                if (sb_add(&c->scratch, t->bl_str[(uint8_t)s[i]], t->bl_len[(uint8_t)s[i]]) != TSR_OK)
                                        return TSR_E_NOMEM;
                        w = c->scratch.p;
                        wn = c->scratch.n;
                }
                id = strmap_get(&t->vmap, t->vstr, t->vlen, w, wn);
                if (id >= 0)
                        return ids_push(&c->out, (uint32_t)id);
        }
        if (n > INT32_MAX / 4)
                return TSR_E_LIMIT;
        if (sym_reserve(c, n * 4) != TSR_OK)
                return TSR_E_NOMEM;
        /* Initial symbols: one per character (per byte under ByteLevel). */
        for (i = 0; i < n;) {
                size_t cl = t->byte_level ? 1 : utf8_valid_len((const uint8_t *)s + i, n - i);
                const char *cs_ = s + i;
                size_t k;
                if (!cl)
                        cl = 1;         /* cannot happen: input was validated */
                if (t->byte_level) {
                        id = t->byte_tok[(uint8_t)s[i]];
                        cs_ = t->bl_str[(uint8_t)s[i]];
                } else {
                        id = strmap_get(&t->vmap, t->vstr, t->vlen, s + i, cl);
                }
                if (id >= 0) {
                        c->sym[ns++] = (uint32_t)id;
                        last_unk = false;
                } else {
                        bool all = t->byte_fallback;
                        size_t bl = t->byte_level ? t->bl_len[(uint8_t)s[i]] : cl;
                        (void)cs_;
                        for (k = 0; all && k < bl; k++)
                                all = t->fallback_tok[(uint8_t)cs_[k]] >= 0;
                        if (all) {
                                for (k = 0; k < bl; k++)
                                        c->sym[ns++] = (uint32_t)t->fallback_tok[(uint8_t)cs_[k]];
                                last_unk = false;
                        } else if (t->unk_id >= 0) {
                                if (!(t->fuse_unk && last_unk))
                                        c->sym[ns++] = (uint32_t)t->unk_id;
                                last_unk = true;
                        }
                }
                i += cl;
        }
        for (i = 0; i < ns; i++) {
                c->prev[i] = (int32_t)i - 1;
                c->next[i] = i + 1 < ns ? (int32_t)i + 1 : -1;
        }
        c->n_heap = 0;
        for (i = 0; i + 1 < ns; i++)
                if (push_pair(c, (uint32_t)i) != TSR_OK)
                        return TSR_E_NOMEM;
        while (c->n_heap) {
                uint32_t rank = c->heap_rank[0], pos = c->heap_pos[0], nid = c->heap_new[0], r2, n2;
                int32_t nx;
                (void)rank;
                heap_pop(c);
                /* Stale entries: the left symbol was absorbed (sym = UINT32_MAX), has no
                 * right neighbour, or the pair changed since it was queued. */
                if (c->sym[pos] == UINT32_MAX)
                        continue;
                nx = c->next[pos];
                if (nx < 0)
                        continue;
                if (!u64map_get(&t->merges, (uint64_t)c->sym[pos] << 32 | c->sym[nx], &r2, &n2) || n2 != nid)
                        continue;
                c->sym[pos] = nid;
                c->sym[nx] = UINT32_MAX;
                c->next[pos] = c->next[nx];
                if (c->next[nx] >= 0)
                        c->prev[c->next[nx]] = (int32_t)pos;
                if (c->prev[pos] >= 0 && push_pair(c, (uint32_t)c->prev[pos]) != TSR_OK)
                        return TSR_E_NOMEM;
                if (push_pair(c, pos) != TSR_OK)
                        return TSR_E_NOMEM;
        }
        {
                size_t start = c->out.n;
                for (i = 0; i < ns; i = (size_t)c->next[i]) {
                        if (ids_push(&c->out, c->sym[i]) != TSR_OK)
                                return TSR_E_NOMEM;
                        if (c->next[i] < 0)
                                break;
                }
                if (cs && c->cpool.n + n <= CACHE_POOL_MAX && c->ipool.n + (c->out.n - start) <= CACHE_POOL_MAX) {
                        uint32_t woff = (uint32_t)c->cpool.n, ioff = (uint32_t)c->ipool.n;
                        if (sb_add(&c->cpool, s, n) != TSR_OK)
                                return TSR_E_NOMEM;
                        for (i = start; i < c->out.n; i++)
                                if (ids_push(&c->ipool, c->out.v[i]) != TSR_OK)
                                        return TSR_E_NOMEM;
                        cs->used = true;
                        cs->h = h;
                        cs->woff = woff;
                        cs->wlen = (uint32_t)n;
                        cs->ioff = ioff;
                        cs->n = (uint32_t)(c->out.n - start);
                }
        }
        return TSR_OK;
}

static tsr_status pre_run(enc_ctx *c, size_t k, const char *s, size_t n, bool first);

/* Split behaviours, streamed: HF first lists (span, is_match) pairs, then folds them;
 * here each pair is folded as it is found so that nothing grows with the input. */
typedef struct splitter {
        enc_ctx *c;
        size_t k;               /* stage to hand pieces to */
        const char *s;
        bool first;
        split_beh beh;
        bool has_pend, pend_match, prev_match;
        size_t ps, pe;
} splitter;

static tsr_status sp_emit(splitter *sp, size_t a, size_t b) {
        if (a == b)
                return TSR_OK;
        return pre_run(sp->c, sp->k, sp->s + a, b - a, sp->first && a == 0);
}

static tsr_status sp_item(splitter *sp, size_t a, size_t b, bool m) {
        tsr_status st = TSR_OK;

        switch (sp->beh) {
        case BEH_REMOVED:
                if (!m)
                        st = sp_emit(sp, a, b);
                break;
        case BEH_ISOLATED:
                st = sp_emit(sp, a, b);
                break;
        case BEH_MERGED_PREV:
                if (m && !sp->prev_match && sp->has_pend) {
                        sp->pe = b;
                } else {
                        if (sp->has_pend)
                                st = sp_emit(sp, sp->ps, sp->pe);
                        sp->has_pend = true;
                        sp->ps = a;
                        sp->pe = b;
                }
                break;
        case BEH_MERGED_NEXT:
                /* A match followed by a non-match is glued to it. */
                if (sp->has_pend) {
                        if (!m) {
                                st = sp_emit(sp, sp->ps, b);
                                sp->has_pend = false;
                                break;
                        }
                        st = sp_emit(sp, sp->ps, sp->pe);
                        sp->has_pend = false;
                        if (st != TSR_OK)
                                break;
                }
                if (m) {
                        sp->has_pend = true;
                        sp->ps = a;
                        sp->pe = b;
                } else {
                        st = sp_emit(sp, a, b);
                }
                break;
        case BEH_CONTIGUOUS:
                if (sp->has_pend && m == sp->prev_match) {
                        sp->pe = b;
                } else {
                        if (sp->has_pend)
                                st = sp_emit(sp, sp->ps, sp->pe);
                        sp->has_pend = true;
                        sp->ps = a;
                        sp->pe = b;
                }
                break;
        }
        sp->prev_match = m;
        return st;
}

static tsr_status sp_end(splitter *sp) {
        if (sp->has_pend) {
                sp->has_pend = false;
                return sp_emit(sp, sp->ps, sp->pe);
        }
        return TSR_OK;
}

/* Find the matches of `op` in s[0..n) and feed (span, is_match) pairs to the splitter. */
static tsr_status split_run(enc_ctx *c, const pre_op *op, pcre2_code *re, const char *s, size_t n,
                            splitter *sp) {
        size_t pos = 0, prev = 0;
        tsr_status st;

        while (pos < n) {
                size_t ms, me;
                if (re) {
                        int rc = pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, c->md, c->mctx);
                        PCRE2_SIZE *ov;
                        if (rc == PCRE2_ERROR_NOMATCH)
                                break;
                        if (rc < 0)
                                return rc == PCRE2_ERROR_NOMEMORY ? TSR_E_NOMEM : TSR_E_LIMIT;
                        ov = pcre2_get_ovector_pointer(c->md);
                        ms = ov[0];
                        me = ov[1];
                } else {
                        const char *f = memmem(s + pos, n - pos, op->lit, op->litlen);
                        if (!f || !op->litlen)
                                break;
                        ms = (size_t)(f - s);
                        me = ms + op->litlen;
                }
                if (me == ms) {
                        /* An empty match splits nothing; step over one character. */
                        size_t cl = utf8_valid_len((const uint8_t *)s + ms, n - ms);
                        pos = ms + (cl ? cl : 1);
                        continue;
                }
                if (prev != ms && (st = sp_item(sp, prev, ms, op->invert)) != TSR_OK)
                        return st;
                if ((st = sp_item(sp, ms, me, !op->invert)) != TSR_OK)
                        return st;
                prev = pos = me;
        }
        if (prev != n && (st = sp_item(sp, prev, n, op->invert)) != TSR_OK)
                return st;
        return sp_end(sp);
}

/* Run pre-tokenizer stage k on one piece; past the last stage, the model. */
static tsr_status pre_run(enc_ctx *c, size_t k, const char *s, size_t n, bool first) {
        const tsr_tokenizer *t = c->t;
        const pre_op *op;
        splitter sp;
        tsr_status st;

        if (!n)
                return TSR_OK;
        if (k == t->n_pre)
                return bpe_word(c, s, n);
        op = &t->pre[k];
        memset(&sp, 0, sizeof(sp));
        sp.c = c;
        sp.k = k + 1;
        sp.s = s;
        sp.first = first;
        switch (op->kind) {
        case PRE_SPLIT:
                sp.beh = op->beh;
                return split_run(c, op, op->re, s, n, &sp);
        case PRE_BYTELEVEL: {
                char *tmp = NULL;
                if (op->add_prefix_space && s[0] != ' ') {
                        tmp = malloc(n + 1);
                        if (!tmp)
                                return TSR_E_NOMEM;
                        tmp[0] = ' ';
                        memcpy(tmp + 1, s, n);
                        s = tmp;
                        n++;
                }
                if (op->re) {
                        sp.s = s;
                        sp.beh = BEH_ISOLATED;
                        st = split_run(c, op, op->re, s, n, &sp);
                } else {
                        st = pre_run(c, k + 1, s, n, first);
                }
                free(tmp);
                return st;
        }
        case PRE_METASPACE: {
                sbuf b = {0};
                size_t i = 0;
                /* HF replaces the spaces first, then prepends unless the text already starts
                 * with the replacement. */
                bool pre = (op->prepend == 2 || (op->prepend == 1 && first)) && s[0] != ' ' &&
                           !(n >= op->repllen && memcmp(s, op->repl, op->repllen) == 0);
                if (pre && sb_add(&b, op->repl, op->repllen) != TSR_OK)
                        return TSR_E_NOMEM;
                while (i < n) {
                        const char *sp_ = memchr(s + i, ' ', n - i);
                        size_t e = sp_ ? (size_t)(sp_ - s) : n;
                        if (sb_add(&b, s + i, e - i) != TSR_OK ||
                            (sp_ && sb_add(&b, op->repl, op->repllen) != TSR_OK)) {
                                free(b.p);
                                return TSR_E_NOMEM;
                        }
                        i = sp_ ? e + 1 : n;
                }
                if (op->split) {
                        pre_op lit = *op;
                        lit.lit = (char *)op->repl;
                        lit.litlen = op->repllen;
                        lit.invert = false;
                        sp.s = b.p;
                        sp.beh = BEH_MERGED_NEXT;
                        st = split_run(c, &lit, NULL, b.p, b.n, &sp);
                } else {
                        st = pre_run(c, k + 1, b.p, b.n, first);
                }
                free(b.p);
                return st;
        }
        }
        return TSR_E_INTERNAL;
}

/* Apply the normalizers to one piece; *out is malloc'd (NULL when there are none). */
/* Code points HF tokenizers' normalizers leave alone: its Unicode tables are 9.0's, so a
 * character assigned since then has no decomposition, combining class 0 and composes with
 * nothing there, while utf8proc knows it.  Generated by `make_tokenizer_goldens.py
 * unicode-table` (HF tokenizers 0.23.3 against utf8proc on every assigned code point).
 * 245 code points in 48 ranges; utf8proc 2.8.0 */
static const uint32_t hf_unicode9_unknown[][2] = {
        {0x7FD, 0x7FD}, {0x898, 0x89F}, {0x8CA, 0x8D3}, {0x9FE, 0x9FE}, {0xC3C, 0xC3C}, {0xD3B, 0xD3C},
        {0xEBA, 0xEBA}, {0x1715, 0x1715}, {0x1ABF, 0x1ACE}, {0x1DF6, 0x1DFA}, {0x32FF, 0x32FF}, {0xA7F2, 0xA7F4},
        {0xA82C, 0xA82C}, {0xAB69, 0xAB69}, {0x10781, 0x10785}, {0x10787, 0x107B0}, {0x107B2, 0x107BA}, {0x10D24, 0x10D27},
        {0x10EAB, 0x10EAC}, {0x10EFD, 0x10EFF}, {0x10F46, 0x10F50}, {0x10F82, 0x10F85}, {0x11070, 0x11070}, {0x1133B, 0x1133B},
        {0x1145E, 0x1145E}, {0x11839, 0x1183A}, {0x11930, 0x11930}, {0x11935, 0x11935}, {0x11938, 0x11938}, {0x1193D, 0x1193E},
        {0x11943, 0x11943}, {0x119E0, 0x119E0}, {0x11A34, 0x11A34}, {0x11A47, 0x11A47}, {0x11A99, 0x11A99}, {0x11D42, 0x11D42},
        {0x11D44, 0x11D45}, {0x11D97, 0x11D97}, {0x11F41, 0x11F42}, {0x16FF0, 0x16FF1}, {0x1E030, 0x1E06D}, {0x1E08F, 0x1E08F},
        {0x1E130, 0x1E136}, {0x1E2AE, 0x1E2AE}, {0x1E2EC, 0x1E2EF}, {0x1E4EC, 0x1E4EF}, {0x1F16C, 0x1F16C}, {0x1FBF0, 0x1FBF9},
};

static bool hf_norm_unknown(uint32_t cp) {
        size_t lo = 0, hi = sizeof(hf_unicode9_unknown) / sizeof(hf_unicode9_unknown[0]);

        while (lo < hi) {
                size_t mid = (lo + hi) / 2;
                if (cp < hf_unicode9_unknown[mid][0])
                        hi = mid;
                else if (cp > hf_unicode9_unknown[mid][1])
                        lo = mid + 1;
                else
                        return true;
        }
        return false;
}

/* One Unicode normalization form over valid UTF-8 `s`, as HF's: utf8proc on the runs
 * between the characters HF does not know, which stay as they are (being starters that
 * compose with nothing, they end every reordering and composition anyway). */
static tsr_status unicode_norm(const norm_op *op, const char *s, size_t n, sbuf *out) {
        size_t i = 0, run = 0, cl;

        while (run < n) {
                uint32_t cp = 0;
                for (i = run; i < n; i += cl) {
                        cl = utf8_dec(s + i, &cp);
                        if (hf_norm_unknown(cp))
                                break;
                }
                if (i > run) {
                        utf8proc_uint8_t *u = NULL;
                        utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)s + run, (utf8proc_ssize_t)(i - run),
                                                          &u, (utf8proc_option_t)op->uflags);
                        tsr_status st = r < 0 ? (r == UTF8PROC_ERROR_NOMEM ? TSR_E_NOMEM : TSR_E_INVAL)
                                              : sb_add(out, u, (size_t)r);
                        free(u);
                        if (st != TSR_OK)
                                return st;
                }
                if (i < n) {
                        cl = utf8_dec(s + i, &cp);
                        if (sb_add(out, s + i, cl) != TSR_OK)
                                return TSR_E_NOMEM;
                        i += cl;
                }
                run = i;
        }
        return TSR_OK;
}

static tsr_status normalize(const tsr_tokenizer *t, const char *s, size_t n, char **out, size_t *outlen) {
        sbuf a = {0}, b = {0};
        size_t i, j;

        if (sb_add(&a, s, n) != TSR_OK)
                return TSR_E_NOMEM;
        for (i = 0; i < t->n_norm; i++) {
                const norm_op *op = &t->norm[i];
                b.n = 0;
                if (op->kind == NORM_UNICODE) {
                        /* the text is valid UTF-8 here, so only running out of memory can fail */
                        tsr_status st = unicode_norm(op, a.p, a.n, &b);
                        if (st != TSR_OK) {
                                free(a.p);
                                free(b.p);
                                return st;
                        }
                } else if (op->kind == NORM_PREPEND) {
                        if (!a.n)
                                continue;       /* HF leaves an empty string alone */
                        if (sb_add(&b, op->a, op->alen) != TSR_OK || sb_add(&b, a.p, a.n) != TSR_OK)
                                goto nomem;
                } else {
                        for (j = 0; j < a.n;) {
                                const char *f = op->alen ? memmem(a.p + j, a.n - j, op->a, op->alen) : NULL;
                                size_t e = f ? (size_t)(f - a.p) : a.n;
                                if (sb_add(&b, a.p + j, e - j) != TSR_OK ||
                                    (f && sb_add(&b, op->b, op->blen) != TSR_OK))
                                        goto nomem;
                                j = f ? e + op->alen : a.n;
                        }
                        if (!a.n && sb_add(&b, "", 0) != TSR_OK)
                                goto nomem;
                }
                {
                        sbuf tmp = a;
                        a = b;
                        b = tmp;
                }
        }
        free(b.p);
        if (!a.p && sb_add(&a, "", 0) != TSR_OK)
                return TSR_E_NOMEM;
        *out = a.p;
        *outlen = a.n;
        return TSR_OK;
nomem:
        free(a.p);
        free(b.p);
        return TSR_E_NOMEM;
}

static bool is_word_at(const tsr_tokenizer *t, enc_ctx *c, const char *s, size_t n, size_t at) {
        /* word_re is anchored at compile time: JIT rejects PCRE2_ANCHORED at match time. */
        return pcre2_match(t->word_re, (PCRE2_SPTR)s, n, at, PCRE2_NO_UTF_CHECK, c->md, c->mctx) >= 0;
}

typedef tsr_status (*piece_fn)(enc_ctx *c, const char *s, size_t n, bool first);

/* Split s on the added tokens of `tr` (HF's AddedVocabulary::find_matches): leftmost-
 * longest matches, single_word checked against the neighbouring characters, lstrip/rstrip
 * widening the match over Unicode whitespace.  Text between matches goes to `fn`. */
static tsr_status split_added(enc_ctx *c, const trie *tr, const char *s, size_t n, bool first, piece_fn fn) {
        const tsr_tokenizer *t = c->t;
        size_t i = 0, done = 0;
        tsr_status st;

        if (tr->n_nodes > 1) {
                while (i < n) {
                        int32_t idx = -1;
                        size_t ml = trie_longest(tr, s + i, n - i, &idx), ms = i, me;
                        const added_tok *a;
                        if (!ml) {
                                i++;
                                continue;
                        }
                        a = &t->added[idx];
                        me = i + ml;
                        if (a->single_word) {
                                bool ok = true;
                                if (ms > 0)
                                        ok = !is_word_at(t, c, s, n, utf8_last(s, ms));
                                if (ok && me < n)
                                        ok = !is_word_at(t, c, s, n, me);
                                if (!ok) {
                                        i = me;
                                        continue;
                                }
                        }
                        if (a->lstrip) {
                                size_t ns = ms;
                                while (ns > done) {
                                        size_t p = utf8_last(s, ns);
                                        uint32_t cp;
                                        utf8_dec(s + p, &cp);
                                        if (!is_uspace(cp))
                                                break;
                                        ns = p;
                                }
                                ms = ns;
                        }
                        if (a->rstrip) {
                                while (me < n) {
                                        uint32_t cp;
                                        size_t cl = utf8_dec(s + me, &cp);
                                        if (!is_uspace(cp))
                                                break;
                                        me += cl;
                                }
                        }
                        if (done < ms && (st = fn(c, s + done, ms - done, first && done == 0)) != TSR_OK)
                                return st;
                        if ((st = ids_push(&c->out, a->id)) != TSR_OK)
                                return st;
                        done = i = me;
                }
        }
        if (done < n || n == 0)
                return fn(c, s + done, n - done, first && done == 0);
        return TSR_OK;
}

static tsr_status piece_pretok(enc_ctx *c, const char *s, size_t n, bool first) {
        return pre_run(c, 0, s, n, first);
}

static tsr_status piece_normalize(enc_ctx *c, const char *s, size_t n, bool first) {
        char *ns;
        size_t nn;
        tsr_status st;

        if (!c->t->n_norm)
                return split_added(c, &c->t->norm_trie, s, n, first, piece_pretok);
        if ((st = normalize(c->t, s, n, &ns, &nn)) != TSR_OK)
                return st;
        st = split_added(c, &c->t->norm_trie, ns, nn, first, piece_pretok);
        free(ns);
        return st;
}

tsr_status tsr_tokenizer_encode(const tsr_tokenizer *t, const char *text, size_t len,
                                bool add_special_tokens, uint32_t **ids, size_t *n_ids) {
        enc_ctx c;
        tsr_status st = TSR_E_NOMEM;
        size_t i, j;

        if (!t || (!text && len) || !ids || !n_ids)
                return TSR_E_INVAL;
        if (!text)
                text = "";
        if (!utf8_valid(text, len))
                return TSR_E_INVAL;
        memset(&c, 0, sizeof(c));
        c.t = t;
        c.md = pcre2_match_data_create(1, NULL);
        c.mctx = pcre2_match_context_create(NULL);
        /* The word cache pays off only on long inputs; short prompts skip its setup. */
        if (len >= CACHE_MIN_INPUT && !(c.cache = calloc(CACHE_SLOTS, sizeof(cache_slot))))
                goto out;
        if (!c.md || !c.mctx)
                goto out;
        /* Pieces can be as long as the input; let the engine work on them rather than stop
         * at PCRE2's default limits (the patterns in use are linear). */
        pcre2_set_match_limit(c.mctx, UINT32_MAX);
        pcre2_set_depth_limit(c.mctx, UINT32_MAX);
        if (add_special_tokens && t->has_tmpl) {
                for (i = 0; i < t->n_tmpl && t->tmpl[i] != UINT32_MAX; i++)
                        if ((st = ids_push(&c.out, t->tmpl[i])) != TSR_OK)
                                goto out;
        }
        if ((st = split_added(&c, &t->raw_trie, text, len, true, piece_normalize)) != TSR_OK)
                goto out;
        if (add_special_tokens && t->has_tmpl) {
                for (j = 0; j < t->n_tmpl && t->tmpl[j] != UINT32_MAX; j++)
                        ;
                for (j++; j < t->n_tmpl; j++)
                        if (t->tmpl[j] != UINT32_MAX && (st = ids_push(&c.out, t->tmpl[j])) != TSR_OK)
                                goto out;
        }
        *ids = c.out.v;
        *n_ids = c.out.n;
        c.out.v = NULL;
        st = TSR_OK;
out:
        free(c.out.v);
        pcre2_match_data_free(c.md);
        pcre2_match_context_free(c.mctx);
        free(c.sym);
        free(c.prev);
        free(c.next);
        free(c.heap_rank);
        free(c.heap_pos);
        free(c.heap_new);
        free(c.scratch.p);
        free(c.cache);
        free(c.cpool.p);
        free(c.ipool.v);
        return st;
}

/* ------------------------------------------------------------------ decode */

struct tsr_detok {
        const tsr_tokenizer *t;
        bool skip_special, done;
        bool any;                       /* a token reached the fuse point (no-decoder joins) */
        size_t fuse_at;                 /* first Fuse/ByteLevel decoder, or n_dec */
        size_t n_in[MAX_STAGES];        /* tokens seen by each per-token stage */
        sbuf group[MAX_STAGES];         /* ByteFallback: bytes of the current <0xNN> run */
        sbuf lossy;                     /* ByteLevel: bytes of an unfinished UTF-8 sequence */
        sbuf hold[MAX_STAGES];          /* stream stages: text that may still change */
        size_t cnt[MAX_STAGES];         /* stream Strip: leading chars stripped so far */
        bool lead_done[MAX_STAGES];
        sbuf out;

        /* vLLM's view of the stream (tsr_detok_push/flush only; tsr_tokenizer_decode does not
         * use these).  vLLM streams through tokenizers' DecodeStream, which hands out new text
         * only when the decode so far does not end in U+FFFD; the request's text is what it
         * handed out, so a stream ending in U+FFFD (an unfinished or broken UTF-8 sequence, a
         * run of invalid <0xNN> bytes, a U+FFFD token) loses everything after its last step
         * that did not. */
        sbuf vis;                       /* settled text held because the decode ended in U+FFFD */
        sbuf good_tail;                 /* at the last step whose decode did not end in U+FFFD:
                                         * what finishing then would have added */
        bool out_fffd;                  /* the text handed out so far ends in U+FFFD */

        /* Priming with the prompt (tsr_detok_prime): the prompt's ids went through the
         * pipeline first, so what comes out is decode(prompt + generated); vLLM hands out
         * only what follows decode(prompt). */
        bool started;                   /* primed, pushed or flushed: no more priming */
        size_t skip;                    /* bytes of the prompt's decode still to drop */
};

static const char FFFD[] = "\xEF\xBF\xBD";

static tsr_status dstream(tsr_detok *d, size_t j, const char *s, size_t n);

/* Stream Replace: emit what can no longer be part of a match, keep the rest. */
static tsr_status ds_replace(tsr_detok *d, size_t j, const dec_op *op, bool final) {
        sbuf *h = &d->hold[j];
        size_t pos = 0, t;
        tsr_status st;

        for (;;) {
                const char *f = memmem(h->p + pos, h->n - pos, op->a, op->alen);
                if (!f)
                        break;
                if ((st = dstream(d, j + 1, h->p + pos, (size_t)(f - h->p) - pos)) != TSR_OK ||
                    (st = dstream(d, j + 1, op->b, op->blen)) != TSR_OK)
                        return st;
                pos = (size_t)(f - h->p) + op->alen;
        }
        t = h->n;
        if (!final) {
                size_t k = h->n - pos < op->alen ? h->n - pos : op->alen - 1;
                for (; k > 0; k--)
                        if (memcmp(h->p + h->n - k, op->a, k) == 0)
                                break;
                t = h->n - k;
        }
        if ((st = dstream(d, j + 1, h->p + pos, t - pos)) != TSR_OK)
                return st;
        memmove(h->p, h->p + t, h->n - t);
        h->n -= t;
        return TSR_OK;
}

/* Push text into stream stage j (after the fuse point); j == n_dec is the output. */
static tsr_status dstream(tsr_detok *d, size_t j, const char *s, size_t n) {
        const tsr_tokenizer *t = d->t;
        const dec_op *op;
        size_t i, cl;
        tsr_status st;

        if (!n)
                return TSR_OK;
        if (j >= t->n_dec)
                return sb_add(&d->out, s, n);
        op = &t->dec[j];
        switch (op->kind) {
        case DEC_FUSE:
                return dstream(d, j + 1, s, n);
        case DEC_REPLACE:
                if (!op->alen)
                        return dstream(d, j + 1, s, n);
                if (sb_add(&d->hold[j], s, n) != TSR_OK)
                        return TSR_E_NOMEM;
                return ds_replace(d, j, op, false);
        case DEC_METASPACE:
                /* After a fuse the whole text is HF's token 0. */
                for (i = 0; i < n; i += cl) {
                        cl = utf8_valid_len((const uint8_t *)s + i, n - i);
                        if (!cl)
                                cl = 1;
                        if (cl == op->alen && memcmp(s + i, op->a, cl) == 0) {
                                if (!op->prepend && (st = dstream(d, j + 1, " ", 1)) != TSR_OK)
                                        return st;
                        } else if ((st = dstream(d, j + 1, s + i, cl)) != TSR_OK) {
                                return st;
                        }
                }
                return TSR_OK;
        case DEC_STRIP:
                for (i = 0; i < n; i += cl) {
                        bool is_c;
                        cl = utf8_valid_len((const uint8_t *)s + i, n - i);
                        if (!cl)
                                cl = 1;
                        is_c = cl == op->alen && memcmp(s + i, op->a, cl) == 0;
                        if (!d->lead_done[j]) {
                                if (is_c && d->cnt[j] < op->start) {
                                        d->cnt[j]++;
                                        continue;
                                }
                                d->lead_done[j] = true;
                        }
                        if (!op->stop) {
                                if ((st = dstream(d, j + 1, s + i, cl)) != TSR_OK)
                                        return st;
                        } else if (is_c) {
                                /* Hold at most `stop` trailing content chars. */
                                if (sb_add(&d->hold[j], s + i, cl) != TSR_OK)
                                        return TSR_E_NOMEM;
                                if (d->hold[j].n > op->stop * op->alen) {
                                        if ((st = dstream(d, j + 1, d->hold[j].p, op->alen)) != TSR_OK)
                                                return st;
                                        memmove(d->hold[j].p, d->hold[j].p + op->alen, d->hold[j].n - op->alen);
                                        d->hold[j].n -= op->alen;
                                }
                        } else {
                                if ((st = dstream(d, j + 1, d->hold[j].p, d->hold[j].n)) != TSR_OK)
                                        return st;
                                d->hold[j].n = 0;
                                if ((st = dstream(d, j + 1, s + i, cl)) != TSR_OK)
                                        return st;
                        }
                }
                return TSR_OK;
        case DEC_BYTEFALLBACK:
        case DEC_BYTELEVEL:
                break;  /* rejected at load after a fuse */
        }
        return TSR_E_INTERNAL;
}

/* ByteLevel output: Rust's String::from_utf8_lossy over the byte stream, one U+FFFD per
 * maximal invalid subpart; an unfinished sequence at the end is kept unless `final`. */
static tsr_status lossy_drain(tsr_detok *d, bool final) {
        sbuf *b = &d->lossy;
        const uint8_t *p = (const uint8_t *)b->p;
        size_t i = 0, run = 0, keep;
        tsr_status st;

        while (i < b->n) {
                uint8_t c = p[i];
                size_t need, k;
                uint8_t lo = 0x80, hi = 0xBF;
                bool bad = false;
                if (c < 0x80) {
                        i++;
                        continue;
                }
                if (c >= 0xC2 && c <= 0xDF) {
                        need = 2;
                } else if (c >= 0xE0 && c <= 0xEF) {
                        need = 3;
                        lo = c == 0xE0 ? 0xA0 : 0x80;
                        hi = c == 0xED ? 0x9F : 0xBF;
                } else if (c >= 0xF0 && c <= 0xF4) {
                        need = 4;
                        lo = c == 0xF0 ? 0x90 : 0x80;
                        hi = c == 0xF4 ? 0x8F : 0xBF;
                } else {
                        need = 1;
                        bad = true;
                }
                for (k = 1; !bad && k < need; k++) {
                        if (i + k >= b->n) {
                                if (!final)
                                        goto stop;
                                bad = true;
                                break;
                        }
                        if (p[i + k] < (k == 1 ? lo : 0x80) || p[i + k] > (k == 1 ? hi : 0xBF)) {
                                bad = true;
                                break;
                        }
                }
                if (!bad) {
                        i += need;
                        continue;
                }
                if ((st = dstream(d, d->fuse_at + 1, b->p + run, i - run)) != TSR_OK ||
                    (st = dstream(d, d->fuse_at + 1, FFFD, 3)) != TSR_OK)
                        return st;
                i += k;
                run = i;
        }
stop:
        /* An empty buffer may have no storage yet, and NULL + 0 is undefined in C. */
        if (i > run && (st = dstream(d, d->fuse_at + 1, b->p + run, i - run)) != TSR_OK)
                return st;
        keep = b->n - i;
        if (keep && i)
                memmove(b->p, b->p + i, keep);
        b->n = keep;
        return TSR_OK;
}

static int hexv(char c) {
        if (c >= '0' && c <= '9')
                return c - '0';
        if (c >= 'a' && c <= 'f')
                return c - 'a' + 10;
        if (c >= 'A' && c <= 'F')
                return c - 'A' + 10;
        return -1;
}

static tsr_status dtok(tsr_detok *d, size_t k, const char *s, size_t n);

static tsr_status flush_group(tsr_detok *d, size_t k) {
        sbuf *g = &d->group[k];
        tsr_status st = TSR_OK;
        size_t i;

        if (!g->n)
                return TSR_OK;
        if (utf8_valid(g->p, g->n)) {
                st = dtok(d, k + 1, g->p, g->n);
        } else {
                /* HF: a run of byte tokens that is not valid UTF-8 becomes one U+FFFD per byte. */
                for (i = 0; i < g->n && st == TSR_OK; i++)
                        st = dtok(d, k + 1, FFFD, 3);
        }
        g->n = 0;
        return st;
}

/* Push one token string into per-token stage k (before the fuse point). */
static tsr_status dtok(tsr_detok *d, size_t k, const char *s, size_t n) {
        const tsr_tokenizer *t = d->t;
        const dec_op *op;
        sbuf b = {0};
        size_t i, cl, idx;
        tsr_status st;

        if (k == d->fuse_at) {
                if (k < t->n_dec && t->dec[k].kind == DEC_BYTELEVEL) {
                        /* Map each char back to its byte; a token with any other char
                         * contributes its own UTF-8 bytes, as HF does. */
                        size_t start = d->lossy.n;
                        bool all = true;
                        for (i = 0; i < n && all; i += cl) {
                                uint32_t cp;
                                cl = utf8_dec(s + i, &cp);
                                if (cp < 324 && t->bl_inv[cp] >= 0) {
                                        char c = (char)t->bl_inv[cp];
                                        if (sb_add(&d->lossy, &c, 1) != TSR_OK)
                                                return TSR_E_NOMEM;
                                } else {
                                        all = false;
                                }
                        }
                        if (!all) {
                                d->lossy.n = start;
                                if (sb_add(&d->lossy, s, n) != TSR_OK)
                                        return TSR_E_NOMEM;
                        }
                        return lossy_drain(d, false);
                }
                /* Without a decoder HF joins the tokens with spaces. */
                if (!t->n_dec && d->any && (st = dstream(d, k + 1, " ", 1)) != TSR_OK)
                        return st;
                d->any = true;
                return dstream(d, k + 1, s, n);
        }
        op = &t->dec[k];
        idx = d->n_in[k]++;
        switch (op->kind) {
        case DEC_REPLACE:
                for (i = 0; i < n;) {
                        const char *f = op->alen ? memmem(s + i, n - i, op->a, op->alen) : NULL;
                        size_t e = f ? (size_t)(f - s) : n;
                        if (sb_add(&b, s + i, e - i) != TSR_OK || (f && sb_add(&b, op->b, op->blen) != TSR_OK))
                                goto nomem;
                        i = f ? e + op->alen : n;
                }
                st = dtok(d, k + 1, b.p ? b.p : "", b.n);
                free(b.p);
                return st;
        case DEC_STRIP: {
                size_t a = 0, e = n, c;
                for (c = 0; c < op->start && a + op->alen <= n && memcmp(s + a, op->a, op->alen) == 0; c++)
                        a += op->alen;
                for (c = 0; c < op->stop && e >= a + op->alen && memcmp(s + e - op->alen, op->a, op->alen) == 0; c++)
                        e -= op->alen;
                return dtok(d, k + 1, s + a, e - a);
        }
        case DEC_METASPACE:
                for (i = 0; i < n; i += cl) {
                        cl = utf8_valid_len((const uint8_t *)s + i, n - i);
                        if (!cl)
                                cl = 1;
                        if (cl == op->alen && memcmp(s + i, op->a, cl) == 0) {
                                /* HF drops every replacement char of the first token. */
                                if (!(idx == 0 && op->prepend) && sb_add(&b, " ", 1) != TSR_OK)
                                        goto nomem;
                        } else if (sb_add(&b, s + i, cl) != TSR_OK) {
                                goto nomem;
                        }
                }
                st = dtok(d, k + 1, b.p ? b.p : "", b.n);
                free(b.p);
                return st;
        case DEC_BYTEFALLBACK:
                if (n == 6 && memcmp(s, "<0x", 3) == 0 && s[5] == '>' && hexv(s[3]) >= 0 && hexv(s[4]) >= 0) {
                        char c = (char)(hexv(s[3]) << 4 | hexv(s[4]));
                        d->n_in[k]--;
                        return sb_add(&d->group[k], &c, 1);
                }
                if ((st = flush_group(d, k)) != TSR_OK)
                        return st;
                return dtok(d, k + 1, s, n);
        case DEC_BYTELEVEL:
        case DEC_FUSE:
                break;  /* these are the fuse point */
        }
        return TSR_E_INTERNAL;
nomem:
        free(b.p);
        return TSR_E_NOMEM;
}

static tsr_status detok_finish(tsr_detok *d) {
        const tsr_tokenizer *t = d->t;
        size_t k;
        tsr_status st;

        for (k = 0; k < d->fuse_at; k++)
                if (t->dec[k].kind == DEC_BYTEFALLBACK && (st = flush_group(d, k)) != TSR_OK)
                        return st;
        if (d->fuse_at < t->n_dec && t->dec[d->fuse_at].kind == DEC_BYTELEVEL &&
            (st = lossy_drain(d, true)) != TSR_OK)
                return st;
        for (k = d->fuse_at + 1; k < t->n_dec; k++) {
                const dec_op *op = &t->dec[k];
                if (op->kind == DEC_REPLACE && op->alen && (st = ds_replace(d, k, op, true)) != TSR_OK)
                        return st;
                /* Strip: what is still held is the trailing run it removes. */
                d->hold[k].n = 0;
        }
        d->done = true;
        return TSR_OK;
}

static void detok_init(tsr_detok *d, const tsr_tokenizer *t, bool skip) {
        size_t k;

        memset(d, 0, sizeof(*d));
        d->t = t;
        d->skip_special = skip;
        d->fuse_at = t->n_dec;
        for (k = 0; k < t->n_dec; k++) {
                if (t->dec[k].kind == DEC_FUSE || t->dec[k].kind == DEC_BYTELEVEL) {
                        d->fuse_at = k;
                        break;
                }
        }
}

static void detok_done(tsr_detok *d) {
        size_t k;

        for (k = 0; k < MAX_STAGES; k++) {
                free(d->group[k].p);
                free(d->hold[k].p);
        }
        free(d->lossy.p);
        free(d->out.p);
        free(d->vis.p);
        free(d->good_tail.p);
}

static bool ends_fffd(const sbuf *b) {
        return b->n >= 3 && memcmp(b->p + b->n - 3, FFFD, 3) == 0;
}

static tsr_status sb_copy(sbuf *dst, const sbuf *src) {
        *dst = (sbuf){0};
        return src->n ? sb_add(dst, src->p, src->n) : TSR_OK;
}

/* What detok_finish would output now, without finishing `d`: run it on a copy.  Empty
 * when nothing is held back. */
static tsr_status detok_tail(const tsr_detok *d, sbuf *tail) {
        tsr_detok c;
        bool held = d->lossy.n > 0;
        size_t k;
        tsr_status st = TSR_OK;

        tail->n = 0;
        for (k = 0; k < MAX_STAGES && !held; k++)
                held = d->group[k].n || d->hold[k].n;
        if (!held)
                return TSR_OK;
        c = *d;
        c.out = c.vis = c.good_tail = (sbuf){0};
        for (k = 0; k < MAX_STAGES; k++)
                c.group[k] = c.hold[k] = (sbuf){0};
        c.lossy = (sbuf){0};
        for (k = 0; k < MAX_STAGES && st == TSR_OK; k++)
                if ((st = sb_copy(&c.group[k], &d->group[k])) == TSR_OK)
                        st = sb_copy(&c.hold[k], &d->hold[k]);
        if (st == TSR_OK && (st = sb_copy(&c.lossy, &d->lossy)) == TSR_OK)
                st = detok_finish(&c);
        if (st == TSR_OK && c.out.n)
                st = sb_add(tail, c.out.p, c.out.n);
        detok_done(&c);
        return st;
}

/* The spelling a decoder sees for `id`, or NULL for an id HF could not map. */
static const char *tok_str(const tsr_tokenizer *t, uint32_t id, size_t *n) {
        int32_t a;

        if (id >= t->n_ids)
                return NULL;
        a = t->added_of[id];
        if (a >= 0) {
                /* HF maps the id of a normalized added token back to its normalized spelling,
                 * and decodes that (NFD: "Ångström" decodes as "A\u030angstro\u0308m"). */
                *n = t->added[a].matchlen;
                return t->added[a].match;
        }
        if (id < t->n_vocab && t->vstr[id]) {
                *n = t->vlen[id];
                return t->vstr[id];
        }
        return NULL;
}

static tsr_status detok_add(tsr_detok *d, uint32_t id) {
        const tsr_tokenizer *t = d->t;
        const char *s;
        size_t n;

        s = tok_str(t, id, &n);
        if (!s)
                return TSR_E_INVAL;
        if (d->skip_special && t->added_of[id] >= 0 && t->added[t->added_of[id]].special)
                return TSR_OK;
        return dtok(d, 0, s, n);
}

tsr_status tsr_tokenizer_decode(const tsr_tokenizer *t, const uint32_t *ids, size_t n,
                                bool skip_special_tokens, char **text, size_t *len) {
        tsr_detok d;
        tsr_status st = TSR_OK;
        size_t i;

        if (!t || (!ids && n) || !text || !len)
                return TSR_E_INVAL;
        for (i = 0; i < n; i++)
                if (!tok_str(t, ids[i], &(size_t){0}))
                        return TSR_E_INVAL;
        detok_init(&d, t, skip_special_tokens);
        for (i = 0; i < n && st == TSR_OK; i++)
                st = detok_add(&d, ids[i]);
        if (st == TSR_OK)
                st = detok_finish(&d);
        if (st == TSR_OK && !d.out.p)
                st = sb_add(&d.out, "", 0);
        if (st == TSR_OK) {
                *text = d.out.p;
                *len = d.out.n;
                d.out.p = NULL;
        }
        detok_done(&d);
        return st;
}

tsr_status tsr_detok_new(const tsr_tokenizer *t, bool skip_special_tokens, tsr_detok **ret) {
        tsr_detok *d;

        if (!t || !ret)
                return TSR_E_INVAL;
        d = malloc(sizeof(*d));
        if (!d)
                return TSR_E_NOMEM;
        detok_init(d, t, skip_special_tokens);
        *ret = d;
        return TSR_OK;
}

/* Hand out `b` as a fresh NUL-terminated string and empty it. */
static tsr_status give(sbuf *b, char **delta, size_t *delta_len) {
        char *p = xstrndup(b->p ? b->p : "", b->n);

        if (!p)
                return TSR_E_NOMEM;
        *delta = p;
        *delta_len = b->n;
        b->n = 0;
        return TSR_OK;
}

/* Hand out `b` without the bytes of the prompt's decode not dropped yet (skip). */
static tsr_status hand_out(tsr_detok *d, sbuf *b, char **delta, size_t *delta_len) {
        size_t k = d->skip < b->n ? d->skip : b->n;

        if (k) {
                memmove(b->p, b->p + k, b->n - k);
                b->n -= k;
                d->skip -= k;
        }
        return give(b, delta, delta_len);
}

/* The end of a DecodeStream step, after the step's ids went through detok_add: *emit is
 * whether the decode of every id so far does not end in U+FFFD, and then d->vis holds the
 * text that step hands out. */
static tsr_status detok_settle(tsr_detok *d, bool *emit) {
        sbuf tail = {0};
        bool fffd;
        tsr_status st;

        if (d->out.n && sb_add(&d->vis, d->out.p, d->out.n) != TSR_OK)
                return TSR_E_NOMEM;
        d->out.n = 0;
        /* Does the decode of every id so far end in U+FFFD?  Its last char is in the held-back
         * tail if there is one, else in the settled text. */
        if ((st = detok_tail(d, &tail)) != TSR_OK) {
                free(tail.p);
                return st;
        }
        fffd = tail.n ? ends_fffd(&tail) : d->vis.n ? ends_fffd(&d->vis) : d->out_fffd;
        *emit = !fffd;
        if (fffd) {
                free(tail.p);
                return TSR_OK;
        }
        free(d->good_tail.p);
        d->good_tail = tail;
        if (d->vis.n)
                d->out_fffd = ends_fffd(&d->vis);
        return TSR_OK;
}

tsr_status tsr_detok_prime(tsr_detok *d, const uint32_t *ids, size_t n) {
        bool emit, any = false;
        tsr_status st;
        size_t i;

        if (!d || (!ids && n) || d->done || d->started)
                return TSR_E_INVAL;
        d->started = true;
        /* The whole prompt as one step: only the state after its last id matters (what it
         * decodes to, what is still held, whether it ends in U+FFFD). */
        d->out.n = 0;
        for (i = 0; i < n; i++) {
                /* An id with no spelling (a token-id prompt may hold one; the router checks only
                 * the range) is dropped, as HF's decode drops it. */
                if (!tok_str(d->t, ids[i], &(size_t){0}))
                        continue;
                if ((st = detok_add(d, ids[i])) != TSR_OK)
                        return st;
                any = true;
        }
        if (!any)
                return TSR_OK;
        if ((st = detok_settle(d, &emit)) != TSR_OK)
                return st;
        if (emit) {
                /* DecodeStream's prefix is decode(prompt): the settled text (vis) and what is
                 * still held (good_tail, this step's tail).  Drop the one, skip the other. */
                d->vis.n = 0;
                d->skip = d->good_tail.n;
        } else {
                /* decode(prompt) ends in U+FFFD: DecodeStream keeps an empty prefix, and its
                 * first chunk is the decode of the prompt and generated ids together (vis
                 * keeps the prompt's text for it).  Until a step ends elsewhere than in
                 * U+FFFD, nothing is handed out. */
                d->good_tail.n = 0;
        }
        return TSR_OK;
}

tsr_status tsr_detok_push(tsr_detok *d, uint32_t id, char **delta, size_t *delta_len) {
        bool emit;
        tsr_status st;

        if (!d || !delta || !delta_len || d->done || !tok_str(d->t, id, &(size_t){0}))
                return TSR_E_INVAL;
        d->started = true;
        d->out.n = 0;
        if ((st = detok_add(d, id)) != TSR_OK || (st = detok_settle(d, &emit)) != TSR_OK)
                return st;
        if (!emit)
                return give(&d->out, delta, delta_len);    /* "" until a later step settles it */
        return hand_out(d, &d->vis, delta, delta_len);
}

tsr_status tsr_detok_flush(tsr_detok *d, char **delta, size_t *delta_len) {
        tsr_status st;

        if (!d || !delta || !delta_len || d->done)
                return TSR_E_INVAL;
        d->started = true;
        d->out.n = 0;
        if ((st = detok_finish(d)) != TSR_OK)
                return st;
        if (d->out.n ? ends_fffd(&d->out) : d->vis.n ? ends_fffd(&d->vis) : d->out_fffd)
                return hand_out(d, &d->good_tail, delta, delta_len);
        if (d->out.n && sb_add(&d->vis, d->out.p, d->out.n) != TSR_OK)
                return TSR_E_NOMEM;
        return hand_out(d, &d->vis, delta, delta_len);
}

void tsr_detok_free(tsr_detok **dp) {
        if (!dp || !*dp)
                return;
        detok_done(*dp);
        free(*dp);
        *dp = NULL;
}

/* ------------------------------------------------------------------ accessors */

size_t tsr_tokenizer_vocab_size(const tsr_tokenizer *t) { return t->n_ids; }

int64_t tsr_tokenizer_token_id(const tsr_tokenizer *t, const char *tok, size_t len) {
        int64_t a = strmap_get(&t->amap, t->astr, t->alen, tok, len);

        if (a >= 0)
                return t->added[a].id;
        return strmap_get(&t->vmap, t->vstr, t->vlen, tok, len);
}

const char *tsr_tokenizer_token_str(const tsr_tokenizer *t, uint32_t id) {
        size_t n;

        return tok_str(t, id, &n);
}

int64_t tsr_tokenizer_bos_id(const tsr_tokenizer *t) { return t->bos_id; }
int64_t tsr_tokenizer_eos_id(const tsr_tokenizer *t) { return t->eos_id; }
bool tsr_tokenizer_add_bos(const tsr_tokenizer *t) { return t->add_bos; }
bool tsr_tokenizer_add_eos(const tsr_tokenizer *t) { return t->add_eos; }

bool tsr_tokenizer_is_special(const tsr_tokenizer *t, uint32_t id) {
        return id < t->n_ids && t->added_of[id] >= 0 && t->added[t->added_of[id]].special;
}

/* ------------------------------------------------------------------ construction */

#define MAX_VOCAB (1u << 24)    /* ids past this are a malformed file, not a tokenizer */

typedef struct ld {
        tsr_tokenizer *t;
        char *err;
        size_t errlen;
} ld;

static tsr_tokenizer *tok_alloc(void) {
        tsr_tokenizer *t = calloc(1, sizeof(*t));

        if (t) {
                t->unk_id = -1;
                t->bos_id = -1;
                t->eos_id = -1;
        }
        return t;
}

static tsr_status set_vocab(ld *L, size_t n) {
        tsr_tokenizer *t = L->t;

        t->n_vocab = n;
        t->vstr = calloc(n ? n : 1, sizeof(char *));
        t->vlen = calloc(n ? n : 1, sizeof(uint32_t));
        if (!t->vstr || !t->vlen || strmap_init(&t->vmap, n) != TSR_OK)
                return TSR_E_NOMEM;
        return TSR_OK;
}

/* Put token `s` at `id`.  A repeated spelling maps to the later id, like a Python dict. */
static tsr_status put_vocab(ld *L, uint32_t id, const char *s, size_t n) {
        tsr_tokenizer *t = L->t;
        size_t slot;

        if (n > UINT32_MAX)
                return TSR_E_INVAL;
        if (t->vstr[id]) {
                tsr_errf(L->err, L->errlen, "vocab: id %u given twice", id);
                return TSR_E_INVAL;
        }
        t->vstr[id] = xstrndup(s, n);
        if (!t->vstr[id])
                return TSR_E_NOMEM;
        t->vlen[id] = (uint32_t)n;
        slot = strmap_find(&t->vmap, t->vstr, t->vlen, s, n);
        t->vmap.slot[slot] = id + 1;
        return TSR_OK;
}

static tsr_status put_merge(ld *L, const char *a, size_t an, const char *b, size_t bn, uint32_t rank, bool lenient) {
        tsr_tokenizer *t = L->t;
        int64_t ia, ib, im;
        char *cat;

        ia = strmap_get(&t->vmap, t->vstr, t->vlen, a, an);
        ib = strmap_get(&t->vmap, t->vstr, t->vlen, b, bn);
        if (ia < 0 || ib < 0) {
                if (lenient)
                        return TSR_OK;
                tsr_errf(L->err, L->errlen, "model.merges[%u]: token '%.*s' not in vocab", rank,
                       (int)(ia < 0 ? (an > 100 ? 100 : an) : (bn > 100 ? 100 : bn)), ia < 0 ? a : b);
                return TSR_E_INVAL;
        }
        cat = malloc(an + bn + 1);
        if (!cat)
                return TSR_E_NOMEM;
        memcpy(cat, a, an);
        memcpy(cat + an, b, bn);
        im = strmap_get(&t->vmap, t->vstr, t->vlen, cat, an + bn);
        free(cat);
        if (im < 0) {
                if (lenient)
                        return TSR_OK;
                tsr_errf(L->err, L->errlen, "model.merges[%u]: merged token '%.*s%.*s' not in vocab", rank,
                       (int)(an > 100 ? 100 : an), a, (int)(bn > 100 ? 100 : bn), b);
                return TSR_E_INVAL;
        }
        return u64map_put(&t->merges, (uint64_t)ia << 32 | (uint64_t)ib, rank, (uint32_t)im);
}

static tsr_status add_added(ld *L, uint32_t id, const char *s, size_t n, bool special, bool lstrip, bool rstrip,
                            bool normalized, bool single_word) {
        tsr_tokenizer *t = L->t;
        added_tok *a;
        size_t cap = t->n_added;

        if (grow((void **)&t->added, &cap, t->n_added + 1, sizeof(added_tok)) != TSR_OK)
                return TSR_E_NOMEM;
        a = &t->added[t->n_added];
        memset(a, 0, sizeof(*a));
        a->content = xstrndup(s, n);
        if (!a->content)
                return TSR_E_NOMEM;
        a->len = (uint32_t)n;
        a->id = id;
        a->special = special;
        a->lstrip = lstrip;
        a->rstrip = rstrip;
        a->normalized = normalized;
        a->single_word = single_word;
        a->match = a->content;
        a->matchlen = n;
        t->n_added++;
        return TSR_OK;
}

/* Everything that depends on the parts being loaded: id space, byte tables, tries. */
static tsr_status finish(ld *L) {
        tsr_tokenizer *t = L->t;
        size_t i;
        unsigned b;
        tsr_status st;

        t->n_ids = t->n_vocab;
        for (i = 0; i < t->n_added; i++)
                if ((size_t)t->added[i].id + 1 > t->n_ids)
                        t->n_ids = (size_t)t->added[i].id + 1;
        t->added_of = malloc((t->n_ids ? t->n_ids : 1) * sizeof(int32_t));
        t->astr = calloc(t->n_added + 1, sizeof(char *));
        t->alen = calloc(t->n_added + 1, sizeof(uint32_t));
        if (!t->added_of || !t->astr || !t->alen || strmap_init(&t->amap, t->n_added) != TSR_OK)
                return TSR_E_NOMEM;
        for (i = 0; i < t->n_ids; i++)
                t->added_of[i] = -1;
        for (i = 0; i < t->n_added; i++) {
                added_tok *a = &t->added[i];
                size_t slot;
                t->astr[i] = a->content;
                t->alen[i] = a->len;
                slot = strmap_find(&t->amap, t->astr, t->alen, a->content, a->len);
                if (!t->amap.slot[slot])
                        t->amap.slot[slot] = (uint32_t)i + 1;
                t->added_of[a->id] = (int32_t)i;
        }
        for (i = 0; i < 324; i++)
                t->bl_inv[i] = -1;
        for (b = 0; b < 256; b++) {
                uint32_t cp = byte_to_cp(b);
                char hex[8];
                int64_t id;
                t->bl_len[b] = (uint8_t)utf8_enc(cp, t->bl_str[b]);
                t->bl_inv[cp] = (int16_t)b;
                id = strmap_get(&t->vmap, t->vstr, t->vlen, t->bl_str[b], t->bl_len[b]);
                t->byte_tok[b] = (int32_t)id;
                snprintf(hex, sizeof(hex), "<0x%02X>", b);
                id = strmap_get(&t->vmap, t->vstr, t->vlen, hex, 6);
                t->fallback_tok[b] = (int32_t)id;
        }
        /* Normalized added tokens are looked for in normalized text, so their pattern is
         * their normalized spelling (HF refresh_added_tokens). */
        for (i = 0; i < t->n_added; i++) {
                added_tok *a = &t->added[i];
                if (a->normalized && t->n_norm) {
                        char *m;
                        size_t ml;
                        if ((st = normalize(t, a->content, a->len, &m, &ml)) != TSR_OK)
                                return st;
                        a->match = m;
                        a->matchlen = ml;
                }
                if ((st = trie_add(a->normalized ? &t->norm_trie : &t->raw_trie, a->match, a->matchlen,
                                   (int32_t)i)) != TSR_OK)
                        return st;
        }
        if ((st = compile_re_opt("[\\p{L}\\p{N}_]", 13, PCRE2_ANCHORED, &t->word_re, L->err, L->errlen)) != TSR_OK)
                return st;
        /* Whether add_special_tokens adds BOS / EOS, from the template. */
        if (t->has_tmpl) {
                size_t seq = t->n_tmpl;
                for (i = 0; i < t->n_tmpl; i++)
                        if (t->tmpl[i] == UINT32_MAX) {
                                seq = i;
                                break;
                        }
                if (seq > 0) {
                        if (t->bos_id < 0)
                                t->bos_id = t->tmpl[0];
                        t->add_bos = true;
                }
                if (seq + 1 < t->n_tmpl) {
                        if (t->eos_id < 0)
                                t->eos_id = t->tmpl[t->n_tmpl - 1];
                        t->add_eos = true;
                }
        }
        return TSR_OK;
}

/* ---- tokenizer.json */

static const char *jstr(json_t *o, const char *k) {
        json_t *v = json_object_get(o, k);

        return json_is_string(v) ? json_string_value(v) : NULL;
}

static bool jbool(json_t *o, const char *k, bool def) {
        json_t *v = json_object_get(o, k);

        return json_is_boolean(v) ? json_is_true(v) : def;
}

/* A {"String": s} pattern; {"Regex": r} too when re is not NULL. */
static tsr_status get_pattern(ld *L, json_t *o, const char *where, char **lit, size_t *litlen, pcre2_code **re) {
        json_t *p = json_object_get(o, "pattern"), *v;

        if ((v = json_object_get(p, "String")) && json_is_string(v)) {
                *lit = xstrndup(json_string_value(v), json_string_length(v));
                *litlen = json_string_length(v);
                return *lit ? TSR_OK : TSR_E_NOMEM;
        }
        if ((v = json_object_get(p, "Regex")) && json_is_string(v)) {
                if (!re) {
                        tsr_errf(L->err, L->errlen, "%s: a Regex pattern is not supported here", where);
                        return TSR_E_UNSUPPORTED;
                }
                return compile_re(json_string_value(v), json_string_length(v), re, L->err, L->errlen);
        }
        tsr_errf(L->err, L->errlen, "%s: field 'pattern': expected {\"String\": ...} or {\"Regex\": ...}", where);
        return TSR_E_INVAL;
}

static tsr_status one_char(ld *L, json_t *o, const char *k, const char *def, const char *where, char *out,
                           size_t *outlen) {
        const char *s = jstr(o, k);
        uint32_t cp;

        if (!s)
                s = def;
        if (!s || !*s || !utf8_valid(s, strlen(s)) || utf8_dec(s, &cp) != strlen(s)) {
                tsr_errf(L->err, L->errlen, "%s: field '%s': expected one character", where, k);
                return TSR_E_INVAL;
        }
        *outlen = strlen(s);
        memcpy(out, s, *outlen);
        return TSR_OK;
}

static int prepend_scheme(json_t *o) {
        const char *ps = jstr(o, "prepend_scheme");

        if (ps)
                return !strcmp(ps, "never") ? 0 : !strcmp(ps, "first") ? 1 : 2;
        return jbool(o, "add_prefix_space", true) ? 2 : 0;
}

static tsr_status load_normalizer(ld *L, json_t *o, int depth) {
        tsr_tokenizer *t = L->t;
        const char *type;
        norm_op *op;
        size_t i;
        tsr_status st;

        if (!o || json_is_null(o))
                return TSR_OK;
        type = jstr(o, "type");
        if (!type) {
                tsr_errf(L->err, L->errlen, "normalizer: field 'type' missing");
                return TSR_E_INVAL;
        }
        if (!strcmp(type, "Sequence")) {
                json_t *arr = json_object_get(o, "normalizers");
                if (!json_is_array(arr) || depth >= MAX_NEST) {
                        tsr_errf(L->err, L->errlen, "normalizer Sequence: field 'normalizers': expected an array");
                        return TSR_E_INVAL;
                }
                for (i = 0; i < json_array_size(arr); i++)
                        if ((st = load_normalizer(L, json_array_get(arr, i), depth + 1)) != TSR_OK)
                                return st;
                return TSR_OK;
        }
        if (strcmp(type, "Prepend") && strcmp(type, "Replace") && strcmp(type, "NFC") && strcmp(type, "NFD") &&
            strcmp(type, "NFKC") && strcmp(type, "NFKD")) {
                tsr_errf(L->err, L->errlen,
                         "normalizer '%s' is not supported (supported: Prepend, Replace, NFC, NFD, NFKC, NFKD, Sequence)",
                         type);
                return TSR_E_UNSUPPORTED;
        }
        if (t->n_norm == MAX_STAGES) {
                tsr_errf(L->err, L->errlen, "normalizer: more than %d steps", MAX_STAGES);
                return TSR_E_UNSUPPORTED;
        }
        op = &t->norm[t->n_norm++];
        memset(op, 0, sizeof(*op));
        if (type[0] == 'N') {
                op->kind = NORM_UNICODE;
                op->uflags = UTF8PROC_STABLE | (type[2] == 'K' || type[3] == 'K' ? UTF8PROC_COMPAT : 0) |
                             (type[strlen(type) - 1] == 'C' ? UTF8PROC_COMPOSE : UTF8PROC_DECOMPOSE);
                return TSR_OK;
        }
        if (!strcmp(type, "Prepend")) {
                json_t *v = json_object_get(o, "prepend");
                op->kind = NORM_PREPEND;
                if (!json_is_string(v)) {
                        tsr_errf(L->err, L->errlen, "normalizer Prepend: field 'prepend': expected a string");
                        return TSR_E_INVAL;
                }
                op->alen = json_string_length(v);
                op->a = xstrndup(json_string_value(v), op->alen);
                return op->a ? TSR_OK : TSR_E_NOMEM;
        }
        op->kind = NORM_REPLACE;
        if ((st = get_pattern(L, o, "normalizer Replace", &op->a, &op->alen, NULL)) != TSR_OK)
                return st;
        {
                json_t *v = json_object_get(o, "content");
                if (!json_is_string(v)) {
                        tsr_errf(L->err, L->errlen, "normalizer Replace: field 'content': expected a string");
                        return TSR_E_INVAL;
                }
                op->blen = json_string_length(v);
                op->b = xstrndup(json_string_value(v), op->blen);
                return op->b ? TSR_OK : TSR_E_NOMEM;
        }
}

static tsr_status load_pretok(ld *L, json_t *o, int depth) {
        tsr_tokenizer *t = L->t;
        const char *type;
        pre_op *op;
        size_t i;
        tsr_status st;

        if (!o || json_is_null(o))
                return TSR_OK;
        type = jstr(o, "type");
        if (!type) {
                tsr_errf(L->err, L->errlen, "pre_tokenizer: field 'type' missing");
                return TSR_E_INVAL;
        }
        if (!strcmp(type, "Sequence")) {
                json_t *arr = json_object_get(o, "pretokenizers");
                if (!json_is_array(arr) || depth >= MAX_NEST) {
                        tsr_errf(L->err, L->errlen, "pre_tokenizer Sequence: field 'pretokenizers': expected an array");
                        return TSR_E_INVAL;
                }
                for (i = 0; i < json_array_size(arr); i++)
                        if ((st = load_pretok(L, json_array_get(arr, i), depth + 1)) != TSR_OK)
                                return st;
                return TSR_OK;
        }
        if (t->n_pre == MAX_STAGES) {
                tsr_errf(L->err, L->errlen, "pre_tokenizer: more than %d steps", MAX_STAGES);
                return TSR_E_UNSUPPORTED;
        }
        if (t->n_pre && t->pre[t->n_pre - 1].kind == PRE_BYTELEVEL) {
                /* BPE reads ByteLevel's byte mapping straight from the bytes, so nothing may
                 * act on the mapped text. */
                tsr_errf(L->err, L->errlen, "pre_tokenizer '%s' after ByteLevel is not supported", type);
                return TSR_E_UNSUPPORTED;
        }
        op = &t->pre[t->n_pre];
        memset(op, 0, sizeof(*op));
        if (!strcmp(type, "Split")) {
                const char *beh = jstr(o, "behavior");
                op->kind = PRE_SPLIT;
                t->n_pre++;
                if ((st = get_pattern(L, o, "pre_tokenizer Split", &op->lit, &op->litlen, &op->re)) != TSR_OK)
                        return st;
                if (!beh) {
                        tsr_errf(L->err, L->errlen, "pre_tokenizer Split: field 'behavior' missing");
                        return TSR_E_INVAL;
                }
                if (!strcmp(beh, "Removed"))
                        op->beh = BEH_REMOVED;
                else if (!strcmp(beh, "Isolated"))
                        op->beh = BEH_ISOLATED;
                else if (!strcmp(beh, "MergedWithPrevious"))
                        op->beh = BEH_MERGED_PREV;
                else if (!strcmp(beh, "MergedWithNext"))
                        op->beh = BEH_MERGED_NEXT;
                else if (!strcmp(beh, "Contiguous"))
                        op->beh = BEH_CONTIGUOUS;
                else {
                        tsr_errf(L->err, L->errlen, "pre_tokenizer Split: unknown behavior '%s'", beh);
                        return TSR_E_INVAL;
                }
                op->invert = jbool(o, "invert", false);
                return TSR_OK;
        }
        if (!strcmp(type, "Digits")) {
                bool ind = jbool(o, "individual_digits", false);
                op->kind = PRE_SPLIT;
                op->beh = BEH_ISOLATED;
                t->n_pre++;
                return compile_re(ind ? "\\p{N}" : "\\p{N}+", ind ? 5 : 6, &op->re, L->err, L->errlen);
        }
        if (!strcmp(type, "Metaspace")) {
                op->kind = PRE_METASPACE;
                t->n_pre++;
                if ((st = one_char(L, o, "replacement", NULL, "pre_tokenizer Metaspace", op->repl, &op->repllen)) != TSR_OK)
                        return st;
                op->prepend = prepend_scheme(o);
                op->split = jbool(o, "split", true);
                return TSR_OK;
        }
        if (!strcmp(type, "ByteLevel")) {
                op->kind = PRE_BYTELEVEL;
                t->n_pre++;
                op->add_prefix_space = jbool(o, "add_prefix_space", true);
                t->byte_level = true;
                if (jbool(o, "use_regex", true))
                        return compile_re(GPT2_PATTERN, sizeof(GPT2_PATTERN) - 1, &op->re, L->err, L->errlen);
                return TSR_OK;
        }
        tsr_errf(L->err, L->errlen,
               "pre_tokenizer '%s' is not supported (supported: ByteLevel, Split, Metaspace, Digits, Sequence)", type);
        return TSR_E_UNSUPPORTED;
}

static tsr_status load_decoder(ld *L, json_t *o, int depth) {
        tsr_tokenizer *t = L->t;
        const char *type;
        dec_op *op;
        size_t i;
        bool fused = false;
        tsr_status st;

        if (!o || json_is_null(o))
                return TSR_OK;
        type = jstr(o, "type");
        if (!type) {
                tsr_errf(L->err, L->errlen, "decoder: field 'type' missing");
                return TSR_E_INVAL;
        }
        if (!strcmp(type, "Sequence")) {
                json_t *arr = json_object_get(o, "decoders");
                if (!json_is_array(arr) || depth >= MAX_NEST) {
                        tsr_errf(L->err, L->errlen, "decoder Sequence: field 'decoders': expected an array");
                        return TSR_E_INVAL;
                }
                for (i = 0; i < json_array_size(arr); i++)
                        if ((st = load_decoder(L, json_array_get(arr, i), depth + 1)) != TSR_OK)
                                return st;
                return TSR_OK;
        }
        if (t->n_dec == MAX_STAGES) {
                tsr_errf(L->err, L->errlen, "decoder: more than %d steps", MAX_STAGES);
                return TSR_E_UNSUPPORTED;
        }
        for (i = 0; i < t->n_dec; i++)
                fused |= t->dec[i].kind == DEC_FUSE || t->dec[i].kind == DEC_BYTELEVEL;
        op = &t->dec[t->n_dec];
        memset(op, 0, sizeof(*op));
        if (!strcmp(type, "ByteLevel") || !strcmp(type, "ByteFallback")) {
                if (fused) {
                        tsr_errf(L->err, L->errlen, "decoder '%s' after Fuse or ByteLevel is not supported", type);
                        return TSR_E_UNSUPPORTED;
                }
                op->kind = !strcmp(type, "ByteLevel") ? DEC_BYTELEVEL : DEC_BYTEFALLBACK;
                t->n_dec++;
                return TSR_OK;
        }
        if (!strcmp(type, "Fuse")) {
                op->kind = DEC_FUSE;
                t->n_dec++;
                return TSR_OK;
        }
        if (!strcmp(type, "Replace")) {
                json_t *v = json_object_get(o, "content");
                op->kind = DEC_REPLACE;
                t->n_dec++;
                if ((st = get_pattern(L, o, "decoder Replace", &op->a, &op->alen, NULL)) != TSR_OK)
                        return st;
                if (!json_is_string(v)) {
                        tsr_errf(L->err, L->errlen, "decoder Replace: field 'content': expected a string");
                        return TSR_E_INVAL;
                }
                op->blen = json_string_length(v);
                op->b = xstrndup(json_string_value(v), op->blen);
                return op->b ? TSR_OK : TSR_E_NOMEM;
        }
        if (!strcmp(type, "Strip") || !strcmp(type, "Metaspace")) {
                char c[8];
                size_t cl;
                bool strip = !strcmp(type, "Strip");
                op->kind = strip ? DEC_STRIP : DEC_METASPACE;
                t->n_dec++;
                if ((st = one_char(L, o, strip ? "content" : "replacement", NULL, strip ? "decoder Strip" : "decoder Metaspace",
                                   c, &cl)) != TSR_OK)
                        return st;
                op->a = xstrndup(c, cl);
                op->alen = cl;
                if (!op->a)
                        return TSR_E_NOMEM;
                if (strip) {
                        json_t *a = json_object_get(o, "start"), *b = json_object_get(o, "stop");
                        if (!json_is_integer(a) || !json_is_integer(b) || json_integer_value(a) < 0 ||
                            json_integer_value(b) < 0 || json_integer_value(a) > 1000000 || json_integer_value(b) > 1000000) {
                                tsr_errf(L->err, L->errlen, "decoder Strip: fields 'start'/'stop': expected small integers");
                                return TSR_E_INVAL;
                        }
                        op->start = (size_t)json_integer_value(a);
                        op->stop = (size_t)json_integer_value(b);
                } else {
                        op->prepend = prepend_scheme(o) != 0;
                }
                return TSR_OK;
        }
        tsr_errf(L->err, L->errlen,
               "decoder '%s' is not supported (supported: ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence)",
               type);
        return TSR_E_UNSUPPORTED;
}

static tsr_status tmpl_add(tsr_tokenizer *t, uint32_t v) {
        size_t cap = t->n_tmpl;

        if (grow((void **)&t->tmpl, &cap, t->n_tmpl + 1, sizeof(uint32_t)) != TSR_OK)
                return TSR_E_NOMEM;
        t->tmpl[t->n_tmpl++] = v;
        return TSR_OK;
}

static tsr_status load_post(ld *L, json_t *o, int depth) {
        tsr_tokenizer *t = L->t;
        const char *type;
        size_t i, j;
        tsr_status st;

        if (!o || json_is_null(o))
                return TSR_OK;
        type = jstr(o, "type");
        if (!type) {
                tsr_errf(L->err, L->errlen, "post_processor: field 'type' missing");
                return TSR_E_INVAL;
        }
        if (!strcmp(type, "ByteLevel"))
                return TSR_OK;  /* only adjusts offsets */
        if (!strcmp(type, "Sequence")) {
                json_t *arr = json_object_get(o, "processors");
                if (!json_is_array(arr) || depth >= MAX_NEST) {
                        tsr_errf(L->err, L->errlen, "post_processor Sequence: field 'processors': expected an array");
                        return TSR_E_INVAL;
                }
                for (i = 0; i < json_array_size(arr); i++)
                        if ((st = load_post(L, json_array_get(arr, i), depth + 1)) != TSR_OK)
                                return st;
                return TSR_OK;
        }
        if (t->has_tmpl) {
                tsr_errf(L->err, L->errlen, "post_processor: more than one template");
                return TSR_E_UNSUPPORTED;
        }
        if (!strcmp(type, "BertProcessing") || !strcmp(type, "RobertaProcessing")) {
                json_t *cls = json_object_get(o, "cls"), *sep = json_object_get(o, "sep");
                json_t *ci = json_array_get(cls, 1), *si = json_array_get(sep, 1);
                if (!json_is_integer(ci) || !json_is_integer(si) || json_integer_value(ci) < 0 ||
                    json_integer_value(si) < 0 || json_integer_value(ci) >= MAX_VOCAB || json_integer_value(si) >= MAX_VOCAB) {
                        tsr_errf(L->err, L->errlen, "post_processor %s: fields 'cls'/'sep': expected [token, id]", type);
                        return TSR_E_INVAL;
                }
                t->has_tmpl = true;
                if (tmpl_add(t, (uint32_t)json_integer_value(ci)) != TSR_OK || tmpl_add(t, UINT32_MAX) != TSR_OK ||
                    tmpl_add(t, (uint32_t)json_integer_value(si)) != TSR_OK)
                        return TSR_E_NOMEM;
                return TSR_OK;
        }
        if (!strcmp(type, "TemplateProcessing")) {
                json_t *single = json_object_get(o, "single"), *sp = json_object_get(o, "special_tokens");
                bool seq = false;
                if (!json_is_array(single)) {
                        tsr_errf(L->err, L->errlen, "post_processor TemplateProcessing: field 'single': expected an array");
                        return TSR_E_INVAL;
                }
                t->has_tmpl = true;
                for (i = 0; i < json_array_size(single); i++) {
                        json_t *it = json_array_get(single, i), *v;
                        if ((v = json_object_get(it, "Sequence"))) {
                                if (seq) {
                                        tsr_errf(L->err, L->errlen, "post_processor TemplateProcessing: two sequences in 'single'");
                                        return TSR_E_UNSUPPORTED;
                                }
                                seq = true;
                                if (tmpl_add(t, UINT32_MAX) != TSR_OK)
                                        return TSR_E_NOMEM;
                        } else if ((v = json_object_get(it, "SpecialToken"))) {
                                const char *name = jstr(v, "id");
                                json_t *e = name ? json_object_get(sp, name) : NULL, *ids = json_object_get(e, "ids");
                                if (!json_is_array(ids)) {
                                        tsr_errf(L->err, L->errlen,
                                               "post_processor TemplateProcessing: special token '%s' missing from 'special_tokens'",
                                               name ? name : "?");
                                        return TSR_E_INVAL;
                                }
                                for (j = 0; j < json_array_size(ids); j++) {
                                        json_t *x = json_array_get(ids, j);
                                        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) >= MAX_VOCAB) {
                                                tsr_errf(L->err, L->errlen, "post_processor TemplateProcessing: bad id for '%s'", name);
                                                return TSR_E_INVAL;
                                        }
                                        if (tmpl_add(t, (uint32_t)json_integer_value(x)) != TSR_OK)
                                                return TSR_E_NOMEM;
                                }
                        } else {
                                tsr_errf(L->err, L->errlen, "post_processor TemplateProcessing: 'single'[%zu]: expected Sequence or SpecialToken", i);
                                return TSR_E_INVAL;
                        }
                }
                if (!seq && tmpl_add(t, UINT32_MAX) != TSR_OK)
                        return TSR_E_NOMEM;
                return TSR_OK;
        }
        tsr_errf(L->err, L->errlen,
               "post_processor '%s' is not supported (supported: TemplateProcessing, ByteLevel, BertProcessing, RobertaProcessing, Sequence)",
               type);
        return TSR_E_UNSUPPORTED;
}

static tsr_status load_model(ld *L, json_t *m) {
        json_t *vocab = json_object_get(m, "vocab"), *merges = json_object_get(m, "merges"), *v;
        const char *type = jstr(m, "type"), *key, *unk;
        size_t max = 0, i;
        tsr_status st;

        if (!json_is_object(m)) {
                tsr_errf(L->err, L->errlen, "field 'model': expected an object");
                return TSR_E_INVAL;
        }
        if (type && strcmp(type, "BPE")) {
                tsr_errf(L->err, L->errlen, "model type '%s' is not supported (only BPE)", type);
                return TSR_E_UNSUPPORTED;
        }
        if (!json_is_object(vocab)) {
                tsr_errf(L->err, L->errlen, "model: field 'vocab': expected an object");
                return TSR_E_INVAL;
        }
        if (merges && !json_is_array(merges)) {
                tsr_errf(L->err, L->errlen, "model: field 'merges': expected an array");
                return TSR_E_INVAL;
        }
        v = json_object_get(m, "dropout");
        if (v && !json_is_null(v) && !(json_is_number(v) && json_number_value(v) == 0.0)) {
                tsr_errf(L->err, L->errlen, "model: BPE dropout is not supported");
                return TSR_E_UNSUPPORTED;
        }
        if ((key = jstr(m, "continuing_subword_prefix")) && *key) {
                tsr_errf(L->err, L->errlen, "model: continuing_subword_prefix is not supported");
                return TSR_E_UNSUPPORTED;
        }
        if ((key = jstr(m, "end_of_word_suffix")) && *key) {
                tsr_errf(L->err, L->errlen, "model: end_of_word_suffix is not supported");
                return TSR_E_UNSUPPORTED;
        }
        json_object_foreach(vocab, key, v) {
                if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= MAX_VOCAB) {
                        tsr_errf(L->err, L->errlen, "model.vocab['%.100s']: expected an id in [0, %u)", key, MAX_VOCAB);
                        return TSR_E_INVAL;
                }
                if ((size_t)json_integer_value(v) + 1 > max)
                        max = (size_t)json_integer_value(v) + 1;
        }
        if ((st = set_vocab(L, max)) != TSR_OK)
                return st;
        {
                /* json_object_foreach gives C strings; keys with NUL bytes are not tokens we meet. */
                json_object_foreach(vocab, key, v)
                        if ((st = put_vocab(L, (uint32_t)json_integer_value(v), key, strlen(key))) != TSR_OK)
                                return st;
        }
        if ((st = u64map_init(&L->t->merges, merges ? json_array_size(merges) : 0)) != TSR_OK)
                return st;
        for (i = 0; merges && i < json_array_size(merges); i++) {
                json_t *e = json_array_get(merges, i);
                if (json_is_string(e)) {
                        const char *s = json_string_value(e), *sp = strchr(s, ' ');
                        size_t n = json_string_length(e);
                        if (!sp || memchr(sp + 1, ' ', n - (size_t)(sp + 1 - s))) {
                                tsr_errf(L->err, L->errlen, "model.merges[%zu]: expected \"left right\"", i);
                                return TSR_E_INVAL;
                        }
                        st = put_merge(L, s, (size_t)(sp - s), sp + 1, n - (size_t)(sp + 1 - s), (uint32_t)i, false);
                } else if (json_is_array(e) && json_array_size(e) == 2 && json_is_string(json_array_get(e, 0)) &&
                           json_is_string(json_array_get(e, 1))) {
                        json_t *a = json_array_get(e, 0), *b = json_array_get(e, 1);
                        st = put_merge(L, json_string_value(a), json_string_length(a), json_string_value(b),
                                       json_string_length(b), (uint32_t)i, false);
                } else {
                        tsr_errf(L->err, L->errlen, "model.merges[%zu]: expected \"left right\" or [left, right]", i);
                        return TSR_E_INVAL;
                }
                if (st != TSR_OK)
                        return st;
        }
        L->t->byte_fallback = jbool(m, "byte_fallback", false);
        L->t->ignore_merges = jbool(m, "ignore_merges", false);
        L->t->fuse_unk = jbool(m, "fuse_unk", false);
        if ((unk = jstr(m, "unk_token")))
                L->t->unk_id = strmap_get(&L->t->vmap, L->t->vstr, L->t->vlen, unk, strlen(unk));
        return TSR_OK;
}

static tsr_status load_added(ld *L, json_t *arr) {
        size_t i;
        tsr_status st;

        if (!arr || json_is_null(arr))
                return TSR_OK;
        if (!json_is_array(arr)) {
                tsr_errf(L->err, L->errlen, "field 'added_tokens': expected an array");
                return TSR_E_INVAL;
        }
        for (i = 0; i < json_array_size(arr); i++) {
                json_t *a = json_array_get(arr, i), *id = json_object_get(a, "id"), *c = json_object_get(a, "content");
                if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= MAX_VOCAB ||
                    !json_is_string(c) || !json_string_length(c)) {
                        tsr_errf(L->err, L->errlen, "added_tokens[%zu]: expected a non-empty 'content' and an 'id' in [0, %u)",
                               i, MAX_VOCAB);
                        return TSR_E_INVAL;
                }
                if ((st = add_added(L, (uint32_t)json_integer_value(id), json_string_value(c), json_string_length(c),
                                    jbool(a, "special", false), jbool(a, "lstrip", false), jbool(a, "rstrip", false),
                                    jbool(a, "normalized", true), jbool(a, "single_word", false))) != TSR_OK)
                        return st;
        }
        return TSR_OK;
}

/* tokenizer_config.json: bos/eos as a string or {"content": ...}. */
static int64_t config_tok(const tsr_tokenizer *t, json_t *cfg, const char *k) {
        json_t *v = json_object_get(cfg, k);
        const char *s = json_is_string(v) ? json_string_value(v) : jstr(v, "content");

        return s ? tsr_tokenizer_token_id(t, s, strlen(s)) : -1;
}

tsr_status tsr_tokenizer_new_json(const uint8_t *json, size_t len, const uint8_t *config_json,
                                  size_t config_len, tsr_tokenizer **ret, char *err, size_t errlen) {
        json_error_t je;
        json_t *root = NULL, *cfg = NULL;
        ld L = {0};
        tsr_status st;

        if (!json || !ret) {
                tsr_errf(err, errlen, "no tokenizer.json given");
                return TSR_E_INVAL;
        }
        root = json_loadb((const char *)json, len, 0, &je);
        if (!json_is_object(root)) {
                tsr_errf(err, errlen, "tokenizer.json: %s (line %d)", root ? "expected an object" : je.text, je.line);
                json_decref(root);
                return TSR_E_INVAL;
        }
        if (config_json && config_len) {
                /* JSON_DECODE_INT_AS_REAL: transformers writes model_max_length = 1e30 as
                 * an integer when a model sets none, past what jansson reads as one;
                 * nothing read here is an integer. */
                cfg = json_loadb((const char *)config_json, config_len, JSON_DECODE_INT_AS_REAL, &je);
                if (!json_is_object(cfg)) {
                        tsr_errf(err, errlen, "tokenizer_config.json: %s (line %d)", cfg ? "expected an object" : je.text, je.line);
                        json_decref(root);
                        json_decref(cfg);
                        return TSR_E_INVAL;
                }
        }
        L.t = tok_alloc();
        L.err = err;
        L.errlen = errlen;
        if (!L.t) {
                st = TSR_E_NOMEM;
                goto out;
        }
        if ((st = load_model(&L, json_object_get(root, "model"))) != TSR_OK ||
            (st = load_added(&L, json_object_get(root, "added_tokens"))) != TSR_OK ||
            (st = load_normalizer(&L, json_object_get(root, "normalizer"), 0)) != TSR_OK ||
            (st = load_pretok(&L, json_object_get(root, "pre_tokenizer"), 0)) != TSR_OK ||
            (st = load_post(&L, json_object_get(root, "post_processor"), 0)) != TSR_OK ||
            (st = load_decoder(&L, json_object_get(root, "decoder"), 0)) != TSR_OK)
                goto out;
        if ((st = finish(&L)) != TSR_OK)
                goto out;
        if (cfg) {
                int64_t b = config_tok(L.t, cfg, "bos_token"), e = config_tok(L.t, cfg, "eos_token");
                if (b >= 0)
                        L.t->bos_id = b;
                if (e >= 0)
                        L.t->eos_id = e;
                /* add_bos/add_eos describe what encode does, which the post-processor
                 * decides, so the config's add_bos_token/add_eos_token are not read. */
        }
        *ret = L.t;
        L.t = NULL;
out:
        if (st == TSR_E_NOMEM)
                tsr_errf(err, errlen, "out of memory");
        tsr_tokenizer_free(&L.t);
        json_decref(root);
        json_decref(cfg);
        return st;
}

/* ---- GGUF */

typedef struct gmerge {
        double score;
        size_t llen, rlen;      /* in code points */
        size_t seq;
        uint32_t l, r;
} gmerge;

static int gmerge_cmp(const void *pa, const void *pb) {
        const gmerge *a = pa, *b = pb;

        if (a->score != b->score)
                return a->score > b->score ? -1 : 1;
        if (a->llen != b->llen)
                return a->llen > b->llen ? -1 : 1;
        if (a->rlen != b->rlen)
                return a->rlen > b->rlen ? -1 : 1;
        return a->seq < b->seq ? -1 : a->seq > b->seq;
}

static size_t cp_count(const char *s, size_t n) {
        size_t i, c = 0;

        for (i = 0; i < n; i++)
                c += ((uint8_t)s[i] & 0xC0) != 0x80;
        return c;
}

/* SentencePiece files carry scores, not merges.  Rebuild the merges the way transformers
 * does (generate_merges): every split of every token into two tokens, best score of the
 * merged token first, then longer left part, then longer right part, then token order and
 * (left id, right id) order.  Merging by these ranks is SentencePiece's "highest-scoring
 * adjacent pair first". */
static tsr_status gguf_gen_merges(ld *L, const tsr_tok_gguf *d) {
        tsr_tokenizer *t = L->t;
        gmerge *g = NULL;
        size_t n = 0, cap = 0, i, k, first;
        tsr_status st = TSR_OK;

        for (i = 0; i < t->n_vocab; i++) {
                const char *s = t->vstr[i];
                size_t len = t->vlen[i];
                if (!s || strmap_get(&t->vmap, t->vstr, t->vlen, s, len) != (int64_t)i)
                        continue;
                first = n;
                for (k = 1; k < len; k++) {
                        int64_t l, r;
                        if (((uint8_t)s[k] & 0xC0) == 0x80)
                                continue;
                        l = strmap_get(&t->vmap, t->vstr, t->vlen, s, k);
                        r = l >= 0 ? strmap_get(&t->vmap, t->vstr, t->vlen, s + k, len - k) : -1;
                        if (l < 0 || r < 0)
                                continue;
                        if (grow((void **)&g, &cap, n + 1, sizeof(gmerge)) != TSR_OK) {
                                free(g);
                                return TSR_E_NOMEM;
                        }
                        g[n].score = d->scores[i];
                        g[n].llen = cp_count(s, k);
                        g[n].rlen = cp_count(s + k, len - k);
                        g[n].l = (uint32_t)l;
                        g[n].r = (uint32_t)r;
                        n++;
                }
                /* within a token: by (left id, right id); insertion sort, the lists are short */
                for (k = first + 1; k < n; k++) {
                        gmerge x = g[k];
                        size_t j = k;
                        while (j > first && (g[j - 1].l > x.l || (g[j - 1].l == x.l && g[j - 1].r > x.r))) {
                                g[j] = g[j - 1];
                                j--;
                        }
                        g[j] = x;
                }
        }
        for (k = 0; k < n; k++)
                g[k].seq = k;
        if (n)
                qsort(g, n, sizeof(gmerge), gmerge_cmp);
        if (u64map_init(&t->merges, n) != TSR_OK) {
                free(g);
                return TSR_E_NOMEM;
        }
        for (k = 0; k < n && st == TSR_OK; k++)
                st = put_merge(L, t->vstr[g[k].l], t->vlen[g[k].l], t->vstr[g[k].r], t->vlen[g[k].r], (uint32_t)k, true);
        free(g);
        return st;
}

static tsr_status gguf_pre(ld *L, const char *pat, size_t plen) {
        tsr_tokenizer *t = L->t;
        pre_op *op = &t->pre[t->n_pre++];
        tsr_status st;

        memset(op, 0, sizeof(*op));
        if (pat) {
                op->kind = PRE_SPLIT;
                op->beh = BEH_ISOLATED;
                if ((st = compile_re(pat, plen, &op->re, L->err, L->errlen)) != TSR_OK)
                        return st;
                op = &t->pre[t->n_pre++];
                memset(op, 0, sizeof(*op));
                op->kind = PRE_BYTELEVEL;
        } else {
                op->kind = PRE_BYTELEVEL;
                if ((st = compile_re(GPT2_PATTERN, sizeof(GPT2_PATTERN) - 1, &op->re, L->err, L->errlen)) != TSR_OK)
                        return st;
        }
        t->byte_level = true;
        return TSR_OK;
}

static bool in_list(const char *s, const char *const *list) {
        for (; *list; list++)
                if (!strcmp(s, *list))
                        return true;
        return false;
}

tsr_status tsr_tokenizer_new_gguf(const tsr_tok_gguf *d, tsr_tokenizer **ret, char *err, size_t errlen) {
        static const char *const llama3[] = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                                             "midm-2.0", "lfm2", "dbrx", "smaug-bpe", NULL};
        static const char *const o200k[] = {"gpt-4o", "llama4", "kanana2", "minimax-m2", NULL};
        static const char *const tekken[] = {"tekken", NULL};
        /* Vocabularies whose original tokenizer.json sets ignore_merges (tiktoken semantics: a
         * pre-token that is itself in the vocab is one token).  transformers' GGUF converter
         * drops the flag, which changes ids on real text (Llama 3: "Cửa Việt" would be
         * 34 91163 11655 26298 83 instead of 34 91163 101798); llama.cpp and the HF-generated ids in
         * its models/ggml-vocab-llama-bpe.gguf.out keep it, and so does Tessera. */
        static const char *const whole_words[] = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                                  "pixtral", "midm-2.0", "lfm2", "tekken", "gpt-4o", "llama4",
                                                  NULL};
        ld L = {0};
        tsr_tokenizer *t;
        bool gpt2, byte_alpha[324] = {false};
        size_t i;
        tsr_status st;

        if (!d || !ret || !d->model || (!d->tokens && d->n_tokens)) {
                tsr_errf(err, errlen, "gguf tokenizer: no metadata");
                return TSR_E_INVAL;
        }
        gpt2 = !strcmp(d->model, "gpt2");
        if (!gpt2 && strcmp(d->model, "llama")) {
                tsr_errf(err, errlen, "gguf tokenizer: model '%s' is not supported (gpt2, llama)", d->model);
                return TSR_E_UNSUPPORTED;
        }
        if (d->n_tokens == 0 || d->n_tokens > MAX_VOCAB) {
                tsr_errf(err, errlen, "gguf tokenizer: %zu tokens", d->n_tokens);
                return TSR_E_INVAL;
        }
        if (!gpt2 && !d->scores) {
                tsr_errf(err, errlen, "gguf tokenizer: model 'llama' needs tokenizer.ggml.scores");
                return TSR_E_INVAL;
        }
        L.t = t = tok_alloc();
        L.err = err;
        L.errlen = errlen;
        if (!t || (st = set_vocab(&L, d->n_tokens)) != TSR_OK) {
                st = TSR_E_NOMEM;
                goto out;
        }
        for (i = 0; i < 256; i++)
                byte_alpha[byte_to_cp((unsigned)i)] = true;
        for (i = 0; i < d->n_tokens; i++) {
                const char *s = d->tokens[i];
                size_t n = s ? strlen(s) : 0, j, cl;
                bool respell = false;
                if (!s || !utf8_valid(s, n)) {
                        tsr_errf(err, errlen, "gguf tokenizer: token %zu is not valid UTF-8", i);
                        st = TSR_E_INVAL;
                        goto out;
                }
                /* transformers respells a byte-level token holding a char outside the byte
                 * alphabet through the byte mapping. */
                for (j = 0; gpt2 && j < n; j += cl) {
                        uint32_t cp;
                        cl = utf8_dec(s + j, &cp);
                        if (cp >= 324 || !byte_alpha[cp])
                                respell = true;
                }
                if (respell) {
                        sbuf b = {0};
                        for (j = 0; j < n; j++) {
                                char e[4];
                                if (sb_add(&b, e, utf8_enc(byte_to_cp((uint8_t)s[j]), e)) != TSR_OK) {
                                        free(b.p);
                                        st = TSR_E_NOMEM;
                                        goto out;
                                }
                        }
                        t->vstr[i] = b.p;
                        t->vlen[i] = (uint32_t)b.n;
                        t->vmap.slot[strmap_find(&t->vmap, t->vstr, t->vlen, b.p, b.n)] = (uint32_t)i + 1;
                } else if ((st = put_vocab(&L, (uint32_t)i, s, n)) != TSR_OK) {
                        goto out;
                }
        }
        if (gpt2) {
                if ((st = u64map_init(&t->merges, d->n_merges)) != TSR_OK)
                        goto out;
                for (i = 0; i < d->n_merges; i++) {
                        const char *m = d->merges ? d->merges[i] : NULL, *sp = m ? strchr(m, ' ') : NULL;
                        if (!sp) {
                                tsr_errf(err, errlen, "gguf tokenizer: merge %zu is not \"left right\"", i);
                                st = TSR_E_INVAL;
                                goto out;
                        }
                        if ((st = put_merge(&L, m, (size_t)(sp - m), sp + 1, strlen(sp + 1), (uint32_t)i, true)) != TSR_OK)
                                goto out;
                }
                if (d->pre && in_list(d->pre, llama3))
                        st = gguf_pre(&L, LLAMA3_PATTERN, sizeof(LLAMA3_PATTERN) - 1);
                else if (d->pre && in_list(d->pre, o200k))
                        st = gguf_pre(&L, O200K_PATTERN, sizeof(O200K_PATTERN) - 1);
                else if (d->pre && in_list(d->pre, tekken))
                        st = gguf_pre(&L, TEKKEN_PATTERN, sizeof(TEKKEN_PATTERN) - 1);
                else    /* "smollm", "gpt2" and unknown names: ByteLevel's own GPT-2 regex */
                        st = gguf_pre(&L, NULL, 0);
                if (st != TSR_OK)
                        goto out;
                t->ignore_merges = d->pre && in_list(d->pre, whole_words);
                t->dec[t->n_dec++].kind = DEC_BYTELEVEL;
        } else {
                pre_op *op = &t->pre[t->n_pre++];
                static const char *const names[] = {"\xE2\x96\x81", " "};
                if ((st = gguf_gen_merges(&L, d)) != TSR_OK)
                        goto out;
                t->byte_fallback = true;
                t->fuse_unk = true;
                memset(op, 0, sizeof(*op));
                op->kind = PRE_METASPACE;
                memcpy(op->repl, names[0], 3);
                op->repllen = 3;
                op->prepend = d->add_space_prefix ? 1 : 0;
                op->split = false;
                t->dec[0].kind = DEC_REPLACE;
                t->dec[0].a = xstrndup(names[0], 3);
                t->dec[0].alen = 3;
                t->dec[0].b = xstrndup(names[1], 1);
                t->dec[0].blen = 1;
                t->dec[1].kind = DEC_BYTEFALLBACK;
                t->dec[2].kind = DEC_FUSE;
                t->dec[3].kind = DEC_STRIP;
                t->dec[3].a = xstrndup(names[1], 1);
                t->dec[3].alen = 1;
                t->dec[3].start = 1;
                t->n_dec = 4;
                if (!t->dec[0].a || !t->dec[0].b || !t->dec[3].a) {
                        st = TSR_E_NOMEM;
                        goto out;
                }
        }
        /* Control tokens are special added tokens; user-defined ones plain added tokens.
         * A byte-level "control" token spelled outside the byte alphabet is a llama.cpp
         * mislabel that transformers skips. */
        for (i = 0; d->token_types && i < d->n_tokens; i++) {
                int32_t ty = d->token_types[i];
                if (ty != 3 && ty != 4)
                        continue;
                if (ty == 3 && gpt2 && strcmp(t->vstr[i], d->tokens[i]))
                        continue;
                if ((st = add_added(&L, (uint32_t)i, t->vstr[i], t->vlen[i], ty == 3, false, false, false, false)) != TSR_OK)
                        goto out;
        }
        /* transformers registers the unknown token as a special token too. */
        if (!gpt2 && d->unk_id >= 0 && (size_t)d->unk_id < d->n_tokens &&
            !(d->token_types && (d->token_types[d->unk_id] == 3 || d->token_types[d->unk_id] == 4)) &&
            (st = add_added(&L, (uint32_t)d->unk_id, t->vstr[d->unk_id], t->vlen[d->unk_id], true, false, false, false,
                            false)) != TSR_OK)
                goto out;
        if (d->bos_id >= 0 && (size_t)d->bos_id < d->n_tokens)
                t->bos_id = d->bos_id;
        if (d->eos_id >= 0 && (size_t)d->eos_id < d->n_tokens)
                t->eos_id = d->eos_id;
        if ((d->add_bos && t->bos_id >= 0) || (d->add_eos && t->eos_id >= 0)) {
                t->has_tmpl = true;
                if ((d->add_bos && t->bos_id >= 0 && tmpl_add(t, (uint32_t)t->bos_id) != TSR_OK) ||
                    tmpl_add(t, UINT32_MAX) != TSR_OK ||
                    (d->add_eos && t->eos_id >= 0 && tmpl_add(t, (uint32_t)t->eos_id) != TSR_OK)) {
                        st = TSR_E_NOMEM;
                        goto out;
                }
        }
        if ((st = finish(&L)) != TSR_OK)
                goto out;
        *ret = t;
        L.t = NULL;
out:
        if (st == TSR_E_NOMEM)
                tsr_errf(err, errlen, "out of memory");
        tsr_tokenizer_free(&L.t);
        return st;
}
