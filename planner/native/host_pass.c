/* The host pass in one call: every step's compiled twin, in program order (see twin.h).
 * Answers 0 when all of them wrote their outputs, else the 1-based index of the first that
 * declined, after which the caller runs the numpy pass, which rewrites every output. */
#include "twin.h"

int64_t fp_host_pass(int64_t buf, int64_t program, int64_t steps) {
    int32_t *base = (int32_t *)(intptr_t)buf;
    const int64_t *rec = (const int64_t *)(intptr_t)program;
    for (int64_t i = 0; i < steps; i++, rec += R_SIZE) {
        fp_twin_fn fn = (fp_twin_fn)(intptr_t)rec[R_FN];
        if (fn(base, rec) != 0) return i + 1;
    }
    return 0;
}

/* The staging screen, then the host pass, in one call: what an eager plan's staging does
 * between the fill and the copy (each ctypes call costs a few microseconds of Python).
 * Answers -1 when the screen refused the batch (the pass did not run), else fp_host_pass's
 * answer. */
int fp_stage_screen(int32_t *host, const int64_t *a);

int64_t fp_screen_and_pass(int64_t host, int64_t args, int64_t program, int64_t steps) {
    if (fp_stage_screen((int32_t *)(intptr_t)host, (const int64_t *)(intptr_t)args) != 0)
        return -1;
    return fp_host_pass(host, program, steps);
}

/* The longest and the total of n lengths (int32, or int64 when wide), into out[0] and out[1]:
 * what an eager plan's dimensions need before anything is staged, as numpy's max() and
 * sum() give them (the int64 sum wrapping as numpy's does). */
void fp_max_sum(int64_t values, int64_t n, int64_t wide, int64_t out) {
    int64_t *result = (int64_t *)(intptr_t)out;
    int64_t top = 0;
    uint64_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t v = wide ? ((const int64_t *)(intptr_t)values)[i]
                         : ((const int32_t *)(intptr_t)values)[i];
        if (i == 0 || v > top) top = v;
        total += (uint64_t)v;
    }
    result[0] = top;
    result[1] = (int64_t)total;
}

/* int64s per record, so the Python side can check it writes records of this layout. */
int64_t fp_twin_record_size(void) { return R_SIZE; }
