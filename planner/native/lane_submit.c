/* The eager lane's submission in one call: the staging screen, the host pass, the staging
 * copy and the plan's kernel launches, each after the last succeeded.
 *
 * Why: once the screen and the host pass were one C call, what an eager decode plan still
 * paid in Python was the copy's runtime call (through ctypes) and its kernel launch
 * through Triton's launcher (a Python __call__, a pointer query per tensor argument, the
 * packed metadata parsed): about 30 us of a 100 us plan on the H200's host. Here the copy
 * and the launches go straight to the CUDA functions whose addresses the record holds,
 * on the stream given, with every argument worked out once per layout
 * (planner/lane_submit.py packs the record).
 *
 * The record, int64s: the copy function (cudaMemcpyAsync), the launch function
 * (cuLaunchKernel), the host pass's records and step count (0 steps: none), the bytes to
 * copy, the number of launches; then per launch its function, grid x, y, z, block x,
 * dynamic shared bytes, parameter count and per parameter a (kind, value) pair. A value
 * is a 32-bit or 64-bit constant, or an offset from the plan's device buffer or from the
 * token table, whose addresses change per plan and come with the call.
 *
 * Answers: 0, everything queued; -1, the screen refused (nothing written anywhere the
 * caller must undo, nothing sent); k > 0, host twin k declined (nothing sent); -2, the
 * copy failed (nothing sent); -3, a launch failed (the copy and the launches before it
 * are queued). */
#include <stddef.h>
#include <stdint.h>

int fp_stage_screen(int32_t *host, const int64_t *a);
int64_t fp_host_pass(int64_t buf, int64_t program, int64_t steps);

typedef int (*fp_copy_fn)(void *dst, const void *src, size_t bytes, int kind, void *stream);
typedef int (*fp_launch_fn)(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                            unsigned by, unsigned bz, unsigned shared, void *stream,
                            void **params, void **extra);

enum { S_COPY, S_LAUNCH, S_PROGRAM, S_STEPS, S_BYTES, S_LAUNCHES, S_HEAD };
enum { L_FUNCTION, L_GX, L_GY, L_GZ, L_BLOCK, L_SHARED, L_PARAMS, L_HEAD };
enum { P_VALUE32, P_VALUE64, P_DEVICE, P_TABLE };
#define HOST_TO_DEVICE 1
#define MAX_PARAMS 64

typedef union {
    int32_t i32;
    int64_t i64;
} fp_param;

int64_t fp_lane_record_head(void) { return S_HEAD; }
int64_t fp_lane_launch_head(void) { return L_HEAD; }
int64_t fp_lane_max_params(void) { return MAX_PARAMS; }

static int launch_one(fp_launch_fn launch, const int64_t *l, int64_t device, int64_t table,
                      void *stream) {
    int64_t n = l[L_PARAMS];
    fp_param values[MAX_PARAMS];
    void *params[MAX_PARAMS];
    if (n < 0 || n > MAX_PARAMS) return 1;
    const int64_t *p = l + L_HEAD;
    for (int64_t j = 0; j < n; j++) {
        int64_t kind = p[2 * j], value = p[2 * j + 1];
        if (kind == P_VALUE32)
            values[j].i32 = (int32_t)value;
        else if (kind == P_DEVICE)
            values[j].i64 = device + value;
        else if (kind == P_TABLE)
            values[j].i64 = table + value;
        else
            values[j].i64 = value;
        params[j] = &values[j];
    }
    return launch((void *)(intptr_t)l[L_FUNCTION], (unsigned)l[L_GX], (unsigned)l[L_GY],
                  (unsigned)l[L_GZ], (unsigned)l[L_BLOCK], 1, 1, (unsigned)l[L_SHARED], stream,
                  params, NULL);
}

int64_t fp_lane_submit(int64_t record, int64_t host, int64_t args, int64_t device,
                       int64_t stream, int64_t table) {
    const int64_t *r = (const int64_t *)(intptr_t)record;
    if (fp_stage_screen((int32_t *)(intptr_t)host, (const int64_t *)(intptr_t)args) != 0)
        return -1;
    if (r[S_STEPS] > 0) {
        int64_t declined = fp_host_pass(host, r[S_PROGRAM], r[S_STEPS]);
        if (declined != 0) return declined;
    }
    void *on = (void *)(intptr_t)stream;
    fp_copy_fn copy = (fp_copy_fn)(intptr_t)r[S_COPY];
    if (copy((void *)(intptr_t)device, (const void *)(intptr_t)host, (size_t)r[S_BYTES],
             HOST_TO_DEVICE, on) != 0)
        return -2;
    fp_launch_fn launch = (fp_launch_fn)(intptr_t)r[S_LAUNCH];
    const int64_t *l = r + S_HEAD;
    for (int64_t i = 0; i < r[S_LAUNCHES]; i++) {
        if (launch_one(launch, l, device, table, on) != 0) return -3;
        l += L_HEAD + 2 * l[L_PARAMS];
    }
    return 0;
}
