/* What a compiled host twin sees: one int32 staging buffer and one record of int64s.
 *
 * A host twin (planner/host_pass.py) computes an eager plan's per-request arithmetic on the
 * host, into the staging buffer after the inputs. Its numpy form is the authority; a
 * compiled form is a screen in front of it, like the staging screen: it returns 0 only
 * when it wrote exactly what the numpy twin writes, and non-zero ("declined") for any case
 * it does not handle, after which the whole pass runs in numpy. Every pass is one call of
 * fp_host_pass (host_pass.c), which runs each step's function in program order.
 *
 * Backends write their twins' C against this header; planner.native builds it in.
 */
#ifndef FP_TWIN_H
#define FP_TWIN_H
#include <stdint.h>

/* One step's record: the function, the output (offset, rank, two dims), up to three inputs
 * (offset, length), up to four integer parameters. Offsets and lengths in int32 elements. */
enum {
    R_FN, R_OUT, R_NDIM, R_D0, R_D1,
    R_IN0, R_LEN0, R_IN1, R_LEN1, R_IN2, R_LEN2,
    R_P0, R_P1, R_P2, R_P3,
    R_SIZE
};

typedef int (*fp_twin_fn)(int32_t *buf, const int64_t *rec);

#define FP_TWIN(name) int name(int32_t *buf, const int64_t *r)
#define TWIN_OUT (buf + r[R_OUT])
#define TWIN_IN(k) ((const int32_t *)(buf + r[R_IN0 + 2 * (k)]))
#define TWIN_LEN(k) (r[R_LEN0 + 2 * (k)])
#define TWIN_NUMEL (r[R_D0] * r[R_D1])
#define DECLINE 1

/* numpy's int32 arithmetic wraps; C's signed overflow is undefined, unsigned wraps. */
static inline int32_t wrap32(int64_t v) { return (int32_t)(uint32_t)(uint64_t)v; }
static inline int32_t add32(int32_t a, int32_t b) { return (int32_t)((uint32_t)a + (uint32_t)b); }
static inline int32_t sub32(int32_t a, int32_t b) { return (int32_t)((uint32_t)a - (uint32_t)b); }

#endif
