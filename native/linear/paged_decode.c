/* Decode attention straight over the paged KV pool, float32, AVX2+FMA: `--dtype auto`'s.
 *
 * The torch path gathers each decoding sequence's context into one tensor (padded to 256
 * tokens so a row's reductions keep their shapes in any batch) and runs two batched matmuls:
 * at a 600-token context that was about a quarter of a one-token step on the bundled model.
 * Here the kernel reads each row's blocks where they lie and does exactly its own tokens' work:
 *
 * - a row's context is cut into spans of SPAN tokens (fixed by the row's own length); a work
 *   item is one span of one row, for every head: scores (an 8-lane dot product per token, summed
 *   in a fixed tree; four tokens and up to three query heads of a KV head at once, so the fmas
 *   overlap and each K load serves its query heads), then exp(s - the span's max) and its sum
 *   in token order, then the weighted V in token order; a span gives per head {max, sum, acc};
 * - the spans of a (row, head) are merged in span order, each rescaled by exp(its max - the
 *   max), then divided by the merged sum. A long context so spreads over the threads, and a
 *   row's result still depends only on its own tokens: not on the rows beside it, the thread
 *   count or the CPU. exp is a fixed polynomial (Cephes' expf), the same everywhere;
 * - a span's block runs are visited for every KV head in turn: the pool keeps a block's heads
 *   side by side. (Software prefetch of the next block's runs measured no gain here.)
 *
 * Pool layout (engine/kv_cache.py): a run of `bt` tokens x `d` floats per (block, layer, K|V,
 * KV head), run index ((block * layers + layer) * 2 + kv) * kv_heads + head.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "call_args.h"
#include "lanes.h"

typedef struct {
    const float *pool;
    const int64_t *tables;
    const int32_t *lens;
    int width, layer, layers, kv_heads, heads, d, bt;
    float scale;
} Plan;

/* The run holding tokens [block_no * bt, ...) of the K (kv 0) or V (kv 1) of KV head h of row r. */
static inline const float *run_at(const Plan *p, int r, int kv, int h, int block_no)
{
    const int64_t block = p->tables[(size_t)r * p->width + block_no];
    const int64_t run = ((block * p->layers + p->layer) * 2 + kv) * p->kv_heads + h;
    return p->pool + (size_t)run * p->bt * p->d;
}

#define MAX_D 256 /* head_dim this kernel takes */
#define SPAN 64 /* tokens per work item: a long context spreads over the threads */
#define GQ 3 /* query heads of one KV head per pass over its tokens (they share its K, V loads) */
#define TT 4 /* tokens scored at once: independent dot products, so the fmas overlap */

/* s[j * SPAN + u] = scale * q_j . k_u for `g` query heads (q_j d floats apart) and `nt` tokens
 * (TT or 1) from k on: one 8-lane fma chain over the head's dims per score, then lanes_sum. */
TARGET __attribute__((always_inline)) static inline void score(const float *q, int g, const float *k,
                                                               int nt, int d, float scale,
                                                               float *s)
{
    __m256 acc[GQ][TT];
    for (int j = 0; j < GQ; j++)
        for (int u = 0; u < TT; u++)
            acc[j][u] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
        __m256 kv[TT];
        for (int u = 0; u < nt; u++)
            kv[u] = _mm256_loadu_ps(k + (size_t)u * d + i);
        for (int j = 0; j < g; j++) {
            const __m256 qv = _mm256_loadu_ps(q + (size_t)j * d + i);
            for (int u = 0; u < nt; u++)
                acc[j][u] = _mm256_fmadd_ps(qv, kv[u], acc[j][u]);
        }
    }
    for (int j = 0; j < g; j++)
        for (int u = 0; u < nt; u++)
            s[j * SPAN + u] = lanes_sum(acc[j][u]) * scale;
}

/* `score` with g and nt constant, so each shape keeps its accumulators in registers. */
TARGET static void score_at(const float *q, int g, const float *k, int nt, int d, float scale,
                            float *s)
{
    if (nt == TT) {
        switch (g) {
        case 3: score(q, 3, k, TT, d, scale, s); break;
        case 2: score(q, 2, k, TT, d, scale, s); break;
        default: score(q, 1, k, TT, d, scale, s); break;
        }
    } else {
        switch (g) {
        case 3: score(q, 3, k, 1, d, scale, s); break;
        case 2: score(q, 2, k, 1, d, scale, s); break;
        default: score(q, 1, k, 1, d, scale, s); break;
        }
    }
}

/* acc_j[i0, i0 + 8 * nv) += e_j[t] v_t[i0, ...] over the `nt` tokens of one run (v on its first),
 * tokens in order: every lane's sum runs over the tokens ascending. */
TARGET __attribute__((always_inline)) static inline void weigh(const float *e, int g, const float *v,
                                                               int nt, int d, int i0, int nv,
                                                               float *acc)
{
    __m256 a[GQ][4];
    for (int j = 0; j < g; j++)
        for (int x = 0; x < nv; x++)
            a[j][x] = _mm256_loadu_ps(acc + (size_t)j * d + i0 + 8 * x);
    for (int t = 0; t < nt; t++, v += d)
        for (int j = 0; j < g; j++) {
            const __m256 w = _mm256_set1_ps(e[j * SPAN + t]);
            for (int x = 0; x < nv; x++)
                a[j][x] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + i0 + 8 * x), a[j][x]);
        }
    for (int j = 0; j < g; j++)
        for (int x = 0; x < nv; x++)
            _mm256_storeu_ps(acc + (size_t)j * d + i0 + 8 * x, a[j][x]);
}

/* `weigh` over the whole head, in slices of 32 dims (then 8) with g constant. */
TARGET static void weigh_run(const float *e, int g, const float *v, int nt, int d, float *acc)
{
    int i0 = 0;
#define WEIGH(G, NV) weigh(e, G, v, nt, d, i0, NV, acc)
    for (; i0 + 32 <= d; i0 += 32)
        switch (g) {
        case 3: WEIGH(3, 4); break;
        case 2: WEIGH(2, 4); break;
        default: WEIGH(1, 4); break;
        }
    for (; i0 < d; i0 += 8)
        switch (g) {
        case 3: WEIGH(3, 1); break;
        case 2: WEIGH(2, 1); break;
        default: WEIGH(1, 1); break;
        }
#undef WEIGH
}

/* The `nt` tokens of row r's run from token t on, for K (kv 0) or V (kv 1) of KV head h. */
static inline const float *tokens_at(const Plan *p, int r, int kv, int h, int t)
{
    return run_at(p, r, kv, h, t / p->bt) + (size_t)(t % p->bt) * p->d;
}

/* softmax's numerator in place over s[0, n) and its parts: part = {max, sum of exp(s - max)};
 * the sum in token order (8 lanes, then lanes_sum, then the tail). */
TARGET static void exp_span(float *s, int n, float *part)
{
    const int whole = n / 8 * 8;
    /* the max in 8 lanes (a max is exact in any order; a NaN score is passed over) */
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    for (int t = 0; t < whole; t += 8)
        top8 = _mm256_max_ps(_mm256_loadu_ps(s + t), top8);
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, top8);
    for (int i = 0; i < 8; i++)
        top = lanes[i] > top ? lanes[i] : top;
    for (int t = whole; t < n; t++)
        top = s[t] > top ? s[t] : top;
    __m256 sum8 = _mm256_setzero_ps();
    for (int t = 0; t < whole; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(top)));
        _mm256_storeu_ps(s + t, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = lanes_sum(sum8);
    if (whole < n) {
        float tail[8] = {0};
        for (int t = whole; t < n; t++)
            tail[t - whole] = s[t] - top;
        _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
        for (int t = whole; t < n; t++) {
            s[t] = tail[t - whole];
            sum += s[t];
        }
    }
    part[0] = top;
    part[1] = sum;
}

/* One work item: every query head of row r (q on its first) over tokens [t0, t1), one span.
 * Per head, its span's max score m, sum of exp(s - m) l and sum of exp(s - m) v, written as
 * part[qh] = {m, l, acc[d]}. A block's runs are visited for every KV head in turn (the pool
 * keeps them side by side), each KV head's query heads GQ at a time sharing its loads.
 * s: heads x SPAN floats, acc: heads x d floats of scratch. */
TARGET static void span_part(const Plan *p, int r, const float *q, int t0, int t1, float *s,
                             float *acc, float *part)
{
    const int d = p->d, bt = p->bt, group = p->heads / p->kv_heads, step = d + 2;
    for (int t = t0; t < t1;) { /* scores, a block's runs at a time */
        const int in_run = bt - t % bt, nt = t1 - t < in_run ? t1 - t : in_run;
        for (int h = 0; h < p->kv_heads; h++) {
            const float *k = tokens_at(p, r, 0, h, t);
            for (int j0 = 0; j0 < group; j0 += GQ) {
                const int g = group - j0 < GQ ? group - j0 : GQ, qh = h * group + j0;
                float *sq = s + (size_t)qh * SPAN + (t - t0);
                int u = 0;
                for (; u + TT <= nt; u += TT)
                    score_at(q + (size_t)qh * d, g, k + (size_t)u * d, TT, d, p->scale, sq + u);
                for (; u < nt; u++)
                    score_at(q + (size_t)qh * d, g, k + (size_t)u * d, 1, d, p->scale, sq + u);
            }
        }
        t += nt;
    }
    for (int qh = 0; qh < p->heads; qh++)
        exp_span(s + (size_t)qh * SPAN, t1 - t0, part + (size_t)qh * step);
    memset(acc, 0, (size_t)p->heads * d * sizeof(float));
    for (int t = t0; t < t1;) { /* weighted V, a block's runs at a time */
        const int in_run = bt - t % bt, nt = t1 - t < in_run ? t1 - t : in_run;
        for (int h = 0; h < p->kv_heads; h++) {
            const float *v = tokens_at(p, r, 1, h, t);
            for (int j0 = 0; j0 < group; j0 += GQ) {
                const int qh = h * group + j0;
                weigh_run(s + (size_t)qh * SPAN + (t - t0), group - j0 < GQ ? group - j0 : GQ, v,
                          nt, d, acc + (size_t)qh * d);
            }
        }
        t += nt;
    }
    for (int qh = 0; qh < p->heads; qh++)
        memcpy(part + (size_t)qh * step + 2, acc + (size_t)qh * d, (size_t)d * sizeof(float));
}

/* out = the spans' parts of one query head merged in span order: each part rescaled by
 * exp(m - max m), the sum of V over the sum of weights. */
TARGET static void merge(const float *part, int spans, int step, int d, float *out)
{
    if (spans == 0) { /* no tokens: nothing to attend to */
        memset(out, 0, (size_t)d * sizeof(float));
        return;
    }
    float top = -INFINITY;
    for (int sp = 0; sp < spans; sp++)
        top = part[(size_t)sp * step] > top ? part[(size_t)sp * step] : top;
    __m256 acc[MAX_D / 8];
    for (int i = 0; i < d / 8; i++)
        acc[i] = _mm256_setzero_ps();
    float sum = 0.0f;
    for (int sp = 0; sp < spans; sp++) {
        const float *pt = part + (size_t)sp * step;
        const float c = _mm256_cvtss_f32(exp8(_mm256_set1_ps(pt[0] - top)));
        sum = fmaf(c, pt[1], sum);
        const __m256 cv = _mm256_set1_ps(c);
        for (int i = 0; i < d / 8; i++)
            acc[i] = _mm256_fmadd_ps(cv, _mm256_loadu_ps(pt + 2 + 8 * i), acc[i]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int i = 0; i < d / 8; i++)
        _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], inv));
}

/* decode(q, q_row_stride, pool, tables, width, lens, rows, layer, layers, kv_heads, heads, d,
 *        bt, scale, out): addresses as ints; q rows of `heads` x d floats `q_row_stride` apart,
 *        out [rows, heads, d] contiguous. */
static PyObject *py_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Arg a[15];
    if (call_args(args, nargs, "iiiiiiiiiiiiifi", "decode", a))
        return NULL;
    Plan p = {ADDR(a[2]), ADDR(a[3]), ADDR(a[5]), (int)a[4].i, (int)a[7].i, (int)a[8].i,
              (int)a[9].i, (int)a[10].i, (int)a[11].i, (int)a[12].i, (float)a[13].f};
    const float *q = ADDR(a[0]);
    const long stride = a[1].i, rows = a[6].i;
    float *out = ADDR(a[14]);
    if (rows < 0 || p.d % 8 || p.d > MAX_D || p.kv_heads <= 0 || p.heads % p.kv_heads || p.bt <= 0) {
        PyErr_SetString(PyExc_ValueError, "bad decode shape");
        return NULL;
    }
    /* Work items: (row, span of SPAN tokens), a row's spans fixed by its own length; each
     * writes one part per query head, merged per (row, head) in span order. */
    const int step = p.d + 2;
    long *first = malloc(((size_t)rows + 1) * sizeof(long)); /* a row's first item */
    if (!first)
        return PyErr_NoMemory();
    first[0] = 0;
    for (long r = 0; r < rows; r++)
        first[r + 1] = first[r] + (p.lens[r] + SPAN - 1) / SPAN;
    const long items = first[rows];
    float *parts = malloc(((size_t)items * p.heads * step + 1) * sizeof(float));
    if (!parts) {
        free(first);
        return PyErr_NoMemory();
    }
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel reduction(|| : failed)
    {
        float *scratch = malloc((size_t)p.heads * (SPAN + p.d) * sizeof(float));
        failed = scratch == NULL;
        long r = 0;
#pragma omp for schedule(static)
        for (long it = 0; it < items; it++) {
            while (first[r + 1] <= it)
                r++;
            const int t0 = (int)(it - first[r]) * SPAN;
            if (scratch)
                span_part(&p, (int)r, q + r * stride, t0,
                          t0 + SPAN < p.lens[r] ? t0 + SPAN : p.lens[r], scratch,
                          scratch + (size_t)p.heads * SPAN, parts + (size_t)it * p.heads * step);
        }
        free(scratch);
#pragma omp for schedule(static)
        for (long i = 0; i < rows * p.heads; i++) {
            const long row = i / p.heads, qh = i % p.heads;
            merge(parts + ((size_t)first[row] * p.heads + qh) * step,
                  (int)(first[row + 1] - first[row]), p.heads * step, p.d, out + i * p.d);
        }
    }
    Py_END_ALLOW_THREADS
    free(parts);
    free(first);
    if (failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", (PyCFunction)(void (*)(void))py_decode, METH_FASTCALL,
     "Decode attention over the paged pool, one fixed order per row (addresses as ints)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged_decode",
                                    "Decode attention over the paged KV pool on AVX2+FMA.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__paged_decode(void) { return PyModule_Create(&module); }
