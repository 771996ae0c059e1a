/* FlashInfer's host plan arrays for one uniform batch, in one call (see
 * backends/flashinfer/host_args.py, whose numpy fill is the authority).
 *
 * Answers 0 only when it wrote exactly what the numpy fill writes: the lengths padded to
 * `reqs` with next_n, pages per request and their prefix sum, the last page's tokens, the
 * query offsets, and the summary [requests, pages, tokens, longest]. It answers non-zero,
 * and the caller runs numpy, for what it does not handle: a length below 1 (the numpy
 * remainder and C's differ there) or a page total past int32.
 */
#include <stdint.h>

enum {
    A_SRC,       /* address of the batch's int32 host lengths */
    A_REAL,      /* how many there are */
    A_REQS,      /* the planned request count (the rest is padding) */
    A_PAGE,      /* page size */
    A_NEXT_N,    /* query tokens per request, and the padding requests' length */
    A_QO,        /* int32[reqs + 1] query offsets */
    A_INDPTR,    /* int32[reqs + 1] page prefix sum */
    A_LAST,      /* int32[reqs] tokens in each request's last page */
    A_LENS,      /* int32[reqs] the padded lengths */
    A_SUMMARY,   /* int64[4] */
    A_COUNT
};

int fp_fi_host_args(const int64_t *a) {
    const int32_t *src = (const int32_t *)(intptr_t)a[A_SRC];
    int64_t real = a[A_REAL], reqs = a[A_REQS], page = a[A_PAGE], next_n = a[A_NEXT_N];
    int32_t *qo = (int32_t *)(intptr_t)a[A_QO];
    int32_t *indptr = (int32_t *)(intptr_t)a[A_INDPTR];
    int32_t *last = (int32_t *)(intptr_t)a[A_LAST];
    int32_t *lens = (int32_t *)(intptr_t)a[A_LENS];
    int64_t *summary = (int64_t *)(intptr_t)a[A_SUMMARY];
    if (page < 1 || next_n < 1 || real < 0 || real > reqs || reqs < 1) return 1;
    int64_t pages = 0, tokens = 0, longest = 0;
    indptr[0] = 0;
    qo[0] = 0;
    for (int64_t r = 0; r < reqs; ++r) {
        int64_t len = r < real ? src[r] : next_n;
        if (len < 1 || len > INT32_MAX - page) return 2;
        lens[r] = (int32_t)len;
        pages += (len + page - 1) / page;
        if (pages > INT32_MAX) return 3;
        indptr[r + 1] = (int32_t)pages;
        last[r] = (int32_t)((len - 1) % page + 1);
        qo[r + 1] = (int32_t)((r + 1) * next_n);
        tokens += len;
        if (len > longest) longest = len;
    }
    summary[0] = reqs;
    summary[1] = pages;
    summary[2] = tokens;
    summary[3] = longest;
    return 0;
}
