/* llama.c - Llama weights + config + forward for one sequence over a paged KV layout. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kernels/quant/quant.h"
#include "worker/load/gguf.h"
#include "worker/model/answer.h"
#include "worker/model/cudagraph.h"
#include "worker/model/device_arrays.h"
#include "worker/model/family.h"
#include "common/log.h"
#include "worker/model/llama.h"
#include "worker/model/tp.h"
#include "worker/parallel/comm.h"

/* The matmul weights of a layer, in the order bf16[] and the layers' stored[] keep them. */
enum {
        MM_Q = TSR_LLAMA_MM_Q, MM_K = TSR_LLAMA_MM_K, MM_V = TSR_LLAMA_MM_V, MM_O = TSR_LLAMA_MM_O,
        MM_GATE = TSR_LLAMA_MM_GATE, MM_UP = TSR_LLAMA_MM_UP, MM_DOWN = TSR_LLAMA_MM_DOWN,
        MM_PER_LAYER = TSR_LLAMA_MM_PER_LAYER
};

struct tsr_llama {
        tsr_llama_config cfg;           /* the whole model's (n_layers counts every layer) */
        tsr_llama_weights *w;           /* owned */
        /* The layers this model holds: global first_layer .. first_layer + n_local - 1 (its
         * shard spec; a pipeline stage holds a range, w->layers[] and the KV are local). */
        uint32_t first_layer, n_local;
        /* Tensor parallelism (tsr_llama_shard_tp; issue #20): this rank's heads, KV heads,
         * MLP columns and lm_head rows (the whole model's counts when tp_size is 1).  With
         * `canonical`, o_proj and down_proj are held as S / tp_size contiguous K slices
         * (S = TSR_COMM_TREE_LEAVES; wo / w_down: [S / tp_size] blocks of (dim, K / S)), and
         * computed as S fp32 partial sums combined by the fixed balanced tree, the lower
         * levels here and the upper ones in `comm`'s all-reduce (reference/distributed.md
         * R7): the same bits for every tp_size. */
        uint32_t tp_rank, tp_size;
        uint32_t nh, nkv, hid, vocab_out;
        bool canonical;
        tsr_comm *comm;                 /* the rank's TP group (tsr_llama_set_comm); NULL when tp_size 1 */
        float *inv_freq;                /* (head_dim/2,) */
        /* --dtype bfloat16 (tsr_llama_use_bf16): the matmul weights as bf16 bits, their
         * float32 copies in w freed (NULL), except token_embd which the embedding reads.
         * Weights kept in their GGUF block format (w's stored tensors) have no bf16 copy. */
        uint16_t **bf16;                /* [n_local * MM_PER_LAYER], NULL when float32 */
        uint16_t *output_bf16;          /* (vocab, dim) */
        /* On a backend whose memory is not the host's (tsr_llama_to_backend; issue #16):
         * the weights the forward reads, copied there, the host copies freed; NULL on the
         * CPU.  Its scratch is kept between forwards (a device allocation is too slow to
         * make per step), so `dev` points to mutable state behind the const model the
         * forward gets: one forward at a time, on the thread that drives the backend. */
        struct llama_dev *dev;
};

/* A layer's weights in device memory: the norms float32, the matmuls in the dtype the
 * host held them in (float32, or bf16 under --dtype bfloat16, or a ModelOpt checkpoint's
 * fp8 / nvfp4 bytes as stored, with their scales), each as the tensor mm() hands the
 * backend: its data is device memory dev owns. */
struct llama_dev_layer {
        float *attn_norm, *ffn_norm;
        tsr_tensor mm[MM_PER_LAYER];
};

struct llama_dev {
        tsr_backend *be;                /* borrowed: outlives the model (the runner frees it after) */
        struct llama_dev_layer *layers; /* [n_local] */
        void *token_embd;               /* (vocab, dim) in embd_dtype, NULL on a stage without the embedding */
        tsr_dtype embd_dtype;           /* float32, or bf16 for a BF16 table kept as stored */
        void *output;                   /* (vocab_out, dim) in output_dtype; the embedding's when tied and float32 */
        float *output_norm, *inv_freq;
        tsr_dtype mm_dtype;             /* of every matmul not kept as stored:
                                         * TSR_DTYPE_F32 or TSR_DTYPE_BF16 */
        tsr_dtype output_dtype;         /* output's: mm_dtype, or bf16 for a BF16 lm_head kept as stored */
        /* The forward's activations for up to scratch_rows tokens and logits for up to
         * logits_rows rows (device memory), grown on demand and kept. */
        float *scratch;
        size_t scratch_rows;
        float *logits;
        size_t logits_rows;
        /* CUDA graphs of decode steps (tsr_llama_set_graphs): the batch sizes recorded,
         * ascending, each with its failed recordings; a graph's block-table width per
         * sequence; the longest sequence a graph runs; what the graphed steps did. */
        uint32_t *graph_sizes;
        uint8_t *graph_fails;
        size_t n_graph_sizes;
        uint32_t graph_width, graph_max_len;
        tsr_llama_graph_stats graph_stats;
        /* the weights' upload (tsr_llama_to_backend, main thread): its log lines */
        tsr_dev_progress upload;
        size_t n_uploaded;
};

/* A view of a KV pool's one full-attention group (kv_pool.h), which the pool allocated
 * per layer; the pool is the view's own only when tsr_llama_kv_new made it. */
struct tsr_llama_kv {
        size_t n_layers, n_kv_heads, head_dim;
        size_t block_size, n_blocks;
        size_t len;                     /* valid positions */
        float **k, **v;                 /* [n_layers], borrowed from pool: (n_blocks, block_size, n_kv_heads, head_dim)
                                         * elements of `dtype` (for fp8 the arrays are bytes) */
        tsr_dtype dtype;                /* float32, or fp8_e4m3 (--kv-cache-dtype fp8) */
        const float *k_scale, *v_scale; /* [n_layers], borrowed from pool: fp8's scales */
        uint32_t *block_table;          /* (n_blocks,): 0, 1, 2, ... */
        tsr_kv_pool *owned_pool;        /* NULL when bound to the caller's pool */
};

/* ---- config and load ------------------------------------------------------------- */

static void bf16_free(tsr_llama *m) {
        if (m->bf16)
                for (size_t i = 0; i < (size_t)m->n_local * MM_PER_LAYER; i++)
                        free(m->bf16[i]);
        free(m->bf16);
        free(m->output_bf16);
        m->bf16 = NULL;
        m->output_bf16 = NULL;
}

tsr_status tsr_llama_rope_inv_freq(const tsr_llama_config *cfg, const float *divisors, float *out) {
        size_t half;

        if (!cfg || !out || cfg->head_dim == 0 || cfg->head_dim % 2 != 0 || !(cfg->rope_theta > 0))
                return TSR_E_INVAL;
        if (cfg->rope_llama3 && (!(cfg->rope_factor > 0) || !(cfg->rope_low_freq_factor > 0) ||
                                 !(cfg->rope_high_freq_factor >= cfg->rope_low_freq_factor) ||
                                 cfg->rope_original_max_pos == 0))
                return TSR_E_INVAL;
        half = cfg->head_dim / 2;
        for (size_t i = 0; i < half; i++)
                if (divisors && !(divisors[i] > 0))
                        return TSR_E_INVAL;

        for (size_t i = 0; i < half; i++) {
                /* HF: 1 / base ** (arange(0, d, 2).float() / d): the exponent is a float32. */
                float e = (float)(2 * i) / (float)cfg->head_dim;
                double f = 1.0 / pow(cfg->rope_theta, (double)e);

                if (cfg->rope_llama3) {
                        /* Wavelengths shorter than O/hi keep their frequency, longer than
                         * O/lo are slowed by `factor`, and the band between is blended. */
                        double O = cfg->rope_original_max_pos, lo = cfg->rope_low_freq_factor;
                        double hi = cfg->rope_high_freq_factor, fac = cfg->rope_factor;
                        double wl = 2.0 * M_PI / f;
                        if (wl < O / hi) {
                                /* unchanged */
                        } else if (wl > O / lo) {
                                f = f / fac;
                        } else if (hi != lo) {          /* hi == lo: the band is empty (vLLM: s = 0) */
                                double s = (O / wl - lo) / (hi - lo);
                                f = (1.0 - s) * f / fac + s * f;
                        } else {
                                f = f / fac;
                        }
                }
                if (divisors)
                        f = f / (double)divisors[i];
                out[i] = (float)f;
        }
        return TSR_OK;
}

/* Layer l's matmul weight `which` (l < 0: the output matrix) as the forward hands it to
 * the backend, a tensor with its dtype: kept in its GGUF block format, else bf16
 * (--dtype bfloat16), else float32 (`w_f32`, the weights' field). */
static tsr_tensor mm_weight(const tsr_llama *m, long l, int which, const float *w_f32) {
        const tsr_tensor *st = l < 0 ? &m->w->output_stored : &m->w->layers[l].stored[which];
        tsr_tensor t = {.dtype = TSR_DTYPE_F32, .data = (void *)w_f32};

        if (m->dev && l >= 0)
                return m->dev->layers[l].mm[which];
        if (m->dev) {
                t.dtype = m->dev->output_dtype;
                t.data = m->dev->output;
                return t;
        }
        if (st->data)
                return *st;
        if (m->bf16) {
                t.dtype = TSR_DTYPE_BF16;
                t.data = l < 0 ? m->output_bf16 : m->bf16[(size_t)l * MM_PER_LAYER + (size_t)which];
        }
        return t;
}

tsr_status tsr_llama_check_backend(const tsr_llama *m, const tsr_backend *be) {
        static const tsr_op needed[] = {TSR_OP_RMSNORM, TSR_OP_EMBEDDING, TSR_OP_ROPE,    TSR_OP_KV_WRITE,
                                        TSR_OP_ATTENTION, TSR_OP_SILU_MUL, TSR_OP_ADD, TSR_OP_ADD_RMSNORM};
        if (!m || !be)
                return TSR_E_INVAL;
        /* Host memory, or the backend the weights were copied to (tsr_llama_to_backend). */
        if (!tsr_backend_host_memory(be) && (!m->dev || m->dev->be != be))
                return TSR_E_UNSUPPORTED;
        for (size_t i = 0; i < sizeof needed / sizeof needed[0]; i++)
                if (!tsr_backend_supports(be, needed[i], TSR_DTYPE_F32))
                        return TSR_E_UNSUPPORTED;
        for (long l = -1; l < (long)m->n_local; l++)
                for (int i = 0; i < (l < 0 ? 1 : MM_PER_LAYER); i++)
                        if (!tsr_backend_supports(be, TSR_OP_MATMUL, mm_weight(m, l, i, NULL).dtype))
                                return TSR_E_UNSUPPORTED;
        return TSR_OK;
}


/* A GGUF file: config from its metadata, tensors dequantized; the file is closed after. */
static tsr_status load_gguf(const char *path, const tsr_llama_config *given, const tsr_shard_spec *spec,
                            const tsr_load_opts *opts, tsr_load_progress_fn progress, void *ud,
                            tsr_llama_weights **ret, tsr_load_stats *stats, char *err, size_t errlen) {
        tsr_gguf *g = NULL;
        tsr_llama_config cfg;
        tsr_shard_spec whole;
        tsr_status st = TSR_OK;

        if ((st = tsr_gguf_open(path, &g, err, errlen)) != TSR_OK)
                return st;
        if (given)
                cfg = *given;
        else
                st = tsr_llama_config_from_gguf(g, path, &cfg, err, errlen);
        if (st == TSR_OK) {
                whole = tsr_shard_spec_whole(cfg.n_layers);
                st = tsr_llama_weights_load_opts(g, path, &cfg, spec ? spec : &whole, opts, progress, ud, ret,
                                                 stats, err, errlen);
        }
        tsr_gguf_close(&g);
        return st;
}

/* A Hugging Face folder: config.json first (an unsupported model fails before any
 * weights are mapped), then the safetensors, unmapped after conversion. */
static tsr_status load_hf(const char *dir, const tsr_llama_config *given, const tsr_shard_spec *spec,
                          const tsr_load_opts *opts, tsr_load_progress_fn progress, void *ud,
                          tsr_llama_weights **ret, tsr_load_stats *stats, char *err, size_t errlen) {
        tsr_safetensors_set *set = NULL;
        tsr_llama_config cfg;
        tsr_shard_spec whole;
        tsr_status st;

        if (given)
                cfg = *given;
        else if ((st = tsr_llama_config_from_hf(dir, &cfg, err, errlen)) != TSR_OK)
                return st;
        if ((st = tsr_safetensors_set_open(dir, &set, err, errlen)) != TSR_OK)
                return st;
        whole = tsr_shard_spec_whole(cfg.n_layers);
        st = tsr_llama_weights_load_hf_opts(set, &cfg, spec ? spec : &whole, opts, progress, ud, ret, stats, err,
                                            errlen);
        tsr_safetensors_set_close(&set);
        return st;
}

tsr_status tsr_llama_load(const char *path, const tsr_shard_spec *spec,
                          tsr_load_progress_fn progress, void *ud, tsr_llama **ret, tsr_load_stats *stats,
                          char *err, size_t errlen) {
        return tsr_llama_load_config(path, NULL, spec, progress, ud, ret, stats, err, errlen);
}

tsr_status tsr_llama_load_config(const char *path, const tsr_llama_config *cfg, const tsr_shard_spec *spec,
                                 tsr_load_progress_fn progress, void *ud, tsr_llama **ret, tsr_load_stats *stats,
                                 char *err, size_t errlen) {
        return tsr_llama_load_opts(path, cfg, spec, NULL, progress, ud, ret, stats, err, errlen);
}

tsr_status tsr_llama_load_opts(const char *path, const tsr_llama_config *cfg, const tsr_shard_spec *spec,
                               const tsr_load_opts *opts, tsr_load_progress_fn progress, void *ud, tsr_llama **ret,
                               tsr_load_stats *stats, char *err, size_t errlen) {
        tsr_llama_weights *w = NULL;
        tsr_llama *m = NULL;
        struct stat sb;
        tsr_status st;

        if (!path || !ret)
                return TSR_E_INVAL;
        if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
                st = load_hf(path, cfg, spec, opts, progress, ud, &w, stats, err, errlen);
        else
                st = load_gguf(path, cfg, spec, opts, progress, ud, &w, stats, err, errlen);
        if (st != TSR_OK)
                return st;
        m = calloc(1, sizeof *m);
        if (!m || !(m->inv_freq = malloc(w->cfg.head_dim / 2 * sizeof(float)))) {
                tsr_errf(err, errlen, "%s: out of memory", path);
                st = TSR_E_NOMEM;
                goto done;
        }
        m->cfg = w->cfg;
        m->first_layer = w->shard.first_layer;
        m->n_local = w->shard.last_layer - w->shard.first_layer + 1;
        m->tp_size = 1;
        m->nh = w->cfg.n_heads;
        m->nkv = w->cfg.n_kv_heads;
        m->hid = w->cfg.hidden_dim;
        m->vocab_out = w->cfg.vocab_size;
        m->w = w;
        w = NULL;
        if ((st = tsr_llama_rope_inv_freq(&m->cfg, m->w->rope_freqs, m->inv_freq)) != TSR_OK) {
                tsr_errf(err, errlen, "%s: bad RoPE parameters", path);
                goto done;
        }
        /* A tensor-parallel rank's share: finish the split here, so that what load returns
         * is always a whole model or a rank's, never half of one (shard_tp is then a no-op) */
        if (m->w->tp_sliced && (st = tsr_llama_shard_tp(m, m->w->shard.tp_rank, m->w->shard.tp_size, err, errlen)) !=
                                       TSR_OK)
                goto done;
        *ret = m;
        m = NULL;
done:
        tsr_llama_free(&m);
        tsr_llama_weights_free(&w);
        return st;
}

/* A float32 (rows, cols) matrix as bf16, rounded to nearest even.  64-byte aligned: the
 * AMX kernel loads 64-byte tile rows, which straddle two cache lines otherwise. */
static uint16_t *to_bf16(const float *src, size_t rows, size_t cols) {
        size_t bytes = rows * cols * sizeof(uint16_t);
        uint16_t *dst = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (dst)
                for (size_t i = 0; i < rows * cols; i++)
                        dst[i] = tsr_f32_to_bf16(src[i]);
        return dst;
}

/* The (rows, cols) of each matmul weight of a layer as this model holds them (its TP
 * shard's head and MLP counts). */
static void mm_shapes(const tsr_llama *m, size_t rows[MM_PER_LAYER], size_t cols[MM_PER_LAYER]) {
        size_t hd = m->cfg.head_dim, dim = m->cfg.dim, hid = m->hid;
        size_t q_dim = (size_t)m->nh * hd, kv_dim = (size_t)m->nkv * hd;
        const size_t r[MM_PER_LAYER] = {q_dim, kv_dim, kv_dim, dim, hid, hid, dim};
        const size_t c[MM_PER_LAYER] = {dim, dim, dim, q_dim, dim, dim, hid};
        memcpy(rows, r, sizeof r);
        memcpy(cols, c, sizeof c);
}

/* The float32 matmul weight fields of layer L, in MM_* order. */
static void mm_slots(tsr_llama_layer *L, float **slot[MM_PER_LAYER]) {
        float **s[MM_PER_LAYER] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        memcpy(slot, s, sizeof s);
}

/* The host weights' bytes as held now: each matmul as its float32, bf16 or stored block
 * copy, the embedding and output likewise (a tied output counted once, its bf16 copy
 * apart), the norms.  0 once the weights have moved to a device. */
uint64_t tsr_llama_resident_bytes(const tsr_llama *m) {
        if (!m || !m->w || m->dev)
                return 0;
        const tsr_llama_weights *w = m->w;
        uint64_t dim = m->cfg.dim, b = dim * sizeof(float);    /* output_norm */
        size_t rows[MM_PER_LAYER], cols[MM_PER_LAYER];
        mm_shapes(m, rows, cols);
        b += w->token_embd ? (uint64_t)m->vocab_out * dim * sizeof(float)
                           : w->token_embd_stored.data ? tsr_tensor_n_bytes(&w->token_embd_stored) : 0;
        if (m->output_bf16)
                b += (uint64_t)m->vocab_out * dim * sizeof(uint16_t);
        else if (w->output && w->output != w->token_embd)
                b += (uint64_t)m->vocab_out * dim * sizeof(float);
        else if (!w->output && w->output_stored.data && w->output_stored.data != w->token_embd_stored.data)
                b += tsr_tensor_n_bytes(&w->output_stored);
        for (size_t l = 0; l < m->n_local; l++) {
                tsr_llama_layer *L = &w->layers[l];
                float **f32[MM_PER_LAYER];
                mm_slots(L, f32);
                b += 2 * dim * sizeof(float);                   /* attn_norm, ffn_norm */
                for (int i = 0; i < MM_PER_LAYER; i++) {
                        uint64_t n = (uint64_t)rows[i] * cols[i];
                        if (m->bf16 && m->bf16[l * MM_PER_LAYER + i])
                                b += n * sizeof(uint16_t);
                        else if (*f32[i])
                                b += n * sizeof(float);
                        else if (L->stored[i].data)
                                b += tsr_tensor_n_bytes(&L->stored[i]);
                }
        }
        return b;
}

tsr_status tsr_llama_use_bf16(tsr_llama *m) {
        if (!m || m->dev)
                return TSR_E_INVAL;     /* after tsr_llama_to_backend the host weights are gone */
        if (m->bf16)
                return TSR_OK;
        const tsr_llama_config *c = &m->cfg;
        size_t n_layers = m->n_local, rows[MM_PER_LAYER], cols[MM_PER_LAYER];
        float **f32[MM_PER_LAYER];
        mm_shapes(m, rows, cols);
        if (!(m->bf16 = calloc(n_layers * MM_PER_LAYER, sizeof *m->bf16)))
                return TSR_E_NOMEM;
        /* One matrix at a time, its float32 copy freed as soon as it is converted: the
         * host holds the float32 model plus one bf16 matrix at the peak, not both whole
         * models (a 70B checkpoint: 280 GB, not 420).  A failure leaves a model only
         * tsr_llama_free may touch.  A weight kept in its block format has no float32
         * copy and stays as it is.  A tensor-parallel rank's lm_head rows: vocab_out. */
        if (m->w->output && !(m->output_bf16 = to_bf16(m->w->output, m->vocab_out, c->dim)))
                return TSR_E_NOMEM;
        /* tied: output is token_embd, which the embedding reads */
        if (m->w->output && m->w->output != m->w->token_embd) {
                free(m->w->output);
                m->w->output = NULL;
        }
        for (size_t l = 0; l < n_layers; l++) {
                uint16_t **b = m->bf16 + l * MM_PER_LAYER;
                mm_slots(&m->w->layers[l], f32);
                for (int i = 0; i < MM_PER_LAYER; i++) {
                        if (!*f32[i])
                                continue;
                        if (!(b[i] = to_bf16(*f32[i], rows[i], cols[i])))
                                return TSR_E_NOMEM;
                        free(*f32[i]);
                        *f32[i] = NULL;
                }
        }
        return TSR_OK;
}

/* On a device the host bf16 arrays are gone: the device copy's dtype says it. */
bool tsr_llama_is_bf16(const tsr_llama *m) {
        return m && (m->bf16 || (m->dev && m->dev->mm_dtype == TSR_DTYPE_BF16));
}

/* ---- on a device backend (issue #16) -------------------------------------------------- */

static void dev_free(tsr_llama *m) {
        struct llama_dev *d = m->dev;
        if (!d)
                return;
        if (d->layers)
                for (size_t l = 0; l < m->n_local; l++) {
                        tsr_backend_mem_free(d->be, d->layers[l].attn_norm);
                        tsr_backend_mem_free(d->be, d->layers[l].ffn_norm);
                        for (int i = 0; i < MM_PER_LAYER; i++)
                                tsr_backend_mem_free(d->be, d->layers[l].mm[i].data);
                }
        free(d->layers);
        if (d->output != d->token_embd)
                tsr_backend_mem_free(d->be, d->output);
        tsr_backend_mem_free(d->be, d->token_embd);
        tsr_backend_mem_free(d->be, d->output_norm);
        tsr_backend_mem_free(d->be, d->inv_freq);
        tsr_backend_mem_free(d->be, d->scratch);
        tsr_backend_mem_free(d->be, d->logits);
        if (d->n_graph_sizes)
                log_info("CUDA graphs: %llu decode steps replayed, %llu recorded on first use, %llu run eagerly after "
                         "a failed recording", (unsigned long long)d->graph_stats.replays,
                         (unsigned long long)d->graph_stats.captures, (unsigned long long)d->graph_stats.eager);
        tsr_backend_graph_drop(d->be);          /* they read the memory freed above */
        free(d->graph_sizes);
        free(d->graph_fails);
        free(d);
        m->dev = NULL;
}

/* `bytes` of `src` copied into new memory of d->be at *dst; nothing when src is NULL. */
static tsr_status dev_put(struct llama_dev *d, const void *src, size_t bytes, void **dst) {
        tsr_status st;
        *dst = NULL;
        if (!src)
                return TSR_OK;
        if ((st = tsr_backend_mem_alloc(d->be, bytes, dst)) != TSR_OK)
                return st;
        if ((st = tsr_backend_upload(d->be, *dst, src, bytes)) != TSR_OK) {
                tsr_backend_mem_free(d->be, *dst);
                *dst = NULL;
                return st;
        }
        tsr_dev_progress_add(&d->upload, bytes);
        d->n_uploaded++;
        return TSR_OK;
}

/* Free the host copies of everything dev now holds. */
static void host_weights_drop(tsr_llama *m) {
        tsr_llama_weights *w = m->w;
        float **f32[MM_PER_LAYER];
        for (size_t l = 0; l < m->n_local; l++) {
                tsr_llama_layer *L = &w->layers[l];
                mm_slots(L, f32);
                for (int i = 0; i < MM_PER_LAYER; i++) {
                        free(*f32[i]);
                        *f32[i] = NULL;
                        free(L->stored[i].data);
                        L->stored[i].data = NULL;
                }
                free(L->attn_norm);
                free(L->ffn_norm);
                L->attn_norm = L->ffn_norm = NULL;
        }
        bf16_free(m);
        if (w->output != w->token_embd)
                free(w->output);
        w->output = NULL;
        free(w->token_embd);
        w->token_embd = NULL;
        if (w->output_stored.data != w->token_embd_stored.data)
                free(w->output_stored.data);
        free(w->token_embd_stored.data);
        w->output_stored = w->token_embd_stored = (tsr_tensor){0};
        free(w->output_norm);
        w->output_norm = NULL;
}

/* Bytes tsr_llama_to_backend copies: what the host holds of each array it copies. */
static size_t weights_device_bytes(const tsr_llama *m) {
        const tsr_llama_config *c = &m->cfg;
        size_t hd = c->head_dim, dim = c->dim, rows[MM_PER_LAYER], cols[MM_PER_LAYER];
        size_t esz = m->bf16 ? sizeof(uint16_t) : sizeof(float);
        size_t bytes = (size_t)m->n_local * 2 * dim * sizeof(float) + dim * sizeof(float) + hd / 2 * sizeof(float);
        mm_shapes(m, rows, cols);
        for (size_t l = 0; l < m->n_local; l++)
                for (int i = 0; i < MM_PER_LAYER; i++) {
                        const tsr_tensor *st = &m->w->layers[l].stored[i];
                        bytes += st->data ? tsr_tensor_n_bytes(st) : rows[i] * cols[i] * esz;
                }
        if (m->w->token_embd_stored.data)                       /* a stored BF16 table goes as its bytes */
                bytes += tsr_tensor_n_bytes(&m->w->token_embd_stored);
        else if (m->w->token_embd)
                bytes += (size_t)c->vocab_size * dim * sizeof(float);
        if (m->w->output_stored.data && m->w->output_stored.data != m->w->token_embd_stored.data)
                bytes += (size_t)m->vocab_out * dim * sizeof(uint16_t);         /* tied: the table's */
        else if (m->bf16 ? m->output_bf16 != NULL : (m->w->output && m->w->output != m->w->token_embd))
                bytes += (size_t)m->vocab_out * dim * esz;
        return bytes;
}

/* The embedding table on the device: the host's float32 one, or a BF16 checkpoint's kept
 * as stored as its bytes (the device's gather widens each row it reads, exactly). */
static tsr_status put_table(const tsr_llama *m, struct llama_dev *d, void **dst) {
        const tsr_tensor *t = &m->w->token_embd_stored;
        size_t n = (size_t)m->cfg.vocab_size * m->cfg.dim;
        d->embd_dtype = t->data ? t->dtype : TSR_DTYPE_F32;
        return t->data ? dev_put(d, t->data, tsr_tensor_n_bytes(t), dst)
                       : dev_put(d, m->w->token_embd, n * sizeof(float), dst);
}

/* lm_head kept as stored (BF16): its bytes, multiplied as bf16 as on the host
 * (output_dtype), whatever the other matmuls' dtype. */
static tsr_status put_output_stored(const tsr_llama *m, struct llama_dev *d, void **dst) {
        d->output_dtype = TSR_DTYPE_BF16;
        return dev_put(d, m->w->output_stored.data, (size_t)m->vocab_out * m->cfg.dim * sizeof(uint16_t), dst);
}

tsr_status tsr_llama_to_backend(tsr_llama *m, tsr_backend *be, char *err, size_t errlen) {
        const tsr_llama_config *c;
        struct llama_dev *d;
        size_t hd, dim, esz, rows[MM_PER_LAYER], cols[MM_PER_LAYER];
        float **f32[MM_PER_LAYER];
        tsr_status st = TSR_OK;

        if (!m || !be || m->dev)
                return TSR_E_INVAL;
        if (tsr_backend_host_memory(be))
                return TSR_OK;          /* the CPU reads the host arrays */
        c = &m->cfg;
        if (m->tp_size > 1 || m->canonical) {
                tsr_errf(err, errlen, "tensor parallelism on the %s backend is not supported yet", tsr_backend_name(be));
                return TSR_E_UNSUPPORTED;
        }
        if ((m->w->token_embd_stored.data && m->w->token_embd_stored.dtype != TSR_DTYPE_BF16) ||
            (m->w->output_stored.data && m->w->output_stored.dtype != TSR_DTYPE_BF16)) {
                tsr_errf(err, errlen, "weights kept in a GGUF block format cannot go to the %s backend yet "
                         "(use --dtype float32 or bfloat16)", tsr_backend_name(be));
                return TSR_E_UNSUPPORTED;
        }
        /* A weight kept as stored goes as its bytes where the backend computes on them
         * (ModelOpt's fp8 / nvfp4 on CUDA: tsr_backend_matmul_scaled). */
        for (size_t l = 0; l < m->n_local; l++)
                for (int i = 0; i < MM_PER_LAYER; i++) {
                        const tsr_tensor *t = &m->w->layers[l].stored[i];
                        if (t->data && !tsr_backend_supports(be, TSR_OP_MATMUL, t->dtype)) {
                                tsr_errf(err, errlen, "layer %zu: a weight kept as %s cannot go to the %s backend "
                                         "yet (its matmul computes on float32, bfloat16, fp8_e4m3 and nvfp4)",
                                         m->first_layer + l, tsr_dtype_get_info(t->dtype)->name,
                                         tsr_backend_name(be));
                                return TSR_E_UNSUPPORTED;
                        }
                }
        /* A model larger than the device is one clear error here, before any allocation. */
        size_t need = weights_device_bytes(m), free_b = 0, total_b = 0;
        if (tsr_backend_mem_info(be, &free_b, &total_b) == TSR_OK && need > free_b) {
                tsr_errf(err, errlen, "the weights need %.2f GiB on the %s device, which has %.2f GiB free of "
                         "%.2f GiB", (double)need / (1 << 30), tsr_backend_name(be), (double)free_b / (1 << 30),
                         (double)total_b / (1 << 30));
                return TSR_E_NOMEM;
        }
        if (!(d = calloc(1, sizeof *d)) || !(d->layers = calloc(m->n_local, sizeof *d->layers))) {
                free(d);
                return TSR_E_NOMEM;
        }
        d->be = be;
        tsr_dev_progress_start(&d->upload, be, need);
        d->mm_dtype = m->bf16 ? TSR_DTYPE_BF16 : TSR_DTYPE_F32;
        d->output_dtype = d->mm_dtype;
        m->dev = d;             /* from here dev_free undoes a partial copy */
        hd = c->head_dim;
        dim = c->dim;
        esz = m->bf16 ? sizeof(uint16_t) : sizeof(float);
        mm_shapes(m, rows, cols);
        for (size_t l = 0; l < m->n_local && st == TSR_OK; l++) {
                tsr_llama_layer *L = &m->w->layers[l];
                struct llama_dev_layer *D = &d->layers[l];
                mm_slots(L, f32);
                st = dev_put(d, L->attn_norm, dim * sizeof(float), (void **)&D->attn_norm);
                if (st == TSR_OK)
                        st = dev_put(d, L->ffn_norm, dim * sizeof(float), (void **)&D->ffn_norm);
                for (int i = 0; i < MM_PER_LAYER && st == TSR_OK; i++) {
                        const tsr_tensor *stored = &L->stored[i];
                        if (stored->data) {
                                D->mm[i] = *stored;     /* dtype, shape, scales; the data is dev's below */
                                D->mm[i].backend = be;
                                D->mm[i].owns_data = false;
                                st = dev_put(d, stored->data, tsr_tensor_n_bytes(stored), &D->mm[i].data);
                                continue;
                        }
                        const void *src = m->bf16 ? (const void *)m->bf16[l * MM_PER_LAYER + (size_t)i]
                                                  : (const void *)*f32[i];
                        D->mm[i].dtype = d->mm_dtype;
                        st = dev_put(d, src, rows[i] * cols[i] * esz, &D->mm[i].data);
                }
        }
        if (st == TSR_OK)
                st = put_table(m, d, &d->token_embd);
        bool tied_stored = m->w->output_stored.data && m->w->output_stored.data == m->w->token_embd_stored.data;
        if (st == TSR_OK && tied_stored) {              /* the one bf16 table for both */
                d->output = d->token_embd;
                d->output_dtype = TSR_DTYPE_BF16;
        } else if (st == TSR_OK && m->w->output_stored.data)    /* a BF16 checkpoint's lm_head kept as stored */
                st = put_output_stored(m, d, &d->output);
        else if (st == TSR_OK && m->bf16 && m->output_bf16)
                st = dev_put(d, m->output_bf16, (size_t)m->vocab_out * dim * esz, &d->output);
        else if (st == TSR_OK && m->w->output == m->w->token_embd)
                d->output = d->token_embd;
        else if (st == TSR_OK)
                st = dev_put(d, m->w->output, (size_t)m->vocab_out * dim * sizeof(float), &d->output);
        if (st == TSR_OK)
                st = dev_put(d, m->w->output_norm, dim * sizeof(float), (void **)&d->output_norm);
        if (st == TSR_OK)
                st = dev_put(d, m->inv_freq, hd / 2 * sizeof(float), (void **)&d->inv_freq);
        if (st != TSR_OK) {
                tsr_errf(err, errlen, "cannot copy the weights to the %s backend: %s", tsr_backend_name(be),
                         tsr_status_str(st));
                dev_free(m);
                return st;
        }
        host_weights_drop(m);
        tsr_dev_progress_done(&d->upload, d->n_uploaded);
        return TSR_OK;
}

/* Floats of one token's activations in the forward (struct scratch's arrays). */
static size_t scratch_row_floats(const tsr_llama *m) {
        size_t hd = m->cfg.head_dim;
        return 2 * (size_t)m->cfg.dim + 2 * (size_t)m->nh * hd + 2 * (size_t)m->nkv * hd + 2 * (size_t)m->hid;
}

/* Grow the kept device array *buf of *have rows of `per` floats to `want` rows (its old
 * contents are not kept: they are a step's scratch). */
static tsr_status dev_grow(struct llama_dev *d, float **buf, size_t *have, size_t want, size_t per) {
        void *p;
        tsr_status st;

        if (want <= *have)
                return TSR_OK;
        if (want > SIZE_MAX / sizeof(float) / per)
                return TSR_E_LIMIT;
        tsr_backend_mem_free(d->be, *buf);
        *buf = NULL;
        *have = 0;
        if ((st = tsr_backend_mem_alloc(d->be, want * per * sizeof(float), &p)) != TSR_OK)
                return st;
        *buf = p;
        *have = want;
        return TSR_OK;
}

/* Grow the device scratch to `rows` tokens and the logits to `logit_rows` rows. */
static tsr_status dev_reserve(const tsr_llama *m, size_t rows, size_t logit_rows) {
        struct llama_dev *d = m->dev;
        tsr_status st = dev_grow(d, &d->scratch, &d->scratch_rows, rows, scratch_row_floats(m));
        return st != TSR_OK ? st : dev_grow(d, &d->logits, &d->logits_rows, logit_rows, m->cfg.vocab_size);
}

tsr_status tsr_llama_reserve(const tsr_llama *m, size_t tokens, size_t logit_rows) {
        if (!m)
                return TSR_E_INVAL;
        return m->dev ? dev_reserve(m, tokens, logit_rows) : TSR_OK;
}

/* A weight kept in a GGUF block format, widened into a new float32 array *dst as the
 * load would have widened it (tsr_dequant_row), the stored bytes freed: the split's
 * float32 path takes it from there. */
static tsr_status widen_stored(tsr_tensor *t, float **dst) {
        size_t rows = t->shape[0], cols = t->shape[1], rb;
        float *f;
        tsr_status st = tsr_dtype_row_bytes(t->dtype, cols, &rb);

        if (st != TSR_OK)
                return st;
        if (!(f = malloc(rows * cols * sizeof(float))))
                return TSR_E_NOMEM;
        for (size_t r = 0; r < rows && st == TSR_OK; r++)
                st = tsr_dequant_row(t->dtype, (const uint8_t *)t->data + r * rb, cols, f + r * cols);
        if (st != TSR_OK) {
                free(f);
                return st;
        }
        free(t->data);
        *t = (tsr_tensor){0};
        *dst = f;
        return TSR_OK;
}

/* The vocabulary rows [first, first + n) of the embedding and lm_head kept in a block
 * format (tsr_tp_keep_vocab_rows for stored tables): each cut, a tied table once. */
static tsr_status keep_vocab_rows_stored(tsr_llama_weights *w, size_t first, size_t n) {
        tsr_load_slice rows = {TSR_LOAD_SLICE_ROWS, 1, {{first, n}}};
        bool tied = w->output_stored.data && w->output_stored.data == w->token_embd_stored.data;
        tsr_status st = TSR_OK;

        if (w->token_embd_stored.data && (st = tsr_load_stored_slice(&w->token_embd_stored, &rows)) != TSR_OK)
                return st;
        if (tied)
                w->output_stored = w->token_embd_stored;
        else if (w->output_stored.data)
                st = tsr_load_stored_slice(&w->output_stored, &rows);
        return st;
}

tsr_status tsr_llama_shard_tp(tsr_llama *m, uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen) {
        const tsr_llama_config *c;
        tsr_llama_tp_share sh;
        size_t hd;
        tsr_llama_weights *w;
        tsr_status st = TSR_OK;

        if (!m)
                return TSR_E_INVAL;
        c = &m->cfg;
        w = m->w;
        hd = c->head_dim;
        /* Read as the rank's share (tsr_llama_weights.tp_sliced): the load's own call
         * splits it, a later one for that rank has nothing left to do; only o_proj's and
         * down_proj's columns still go into the canonical slice order below. */
        bool done, sliced = w->tp_sliced;
        if ((st = tsr_tp_shard_begin(&w->shard, m->canonical, tp_rank, tp_size, false, &done, err, errlen)) != TSR_OK ||
            done)
                return st;
        if ((st = tsr_llama_tp_share_of(c, tp_rank, tp_size, &sh, err, errlen)) != TSR_OK)
                return st;
        bool split_rows = tp_size > 1 && !sliced;
        size_t o_cols = sliced ? (size_t)sh.nh * hd : (size_t)c->n_heads * hd;
        size_t o_first = sliced ? 0 : tp_rank * sh.nh * hd;
        size_t down_cols = sliced ? sh.hid : c->hidden_dim, down_first = sliced ? 0 : (size_t)tp_rank * sh.hid;
        if (m->bf16) {
                tsr_errf(err, errlen, "tensor parallelism needs float32 weights (--dtype float32)");
                return TSR_E_UNSUPPORTED;
        }
        /* Weights kept as stored (a ModelOpt checkpoint's fp8 / nvfp4 linears, a GGUF's
         * blocks): rows, and K slices of whole blocks.  Checked for every layer before
         * anything is cut, so a refusal at tp 1 leaves the model as loaded; a GGUF block
         * weight whose slices would cut a block is widened to float32 instead (its bits
         * are the widened load's). */
        size_t o_ks = (size_t)sh.nh * hd / sh.ns, down_ks = sh.hid / sh.ns;
        for (size_t l = 0; l < m->n_local; l++) {
                const tsr_tensor *t = w->layers[l].stored;
                /* only a ModelOpt format is refused: a GGUF block is widened below */
                bool o_mo = t[TSR_LLAMA_MM_O].dtype == TSR_DTYPE_FP8_E4M3 || t[TSR_LLAMA_MM_O].dtype == TSR_DTYPE_NVFP4;
                bool d_mo = t[TSR_LLAMA_MM_DOWN].dtype == TSR_DTYPE_FP8_E4M3 ||
                            t[TSR_LLAMA_MM_DOWN].dtype == TSR_DTYPE_NVFP4;
                if ((o_mo && (st = tsr_tp_check_stored_slice(&t[TSR_LLAMA_MM_O], o_ks, sh.ns, "o_proj",
                                                             m->first_layer + l, err, errlen)) != TSR_OK) ||
                    (d_mo && (st = tsr_tp_check_stored_slice(&t[TSR_LLAMA_MM_DOWN], down_ks, sh.ns, "down_proj",
                                                             m->first_layer + l, err, errlen)) != TSR_OK))
                        return st;
        }
        for (size_t l = 0; l < m->n_local; l++) {
                tsr_llama_layer *L = &w->layers[l];
                tsr_tensor *t = L->stored;
                float **o_f32[2] = {&L->wo, &L->w_down};
                for (int j = 0; j < 2 && st == TSR_OK; j++) {
                        int i = j ? TSR_LLAMA_MM_DOWN : TSR_LLAMA_MM_O;
                        size_t ks = j ? down_ks : o_ks;
                        const tsr_dtype_info *di = t[i].data ? tsr_dtype_get_info(t[i].dtype) : NULL;
                        if (di && ks % di->block_elems) {
                                if (l == 0 && tp_rank == 0)
                                        log_info("tensor parallelism: %s (%s) widened to float32 in every layer: "
                                                 "its canonical K slices of %zu columns would cut its blocks of %u",
                                                 j ? "down_proj" : "o_proj", di->name, ks, di->block_elems);
                                st = widen_stored(&t[i], o_f32[j]);
                        }
                }
                struct { float **f; int which; size_t rows, first, n; } col_par[] = {
                        {&L->wq, TSR_LLAMA_MM_Q, (size_t)c->n_heads * hd, (size_t)tp_rank * sh.nh * hd,
                         (size_t)sh.nh * hd},
                        {&L->wk, TSR_LLAMA_MM_K, (size_t)c->n_kv_heads * hd, (size_t)sh.kv0 * hd, (size_t)sh.nkv * hd},
                        {&L->wv, TSR_LLAMA_MM_V, (size_t)c->n_kv_heads * hd, (size_t)sh.kv0 * hd, (size_t)sh.nkv * hd},
                        {&L->w_gate, TSR_LLAMA_MM_GATE, c->hidden_dim, (size_t)tp_rank * sh.hid, sh.hid},
                        {&L->w_up, TSR_LLAMA_MM_UP, c->hidden_dim, (size_t)tp_rank * sh.hid, sh.hid},
                };
                for (size_t j = 0; split_rows && st == TSR_OK && j < sizeof col_par / sizeof col_par[0]; j++)
                        st = tsr_tp_keep_rows_of(col_par[j].f, &t[col_par[j].which], col_par[j].rows, c->dim,
                                                 col_par[j].first, col_par[j].n);
                if (st == TSR_OK)
                        st = tsr_tp_keep_col_slices_of(&L->wo, &t[TSR_LLAMA_MM_O], c->dim, o_cols, o_first,
                                                       (size_t)sh.nh * hd, sh.ns);
                if (st == TSR_OK)
                        st = tsr_tp_keep_col_slices_of(&L->w_down, &t[TSR_LLAMA_MM_DOWN], c->dim, down_cols, down_first,
                                                       sh.hid, sh.ns);
        }
        /* the embedding and lm_head by vocabulary rows (vocabulary-parallel, a tied table
         * once); read as the share, they are already the rank's */
        if (st == TSR_OK && split_rows)         /* those kept in a block format, */
                st = keep_vocab_rows_stored(w, sh.v0, sh.vl);
        if (st == TSR_OK && split_rows)         /* then the float32 ones */
                st = tsr_tp_keep_vocab_rows(&w->output, &w->token_embd, c->vocab_size, c->dim, sh.v0, sh.vl);
        if (st != TSR_OK) {
                tsr_errf(err, errlen, "out of memory while splitting the weights for tensor parallelism");
                return st;      /* the model is half split: the caller frees it */
        }
        m->tp_rank = tp_rank;
        m->tp_size = tp_size;
        m->nh = sh.nh;
        m->nkv = sh.nkv;
        m->hid = sh.hid;
        m->vocab_out = sh.vl;
        m->canonical = true;
        return TSR_OK;
}

void tsr_llama_set_comm(tsr_llama *m, tsr_comm *comm) {
        if (m)
                m->comm = comm;
}


void tsr_llama_free(tsr_llama **mp) {
        if (!mp || !*mp)
                return;
        dev_free(*mp);
        bf16_free(*mp);
        tsr_llama_weights_free(&(*mp)->w);
        free((*mp)->inv_freq);
        free(*mp);
        *mp = NULL;
}

const tsr_llama_config *tsr_llama_config_of(const tsr_llama *m) { return m ? &m->cfg : NULL; }

/* ---- KV cache ---------------------------------------------------------------------- */

/* The one KV group of a Llama: every layer full attention, float32 whatever the weights'
 * dtype (activations and attention stay float32); --kv-cache-dtype fp8 makes the runner
 * store the group as fp8_e4m3 (tsr_kv_groups_set_dtype), which kv_bind accepts. */
tsr_kv_group tsr_llama_kv_group(const tsr_llama_config *c) {
        return (tsr_kv_group){.kind = TSR_KV_FULL_ATTENTION, .n_layers = c->n_layers, .n_kv_heads = c->n_kv_heads,
                              .head_dim = c->head_dim, .dtype = TSR_DTYPE_F32};
}

tsr_status tsr_llama_kv_bind(const tsr_llama *m, tsr_kv_pool *pool, tsr_llama_kv **ret) {
        tsr_kv_group want;
        const tsr_kv_pool_group *g;
        tsr_llama_kv *kv;

        if (!m || !pool || !ret)
                return TSR_E_INVAL;
        want = tsr_llama_kv_group(&m->cfg);
        want.n_layers = m->n_local;
        want.n_kv_heads = m->nkv;
        g = &pool->groups[0];
        if (pool->n_groups != 1 || g->spec.kind != want.kind || g->spec.n_layers != want.n_layers ||
            g->spec.n_kv_heads != want.n_kv_heads || g->spec.head_dim != want.head_dim ||
            !tsr_dtype_is_kv(g->spec.dtype) || !g->k_scale || !g->v_scale)
                return TSR_E_INVAL;
        if (pool->n_blocks > UINT32_MAX)
                return TSR_E_LIMIT;
        kv = calloc(1, sizeof *kv);
        if (!kv)
                return TSR_E_NOMEM;
        kv->n_layers = want.n_layers;
        kv->n_kv_heads = want.n_kv_heads;
        kv->head_dim = want.head_dim;
        kv->block_size = pool->block_size;
        kv->n_blocks = (size_t)pool->n_blocks;
        kv->k = (float **)g->k;
        kv->v = (float **)g->v;
        kv->dtype = g->spec.dtype;
        kv->k_scale = g->k_scale;
        kv->v_scale = g->v_scale;
        kv->block_table = malloc(kv->n_blocks * sizeof *kv->block_table);
        if (!kv->block_table) {
                free(kv);
                return TSR_E_NOMEM;
        }
        for (size_t b = 0; b < kv->n_blocks; b++)
                kv->block_table[b] = (uint32_t)b;
        *ret = kv;
        return TSR_OK;
}

tsr_status tsr_llama_kv_new(const tsr_llama *m, size_t max_tokens, size_t block_size, tsr_llama_kv **ret) {
        tsr_kv_group g;
        tsr_kv_pool *pool = NULL;
        tsr_status st;

        if (!m || !ret || max_tokens == 0)
                return TSR_E_INVAL;
        if (block_size == 0)
                block_size = 16;
        if (max_tokens > UINT32_MAX || block_size > UINT32_MAX)
                return TSR_E_LIMIT;
        g = tsr_llama_kv_group(&m->cfg);
        g.n_layers = m->n_local;
        g.n_kv_heads = m->nkv;
        /* in the memory the forward runs in: the device's after tsr_llama_to_backend */
        if ((st = tsr_kv_pool_new_on(m->dev ? m->dev->be : NULL, &g, 1, (max_tokens + block_size - 1) / block_size,
                                     (uint32_t)block_size, 0, &pool)) != TSR_OK)
                return st;
        if ((st = tsr_llama_kv_bind(m, pool, ret)) != TSR_OK) {
                tsr_kv_pool_free(&pool);
                return st;
        }
        (*ret)->owned_pool = pool;
        return TSR_OK;
}

void tsr_llama_kv_free(tsr_llama_kv **kvp) {
        tsr_llama_kv *kv;

        if (!kvp || !*kvp)
                return;
        kv = *kvp;
        tsr_kv_pool_free(&kv->owned_pool);
        free(kv->block_table);
        free(kv);
        *kvp = NULL;
}

size_t tsr_llama_kv_len(const tsr_llama_kv *kv) { return kv ? kv->len : 0; }

size_t tsr_llama_kv_capacity(const tsr_llama_kv *kv) { return kv ? kv->n_blocks * kv->block_size : 0; }

tsr_status tsr_llama_kv_truncate(tsr_llama_kv *kv, size_t len) {
        if (!kv || len > kv->len)
                return TSR_E_INVAL;
        kv->len = len;
        return TSR_OK;
}

/* The view of one layer through a block table: what the kernels read and write. */
static tsr_kv_view kv_layer_view(const tsr_llama_kv *kv, size_t layer, const uint32_t *table, size_t n_table) {
        return (tsr_kv_view){
                .k = kv->k[layer],
                .v = kv->v[layer],
                .dtype = kv->dtype,
                .k_scale = kv->k_scale[layer],
                .v_scale = kv->v_scale[layer],
                .block_table = table,
                .n_table = n_table,
                .n_blocks = kv->n_blocks,
                .block_size = kv->block_size,
                .n_kv_heads = kv->n_kv_heads,
                .head_dim = kv->head_dim,
        };
}

/* ---- forward ------------------------------------------------------------------------ */

/* Per-call activations for n tokens. */
struct scratch {
        float *x;       /* (n, dim) residual stream */
        float *xb;      /* (n, dim) normed input of a sublayer, then its output */
        float *q;       /* (n, n_heads * head_dim) */
        float *k, *v;   /* (n, n_kv_heads * head_dim) */
        float *att;     /* (n, n_heads * head_dim) attention output before o_proj */
        float *hb, *hb2;  /* (n, hidden_dim) gate and up */
        uint32_t *pos;  /* (n,) */
        /* canonical models (mm_row): one K slice of the rows, and the slices' partial sums */
        float *slice;   /* (n, max(q_dim, hidden_dim) / slices) */
        float *parts;   /* (slices, n, dim) */
};

static void scratch_free(struct scratch *s) {
        free(s->x);
        free(s->xb);
        free(s->q);
        free(s->k);
        free(s->v);
        free(s->att);
        free(s->hb);
        free(s->hb2);
        free(s->pos);
        free(s->slice);
        free(s->parts);
}

static tsr_status scratch_alloc(struct scratch *s, const tsr_llama *m, size_t n) {
        const tsr_llama_config *c = &m->cfg;
        size_t q_dim = (size_t)m->nh * c->head_dim, kv_dim = (size_t)m->nkv * c->head_dim;
        size_t widest = c->dim;

        if (q_dim > widest)
                widest = q_dim;
        if (m->hid > widest)
                widest = m->hid;
        memset(s, 0, sizeof *s);
        if (n > SIZE_MAX / sizeof(float) / widest)
                return TSR_E_LIMIT;
        s->x = malloc(n * c->dim * sizeof(float));
        s->xb = malloc(n * c->dim * sizeof(float));
        s->q = malloc(n * q_dim * sizeof(float));
        s->k = malloc(n * kv_dim * sizeof(float));
        s->v = malloc(n * kv_dim * sizeof(float));
        s->att = malloc(n * q_dim * sizeof(float));
        s->hb = malloc(n * m->hid * sizeof(float));
        s->hb2 = malloc(n * m->hid * sizeof(float));
        s->pos = malloc(n * sizeof(uint32_t));
        if (m->canonical) {     /* once per forward, not per row-parallel matmul */
                size_t ns = TSR_COMM_TREE_LEAVES / m->tp_size, k = q_dim > m->hid ? q_dim : m->hid;
                s->slice = malloc(n * (k / ns) * sizeof(float));
                s->parts = malloc(ns * n * c->dim * sizeof(float));
                if (!s->slice || !s->parts) {
                        scratch_free(s);
                        return TSR_E_NOMEM;
                }
        }
        if (!s->x || !s->xb || !s->q || !s->k || !s->v || !s->att || !s->hb || !s->hb2 || !s->pos) {
                scratch_free(s);
                return TSR_E_NOMEM;
        }
        return TSR_OK;
}

/* The scratch of n tokens on a device backend: views into the model's kept device
 * scratch (dev_reserve), pos on the host (an index array, kernels.h).  The canonical
 * split's buffers stay NULL: it runs on the CPU only (tsr_llama_to_backend). */
static tsr_status scratch_dev(struct scratch *s, const tsr_llama *m, size_t n, size_t logit_rows) {
        size_t dim = m->cfg.dim, q_dim = (size_t)m->nh * m->cfg.head_dim, kv_dim = (size_t)m->nkv * m->cfg.head_dim;
        tsr_status st;
        float *p;

        memset(s, 0, sizeof *s);
        if ((st = dev_reserve(m, n, logit_rows)) != TSR_OK)
                return st;
        if (!(s->pos = malloc(n * sizeof(uint32_t))))
                return TSR_E_NOMEM;
        p = m->dev->scratch;
        s->x = p, p += n * dim;
        s->xb = p, p += n * dim;
        s->q = p, p += n * q_dim;
        s->att = p, p += n * q_dim;
        s->k = p, p += n * kv_dim;
        s->v = p, p += n * kv_dim;
        s->hb = p, p += n * m->hid;
        s->hb2 = p;
        return TSR_OK;
}

/* Release what scratch_alloc / scratch_dev made. */
static void scratch_done(const tsr_llama *m, struct scratch *s) {
        if (m->dev)
                free(s->pos);
        else
                scratch_free(s);
}

/* W (d, n) @ x (rows, n) -> out (rows, d) with layer l's matmul `which` (l < 0: the
 * output matrix), in the dtype the model holds it in (mm_weight): the backend picks the
 * kernel for the tensor's dtype. */
static tsr_status mm(const tsr_llama *m, tsr_backend *be, float *out, const float *x, long l, int which,
                     const float *w_f32, size_t rows, size_t n, size_t d) {
        tsr_tensor t = mm_weight(m, l, which, w_f32);
        if (t.dtype == TSR_DTYPE_FP8_E4M3 || t.dtype == TSR_DTYPE_NVFP4)        /* ModelOpt: with its scales */
                return tsr_backend_matmul_scaled(be, out, x, t.data, t.dtype, &t.scales, rows, n, d);
        return tsr_backend_matmul(be, out, x, t.data, t.dtype, rows, n, d);
}

/* x (rows, dim) = the rows `ids` of the embedding table the model holds (a
 * tensor-parallel rank's vocab_out rows): float32 (on a device, always), or kept in its
 * block format or as a BF16 checkpoint's bytes (token_embd_stored).  A tsr_tp_gather_fn. */
static tsr_status embed_rows(const void *model, tsr_backend *be, float *x, const uint32_t *ids, size_t rows) {
        const tsr_llama *m = model;
        if (m->dev)
                return tsr_backend_embedding(be, x, m->dev->token_embd, m->dev->embd_dtype, m->vocab_out, m->cfg.dim,
                                             ids, rows);
        return tsr_tp_table_rows(be, x, m->w->token_embd, &m->w->token_embd_stored, m->vocab_out, m->cfg.dim, ids,
                                 rows);
}

/* x (rows, dim) = the embedding rows of `tokens`, vocabulary-parallel across the ranks
 * (tsr_tp_embed: the same bits at every tp_size). */
static tsr_status embed(const tsr_llama *m, tsr_backend *be, float *x, const uint32_t *tokens, size_t rows) {
        return tsr_tp_embed(m->comm, m->tp_rank, m->tp_size, m->cfg.vocab_size, m->cfg.dim, tokens, rows, x,
                            embed_rows, m, be);
}

/* A row-parallel matmul, W (d, K) @ x (rows, K) -> out (rows, d) where x holds this rank's
 * K columns: plain `mm` unless the model is canonical; then the S / tp_size K slices of
 * the rank (wo / w_down hold them as contiguous (d, K / S) blocks, tsr_llama_shard_tp)
 * give one fp32 partial each, the balanced tree adds them here and the all-reduce adds
 * the ranks' sums in the same tree (reference/distributed.md R7), so the sum is the same
 * bits for every tp_size. */
static tsr_status mm_row(const tsr_llama *m, tsr_backend *be, struct scratch *s, float *out, const float *x, long l,
                         int which, const float *w_f32, size_t rows, size_t k, size_t d) {
        size_t ns;
        tsr_status st;

        if (!m->canonical)
                return mm(m, be, out, x, l, which, w_f32, rows, k, d);
        ns = TSR_COMM_TREE_LEAVES / m->tp_size;
        tsr_tensor t = mm_weight(m, l, which, w_f32);   /* float32, or its bf16 copy */
        if ((st = tsr_tp_row_partials(be, s->parts, s->slice, x, t.data, t.dtype, &t.scales, rows, k, d, ns)) != TSR_OK)
                return st;
        return tsr_tp_row_reduce(m->comm, m->tp_size, s->parts, ns, out, rows * d);
}

/* logits (rows, vocab) of the normed rows xb (rows, dim): with tensor parallelism each rank
 * computes its vocab_out rows of lm_head and the all-gather puts the vocab back together
 * (every rank gets the whole rows; vLLM's LogitsProcessor gathers the same way). */
static tsr_status lm_head(const tsr_llama *m, tsr_backend *be, float *logits, const float *xb, size_t rows) {
        size_t dim = m->cfg.dim, vl = m->vocab_out;
        float *mine;
        tsr_status st;

        if (m->tp_size == 1)
                return mm(m, be, logits, xb, -1, 0, m->w->output, rows, dim, vl);
        if (!m->comm)
                return TSR_E_INVAL;
        mine = malloc(rows * vl * sizeof(float));
        st = mine ? mm(m, be, mine, xb, -1, 0, m->w->output, rows, dim, vl) : TSR_E_NOMEM;
        if (st == TSR_OK)
                st = tsr_tp_gather_vocab(m->comm, m->tp_rank, m->tp_size, m->cfg.vocab_size, mine, logits, rows);
        free(mine);
        return st;
}

/* The small float32 arrays the forward reads: from the device copy when there is one. */
static const float *attn_norm_of(const tsr_llama *m, size_t l) {
        return m->dev ? m->dev->layers[l].attn_norm : m->w->layers[l].attn_norm;
}

static const float *ffn_norm_of(const tsr_llama *m, size_t l) {
        return m->dev ? m->dev->layers[l].ffn_norm : m->w->layers[l].ffn_norm;
}

/* Rows of logits sequence q asks for. */
static size_t seq_logit_rows(const tsr_llama_seq *q) {
        return q->which == TSR_LLAMA_LOGITS_NONE ? 0 : q->which == TSR_LLAMA_LOGITS_LAST ? 1 : q->n;
}

#define TRY(expr)                               \
        do {                                    \
                if ((st = (expr)) != TSR_OK)    \
                        goto done;              \
        } while (0)

/* Chunk i of a tsr_llama_seq array for tsr_answer_rows. */
static const tsr_engine_seq *llama_chunk(const void *seqs, size_t i, size_t *rows) {
        const tsr_llama_seq *q = (const tsr_llama_seq *)seqs + i;
        *rows = seq_logit_rows(q);
        return q->answer;
}

/* The step's logits rows `lg` (n_rows, vocab) from the device into `logits`, in sequence
 * order, the rows the engine offers as their token, logprobs or prompt logprobs answered
 * on the device instead (answer.h).  A decode step so reads 4 bytes a row instead of
 * vocab * 4 (at 256 rows of a 49152-entry vocabulary, 50 MB a step). */
tsr_status tsr_llama_logits_to_host(tsr_backend *be, const tsr_llama_seq *seqs, size_t n_seqs, float *logits,
                                    float *lg, size_t vocab) {
        return tsr_answer_rows(be, llama_chunk, seqs, n_seqs, logits, lg, vocab);
}

/* One forward's working set: the (possibly padded) sequences, their stacked tokens and
 * KV rows, the scratch, and where the logits go (fwd_setup / fwd_done). */
struct fwd {
        const tsr_llama_seq *seqs;
        size_t n_seqs, N;
        const float *in;
        float *out;
        float *lg;                      /* the logits rows: the caller's host array, or the device's */
        bool want_logits;
        struct scratch s;
        uint32_t *tokens;               /* (N,) */
        tsr_kv_seq *kseqs;              /* the sequences as the batched KV ops take them */
        size_t n_rows_out;              /* logits rows written */
};

/* Release what fwd_setup made; safe to call again, and after a failed fwd_setup (its
 * scratch is set up when s.pos is: both scratch_dev and scratch_alloc make it). */
static void fwd_done(const tsr_llama *m, struct fwd *f) {
        free(f->tokens);
        free(f->kseqs);
        if (f->s.pos)
                scratch_done(m, &f->s);
        f->tokens = NULL;
        f->kseqs = NULL;
        memset(&f->s, 0, sizeof f->s);
}

static tsr_status fwd_setup(const tsr_llama *m, const tsr_llama_seq *seqs, size_t n_seqs, const float *in, float *out,
                            float *logits, struct fwd *f) {
        size_t want_rows = 0;
        tsr_status st;

        memset(f, 0, sizeof *f);
        for (size_t i = 0; i < n_seqs; i++) {
                for (size_t t = 0; t < seqs[i].n; t++)
                        if (seqs[i].tokens[t] >= m->cfg.vocab_size)
                                return TSR_E_INVAL;
                f->N += seqs[i].n;
                want_rows += seq_logit_rows(&seqs[i]);
        }
        st = m->dev ? scratch_dev(&f->s, m, f->N, logits ? want_rows : 0) : scratch_alloc(&f->s, m, f->N);
        if (st != TSR_OK) {
                memset(&f->s, 0, sizeof f->s);  /* a failed scratch freed itself: nothing for fwd_done */
                return st;
        }
        f->seqs = seqs;
        f->n_seqs = n_seqs;
        f->in = in;
        f->out = out;
        f->want_logits = logits != NULL;
        /* The logits land in the caller's host array; on a device, in the kept device
         * array first, downloaded at the end. */
        f->lg = m->dev ? m->dev->logits : logits;
        f->tokens = malloc(f->N * sizeof(uint32_t));
        f->kseqs = malloc(n_seqs * sizeof *f->kseqs);
        if (!f->tokens || !f->kseqs) {
                fwd_done(m, f);
                return TSR_E_NOMEM;
        }
        for (size_t i = 0, row = 0; i < n_seqs; i++) {
                f->kseqs[i] = (tsr_kv_seq){.block_table = seqs[i].block_table, .n_table = seqs[i].n_table,
                                           .n = seqs[i].n, .past_len = seqs[i].past_len};
                for (size_t t = 0; t < seqs[i].n; t++, row++) {
                        f->tokens[row] = seqs[i].tokens[t];
                        f->s.pos[row] = (uint32_t)(seqs[i].past_len + t);
                }
        }
        return TSR_OK;
}

/* The forward's ops, from the embedding (or the previous stage's pair) to the logits rows
 * in f->lg (f->n_rows_out of them) or the pair for the next stage: everything a CUDA
 * graph records (forward_graphed), nothing that waits for the device.
 * Their token rows are stacked into one (N, dim) batch, so every matmul reads its
 * weights once for all rows (continuous batching's gain on a memory-bound decode);
 * only kv_write and attention work per sequence, through its own block table.  Each
 * row's arithmetic is the same whatever else is in the batch (matmul, rmsnorm,
 * add_rmsnorm and rope are per row with a fixed order), so batching never changes a
 * sequence's logits.
 * Logits: per segment, none, the last row, or every row, packed in segment order.
 * A pipeline stage (m holds layers first_layer .. first_layer + n_local - 1): `in` is NULL
 * on the first stage (the embedding runs), else the previous stage's (2, N, dim) pair, x
 * (the residual stream) then xb (its last sublayer's output, not yet added), so the
 * add_rmsnorm that joins two layers runs here exactly as it does in one process; `out`
 * receives that pair when a later stage holds the remaining layers (no logits then). */
static tsr_status forward_ops(const tsr_llama *m, tsr_backend *be, tsr_llama_kv *kv, struct fwd *f) {
        const tsr_llama_config *c = &m->cfg;
        struct scratch *s = &f->s;
        const tsr_llama_seq *seqs = f->seqs;
        size_t N = f->N, n_seqs = f->n_seqs;
        const float *inv_freq = m->dev ? m->dev->inv_freq : m->inv_freq;
        size_t dim = c->dim, hd = c->head_dim, hid = m->hid;
        size_t q_dim = (size_t)m->nh * hd, kv_dim = (size_t)m->nkv * hd;     /* this TP rank's */
        float scale = (float)(1.0 / sqrt((double)hd));
        const tsr_llama_weights *w = m->w;
        bool last_stage = m->first_layer + m->n_local == c->n_layers;
        tsr_status st = TSR_OK;

        f->n_rows_out = 0;
        if (!f->in) {
                TRY(embed(m, be, s->x, f->tokens, N));                                      /* x (N, dim) */
                /* The first layer's attention norm; each later norm is fused with the
                 * residual add before it (add_rmsnorm: x += xb, xb = rmsnorm(x), bitwise the
                 * two ops in turn). */
                if (m->n_local)
                        TRY(tsr_backend_rmsnorm(be, s->xb, s->x, attn_norm_of(m, 0), N, dim, c->rms_eps));
        } else {        /* the previous stage's x and xb: the add and norm it left to this one */
                TRY(tsr_stage_recv(be, s->x, s->xb, f->in, N, dim));
                TRY(tsr_backend_add_rmsnorm(be, s->xb, s->x, s->xb, attn_norm_of(m, 0), N, dim, c->rms_eps));
        }

        for (size_t l = 0; l < m->n_local; l++) {
                const tsr_llama_layer *L = &w->layers[l];

                /* attention: x += o_proj(attn(rope(q), rope(k), v)) of xb = rmsnorm(x) */
                TRY(mm(m, be, s->q, s->xb, (long)l, MM_Q, L->wq, N, dim, q_dim));                /* q (N, q_dim) */
                TRY(mm(m, be, s->k, s->xb, (long)l, MM_K, L->wk, N, dim, kv_dim));               /* k (N, kv_dim) */
                TRY(mm(m, be, s->v, s->xb, (long)l, MM_V, L->wv, N, dim, kv_dim));               /* v (N, kv_dim) */
                TRY(tsr_backend_rope(be, s->q, N, m->nh, hd, s->pos, inv_freq, c->rope_layout));
                TRY(tsr_backend_rope(be, s->k, N, m->nkv, hd, s->pos, inv_freq, c->rope_layout));
                /* every sequence's keys and values into its blocks, then its attention
                 * over them: one call each for the whole batch (kernels.h) */
                tsr_kv_view view = kv_layer_view(kv, l, NULL, 0);
                TRY(tsr_backend_kv_write_batch(be, &view, f->kseqs, n_seqs, s->k, s->v));
                TRY(tsr_backend_attention_batch(be, s->att, s->q, &view, f->kseqs, n_seqs, m->nh,
                                                scale));                                  /* att (N, q_dim) */
                TRY(mm_row(m, be, s, s->xb, s->att, (long)l, MM_O, L->wo, N, q_dim, dim));         /* xb (N, dim) */

                /* MLP: x += down(silu(gate(xb)) * up(xb)), xb = rmsnorm(x) after the attention's add */
                TRY(tsr_backend_add_rmsnorm(be, s->xb, s->x, s->xb, ffn_norm_of(m, l), N, dim, c->rms_eps));
                TRY(mm(m, be, s->hb, s->xb, (long)l, MM_GATE, L->w_gate, N, dim, hid));          /* hb (N, hid) */
                TRY(mm(m, be, s->hb2, s->xb, (long)l, MM_UP, L->w_up, N, dim, hid));             /* hb2 (N, hid) */
                TRY(tsr_backend_silu_mul(be, s->hb, s->hb, s->hb2, N * hid));
                TRY(mm_row(m, be, s, s->xb, s->hb, (long)l, MM_DOWN, L->w_down, N, hid, dim));     /* xb (N, dim) */
                if (l + 1 < m->n_local) {       /* with the next layer's attention norm */
                        TRY(tsr_backend_add_rmsnorm(be, s->xb, s->x, s->xb, attn_norm_of(m, l + 1), N, dim,
                                                    c->rms_eps));
                } else if (!last_stage) {       /* the next stage adds and norms (see above) */
                        TRY(tsr_stage_send(be, f->out, s->x, s->xb, N, dim));
                        goto done;
                } else {                        /* the final norm runs on the gathered rows only */
                        TRY(tsr_backend_add(be, s->x, s->x, s->xb, N * dim));
                }
        }
        if (!f->want_logits)
                goto done;

        /* Only the rows whose logits are wanted go through the final norm and the
         * (vocab, dim) output matrix, the largest matmul of a decode step: gather them,
         * each run of neighbouring rows in one copy (a decode step's are all one run). */
        size_t run_src = 0, run_rows = 0;
        for (size_t i = 0, row = 0; i < n_seqs; row += seqs[i].n, i++) {
                size_t rows = seq_logit_rows(&seqs[i]), first = row + seqs[i].n - rows;
                if (run_rows && first != run_src + run_rows) {
                        TRY(tsr_backend_copy(be, s->xb + (f->n_rows_out - run_rows) * dim, s->x + run_src * dim,
                                             run_rows * dim * sizeof(float)));
                        run_rows = 0;
                }
                if (!run_rows)
                        run_src = first;
                run_rows += rows;
                f->n_rows_out += rows;
        }
        if (run_rows)
                TRY(tsr_backend_copy(be, s->xb + (f->n_rows_out - run_rows) * dim, s->x + run_src * dim,
                                     run_rows * dim * sizeof(float)));
        if (f->n_rows_out) {
                TRY(tsr_backend_rmsnorm(be, s->xb, s->xb, m->dev ? m->dev->output_norm : w->output_norm,
                                        f->n_rows_out, dim, c->rms_eps));
                TRY(lm_head(m, be, f->lg, s->xb, f->n_rows_out));                                 /* (rows, vocab) */
        }
done:
        return st;
}

/* ---- CUDA graphs of decode steps (tsr_llama_set_graphs; issue #16) ---------------------- */

/* After this many failed recordings a batch size runs eagerly for good. */
#define GRAPH_MAX_FAILS 3

/* The index in d->graph_sizes of the graph that runs this step, or -1: eager.  A graph
 * runs a plain decode step of a whole model on one rank (every sequence one new token,
 * its logits wanted; no pipeline stage, no tensor parallelism) of at most the largest
 * recorded batch size, no sequence longer than max_seq_len_to_capture; the batch is
 * padded to the smallest recorded size that holds it (forward_segments). */
static long graph_slot(const tsr_llama *m, const tsr_llama_seq *seqs, size_t n_seqs, const float *in, float *out,
                       const float *logits, uint32_t *longest_ret) {
        const struct llama_dev *d = m->dev;
        size_t longest = 0;
        if (!d || !d->n_graph_sizes || in || out || !logits || m->tp_size != 1 || m->first_layer != 0 ||
            m->n_local != m->cfg.n_layers)
                return -1;
        for (size_t i = 0; i < n_seqs; i++) {
                if (seqs[i].n != 1 || seqs[i].which != TSR_LLAMA_LOGITS_LAST ||
                    seqs[i].past_len + 1 > d->graph_max_len)
                        return -1;
                longest = seqs[i].past_len + 1 > longest ? seqs[i].past_len + 1 : longest;
        }
        *longest_ret = (uint32_t)longest;
        for (size_t k = 0; k < d->n_graph_sizes; k++)
                if (d->graph_sizes[k] >= n_seqs)
                        return d->graph_fails[k] < GRAPH_MAX_FAILS ? (long)k : -1;
        return -1;
}

/* forward_ops of f between tsr_backend_graph_begin(mode) and _end(launch); *launched:
 * whether the graph was queued.  The ops' error first, then the graph's. */
static tsr_status graph_run(const tsr_llama *m, tsr_backend *be, tsr_llama_kv *kv, struct fwd *f, uint64_t key,
                            tsr_graph_mode mode, uint32_t longest, bool launch, bool *launched) {
        tsr_status st = tsr_backend_graph_begin(be, key, mode, m->dev->graph_width, longest), end_st;

        *launched = false;
        if (st != TSR_OK)
                return st;
        st = forward_ops(m, be, kv, f);
        end_st = tsr_backend_graph_end(be, launch, launched);
        return st != TSR_OK ? st : end_st;
}

/* forward_ops of f (a batch of one recorded size whose longest sequence has `longest`
 * tokens) through the graph of the size and that length's class (kernels.h: one graph
 * per class, so that attention launches what the step needs and no more): replayed;
 * when there is none yet (start-up records the shortest class) or the replay does not
 * match (a scratch moved or grew, a table outgrew the width), recorded and launched;
 * when that fails too, run eagerly and counted against the size (its next step records
 * again, from a grown scratch). */
static tsr_status forward_graphed(const tsr_llama *m, tsr_backend *be, tsr_llama_kv *kv, struct fwd *f, size_t k,
                                  uint32_t longest) {
        struct llama_dev *d = m->dev;
        uint64_t key = d->graph_sizes[k];
        bool launched = false;
        tsr_status st;

        if (tsr_backend_graph_has(be, key, longest) &&
            ((st = graph_run(m, be, kv, f, key, TSR_GRAPH_REPLAY, longest, true, &launched)) != TSR_OK || launched)) {
                d->graph_stats.replays += launched;
                return st;
        }
        st = graph_run(m, be, kv, f, key, TSR_GRAPH_CAPTURE, longest, true, &launched);
        if (st == TSR_E_UNSUPPORTED)            /* a backend without graphs */
                d->graph_fails[k] = GRAPH_MAX_FAILS;
        else if (st != TSR_OK || launched) {
                d->graph_stats.captures += launched;
                return st;
        } else {
                d->graph_fails[k]++;
        }
        d->graph_stats.eager++;
        return forward_ops(m, be, kv, f);
}

/* The forward of several sequences at once over `kv`'s pools; arguments already checked:
 * forward_ops, through a CUDA graph where one applies (graph_slot: the batch padded with
 * copies of its last sequence, whose rows are computed and dropped; each writes the same
 * bits to that sequence's newest KV row), then the device's logits down. */
static tsr_status forward_segments(const tsr_llama *m, tsr_backend *be, tsr_llama_kv *kv, const tsr_llama_seq *seqs,
                                   size_t n_seqs, const float *in, float *out, float *logits) {
        uint32_t longest = 0;
        long k = graph_slot(m, seqs, n_seqs, in, out, logits, &longest);
        tsr_llama_seq *padded = NULL;
        struct fwd f;
        tsr_status st;

        if (k >= 0 && m->dev->graph_sizes[k] > n_seqs) {
                size_t S = m->dev->graph_sizes[k];
                if (!(padded = malloc(S * sizeof *padded)))
                        return TSR_E_NOMEM;
                memcpy(padded, seqs, n_seqs * sizeof *padded);
                for (size_t i = n_seqs; i < S; i++) {
                        padded[i] = seqs[n_seqs - 1];
                        padded[i].answer = NULL;
                }
        }
        st = fwd_setup(m, padded ? padded : seqs, padded ? m->dev->graph_sizes[k] : n_seqs, in, out, logits, &f);
        if (st == TSR_OK)
                st = k >= 0 ? forward_graphed(m, be, kv, &f, (size_t)k, longest) : forward_ops(m, be, kv, &f);
        /* the real sequences' rows come first; the padding's are dropped */
        if (st == TSR_OK && m->dev && logits && f.n_rows_out)
                st = tsr_llama_logits_to_host(be, seqs, n_seqs, logits, f.lg, m->cfg.vocab_size);
        fwd_done(m, &f);
        free(padded);
        return st;
}

tsr_status tsr_llama_set_graphs(tsr_llama *m, const uint32_t *sizes, size_t n_sizes, uint32_t table_width,
                                uint32_t max_seq_len) {
        struct llama_dev *d = m ? m->dev : NULL;
        uint32_t *sz = NULL;
        uint8_t *fails = NULL;
        size_t n = 0;

        if (!d || (n_sizes && (!sizes || table_width == 0)))
                return TSR_E_INVAL;
        if (n_sizes && (!(sz = malloc(n_sizes * sizeof *sz)) || !(fails = calloc(n_sizes, 1)))) {
                free(sz);
                return TSR_E_NOMEM;
        }
        if (n_sizes) {
                memcpy(sz, sizes, n_sizes * sizeof *sz);
                n = tsr_cudagraph_sort_sizes(sz, n_sizes);
        }
        tsr_backend_graph_drop(d->be);
        free(d->graph_sizes);
        free(d->graph_fails);
        d->graph_sizes = n ? sz : NULL;
        d->graph_fails = n ? fails : NULL;
        if (!n) {
                free(sz);
                free(fails);
        }
        d->n_graph_sizes = n;
        d->graph_width = table_width;
        d->graph_max_len = max_seq_len;
        memset(&d->graph_stats, 0, sizeof d->graph_stats);
        return TSR_OK;
}

tsr_status tsr_llama_capture_graphs(const tsr_llama *m, tsr_backend *be, tsr_llama_kv *kv, size_t *captured) {
        struct llama_dev *d = m ? m->dev : NULL;
        tsr_llama_seq *seqs = NULL;
        uint32_t token = 0, block = 0;
        float no_host_logits;           /* a device forward's logits stay on the device */
        struct fwd f = {0};
        tsr_status st = TSR_OK;

        if (!captured || !d || !kv || kv->n_blocks == 0 || be != d->be)
                return TSR_E_INVAL;
        *captured = 0;
        if (!d->n_graph_sizes)
                return TSR_OK;
        size_t most = d->graph_sizes[d->n_graph_sizes - 1];
        size_t warm = d->scratch_rows > most ? d->scratch_rows : most, warm_blocks = (warm + kv->block_size - 1) /
                                                                                     kv->block_size;
        uint32_t *zeros = NULL;
        if ((st = dev_reserve(m, warm, d->logits_rows > most ? d->logits_rows : most)) != TSR_OK)
                return st;
        if (!(seqs = malloc(most * sizeof *seqs)) || !(zeros = calloc(warm_blocks, sizeof *zeros))) {
                free(seqs);
                return TSR_E_NOMEM;
        }
        /* Sequences of one token at position 0 in block 0: the values only matter to the
         * warm-up run (which writes block 0's first row, rewritten by whichever request
         * gets the block before it reads it); a capture runs nothing. */
        for (size_t i = 0; i < most; i++)
                seqs[i] = (tsr_llama_seq){.block_table = &block, .n_table = 1, .tokens = &token, .n = 1,
                                          .which = TSR_LLAMA_LOGITS_LAST};
        /* One eager run of the most tokens a step may have first (a prefill of `warm`
         * tokens, every row in block 0): every scratch of the model's and the backend's
         * grows to its size here, outside a recording (which may not allocate), and no
         * later step moves it (which would make every graph record again). */
        uint32_t *wtok = calloc(warm, sizeof *wtok);
        tsr_llama_seq w = {.block_table = zeros, .n_table = warm_blocks, .tokens = wtok, .n = warm,
                           .which = TSR_LLAMA_LOGITS_LAST};
        st = wtok ? fwd_setup(m, &w, 1, NULL, NULL, &no_host_logits, &f) : TSR_E_NOMEM;
        if (st == TSR_OK && (st = forward_ops(m, be, kv, &f)) == TSR_OK)
                st = tsr_backend_synchronize(be);
        fwd_done(m, &f);
        free(wtok);
        for (size_t k = d->n_graph_sizes; k-- > 0 && st == TSR_OK;) {
                bool kept = false;
                /* a second try when the first outgrew the staging (graph_end grew it) */
                for (int attempt = 0; attempt < 2 && !kept && st == TSR_OK; attempt++) {
                        bool launched;
                        if ((st = fwd_setup(m, seqs, d->graph_sizes[k], NULL, NULL, &no_host_logits, &f)) != TSR_OK)
                                break;
                        st = graph_run(m, be, kv, &f, d->graph_sizes[k], TSR_GRAPH_CAPTURE, 1, false, &launched);
                        if (st == TSR_E_UNSUPPORTED)    /* a backend without graphs: every step eager */
                                memset(d->graph_fails, GRAPH_MAX_FAILS, d->n_graph_sizes);
                        kept = st == TSR_OK && tsr_backend_graph_has(be, d->graph_sizes[k], 1);
                        fwd_done(m, &f);
                }
                if (kept)
                        (*captured)++;
                else
                        d->graph_fails[k]++;
        }
        free(seqs);
        free(zeros);
        return st;
}

void tsr_llama_graph_stats_of(const tsr_llama *m, tsr_llama_graph_stats *ret) {
        if (ret)
                *ret = m && m->dev ? m->dev->graph_stats : (tsr_llama_graph_stats){0};
}

/* One sequence through `table`. */
static tsr_status forward_table(const tsr_llama *m, tsr_backend *be, tsr_llama_kv *kv, const uint32_t *table,
                                size_t n_table, const uint32_t *tokens, size_t n, size_t past_len,
                                tsr_llama_logits which, float *logits) {
        tsr_llama_seq one = {
                .block_table = table, .n_table = n_table, .tokens = tokens, .n = n, .past_len = past_len,
                .which = which,
        };
        return forward_segments(m, be, kv, &one, 1, NULL, NULL, logits);
}

/* Checks of one sequence's arguments, shared by every entry point. */
static tsr_status seq_args_ok(const tsr_llama *m, const tsr_llama_kv *kv, const uint32_t *tokens, size_t n,
                              size_t past_len, tsr_llama_logits which) {
        if (!m || !kv || !tokens || n == 0)
                return TSR_E_INVAL;
        if (which != TSR_LLAMA_LOGITS_NONE && which != TSR_LLAMA_LOGITS_LAST && which != TSR_LLAMA_LOGITS_ALL)
                return TSR_E_INVAL;
        if (kv->n_layers != m->n_local || kv->n_kv_heads != m->nkv ||
            kv->head_dim != m->cfg.head_dim)
                return TSR_E_INVAL;     /* a cache made for another model */
        if (past_len > UINT32_MAX || n > UINT32_MAX - past_len)
                return TSR_E_LIMIT;     /* positions are uint32 */
        return TSR_OK;
}

static tsr_status forward_args_ok(const tsr_llama *m, const tsr_backend *be, const tsr_llama_kv *kv,
                                  const uint32_t *tokens, size_t n, size_t past_len, tsr_llama_logits which,
                                  const float *logits) {
        tsr_status st;
        if (which != TSR_LLAMA_LOGITS_NONE && !logits)
                return TSR_E_INVAL;
        if ((st = seq_args_ok(m, kv, tokens, n, past_len, which)) != TSR_OK)
                return st;
        if (m->first_layer != 0 || m->n_local != m->cfg.n_layers)
                return TSR_E_INVAL;     /* a pipeline stage runs through tsr_llama_forward_stage */
        return tsr_llama_check_backend(m, be);
}

tsr_status tsr_llama_forward(const tsr_llama *m, tsr_backend *be, tsr_llama_kv *kv, const uint32_t *tokens, size_t n,
                             size_t past_len, tsr_llama_logits which, float *logits) {
        tsr_status st = forward_args_ok(m, be, kv, tokens, n, past_len, which, logits);

        if (st != TSR_OK)
                return st;
        if (past_len > kv->len)
                return TSR_E_INVAL;
        if (n > tsr_llama_kv_capacity(kv) - past_len)
                return TSR_E_LIMIT;
        for (size_t t = 0; t < n; t++)          /* before the cache is touched */
                if (tokens[t] >= m->cfg.vocab_size)
                        return TSR_E_INVAL;
        /* From here on the cache rows >= past_len are being rewritten. */
        kv->len = past_len;
        st = forward_table(m, be, kv, kv->block_table, kv->n_blocks, tokens, n, past_len, which, logits);
        if (st == TSR_OK)
                kv->len = past_len + n;
        return st;
}

tsr_status tsr_llama_forward_batch(const tsr_llama *m, tsr_backend *be, tsr_llama_kv *pool, const tsr_llama_seq *seqs,
                                   size_t n_seqs, float *logits) {
        return tsr_llama_forward_stage(m, be, pool, seqs, n_seqs, NULL, NULL, logits);
}

tsr_status tsr_llama_forward_stage(const tsr_llama *m, tsr_backend *be, tsr_llama_kv *pool, const tsr_llama_seq *seqs,
                                   size_t n_seqs, const float *in, float *out, float *logits) {
        bool want = false;
        if (!seqs || n_seqs == 0)
                return TSR_E_INVAL;
        for (size_t i = 0; i < n_seqs; i++) {
                const tsr_llama_seq *q = &seqs[i];
                tsr_status st = seq_args_ok(m, pool, q->tokens, q->n, q->past_len, q->which);
                if (st != TSR_OK)
                        return st;
                if (!q->block_table || q->n_table > SIZE_MAX / pool->block_size ||
                    q->past_len + q->n > q->n_table * pool->block_size)
                        return TSR_E_INVAL;
                for (size_t b = 0; b < q->n_table; b++)
                        if (q->block_table[b] >= pool->n_blocks)
                                return TSR_E_INVAL;
                want |= q->which != TSR_LLAMA_LOGITS_NONE;
        }
        /* A stage after the first needs its input, one before the last its output (and
         * makes no logits). */
        tsr_shard_spec range = {.first_layer = m->first_layer, .last_layer = m->first_layer + m->n_local - 1};
        bool last_stage = m->first_layer + m->n_local == m->cfg.n_layers;
        if (!tsr_stage_args_ok(&range, m->cfg.n_layers, in, out, want, logits))
                return TSR_E_INVAL;
        tsr_status st = tsr_llama_check_backend(m, be);
        if (st != TSR_OK)
                return st;
        return forward_segments(m, be, pool, seqs, n_seqs, in, out, last_stage ? logits : NULL);
}

tsr_status tsr_llama_forward_blocks(const tsr_llama *m, tsr_backend *be, tsr_llama_kv *pool,
                                    const uint32_t *block_table, size_t n_table, const uint32_t *tokens, size_t n,
                                    size_t past_len, tsr_llama_logits which, float *logits) {
        tsr_status st = forward_args_ok(m, be, pool, tokens, n, past_len, which, logits);

        if (st != TSR_OK)
                return st;
        if (!block_table || n_table > SIZE_MAX / pool->block_size ||
            past_len + n > n_table * pool->block_size)
                return TSR_E_INVAL;
        for (size_t b = 0; b < n_table; b++)
                if (block_table[b] >= pool->n_blocks)
                        return TSR_E_INVAL;
        return forward_table(m, be, pool, block_table, n_table, tokens, n, past_len, which, logits);
}
