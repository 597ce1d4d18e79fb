/* llama4.c - Llama 4 text weights and forward (llama4.h; models.md §2.3).
 *
 * Everything runs on the caller's backend through kernels.h, except the small
 * family-specific arithmetic done on the host per row: the router's top-k and sigmoid
 * (on its logits), and the NoPE layers' temperature factor.  The rows an expert takes
 * are gathered and scaled by their scores, and its outputs added back to their rows, by
 * the backend's gather_rows / scatter_add_rows (the factor is applied by gather_rows in
 * place), so those arrays may live in a device's memory.  Each of those reads only its
 * own row, in a fixed order, so a row's result never depends on the other rows of the
 * batch (the experts' matmuls run on the rows routed to them, which kernels.h guarantees
 * is bitwise the same per row as running each alone).  Engine (or step) thread. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "worker/load/modelopt.h"
#include "worker/model/device_arrays.h"
#include "worker/model/family.h"
#include "worker/model/llama4.h"
#include "worker/model/tp.h"
#include "worker/parallel/comm.h"

/* A matmul weight: float32 as loaded, or its bf16 copy after tsr_llama4_use_bf16 (then
 * f is freed, except a tied output which is the embedding table), or, for a ModelOpt
 * checkpoint's quantized linear, q: the fp8_e4m3 / nvfp4 bytes as stored with their
 * scales (f and b NULL; --dtype bfloat16 leaves it as it is), or a BF16 checkpoint's
 * linear kept as stored (keep_bf16), q of dtype bf16.  The expert stacks (exp_gate_up,
 * exp_down) are f or b, never q: a BF16 stack kept as stored is transposed into b. */
typedef struct mat {
        float *f;
        uint16_t *b;
        tsr_tensor q;
} mat;

typedef struct layer {
        float *attn_norm, *ffn_norm;            /* (dim,) */
        mat q, k, v, o;
        mat gate, up, down;                     /* dense layers: (mlp, dim), (mlp, dim), (dim, mlp) */
        mat router;                             /* MoE layers: (E, dim) */
        mat exp_gate_up;                        /* (E, 2I, dim) (the file's (E, dim, 2I), transposed at load) */
        mat exp_down;                           /* (E, dim, I)  (the file's (E, I, dim)) */
        mat sh_gate, sh_up, sh_down;            /* shared expert: (I, dim), (I, dim), (dim, I) */
        /* MoE layers of a ModelOpt checkpoint that quantizes the experts: expert e's gate
         * (I, dim), up (I, dim) and down (dim, I) at [3e], [3e + 1], [3e + 2], as stored
         * (exp_gate_up and exp_down are then NULL); all zero otherwise. */
        tsr_tensor *qexp;
        /* load only: an FP8 BMM stack as the file has it ([E, dim, 2I], [E, I, dim]), and
         * the per-expert layout's widened matrices ([3E] as qexp); a GGUF's gate and up
         * stacks apart ([E, I, dim] each, merged into exp_gate_up) */
        tsr_tensor stack_gu, stack_dn;
        float **fexp;
        float *gguf_gate, *gguf_up;
} layer;

struct tsr_llama4 {
        tsr_llama4_config *cfg;                 /* owned copy */
        tsr_shard_spec shard;
        float *embed;                           /* (vocab_out, dim): a tensor-parallel rank's rows */
        /* A BF16 checkpoint's untied embedding kept as stored (keep_bf16; embed NULL): the
         * backend's gather widens the rows a step looks up, exactly, on the host or on a
         * device (which holds the bf16 bytes).  lm_head likewise stays in output.q. */
        tsr_tensor embd_q;
        float *out_norm;                        /* (dim,) */
        mat output;                             /* (vocab_out, dim); f == embed when tied */
        layer *layers;
        float *inv_freq;                        /* (head_dim/2,) */
        float *rope_freqs;                      /* (head_dim/2,) a GGUF's llama3 divisors; NULL: none */
        float *ones;                            /* (head_dim,): the qk L2 norm is rmsnorm with unit weight */
        bool bf16;
        /* Tensor parallelism (tsr_llama4_shard_tp; issue #20): this rank's attention heads,
         * KV heads, expert and shared-expert columns (of I), dense MLP columns and lm_head
         * rows; the whole model's counts when tp_size is 1.  With `canonical`, every
         * row-parallel matrix (o, down, each expert's down, the shared expert's down)
         * holds the rank's S / tp_size canonical K slices (tp.h), so the forward's sums
         * are the same bits at every tp_size. */
        uint32_t tp_size, nh, nkv, hid, mlp, vocab_out;
        bool canonical;
        /* Expert parallelism (tsr_llama4_shard_ep): this rank holds routed experts
         * [e0, e0 + ne) whole, ehid columns each (the whole intermediate_size; hid, the
         * rank's share of every expert, without it), their down_proj as the
         * TSR_COMM_TREE_LEAVES canonical K slices. */
        bool ep;
        uint32_t tp_rank, e0, ne, ehid;
        tsr_comm *comm;                         /* the rank's TP group; NULL when tp_size 1 */
        /* The backend whose memory holds the weights the forward reads, after
         * tsr_llama4_to_backend (every weight pointer is then its memory, rope_freqs
         * excepted); NULL: the host's. */
        tsr_backend *dev;
        /* On the device: the step's activation arrays, kept between steps and grown on
         * demand (scratch_alloc), sized up front by tsr_llama4_reserve so that the KV
         * cache sized after it never leaves a step short.  Engine thread: the forward
         * is the only writer, as Llama's (a model runs one forward at a time). */
        struct kept_acts *acts;
        /* ModelOpt: the dtype the quantized weights are stored in (fp8_e4m3 or nvfp4);
         * TSR_DTYPE_F32 when nothing is */
        tsr_dtype qdtype;
        /* Some matmul weight is a BF16 checkpoint's kept as stored (tsr_load_opts.keep_bf16):
         * the backend needs the bf16 matmul even before tsr_llama4_use_bf16. */
        bool kept_bf16;
        /* The per-expert layout (experts.<e>.{gate,up,down}_proj) instead of the BMM
         * stacks: its 3 E loader rows (gate, up, down per expert; hf names in strs). */
        bool per_expert;
        tsr_tensor_name *expert_names;
        char *expert_strs;
};

struct tsr_llama4_kv {
        size_t n_layers, n_kv_heads, head_dim, block_size, n_blocks;
        float **k, **v;                         /* [n_layers], borrowed from the pool (fp8: bytes) */
        tsr_dtype dtype;                        /* the pool's: float32, or fp8_e4m3 (--kv-cache-dtype fp8) */
        float *k_scale, *v_scale;               /* [n_layers]: the pool's per-layer scales (fp8) */
        uint32_t *table;                        /* [n_layers] which of a sequence's tables layer l uses */
        size_t n_tables;
        uint32_t chunk[TSR_KV_GROUPS_MAX];      /* per table: 0 full attention, else its chunk */
};

#define N_MATS 13

/* The layer's matmul weights with their (rows, cols) per expert and expert count, as the
 * model holds them (a tensor-parallel rank: its share). */
static void layer_mats(const tsr_llama4 *m, layer *L, mat **w, size_t *rows, size_t *cols, size_t *n) {
        const tsr_llama4_config *c = m->cfg;
        size_t dim = c->base.dim, qd = (size_t)m->nh * c->base.head_dim;
        size_t kvd = (size_t)m->nkv * c->base.head_dim, I = m->hid, M = m->mlp;
        size_t E = m->ne, EI = m->ehid;         /* the routed experts as held */
        mat *ww[N_MATS] = {&L->q, &L->k, &L->v, &L->o, &L->gate, &L->up, &L->down, &L->router, &L->exp_gate_up,
                           &L->exp_down, &L->sh_gate, &L->sh_up, &L->sh_down};
        size_t r[N_MATS] = {qd, kvd, kvd, dim, M, M, dim, c->n_experts, 2 * EI, dim, I, I, dim};
        size_t cc[N_MATS] = {dim, dim, dim, qd, dim, dim, M, dim, dim, EI, dim, dim, I};
        size_t nn[N_MATS] = {1, 1, 1, 1, 1, 1, 1, 1, E, E, 1, 1, 1};
        memcpy(w, ww, sizeof ww);
        memcpy(rows, r, sizeof r);
        memcpy(cols, cc, sizeof cc);
        memcpy(n, nn, sizeof nn);
}

#define N_ACTS 17       /* struct scratch's activation arrays (SCRATCH_ACTS) */

struct kept_acts {
        float *p[N_ACTS];
        size_t bytes[N_ACTS];
};

/* Free weight memory: the device's after tsr_llama4_to_backend, else the host's. */
static void release(const tsr_llama4 *m, void *p) {
        if (m->dev)
                tsr_backend_mem_free(m->dev, p);
        else
                free(p);
}

static void mat_free(const tsr_llama4 *m, mat *w) {
        release(m, w->f);
        release(m, w->b);
        release(m, w->q.data);
        *w = (mat){0};
}

/* A MoE layer's expert state beyond exp_gate_up / exp_down (qexp, the load-only stacks
 * and per-expert matrices). */
static void experts_free(const tsr_llama4 *m, layer *L, size_t E) {
        for (size_t i = 0; L->qexp && i < 3 * E; i++)
                release(m, L->qexp[i].data);
        for (size_t i = 0; L->fexp && i < 3 * E; i++)
                free(L->fexp[i]);
        free(L->qexp);
        free(L->fexp);
        free(L->stack_gu.data);
        free(L->stack_dn.data);
        free(L->gguf_gate);
        free(L->gguf_up);
        L->gguf_gate = L->gguf_up = NULL;
        L->qexp = NULL;
        L->fexp = NULL;
        L->stack_gu = L->stack_dn = (tsr_tensor){0};
}

void tsr_llama4_free(tsr_llama4 **mp) {
        tsr_llama4 *m;
        if (!mp || !*mp)
                return;
        m = *mp;
        if (m->layers) {
                for (size_t l = 0; l <= m->shard.last_layer - m->shard.first_layer; l++) {
                        layer *L = &m->layers[l];
                        mat *w[N_MATS];
                        size_t r[N_MATS], c[N_MATS], n[N_MATS];
                        layer_mats(m, L, w, r, c, n);
                        for (int i = 0; i < N_MATS; i++)
                                mat_free(m, w[i]);
                        experts_free(m, L, m->cfg->n_experts);
                        release(m, L->attn_norm);
                        release(m, L->ffn_norm);
                }
                free(m->layers);
        }
        if (m->output.f == m->embed)
                m->output.f = NULL;
        mat_free(m, &m->output);
        for (size_t i = 0; m->acts && i < N_ACTS; i++)
                tsr_backend_mem_free(m->dev, m->acts->p[i]);
        free(m->acts);
        release(m, m->embed);
        release(m, m->embd_q.data);
        release(m, m->out_norm);
        release(m, m->inv_freq);
        release(m, m->ones);
        free(m->rope_freqs);
        free(m->cfg);
        free(m->expert_names);
        free(m->expert_strs);
        free(m);
        *mp = NULL;
}

const tsr_llama4_config *tsr_llama4_config_of(const tsr_llama4 *m) { return m ? m->cfg : NULL; }

/* ---- load ------------------------------------------------------------------------------ */

static tsr_status tp_check(const tsr_llama4_config *c, uint32_t t, char *err, size_t errlen);
static tsr_status shard(tsr_llama4 *m, uint32_t tp_rank, uint32_t tp_size, bool ep, char *err, size_t errlen);

/* A tensor-parallel rank's share of logical tensor `name` (m->shard.tp_size > 1: the
 * rank reads only it from the file; issue #20): what shard() keeps of a whole model --
 * the attention's heads, the dense MLP's, the shared expert's and every expert's
 * intermediate columns (the BMM stacks [E, in, out] by their gate and up column halves
 * and down's rows), the embedding's and lm_head's vocabulary rows; TSR_LOAD_WHOLE for
 * what every rank holds whole (norms, router) and at tp 1. */
static tsr_load_slice l4_slice(const tsr_llama4 *m, const char *name) {
        const tsr_llama4_config *c = m->cfg;
        uint32_t t = m->shard.tp_size, rk = m->shard.tp_rank;
        if (t <= 1)
                return (tsr_load_slice){0};
        uint64_t hd = c->base.head_dim, KVH = c->base.n_kv_heads, I = c->base.hidden_dim;
        uint64_t qr = c->base.n_heads / t * hd, nkv = t <= KVH ? KVH / t : 1;
        uint64_t kv0 = t <= KVH ? rk * nkv : rk / (t / KVH);
        uint64_t hid = I / t, mlp = c->mlp_dim / t;
        tsr_tp_vocab v = tsr_tp_vocab_of(c->base.vocab_size, rk, t);
        const tsr_tp_slice_rule rule[] = {
                {"attn_q", {TSR_LOAD_SLICE_ROWS, 1, {{rk * qr, qr}}}},
                {"attn_k", {TSR_LOAD_SLICE_ROWS, 1, {{kv0 * hd, nkv * hd}}}},
                {"attn_v", {TSR_LOAD_SLICE_ROWS, 1, {{kv0 * hd, nkv * hd}}}},
                {"attn_output", {TSR_LOAD_SLICE_COLS, 1, {{rk * qr, qr}}}},
                {"ffn_gate", {TSR_LOAD_SLICE_ROWS, 1, {{rk * mlp, mlp}}}},
                {"ffn_up", {TSR_LOAD_SLICE_ROWS, 1, {{rk * mlp, mlp}}}},
                {"ffn_down", {TSR_LOAD_SLICE_COLS, 1, {{rk * mlp, mlp}}}},
                /* [E, dim, 2I]: the rank's gate columns, then its up columns */
                {"ffn_gate_up_exps", {TSR_LOAD_SLICE_COLS, 2, {{rk * hid, hid}, {I + rk * hid, hid}}}},
                {"ffn_down_exps", {c->gguf ? TSR_LOAD_SLICE_COLS : TSR_LOAD_SLICE_ROWS, 1,  /* HF [E, I, dim], */
                                   {{rk * hid, hid}}}},                                 /* GGUF [E, dim, I] */
                {"ffn_gate_exps", {TSR_LOAD_SLICE_ROWS, 1, {{rk * hid, hid}}}},        /* GGUF [E, I, dim] */
                {"ffn_up_exps", {TSR_LOAD_SLICE_ROWS, 1, {{rk * hid, hid}}}},
                {"ffn_gate_shexp", {TSR_LOAD_SLICE_ROWS, 1, {{rk * hid, hid}}}},
                {"ffn_up_shexp", {TSR_LOAD_SLICE_ROWS, 1, {{rk * hid, hid}}}},
                {"ffn_down_shexp", {TSR_LOAD_SLICE_COLS, 1, {{rk * hid, hid}}}},
                {"output", {TSR_LOAD_SLICE_ROWS, 1, {{v.first, v.n}}}},
                {"token_embd", {TSR_LOAD_SLICE_ROWS, 1, {{v.first, v.n}}}},    /* tsr_tp_embed */
                /* the per-expert layout's matrices */
                {"ffn_gate_exp", {TSR_LOAD_SLICE_ROWS, 1, {{rk * hid, hid}}}},
                {"ffn_up_exp", {TSR_LOAD_SLICE_ROWS, 1, {{rk * hid, hid}}}},
                {"ffn_down_exp", {TSR_LOAD_SLICE_COLS, 1, {{rk * hid, hid}}}},
        };
        return tsr_tp_slice_of(rule, sizeof rule / sizeof rule[0], name);
}

/* Where the family's logical tensor `n` of `layer` goes (llama4_family.c's table).  A
 * dense layer has no router or experts, a MoE layer no dense MLP; a tied model no output
 * matrix.  Experts are 3-D stacks in transformers' BMM layout [E, in, out]. */
static bool llama4_bind(void *model, const tsr_tensor_name *n, uint32_t l, tsr_load_slot *ret) {
        tsr_llama4 *m = model;
        const tsr_llama4_config *c = m->cfg;
        layer *L = n->per_layer ? &m->layers[l - m->shard.first_layer] : NULL;
        bool moe = L && (c->layer[l] & TSR_LLAMA4_MOE);
        uint64_t dim = c->base.dim, qd = (uint64_t)c->base.n_heads * c->base.head_dim;
        uint64_t kvd = (uint64_t)c->base.n_kv_heads * c->base.head_dim, I = c->base.hidden_dim, M = c->mlp_dim;
        uint64_t E = c->n_experts;
        /* A pipeline stage holds the embedding only on the first stage, the final norm and
         * lm_head only on the last (a tied lm_head is the embedding: the last reads it too),
         * as the Llama family's stages do. */
        bool first = m->shard.first_layer == 0, last = m->shard.last_layer + 1 == c->base.n_layers;
        /* an expert-parallel rank's routed experts (tsr_tp_expert_range; checked at load) */
        size_t e0 = 0, ne = E;
        bool ep = m->shard.expert_parallel && m->shard.tp_size > 1 &&
                  tsr_tp_expert_range(E, m->shard.tp_rank, m->shard.tp_size, &e0, &ne, NULL, 0) == TSR_OK;
        /* `mat`: a linear a ModelOpt checkpoint may store quantized (its .q) */
        struct { const char *name; float **dst; uint64_t rows, cols, experts; mat *mat; } s[] = {
                {"token_embd", first || (last && c->base.tied_embeddings) ? &m->embed : NULL, c->base.vocab_size, dim,
                 0},
                {"output_norm", last ? &m->out_norm : NULL, dim, 0, 0},
                /* a BF16 lm_head kept as stored under keep_bf16 (output.q; a GGUF's widened) */
                {"output", c->base.tied_embeddings || !last ? NULL : &m->output.f, c->base.vocab_size, dim, 0,
                 c->gguf ? NULL : &m->output},
                {"attn_norm", L ? &L->attn_norm : NULL, dim, 0, 0},
                {"attn_q", L ? &L->q.f : NULL, qd, dim, 0, L ? &L->q : NULL},
                {"attn_k", L ? &L->k.f : NULL, kvd, dim, 0, L ? &L->k : NULL},
                {"attn_v", L ? &L->v.f : NULL, kvd, dim, 0, L ? &L->v : NULL},
                {"attn_output", L ? &L->o.f : NULL, dim, qd, 0, L ? &L->o : NULL},
                {"ffn_norm", L ? &L->ffn_norm : NULL, dim, 0, 0},
                {"ffn_gate", L && !moe ? &L->gate.f : NULL, M, dim, 0, L ? &L->gate : NULL},
                {"ffn_up", L && !moe ? &L->up.f : NULL, M, dim, 0, L ? &L->up : NULL},
                {"ffn_down", L && !moe ? &L->down.f : NULL, dim, M, 0, L ? &L->down : NULL},
                {"ffn_gate_inp", moe ? &L->router.f : NULL, E, dim, 0},
                {"ffn_gate_up_exps", moe && !m->per_expert ? &L->exp_gate_up.f : NULL, dim, 2 * I, E},
                {"ffn_gate_exps", moe ? &L->gguf_gate : NULL, I, dim, E},   /* GGUF: (out, in) per expert */
                {"ffn_up_exps", moe ? &L->gguf_up : NULL, I, dim, E},
                {"ffn_down_exps", moe && !m->per_expert ? &L->exp_down.f : NULL, c->gguf ? dim : I, c->gguf ? I : dim,
                 E},
                {"rope_freqs", &m->rope_freqs, c->base.head_dim / 2, 0, 0},        /* GGUF only, optional */
                {"ffn_gate_shexp", moe ? &L->sh_gate.f : NULL, I, dim, 0, L ? &L->sh_gate : NULL},
                {"ffn_up_shexp", moe ? &L->sh_up.f : NULL, I, dim, 0, L ? &L->sh_up : NULL},
                {"ffn_down_shexp", moe ? &L->sh_down.f : NULL, dim, I, 0, L ? &L->sh_down : NULL},
        };

        if (m->expert_names && n >= m->expert_names && n < m->expert_names + 3 * E) {
                size_t i = (size_t)(n - m->expert_names);       /* expert i / 3's gate, up, down */
                if (!moe)
                        return false;
                if (ep && (i / 3 < e0 || i / 3 >= e0 + ne))
                        return false;   /* an expert-parallel rank reads its experts, no other's */
                tsr_load_slice sl = ep ? (tsr_load_slice){0} : l4_slice(m, n->logical);
                /* a ModelOpt weight is kept as stored, whole or its share (loader.h) */
                *ret = (tsr_load_slot){.dst = &L->fexp[i], .stored = &L->qexp[i],
                                       .rows = i % 3 == 2 ? dim : I, .cols = i % 3 == 2 ? I : dim, .slice = sl};
                return true;
        }
        for (size_t i = 0; i < sizeof s / sizeof s[0]; i++)
                if (strcmp(s[i].name, n->logical) == 0 && s[i].dst) {
                        /* the expert stacks of an expert-parallel rank: its experts whole */
                        bool ep_stack = ep && s[i].experts;
                        tsr_load_slice sl = ep_stack ? (tsr_load_slice){0} : l4_slice(m, n->logical);
                        tsr_tensor *stored = s[i].mat ? &s[i].mat->q : NULL;
                        /* an untied embedding may be kept as stored (a tied one: lm_head
                         * reads the float32 table) */
                        if (s[i].dst == &m->embed && !c->base.tied_embeddings && !c->gguf)
                                stored = &m->embd_q;
                        if (s[i].experts)       /* an FP8 BMM stack is kept as stored, then split per expert */
                                stored = c->gguf ? NULL : s[i].dst == &L->exp_gate_up.f ? &L->stack_gu : &L->stack_dn;
                        /* a tensor-parallel rank reads a float stack's share; an FP8 stack is
                         * read whole and cut at once to the share of each expert, or to an
                         * expert-parallel rank's experts (loader.h), which split_stacks
                         * splits per expert */
                        *ret = (tsr_load_slot){.dst = s[i].dst, .stored = stored,
                                               .rows = s[i].rows, .cols = s[i].cols, .experts = s[i].experts,
                                               .slice = sl, .experts_first = ep_stack ? e0 : 0,
                                               .experts_n = ep_stack ? ne : 0,
                                               .optional = s[i].dst == &m->rope_freqs};
                        return true;
                }
        return false;
}

/* Each expert's (rows, cols) matrix of `w` (E of them) transposed in place to (cols, rows):
 * the file's [E, in, out] becomes the (out, in) row-major the matmul reads. */
static bool transpose_experts(float *w, size_t E, size_t rows, size_t cols) {
        float *tmp = malloc(rows * cols * sizeof(float));
        if (!tmp)
                return false;
        for (size_t e = 0; e < E; e++) {
                float *a = w + e * rows * cols;
                for (size_t r = 0; r < rows; r++)
                        for (size_t c = 0; c < cols; c++)
                                tmp[c * rows + r] = a[r * cols + c];
                memcpy(a, tmp, rows * cols * sizeof(float));
        }
        free(tmp);
        return true;
}

/* A BF16 expert stack kept as stored ([E, rows, cols]: the file's (in, out) per expert,
 * the rank's experts and share) -> *dst (E, cols, rows) bf16, the (out, in) rows the
 * matmul reads: transpose_experts' layout, and the bits tsr_llama4_use_bf16 gives the
 * stack widened.  The stack is freed.  TSR_E_NOMEM (nothing changed). */
static tsr_status transpose_bf16_stack(uint16_t **dst, tsr_tensor *stack) {
        size_t E = stack->shape[0], rows = stack->shape[1], cols = stack->shape[2], n = E * rows * cols;
        const uint16_t *a = stack->data;
        uint16_t *b = aligned_alloc(64, (n * sizeof(uint16_t) + 63) / 64 * 64 + 64);
        if (!b)
                return TSR_E_NOMEM;
        for (size_t e = 0; e < E; e++)
                for (size_t r = 0; r < rows; r++)
                        for (size_t c = 0; c < cols; c++)
                                b[(e * cols + c) * rows + r] = a[(e * rows + r) * cols + c];
        free(stack->data);
        *stack = (tsr_tensor){0};
        *dst = b;
        return TSR_OK;
}

/* The per-expert layout's BF16 matrices kept as stored (keep_bf16) of the E experts held,
 * qexp[3e ..]: all of them -> the stacks exp_gate_up (E, 2I, dim) and exp_down (E, dim,
 * I) as bf16 bytes; some (the others float32, fexp) -> widened into fexp, so the layer
 * stacks float32 as before.  Each kept matrix is freed.  TSR_E_NOMEM. */
static tsr_status per_expert_bf16(layer *L, tsr_tensor *qexp, float **fexp, size_t E, size_t I, size_t dim) {
        size_t nb = 0, per = I * dim;
        for (size_t i = 0; i < 3 * E; i++)
                nb += qexp[i].data && qexp[i].dtype == TSR_DTYPE_BF16;
        if (!nb)
                return TSR_OK;
        if (nb == 3 * E) {
                if (!(L->exp_gate_up.b = aligned_alloc(64, (E * 2 * per * sizeof(uint16_t) + 63) / 64 * 64 + 64)) ||
                    !(L->exp_down.b = aligned_alloc(64, (E * per * sizeof(uint16_t) + 63) / 64 * 64 + 64)))
                        return TSR_E_NOMEM;
                for (size_t e = 0; e < E; e++) {
                        memcpy(L->exp_gate_up.b + e * 2 * per, qexp[3 * e].data, per * sizeof(uint16_t));
                        memcpy(L->exp_gate_up.b + (e * 2 + 1) * per, qexp[3 * e + 1].data, per * sizeof(uint16_t));
                        memcpy(L->exp_down.b + e * per, qexp[3 * e + 2].data, per * sizeof(uint16_t));
                }
        }
        for (size_t i = 0; i < 3 * E; i++) {
                if (!qexp[i].data || qexp[i].dtype != TSR_DTYPE_BF16)
                        continue;
                if (nb < 3 * E) {
                        const uint16_t *h = qexp[i].data;
                        if (!(fexp[i] = malloc(per * sizeof(float))))
                                return TSR_E_NOMEM;
                        for (size_t k = 0; k < per; k++)
                                fexp[i][k] = tsr_bf16_to_f32(h[k]);
                }
                free(qexp[i].data);
                qexp[i] = (tsr_tensor){0};
        }
        return TSR_OK;
}

/* The per-expert loader rows: for expert e, "...experts.<e>.{gate,up,down}_proj.weight",
 * each with the layer's "%u" left for the loader. */
static tsr_status expert_table(tsr_llama4 *m) {
        static const char *const logical[3] = {"ffn_gate_exp", "ffn_up_exp", "ffn_down_exp"};
        static const char *const proj[3] = {"gate", "up", "down"};
        size_t E = m->cfg->n_experts, stride = 96;
        char *p;

        if (!(m->expert_names = calloc(3 * E, sizeof *m->expert_names)) || !(m->expert_strs = malloc(3 * E * stride)))
                return TSR_E_NOMEM;
        p = m->expert_strs;
        for (size_t i = 0; i < 3 * E; i++, p += stride) {
                snprintf(p, stride, "model.layers.%%u.feed_forward.experts.%zu.%s_proj.weight", i / 3, proj[i % 3]);
                m->expert_names[i] = (tsr_tensor_name){.logical = logical[i % 3], .hf = p, .per_layer = true,
                                                       .shard = TSR_SHARD_EXPERT};
        }
        return TSR_OK;
}

/* tensor (rows, cols) of `dtype` in new 64-byte aligned memory, scales `sc`; NULL data
 * on failure (nothing else set). */
static tsr_status tensor_new(tsr_tensor *t, tsr_dtype dtype, size_t rows, size_t cols, tsr_matmul_scales sc) {
        size_t shape[2] = {rows, cols};
        tsr_status st = tsr_tensor_init(t, dtype, 2, shape, NULL, NULL);
        if (st != TSR_OK)
                return st;
        size_t bytes = tsr_tensor_n_bytes(t);
        if (!(t->data = aligned_alloc(64, (bytes + 63) / 64 * 64)))
                return TSR_E_NOMEM;
        t->scales = sc;
        return TSR_OK;
}

/* An FP8 BMM stack pair (ModelOpt's Llama 4 FP8: gate_up [E, dim, 2I], down [E, I, dim],
 * fp8 bytes; a tensor-parallel rank's I columns already, or an expert-parallel rank's E
 * experts: the loader cut them) -> each expert's gate and up (I, dim) and down (dim, I)
 * at qexp[3e ..] (the rank's first expert's entry), the (out, in) rows the matmul reads:
 * a transposition of bytes, the values and the stack's one scale pair unchanged. */
static tsr_status split_stacks(layer *L, tsr_tensor *qexp, size_t E, size_t I, size_t dim) {
        const uint8_t *gu = L->stack_gu.data, *dn = L->stack_dn.data;
        tsr_status st;

        for (size_t e = 0; e < E; e++) {
                tsr_tensor *g = &qexp[3 * e], *u = g + 1, *d = g + 2;
                if ((st = tensor_new(g, TSR_DTYPE_FP8_E4M3, I, dim, L->stack_gu.scales)) != TSR_OK ||
                    (st = tensor_new(u, TSR_DTYPE_FP8_E4M3, I, dim, L->stack_gu.scales)) != TSR_OK ||
                    (st = tensor_new(d, TSR_DTYPE_FP8_E4M3, dim, I, L->stack_dn.scales)) != TSR_OK)
                        return st;
                uint8_t *gb = g->data, *ub = u->data, *db = d->data;
                for (size_t r = 0; r < dim; r++)
                        for (size_t i = 0; i < I; i++) {
                                gb[i * dim + r] = gu[(e * dim + r) * 2 * I + i];
                                ub[i * dim + r] = gu[(e * dim + r) * 2 * I + I + i];
                        }
                for (size_t i = 0; i < I; i++)
                        for (size_t o = 0; o < dim; o++)
                                db[o * I + i] = dn[(e * I + i) * dim + o];
        }
        free(L->stack_gu.data);
        free(L->stack_dn.data);
        L->stack_gu = L->stack_dn = (tsr_tensor){0};
        return TSR_OK;
}

/* An expert-parallel rank of an NVFP4 checkpoint: the max input_scale over EVERY routed
 * expert of layer l, as the file holds them (the rank read only its own experts'
 * tensors), gate and up into *gu, down into *down.  vLLM's global-scale NVFP4 MoE
 * backends (FlashInfer's) keep every expert's input scale on every rank, so a rank
 * quantizes its experts' inputs as -tp without expert parallelism does.  TSR_E_INVAL
 * naming the file and the tensor when one is missing or bad. */
static tsr_status all_input_scales(const tsr_safetensors_set *set, const char *pre, uint32_t l, size_t n_experts,
                                   float *gu, float *down, char *err, size_t errlen) {
        static const char *const proj[3] = {"gate", "up", "down"};
        *gu = *down = 0.0f;
        for (size_t i = 0; i < 3 * n_experts; i++) {
                char module[192];
                float v;
                snprintf(module, sizeof module, "%smodel.layers.%u.feed_forward.experts.%zu.%s_proj", pre, l, i / 3,
                         proj[i % 3]);
                tsr_status st = tsr_modelopt_input_scale(set, module, &v, err, errlen);
                if (st != TSR_OK)
                        return st;
                float *xs = i % 3 == 2 ? down : gu;
                *xs = fmaxf(*xs, v);
        }
        return TSR_OK;
}

/* MoE layer l's experts after the tensors (its layer struct L): the FP8 stacks split per
 * expert, the per-expert layout's float matrices stacked into exp_gate_up / exp_down (the
 * BMM layout's, transposed), or the BMM float stacks transposed; for quantized experts
 * the GEMMs' shared activation scales (tsr_llama4_load; an NVFP4 expert-parallel rank
 * reads the other experts' from `set`).  TSR_E_INVAL (a layer that mixes quantized and
 * float experts, or an input scale missing; err names the tensor), TSR_E_NOMEM. */
static tsr_status experts_finish(tsr_llama4 *m, layer *L, uint32_t l, const tsr_safetensors_set *set,
                                 const char *pre, const char *dir, char *err, size_t errlen) {
        /* a tensor-parallel rank read its hidden_dim / tp columns of each expert (l4_slice),
         * an expert-parallel one its experts e0 .. e0 + E - 1 whole (llama4_bind) */
        size_t En = m->cfg->n_experts, E = En, I = m->cfg->base.hidden_dim, dim = m->cfg->base.dim, nq = 0, e0 = 0;
        static const char *const proj[3] = {"gate", "up", "down"};
        tsr_status st = TSR_OK;

        if (m->shard.tp_size > 1 && m->shard.expert_parallel) {
                if ((st = tsr_tp_expert_range(En, m->shard.tp_rank, m->shard.tp_size, &e0, &E, err, errlen)) != TSR_OK)
                        return st;
        } else {
                I /= m->shard.tp_size;
        }
        /* the per-expert layout's matrices of the experts held: global expert e0 + j at j */
        tsr_tensor *qexp = L->qexp + 3 * e0;
        float **fexp = L->fexp ? L->fexp + 3 * e0 : NULL;

        if (m->cfg->gguf) {     /* gate and up apart, each expert's (I, dim) as the matmul reads it */
                if (!(L->exp_gate_up.f = malloc(E * 2 * I * dim * sizeof(float))))
                        st = TSR_E_NOMEM;
                for (size_t e = 0; st == TSR_OK && e < E; e++) {
                        memcpy(L->exp_gate_up.f + e * 2 * I * dim, L->gguf_gate + e * I * dim, I * dim * sizeof(float));
                        memcpy(L->exp_gate_up.f + (e * 2 + 1) * I * dim, L->gguf_up + e * I * dim,
                               I * dim * sizeof(float));
                }
                free(L->gguf_gate);
                free(L->gguf_up);
                L->gguf_gate = L->gguf_up = NULL;
        } else if (!m->per_expert) {
                /* a stack kept as stored: FP8 (ModelOpt) or BF16 (keep_bf16), each already the
                 * rank's share (llama4_bind) */
                bool fp8_gu = L->stack_gu.data && L->stack_gu.dtype != TSR_DTYPE_BF16;
                bool fp8_dn = L->stack_dn.data && L->stack_dn.dtype != TSR_DTYPE_BF16;
                if (fp8_gu != fp8_dn) {
                        tsr_errf(err, errlen, "%s: tensor '%smodel.layers.%u.feed_forward.experts.%s' is F8_E4M3 but "
                                 "experts.%s is not: a MoE layer's expert stacks must be quantized both or neither",
                                 dir, pre, l, fp8_gu ? "gate_up_proj" : "down_proj",
                                 fp8_gu ? "down_proj" : "gate_up_proj");
                        return TSR_E_INVAL;
                }
                if (fp8_gu)
                        st = split_stacks(L, qexp, E, I, dim);
                else if (L->stack_gu.data ? transpose_bf16_stack(&L->exp_gate_up.b, &L->stack_gu) != TSR_OK
                                          : !transpose_experts(L->exp_gate_up.f, E, dim, 2 * I))
                        st = TSR_E_NOMEM;
                else if (L->stack_dn.data ? transpose_bf16_stack(&L->exp_down.b, &L->stack_dn) != TSR_OK
                                          : !transpose_experts(L->exp_down.f, E, I, dim))
                        st = TSR_E_NOMEM;
        } else if ((st = per_expert_bf16(L, qexp, fexp, E, I, dim)) == TSR_OK) {
                for (size_t i = 0; i < 3 * E; i++)
                        nq += qexp[i].data != NULL;
                for (size_t i = 1; nq && nq < 3 * E && i < 3 * E; i++)
                        if (!qexp[i].data != !qexp[0].data) {
                                tsr_errf(err, errlen, "%s: tensor '%smodel.layers.%u.feed_forward.experts.%zu.%s_proj."
                                         "weight' is %s but expert %zu's gate_proj is %s: a MoE layer's experts must "
                                         "be quantized all or none (vLLM fuses them into one weight)", dir, pre, l,
                                         e0 + i / 3, proj[i % 3],
                                         qexp[i].data ? tsr_dtype_name(qexp[i].dtype) : "not quantized", e0,
                                         qexp[0].data ? tsr_dtype_name(qexp[0].dtype) : "not quantized");
                                return TSR_E_INVAL;
                        }
                if (!nq && !L->exp_gate_up.b) { /* float experts, one matrix each: stacked as the BMM layout's */
                        if (!(L->exp_gate_up.f = malloc(E * 2 * I * dim * sizeof(float))) ||
                            !(L->exp_down.f = malloc(E * dim * I * sizeof(float))))
                                st = TSR_E_NOMEM;
                        for (size_t e = 0; st == TSR_OK && e < E; e++) {
                                memcpy(L->exp_gate_up.f + e * 2 * I * dim, fexp[3 * e], I * dim * sizeof(float));
                                memcpy(L->exp_gate_up.f + (e * 2 + 1) * I * dim, fexp[3 * e + 1],
                                       I * dim * sizeof(float));
                                memcpy(L->exp_down.f + e * dim * I, fexp[3 * e + 2], dim * I * sizeof(float));
                        }
                }
                for (size_t i = 0; i < 3 * En; i++) {
                        free(L->fexp[i]);
                        L->fexp[i] = NULL;
                }
        }
        if (st != TSR_OK) {
                tsr_errf(err, errlen, "%s: out of memory", dir);
                return st;
        }
        if (!qexp[0].data)
                return TSR_OK;
        /* one activation scale per expert GEMM (vLLM's fused MoE: "use the max"), over
         * the experts the rank holds: an expert-parallel rank's own with FP8 (vLLM's
         * FusedMoE registers only the local experts' input_scale; nemotron_h.c's
         * expert_scales), every expert's with NVFP4 (all_input_scales) */
        float xs_gu = 0, xs_d = 0;
        for (size_t e = 0; e < E; e++) {
                xs_gu = fmaxf(xs_gu, fmaxf(qexp[3 * e].scales.input, qexp[3 * e + 1].scales.input));
                xs_d = fmaxf(xs_d, qexp[3 * e + 2].scales.input);
        }
        if (qexp[0].dtype == TSR_DTYPE_NVFP4 && E < En &&
            (st = all_input_scales(set, pre, l, En, &xs_gu, &xs_d, err, errlen)) != TSR_OK)
                return st;
        for (size_t e = 0; e < E; e++) {
                qexp[3 * e].scales.input = qexp[3 * e + 1].scales.input = xs_gu;
                qexp[3 * e + 2].scales.input = xs_d;
        }
        m->qdtype = qexp[0].dtype;
        return TSR_OK;
}

static bool is_vision(const char *name) {
        return strncmp(name, "vision_model.", 13) == 0 || strncmp(name, "multi_modal_projector.", 22) == 0;
}

tsr_status tsr_llama4_load(const char *dir, const tsr_llama4_config *cfg, const tsr_shard_spec *spec,
                           const tsr_load_opts *opts, tsr_load_progress_fn progress, void *ud, tsr_llama4 **ret,
                           tsr_load_stats *stats, char *err, size_t errlen) {
        const tsr_model_family *fam = &tsr_family_llama4;
        tsr_safetensors_set *set = NULL;
        tsr_gguf *g = NULL;
        tsr_llama4 *m = NULL;
        tsr_load_stats a = {0}, b = {0};
        size_t cfg_bytes, n_vision = 0, hd, E = cfg ? cfg->n_experts : 0;
        char name[256];
        tsr_status st;

        if (!dir || !cfg || !spec || !ret)
                return TSR_E_INVAL;
        /* the layer range as a Llama's; a tensor-parallel rank (it reads its share:
         * l4_slice) by Llama 4's own split rules */
        tsr_shard_spec layers = *spec;
        layers.tp_rank = 0;
        layers.tp_size = 1;
        if ((st = tsr_llama_weights_check(&cfg->base, &layers, dir, err, errlen)) != TSR_OK)
                return st;
        if (spec->tp_size == 0 || spec->tp_rank >= spec->tp_size) {
                tsr_errf(err, errlen, "%s: shard tp %u/%u: a rank below the tensor parallel size is supported", dir,
                         spec->tp_rank, spec->tp_size);
                return TSR_E_UNSUPPORTED;
        }
        if (spec->tp_size > 1) {
                char why[400];
                size_t e0, ne;
                if ((st = tp_check(cfg, spec->tp_size, why, sizeof why)) != TSR_OK ||
                    (spec->expert_parallel &&
                     (st = tsr_tp_expert_range(E, spec->tp_rank, spec->tp_size, &e0, &ne, why, sizeof why)) !=
                             TSR_OK)) {
                        tsr_errf(err, errlen, "%s: %s", dir, why);
                        return st;
                }
        }
        if ((st = cfg->gguf ? tsr_gguf_open(dir, &g, err, errlen) : tsr_safetensors_set_open(dir, &set, err, errlen)) !=
            TSR_OK)
                return st;
        hd = cfg->base.head_dim;
        cfg_bytes = sizeof *cfg + cfg->base.n_layers;
        /* the config and shard first: tsr_llama4_free reads them */
        if ((m = calloc(1, sizeof *m)) && (m->cfg = malloc(cfg_bytes))) {
                memcpy(m->cfg, cfg, cfg_bytes);
                m->shard = *spec;
                m->tp_size = 1;
                m->nh = cfg->base.n_heads;
                m->nkv = cfg->base.n_kv_heads;
                m->hid = cfg->base.hidden_dim;
                m->mlp = cfg->mlp_dim;
                m->vocab_out = cfg->base.vocab_size;
                m->ne = cfg->n_experts;
                m->ehid = cfg->base.hidden_dim;
                m->qdtype = TSR_DTYPE_F32;
        }
        if (!m || !m->cfg || !(m->layers = calloc(spec->last_layer - spec->first_layer + 1, sizeof *m->layers)) ||
            !(m->inv_freq = malloc(hd / 2 * sizeof(float))) || !(m->ones = malloc(hd * sizeof(float)))) {
                tsr_errf(err, errlen, "%s: out of memory", dir);
                st = TSR_E_NOMEM;
                goto done;
        }
        for (size_t i = 0; i < hd; i++)
                m->ones[i] = 1.0f;
        if ((st = tsr_llama_rope_inv_freq(&cfg->base, NULL, m->inv_freq)) != TSR_OK) {
                tsr_errf(err, errlen, "%s: bad RoPE parameters", dir);
                goto done;
        }
        for (size_t i = 0; set && i < tsr_safetensors_set_n_tensors(set); i++) {
                const tsr_safetensors_tensor *t = tsr_safetensors_set_tensor_at(set, i, NULL);
                n_vision += t && is_vision(t->name);
        }
        if (n_vision)
                log_info("%s: %zu vision tower and projector tensors not loaded (Llama 4 is served as text only)", dir,
                         n_vision);
        /* The nested layout (Meta/HF Scout) keeps the text model under language_model.;
         * Llama4ForCausalLM and ModelOpt's exports of the nested model use the bare names. */
        const char *pre = set && tsr_safetensors_set_find(set, "language_model.model.embed_tokens.weight", NULL)
                                  ? "language_model."
                                  : "";
        const tsr_modelopt_config *mo = opts ? opts->modelopt : NULL;
        tsr_tensor_source src = {.set = set, .g = g, .src = dir, .hf_prefix = *pre ? pre : NULL,
                                 .modelopt = mo && mo->algo != TSR_MODELOPT_NONE ? mo : NULL,
                                 .keep_bf16 = opts && opts->keep_bf16};
        /* The experts' layout, from the range's first MoE layer: BMM stacks unless that
         * layer has expert 0's gate_proj instead (a GGUF: its gate and up stacks). */
        for (uint32_t l = spec->first_layer; set && l <= spec->last_layer; l++) {
                if (!(cfg->layer[l] & TSR_LLAMA4_MOE))
                        continue;
                snprintf(name, sizeof name, "%smodel.layers.%u.feed_forward.experts.gate_up_proj", pre, l);
                if (!tsr_safetensors_set_find(set, name, NULL)) {
                        snprintf(name, sizeof name, "%smodel.layers.%u.feed_forward.experts.0.gate_proj.weight", pre,
                                 l);
                        m->per_expert = tsr_safetensors_set_find(set, name, NULL) != NULL;
                }
                break;
        }
        if (m->per_expert && (st = expert_table(m)) != TSR_OK)
                goto nomem;
        for (uint32_t l = spec->first_layer; l <= spec->last_layer; l++) {
                layer *L = &m->layers[l - spec->first_layer];
                if ((cfg->layer[l] & TSR_LLAMA4_MOE) &&
                    (!(L->qexp = calloc(3 * E, sizeof *L->qexp)) ||
                     (m->per_expert && !(L->fexp = calloc(3 * E, sizeof *L->fexp)))))
                        goto nomem;
        }
        /* the family's fixed rows, then (per-expert layout) the 3 E rows per MoE layer */
        if ((st = tsr_load_tensors(&src, fam->tensors, fam->n_tensors, spec, llama4_bind, m, progress, ud, &a, err,
                                   errlen)) != TSR_OK ||
            (m->per_expert && (st = tsr_load_tensors(&src, m->expert_names, 3 * E, spec, llama4_bind, m, progress, ud,
                                                     &b, err, errlen)) != TSR_OK))
                goto done;
        if (stats)
                *stats = (tsr_load_stats){.n_tensors = a.n_tensors + b.n_tensors,
                                          .file_bytes = a.file_bytes + b.file_bytes,
                                          .f32_bytes = a.f32_bytes + b.f32_bytes,
                                          .resident_bytes = a.resident_bytes + b.resident_bytes,
                                          .seconds = a.seconds + b.seconds};
        for (uint32_t l = spec->first_layer; l <= spec->last_layer; l++) {
                layer *L = &m->layers[l - spec->first_layer];
                mat *w[N_MATS];
                size_t r[N_MATS], cc[N_MATS], n[N_MATS];
                layer_mats(m, L, w, r, cc, n);
                for (int i = 0; i < N_MATS; i++) {
                        if (w[i]->q.data && w[i]->q.dtype == TSR_DTYPE_BF16)
                                m->kept_bf16 = true;
                        else if (w[i]->q.data)
                                m->qdtype = w[i]->q.dtype;
                }
                if ((cfg->layer[l] & TSR_LLAMA4_MOE) &&
                    (st = experts_finish(m, L, l, set, pre, dir, err, errlen)) != TSR_OK)
                        goto done;
                m->kept_bf16 |= L->exp_gate_up.b || L->exp_down.b;     /* a BF16 stack kept */
        }
        if (m->rope_freqs && (st = tsr_llama_rope_inv_freq(&cfg->base, m->rope_freqs, m->inv_freq)) != TSR_OK) {
                tsr_errf(err, errlen, "%s: tensor 'rope_freqs.weight': every entry must be a positive finite "
                         "divisor", dir);
                goto done;
        }
        if (m->output.q.data && m->output.q.dtype == TSR_DTYPE_BF16)
                m->kept_bf16 = true;            /* a BF16 lm_head kept as stored */
        else if (m->output.q.data)
                m->qdtype = m->output.q.dtype;
        if (cfg->base.tied_embeddings)
                m->output.f = m->embed;         /* NULL before the last stage */
        /* a tensor-parallel rank's share: split here, so load never returns half a split */
        if (spec->tp_size > 1 &&
            (st = shard(m, spec->tp_rank, spec->tp_size, spec->expert_parallel, err, errlen)) != TSR_OK)
                goto done;
        *ret = m;
        m = NULL;
        goto done;
nomem:
        tsr_errf(err, errlen, "%s: out of memory", dir);
        st = TSR_E_NOMEM;
done:
        tsr_llama4_free(&m);
        tsr_safetensors_set_close(&set);
        tsr_gguf_close(&g);
        return st;
}

/* The weights' bytes as held now: the embedding and norms in float32, each matmul as its
 * float32 or its bf16 copy or as stored (ModelOpt), the output unless it is the
 * embedding itself. */
uint64_t tsr_llama4_resident_bytes(const tsr_llama4 *m) {
        if (!m)
                return 0;
        const tsr_llama4_config *c = m->cfg;
        uint64_t dim = c->base.dim, od = (uint64_t)m->vocab_out * dim;
        uint64_t n_layers, b;
        n_layers = m->shard.last_layer - m->shard.first_layer + 1;
        b = (m->embed ? od * sizeof(float) : m->embd_q.data ? tsr_tensor_n_bytes(&m->embd_q) : 0) +
            (m->out_norm ? dim * sizeof(float) : 0);
        b += m->output.q.data ? tsr_tensor_n_bytes(&m->output.q)
             : m->output.b    ? od * sizeof(uint16_t)
             : m->output.f && m->output.f != m->embed ? od * sizeof(float)
                                                      : 0;
        for (size_t l = 0; l < n_layers; l++) {
                layer *L = &m->layers[l];
                mat *w[N_MATS];
                size_t r[N_MATS], cc[N_MATS], n[N_MATS];
                layer_mats(m, L, w, r, cc, n);
                b += ((L->attn_norm ? dim : 0) + (L->ffn_norm ? dim : 0)) * sizeof(float);
                for (int i = 0; i < N_MATS; i++)
                        b += w[i]->q.data ? tsr_tensor_n_bytes(&w[i]->q)
                                          : (uint64_t)r[i] * cc[i] * n[i] *
                                                    (w[i]->b ? sizeof(uint16_t) : w[i]->f ? sizeof(float) : 0);
                for (size_t i = 0; L->qexp && i < 3 * (size_t)c->n_experts; i++)
                        b += L->qexp[i].data ? tsr_tensor_n_bytes(&L->qexp[i]) : 0;
        }
        return b;
}

/* ---- bf16 ------------------------------------------------------------------------------- */

static uint16_t *to_bf16(const float *src, size_t n) {
        uint16_t *dst = aligned_alloc(64, (n * sizeof(uint16_t) + 63) / 64 * 64);
        if (dst)
                for (size_t i = 0; i < n; i++)
                        dst[i] = tsr_f32_to_bf16(src[i]);
        return dst;
}

tsr_status tsr_llama4_use_bf16(tsr_llama4 *m) {
        const tsr_llama4_config *c;
        size_t n_layers;

        if (!m || m->dev)
                return TSR_E_INVAL;     /* the host arrays are gone after tsr_llama4_to_backend */
        if (m->bf16)
                return TSR_OK;
        c = m->cfg;
        n_layers = m->shard.last_layer - m->shard.first_layer + 1;
        /* One matrix at a time, its float32 copy freed once converted (llama.c's
         * tsr_llama_use_bf16 says why); a failure leaves a model only tsr_llama4_free may
         * touch.  The output matrix is the last pipeline stage's only. */
        if (m->output.f && !(m->output.b = to_bf16(m->output.f, (size_t)m->vocab_out * c->base.dim)))
                return TSR_E_NOMEM;
        if (m->output.f != m->embed)            /* tied: the embedding still reads it */
                free(m->output.f);
        m->output.f = NULL;
        for (size_t l = 0; l < n_layers; l++) {
                mat *w[N_MATS];
                size_t r[N_MATS], cc[N_MATS], n[N_MATS];
                layer_mats(m, &m->layers[l], w, r, cc, n);
                for (int i = 0; i < N_MATS; i++) {
                        if (!w[i]->f)
                                continue;
                        if (!(w[i]->b = to_bf16(w[i]->f, r[i] * cc[i] * n[i])))
                                return TSR_E_NOMEM;
                        free(w[i]->f);
                        w[i]->f = NULL;
                }
        }
        m->bf16 = true;
        return TSR_OK;
}

bool tsr_llama4_is_bf16(const tsr_llama4 *m) { return m && m->bf16; }

tsr_status tsr_llama4_check_backend(const tsr_llama4 *m, const tsr_backend *be) {
        static const tsr_op needed[] = {TSR_OP_RMSNORM,     TSR_OP_EMBEDDING, TSR_OP_ROPE,
                                        TSR_OP_KV_WRITE,    TSR_OP_ATTENTION, TSR_OP_SILU_MUL,
                                        TSR_OP_ADD,         TSR_OP_ADD_RMSNORM, TSR_OP_GATHER_ROWS,
                                        TSR_OP_SCATTER_ADD_ROWS};
        if (!m || !be)
                return TSR_E_INVAL;
        /* the weights are in the host's memory, or in this device's (tsr_llama4_to_backend) */
        if (tsr_backend_host_memory(be) ? m->dev != NULL : m->dev != be)
                return TSR_E_UNSUPPORTED;
        for (size_t i = 0; i < sizeof needed / sizeof needed[0]; i++)
                if (!tsr_backend_supports(be, needed[i], TSR_DTYPE_F32))
                        return TSR_E_UNSUPPORTED;
        /* the router (and, in a ModelOpt checkpoint, what it leaves unquantized) runs in
         * the model's dtype; the quantized weights on their own */
        if (!tsr_backend_supports(be, TSR_OP_MATMUL, m->bf16 ? TSR_DTYPE_BF16 : TSR_DTYPE_F32) ||
            !tsr_backend_supports(be, TSR_OP_MATMUL, m->qdtype) ||
            (m->kept_bf16 && !tsr_backend_supports(be, TSR_OP_MATMUL, TSR_DTYPE_BF16)))
                return TSR_E_UNSUPPORTED;
        return TSR_OK;
}

/* ---- on a device backend (issue #16) ----------------------------------------------------- */

/* Every weight array the forward reads, onto list.  A tied output is the embedding: not
 * listed (the pointer is set after the move). */
static void dev_arrays(tsr_llama4 *m, tsr_dev_list *list) {
        const tsr_llama4_config *c = m->cfg;
        size_t dim = c->base.dim, hd = c->base.head_dim;
#define SLOT(p, b) tsr_dev_list_add(list, (void **)&(p), (b))
        SLOT(m->embed, (size_t)c->base.vocab_size * dim * sizeof(float));
        SLOT(m->out_norm, dim * sizeof(float));
        SLOT(m->inv_freq, hd / 2 * sizeof(float));
        SLOT(m->ones, hd * sizeof(float));
        if (m->output.f != m->embed)
                SLOT(m->output.f, (size_t)m->vocab_out * dim * sizeof(float));
        SLOT(m->output.b, (size_t)m->vocab_out * dim * sizeof(uint16_t));
        SLOT(m->output.q.data, m->output.q.data ? tsr_tensor_n_bytes(&m->output.q) : 0);
        SLOT(m->embd_q.data, m->embd_q.data ? tsr_tensor_n_bytes(&m->embd_q) : 0);     /* as its bf16 bytes */
        for (size_t l = 0; l <= m->shard.last_layer - m->shard.first_layer; l++) {
                layer *L = &m->layers[l];
                mat *w[N_MATS];
                size_t r[N_MATS], cc[N_MATS], k[N_MATS];
                layer_mats(m, L, w, r, cc, k);
                SLOT(L->attn_norm, dim * sizeof(float));
                SLOT(L->ffn_norm, dim * sizeof(float));
                for (int i = 0; i < N_MATS; i++) {
                        SLOT(w[i]->f, r[i] * cc[i] * k[i] * sizeof(float));
                        SLOT(w[i]->b, r[i] * cc[i] * k[i] * sizeof(uint16_t));
                        SLOT(w[i]->q.data, w[i]->q.data ? tsr_tensor_n_bytes(&w[i]->q) : 0);
                }
                for (size_t i = 0; L->qexp && i < 3 * (size_t)c->n_experts; i++)
                        SLOT(L->qexp[i].data, L->qexp[i].data ? tsr_tensor_n_bytes(&L->qexp[i]) : 0);
        }
#undef SLOT
}

tsr_status tsr_llama4_to_backend(tsr_llama4 *m, tsr_backend *be, char *err, size_t errlen) {
        tsr_status st = TSR_OK;

        if (!m || !be || m->dev)
                return TSR_E_INVAL;
        if (tsr_backend_host_memory(be))
                return TSR_OK;          /* the CPU reads the host arrays */
        bool split = m->tp_size > 1 || m->canonical || m->ep || m->shard.first_layer > 0 ||
                     m->shard.last_layer + 1 < m->cfg->base.n_layers;
        if ((st = tsr_dev_check(be, "Llama 4", split, m->qdtype, err, errlen)) != TSR_OK)
                return st;
        tsr_dev_list l = {0};
        if (!(m->acts = calloc(1, sizeof *m->acts)))
                return TSR_E_NOMEM;
        dev_arrays(m, &l);
        bool tied = m->output.f && m->output.f == m->embed;
        if ((st = tsr_dev_list_move(be, &l, err, errlen)) != TSR_OK) {
                free(m->acts);
                m->acts = NULL;
                return st;
        }
        if (tied)
                m->output.f = m->embed;
        m->dev = be;
        return TSR_OK;
}

/* ---- tensor parallelism ----------------------------------------------------------------- */

/* Whether tp_size splits the model (tsr_llama4_shard_tp); else TSR_E_UNSUPPORTED with the
 * first count that does not divide named in err, in vLLM's words where vLLM has them. */
static tsr_status tp_check(const tsr_llama4_config *c, uint32_t t, char *err, size_t errlen) {
        uint32_t S = TSR_COMM_TREE_LEAVES, H = c->base.n_heads;
        uint32_t qd = H * c->base.head_dim, I = c->base.hidden_dim, M = c->mlp_dim;
        tsr_status st = tsr_tp_check_split(t, H, c->base.n_kv_heads, c->base.vocab_size, err, errlen);

        if (st != TSR_OK)
                return st;
        if (I % S)
                tsr_errf(err, errlen, "intermediate_size (%u: the columns of every expert and of the shared "
                         "expert) must be divisible by tensor parallel size (%u) and by %u (the canonical partial "
                         "sums of their down_proj)", I, t, S);
        else if (M % S)
                tsr_errf(err, errlen, "intermediate_size_mlp (%u: the dense layers' MLP columns) must be "
                         "divisible by tensor parallel size (%u) and by %u (the canonical partial sums of their "
                         "down_proj)", M, t, S);
        else if (qd % S)
                tsr_errf(err, errlen, "the attention output (%u heads x %u = %u columns) must be divisible by %u "
                         "(the canonical partial sums of o_proj)", H, c->base.head_dim, qd, S);
        else
                return TSR_OK;
        return TSR_E_UNSUPPORTED;
}

/* tsr_llama4_shard_tp, and with `ep` tsr_llama4_shard_ep: the routed experts whole per
 * rank instead of a share of each. */
/* tp.h's splits of a linear held as float32 (w->f) or kept as stored (a ModelOpt
 * checkpoint's fp8 / nvfp4: w->q). */
static tsr_status keep_rows(mat *w, size_t rows, size_t cols, size_t first, size_t n) {
        return tsr_tp_keep_rows_of(&w->f, &w->q, rows, cols, first, n);
}

static tsr_status keep_col_slices(mat *w, size_t rows, size_t cols, size_t first, size_t n, size_t ns) {
        return tsr_tp_keep_col_slices_of(&w->f, &w->q, rows, cols, first, n, ns);
}

/* tp.h's splits of n_mats stacked (rows, cols) expert matrices held as float32 (w->f) or
 * bf16 (w->b: a BF16 checkpoint's stack kept as stored). */
static tsr_status stack_keep_rows(mat *w, size_t n_mats, size_t rows, size_t cols, size_t first, size_t n) {
        return w->b ? tsr_tp_keep_rows_bf16(&w->b, n_mats, rows, cols, first, n)
                    : tsr_tp_keep_rows(&w->f, n_mats, rows, cols, first, n);
}

static tsr_status stack_keep_col_slices(mat *w, size_t n_mats, size_t rows, size_t cols, size_t first, size_t n,
                                        size_t ns) {
        return w->b ? tsr_tp_keep_col_slices_bf16(&w->b, n_mats, rows, cols, first, n, ns)
                    : tsr_tp_keep_col_slices(&w->f, n_mats, rows, cols, first, n, ns);
}

/* The row-parallel linears kept as stored split into canonical K slices of whole blocks
 * (NVFP4's 16 elements): o_proj's ko columns a slice, the shared expert's ke, the dense
 * MLP's km, the routed experts' ke too, or under expert parallelism (ep) all S slices of
 * the rank's first expert, e0.  Checked for every layer before anything is cut. */
static tsr_status stored_slices_check(const tsr_llama4 *m, size_t ko, size_t ke, size_t km, size_t ns, bool ep,
                                      size_t e0, char *err, size_t errlen) {
        size_t S = TSR_COMM_TREE_LEAVES, kx = ep ? m->cfg->base.hidden_dim / S : ke;
        size_t n_local = m->shard.last_layer - m->shard.first_layer + 1;
        for (size_t l = 0; l < n_local; l++) {
                const layer *L = &m->layers[l];
                const struct { const tsr_tensor *q; size_t k, ns; const char *what; } rows[] = {
                        {&L->o.q, ko, ns, "o_proj"},
                        {&L->sh_down.q, ke, ns, "the shared expert's down_proj"},
                        {L->qexp ? &L->qexp[3 * e0 + 2] : NULL, kx, ep ? S : ns, "the experts' down_proj"},
                        {&L->down.q, km, ns, "down_proj"},
                };
                for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
                        tsr_status st = tsr_tp_check_stored_slice(rows[i].q, rows[i].k, rows[i].ns, rows[i].what,
                                                                  m->shard.first_layer + l, err, errlen);
                        if (st != TSR_OK)
                                return st;
                }
        }
        return TSR_OK;
}

static tsr_status shard(tsr_llama4 *m, uint32_t tp_rank, uint32_t tp_size, bool ep, char *err, size_t errlen) {
        const tsr_llama4_config *c;
        size_t dim, hd, H, KVH, I, M, E, nh, nkv, kv0, hid, mlp, ns, n_local, e0 = 0, ne = 0;
        bool split;
        tsr_status st;

        /* read as the rank's share (the load's tp spec): the load's own call splits it,
         * a later one for that rank has nothing left to do; the splits below then only
         * put the row-parallel columns in the canonical order */
        bool done, sliced = m && m->shard.tp_size > 1;
        if (!m || (st = tsr_tp_shard_begin(&m->shard, m->canonical, tp_rank, tp_size, ep, &done, err, errlen)) !=
                          TSR_OK)
                return m ? st : TSR_E_INVAL;
        if (done)
                return TSR_OK;
        c = m->cfg;
        if ((st = tp_check(c, tp_size, err, errlen)) != TSR_OK)
                return st;
        if (m->bf16) {
                tsr_errf(err, errlen, "tensor parallelism needs float32 weights (--dtype float32)");
                return TSR_E_UNSUPPORTED;
        }
        dim = c->base.dim, hd = c->base.head_dim, H = c->base.n_heads, KVH = c->base.n_kv_heads;
        I = c->base.hidden_dim, M = c->mlp_dim, E = c->n_experts;
        nh = H / tp_size;
        nkv = tp_size <= KVH ? KVH / tp_size : 1;
        /* tp > KV heads: each KV head is replicated on tp / n_kv_heads ranks (vLLM) */
        kv0 = tp_size <= KVH ? tp_rank * nkv : tp_rank / (tp_size / KVH);
        hid = I / tp_size, mlp = M / tp_size;
        tsr_tp_vocab v = tsr_tp_vocab_of(c->base.vocab_size, tp_rank, tp_size);
        ns = TSR_COMM_TREE_LEAVES / tp_size;
        split = tp_size > 1;    /* tp 1: the canonical K slices alone */
        size_t o_cols = sliced ? nh * hd : H * hd, o0 = sliced ? 0 : tp_rank * nh * hd;
        size_t i_cols = sliced ? hid : I, i0 = sliced ? 0 : tp_rank * hid;
        size_t m_cols = sliced ? mlp : M, m0 = sliced ? 0 : tp_rank * mlp;
        n_local = m->shard.last_layer - m->shard.first_layer + 1;
        if (ep && (st = tsr_tp_expert_range(E, tp_rank, tp_size, &e0, &ne, err, errlen)) != TSR_OK)
                return st;
        /* quantized experts loaded whole share the max input scale of all of them
         * (experts_finish); an expert-parallel rank's is its own experts' max, so it must
         * be loaded as that rank (the worker always does) */
        for (size_t l = 0; ep && !sliced && l < n_local; l++)
                if (m->layers[l].qexp && m->layers[l].qexp[0].data) {
                        tsr_errf(err, errlen, "expert parallelism of quantized experts needs the model loaded as "
                                 "the rank (tsr_shard_spec.expert_parallel), not loaded whole and split");
                        return TSR_E_UNSUPPORTED;
                }
        if ((st = stored_slices_check(m, nh * hd / ns, hid / ns, mlp / ns, ns, ep, e0, err, errlen)) != TSR_OK)
                return st;
        st = TSR_OK;
        for (size_t l = 0; l < n_local && st == TSR_OK; l++) {
                layer *L = &m->layers[l];
                if (split && !sliced &&
                    (st = keep_rows(&L->q, H * hd, dim, tp_rank * nh * hd, nh * hd)) == TSR_OK &&
                    (st = keep_rows(&L->k, KVH * hd, dim, kv0 * hd, nkv * hd)) == TSR_OK)
                        st = keep_rows(&L->v, KVH * hd, dim, kv0 * hd, nkv * hd);
                if (st == TSR_OK)
                        st = keep_col_slices(&L->o, dim, o_cols, o0, nh * hd, ns);
                /* a ModelOpt checkpoint's experts, one tensor each (qexp): the rank's rows
                 * of gate and up (read as the share already at tp > 1), down's K slices; an
                 * expert-parallel rank's experts whole, down as all S slices */
                for (size_t e = 0; st == TSR_OK && L->qexp && e < E; e++) {
                        tsr_tensor *g = &L->qexp[3 * e];
                        tsr_load_slice rows = {TSR_LOAD_SLICE_ROWS, 1, {{tp_rank * hid, hid}}};
                        if (!g[0].data)         /* not quantized, or another rank's expert */
                                continue;
                        if (ep) {
                                st = tsr_tp_keep_stored_col_slices(&g[2], 0, I, TSR_COMM_TREE_LEAVES);
                                continue;
                        }
                        if (split && !sliced && (st = tsr_load_stored_slice(&g[0], &rows)) == TSR_OK)
                                st = tsr_load_stored_slice(&g[1], &rows);
                        if (st == TSR_OK)
                                st = tsr_tp_keep_stored_col_slices(&g[2], i0, hid, ns);
                }
                if (st != TSR_OK)
                        break;
                if ((c->layer[m->shard.first_layer + l] & TSR_LLAMA4_MOE) && ep) {
                        /* experts e0 .. e0 + ne - 1 whole (their rows of the (E, 2I, dim) and
                         * (E, dim, I) stacks), down_proj as all S canonical K slices; the
                         * shared expert as below */
                        /* else quantized: qexp, above */
                        bool fexp = L->exp_gate_up.f || L->exp_gate_up.b;
                        if (fexp && !sliced &&
                            (st = stack_keep_rows(&L->exp_gate_up, 1, E * 2 * I, dim, e0 * 2 * I, ne * 2 * I)) ==
                                    TSR_OK)
                                st = stack_keep_rows(&L->exp_down, 1, E * dim, I, e0 * dim, ne * dim);
                        if (st == TSR_OK && fexp)       /* (read: the rank's experts only) */
                                st = stack_keep_col_slices(&L->exp_down, ne, dim, I, 0, I, TSR_COMM_TREE_LEAVES);
                        if (st == TSR_OK && split && !sliced &&
                            (st = keep_rows(&L->sh_gate, I, dim, tp_rank * hid, hid)) == TSR_OK)
                                st = keep_rows(&L->sh_up, I, dim, tp_rank * hid, hid);
                        if (st == TSR_OK)
                                st = keep_col_slices(&L->sh_down, dim, i_cols, i0, hid, ns);
                } else if (c->layer[m->shard.first_layer + l] & TSR_LLAMA4_MOE) {
                        /* every expert's gate and up halves, (2E, I, dim) as stacked (I, dim)
                         * matrices (float; a quantized checkpoint's are qexp, above), and the
                         * shared expert: the rank's hid rows of each */
                        bool fexp = L->exp_gate_up.f || L->exp_gate_up.b;
                        if (split && !sliced && fexp &&
                            (st = stack_keep_rows(&L->exp_gate_up, 2 * E, I, dim, tp_rank * hid, hid)) != TSR_OK)
                                break;
                        if (split && !sliced && (st = keep_rows(&L->sh_gate, I, dim, tp_rank * hid, hid)) == TSR_OK)
                                st = keep_rows(&L->sh_up, I, dim, tp_rank * hid, hid);
                        if (st == TSR_OK && fexp)
                                st = stack_keep_col_slices(&L->exp_down, E, dim, i_cols, i0, hid, ns);
                        if (st == TSR_OK)
                                st = keep_col_slices(&L->sh_down, dim, i_cols, i0, hid, ns);
                } else {
                        if (split && !sliced && (st = keep_rows(&L->gate, M, dim, tp_rank * mlp, mlp)) == TSR_OK)
                                st = keep_rows(&L->up, M, dim, tp_rank * mlp, mlp);
                        if (st == TSR_OK)
                                st = keep_col_slices(&L->down, dim, m_cols, m0, mlp, ns);
                }
        }
        /* the embedding and lm_head by vocabulary rows (vocabulary-parallel, a tied table
         * once); read as the share, they are already the rank's */
        tsr_load_slice vocab_rows = {TSR_LOAD_SLICE_ROWS, 1, {{v.first, v.n}}};
        if (st == TSR_OK && split && !sliced)
                st = tsr_tp_keep_vocab_rows(&m->output.f, &m->embed, c->base.vocab_size, dim, v.first, v.n);
        if (st == TSR_OK && split && !sliced && m->output.q.data)
                st = tsr_load_stored_slice(&m->output.q, &vocab_rows);
        if (st == TSR_OK && split && !sliced && m->embd_q.data)
                st = tsr_load_stored_slice(&m->embd_q, &vocab_rows);
        if (st != TSR_OK) {
                tsr_errf(err, errlen, "out of memory while splitting the weights for tensor parallelism");
                return st;      /* the model is half split: the caller frees it */
        }
        m->tp_size = tp_size;
        m->tp_rank = tp_rank;
        m->nh = (uint32_t)nh;
        m->nkv = (uint32_t)nkv;
        m->hid = (uint32_t)hid;
        m->mlp = (uint32_t)mlp;
        m->vocab_out = (uint32_t)v.n;
        m->canonical = true;
        if (ep)         /* vLLM logs the same per EP rank ("Local/global number of experts") */
                log_info("expert parallel rank %u of %u: routed experts %zu..%zu of %zu (%zu local)", tp_rank, tp_size,
                         e0, e0 + ne - 1, E, ne);
        m->ep = ep;
        m->e0 = ep ? (uint32_t)e0 : 0;
        m->ne = ep ? (uint32_t)ne : (uint32_t)E;
        m->ehid = ep ? (uint32_t)I : (uint32_t)hid;
        return TSR_OK;
}

tsr_status tsr_llama4_shard_tp(tsr_llama4 *m, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen) {
        return shard(m, tp_rank, tp_size, false, err, errlen);
}

tsr_status tsr_llama4_shard_ep(tsr_llama4 *m, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen) {
        return shard(m, tp_rank, tp_size, true, err, errlen);
}

void tsr_llama4_set_comm(tsr_llama4 *m, tsr_comm *comm) {
        if (m)
                m->comm = comm;
}

/* ---- KV --------------------------------------------------------------------------------- */

tsr_kv_group tsr_llama4_kv_group(const tsr_llama4_config *c) {
        return tsr_llama_kv_group(&c->base);
}

/* The whole model's grouping into at most max groups (llama4.h, tsr_llama4_kv_groups). */
static size_t whole_groups(const tsr_llama4_config *c, uint32_t tp_size, tsr_kv_group *out, size_t max) {
        tsr_kv_group base = tsr_llama4_kv_group(c);
        uint32_t n_full = 0, n_chunked = 0, per, n = 0;

        if (max < 1)
                return 0;
        /* tp above the KV heads: one (replicated) KV head per rank, as vLLM */
        if (tp_size > 1)
                base.n_kv_heads = tp_size <= base.n_kv_heads ? base.n_kv_heads / tp_size : 1;
        for (uint32_t l = 0; l < c->base.n_layers; l++)
                (c->layer[l] & TSR_LLAMA4_CHUNKED) ? n_chunked++ : n_full++;
        if (n_chunked == 0) {
                out[0] = base;
                out[0].n_layers = n_full;
                return 1;
        }
        if (n_full && max < 2)
                return 0;
        /* P: the full group's size, unless the chunked layers would then need more groups
         * than are left */
        per = n_full ? n_full : 1;
        if ((n_chunked + per - 1) / per > max - (n_full ? 1 : 0))
                per = (n_chunked + (uint32_t)(max - (n_full ? 1 : 0)) - 1) / (uint32_t)(max - (n_full ? 1 : 0));
        if (n_full) {
                out[n] = base;
                out[n++].n_layers = n_full;
        }
        for (uint32_t left = n_chunked; left; n++) {
                out[n] = base;
                out[n].kind = TSR_KV_CHUNKED_LOCAL;
                out[n].chunk = c->chunk;
                out[n].n_layers = left < per ? left : per;
                left -= out[n].n_layers;
        }
        return n;
}

/* The group of whole[] (whole_groups' order) layer l is in, into *g: the full-attention
 * layers are group 0, the chunked ones fill the next groups in order, P (the first
 * chunked group's size) to a group. */
static void whole_slot(const tsr_llama4_config *c, const tsr_kv_group *whole, uint32_t l, uint32_t *g) {
        bool has_full = whole[0].kind == TSR_KV_FULL_ATTENTION;
        uint32_t n_chunked = 0;
        for (uint32_t i = 0; i < l; i++)
                n_chunked += (c->layer[i] & TSR_LLAMA4_CHUNKED) != 0;
        *g = !(c->layer[l] & TSR_LLAMA4_CHUNKED) ? 0
                                                  : (has_full ? 1 : 0) + n_chunked / whole[has_full ? 1 : 0].n_layers;
}

size_t tsr_llama4_kv_groups(const tsr_llama4_config *c, uint32_t first, uint32_t last, uint32_t tp_size,
                            tsr_kv_group *out, size_t max) {
        tsr_kv_group whole[TSR_KV_GROUPS_MAX];
        uint32_t count[TSR_KV_GROUPS_MAX] = {0}, g;
        size_t n_whole, n = 0;

        if (last < first || last >= c->base.n_layers)
                return 0;
        if (!(n_whole = whole_groups(c, tp_size, whole, max < TSR_KV_GROUPS_MAX ? max : TSR_KV_GROUPS_MAX)))
                return 0;
        for (uint32_t l = first; l <= last; l++) {
                whole_slot(c, whole, l, &g);
                count[g]++;
        }
        for (g = 0; g < n_whole; g++)           /* the whole model's groups the range has layers of */
                if (count[g]) {
                        out[n] = whole[g];
                        out[n++].n_layers = count[g];
                }
        return n;
}

uint32_t tsr_llama4_kv_layer(const tsr_llama4_config *c, uint32_t first, uint32_t last, uint32_t tp_size,
                             uint32_t group, uint32_t i) {
        tsr_kv_group whole[TSR_KV_GROUPS_MAX];
        uint32_t count[TSR_KV_GROUPS_MAX] = {0}, g, want = UINT32_MAX, seen = 0;
        size_t n_whole;

        if (last < first || last >= c->base.n_layers ||
            !(n_whole = whole_groups(c, tp_size, whole, TSR_KV_GROUPS_MAX)))
                return UINT32_MAX;
        for (uint32_t l = first; l <= last; l++) {
                whole_slot(c, whole, l, &g);
                count[g]++;
        }
        for (g = 0; g < n_whole && want == UINT32_MAX; g++)   /* the group-th with layers in the range */
                if (count[g] && seen++ == group)
                        want = g;
        for (uint32_t l = first, k = 0; want != UINT32_MAX && l <= last; l++) {
                whole_slot(c, whole, l, &g);
                if (g == want && k++ == i)
                        return l;
        }
        return UINT32_MAX;
}

static bool pool_is(const tsr_kv_pool *pool, const tsr_kv_group *want, size_t n_want) {
        if (pool->n_groups != n_want)
                return false;
        for (size_t i = 0; i < n_want; i++) {
                const tsr_kv_group *g = &pool->groups[i].spec;
                if (g->kind != want[i].kind || g->n_layers != want[i].n_layers || g->chunk != want[i].chunk ||
                    g->n_kv_heads != want[i].n_kv_heads || g->head_dim != want[i].head_dim ||
                    !tsr_dtype_is_kv(g->dtype) ||
                    g->dtype != pool->groups[0].spec.dtype)     /* one dtype for every paged group */
                        return false;
        }
        return true;
}

tsr_status tsr_llama4_kv_bind(const tsr_llama4 *m, tsr_kv_pool *pool, tsr_llama4_kv **ret) {
        tsr_kv_group want[TSR_KV_GROUPS_MAX], whole[TSR_KV_GROUPS_MAX];
        uint32_t count[TSR_KV_GROUPS_MAX] = {0}, at[TSR_KV_GROUPS_MAX], next[TSR_KV_GROUPS_MAX] = {0};
        size_t n_want, n_whole, n_layers;
        uint32_t first, g;
        bool one;
        tsr_llama4_kv *kv;

        if (!m || !pool || !ret)
                return TSR_E_INVAL;
        first = m->shard.first_layer;
        n_layers = m->shard.last_layer - first + 1;
        n_whole = whole_groups(m->cfg, m->tp_size, whole, TSR_KV_GROUPS_MAX);
        n_want = tsr_llama4_kv_groups(m->cfg, first, m->shard.last_layer, m->tp_size, want, TSR_KV_GROUPS_MAX);
        /* the hybrid (a pipeline stage's: the whole model's groups it has layers of), or
         * the one-group pool of every position */
        one = !pool_is(pool, want, n_want);
        want[0] = tsr_llama4_kv_group(m->cfg);
        want[0].n_layers = (uint32_t)n_layers;
        want[0].n_kv_heads = m->nkv;
        if (one && !pool_is(pool, want, 1))
                return TSR_E_INVAL;
        if (pool->n_blocks > UINT32_MAX)
                return TSR_E_LIMIT;
        if (!(kv = calloc(1, sizeof *kv)) || !(kv->k = calloc(n_layers, sizeof *kv->k)) ||
            !(kv->v = calloc(n_layers, sizeof *kv->v)) || !(kv->table = calloc(n_layers, sizeof *kv->table)) ||
            !(kv->k_scale = calloc(n_layers, sizeof *kv->k_scale)) ||
            !(kv->v_scale = calloc(n_layers, sizeof *kv->v_scale))) {
                tsr_llama4_kv_free(&kv);
                return TSR_E_NOMEM;
        }
        kv->dtype = pool->groups[0].spec.dtype;
        kv->n_layers = n_layers;
        kv->n_kv_heads = want[0].n_kv_heads;
        kv->head_dim = want[0].head_dim;
        kv->block_size = pool->block_size;
        kv->n_blocks = (size_t)pool->n_blocks;
        /* A sequence holds the whole model's tables (the engine's, whichever stage this
         * is): layer l uses its whole-model group's table, and the arrays of its place
         * among the range's layers of that group in the pool.  Layers of different groups
         * may share an array: their tables never hold the same block. */
        kv->n_tables = one ? 1 : tsr_kv_tables(whole, n_whole, kv->chunk);
        for (uint32_t l = 0; !one && l < n_layers; l++) {
                whole_slot(m->cfg, whole, first + l, &g);
                count[g]++;
        }
        for (uint32_t i = 0, k = 0; i < n_whole; i++)
                at[i] = count[i] ? k++ : 0;
        for (uint32_t l = 0; l < n_layers; l++) {
                uint32_t j = l;
                g = 0;
                if (!one) {
                        whole_slot(m->cfg, whole, first + l, &g);
                        j = next[g]++;
                }
                const tsr_kv_pool_group *pg = &pool->groups[one ? 0 : at[g]];
                kv->k[l] = (float *)pg->k[j];
                kv->v[l] = (float *)pg->v[j];
                kv->k_scale[l] = pg->k_scale ? pg->k_scale[j] : 1.0f;
                kv->v_scale[l] = pg->v_scale ? pg->v_scale[j] : 1.0f;
                kv->table[l] = g;       /* every group of a hybrid is paged: group i is table i */
        }
        *ret = kv;
        return TSR_OK;
}

void tsr_llama4_kv_free(tsr_llama4_kv **kv) {
        if (!kv || !*kv)
                return;
        free((*kv)->k);
        free((*kv)->v);
        free((*kv)->table);
        free((*kv)->k_scale);
        free((*kv)->v_scale);
        free(*kv);
        *kv = NULL;
}

/* Layer l's view of q's blocks: its group's table. */
static tsr_kv_view kv_view(const tsr_llama4_kv *kv, size_t l, const tsr_llama_seq *q) {
        return (tsr_kv_view){.k = kv->k[l], .v = kv->v[l], .dtype = kv->dtype, .k_scale = kv->k_scale[l],
                             .v_scale = kv->v_scale[l], .block_table = q->block_table + kv->table[l] * q->n_table,
                             .n_table = q->n_table,
                             .n_blocks = kv->n_blocks, .block_size = kv->block_size, .n_kv_heads = kv->n_kv_heads,
                             .head_dim = kv->head_dim};
}

/* ---- forward ---------------------------------------------------------------------------- */

/* A step's arrays.  The activations (x .. cv, rl and lg) live in the memory of the
 * model's device (`mem`, tsr_llama4_to_backend) or the host's; the index arrays, the
 * routing results and rlh (the router logits the host's top-k reads) in the host's. */
struct scratch {
        tsr_backend *mem;               /* NULL: every array is host memory */
        float *x, *xb;                  /* (N, dim) residual stream; a sublayer's input, then output */
        float *q, *att;                 /* (N, q_dim) */
        float *k, *v;                   /* (N, kv_dim) */
        float *hb, *hb2;                /* (N, max(mlp, I)): the rank's columns */
        /* (P, N, dim), P = n_parts: a row-parallel matmul's partials (the one product when
         * the model is not canonical): o_proj's, the dense MLP's, the shared expert's (then
         * the MoE block's); the routed experts' sum; one expert's rows' */
        float *parts, *routed, *ey;
        float *xin;                     /* (N, dim) an expert's rows in */
        float *slice;                   /* canonical: (N, widest K / P) one K slice of a row-parallel input */
        float *rl;                      /* (N, E) router logits */
        float *ck, *cv;                 /* (chunk rows, kv_dim) a chunk's keys and values, gathered */
        float *lg;                      /* on a device: (logit rows, vocab_out) logits before their download */
        float *rlh;                     /* (N, E) the router logits on the host: rl itself there */
        float *score;                   /* (N, top_k) */
        uint32_t *sel;                  /* (N, top_k) chosen experts */
        uint32_t *rows;                 /* (N,) rows routed to one expert */
        float *rscale;                  /* (N,) their scores */
        float *qscale;                  /* (N,) a NoPE layer's query scale per row */
        /* expert parallelism: (N,) which of its top_k choices each routed row is, and
         * (N, top_k, S, dim) every choice's down_proj partials per canonical slice, this
         * rank's experts' filled, the others' zero, all-reduced (tsr_llama4_shard_ep) */
        uint32_t *rk;
        float *ep_parts;
        uint32_t *pos, *tokens;         /* (N,) */
};

/* The activation arrays of s, for allocating and freeing them alike. */
#define SCRATCH_ACTS(s)                                                                                               \
        {&(s)->x,   &(s)->xb, &(s)->q,     &(s)->att, &(s)->k,  &(s)->v,  &(s)->hb, &(s)->hb2, &(s)->parts, &(s)->routed, \
         &(s)->xin, &(s)->ey, &(s)->slice, &(s)->rl,  &(s)->ck, &(s)->cv, &(s)->lg}

static void scratch_free(struct scratch *s) {
        float **acts[] = SCRATCH_ACTS(s);
        for (size_t i = 0; !s->mem && i < sizeof acts / sizeof acts[0]; i++)
                free(*acts[i]);         /* on a device they are the model's, kept */
        if (s->rlh != s->rl)
                free(s->rlh);
        free(s->score);
        free(s->rscale);
        free(s->qscale);
        free(s->sel);
        free(s->rows);
        free(s->rk);
        free(s->ep_parts);
        free(s->pos);
        free(s->tokens);
}

/* Partials of a row-parallel matmul: the rank's canonical K slices, or the one product. */
static size_t n_parts(const tsr_llama4 *m) { return m->canonical ? TSR_COMM_TREE_LEAVES / m->tp_size : 1; }

/* The arrays of a step of N rows (chunk_rows: the longest chunk a chunked layer gathers;
 * logit_rows: the rows whose logits are wanted), in the model's memory. */
static tsr_status scratch_alloc(struct scratch *s, const tsr_llama4 *m, size_t N, size_t chunk_rows,
                                size_t logit_rows) {
        const tsr_llama4_config *c = m->cfg;
        size_t dim = c->base.dim, qd = (size_t)m->nh * c->base.head_dim;
        size_t kvd = (size_t)m->nkv * c->base.head_dim, P = n_parts(m);
        size_t hid = m->mlp > m->hid ? m->mlp : m->hid;
        size_t E = c->n_experts, K = c->top_k, widest = P * dim, k = qd > hid ? qd : hid, S = TSR_COMM_TREE_LEAVES;

        /* expert parallelism: an expert's whole width, its S partials, every choice's */
        if (m->ep) {
                hid = m->ehid > hid ? m->ehid : hid;
                k = m->ehid / S * P > k ? m->ehid / S * P : k;
                widest = S * dim > widest ? S * dim : widest;
        }

        memset(s, 0, sizeof *s);
        s->mem = m->dev;
        widest = qd > widest ? qd : widest;
        widest = hid > widest ? hid : widest;
        widest = E > widest ? E : widest;
        if (N > SIZE_MAX / sizeof(float) / widest || chunk_rows > SIZE_MAX / sizeof(float) / kvd ||
            logit_rows > SIZE_MAX / sizeof(float) / m->vocab_out)
                return TSR_E_LIMIT;
        /* the activations, in the order of SCRATCH_ACTS (floats; at least one each) */
        size_t n_acts[] = {N * dim,  N * dim, N * qd,           N * qd,  N * kvd,          N * kvd,
                           N * hid,  N * hid, P * N * dim,      P * N * dim,
                           N * dim,  (m->ep ? S : P) * N * dim,  m->canonical ? N * k / P : 1, N * E,
                           chunk_rows * kvd + 1, chunk_rows * kvd + 1, m->dev ? logit_rows * m->vocab_out + 1 : 1};
        float **acts[] = SCRATCH_ACTS(s);
        _Static_assert(sizeof n_acts / sizeof n_acts[0] == N_ACTS, "one size per activation array");
        if (tsr_acts_bind(s->mem, s->mem ? m->acts->p : NULL, s->mem ? m->acts->bytes : NULL, acts, n_acts, N_ACTS) !=
            TSR_OK) {
                scratch_free(s);
                return TSR_E_NOMEM;
        }
#define A(p, n) ((p) = malloc((n) * sizeof *(p)))
        s->rlh = s->mem ? NULL : s->rl;
        if ((s->mem && !A(s->rlh, N * E)) || !A(s->score, N * K) || !A(s->sel, N * K) || !A(s->rows, N) ||
            !A(s->rscale, N) || !A(s->qscale, N) || !A(s->pos, N) || !A(s->tokens, N) || !A(s->rk, N) ||
            (m->ep && !A(s->ep_parts, N * K * S * dim))) {
                scratch_free(s);
                return TSR_E_NOMEM;
        }
#undef A
        return TSR_OK;
}

/* W @ x (rows, n) -> out (rows, d) for a weight kept as stored (ModelOpt: W8A8 / W4A4
 * with its scales; a BF16 checkpoint's bf16), t (d, n). */
static tsr_status mm_stored(tsr_backend *be, float *out, const float *x, const tsr_tensor *t, size_t rows) {
        if (t->dtype == TSR_DTYPE_BF16)
                return tsr_backend_matmul(be, out, x, t->data, t->dtype, rows, t->shape[1], t->shape[0]);
        return tsr_backend_matmul_scaled(be, out, x, t->data, t->dtype, &t->scales, rows, t->shape[1], t->shape[0]);
}

/* W (d, n) @ x (rows, n) -> out (rows, d) for the (d, n) matrix starting `off` elements
 * into `w`, in the dtype the model holds it in (a quantized one is always whole: off 0). */
static tsr_status mm(tsr_backend *be, float *out, const float *x, const mat *w, size_t off, size_t rows, size_t n,
                     size_t d) {
        if (w->q.data)
                return off == 0 && w->q.shape[0] == d && w->q.shape[1] == n ? mm_stored(be, out, x, &w->q, rows)
                                                                           : TSR_E_INTERNAL;
        if (w->b)
                return tsr_backend_matmul(be, out, x, w->b + off, TSR_DTYPE_BF16, rows, n, d);
        return tsr_backend_matmul(be, out, x, w->f + off, TSR_DTYPE_F32, rows, n, d);
}

/* A row-parallel W (dim, k) @ x (rows, k), x the rank's k columns, for the matrix `off`
 * elements into `w`: its n_parts partials into parts (n_parts, rows, dim), the one
 * product unless the model is canonical, then one per K slice (tp.h). */
static tsr_status mm_parts(const tsr_llama4 *m, tsr_backend *be, struct scratch *s, float *parts, const float *x,
                           const mat *w, size_t off, size_t rows, size_t k) {
        if (!m->canonical)
                return mm(be, parts, x, w, off, rows, k, m->cfg->base.dim);
        if (w->q.data)  /* as stored: the canonical K slices of the quantized bytes */
                return off ? TSR_E_INTERNAL
                           : tsr_tp_row_partials(be, parts, s->slice, x, w->q.data, w->q.dtype, &w->q.scales, rows, k,
                                                 m->cfg->base.dim, n_parts(m));
        if (w->b)       /* converted after the split: bf16 blocks of the same layout */
                return tsr_tp_row_partials(be, parts, s->slice, x, w->b + off, TSR_DTYPE_BF16, NULL, rows, k,
                                           m->cfg->base.dim, n_parts(m));
        return tsr_tp_row_partials(be, parts, s->slice, x, w->f + off, TSR_DTYPE_F32, NULL, rows, k,
                                   m->cfg->base.dim, n_parts(m));
}

/* out (count,) = the sum of the partials parts (n_parts, count) over the rank's slices
 * and the TP group (R7); `out` itself when the model is not canonical (parts == out). */
static tsr_status parts_sum(const tsr_llama4 *m, float *out, const float *parts, size_t count) {
        return m->canonical ? tsr_tp_row_reduce(m->comm, m->tp_size, parts, n_parts(m), out, count) : TSR_OK;
}

#define TRY(expr)                               \
        do {                                    \
                if ((st = (expr)) != TSR_OK)    \
                        goto done;              \
        } while (0)

/* down(silu(gate(x)) * up(x)) for x (rows, dim): down's partials into parts (n_parts, rows,
 * dim) (mm_parts); `hid` the rank's width. */
static tsr_status swiglu(const tsr_llama4 *m, tsr_backend *be, struct scratch *s, float *parts, const float *x,
                         const mat *gate, const mat *up, const mat *down, size_t rows, size_t hid) {
        size_t dim = m->cfg->base.dim;
        tsr_status st;
        TRY(mm(be, s->hb, x, gate, 0, rows, dim, hid));
        TRY(mm(be, s->hb2, x, up, 0, rows, dim, hid));
        TRY(tsr_backend_silu_mul(be, s->hb, s->hb, s->hb2, rows * hid));
        TRY(mm_parts(m, be, s, parts, s->hb, down, 0, rows, hid));
done:
        return st;
}

/* Llama4TextMoe on s->xb (N, dim) -> s->xb: shared(x) + sum over the token's top-k experts
 * e (in expert order) of expert_e(x * sigmoid(logit_e)).  transformers runs every expert
 * on every token with the others' input scaled by sigmoid(-inf) = 0, whose outputs are
 * exact zeros: the same sum.  A tensor-parallel rank (vLLM's Llama4MoE without expert
 * parallelism) holds its columns of every expert and of the shared expert, and the
 * router whole: every rank routes alike from the same x.  The canonical form keeps the
 * sums per K slice: slice j's shared partial + its routed experts' partials (added in
 * expert order), then the one reduce over the slices and the group, so every tp_size
 * adds the same floats in the same order (R7's tree_r(routed_r + shared_r)). */
static tsr_status moe(const tsr_llama4 *m, tsr_backend *be, const layer *L, struct scratch *s, size_t N) {
        const tsr_llama4_config *c = m->cfg;
        size_t dim = c->base.dim, I = m->ehid, E = c->n_experts, K = c->top_k, P = n_parts(m), cnt = N * dim;
        size_t S = TSR_COMM_TREE_LEAVES;
        tsr_status st;

        TRY(swiglu(m, be, s, s->parts, s->xb, &L->sh_gate, &L->sh_up, &L->sh_down, N, m->hid)); /* parts (P, N, dim) */
        TRY(mm(be, s->rl, s->xb, &L->router, 0, N, dim, E));                                    /* rl (N, E) */
        if (s->mem)     /* the top-k runs on the host */
                TRY(tsr_backend_download(be, s->rlh, s->rl, N * E * sizeof(float)));
        for (size_t r = 0; r < N; r++) {
                /* top-k by logit, ties to the lower index; the score is the sigmoid in float32 */
                const float *lg = s->rlh + r * E;
                for (size_t j = 0; j < K; j++) {
                        size_t best = E;
                        for (size_t e = 0; e < E; e++) {
                                bool taken = false;
                                for (size_t i = 0; i < j; i++)
                                        taken |= s->sel[r * K + i] == e;
                                if (!taken && (best == E || lg[e] > lg[best]))
                                        best = e;
                        }
                        s->sel[r * K + j] = (uint32_t)best;
                        s->score[r * K + j] = 1.0f / (1.0f + expf(-lg[best]));
                }
        }
        TRY(tsr_backend_zero(be, s->routed, P * cnt * sizeof(float)));
        if (m->ep)
                memset(s->ep_parts, 0, N * K * S * dim * sizeof(float));
        for (size_t e = m->e0; e < m->e0 + m->ne; e++) {       /* the experts held: all, or the rank's (ep) */
                size_t n = 0, le = e - m->e0;
                for (size_t r = 0; r < N; r++)
                        for (size_t j = 0; j < K; j++)
                                if (s->sel[r * K + j] == e) {
                                        s->rows[n] = (uint32_t)r;
                                        s->rk[n] = (uint32_t)j;
                                        s->rscale[n++] = s->score[r * K + j];
                                }
                if (!n)
                        continue;
                /* the router weight scales the expert's input */
                TRY(tsr_backend_gather_rows(be, s->xin, s->xb, N, dim, s->rows, s->rscale, n));
                if (L->qexp && L->qexp[3 * e].data) {       /* as stored (ModelOpt) */
                        const tsr_tensor *d = &L->qexp[3 * e + 2];
                        TRY(mm_stored(be, s->hb, s->xin, &L->qexp[3 * e], n));
                        TRY(mm_stored(be, s->hb2, s->xin, &L->qexp[3 * e + 1], n));
                        TRY(tsr_backend_silu_mul(be, s->hb, s->hb, s->hb2, n * I));
                        if (m->canonical)       /* its K slices (shard): ey (P, n, dim); ep: (S, n, dim) */
                                TRY(tsr_tp_row_partials(be, s->ey, s->slice, s->hb, d->data, d->dtype, &d->scales, n,
                                                        I, dim, m->ep ? S : P));
                        else
                                TRY(mm_stored(be, s->ey, s->hb, d, n));
                } else {
                        /* gate rows 0..I-1 and up rows I..2I-1 of the expert's (2I, dim) matrix */
                        TRY(mm(be, s->hb, s->xin, &L->exp_gate_up, le * 2 * I * dim, n, dim, I));
                        TRY(mm(be, s->hb2, s->xin, &L->exp_gate_up, le * 2 * I * dim + I * dim, n, dim, I));
                        TRY(tsr_backend_silu_mul(be, s->hb, s->hb, s->hb2, n * I));
                        if (m->ep)      /* all S slices of the whole expert: ey (S, n, dim) */
                                TRY(tsr_tp_row_partials(be, s->ey, s->slice, s->hb,
                                                        L->exp_down.b ? (const void *)(L->exp_down.b + le * dim * I)
                                                                      : (const void *)(L->exp_down.f + le * dim * I),
                                                        L->exp_down.b ? TSR_DTYPE_BF16 : TSR_DTYPE_F32, NULL, n, I,
                                                        dim, S));
                        else
                                TRY(mm_parts(m, be, s, s->ey, s->hb, &L->exp_down, le * dim * I, n, I)); /* (P, n, dim) */
                }
                if (m->ep) {    /* each choice's slices where every rank finds them (below) */
                        for (size_t j = 0; j < S; j++)
                                for (size_t i = 0; i < n; i++)
                                        memcpy(s->ep_parts + (((size_t)s->rows[i] * K + s->rk[i]) * S + j) * dim,
                                               s->ey + (j * n + i) * dim, dim * sizeof(float));
                        continue;
                }
                for (size_t p = 0; p < P; p++)  /* each routed row once: the rows are distinct */
                        TRY(tsr_backend_scatter_add_rows(be, s->routed + p * cnt, N, dim, s->ey + p * n * dim, s->rows,
                                                         NULL, n));
        }
        if (m->ep) {
                /* Every choice's partials from the rank holding its expert (each entry is
                 * written by one rank, zero on the others: the sum is exact), then per row
                 * and per slice of this rank the choices added in expert order from zero,
                 * as the tensor-parallel sum above adds them: the same bits. */
                if (m->tp_size > 1)
                        TRY(tsr_comm_all_reduce_sum(m->comm, s->ep_parts, N * K * S * dim, NULL));
                for (size_t r = 0; r < N; r++) {
                        const uint32_t *sel = s->sel + r * K;   /* distinct experts */
                        for (size_t t = 0, best = K; t < K; t++) {
                                /* the choice with the next larger expert */
                                size_t prev = best;
                                best = K;
                                for (size_t j = 0; j < K; j++)
                                        if ((prev == K || sel[j] > sel[prev]) && (best == K || sel[j] < sel[best]))
                                                best = j;
                                for (size_t p = 0; p < P; p++) {
                                        size_t slice = (size_t)m->tp_rank * P + p;
                                        const float *src = s->ep_parts + ((r * K + best) * S + slice) * dim;
                                        float *dst = s->routed + p * cnt + r * dim;
                                        for (size_t d = 0; d < dim; d++)
                                                dst[d] += src[d];
                                }
                        }
                }
        }
        if (!m->canonical) {
                TRY(tsr_backend_add(be, s->xb, s->parts, s->routed, cnt));
        } else {
                for (size_t p = 0; p < P; p++)
                        TRY(tsr_backend_add(be, s->parts + p * cnt, s->parts + p * cnt, s->routed + p * cnt, cnt));
                TRY(parts_sum(m, s->xb, s->parts, cnt));
        }
done:
        return st;
}

/* The first block of q's table for layer l that the step reads or writes: 0 for full
 * attention, the block of the first query's chunk start for a chunked table (the engine
 * frees those before it). */
static size_t live_block(const tsr_llama4_kv *kv, size_t l, const tsr_llama_seq *q) {
        uint32_t C = kv->chunk[kv->table[l]];
        return C ? q->past_len / C * C / kv->block_size : 0;
}

/* Attention of one sequence's n query rows (q, out: (n, q_dim)) in the model's local layer
 * l (its KV; the flags are those of global layer shard.first_layer + l).  Full layers:
 * causal over the whole cache.  Chunked layers: the queries of each chunk [cs, cs + C)
 * see the keys cs .. their own position only, i.e. the causal kernel on a view that
 * starts at cs: the block table shifted by cs / block_size when cs is a block boundary
 * (the real configs: C = 8192), else the chunk's rows gathered into one block. */
static tsr_status attend(tsr_backend *be, const tsr_llama4 *m, const tsr_llama4_kv *kv, struct scratch *s,
                         size_t l, const tsr_llama_seq *q, const float *qrows, float *out) {
        const tsr_llama4_config *c = m->cfg;
        size_t H = m->nh, qd = H * c->base.head_dim, kvd = kv->n_kv_heads * kv->head_dim;
        size_t C = c->chunk, bs = kv->block_size;
        float scale = (float)(1.0 / sqrt((double)c->base.head_dim));
        tsr_kv_view view = kv_view(kv, l, q);
        tsr_status st = TSR_OK;

        if (!(c->layer[m->shard.first_layer + l] & TSR_LLAMA4_CHUNKED))
                return tsr_backend_attention(be, out, qrows, &view, q->n, q->past_len, H, scale);
        for (size_t t = 0; t < q->n;) {
                size_t p0 = q->past_len + t, cs = p0 / C * C, cnt = q->n - t;
                tsr_kv_view v2 = view;
                if (cnt > cs + C - p0)
                        cnt = cs + C - p0;
                if (cs % bs == 0) {
                        v2.block_table += cs / bs;
                        v2.n_table -= cs / bs;
                } else {
                        size_t rows = p0 + cnt - cs;
                        /* the rows as stored (fp8: one byte each, bf16 two), and the view says so */
                        size_t eb = tsr_dtype_get_info(kv->dtype)->block_bytes;
                        static const uint32_t zero = 0;
                        for (size_t p = cs; p < cs + rows && st == TSR_OK; p++) {
                                size_t at = ((size_t)view.block_table[p / bs] * bs + p % bs) * kvd * eb;
                                if ((st = tsr_backend_copy(be, (char *)s->ck + (p - cs) * kvd * eb,
                                                           (const char *)kv->k[l] + at, kvd * eb)) == TSR_OK)
                                        st = tsr_backend_copy(be, (char *)s->cv + (p - cs) * kvd * eb,
                                                              (const char *)kv->v[l] + at, kvd * eb);
                        }
                        if (st != TSR_OK)
                                return st;
                        v2 = (tsr_kv_view){.k = s->ck, .v = s->cv, .dtype = kv->dtype, .k_scale = view.k_scale,
                                           .v_scale = view.v_scale, .block_table = &zero, .n_table = 1, .n_blocks = 1,
                                           .block_size = rows, .n_kv_heads = kv->n_kv_heads, .head_dim = kv->head_dim};
                }
                if ((st = tsr_backend_attention(be, out + t * qd, qrows + t * qd, &v2, cnt, p0 - cs, H, scale)) !=
                    TSR_OK)
                        return st;
                t += cnt;
        }
        return st;
}

/* x (rows, dim) = the rows `ids` of the embedding table the model holds (a
 * tensor-parallel rank's vocab_out rows), float32 or kept as stored (embd_q).  A
 * tsr_tp_gather_fn. */
static tsr_status embed_rows(const void *model, tsr_backend *be, float *x, const uint32_t *ids, size_t rows) {
        const tsr_llama4 *m = model;
        return tsr_tp_table_rows(be, x, m->embed, &m->embd_q, m->vocab_out, m->cfg->base.dim, ids, rows);
}

/* logits (rows, vocab) of the normed rows xb (rows, dim): a tensor-parallel rank computes
 * its vocab_out rows of lm_head and the all-gather puts the vocabulary together (tp.h). */
static tsr_status lm_head(const tsr_llama4 *m, tsr_backend *be, float *logits, const float *xb, size_t rows) {
        size_t dim = m->cfg->base.dim, vl = m->vocab_out;
        float *mine;
        tsr_status st;

        if (m->tp_size == 1)
                return mm(be, logits, xb, &m->output, 0, rows, dim, vl);
        if (!(mine = malloc(rows * vl * sizeof(float))))
                return TSR_E_NOMEM;
        st = mm(be, mine, xb, &m->output, 0, rows, dim, vl);
        if (st == TSR_OK)
                st = tsr_tp_gather_vocab(m->comm, m->tp_rank, m->tp_size, m->cfg->base.vocab_size, mine, logits,
                                         rows);
        free(mine);
        return st;
}

/* The stacked forward of n_seqs sequences through the model's layers; arguments already
 * checked.  A pipeline stage (family.h forward_stage, as the Llama's): `in` NULL on the
 * first stage (the embedding runs), else the previous stage's pair x then xb (its last
 * MLP's output, not yet added), which the add_rmsnorm before this stage's first layer
 * joins exactly as in one process; `out` receives that pair on a stage before the last. */
static tsr_status forward(const tsr_llama4 *m, tsr_backend *be, const tsr_llama4_kv *kv, const tsr_llama_seq *seqs,
                          size_t n_seqs, const float *in, float *out, float *logits) {
        const tsr_llama4_config *c = m->cfg;
        size_t dim = c->base.dim, hd = c->base.head_dim, H = m->nh, KVH = m->nkv;     /* the rank's heads */
        size_t qd = H * hd, kvd = KVH * hd, N = 0, chunk_rows = 0, n_out = 0;
        size_t first_layer = m->shard.first_layer, n_local = m->shard.last_layer - first_layer + 1;
        bool last_stage = first_layer + n_local == c->base.n_layers;
        float eps = c->base.rms_eps, *parts;
        struct scratch s;
        tsr_status st;

        size_t logit_rows = 0;
        for (size_t i = 0; i < n_seqs; i++) {
                size_t end = seqs[i].past_len + seqs[i].n;
                N += seqs[i].n;
                if (c->chunk && end > chunk_rows)
                        chunk_rows = end < c->chunk ? end : c->chunk;
                logit_rows += seqs[i].which == TSR_LLAMA_LOGITS_ALL ? seqs[i].n : seqs[i].which != TSR_LLAMA_LOGITS_NONE;
        }
        if ((st = scratch_alloc(&s, m, N, chunk_rows, logit_rows)) != TSR_OK)
                return st;
        /* a row-parallel matmul's partials: the canonical slices', else its output itself */
        parts = m->canonical ? s.parts : s.xb;
        for (size_t i = 0, row = 0; i < n_seqs; i++)
                for (size_t t = 0; t < seqs[i].n; t++, row++) {
                        s.tokens[row] = seqs[i].tokens[t];
                        s.pos[row] = (uint32_t)(seqs[i].past_len + t);
                }
        if (!in) {
                TRY(tsr_tp_embed(m->comm, m->tp_rank, m->tp_size, c->base.vocab_size, dim, s.tokens, N, s.x,
                                 embed_rows, m, be));                                   /* x (N, dim) */
                TRY(tsr_backend_rmsnorm(be, s.xb, s.x, m->layers[0].attn_norm, N, dim, eps));
        } else {        /* the previous stage's x and xb: the add and norm it left to this one */
                TRY(tsr_stage_recv(be, s.x, s.xb, in, N, dim));
                TRY(tsr_backend_add_rmsnorm(be, s.xb, s.x, s.xb, m->layers[0].attn_norm, N, dim, eps));
        }
        for (size_t li = 0; li < n_local; li++) {
                const layer *L = &m->layers[li];
                size_t l = first_layer + li;    /* the global layer: its flags */
                TRY(mm(be, s.q, s.xb, &L->q, 0, N, dim, qd));
                TRY(mm(be, s.k, s.xb, &L->k, 0, N, dim, kvd));
                TRY(mm(be, s.v, s.xb, &L->v, 0, N, dim, kvd));
                if (c->layer[l] & TSR_LLAMA4_ROPE) {
                        TRY(tsr_backend_rope(be, s.q, N, H, hd, s.pos, m->inv_freq, c->base.rope_layout));
                        TRY(tsr_backend_rope(be, s.k, N, KVH, hd, s.pos, m->inv_freq, c->base.rope_layout));
                        if (c->qk_norm) {       /* Llama4TextL2Norm: per head, no weight, after RoPE */
                                TRY(tsr_backend_rmsnorm(be, s.q, s.q, m->ones, N * H, hd, eps));
                                TRY(tsr_backend_rmsnorm(be, s.k, s.k, m->ones, N * KVH, hd, eps));
                        }
                } else if (c->temp_tuning) {
                        /* NoPE: q scaled by log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1, in
                         * float32 as transformers computes it (the absolute position) */
                        for (size_t r = 0; r < N; r++) {
                                float f = log1pf(floorf(((float)s.pos[r] + 1.0f) / c->floor_scale));
                                s.qscale[r] = f * c->attn_scale + 1.0f;
                        }
                        TRY(tsr_backend_gather_rows(be, s.q, s.q, N, qd, NULL, s.qscale, N));   /* in place */
                }
                for (size_t i = 0, row = 0; i < n_seqs; row += seqs[i].n, i++) {
                        /* from the first block the step reads: a chunked table's blocks
                         * before it may be freed (TSR_KV_NULL_BLOCK) */
                        size_t lo = live_block(kv, li, &seqs[i]);
                        tsr_kv_view view = kv_view(kv, li, &seqs[i]);
                        view.block_table += lo;
                        view.n_table -= lo;
                        TRY(tsr_backend_kv_write(be, &view, s.k + row * kvd, s.v + row * kvd, seqs[i].n,
                                                 seqs[i].past_len - lo * kv->block_size));
                        TRY(attend(be, m, kv, &s, li, &seqs[i], s.q + row * qd, s.att + row * qd));
                }
                TRY(mm_parts(m, be, &s, parts, s.att, &L->o, 0, N, qd));
                TRY(parts_sum(m, s.xb, parts, N * dim));
                TRY(tsr_backend_add_rmsnorm(be, s.xb, s.x, s.xb, L->ffn_norm, N, dim, eps));
                if (c->layer[l] & TSR_LLAMA4_MOE) {
                        TRY(moe(m, be, L, &s, N));
                } else {
                        TRY(swiglu(m, be, &s, parts, s.xb, &L->gate, &L->up, &L->down, N, m->mlp));
                        TRY(parts_sum(m, s.xb, parts, N * dim));
                }
                if (li + 1 < n_local) {
                        TRY(tsr_backend_add_rmsnorm(be, s.xb, s.x, s.xb, m->layers[li + 1].attn_norm, N, dim, eps));
                } else if (!last_stage) {       /* the next stage adds and norms (see above) */
                        TRY(tsr_stage_send(be, out, s.x, s.xb, N, dim));
                        goto done;
                } else {
                        TRY(tsr_backend_add(be, s.x, s.x, s.xb, N * dim));
                }
        }
        /* the final norm and the output matrix on the rows whose logits are wanted only */
        for (size_t i = 0, row = 0; i < n_seqs; row += seqs[i].n, i++) {
                size_t first = seqs[i].which == TSR_LLAMA_LOGITS_LAST ? seqs[i].n - 1 : 0;
                size_t rows = seqs[i].which == TSR_LLAMA_LOGITS_NONE ? 0 : seqs[i].n - first;
                if (rows)
                        TRY(tsr_backend_copy(be, s.xb + n_out * dim, s.x + (row + first) * dim,
                                             rows * dim * sizeof(float)));
                n_out += rows;
        }
        if (n_out) {
                TRY(tsr_backend_rmsnorm(be, s.xb, s.xb, m->out_norm, n_out, dim, eps));
                /* on a device: into its memory, then the one download of the step */
                TRY(lm_head(m, be, s.mem ? s.lg : logits, s.xb, n_out));
                if (s.mem)      /* the rows the engine offers answered on the device (answer.h) */
                        TRY(tsr_llama_logits_to_host(be, seqs, n_seqs, logits, s.lg, m->cfg->base.vocab_size));
        }
done:
        scratch_free(&s);
        return st;
}

tsr_status tsr_llama4_reserve(const tsr_llama4 *m, size_t tokens, size_t logit_rows) {
        struct scratch s;
        tsr_status st;
        if (!m)
                return TSR_E_INVAL;
        if (!m->dev || tokens == 0)
                return TSR_OK;
        /* a chunked layer gathers at most one chunk's rows */
        if ((st = scratch_alloc(&s, m, tokens, m->cfg->chunk, logit_rows)) == TSR_OK)
                scratch_free(&s);
        return st;
}

tsr_status tsr_llama4_forward_batch(const tsr_llama4 *m, tsr_backend *be, tsr_llama4_kv *kv, const tsr_llama_seq *seqs,
                                    size_t n_seqs, float *logits) {
        return tsr_llama4_forward_stage(m, be, kv, seqs, n_seqs, NULL, NULL, logits);
}

tsr_status tsr_llama4_forward_stage(const tsr_llama4 *m, tsr_backend *be, tsr_llama4_kv *kv, const tsr_llama_seq *seqs,
                                    size_t n_seqs, const float *in, float *out, float *logits) {
        bool want = false;
        tsr_status st;

        if (!m || !kv || !seqs || n_seqs == 0)
                return TSR_E_INVAL;
        if (kv->n_layers != m->shard.last_layer - m->shard.first_layer + 1 ||
            kv->n_kv_heads != m->nkv || kv->head_dim != m->cfg->base.head_dim)
                return TSR_E_INVAL;     /* a view made for another model */
        for (size_t i = 0; i < n_seqs; i++) {
                const tsr_llama_seq *q = &seqs[i];
                if (!q->tokens || q->n == 0 || !q->block_table ||
                    (q->which != TSR_LLAMA_LOGITS_NONE && q->which != TSR_LLAMA_LOGITS_LAST &&
                     q->which != TSR_LLAMA_LOGITS_ALL))
                        return TSR_E_INVAL;
                if (q->past_len > UINT32_MAX || q->n > UINT32_MAX - q->past_len)
                        return TSR_E_LIMIT;
                if (q->n_table > SIZE_MAX / kv->block_size || q->past_len + q->n > q->n_table * kv->block_size)
                        return TSR_E_INVAL;
                for (size_t t = 0; t < kv->n_tables; t++) {
                        /* a chunked table's entries behind the first query's chunk are
                         * never read (the engine's TSR_KV_NULL_BLOCK) */
                        size_t C = kv->chunk[t], lo = C ? q->past_len / C * C / kv->block_size : 0;
                        for (size_t b = lo; b < q->n_table; b++)
                                if (q->block_table[t * q->n_table + b] >= kv->n_blocks)
                                        return TSR_E_INVAL;
                }
                for (size_t t = 0; t < q->n; t++)
                        if (q->tokens[t] >= m->cfg->base.vocab_size)
                                return TSR_E_INVAL;
                want |= q->which != TSR_LLAMA_LOGITS_NONE;
        }
        /* a stage after the first needs its input, one before the last its output (and
         * makes no logits) */
        if (!tsr_stage_args_ok(&m->shard, m->cfg->base.n_layers, in, out, want, logits))
                return TSR_E_INVAL;
        if ((st = tsr_llama4_check_backend(m, be)) != TSR_OK)
                return st;
        return forward(m, be, kv, seqs, n_seqs, in, out, logits);
}
