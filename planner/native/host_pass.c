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
