/* test_backend.c - the backend handle of kernels.h: creation, queries, memory, the
 * matmul's dispatch on the weight dtype, and two fast CPU backends with pools of
 * different sizes driven at once from two threads, every result bitwise the
 * reference's (float32 ops; the bf16 matmul bitwise the reference's where the ISA
 * widens, else bitwise the same on both backends: its order is fixed per element).
 * No file-scope mutable state in kernels/ is what makes the last one possible.  And
 * host tasks (tsr_backend_host_tasks): each runs once, on a worker of its own. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kernels/kernels.h"

static uint64_t rng_state = 0x853c49e6748fea9bull;

static float frand(void) {      /* uniform in [-1, 1), xorshift64* */
        rng_state ^= rng_state >> 12;
        rng_state ^= rng_state << 25;
        rng_state ^= rng_state >> 27;
        return (float)((rng_state * 0x2545f4914f6cdd1dull) >> 40) / (float)(1u << 23) - 1.0f;
}

static float *rand_vec(size_t n) {
        float *v = malloc(n * sizeof(float));
        assert_non_null(v);
        for (size_t i = 0; i < n; i++)
                v[i] = frand();
        return v;
}

static tsr_backend *cpu_new(int threads, tsr_cpu_isa isa) {
        tsr_backend *be = NULL;
        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = threads, .max_isa = isa}, &be),
                         TSR_OK);
        assert_non_null(be);
        return be;
}

/* ---- creation, queries, memory ------------------------------------------------------------ */

static void test_create_and_query(void **state) {
        tsr_backend *ref = NULL, *fast = NULL, *cuda = NULL;

        assert_int_equal(tsr_backend_cpu_ref_new(&ref), TSR_OK);
        assert_string_equal(tsr_backend_name(ref), "cpu-ref");
        assert_int_equal(tsr_backend_cpu_isa(ref), TSR_CPU_ISA_SCALAR);
        assert_int_equal(tsr_backend_threads(ref), 1);
        assert_true(tsr_backend_host_memory(ref));

        fast = cpu_new(3, TSR_CPU_ISA_AMX_BF16);
        assert_string_equal(tsr_backend_name(fast), "cpu-fast");
        assert_int_equal(tsr_backend_threads(fast), 3);
        assert_int_equal(tsr_backend_cpu_isa(fast), tsr_cpu_isa_best());
        tsr_backend_free(&fast);
        assert_null(fast);
        fast = cpu_new(1, TSR_CPU_ISA_SCALAR);          /* the cap holds, and 1 thread starts no pool */
        assert_int_equal(tsr_backend_cpu_isa(fast), TSR_CPU_ISA_SCALAR);
        assert_int_equal(tsr_backend_threads(fast), 1);

        /* Every op the Llama forward uses, both weight dtypes; nothing for a NULL handle. */
        for (int op = 0; op < TSR_OP_COUNT; op++) {
                assert_true(tsr_backend_supports(ref, (tsr_op)op, TSR_DTYPE_F32));
                assert_true(tsr_backend_supports(fast, (tsr_op)op, TSR_DTYPE_F32));
                assert_false(tsr_backend_supports(NULL, (tsr_op)op, TSR_DTYPE_F32));
        }
        assert_true(tsr_backend_supports(fast, TSR_OP_MATMUL, TSR_DTYPE_BF16));
        assert_false(tsr_backend_supports(fast, TSR_OP_MATMUL, TSR_DTYPE_COUNT));
        assert_string_equal(tsr_dtype_name(TSR_DTYPE_BF16), "bf16");

        /* Bad arguments are statuses, and the caller's pointer is untouched. */
        tsr_backend *untouched = (tsr_backend *)&untouched;
        assert_int_equal(tsr_backend_cpu_new(NULL, &untouched), TSR_E_INVAL);
        assert_int_equal(tsr_backend_cpu_new(&(tsr_cpu_backend_config){.n_threads = -2}, &untouched), TSR_E_INVAL);
        assert_ptr_equal(untouched, (tsr_backend *)&untouched);
        assert_int_equal(tsr_backend_cpu_ref_new(NULL), TSR_E_INVAL);
        assert_int_equal(tsr_backend_rmsnorm(NULL, NULL, NULL, NULL, 1, 1, 1e-5f), TSR_E_INVAL);
        assert_int_equal(tsr_backend_synchronize(NULL), TSR_E_INVAL);
        tsr_backend_free(NULL);

        /* CUDA: not built, or no device here; a device only where the machine has one. */
        tsr_status st = tsr_backend_cuda_new(0, &cuda);
        if (st == TSR_OK) {
                assert_string_equal(tsr_backend_name(cuda), "cuda");
                assert_false(tsr_backend_host_memory(cuda));
                /* f32 and bf16 weights on cuBLAS; the GGUF blocks and the scaled formats not yet. */
                assert_true(tsr_backend_supports(cuda, TSR_OP_MATMUL, TSR_DTYPE_F32));
                assert_true(tsr_backend_supports(cuda, TSR_OP_MATMUL, TSR_DTYPE_BF16));
                assert_false(tsr_backend_supports(cuda, TSR_OP_MATMUL, TSR_DTYPE_Q8_0));
                assert_int_equal(tsr_backend_matmul(cuda, NULL, NULL, NULL, TSR_DTYPE_F32, 1, 1, 1), TSR_E_INVAL);
                assert_int_equal(tsr_backend_matmul(cuda, NULL, NULL, NULL, TSR_DTYPE_Q8_0, 1, 32, 1),
                                 TSR_E_UNSUPPORTED);
                tsr_backend_free(&cuda);
        } else {
                assert_true(st == TSR_E_UNSUPPORTED || st == TSR_E_NOTFOUND);
                assert_null(cuda);
        }
        /* A negative ordinal: not built says so first, a built backend checks the argument. */
        assert_int_equal(tsr_backend_cuda_new(-1, &cuda), st == TSR_E_UNSUPPORTED ? TSR_E_UNSUPPORTED : TSR_E_INVAL);
        tsr_backend_free(&fast);
        tsr_backend_free(&ref);
}

static void test_memory(void **state) {
        tsr_backend *bes[2] = {NULL, cpu_new(2, TSR_CPU_ISA_AMX_BF16)};
        float host[37], back[37];
        void *p = NULL;

        assert_int_equal(tsr_backend_cpu_ref_new(&bes[0]), TSR_OK);
        for (size_t i = 0; i < 37; i++)
                host[i] = (float)i * 0.5f - 3.0f;
        for (int b = 0; b < 2; b++) {
                tsr_backend *be = bes[b];
                assert_int_equal(tsr_backend_mem_alloc(be, 0, &p), TSR_E_INVAL);
                assert_int_equal(tsr_backend_mem_alloc(be, sizeof host, &p), TSR_OK);
                assert_non_null(p);
                assert_int_equal((uintptr_t)p % 64, 0);
                assert_int_equal(tsr_backend_upload(be, p, host, sizeof host), TSR_OK);
                memset(back, 0, sizeof back);
                assert_int_equal(tsr_backend_download(be, back, p, sizeof back), TSR_OK);
                assert_memory_equal(back, host, sizeof host);
                assert_int_equal(tsr_backend_synchronize(be), TSR_OK);
                assert_int_equal(tsr_backend_upload(be, NULL, host, 4), TSR_E_INVAL);
                assert_int_equal(tsr_backend_download(be, back, p, 0), TSR_OK);
                tsr_backend_mem_free(be, p);
                tsr_backend_mem_free(be, NULL);
                p = NULL;
                tsr_backend_free(&bes[b]);
        }
}

/* One slot, one dtype argument: each dtype reaches its own kernel (the bf16 one rounds x
 * through bf16, so it differs from the float32 one on the same numbers), and a dtype no
 * kernel exists for is TSR_E_UNSUPPORTED with nothing written. */
static void test_matmul_dtype_dispatch(void **state) {
        tsr_backend *ref = NULL;
        size_t n = 35, d = 7, rows = 2;
        float *x = rand_vec(rows * n), *w = rand_vec(d * n), o32[14], o16[14], kept[14];
        uint16_t wb[7 * 35];

        assert_int_equal(tsr_backend_cpu_ref_new(&ref), TSR_OK);
        for (size_t i = 0; i < d * n; i++)
                wb[i] = tsr_f32_to_bf16(w[i]);
        assert_int_equal(tsr_backend_matmul(ref, o32, x, w, TSR_DTYPE_F32, rows, n, d), TSR_OK);
        assert_int_equal(tsr_backend_matmul(ref, o16, x, wb, TSR_DTYPE_BF16, rows, n, d), TSR_OK);
        for (size_t r = 0; r < rows; r++)
                for (size_t i = 0; i < d; i++) {
                        double a = 0;
                        for (size_t k = 0; k < n; k++)
                                a += (double)tsr_bf16_to_f32(wb[i * n + k]) *
                                     tsr_bf16_to_f32(tsr_f32_to_bf16(x[r * n + k]));
                        assert_true(fabs(o16[r * d + i] - a) <= 1e-5 * (1 + fabs(a)));
                }
        assert_memory_not_equal(o32, o16, sizeof o32);
        memcpy(kept, o16, sizeof kept);
        assert_int_equal(tsr_backend_matmul(ref, o16, x, wb, TSR_DTYPE_COUNT, rows, n, d), TSR_E_UNSUPPORTED);
        assert_int_equal(tsr_backend_matmul(ref, o16, x, wb, (tsr_dtype)-1, rows, n, d), TSR_E_UNSUPPORTED);
        assert_memory_equal(o16, kept, sizeof kept);
        free(x);
        free(w);
        tsr_backend_free(&ref);
}

/* ---- two backends, two threads, at once -------------------------------------------------- */

/* Shapes large enough that every op splits over the pool (pool tasks: 16 weight rows of
 * a matmul, 16384 floats of an elementwise op). */
enum { ROWS = 5, N = 576, D = 1536, HEADS = 9, KV_HEADS = 3, HD = 64, PAST = 40, BS = 16 };
#define ELEMS (64 * 1024 + 3)

struct inputs {
        float *x, *w, *norm_w, *a, *b, *res, *q, *k, *v;    /* read-only while threads run */
        uint16_t *wb;
        uint32_t table[(PAST + ROWS + BS - 1) / BS];
};

struct outputs {
        float *mm, *mm_bf16, *att, *norm, *silu, *sum, *res, *fused;
};

static void outputs_alloc(struct outputs *o) {
        *o = (struct outputs){
                .mm = malloc(ROWS * D * sizeof(float)), .mm_bf16 = malloc(ROWS * D * sizeof(float)),
                .att = malloc(ROWS * HEADS * HD * sizeof(float)), .norm = malloc(ELEMS * sizeof(float)),
                .silu = malloc(ELEMS * sizeof(float)), .sum = malloc(ELEMS * sizeof(float)),
                .res = malloc(ELEMS * sizeof(float)), .fused = malloc(ELEMS * sizeof(float)),
        };
        assert_true(o->mm && o->mm_bf16 && o->att && o->norm && o->silu && o->sum && o->res && o->fused);
}

static void outputs_free(struct outputs *o) {
        free(o->mm);
        free(o->mm_bf16);
        free(o->att);
        free(o->norm);
        free(o->silu);
        free(o->sum);
        free(o->res);
        free(o->fused);
}

/* Every op once on `be`; TSR_OK or the first failure.  The KV cache (k, v) was written
 * before; attention only reads it.  rmsnorm and add_rmsnorm see ELEMS / 257 rows of 257. */
static tsr_status run_ops(tsr_backend *be, const struct inputs *in, struct outputs *o) {
        tsr_kv_view kv = {.k = in->k, .v = in->v, .block_table = in->table,
                          .n_table = sizeof in->table / sizeof in->table[0],
                          .n_blocks = sizeof in->table / sizeof in->table[0], .block_size = BS,
                          .n_kv_heads = KV_HEADS, .head_dim = HD};
        size_t dim = 257, rows = ELEMS / 257;
        tsr_status st;

        if ((st = tsr_backend_matmul(be, o->mm, in->x, in->w, TSR_DTYPE_F32, ROWS, N, D)) != TSR_OK ||
            (st = tsr_backend_matmul(be, o->mm_bf16, in->x, in->wb, TSR_DTYPE_BF16, ROWS, N, D)) != TSR_OK ||
            (st = tsr_backend_attention(be, o->att, in->q, &kv, ROWS, PAST, HEADS, 0.125f)) != TSR_OK ||
            (st = tsr_backend_rmsnorm(be, o->norm, in->a, in->norm_w, rows, dim, 1e-5f)) != TSR_OK ||
            (st = tsr_backend_silu_mul(be, o->silu, in->a, in->b, ELEMS)) != TSR_OK ||
            (st = tsr_backend_add(be, o->sum, in->a, in->b, ELEMS)) != TSR_OK)
                return st;
        memcpy(o->res, in->res, ELEMS * sizeof(float));
        return tsr_backend_add_rmsnorm(be, o->fused, o->res, in->a, in->norm_w, rows, dim, 1e-5f);
}

/* The results bitwise equal?  bf16: `bf16_too` where both ran the same bf16 order. */
static bool outputs_equal(const struct outputs *a, const struct outputs *b, bool bf16_too) {
        return memcmp(a->mm, b->mm, ROWS * D * sizeof(float)) == 0 &&
               (!bf16_too || memcmp(a->mm_bf16, b->mm_bf16, ROWS * D * sizeof(float)) == 0) &&
               memcmp(a->att, b->att, ROWS * HEADS * HD * sizeof(float)) == 0 &&
               memcmp(a->norm, b->norm, (ELEMS / 257) * 257 * sizeof(float)) == 0 &&
               memcmp(a->silu, b->silu, ELEMS * sizeof(float)) == 0 &&
               memcmp(a->sum, b->sum, ELEMS * sizeof(float)) == 0 &&
               memcmp(a->res, b->res, (ELEMS / 257) * 257 * sizeof(float)) == 0 &&
               memcmp(a->fused, b->fused, (ELEMS / 257) * 257 * sizeof(float)) == 0;
}

struct runner {
        tsr_backend *be;                /* this thread's own */
        const struct inputs *in;
        const struct outputs *want;     /* the reference's */
        const struct outputs *want_bf16_from;   /* the other backend's single-threaded run, for the bf16 matmul */
        bool bf16_is_ref;               /* this ISA's bf16 matmul is bitwise the reference's */
        int rounds, failed_round;       /* -1: all rounds bitwise equal */
        tsr_status st;
};

static void *run_rounds(void *arg) {
        struct runner *r = arg;
        struct outputs got;
        outputs_alloc(&got);
        r->failed_round = -1;
        r->st = TSR_OK;
        for (int i = 0; i < r->rounds && r->failed_round < 0; i++) {
                memset(got.mm_bf16, 0xff, ROWS * D * sizeof(float));
                if ((r->st = run_ops(r->be, r->in, &got)) != TSR_OK ||
                    !outputs_equal(&got, r->want, r->bf16_is_ref) ||
                    memcmp(got.mm_bf16, r->want_bf16_from->mm_bf16, ROWS * D * sizeof(float)) != 0)
                        r->failed_round = i;
        }
        outputs_free(&got);
        return NULL;
}

static void test_two_backends_concurrently(void **state) {
        struct inputs in = {.x = rand_vec(ROWS * N), .w = rand_vec(D * N), .norm_w = rand_vec(257),
                            .a = rand_vec(ELEMS), .b = rand_vec(ELEMS), .res = rand_vec(ELEMS),
                            .q = rand_vec(ROWS * HEADS * HD)};
        size_t n_table = sizeof in.table / sizeof in.table[0], kv_floats = n_table * BS * KV_HEADS * HD;
        tsr_backend *ref = NULL, *solo = NULL;
        struct outputs want, want_bf16;

        in.wb = malloc(D * N * sizeof(uint16_t));
        assert_non_null(in.wb);
        for (size_t i = 0; i < (size_t)D * N; i++)
                in.wb[i] = tsr_f32_to_bf16(in.w[i]);
        in.k = calloc(kv_floats, sizeof(float));
        in.v = calloc(kv_floats, sizeof(float));
        assert_true(in.k && in.v);
        for (size_t i = 0; i < n_table; i++)
                in.table[i] = (uint32_t)(n_table - 1 - i);      /* blocks out of order, as a pool hands them */
        assert_int_equal(tsr_backend_cpu_ref_new(&ref), TSR_OK);
        {
                tsr_kv_view kv = {.k = in.k, .v = in.v, .block_table = in.table, .n_table = n_table,
                                  .n_blocks = n_table, .block_size = BS, .n_kv_heads = KV_HEADS, .head_dim = HD};
                float *kn = rand_vec((PAST + ROWS) * KV_HEADS * HD), *vn = rand_vec((PAST + ROWS) * KV_HEADS * HD);
                assert_int_equal(tsr_backend_kv_write(ref, &kv, kn, vn, PAST + ROWS, 0), TSR_OK);
                free(kn);
                free(vn);
        }
        outputs_alloc(&want);
        outputs_alloc(&want_bf16);
        assert_int_equal(run_ops(ref, &in, &want), TSR_OK);
        /* The bf16 matmul of the fast ISA, alone and single-threaded: what both threads must give. */
        solo = cpu_new(1, TSR_CPU_ISA_AMX_BF16);
        assert_int_equal(run_ops(solo, &in, &want_bf16), TSR_OK);
        assert_true(outputs_equal(&want_bf16, &want, false));
        bool bf16_is_ref = tsr_backend_cpu_isa(solo) < TSR_CPU_ISA_AVX512_BF16;
        if (bf16_is_ref)
                assert_memory_equal(want_bf16.mm_bf16, want.mm_bf16, ROWS * D * sizeof(float));
        tsr_backend_free(&solo);

        /* Two backends, pools of 2 and 3 threads (5 threads on this process's cores at
         * once), driven from two threads for 6 rounds each. */
        struct runner r[2] = {
                {.be = cpu_new(2, TSR_CPU_ISA_AMX_BF16), .in = &in, .want = &want, .want_bf16_from = &want_bf16,
                 .bf16_is_ref = bf16_is_ref, .rounds = 6},
                {.be = cpu_new(3, TSR_CPU_ISA_AMX_BF16), .in = &in, .want = &want, .want_bf16_from = &want_bf16,
                 .bf16_is_ref = bf16_is_ref, .rounds = 6},
        };
        assert_int_equal(tsr_backend_threads(r[0].be), 2);
        assert_int_equal(tsr_backend_threads(r[1].be), 3);
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, run_rounds, &r[0]), 0);
        run_rounds(&r[1]);
        assert_int_equal(pthread_join(th, NULL), 0);
        for (int i = 0; i < 2; i++) {
                if (r[i].st != TSR_OK)
                        fail_msg("backend %d (%d threads): %s", i, tsr_backend_threads(r[i].be),
                                 tsr_status_str(r[i].st));
                if (r[i].failed_round >= 0)
                        fail_msg("backend %d (%d threads, %s): round %d differs from cpu-ref", i,
                                 tsr_backend_threads(r[i].be), tsr_cpu_isa_name(tsr_backend_cpu_isa(r[i].be)),
                                 r[i].failed_round);
                tsr_backend_free(&r[i].be);
        }
        print_message("two cpu-fast backends (2 and 3 threads, %s) at once: 6 rounds each bitwise cpu-ref%s\n",
                      tsr_cpu_isa_name(tsr_cpu_isa_best()),
                      bf16_is_ref ? " (bf16 matmul too)" : "; bf16 matmul bitwise the single-threaded run");
        outputs_free(&want);
        outputs_free(&want_bf16);
        tsr_backend_free(&ref);
        free(in.x);
        free(in.w);
        free(in.wb);
        free(in.norm_w);
        free(in.a);
        free(in.b);
        free(in.res);
        free(in.q);
        free(in.k);
        free(in.v);
}

/* ---- host tasks --------------------------------------------------------------------------- */

struct task_log {
        int threads;
        unsigned runs[1000];            /* how often each task ran */
        int worker[1000];               /* which worker ran it */
        unsigned busy[8];               /* tasks running per worker right now (never above 1) */
        unsigned overlap;
};

static void log_task(void *ctx, size_t i, int worker) {
        struct task_log *l = ctx;
        assert_true(worker >= 0 && worker < l->threads);
        if (__atomic_fetch_add(&l->busy[worker], 1, __ATOMIC_SEQ_CST) != 0)
                __atomic_fetch_add(&l->overlap, 1, __ATOMIC_SEQ_CST);
        __atomic_fetch_add(&l->runs[i], 1, __ATOMIC_SEQ_CST);
        l->worker[i] = worker;
        __atomic_fetch_sub(&l->busy[worker], 1, __ATOMIC_SEQ_CST);
}

/* tsr_backend_host_tasks runs every task once, each on a worker index below the thread
 * count that no other task uses at the same time; the reference runs them in order on
 * worker 0.  Zero tasks is a no-op; a missing task function with tasks is refused. */
static void test_host_tasks(void **state) {
        tsr_backend *ref = NULL, *fast = cpu_new(3, TSR_CPU_ISA_AMX_BF16), *one = cpu_new(1, TSR_CPU_ISA_SCALAR);
        tsr_backend *bs[3];
        static struct task_log l;

        (void)state;
        assert_int_equal(tsr_backend_cpu_ref_new(&ref), TSR_OK);
        bs[0] = ref, bs[1] = fast, bs[2] = one;
        for (size_t b = 0; b < 3; b++) {
                memset(&l, 0, sizeof l);
                l.threads = tsr_backend_threads(bs[b]);
                assert_int_equal(tsr_backend_host_tasks(bs[b], 1000, log_task, &l), TSR_OK);
                for (size_t i = 0; i < 1000; i++)
                        assert_int_equal(l.runs[i], 1);
                assert_int_equal(l.overlap, 0);
                if (b != 1)
                        for (size_t i = 0; i < 1000; i++)
                                assert_int_equal(l.worker[i], 0);
                assert_int_equal(tsr_backend_host_tasks(bs[b], 0, NULL, NULL), TSR_OK);
                assert_int_equal(tsr_backend_host_tasks(bs[b], 1, NULL, NULL), TSR_E_INVAL);
        }
        assert_int_equal(tsr_backend_host_tasks(NULL, 1, log_task, &l), TSR_E_INVAL);
        tsr_backend_free(&ref);
        tsr_backend_free(&fast);
        tsr_backend_free(&one);
}

/* <root>/cpu<c>/topology/{physical_package_id,core_id}. */
static void put_topology(const char *root, int cpu, int pkg, int core) {
        char path[512];
        FILE *f;
        snprintf(path, sizeof path, "%s/cpu%d", root, cpu);
        assert_int_equal(mkdir(path, 0700), 0);
        snprintf(path, sizeof path, "%s/cpu%d/topology", root, cpu);
        assert_int_equal(mkdir(path, 0700), 0);
        snprintf(path, sizeof path, "%s/cpu%d/topology/physical_package_id", root, cpu);
        assert_non_null(f = fopen(path, "w"));
        fprintf(f, "%d\n", pkg);
        fclose(f);
        snprintf(path, sizeof path, "%s/cpu%d/topology/core_id", root, cpu);
        assert_non_null(f = fopen(path, "w"));
        fprintf(f, "%d\n", core);
        fclose(f);
}

/* The default thread count counts physical cores: a fake sysfs of two packages, each of
 * two cores with two SMT threads (cpus 0-3 the first threads, 4-7 their siblings; core
 * ids repeat across packages): all 8 CPUs are 4 cores, the first threads alone 4, one
 * core's two threads 1, the same core id in two packages 2; a CPU without topology
 * counts the CPUs.  And the real one is at least 1. */
static void test_default_threads_physical_cores(void **state) {
        char root[] = "/tmp/tsr-sysfs-XXXXXX";
        (void)state;
        assert_non_null(mkdtemp(root));
        for (int cpu = 0; cpu < 8; cpu++)
                put_topology(root, cpu, (cpu % 4) / 2, cpu % 2);
        const int all[] = {0, 1, 2, 3, 4, 5, 6, 7}, firsts[] = {0, 1, 2, 3}, one_core[] = {0, 4}, pkgs[] = {0, 2},
                  missing[] = {0, 9, 1};
        assert_int_equal(tsr_cpu_cores_of(all, 8, root), 4);
        assert_int_equal(tsr_cpu_cores_of(firsts, 4, root), 4);
        assert_int_equal(tsr_cpu_cores_of(one_core, 2, root), 1);
        assert_int_equal(tsr_cpu_cores_of(pkgs, 2, root), 2);
        assert_int_equal(tsr_cpu_cores_of(missing, 3, root), 3);
        assert_int_equal(tsr_cpu_cores_of(all, 0, root), 0);
        assert_true(tsr_cpu_default_threads() >= 1);
        char cmd[600];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
        assert_int_equal(system(cmd), 0);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_default_threads_physical_cores),
                cmocka_unit_test(test_create_and_query),
                cmocka_unit_test(test_memory),
                cmocka_unit_test(test_matmul_dtype_dispatch),
                cmocka_unit_test(test_two_backends_concurrently),
                cmocka_unit_test(test_host_tasks),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
