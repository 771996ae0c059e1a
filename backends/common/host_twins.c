/* The generic and ragged ops' host twins, compiled (see planner/native/twin.h).
 *
 * Each writes what its numpy twin in host_twins.py writes, int32 wrapping included, and
 * declines every case where numpy would broadcast, raise or read an unsorted index array:
 * those the numpy twin handles (and names, if it fails). Parameters arrive range-checked
 * by the packers in host_twins.py.
 */
#include "twin.h"

FP_TWIN(fp_twin_cumsum_with_zero) {
    int64_t n = r[R_D0];
    if (r[R_NDIM] != 1 || n < 1 || TWIN_LEN(0) != n - 1) return DECLINE;
    int32_t *out = TWIN_OUT;
    const int32_t *x = TWIN_IN(0);
    int32_t acc = 0;
    out[0] = 0;
    for (int64_t i = 1; i < n; i++) out[i] = acc = add32(acc, x[i - 1]);
    return 0;
}

/* P0, P1: whether there is a lower bound, and it; P2, P3: the same for the upper one. */
FP_TWIN(fp_twin_clamp) {
    int64_t n = r[R_D0];
    if (r[R_NDIM] != 1 || TWIN_LEN(0) != n) return DECLINE;
    int32_t *out = TWIN_OUT;
    const int32_t *x = TWIN_IN(0);
    int has_lo = (int)r[R_P0], has_hi = (int)r[R_P2];
    int32_t lo = (int32_t)r[R_P1], hi = (int32_t)r[R_P3];
    for (int64_t i = 0; i < n; i++) {
        int32_t v = x[i];
        if (has_lo && v < lo) v = lo;
        if (has_hi && v > hi) v = hi; /* after the lower bound: lo > hi gives hi, as numpy */
        out[i] = v;
    }
    return 0;
}

/* P0: the step. */
FP_TWIN(fp_twin_uniform_offsets) {
    if (r[R_NDIM] != 1) return DECLINE;
    int32_t *out = TWIN_OUT;
    uint32_t step = (uint32_t)(int32_t)r[R_P0];
    for (int64_t i = 0; i < r[R_D0]; i++) out[i] = (int32_t)((uint32_t)i * step);
    return 0;
}

/* P0: next_n, the rows per request. */
FP_TWIN(fp_twin_causal_lengths) {
    int64_t reqs = TWIN_LEN(0), next_n = r[R_P0];
    if (TWIN_NUMEL != reqs * next_n) return DECLINE;
    int32_t *out = TWIN_OUT;
    const int32_t *seq = TWIN_IN(0);
    for (int64_t b = 0; b < reqs; b++)
        for (int64_t j = 0; j < next_n; j++)
            out[b * next_n + j] = sub32(seq[b], (int32_t)(next_n - 1 - j));
    return 0;
}

/* The ragged ops find each token's request as numpy's searchsorted(indptr[1:], t, "right")
 * does on a sorted array; on an unsorted one numpy's answer depends on its search, so the
 * C declines. A walk, since the tokens come in order. */
typedef struct {
    const int32_t *indptr;
    int64_t reqs, b;
} owner_walk;

static int owner_start(owner_walk *w, const int32_t *indptr, int64_t len) {
    if (len < 2) return 0;
    for (int64_t i = 2; i < len; i++)
        if (indptr[i] < indptr[i - 1]) return 0;
    w->indptr = indptr;
    w->reqs = len - 1;
    w->b = 0;
    return 1;
}

/* The request owning token t (clamped into range, so padding tokens gather in bounds). */
static int64_t owner_of(owner_walk *w, int64_t t) {
    while (w->b < w->reqs && w->indptr[1 + w->b] <= t) w->b++;
    return w->b < w->reqs - 1 ? w->b : w->reqs - 1;
}

static int fill(int32_t *out, int64_t n, int32_t value) {
    for (int64_t i = 0; i < n; i++) out[i] = value;
    return 0;
}

/* P0: the padding value. */
FP_TWIN(fp_twin_token_request) {
    int64_t n = r[R_D0];
    owner_walk w;
    if (r[R_NDIM] != 1 || TWIN_LEN(0) < 1) return DECLINE;
    if (TWIN_LEN(0) == 1) return fill(TWIN_OUT, n, (int32_t)r[R_P0]);
    if (!owner_start(&w, TWIN_IN(0), TWIN_LEN(0))) return DECLINE;
    int32_t end = TWIN_IN(0)[w.reqs];
    for (int64_t t = 0; t < n; t++) {
        int64_t b = owner_of(&w, t);
        TWIN_OUT[t] = t < end ? (int32_t)b : (int32_t)r[R_P0];
    }
    return 0;
}

enum { POS_PLAIN, POS_CAUSAL, POS_TOPK };

/* out[t] = of(position) for real tokens, pad for padding: the per-token length ops. */
static int per_position(int32_t *buf, const int64_t *r, int of, int32_t pad, int32_t topk) {
    int64_t n = r[R_D0];
    owner_walk w;
    if (r[R_NDIM] != 1 || TWIN_LEN(0) < 1) return DECLINE;
    if (TWIN_LEN(0) == 1) return fill(TWIN_OUT, n, pad);
    if (!owner_start(&w, TWIN_IN(0), TWIN_LEN(0)) || TWIN_LEN(1) < w.reqs) return DECLINE;
    const int32_t *qo = TWIN_IN(0), *seq = TWIN_IN(1);
    for (int64_t t = 0; t < n; t++) {
        int64_t b = owner_of(&w, t);
        int32_t pos = add32(sub32(seq[b], qo[b + 1]), (int32_t)t);
        int32_t v = of == POS_PLAIN ? pos : add32(pos, 1);
        if (of == POS_TOPK && v > topk) v = topk;
        TWIN_OUT[t] = t < qo[w.reqs] ? v : pad;
    }
    return 0;
}

FP_TWIN(fp_twin_token_positions) { return per_position(buf, r, POS_PLAIN, 0, 0); }

FP_TWIN(fp_twin_token_causal_lengths) { return per_position(buf, r, POS_CAUSAL, 1, 0); }

/* P0: top-k. */
FP_TWIN(fp_twin_token_topk_lengths) {
    return per_position(buf, r, POS_TOPK, 1, (int32_t)r[R_P0]);
}

/* out [2, n]: each token's KV range [start, end) over the flat KV of its request. */
FP_TWIN(fp_twin_token_kv_ranges) {
    int64_t n = r[R_D1];
    owner_walk w;
    if (r[R_NDIM] != 2 || r[R_D0] != 2 || TWIN_LEN(0) < 1) return DECLINE;
    int32_t *start = TWIN_OUT, *end = TWIN_OUT + n;
    if (TWIN_LEN(0) == 1) return fill(start, n, 0) | fill(end, n, 1);
    if (!owner_start(&w, TWIN_IN(0), TWIN_LEN(0)) || TWIN_LEN(1) < TWIN_LEN(0)) return DECLINE;
    const int32_t *qo = TWIN_IN(0), *kv = TWIN_IN(1);
    for (int64_t t = 0; t < n; t++) {
        int64_t b = owner_of(&w, t);
        int real = t < qo[w.reqs];
        start[t] = real ? kv[b] : 0;
        end[t] = real ? add32(add32(sub32(kv[b + 1], qo[b + 1]), (int32_t)t), 1) : 1;
    }
    return 0;
}

FP_TWIN(fp_twin_last_token_rows) {
    int64_t n = r[R_D0];
    if (r[R_NDIM] != 1 || TWIN_LEN(0) != n + 1) return DECLINE;
    const int32_t *qo = TWIN_IN(0);
    for (int64_t i = 0; i < n; i++) TWIN_OUT[i] = sub32(qo[i + 1], 1);
    return 0;
}

/* out [2, n]: each slot's page and place in it (floor division, as numpy). P0: page size. */
FP_TWIN(fp_twin_slot_pages) {
    int64_t n = r[R_D1];
    if (r[R_NDIM] != 2 || r[R_D0] != 2 || TWIN_LEN(0) != n) return DECLINE;
    const int32_t *loc = TWIN_IN(0);
    int32_t size = (int32_t)r[R_P0];
    for (int64_t i = 0; i < n; i++) {
        int32_t q = loc[i] / size, rem = loc[i] % size;
        if (rem != 0 && rem < 0) {
            q -= 1;
            rem += size;
        }
        TWIN_OUT[i] = q;
        TWIN_OUT[n + i] = rem;
    }
    return 0;
}
