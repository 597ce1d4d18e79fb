/* nemotron_h.c - NemotronH weights (through the one loader), state cache and forward
 * (nemotron_h.h).  The family math that has no kernel op (the causal conv, the
 * selective scan, the gated group norm, ReLU², the router) lives here as plain loops
 * with a fixed order per row or per sequence: batch invariance holds by construction.
 * Matmuls, norms, the embedding, attention and the MoE's row gather and weighted
 * scatter-add (gather_rows, scatter_add_rows) go through the backend. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "worker/model/answer.h"
#include "worker/model/device_arrays.h"
#include "worker/model/family.h"
#include "worker/model/nemotron_h.h"
#include "worker/model/tp.h"
#include "worker/parallel/comm.h"

/* One row per weight.  Layers hold only the rows of their block type (the bind answers
 * "no slot" for the others).  Shard rules follow vLLM's nemotron_h.py: in_proj is
 * column-parallel over its z / xBC / dt parts (each split by heads and groups), the
 * conv, A_log, D, dt_bias and the gated norm split with the heads they belong to
 * (COLUMN: along their first dimension), out_proj / o_proj / down projections are
 * row-parallel, the router and its bias are replicated; a routed expert's up / down
 * split as the shared expert's (EXPERT: vLLM's expert parallelism would keep it whole,
 * tsr_nemotron_h_shard_tp splits its columns as vLLM's default MoE does).  The loader
 * reads every tensor whole; tsr_nemotron_h_shard_tp splits them.  The per-expert rows are formatted at load time (expert index inside the name):
 * the "%u" here is the layer, EXPERT_FMT below adds the expert. */
const tsr_tensor_name tsr_nemotron_h_tensors[TSR_NEMOTRON_H_N_TENSORS] = {
        {"token_embd", "token_embd.weight", "backbone.embeddings.weight", false, TSR_SHARD_COLUMN},
        {"norm", "blk.%u.attn_norm.weight", "backbone.layers.%u.norm.weight", true, TSR_SHARD_REPLICATED},
        {"in_proj", "blk.%u.ssm_in.weight", "backbone.layers.%u.mixer.in_proj.weight", true, TSR_SHARD_COLUMN},
        {"conv_w", "blk.%u.ssm_conv1d.weight", "backbone.layers.%u.mixer.conv1d.weight", true, TSR_SHARD_COLUMN},
        {"conv_b", "blk.%u.ssm_conv1d.bias", "backbone.layers.%u.mixer.conv1d.bias", true, TSR_SHARD_COLUMN},
        {"A_log", NULL, "backbone.layers.%u.mixer.A_log", true, TSR_SHARD_COLUMN},
        /* the GGUF stores A = -exp(A_log) itself, (heads, 1) */
        {"ssm_a", "blk.%u.ssm_a", NULL, true, TSR_SHARD_COLUMN},
        {"D", "blk.%u.ssm_d", "backbone.layers.%u.mixer.D", true, TSR_SHARD_COLUMN},
        {"dt_bias", "blk.%u.ssm_dt.bias", "backbone.layers.%u.mixer.dt_bias", true, TSR_SHARD_COLUMN},
        {"gnorm", "blk.%u.ssm_norm.weight", "backbone.layers.%u.mixer.norm.weight", true, TSR_SHARD_COLUMN},
        {"out_proj", "blk.%u.ssm_out.weight", "backbone.layers.%u.mixer.out_proj.weight", true, TSR_SHARD_ROW},
        {"attn_q", "blk.%u.attn_q.weight", "backbone.layers.%u.mixer.q_proj.weight", true, TSR_SHARD_COLUMN},
        {"attn_k", "blk.%u.attn_k.weight", "backbone.layers.%u.mixer.k_proj.weight", true, TSR_SHARD_COLUMN},
        {"attn_v", "blk.%u.attn_v.weight", "backbone.layers.%u.mixer.v_proj.weight", true, TSR_SHARD_COLUMN},
        {"attn_o", "blk.%u.attn_output.weight", "backbone.layers.%u.mixer.o_proj.weight", true, TSR_SHARD_ROW},
        {"router", "blk.%u.ffn_gate_inp.weight", "backbone.layers.%u.mixer.gate.weight", true, TSR_SHARD_REPLICATED},
        {"router_bias", "blk.%u.exp_probs_b.bias", "backbone.layers.%u.mixer.gate.e_score_correction_bias", true,
         TSR_SHARD_REPLICATED},
        {"shared_up", "blk.%u.ffn_up_shexp.weight", "backbone.layers.%u.mixer.shared_experts.up_proj.weight", true,
         TSR_SHARD_COLUMN},
        {"shared_down", "blk.%u.ffn_down_shexp.weight", "backbone.layers.%u.mixer.shared_experts.down_proj.weight",
         true, TSR_SHARD_ROW},
        {"mlp_up", "blk.%u.ffn_up.weight", "backbone.layers.%u.mixer.up_proj.weight", true, TSR_SHARD_COLUMN},
        {"mlp_down", "blk.%u.ffn_down.weight", "backbone.layers.%u.mixer.down_proj.weight", true, TSR_SHARD_ROW},
        {"output_norm", "output_norm.weight", "backbone.norm_f.weight", false, TSR_SHARD_REPLICATED},
        {"output", "output.weight", "lm_head.weight", false, TSR_SHARD_COLUMN},
        /* the GGUF's routed experts in two stacks, [E, I, dim] and [E, dim, I] (the
         * converter stacks the per-expert linears), split per expert after the load */
        {"expert_up_stack", "blk.%u.ffn_up_exps.weight", NULL, true, TSR_SHARD_EXPERT},
        {"expert_down_stack", "blk.%u.ffn_down_exps.weight", NULL, true, TSR_SHARD_EXPERT},
        /* last: the per-expert rows (N_FIXED) */
        {"expert_up", NULL, "backbone.layers.%u.mixer.experts.<e>.up_proj.weight", true, TSR_SHARD_EXPERT},
        {"expert_down", NULL, "backbone.layers.%u.mixer.experts.<e>.down_proj.weight", true, TSR_SHARD_EXPERT},
};

/* The static rows the loader reads as they are (every row but the two per-expert ones). */
#define N_FIXED (TSR_NEMOTRON_H_N_TENSORS - 2)
#define EXPERT_FMT "backbone.layers.%%u.mixer.experts.%u.%s_proj.weight"

/* A linear's weight: float32 as loaded, or its bf16 copy after tsr_nemotron_h_use_bf16
 * (then f is freed, except a tied output, which is the embedding table), or, for a
 * ModelOpt FP8 / NVFP4 checkpoint's quantized linear, q: the fp8_e4m3 / nvfp4 bytes as
 * stored with their weight_scale / input_scale (f and b NULL; --dtype bfloat16 leaves it
 * as it is), or a BF16 checkpoint's linear kept as stored (keep_bf16): q of dtype bf16,
 * not quantized (quantized()). */
typedef struct nh_mat {
        float *f;
        uint16_t *b;
        tsr_tensor q;
} nh_mat;

typedef struct nh_layer {
        float *norm;
        /* 'M' */
        nh_mat in_proj, out_proj;
        float *conv_w, *conv_b, *A_log, *D, *dt_bias, *gnorm;
        float *A;                       /* -exp(A_log), computed once after the load (a GGUF's as stored) */
        /* '*' */
        nh_mat wq, wk, wv, wo;
        /* 'E': the router stays float32 in every dtype (models.md §3.6: transformers'
         * NemotronHTopkRouter and vLLM's GateLinear compute it in float32) */
        float *router, *router_bias;
        nh_mat shared_up, shared_down;
        nh_mat *exp_up, *exp_down;      /* [n_experts] */
        float *stack_up, *stack_down;   /* load only: a GGUF's expert stacks, split into exp_up / exp_down */
        /* An expert-parallel rank of an NVFP4 checkpoint: the max input_scale over every
         * routed expert of the layer, as the file holds them (up, down; all_input_scales),
         * the rank's GEMMs' activation scale; 0 otherwise. */
        float xs_all_up, xs_all_down;
        /* '-' */
        nh_mat mlp_up, mlp_down;
        uint32_t kind_index;            /* among the shard's layers of its kind: its K/V or state arrays */
} nh_layer;

struct tsr_nemotron_h {
        tsr_nemotron_h_config cfg;
        tsr_shard_spec shard;           /* the layers held: all, or a pipeline stage's range */
        float *token_embd, *output_norm;        /* the first stage's, the last stage's (tied: both) */
        /* A BF16 checkpoint's untied embedding kept as stored (keep_bf16; token_embd NULL):
         * the backend's gather widens the rows a step looks up, exactly, on the host or on
         * a device (which holds the bf16 bytes). */
        tsr_tensor embd_q;
        nh_mat output;                  /* output.f == token_embd when tied; NULL before the last stage */
        nh_layer *layers;               /* [n_layers], indexed by the global layer; only the shard's loaded */
        tsr_tensor_name *expert_names;  /* [2 * n_experts]: up, down per expert */
        char *expert_strs;
        bool bf16;                      /* the linears are bf16 (tsr_nemotron_h_use_bf16) */
        bool kept_bf16;                 /* some are a BF16 checkpoint's kept as stored (keep_bf16) */
        /* ModelOpt: the dtype some linears are stored in (nh_mat.q: fp8_e4m3 or nvfp4);
         * TSR_DTYPE_F32 when none is */
        tsr_dtype qdtype;
        /* Tensor parallelism (tsr_nemotron_h_shard_tp): `rank` is the config as this rank
         * holds it (tsr_nemotron_h_config_rank; `cfg` at tp_size 1), which the forward and
         * the state read; vocab_out its lm_head rows.  With `canonical`, every row-parallel
         * matrix holds the rank's canonical K slices (tp.h), so the sums are the same bits
         * at every tp_size. */
        tsr_nemotron_h_config rank;
        uint32_t tp_size, vocab_out;
        bool canonical;
        /* Expert parallelism (tsr_nemotron_h_shard_ep): this rank holds routed experts
         * [e0, e0 + ne) whole (cfg.moe_hidden columns each, down_proj as all
         * TSR_COMM_TREE_LEAVES canonical K slices), the others not at all. */
        bool ep;
        uint32_t tp_rank, e0, ne;
        tsr_comm *comm;                 /* the rank's TP group; NULL at tp_size 1 */
        /* NULL, or the device backend whose memory holds every weight the forward reads
         * (tsr_nemotron_h_to_backend; the router's bias, read by the host's top-k, stays
         * the host's), and the step's activations kept there (scratch_alloc). */
        tsr_backend *dev;
        struct kept_acts *acts;
};

#define N_ACTS 14       /* struct scratch's activation arrays (SCRATCH_ACTS) */

struct kept_acts {
        float *p[N_ACTS];
        size_t bytes[N_ACTS];
};

struct tsr_nemotron_h_cache {
        size_t n_blocks, block_size, n_slots;
        size_t n_attn, n_mamba;
        float **k, **v;                 /* [n_attn]: (n_blocks, block_size, n_kv_heads, head_dim) of
                                         * kv_dtype (fp8: the arrays are bytes) */
        tsr_dtype kv_dtype;             /* float32, bf16 or fp8 (--kv-cache-dtype) */
        const float *k_scale, *v_scale; /* [n_attn], the pool's: fp8's per-layer scales */
        float **conv, **ssm;            /* [n_mamba]: (n_slots, K-1, conv_dim), (n_slots, heads, head_dim, state) */
        bool owned;                     /* the arrays are this cache's (cache_new), else a pool's */
};

/* ---- load -------------------------------------------------------------------------- */

const tsr_nemotron_h_config *tsr_nemotron_h_config_of(const tsr_nemotron_h *m) { return m ? &m->cfg : NULL; }

/* The layer's linears but the routed experts (those are exp_up / exp_down), into
 * w[NH_LAYER_MATS]; a block type's absent ones are zeroed nh_mats.  For the loops that
 * convert or free them all. */
#define NH_LAYER_MATS 10
static void layer_mats(nh_layer *L, nh_mat **w) {
        nh_mat *all[NH_LAYER_MATS] = {&L->in_proj, &L->out_proj,  &L->wq,          &L->wk,     &L->wv,
                                      &L->wo,      &L->shared_up, &L->shared_down, &L->mlp_up, &L->mlp_down};
        memcpy(w, all, sizeof all);
}

/* Whether w's stored weight is a quantized one (ModelOpt), not a BF16 one kept as stored. */
static bool quantized(const nh_mat *w) { return w->q.data && w->q.dtype != TSR_DTYPE_BF16; }

/* Free weight memory: the device's after tsr_nemotron_h_to_backend, else the host's. */
static void release(const tsr_nemotron_h *m, void *p) {
        if (m->dev)
                tsr_backend_mem_free(m->dev, p);
        else
                free(p);
}

static void mat_free(const tsr_nemotron_h *m, nh_mat *w) {
        if (w->f != m->token_embd)      /* a tied output is the embedding, freed once */
                release(m, w->f);
        release(m, w->b);
        release(m, w->q.data);
        *w = (nh_mat){0};
}

void tsr_nemotron_h_free(tsr_nemotron_h **mp) {
        tsr_nemotron_h *m;

        if (!mp || !*mp)
                return;
        m = *mp;
        for (uint32_t l = 0; m->layers && l < m->cfg.n_layers; l++) {
                nh_layer *L = &m->layers[l];
                /* the forward's (on the device after to_backend), then the host's only */
                float *arrays[] = {L->norm, L->conv_w, L->conv_b, L->D, L->dt_bias, L->gnorm, L->A, L->router};
                float *host[] = {L->A_log, L->router_bias, L->stack_up, L->stack_down};
                nh_mat *w[NH_LAYER_MATS];
                for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++)
                        release(m, arrays[i]);
                for (size_t i = 0; i < sizeof host / sizeof host[0]; i++)
                        free(host[i]);
                layer_mats(L, w);
                for (size_t i = 0; i < NH_LAYER_MATS; i++)
                        mat_free(m, w[i]);
                for (uint32_t e = 0; e < m->cfg.n_experts; e++) {
                        if (L->exp_up)
                                mat_free(m, &L->exp_up[e]);
                        if (L->exp_down)
                                mat_free(m, &L->exp_down[e]);
                }
                free(L->exp_up);
                free(L->exp_down);
        }
        free(m->layers);
        mat_free(m, &m->output);
        release(m, m->output_norm);
        release(m, m->token_embd);
        release(m, m->embd_q.data);
        for (size_t i = 0; m->acts && i < N_ACTS; i++)
                tsr_backend_mem_free(m->dev, m->acts->p[i]);
        free(m->acts);
        free(m->expert_names);
        free(m->expert_strs);
        free(m);
        *mp = NULL;
}

static tsr_status tp_check(const tsr_nemotron_h_config *c, uint32_t t, char *err, size_t errlen);
static tsr_status shard(tsr_nemotron_h *m, uint32_t tp_rank, uint32_t tp_size, bool ep, char *err, size_t errlen);

/* A tensor-parallel rank's share of logical tensor `name` (m->shard.tp_size > 1: the
 * rank reads only it from the file; issue #20): the rows and columns shard() keeps of a
 * whole model (split_mamba, split_ffn, the attention's heads, the embedding's and
 * lm_head's vocabulary rows), TSR_LOAD_WHOLE for what every rank holds whole (norms,
 * router) and at tp 1. */
static tsr_load_slice nh_slice(const tsr_nemotron_h *m, const char *name) {
        const tsr_nemotron_h_config *c = &m->cfg;
        uint32_t t = m->shard.tp_size, rk = m->shard.tp_rank;
        if (t <= 1)
                return (tsr_load_slice){0};
        tsr_nemotron_h_config r = tsr_nemotron_h_config_rank(c, t);
        uint64_t P = c->m_head_dim, NS = c->ssm_state, di = tsr_nemotron_h_d_inner(c), gn = (uint64_t)c->n_groups * NS;
        uint64_t hr = r.m_heads, dr = hr * P, gr = (uint64_t)r.n_groups * NS, h0 = rk * hr, x0 = rk * dr;
        bool replicated = c->n_groups % t != 0;         /* one group, every rank's (config_rank) */
        uint64_t g0 = replicated ? 0 : rk * gr;
        uint64_t hd = c->head_dim, qr = (uint64_t)r.n_heads * hd, nkv = r.n_kv_heads;
        uint64_t kv0 = t <= c->n_kv_heads ? rk * nkv : rk / (t / c->n_kv_heads);
        tsr_tp_vocab v = tsr_tp_vocab_of(c->vocab_size, rk, t);
        uint64_t gw = di / c->n_groups;         /* a GGUF's gated norm is (groups, gw): whole groups per rank */
        const tsr_tp_slice_rule rule[] = {
                /* in_proj's rows [z | xBC | dt]: the rank's z, its xBC channels, its heads' dt */
                {"in_proj", {TSR_LOAD_SLICE_ROWS, 5, {{x0, dr}, {di + x0, dr}, {2 * di + g0, gr},
                                                      {2 * di + gn + g0, gr}, {2 * di + 2 * gn + h0, hr}}}},
                /* xBC's channels: the rank's heads' x, its groups' B, then their C */
                {"conv_w", {TSR_LOAD_SLICE_ROWS, 3, {{x0, dr}, {di + g0, gr}, {di + gn + g0, gr}}}},
                {"conv_b", {TSR_LOAD_SLICE_ROWS, 3, {{x0, dr}, {di + g0, gr}, {di + gn + g0, gr}}}},
                {"A_log", {TSR_LOAD_SLICE_ROWS, 1, {{h0, hr}}}},
                {"ssm_a", {TSR_LOAD_SLICE_ROWS, 1, {{h0, hr}}}},
                {"D", {TSR_LOAD_SLICE_ROWS, 1, {{h0, hr}}}},
                {"dt_bias", {TSR_LOAD_SLICE_ROWS, 1, {{h0, hr}}}},
                /* one group across the ranks: a GGUF's (1, di) row, the rank's columns of it */
                {"gnorm", replicated && c->gguf ? (tsr_load_slice){TSR_LOAD_SLICE_COLS, 1, {{x0, dr}}}
                                                : (tsr_load_slice){TSR_LOAD_SLICE_ROWS, 1,
                                                                   {{c->gguf ? x0 / gw : x0, c->gguf ? dr / gw : dr}}}},
                {"out_proj", {TSR_LOAD_SLICE_COLS, 1, {{x0, dr}}}},
                {"attn_q", {TSR_LOAD_SLICE_ROWS, 1, {{rk * qr, qr}}}},
                {"attn_k", {TSR_LOAD_SLICE_ROWS, 1, {{kv0 * hd, nkv * hd}}}},
                {"attn_v", {TSR_LOAD_SLICE_ROWS, 1, {{kv0 * hd, nkv * hd}}}},
                {"attn_o", {TSR_LOAD_SLICE_COLS, 1, {{rk * qr, qr}}}},
                {"expert_up", {TSR_LOAD_SLICE_ROWS, 1, {{rk * r.moe_hidden, r.moe_hidden}}}},
                {"expert_down", {TSR_LOAD_SLICE_COLS, 1, {{rk * r.moe_hidden, r.moe_hidden}}}},
                /* a GGUF's stacks [E, I, dim] / [E, dim, I]: every expert's rows / columns */
                {"expert_up_stack", {TSR_LOAD_SLICE_ROWS, 1, {{rk * r.moe_hidden, r.moe_hidden}}}},
                {"expert_down_stack", {TSR_LOAD_SLICE_COLS, 1, {{rk * r.moe_hidden, r.moe_hidden}}}},
                {"shared_up", {TSR_LOAD_SLICE_ROWS, 1, {{rk * r.shared_hidden, r.shared_hidden}}}},
                {"shared_down", {TSR_LOAD_SLICE_COLS, 1, {{rk * r.shared_hidden, r.shared_hidden}}}},
                {"mlp_up", {TSR_LOAD_SLICE_ROWS, 1, {{rk * r.mlp_hidden, r.mlp_hidden}}}},
                {"mlp_down", {TSR_LOAD_SLICE_COLS, 1, {{rk * r.mlp_hidden, r.mlp_hidden}}}},
                {"output", {TSR_LOAD_SLICE_ROWS, 1, {{v.first, v.n}}}},
                {"token_embd", {TSR_LOAD_SLICE_ROWS, 1, {{v.first, v.n}}}},    /* tsr_tp_embed */
        };
        return tsr_tp_slice_of(rule, sizeof rule / sizeof rule[0], name);
}

/* The routed experts the rank loads: all, or under expert parallelism its range
 * (tsr_tp_expert_range, checked before the load begins; all if it is not valid). */
static void held_experts(const tsr_nemotron_h *m, size_t *e0, size_t *ne) {
        if (!m->shard.expert_parallel || m->shard.tp_size < 2 ||
            tsr_tp_expert_range(m->cfg.n_experts, m->shard.tp_rank, m->shard.tp_size, e0, ne, NULL, 0) != TSR_OK) {
                *e0 = 0;
                *ne = m->cfg.n_experts;
        }
}

/* Where the family's logical tensor `n` of `layer` goes, and its shape; false when the
 * layer's block type has no such tensor. */
static bool nh_bind(void *model, const tsr_tensor_name *n, uint32_t layer, tsr_load_slot *ret) {
        tsr_nemotron_h *m = model;
        const tsr_nemotron_h_config *c = &m->cfg;
        nh_layer *L = n->per_layer ? &m->layers[layer] : NULL;
        char kind = L ? c->pattern[layer] : 0;
        uint64_t dim = c->dim, di = tsr_nemotron_h_d_inner(c), cd = tsr_nemotron_h_conv_dim(c);
        uint64_t qd = (uint64_t)c->n_heads * c->head_dim, kvd = (uint64_t)c->n_kv_heads * c->head_dim;
        /* A pipeline stage holds the embedding on the first stage, the final norm and
         * lm_head on the last (a tied lm_head is the embedding: the last reads it too). */
        bool first = m->shard.first_layer == 0, last = m->shard.last_layer + 1 == c->n_layers;
        /* `mat`: a linear, which a ModelOpt checkpoint may store quantized (its .q); the
         * output matrix and the router are read as float32 only (ModelOpt never quantizes
         * them: models.md §4.1). */
        struct { const char *name; char kind; float **dst; uint64_t rows, cols; nh_mat *mat; } s[] = {
                {"token_embd", 0, first || (last && c->tied_embeddings) ? &m->token_embd : NULL, c->vocab_size, dim},
                {"output_norm", 0, last ? &m->output_norm : NULL, dim, 0},
                /* a BF16 lm_head kept as stored under keep_bf16 (output.q; never quantized) */
                {"output", 0, c->tied_embeddings || !last ? NULL : &m->output.f, c->vocab_size, dim, &m->output},
                {"norm", 'A', L ? &L->norm : NULL, dim, 0},
                {"in_proj", 'M', L ? &L->in_proj.f : NULL, di + cd + c->m_heads, dim, L ? &L->in_proj : NULL},
                /* conv1d.weight is [conv_dim, 1, K] on disk: the loader reads it as (rows, cols). */
                {"conv_w", 'M', L ? &L->conv_w : NULL, cd, c->conv_kernel},
                {"conv_b", 'M', L && c->conv_bias ? &L->conv_b : NULL, cd, 0},
                {"A_log", 'M', L ? &L->A_log : NULL, c->m_heads, 0},
                /* a GGUF's A, D (heads, 1) and gated-norm weight (groups, di / groups): the
                 * same floats in the same order as HF's vectors */
                {"ssm_a", 'M', L ? &L->A : NULL, c->m_heads, 1},
                {"D", 'M', L ? &L->D : NULL, c->m_heads, c->gguf ? 1 : 0},
                {"dt_bias", 'M', L ? &L->dt_bias : NULL, c->m_heads, 0},
                {"gnorm", 'M', L ? &L->gnorm : NULL, c->gguf ? c->n_groups : di, c->gguf ? di / c->n_groups : 0},
                {"out_proj", 'M', L ? &L->out_proj.f : NULL, dim, di, L ? &L->out_proj : NULL},
                {"attn_q", '*', L ? &L->wq.f : NULL, qd, dim, L ? &L->wq : NULL},
                {"attn_k", '*', L ? &L->wk.f : NULL, kvd, dim, L ? &L->wk : NULL},
                {"attn_v", '*', L ? &L->wv.f : NULL, kvd, dim, L ? &L->wv : NULL},
                {"attn_o", '*', L ? &L->wo.f : NULL, dim, qd, L ? &L->wo : NULL},
                {"router", 'E', L ? &L->router : NULL, c->n_experts, dim},
                {"router_bias", 'E', L ? &L->router_bias : NULL, c->n_experts, 0},
                {"shared_up", 'E', L ? &L->shared_up.f : NULL, c->shared_hidden, dim, L ? &L->shared_up : NULL},
                {"shared_down", 'E', L ? &L->shared_down.f : NULL, dim, c->shared_hidden, L ? &L->shared_down : NULL},
                {"mlp_up", '-', L ? &L->mlp_up.f : NULL, c->mlp_hidden, dim, L ? &L->mlp_up : NULL},
                {"mlp_down", '-', L ? &L->mlp_down.f : NULL, dim, c->mlp_hidden, L ? &L->mlp_down : NULL},
        };

        if (strcmp(n->logical, "expert_up_stack") == 0 || strcmp(n->logical, "expert_down_stack") == 0) {
                bool up = n->logical[7] == 'u';
                if (kind != 'E')
                        return false;
                /* a tensor-parallel rank: its columns of every expert; an expert-parallel one:
                 * its routed experts whole */
                size_t e0, ne;
                held_experts(m, &e0, &ne);
                bool ep = ne < c->n_experts;
                *ret = (tsr_load_slot){.dst = up ? &L->stack_up : &L->stack_down, .rows = up ? c->moe_hidden : dim,
                                       .cols = up ? dim : c->moe_hidden, .experts = c->n_experts,
                                       .slice = ep ? (tsr_load_slice){0} : nh_slice(m, n->logical),
                                       .experts_first = ep ? e0 : 0, .experts_n = ep ? ne : 0};
                return true;
        }
        if (m->expert_names && n >= m->expert_names && n < m->expert_names + 2 * (size_t)c->n_experts) {
                size_t i = (size_t)(n - m->expert_names);
                bool up = i % 2 == 0;
                if (kind != 'E')
                        return false;
                nh_mat *w = up ? &L->exp_up[i / 2] : &L->exp_down[i / 2];
                /* an expert-parallel rank reads its routed experts whole, no other's */
                size_t e0, ne;
                held_experts(m, &e0, &ne);
                if (i / 2 < e0 || i / 2 >= e0 + ne)
                        return false;
                tsr_load_slice sl = m->shard.expert_parallel ? (tsr_load_slice){0} : nh_slice(m, n->logical);
                /* a share of a ModelOpt weight is kept as stored too (loader.h) */
                *ret = (tsr_load_slot){.dst = &w->f, .stored = &w->q, .rows = up ? c->moe_hidden : dim,
                                       .cols = up ? dim : c->moe_hidden, .slice = sl};
                return true;
        }
        for (size_t i = 0; i < sizeof s / sizeof s[0]; i++) {
                if (strcmp(s[i].name, n->logical) != 0)
                        continue;
                if (!s[i].dst || (s[i].kind && s[i].kind != 'A' && s[i].kind != kind))
                        return false;
                tsr_load_slice sl = nh_slice(m, n->logical);
                /* an untied embedding may be kept as stored (a tied one: lm_head reads the
                 * float32 table) */
                tsr_tensor *stored = s[i].mat ? &s[i].mat->q
                                     : s[i].dst == &m->token_embd && !c->tied_embeddings ? &m->embd_q : NULL;
                *ret = (tsr_load_slot){.dst = s[i].dst, .stored = stored, .rows = s[i].rows, .cols = s[i].cols,
                                       .slice = sl};
                return true;
        }
        return false;
}

/* The per-expert rows: for expert e, "…experts.<e>.up_proj.weight" then the down one,
 * each with the layer's "%u" left for the loader. */
static tsr_status expert_table(tsr_nemotron_h *m) {
        size_t ne = m->cfg.n_experts, stride = 96;
        char *p;

        if (ne == 0)
                return TSR_OK;
        if (!(m->expert_names = calloc(2 * ne, sizeof *m->expert_names)) ||
            !(m->expert_strs = malloc(2 * ne * stride)))
                return TSR_E_NOMEM;
        p = m->expert_strs;
        for (size_t e = 0; e < ne; e++) {
                for (int up = 1; up >= 0; up--, p += stride) {
                        snprintf(p, stride, EXPERT_FMT, (unsigned)e, up ? "up" : "down");
                        m->expert_names[2 * e + (up ? 0 : 1)] = (tsr_tensor_name){
                                .logical = up ? "expert_up" : "expert_down", .hf = p, .per_layer = true,
                                .shard = TSR_SHARD_EXPERT};
                }
        }
        return TSR_OK;
}

static tsr_status alloc_layers(tsr_nemotron_h *m) {
        const tsr_nemotron_h_config *c = &m->cfg;
        uint32_t counts[256] = {0};

        if (!(m->layers = calloc(c->n_layers, sizeof *m->layers)))
                return TSR_E_NOMEM;
        for (uint32_t l = m->shard.first_layer; l <= m->shard.last_layer; l++) {
                nh_layer *L = &m->layers[l];
                L->kind_index = counts[(unsigned char)c->pattern[l]]++;
                if (c->pattern[l] == 'E' && (!(L->exp_up = calloc(c->n_experts, sizeof *L->exp_up)) ||
                                             !(L->exp_down = calloc(c->n_experts, sizeof *L->exp_down))))
                        return TSR_E_NOMEM;
        }
        return expert_table(m);
}

/* A ModelOpt FP8 / NVFP4 MoE layer's expert GEMM (up or down over the experts held), as
 * vLLM's ModelOptFp8MoEMethod / ModelOptNvFp4FusedMoE hold it: one fused weight, so
 * either every expert is quantized or none (a mix is refused naming the first expert
 * that differs), and ONE activation scale for the GEMM, the max of the experts'
 * input_scale (FP8's process_fp8_input_tensor_strategy_moe: "use the max"; NVFP4's
 * global-scale backends, FlashInfer's, the max over the experts too); each expert keeps
 * its own weight_scale / weight_scale_2 (Nemotron's experts are non-gated: one w13
 * shard, nothing to requantize or pick).  An expert-parallel rank of an FP8 checkpoint
 * takes the max over its own experts only, as vLLM's FusedMoE under expert parallelism
 * registers the input_scale of its local experts alone and then takes the max: the
 * ranks may quantize their experts' inputs differently from one another and from -tp
 * without it.  NVFP4's global-scale backends keep every expert's input scale on every
 * rank (FlashInfer's, `global_sf_num_experts`), so an NVFP4 rank takes the max over all
 * the layer's experts (xs_all_up / xs_all_down, read by all_input_scales): the same
 * scale as -tp without expert parallelism.
 * TSR_OK, or TSR_E_INVAL with `err` naming the source and the tensor. */
/* How the file stores a linear held as `q`, for messages: its safetensors dtype. */
static const char *stored_as(const tsr_tensor *q) {
        return !q->data || q->dtype == TSR_DTYPE_BF16 ? "not quantized"
               : q->dtype == TSR_DTYPE_NVFP4          ? "U8 (NVFP4)"
                                                      : "F8_E4M3";
}

static tsr_status expert_scales(tsr_nemotron_h *m, uint32_t layer, bool up, const char *src, char *err,
                                size_t errlen) {
        nh_layer *L = &m->layers[layer];
        size_t e0, ne;
        bool any = false;
        float xs = 0.0f;

        held_experts(m, &e0, &ne);
        nh_mat *w = (up ? L->exp_up : L->exp_down) + e0;        /* global expert e0 + j at j */
        for (size_t j = 0; j < ne; j++)
                if (quantized(&w[j])) {
                        any = true;
                        xs = fmaxf(xs, w[j].q.scales.input);
                }
        if (!any)
                return TSR_OK;
        if (w[0].q.dtype == TSR_DTYPE_NVFP4 && (up ? L->xs_all_up : L->xs_all_down) > 0)
                xs = up ? L->xs_all_up : L->xs_all_down;        /* the other ranks' experts too */
        for (size_t j = 1; j < ne; j++)
                if (quantized(&w[j]) != quantized(&w[0])) {
                        tsr_errf(err, errlen, "%s: tensor 'backbone.layers.%u.mixer.experts.%zu.%s_proj.weight' is %s "
                                 "but expert %zu's is %s: a MoE layer's experts must be all quantized or none (vLLM "
                                 "fuses them into one weight)", src, layer, e0 + j, up ? "up" : "down",
                                 stored_as(&w[j].q), e0, stored_as(&w[0].q));
                        return TSR_E_INVAL;
                }
        for (size_t j = 0; j < ne; j++)
                w[j].q.scales.input = xs;
        m->qdtype = w[0].q.dtype;
        return TSR_OK;
}

/* A GGUF MoE layer's stacks ([E, I, dim] up, [E, dim, I] down: each expert's matrix as
 * the matmul reads it) into one matrix per expert, as the HF layout loads; the stacks
 * freed.  TSR_E_NOMEM (the experts copied so far stay for tsr_nemotron_h_free). */
static tsr_status split_stacks(const tsr_nemotron_h *m, nh_layer *L) {
        /* what the load read (nh_bind): a tensor-parallel rank its columns of every
         * expert, an expert-parallel one its experts e0 .. e0 + ne - 1 whole */
        const tsr_nemotron_h_config *c = &m->cfg;
        size_t e0, ne, I = c->moe_hidden;
        held_experts(m, &e0, &ne);
        if (m->shard.tp_size > 1 && !m->shard.expert_parallel)
                I = tsr_nemotron_h_config_rank(c, m->shard.tp_size).moe_hidden;
        size_t per = I * c->dim;
        for (size_t j = 0; j < ne; j++) {
                nh_mat *u = &L->exp_up[e0 + j], *d = &L->exp_down[e0 + j];
                if (!(u->f = malloc(per * sizeof(float))) || !(d->f = malloc(per * sizeof(float))))
                        return TSR_E_NOMEM;
                memcpy(u->f, L->stack_up + j * per, per * sizeof(float));
                memcpy(d->f, L->stack_down + j * per, per * sizeof(float));
        }
        free(L->stack_up);
        free(L->stack_down);
        L->stack_up = L->stack_down = NULL;
        return TSR_OK;
}

/* After the tensors: the experts' shared activation scales (expert_scales), whether any
 * linear is fp8, and A = -exp(A_log), as transformers computes it in float32 per call.
 * TSR_E_INVAL (err set) or TSR_E_NOMEM. */
static tsr_status finish_load(tsr_nemotron_h *m, const char *src, char *err, size_t errlen) {
        const tsr_nemotron_h_config *c = &m->cfg;
        tsr_status st;

        for (uint32_t l = m->shard.first_layer; l <= m->shard.last_layer; l++) {
                nh_layer *L = &m->layers[l];
                nh_mat *w[NH_LAYER_MATS];
                layer_mats(L, w);
                for (size_t i = 0; i < NH_LAYER_MATS; i++) {
                        m->kept_bf16 |= w[i]->q.data && !quantized(w[i]);
                        if (quantized(w[i]))
                                m->qdtype = w[i]->q.dtype;
                }
                for (size_t e = 0; c->pattern[l] == 'E' && e < c->n_experts; e++)
                        m->kept_bf16 |= (L->exp_up[e].q.data && !quantized(&L->exp_up[e])) ||
                                        (L->exp_down[e].q.data && !quantized(&L->exp_down[e]));
                if (c->pattern[l] == 'E' && L->stack_up && (st = split_stacks(m, L)) != TSR_OK) {
                        tsr_errf(err, errlen, "%s: out of memory", src);
                        return st;
                }
                if (c->pattern[l] == 'E' && ((st = expert_scales(m, l, true, src, err, errlen)) != TSR_OK ||
                                             (st = expert_scales(m, l, false, src, err, errlen)) != TSR_OK))
                        return st;
                if (c->pattern[l] != 'M' || L->A)       /* a GGUF's A is as stored */
                        continue;
                /* a tensor-parallel rank read its heads' A_log only (nh_slice) */
                uint32_t heads = m->shard.tp_size > 1 ? c->m_heads / m->shard.tp_size : c->m_heads;
                if (!(L->A = malloc(heads * sizeof *L->A))) {
                        tsr_errf(err, errlen, "%s: out of memory", src);
                        return TSR_E_NOMEM;
                }
                for (uint32_t h = 0; h < heads; h++)
                        L->A[h] = -expf(L->A_log[h]);
        }
        if (c->tied_embeddings)
                m->output.f = m->token_embd;    /* NULL before the last stage */
        return TSR_OK;
}

/* An expert-parallel rank of an NVFP4 checkpoint: every routed expert's up / down
 * input_scale of each MoE layer it holds, read from `set` (the rank read only its own
 * experts' tensors), their max into xs_all_up / xs_all_down (expert_scales).  A layer
 * whose experts are not quantized (no input_scale for expert 0) is left alone; a
 * missing or bad scale of another expert is TSR_E_INVAL naming the file and the tensor. */
static tsr_status all_input_scales(tsr_nemotron_h *m, const tsr_safetensors_set *set, char *err, size_t errlen) {
        const tsr_nemotron_h_config *c = &m->cfg;
        size_t e0, ne;
        held_experts(m, &e0, &ne);
        if (ne == c->n_experts)
                return TSR_OK;          /* not expert-parallel: expert_scales sees every expert */
        for (uint32_t l = m->shard.first_layer; l <= m->shard.last_layer; l++) {
                nh_layer *L = &m->layers[l];
                if (c->pattern[l] != 'E' || !L->exp_up[e0].q.data || L->exp_up[e0].q.dtype != TSR_DTYPE_NVFP4)
                        continue;
                for (int up = 0; up < 2; up++) {
                        float xs = 0.0f, v;
                        for (uint32_t e = 0; e < c->n_experts; e++) {
                                char module[160];
                                snprintf(module, sizeof module, "backbone.layers.%u.mixer.experts.%u.%s_proj", l, e,
                                         up ? "up" : "down");
                                tsr_status st = tsr_modelopt_input_scale(set, module, &v, err, errlen);
                                if (st != TSR_OK)
                                        return st;
                                xs = fmaxf(xs, v);
                        }
                        *(up ? &L->xs_all_up : &L->xs_all_down) = xs;
                }
        }
        return TSR_OK;
}

static tsr_status load_from(const tsr_tensor_source *s, tsr_nemotron_h *m, const tsr_shard_spec *spec,
                            tsr_load_progress_fn progress, void *ud, tsr_load_stats *stats, char *err, size_t errlen) {
        tsr_load_stats a = {0}, b = {0};
        tsr_status st;

        /* Two passes of the one loader: the family's fixed rows, then the per-expert rows
         * (names made for this model's expert count). */
        if ((st = tsr_load_tensors(s, tsr_nemotron_h_tensors, N_FIXED, spec, nh_bind, m, progress, ud, &a, err,
                                   errlen)) != TSR_OK)
                return st;
        if (m->expert_names &&
            (st = tsr_load_tensors(s, m->expert_names, 2 * (size_t)m->cfg.n_experts, spec, nh_bind, m, progress,
                                   ud, &b, err, errlen)) != TSR_OK)
                return st;
        if (stats)
                *stats = (tsr_load_stats){.n_tensors = a.n_tensors + b.n_tensors,
                                          .file_bytes = a.file_bytes + b.file_bytes,
                                          .f32_bytes = a.f32_bytes + b.f32_bytes,
                                          .resident_bytes = a.resident_bytes + b.resident_bytes,
                                          .seconds = a.seconds + b.seconds};
        return TSR_OK;
}

tsr_status tsr_nemotron_h_load(const char *dir, const tsr_nemotron_h_config *cfg, const tsr_shard_spec *spec,
                               const tsr_load_opts *opts, tsr_load_progress_fn progress, void *ud,
                               tsr_nemotron_h **ret, tsr_load_stats *stats, char *err, size_t errlen) {
        tsr_safetensors_set *set = NULL;
        tsr_gguf *g = NULL;
        tsr_tensor_source s = {0};
        tsr_nemotron_h *m;
        tsr_status st;

        if (!dir || !ret)
                return TSR_E_INVAL;
        if (!(m = calloc(1, sizeof *m))) {
                tsr_errf(err, errlen, "%s: out of memory", dir);
                return TSR_E_NOMEM;
        }
        m->qdtype = TSR_DTYPE_F32;
        if (cfg)
                m->cfg = *cfg;
        else if ((st = tsr_nemotron_h_config_from_hf(dir, &m->cfg, err, errlen)) != TSR_OK)
                goto fail;
        m->shard = spec ? *spec : tsr_shard_spec_whole(m->cfg.n_layers);
        m->rank = m->cfg;
        m->ne = m->cfg.n_experts;       /* every routed expert (tsr_nemotron_h_shard_ep keeps a range) */
        m->tp_size = 1;
        m->vocab_out = m->cfg.vocab_size;
        if (m->shard.tp_size == 0 || m->shard.tp_rank >= m->shard.tp_size ||
            m->shard.first_layer > m->shard.last_layer || m->shard.last_layer >= m->cfg.n_layers) {
                tsr_errf(err, errlen, "%s: shard tp %u/%u layers %u..%u: a rank below the tensor parallel size and "
                         "a layer range within 0..%u are supported", dir, m->shard.tp_rank,
                         m->shard.tp_size, m->shard.first_layer, m->shard.last_layer,
                         m->cfg.n_layers ? m->cfg.n_layers - 1 : 0);
                st = TSR_E_UNSUPPORTED;
                goto fail;
        }
        /* a tensor-parallel rank reads its share (nh_slice), which needs tp to split it;
         * an expert-parallel one its range of whole experts */
        char why[400];
        size_t e0, ne;
        if (m->shard.tp_size > 1 &&
            ((st = tp_check(&m->cfg, m->shard.tp_size, why, sizeof why)) != TSR_OK ||
             (m->shard.expert_parallel && (st = tsr_tp_expert_range(m->cfg.n_experts, m->shard.tp_rank,
                                                                    m->shard.tp_size, &e0, &ne, why, sizeof why)) !=
                                                  TSR_OK))) {
                tsr_errf(err, errlen, "%s: %s", dir, why);
                goto fail;
        }
        if ((st = alloc_layers(m)) != TSR_OK) {
                tsr_errf(err, errlen, "%s: out of memory", dir);
                goto fail;
        }
        if (m->cfg.gguf) {      /* llama.cpp's nemotron_h / nemotron_h_moe: every tensor widened to float32 */
                if ((st = tsr_gguf_open(dir, &g, err, errlen)) != TSR_OK)
                        goto fail;
                s.g = g;
                s.src = dir;
        } else {
                if ((st = tsr_safetensors_set_open(dir, &set, err, errlen)) != TSR_OK)
                        goto fail;
                s.set = set;
                s.src = tsr_safetensors_set_source(set);
                const tsr_modelopt_config *mo = opts ? opts->modelopt : NULL;
                s.modelopt = mo && mo->algo != TSR_MODELOPT_NONE ? mo : NULL;
                s.keep_bf16 = opts && opts->keep_bf16;
        }
        st = load_from(&s, m, &m->shard, progress, ud, stats, err, errlen);
        if (st == TSR_OK && s.modelopt && s.modelopt->algo == TSR_MODELOPT_NVFP4)
                st = all_input_scales(m, set, err, errlen);
        tsr_safetensors_set_close(&set);
        tsr_gguf_close(&g);
        if (st != TSR_OK)
                goto fail;
        if ((st = finish_load(m, dir, err, errlen)) != TSR_OK)
                goto fail;
        /* a tensor-parallel rank's share: split here, so load never returns half a split */
        if (m->shard.tp_size > 1 &&
            (st = shard(m, m->shard.tp_rank, m->shard.tp_size, m->shard.expert_parallel, err, errlen)) != TSR_OK)
                goto fail;
        *ret = m;
        return TSR_OK;
fail:
        tsr_nemotron_h_free(&m);
        return st;
}

/* ---- bfloat16 -------------------------------------------------------------------------- */

/* Every linear of the model with its element count, into w[] / n[] (up to max); returns
 * how many.  The output matrix first. */
static bool held(const nh_mat *w) { return w->f || w->b || w->q.data; }

/* Every linear the rank holds (in any form: float32, bf16, kept as stored), into w[max],
 * with its element count in n; how many. */
static size_t all_mats(tsr_nemotron_h *m, nh_mat **w, size_t *n, size_t max) {
        /* the rank's counts after a tensor-parallel split (the whole model's before) */
        const tsr_nemotron_h_config *c = &m->rank;
        uint64_t dim = c->dim, di = tsr_nemotron_h_d_inner(c), cd = tsr_nemotron_h_conv_dim(c);
        uint64_t qd = (uint64_t)c->n_heads * c->head_dim, kvd = (uint64_t)c->n_kv_heads * c->head_dim;
        uint64_t I = m->ep ? m->cfg.moe_hidden : c->moe_hidden;       /* a held expert's columns */
        size_t k = 0;

        if (held(&m->output) && k < max) {      /* the last pipeline stage's only */
                w[k] = &m->output;
                n[k++] = (size_t)((uint64_t)m->vocab_out * dim);
        }
        for (uint32_t l = 0; l < c->n_layers; l++) {
                nh_layer *L = &m->layers[l];
                nh_mat *lw[NH_LAYER_MATS];
                uint64_t ln[NH_LAYER_MATS] = {(di + cd + c->m_heads) * dim, dim * di, qd * dim, kvd * dim,
                                              kvd * dim, dim * qd, (uint64_t)c->shared_hidden * dim,
                                              dim * c->shared_hidden, (uint64_t)c->mlp_hidden * dim,
                                              dim * c->mlp_hidden};
                layer_mats(L, lw);
                for (size_t i = 0; i < NH_LAYER_MATS; i++)
                        if (held(lw[i]) && k < max) {
                                w[k] = lw[i];
                                n[k++] = (size_t)ln[i];
                        }
                for (uint32_t e = 0; L->exp_up && e < c->n_experts; e++)
                        for (int up = 1; up >= 0 && k < max; up--) {
                                nh_mat *x = up ? &L->exp_up[e] : &L->exp_down[e];
                                if (!held(x))
                                        continue;
                                w[k] = x;
                                n[k++] = (size_t)(I * dim);
                        }
        }
        return k;
}

/* --dtype bfloat16 (or auto where the runner picks it): the linears (in_proj, out_proj,
 * q/k/v/o, the experts, the shared expert, the dense MLP, lm_head) rounded to bf16 for
 * the backend's bf16 matmul (kernels.h: it rounds each activation row to bf16 too, as
 * vLLM's bf16 activations are at every linear's input); float32 copies freed.  What
 * stays float32 is models.md §3's: the router and its correction bias, A_log (A), D and
 * dt_bias, the conv weights, the norms, the embedding table (exact for a bf16
 * checkpoint), and the recurrent state.  Main thread, after the load; converts
 * everything before it frees anything, so TSR_E_NOMEM leaves the model as it was. */
tsr_status tsr_nemotron_h_use_bf16(tsr_nemotron_h *m) {
        nh_mat **w = NULL;
        size_t *n = NULL, k, max;
        tsr_status st = TSR_E_NOMEM;

        if (!m || m->dev)
                return TSR_E_INVAL;     /* the host arrays are gone after tsr_nemotron_h_to_backend */
        if (m->bf16)
                return TSR_OK;
        max = 1 + (size_t)m->cfg.n_layers * (NH_LAYER_MATS + 2 * (size_t)m->cfg.n_experts);
        if (!(w = malloc(max * sizeof *w)) || !(n = malloc(max * sizeof *n)))
                goto done;
        k = all_mats(m, w, n, max);
        /* One linear at a time, its float32 copy freed once converted (llama.c's
         * tsr_llama_use_bf16 says why); a failure leaves a model only
         * tsr_nemotron_h_free may touch. */
        for (size_t i = 0; i < k; i++) {
                if (!w[i]->f)           /* kept as stored: stays so */
                        continue;
                /* 64-byte aligned, as the other families hold their bf16 copies */
                if (!(w[i]->b = aligned_alloc(64, (n[i] * sizeof(uint16_t) + 63) / 64 * 64)))
                        goto done;
                for (size_t e = 0; e < n[i]; e++)
                        w[i]->b[e] = tsr_f32_to_bf16(w[i]->f[e]);
                if (w[i]->f != m->token_embd)           /* tied: the embedding still reads it */
                        free(w[i]->f);
                w[i]->f = NULL;
        }
        m->bf16 = true;
        st = TSR_OK;
done:
        free(w);
        free(n);
        return st;
}

bool tsr_nemotron_h_is_bf16(const tsr_nemotron_h *m) { return m && m->bf16; }

/* Bytes of a linear of n elements as held: as stored (ModelOpt), bf16 or float32. */
static uint64_t mat_bytes(const nh_mat *w, uint64_t n) {
        return w->q.data ? tsr_tensor_n_bytes(&w->q) : w->b ? n * sizeof(uint16_t) : w->f ? n * sizeof(float) : 0;
}

/* Every array the model holds, at the sizes it holds them (the rank's counts after a
 * tensor- or expert-parallel split): what the load counted for an unsplit model, and
 * less once a split has freed the other ranks' shares. */
uint64_t tsr_nemotron_h_resident_bytes(const tsr_nemotron_h *m) {
        if (!m)
                return 0;
        const tsr_nemotron_h_config *c = &m->cfg, *r = &m->rank;
        uint64_t dim = c->dim, F = sizeof(float), b = 0;
        uint64_t di = tsr_nemotron_h_d_inner(r), cd = tsr_nemotron_h_conv_dim(r), H = r->m_heads;
        uint64_t qd = (uint64_t)r->n_heads * r->head_dim, kvd = (uint64_t)r->n_kv_heads * r->head_dim;
        uint64_t I = m->ep ? c->moe_hidden : r->moe_hidden;

        b += (m->token_embd ? (uint64_t)m->vocab_out * dim * F
                            : m->embd_q.data ? tsr_tensor_n_bytes(&m->embd_q) : 0) + (m->output_norm ? dim * F : 0);
        if (m->output.f != m->token_embd || m->output.b || m->output.q.data)
                b += mat_bytes(&m->output, (uint64_t)m->vocab_out * dim);
        for (uint32_t l = m->shard.first_layer; l <= m->shard.last_layer; l++) {
                const nh_layer *L = &m->layers[l];
                b += L->norm ? dim * F : 0;
                switch (c->pattern[l]) {
                case 'M':
                        b += mat_bytes(&L->in_proj, (di + cd + H) * dim) + mat_bytes(&L->out_proj, dim * di);
                        b += (cd * c->conv_kernel + (L->conv_b ? cd : 0) + 3 * H + di) * F;
                        break;
                case '*':
                        b += mat_bytes(&L->wq, qd * dim) + mat_bytes(&L->wk, kvd * dim) + mat_bytes(&L->wv, kvd * dim) +
                             mat_bytes(&L->wo, dim * qd);
                        break;
                case 'E':
                        b += ((uint64_t)c->n_experts * dim + (L->router_bias ? c->n_experts : 0)) * F;
                        b += mat_bytes(&L->shared_up, (uint64_t)r->shared_hidden * dim) +
                             mat_bytes(&L->shared_down, dim * r->shared_hidden);
                        for (uint32_t e = 0; L->exp_up && e < c->n_experts; e++)
                                b += mat_bytes(&L->exp_up[e], I * dim) + mat_bytes(&L->exp_down[e], dim * I);
                        break;
                default:
                        b += mat_bytes(&L->mlp_up, (uint64_t)r->mlp_hidden * dim) +
                             mat_bytes(&L->mlp_down, dim * r->mlp_hidden);
                        break;
                }
        }
        return b;
}

tsr_status tsr_nemotron_h_check_backend(const tsr_nemotron_h *m, const tsr_backend *be) {
        static const tsr_op needed[] = {TSR_OP_RMSNORM,     TSR_OP_EMBEDDING,   TSR_OP_KV_WRITE,      TSR_OP_ATTENTION,
                                        TSR_OP_ADD,         TSR_OP_RELU_SQ,     TSR_OP_ROUND_BF16,    TSR_OP_MAMBA_MIXER,
                                        TSR_OP_GATHER_ROWS, TSR_OP_SCATTER_ADD_ROWS};
        if (!m || !be)
                return TSR_E_INVAL;
        /* the weights are in the host's memory, or in this device's (tsr_nemotron_h_to_backend);
         * the router's matmul is float32 in every dtype */
        if ((tsr_backend_host_memory(be) ? m->dev != NULL : m->dev != be) ||
            !tsr_backend_supports(be, TSR_OP_MATMUL, TSR_DTYPE_F32) ||
            ((m->bf16 || m->kept_bf16) && !tsr_backend_supports(be, TSR_OP_MATMUL, TSR_DTYPE_BF16)) ||
            !tsr_backend_supports(be, TSR_OP_MATMUL, m->qdtype))
                return TSR_E_UNSUPPORTED;
        for (size_t i = 0; i < sizeof needed / sizeof needed[0]; i++)
                if (!tsr_backend_supports(be, needed[i], TSR_DTYPE_F32))
                        return TSR_E_UNSUPPORTED;
        return TSR_OK;
}

bool tsr_nemotron_h_norm_across(const tsr_nemotron_h_config *c) {
        return c->n_groups == 1 && tsr_nemotron_h_d_inner(c) % TSR_COMM_TREE_LEAVES == 0;
}

/* ---- on a device backend (issue #16) ----------------------------------------------------- */


/* Every array the forward reads from backend memory, onto list.  A tied output is the
 * embedding: not listed (the pointer is set after the move). */
static void dev_arrays(tsr_nemotron_h *m, tsr_dev_list *list) {
        const tsr_nemotron_h_config *c = &m->rank;
        size_t dim = c->dim, di = tsr_nemotron_h_d_inner(c), cd = tsr_nemotron_h_conv_dim(c), H = c->m_heads;
        size_t F = sizeof(float), max = 1 + (size_t)c->n_layers * (NH_LAYER_MATS + 2 * (size_t)c->n_experts);
        nh_mat **w = malloc(max * sizeof *w);
        size_t *cnt = malloc(max * sizeof *cnt);
#define SLOT(p, b) tsr_dev_list_add(list, (void **)&(p), (b))
        if (!w || !cnt) {
                list->nomem = true;
                free(w);
                free(cnt);
                return;
        }
        SLOT(m->token_embd, (size_t)c->vocab_size * dim * F);
        SLOT(m->embd_q.data, m->embd_q.data ? tsr_tensor_n_bytes(&m->embd_q) : 0);    /* as its bf16 bytes */
        SLOT(m->output_norm, dim * F);
        size_t k = all_mats(m, w, cnt, max);
        for (size_t i = 0; i < k; i++) {
                if (w[i]->f != m->token_embd)
                        SLOT(w[i]->f, cnt[i] * F);
                SLOT(w[i]->b, cnt[i] * sizeof(uint16_t));
                SLOT(w[i]->q.data, w[i]->q.data ? tsr_tensor_n_bytes(&w[i]->q) : 0);
        }
        for (uint32_t l = m->shard.first_layer; l <= m->shard.last_layer; l++) {
                nh_layer *L = &m->layers[l];
                SLOT(L->norm, dim * F);
                SLOT(L->conv_w, cd * c->conv_kernel * F);
                SLOT(L->conv_b, cd * F);
                SLOT(L->dt_bias, H * F);
                SLOT(L->A, H * F);
                SLOT(L->D, H * F);
                SLOT(L->gnorm, di * F);
                SLOT(L->router, (size_t)c->n_experts * dim * F);
        }
#undef SLOT
        free(w);
        free(cnt);
}

tsr_status tsr_nemotron_h_to_backend(tsr_nemotron_h *m, tsr_backend *be, char *err, size_t errlen) {
        tsr_status st = TSR_OK;

        if (!m || !be || m->dev)
                return TSR_E_INVAL;
        if (tsr_backend_host_memory(be))
                return TSR_OK;          /* the CPU reads the host arrays */
        bool split = m->tp_size > 1 || m->canonical || m->ep || m->shard.first_layer > 0 ||
                     m->shard.last_layer + 1 < m->cfg.n_layers;
        if ((st = tsr_dev_check(be, "NemotronH", split, m->qdtype, err, errlen)) != TSR_OK)
                return st;
        if (tsr_nemotron_h_count(&m->cfg, 'M') && tsr_nemotron_h_norm_across(&m->cfg)) {
                tsr_errf(err, errlen, "a NemotronH whose Mamba layers have one group (n_groups 1) does not run on "
                         "the %s backend yet (its gated norm is finished on the host)", tsr_backend_name(be));
                return TSR_E_UNSUPPORTED;
        }
        tsr_dev_list l = {0};
        if (!(m->acts = calloc(1, sizeof *m->acts)))
                return TSR_E_NOMEM;
        dev_arrays(m, &l);
        bool tied = m->output.f && m->output.f == m->token_embd;
        if ((st = tsr_dev_list_move(be, &l, err, errlen)) != TSR_OK) {
                free(m->acts);
                m->acts = NULL;
                return st;
        }
        if (tied)
                m->output.f = m->token_embd;
        m->dev = be;
        return TSR_OK;
}

/* ---- tensor parallelism ----------------------------------------------------------------- */

tsr_nemotron_h_config tsr_nemotron_h_config_rank(const tsr_nemotron_h_config *c, uint32_t t) {
        tsr_nemotron_h_config r = *c;

        if (t <= 1)
                return r;
        r.m_heads /= t;
        /* one group that t does not divide (n_groups 1, tp_check): every rank holds it,
         * B and C replicated, as vLLM's extra_groups_for_head_shards */
        r.n_groups = c->n_groups % t ? 1 : c->n_groups / t;
        r.n_heads /= t;
        /* tp above the KV heads: one (replicated) KV head per rank, as vLLM */
        r.n_kv_heads = t <= c->n_kv_heads ? c->n_kv_heads / t : 1;
        r.moe_hidden /= t;
        r.shared_hidden /= t;
        r.mlp_hidden /= t;
        return r;
}

/* Whether tp_size t splits the model (tsr_nemotron_h_shard_tp); else TSR_E_UNSUPPORTED
 * with the first count that does not divide named in err, in vLLM's words where vLLM has
 * them.  A row-parallel input (out_proj's, o_proj's, the experts', the MLP's) must split
 * into the TSR_COMM_TREE_LEAVES canonical slices; only the kinds of layer the pattern has
 * count. */
static tsr_status tp_check(const tsr_nemotron_h_config *c, uint32_t t, char *err, size_t errlen) {
        uint32_t S = TSR_COMM_TREE_LEAVES, di = tsr_nemotron_h_d_inner(c), qd = c->n_heads * c->head_dim;
        const struct { char kind; uint32_t cols; const char *what; } rows[] = {
                {'M', di, "the Mamba output (mamba_num_heads x mamba_head_dim: out_proj's input)"},
                {'*', qd, "the attention output (num_attention_heads x head_dim: o_proj's input)"},
                {'E', c->moe_hidden, "moe_intermediate_size (every routed expert's down_proj input)"},
                {'E', c->shared_hidden, "moe_shared_expert_intermediate_size (the shared expert's down_proj input)"},
                {'-', c->mlp_hidden, "intermediate_size (the dense MLP's down_proj input)"},
        };
        tsr_status st = tsr_tp_check_split(t, c->n_heads, c->n_kv_heads, c->vocab_size, err, errlen);

        if (st != TSR_OK)
                return st;
        if (c->m_heads % t) {
                tsr_errf(err, errlen, "Tensor parallel world size must divide num heads. (mamba_num_heads %u, "
                         "tensor parallel size %u)", c->m_heads, t);
                return TSR_E_UNSUPPORTED;
        }
        if (c->n_groups % t && c->n_groups != 1) {
                tsr_errf(err, errlen, "If tensor parallel world size does not divide num_groups, then num_groups "
                         "must equal 1. (n_groups %u, tensor parallel size %u)", c->n_groups, t);
                return TSR_E_UNSUPPORTED;
        }
        for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
                if (tsr_nemotron_h_count(c, rows[i].kind) && rows[i].cols % S) {
                        tsr_errf(err, errlen, "%s: %u columns must be divisible by %u (the canonical partial sums "
                                 "of a row-parallel layer)", rows[i].what, rows[i].cols, S);
                        return TSR_E_UNSUPPORTED;
                }
        return TSR_OK;
}

/* tp.h's splits of a linear held as float32 (w->f) or kept as stored (a ModelOpt
 * checkpoint's fp8 / nvfp4: w->q). */
static tsr_status nh_keep_row_ranges(nh_mat *w, size_t cols, const size_t (*ranges)[2], size_t n) {
        return tsr_tp_keep_row_ranges_of(&w->f, &w->q, cols, ranges, n);
}

static tsr_status nh_keep_rows(nh_mat *w, size_t rows, size_t cols, size_t first, size_t n) {
        return tsr_tp_keep_rows_of(&w->f, &w->q, rows, cols, first, n);
}

static tsr_status nh_keep_col_slices(nh_mat *w, size_t rows, size_t cols, size_t first, size_t n, size_t ns) {
        return tsr_tp_keep_col_slices_of(&w->f, &w->q, rows, cols, first, n, ns);
}

/* One Mamba layer's weights for rank `rk` of the counts in `r` (the whole model's in
 * `c`); `split` false: out_proj's canonical slices alone. */
static tsr_status split_mamba(nh_layer *L, const tsr_nemotron_h_config *c, const tsr_nemotron_h_config *r,
                              uint32_t rk, size_t ns, bool split, bool sliced) {
        size_t P = c->m_head_dim, NS = c->ssm_state, di = tsr_nemotron_h_d_inner(c), gn = (size_t)c->n_groups * NS;
        size_t hr = r->m_heads, dr = hr * P, gr = (size_t)r->n_groups * NS;
        size_t h0 = rk * hr, x0 = rk * dr, g0 = c->n_groups % (c->m_heads / hr) ? 0 : rk * gr;  /* replicated: 0 */
        /* xBC's channels: the rank's heads' x, its groups' B, then their C */
        const size_t xbc[3][2] = {{x0, dr}, {di + g0, gr}, {di + gn + g0, gr}};
        /* in_proj's rows [z | xBC | dt]: the rank's z, its xBC channels, its heads' dt */
        const size_t in[5][2] = {{x0, dr}, {di + x0, dr}, {2 * di + g0, gr}, {2 * di + gn + g0, gr},
                                 {2 * di + 2 * gn + h0, hr}};
        float **per_head[] = {&L->A_log, &L->D, &L->dt_bias, &L->A};
        tsr_status st;

        if (split && !sliced) {
                if ((st = nh_keep_row_ranges(&L->in_proj, c->dim, in, 5)) ||
                    (st = tsr_tp_keep_row_ranges(&L->conv_w, c->conv_kernel, xbc, 3)) ||
                    (L->conv_b && (st = tsr_tp_keep_row_ranges(&L->conv_b, 1, xbc, 3))) ||
                    (st = tsr_tp_keep_rows(&L->gnorm, 1, di, 1, x0, dr)))
                        return st;
                for (size_t i = 0; i < sizeof per_head / sizeof per_head[0]; i++)
                        if ((st = tsr_tp_keep_rows(per_head[i], 1, c->m_heads, 1, h0, hr)))
                                return st;
        }
        if (sliced)     /* read as the share (nh_slice): only out_proj's canonical order left */
                return nh_keep_col_slices(&L->out_proj, c->dim, dr, 0, dr, ns);
        return nh_keep_col_slices(&L->out_proj, c->dim, di, x0, dr, ns);
}

/* A column-parallel up (hid, dim) and row-parallel down (dim, hid) pair: rank rk's n of
 * the hid columns (`sliced`: read as the share already, down's canonical order left). */
static tsr_status split_ffn(nh_mat *up, nh_mat *down, size_t dim, size_t hid, size_t n, uint32_t rk, size_t ns,
                            bool split, bool sliced) {
        tsr_status st;

        if (sliced)
                return nh_keep_col_slices(down, dim, n, 0, n, ns);
        if (split && (st = nh_keep_rows(up, hid, dim, rk * n, n)))
                return st;
        return nh_keep_col_slices(down, dim, hid, rk * n, n, ns);
}

/* An expert parallel rank's experts: e0 .. e0 + ne - 1 whole (down_proj as all S
 * canonical K slices), every other expert's weights freed. */
static tsr_status keep_experts(nh_layer *L, const tsr_nemotron_h_config *c, size_t e0, size_t ne) {
        tsr_status st = TSR_OK;
        for (size_t e = 0; e < c->n_experts && st == TSR_OK; e++) {
                if (e < e0 || e >= e0 + ne) {
                        free(L->exp_up[e].f);
                        free(L->exp_down[e].f);
                        free(L->exp_up[e].q.data);
                        free(L->exp_down[e].q.data);
                        L->exp_up[e] = L->exp_down[e] = (nh_mat){0};
                        continue;
                }
                st = nh_keep_col_slices(&L->exp_down[e], c->dim, c->moe_hidden, 0, c->moe_hidden,
                                        TSR_COMM_TREE_LEAVES);
        }
        return st;
}

/* A ModelOpt checkpoint's row-parallel linears kept as stored split into canonical K
 * slices of whole blocks (NVFP4's 16 elements): checked for every layer before anything
 * is cut, so a refusal at tp 1 leaves the model as loaded.  `r`: the rank's counts. */
static tsr_status stored_slices_check(const tsr_nemotron_h *m, const tsr_nemotron_h_config *r, uint32_t tp_size,
                                      bool ep, char *err, size_t errlen) {
        const tsr_nemotron_h_config *c = &m->cfg;
        size_t ns = TSR_COMM_TREE_LEAVES / tp_size, e0, ne;
        held_experts(m, &e0, &ne);      /* the first held expert stands for them all */
        for (uint32_t l = m->shard.first_layer; l <= m->shard.last_layer; l++) {
                const nh_layer *L = &m->layers[l];
                /* an expert-parallel rank holds its experts whole: all S slices of each */
                size_t ens = ep ? TSR_COMM_TREE_LEAVES : ns;
                const struct { const nh_mat *w; size_t k, ns; const char *what; } rows[] = {
                        {&L->out_proj, (size_t)r->m_heads * c->m_head_dim / ns, ns, "out_proj"},
                        {&L->wo, (size_t)r->n_heads * c->head_dim / ns, ns, "o_proj"},
                        {&L->shared_down, r->shared_hidden / ns, ns, "the shared expert's down_proj"},
                        {&L->mlp_down, r->mlp_hidden / ns, ns, "down_proj"},
                        {L->exp_down ? L->exp_down + e0 : NULL, (ep ? c->moe_hidden : r->moe_hidden) / ens, ens,
                         "the experts' down_proj"},
                };
                for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
                        tsr_status st = tsr_tp_check_stored_slice(rows[i].w ? &rows[i].w->q : NULL, rows[i].k,
                                                                  rows[i].ns, rows[i].what, l, err, errlen);
                        if (st != TSR_OK)
                                return st;
                }
        }
        return TSR_OK;
}

/* tsr_nemotron_h_shard_tp, and with `ep` tsr_nemotron_h_shard_ep: the routed experts
 * whole per rank instead of a share of each. */
static tsr_status shard(tsr_nemotron_h *m, uint32_t tp_rank, uint32_t tp_size, bool ep, char *err, size_t errlen) {
        const tsr_nemotron_h_config *c;
        tsr_nemotron_h_config r;
        size_t dim, hd, ns, nkv, kv0, E, e0 = 0, ne = 0;
        bool split;
        tsr_status st = TSR_OK;

        /* read as the rank's share (the load's tp spec): the load's own call splits it,
         * a later one for that rank has nothing left to do; the splits below then only
         * put the row-parallel columns in the canonical order */
        bool done, sliced = m && m->shard.tp_size > 1;
        if (!m || (st = tsr_tp_shard_begin(&m->shard, m->canonical, tp_rank, tp_size, ep, &done, err, errlen)) !=
                          TSR_OK)
                return m ? st : TSR_E_INVAL;
        if (done)
                return TSR_OK;
        c = &m->cfg;
        if ((st = tp_check(c, tp_size, err, errlen)) != TSR_OK)
                return st;
        if (m->bf16) {
                tsr_errf(err, errlen, "tensor parallelism needs float32 weights (--dtype float32)");
                return TSR_E_UNSUPPORTED;
        }
        E = c->n_experts;
        if (ep && (st = tsr_tp_expert_range(E, tp_rank, tp_size, &e0, &ne, err, errlen)) != TSR_OK)
                return st;
        /* quantized experts loaded whole share the max input scale of all of them
         * (expert_scales); an expert-parallel rank's is its own experts' max, so it must
         * be loaded as that rank (the worker always does) */
        for (uint32_t l = m->shard.first_layer; ep && !sliced && l <= m->shard.last_layer; l++)
                if (c->pattern[l] == 'E' && quantized(&m->layers[l].exp_up[0])) {
                        tsr_errf(err, errlen, "expert parallelism of quantized experts needs the model loaded as "
                                 "the rank (tsr_shard_spec.expert_parallel), not loaded whole and split");
                        return TSR_E_UNSUPPORTED;
                }
        r = tsr_nemotron_h_config_rank(c, tp_size);
        if ((st = stored_slices_check(m, &r, tp_size, ep, err, errlen)) != TSR_OK)
                return st;
        dim = c->dim, hd = c->head_dim, ns = TSR_COMM_TREE_LEAVES / tp_size, nkv = r.n_kv_heads;
        /* tp > KV heads: each KV head is replicated on tp / n_kv_heads ranks (vLLM) */
        kv0 = tp_size <= c->n_kv_heads ? tp_rank * nkv : tp_rank / (tp_size / c->n_kv_heads);
        tsr_tp_vocab v = tsr_tp_vocab_of(c->vocab_size, tp_rank, tp_size);
        split = tp_size > 1;    /* tp 1: the canonical K slices alone */
        for (uint32_t l = m->shard.first_layer; l <= m->shard.last_layer && st == TSR_OK; l++) {
                nh_layer *L = &m->layers[l];
                size_t qr = (size_t)r.n_heads * hd;
                switch (c->pattern[l]) {
                case 'M':
                        st = split_mamba(L, c, &r, tp_rank, ns, split, sliced);
                        break;
                case '*':
                        if (sliced) {
                                st = nh_keep_col_slices(&L->wo, dim, qr, 0, qr, ns);
                                break;
                        }
                        if (split && ((st = nh_keep_rows(&L->wq, c->n_heads * hd, dim, tp_rank * qr, qr)) ||
                                      (st = nh_keep_rows(&L->wk, c->n_kv_heads * hd, dim, kv0 * hd, nkv * hd)) ||
                                      (st = nh_keep_rows(&L->wv, c->n_kv_heads * hd, dim, kv0 * hd, nkv * hd))))
                                break;
                        st = nh_keep_col_slices(&L->wo, dim, c->n_heads * hd, tp_rank * qr, qr, ns);
                        break;
                case 'E':
                        if (ep)
                                st = keep_experts(L, c, e0, ne);
                        for (uint32_t e = 0; !ep && e < c->n_experts && st == TSR_OK; e++)
                                st = split_ffn(&L->exp_up[e], &L->exp_down[e], dim, c->moe_hidden, r.moe_hidden,
                                               tp_rank, ns, split, sliced);
                        if (st == TSR_OK)
                                st = split_ffn(&L->shared_up, &L->shared_down, dim, c->shared_hidden, r.shared_hidden,
                                               tp_rank, ns, split, sliced);
                        break;
                default:
                        st = split_ffn(&L->mlp_up, &L->mlp_down, dim, c->mlp_hidden, r.mlp_hidden, tp_rank, ns, split,
                                       sliced);
                        break;
                }
        }
        /* the embedding and lm_head by vocabulary rows (vocabulary-parallel, a tied table
         * once), those kept as stored (BF16) too; read as the share, they are already the
         * rank's */
        tsr_load_slice vocab_rows = {TSR_LOAD_SLICE_ROWS, 1, {{v.first, v.n}}};
        if (st == TSR_OK && split && !sliced)
                st = tsr_tp_keep_vocab_rows(&m->output.f, &m->token_embd, c->vocab_size, dim, v.first, v.n);
        if (st == TSR_OK && split && !sliced && m->output.q.data)
                st = tsr_load_stored_slice(&m->output.q, &vocab_rows);
        if (st == TSR_OK && split && !sliced && m->embd_q.data)
                st = tsr_load_stored_slice(&m->embd_q, &vocab_rows);
        if (st != TSR_OK) {
                tsr_errf(err, errlen, "out of memory while splitting the weights for tensor parallelism");
                return st;      /* the model is half split: the caller frees it */
        }
        if (ep)         /* vLLM logs the same per EP rank ("Local/global number of experts") */
                log_info("expert parallel rank %u of %u: routed experts %zu..%zu of %zu (%zu local)", tp_rank, tp_size,
                         e0, e0 + ne - 1, E, ne);
        m->rank = r;
        m->tp_size = tp_size;
        m->tp_rank = tp_rank;
        m->vocab_out = split ? (uint32_t)v.n : c->vocab_size;
        m->canonical = true;
        m->ep = ep;
        m->e0 = ep ? (uint32_t)e0 : 0;
        m->ne = ep ? (uint32_t)ne : c->n_experts;
        return TSR_OK;
}

tsr_status tsr_nemotron_h_shard_tp(tsr_nemotron_h *m, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen) {
        return shard(m, tp_rank, tp_size, false, err, errlen);
}

tsr_status tsr_nemotron_h_shard_ep(tsr_nemotron_h *m, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen) {
        return shard(m, tp_rank, tp_size, true, err, errlen);
}

void tsr_nemotron_h_set_comm(tsr_nemotron_h *m, tsr_comm *comm) {
        if (m)
                m->comm = comm;
}

/* ---- state cache -------------------------------------------------------------------- */

static size_t conv_elems(const tsr_nemotron_h_config *c) {
        return (size_t)(c->conv_kernel - 1) * tsr_nemotron_h_conv_dim(c);
}
static size_t ssm_elems(const tsr_nemotron_h_config *c) {
        return (size_t)c->m_heads * c->m_head_dim * c->ssm_state;
}

/* Layers of one kind among first .. last. */
static uint32_t count_in(const tsr_nemotron_h_config *c, char kind, uint32_t first, uint32_t last) {
        uint32_t n = 0;
        for (uint32_t l = first; l <= last && l < c->n_layers; l++)
                n += c->pattern[l] == kind;
        return n;
}

uint64_t tsr_nemotron_h_slot_bytes(const tsr_nemotron_h_config *c) {
        return (uint64_t)tsr_nemotron_h_count(c, 'M') * (conv_elems(c) + ssm_elems(c)) * sizeof(float);
}

void tsr_nemotron_h_cache_free(tsr_nemotron_h_cache **cp) {
        tsr_nemotron_h_cache *c;

        if (!cp || !*cp)
                return;
        c = *cp;
        for (size_t i = 0; c->owned && c->k && i < c->n_attn; i++) {
                free(c->k[i]);
                free(c->v[i]);
        }
        for (size_t i = 0; c->owned && c->conv && i < c->n_mamba; i++) {
                free(c->conv[i]);
                free(c->ssm[i]);
        }
        if (c->owned) {         /* else the per-layer tables are the pool's */
                free(c->k);
                free(c->v);
                free(c->conv);
                free(c->ssm);
        }
        free(c);
        *cp = NULL;
}

tsr_status tsr_nemotron_h_cache_new(const tsr_nemotron_h *m, size_t n_blocks, size_t block_size, size_t n_slots,
                                    tsr_nemotron_h_cache **ret) {
        const tsr_nemotron_h_config *cfg;
        tsr_nemotron_h_cache *c;
        size_t kv_row, kv_elems;

        if (!m || !ret || m->dev)       /* host arrays: a device model binds a pool in its memory */
                return TSR_E_INVAL;
        cfg = &m->rank;         /* the rank's KV heads, conv channels and SSM heads */
        if (!(c = calloc(1, sizeof *c)))
                return TSR_E_NOMEM;
        c->owned = true;
        c->n_blocks = n_blocks;
        c->block_size = block_size;
        c->n_slots = n_slots;
        c->n_attn = count_in(cfg, '*', m->shard.first_layer, m->shard.last_layer);
        c->n_mamba = count_in(cfg, 'M', m->shard.first_layer, m->shard.last_layer);
        if ((c->n_attn && (n_blocks == 0 || block_size == 0)) || (c->n_mamba && n_slots == 0)) {
                free(c);
                return TSR_E_INVAL;
        }
        kv_row = (size_t)cfg->n_kv_heads * cfg->head_dim;
        if (c->n_attn && (n_blocks > SIZE_MAX / block_size || n_blocks * block_size > SIZE_MAX / 4 / kv_row)) {
                free(c);
                return TSR_E_LIMIT;
        }
        kv_elems = n_blocks * block_size * kv_row;
        if (!(c->k = calloc(c->n_attn + 1, sizeof *c->k)) || !(c->v = calloc(c->n_attn + 1, sizeof *c->v)) ||
            !(c->conv = calloc(c->n_mamba + 1, sizeof *c->conv)) || !(c->ssm = calloc(c->n_mamba + 1, sizeof *c->ssm)))
                goto nomem;
        for (size_t i = 0; i < c->n_attn; i++)
                if (!(c->k[i] = calloc(kv_elems, sizeof(float))) || !(c->v[i] = calloc(kv_elems, sizeof(float))))
                        goto nomem;
        for (size_t i = 0; i < c->n_mamba; i++)
                if (!(c->conv[i] = calloc(n_slots * conv_elems(cfg) + 1, sizeof(float))) ||
                    !(c->ssm[i] = calloc(n_slots * ssm_elems(cfg), sizeof(float))))
                        goto nomem;
        *ret = c;
        return TSR_OK;
nomem:
        tsr_nemotron_h_cache_free(&c);
        return TSR_E_NOMEM;
}

/* The state's dtype, in every weight dtype: float32.  vLLM keeps the SSM state in
 * mamba_ssm_cache_dtype (config.json: "float32" in the real checkpoints; another value
 * is refused by the config reader) and the conv state in the model dtype (bf16 under
 * mamba_cache_dtype auto).  We keep the conv state float32 too, because (1) it holds
 * raw in_proj outputs, which our bf16 matmul returns in float32: rounding only the rows
 * that cross a chunk boundary would make a chunked prefill differ from a whole one,
 * breaking the bitwise chunk invariance; (2) the engine's state group has one dtype for
 * both arrays (worker/engine/kv_pool.h) and the slots are planned (main.c) before the
 * weight dtype is chosen; (3) it is small: (K-1) x conv_dim per layer against the SSM
 * state's heads x head_dim x state (3.4% of a Nemotron-3-Nano slot), so bf16 would save
 * 1.7% of the slot.  The attention K/V are float32 as in the other families on the CPU
 * backend. */
size_t tsr_nemotron_h_kv_groups(const tsr_nemotron_h_config *whole, uint32_t first, uint32_t last, uint32_t tp_size,
                                tsr_kv_group *out, size_t max) {
        tsr_nemotron_h_config rank = tsr_nemotron_h_config_rank(whole, tp_size);
        const tsr_nemotron_h_config *c = &rank;
        uint32_t n_attn = count_in(c, '*', first, last), n_mamba = count_in(c, 'M', first, last);
        size_t n = 0;

        if (n_attn && n < max)
                out[n++] = (tsr_kv_group){.kind = TSR_KV_FULL_ATTENTION, .n_layers = n_attn,
                                          .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim,
                                          .dtype = TSR_DTYPE_F32};
        if (n_mamba && n < max)
                out[n++] = (tsr_kv_group){.kind = TSR_KV_MAMBA_STATE, .n_layers = n_mamba,
                                          .dtype = TSR_DTYPE_F32, .conv_elems = conv_elems(c),
                                          .ssm_elems = ssm_elems(c)};
        return n;
}

tsr_status tsr_nemotron_h_cache_bind(const tsr_nemotron_h *m, tsr_kv_pool *pool, tsr_nemotron_h_cache **ret) {
        tsr_kv_group want[TSR_KV_GROUPS_MAX];
        tsr_nemotron_h_cache *c;
        size_t n;

        if (!m || !pool || !ret)
                return TSR_E_INVAL;
        n = tsr_nemotron_h_kv_groups(&m->cfg, m->shard.first_layer, m->shard.last_layer, m->tp_size, want,
                                     TSR_KV_GROUPS_MAX);
        if (pool->n_groups != n)
                return TSR_E_INVAL;
        for (size_t i = 0; i < n; i++) {
                const tsr_kv_group *g = &pool->groups[i].spec;
                /* the attention group may be bf16 or fp8 (the runner's --kv-cache-dtype) */
                bool dtype_ok = tsr_kv_group_paged(g) && tsr_dtype_is_kv(g->dtype) && pool->groups[i].k_scale &&
                                pool->groups[i].v_scale;
                if (g->kind != want[i].kind || g->n_layers != want[i].n_layers ||
                    (g->dtype != want[i].dtype && !dtype_ok) ||
                    g->n_kv_heads != want[i].n_kv_heads || g->head_dim != want[i].head_dim ||
                    g->conv_elems != want[i].conv_elems || g->ssm_elems != want[i].ssm_elems)
                        return TSR_E_INVAL;
        }
        if (!(c = calloc(1, sizeof *c)))
                return TSR_E_NOMEM;
        c->n_blocks = (size_t)pool->n_blocks;
        c->block_size = pool->block_size;
        c->n_slots = pool->n_slots;
        c->n_attn = count_in(&m->cfg, '*', m->shard.first_layer, m->shard.last_layer);
        c->n_mamba = count_in(&m->cfg, 'M', m->shard.first_layer, m->shard.last_layer);
        for (size_t i = 0; i < n; i++) {
                if (want[i].kind == TSR_KV_MAMBA_STATE) {
                        c->conv = (float **)pool->groups[i].k;
                        c->ssm = (float **)pool->groups[i].v;
                } else {
                        c->k = (float **)pool->groups[i].k;
                        c->v = (float **)pool->groups[i].v;
                        c->kv_dtype = pool->groups[i].spec.dtype;
                        c->k_scale = pool->groups[i].k_scale;
                        c->v_scale = pool->groups[i].v_scale;
                }
        }
        *ret = c;
        return TSR_OK;
}

/* ---- forward ------------------------------------------------------------------------- */

/* Scratch for one batched forward of N rows.  The activations (x .. lg) live in the
 * memory of the model's device (`mem`, tsr_nemotron_h_to_backend: kept for the model's
 * life) or the host's; the sequences, the routing and the router logits the host's top-k
 * reads (rlh) in the host's. */
struct scratch {
        tsr_backend *mem;               /* NULL: every array is host memory */
        float *x, *xb, *out;            /* (N, dim) */
        float *proj;                    /* (N, max(in_proj rows, q+2kv, E)) */
        float *y;                       /* (N, max(d_inner, q_dim)) */
        float *hid, *hid2;              /* (N, max hidden) */
        float *exp_in;                  /* (N, dim): the rows routed to one expert */
        /* (P, N, dim), P = n_parts: a row-parallel matmul's partials (the canonical K
         * slices'; P = 1 when the model is not canonical): one expert's rows', then the
         * shared expert's (ey); out_proj's, o_proj's, the MLP's and the shared expert's
         * (parts); the routed experts' sum (routed) */
        float *ey, *parts, *routed;
        float *slice;                   /* canonical: (N, widest row-parallel K) one K slice */
        /* one gated-norm group across the model (n_groups 1): each row's sums of squares
         * over the S / tp canonical channel slices this rank holds (leaves, leaf-major:
         * (S / tp, N)), then the row's whole sum (ss, (N,), host) */
        float *leaves;
        float *lg;                      /* on a device: (logit rows, vocab_out) logits before their download */
        float *rlh;                     /* (N, E) the router logits on the host: proj itself there */
        float *ss;
        tsr_mamba_seq *mseqs;           /* (n_seqs,) the sequences as the mixer op takes them */
        float *rs, *rsc, *gscore;       /* (E,), (E,), (n_group,) one row's router scores */
        bool *gsel, *taken;             /* (n_group,), (E,) */
        uint32_t *top;                  /* (N, top_k) chosen experts */
        float *topw;                    /* (N, top_k) their weights */
        uint32_t *rows;                 /* (N,) the rows routed to one expert */
        float *rowsw;                   /* (N,) */
        /* expert parallelism: (N,) which of its top_k choices each routed row is, and
         * (N, top_k, S, dim) every choice's down_proj partials per canonical slice (not
         * yet weighted), this rank's experts' filled, the others' zero, all-reduced */
        uint32_t *rk;
        float *ep_parts;
};

/* The activation arrays of s, for allocating and freeing them alike. */
#define SCRATCH_ACTS(s)                                                                                  \
        {&(s)->x,   &(s)->xb, &(s)->out,    &(s)->proj,  &(s)->y,     &(s)->hid,    &(s)->hid2,         \
         &(s)->exp_in, &(s)->ey, &(s)->parts, &(s)->routed, &(s)->slice, &(s)->leaves, &(s)->lg}

static void scratch_free(struct scratch *s) {
        float **acts[] = SCRATCH_ACTS(s);
        for (size_t i = 0; !s->mem && i < sizeof acts / sizeof acts[0]; i++)
                free(*acts[i]);         /* on a device they are the model's, kept */
        if (s->rlh != s->proj)
                free(s->rlh);
        void *p[] = {s->ss, s->mseqs, s->rs, s->rsc, s->gscore, s->gsel, s->taken, s->top,
                     s->topw, s->rows, s->rowsw, s->rk, s->ep_parts};
        for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
                free(p[i]);
}

static size_t max3(size_t a, size_t b, size_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* Partials of a row-parallel matmul: the rank's canonical K slices, or the one product. */
static size_t n_parts(const tsr_nemotron_h *m) { return m->canonical ? TSR_COMM_TREE_LEAVES / m->tp_size : 1; }

/* Scratch for N rows of n_seqs sequences at the rank's sizes (m->rank), logit_rows rows of
 * logits (a device's only), in the model's memory. */
static tsr_status scratch_alloc(struct scratch *s, const tsr_nemotron_h *m, size_t N, size_t n_seqs,
                                size_t logit_rows) {
        const tsr_nemotron_h_config *c = &m->rank;
        size_t dim = c->dim, di = tsr_nemotron_h_d_inner(c), cd = tsr_nemotron_h_conv_dim(c), P = n_parts(m);
        size_t qd = (size_t)c->n_heads * c->head_dim, kvd = (size_t)c->n_kv_heads * c->head_dim;
        size_t proj = max3(di + cd + c->m_heads, qd + 2 * kvd, c->n_experts);
        size_t hid = max3(m->ep ? m->cfg.moe_hidden : c->moe_hidden, c->shared_hidden, c->mlp_hidden);
        size_t tk = c->top_k ? c->top_k : 1, S = TSR_COMM_TREE_LEAVES, E = c->n_experts;

        *s = (struct scratch){.mem = m->dev};
        if (N > SIZE_MAX / sizeof(float) / (S * dim + proj + hid) || logit_rows > SIZE_MAX / sizeof(float) / m->vocab_out)
                return TSR_E_LIMIT;
        /* the activations, in the order of SCRATCH_ACTS (floats; at least one each); the
         * widest K of a row-parallel matmul (slice): out_proj's, o_proj's, the experts'
         * and the MLP's */
        size_t n_acts[] = {N * dim,  N * dim,  N * dim,  N * proj, N * (di > qd ? di : qd), N * hid, N * hid,
                           N * dim,  (m->ep ? S : P) * N * dim, P * N * dim, P * N * dim,
                           m->canonical ? N * max3(di, qd, hid) : 1, N * S, m->dev ? logit_rows * m->vocab_out : 1};
        float **acts[] = SCRATCH_ACTS(s);
        _Static_assert(sizeof n_acts / sizeof n_acts[0] == N_ACTS, "one size per activation array");
        if (tsr_acts_bind(s->mem, s->mem ? m->acts->p : NULL, s->mem ? m->acts->bytes : NULL, acts, n_acts, N_ACTS) !=
            TSR_OK) {
                scratch_free(s);
                return TSR_E_NOMEM;
        }
#define A(p, n) ((p) = malloc(((n) + 1) * sizeof *(p)))  /* + 1: never malloc(0) */
        s->rlh = s->mem ? NULL : s->proj;
        if ((s->mem && !A(s->rlh, N * E)) || !A(s->ss, N) || !A(s->mseqs, n_seqs) || !A(s->rs, E) ||
            !A(s->rsc, E) || !A(s->gscore, c->n_group) || !A(s->gsel, c->n_group) || !A(s->taken, E) ||
            !A(s->top, N * tk) || !A(s->topw, N * tk) || !A(s->rows, N) || !A(s->rowsw, N) || !A(s->rk, N) ||
            (m->ep && !A(s->ep_parts, N * tk * S * dim))) {
                scratch_free(s);
                return TSR_E_NOMEM;
        }
#undef A
        return TSR_OK;
}

/* Size the kept activations for a step of `tokens` rows and `logit_rows` rows of logits
 * (a device model's; nothing on the host). */
tsr_status tsr_nemotron_h_reserve(const tsr_nemotron_h *m, size_t tokens, size_t logit_rows) {
        struct scratch s;
        tsr_status st;
        if (!m)
                return TSR_E_INVAL;
        if (!m->dev || tokens == 0)
                return TSR_OK;
        if ((st = scratch_alloc(&s, m, tokens, 1, logit_rows)) == TSR_OK)
                scratch_free(&s);
        return st;
}

/* W (d, n) @ x (rows, n) -> out (rows, d), in the dtype the model holds W in. */
static tsr_status mm(tsr_backend *be, float *out, const float *x, const nh_mat *w, size_t rows, size_t n, size_t d) {
        if (quantized(w))       /* ModelOpt FP8 / NVFP4: W8A8 / W4A4 with the weight's static scales */
                return tsr_backend_matmul_scaled(be, out, x, w->q.data, w->q.dtype, &w->q.scales, rows, n, d);
        if (w->q.data)          /* a BF16 checkpoint's, kept as stored */
                return tsr_backend_matmul(be, out, x, w->q.data, TSR_DTYPE_BF16, rows, n, d);
        if (w->b)
                return tsr_backend_matmul(be, out, x, w->b, TSR_DTYPE_BF16, rows, n, d);
        return tsr_backend_matmul(be, out, x, w->f, TSR_DTYPE_F32, rows, n, d);
}

/* A row-parallel W (dim, k) @ x (rows, k), x the rank's k columns: its n_parts partials
 * into parts (n_parts, rows, dim), the one product unless the model is canonical, then
 * one per K slice (tp.h). */
static tsr_status mm_parts(const tsr_nemotron_h *m, tsr_backend *be, struct scratch *s, float *parts, const float *x,
                           const nh_mat *w, size_t rows, size_t k) {
        if (!m->canonical)
                return mm(be, parts, x, w, rows, k, m->cfg.dim);
        if (w->q.data)
                return tsr_tp_row_partials(be, parts, s->slice, x, w->q.data, w->q.dtype, &w->q.scales, rows, k,
                                           m->cfg.dim, n_parts(m));
        return tsr_tp_row_partials(be, parts, s->slice, x, w->b ? (const void *)w->b : (const void *)w->f,
                                   w->b ? TSR_DTYPE_BF16 : TSR_DTYPE_F32, NULL, rows, k, m->cfg.dim, n_parts(m));
}

/* out (count,) = the partials parts (n_parts, count) summed over the rank's slices and
 * the TP group (R7); nothing when the model is not canonical (then parts is out). */
static tsr_status parts_sum(const tsr_nemotron_h *m, float *out, const float *parts, size_t count) {
        return m->canonical ? tsr_tp_row_reduce(m->comm, m->tp_size, parts, n_parts(m), out, count) : TSR_OK;
}

/* A row-parallel matmul whole: W (dim, k) @ x (rows, k) -> s->out (rows, dim). */
static tsr_status mm_row(const tsr_nemotron_h *m, tsr_backend *be, struct scratch *s, const float *x,
                         const nh_mat *w, size_t rows, size_t k) {
        float *parts = m->canonical ? s->parts : s->out;
        tsr_status st = mm_parts(m, be, s, parts, x, w, rows, k);
        return st != TSR_OK ? st : parts_sum(m, s->out, parts, rows * m->cfg.dim);
}

#define TRY(expr)                               \
        do {                                    \
                if ((st = (expr)) != TSR_OK)    \
                        goto done;              \
        } while (0)


/* The router of one row: scores = sigmoid(logits); the choice by scores + bias within
 * the topk_group best groups (a group's score: its two best biased scores); weights are
 * the chosen plain scores, renormalised and scaled.  Ties keep the lower index. */
static void route_row(const tsr_nemotron_h_config *c, const float *bias, const float *logits, struct scratch *x,
                      uint32_t *top, float *w) {
        size_t E = c->n_experts, per = E / c->n_group;
        float *s = x->rs, *sc = x->rsc, *gscore = x->gscore, sum = 0.0f;
        bool *gsel = x->gsel, *taken = x->taken;

        for (size_t e = 0; e < E; e++) {
                s[e] = 1.0f / (1.0f + expf(-logits[e]));
                sc[e] = s[e] + bias[e];
                taken[e] = false;
        }
        for (size_t g = 0; g < c->n_group; g++) {
                float a = -INFINITY, b = -INFINITY;
                for (size_t e = g * per; e < (g + 1) * per; e++) {
                        if (sc[e] > a) {
                                b = a;
                                a = sc[e];
                        } else if (sc[e] > b) {
                                b = sc[e];
                        }
                }
                gscore[g] = a + b;
                gsel[g] = false;
        }
        for (size_t k = 0; k < c->topk_group; k++) {
                size_t best = SIZE_MAX;
                for (size_t g = 0; g < c->n_group; g++)
                        if (!gsel[g] && (best == SIZE_MAX || gscore[g] > gscore[best]))
                                best = g;
                gsel[best] = true;
        }
        for (size_t k = 0; k < c->top_k; k++) {
                size_t best = SIZE_MAX;
                for (size_t e = 0; e < E; e++)
                        if (gsel[e / per] && !taken[e] && (best == SIZE_MAX || sc[e] > sc[best]))
                                best = e;
                taken[best] = true;
                top[k] = (uint32_t)best;
                w[k] = s[best];
                sum += s[best];
        }
        for (size_t k = 0; k < c->top_k; k++) {
                if (c->norm_topk_prob)
                        w[k] /= sum + 1e-20f;
                w[k] *= c->routed_scale;
        }
}

/* MoE over N rows xb -> out: routed experts in expert-index order (as transformers
 * accumulates them), each row's weighted outputs summed onto zero, then the shared expert.
 * A tensor-parallel rank (vLLM's MoE without expert parallelism) holds its columns of
 * every expert and of the shared expert, and the router whole: every rank routes alike.
 * The canonical form keeps the sums per K slice, as Llama 4's: slice j's routed sum (in
 * expert order) plus its shared partial, then the one reduce over the slices and the
 * group. */
/* o (dim,) += y * w: one routed choice's weighted output added to a row's sum, the one
 * expression both the tensor-parallel and the expert-parallel sums use (the compiler may
 * fuse the multiply-add; it must do it alike in both). */
static void add_weighted(float *o, const float *y, float w, size_t dim) {
        for (size_t j = 0; j < dim; j++)
                o[j] += y[j] * w;
}

static tsr_status moe(const tsr_nemotron_h *m, const nh_layer *L, tsr_backend *be, struct scratch *s, size_t N) {
        const tsr_nemotron_h_config *c = &m->rank;
        size_t dim = c->dim, E = c->n_experts, tk = c->top_k, SI = c->shared_hidden;
        size_t I = m->ep ? m->cfg.moe_hidden : c->moe_hidden;  /* an expert's columns as held */
        size_t P = n_parts(m), cnt = N * dim, S = TSR_COMM_TREE_LEAVES;
        float *routed = m->canonical ? s->routed : s->out, *shared = m->canonical ? s->parts : s->ey;
        tsr_status st;

        if ((st = tsr_backend_matmul(be, s->proj, s->xb, L->router, TSR_DTYPE_F32, N, dim, E)) != TSR_OK)
                return st;
        if (s->mem && (st = tsr_backend_download(be, s->rlh, s->proj, N * E * sizeof(float))) != TSR_OK)
                return st;      /* the top-k runs on the host */
        for (size_t r = 0; r < N; r++)
                route_row(c, L->router_bias, s->rlh + r * E, s, s->top + r * tk, s->topw + r * tk);
        if ((st = tsr_backend_zero(be, routed, P * cnt * sizeof(float))) != TSR_OK)
                return st;
        if (m->ep)
                memset(s->ep_parts, 0, N * tk * S * dim * sizeof(float));
        for (size_t e = m->e0; e < m->e0 + m->ne; e++) {       /* the experts held: all, or the rank's (ep) */
                size_t n = 0;
                for (size_t r = 0; r < N; r++)
                        for (size_t k = 0; k < tk; k++)
                                if (s->top[r * tk + k] == e) {
                                        s->rows[n] = (uint32_t)r;
                                        s->rk[n] = (uint32_t)k;
                                        s->rowsw[n++] = s->topw[r * tk + k];
                                }
                if (n == 0)
                        continue;
                if ((st = tsr_backend_gather_rows(be, s->exp_in, s->xb, N, dim, s->rows, NULL, n)) ||
                    (st = mm(be, s->hid, s->exp_in, &L->exp_up[e], n, dim, I)) ||
                    (st = tsr_backend_relu_sq(be, s->hid, n * I)))
                        return st;
                if (m->ep) {    /* all S slices of the whole expert, each where every rank finds it */
                        const nh_mat *dw = &L->exp_down[e];
                        const void *wd = dw->q.data ? dw->q.data : dw->b ? (const void *)dw->b : (const void *)dw->f;
                        tsr_dtype dt = dw->q.data ? dw->q.dtype : dw->b ? TSR_DTYPE_BF16 : TSR_DTYPE_F32;
                        if ((st = tsr_tp_row_partials(be, s->ey, s->slice, s->hid, wd, dt,
                                                      dw->q.data ? &dw->q.scales : NULL, n, I, dim, S)))
                                return st;
                        for (size_t j = 0; j < S; j++)
                                for (size_t i = 0; i < n; i++)
                                        memcpy(s->ep_parts + (((size_t)s->rows[i] * tk + s->rk[i]) * S + j) * dim,
                                               s->ey + (j * n + i) * dim, dim * sizeof(float));
                        continue;
                }
                if ((st = mm_parts(m, be, s, s->ey, s->hid, &L->exp_down[e], n, I)))   /* ey (P, n, dim) */
                        return st;
                for (size_t p = 0; p < P; p++)  /* each routed row once, weighted: the rows are distinct */
                        if ((st = tsr_backend_scatter_add_rows(be, routed + p * cnt, N, dim, s->ey + p * n * dim,
                                                               s->rows, s->rowsw, n)))
                                return st;
        }
        if (m->ep) {
                /* Every choice's partials from the rank holding its expert (one non-zero
                 * addend per entry: the sum is exact), then per row and per slice of this
                 * rank the choices weighted and added in expert order from zero, as the
                 * tensor-parallel sum above: the same bits (llama4.c's, with the weight). */
                if (m->tp_size > 1 &&
                    (st = tsr_comm_all_reduce_sum(m->comm, s->ep_parts, N * tk * S * dim, NULL)) != TSR_OK)
                        return st;
                for (size_t r = 0; r < N; r++) {
                        const uint32_t *sel = s->top + r * tk;  /* distinct experts */
                        for (size_t t = 0, best = tk; t < tk; t++) {
                                size_t prev = best;     /* the choice with the next larger expert */
                                best = tk;
                                for (size_t k = 0; k < tk; k++)
                                        if ((prev == tk || sel[k] > sel[prev]) && (best == tk || sel[k] < sel[best]))
                                                best = k;
                                for (size_t p = 0; p < P; p++)
                                        add_weighted(routed + p * cnt + r * dim,
                                                     s->ep_parts + ((r * tk + best) * S + m->tp_rank * P + p) * dim,
                                                     s->topw[r * tk + best], dim);
                        }
                }
        }
        if ((st = mm(be, s->hid, s->xb, &L->shared_up, N, dim, SI)) != TSR_OK ||
            (st = tsr_backend_relu_sq(be, s->hid, N * SI)) != TSR_OK)
                return st;
        if ((st = mm_parts(m, be, s, shared, s->hid, &L->shared_down, N, SI)) != TSR_OK)
                return st;
        for (size_t p = 0; p < P; p++)
                if ((st = tsr_backend_add(be, routed + p * cnt, routed + p * cnt, shared + p * cnt, cnt)) != TSR_OK)
                        return st;
        return parts_sum(m, s->out, routed, cnt);
}

static tsr_kv_view attn_view(const tsr_nemotron_h_config *c, tsr_nemotron_h_cache *kv, size_t i,
                             const tsr_nemotron_h_seq *q) {
        bool fp8 = tsr_dtype_is_fp8(kv->kv_dtype);
        return (tsr_kv_view){.k = kv->k[i], .v = kv->v[i], .dtype = kv->kv_dtype,
                             .k_scale = fp8 ? kv->k_scale[i] : 1.0f, .v_scale = fp8 ? kv->v_scale[i] : 1.0f,
                             .block_table = q->block_table, .n_table = q->n_table, .n_blocks = kv->n_blocks,
                             .block_size = kv->block_size, .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim};
}

/* Attention of the rank's heads (its KV heads' cache), o_proj row-parallel. */
static tsr_status attention(const tsr_nemotron_h *m, const nh_layer *L, tsr_backend *be, tsr_nemotron_h_cache *kv,
                            const tsr_nemotron_h_seq *seqs, size_t n_seqs, struct scratch *s, size_t N) {
        const tsr_nemotron_h_config *c = &m->rank;
        size_t dim = c->dim, qd = (size_t)c->n_heads * c->head_dim, kvd = (size_t)c->n_kv_heads * c->head_dim;
        float *q = s->proj, *k = q + N * qd, *v = k + N * kvd;
        float scale = 1.0f / sqrtf((float)c->head_dim);
        tsr_status st;

        if ((st = mm(be, q, s->xb, &L->wq, N, dim, qd)) ||
            (st = mm(be, k, s->xb, &L->wk, N, dim, kvd)) ||
            (st = mm(be, v, s->xb, &L->wv, N, dim, kvd)))
                return st;
        for (size_t i = 0, row = 0; i < n_seqs; row += seqs[i].n, i++) {
                tsr_kv_view view = attn_view(c, kv, L->kind_index, &seqs[i]);
                if ((st = tsr_backend_kv_write(be, &view, k + row * kvd, v + row * kvd, seqs[i].n,
                                               seqs[i].past_len)) ||
                    (st = tsr_backend_attention(be, s->y + row * qd, q + row * qd, &view, seqs[i].n,
                                                seqs[i].past_len, c->n_heads, scale)))
                        return st;
        }
        return mm_row(m, be, s, s->y, &L->wo, N, qd);
}

/* The Mamba mixer of the rank's heads and groups (its state slots' channels), out_proj
 * row-parallel. */
static tsr_status mamba(const tsr_nemotron_h *m, const nh_layer *L, tsr_backend *be, tsr_nemotron_h_cache *kv,
                        const tsr_nemotron_h_seq *seqs, size_t n_seqs, struct scratch *s, size_t N) {
        const tsr_nemotron_h_config *c = &m->rank;
        size_t dim = c->dim, di = tsr_nemotron_h_d_inner(c), pr = di + tsr_nemotron_h_conv_dim(c) + c->m_heads;
        tsr_status st;

        if ((st = mm(be, s->proj, s->xb, &L->in_proj, N, dim, pr)) != TSR_OK)
                return st;
        float *conv = kv->conv[L->kind_index], *ssm = kv->ssm[L->kind_index];
        size_t ce = conv_elems(c), se = ssm_elems(c);
        for (size_t i = 0, row = 0; i < n_seqs; row += seqs[i].n, i++) {
                const tsr_nemotron_h_seq *q = &seqs[i];
                s->mseqs[i] = (tsr_mamba_seq){.row = row, .n = q->n, .past_len = q->past_len,
                                              .chunked_end = q->chunked_end, .slot = q->slot, .saves = q->saves,
                                              .n_saves = q->n_saves};
                if (q->past_len == 0) {         /* a new sequence: its slot's state from zero */
                        if ((st = tsr_backend_zero(be, conv + q->slot * ce, ce * sizeof(float))) != TSR_OK ||
                            (st = tsr_backend_zero(be, ssm + q->slot * se, se * sizeof(float))) != TSR_OK)
                                return st;
                } else if (q->restore) {        /* it continues a cached prefix: that state */
                        if ((st = tsr_backend_copy(be, conv + q->slot * ce, conv + q->restore_from * ce,
                                                   ce * sizeof(float))) != TSR_OK ||
                            (st = tsr_backend_copy(be, ssm + q->slot * se, ssm + q->restore_from * se,
                                                   se * sizeof(float))) != TSR_OK)
                                return st;
                }
        }
        /* vLLM's Mixer2RMSNormGated with one group over tp ranks all-reduces the sum of
         * squares; here as R7's canonical partials (comm.h): S fixed channel slices summed
         * in one tree, the same bits at every tp (tp 1 included) */
        bool across = tsr_nemotron_h_norm_across(&m->cfg);
        size_t S = TSR_COMM_TREE_LEAVES, n_leaves = S / m->tp_size;
        tsr_mamba_dims dims = {.heads = c->m_heads, .head_dim = c->m_head_dim, .state = c->ssm_state,
                               .groups = c->n_groups, .conv_kernel = c->conv_kernel,
                               .chunk = tsr_nemotron_h_scan_chunk(c), .eps = c->eps, .dt_min = c->dt_min,
                               .dt_max = c->dt_max};
        tsr_mamba_weights w = {.conv_w = L->conv_w, .conv_b = L->conv_b, .dt_bias = L->dt_bias, .A = L->A,
                               .D = L->D, .norm = L->gnorm};
        if ((st = tsr_backend_mamba_mixer(be, &dims, &w, s->proj, N, conv, ssm, kv->n_slots, s->mseqs, n_seqs, s->y,
                                          across ? s->leaves : NULL, n_leaves)) != TSR_OK)
                return st;
        if (across) {
                size_t gs = tsr_nemotron_h_d_inner(&m->cfg);    /* the whole group */
                if ((st = tsr_tp_row_reduce(m->comm, m->tp_size, s->leaves, n_leaves, s->ss, N)) != TSR_OK)
                        return st;
                for (size_t r = 0; r < N; r++) {
                        float *u = s->y + r * di, rs = 1.0f / sqrtf(s->ss[r] / (float)gs + c->eps);
                        for (size_t e = 0; e < di; e++)
                                u[e] = L->gnorm[e] * (u[e] * rs);
                }
        }
        return mm_row(m, be, s, s->y, &L->out_proj, N, di);
}

static tsr_status mlp(const tsr_nemotron_h *m, const nh_layer *L, tsr_backend *be, struct scratch *s, size_t N) {
        const tsr_nemotron_h_config *c = &m->rank;
        tsr_status st;

        if ((st = mm(be, s->hid, s->xb, &L->mlp_up, N, c->dim, c->mlp_hidden)) ||
            (st = tsr_backend_relu_sq(be, s->hid, N * c->mlp_hidden)))
                return st;
        return mm_row(m, be, s, s->hid, &L->mlp_down, N, c->mlp_hidden);
}

/* x (rows, dim) = the rows `ids` of the embedding table the model holds (a
 * tensor-parallel rank's vocab_out rows), float32 or kept as stored (embd_q).  A
 * tsr_tp_gather_fn. */
static tsr_status embed_rows(const void *model, tsr_backend *be, float *x, const uint32_t *ids, size_t rows) {
        const tsr_nemotron_h *m = model;
        return tsr_tp_table_rows(be, x, m->token_embd, &m->embd_q, m->vocab_out, m->cfg.dim, ids, rows);
}

/* x (N, dim) = the embedding rows of the sequences' tokens in order, in one
 * vocabulary-parallel lookup (tsr_tp_embed: one all-reduce a step, the same bits at
 * every tp_size). */
static tsr_status embed(const tsr_nemotron_h *m, tsr_backend *be, float *x, const tsr_nemotron_h_seq *seqs,
                        size_t n_seqs, size_t N) {
        uint32_t *tokens = malloc(N * sizeof *tokens + 1);
        tsr_status st;

        if (!tokens)
                return TSR_E_NOMEM;
        for (size_t i = 0, row = 0; i < n_seqs; row += seqs[i].n, i++)
                memcpy(tokens + row, seqs[i].tokens, seqs[i].n * sizeof *tokens);
        st = tsr_tp_embed(m->comm, m->tp_rank, m->tp_size, m->cfg.vocab_size, m->cfg.dim, tokens, N, x, embed_rows, m,
                          be);
        free(tokens);
        return st;
}

/* logits (rows, vocab) of the normed rows xb (rows, dim): a tensor-parallel rank computes
 * its vocab_out rows of lm_head and the all-gather puts the vocabulary together (tp.h). */
static tsr_status lm_head(const tsr_nemotron_h *m, tsr_backend *be, float *logits, const float *xb, size_t rows) {
        size_t dim = m->cfg.dim, vl = m->vocab_out;
        float *mine;
        tsr_status st;

        if (m->tp_size == 1)
                return mm(be, logits, xb, &m->output, rows, dim, vl);
        if (!(mine = malloc(rows * vl * sizeof(float))))
                return TSR_E_NOMEM;
        if ((st = mm(be, mine, xb, &m->output, rows, dim, vl)) == TSR_OK)
                st = tsr_tp_gather_vocab(m->comm, m->tp_rank, m->tp_size, m->cfg.vocab_size, mine, logits, rows);
        free(mine);
        return st;
}

/* The slots a step writes (each sequence's own, its saves) are distinct, and no restore
 * reads one of them (restores may share a source): the copies then commute with the
 * other sequences' mixer tasks.  Slots already checked in range. */
static tsr_status slots_ok(const tsr_nemotron_h_cache *kv, const tsr_nemotron_h_seq *seqs, size_t n_seqs) {
        uint8_t *written = calloc(kv->n_slots, 1);
        tsr_status st = TSR_OK;
        if (!written)
                return TSR_E_NOMEM;
        for (size_t i = 0; i < n_seqs && st == TSR_OK; i++) {
                if (written[seqs[i].slot]++)
                        st = TSR_E_INVAL;
                for (size_t k = 0; k < seqs[i].n_saves; k++)
                        if (written[seqs[i].saves[k].slot]++)
                                st = TSR_E_INVAL;
        }
        for (size_t i = 0; i < n_seqs && st == TSR_OK; i++)
                if (seqs[i].restore && written[seqs[i].restore_from])
                        st = TSR_E_INVAL;
        free(written);
        return st;
}

/* The sequences against the cache (the logits against the stage: tsr_stage_args_ok). */
static tsr_status args_ok(const tsr_nemotron_h *m, const tsr_nemotron_h_cache *kv, const tsr_nemotron_h_seq *seqs,
                          size_t n_seqs) {
        const tsr_nemotron_h_config *c = &m->cfg;

        for (size_t i = 0; i < n_seqs; i++) {
                const tsr_nemotron_h_seq *q = &seqs[i];
                if (q->n == 0 || !q->tokens)
                        return TSR_E_INVAL;
                for (size_t t = 0; t < q->n; t++)
                        if (q->tokens[t] >= c->vocab_size)
                                return TSR_E_INVAL;
                if (kv->n_mamba) {
                        if (q->slot >= kv->n_slots ||
                            (q->restore && (q->restore_from >= kv->n_slots || q->past_len == 0)))
                                return TSR_E_INVAL;
                        for (size_t k = 0; k < q->n_saves; k++)
                                if (q->saves[k].slot >= kv->n_slots || q->saves[k].pos <= q->past_len ||
                                    q->saves[k].pos > q->past_len + q->n ||
                                    (k && q->saves[k].pos <= q->saves[k - 1].pos))
                                        return TSR_E_INVAL;
                }
                if (kv->n_attn) {
                        size_t need = (q->past_len + q->n + kv->block_size - 1) / kv->block_size;
                        if (!q->block_table || q->n_table < need)
                                return TSR_E_INVAL;
                        for (size_t b = 0; b < need; b++)
                                if (q->block_table[b] >= kv->n_blocks)
                                        return TSR_E_INVAL;
                }
        }
        return kv->n_mamba ? slots_ok(kv, seqs, n_seqs) : TSR_OK;
}

/* Chunk i of a tsr_nemotron_h_seq array for tsr_answer_rows (answer.h). */
static const tsr_engine_seq *nh_chunk(const void *seqs, size_t i, size_t *rows) {
        const tsr_nemotron_h_seq *q = (const tsr_nemotron_h_seq *)seqs + i;
        *rows = q->which == TSR_LLAMA_LOGITS_ALL ? q->n : q->which == TSR_LLAMA_LOGITS_LAST;
        return q->answer;
}

tsr_status tsr_nemotron_h_forward_batch(const tsr_nemotron_h *m, tsr_backend *be, tsr_nemotron_h_cache *kv,
                                        const tsr_nemotron_h_seq *seqs, size_t n_seqs, float *logits) {
        return tsr_nemotron_h_forward_stage(m, be, kv, seqs, n_seqs, NULL, NULL, logits);
}

/* A pipeline stage hands on the pair the Llama family's does (family.h): x, the
 * residual stream before its last layer's add, then that layer's mixer output; the next
 * stage adds them (and rounds to bf16 where the stream is held so), as one process would. */
tsr_status tsr_nemotron_h_forward_stage(const tsr_nemotron_h *m, tsr_backend *be, tsr_nemotron_h_cache *kv,
                                        const tsr_nemotron_h_seq *seqs, size_t n_seqs, const float *in, float *out,
                                        float *logits) {
        const tsr_nemotron_h_config *c;
        struct scratch s;
        size_t N = 0, dim, out_row = 0;
        bool bf16_residual, want = false, last_stage;
        tsr_status st;

        if (!m || !be || !kv || !seqs || n_seqs == 0)
                return TSR_E_INVAL;
        if ((st = tsr_nemotron_h_check_backend(m, be)) != TSR_OK || (st = args_ok(m, kv, seqs, n_seqs)))
                return st;
        c = &m->rank;           /* the rank's counts (the whole model's at tp_size 1) */
        size_t logit_rows = 0;
        for (size_t i = 0; i < n_seqs; i++) {
                want |= seqs[i].which != TSR_LLAMA_LOGITS_NONE;
                logit_rows += seqs[i].which == TSR_LLAMA_LOGITS_ALL ? seqs[i].n : seqs[i].which != TSR_LLAMA_LOGITS_NONE;
        }
        if (!tsr_stage_args_ok(&m->shard, c->n_layers, in, out, want, logits))
                return TSR_E_INVAL;
        last_stage = m->shard.last_layer + 1 == c->n_layers;
        dim = c->dim;
        bf16_residual = m->bf16 && !c->residual_in_fp32;
        for (size_t i = 0; i < n_seqs; i++)
                N += seqs[i].n;
        if ((st = scratch_alloc(&s, m, N, n_seqs, logit_rows)) != TSR_OK)
                return st;
        if (!in) {
                TRY(embed(m, be, s.x, seqs, n_seqs, N));
                /* exact for a bf16 checkpoint; a float32 one's rows as vLLM's bf16 table */
                if (m->bf16)
                        TRY(tsr_backend_round_bf16(be, s.x, N * dim));
        } else {        /* the previous stage's last add, left to this one */
                TRY(tsr_stage_recv(be, s.x, s.out, in, N, dim));
                TRY(tsr_backend_add(be, s.x, s.x, s.out, N * dim));
                /* the residual stream in bf16 precision (a bf16 model with residual_in_fp32
                 * false, as transformers and vLLM hold it: models.md §0), per element, so
                 * batching and chunking cannot change it */
                if (bf16_residual)
                        TRY(tsr_backend_round_bf16(be, s.x, N * dim));
        }
        for (uint32_t l = m->shard.first_layer; l <= m->shard.last_layer; l++) {
                const nh_layer *L = &m->layers[l];
                TRY(tsr_backend_rmsnorm(be, s.xb, s.x, L->norm, N, dim, c->eps));
                switch (c->pattern[l]) {
                case 'M': TRY(mamba(m, L, be, kv, seqs, n_seqs, &s, N)); break;
                case '*': TRY(attention(m, L, be, kv, seqs, n_seqs, &s, N)); break;
                case 'E': TRY(moe(m, L, be, &s, N)); break;
                default: TRY(mlp(m, L, be, &s, N)); break;
                }
                if (l == m->shard.last_layer && !last_stage) {  /* the next stage adds (see above) */
                        TRY(tsr_stage_send(be, out, s.x, s.out, N, dim));
                        goto done;
                }
                TRY(tsr_backend_add(be, s.x, s.x, s.out, N * dim));
                /* the residual stream in bf16 precision (a bf16 model with residual_in_fp32
                 * false, as transformers and vLLM hold it: models.md §0), per element, so
                 * batching and chunking cannot change it */
                if (bf16_residual)
                        TRY(tsr_backend_round_bf16(be, s.x, N * dim));
        }
        /* The rows whose logits are asked for, stacked: norm_f, then lm_head over them all
         * (one all-gather of the vocabulary under tensor parallelism). */
        for (size_t i = 0, row = 0; i < n_seqs; row += seqs[i].n, i++) {
                size_t first = seqs[i].which == TSR_LLAMA_LOGITS_ALL ? row : row + seqs[i].n - 1;
                size_t cnt = seqs[i].which == TSR_LLAMA_LOGITS_ALL ? seqs[i].n : 1;
                if (seqs[i].which == TSR_LLAMA_LOGITS_NONE)
                        continue;
                TRY(tsr_backend_rmsnorm(be, s.xb + out_row * dim, s.x + first * dim, m->output_norm, cnt, dim,
                                        c->eps));
                out_row += cnt;
        }
        if (out_row) {          /* on a device: into the kept array, then the step's one download */
                TRY(lm_head(m, be, s.mem ? s.lg : logits, s.xb, out_row));
                if (s.mem)      /* the rows the engine offers answered on the device (answer.h) */
                        TRY(tsr_answer_rows(be, nh_chunk, seqs, n_seqs, logits, s.lg, c->vocab_size));
        }
done:
        scratch_free(&s);
        return st;
}
