/* FlashInfer's per-request host twins, compiled (see planner/native/twin.h): what the numpy
 * twins in host_twins.py write, for a page size the packer checked to be >= 1. */
#include "twin.h"

/* ceil(len / page) rounded toward zero, as the reference's trunc division. P0: page. */
FP_TWIN(fp_twin_pages_per_request) {
    int64_t n = r[R_D0];
    if (r[R_NDIM] != 1 || TWIN_LEN(0) != n) return DECLINE;
    const int32_t *seq = TWIN_IN(0);
    int32_t page = (int32_t)r[R_P0];
    for (int64_t i = 0; i < n; i++) TWIN_OUT[i] = add32(seq[i], page - 1) / page;
    return 0;
}

/* (len - 1) mod page + 1, the remainder taking the sign of len - 1 (torch.fmod). P0: page. */
FP_TWIN(fp_twin_last_page_len) {
    int64_t n = r[R_D0];
    if (r[R_NDIM] != 1 || TWIN_LEN(0) != n) return DECLINE;
    const int32_t *seq = TWIN_IN(0);
    int32_t page = (int32_t)r[R_P0];
    for (int64_t i = 0; i < n; i++) TWIN_OUT[i] = sub32(seq[i], 1) % page + 1;
    return 0;
}
