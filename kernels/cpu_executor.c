/* FreeToken's CPU expert executor (see cpu_executor.h for the contract).
 *
 * Layout of the work of one call:
 *   caller:  validate items, group them by expert (sorted by flat id), convert the rows of x
 *            they use into the kernel's activation format when x is not already in it;
 *   phase 1: the compute threads take chunks of all (expert, j) gate/up row pairs and
 *            write act(gate_j · x + bg) * (up_j · x + bu) for each token of that expert
 *            into the intermediate buffer;
 *   phase 2: once every phase-1 chunk is done, the compute threads take chunks of the H
 *            output rows and, for every expert, add weight * (w2[h] · inter + b2[h]) into
 *            out[row, h]. An output row belongs to one chunk, so nothing is written twice.
 *   The caller returns once every phase-2 chunk is done.
 * Chunks are handed out from counters tagged with the call's number (about four chunks per
 * thread), and completion is counted in chunks, not in threads: a thread that shares its
 * core with another busy thread (in a server: the scheduler's thread waiting on the GPU,
 * the CUDA callback thread), or that is still asleep, does less of the work or none of it,
 * instead of holding up the call at a barrier (the call still waits for chunks a slowed
 * thread has already taken). A thread that wakes after the call is over finds its counters
 * used up, or joins the next dynamic call, whose tag it then claims against; the job it runs
 * is the one carried by the dispatch word it woke on. ft_executor_set_schedule(ex, 0) gives
 * each thread one fixed contiguous share, with barriers, instead (for comparison).
 * Each weight byte is read once per call. The intermediate buffer [items, I] is shared: in
 * phase 1 each thread writes its own slice, in phase 2 every thread reads all of it. The
 * dot-product micro-kernels take 4 weight rows and up to FT_TMAX token vectors at a time,
 * with one kernel per (path, weight dtype), and prefetch the rows of their next call into
 * L2 while they run. Every SIMD path is compiled with a target attribute and chosen at run
 * time, so one binary runs on any x86-64 CPU. On the AMX paths, an expert with at least
 * tile_min tokens in the call runs on tiles instead: its phase-1 units and its share of each
 * phase-2 block are 16 x 16 tile products over the weights in place and the expert's tokens,
 * which the first thread to reach the expert packs once into the tiles' layout (xt); phase 1
 * writes its intermediate in that layout too (it). */
#define _GNU_SOURCE
#include "cpu_executor.h"

#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define FT_X86 1
#else
#define FT_X86 0
#endif
/* AMX tile intrinsics: GCC 11+ or clang 12+ (older compilers build without the AMX path). */
#if FT_X86 && ((defined(__clang__) && __clang_major__ >= 12) || \
               (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define FT_HAVE_AMX 1
#else
#define FT_HAVE_AMX 0
#endif

#define FT_TMAX 4          /* most token vectors one micro-kernel call takes */
#define FT_ROWS 4          /* weight rows one micro-kernel call takes */
#define FT_ALIGN 64        /* cache line */
#define FT_OUT_BLOCK 16    /* phase-2 output rows are split in blocks of one fp32 line */
#define FT_INTER_BLOCK 16  /* phase-1 units: 16 gate/up row pairs */
#define FT_TILE 16         /* tiled path: 16 weight rows x 16 tokens per tile product */
#define FT_KCHUNK 32       /* tiled path: bf16 elements of K per tile (64 bytes) */
/* AMX tiles from 8 tokens per expert: on the Xeon of the H100 device machine (16 threads,
 * 2048 x 768 experts, one run) they ran 0.76-0.79x of the AVX512-BF16 path at 1-4 tokens,
 * 1.05x at 8, 2.11x at 16 and up to 3.64x at 256; 5-7 not measured (bench_cpu_tiles.py;
 * RESULTS.md, Session 24). */
#define FT_DEFAULT_TILE_MIN 8
#define FT_DEFAULT_SPIN_US 200

/* ------------------------------------------------------------------------------------ */
/* Scalar conversions                                                                   */
/* ------------------------------------------------------------------------------------ */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                            /* RNE */
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        float f = (float)mant * 0x1p-24f; /* zero or subnormal */
        memcpy(&u, &f, sizeof u);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (mant << 13);
    } else {
        u = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float load_elem(const void *p, int64_t i, int dtype) {
    switch (dtype) {
    case FT_DTYPE_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    case FT_DTYPE_F16: return f16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

static inline float ld_f32(const void *p, int i) { return ((const float *)p)[i]; }
static inline float ld_bf16(const void *p, int i) { return bf16_to_f32(((const uint16_t *)p)[i]); }
static inline float ld_f16(const void *p, int i) { return f16_to_f32(((const uint16_t *)p)[i]); }

static inline size_t dtype_size(int dtype) { return dtype == FT_DTYPE_F32 ? 4 : 2; }

static inline float activate(float g, int act) {
    if (act == FT_ACT_GELU_TANH)
        return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    return g / (1.0f + expf(-g));
}

/* ---- Quantized formats: scalar definitions (the portable path and the scale loads). -- */

/* float8_e4m3fn: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits, subnormals at exponent
 * 0, no infinities, 0x7f / 0xff NaN. Filled once by init_luts. */
static float ft_e4m3_lut[256];
/* e8m0: 2^(s - 127), 0xff NaN. Filled once by init_luts. */
static float ft_e8m0_lut[256];
/* e2m1 (fp4): bit 3 sign, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. */
static const float ft_e2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
static pthread_once_t ft_lut_once = PTHREAD_ONCE_INIT;

static void init_luts(void) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10);
        if ((b & 0x7f) == 0x7f) v = NAN;
        ft_e4m3_lut[b] = (b & 0x80) ? -v : v;
        ft_e8m0_lut[b] = b == 255 ? NAN : ldexpf(1.0f, b - 127);
    }
}

static inline float e8m0_to_f32(uint8_t s) { return ft_e8m0_lut[s]; }

static inline float gated_act(const ft_pool_desc *p, float a, float u) {
    if (p->activation == FT_ACT_SWIGLU_OAI) {
        const float lim = p->limit;
        float g = a > lim ? lim : a;
        float v = u > lim ? lim : (u < -lim ? -lim : u);
        return g / (1.0f + expf(-p->alpha * g)) * (v + 1.0f);
    }
    return activate(a, p->activation) * u;
}

/* ------------------------------------------------------------------------------------ */
/* Micro-kernels: res[r * FT_TMAX + t] = dot(w[r][0:n], x[t][0:n]) for r < 4, t < nt.    */
/* x is fp32, except for the AVX512-BF16 kernel where it is bf16. The SIMD kernels also  */
/* prefetch pf[r][0:n] (the rows of the caller's next call) into L2 as they go, so that   */
/* each new row does not start cold at a page boundary where the hardware prefetcher    */
/* stops; pass w again when there is no next call.                                       */
/* ------------------------------------------------------------------------------------ */

typedef void (*ft_dot_fn)(const void *const *w, const void *const *pf, const void *const *x,
                          int nt, int n, float *res);

typedef void (*ft_qdot_fn)(const void *const *w, const void *const *s, const void *const *pf,
                           const void *const *x, int nt, int n, int bk, float *res);

typedef struct {
    ft_dot_fn dot;   /* dense formats */
    ft_qdot_fn qdot; /* quantized formats (then dot is NULL) */
    int tmax;     /* largest nt the kernel takes */
    int x_bf16;   /* activations (x and the intermediate) are bf16, else fp32 */
} ft_kernel;

/* Portable C: 8 independent lanes per row so that compilers can vectorize the loop. */
#define FT_DEFINE_PORTABLE_DOT(NAME, WT, CVT)                                                \
    static void NAME(const void *const *w, const void *const *pf, const void *const *x, int nt, \
                     int n, float *res) {                                                    \
        (void)pf;                                                                            \
        const WT *w0 = (const WT *)w[0], *w1 = (const WT *)w[1];                             \
        const WT *w2 = (const WT *)w[2], *w3 = (const WT *)w[3];                             \
        for (int t = 0; t < nt; t++) {                                                       \
            const float *xv = (const float *)x[t];                                           \
            float a0[8] = {0}, a1[8] = {0}, a2[8] = {0}, a3[8] = {0};                        \
            int i = 0;                                                                       \
            for (; i + 8 <= n; i += 8) {                                                     \
                for (int k = 0; k < 8; k++) {                                                \
                    float xk = xv[i + k];                                                    \
                    a0[k] += CVT(w0[i + k]) * xk;                                            \
                    a1[k] += CVT(w1[i + k]) * xk;                                            \
                    a2[k] += CVT(w2[i + k]) * xk;                                            \
                    a3[k] += CVT(w3[i + k]) * xk;                                            \
                }                                                                            \
            }                                                                                \
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0;                                            \
            for (int k = 0; k < 8; k++) {                                                    \
                s0 += a0[k];                                                                 \
                s1 += a1[k];                                                                 \
                s2 += a2[k];                                                                 \
                s3 += a3[k];                                                                 \
            }                                                                                \
            for (; i < n; i++) {                                                             \
                float xk = xv[i];                                                            \
                s0 += CVT(w0[i]) * xk;                                                       \
                s1 += CVT(w1[i]) * xk;                                                       \
                s2 += CVT(w2[i]) * xk;                                                       \
                s3 += CVT(w3[i]) * xk;                                                       \
            }                                                                                \
            res[0 * FT_TMAX + t] = s0;                                                       \
            res[1 * FT_TMAX + t] = s1;                                                       \
            res[2 * FT_TMAX + t] = s2;                                                       \
            res[3 * FT_TMAX + t] = s3;                                                       \
        }                                                                                    \
    }

static inline float cvt_f32(float v) { return v; }
FT_DEFINE_PORTABLE_DOT(portable_dot_f32, float, cvt_f32)
FT_DEFINE_PORTABLE_DOT(portable_dot_bf16, uint16_t, bf16_to_f32)
FT_DEFINE_PORTABLE_DOT(portable_dot_f16, uint16_t, f16_to_f32)

/* Quantized micro-kernels: as ft_dot_fn, with s[r] the scale row of weight row r (FP8:
 * fp32 column-block scales, one per bk columns; MXFP4: e8m0 bytes, one per 32 columns;
 * NVFP4: e4m3 bytes, one per 16 columns). w[r] holds the row's codes (FP8: n bytes; FP4:
 * n/2 bytes, low nibble first). The result is the dot product with the dequantized row
 * (NVFP4's per-tensor scale_2 is applied by the caller). */
/* Portable C: dequantize up to 64 columns of the 4 rows into a buffer, then dot it with
 * every token (each weight byte is read once). */
#define FT_PCHUNK 64

static inline __attribute__((always_inline)) void portable_dequant(int fmt, const void *w,
                                                                   const void *s, int c0,
                                                                   int len, int bk,
                                                                   float *buf) {
    const uint8_t *p = (const uint8_t *)w;
    if (fmt == FT_FMT_FP8_BLOCK) {
        const float sc = ((const float *)s)[c0 / bk];
        for (int k = 0; k < len; k++) buf[k] = ft_e4m3_lut[p[c0 + k]] * sc;
        return;
    }
    const int gs = fmt == FT_FMT_MXFP4 ? 32 : 16; /* c0 and len are multiples of gs */
    const uint8_t *q = (const uint8_t *)s;
    for (int g = 0; g < len; g += gs) {
        const int c = c0 + g;
        const float sc = fmt == FT_FMT_MXFP4 ? e8m0_to_f32(q[c / 32]) : ft_e4m3_lut[q[c / 16]];
        for (int k = 0; k < gs; k += 2) {
            const uint8_t b = p[(c + k) >> 1];
            buf[g + k] = ft_e2m1[b & 15] * sc;
            buf[g + k + 1] = ft_e2m1[b >> 4] * sc;
        }
    }
}

static inline __attribute__((always_inline)) void portable_qdot_body(
    int fmt, const void *const *w, const void *const *s, const void *const *x, int nt, int n,
    int bk, float *res) {
    float acc[FT_ROWS][FT_TMAX];
    float buf[FT_ROWS][FT_PCHUNK];
    for (int r = 0; r < FT_ROWS; r++)
        for (int t = 0; t < FT_TMAX; t++) acc[r][t] = 0.0f;
    for (int c0 = 0; c0 < n;) {
        int c1 = c0 + FT_PCHUNK < n ? c0 + FT_PCHUNK : n;
        if (fmt == FT_FMT_FP8_BLOCK) { /* one scale per chunk: stop at the block's end */
            int be = (c0 / bk + 1) * bk;
            if (c1 > be) c1 = be;
        }
        const int len = c1 - c0;
        for (int r = 0; r < FT_ROWS; r++) portable_dequant(fmt, w[r], s[r], c0, len, bk, buf[r]);
        for (int t = 0; t < nt; t++) {
            const float *xv = (const float *)x[t] + c0;
            for (int r = 0; r < FT_ROWS; r++) {
                float a[8] = {0};
                int k = 0;
                for (; k + 8 <= len; k += 8)
                    for (int l = 0; l < 8; l++) a[l] += buf[r][k + l] * xv[k + l];
                float sum = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
                for (; k < len; k++) sum += buf[r][k] * xv[k];
                acc[r][t] += sum;
            }
        }
        c0 = c1;
    }
    for (int r = 0; r < FT_ROWS; r++)
        for (int t = 0; t < nt; t++) res[r * FT_TMAX + t] = acc[r][t];
}

#define FT_DEFINE_PORTABLE_QDOT(NAME, FMT)                                                   \
    static void NAME(const void *const *w, const void *const *s, const void *const *pf,      \
                     const void *const *x, int nt, int n, int bk, float *res) {              \
        (void)pf;                                                                            \
        portable_qdot_body(FMT, w, s, x, nt, n, bk, res);                                    \
    }
FT_DEFINE_PORTABLE_QDOT(portable_qdot_fp8, FT_FMT_FP8_BLOCK)
FT_DEFINE_PORTABLE_QDOT(portable_qdot_mxfp4, FT_FMT_MXFP4)
FT_DEFINE_PORTABLE_QDOT(portable_qdot_nvfp4, FT_FMT_NVFP4)

/* STREAM-like reads reduce a buffer to the sum of its 64-bit little-endian words (mod 2^64),
 * plus each byte of a final partial word, whatever the path and the split across threads
 * (threads get multiples of 256 bytes). This is the part after the SIMD blocks. */
static uint64_t read_tail(const uint8_t *p, size_t n) {
    uint64_t s = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, sizeof v);
        s += v;
    }
    for (; i < n; i++) s += p[i];
    return s;
}

#if FT_X86
/* ---- AVX2 + FMA + F16C: 8 fp32 lanes, up to 2 tokens (4x2 accumulators + 4 weights). -- */
#define FT_AVX2 __attribute__((target("avx2,fma,f16c")))

static inline FT_AVX2 __m256 avx2_w_f32(const void *p, int i) {
    return _mm256_loadu_ps((const float *)p + i);
}
static inline FT_AVX2 __m256 avx2_w_bf16(const void *p, int i) {
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline FT_AVX2 __m256 avx2_w_f16(const void *p, int i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
}
static inline FT_AVX2 float avx2_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Prefetch line OFF (bytes) of the 4 next rows into L2. */
#define FT_PREFETCH4(OFF)                                                                    \
    do {                                                                                     \
        _mm_prefetch((const char *)pf[0] + (OFF), _MM_HINT_T1);                              \
        _mm_prefetch((const char *)pf[1] + (OFF), _MM_HINT_T1);                              \
        _mm_prefetch((const char *)pf[2] + (OFF), _MM_HINT_T1);                              \
        _mm_prefetch((const char *)pf[3] + (OFF), _MM_HINT_T1);                              \
    } while (0)
/* Once per cache line of weights: at element I of elements of ESZ bytes. */
#define FT_PREFETCH_AT(I, ESZ)                                                               \
    do {                                                                                     \
        if ((((size_t)(I) * (ESZ)) & (FT_ALIGN - 1)) == 0) FT_PREFETCH4((size_t)(I) * (ESZ)); \
    } while (0)

#define FT_DEFINE_AVX2_DOT(NAME, LOADW, SCALARW, ESZ)                                        \
    static inline __attribute__((always_inline)) FT_AVX2 void NAME##_body(                   \
        const void *const *w, const void *const *pf, const void *const *x, const int nt,     \
        int n, float *res) {                                                                 \
        __m256 acc[FT_ROWS][2];                                                              \
        for (int t = 0; t < nt; t++)                                                         \
            for (int r = 0; r < FT_ROWS; r++) acc[r][t] = _mm256_setzero_ps();               \
        int i = 0;                                                                           \
        for (; i + 8 <= n; i += 8) {                                                         \
            FT_PREFETCH_AT(i, ESZ);                                                          \
            __m256 w0 = LOADW(w[0], i), w1 = LOADW(w[1], i);                                 \
            __m256 w2 = LOADW(w[2], i), w3 = LOADW(w[3], i);                                 \
            for (int t = 0; t < nt; t++) {                                                   \
                __m256 xv = _mm256_loadu_ps((const float *)x[t] + i);                        \
                acc[0][t] = _mm256_fmadd_ps(w0, xv, acc[0][t]);                              \
                acc[1][t] = _mm256_fmadd_ps(w1, xv, acc[1][t]);                              \
                acc[2][t] = _mm256_fmadd_ps(w2, xv, acc[2][t]);                              \
                acc[3][t] = _mm256_fmadd_ps(w3, xv, acc[3][t]);                              \
            }                                                                                \
        }                                                                                    \
        for (int t = 0; t < nt; t++) {                                                       \
            const float *xt = (const float *)x[t];                                           \
            for (int r = 0; r < FT_ROWS; r++) {                                              \
                float s = avx2_hsum(acc[r][t]);                                              \
                for (int k = i; k < n; k++) s += SCALARW(w[r], k) * xt[k];                   \
                res[r * FT_TMAX + t] = s;                                                    \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    static FT_AVX2 void NAME(const void *const *w, const void *const *pf,                   \
                             const void *const *x, int nt, int n, float *res) {              \
        if (nt == 1)                                                                         \
            NAME##_body(w, pf, x, 1, n, res);                                                \
        else                                                                                 \
            NAME##_body(w, pf, x, 2, n, res);                                                \
    }

FT_DEFINE_AVX2_DOT(avx2_dot_f32, avx2_w_f32, ld_f32, 4)
FT_DEFINE_AVX2_DOT(avx2_dot_bf16, avx2_w_bf16, ld_bf16, 2)
FT_DEFINE_AVX2_DOT(avx2_dot_f16, avx2_w_f16, ld_f16, 2)

/* ---- AVX2 quantized kernels: 8 fp32 lanes, up to 2 tokens. -------------------------- */
/* 8 e4m3 bytes -> 8 floats / 256: the bits ((b & 0x80) << 8) | ((b & 0x7f) << 7) read as
 * fp16 are e4m3(b) / 256 exactly, subnormals included (the 256 goes into the scale). */
static inline FT_AVX2 __m256 avx2_fp8x8(const uint8_t *p) {
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7),
                              _mm_set1_epi16((short)0xbf80));
    return _mm256_cvtph_ps(h);
}
#define FT_AVX2_QFMA(I)                                                                      \
    do {                                                                                     \
        for (int t = 0; t < nt; t++) {                                                       \
            __m256 xv = _mm256_loadu_ps((const float *)x[t] + (I));                          \
            for (int r = 0; r < FT_ROWS; r++) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]); \
        }                                                                                    \
    } while (0)

static inline __attribute__((always_inline)) FT_AVX2 void avx2_qfp8_body(
    const void *const *w, const void *const *s, const void *const *pf, const void *const *x,
    const int nt, int n, int bk, float *res) {
    __m256 acc[FT_ROWS][2];
    float tail[FT_ROWS][2];
    for (int r = 0; r < FT_ROWS; r++)
        for (int t = 0; t < 2; t++) {
            acc[r][t] = _mm256_setzero_ps();
            tail[r][t] = 0.0f;
        }
    int64_t pfo = 0;
    for (int64_t c0 = 0, kb = 0; c0 < n; c0 += bk, kb++) {
        const int c1 = (int)(c0 + bk < n ? c0 + bk : n);
        float sc[FT_ROWS];
        __m256 scv[FT_ROWS];
        for (int r = 0; r < FT_ROWS; r++) {
            sc[r] = ((const float *)s[r])[kb];
            scv[r] = _mm256_set1_ps(sc[r] * 256.0f);
        }
        int i = (int)c0;
        for (; i + 8 <= c1; i += 8) {
            if (i >= pfo) {
                FT_PREFETCH4((size_t)pfo);
                pfo += FT_ALIGN;
            }
            __m256 wv[FT_ROWS];
            for (int r = 0; r < FT_ROWS; r++)
                wv[r] = _mm256_mul_ps(avx2_fp8x8((const uint8_t *)w[r] + i), scv[r]);
            FT_AVX2_QFMA(i);
        }
        for (; i < c1; i++)
            for (int r = 0; r < FT_ROWS; r++) {
                float wq = ft_e4m3_lut[((const uint8_t *)w[r])[i]] * sc[r];
                for (int t = 0; t < nt; t++) tail[r][t] += wq * ((const float *)x[t])[i];
            }
    }
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < FT_ROWS; r++) res[r * FT_TMAX + t] = avx2_hsum(acc[r][t]) + tail[r][t];
}

/* 2 * e2m1 as int8, by code (bit 3: sign): exact integers, converted to floats without a
 * table of floats; the scales take the factor 1/2. */
#define FT_E2M1_X2_I8 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12
/* n is a multiple of 16 (NVFP4) or 32 (MXFP4). The codes go through one byte shuffle to
 * 2 * e2m1 as int8, then to floats; ``(2 e2m1) * (scale / 2)`` is ``e2m1 * scale`` exactly, and
 * the FMAs run per 8 lanes in column order: the same arithmetic as the scalar definition's
 * dequantized weights (and as a dense kernel over them). */
static inline __attribute__((always_inline)) FT_AVX2 void avx2_qfp4_body(
    int fmt, const void *const *w, const void *const *s, const void *const *pf,
    const void *const *x, const int nt, int n, float *res) {
    __m256 acc[FT_ROWS][2];
    for (int r = 0; r < FT_ROWS; r++)
        for (int t = 0; t < 2; t++) acc[r][t] = _mm256_setzero_ps();
    const __m128i lut = _mm_setr_epi8(FT_E2M1_X2_I8);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    int i = 0;
    /* 32 weights (16 bytes) of one row at a time: one MXFP4 scale, or two NVFP4 ones. */
    for (; i + 32 <= n; i += 32) {
        if (((i >> 1) & (FT_ALIGN - 1)) == 0) FT_PREFETCH4((size_t)(i >> 1));
        for (int r = 0; r < FT_ROWS; r++) {
            const uint8_t *q = (const uint8_t *)s[r];
            const float f0 = fmt == FT_FMT_MXFP4 ? e8m0_to_f32(q[i >> 5]) : ft_e4m3_lut[q[i >> 4]];
            const float f1 = fmt == FT_FMT_MXFP4 ? f0 : ft_e4m3_lut[q[(i >> 4) + 1]];
            const __m256 s0 = _mm256_set1_ps(0.5f * f0), s1 = _mm256_set1_ps(0.5f * f1);
            const __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)w[r] + (i >> 1)));
            const __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
            const __m128i v0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
            const __m128i v1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));
            const __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0)), s0);
            const __m256 w1 = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8))), s0);
            const __m256 w2 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1)), s1);
            const __m256 w3 = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8))), s1);
            for (int t = 0; t < nt; t++) {
                const float *xt = (const float *)x[t] + i;
                acc[r][t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt), acc[r][t]);
                acc[r][t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt + 8), acc[r][t]);
                acc[r][t] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xt + 16), acc[r][t]);
                acc[r][t] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xt + 24), acc[r][t]);
            }
        }
    }
    for (; i < n; i += 16) { /* NVFP4's last 16 */
        for (int r = 0; r < FT_ROWS; r++) {
            const uint8_t *q = (const uint8_t *)s[r];
            const float f = fmt == FT_FMT_MXFP4 ? e8m0_to_f32(q[i >> 5]) : ft_e4m3_lut[q[i >> 4]];
            const __m256 sc = _mm256_set1_ps(0.5f * f);
            const __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)w[r] + (i >> 1)));
            const __m128i v = _mm_shuffle_epi8(
                lut, _mm_unpacklo_epi8(_mm_and_si128(b, m4), _mm_and_si128(_mm_srli_epi16(b, 4), m4)));
            const __m256 wl = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), sc);
            const __m256 wh = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), sc);
            for (int t = 0; t < nt; t++) {
                const float *xt = (const float *)x[t] + i;
                acc[r][t] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xt), acc[r][t]);
                acc[r][t] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xt + 8), acc[r][t]);
            }
        }
    }
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < FT_ROWS; r++) res[r * FT_TMAX + t] = avx2_hsum(acc[r][t]);
}

static FT_AVX2 void avx2_qdot_fp8(const void *const *w, const void *const *s,
                                  const void *const *pf, const void *const *x, int nt, int n,
                                  int bk, float *res) {
    if (nt == 1)
        avx2_qfp8_body(w, s, pf, x, 1, n, bk, res);
    else
        avx2_qfp8_body(w, s, pf, x, 2, n, bk, res);
}
#define FT_DEFINE_AVX2_QDOT_FP4(NAME, FMT)                                                   \
    static FT_AVX2 void NAME(const void *const *w, const void *const *s,                    \
                             const void *const *pf, const void *const *x, int nt, int n,     \
                             int bk, float *res) {                                           \
        (void)bk;                                                                            \
        if (nt == 1)                                                                         \
            avx2_qfp4_body(FMT, w, s, pf, x, 1, n, res);                                     \
        else                                                                                 \
            avx2_qfp4_body(FMT, w, s, pf, x, 2, n, res);                                     \
    }
FT_DEFINE_AVX2_QDOT_FP4(avx2_qdot_mxfp4, FT_FMT_MXFP4)
FT_DEFINE_AVX2_QDOT_FP4(avx2_qdot_nvfp4, FT_FMT_NVFP4)

/* ---- AVX-512: 16 fp32 lanes, masked tails, up to 4 tokens (16 accumulators). -------- */
#define FT_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"
#define FT_AVX512 __attribute__((target(FT_AVX512_TARGET)))
#define FT_AVX512BF16 __attribute__((target(FT_AVX512_TARGET ",avx512bf16")))

static inline FT_AVX512 __m512 avx512_w_f32(const void *p, int i, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}
static inline FT_AVX512 __m512 avx512_w_bf16(const void *p, int i, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline FT_AVX512 __m512 avx512_w_f16(const void *p, int i, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i));
}

/* Accumulators are named variables (a<row><token>), not an array, so that they stay in
 * registers; with nt a constant after inlining, the unused ones vanish. */
#define FT_ACC_DECL                                                                          \
    __m512 a00 = _mm512_setzero_ps(), a10 = a00, a20 = a00, a30 = a00;                       \
    __m512 a01 = a00, a11 = a00, a21 = a00, a31 = a00;                                       \
    __m512 a02 = a00, a12 = a00, a22 = a00, a32 = a00;                                       \
    __m512 a03 = a00, a13 = a00, a23 = a00, a33 = a00
#define FT_ACC_STORE(T)                                                                      \
    do {                                                                                     \
        res[0 * FT_TMAX + T] = _mm512_reduce_add_ps(a0##T);                                  \
        res[1 * FT_TMAX + T] = _mm512_reduce_add_ps(a1##T);                                  \
        res[2 * FT_TMAX + T] = _mm512_reduce_add_ps(a2##T);                                  \
        res[3 * FT_TMAX + T] = _mm512_reduce_add_ps(a3##T);                                  \
    } while (0)
#define FT_ACC_STORE_ALL                                                                     \
    do {                                                                                     \
        FT_ACC_STORE(0);                                                                     \
        if (nt > 1) FT_ACC_STORE(1);                                                         \
        if (nt > 2) FT_ACC_STORE(2);                                                         \
        if (nt > 3) FT_ACC_STORE(3);                                                         \
    } while (0)

/* fp32 FMA of 4 weight vectors with token T's activations. */
#define FT_FMA_TOKEN(T, I, M)                                                                \
    do {                                                                                     \
        __m512 xv = _mm512_maskz_loadu_ps(M, (const float *)x[T] + (I));                     \
        a0##T = _mm512_fmadd_ps(w0, xv, a0##T);                                              \
        a1##T = _mm512_fmadd_ps(w1, xv, a1##T);                                              \
        a2##T = _mm512_fmadd_ps(w2, xv, a2##T);                                              \
        a3##T = _mm512_fmadd_ps(w3, xv, a3##T);                                              \
    } while (0)
#define FT_AVX512_STEP(LOADW, I, M)                                                          \
    do {                                                                                     \
        __m512 w0 = LOADW(w[0], I, M), w1 = LOADW(w[1], I, M);                               \
        __m512 w2 = LOADW(w[2], I, M), w3 = LOADW(w[3], I, M);                               \
        FT_FMA_TOKEN(0, I, M);                                                               \
        if (nt > 1) FT_FMA_TOKEN(1, I, M);                                                   \
        if (nt > 2) FT_FMA_TOKEN(2, I, M);                                                   \
        if (nt > 3) FT_FMA_TOKEN(3, I, M);                                                   \
    } while (0)

#define FT_DEFINE_AVX512_DOT(NAME, LOADW, ESZ)                                               \
    static inline __attribute__((always_inline)) FT_AVX512 void NAME##_body(                 \
        const void *const *w, const void *const *pf, const void *const *x, const int nt,     \
        int n, float *res) {                                                                 \
        FT_ACC_DECL;                                                                         \
        int i = 0;                                                                           \
        for (; i + 16 <= n; i += 16) {                                                       \
            FT_PREFETCH_AT(i, ESZ);                                                          \
            FT_AVX512_STEP(LOADW, i, (__mmask16)0xffff);                                     \
        }                                                                                    \
        if (i < n) FT_AVX512_STEP(LOADW, i, (__mmask16)((1u << (n - i)) - 1));               \
        FT_ACC_STORE_ALL;                                                                    \
    }                                                                                        \
    static FT_AVX512 void NAME(const void *const *w, const void *const *pf,                 \
                               const void *const *x, int nt, int n, float *res) {            \
        switch (nt) {                                                                        \
        case 1: NAME##_body(w, pf, x, 1, n, res); break;                                     \
        case 2: NAME##_body(w, pf, x, 2, n, res); break;                                     \
        case 3: NAME##_body(w, pf, x, 3, n, res); break;                                     \
        default: NAME##_body(w, pf, x, 4, n, res); break;                                    \
        }                                                                                    \
    }

FT_DEFINE_AVX512_DOT(avx512_dot_f32, avx512_w_f32, 4)
FT_DEFINE_AVX512_DOT(avx512_dot_bf16, avx512_w_bf16, 2)
FT_DEFINE_AVX512_DOT(avx512_dot_f16, avx512_w_f16, 2)

/* ---- AVX-512 quantized kernels: 16 fp32 lanes, up to 4 tokens, fp32 FMA. ------------ */
/* 16 e4m3 bytes (masked) -> 16 floats / 256 (see avx2_fp8x8). */
static inline FT_AVX512 __m512 avx512_fp8x16(const uint8_t *p, __mmask16 m) {
    __m128i b = _mm_maskz_loadu_epi8(m, p);
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                 _mm256_set1_epi16((short)0xbf80));
    return _mm512_cvtph_ps(h);
}
/* 8 bytes of packed e2m1 (low nibble first) -> 16 floats (vpermps uses the index's low 4
 * bits, so the nibbles need no masking). */
static inline FT_AVX512 __m512 avx512_e2m1x16(__m128i codes, __m512 lut) {
    return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), lut);
}
static inline FT_AVX512 __m512 avx512_fp4x16(const uint8_t *p, __m512 lut) {
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return avx512_e2m1x16(_mm_unpacklo_epi8(b, _mm_srli_epi16(b, 4)), lut);
}

#define FT_AVX512_QFMA(I, M)                                                                 \
    do {                                                                                     \
        FT_FMA_TOKEN(0, I, M);                                                               \
        if (nt > 1) FT_FMA_TOKEN(1, I, M);                                                   \
        if (nt > 2) FT_FMA_TOKEN(2, I, M);                                                   \
        if (nt > 3) FT_FMA_TOKEN(3, I, M);                                                   \
    } while (0)
#define FT_AVX512_FP8_STEP(I, M)                                                             \
    do {                                                                                     \
        __m512 w0 = _mm512_mul_ps(avx512_fp8x16(p0 + (I), M), sc0);                          \
        __m512 w1 = _mm512_mul_ps(avx512_fp8x16(p1 + (I), M), sc1);                          \
        __m512 w2 = _mm512_mul_ps(avx512_fp8x16(p2 + (I), M), sc2);                          \
        __m512 w3 = _mm512_mul_ps(avx512_fp8x16(p3 + (I), M), sc3);                          \
        FT_AVX512_QFMA(I, M);                                                                \
    } while (0)

static inline __attribute__((always_inline)) FT_AVX512 void avx512_qfp8_body(
    const void *const *w, const void *const *s, const void *const *pf, const void *const *x,
    const int nt, int n, int bk, float *res) {
    FT_ACC_DECL;
    const uint8_t *p0 = (const uint8_t *)w[0], *p1 = (const uint8_t *)w[1];
    const uint8_t *p2 = (const uint8_t *)w[2], *p3 = (const uint8_t *)w[3];
    const float *q0 = (const float *)s[0], *q1 = (const float *)s[1];
    const float *q2 = (const float *)s[2], *q3 = (const float *)s[3];
    int64_t pfo = 0;
    for (int64_t c0 = 0, kb = 0; c0 < n; c0 += bk, kb++) {
        const int c1 = (int)(c0 + bk < n ? c0 + bk : n);
        const __m512 sc0 = _mm512_set1_ps(q0[kb] * 256.0f);
        const __m512 sc1 = _mm512_set1_ps(q1[kb] * 256.0f);
        const __m512 sc2 = _mm512_set1_ps(q2[kb] * 256.0f);
        const __m512 sc3 = _mm512_set1_ps(q3[kb] * 256.0f);
        int i = (int)c0;
        for (; i + 16 <= c1; i += 16) {
            if (i >= pfo) {
                FT_PREFETCH4((size_t)pfo);
                pfo += FT_ALIGN;
            }
            FT_AVX512_FP8_STEP(i, (__mmask16)0xffff);
        }
        if (i < c1) FT_AVX512_FP8_STEP(i, (__mmask16)((1u << (c1 - i)) - 1));
    }
    FT_ACC_STORE_ALL;
}

/* n is a multiple of 16 (NVFP4) or 32 (MXFP4): no tails. Steps of 32 columns (16 bytes of
 * each row, one MXFP4 scale or two NVFP4 scales), then one of 16 for an NVFP4 remainder. */
#define FT_FP4_SCALE(Q, I)                                                                   \
    _mm512_set1_ps(fmt == FT_FMT_MXFP4 ? ft_e8m0_lut[(Q)[(I) >> 5]]                          \
                                       : ft_e4m3_lut[(Q)[(I) >> 4]])
static inline __attribute__((always_inline)) FT_AVX512 void avx512_qfp4_body(
    int fmt, const void *const *w, const void *const *s, const void *const *pf,
    const void *const *x, const int nt, int n, float *res) {
    FT_ACC_DECL;
    const __m512 lut = _mm512_loadu_ps(ft_e2m1);
    const uint8_t *p0 = (const uint8_t *)w[0], *p1 = (const uint8_t *)w[1];
    const uint8_t *p2 = (const uint8_t *)w[2], *p3 = (const uint8_t *)w[3];
    const uint8_t *q0 = (const uint8_t *)s[0], *q1 = (const uint8_t *)s[1];
    const uint8_t *q2 = (const uint8_t *)s[2], *q3 = (const uint8_t *)s[3];
    const __mmask16 all = (__mmask16)0xffff;
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        if (((i >> 1) & (FT_ALIGN - 1)) == 0) FT_PREFETCH4((size_t)(i >> 1));
        const __m128i b0 = _mm_loadu_si128((const __m128i *)(p0 + (i >> 1)));
        const __m128i b1 = _mm_loadu_si128((const __m128i *)(p1 + (i >> 1)));
        const __m128i b2 = _mm_loadu_si128((const __m128i *)(p2 + (i >> 1)));
        const __m128i b3 = _mm_loadu_si128((const __m128i *)(p3 + (i >> 1)));
        const __m128i h0 = _mm_srli_epi16(b0, 4), h1 = _mm_srli_epi16(b1, 4);
        const __m128i h2 = _mm_srli_epi16(b2, 4), h3 = _mm_srli_epi16(b3, 4);
        __m512 s0 = FT_FP4_SCALE(q0, i), s1 = FT_FP4_SCALE(q1, i);
        __m512 s2 = FT_FP4_SCALE(q2, i), s3 = FT_FP4_SCALE(q3, i);
        if (fmt == FT_FMT_MXFP4) {
            /* one scale for the 32 columns: look the codes up in the scaled table (exact:
             * the scale is a power of two) */
            const __m512 l0 = _mm512_mul_ps(lut, s0), l1 = _mm512_mul_ps(lut, s1);
            const __m512 l2 = _mm512_mul_ps(lut, s2), l3 = _mm512_mul_ps(lut, s3);
            {
                __m512 w0 = avx512_e2m1x16(_mm_unpacklo_epi8(b0, h0), l0);
                __m512 w1 = avx512_e2m1x16(_mm_unpacklo_epi8(b1, h1), l1);
                __m512 w2 = avx512_e2m1x16(_mm_unpacklo_epi8(b2, h2), l2);
                __m512 w3 = avx512_e2m1x16(_mm_unpacklo_epi8(b3, h3), l3);
                FT_AVX512_QFMA(i, all);
            }
            {
                __m512 w0 = avx512_e2m1x16(_mm_unpackhi_epi8(b0, h0), l0);
                __m512 w1 = avx512_e2m1x16(_mm_unpackhi_epi8(b1, h1), l1);
                __m512 w2 = avx512_e2m1x16(_mm_unpackhi_epi8(b2, h2), l2);
                __m512 w3 = avx512_e2m1x16(_mm_unpackhi_epi8(b3, h3), l3);
                FT_AVX512_QFMA(i + 16, all);
            }
            continue;
        }
        {
            __m512 w0 = _mm512_mul_ps(avx512_e2m1x16(_mm_unpacklo_epi8(b0, h0), lut), s0);
            __m512 w1 = _mm512_mul_ps(avx512_e2m1x16(_mm_unpacklo_epi8(b1, h1), lut), s1);
            __m512 w2 = _mm512_mul_ps(avx512_e2m1x16(_mm_unpacklo_epi8(b2, h2), lut), s2);
            __m512 w3 = _mm512_mul_ps(avx512_e2m1x16(_mm_unpacklo_epi8(b3, h3), lut), s3);
            FT_AVX512_QFMA(i, all);
        }
        s0 = FT_FP4_SCALE(q0, i + 16);
        s1 = FT_FP4_SCALE(q1, i + 16);
        s2 = FT_FP4_SCALE(q2, i + 16);
        s3 = FT_FP4_SCALE(q3, i + 16);
        {
            __m512 w0 = _mm512_mul_ps(avx512_e2m1x16(_mm_unpackhi_epi8(b0, h0), lut), s0);
            __m512 w1 = _mm512_mul_ps(avx512_e2m1x16(_mm_unpackhi_epi8(b1, h1), lut), s1);
            __m512 w2 = _mm512_mul_ps(avx512_e2m1x16(_mm_unpackhi_epi8(b2, h2), lut), s2);
            __m512 w3 = _mm512_mul_ps(avx512_e2m1x16(_mm_unpackhi_epi8(b3, h3), lut), s3);
            FT_AVX512_QFMA(i + 16, all);
        }
    }
    if (i < n) { /* NVFP4: 16 columns left */
        __m512 w0 = _mm512_mul_ps(avx512_fp4x16(p0 + (i >> 1), lut), FT_FP4_SCALE(q0, i));
        __m512 w1 = _mm512_mul_ps(avx512_fp4x16(p1 + (i >> 1), lut), FT_FP4_SCALE(q1, i));
        __m512 w2 = _mm512_mul_ps(avx512_fp4x16(p2 + (i >> 1), lut), FT_FP4_SCALE(q2, i));
        __m512 w3 = _mm512_mul_ps(avx512_fp4x16(p3 + (i >> 1), lut), FT_FP4_SCALE(q3, i));
        FT_AVX512_QFMA(i, all);
    }
    FT_ACC_STORE_ALL;
}
#undef FT_FP4_SCALE

static FT_AVX512 void avx512_qdot_fp8(const void *const *w, const void *const *s,
                                      const void *const *pf, const void *const *x, int nt,
                                      int n, int bk, float *res) {
    switch (nt) {
    case 1: avx512_qfp8_body(w, s, pf, x, 1, n, bk, res); break;
    case 2: avx512_qfp8_body(w, s, pf, x, 2, n, bk, res); break;
    case 3: avx512_qfp8_body(w, s, pf, x, 3, n, bk, res); break;
    default: avx512_qfp8_body(w, s, pf, x, 4, n, bk, res); break;
    }
}
#define FT_DEFINE_AVX512_QDOT_FP4(NAME, FMT)                                                 \
    static FT_AVX512 void NAME(const void *const *w, const void *const *s,                  \
                               const void *const *pf, const void *const *x, int nt, int n,   \
                               int bk, float *res) {                                         \
        (void)bk;                                                                            \
        switch (nt) {                                                                        \
        case 1: avx512_qfp4_body(FMT, w, s, pf, x, 1, n, res); break;                        \
        case 2: avx512_qfp4_body(FMT, w, s, pf, x, 2, n, res); break;                        \
        case 3: avx512_qfp4_body(FMT, w, s, pf, x, 3, n, res); break;                        \
        default: avx512_qfp4_body(FMT, w, s, pf, x, 4, n, res); break;                       \
        }                                                                                    \
    }
FT_DEFINE_AVX512_QDOT_FP4(avx512_qdot_mxfp4, FT_FMT_MXFP4)
FT_DEFINE_AVX512_QDOT_FP4(avx512_qdot_nvfp4, FT_FMT_NVFP4)

/* ---- AVX512-BF16: bf16 weights x bf16 activations, 32 pairs per vdpbf16ps. ---------- */
/* bf16 pair dot products of 4 weight vectors with token T's activations. */
#define FT_DPBF16_TOKEN(T, I, M)                                                             \
    do {                                                                                     \
        __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(M, (const uint16_t *)x[T] + (I));   \
        a0##T = _mm512_dpbf16_ps(a0##T, w0, xv);                                             \
        a1##T = _mm512_dpbf16_ps(a1##T, w1, xv);                                             \
        a2##T = _mm512_dpbf16_ps(a2##T, w2, xv);                                             \
        a3##T = _mm512_dpbf16_ps(a3##T, w3, xv);                                             \
    } while (0)
#define FT_AVX512BF16_STEP(I, M)                                                             \
    do {                                                                                     \
        __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(M, (const uint16_t *)w[0] + (I));   \
        __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi16(M, (const uint16_t *)w[1] + (I));   \
        __m512bh w2 = (__m512bh)_mm512_maskz_loadu_epi16(M, (const uint16_t *)w[2] + (I));   \
        __m512bh w3 = (__m512bh)_mm512_maskz_loadu_epi16(M, (const uint16_t *)w[3] + (I));   \
        FT_DPBF16_TOKEN(0, I, M);                                                            \
        if (nt > 1) FT_DPBF16_TOKEN(1, I, M);                                                \
        if (nt > 2) FT_DPBF16_TOKEN(2, I, M);                                                \
        if (nt > 3) FT_DPBF16_TOKEN(3, I, M);                                                \
    } while (0)

static inline __attribute__((always_inline)) FT_AVX512BF16 void avx512bf16_dot_body(
    const void *const *w, const void *const *pf, const void *const *x, const int nt, int n,
    float *res) {
    FT_ACC_DECL;
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        FT_PREFETCH4((size_t)i * 2);
        FT_AVX512BF16_STEP(i, (__mmask32)0xffffffffu);
    }
    if (i < n) FT_AVX512BF16_STEP(i, (__mmask32)(((uint64_t)1 << (n - i)) - 1));
    FT_ACC_STORE_ALL;
}

static FT_AVX512BF16 void avx512bf16_dot(const void *const *w, const void *const *pf,
                                         const void *const *x, int nt, int n, float *res) {
    switch (nt) {
    case 1: avx512bf16_dot_body(w, pf, x, 1, n, res); break;
    case 2: avx512bf16_dot_body(w, pf, x, 2, n, res); break;
    case 3: avx512bf16_dot_body(w, pf, x, 3, n, res); break;
    default: avx512bf16_dot_body(w, pf, x, 4, n, res); break;
    }
}


/* ---- Tile products (AMX-BF16, or the same in portable C) ----------------------------- */
/* c[2 * ia + ib][m][n] (fp32 [4][16][16]) = sum over chunks kc < nk of
 *   sum_{i < 32} A_ia[m][32 kc + i] * B_ib(kc)[i / 2][n][i % 2],
 * A_ia: 16 bf16 weight rows, row m at a_ia + m * a_stride (chunk kc at +64 kc bytes);
 * B_ib(kc): the VNNI chunk at b_ib + 1024 kc (16 rows of 16 tokens x 2 bf16). Pass a1 = a0
 * or b1 = b0 when there is only one; prefetch: the A rows are cold (first token pass). */
typedef void (*ft_tile_fn)(const uint8_t *a0, const uint8_t *a1, size_t a_stride,
                           const uint8_t *b0, const uint8_t *b1, int nk, int prefetch, float *c);

static void emulated_tile(const uint8_t *a0, const uint8_t *a1, size_t a_stride,
                          const uint8_t *b0, const uint8_t *b1, int nk, int prefetch, float *c) {
    (void)prefetch;
    const uint8_t *as[2] = {a0, a1}, *bs[2] = {b0, b1};
    for (int q = 0; q < 4; q++) {
        float *cq = c + q * FT_TILE * FT_TILE;
        memset(cq, 0, FT_TILE * FT_TILE * sizeof(float));
        for (int kc = 0; kc < nk; kc++) {
            const uint16_t *bk = (const uint16_t *)(bs[q & 1] + (size_t)kc * 1024);
            for (int m = 0; m < FT_TILE; m++) {
                const uint16_t *am =
                    (const uint16_t *)(as[q >> 1] + (size_t)m * a_stride + (size_t)kc * 64);
                for (int r = 0; r < FT_TILE; r++) {
                    float x0 = bf16_to_f32(am[2 * r]), x1 = bf16_to_f32(am[2 * r + 1]);
                    const uint16_t *br = bk + r * 32;
                    /* TDPBF16PS's order; unlike it, subnormals are not flushed here */
                    for (int n = 0; n < FT_TILE; n++) {
                        cq[m * FT_TILE + n] += x0 * bf16_to_f32(br[2 * n]);
                        cq[m * FT_TILE + n] += x1 * bf16_to_f32(br[2 * n + 1]);
                    }
                }
            }
        }
    }
}

#if FT_HAVE_AMX
#define FT_AMX __attribute__((target("amx-tile,amx-bf16")))
/* Palette 1, tiles 0-7 of 16 rows x 64 bytes: 0-1 the A rows, 2-3 the B chunks, 4-7 c. */
static const struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) ft_tile_cfg = {
    1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

static FT_AMX void amx_tile(const uint8_t *a0, const uint8_t *a1, size_t a_stride,
                            const uint8_t *b0, const uint8_t *b1, int nk, int prefetch,
                            float *c) {
    _tile_loadconfig(&ft_tile_cfg);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int kc = 0; kc < nk; kc++) {
        if (prefetch && kc + 4 < nk)
            for (int m = 0; m < FT_TILE; m++) {
                _mm_prefetch((const char *)a0 + (size_t)m * a_stride + (size_t)(kc + 4) * 64,
                             _MM_HINT_T0);
                _mm_prefetch((const char *)a1 + (size_t)m * a_stride + (size_t)(kc + 4) * 64,
                             _MM_HINT_T0);
            }
        _tile_loadd(0, a0 + (size_t)kc * 64, (long)a_stride);
        _tile_loadd(1, a1 + (size_t)kc * 64, (long)a_stride);
        _tile_loadd(2, b0 + (size_t)kc * 1024, 64);
        _tile_loadd(3, b1 + (size_t)kc * 1024, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        _tile_dpbf16ps(6, 1, 2);
        _tile_dpbf16ps(7, 1, 3);
    }
    _tile_stored(4, c, 64);
    _tile_stored(5, c + 256, 64);
    _tile_stored(6, c + 512, 64);
    _tile_stored(7, c + 768, 64);
    _tile_release();
}

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* 1 if the CPU has AMX-TILE and AMX-BF16 and Linux lets this process use the tile data. */
static int amx_usable(void) {
    static _Atomic int state = -1;
    int s = atomic_load(&state);
    if (s >= 0) return s;
    unsigned a, b, c, d;
    s = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 22)))
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    atomic_store(&state, s);
    return s;
}
#endif

/* ---- STREAM-like read-reduce loops (4 independent accumulators). -------------------- */
static FT_AVX2 uint64_t avx2_read(const uint8_t *p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, a0);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3] + read_tail(p + i, n - i);
}

static FT_AVX512 uint64_t avx512_read(const uint8_t *p, size_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        a0 = _mm512_add_epi64(a0, _mm512_loadu_si512((const void *)(p + i)));
        a1 = _mm512_add_epi64(a1, _mm512_loadu_si512((const void *)(p + i + 64)));
        a2 = _mm512_add_epi64(a2, _mm512_loadu_si512((const void *)(p + i + 128)));
        a3 = _mm512_add_epi64(a3, _mm512_loadu_si512((const void *)(p + i + 192)));
    }
    return (uint64_t)_mm512_reduce_add_epi64(
               _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3))) +
           read_tail(p + i, n - i);
}
#endif /* FT_X86 */

static uint64_t portable_read(const uint8_t *p, size_t n) {
    uint64_t a[8] = {0};
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        for (int k = 0; k < 8; k++) {
            uint64_t v;
            memcpy(&v, p + i + 8 * k, sizeof v);
            a[k] += v;
        }
    }
    uint64_t s = 0;
    for (int k = 0; k < 8; k++) s += a[k];
    return s + read_tail(p + i, n - i);
}

/* ------------------------------------------------------------------------------------ */
/* CPU features and kernel selection                                                    */
/* ------------------------------------------------------------------------------------ */

int ft_isa_supported(int isa) {
    switch (isa) {
    case FT_ISA_AUTO:
    case FT_ISA_PORTABLE: return 1;
#if FT_X86
    case FT_ISA_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    case FT_ISA_AVX512:
        __builtin_cpu_init();
        return ft_isa_supported(FT_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512dq");
    case FT_ISA_AVX512_BF16:
        __builtin_cpu_init();
        return ft_isa_supported(FT_ISA_AVX512) && __builtin_cpu_supports("avx512bf16");
#endif
#if FT_HAVE_AMX
    case FT_ISA_AMX: return ft_isa_supported(FT_ISA_AVX512_BF16) && amx_usable();
#endif
    case FT_ISA_AMX_EMULATED: return 1;
    default: return 0;
    }
}

int ft_best_isa(void) { /* AMX is asked for by name until it is measured on a server */
    for (int isa = FT_ISA_AVX512_BF16; isa > FT_ISA_PORTABLE; isa--)
        if (ft_isa_supported(isa)) return isa;
    return FT_ISA_PORTABLE;
}

const char *ft_isa_name(int isa) {
    switch (isa) {
    case FT_ISA_AUTO: return "auto";
    case FT_ISA_PORTABLE: return "portable";
    case FT_ISA_AVX2: return "avx2";
    case FT_ISA_AVX512: return "avx512";
    case FT_ISA_AVX512_BF16: return "avx512_bf16";
    case FT_ISA_AMX: return "amx";
    case FT_ISA_AMX_EMULATED: return "amx_emulated";
    default: return "unknown";
    }
}

const char *ft_strerror(int code) {
    switch (code) {
    case FT_OK: return "ok";
    case FT_ERR_ARG: return "invalid argument";
    case FT_ERR_ROW: return "token row out of range";
    case FT_ERR_EXPERT: return "expert id out of range";
    case FT_ERR_NOMEM: return "out of memory";
    case FT_ERR_ISA: return "kernel path not supported by this CPU";
    case FT_ERR_THREAD: return "could not start a worker thread";
    default: return "unknown error";
    }
}

/* The path that runs what the tiles do not: AVX512_BF16 under AMX, PORTABLE under
 * AMX_EMULATED. */
static int base_isa(int isa) {
    return isa == FT_ISA_AMX ? FT_ISA_AVX512_BF16
           : isa == FT_ISA_AMX_EMULATED ? FT_ISA_PORTABLE
                                        : isa;
}

static ft_kernel select_kernel(int isa, int wdtype, int fmt) {
    ft_kernel k = {NULL, NULL, FT_TMAX, 0};
    isa = base_isa(isa);
    if (fmt != FT_FMT_DENSE) {
#if FT_X86
        if (isa == FT_ISA_AVX512 || isa == FT_ISA_AVX512_BF16) {
            k.qdot = fmt == FT_FMT_FP8_BLOCK ? avx512_qdot_fp8
                     : fmt == FT_FMT_MXFP4   ? avx512_qdot_mxfp4
                                             : avx512_qdot_nvfp4;
            return k;
        }
        if (isa == FT_ISA_AVX2) {
            k.qdot = fmt == FT_FMT_FP8_BLOCK ? avx2_qdot_fp8
                     : fmt == FT_FMT_MXFP4   ? avx2_qdot_mxfp4
                                             : avx2_qdot_nvfp4;
            k.tmax = 2;
            return k;
        }
#endif
        k.qdot = fmt == FT_FMT_FP8_BLOCK ? portable_qdot_fp8
                 : fmt == FT_FMT_MXFP4   ? portable_qdot_mxfp4
                                         : portable_qdot_nvfp4;
        return k;
    }
#if FT_X86
    if (isa == FT_ISA_AVX512_BF16 && wdtype == FT_DTYPE_BF16) {
        k.dot = avx512bf16_dot;
        k.x_bf16 = 1;
        return k;
    }
    if (isa == FT_ISA_AVX512 || isa == FT_ISA_AVX512_BF16) {
        k.dot = wdtype == FT_DTYPE_BF16  ? avx512_dot_bf16
                : wdtype == FT_DTYPE_F16 ? avx512_dot_f16
                                         : avx512_dot_f32;
        return k;
    }
    if (isa == FT_ISA_AVX2) {
        k.dot = wdtype == FT_DTYPE_BF16  ? avx2_dot_bf16
                : wdtype == FT_DTYPE_F16 ? avx2_dot_f16
                                         : avx2_dot_f32;
        k.tmax = 2;
        return k;
    }
#endif
    k.dot = wdtype == FT_DTYPE_BF16  ? portable_dot_bf16
            : wdtype == FT_DTYPE_F16 ? portable_dot_f16
                                     : portable_dot_f32;
    return k;
}

static uint64_t read_reduce(int isa, const uint8_t *p, size_t n) {
    isa = base_isa(isa);
#if FT_X86
    if (isa >= FT_ISA_AVX512) return avx512_read(p, n);
    if (isa == FT_ISA_AVX2) return avx2_read(p, n);
#else
    (void)isa;
#endif
    return portable_read(p, n);
}

/* ------------------------------------------------------------------------------------ */
/* CPU topology                                                                         */
/* ------------------------------------------------------------------------------------ */

static int read_sys_int(int cpu, const char *what) {
    char path[128];
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/%s", cpu, what);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int v = -1;
    if (fscanf(f, "%d", &v) != 1) v = -1;
    fclose(f);
    return v;
}

/* The process's logical CPUs, ordered so that the first *n_cores entries lie on distinct
 * physical cores (the first hyperthread of each), then the remaining siblings. Returns a
 * malloc'd array of *n_cpus entries, or NULL when out of memory. */
static int *ordered_cpus(int *n_cpus, int *n_cores) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) != 0) CPU_SET(0, &set);
    int *cpus = (int *)malloc(sizeof(int) * CPU_SETSIZE);
    int *keys = (int *)malloc(sizeof(int) * CPU_SETSIZE);
    int *later = (int *)malloc(sizeof(int) * CPU_SETSIZE);
    if (!cpus || !keys || !later) {
        free(cpus);
        free(keys);
        free(later);
        return NULL;
    }
    int firsts = 0, rest = 0;
    for (int c = 0; c < CPU_SETSIZE; c++) {
        if (!CPU_ISSET(c, &set)) continue;
        int pkg = read_sys_int(c, "physical_package_id");
        int core = read_sys_int(c, "core_id");
        int key = (pkg < 0 || core < 0) ? -1 - c : pkg * 65536 + core;
        int seen = 0;
        for (int k = 0; k < firsts && !seen; k++) seen = keys[k] == key;
        if (seen) {
            later[rest++] = c;
        } else {
            keys[firsts] = key;
            cpus[firsts++] = c;
        }
    }
    memcpy(cpus + firsts, later, sizeof(int) * (size_t)rest);
    free(keys);
    free(later);
    *n_cpus = firsts + rest;
    *n_cores = firsts;
    return cpus;
}

int ft_physical_cores(void) {
    int n_cpus = 1, n_cores = 1;
    free(ordered_cpus(&n_cpus, &n_cores));
    return n_cores;
}

/* ------------------------------------------------------------------------------------ */
/* Executor state                                                                       */
/* ------------------------------------------------------------------------------------ */

/* Jobs, carried in the low bits of the dispatch word gen (JOB_MASK). */
enum { JOB_MOE = 1, JOB_STREAM = 2, JOB_EXIT = 3, JOB_MOE_DYNAMIC = 4 };
#define JOB_MASK 7u

typedef struct {
    int32_t expert;      /* flat expert id */
    int32_t start;       /* first sorted item */
    int32_t count;       /* items (tokens) of this expert */
    int32_t tiled;       /* 1: this expert runs on tiles (then tile_block is its first) */
    int64_t unit_start;  /* first phase-1 unit of this expert, in the flattened unit space */
    int64_t tile_block;  /* first 16-token block of this expert in xt / it */
    _Atomic int32_t packed; /* tiled: 0 x not packed, 1 being packed, 2 packed */
} ft_group;

typedef struct {
    alignas(FT_ALIGN) uint64_t value;
} ft_padded_u64;

struct ft_executor {
    ft_pool_desc pool;
    size_t esz;               /* weight element size (dense) */
    int64_t up_rows;          /* rows of one expert's w13 */
    /* weight and scale geometry (scale fields unused when dense) */
    size_t w13_row_bytes, w2_row_bytes;   /* bytes of one weight row */
    size_t s13_row_bytes, s2_row_bytes;   /* bytes of one scale row */
    int64_t s13_rows, s2_rows;            /* scale rows per expert */
    int64_t s13_div, s2_div;              /* weight row -> scale row: / block_n, or 1 */
    int64_t s13_up_first;                 /* w13_scale_split: first up scale row */
    int isa;
    ft_kernel kern;
    int tiles;                /* 1: AMX (or emulated) tiles for experts of >= tile_min tokens */
    int tile_min;
    ft_tile_fn tile;
    int nthreads;             /* compute threads, the caller included */
    int spin_us;
    pthread_t *threads;       /* [nthreads - 1] */
    int *thread_cpu;          /* [nthreads - 1], -1 when not pinned */
    pthread_mutex_t run_lock;

    /* dispatch: the caller publishes a job in gen; workers wait for it to change */
    alignas(FT_ALIGN) _Atomic uint32_t gen;
    _Atomic int gen_waiters;
    alignas(FT_ALIGN) _Atomic uint32_t bar_gen;
    _Atomic int bar_count;
    _Atomic int bar_waiters;
    _Atomic uint64_t stall;     /* ft_executor_stall_worker: (tid << 32) | microseconds */
    alignas(FT_ALIGN) _Atomic int npinned;
    _Atomic int nstarted;       /* workers past their pinning step */

    /* the current call, written by the caller before publishing it */
    const ft_moe_task *task;
    int n_groups;
    int64_t n_units;
    int dynamic;                /* chunks from the counters below (1) or fixed shares (0) */
    /* Dynamic schedule: each counter holds (call number << 32) | value, so that a thread
     * still looking at a finished call fails its claim instead of taking the next call's
     * work. next*: the next phase-1 unit / phase-2 output block to hand out; done*: the
     * units / blocks finished. */
    _Atomic uint32_t call;      /* number of the current dynamic call (only the caller
                                 * writes it), published last */
    _Atomic int64_t total1[2];  /* phase-1 units of call c, in slot c & 1. A thread still
                                 * on an older call may read another call's total; the tags
                                 * make that harmless: its claims against the old tag fail,
                                 * and the slot of a call is not rewritten while a claim
                                 * against that call's tag can still succeed */
    alignas(FT_ALIGN) _Atomic uint64_t next1;
    alignas(FT_ALIGN) _Atomic uint64_t done1;
    alignas(FT_ALIGN) _Atomic uint64_t next2;
    alignas(FT_ALIGN) _Atomic uint64_t done2;
    const uint8_t *stream_buf;
    size_t stream_bytes;
    ft_padded_u64 *stream_sums; /* [nthreads] */

    /* workspace, grown by the caller under run_lock */
    int32_t cap_items, cap_rows, cap_xrows;
    uint64_t *keys;           /* [cap_items] (expert << 32 | item) for sorting */
    ft_group *groups;         /* [cap_items] */
    int32_t *s_rows;          /* [cap_items] token row of each sorted item */
    float *s_weights;         /* [cap_items] */
    const void **s_x;         /* [cap_items] activation vector of each sorted item */
    void **s_inter;           /* [cap_items] intermediate vector of each sorted item */
    int32_t *row_map;         /* [cap_rows] converted-x row of each token row, or -1 */
    uint8_t *xconv;           /* [cap_xrows, x_stride] converted activations */
    uint8_t *inter;           /* [cap_items, inter_stride] intermediate act(gate)*up */
    size_t x_stride, inter_stride; /* bytes, multiples of FT_ALIGN */
    /* Tiled experts: their tokens in blocks of 16 (the last block padded), in the layout
     * a tile product reads as its second operand ("VNNI": per 32-element chunk of K, 16
     * rows of 16 tokens x 2 consecutive elements, 1 KiB): xt holds x, it the intermediate. */
    int64_t cap_tblocks;
    uint8_t *xt;              /* [cap_tblocks, H / 32, 16, 16, 2] bf16 */
    uint8_t *it;              /* [cap_tblocks, I / 32, 16, 16, 2] bf16 */
};

static void *aligned_or_null(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, FT_ALIGN, bytes ? bytes : FT_ALIGN) != 0) return NULL;
    return p;
}

static inline size_t round_up(size_t v, size_t m) { return (v + m - 1) / m * m; }

/* ------------------------------------------------------------------------------------ */
/* Waiting: spin for spin_us, then sleep on a futex                                     */
/* ------------------------------------------------------------------------------------ */

static inline void cpu_relax(void) {
#if FT_X86
    _mm_pause();
#endif
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *word, uint32_t val) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* Return once *word != val. The spin yields the core every 256 polls, so that on an
 * oversubscribed machine a spinning thread does not hold up the thread it waits for. */
static void wait_change(_Atomic uint32_t *word, uint32_t val, _Atomic int *waiters,
                        int spin_us) {
    if (atomic_load_explicit(word, memory_order_acquire) != val) return;
    int64_t deadline = now_ns() + (int64_t)spin_us * 1000;
    for (unsigned it = 1;; it++) {
        cpu_relax();
        if (atomic_load_explicit(word, memory_order_acquire) != val) return;
        if ((it & 255) == 0) {
            if (now_ns() > deadline) break;
            sched_yield();
        }
    }
    for (;;) {
        atomic_fetch_add(waiters, 1);
        if (atomic_load(word) == val) futex_wait(word, val);
        atomic_fetch_sub(waiters, 1);
        if (atomic_load_explicit(word, memory_order_acquire) != val) return;
    }
}

static void bump_and_wake(_Atomic uint32_t *word, _Atomic int *waiters) {
    atomic_fetch_add(word, 1);
    if (atomic_load(waiters) > 0) futex_wake_all(word);
}

static void barrier(ft_executor *ex) {
    if (ex->nthreads == 1) return;
    uint32_t g = atomic_load(&ex->bar_gen);
    if (atomic_fetch_add(&ex->bar_count, 1) == ex->nthreads - 1) {
        atomic_store(&ex->bar_count, 0);
        bump_and_wake(&ex->bar_gen, &ex->bar_waiters);
    } else {
        wait_change(&ex->bar_gen, g, &ex->bar_waiters, ex->spin_us);
    }
}

/* ------------------------------------------------------------------------------------ */
/* The two phases                                                                       */
/* ------------------------------------------------------------------------------------ */

static inline void split_range(int64_t total, int parts, int idx, int64_t *b, int64_t *e) {
    *b = total * idx / parts;
    *e = total * (idx + 1) / parts;
}

static inline void store_inter(void *dst, int j, float v, int bf16) {
    if (bf16)
        ((uint16_t *)dst)[j] = f32_to_bf16(v);
    else
        ((float *)dst)[j] = v;
}

/* The w13 bank rows of one micro-kernel call at intermediate index j (< j1): gated, gate
 * rows of j, j+1 then up rows of j, j+1 (halves: j, j+1, I+j, I+j+1; interleaved: 2j,
 * 2j+2, 2j+1, 2j+3); not gated, rows j..j+3. Rows past j1 repeat the last one (their
 * results are ignored). */
static void gate_up_rows(int64_t j, int64_t j1, int64_t I, int gated, int il, int64_t *jr) {
    const int step = gated ? 2 : 4;
    int nj = (int)(j1 - j < step ? j1 - j : step);
    for (int r = 0; r < FT_ROWS; r++) {
        int64_t jj = gated ? j + (r % 2 < nj ? r % 2 : nj - 1) : j + (r < nj ? r : nj - 1);
        if (!gated)
            jr[r] = jj;
        else if (il)
            jr[r] = 2 * jj + (r >= 2);
        else
            jr[r] = r >= 2 ? I + jj : jj;
    }
}

/* The scale row of w13 row r of expert e (NULL when dense). */
static inline const void *w13_scale_row(const ft_executor *ex, int64_t e, int64_t r) {
    const ft_pool_desc *p = &ex->pool;
    if (p->format == FT_FMT_DENSE) return NULL;
    int64_t sr;
    if (ex->s13_up_first > 0 && r >= p->inter)
        sr = ex->s13_up_first + (r - p->inter) / ex->s13_div;
    else
        sr = r / ex->s13_div;
    return (const uint8_t *)p->w13_scale + ((size_t)e * ex->s13_rows + sr) * ex->s13_row_bytes;
}

/* The per-tensor factor of w13 row r of expert e: NVFP4's scale_2, else 1. */
static inline float w13_row_mul(const ft_executor *ex, int64_t e, int64_t r) {
    const ft_pool_desc *p = &ex->pool;
    if (p->format != FT_FMT_NVFP4) return 1.0f;
    int up = p->w13_scale_2_n == 2 && (p->gate_up_interleaved ? (r & 1) : r >= p->inter);
    return p->w13_scale_2[(size_t)e * p->w13_scale_2_n + up];
}

static inline float bias_at(const void *b, int64_t i, int dtype) { return load_elem(b, i, dtype); }

/* One micro-kernel call, dense or quantized. */
static inline void kdot(const ft_executor *ex, const void *const *w, const void *const *sc,
                        const void *const *pf, const void *const *x, int nt, int n,
                        float *res) {
    if (ex->kern.qdot)
        ex->kern.qdot(w, sc, pf, x, nt, n, ex->pool.block_k, res);
    else
        ex->kern.dot(w, pf, x, nt, n, res);
}

/* ---- Tiled experts ------------------------------------------------------------------ */

/* Byte offset of element k (of a row of K) for token n in a VNNI block of 16 tokens. */
static inline size_t vnni_at(int64_t k, int n) {
    return (size_t)(k / FT_KCHUNK) * 1024 + (size_t)((k % FT_KCHUNK) / 2) * 64 +
           (size_t)n * 4 + (size_t)(k & 1) * 2;
}

/* Pack the tokens of tiled group g into xt (bf16, the padding tokens zero), once: the first
 * thread to reach the group packs it, the others wait for it. */
static void pack_group_x(const ft_executor *ex, ft_group *g) {
    int32_t st = atomic_load_explicit(&g->packed, memory_order_acquire);
    if (st == 2) return;
    if (st == 0 && atomic_compare_exchange_strong(&g->packed, &st, 1)) {
        const ft_moe_task *t = ex->task;
        const int64_t H = ex->pool.hidden;
        const int nb = (g->count + FT_TILE - 1) / FT_TILE;
        const size_t xrow = (size_t)t->x_row_stride * dtype_size(t->x_dtype);
        for (int tok = 0; tok < nb * FT_TILE; tok++) {
            uint8_t *blk = ex->xt + (size_t)(g->tile_block + tok / FT_TILE) * 32 * H;
            const int n = tok % FT_TILE;
            const uint8_t *src = tok < g->count
                                     ? (const uint8_t *)t->x + (size_t)ex->s_rows[g->start + tok] * xrow
                                     : NULL;
            for (int64_t k = 0; k < H; k += 2) {
                uint32_t pair = 0;
                if (src) {
                    uint16_t lo, hi;
                    if (t->x_dtype == FT_DTYPE_BF16) {
                        lo = ((const uint16_t *)src)[k];
                        hi = ((const uint16_t *)src)[k + 1];
                    } else {
                        lo = f32_to_bf16(load_elem(src, k, t->x_dtype));
                        hi = f32_to_bf16(load_elem(src, k + 1, t->x_dtype));
                    }
                    pair = (uint32_t)lo | ((uint32_t)hi << 16);
                }
                memcpy(blk + vnni_at(k, n), &pair, 4);
            }
        }
        atomic_store_explicit(&g->packed, 2, memory_order_release);
        return;
    }
    for (unsigned it = 1; atomic_load_explicit(&g->packed, memory_order_acquire) != 2; it++) {
        cpu_relax();
        if ((it & 1023) == 0) sched_yield(); /* the packer may share this core */
    }
}

/* Intermediate rows [j0, j0 + 16) of tiled group g, written to it in the VNNI layout. */
static void phase1_tiled(const ft_executor *ex, ft_group *g, int64_t j0) {
    const ft_pool_desc *p = &ex->pool;
    const int64_t H = p->hidden, I = p->inter;
    const size_t rb = ex->w13_row_bytes;
    const uint8_t *base = (const uint8_t *)p->w13 + (size_t)g->expert * ex->up_rows * rb;
    const int gated = p->gated, il = p->gate_up_interleaved;
    const uint8_t *ag, *au;
    size_t stride = rb;
    int64_t jg[FT_TILE], ju[FT_TILE]; /* bank rows of gate / up row j0 + q */
    for (int q = 0; q < FT_TILE; q++) {
        int64_t j = j0 + q;
        jg[q] = gated && il ? 2 * j : j;
        ju[q] = !gated ? j : il ? 2 * j + 1 : I + j;
    }
    ag = base + (size_t)jg[0] * rb;
    au = base + (size_t)ju[0] * rb;
    if (gated && il) stride = 2 * rb;
    float bg[FT_TILE], bu[FT_TILE];
    const int64_t bias0 = g->expert * ex->up_rows;
    for (int q = 0; q < FT_TILE; q++) {
        bg[q] = p->w13_bias ? bias_at(p->w13_bias, bias0 + jg[q], p->bias_dtype) : 0.0f;
        bu[q] = p->w13_bias ? bias_at(p->w13_bias, bias0 + ju[q], p->bias_dtype) : 0.0f;
    }
    pack_group_x(ex, g);
    const int nb = (g->count + FT_TILE - 1) / FT_TILE;
    float c[4 * FT_TILE * FT_TILE];
    for (int tb = 0; tb < nb; tb += 2) {
        const uint8_t *b0 = ex->xt + (size_t)(g->tile_block + tb) * 32 * H;
        const int two = tb + 1 < nb;
        ex->tile(ag, au, stride, b0, two ? b0 + 32 * H : b0, (int)(H / FT_KCHUNK), tb == 0, c);
        for (int ib = 0; ib <= two; ib++) {
            uint8_t *blk = ex->it + (size_t)(g->tile_block + tb + ib) * 32 * I;
            const float *cg = c + ib * FT_TILE * FT_TILE, *cu = c + (2 + ib) * FT_TILE * FT_TILE;
            for (int q = 0; q < FT_TILE; q++)
                for (int n = 0; n < FT_TILE; n++) {
                    float a = cg[q * FT_TILE + n] + bg[q];
                    float v = gated ? gated_act(p, a, cu[q * FT_TILE + n] + bu[q])
                                    : activate(a, p->activation);
                    uint16_t h = f32_to_bf16(v);
                    memcpy(blk + vnni_at(j0 + q, n), &h, 2);
                }
        }
    }
}

/* Output rows [h0, h1) (multiples of 16) of tiled group g, added into out. */
static void phase2_tiled(const ft_executor *ex, const ft_group *g, int64_t h0, int64_t h1) {
    const ft_pool_desc *p = &ex->pool;
    const ft_moe_task *task = ex->task;
    const int64_t H = p->hidden, I = p->inter;
    const size_t rb = ex->w2_row_bytes;
    const uint8_t *base = (const uint8_t *)p->w2 + (size_t)g->expert * H * rb;
    const int nb = (g->count + FT_TILE - 1) / FT_TILE;
    float c[4 * FT_TILE * FT_TILE];
    for (int64_t h = h0; h < h1; h += 2 * FT_TILE) {
        const int two_a = h + FT_TILE < h1;
        const uint8_t *a0 = base + (size_t)h * rb;
        float b2[2 * FT_TILE];
        for (int m = 0; m < (1 + two_a) * FT_TILE; m++)
            b2[m] = p->w2_bias ? bias_at(p->w2_bias, g->expert * H + h + m, p->bias_dtype) : 0.0f;
        for (int tb = 0; tb < nb; tb += 2) {
            const uint8_t *b0 = ex->it + (size_t)(g->tile_block + tb) * 32 * I;
            const int two_b = tb + 1 < nb;
            ex->tile(a0, two_a ? a0 + FT_TILE * rb : a0, rb, b0, two_b ? b0 + 32 * I : b0,
                     (int)(I / FT_KCHUNK), tb == 0, c);
            for (int ia = 0; ia <= two_a; ia++)
                for (int ib = 0; ib <= two_b; ib++) {
                    const float *cq = c + (2 * ia + ib) * FT_TILE * FT_TILE;
                    for (int n = 0; n < FT_TILE; n++) {
                        int tok = (tb + ib) * FT_TILE + n;
                        if (tok >= g->count) break;
                        int item = g->start + tok;
                        float wt = ex->s_weights[item];
                        float *o = task->out + (size_t)ex->s_rows[item] * task->out_row_stride +
                                   h + ia * FT_TILE;
                        for (int m = 0; m < FT_TILE; m++)
                            o[m] += wt * (cq[m * FT_TILE + n] + b2[ia * FT_TILE + m]);
                    }
                }
        }
    }
}

/* Intermediate rows [j0, j1) of group g. */
static void phase1_group(const ft_executor *ex, const ft_group *g, int64_t j0, int64_t j1) {
    const ft_pool_desc *p = &ex->pool;
    const ft_kernel *k = &ex->kern;
    const int H = p->hidden, I = p->inter, gated = p->gated, il = p->gate_up_interleaved;
    const int64_t e = g->expert;
    const size_t row_bytes = ex->w13_row_bytes;
    const uint8_t *base = (const uint8_t *)p->w13 + (size_t)e * ex->up_rows * row_bytes;
    const int64_t bias0 = e * ex->up_rows;
    const int step = gated ? 2 : 4; /* 4 rows per micro-kernel call: 2 gate + 2 up, or 4 */
    float res[FT_ROWS * FT_TMAX];
    const void *w[FT_ROWS], *next[FT_ROWS], *sc[FT_ROWS];
    float mul[FT_ROWS], bias[FT_ROWS];
    int64_t jr[FT_ROWS], next_jr[FT_ROWS]; /* bank row of each micro-kernel row */
    gate_up_rows(j0, j1, I, gated, il, jr);
    for (int r = 0; r < FT_ROWS; r++) w[r] = base + (size_t)jr[r] * row_bytes;
    for (int64_t j = j0; j < j1; j += step) {
        int nj = (int)(j1 - j < step ? j1 - j : step);
        int has_next = j + step < j1;
        if (has_next) gate_up_rows(j + step, j1, I, gated, il, next_jr);
        for (int r = 0; r < FT_ROWS; r++) {
            next[r] = has_next ? (const void *)(base + (size_t)next_jr[r] * row_bytes) : w[r];
            sc[r] = w13_scale_row(ex, e, jr[r]);
            mul[r] = w13_row_mul(ex, e, jr[r]);
            bias[r] = p->w13_bias ? bias_at(p->w13_bias, bias0 + jr[r], p->bias_dtype) : 0.0f;
        }
        for (int tt = 0; tt < g->count; tt += k->tmax) {
            int nt = g->count - tt < k->tmax ? g->count - tt : k->tmax;
            int item0 = g->start + tt;
            kdot(ex, w, sc, tt == 0 ? next : w, (const void *const *)&ex->s_x[item0], nt, H, res);
            for (int t = 0; t < nt; t++) {
                void *dst = ex->s_inter[item0 + t];
                for (int q = 0; q < nj; q++) {
                    float a = res[q * FT_TMAX + t] * mul[q] + bias[q];
                    float v;
                    if (gated) {
                        float u = res[(q + 2) * FT_TMAX + t] * mul[q + 2] + bias[q + 2];
                        v = gated_act(p, a, u);
                    } else {
                        v = activate(a, p->activation);
                    }
                    store_inter(dst, (int)(j + q), v, k->x_bf16);
                }
            }
        }
        if (has_next) {
            memcpy(jr, next_jr, sizeof jr);
            memcpy(w, next, sizeof w);
        }
    }
}

/* Phase-1 units [ub, ue) of the flattened (group, 16-row block) space. */
static void phase1_units(ft_executor *ex, int64_t ub, int64_t ue) {
    const int64_t I = ex->pool.inter;
    for (int gi = 0; gi < ex->n_groups && ub < ue; gi++) {
        ft_group *g = &ex->groups[gi]; /* (its packing state is written) */
        int64_t gu0 = g->unit_start;
        int64_t gu1 = gu0 + (I + FT_INTER_BLOCK - 1) / FT_INTER_BLOCK;
        int64_t b = ub > gu0 ? ub : gu0, e = ue < gu1 ? ue : gu1;
        if (b >= e) continue;
        int64_t j0 = (b - gu0) * FT_INTER_BLOCK;
        int64_t j1 = (e - gu0) * FT_INTER_BLOCK;
        if (g->tiled)
            for (int64_t j = j0; j < j1; j += FT_TILE) phase1_tiled(ex, g, j);
        else
            phase1_group(ex, g, j0, j1 < I ? j1 : I);
    }
}

/* The chunk size that gives each thread about four chunks of ``total``. */
static inline int64_t chunk_of(int64_t total, int nthreads) {
    int64_t c = total / ((int64_t)nthreads * 4);
    return c > 0 ? c : 1;
}

static void phase1_static(ft_executor *ex, int tid) {
    int64_t ub, ue;
    split_range(ex->n_units, ex->nthreads, tid, &ub, &ue);
    phase1_units(ex, ub, ue);
}

/* Output rows [h0, h1) for every group. */
static void phase2_rows(ft_executor *ex, int64_t h0, int64_t h1) {
    const ft_pool_desc *p = &ex->pool;
    const ft_kernel *k = &ex->kern;
    const ft_moe_task *task = ex->task;
    const int H = p->hidden, I = p->inter;
    if (h0 >= h1) return;
    if (task->flags & FT_RUN_ZERO_OUTPUT)
        for (int r = 0; r < task->n_rows; r++)
            memset(task->out + (size_t)r * task->out_row_stride + h0, 0,
                   (size_t)(h1 - h0) * sizeof(float));
    const size_t row_bytes = ex->w2_row_bytes;
    float res[FT_ROWS * FT_TMAX];
    for (int gi = 0; gi < ex->n_groups; gi++) {
        const ft_group *g = &ex->groups[gi];
        if (g->tiled) {
            phase2_tiled(ex, g, h0, h1);
            continue;
        }
        const int64_t e = g->expert;
        const uint8_t *base = (const uint8_t *)p->w2 + (size_t)e * H * row_bytes;
        const uint8_t *sbase =
            p->format == FT_FMT_DENSE
                ? NULL
                : (const uint8_t *)p->w2_scale + (size_t)e * ex->s2_rows * ex->s2_row_bytes;
        const float mul = p->format == FT_FMT_NVFP4 ? p->w2_scale_2[e] : 1.0f;
        for (int64_t h = h0; h < h1; h += FT_ROWS) {
            int nh = (int)(h1 - h < FT_ROWS ? h1 - h : FT_ROWS);
            const void *w[FT_ROWS], *next[FT_ROWS], *sc[FT_ROWS];
            float b2[FT_ROWS];
            for (int r = 0; r < FT_ROWS; r++) {
                int64_t hr = h + (r < nh ? r : nh - 1);
                w[r] = base + (size_t)hr * row_bytes;
                sc[r] = sbase ? (const void *)(sbase + (size_t)(hr / ex->s2_div) * ex->s2_row_bytes)
                              : NULL;
                b2[r] = p->w2_bias ? bias_at(p->w2_bias, e * H + hr, p->bias_dtype) : 0.0f;
                /* the next rows of this range, or the last ones again */
                int64_t hn = h + FT_ROWS + r < h1 ? h + FT_ROWS + r : h1 - 1;
                next[r] = base + (size_t)hn * row_bytes;
            }
            for (int tt = 0; tt < g->count; tt += k->tmax) {
                int nt = g->count - tt < k->tmax ? g->count - tt : k->tmax;
                int item0 = g->start + tt;
                kdot(ex, w, sc, tt == 0 ? next : w, (const void *const *)&ex->s_inter[item0], nt,
                     I, res);
                for (int t = 0; t < nt; t++) {
                    float wt = ex->s_weights[item0 + t];
                    float *o = task->out + (size_t)ex->s_rows[item0 + t] * task->out_row_stride;
                    for (int r = 0; r < nh; r++)
                        o[h + r] += wt * (res[r * FT_TMAX + t] * mul + b2[r]);
                }
            }
        }
    }
}

/* Output blocks [bb, be) of FT_OUT_BLOCK rows. */
static void phase2_blocks(ft_executor *ex, int64_t bb, int64_t be) {
    const int64_t H = ex->pool.hidden;
    phase2_rows(ex, bb * FT_OUT_BLOCK, be * FT_OUT_BLOCK < H ? be * FT_OUT_BLOCK : H);
}

static void phase2_static(ft_executor *ex, int tid) {
    const int64_t total = (ex->pool.hidden + FT_OUT_BLOCK - 1) / FT_OUT_BLOCK;
    int64_t bb, be;
    split_range(total, ex->nthreads, tid, &bb, &be);
    phase2_blocks(ex, bb, be);
}

/* ------------------------------------------------------------------------------------ */
/* Dynamic schedule: tagged chunk counters, completion counted in chunks                */
/* ------------------------------------------------------------------------------------ */

static inline uint64_t tagged(uint32_t call, int64_t v) {
    return ((uint64_t)call << 32) | (uint64_t)v;
}

/* Claim up to c units of [0, total) of call `call` from *next: returns the first unit, or
 * -1 when none is left or the call is over. */
static int64_t claim(_Atomic uint64_t *next, uint32_t call, int64_t total, int64_t c) {
    uint64_t v = atomic_load_explicit(next, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(v >> 32) != call) return -1;
        int64_t u = (int64_t)(v & 0xffffffffu);
        if (u >= total) return -1;
        int64_t n = u + c < total ? u + c : total;
        if (atomic_compare_exchange_weak_explicit(next, &v, tagged(call, n),
                                                  memory_order_acq_rel, memory_order_acquire))
            return u;
    }
}

/* Wait until *done reads tagged(call, total): returns 1, or 0 if the call is over (the
 * tag changed: this thread woke late and the call finished without it). */
static int wait_done(_Atomic uint64_t *done, uint32_t call, int64_t total) {
    const uint64_t want = tagged(call, total);
    for (unsigned it = 1;; it++) {
        uint64_t v = atomic_load_explicit(done, memory_order_acquire);
        if (v == want) return 1;
        if ((uint32_t)(v >> 32) != call) return 0;
        cpu_relax();
        if ((it & 1023) == 0) sched_yield();
    }
}

/* One thread's part of a dynamic call: phase-1 chunks, then (when all are done) phase-2
 * chunks. The caller (wait_all) also waits for the last phase-2 chunk. */
static void run_dynamic(ft_executor *ex, int wait_all) {
    const uint32_t call = atomic_load_explicit(&ex->call, memory_order_acquire);
    const int64_t total1 = atomic_load_explicit(&ex->total1[call & 1], memory_order_relaxed);
    const int64_t c1 = chunk_of(total1, ex->nthreads);
    int64_t u;
    while ((u = claim(&ex->next1, call, total1, c1)) >= 0) {
        int64_t e = u + c1 < total1 ? u + c1 : total1;
        phase1_units(ex, u, e);
        atomic_fetch_add_explicit(&ex->done1, (uint64_t)(e - u), memory_order_acq_rel);
    }
    if (!wait_done(&ex->done1, call, total1)) return;
    const int64_t total2 = (ex->pool.hidden + FT_OUT_BLOCK - 1) / FT_OUT_BLOCK;
    const int64_t c2 = chunk_of(total2, ex->nthreads);
    while ((u = claim(&ex->next2, call, total2, c2)) >= 0) {
        int64_t e = u + c2 < total2 ? u + c2 : total2;
        phase2_blocks(ex, u, e);
        atomic_fetch_add_explicit(&ex->done2, (uint64_t)(e - u), memory_order_acq_rel);
    }
    if (wait_all) wait_done(&ex->done2, call, total2);
}

static void stream_part(ft_executor *ex, int tid) {
    const size_t block = 256;
    size_t chunks = (ex->stream_bytes + block - 1) / block;
    size_t b = chunks * (size_t)tid / (size_t)ex->nthreads * block;
    size_t e = chunks * (size_t)(tid + 1) / (size_t)ex->nthreads * block;
    if (e > ex->stream_bytes) e = ex->stream_bytes;
    ex->stream_sums[tid].value = b < e ? read_reduce(ex->isa, ex->stream_buf + b, e - b) : 0;
}

/* The share of thread tid of a job: a dynamic call's chunks (the caller, tid 0, also waits
 * for the last one), or a static call's or stream read's fixed share, which every thread
 * ends at the final barrier. */
static void do_job(ft_executor *ex, int tid, int job) {
    if (job == JOB_MOE_DYNAMIC) {
        run_dynamic(ex, tid == 0);
        return;
    }
    if (job == JOB_MOE) {
        phase1_static(ex, tid);
        barrier(ex);
        phase2_static(ex, tid);
    } else {
        stream_part(ex, tid);
    }
    barrier(ex);
}

typedef struct {
    ft_executor *ex;
    int tid;
} ft_worker_arg;

static void *worker_main(void *arg_) {
    ft_worker_arg arg = *(ft_worker_arg *)arg_;
    free(arg_);
    ft_executor *ex = arg.ex;
    int cpu = ex->thread_cpu[arg.tid - 1];
    if (cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0)
            atomic_fetch_add(&ex->npinned, 1);
    }
    atomic_fetch_add(&ex->nstarted, 1);
    uint32_t seen = 0; /* gen is 0 when the thread is created */
    for (;;) {
        wait_change(&ex->gen, seen, &ex->gen_waiters, ex->spin_us);
        seen = atomic_load_explicit(&ex->gen, memory_order_acquire);
        /* The job travels in gen's low bits, so that the job a worker runs is the one of
         * the gen it saw: a late worker (a dynamic call ends without it) must not read a
         * newer job and then, seeing gen changed once more, run that job twice. */
        int job = (int)(seen & JOB_MASK);
        uint64_t stall = atomic_load_explicit(&ex->stall, memory_order_relaxed);
        if (stall && (int)(stall >> 32) == arg.tid &&
            atomic_compare_exchange_strong(&ex->stall, &stall, 0))
            usleep((useconds_t)(stall & 0xffffffffu));
        if (job == JOB_EXIT) return NULL;
        do_job(ex, arg.tid, job);
    }
}

/* Caller side: make gen the next multiple of JOB_MASK + 1 plus the job, wake sleepers. */
static void publish(ft_executor *ex, int job) {
    uint32_t g = atomic_load_explicit(&ex->gen, memory_order_relaxed);
    /* seq_cst, so that the store is visible before gen_waiters is read (no lost wake-up) */
    atomic_store(&ex->gen, ((g & ~JOB_MASK) + JOB_MASK + 1u) | (uint32_t)job);
    if (atomic_load(&ex->gen_waiters) > 0) futex_wake_all(&ex->gen);
}

/* Caller side: publish the job and do thread 0's share; returns when the job is done. */
static void dispatch(ft_executor *ex, int job) {
    if (ex->nthreads > 1) publish(ex, job);
    if (job != JOB_EXIT) do_job(ex, 0, job);
}

/* ------------------------------------------------------------------------------------ */
/* Create / destroy                                                                     */
/* ------------------------------------------------------------------------------------ */

static void stop_workers(ft_executor *ex, int started) {
    if (started > 0) {
        publish(ex, JOB_EXIT);
        for (int i = 0; i < started; i++) pthread_join(ex->threads[i], NULL);
    }
}

static void free_workspace(ft_executor *ex) {
    free(ex->keys);
    free(ex->groups);
    free(ex->s_rows);
    free(ex->s_weights);
    free(ex->s_x);
    free(ex->s_inter);
    free(ex->row_map);
    free(ex->xconv);
    free(ex->inter);
    free(ex->xt);
    free(ex->it);
}

static int resolve_isa(int isa) {
    if (isa == FT_ISA_AUTO) return ft_best_isa();
    if (isa < FT_ISA_PORTABLE || isa > FT_ISA_AMX_EMULATED || !ft_isa_supported(isa))
        return FT_ERR_ISA;
    return isa;
}

/* The format-specific part of a pool's validation: 1 if valid. */
static int pool_valid(const ft_pool_desc *p) {
    if (p->activation < FT_ACT_SILU || p->activation > FT_ACT_SWIGLU_OAI ||
        p->bias_dtype < FT_DTYPE_F32 || p->bias_dtype > FT_DTYPE_BF16)
        return 0;
    if (p->activation == FT_ACT_SWIGLU_OAI &&
        (!p->gated || !(p->limit > 0.0f) || !isfinite(p->alpha) || !isfinite(p->limit)))
        return 0;
    switch (p->format) {
    case FT_FMT_DENSE: return p->dtype >= FT_DTYPE_F32 && p->dtype <= FT_DTYPE_BF16;
    case FT_FMT_FP8_BLOCK:
        return p->w13_scale && p->w2_scale && p->block_n > 0 && p->block_k > 0 &&
               (!p->w13_scale_split || (p->gated && !p->gate_up_interleaved));
    case FT_FMT_MXFP4:
        return p->w13_scale && p->w2_scale && p->hidden % 32 == 0 && p->inter % 32 == 0;
    case FT_FMT_NVFP4:
        return p->w13_scale && p->w2_scale && p->w13_scale_2 && p->w2_scale_2 &&
               p->hidden % 16 == 0 && p->inter % 16 == 0 && p->w13_scale_2_n >= 0 &&
               p->w13_scale_2_n <= (p->gated ? 2 : 1);
    default: return 0;
    }
}

/* Weight and scale geometry of the (validated) pool. */
static void set_geometry(ft_executor *ex) {
    ft_pool_desc *p = &ex->pool;
    const int64_t H = p->hidden, I = p->inter, R = ex->up_rows;
    ex->esz = p->format == FT_FMT_DENSE ? dtype_size(p->dtype) : 1;
    ex->s13_div = ex->s2_div = 1;
    ex->s13_rows = R;
    ex->s2_rows = H;
    ex->s13_up_first = 0;
    switch (p->format) {
    case FT_FMT_FP8_BLOCK: {
        const int64_t bn = p->block_n, bk = p->block_k;
        ex->w13_row_bytes = (size_t)H;
        ex->w2_row_bytes = (size_t)I;
        ex->s13_div = ex->s2_div = bn;
        if (p->w13_scale_split) {
            ex->s13_up_first = (I + bn - 1) / bn;
            ex->s13_rows = 2 * ex->s13_up_first;
        } else {
            ex->s13_rows = (R + bn - 1) / bn;
        }
        ex->s2_rows = (H + bn - 1) / bn;
        ex->s13_row_bytes = (size_t)((H + bk - 1) / bk) * sizeof(float);
        ex->s2_row_bytes = (size_t)((I + bk - 1) / bk) * sizeof(float);
        break;
    }
    case FT_FMT_MXFP4:
    case FT_FMT_NVFP4: {
        const int64_t gs = p->format == FT_FMT_MXFP4 ? 32 : 16;
        ex->w13_row_bytes = (size_t)H / 2;
        ex->w2_row_bytes = (size_t)I / 2;
        ex->s13_row_bytes = (size_t)(H / gs);
        ex->s2_row_bytes = (size_t)(I / gs);
        if (p->format == FT_FMT_NVFP4 && p->w13_scale_2_n == 0) p->w13_scale_2_n = p->gated ? 2 : 1;
        break;
    }
    default:
        ex->w13_row_bytes = (size_t)H * ex->esz;
        ex->w2_row_bytes = (size_t)I * ex->esz;
        ex->s13_row_bytes = ex->s2_row_bytes = 0;
        break;
    }
}

/* Tiles for the kernel path in use: an AMX path on a dense BF16 pool, H and I % 32 == 0. */
static void set_tiles(ft_executor *ex) {
    const ft_pool_desc *p = &ex->pool;
    ex->tiles = (ex->isa == FT_ISA_AMX || ex->isa == FT_ISA_AMX_EMULATED) &&
                p->format == FT_FMT_DENSE && p->dtype == FT_DTYPE_BF16 &&
                p->hidden % FT_KCHUNK == 0 && p->inter % FT_KCHUNK == 0;
    ex->tile = emulated_tile;
#if FT_HAVE_AMX
    if (ex->isa == FT_ISA_AMX) ex->tile = amx_tile;
#endif
}

int ft_executor_create(const ft_pool_desc *pool, int num_threads, int isa, int spin_us,
                       int pin_threads, ft_executor **out) {
    if (!pool || !out || !pool->w13 || !pool->w2 || pool->hidden <= 0 || pool->inter <= 0 ||
        pool->n_experts <= 0 || !pool_valid(pool))
        return FT_ERR_ARG;
    pthread_once(&ft_lut_once, init_luts);
    int chosen = resolve_isa(isa);
    if (chosen < 0) return chosen;
    int n_cpus = 1, n_cores = 1;
    int *cpus = ordered_cpus(&n_cpus, &n_cores);
    if (!cpus) return FT_ERR_NOMEM;
    if (num_threads <= 0) num_threads = n_cores;

    ft_executor *ex = (ft_executor *)aligned_or_null(sizeof *ex);
    if (!ex) {
        free(cpus);
        return FT_ERR_NOMEM;
    }
    memset(ex, 0, sizeof *ex);
    ex->pool = *pool;
    ex->pool.gated = pool->gated ? 1 : 0;
    ex->pool.gate_up_interleaved = ex->pool.gated && pool->gate_up_interleaved ? 1 : 0;
    ex->pool.w13_scale_split = pool->w13_scale_split ? 1 : 0;
    ex->up_rows = (int64_t)pool->inter * (ex->pool.gated ? 2 : 1);
    set_geometry(ex);
    ex->isa = chosen;
    ex->kern = select_kernel(chosen, pool->dtype, pool->format);
    ex->tile_min = FT_DEFAULT_TILE_MIN;
    set_tiles(ex);
    ex->nthreads = num_threads;
    ex->dynamic = 1;
    ex->spin_us = spin_us < 0 ? FT_DEFAULT_SPIN_US : spin_us;
    pthread_mutex_init(&ex->run_lock, NULL);
    ex->threads = (pthread_t *)calloc((size_t)num_threads, sizeof(pthread_t));
    ex->thread_cpu = (int *)calloc((size_t)num_threads, sizeof(int));
    ex->stream_sums = (ft_padded_u64 *)aligned_or_null(sizeof(ft_padded_u64) * num_threads);
    if (!ex->threads || !ex->thread_cpu || !ex->stream_sums) {
        free(cpus);
        ex->nthreads = 1;
        ft_executor_destroy(ex);
        return FT_ERR_NOMEM;
    }
    /* Worker i (1-based) takes cpus[i]: one per physical core first; the caller stays
     * unpinned on what is left (cpus[0]'s core when the scheduler lets it). */
    for (int i = 1; i < num_threads; i++) {
        ex->thread_cpu[i - 1] = pin_threads ? cpus[i % n_cpus] : -1;
        ft_worker_arg *arg = (ft_worker_arg *)malloc(sizeof *arg);
        if (!arg) {
            free(cpus);
            stop_workers(ex, i - 1);
            ex->nthreads = 1;
            ft_executor_destroy(ex);
            return FT_ERR_NOMEM;
        }
        arg->ex = ex;
        arg->tid = i;
        if (pthread_create(&ex->threads[i - 1], NULL, worker_main, arg) != 0) {
            free(arg);
            free(cpus);
            stop_workers(ex, i - 1);
            ex->nthreads = 1;
            ft_executor_destroy(ex);
            return FT_ERR_THREAD;
        }
    }
    free(cpus);
    /* Return with every worker running and pinned, so that the first call and
     * ft_executor_num_pinned see the final state. */
    while (atomic_load(&ex->nstarted) < num_threads - 1) sched_yield();
    *out = ex;
    return FT_OK;
}

void ft_executor_destroy(ft_executor *ex) {
    if (!ex) return;
    if (ex->nthreads > 1) stop_workers(ex, ex->nthreads - 1);
    pthread_mutex_destroy(&ex->run_lock);
    free_workspace(ex);
    free(ex->threads);
    free(ex->thread_cpu);
    free(ex->stream_sums);
    free(ex);
}

int ft_executor_set_isa(ft_executor *ex, int isa) {
    if (!ex) return FT_ERR_ARG;
    int chosen = resolve_isa(isa);
    if (chosen < 0) return chosen;
    pthread_mutex_lock(&ex->run_lock);
    ex->isa = chosen;
    ex->kern = select_kernel(chosen, ex->pool.dtype, ex->pool.format);
    set_tiles(ex);
    pthread_mutex_unlock(&ex->run_lock);
    return FT_OK;
}

int ft_executor_set_tile_min(ft_executor *ex, int min_tokens) {
    if (!ex || min_tokens < 1) return FT_ERR_ARG;
    pthread_mutex_lock(&ex->run_lock);
    ex->tile_min = min_tokens;
    pthread_mutex_unlock(&ex->run_lock);
    return FT_OK;
}

int ft_executor_tile_min(const ft_executor *ex) { return ex ? ex->tile_min : FT_ERR_ARG; }
int ft_executor_tiled(const ft_executor *ex) { return ex ? ex->tiles : FT_ERR_ARG; }

int ft_executor_isa(const ft_executor *ex) { return ex ? ex->isa : FT_ERR_ARG; }

int ft_executor_set_schedule(ft_executor *ex, int dynamic) {
    if (!ex || (dynamic != 0 && dynamic != 1)) return FT_ERR_ARG;
    pthread_mutex_lock(&ex->run_lock);
    ex->dynamic = dynamic;
    pthread_mutex_unlock(&ex->run_lock);
    return FT_OK;
}

int ft_executor_stall_worker(ft_executor *ex, int tid, int stall_us) {
    if (!ex || tid < 1 || tid >= ex->nthreads || stall_us < 0) return FT_ERR_ARG;
    atomic_store(&ex->stall, stall_us ? ((uint64_t)tid << 32) | (uint32_t)stall_us : 0);
    return FT_OK;
}

int ft_executor_schedule(const ft_executor *ex) { return ex ? ex->dynamic : FT_ERR_ARG; }
int ft_executor_num_threads(const ft_executor *ex) { return ex ? ex->nthreads : FT_ERR_ARG; }
int ft_executor_num_pinned(const ft_executor *ex) {
    return ex ? atomic_load(&((ft_executor *)ex)->npinned) : FT_ERR_ARG;
}

/* ------------------------------------------------------------------------------------ */
/* A call                                                                               */
/* ------------------------------------------------------------------------------------ */

static int grow(void **p, size_t bytes) {
    void *q = aligned_or_null(bytes);
    if (!q) return 0;
    free(*p);
    *p = q;
    return 1;
}

static int reserve(ft_executor *ex, int32_t n_items, int32_t n_rows) {
    if (n_items > ex->cap_items) {
        size_t n = (size_t)n_items;
        if (!grow((void **)&ex->keys, n * sizeof(uint64_t)) ||
            !grow((void **)&ex->groups, n * sizeof(ft_group)) ||
            !grow((void **)&ex->s_rows, n * sizeof(int32_t)) ||
            !grow((void **)&ex->s_weights, n * sizeof(float)) ||
            !grow((void **)&ex->s_x, n * sizeof(void *)) ||
            !grow((void **)&ex->s_inter, n * sizeof(void *)) ||
            !grow((void **)&ex->inter, n * ex->inter_stride)) {
            ex->cap_items = 0; /* some arrays may now be smaller than cap_items */
            return FT_ERR_NOMEM;
        }
        ex->cap_items = n_items;
    }
    if (n_rows > ex->cap_rows) {
        if (!grow((void **)&ex->row_map, (size_t)n_rows * sizeof(int32_t))) return FT_ERR_NOMEM;
        ex->cap_rows = n_rows;
    }
    return FT_OK;
}

static int reserve_xrows(ft_executor *ex, int32_t n_xrows) {
    if (n_xrows > ex->cap_xrows) {
        if (!grow((void **)&ex->xconv, (size_t)n_xrows * ex->x_stride)) return FT_ERR_NOMEM;
        ex->cap_xrows = n_xrows;
    }
    return FT_OK;
}

static void sort_keys(uint64_t *k, int n) {
    for (int i = 1; i < n; i++) { /* insertion sort: n is a few dozen at most per call */
        uint64_t v = k[i];
        int j = i - 1;
        while (j >= 0 && k[j] > v) {
            k[j + 1] = k[j];
            j--;
        }
        k[j + 1] = v;
    }
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void convert_row(void *dst, const void *src, int src_dtype, int n, int to_bf16) {
    for (int i = 0; i < n; i++) {
        float v = load_elem(src, i, src_dtype);
        if (to_bf16)
            ((uint16_t *)dst)[i] = f32_to_bf16(v);
        else
            ((float *)dst)[i] = v;
    }
}

static int run_locked(ft_executor *ex, ft_moe_task *t) {
    const ft_pool_desc *p = &ex->pool;
    const int H = p->hidden;
    int32_t n = t->n_items_ptr ? *t->n_items_ptr : t->n_items;
    if (n < 0 || t->n_rows < 0 || t->x_dtype < FT_DTYPE_F32 || t->x_dtype > FT_DTYPE_BF16 ||
        (n > 0 && (!t->rows || !t->experts || !t->weights || !t->x)) ||
        (t->n_rows > 0 && !t->out) || t->x_row_stride < H || t->out_row_stride < H)
        return FT_ERR_ARG;
    for (int32_t i = 0; i < n; i++) {
        if (t->experts[i] < 0) continue;
        if (t->experts[i] >= p->n_experts) {
            t->error_index = i;
            return FT_ERR_EXPERT;
        }
        if (t->rows[i] < 0 || t->rows[i] >= t->n_rows) {
            t->error_index = i;
            return FT_ERR_ROW;
        }
    }
    const size_t act_esz = ex->kern.x_bf16 ? 2 : 4;
    ex->x_stride = round_up((size_t)H * act_esz, FT_ALIGN);
    size_t inter_stride = round_up((size_t)p->inter * act_esz, FT_ALIGN);
    if (inter_stride != ex->inter_stride) { /* the kernel path changed: regrow */
        ex->inter_stride = inter_stride;
        ex->cap_items = 0;
        ex->cap_xrows = 0;
    }
    int rc = reserve(ex, n, t->n_rows);
    if (rc) return rc;

    /* Group the valid items by expert. */
    int nv = 0;
    for (int32_t i = 0; i < n; i++)
        if (t->experts[i] >= 0)
            ex->keys[nv++] = ((uint64_t)(uint32_t)t->experts[i] << 32) | (uint32_t)i;
    if (nv == 0) {
        if (t->flags & FT_RUN_ZERO_OUTPUT)
            for (int r = 0; r < t->n_rows; r++)
                memset(t->out + (size_t)r * t->out_row_stride, 0, (size_t)H * sizeof(float));
        return FT_OK;
    }
    if (nv <= 64)
        sort_keys(ex->keys, nv);
    else
        qsort(ex->keys, (size_t)nv, sizeof(uint64_t), cmp_u64);

    /* Group the sorted items by expert; experts with at least tile_min tokens run on tiles
     * (their tokens packed into xt by the compute threads). */
    int ng = 0;
    int64_t units_per_group = (p->inter + FT_INTER_BLOCK - 1) / FT_INTER_BLOCK;
    for (int s = 0; s < nv; s++) {
        uint32_t i = (uint32_t)ex->keys[s];
        int32_t e = (int32_t)(ex->keys[s] >> 32);
        if (ng == 0 || ex->groups[ng - 1].expert != e) {
            ex->groups[ng].expert = e;
            ex->groups[ng].start = s;
            ex->groups[ng].count = 0;
            ex->groups[ng].unit_start = ng * units_per_group;
            ng++;
        }
        ex->groups[ng - 1].count++;
        ex->s_rows[s] = t->rows[i];
        ex->s_weights[s] = t->weights[i];
    }
    int64_t tblocks = 0;
    for (int gi = 0; gi < ng; gi++) {
        ft_group *g = &ex->groups[gi];
        g->tiled = ex->tiles && g->count >= ex->tile_min;
        g->tile_block = tblocks;
        atomic_store_explicit(&g->packed, 0, memory_order_relaxed);
        if (g->tiled) tblocks += (g->count + FT_TILE - 1) / FT_TILE;
    }
    if (tblocks > ex->cap_tblocks) {
        if (!grow((void **)&ex->xt, (size_t)tblocks * 32 * (size_t)H) ||
            !grow((void **)&ex->it, (size_t)tblocks * 32 * (size_t)p->inter)) {
            ex->cap_tblocks = 0;
            return FT_ERR_NOMEM;
        }
        ex->cap_tblocks = tblocks;
    }

    /* Activation vectors of the other experts' items: x itself when already in the
     * kernel's format, else converted once per distinct token row. */
    int x_native = ex->kern.x_bf16 ? t->x_dtype == FT_DTYPE_BF16 : t->x_dtype == FT_DTYPE_F32;
    int n_xrows = 0;
    if (!x_native) {
        for (int r = 0; r < t->n_rows; r++) ex->row_map[r] = -1;
        for (int gi = 0; gi < ng; gi++) {
            const ft_group *g = &ex->groups[gi];
            if (g->tiled) continue;
            for (int s = g->start; s < g->start + g->count; s++)
                if (ex->row_map[ex->s_rows[s]] < 0) ex->row_map[ex->s_rows[s]] = n_xrows++;
        }
        if ((rc = reserve_xrows(ex, n_xrows))) return rc;
        const size_t x_row_bytes = (size_t)t->x_row_stride * dtype_size(t->x_dtype);
        for (int r = 0; r < t->n_rows; r++)
            if (ex->row_map[r] >= 0)
                convert_row(ex->xconv + (size_t)ex->row_map[r] * ex->x_stride,
                            (const uint8_t *)t->x + (size_t)r * x_row_bytes, t->x_dtype, H,
                            ex->kern.x_bf16);
    }
    for (int gi = 0; gi < ng; gi++) {
        const ft_group *g = &ex->groups[gi];
        if (g->tiled) continue;
        for (int s = g->start; s < g->start + g->count; s++) {
            int32_t row = ex->s_rows[s];
            ex->s_x[s] =
                x_native ? (const void *)((const uint8_t *)t->x +
                                          (size_t)row * (size_t)t->x_row_stride * act_esz)
                         : (const void *)(ex->xconv + (size_t)ex->row_map[row] * ex->x_stride);
            ex->s_inter[s] = ex->inter + (size_t)s * ex->inter_stride;
        }
    }
    ex->n_groups = ng;
    ex->n_units = (int64_t)ng * units_per_group;
    ex->task = t;
    if (!ex->dynamic || ex->n_units >= INT32_MAX) { /* the tagged counters hold 32 bits */
        dispatch(ex, JOB_MOE);
        return FT_OK;
    }
    /* Every chunk of the previous dynamic call is done, so no thread holds one; a thread
     * still inside run_dynamic for it finds the new tag and leaves, or joins this call. */
    uint32_t call = atomic_load_explicit(&ex->call, memory_order_relaxed) + 1;
    atomic_store_explicit(&ex->total1[call & 1], ex->n_units, memory_order_relaxed);
    atomic_store_explicit(&ex->done1, tagged(call, 0), memory_order_relaxed);
    atomic_store_explicit(&ex->next2, tagged(call, 0), memory_order_relaxed);
    atomic_store_explicit(&ex->done2, tagged(call, 0), memory_order_relaxed);
    atomic_store_explicit(&ex->next1, tagged(call, 0), memory_order_release);
    atomic_store_explicit(&ex->call, call, memory_order_release);
    dispatch(ex, JOB_MOE_DYNAMIC); /* the gen bump wakes the workers that sleep */
    return FT_OK;
}

void ft_cpu_moe_run(void *task) {
    ft_moe_task *t = (ft_moe_task *)task;
    if (!t) return;
    t->error_index = -1;
    ft_executor *ex = t->executor;
    if (!ex) {
        t->status = FT_ERR_ARG;
        return;
    }
    pthread_mutex_lock(&ex->run_lock);
    t->status = run_locked(ex, t);
    pthread_mutex_unlock(&ex->run_lock);
    /* A failed run must not leave a stale partial behind for the caller to merge: with
     * FT_RUN_ZERO_OUTPUT the output is zero whatever happened (the status says why). */
    if (t->status != FT_OK && (t->flags & FT_RUN_ZERO_OUTPUT) && t->out && t->n_rows > 0 &&
        t->out_row_stride >= ex->pool.hidden)
        for (int r = 0; r < t->n_rows; r++)
            memset(t->out + (size_t)r * t->out_row_stride, 0,
                   (size_t)ex->pool.hidden * sizeof(float));
}

int ft_executor_run(ft_executor *ex, const void *x, int32_t x_dtype, int64_t x_row_stride,
                    int32_t n_rows, const int32_t *rows, const int32_t *experts,
                    const float *weights, int32_t n_items, float *out,
                    int64_t out_row_stride, int32_t flags, int32_t *error_index) {
    ft_moe_task t;
    memset(&t, 0, sizeof t);
    t.executor = ex;
    t.x = x;
    t.x_row_stride = x_row_stride;
    t.x_dtype = x_dtype;
    t.n_rows = n_rows;
    t.rows = rows;
    t.experts = experts;
    t.weights = weights;
    t.n_items = n_items;
    t.out = out;
    t.out_row_stride = out_row_stride;
    t.flags = flags;
    ft_cpu_moe_run(&t);
    if (error_index) *error_index = t.error_index;
    return t.status;
}

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

void ft_doorbell_serve(ft_doorbell *db) {
    if (!db || !db->task || !db->ring || !db->done || !db->n_rows_ptr) return;
    int64_t last = *db->done;
    int64_t idle_since = now_us();
    for (;;) {
        int64_t seq = *db->ring;
        if (seq != last) {
            /* the GPU wrote the inputs before the ring (system-scope fence): read after it */
            atomic_thread_fence(memory_order_acquire);
            db->task->n_rows = *db->n_rows_ptr;
            ft_cpu_moe_run(db->task);
            if (db->task->status != FT_OK && db->status == FT_OK) {
                db->status = db->task->status;
                db->error_index = db->task->error_index;
            }
            db->served++;
            atomic_thread_fence(memory_order_release); /* the partial before done */
            *db->done = seq;
            last = seq;
            idle_since = now_us();
            continue;
        }
        if (db->stop) return;
        if (now_us() - idle_since < db->spin_us) {
#if FT_X86
            _mm_pause();
#endif
        } else {
            usleep(db->sleep_us > 0 ? (useconds_t)db->sleep_us : 50);
        }
    }
}

uint64_t ft_executor_stream_read(ft_executor *ex, const void *buf, size_t nbytes) {
    if (!ex || !buf) return 0;
    pthread_mutex_lock(&ex->run_lock);
    ex->stream_buf = (const uint8_t *)buf;
    ex->stream_bytes = nbytes;
    dispatch(ex, JOB_STREAM);
    uint64_t s = 0;
    for (int i = 0; i < ex->nthreads; i++) s += ex->stream_sums[i].value;
    pthread_mutex_unlock(&ex->run_lock);
    return s;
}
