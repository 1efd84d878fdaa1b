/* One-pass FP8 statistics of a CPU tensor: the same numbers as capture/stats.py's torch path
 * (counts, smallest non-zero, quantization error, signal energy) in a single read of the tensor.
 *
 * Why this exists: on CPU the torch formulation needs ~25 elementwise passes per tensor; here
 * each element is loaded once and every statistic is accumulated from registers. The loops are
 * branch-free so the compiler vectorizes them (built with -O3 -march=native, no -ffast-math:
 * NaN and Inf must behave exactly as in IEEE arithmetic). Large tensors are split over the
 * OpenMP threads torch itself uses (see run_jobs).
 *
 * FP8 rounding (round to nearest, ties to even, onto a format with `mbits` mantissa bits and
 * smallest normal exponent `emin`) is done with rintf on the value scaled by a power of two,
 * which is exact: the step between neighbouring FP8 codes around |y| is 2^(max(e, emin) - mbits).
 * The tests check it bit for bit against torch's own cast.
 *
 * Built and loaded by fp8scope/native/__init__.py with ctypes; compiled on first use into a cache folder.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };

typedef struct {
    int64_t n_nan, n_inf, nonzero, over, sat, above_under;
    double sq_err, sq_sig;
    float min_nz, amax;
} acc_t;

typedef struct {
    const void *x;
    const float *deq; /* NULL: quantize here */
    int dtype;
    int64_t cols;
    const float *scale, *inv;
    int64_t scale_n, inv_n;
    float fmax, sat_floor, uthr;
    int emin, mbits;
    int64_t lo, hi; /* flat element range of this worker */
    acc_t acc;
} job_t;

static inline float pow2f(int e) { /* 2^e for -126 <= e <= 127 */
    uint32_t b = (uint32_t)(127 + e) << 23;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* |y| (non-negative, <= fmax, or NaN) rounded onto the FP8 grid */
static inline float round_fp8(float v, int emin, int mbits) {
    uint32_t b;
    memcpy(&b, &v, 4);
    int e = (int)(b >> 23) - 127;
    e = e < emin ? emin : e;
    e = e > 126 ? 126 : e; /* NaN: keep the powers of two valid; NaN stays NaN */
    int se = e - mbits;
    return __builtin_rintf(v * pow2f(-se)) * pow2f(se);
}

/* Elements per block: int32 counters stay exact inside a block and are added into int64 totals
 * after it. Squares are summed in double: float32 squares overflow past |x| ~ 1.8e19 and vanish
 * below ~1e-23. */
#define BLOCK 2048

/* One contiguous run of elements sharing one scale. `LOAD(i)` reads element i as float; `DEQ(i)` is the
 * dequantized value (given by the caller, or computed here). Written so gcc vectorizes the inner loop:
 * no branches (ternaries become blends), fminf avoided (its NaN rules block vectorization), and the
 * float reductions allowed to reassociate by the omp simd pragma. */
#define DEFINE_SEGMENT(NAME, ELEM, LOAD, DEQ)                                                         \
    static void NAME(job_t *j, int64_t a, int64_t b, float s, float iv) {                             \
        const ELEM *restrict x = (const ELEM *)j->x;                                                  \
        const float *restrict deq = j->deq;                                                           \
        const float fmax = j->fmax, sat_floor = j->sat_floor, uthr = j->uthr;                          \
        const int emin = j->emin, mbits = j->mbits;                                                   \
        acc_t *c = &j->acc;                                                                           \
        (void)deq; (void)emin; (void)mbits; (void)iv;                                                 \
        for (int64_t b0 = a; b0 < b; b0 += BLOCK) {                                                   \
            const int64_t b1 = b - b0 < BLOCK ? b : b0 + BLOCK;                                        \
            int32_t n_nan = 0, n_inf = 0, nonzero = 0, over = 0, sat = 0, above = 0;                  \
            float mn = INFINITY, mx = 0.0f;                                                           \
            float errs[BLOCK], sigs[BLOCK]; /* finite terms, squared and summed in double below */     \
            _Pragma("omp simd reduction(+ : n_nan, n_inf, nonzero, over, sat, above) reduction(min : mn) reduction(max : mx)") \
            for (int64_t i = b0; i < b1; i++) {                                                       \
                const float xv = LOAD(i);                                                             \
                const float ax = fabsf(xv);                                                           \
                const float ys = xv * s;                                                              \
                const float y = fabsf(ys);                                                            \
                n_nan += (xv != xv);                                                                  \
                n_inf += (ax > FLT_MAX);                                                              \
                nonzero += (ax > 0.0f);                                                               \
                over += (y > fmax);                                                                   \
                sat += (y > sat_floor);                                                               \
                above += (y > uthr);                                                                  \
                const float cand = (ax > 0.0f && ax <= FLT_MAX) ? ax : INFINITY;                      \
                mn = cand < mn ? cand : mn;                                                           \
                mx = ax > mx ? ax : mx;                                                               \
                const float err = (DEQ(i)) - xv;                                                      \
                errs[i - b0] = fabsf(err) <= FLT_MAX ? err : 0.0f;                                    \
                sigs[i - b0] = ax <= FLT_MAX ? xv : 0.0f;                                             \
            }                                                                                         \
            double sq_err = 0.0, sq_sig = 0.0;                                                        \
            _Pragma("omp simd reduction(+ : sq_err, sq_sig)")                                         \
            for (int64_t k = 0; k < b1 - b0; k++) {                                                   \
                const double e = errs[k], v = sigs[k];                                                \
                sq_err += e * e;                                                                      \
                sq_sig += v * v;                                                                      \
            }                                                                                         \
            c->n_nan += n_nan;                                                                        \
            c->n_inf += n_inf;                                                                        \
            c->nonzero += nonzero;                                                                    \
            c->over += over;                                                                          \
            c->sat += sat;                                                                            \
            c->above_under += above;                                                                  \
            c->sq_err += sq_err;                                                                      \
            c->sq_sig += sq_sig;                                                                      \
            c->min_nz = mn < c->min_nz ? mn : c->min_nz;                                              \
            c->amax = mx > c->amax ? mx : c->amax;                                                    \
        }                                                                                             \
    }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* quantize here: clamp to the format's range, round onto its grid, keep the sign, dequantize */
static inline float quant_dequant(float xv, float s, float iv, float fmax, int emin, int mbits) {
    const float ys = xv * s;
    const float y = fabsf(ys);
    const float yc = y > fmax ? fmax : y; /* NaN stays NaN */
    return copysignf(round_fp8(yc, emin, mbits), ys) * iv;
}

#define LOAD_F32(i) (x[i])
#define LOAD_BF16(i) (bf16_to_f32(x[i]))
#define LOAD_F16(i) ((float)x[i])
#define DEQ_GIVEN(i) (deq[i])
#define DEQ_F32(i) quant_dequant(x[i], s, iv, fmax, emin, mbits)
#define DEQ_BF16(i) quant_dequant(bf16_to_f32(x[i]), s, iv, fmax, emin, mbits)
#define DEQ_F16(i) quant_dequant((float)x[i], s, iv, fmax, emin, mbits)

DEFINE_SEGMENT(seg_f32, float, LOAD_F32, DEQ_F32)
DEFINE_SEGMENT(seg_bf16, uint16_t, LOAD_BF16, DEQ_BF16)
DEFINE_SEGMENT(seg_f16, _Float16, LOAD_F16, DEQ_F16)
DEFINE_SEGMENT(seg_f32_deq, float, LOAD_F32, DEQ_GIVEN)
DEFINE_SEGMENT(seg_bf16_deq, uint16_t, LOAD_BF16, DEQ_GIVEN)
DEFINE_SEGMENT(seg_f16_deq, _Float16, LOAD_F16, DEQ_GIVEN)

static void segment(job_t *j, int64_t a, int64_t b, float s, float iv) {
    static void (*const table[2][3])(job_t *, int64_t, int64_t, float, float) = {
        {seg_f32, seg_bf16, seg_f16}, {seg_f32_deq, seg_bf16_deq, seg_f16_deq}};
    table[j->deq != NULL][j->dtype](j, a, b, s, iv);
}

static void *work(void *arg) {
    job_t *j = (job_t *)arg;
    int64_t i = j->lo;
    while (i < j->hi) { /* walk row segments so a per-row scale stays constant inside a segment */
        int64_t row = i / j->cols;
        int64_t end = (row + 1) * j->cols;
        if (end > j->hi) end = j->hi;
        float s = j->scale[j->scale_n == 1 ? 0 : row];
        float iv = j->inv[j->inv_n == 1 ? 0 : row];
        segment(j, i, end, s, iv);
        i = end;
    }
    return NULL;
}

/* Threads come from OpenMP. Built with -fopenmp, this library names libgomp.so.1, and the
 * dynamic loader hands it the copy torch has already loaded (same soname): the kernel shares
 * torch's warm intra-op thread pool instead of starting or waking threads of its own (waking a
 * private pool per call cost more than a mid-sized tensor's pass). */
static void run_jobs(job_t *jobs, int nj) {
#pragma omp parallel for num_threads(nj) schedule(static, 1) if (nj > 1)
    for (int t = 0; t < nj; t++) work(&jobs[t]);
}

/* out: n_nan, n_inf, nonzero, overflow, saturated, above_underflow, sq_err, sq_signal, min_nonzero, amax
 * (amax ignores NaN: the caller makes it NaN when n_nan > 0) */
int fp8s_full_stats(const void *x, int dtype, int64_t rows, int64_t cols, const float *scale, int64_t scale_n,
                    const float *inv, int64_t inv_n, const float *deq, float fmax, float sat_floor, float uthr,
                    int emin, int mbits, int nthreads, double *out) {
    enum { MAX_THREADS = 64 };
    if (nthreads < 1) nthreads = 1;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    int64_t n = rows * cols;
    if (n < ((int64_t)1 << 16)) nthreads = 1; /* waking a helper costs more than the work */
    job_t jobs[MAX_THREADS];
    int64_t per = (n + nthreads - 1) / nthreads;
    per = (per + 63) & ~(int64_t)63;
    for (int t = 0; t < nthreads; t++) {
        job_t *j = &jobs[t];
        j->x = x;
        j->deq = deq;
        j->dtype = dtype;
        j->cols = cols > 0 ? cols : 1;
        j->scale = scale;
        j->inv = inv;
        j->scale_n = scale_n;
        j->inv_n = inv_n;
        j->fmax = fmax;
        j->sat_floor = sat_floor;
        j->uthr = uthr;
        j->emin = emin;
        j->mbits = mbits;
        j->lo = t * per < n ? t * per : n;
        j->hi = (t + 1) * per < n ? (t + 1) * per : n;
        memset(&j->acc, 0, sizeof(acc_t));
        j->acc.min_nz = INFINITY;
    }
    run_jobs(jobs, nthreads);
    acc_t total;
    memset(&total, 0, sizeof total);
    total.min_nz = INFINITY;
    for (int t = 0; t < nthreads; t++) {
        acc_t *c = &jobs[t].acc;
        total.n_nan += c->n_nan;
        total.n_inf += c->n_inf;
        total.nonzero += c->nonzero;
        total.over += c->over;
        total.sat += c->sat;
        total.above_under += c->above_under;
        total.sq_err += c->sq_err;
        total.sq_sig += c->sq_sig;
        total.min_nz = c->min_nz < total.min_nz ? c->min_nz : total.min_nz;
        total.amax = c->amax > total.amax ? c->amax : total.amax;
    }
    out[0] = (double)total.n_nan;
    out[1] = (double)total.n_inf;
    out[2] = (double)total.nonzero;
    out[3] = (double)total.over;
    out[4] = (double)total.sat;
    out[5] = (double)total.above_under;
    out[6] = total.sq_err;
    out[7] = total.sq_sig;
    out[8] = (double)total.min_nz;
    out[9] = (double)total.amax;
    return 0;
}

/* max |x| in one pass, NaN if x holds a NaN (the monitor must see it; TE's fmaxf would hide it).
 * What a cheap step needs when nothing computed the amax yet (what-if states on the CPU). */
#define DEFINE_AMAX(NAME, ELEM, LOAD)                                                                \
    static void NAME(const void *xv_, int64_t a, int64_t b, float *mx_out, int64_t *nan_out) {       \
        const ELEM *restrict x = (const ELEM *)xv_;                                                  \
        float mx = 0.0f;                                                                             \
        int64_t nan = 0;                                                                             \
        for (int64_t b0 = a; b0 < b; b0 += BLOCK) {                                                  \
            const int64_t b1 = b - b0 < BLOCK ? b : b0 + BLOCK;                                       \
            int32_t nb = 0;                                                                          \
            _Pragma("omp simd reduction(max : mx) reduction(+ : nb)")                                \
            for (int64_t i = b0; i < b1; i++) {                                                      \
                const float v = LOAD(i);                                                             \
                const float av = fabsf(v);                                                           \
                mx = av > mx ? av : mx;                                                              \
                nb += (v != v);                                                                      \
            }                                                                                        \
            nan += nb;                                                                               \
        }                                                                                            \
        *mx_out = mx;                                                                                \
        *nan_out = nan;                                                                              \
    }

DEFINE_AMAX(amax_f32, float, LOAD_F32)
DEFINE_AMAX(amax_bf16, uint16_t, LOAD_BF16)
DEFINE_AMAX(amax_f16, _Float16, LOAD_F16)

double fp8s_amax(const void *x, int dtype, int64_t n, int nthreads) {
    static void (*const table[3])(const void *, int64_t, int64_t, float *, int64_t *) = {amax_f32, amax_bf16,
                                                                                       amax_f16};
    enum { MAX_THREADS = 64 };
    if (nthreads < 1 || n < ((int64_t)1 << 16)) nthreads = 1;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    float mx[MAX_THREADS];
    int64_t nan[MAX_THREADS];
    int64_t per = (n + nthreads - 1) / nthreads;
#pragma omp parallel for num_threads(nthreads) schedule(static, 1) if (nthreads > 1)
    for (int t = 0; t < nthreads; t++) {
        const int64_t lo = t * per < n ? t * per : n, hi = (t + 1) * per < n ? (t + 1) * per : n;
        table[dtype](x, lo, hi, &mx[t], &nan[t]);
    }
    float m = 0.0f;
    for (int t = 0; t < nthreads; t++) {
        if (nan[t]) return NAN;
        m = mx[t] > m ? mx[t] : m;
    }
    return (double)m;
}

/* The kernel's quantize-dequantize of float32 values, exposed so tests can compare it bit for bit
 * with torch's own cast. */
void fp8s_quant_dequant(const float *x, int64_t n, float s, float iv, float fmax, int emin, int mbits, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = quant_dequant(x[i], s, iv, fmax, emin, mbits);
}

/* Delayed scaling's update (Transformer Engine's rule, see fp8scope/emulate/scaling.py) for the
 * pending slots of a HostDelayedBank (fp8scope/emulate/scaling_bank.py), which keeps float32 values
 * in doubles: slot i has a ring of `len` amaxes at ring[i * len ...] with row 0 at head[i], and the
 * amax recorded this step in cur[i]. One call per step instead of a numpy pass per field: the
 * what-if monitor runs it at every step's end, where the interpreter is cold.
 *   roll when cur != 0 (NaN rolls); amax = max of the window from 0 ignoring NaN ("max", fmaxf) or
 *   cur ("most_recent"); scale = scaled_max / amax in float32 when amax is finite and > 0 (+inf ->
 *   FLT_MAX), else kept; scale_inv = 1 / scale in float32. */
void fp8s_delayed_update(int64_t n, int64_t len, int most_recent, double *ring, int64_t *head, double *cur,
                         int8_t *pending, const double *scaled_max, double *scale, double *scale_inv,
                         double *expected, int8_t *kept, int64_t *updates, double *wmax) {
    for (int64_t i = 0; i < n; i++) {
        if (!pending[i]) continue;
        const double last = cur[i];
        double *r = ring + i * len;
        float amax = 0.0f;
        if (!(last == 0.0)) { /* NaN != 0: a NaN amax rolls in like any other */
            r[head[i]] = last;
            /* wmax[i]: max of the rows other than row 0, from 0, NaN ignored: with `last` it is
             * the max of the whole window, in O(1) */
            const double m = last > wmax[i] ? last : wmax[i];
            amax = most_recent ? (float)last : (float)m;
            head[i] = (head[i] + 1) % len; /* roll(h, -1): the oldest row becomes row 0, cleared */
            const double dropped = r[head[i]];
            r[head[i]] = 0.0;
            if (dropped == m) { /* the max left the window: find the new one */
                double w = 0.0;
                for (int64_t j = 0; j < len; j++) w = r[j] > w ? r[j] : w;
                wmax[i] = w;
            } else {
                wmax[i] = m;
            }
        }
        const int valid = isfinite(amax) && amax > 0.0f;
        if (valid) {
            float sf = (float)scaled_max[i] / amax;
            scale[i] = isinf(sf) ? FLT_MAX : sf;
            expected[i] = amax;
        }
        scale_inv[i] = 1.0f / (float)scale[i];
        kept[i] = !valid;
        cur[i] = 0.0;
        pending[i] = 0;
        updates[i] += 1;
    }
}

/* A what-if cheap capture of a CPU tensor, whole: its amax (fp8s_amax), recorded into its
 * HostDelayedBank slot (the slot's own pending update applied first: a micro-batch's second
 * capture), and its row appended to the step's row log. One call from the layer's hook instead of
 * a chain of Python calls, list appends and tuples; the step's end reads the log as one array.
 *   bank: HostDelayedBank's buffers (fp8scope/emulate/scaling_bank.py, `_ctx`, int64 slots);
 *   log:  int64 [rows, capacity, row buffer address, overflowed captures, threads] (RowLog).
 * A row: amax, scale, scale_inv, expected amax (the scales in use before this record), key id,
 * numel, and `after`: how many of the collector's other captures came first (execution order).
 * Returns the log's row count, or -1 when it is full (nothing recorded: the caller records the
 * tensor its own way, and the log grows at the step's end). */
typedef struct {
    double *ring;
    int64_t *head;
    double *cur;
    int8_t *pending;
    const double *scaled_max;
    double *scale, *scale_inv, *expected;
    int8_t *kept;
    int64_t *updates;
    double *wmax;
    int64_t len, most_recent;
    int64_t *log;
} bank_t;

enum { ROW_WIDTH = 7 };

int64_t fp8s_bank_capture(bank_t *b, const void *x, int dtype, int64_t n, int64_t slot, int64_t kid, int64_t after) {
    int64_t *log = b->log;
    if (log[0] >= log[1]) {
        log[3] += 1;
        return -1;
    }
    const double amax = fp8s_amax(x, dtype, n, (int)log[4]);
    if (b->pending[slot]) {
        const int64_t L = b->len;
        fp8s_delayed_update(1, L, (int)b->most_recent, b->ring + slot * L, b->head + slot, b->cur + slot,
                            b->pending + slot, b->scaled_max + slot, b->scale + slot, b->scale_inv + slot,
                            b->expected + slot, b->kept + slot, b->updates + slot, b->wmax + slot);
    }
    b->cur[slot] = amax;
    b->pending[slot] = 1;
    double *row = (double *)(intptr_t)log[2] + log[0] * ROW_WIDTH;
    row[0] = amax;
    row[1] = b->scale[slot];
    row[2] = b->scale_inv[slot];
    row[3] = b->expected[slot];
    row[4] = (double)kid;
    row[5] = (double)n;
    row[6] = (double)after;
    return ++log[0];
}

/* A cheap what-if step's tensor message with no Python in between (step_records.cheap_log_message):
 * the row log's amax, scale, scale_inv and expected amax written into the columns of the last
 * serialized message with the same rows (a MessageTemplate's buffers: float64 columns, int64
 * step), and the step number. `kid_numel`: the template's key id and numel per row.
 * Returns -1, writing nothing, when the rows are not the template's (another tensor or numel at a
 * row) or hold a NaN (stored as null: the template cannot take it); else 1 when the step is
 * suspicious by the writer's rule (an amax that is not finite, or above 8x what its scale can
 * represent: BackgroundWriter._suspicious, same operations in the same order), 0 otherwise. */
int fp8s_fill_cheap_message(const double *rows, int64_t n, const double *kid_numel, const double *fp8_max,
                            int64_t step, int64_t *step_col, double *amax_col, double *scale_col,
                            double *scale_inv_col, double *expected_col) {
    for (int64_t i = 0; i < n; i++) {
        const double *r = rows + i * ROW_WIDTH;
        if (r[4] != kid_numel[2 * i] || r[5] != kid_numel[2 * i + 1]) return -1;
        if (r[0] != r[0] || r[1] != r[1] || r[2] != r[2] || r[3] != r[3]) return -1;
    }
    int suspicious = 0;
    for (int64_t i = 0; i < n; i++) {
        const double *r = rows + i * ROW_WIDTH;
        step_col[i] = step;
        amax_col[i] = r[0];
        scale_col[i] = r[1];
        scale_inv_col[i] = r[2];
        expected_col[i] = r[3];
        if (!isfinite(r[0]) || r[0] > 8.0 * r[2] * fp8_max[i]) suspicious = 1;
    }
    return suspicious;
}

int fp8s_abi_version(void) { return 6; }
