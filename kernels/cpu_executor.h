/* FreeToken's CPU expert executor: runs missed MoE experts in place on the host expert pool
 * (paper §3.2 and §4.1, "graph-resident CPU execution").
 *
 * The pool's banks hold every routed expert under the flattened layer-expert id l*E + e:
 *   w13 [L*E, 2I, H]  (rows 0..I-1 gate, rows I..2I-1 up, or interleaved gate/up rows;
 *                      [L*E, I, H] when not gated)
 *   w2  [L*E, H, I]
 *   optional biases w13_bias [L*E, 2I] (or [L*E, I]) and w2_bias [L*E, H] (fp32 or bf16),
 * dense (f32/f16/bf16) or quantized (FP8 e4m3 with block scales, MXFP4, NVFP4: see
 * FT_FMT_*), dequantized inside the kernels.
 * A call takes work items (token row, flat expert id, gate weight) and adds, in fp32,
 *   out[row, :] += weight * (w2 · act(gate(x[row]) + b_gate) * (up(x[row]) + b_up) + b2)
 * reading each weight byte once. A persistent pool of pinned worker threads splits every
 * expert's gate/up rows (phase 1) and then the down projection's output rows (phase 2)
 * into chunks that any awake worker takes, so a single decode token with one missed expert
 * can use every core, and a worker that is asleep or descheduled does not hold the call up.
 *
 * Linux only (futex, sched_setaffinity). The text between the FT_CDEF markers is plain C
 * that the cffi build script feeds to cffi as the module's declarations. */
#ifndef FT_CPU_EXECUTOR_H
#define FT_CPU_EXECUTOR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* FT_CDEF_BEGIN */
/* Element types of weights and activations. */
enum { FT_DTYPE_F32 = 0, FT_DTYPE_F16 = 1, FT_DTYPE_BF16 = 2 };

/* Activation of the gate projection (gated) or of the single projection (not gated).
 * FT_ACT_SWIGLU_OAI (gated only; GPT-OSS, SGLang's Triton runner with gemm1_alpha): with
 * g, u the gate and up projections plus their biases, g = min(g, limit),
 * u = clamp(u, -limit, limit), h = g * sigmoid(alpha * g) * (u + 1). */
enum { FT_ACT_SILU = 0, FT_ACT_GELU_TANH = 1, FT_ACT_SWIGLU_OAI = 2 };

/* Weight formats (one per pool). The weights stay quantized in the banks and are
 * dequantized inside the kernels (fp32 accumulation).
 *   DENSE:     w13/w2 in ft_pool_desc.dtype.
 *   FP8_BLOCK: w13/w2 float8_e4m3fn bytes; w13_scale fp32 [n_experts, ceil(R/block_n),
 *              ceil(H/block_k)] (or [n_experts, 2*ceil(I/block_n), ceil(H/block_k)] with
 *              w13_scale_split: gate and up rows blocked separately), w2_scale fp32
 *              [n_experts, ceil(H/block_n), ceil(I/block_k)];
 *              w[r, c] = e4m3(q[r, c]) * scale[r / block_n, c / block_k]. NaN codes
 *              (0x7f, 0xff) are not detected.
 *   MXFP4:     w13 uint8 [n_experts, R, H/2], w2 uint8 [n_experts, H, I/2], two e2m1 values
 *              per byte (low nibble first); w13_scale uint8 e8m0 [n_experts, R, H/32],
 *              w2_scale [n_experts, H, I/32]; w = e2m1(q) * 2^(s - 127). H, I % 32 == 0.
 *   NVFP4:     w13/w2 packed e2m1 as MXFP4; w13_scale e4m3 [n_experts, R, H/16], w2_scale
 *              e4m3 [n_experts, H, I/16]; w13_scale_2 fp32 [n_experts, w13_scale_2_n]
 *              (2: index 0 for gate rows, 1 for up rows; 1: one per expert), w2_scale_2
 *              fp32 [n_experts]; w = e2m1(q) * e4m3(s) * scale_2. H, I % 16 == 0.
 * (R = gated ? 2I : I.) */
enum { FT_FMT_DENSE = 0, FT_FMT_FP8_BLOCK = 1, FT_FMT_MXFP4 = 2, FT_FMT_NVFP4 = 3 };

/* Kernel paths. AVX512 needs AVX-512 F/BW/VL/DQ; AVX512_BF16 also AVX512_BF16 and then
 * runs dense BF16 weights with vdpbf16ps (activations rounded to BF16); for FP16/FP32 and
 * the quantized formats it is the AVX512 path (fp32 FMA). AMX is AVX512_BF16 plus AMX-BF16
 * tiles (16 weight rows x 16 tokens per tile product, fp32 accumulation) for every expert
 * of a call with at least ft_executor_tile_min tokens, when the pool is dense BF16 with H
 * and I multiples of 32 (prefill-sized CPU work); it needs Linux's AMX permission, which
 * ft_isa_supported requests. AMX_EMULATED runs the same tiled layouts with the tile
 * products computed in portable C and everything else on the PORTABLE path: it checks the
 * tiled path on CPUs without AMX. AUTO picks the best of PORTABLE to AVX512_BF16 that the
 * CPU supports (AMX only by name: not yet measured in a server). */
enum {
    FT_ISA_AUTO = 0,
    FT_ISA_PORTABLE = 1,
    FT_ISA_AVX2 = 2,
    FT_ISA_AVX512 = 3,
    FT_ISA_AVX512_BF16 = 4,
    FT_ISA_AMX = 5,
    FT_ISA_AMX_EMULATED = 6
};

/* Status codes (0 or negative). */
enum {
    FT_OK = 0,
    FT_ERR_ARG = -1,    /* a null pointer, a bad dtype/format/activation/size */
    FT_ERR_ROW = -2,    /* a token row outside [0, n_rows) */
    FT_ERR_EXPERT = -3, /* a flat expert id >= the pool's number of experts */
    FT_ERR_NOMEM = -4,  /* workspace or thread allocation failed */
    FT_ERR_ISA = -5,    /* the CPU lacks the requested kernel path */
    FT_ERR_THREAD = -6  /* a worker thread could not be started */
};

/* Task flags. */
enum { FT_RUN_ZERO_OUTPUT = 1 }; /* set out[0:n_rows, 0:H] to 0 before accumulating */

typedef struct ft_executor ft_executor;

/* The host expert pool, read in place. Banks are contiguous, leading index l*E + e. */
typedef struct ft_pool_desc {
    const void *w13;        /* [n_experts, gated ? 2*inter : inter, hidden], weight dtype */
    const void *w2;         /* [n_experts, hidden, inter], weight dtype */
    const void *w13_bias;   /* [n_experts, gated ? 2*inter : inter] bias_dtype, or NULL */
    const void *w2_bias;    /* [n_experts, hidden] bias_dtype, or NULL */
    int64_t n_experts;      /* L*E: rows of every bank */
    int32_t dtype;          /* FT_DTYPE_* of w13 and w2 */
    int32_t hidden;         /* H */
    int32_t inter;          /* I */
    int32_t gated;          /* 1: act(gate) * up; 0: act(up) */
    int32_t activation;     /* FT_ACT_* */
    /* Appended fields: all zero / NULL is a dense pool as above. */
    int32_t format;         /* FT_FMT_*; dtype is ignored unless FT_FMT_DENSE */
    int32_t block_n;        /* FP8_BLOCK: rows of a scale block (> 0) */
    int32_t block_k;        /* FP8_BLOCK: columns of a scale block (> 0) */
    int32_t w13_scale_split; /* FP8_BLOCK, gated, not interleaved: w13_scale has
                              * 2*ceil(I/block_n) block rows (gate, then up) */
    const void *w13_scale;  /* block scales of w13 (see FT_FMT_*), NULL when dense */
    const void *w2_scale;   /* block scales of w2 */
    const float *w13_scale_2; /* NVFP4: fp32 [n_experts, w13_scale_2_n] */
    const float *w2_scale_2;  /* NVFP4: fp32 [n_experts] */
    int32_t w13_scale_2_n;  /* NVFP4: 1 or 2 (0: 2 when gated, else 1) */
    int32_t bias_dtype;     /* FT_DTYPE_* of w13_bias and w2_bias (0: fp32) */
    int32_t gate_up_interleaved; /* gated: 1, rows 2j / 2j+1 are gate j / up j; 0: gate
                                  * rows 0..I-1, then up rows I..2I-1 */
    float alpha;            /* FT_ACT_SWIGLU_OAI: sigmoid slope (GPT-OSS 1.702) */
    float limit;            /* FT_ACT_SWIGLU_OAI: clamp limit (GPT-OSS 7.0), > 0 */
} ft_pool_desc;

/* One layer call, self-contained so that a CUDA host-function node can pass its address
 * to ft_cpu_moe_run. Items with expert < 0 are padding and skipped. */
typedef struct ft_moe_task {
    ft_executor *executor;
    const void *x;              /* [n_rows, x_row_stride] activations, x_dtype */
    int64_t x_row_stride;       /* elements between rows of x (>= hidden) */
    int32_t x_dtype;            /* FT_DTYPE_* */
    int32_t n_rows;             /* token rows of x and out */
    const int32_t *rows;        /* [n_items] token row of each item */
    const int32_t *experts;     /* [n_items] flat expert id l*E + e, or < 0 for padding */
    const float *weights;       /* [n_items] gate weight of each item */
    int32_t n_items;            /* item count, used when n_items_ptr is NULL */
    const int32_t *n_items_ptr; /* if not NULL, the item count is read from here at run time */
    float *out;                 /* [n_rows, out_row_stride] fp32, accumulated into */
    int64_t out_row_stride;     /* elements between rows of out (>= hidden) */
    int32_t flags;              /* FT_RUN_* */
    int32_t status;             /* written by the run: FT_OK or an FT_ERR_* code */
    int32_t error_index;        /* written by the run: the offending item, or -1 */
} ft_moe_task;

/* Start an executor on a pool: num_threads compute threads including the caller (<= 0: one
 * per physical core of the process's CPU set), num_threads - 1 of them persistent workers,
 * each pinned to its own physical core when pin_threads is set. Idle workers spin for
 * spin_us microseconds before sleeping on a futex (< 0: the default, 200). The pool
 * descriptor is copied; the banks must outlive the executor. Returns FT_OK or an FT_ERR_*
 * code and sets *out on success. */
int ft_executor_create(const ft_pool_desc *pool, int num_threads, int isa, int spin_us,
                       int pin_threads, ft_executor **out);
/* Stop and join every worker, free everything. NULL is a no-op. */
void ft_executor_destroy(ft_executor *ex);
/* Choose the kernel path for later runs: FT_OK, or FT_ERR_ISA if the CPU lacks it. */
int ft_executor_set_isa(ft_executor *ex, int isa);
/* The kernel path in use (never FT_ISA_AUTO). */
int ft_executor_isa(const ft_executor *ex);
/* Experts with at least min_tokens tokens in a call run on AMX tiles (paths AMX and
 * AMX_EMULATED; >= 1; default 4). FT_OK, or FT_ERR_ARG. */
int ft_executor_set_tile_min(ft_executor *ex, int min_tokens);
/* The tile threshold in use. */
int ft_executor_tile_min(const ft_executor *ex);
/* 1 if later runs use tiles for large enough experts (an AMX path on a dense BF16 pool
 * with H and I multiples of 32), else 0. */
int ft_executor_tiled(const ft_executor *ex);
/* How later runs share the work between the compute threads: 1 (the default), chunks handed
 * out from a counter and completion counted in chunks, so a thread slowed by another busy
 * thread on its core, or still asleep, takes fewer chunks or none, and the call waits only
 * for chunks already taken; 0, one fixed contiguous share per thread, with barriers. Threads
 * that wait for a phase's last chunks spin (yielding the core now and then) without a time
 * limit; spin_us bounds only the spin of idle workers. FT_OK, or FT_ERR_ARG. */
int ft_executor_set_schedule(ft_executor *ex, int dynamic);
/* The schedule in use: 1 dynamic, 0 static. */
int ft_executor_schedule(const ft_executor *ex);
/* Compute threads, the caller included. */
int ft_executor_num_threads(const ft_executor *ex);
/* Workers pinned to their core (every worker has started when create returns). */
int ft_executor_num_pinned(const ft_executor *ex);
/* For tests: worker tid (1 .. num_threads - 1) sleeps stall_us microseconds once, right
 * after it next sees a job (a call, a stream read or the exit) and before it starts it, as a
 * descheduled worker would. FT_OK, or FT_ERR_ARG. */
int ft_executor_stall_worker(ft_executor *ex, int tid, int stall_us);

/* Run one layer call described by a ft_moe_task (the argument is a ft_moe_task *); the
 * result is in task->status. Calls on one executor are serialized. */
void ft_cpu_moe_run(void *task);
/* The same with explicit arguments; returns the status, and the offending item in
 * *error_index (may be NULL). */
int ft_executor_run(ft_executor *ex, const void *x, int32_t x_dtype, int64_t x_row_stride,
                    int32_t n_rows, const int32_t *rows, const int32_t *experts,
                    const float *weights, int32_t n_items, float *out,
                    int64_t out_row_stride, int32_t flags, int32_t *error_index);

/* A doorbell in mapped host memory, so that the GPU starts CPU work without a host-function
 * node (paper §3.2's CPU branch; a layer call without CPU items then costs the GPU nothing
 * but two small kernels). The GPU writes the task's inputs (x, items, *n_items_ptr,
 * *n_rows_ptr), then stores a new sequence number into *ring (system-scope release); the
 * serving thread runs the task and stores the same number into *done, which the GPU waits
 * for before merging. One call is outstanding at a time. */
typedef struct ft_doorbell {
    ft_moe_task *task;          /* the call's inputs and output; n_rows is set per call */
    const volatile int32_t *n_rows_ptr; /* token rows of the call, written by the GPU */
    const volatile int64_t *ring;       /* sequence number of the last posted call */
    volatile int64_t *done;     /* sequence number of the last served call */
    volatile int32_t stop;      /* nonzero: ft_doorbell_serve returns */
    int32_t spin_us;            /* busy-poll this long after the last call ... */
    int32_t sleep_us;           /* ... then poll every sleep_us microseconds */
    int32_t status;             /* first failing run's FT_ERR_* code, or FT_OK */
    int32_t error_index;        /* its offending item */
    int64_t served;             /* calls served */
} ft_doorbell;
/* Serve the doorbell until db->stop is set (call it on a thread of its own). */
void ft_doorbell_serve(ft_doorbell *db);

/* STREAM-like read: every compute thread reads its share of buf[0:nbytes] with the
 * executor's kernel path. Returns the sum (mod 2^64) of the buffer's 64-bit little-endian
 * words plus each byte of a final partial word, so that the reads cannot be elided. */
uint64_t ft_executor_stream_read(ft_executor *ex, const void *buf, size_t nbytes);

/* 1 if this CPU (and OS) supports kernel path isa, else 0; FT_ISA_AUTO is always 1. */
int ft_isa_supported(int isa);
/* The best kernel path this CPU supports. */
int ft_best_isa(void);
/* "auto", "portable", "avx2", "avx512", "avx512_bf16", "amx", "amx_emulated", or
 * "unknown". */
const char *ft_isa_name(int isa);
/* A short English message for a status code. */
const char *ft_strerror(int code);
/* Physical cores in the process's CPU set (logical CPUs when the topology is unknown). */
int ft_physical_cores(void);
/* FT_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* FT_CPU_EXECUTOR_H */
