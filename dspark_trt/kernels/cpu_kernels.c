/* Our CPU kernels: y[M, N] (fp32) = x[M, K] (fp32) @ W (bf16, packed once) (+ bias) for any M,
 * and causal attention over the KV pool, both batch invariant by construction; in the AMX build
 * also W in the GGUF's 4- and 8-bit blocks ("4-bit weights" below, `--dtype int4`).
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
 * (128 bytes per k: one stream per group, which hardware prefetchers follow). A register tile
 * (TILE_ROWS rows x the group, or fewer columns on ISAs with fewer registers) keeps its
 * accumulators of 16 floats in registers for the whole K loop. Threads split the groups; more
 * rows are more tiles over the same group, re-read from L1/L2.
 *
 * Threads: our own small pool, not OpenMP. A step makes ~120 of these calls, each 0.05-5 ms.
 * Waking sleeping threads for each (OpenMP with OMP_WAIT_POLICY=PASSIVE, which the runtime
 * needs so that PyTorch's threads do not spin against numpy's BLAS threads) cost ~40 ms per
 * step here; so our workers spin for a short while after each call (SPIN_NS) and only then
 * sleep, without changing how PyTorch's or numpy's threads wait.
 *
 * ISAs: one source, built once per instruction set (`cpu_kernels.py` picks the build by the CPU).
 * The kernels are written once over the small vector layer below (as ggml-cpu's
 * simd-mappings.h): a "vector" is 16 fp32 lanes, one zmm register under AVX-512 (F + BW), two ymm
 * registers under AVX2 + FMA. Everything ISA-specific lives in that layer, plus the few register
 * tile sizes that differ (TILE_*, SCORE_KEYS, VALUE_PANELS below), which change how much work
 * one pass keeps in registers, never the arithmetic: both builds do the same operations on the
 * same values in the same order, so their results are bit-identical (tested).
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define GROUP 64   /* columns per group: 4 panels of 16 */
#define PREFETCH 2048  /* elements ahead (4 KB) in the group's stream */

/* ---- the vector layer ------------------------------------------------------------------------
 *
 * vf: 16 fp32 lanes; vi: 16 int32 lanes; vmask: a 16-bit lane mask (bit i: lane i), for the
 * masked loads and stores of row tails (a masked-out lane is neither read nor written, so a
 * tail never touches memory past its row); vcmp: a per-lane comparison result. */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void cpu_relax(void) { _mm_pause(); }  /* in spin-waits */
static inline void prefetch(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }  /* into L1 */
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KERNEL_ISA "amx"  /* the AVX-512 build, its matmuls on AMX tiles (below) */
#define AMX 1
#else
#define KERNEL_ISA "avx512"
#endif
/* GEMM tiles, (rows, panels of 16 columns) for blocks of 1..TILE_ROWS rows: up to 6 rows x the
 * whole group, 24 accumulators + the weights and a broadcast in 32 zmm. */
#define TILE_ROWS 6
#define TILE_SHAPES(T) T(1, 4) T(2, 4) T(3, 4) T(4, 4) T(5, 4) T(6, 4)
#define SCORE_KEYS 16  /* keys whose dot products one pass over q keeps in registers */
#define SCORE_QUERIES 2 /* queries whose scores one pass over a key block computes (score_keys_pair) */
#define VALUE_PANELS 4 /* 16-float panels of a value row one pass keeps (even and odd chains) */
#define VALUE_QUERIES 2 /* queries one pass over the values serves: 2 x 4 panels x 2 chains = 16 accumulators */

typedef __m512 vf;
typedef __m512i vi;
typedef __mmask16 vmask;
typedef __mmask16 vcmp;

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_load(const float *p) { return _mm512_load_ps(p); }  /* 64-byte aligned */
static inline void vf_store(float *p, vf v) { _mm512_store_ps(p, v); }  /* 64-byte aligned */
static inline vf vf_load_mask(const float *p, vmask m) { return _mm512_maskz_loadu_ps(m, p); }  /* others 0 */
static inline vf vf_load_mask_or(const float *p, vmask m, vf fill) { return _mm512_mask_loadu_ps(fill, m, p); }
static inline void vf_store_mask(float *p, vmask m, vf v) { _mm512_mask_storeu_ps(p, m, v); }
static inline vf vf_keep(vmask m, vf v) { return _mm512_maskz_mov_ps(m, v); }  /* the others 0 */
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }  /* b where either is NaN */
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    /* a * b + c, one rounding */
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  /* c - a * b, one rounding */
static inline vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_scale2(vf a, vf n) { return _mm512_scalef_ps(a, n); }  /* a * 2^n, n integral */
static inline float vf_reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
static inline float vf_reduce_max(vf a) { return _mm512_reduce_max_ps(a); }

/* 32 bf16 -> two vectors of 16 fp32, exact (a bf16 is the top half of an fp32): interleaving
 * zeros below each bf16 is one shuffle-port instruction per 16 values, leaving the FMA ports to
 * the FMAs (~10% faster than widening by zero-extend and shift, measured). The shuffle works
 * within 128-bit lanes, so the packing (`PackedWeight`) stores each 32 columns permuted such that
 * the low interleave yields columns 0-15 in order and the high one columns 16-31. */
static inline void vf_widen32(const uint16_t *w, vf *low, vf *high) {
    __m512i packed = _mm512_loadu_si512((const void *)w), zero = _mm512_setzero_si512();
    *low = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, packed));
    *high = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, packed));
}
static inline vf vf_widen16(const uint16_t *w, int high) {  /* vf_widen32's low (or high) vector alone */
    __m512i packed = _mm512_loadu_si512((const void *)w), zero = _mm512_setzero_si512();
    return _mm512_castsi512_ps(high ? _mm512_unpackhi_epi16(zero, packed) : _mm512_unpacklo_epi16(zero, packed));
}

/* The 16 horizontal sums of v[0..15], as one vector (lane i = sum of v[i]'s lanes): a transpose
 * tree of 15 shuffle/add pairs instead of 16 separate reductions. Its first half, v[0..7], and its
 * second, v[8..15], reduce apart until the last add (vf_sum8_half, vf_sum16_join), so that a
 * caller can sum 8 vectors at a time and get the same bits. */
static inline vf vf_sum8_half(const vf *v) {
    __m512 t[4], w[2];
    for (int i = 0; i < 4; i++)  /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) {  /* per 128-bit lane: the lane sums of v[4i .. 4i+3] */
        __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]));
        __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]));
        w[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}
static inline vf vf_sum16_join(vf low, vf high) {  /* vf_sum8_half of v[0..7] and of v[8..15] */
    return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}
static inline vf vf_sum16(const vf *v) { return vf_sum16_join(vf_sum8_half(v), vf_sum8_half(v + 8)); }

static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_iota(void) { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vi vi_set1(int a) { return _mm512_set1_epi32(a); }
static inline void vi_storeu(int *p, vi a) { _mm512_storeu_si512((void *)p, a); }
static inline vcmp vcmp_none(void) { return 0; }
static inline vcmp vcmp_or(vcmp a, vcmp b) { return a | b; }
static inline unsigned vcmp_bits(vcmp c) { return c; }  /* bit i: lane i */
static inline vcmp vf_unordered(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); }
static inline vcmp vf_greater(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
static inline vcmp vf_equal(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
static inline vf vf_select(vcmp c, vf a, vf b) { return _mm512_mask_mov_ps(a, c, b); }  /* b where c, else a */
static inline vi vi_select(vcmp c, vi a, vi b) { return _mm512_mask_mov_epi32(a, c, b); }

#elif defined(__AVX2__) && defined(__FMA__)

#define KERNEL_ISA "avx2"
/* GEMM tiles (rows, panels of 16 columns) in 16 ymm registers, for blocks of 1..6 rows: 1 row x
 * the whole group (8 accumulators); 2 rows x the whole group (16 accumulators, a few spilled to
 * L1, but one pass over the group's stream: while a step is memory-bound that beats two passes
 * over halves); 3 rows x half the group; 4-6 rows x a quarter (8-12 accumulators, 2 shuffles per
 * 8-12 FMAs: 12 chains cover the FMA latency, 8 do not). On a real AVX2-only CPU (AMD EPYC Zen 1,
 * whose ymm FMAs run as two 128-bit halves), over SmolLM2-135M's 120 layer matrices and LM head, both
 * threads, the two builds alternated: 6 rows 29.5 -> 25.3 ms, 16 rows 58.2 -> 55.8 ms, 1-4 and 8
 * rows unchanged (docs/portable_cpu.md). */
#define TILE_ROWS 6
#define TILE_SHAPES(T) T(1, 4) T(2, 4) T(3, 2) T(4, 1) T(5, 1) T(6, 1)
#define EQUAL_ROW_BLOCKS  /* the AVX2 build only: the AVX-512 build keeps blocks of 6 (not measured there) */
#define SCORE_KEYS 4   /* 4 keys' dot products: 8 accumulators, not 32 */
#define SCORE_QUERIES 1 /* one query a pass (score_keys_pair is AVX-512 only) */
#define VALUE_PANELS 2 /* 2 panels' even and odd chains: 8 accumulators, not 16 */
#define VALUE_QUERIES 1 /* one query a pass: a second one's 8 accumulators would not fit in 16 ymm */

typedef struct { __m256 lo, hi; } vf;     /* lanes 0-7, 8-15 */
typedef struct { __m256i lo, hi; } vi;
typedef unsigned short vmask;
typedef struct { __m256 lo, hi; } vcmp;   /* all-ones lanes where true */

static inline __m256i mask8_(unsigned bits) {  /* bits 0-7 -> 8 lanes of all ones or zeros */
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), lane), lane);
}
static inline vf vf_make_(__m256 lo, __m256 hi) { vf v = {lo, hi}; return v; }
static inline vf vf_zero(void) { return vf_make_(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vf vf_set1(float a) { return vf_make_(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
static inline vf vf_load(const float *p) { return vf_make_(_mm256_load_ps(p), _mm256_load_ps(p + 8)); }
static inline void vf_store(float *p, vf v) { _mm256_store_ps(p, v.lo); _mm256_store_ps(p + 8, v.hi); }
static inline vf vf_load_mask(const float *p, vmask m) {
    if (m == 0xFFFF) return vf_make_(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
    return vf_make_(_mm256_maskload_ps(p, mask8_(m)), _mm256_maskload_ps(p + 8, mask8_(m >> 8u)));
}
static inline vf vf_load_mask_or(const float *p, vmask m, vf fill) {
    if (m == 0xFFFF) return vf_make_(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
    __m256i lo = mask8_(m), hi = mask8_(m >> 8u);
    return vf_make_(_mm256_blendv_ps(fill.lo, _mm256_maskload_ps(p, lo), _mm256_castsi256_ps(lo)),
                    _mm256_blendv_ps(fill.hi, _mm256_maskload_ps(p + 8, hi), _mm256_castsi256_ps(hi)));
}
static inline void vf_store_mask(float *p, vmask m, vf v) {
    if (m == 0xFFFF) {
        _mm256_storeu_ps(p, v.lo);
        _mm256_storeu_ps(p + 8, v.hi);
    } else {
        _mm256_maskstore_ps(p, mask8_(m), v.lo);
        _mm256_maskstore_ps(p + 8, mask8_(m >> 8u), v.hi);
    }
}
static inline vf vf_keep(vmask m, vf v) {
    return vf_make_(_mm256_and_ps(v.lo, _mm256_castsi256_ps(mask8_(m))),
                    _mm256_and_ps(v.hi, _mm256_castsi256_ps(mask8_(m >> 8u))));
}
#define VF_BINARY_(name, op) \
    static inline vf name(vf a, vf b) { return vf_make_(op(a.lo, b.lo), op(a.hi, b.hi)); }
VF_BINARY_(vf_add, _mm256_add_ps)
VF_BINARY_(vf_sub, _mm256_sub_ps)
VF_BINARY_(vf_mul, _mm256_mul_ps)
VF_BINARY_(vf_div, _mm256_div_ps)
VF_BINARY_(vf_max, _mm256_max_ps)  /* b where either is NaN, as AVX-512 */
VF_BINARY_(vf_min, _mm256_min_ps)
static inline vf vf_fmadd(vf a, vf b, vf c) {
    return vf_make_(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline vf vf_fnmadd(vf a, vf b, vf c) {
    return vf_make_(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
static inline vf vf_round(vf a) {
    return vf_make_(_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                    _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/* a * 2^n for integral n in [-126, 127] (what vf_exp's clamp allows): 2^n is then a normal fp32,
 * built in the exponent bits, and one multiply rounds a * 2^n exactly as AVX-512's scalef does. */
static inline __m256 pow2_(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline vf vf_scale2(vf a, vf n) {
    return vf_make_(_mm256_mul_ps(a.lo, pow2_(n.lo)), _mm256_mul_ps(a.hi, pow2_(n.hi)));
}
/* The reductions in GCC's _mm512_reduce_add_ps / _mm512_reduce_max_ps order (lanes i + 8, then
 * i + 4, then i + 2, then i + 1), so both builds give the same bits. */
static inline float vf_reduce_add(vf a) {
    __m256 t3 = _mm256_add_ps(a.hi, a.lo);
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1)));
}
static inline float vf_reduce_max(vf a) {
    __m256 t3 = _mm256_max_ps(a.hi, a.lo);
    __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1))));
}

/* The same 32 columns from the same 64 bytes as AVX-512: AVX2's interleave also works within
 * 128-bit lanes, so the low interleave of bytes 0-31 holds columns 0-7 and of bytes 32-63
 * columns 8-15; the high interleaves columns 16-23 and 24-31. */
static inline void vf_widen32(const uint16_t *w, vf *low, vf *high) {
    __m256i a = _mm256_loadu_si256((const __m256i *)w), b = _mm256_loadu_si256((const __m256i *)(w + 16));
    __m256i zero = _mm256_setzero_si256();
    *low = vf_make_(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, a)),
                    _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, b)));
    *high = vf_make_(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, a)),
                     _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, b)));
}
static inline vf vf_widen16(const uint16_t *w, int high) {  /* vf_widen32's low (or high) vector alone */
    __m256i a = _mm256_loadu_si256((const __m256i *)w), b = _mm256_loadu_si256((const __m256i *)(w + 16));
    __m256i zero = _mm256_setzero_si256();
    if (high) return vf_make_(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, a)),
                              _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, b)));
    return vf_make_(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, a)),
                    _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, b)));
}

/* AVX-512's sum16 step by step on the two halves (128-bit lanes 0-1 in lo, 2-3 in hi): the same
 * additions of the same pairs, so the same bits. */
static inline vf vf_sum16(const vf *v) {
    __m256 t[8][2], w[4][2];
    for (int i = 0; i < 8; i++) {
        t[i][0] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i].lo, v[2 * i + 1].lo),
                                _mm256_unpackhi_ps(v[2 * i].lo, v[2 * i + 1].lo));
        t[i][1] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i].hi, v[2 * i + 1].hi),
                                _mm256_unpackhi_ps(v[2 * i].hi, v[2 * i + 1].hi));
    }
    for (int i = 0; i < 4; i++)
        for (int h = 0; h < 2; h++) {
            __m256d a = _mm256_castps_pd(t[2 * i][h]), b = _mm256_castps_pd(t[2 * i + 1][h]);
            w[i][h] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
        }
    /* _mm512_shuffle_f32x4(a, b, 0x88) = 128-bit lanes [a0, a2, b0, b2]; 0xDD = [a1, a3, b1, b3] */
#define EVEN_(a, b) _mm256_permute2f128_ps((a)[0], (a)[1], 0x20), _mm256_permute2f128_ps((b)[0], (b)[1], 0x20)
#define ODD_(a, b) _mm256_permute2f128_ps((a)[0], (a)[1], 0x31), _mm256_permute2f128_ps((b)[0], (b)[1], 0x31)
    __m256 e01[2] = {EVEN_(w[0], w[1])}, o01[2] = {ODD_(w[0], w[1])};
    __m256 e23[2] = {EVEN_(w[2], w[3])}, o23[2] = {ODD_(w[2], w[3])};
    __m256 s01[2] = {_mm256_add_ps(e01[0], o01[0]), _mm256_add_ps(e01[1], o01[1])};
    __m256 s23[2] = {_mm256_add_ps(e23[0], o23[0]), _mm256_add_ps(e23[1], o23[1])};
    __m256 e[2] = {EVEN_(s01, s23)}, o[2] = {ODD_(s01, s23)};
#undef EVEN_
#undef ODD_
    return vf_make_(_mm256_add_ps(e[0], o[0]), _mm256_add_ps(e[1], o[1]));
}

static inline vi vi_make_(__m256i lo, __m256i hi) { vi v = {lo, hi}; return v; }
static inline vi vi_zero(void) { return vi_make_(_mm256_setzero_si256(), _mm256_setzero_si256()); }
static inline vi vi_iota(void) {
    return vi_make_(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15));
}
static inline vi vi_add(vi a, vi b) { return vi_make_(_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)); }
static inline vi vi_set1(int a) { return vi_make_(_mm256_set1_epi32(a), _mm256_set1_epi32(a)); }
static inline void vi_storeu(int *p, vi a) {
    _mm256_storeu_si256((__m256i *)p, a.lo);
    _mm256_storeu_si256((__m256i *)(p + 8), a.hi);
}
static inline vcmp vcmp_make_(__m256 lo, __m256 hi) { vcmp c = {lo, hi}; return c; }
static inline vcmp vcmp_none(void) { return vcmp_make_(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vcmp vcmp_or(vcmp a, vcmp b) { return vcmp_make_(_mm256_or_ps(a.lo, b.lo), _mm256_or_ps(a.hi, b.hi)); }
static inline unsigned vcmp_bits(vcmp c) {
    return (unsigned)_mm256_movemask_ps(c.lo) | (unsigned)_mm256_movemask_ps(c.hi) << 8;
}
#define VF_COMPARE_(name, predicate) \
    static inline vcmp name(vf a, vf b) { \
        return vcmp_make_(_mm256_cmp_ps(a.lo, b.lo, predicate), _mm256_cmp_ps(a.hi, b.hi, predicate)); \
    }
VF_COMPARE_(vf_unordered, _CMP_UNORD_Q)
VF_COMPARE_(vf_greater, _CMP_GT_OQ)
VF_COMPARE_(vf_equal, _CMP_EQ_OQ)
static inline vf vf_select(vcmp c, vf a, vf b) {  /* b where c, else a */
    return vf_make_(_mm256_blendv_ps(a.lo, b.lo, c.lo), _mm256_blendv_ps(a.hi, b.hi, c.hi));
}
static inline vi vi_select(vcmp c, vi a, vi b) {
    return vi_make_(_mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(b.lo), c.lo)),
                    _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(a.hi), _mm256_castsi256_ps(b.hi), c.hi)));
}

#else
#error "cpu_kernels.c needs AVX-512 (F and BW) or AVX2 and FMA: build it with -mavx512f -mavx512bw, or -mavx2 -mfma"
#endif

/* ---- written once over the layer ---------------------------------------------------------- */

/* e^x for 16 floats (Cephes' expf: range reduction by ln 2 in two parts, a degree-7 polynomial,
 * 2^n by scaling): within 2 ulp of expf over the range softmax and SiLU use, and the same bits
 * for the same input wherever it sits in a batch. Inputs below -87.3 give ~0, above 88.3 give ~3e38. */
static inline vf vf_exp(vf x) {
    x = vf_min(vf_max(x, vf_set1(-87.3f)), vf_set1(88.3f));
    vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693359375f), x);
    r = vf_fnmadd(n, vf_set1(-2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_fmadd(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fmadd(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fmadd(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fmadd(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fmadd(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fmadd(p, vf_mul(r, r), r);
    return vf_scale2(vf_add(p, vf_set1(1.0f)), n);
}

static inline vmask tail_mask(long left) {  /* the first `left` of 16 lanes (all when >= 16) */
    return left >= 16 ? (vmask)0xFFFF : left <= 0 ? (vmask)0 : (vmask)((1u << left) - 1u);
}

/* The ISA this build runs (`cpu_kernels.py` checks it is the one it asked for). */
const char *dspark_kernel_isa(void) { return KERNEL_ISA; }

/* How packed weights are laid out (`PackedWeight` in cpu_kernels.py packs to match): 0 = groups of
 * 64 columns, k by k, each 32 columns in widening order (the FMA builds); 1 = groups of 64 columns,
 * k-pairs by k-pairs, K padded to 32 (what AMX tiles read: the AMX build). */
#ifdef AMX
int dspark_weight_layout(void) { return 1; }
#else
int dspark_weight_layout(void) { return 0; }
#endif

/* ---- the matmul --------------------------------------------------------------------------- */

/* A matmul's output panel: y = sum + bias, or y += sum + bias with `accumulate` (the residual add
 * in the same pass), masked to the panel's columns. Every build's matmul ends here, so their
 * epilogues are one order of fp32 adds. */
static inline void store_output(float *y, vmask mask, vf sum, vf bias, int accumulate) {
    vf out = vf_add(sum, bias);
    if (accumulate) out = vf_add(vf_load_mask(y, mask), out);
    vf_store_mask(y, mask, out);
}

#ifndef AMX  /* the FMA builds' matmul */

/* A register tile: R rows x P panels (16 columns each; P = 1, 2 or 4) of one group: from the
 * 32-column block w points at (its upper 16 columns when `high`, for P = 1); y, mask and bias
 * point at the tile's first panel. Each output is one FMA chain over k in order, whatever the
 * tile. Every tile prefetches the group's whole stream (both 64-byte lines of each k), so tiles
 * over part of a group find the rest in cache. */
#define TILE_K_LOOP(R, P, HIGH)                                                                     \
    for (long k = 0; k < K; k++) {                                                                  \
        const uint16_t *wk = w + k * GROUP;                                                         \
        prefetch(wk + PREFETCH);                                                                    \
        prefetch(wk + PREFETCH + 32);                                                               \
        if (P == 1) {                                                                               \
            vf wv = vf_widen16(wk, HIGH);                                                           \
            for (int r = 0; r < R; r++) acc[0][r] = vf_fmadd(vf_set1(x[r * ldx + k]), wv, acc[0][r]); \
        }                                                                                           \
        for (int h = 0; h < P / 2; h++) { /* 32 columns at a time: widened, then used */         \
            vf wv[2];                                                                               \
            vf_widen32(wk + 32 * h, &wv[0], &wv[1]);                                                \
            for (int p = 0; p < 2; p++)                                                             \
                for (int r = 0; r < R; r++)                                                         \
                    acc[2 * h + p][r] = vf_fmadd(vf_set1(x[r * ldx + k]), wv[p], acc[2 * h + p][r]); \
        }                                                                                           \
    }

#define DEFINE_TILE(R, P)                                                                           \
    static void tile_##R##x##P(const float *x, long ldx, const uint16_t *w, int high, long K, float *y, \
                               long ldy, const vmask *mask, const float *bias, int accumulate) {    \
        vf acc[P][R];                                                                               \
        for (int p = 0; p < P; p++)                                                                 \
            for (int r = 0; r < R; r++) acc[p][r] = vf_zero();                                      \
        if (P == 1 && high) /* a loop per half: no choice inside it */                              \
            TILE_K_LOOP(R, P, 1)                                                                    \
        else                                                                                        \
            TILE_K_LOOP(R, P, 0)                                                                    \
        for (int p = 0; p < P; p++) {                                                               \
            vf b = bias ? vf_load_mask(bias + 16 * p, mask[p]) : vf_zero();                         \
            for (int r = 0; r < R; r++)                                                             \
                store_output(y + r * ldy + 16 * p, mask[p], acc[p][r], b, accumulate);              \
        }                                                                                           \
    }

typedef void (*tile_fn)(const float *, long, const uint16_t *, int, long, float *, long, const vmask *,
                        const float *, int);
typedef struct { tile_fn fn; int panels; } tile_plan;  /* a tile over `panels` of the group's 4 panels */

/* TILES[rows]: the tile for a block of that many rows (up to TILE_ROWS, the ISA's TILE_SHAPES),
 * run over the group's panels `panels` at a time. */
TILE_SHAPES(DEFINE_TILE)
#define TILE_PLAN(R, P) {tile_##R##x##P, P},
static const tile_plan TILES[TILE_ROWS + 1] = {{0, 0}, TILE_SHAPES(TILE_PLAN)};
#undef TILE_PLAN

typedef struct {
    const float *x; long M, ldx; const uint16_t *wp; long K, N; float *y; long ldy; const float *bias;
    int accumulate;  /* y += x @ W + b instead of y = x @ W + b */
} gemm_args;

/* Groups [first, last) of one call. */
static void gemm_groups(const gemm_args *a, long first, long last) {
    const float *x = a->x, *bias = a->bias;
    long M = a->M, ldx = a->ldx, K = a->K, N = a->N, ldy = a->ldy;
    long block_rows = TILE_ROWS;
#ifdef EQUAL_ROW_BLOCKS  /* blocks of equal height: 8 rows as 4 + 4, not 6 + 2 (whose 2-row tile spills) */
    long blocks = (M + TILE_ROWS - 1) / TILE_ROWS;
    block_rows = (M + blocks - 1) / blocks;
#endif
    for (long g = first; g < last; g++) {
        vmask mask[4];
        for (int p = 0; p < 4; p++) mask[p] = tail_mask(N - g * GROUP - 16 * p);
        const float *b = bias ? bias + g * GROUP : 0;
        for (long r0 = 0; r0 < M; r0 += block_rows) {
            long rows = M - r0 < block_rows ? M - r0 : block_rows;
            const tile_plan *tile = &TILES[rows];
            for (int p0 = 0; p0 < 4 && mask[p0]; p0 += tile->panels)  /* panels past N: nothing to do */
                tile->fn(x + r0 * ldx, ldx, a->wp + g * K * GROUP + 32 * (p0 / 2), p0 & 1, K,
                         a->y + r0 * ldy + g * GROUP + 16 * p0, ldy, mask + p0, b ? b + 16 * p0 : 0, a->accumulate);
        }
    }
}

#else  /* AMX */

/* The AMX matmul (Intel Sapphire Rapids and later). TDPBF16PS multiplies a tile of up to 16 rows
 * x 32 bf16 of x by a tile of 16 k-pairs x 16 columns of W into 16 x 16 fp32 accumulators: about
 * 30x the multiply-adds per cycle of AVX-512 FMAs here (measured), so a step over 8 or 16 rows
 * costs about what a step over one row costs, the weights' read. It reads both operands in bf16,
 * so here, and only here, each matmul's input is rounded to bf16 (round to nearest even), as
 * oneDNN's AMX kernels and PyTorch's bf16 models do; accumulation stays fp32, and everything
 * around the matmuls (norms, attention, the residual stream) is the same code as the AVX-512
 * build. Batch invariant as the FMA builds: a row's outputs come from its own tile row, whatever
 * the other rows and whichever thread runs the group. Layout ("pairs"): wp[group][K / 2][64][2],
 * K padded to a multiple of 32 with zeros; the activations are converted once per call, on the
 * calling thread, into a buffer padded the same way (and to whole blocks of rows). */

#define AMX_K 32        /* bf16 per A-tile row: 64 bytes */
#define AMX_ROWS 16     /* rows per tile */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Tiles 0-3: the group's four 16-column panels of C [rows x 16 fp32]; 4: A [rows x 32 bf16];
 * 5, 6: B [16 k-pairs x 16 columns x 2], alternating so that loads overlap multiplies. The
 * configuration is per thread and other libraries (oneDNN) load their own: set on every call. */
static void amx_configure(int rows) {
    amx_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 5; t++) config.rows[t] = rows, config.colsb[t] = 64;
    for (int t = 5; t < 7; t++) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

typedef struct {
    const uint16_t *xb; long M, ldxb, rows;  /* xb: bf16 rows, padded to whole blocks of `rows` */
    const uint16_t *wp; long K, N;           /* K: padded to AMX_K */
    float *y; long ldy; const float *bias;
    int accumulate;
} amx_args;

/* Groups [first, last) of one call: per group, each block of rows through the whole K, then the
 * fp32 epilogue (bias, residual, column tail) in the FMA build's order. */
static void amx_groups(const void *ctx, long first, long last) {
    const amx_args *a = (const amx_args *)ctx;
    long K = a->K, N = a->N, ldxb = a->ldxb, ldy = a->ldy;
    float c[AMX_ROWS * GROUP] __attribute__((aligned(64)));
    amx_configure((int)a->rows);
    for (long g = first; g < last; g++) {
        const uint16_t *w = a->wp + g * K * GROUP;
        vmask mask[4];
        for (int p = 0; p < 4; p++) mask[p] = tail_mask(N - g * GROUP - 16 * p);
        const float *bias = a->bias ? a->bias + g * GROUP : 0;
        for (long r0 = 0; r0 < a->M; r0 += a->rows) {
            const uint16_t *x = a->xb + r0 * ldxb;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (long k = 0; k < K; k += AMX_K) {
                const uint16_t *wk = w + k * GROUP;  /* 16 k-pairs x 64 columns x 2: 4 KB */
                if (r0 == 0)
                    for (int line = 0; line < AMX_K * GROUP; line += 32) prefetch(wk + PREFETCH + line);
                _tile_loadd(4, x + k, ldxb * 2);
                _tile_loadd(5, wk, GROUP * 4);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, wk + 32, GROUP * 4);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(5, wk + 64, GROUP * 4);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(6, wk + 96, GROUP * 4);
                _tile_dpbf16ps(3, 4, 6);
            }
            _tile_stored(0, c, GROUP * 4);
            _tile_stored(1, c + 16, GROUP * 4);
            _tile_stored(2, c + 32, GROUP * 4);
            _tile_stored(3, c + 48, GROUP * 4);
            long rows = a->M - r0 < a->rows ? a->M - r0 : a->rows;
            for (int p = 0; p < 4 && mask[p]; p++) {
                vf b = bias ? vf_load_mask(bias + 16 * p, mask[p]) : vf_zero();
                for (long r = 0; r < rows; r++)
                    store_output(a->y + (r0 + r) * ldy + g * GROUP + 16 * p, mask[p], vf_load(c + r * GROUP + 16 * p),
                                 b, a->accumulate);
            }
        }
    }
    _tile_release();
}

#endif  /* AMX */

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
            cpu_relax();
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
    while (atomic_load(&ready) < num_threads - 1) cpu_relax();  /* every worker has read `generation` */
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
    while (atomic_load_explicit(&finished, memory_order_acquire) < num_threads - 1) cpu_relax();
    pthread_mutex_unlock(&pool_lock);
}

#ifndef AMX
static void gemm_range(const void *ctx, long first, long last) { gemm_groups((const gemm_args *)ctx, first, last); }

/* x [M, K] fp32 (row stride ldx), wp packed [ceil(N/64)][K][64] bf16, y [M, N] (row stride ldy),
 * bias [N] or NULL. */
static void gemm(const float *x, long M, long ldx, const uint16_t *wp, long K, long N, float *y, long ldy,
                 const float *bias, int accumulate) {
    gemm_args args = {x, M, ldx, wp, K, N, y, ldy, bias, accumulate};
    parallel_for(gemm_range, &args, (N + GROUP - 1) / GROUP, 2);
}
#else
/* The calling thread's bf16 copy of the activations (grown as needed, kept: ~120 calls a step). */
static _Thread_local uint16_t *amx_input;
static _Thread_local long amx_input_size;

/* x [M, K] fp32 rounded to bf16 into [ceil(M / rows) * rows, Kp] (zeros past K and past M). */
static const uint16_t *amx_round_input(const float *x, long M, long ldx, long K, long Kp, long rows) {
    long padded_rows = (M + rows - 1) / rows * rows, size = padded_rows * Kp;
    if (size > amx_input_size) {
        free(amx_input);
        amx_input = aligned_alloc(64, (size * 2 + 63) / 64 * 64);
        amx_input_size = amx_input ? size : 0;
        if (!amx_input) return 0;
    }
    for (long r = 0; r < padded_rows; r++)
        for (long k = 0; k < Kp; k += 32) {
            __m512 low = r < M ? vf_load_mask(x + r * ldx + k, tail_mask(K - k)) : vf_zero();
            __m512 high = r < M ? vf_load_mask(x + r * ldx + k + 16, tail_mask(K - k - 16)) : vf_zero();
            _mm512_store_si512((void *)(amx_input + r * Kp + k), (__m512i)_mm512_cvtne2ps_pbh(high, low));
        }
    return amx_input;
}

/* As the FMA builds' gemm, wp packed [ceil(N/64)][Kp/2][64][2] (Kp: K rounded up to 32). Without
 * memory for the bf16 copy of x (a few MB at most), y is filled with NaN rather than left stale. */
static void gemm(const float *x, long M, long ldx, const uint16_t *wp, long K, long N, float *y, long ldy,
                 const float *bias, int accumulate) {
    long Kp = (K + AMX_K - 1) / AMX_K * AMX_K, rows = M < AMX_ROWS ? M : AMX_ROWS;
    const uint16_t *xb = amx_round_input(x, M, ldx, K, Kp, rows);
    if (!xb) {
        for (long r = 0; r < M; r++)
            for (long n = 0; n < N; n++) y[r * ldy + n] = NAN;
        return;
    }
    amx_args args = {xb, M, Kp, rows, wp, Kp, N, y, ldy, bias, accumulate};
    parallel_for(amx_groups, &args, (N + GROUP - 1) / GROUP, 2);
}

#endif

/* Once per process, before any call: 0 when this build can run. The AMX build asks Linux for the
 * tile data state (off by default: 8 KB more per thread to save on a context switch). */
int dspark_kernel_init(void) {
#ifdef AMX
    return (int)syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */);
#else
    return 0;
#endif
}

void dspark_bf16_gemm(const float *x, long M, long ldx, const uint16_t *wp, long K, long N, float *y, long ldy,
                      const float *bias) {
    gemm(x, M, ldx, wp, K, N, y, ldy, bias, 0);
}

/* ---- 4-bit weights (`--dtype int4`; AMX-INT8 only) -----------------------------------------
 *
 * Each weight column's K inputs in Q4_1 blocks of 32, as the GGUF stores SmolLM2's decoder
 * matrices: w = d * q + m, q in 0..15, d and m fp16 per (column, block). Each matmul's input is
 * quantized per row and per block of 32 to int8 with an fp32 scale s (x ~ s * a, a = round(x *
 * 127 / max|x|)), as llama.cpp does for its CPU dot products, so that a block of 16 columns is one
 * TDPBSUD (int8 x uint8 -> int32 sums of 32 products, exact) and
 *     sum_k x_k w_k ~ d * s * sum_k a_k q_k + m * s * sum_k a_k,
 * applied per block in fp32 in a fixed order. A row's result depends on its own activations and
 * scales only (batch invariant, as the other builds). ~5 bits a weight instead of 16: the weights'
 * read, which bounds a decode step, is ~3.2x smaller (benchmarks/experiments/q4_amx_gemm.c).
 *
 * Layout (`Q4Weight` packs it): [G = ceil(N / 64)][K / 32] blocks of 64 columns x 32 inputs, each
 * 1 KB of nibbles, [4 tiles][8 rows][32 bytes]: byte j of a tile row holds byte j (low nibble)
 * and byte j + 32 (high) of that row of AMX's int8 B tile (byte b: column b / 4, input 4 r + b % 4);
 * then d [G][K / 32][64] and m [G][K / 32][64], fp16.
 *
 * The same kernel takes Q8_0 blocks (the GGUF's embedding / tied LM head: w = d * q, q int8, one
 * TDPBSSD per 16 columns and block, no m): [G][K / 32][4 tiles][8 rows][64 bytes], the int8 B
 * tiles as they are, then d [G][K / 32][64] fp16. */

#define Q4_BLOCK 32

int dspark_q4_available(void) {
#if defined(AMX) && defined(__AMX_INT8__)
    return 1;
#else
    return 0;
#endif
}

#if defined(AMX) && defined(__AMX_INT8__)
typedef struct {
    const int8_t *a; const float *scale, *scaled_sum;  /* a [Mp][K]; scale, scaled_sum [Mp][K / 32] */
    long M, rows, K, N;                                  /* rows: per tile (M padded to whole tiles) */
    const uint8_t *w; float *y; long ldy; const float *bias; int accumulate;
    int bits;                                            /* 4: Q4_1 (uint8 q, with m); 8: Q8_0 (int8 q) */
} q4_args;

static void q4_configure(int rows) {
    amx_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 4; t++) config.rows[t] = rows, config.colsb[t] = 64;  /* C: rows x 16 int32 */
    config.rows[4] = rows, config.colsb[4] = Q4_BLOCK;                        /* A: rows x 32 int8 */
    for (int t = 5; t < 7; t++) config.rows[t] = Q4_BLOCK / 4, config.colsb[t] = 64;  /* B: 8 x 16 x 4 */
    _tile_loadconfig(&config);
}

/* One 32-input block's share of a 4-bit matmul output panel: out + (d * s) * dot [+ m * (s * sum a)]
 * (the m term for Q4_1 only), in this order: the AMX and the VNNI paths both add blocks here, so
 * they give the same bits. */
static inline vf q4_block_add(vf out, vf d, vf m, float scale, float scaled_sum, vf dot, int bits) {
    out = vf_fmadd(vf_mul(d, vf_set1(scale)), dot, out);
    return bits == 4 ? vf_fmadd(m, vf_set1(scaled_sum), out) : out;
}

static void q4_groups(const void *ctx, long first, long last) {
    const q4_args *a = (const q4_args *)ctx;
    long K = a->K, blocks = K / Q4_BLOCK, groups = (a->N + GROUP - 1) / GROUP;
    long block_bytes = a->bits == 4 ? 1024 : 2048;  /* a block's weights: nibbles, or the int8 B tiles as they are */
    const uint8_t *nibbles = a->w;
    const uint16_t *d_all = (const uint16_t *)(a->w + groups * blocks * block_bytes), *m_all = d_all + groups * blocks * GROUP;
    uint8_t b[4][8 * 64] __attribute__((aligned(64)));
    int32_t dots[AMX_ROWS * GROUP] __attribute__((aligned(64)));
    float out[AMX_ROWS * GROUP] __attribute__((aligned(64)));
    const __m256i low = _mm256_set1_epi8(0x0F);
    q4_configure((int)a->rows);
    for (long g = first; g < last; g++) {
        vmask mask[4];
        for (int p = 0; p < 4; p++) mask[p] = tail_mask(a->N - g * GROUP - 16 * p);
        for (long r0 = 0; r0 < a->M; r0 += a->rows) {
            long rows = a->M - r0 < a->rows ? a->M - r0 : a->rows;
            memset(out, 0, sizeof(float) * a->rows * GROUP);
            for (long kb = 0; kb < blocks; kb++) {
                const uint8_t *packed = nibbles + (g * blocks + kb) * block_bytes;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                _tile_loadd(4, a->a + r0 * K + kb * Q4_BLOCK, K);
                if (a->bits == 4) {
                    for (int t = 0; t < 4; t++)
                        for (int r = 0; r < 8; r++) {  /* a tile row's 64 bytes from 32 bytes of nibbles */
                            __m256i v = _mm256_loadu_si256((const __m256i *)(packed + (t * 8 + r) * 32));
                            __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low)),
                                                               _mm256_and_si256(_mm256_srli_epi16(v, 4), low), 1);
                            _mm512_store_si512((void *)(b[t] + r * 64), both);
                        }
                    _tile_loadd(5, b[0], 64);
                    _tile_dpbsud(0, 4, 5);
                    _tile_loadd(6, b[1], 64);
                    _tile_dpbsud(1, 4, 6);
                    _tile_loadd(5, b[2], 64);
                    _tile_dpbsud(2, 4, 5);
                    _tile_loadd(6, b[3], 64);
                    _tile_dpbsud(3, 4, 6);
                } else {  /* int8 x int8, the tiles straight from the weights */
                    _tile_loadd(5, packed, 64);
                    _tile_dpbssd(0, 4, 5);
                    _tile_loadd(6, packed + 512, 64);
                    _tile_dpbssd(1, 4, 6);
                    _tile_loadd(5, packed + 1024, 64);
                    _tile_dpbssd(2, 4, 5);
                    _tile_loadd(6, packed + 1536, 64);
                    _tile_dpbssd(3, 4, 6);
                }
                _tile_stored(0, dots, GROUP * 4);
                _tile_stored(1, dots + 16, GROUP * 4);
                _tile_stored(2, dots + 32, GROUP * 4);
                _tile_stored(3, dots + 48, GROUP * 4);
                const uint16_t *dp = d_all + (g * blocks + kb) * GROUP, *mp = m_all + (g * blocks + kb) * GROUP;
                for (int p = 0; p < 4; p++) {
                    vf d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dp + 16 * p)));
                    vf m = a->bits == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mp + 16 * p))) : vf_zero();
                    for (long r = 0; r < rows; r++) {
                        long row = (r0 + r) * blocks + kb;
                        vf dot = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(dots + r * GROUP + 16 * p)));
                        vf_store(out + r * GROUP + 16 * p, q4_block_add(vf_load(out + r * GROUP + 16 * p), d, m,
                                                                        a->scale[row], a->scaled_sum[row], dot, a->bits));
                    }
                }
            }
            for (int p = 0; p < 4 && mask[p]; p++) {  /* the bf16 build's epilogue: (out + bias), then + y */
                vf bias = a->bias ? vf_load_mask(a->bias + g * GROUP + 16 * p, mask[p]) : vf_zero();
                for (long r = 0; r < rows; r++)
                    store_output(a->y + (r0 + r) * a->ldy + g * GROUP + 16 * p, mask[p], vf_load(out + r * GROUP + 16 * p),
                                 bias, a->accumulate);
            }
        }
    }
    _tile_release();
}

/* q4_groups for a call of at most Q4_VNNI_ROWS rows, 4-bit weights: AVX-512 VNNI instead of AMX.
 * At one row a tile op computes 1 of its 16 rows, and each 32-input block pays four tile stores
 * and loads besides; VPDPBUSD takes the same B-tile rows (each 32-bit lane: a column's 4 inputs,
 * exactly VPDPBUSD's operand layout) and keeps the sums in registers. The int32 sums are exact in
 * both, and both add each block through q4_block_add and store through store_output: the same
 * bits as the AMX path (tested), so which path runs never shows in the results. Every AMX-INT8 CPU has AVX-512 VNNI. */
#define Q4_VNNI_ROWS 2

__attribute__((target("avx512vnni")))
static void q4_groups_vnni(const void *ctx, long first, long last) {
    const q4_args *a = (const q4_args *)ctx;
    long K = a->K, blocks = K / Q4_BLOCK, groups = (a->N + GROUP - 1) / GROUP;
    const uint8_t *nibbles = a->w;
    const uint16_t *d_all = (const uint16_t *)(a->w + groups * blocks * 1024), *m_all = d_all + groups * blocks * GROUP;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (long g = first; g < last; g++) {
        vmask mask[4];
        for (int p = 0; p < 4; p++) mask[p] = tail_mask(a->N - g * GROUP - 16 * p);
        vf out[Q4_VNNI_ROWS][4];
        for (long r = 0; r < a->M; r++)
            for (int p = 0; p < 4; p++) out[r][p] = vf_zero();
        for (long kb = 0; kb < blocks; kb++) {
            const uint8_t *packed = nibbles + (g * blocks + kb) * 1024;
            __m512i dots[Q4_VNNI_ROWS][4];
            for (long r = 0; r < a->M; r++)
                for (int t = 0; t < 4; t++) dots[r][t] = _mm512_setzero_si512();
            for (int t = 0; t < 4; t++)
                for (int row = 0; row < 8; row++) {  /* a B-tile row: 16 columns x 4 inputs */
                    __m256i v = _mm256_loadu_si256((const __m256i *)(packed + (t * 8 + row) * 32));
                    __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, low)),
                                                   _mm256_and_si256(_mm256_srli_epi16(v, 4), low), 1);
                    for (long r = 0; r < a->M; r++) {
                        int32_t four;  /* inputs 4 row .. 4 row + 3 of this block, as one lane */
                        memcpy(&four, a->a + r * K + kb * Q4_BLOCK + 4 * row, 4);
                        dots[r][t] = _mm512_dpbusd_epi32(dots[r][t], b, _mm512_set1_epi32(four));
                    }
                }
            const uint16_t *dp = d_all + (g * blocks + kb) * GROUP, *mp = m_all + (g * blocks + kb) * GROUP;
            for (int p = 0; p < 4; p++) {
                vf d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dp + 16 * p)));
                vf m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mp + 16 * p)));
                for (long r = 0; r < a->M; r++)
                    out[r][p] = q4_block_add(out[r][p], d, m, a->scale[r * blocks + kb], a->scaled_sum[r * blocks + kb],
                                             _mm512_cvtepi32_ps(dots[r][p]), 4);
            }
        }
        for (int p = 0; p < 4 && mask[p]; p++) {  /* the bf16 build's epilogue: (out + bias), then + y */
            vf bias = a->bias ? vf_load_mask(a->bias + g * GROUP + 16 * p, mask[p]) : vf_zero();
            for (long r = 0; r < a->M; r++)
                store_output(a->y + r * a->ldy + g * GROUP + 16 * p, mask[p], out[r][p], bias, a->accumulate);
        }
    }
}

/* The calling thread's int8 copy of the activations and their scales (grown as needed, kept). */
static _Thread_local int8_t *q4_input;
static _Thread_local float *q4_scales;
static _Thread_local long q4_input_size, q4_scales_size;

/* x [M, K] -> int8 rows [Mp, K] (zeros past M) and per (row, block) scale s and s * sum(a). */
static int q4_quantize(const float *x, long M, long ldx, long K, long Mp) {
    long blocks = K / Q4_BLOCK;
    if (Mp * K > q4_input_size) {
        free(q4_input);
        q4_input = aligned_alloc(64, (Mp * K + 63) / 64 * 64);
        q4_input_size = q4_input ? Mp * K : 0;
    }
    if (2 * Mp * blocks > q4_scales_size) {
        free(q4_scales);
        q4_scales = malloc(sizeof(float) * 2 * Mp * blocks);
        q4_scales_size = q4_scales ? 2 * Mp * blocks : 0;
    }
    if (!q4_input || !q4_scales) return -1;
    float *scale = q4_scales, *scaled_sum = q4_scales + Mp * blocks;
    for (long r = 0; r < Mp; r++)
        for (long kb = 0; kb < blocks; kb++) {
            int8_t *out = q4_input + r * K + kb * Q4_BLOCK;
            if (r >= M) {
                memset(out, 0, Q4_BLOCK);
                scale[r * blocks + kb] = scaled_sum[r * blocks + kb] = 0;
                continue;
            }
            vf lo = vf_load_mask(x + r * ldx + kb * Q4_BLOCK, 0xFFFF), hi = vf_load_mask(x + r * ldx + kb * Q4_BLOCK + 16, 0xFFFF);
            float top = vf_reduce_max(vf_max(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            float s = top / 127.0f, inverse = top > 0 ? 127.0f / top : 0.0f;
            __m512i qlo = _mm512_cvtps_epi32(vf_mul(lo, vf_set1(inverse)));  /* round to nearest even */
            __m512i qhi = _mm512_cvtps_epi32(vf_mul(hi, vf_set1(inverse)));
            _mm_storeu_si128((__m128i *)out, _mm512_cvtsepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtsepi32_epi8(qhi));
            scale[r * blocks + kb] = s;
            scaled_sum[r * blocks + kb] = s * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        }
    return 0;
}

/* y [M, N] (+)= x [M, K] @ W (4-bit, the layout above; K a multiple of 32) (+ bias). Returns -1
 * (y filled with NaN) without memory for the int8 copy of x. */
static int q4_gemm(const float *x, long M, long ldx, const uint8_t *w, long K, long N, float *y, long ldy,
                   const float *bias, int accumulate, int bits) {
    long rows = M < AMX_ROWS ? M : AMX_ROWS, Mp = (M + rows - 1) / rows * rows;
    if (q4_quantize(x, M, ldx, K, Mp)) {
        for (long r = 0; r < M; r++)
            for (long n = 0; n < N; n++) y[r * ldy + n] = NAN;
        return -1;
    }
    q4_args args = {q4_input, q4_scales, q4_scales + Mp * (K / Q4_BLOCK), M, rows, K, N, w, y, ldy, bias, accumulate,
                    bits};
    parallel_for(bits == 4 && M <= Q4_VNNI_ROWS ? q4_groups_vnni : q4_groups, &args, (N + GROUP - 1) / GROUP, 2);
    return 0;
}
#else
static int q4_gemm(const float *x, long M, long ldx, const uint8_t *w, long K, long N, float *y, long ldy,
                   const float *bias, int accumulate, int bits) {
    (void)x, (void)ldx, (void)w, (void)K, (void)bias, (void)accumulate, (void)bits;
    for (long r = 0; r < M; r++)
        for (long n = 0; n < N; n++) y[r * ldy + n] = NAN;
    return -1;  /* this build has no 4-bit matmul (dspark_q4_available says so) */
}
#endif

int dspark_q4_gemm(const float *x, long M, long ldx, const uint8_t *w, long K, long N, float *y, long ldy,
                   const float *bias) {
    return q4_gemm(x, M, ldx, w, K, N, y, ldy, bias, 0, 4);
}

int dspark_q8_gemm(const float *x, long M, long ldx, const int8_t *w, long K, long N, float *y, long ldy,
                   const float *bias) {
    return q4_gemm(x, M, ldx, (const uint8_t *)w, K, N, y, ldy, bias, 0, 8);
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

/* scores[j] = (q . k_j) * scale for keys j in [0, length), 16 keys at a time (a partial last
 * block reads only its own keys), SCORE_KEYS keys per pass over q: key j's dot product is one
 * FMA chain per lane over q's 16-float chunks in order, whatever the pass. */
static void score_keys(const float *q, const float *k, long dim, long length, float scale, float *scores) {
    long chunks = (dim + 15) / 16;
    vmask last = tail_mask(dim - 16 * (chunks - 1));
    for (long j0 = 0; j0 < length; j0 += 16) {
        long n = length - j0 < 16 ? length - j0 : 16;
        const float *block = k + j0 * dim;
        vf v[16];
        for (int i = 0; i < 16; i++) v[i] = vf_zero();
        for (int i0 = 0; i0 < 16 && i0 < n; i0 += SCORE_KEYS)
            for (long c = 0; c < chunks; c++) {
                vmask m = c == chunks - 1 ? last : (vmask)0xFFFF;
                vf qc = vf_load_mask(q + 16 * c, m);
                if (n == 16) {
                    for (int i = i0; i < i0 + SCORE_KEYS; i++)
                        v[i] = vf_fmadd(qc, vf_load_mask(block + i * dim + 16 * c, m), v[i]);
                } else {
                    for (int i = i0; i < i0 + SCORE_KEYS; i++)
                        if (i < n) v[i] = vf_fmadd(qc, vf_load_mask(block + i * dim + 16 * c, m), v[i]);
                }
            }
        vf_store_mask(scores + j0, tail_mask(n), vf_mul(vf_sum16(v), vf_set1(scale)));
    }
}

#if SCORE_QUERIES == 2
/* score_keys of two queries over one whole block of 16 keys, sharing each key load: keys 0-7,
 * then 8-15, 8 dot products per query at a time (16 accumulators), each the same FMA chain over
 * q's chunks as in score_keys, and the same reduction tree (vf_sum8_half, vf_sum16_join): the
 * same bits as two score_keys calls. */
static void score_keys_pair(const float *qa, const float *qb, const float *block, long dim, float scale,
                            float *scores_a, float *scores_b) {
    long chunks = (dim + 15) / 16;
    vmask last = tail_mask(dim - 16 * (chunks - 1));
    vf half_a[2], half_b[2];
    for (int h = 0; h < 2; h++) {
        vf va[8], vb[8];
        for (int i = 0; i < 8; i++) va[i] = vb[i] = vf_zero();
        for (long c = 0; c < chunks; c++) {
            vmask m = c == chunks - 1 ? last : (vmask)0xFFFF;
            vf qa_c = vf_load_mask(qa + 16 * c, m), qb_c = vf_load_mask(qb + 16 * c, m);
            for (int i = 0; i < 8; i++) {
                vf key = vf_load_mask(block + (8 * h + i) * dim + 16 * c, m);
                va[i] = vf_fmadd(qa_c, key, va[i]);
                vb[i] = vf_fmadd(qb_c, key, vb[i]);
            }
        }
        half_a[h] = vf_sum8_half(va);
        half_b[h] = vf_sum8_half(vb);
    }
    vf_store_mask(scores_a, (vmask)0xFFFF, vf_mul(vf_sum16_join(half_a[0], half_a[1]), vf_set1(scale)));  /* rows: 4-byte aligned */
    vf_store_mask(scores_b, (vmask)0xFFFF, vf_mul(vf_sum16_join(half_b[0], half_b[1]), vf_set1(scale)));
}
#endif

/* One query's weighted sum of values over keys [0, length): two FMA chains per 16-float panel,
 * even keys and odd keys, each in key order from zero (the last key of an odd length goes to the
 * even chain); the chains are written to even_sums [padded] and even_sums + padded. Keys are
 * paired (0, 1), (2, 3), ... however the work is split, so these are a query's bits. */
static inline void value_pairs(const float *v, long dim, long d0, const float *weights, long from, long to,
                               const vmask *m, vf *even, vf *odd) {
    long j = from;
    for (; j + 1 < to; j += 2) {
        vf w0 = vf_set1(weights[j]), w1 = vf_set1(weights[j + 1]);
        for (int c = 0; c < VALUE_PANELS; c++) {
            even[c] = vf_fmadd(w0, vf_load_mask(v + j * dim + d0 + 16 * c, m[c]), even[c]);
            odd[c] = vf_fmadd(w1, vf_load_mask(v + (j + 1) * dim + d0 + 16 * c, m[c]), odd[c]);
        }
    }
    if (j < to) {  /* the last key of an odd length: its even chain */
        vf w0 = vf_set1(weights[j]);
        for (int c = 0; c < VALUE_PANELS; c++)
            even[c] = vf_fmadd(w0, vf_load_mask(v + j * dim + d0 + 16 * c, m[c]), even[c]);
    }
}

static void weighted_values(const float *v, long dim, long padded, const float *weights, long length,
                            float *even_sums) {
    for (long d0 = 0; d0 < dim; d0 += 16 * VALUE_PANELS) {
        vf even[VALUE_PANELS], odd[VALUE_PANELS];
        vmask m[VALUE_PANELS];
        for (int c = 0; c < VALUE_PANELS; c++) {
            m[c] = tail_mask(dim - d0 - 16 * c);
            even[c] = odd[c] = vf_zero();
        }
        value_pairs(v, dim, d0, weights, 0, length, m, even, odd);
        for (int c = 0; c < VALUE_PANELS; c++) {
            vf_store(even_sums + d0 + 16 * c, even[c]);
            vf_store(even_sums + padded + d0 + 16 * c, odd[c]);
        }
    }
}

/* weighted_values for two queries of a slot at once, each with its own chains (so its own bits,
 * as above): over the keys both see, every value load feeds both queries' FMAs, which halves
 * the loads and gives the core twice the independent chains; then each finishes alone. */
static void weighted_values_pair(const float *v, long dim, long padded, const float *weights_a, long length_a,
                                 const float *weights_b, long length_b, float *sums_a, float *sums_b) {
    long common = (length_a < length_b ? length_a : length_b) / 2 * 2;  /* whole key pairs both see */
    for (long d0 = 0; d0 < dim; d0 += 16 * VALUE_PANELS) {
        vf even_a[VALUE_PANELS], odd_a[VALUE_PANELS], even_b[VALUE_PANELS], odd_b[VALUE_PANELS];
        vmask m[VALUE_PANELS];
        for (int c = 0; c < VALUE_PANELS; c++) {
            m[c] = tail_mask(dim - d0 - 16 * c);
            even_a[c] = odd_a[c] = even_b[c] = odd_b[c] = vf_zero();
        }
        for (long j = 0; j < common; j += 2) {
            vf a0 = vf_set1(weights_a[j]), a1 = vf_set1(weights_a[j + 1]);
            vf b0 = vf_set1(weights_b[j]), b1 = vf_set1(weights_b[j + 1]);
            for (int c = 0; c < VALUE_PANELS; c++) {
                vf v0 = vf_load_mask(v + j * dim + d0 + 16 * c, m[c]);
                vf v1 = vf_load_mask(v + (j + 1) * dim + d0 + 16 * c, m[c]);
                even_a[c] = vf_fmadd(a0, v0, even_a[c]);
                odd_a[c] = vf_fmadd(a1, v1, odd_a[c]);
                even_b[c] = vf_fmadd(b0, v0, even_b[c]);
                odd_b[c] = vf_fmadd(b1, v1, odd_b[c]);
            }
        }
        value_pairs(v, dim, d0, weights_a, common, length_a, m, even_a, odd_a);
        value_pairs(v, dim, d0, weights_b, common, length_b, m, even_b, odd_b);
        for (int c = 0; c < VALUE_PANELS; c++) {
            vf_store(sums_a + d0 + 16 * c, even_a[c]);
            vf_store(sums_a + padded + d0 + 16 * c, odd_a[c]);
            vf_store(sums_b + d0 + 16 * c, even_b[c]);
            vf_store(sums_b + padded + d0 + 16 * c, odd_b[c]);
        }
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
            for (long i = 0; i < n; i++) {
                const float *q = a->q + (t0 + i) * a->ldq + h * dim;
#if SCORE_QUERIES == 2
                if (i + 1 < n && j0 + 16 <= lengths[i] && j0 + 16 <= lengths[i + 1]) {  /* both see the whole block */
                    score_keys_pair(q, q + a->ldq, k + j0 * dim, dim, a->scale, scores + i * stride + j0,
                                    scores + (i + 1) * stride + j0);
                    i++;
                    continue;
                }
#endif
                if (j0 < lengths[i]) {
                    long count = lengths[i] - j0 < 16 ? lengths[i] - j0 : 16;
                    score_keys(q, k + j0 * dim, dim, count, a->scale, scores + i * stride + j0);
                }
            }
        for (long i = 0; i < n; i++) {  /* softmax of each query over its own keys */
            float *row = scores + i * stride;
            long length = lengths[i];
            vf top = vf_set1(-INFINITY);
            for (long j = 0; j < length; j += 16)
                top = vf_max(top, vf_load_mask_or(row + j, tail_mask(length - j), vf_set1(-INFINITY)));
            vf total = vf_zero(), shift = vf_set1(vf_reduce_max(top));
            for (long j = 0; j < length; j += 16) {  /* 16 lanes, in one order fixed by the length */
                vmask m = tail_mask(length - j);
                vf e = vf_exp(vf_sub(vf_load_mask(row + j, m), shift));
                vf_store_mask(row + j, m, e);
                total = vf_add(total, vf_keep(m, e));
            }
            totals[i] = vf_reduce_add(total);
        }
        for (long i = 0; i < n; i += VALUE_QUERIES) {  /* weighted values, VALUE_QUERIES queries a pass */
            if (VALUE_QUERIES == 2 && i + 1 < n)
                weighted_values_pair(v, dim, padded, scores + i * stride, lengths[i], scores + (i + 1) * stride,
                                     lengths[i + 1], sums + i * 2 * padded, sums + (i + 1) * 2 * padded);
            else
                weighted_values(v, dim, padded, scores + i * stride, lengths[i], sums + i * 2 * padded);
        }
        for (long i = 0; i < n; i++) {
            float *o = a->out + (t0 + i) * a->ldo + h * dim;
            const float *even_sums = sums + i * 2 * padded, *odd_sums = even_sums + padded;
            for (long d = 0; d < dim; d += 16) {
                vf sum = vf_add(vf_load(even_sums + d), vf_load(odd_sums + d));
                vf_store_mask(o + d, tail_mask(dim - d), vf_div(sum, vf_set1(totals[i])));
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
    long layer_format;  /* the layer matrices: 0 bf16 (the build's layout), 1 4-bit (q4_gemm) */
    long head_format;   /* the LM head: 0 bf16, 2 8-bit (Q8_0 blocks, q4_gemm's 8-bit form) */
} decoder_model;

/* One of a layer's four matmuls, in the model's layer format. */
static int layer_matmul(const decoder_model *m, const float *x, long M, long ldx, const uint16_t *w, long K, long N,
                        float *y, long ldy, const float *bias, int accumulate) {
    if (m->layer_format == 1) return q4_gemm(x, M, ldx, (const uint8_t *)w, K, N, y, ldy, bias, accumulate, 4);
    gemm(x, M, ldx, w, K, N, y, ldy, bias, accumulate);
    return 0;
}

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
    float *normed;                          /* [num_logits][hidden]: the final norm's output at the logit
                                             * rows (what the LM head reads), or NULL: not wanted */
} decoder_call;

static void rms_norm_row(const float *x, const float *weight, long n, float eps, float *out) {
    vf sums = vf_zero();
    for (long i = 0; i < n; i += 16) {
        vf v = vf_load_mask(x + i, tail_mask(n - i));
        sums = vf_fmadd(v, v, sums);
    }
    float scale = 1.0f / sqrtf(vf_reduce_add(sums) / (float)n + eps);
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
            vmask m = tail_mask(a->inter - i);
            vf g = vf_load_mask(gate + i, m);
            vf silu = vf_div(g, vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), g))));
            vf_store_mask(out + i, m, vf_mul(silu, vf_load_mask(up + i, m)));
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
        status = layer_matmul(m, h, T, d, layer->qkv, d, qkv_width, qkv, qkv_width, layer->qkv_bias, 0);
        qkv_args rope = {m, layer, c, qkv, qkv_width, keys, values};
        parallel_for(qkv_range, &rope, T, ROWS_PER_THREAD);
        status = status ? status : dspark_attention(qkv, T, qkv_width, m->heads, m->kv_heads, dim, keys, values, c->slot_stride,
                                  c->head_stride, c->slots, c->visible ? c->visible : c->positions, 1.0f / sqrtf((float)dim),
                                  attn, q_width);
        status = status ? status : layer_matmul(m, attn, T, q_width, layer->o, q_width, d, x, d, layer->o_bias, 1);  /* x += o(attn) */
        norm_args mlp_norm = {x, d, layer->mlp_norm, d, m->eps, h, d, 0};
        parallel_for(norm_range, &mlp_norm, T, ROWS_PER_THREAD);
        status = status ? status : layer_matmul(m, h, T, d, layer->gate_up, d, 2 * inter, gate_up, 2 * inter, 0, 0);
        silu_args silu = {gate_up, inter, act};
        parallel_for(silu_range, &silu, T, ROWS_PER_THREAD);
        status = status ? status : layer_matmul(m, act, T, inter, layer->down, inter, d, x, d, 0, 1);  /* x += down(silu(gate) * up) */
        for (long f = 0; f < c->num_features; f++)
            if (c->feature_layers[f] == l)
                for (long t = 0; t < T; t++)
                    for (long i = 0; i < d; i++) c->features[t * c->num_features * d + f * d + i] = x[t * d + i];
    }
    if (status == 0 && c->num_logits > 0) {
        norm_args final = {x, d, m->final_norm, d, m->eps, h, d, c->logit_rows};
        parallel_for(norm_range, &final, c->num_logits, ROWS_PER_THREAD);
        if (c->normed) memcpy(c->normed, h, (size_t)(c->num_logits * d) * sizeof(float));
        if (m->head_format == 2)
            status = q4_gemm(h, c->num_logits, d, (const uint8_t *)m->lm_head, d, m->vocab, c->logits, m->vocab, 0, 0, 8);
        else
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

/* The index of the first maximum of row[0 .. n), NaN counting as the maximum. */
static long row_argmax(const float *row, long n) {
    vf best = vf_set1(-INFINITY);
    vi best_index = vi_zero(), index = vi_iota();
    vcmp nan = vcmp_none();
    for (long i = 0; i < n; i += 16) {
        vf v = vf_load_mask_or(row + i, tail_mask(n - i), vf_set1(-INFINITY));
        nan = vcmp_or(nan, vf_unordered(v, v));
        vcmp greater = vf_greater(v, best);  /* strict: a lane keeps its first */
        best = vf_select(greater, best, v);
        best_index = vi_select(greater, best_index, index);
        index = vi_add(index, vi_set1(16));
    }
    long found = 0;
    if (vcmp_bits(nan)) {
        while (row[found] == row[found]) found++;  /* the first NaN */
        return found;
    }
    float top = vf_reduce_max(best);
    unsigned ties = vcmp_bits(vf_equal(best, vf_set1(top)));
    found = n;
    int lanes[16];
    vi_storeu(lanes, best_index);
    for (int lane = 0; lane < 16; lane++)  /* the smallest index among the lanes holding the max
                                             * (at least one does; all -inf rows give lane 0's 0) */
        if (((ties >> lane) & 1) && lanes[lane] < found) found = lanes[lane];
    return found;
}

static void argmax_range(const void *ctx, long first, long last) {
    const argmax_args *a = (const argmax_args *)ctx;
    for (long r = first; r < last; r++) a->out[r] = row_argmax(a->x + r * a->ld, a->n);
}

void dspark_argmax(const float *x, long rows, long n, long ld, long *out) {
    argmax_args args = {x, n, ld, out};
    parallel_for(argmax_range, &args, rows, 4);
}

/* ---- logit of the top probability -----------------------------------------------------------
 * out[r] = logit(max softmax(x[r])) = -log(sum over i != top of e^(x_i - x_top)), at most `cap`:
 * what `models/drafter.py: top_probability_logit` defines (the top term left out rather than
 * subtracted, so a p_top within 1e-6 of 1 keeps its precision). One pass per row on the calling
 * thread (a block's 7-56 rows of 8k draft logits: PyTorch's exp alone took ~0.1 ms here). A row
 * holding NaN gives NaN, as the definition does. */
static float row_top_probability_logit(const float *row, long n, long top_index, float cap) {
    float top = row[top_index];
    if (top != top) return top;
    vf shift = vf_set1(top), total = vf_zero();
    for (long i = 0; i < n; i += 16) {
        vmask m = tail_mask(n - i);
        if (top_index >= i && top_index < i + 16) m &= (vmask)~(1u << (top_index - i));
        total = vf_add(total, vf_keep(m, vf_exp(vf_sub(vf_load_mask(row + i, m), shift))));
    }
    float logit = -logf(vf_reduce_add(total));
    return logit < cap ? logit : cap;
}

void dspark_top_probability_logit(const float *x, long rows, long n, long ld, float cap, float *out) {
    for (long r = 0; r < rows; r++) out[r] = row_top_probability_logit(x + r * ld, n, row_argmax(x + r * ld, n), cap);
}

/* ---- one slot of a block draft ---------------------------------------------------------------
 * What the proposer does at draft slot k, for every request r of the block, in one call on the
 * calling thread (a slot's few PyTorch ops cost ~10 us each warm, but several times that right
 * after a target step has evicted the caches, which a draft always follows):
 *     x[r] += table[previous[r]]                 (the Markov head's bias row; table NULL: none)
 *     x[add_rows[i]][add_columns[i]] += add_weights[i], i = 0 .. num_adds-1, in order   (copy bias)
 *     out[r] = argmax x[r]                       (first maximum, NaN as the maximum: row_argmax)
 *     top_logit[r * top_stride] = logit of x[r]'s top probability, at most cap   (top_logit NULL: not read)
 * The same fp32 adds in the same order as PyTorch's add_ and index adds, so the same bits. */
void dspark_draft_slot(float *x, long rows, long n, long ld, const float *table, const long *previous,
                       const long *add_rows, const long *add_columns, const float *add_weights, long num_adds,
                       long *out, float *top_logit, long top_stride, float cap) {
    if (table)
        for (long r = 0; r < rows; r++) {
            float *row = x + r * ld;
            const float *bias = table + previous[r] * n;
            for (long i = 0; i < n; i++) row[i] += bias[i];
        }
    for (long i = 0; i < num_adds; i++) x[add_rows[i] * ld + add_columns[i]] += add_weights[i];
    for (long r = 0; r < rows; r++) {
        out[r] = row_argmax(x + r * ld, n);
        if (top_logit) top_logit[r * top_stride] = row_top_probability_logit(x + r * ld, n, out[r], cap);
    }
}

/* ---- seeded sampling: Gumbel-max over counter-based noise ------------------------------------
 * out[r] = argmax over i of (x[r][i] * scales[r] + g(keys[r], id_i)), id_i = ids[i] (i without
 * ids), in double (scales: 1 / temperature over raw logits, 1 over log-probabilities); a NaN
 * counts as the maximum and the first maximum wins ties (as torch.argmax).
 * The noise of token id under a key, defined here and by its reference `runtime/sampling.py:
 * gumbel_noise` (the same hash; its logs are PyTorch's, equal to these within an ulp or two):
 *     h1 = fmix32(id ^ key_lo), h2 = fmix32(h1 ^ key_hi), h3 = fmix32(h2 + 0x9E3779B9)
 *     u  = ((h2 << 20 | h3 >> 12) + 1/2) / 2^52         (52 random bits: u in [2^-53, 1 - 2^-53])
 *     g  = -log(-log(u))                                 (a Gumbel: reaches 36.7, so a token
 *                                                         e^-36 below the top one can still be drawn)
 * with fmix32 murmur3's finaliser. A counter-based hash, not a generator's stream: any token's
 * noise is computed on its own, so the drafter's restricted vocabulary reads the same noise as
 * the target's whole one. Why in C: PyTorch drew each position's noise from a freshly seeded
 * generator, ~1 ms a row (a float64 rand, two logs, negations and an argmax over 49k values),
 * a third of a T=1 serving step at 16 requests (measured); this is one pass.
 * Written over GCC's generic vectors (8 doubles), not the vf layer: the same source compiles to
 * AVX-512, AVX2 or NEON. The x86 builds all have FMA, and GCC fuses the same multiply-adds in
 * each, so they do the same IEEE operations in the same order and agree bit for bit (the ISA
 * workload of tests/test_bf16.py checks it). */
#pragma GCC diagnostic ignored "-Wpsabi"  /* 64-byte vectors stay inside this file, inlined */

typedef double vd __attribute__((vector_size(64)));
typedef uint64_t vq __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(32)));
typedef float v8f __attribute__((vector_size(32)));

static inline vu fmix32(vu h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

/* log(x) for 8 positive normal doubles: x = m 2^e with m in [sqrt(1/2), sqrt(2)), and
 * log(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.172, as its series to s^19 (the next term
 * is below 1e-16 of the sum). */
static inline vd vd_log(vd x) {
    const vd ones = {1, 1, 1, 1, 1, 1, 1, 1};
    vq bits = (vq)x;  /* unsigned shifts only: AVX2 has no 64-bit arithmetic shift */
    vd e = (vd)((bits >> 52) | 0x4330000000000000UL) - 4503599627371519.0;  /* exact: minus 2^52 + 1023 */
    vd m = (vd)((bits & 0x000FFFFFFFFFFFFFUL) | 0x3FF0000000000000UL);     /* [1, 2) */
    vq high = (vq)(m > 1.4142135623730951);                                  /* all ones where true */
    m = (vd)(((vq)(m * 0.5) & high) | ((vq)m & ~high));
    e += (vd)((vq)ones & high);                                              /* + 1 where halved */
    vd f = m - 1.0;
    vd s = f / (f + 2.0);
    vd z = s * s;
    vd series = z * (1.0 / 19) + 1.0 / 17;
    series = series * z + 1.0 / 15;
    series = series * z + 1.0 / 13;
    series = series * z + 1.0 / 11;
    series = series * z + 1.0 / 9;
    series = series * z + 1.0 / 7;
    series = series * z + 1.0 / 5;
    series = series * z + 1.0 / 3;
    series = series * z + 1.0;
    return e * 0.6931471805599453 + (s + s) * series;
}

/* The noise of 8 token ids under one key (see above). */
static inline vd gumbel8(vu ids, uint32_t key_lo, uint32_t key_hi) {
    vu h2 = fmix32(fmix32(ids ^ key_lo) ^ key_hi);
    vu h3 = fmix32(h2 + 0x9E3779B9u);
    vq bits52 = (__builtin_convertvector(h2, vq) << 20) | (__builtin_convertvector(h3, vq) >> 12);
    vd count = (vd)(bits52 | 0x4330000000000000UL) - 4503599627370496.0;  /* exact: the 52-bit integer */
    vd u = (count + 0.5) * 0x1p-52;
    return -vd_log(-vd_log(u));
}

void dspark_gumbel_noise(uint64_t key, const int64_t *ids, long n, double *out) {
    for (long i = 0; i < n; i += 8) {
        vu lane_ids;
        for (int lane = 0; lane < 8; lane++)
            lane_ids[lane] = (uint32_t)(i + lane < n ? (ids ? ids[i + lane] : i + lane) : 0);
        vd g = gumbel8(lane_ids, (uint32_t)key, (uint32_t)(key >> 32));
        for (int lane = 0; lane < 8 && i + lane < n; lane++) out[i + lane] = g[lane];
    }
}

/* The best (score, index) of x[first, last) under a key: the first maximum, or the first NaN
 * (score NaN). Chunks of a row are searched apart (in parallel) and combined in order. */
typedef struct { double score; long index; } gumbel_best;

static gumbel_best chunk_gumbel_argmax(const float *x, long first, long last, uint64_t key, double scale,
                                       const int64_t *ids) {
    const uint32_t key_lo = (uint32_t)key, key_hi = (uint32_t)(key >> 32);
    vd best = (vd){0} - INFINITY, best_index = (vd){0} + (double)first;
    vd index = (vd){0, 1, 2, 3, 4, 5, 6, 7} + (double)first;
    vq nan = {0};
    vu lane_ids = (vu){0, 1, 2, 3, 4, 5, 6, 7} + (uint32_t)first;
    for (long i = first; i < last; i += 8, index += 8.0, lane_ids += 8) {
        long count = last - i < 8 ? last - i : 8;
        v8f logits = (v8f){0} - INFINITY;  /* lanes past the chunk: -inf, never the maximum */
        vu noise_ids = lane_ids;
        if (count == 8)
            memcpy(&logits, x + i, sizeof logits);
        else
            for (long lane = 0; lane < count; lane++) logits[lane] = x[i + lane];
        if (ids)
            for (long lane = 0; lane < count; lane++) noise_ids[lane] = (uint32_t)ids[i + lane];
        vd score = __builtin_convertvector(logits, vd) * scale + gumbel8(noise_ids, key_lo, key_hi);
        nan |= (vq)(score != score);
        vq greater = (vq)(score > best);  /* strict: a lane keeps its first */
        best = (vd)(((vq)score & greater) | ((vq)best & ~greater));
        best_index = (vd)(((vq)index & greater) | ((vq)best_index & ~greater));
    }
    gumbel_best found = {-INFINITY, first};
    for (int lane = 0; lane < 8; lane++)
        if (nan[lane]) {
            found.index = first;
            while (x[found.index] == x[found.index]) found.index++;  /* only a NaN logit makes a NaN score */
            found.score = NAN;
            return found;
        }
    for (int lane = 0; lane < 8; lane++) found.score = best[lane] > found.score ? best[lane] : found.score;
    found.index = last;
    for (int lane = 0; lane < 8; lane++)  /* the smallest index among the lanes holding the max */
        if (best[lane] == found.score && (long)best_index[lane] < found.index) found.index = (long)best_index[lane];
    return found;
}

#define GUMBEL_CHUNK 4096  /* tokens per work item: a 49k-vocabulary row is 12, a drafter's 8k row 2 */
typedef struct {
    const float *x; long n, ld, chunks; const uint64_t *keys; const double *scales; const int64_t *ids;
    gumbel_best *found;
} gumbel_args;

static void gumbel_range(const void *ctx, long first, long last) {
    const gumbel_args *a = (const gumbel_args *)ctx;
    for (long item = first; item < last; item++) {
        long r = item / a->chunks, start = item % a->chunks * GUMBEL_CHUNK;
        long end = start + GUMBEL_CHUNK < a->n ? start + GUMBEL_CHUNK : a->n;
        a->found[item] = chunk_gumbel_argmax(a->x + r * a->ld, start, end, a->keys[r], a->scales[r], a->ids);
    }
}

/* Returns 0, or -1 when it could not allocate its scratch. */
int dspark_gumbel_argmax(const float *x, long rows, long n, long ld, const uint64_t *keys, const double *scales,
                         const int64_t *ids, long *out) {
    long chunks = (n + GUMBEL_CHUNK - 1) / GUMBEL_CHUNK;
    gumbel_best *found = malloc(sizeof(gumbel_best) * (size_t)(rows * chunks));
    if (!found) return -1;
    gumbel_args args = {x, n, ld, chunks, keys, scales, ids, found};
    parallel_for(gumbel_range, &args, rows * chunks, 1);
    for (long r = 0; r < rows; r++) {  /* in order: a NaN first, else the greater score, the earlier chunk on ties */
        gumbel_best best = found[r * chunks];
        for (long k = 1; k < chunks && best.score == best.score; k++) {
            gumbel_best other = found[r * chunks + k];
            if (other.score != other.score || other.score > best.score) best = other;
        }
        out[r] = best.index;
    }
    free(found);
    return 0;
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
