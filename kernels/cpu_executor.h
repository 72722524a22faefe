/* FreeToken's CPU expert executor: runs missed MoE experts in place on the host expert pool
 * (paper §3.2 and §4.1, "graph-resident CPU execution").
 *
 * The pool's banks hold every routed expert under the flattened layer-expert id l*E + e:
 *   w13 [L*E, 2I, H]  (rows 0..I-1 gate, rows I..2I-1 up; [L*E, I, H] when not gated)
 *   w2  [L*E, H, I]
 *   optional fp32 biases w13_bias [L*E, 2I] (or [L*E, I]) and w2_bias [L*E, H].
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

/* Activation of the gate projection (gated) or of the single projection (not gated). */
enum { FT_ACT_SILU = 0, FT_ACT_GELU_TANH = 1 };

/* Kernel paths. AVX512 needs AVX-512 F/BW/VL/DQ; AVX512_BF16 also AVX512_BF16 and then
 * runs BF16 weights with vdpbf16ps (activations rounded to BF16); for FP16/FP32 weights it
 * is the AVX512 path. AUTO picks the best the CPU supports. */
enum {
    FT_ISA_AUTO = 0,
    FT_ISA_PORTABLE = 1,
    FT_ISA_AVX2 = 2,
    FT_ISA_AVX512 = 3,
    FT_ISA_AVX512_BF16 = 4
};

/* Status codes (0 or negative). */
enum {
    FT_OK = 0,
    FT_ERR_ARG = -1,    /* a null pointer, a bad dtype/activation/size */
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
    const float *w13_bias;  /* [n_experts, gated ? 2*inter : inter] fp32, or NULL */
    const float *w2_bias;   /* [n_experts, hidden] fp32, or NULL */
    int64_t n_experts;      /* L*E: rows of every bank */
    int32_t dtype;          /* FT_DTYPE_* of w13 and w2 */
    int32_t hidden;         /* H */
    int32_t inter;          /* I */
    int32_t gated;          /* 1: act(gate) * up; 0: act(up) */
    int32_t activation;     /* FT_ACT_* */
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

/* STREAM-like read: every compute thread reads its share of buf[0:nbytes] with the
 * executor's kernel path. Returns the sum (mod 2^64) of the buffer's 64-bit little-endian
 * words plus each byte of a final partial word, so that the reads cannot be elided. */
uint64_t ft_executor_stream_read(ft_executor *ex, const void *buf, size_t nbytes);

/* 1 if this CPU (and OS) supports kernel path isa, else 0; FT_ISA_AUTO is always 1. */
int ft_isa_supported(int isa);
/* The best kernel path this CPU supports. */
int ft_best_isa(void);
/* "auto", "portable", "avx2", "avx512", "avx512_bf16", or "unknown". */
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
