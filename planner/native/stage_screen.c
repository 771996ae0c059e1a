/* The staging screen: a uniform batch's inputs written into the pinned staging buffer and
 * checked in one pass, in C, for the replay hot path (see planner/native/__init__.py).
 *
 * It is a screen in front of planner/staging.py's fill and check, never a replacement:
 * it answers 0 only when the buffer holds exactly what the Python fill writes and every
 * check the Python check runs passes (ranges, no repeated KV slot or request row except
 * the null 0, positions equal to what the lengths imply). Anything else, a bad value or
 * a case it does not handle, answers non-zero, and the caller runs the Python fill and
 * check, which name the field and the limit. A partial write before a refusal is harmless:
 * the Python fill rewrites the whole buffer.
 *
 * Sources, in this order: seq_lens, extend_lens, req_pool_indices, out_cache_loc,
 * positions. Each has a kind and an address (or, for a constant, the value itself).
 */
#include <stdint.h>
#include <string.h>

enum { SRC_SEQ, SRC_EXTEND, SRC_POOL, SRC_SLOT, SRC_POS, N_SRC };
enum {
    K_NONE = 0,     /* not given: padding only (never a real entry; the caller checks) */
    K_I32 = 1,      /* host int32 values at the address */
    K_I64 = 2,      /* host int64 values at the address */
    K_DEVICE = 3,   /* device-resident: copied on the device later, unchecked here */
    K_CONST = 4,    /* one value for every real entry (a uniform batch's extend lengths) */
    K_DERIVED = 5   /* positions the lengths imply: L - n .. L - 1 per request */
};

/* One segment, as seven int64: source, offset, per_token, capacity, pad, lo, hi. */
enum { S_SRC, S_OFFSET, S_PER_TOKEN, S_CAPACITY, S_PAD, S_LO, S_HI, S_WIDTH };

static int64_t value_at(int kind, int64_t addr, int64_t i) {
    if (kind == K_I32) return ((const int32_t *)(intptr_t)addr)[i];
    return ((const int64_t *)(intptr_t)addr)[i];
}

/* Copies n host values of kind k into out; nonzero when one lies outside [lo, hi]. The
 * check is accumulated without branching, one loop per kind, so each loop vectorises: the
 * copy of a 256-request batch's five sources is most of the screen's time otherwise. */
static int copy_checked(int k, int64_t addr, int64_t n, int64_t lo, int64_t hi, int32_t *out) {
    int bad = 0;
    if (k == K_I32) {
        const int32_t *src = (const int32_t *)(intptr_t)addr;
        for (int64_t i = 0; i < n; ++i) {
            int64_t v = src[i];
            bad |= (v < lo) | (v > hi);
            out[i] = (int32_t)v;
        }
    } else {
        const int64_t *src = (const int64_t *)(intptr_t)addr;
        for (int64_t i = 0; i < n; ++i) {
            int64_t v = src[i];
            bad |= (v < lo) | (v > hi);
            out[i] = (int32_t)v;
        }
    }
    return bad;
}

/* Whether a nonzero value repeats among n int32 values, all in [lo, hi] (range-checked
 * before; lo >= 0 for the sources checked): a bitmap over [0, hi] where one fits the
 * caller's scratch (request rows: a few hundred bits), else an open-addressing set over
 * it; the scratch holds at least 2 * n + 16 words. */
static int repeats(const int32_t *values, int64_t n, int64_t lo, int64_t hi, int32_t *scratch,
                   int64_t scratch_len) {
    int64_t words = hi / 32 + 1;
    if (lo >= 0 && hi >= 0 && words <= scratch_len && words <= 2 * n + 16) {
        uint32_t *bits = (uint32_t *)scratch;
        memset(bits, 0, (size_t)words * sizeof(uint32_t));
        for (int64_t i = 0; i < n; ++i) {
            uint32_t v = (uint32_t)values[i], bit = 1u << (v & 31);
            if (v == 0) continue;
            if (bits[v >> 5] & bit) return 1;
            bits[v >> 5] |= bit;
        }
        return 0;
    }
    int64_t size = 16;
    while (size < 2 * n) size <<= 1;
    if (size > scratch_len) return 1; /* no room: let the Python check decide */
    memset(scratch, 0xff, (size_t)size * sizeof(int32_t));
    uint32_t mask = (uint32_t)size - 1;
    for (int64_t i = 0; i < n; ++i) {
        int32_t v = values[i];
        if (v == 0) continue;
        uint32_t h = ((uint32_t)v * 2654435761u) & mask;
        while (scratch[h] != -1) {
            if (scratch[h] == v) return 1;
            h = (h + 1) & mask;
        }
        scratch[h] = v;
    }
    return 0;
}

/* The call's arguments, packed as int64 (one ctypes argument instead of nineteen: each
 * costs about 0.15 us of conversion in Python): */
enum {
    A_SEGMENTS, A_N_SEGMENTS,           /* the segment table and its rows */
    A_KIND, A_ADDR = A_KIND + N_SRC,    /* per source: its kind, then its address or value */
    A_REQS = A_ADDR + N_SRC, A_TOKENS,  /* the padded region's requests and tokens */
    A_REAL_REQS, A_REAL_TOKENS, A_NEXT_N,
    A_SCRATCH, A_SCRATCH_LEN, A_COUNT
};

/* Returns 0 when the staged buffer is good; 1 when the Python path must run. */
int fp_stage_screen(int32_t *host, const int64_t *a) {
    const int64_t *segments = (const int64_t *)(intptr_t)a[A_SEGMENTS];
    int64_t n_segments = a[A_N_SEGMENTS], reqs = a[A_REQS], tokens = a[A_TOKENS];
    int64_t real_reqs = a[A_REAL_REQS], real_tokens = a[A_REAL_TOKENS], next_n = a[A_NEXT_N];
    int32_t *scratch = (int32_t *)(intptr_t)a[A_SCRATCH];
    int64_t scratch_len = a[A_SCRATCH_LEN];
    const int64_t *kind = a + A_KIND, *addr = a + A_ADDR;
    if (kind[SRC_SEQ] != K_I32 && kind[SRC_SEQ] != K_I64) return 1; /* lengths live on the host */
    if (real_tokens != real_reqs * next_n || next_n < 1) return 1;  /* uniform batches only */
    const int32_t *first[N_SRC] = {0};
    int64_t first_lo[N_SRC] = {0}, first_hi[N_SRC] = {0};
    for (int64_t s = 0; s < n_segments; ++s) {
        const int64_t *seg = segments + s * S_WIDTH;
        int src = (int)seg[S_SRC];
        int64_t off = seg[S_OFFSET], lo = seg[S_LO], hi = seg[S_HI], pad = seg[S_PAD];
        int64_t real = seg[S_PER_TOKEN] ? real_tokens : real_reqs;
        int64_t total = seg[S_PER_TOKEN] ? tokens : reqs;
        if (src < 0 || src >= N_SRC || total > seg[S_CAPACITY] || real > total) return 1;
        int32_t *out = host + off;
        int k = (int)kind[src];
        if (k == K_I32 || k == K_I64) {
            if (copy_checked(k, addr[src], real, lo, hi, out)) return 1;
        } else if (k == K_CONST) {
            int64_t v = addr[src];
            if (real && (v < lo || v > hi)) return 1;
            for (int64_t i = 0; i < real; ++i) out[i] = (int32_t)v;
        } else if (k == K_DERIVED) {
            int kl = (int)kind[SRC_SEQ];
            for (int64_t b = 0; b < real_reqs; ++b) {
                int64_t len = value_at(kl, addr[SRC_SEQ], b);
                for (int64_t j = 0; j < next_n; ++j) {
                    int64_t v = len - next_n + j;
                    if (v < lo || v > hi) return 1;
                    out[b * next_n + j] = (int32_t)v;
                }
            }
        } else if (k == K_NONE) {
            if (real) return 1; /* real entries with no values: not a case the screen knows */
        } else if (k != K_DEVICE) {
            return 1;
        }
        for (int64_t i = real; i < total; ++i) out[i] = (int32_t)pad;
        if (!first[src] && k != K_DEVICE) {
            first[src] = out;
            first_lo[src] = lo;
            first_hi[src] = hi;
        }
    }
    /* The relations, on the first segment of each source (what the Python check reads). */
    if (kind[SRC_SLOT] != K_DEVICE) {
        if (!first[SRC_SLOT] ||
            repeats(first[SRC_SLOT], real_tokens, first_lo[SRC_SLOT], first_hi[SRC_SLOT], scratch,
                    scratch_len))
            return 1;
    }
    if (kind[SRC_POOL] != K_DEVICE) {
        if (!first[SRC_POOL] ||
            repeats(first[SRC_POOL], real_reqs, first_lo[SRC_POOL], first_hi[SRC_POOL], scratch,
                    scratch_len))
            return 1;
    }
    if (kind[SRC_POS] == K_I32 || kind[SRC_POS] == K_I64) {
        const int32_t *pos = first[SRC_POS], *lens = first[SRC_SEQ];
        if (!pos || !lens) return 1;
        for (int64_t b = 0; b < real_reqs; ++b)
            for (int64_t j = 0; j < next_n; ++j)
                if (pos[b * next_n + j] != lens[b] - next_n + j) return 1;
    }
    return 0;
}
