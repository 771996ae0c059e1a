/* The nsa backend's host twins, compiled (see planner/native/twin.h): deep_gemm's paged
 * MQA schedule and the sparse MLA split table. Each writes what its numpy twin writes
 * (backends/deepgemm/schedule.py schedule_numpy, backends/nsa/sparse_mla_plan.py
 * split_plan_numpy) and declines what numpy would raise on or compute differently. */
#include "twin.h"

#define SPLIT_KV 256

/* Request b's work units: ceil(last length / 256), the last of its next_n lengths. */
static int64_t units_of(const int32_t *lens, int64_t next_n, int64_t b) {
    return ((int64_t)lens[b * next_n + next_n - 1] + SPLIT_KV - 1) / SPLIT_KV;
}

/* out [num_sms + 1, 2]: the (request, split) where each SM starts. P0: next_n, P1: num_sms,
 * P2: layout (0: "0.1.0", the remainder on the first SMs; 1: "new", on the last ones, the
 * request clamped and an explicit end row; 2: any other name, which numpy places as "new"
 * without the clamp or the end row). */
FP_TWIN(fp_twin_paged_mqa_schedule) {
    int64_t next_n = r[R_P0], sms = r[R_P1], layout = r[R_P2];
    int64_t len = TWIN_LEN(0);
    if (r[R_NDIM] != 2 || r[R_D0] != sms + 1 || r[R_D1] != 2) return DECLINE;
    if (next_n < 1 || sms < 1 || len == 0 || len % next_n != 0) return DECLINE;
    int64_t batch = len / next_n;
    const int32_t *lens = TWIN_IN(0);
    int32_t *out = TWIN_OUT;
    int64_t total = 0;
    for (int64_t b = 0; b < batch; b++) {
        /* floor division in numpy: C's truncation agrees only for lengths > -256, and a
         * negative unit count would unsort the prefix sums numpy searches */
        if (lens[b * next_n + next_n - 1] < 0) return DECLINE;
        total += units_of(lens, next_n, b);
    }
    int64_t q = total / sms, rem = total % sms;
    int64_t last_units = units_of(lens, next_n, batch - 1);
    int64_t req = 0, upto = 0; /* upto: the prefix sum before request req */
    for (int64_t s = 0; s <= sms; s++) {
        int64_t over = s - (sms - rem);
        int64_t start = s * q + (layout == 0 ? (s < rem ? s : rem) : (over > 0 ? over : 0));
        /* req: how many inclusive prefix sums are <= start (searchsorted "right") */
        while (req < batch && upto + units_of(lens, next_n, req) <= start)
            upto += units_of(lens, next_n, req++);
        int64_t row = req, before = upto;
        if (layout == 1 && row == batch) { /* clamped to the last request */
            row = batch - 1;
            before = upto - last_units;
        }
        out[2 * s] = wrap32(row);
        out[2 * s + 1] = wrap32(start - before);
    }
    if (layout == 1) {
        out[2 * sms] = wrap32(batch);
        out[2 * sms + 1] = 0;
    }
    return 0;
}

/* out flat [rows * (splits + 1)]: row r's split s starts at min(s * chunk, len), where
 * len = clamp(topk_lens[r], 0, topk) and chunk is whole tiles of block_n. P0: topk, P1:
 * block_n. In int64 throughout: numpy's int32 path never overflows where it is taken, and
 * its int64 path casts to int32 as wrap32 does. */
FP_TWIN(fp_twin_sparse_mla_split_plan) {
    int64_t rows = TWIN_LEN(0), cells = TWIN_NUMEL, topk = r[R_P0], block_n = r[R_P1];
    if (r[R_NDIM] != 1) return DECLINE;
    if (rows == 0) return cells == 0 ? 0 : DECLINE;
    if (cells % rows != 0 || cells / rows < 2) return DECLINE;
    int64_t splits = cells / rows - 1;
    const int32_t *lens = TWIN_IN(0);
    int32_t *out = TWIN_OUT;
    for (int64_t i = 0; i < rows; i++) {
        int64_t n = lens[i] < 0 ? 0 : lens[i];
        if (n > topk) n = topk;
        int64_t chunk = ((n + block_n - 1) / block_n + splits - 1) / splits;
        chunk = (chunk < 1 ? 1 : chunk) * block_n;
        for (int64_t s = 0; s <= splits; s++) {
            int64_t at = s * chunk;
            out[i * (splits + 1) + s] = wrap32(at < n ? at : n);
        }
    }
    return 0;
}
