/* Our CPU kernels: y[M, N] (fp32) = x[M, K] (fp32) @ W (bf16, packed once) (+ bias) for any M,
 * and causal attention over the KV pool, both batch invariant by construction.
 *
 * Why our own kernel: a decode or verification step multiplies 1-16 rows by every weight.
 * A BLAS (OpenBLAS fp32, oneDNN bf16) re-packs or re-reads the weights per call and picks a
 * kernel by the row count, so a step over 2-16 rows costs 1.5-3x a step over 1 row (measured,
 * `benchmarks/matmul_kernels.py`). Here the weights are packed once, at load, so every call
 * streams each weight byte once, whatever the row count, and each row's result comes from the
 * same instruction sequence whatever the other rows are (batch invariant by construction).
 *
 * Numerics: weight-only bf16. Weights are widened to fp32 exactly (a bf16 is the top half of
 * an fp32), activations stay fp32, and each output is one fp32 FMA chain over k = 0..K-1 in
 * order. The weights' rounding to bf16 is the only difference with an fp32 matmul.
 *
 * Layout: W [K, N] as groups of 64 columns, each group contiguous: wp[group][k][64]
 * (128 bytes per k: one stream per group, which hardware prefetchers follow). A tile of up to
 * ROWS rows keeps ROWS x 4 accumulators of 16 floats in registers for the whole K loop.
 * Threads split the groups; more rows are more tiles over the same group, re-read from L1/L2.
 *
 * Threads: our own small pool, not OpenMP. A step makes ~120 of these calls, each 0.05-5 ms.
 * Waking sleeping threads for each (OpenMP with OMP_WAIT_POLICY=PASSIVE, which the runtime
 * needs so that PyTorch's threads do not spin against numpy's BLAS threads) cost ~40 ms per
 * step here; so our workers spin for a short while after each call (SPIN_NS) and only then
 * sleep, without changing how PyTorch's or numpy's threads wait.
 */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#define GROUP 64   /* columns per group: 4 panels of 16 */
#define ROWS 6     /* rows per tile: 6 x 4 accumulators + a weight and a broadcast register */
#define PREFETCH 2048  /* elements ahead (4 KB) in the group's stream */

/* 32 bf16 -> two vectors of 16 fp32, exact (a bf16 is the top half of an fp32): interleaving
 * zeros below each bf16 is one shuffle-port instruction per 16 values, leaving the FMA ports to
 * the FMAs (~10% faster than widening by zero-extend and shift, measured). The shuffle works
 * within 128-bit lanes, so the packing (`PackedWeight`) stores each 32 columns permuted such that
 * the low interleave yields columns 0-15 in order and the high one columns 16-31. */
static inline void widen32(const uint16_t *w, __m512 *low, __m512 *high) {
    __m512i packed = _mm512_loadu_si512((const void *)w), zero = _mm512_setzero_si512();
    *low = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, packed));
    *high = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, packed));
}

/* e^x for 16 floats (Cephes' expf: range reduction by ln 2 in two parts, a degree-7 polynomial,
 * 2^n by scalef): within 2 ulp of expf over the range softmax and SiLU use, and the same bits for
 * the same input wherever it sits in a batch. Inputs below -87.3 give ~0, above 88.3 give ~3e38. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
    return _mm512_scalef_ps(_mm512_add_ps(p, _mm512_set1_ps(1.0f)), n);
}

static inline __mmask16 tail_mask(long left) {  /* the first `left` of 16 lanes (all when >= 16) */
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
}

#define DEFINE_TILE(R)                                                                              \
    static void tile_##R(const float *x, long ldx, const uint16_t *w, long K, float *y, long ldy,    \
                         const __mmask16 *mask, const float *bias, int accumulate) {                \
        __m512 acc[4][R];                                                                           \
        for (int p = 0; p < 4; p++)                                                                 \
            for (int r = 0; r < R; r++) acc[p][r] = _mm512_setzero_ps();                            \
        for (long k = 0; k < K; k++) {                                                              \
            const uint16_t *wk = w + k * GROUP;                                                     \
            _mm_prefetch((const char *)(wk + PREFETCH), _MM_HINT_T0);                               \
            _mm_prefetch((const char *)(wk + PREFETCH + 32), _MM_HINT_T0);                          \
            __m512 wv[4];                                                                           \
            widen32(wk, &wv[0], &wv[1]);                                                            \
            widen32(wk + 32, &wv[2], &wv[3]);                                                       \
            for (int p = 0; p < 4; p++)                                                             \
                for (int r = 0; r < R; r++)                                                         \
                    acc[p][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), wv[p], acc[p][r]);  \
        }                                                                                           \
        for (int p = 0; p < 4; p++) {                                                               \
            __m512 b = bias ? _mm512_maskz_loadu_ps(mask[p], bias + 16 * p) : _mm512_setzero_ps();  \
            for (int r = 0; r < R; r++) {                                                           \
                __m512 out = _mm512_add_ps(acc[p][r], b);                                           \
                if (accumulate) /* y += x @ W + b: the residual add in the same pass */             \
                    out = _mm512_add_ps(_mm512_maskz_loadu_ps(mask[p], y + r * ldy + 16 * p), out);  \
                _mm512_mask_storeu_ps(y + r * ldy + 16 * p, mask[p], out);                          \
            }                                                                                       \
        }                                                                                           \
    }

DEFINE_TILE(1) DEFINE_TILE(2) DEFINE_TILE(3) DEFINE_TILE(4) DEFINE_TILE(5) DEFINE_TILE(6)

typedef void (*tile_fn)(const float *, long, const uint16_t *, long, float *, long, const __mmask16 *, const float *,
                        int);
static const tile_fn TILES[ROWS + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

typedef struct {
    const float *x; long M, ldx; const uint16_t *wp; long K, N; float *y; long ldy; const float *bias;
    int accumulate;  /* y += x @ W + b instead of y = x @ W + b */
} gemm_args;

/* Groups [first, last) of one call. */
static void gemm_groups(const gemm_args *a, long first, long last) {
    const float *x = a->x, *bias = a->bias;
    long M = a->M, ldx = a->ldx, K = a->K, N = a->N, ldy = a->ldy;
    for (long g = first; g < last; g++) {
        __mmask16 mask[4];
        for (int p = 0; p < 4; p++) mask[p] = tail_mask(N - g * GROUP - 16 * p);
        const float *b = bias ? bias + g * GROUP : 0;
        for (long r0 = 0; r0 < M; r0 += ROWS) {
            long rows = M - r0 < ROWS ? M - r0 : ROWS;
            TILES[rows](x + r0 * ldx, ldx, a->wp + g * K * GROUP, K, a->y + r0 * ldy + g * GROUP, ldy, mask, b,
                        a->accumulate);
        }
    }
}

/* ---- the pool ---------------------------------------------------------------------------- */

#define MAX_THREADS 64
#define SPIN_NS 500000L  /* a worker spins this long after a call before it sleeps */

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;   /* one call at a time */
static pthread_mutex_t sleep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int num_threads = 0;           /* workers + the caller; 0 = not started */
static atomic_long generation = 0;    /* bumped once per call */
static atomic_int finished = 0;       /* workers done with the current call */
static atomic_int ready = 0;          /* workers started and waiting for their first call */
static int wanted_threads = 1;        /* what dspark_start_threads asked for (restarted after fork) */
typedef void (*range_fn)(const void *ctx, long first, long last);
static range_fn current_fn;
static const void *current_ctx;
static long current_count;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void run_share(int index) {  /* contiguous, equal shares: thread i owns items [i*N/n, (i+1)*N/n) */
    long first = current_count * index / num_threads, last = current_count * (index + 1) / num_threads;
    current_fn(current_ctx, first, last);
}

static void *worker(void *arg) {
    int index = (int)(long)arg;
    /* The pool is started under pool_lock, which no call can take before every worker has read
     * the generation it starts from: a call made right after start-up is never missed. */
    long seen = atomic_load(&generation);
    atomic_fetch_add(&ready, 1);
    for (;;) {
        long start = now_ns(), g;
        int spins = 0;
        while ((g = atomic_load_explicit(&generation, memory_order_acquire)) == seen) {
            _mm_pause();
            if ((++spins & 127) == 0 && now_ns() - start > SPIN_NS) {
                pthread_mutex_lock(&sleep_lock);
                while ((g = atomic_load(&generation)) == seen) pthread_cond_wait(&wake, &sleep_lock);
                pthread_mutex_unlock(&sleep_lock);
                break;
            }
        }
        seen = g;
        run_share(index);
        atomic_fetch_add_explicit(&finished, 1, memory_order_release);
    }
    return 0;
}

/* fork: the child has none of the workers. Both locks are held across fork (so neither is copied
 * in the middle of a call) and released on both sides; the child restarts its pool on first use. */
static void before_fork(void) {
    pthread_mutex_lock(&pool_lock);
    pthread_mutex_lock(&sleep_lock);
}

static void after_fork_in_parent(void) {
    pthread_mutex_unlock(&sleep_lock);
    pthread_mutex_unlock(&pool_lock);
}

static void after_fork_in_child(void) {
    num_threads = 0;
    atomic_store(&ready, 0);
    pthread_mutex_unlock(&sleep_lock);
    pthread_mutex_unlock(&pool_lock);
}

/* Start the workers (pool_lock held): wanted_threads in all, the caller being one. */
static void start_locked(void) {
    static int atfork_registered = 0;
    if (!atfork_registered) {
        pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
        atfork_registered = 1;
    }
    num_threads = 1;
    atomic_store(&ready, 0);
    for (int i = 1; i < wanted_threads; i++) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, worker, (void *)(long)i);
        pthread_attr_destroy(&attr);
        if (failed) break;
        num_threads++;
    }
    while (atomic_load(&ready) < num_threads - 1) _mm_pause();  /* every worker has read `generation` */
}

/* Start the pool with `threads` threads in all (the caller is one); returns how many run. */
int dspark_start_threads(int threads) {
    pthread_mutex_lock(&pool_lock);
    if (num_threads == 0) {
        wanted_threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
        start_locked();
    }
    int started = num_threads;
    pthread_mutex_unlock(&pool_lock);
    return started;
}

/* Run fn(ctx, first, last) over [0, count) on the pool (on the caller alone when `count` is
 * below `min_per_thread` per thread). Items are split in contiguous equal shares, so which thread
 * computes an item never changes what it computes. */
static void parallel_for(range_fn fn, const void *ctx, long count, long min_per_thread) {
    pthread_mutex_lock(&pool_lock);
    if (num_threads == 0 && wanted_threads > 1) start_locked();  /* first use in a forked child */
    if (num_threads <= 1 || count < min_per_thread * num_threads) {
        pthread_mutex_unlock(&pool_lock);
        fn(ctx, 0, count);
        return;
    }
    current_fn = fn;
    current_ctx = ctx;
    current_count = count;
    atomic_store(&finished, 0);
    pthread_mutex_lock(&sleep_lock);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&sleep_lock);
    run_share(0);
    while (atomic_load_explicit(&finished, memory_order_acquire) < num_threads - 1) _mm_pause();
    pthread_mutex_unlock(&pool_lock);
}

static void gemm_range(const void *ctx, long first, long last) { gemm_groups((const gemm_args *)ctx, first, last); }

/* x [M, K] fp32 (row stride ldx), wp packed [ceil(N/64)][K][64] bf16, y [M, N] (row stride ldy),
 * bias [N] or NULL. */
static void gemm(const float *x, long M, long ldx, const uint16_t *wp, long K, long N, float *y, long ldy,
                 const float *bias, int accumulate) {
    gemm_args args = {x, M, ldx, wp, K, N, y, ldy, bias, accumulate};
    parallel_for(gemm_range, &args, (N + GROUP - 1) / GROUP, 2);
}

void dspark_bf16_gemm(const float *x, long M, long ldx, const uint16_t *wp, long K, long N, float *y, long ldy,
                      const float *bias) {
    gemm(x, M, ldx, wp, K, N, y, ldy, bias, 0);
}

/* ---- attention ------------------------------------------------------------------------------
 *
 * Causal grouped-query attention of packed new tokens over the KV pool, one (token, head) at a
 * time: token t of slot s at position p sees keys 0..p of its slot, exactly those (no padding,
 * no masking), scores, softmax and the weighted sum of values each in one fixed order over
 * keys. A token's output therefore depends on its query and its slot's keys/values only: not on
 * how many tokens share the call, which feeds they belong to, or how a prompt was chunked
 * (batch invariant by construction). fp32 throughout. */

typedef struct {
    const float *q; long ldq, heads, kv_heads, dim;
    const float *keys, *values; long slot_stride, head_stride;  /* element strides of one layer's pool */
    const long *slots, *positions; float scale; float *out; long ldo;
} attention_args;

/* The 16 horizontal sums of v[0..15], as one vector (lane i = sum of v[i]'s lanes): a transpose
 * tree of 15 shuffle/add pairs instead of 16 separate reductions. */
static inline __m512 sum16(__m512 *v) {
    __m512 t[8], w[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: the lane sums of v[4i .. 4i+3] */
        __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]));
        __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]));
        w[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

/* scores[j] = (q . k_j) * scale for keys j in [0, length), 16 keys at a time (a partial last
 * block reads only its own keys). */
static void score_keys(const float *q, const float *k, long dim, long length, float scale, float *scores) {
    long chunks = (dim + 15) / 16;
    __mmask16 last = tail_mask(dim - 16 * (chunks - 1));
    for (long j0 = 0; j0 < length; j0 += 16) {
        long n = length - j0 < 16 ? length - j0 : 16;
        const float *block = k + j0 * dim;
        __m512 v[16];
        for (int i = 0; i < 16; i++) v[i] = _mm512_setzero_ps();
        for (long c = 0; c < chunks; c++) {
            __mmask16 m = c == chunks - 1 ? last : (__mmask16)0xFFFF;
            __m512 qc = _mm512_maskz_loadu_ps(m, q + 16 * c);
            if (n == 16) {
                for (int i = 0; i < 16; i++)
                    v[i] = _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(m, block + i * dim + 16 * c), v[i]);
            } else {
                for (int i = 0; i < 16; i++)
                    if (i < n) v[i] = _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(m, block + i * dim + 16 * c), v[i]);
            }
        }
        _mm512_mask_storeu_ps(scores + j0, tail_mask(n), _mm512_mul_ps(sum16(v), _mm512_set1_ps(scale)));
    }
}

static atomic_int attention_failed = 0;  /* set when a share could not allocate its scratch */

#define RUN_TOKENS 16  /* queries of one slot attended together (they share each key and value load) */

typedef struct { const attention_args *a; const long *run_start; long num_runs; } run_args;

/* One item = (run of up to RUN_TOKENS consecutive tokens of one slot, head). The run's queries
 * go over the keys block by block (16 keys, 4 KB at head_dim 64, read from L2 once and then
 * from L1 by every query) and over the values likewise, but each query's arithmetic is exactly
 * what it would be alone: its scores over keys 0..visible, in 16-key blocks from key 0; its
 * softmax over its own length; its weighted sum in two chains (even and odd keys) in key
 * order, kept in memory between blocks (exact). So a token's output still depends on its
 * query and its slot's keys/values only (batch invariant by construction). */
static void attention_runs(const void *ctx, long first, long last) {
    const run_args *ra = (const run_args *)ctx;
    const attention_args *a = ra->a;
    long dim = a->dim, group = a->heads / a->kv_heads, padded = (dim + 63) / 64 * 64;
    long score_capacity = 0;
    float *scores = 0;
    float *sums = (float *)aligned_alloc(64, sizeof(float) * RUN_TOKENS * 2 * padded);  /* even, odd per query */
    float totals[RUN_TOKENS];
    long lengths[RUN_TOKENS];
    if (sums == 0) {
        atomic_store(&attention_failed, 1);
        return;
    }
    for (long item = first; item < last; item++) {
        long run = item / a->heads, h = item % a->heads;
        long t0 = ra->run_start[run], n = ra->run_start[run + 1] - t0, longest = 0;
        for (long i = 0; i < n; i++) {
            lengths[i] = a->positions[t0 + i] + 1;
            longest = lengths[i] > longest ? lengths[i] : longest;
        }
        long stride = (longest + 15) / 16 * 16;  /* a query's score row */
        if (n * stride > score_capacity) {
            free(scores);
            score_capacity = n * stride > 16384 ? n * stride : 16384;
            scores = (float *)malloc(sizeof(float) * score_capacity);
            if (scores == 0) {
                atomic_store(&attention_failed, 1);
                break;
            }
        }
        long base = a->slots[t0] * a->slot_stride + (h / group) * a->head_stride;
        const float *k = a->keys + base, *v = a->values + base;
        for (long j0 = 0; j0 < longest; j0 += 16)  /* scores, block by block */
            for (long i = 0; i < n; i++)
                if (j0 < lengths[i]) {
                    long count = lengths[i] - j0 < 16 ? lengths[i] - j0 : 16;
                    score_keys(a->q + (t0 + i) * a->ldq + h * dim, k + j0 * dim, dim, count, a->scale,
                               scores + i * stride + j0);
                }
        for (long i = 0; i < n; i++) {  /* softmax of each query over its own keys */
            float *row = scores + i * stride;
            long length = lengths[i];
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (long j = 0; j < length; j += 16)
                top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(length - j), row + j));
            __m512 total = _mm512_setzero_ps(), shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
            for (long j = 0; j < length; j += 16) {  /* 16 lanes, in one order fixed by the length */
                __mmask16 m = tail_mask(length - j);
                __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j), shift));
                _mm512_mask_storeu_ps(row + j, m, e);
                total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
            }
            totals[i] = _mm512_reduce_add_ps(total);
            for (long d = 0; d < 2 * padded; d += 16) _mm512_store_ps(sums + i * 2 * padded + d, _mm512_setzero_ps());
        }
        for (long j0 = 0; j0 < longest; j0 += 16) {  /* weighted values, block by block */
            for (long i = 0; i < n; i++) {
                long end = lengths[i] < j0 + 16 ? lengths[i] : j0 + 16;
                const float *weights = scores + i * stride;
                for (long d0 = 0; d0 < dim; d0 += 64) {
                    float *even_sums = sums + i * 2 * padded + d0, *odd_sums = even_sums + padded;
                    __m512 even[4], odd[4];
                    __mmask16 m[4];
                    for (int c = 0; c < 4; c++) {
                        m[c] = tail_mask(dim - d0 - 16 * c);
                        even[c] = _mm512_load_ps(even_sums + 16 * c);
                        odd[c] = _mm512_load_ps(odd_sums + 16 * c);
                    }
                    long j = j0;
                    for (; j + 1 < end; j += 2) {
                        __m512 w0 = _mm512_set1_ps(weights[j]), w1 = _mm512_set1_ps(weights[j + 1]);
                        for (int c = 0; c < 4; c++) {
                            even[c] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m[c], v + j * dim + d0 + 16 * c), even[c]);
                            odd[c] = _mm512_fmadd_ps(w1, _mm512_maskz_loadu_ps(m[c], v + (j + 1) * dim + d0 + 16 * c),
                                                     odd[c]);
                        }
                    }
                    if (j < end) {  /* the last key of an odd-length query: its even chain */
                        __m512 w0 = _mm512_set1_ps(weights[j]);
                        for (int c = 0; c < 4; c++)
                            even[c] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(m[c], v + j * dim + d0 + 16 * c), even[c]);
                    }
                    for (int c = 0; c < 4; c++) {
                        _mm512_store_ps(even_sums + 16 * c, even[c]);
                        _mm512_store_ps(odd_sums + 16 * c, odd[c]);
                    }
                }
            }
        }
        for (long i = 0; i < n; i++) {
            float *o = a->out + (t0 + i) * a->ldo + h * dim;
            const float *even_sums = sums + i * 2 * padded, *odd_sums = even_sums + padded;
            for (long d = 0; d < dim; d += 16) {
                __mmask16 m = tail_mask(dim - d);
                __m512 sum = _mm512_add_ps(_mm512_load_ps(even_sums + d), _mm512_load_ps(odd_sums + d));
                _mm512_mask_storeu_ps(o + d, m, _mm512_div_ps(sum, _mm512_set1_ps(totals[i])));
            }
        }
    }
    free(scores);
    free(sums);
}

/* q [T, heads * dim] (row stride ldq); keys/values point at one layer of the pool
 * ([slots][kv_heads][capacity][dim]); slots/positions [T] (token t sees keys 0..positions[t] of
 * slot slots[t]); out [T, heads * dim] (row stride ldo).
 * Returns 0, or -1 when scratch memory could not be allocated (out is then incomplete). */
int dspark_attention(const float *q, long T, long ldq, long heads, long kv_heads, long dim, const float *keys,
                      const float *values, long slot_stride, long head_stride, const long *slots,
                      const long *positions, float scale, float *out, long ldo) {
    attention_args args = {q, ldq, heads, kv_heads, dim, keys, values, slot_stride, head_stride, slots, positions,
                           scale, out, ldo};
    long *run_start = (long *)malloc(sizeof(long) * (T + 1)), num_runs = 0;
    if (run_start == 0) return -1;
    for (long t = 0; t < T; t++)  /* runs: consecutive tokens of one slot, at most RUN_TOKENS each */
        if (t == 0 || slots[t] != slots[t - 1] || t - run_start[num_runs - 1] == RUN_TOKENS) run_start[num_runs++] = t;
    run_start[num_runs] = T;
    run_args runs = {&args, run_start, num_runs};
    atomic_store(&attention_failed, 0);
    parallel_for(attention_runs, &runs, num_runs * heads, 4);
    free(run_start);
    return atomic_load(&attention_failed) ? -1 : 0;
}

/* ---- a whole decoder forward pass -----------------------------------------------------------
 *
 * One call runs every layer of a Llama-family decoder over packed new tokens (fp32 activations,
 * bf16 weights through the kernel above, attention above), then the final norm and LM head at
 * the asked-for rows. Why in C: between the ~120 matmuls of a step sit ~1,000 small PyTorch ops
 * (norms, RoPE, KV writes, SiLU, residual adds): 8-14 ms of dispatch per decode step here, more
 * than half the matmuls' own cost, and at 16 tokens PyTorch's parallel index_put and SiLU woke
 * its sleeping threads for ~40 ms per step (measured). Each op here works row by row in one
 * fixed order, so the pass stays batch invariant: a token's results depend on its own row and
 * its slot's cache only. */

typedef struct {
    const float *attn_norm, *mlp_norm, *q_norm, *k_norm;  /* q_norm/k_norm: NULL without qk-norm */
    const uint16_t *qkv, *o, *gate_up, *down;              /* packed bf16 weights */
    const float *qkv_bias, *o_bias;                        /* NULL when absent */
} decoder_layer;

typedef struct {
    long num_layers, hidden, heads, kv_heads, head_dim, intermediate, vocab;
    float eps;
    const decoder_layer *layers;
    const float *final_norm;
    const uint16_t *lm_head;
} decoder_model;

typedef struct {
    long tokens;
    const long *slots, *positions;          /* [tokens]: where each token's key/value goes (and its RoPE angle) */
    const long *visible;                    /* [tokens]: token t sees keys 0..visible[t]; NULL: 0..positions[t]
                                             * (a drafter's block sees the whole block, not a causal prefix) */
    float *keys, *values;                   /* the KV pool [layers][slots][kv_heads][capacity][dim] */
    long layer_stride, slot_stride, head_stride;
    const float *rope_cos, *rope_sin;       /* [positions][head_dim], rows indexed by position */
    const long *feature_layers;             /* [num_features]: copy these layers' outputs */
    long num_features;
    float *features;                        /* [tokens][num_features * hidden] */
    const long *logit_rows;                 /* [num_logits] rows to compute logits at */
    long num_logits;
    float *logits;                          /* [num_logits][vocab] */
} decoder_call;

static void rms_norm_row(const float *x, const float *weight, long n, float eps, float *out) {
    __m512 sums = _mm512_setzero_ps();
    for (long i = 0; i < n; i += 16) {
        __m512 v = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
        sums = _mm512_fmadd_ps(v, v, sums);
    }
    float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(sums) / (float)n + eps);
    for (long i = 0; i < n; i++) out[i] = weight[i] * (x[i] * scale);  /* as transformers' Llama */
}

typedef struct { const float *x; long ldx; const float *weight; long n; float eps; float *out; long ldo;
                 const long *rows; } norm_args;

static void norm_range(const void *ctx, long first, long last) {
    const norm_args *a = (const norm_args *)ctx;
    for (long i = first; i < last; i++)
        rms_norm_row(a->x + (a->rows ? a->rows[i] : i) * a->ldx, a->weight, a->n, a->eps, a->out + i * a->ldo);
}

static void rope_head(float *x, const float *cos, const float *sin, long dim) {
    /* x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half]) */
    long half = dim / 2;
    for (long i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* One token's keys and values k, v [heads][dim] into a pool layer at `base` (its slot and position). */
static void store_kv(float *keys, float *values, long base, long head_stride, const float *k, const float *v,
                     long heads, long dim) {
    for (long h = 0; h < heads; h++)
        for (long d = 0; d < dim; d++) {
            keys[base + h * head_stride + d] = k[h * dim + d];
            values[base + h * head_stride + d] = v[h * dim + d];
        }
}

typedef struct { const decoder_model *m; const decoder_layer *layer; const decoder_call *c; float *qkv; long ldqkv;
                 float *keys, *values; } qkv_args;

/* Per token: q/k norms (qk-norm models), RoPE on q and k, and the new key/value into the pool. */
static void qkv_range(const void *ctx, long first, long last) {
    const qkv_args *a = (const qkv_args *)ctx;
    const decoder_model *m = a->m;
    long dim = m->head_dim;
    for (long t = first; t < last; t++) {
        float *q = a->qkv + t * a->ldqkv, *k = q + m->heads * dim, *v = k + m->kv_heads * dim;
        long pos = a->c->positions[t];
        const float *cos = a->c->rope_cos + pos * dim, *sin = a->c->rope_sin + pos * dim;
        for (long h = 0; h < m->heads + m->kv_heads; h++) {  /* q heads, then k heads: contiguous */
            float *head = q + h * dim;
            const float *norm = h < m->heads ? a->layer->q_norm : a->layer->k_norm;
            if (norm) rms_norm_row(head, norm, dim, m->eps, head);
            rope_head(head, cos, sin, dim);
        }
        store_kv(a->keys, a->values, a->c->slots[t] * a->c->slot_stride + pos * dim, a->c->head_stride, k, v,
                 m->kv_heads, dim);
    }
}

typedef struct { const float *gate_up; long inter; float *out; } silu_args;

static void silu_range(const void *ctx, long first, long last) {  /* out = silu(gate) * up, per row */
    const silu_args *a = (const silu_args *)ctx;
    for (long t = first; t < last; t++) {
        const float *gate = a->gate_up + t * 2 * a->inter, *up = gate + a->inter;
        float *out = a->out + t * a->inter;
        for (long i = 0; i < a->inter; i += 16) {
            __mmask16 m = tail_mask(a->inter - i);
            __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
            __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, up + i)));
        }
    }
}

#define ROWS_PER_THREAD 8  /* elementwise work below this many rows per thread stays on the caller */

/* x [tokens][hidden] fp32: the embedded tokens in, the last layer's output out (overwritten).
 * Returns 0, or -1 when scratch memory could not be allocated (then nothing is valid). */
int dspark_decoder_forward(const decoder_model *m, float *x, const decoder_call *c) {
    long T = c->tokens, d = m->hidden, dim = m->head_dim, inter = m->intermediate;
    long q_width = m->heads * dim, qkv_width = (m->heads + 2 * m->kv_heads) * dim;
    long scratch_rows = T > c->num_logits ? T : c->num_logits;
    float *h = (float *)malloc(sizeof(float) * scratch_rows * d);
    float *qkv = (float *)malloc(sizeof(float) * T * qkv_width);
    float *attn = (float *)malloc(sizeof(float) * T * q_width);
    float *gate_up = (float *)malloc(sizeof(float) * T * 2 * inter);
    float *act = (float *)malloc(sizeof(float) * T * inter);
    int status = (h && qkv && attn && gate_up && act) ? 0 : -1;
    for (long l = 0; l < m->num_layers && status == 0; l++) {
        const decoder_layer *layer = m->layers + l;
        float *keys = c->keys + l * c->layer_stride, *values = c->values + l * c->layer_stride;
        norm_args norm = {x, d, layer->attn_norm, d, m->eps, h, d, 0};
        parallel_for(norm_range, &norm, T, ROWS_PER_THREAD);
        gemm(h, T, d, layer->qkv, d, qkv_width, qkv, qkv_width, layer->qkv_bias, 0);
        qkv_args rope = {m, layer, c, qkv, qkv_width, keys, values};
        parallel_for(qkv_range, &rope, T, ROWS_PER_THREAD);
        status = dspark_attention(qkv, T, qkv_width, m->heads, m->kv_heads, dim, keys, values, c->slot_stride,
                                  c->head_stride, c->slots, c->visible ? c->visible : c->positions, 1.0f / sqrtf((float)dim),
                                  attn, q_width);
        gemm(attn, T, q_width, layer->o, q_width, d, x, d, layer->o_bias, 1);  /* x += o(attn) */
        norm_args mlp_norm = {x, d, layer->mlp_norm, d, m->eps, h, d, 0};
        parallel_for(norm_range, &mlp_norm, T, ROWS_PER_THREAD);
        gemm(h, T, d, layer->gate_up, d, 2 * inter, gate_up, 2 * inter, 0, 0);
        silu_args silu = {gate_up, inter, act};
        parallel_for(silu_range, &silu, T, ROWS_PER_THREAD);
        gemm(act, T, inter, layer->down, inter, d, x, d, 0, 1);  /* x += down(silu(gate) * up) */
        for (long f = 0; f < c->num_features; f++)
            if (c->feature_layers[f] == l)
                for (long t = 0; t < T; t++)
                    for (long i = 0; i < d; i++) c->features[t * c->num_features * d + f * d + i] = x[t * d + i];
    }
    if (status == 0 && c->num_logits > 0) {
        norm_args final = {x, d, m->final_norm, d, m->eps, h, d, c->logit_rows};
        parallel_for(norm_range, &final, c->num_logits, ROWS_PER_THREAD);
        gemm(h, c->num_logits, d, m->lm_head, d, m->vocab, c->logits, m->vocab, 0, 0);
    }
    free(h); free(qkv); free(attn); free(gate_up); free(act);
    return status;
}

/* ---- argmax ---------------------------------------------------------------------------------
 * out[r] = the index of the first maximum of row r of x [rows][n] (row stride ld), NaN counting
 * as the maximum (as torch.argmax): one vector pass instead of PyTorch's ~0.6 ms over 8 rows of a
 * 49k vocabulary here (measured), paid on every greedy verification. */
typedef struct { const float *x; long n, ld; long *out; } argmax_args;

static void argmax_range(const void *ctx, long first, long last) {
    const argmax_args *a = (const argmax_args *)ctx;
    for (long r = first; r < last; r++) {
        const float *row = a->x + r * a->ld;
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i best_index = _mm512_setzero_si512(), index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                                12, 13, 14, 15);
        __mmask16 nan = 0;
        for (long i = 0; i < a->n; i += 16) {
            __mmask16 m = tail_mask(a->n - i);
            __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, row + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  /* strict: a lane keeps its first */
            best = _mm512_mask_mov_ps(best, greater, v);
            best_index = _mm512_mask_mov_epi32(best_index, greater, index);
            index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
        }
        long found = 0;
        if (nan) {
            while (row[found] == row[found]) found++;  /* the first NaN */
        } else {
            float top = _mm512_reduce_max_ps(best);
            __mmask16 ties = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
            found = a->n;
            int lanes[16];
            _mm512_storeu_si512((void *)lanes, best_index);
            for (int lane = 0; lane < 16; lane++)  /* the smallest index among the lanes holding the max
                                                     * (at least one does; all -inf rows give lane 0's 0) */
                if (((ties >> lane) & 1) && lanes[lane] < found) found = lanes[lane];
        }
        a->out[r] = found;
    }
}

void dspark_argmax(const float *x, long rows, long n, long ld, long *out) {
    argmax_args args = {x, n, ld, out};
    parallel_for(argmax_range, &args, rows, 4);
}

/* ---- a drafter's context: target features -> its keys/values ---------------------------------
 * What DSpark's catch-up computes for the positions a step kept: each target layer's features
 * RMS-normalised (own weights), concatenated, projected to the hidden size, normalised again;
 * then per drafter layer keys and values of that state (keys rotated), or of the layer's own
 * RMS norm of it (`layer_norms`: a drafter trained with `context_norm`), written into its pool.
 * Row by row in a fixed order (batch invariant). One call instead of ~60 PyTorch ops (~2 ms per
 * step here for two new positions, measured). */
typedef struct {
    long num_layers, hidden, kv_heads, head_dim, num_features;
    float eps;
    const float *feature_norms;    /* [num_features][hidden] */
    const uint16_t *project;       /* packed [num_features * hidden, hidden] */
    const float *context_norm;     /* [hidden] */
    const uint16_t *const *kv;     /* [num_layers] packed [hidden, 2 * kv_heads * head_dim]: keys, then values */
    const float *layer_norms;      /* [num_layers][hidden], or NULL: the keys/values read the context as is */
} context_model;

typedef struct { const context_model *m; const float *features; float *normed; } feature_norm_args;

static void feature_norm_range(const void *ctx, long first, long last) {
    const feature_norm_args *a = (const feature_norm_args *)ctx;
    long d = a->m->hidden, width = a->m->num_features * d;
    for (long t = first; t < last; t++)
        for (long f = 0; f < a->m->num_features; f++)
            rms_norm_row(a->features + t * width + f * d, a->m->feature_norms + f * d, d, a->m->eps,
                         a->normed + t * width + f * d);
}

typedef struct { const context_model *m; float *kv; const long *slots, *positions; const float *cos, *sin;
                 float *keys, *values; long slot_stride, head_stride; } context_write_args;

static void context_write_range(const void *ctx, long first, long last) {
    const context_write_args *a = (const context_write_args *)ctx;
    long dim = a->m->head_dim, heads = a->m->kv_heads;
    for (long t = first; t < last; t++) {
        float *k = a->kv + t * 2 * heads * dim, *v = k + heads * dim;
        long pos = a->positions[t];
        for (long h = 0; h < heads; h++) rope_head(k + h * dim, a->cos + pos * dim, a->sin + pos * dim, dim);
        store_kv(a->keys, a->values, a->slots[t] * a->slot_stride + pos * dim, a->head_stride, k, v, heads, dim);
    }
}

/* features [T][num_features * hidden]; token t's keys/values go to (slots[t], positions[t]) of
 * each layer of the pool [layers][slots][kv_heads][capacity][head_dim]. Returns 0, or -1 when
 * scratch memory could not be allocated. */
int dspark_drafter_context(const context_model *m, const float *features, long T, const long *slots,
                           const long *positions, const float *rope_cos, const float *rope_sin, float *keys,
                           float *values, long layer_stride, long slot_stride, long head_stride) {
    long d = m->hidden, width = m->num_features * d, kv_width = 2 * m->kv_heads * m->head_dim;
    float *normed = (float *)malloc(sizeof(float) * T * width);
    float *state = (float *)malloc(sizeof(float) * T * d), *context = (float *)malloc(sizeof(float) * T * d);
    float *kv = (float *)malloc(sizeof(float) * T * kv_width);
    float *layer_input = m->layer_norms ? (float *)malloc(sizeof(float) * T * d) : context;
    int status = (normed && state && context && kv && layer_input) ? 0 : -1;
    if (status == 0) {
        feature_norm_args fn = {m, features, normed};
        parallel_for(feature_norm_range, &fn, T, ROWS_PER_THREAD);
        gemm(normed, T, width, m->project, width, d, state, d, 0, 0);
        norm_args cn = {state, d, m->context_norm, d, m->eps, context, d, 0};
        parallel_for(norm_range, &cn, T, ROWS_PER_THREAD);
        for (long l = 0; l < m->num_layers; l++) {
            if (m->layer_norms) {
                norm_args ln = {context, d, m->layer_norms + l * d, d, m->eps, layer_input, d, 0};
                parallel_for(norm_range, &ln, T, ROWS_PER_THREAD);
            }
            gemm(layer_input, T, d, m->kv[l], d, kv_width, kv, kv_width, 0, 0);
            context_write_args w = {m, kv, slots, positions, rope_cos, rope_sin, keys + l * layer_stride,
                                    values + l * layer_stride, slot_stride, head_stride};
            parallel_for(context_write_range, &w, T, ROWS_PER_THREAD);
        }
    }
    if (layer_input != context) free(layer_input);
    free(normed); free(state); free(context); free(kv);
    return status;
}
