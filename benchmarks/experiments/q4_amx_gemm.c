/* Prototype (issue #42, int4 weights): how fast could SmolLM2-135M's matmuls run from 4-bit
 * weights on AMX, against our bf16 AMX kernel (benchmarks/kernel_ab.c)? Not a kernel of the
 * package: a self-contained measurement that decides whether the int4 engine is worth building.
 *
 *     gcc -O3 -mavx512f -mavx512bw -mavx512vl -mamx-tile -mamx-int8 -mf16c -pthread \
 *         benchmarks/experiments/q4_amx_gemm.c -o q4_amx_gemm
 *     ./q4_amx_gemm 2 1 2 4 8 16     # threads, then row counts; best of 5 passes, ms
 *
 * The weights are the GGUF's own Q4_1 blocks (32 weights along K, w = d * q + m, q in 0..15, d and m
 * fp16; 20 bytes per 32 weights), rearranged at load time so that one block of 64 columns x 32 k
 * unpacks into AMX's int8 B tiles with two byte ops a tile row. The activations are quantized per
 * row and per block of 32 to int8 with an fp32 scale s (x ~ s * a), as llama.cpp does for its CPU
 * dot products, so that each block is one TDPBSUD (int8 x uint8 -> int32 sums) per 16 columns:
 *     sum_k x_k w_k ~ d * s * sum_k a_k q_k + m * s * sum_k a_k.
 * The fp32 epilogue applies d, m and s per block. Every row's result comes from its own tile row and
 * its own scales (batch invariant). The LM head (Q8_0 in the GGUF) is timed in the same 4-bit
 * format here, which reads less than its 8-bit blocks would: the timings are a lower bound for it.
 * Correctness of the arithmetic is checked against a scalar reference on the first shape. */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define GROUP 64   /* output columns per work item: four 16-column tiles */
#define KB 32      /* weights per Q4_1 block along K */
#define MAXR 16

typedef struct { long K, N; uint8_t *nibbles; uint16_t *d, *m; } q4_matrix;
/* nibbles: [N/64][K/32][4 tiles][8 rows][32 bytes]: byte j of a tile row holds lane j (low nibble)
 * and lane j + 32 (high); lane L of tile row r is column L / 4, k = 4 r + L % 4 (AMX's int8 B layout).
 * d, m: [N/64][K/32][64] fp16. */

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;
static void configure(int rows) {
    tile_config c; memset(&c, 0, sizeof c); c.palette = 1;
    for (int t = 0; t < 4; t++) { c.rows[t] = rows; c.colsb[t] = 64; }   /* C: rows x 16 int32 */
    c.rows[4] = rows; c.colsb[4] = KB;                                      /* A: rows x 32 int8 */
    for (int t = 5; t < 7; t++) { c.rows[t] = KB / 4; c.colsb[t] = 64; }   /* B: 8 rows x 16 x 4 uint8 */
    _tile_loadconfig(&c);
}

typedef struct {
    const q4_matrix *w; long M;
    const int8_t *a; const float *s, *asum;  /* a [M][K] int8, s and asum [M][K/32]: s * sum(a) */
    float *y;                                 /* [M][N] */
} call;

static void run_groups(const call *c, long first, long last) {
    const q4_matrix *w = c->w; long K = w->K, N = w->N, blocks = K / KB, M = c->M;
    uint8_t b[4][8 * 64] __attribute__((aligned(64)));
    int32_t acc[MAXR * 64] __attribute__((aligned(64)));
    float out[MAXR * 64] __attribute__((aligned(64)));
    const __m256i low = _mm256_set1_epi8(0x0F);
    configure((int)M);
    for (long g = first; g < last; g++) {
        memset(out, 0, sizeof(float) * M * 64);
        for (long kb = 0; kb < blocks; kb++) {
            const uint8_t *nib = w->nibbles + ((g * blocks + kb) * 4 * 8 * 32);
            for (int t = 0; t < 4; t++)
                for (int r = 0; r < 8; r++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(nib + (t * 8 + r) * 32));
                    __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low)),
                                                       _mm256_and_si256(_mm256_srli_epi16(v, 4), low), 1);
                    _mm512_store_si512((void *)(b[t] + r * 64), both);
                }
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            _tile_loadd(4, c->a + kb * KB, K);
            _tile_loadd(5, b[0], 64); _tile_dpbsud(0, 4, 5);
            _tile_loadd(6, b[1], 64); _tile_dpbsud(1, 4, 6);
            _tile_loadd(5, b[2], 64); _tile_dpbsud(2, 4, 5);
            _tile_loadd(6, b[3], 64); _tile_dpbsud(3, 4, 6);
            _tile_stored(0, acc, 64 * 4); _tile_stored(1, acc + 16, 64 * 4);  /* tile numbers: constants */
            _tile_stored(2, acc + 32, 64 * 4); _tile_stored(3, acc + 48, 64 * 4);
            const uint16_t *dp = w->d + (g * blocks + kb) * 64, *mp = w->m + (g * blocks + kb) * 64;
            for (int p = 0; p < 4; p++) {
                __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dp + 16 * p)));
                __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mp + 16 * p)));
                for (long r = 0; r < M; r++) {
                    __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(acc + r * 64 + 16 * p)));
                    __m512 o = _mm512_load_ps(out + r * 64 + 16 * p);
                    o = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(c->s[r * blocks + kb])), dot, o);
                    o = _mm512_fmadd_ps(m, _mm512_set1_ps(c->asum[r * blocks + kb]), o);
                    _mm512_store_ps(out + r * 64 + 16 * p, o);
                }
            }
        }
        for (long r = 0; r < M; r++)
            for (int col = 0; col < 64 && g * 64 + col < N; col++) c->y[r * N + g * 64 + col] = out[r * 64 + col];
    }
    _tile_release();
}

/* The pass: every thread takes its equal contiguous share of each matrix's column groups and
 * waits at a spin barrier after each matrix, as our kernels' pool does after each call. */
static int threads = 2;
static atomic_int arrived, phase;
static void barrier(void) {
    int my = atomic_load(&phase);
    if (atomic_fetch_add(&arrived, 1) == threads - 1) { atomic_store(&arrived, 0); atomic_fetch_add(&phase, 1); }
    else while (atomic_load(&phase) == my) _mm_pause();
}
typedef struct { const call *calls; int count, index; } pass_args;
static void *run_pass(void *arg) {
    pass_args *p = arg;
    for (int i = 0; i < p->count; i++) {
        long groups = (p->calls[i].w->N + 63) / 64;
        run_groups(&p->calls[i], groups * p->index / threads, groups * (p->index + 1) / threads);
        barrier();
    }
    return 0;
}
static void pass(const call *calls, int count) {
    pthread_t t[8]; pass_args a[8];
    for (int i = 0; i < threads; i++) a[i] = (pass_args){calls, count, i};
    for (int i = 1; i < threads; i++) pthread_create(&t[i], 0, run_pass, &a[i]);
    run_pass(&a[0]);
    for (int i = 1; i < threads; i++) pthread_join(t[i], 0);
}

/* x [M][K] -> a, s, asum: per row and block, s = max|x| / 127, a = round(x / s). */
static void quantize(const float *x, long M, long K, int8_t *a, float *s, float *asum) {
    for (long r = 0; r < M; r++)
        for (long kb = 0; kb < K / KB; kb++) {
            float top = 0; for (int i = 0; i < KB; i++) top = fmaxf(top, fabsf(x[r * K + kb * KB + i]));
            float scale = top > 0 ? top / 127.0f : 1.0f; int sum = 0;
            for (int i = 0; i < KB; i++) { int q = (int)lrintf(x[r * K + kb * KB + i] / scale); a[r * K + kb * KB + i] = (int8_t)q; sum += q; }
            s[r * (K / KB) + kb] = scale; asum[r * (K / KB) + kb] = scale * sum;
        }
}

static q4_matrix make(long K, long N, unsigned seed) {
    q4_matrix w = {K, N, 0, 0, 0};
    long groups = (N + 63) / 64, blocks = K / KB;
    w.nibbles = aligned_alloc(64, groups * blocks * 1024);
    w.d = aligned_alloc(64, groups * blocks * 64 * 2 + 64); w.m = aligned_alloc(64, groups * blocks * 64 * 2 + 64);
    for (long i = 0; i < groups * blocks * 1024; i++) w.nibbles[i] = (uint8_t)((i * 2654435761u + seed) >> 13);
    for (long i = 0; i < groups * blocks * 64; i++) {
        w.d[i] = _cvtss_sh(0.01f + 0.001f * (float)((i + seed) % 7), 0);
        w.m[i] = _cvtss_sh(-0.08f + 0.002f * (float)((i * 3 + seed) % 11), 0);
    }
    return w;
}
static float weight(const q4_matrix *w, long k, long n) {  /* the layout's inverse, for the check */
    long g = n / 64, col = n % 64, t = col / 16, c = col % 16, kb = k / KB, kk = k % KB, r = kk / 4, lane = 4 * c + kk % 4;
    uint8_t byte = w->nibbles[(g * (w->K / KB) + kb) * 1024 + (t * 8 + r) * 32 + lane % 32];
    int q = lane < 32 ? byte & 15 : byte >> 4;
    return _cvtsh_ss(w->d[(g * (w->K / KB) + kb) * 64 + col]) * q + _cvtsh_ss(w->m[(g * (w->K / KB) + kb) * 64 + col]);
}

int main(int argc, char **argv) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) { printf("no AMX tile state\n"); return 1; }
    threads = argc > 1 ? atoi(argv[1]) : 2;
    long shapes[121][2]; int n = 0;
    for (int l = 0; l < 30; l++) { long s[4][2] = {{576, 960}, {576, 576}, {576, 3072}, {1536, 576}}; for (int j = 0; j < 4; j++) { shapes[n][0] = s[j][0]; shapes[n][1] = s[j][1]; n++; } }
    shapes[n][0] = 576; shapes[n][1] = 49152; n++;
    q4_matrix w[121]; long bytes = 0;
    for (int i = 0; i < n; i++) { w[i] = make(shapes[i][0], shapes[i][1], i); bytes += (shapes[i][1] + 63) / 64 * 64 * shapes[i][0] / 32 * 20; }
    float *x = aligned_alloc(64, 16 * 1536 * 4), *y = aligned_alloc(64, 16 * 49152 * 4);
    int8_t *a = aligned_alloc(64, 16 * 1536); float *s = malloc(16 * 48 * 4), *asum = malloc(16 * 48 * 4);
    for (long i = 0; i < 16 * 1536; i++) x[i] = sinf(0.37f * i);
    {   /* check: 3 rows of the first shape against the scalar sums of the same quantized values */
        long K = shapes[0][0], N = shapes[0][1]; quantize(x, 3, K, a, s, asum);
        call c = {&w[0], 3, a, s, asum, y}; pass(&c, 1); double worst = 0;
        for (long r = 0; r < 3; r++) for (long col = 0; col < N; col++) {
            double ref = 0; for (long k = 0; k < K; k++) ref += (double)s[r * (K / KB) + k / KB] * a[r * K + k] * weight(&w[0], k, col);
            worst = fmax(worst, fabs(ref - y[r * N + col]) / (1e-3 + fabs(ref)));
        }
        printf("check: worst relative error %.2e against the scalar sums\n", worst);
    }
    printf("4-bit weights read per pass: %.1f MB\n", bytes / 1e6);
    for (int arg = 2; arg < argc; arg++) {
        long M = atol(argv[arg]); double best = 1e9;
        int8_t *a2 = aligned_alloc(64, 16 * 1536); float *s2 = malloc(16 * 48 * 4), *asum2 = malloc(16 * 48 * 4);
        call calls[121];
        for (int i = 0; i < n; i++) {  /* K = 576 calls read (a, s, asum), K = 1536 calls (a2, s2, asum2) */
            int wide = shapes[i][0] == 1536;
            calls[i] = (call){&w[i], M, wide ? a2 : a, wide ? s2 : s, wide ? asum2 : asum, y};
        }
        for (int rep = 0; rep < 6; rep++) {
            double t0 = now();
            quantize(x, M, 576, a, s, asum);  /* the calls' activations, quantized once each (timed) */
            quantize(x, M, 1536, a2, s2, asum2);
            pass(calls, n);
            double t = now() - t0; if (rep && t < best) best = t;
        }
        printf("%ld:%.1f ", M, best * 1e3);
    }
    printf("\n");
    return 0;
}
