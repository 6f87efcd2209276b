/* Decode attention straight over the paged KV pool, float32, AVX2+FMA: `--dtype auto`'s.
 *
 * The torch path gathers each decoding sequence's context into one tensor (padded to 256
 * tokens so a row's reductions keep their shapes in any batch) and runs two batched matmuls:
 * at a 600-token context that was about a quarter of a one-token step on the bundled model.
 * Here each (sequence, query head) reads its KV head's blocks where they lie and does exactly
 * its own tokens' work, in one fixed order: a score is an 8-lane dot product summed in a fixed
 * tree; the softmax's sum and the weighted sum of V run over the tokens in order; one thread
 * does one (sequence, head) whole. So a row's result does not depend on the rows beside it,
 * the thread count or the CPU. exp is a fixed polynomial (Cephes' expf), the same everywhere.
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

#include "lanes.h"

/* exp(x) for 8 floats: range reduction by ln 2, a degree-5 polynomial, 2^n by exponent bits
 * (Cephes' expf; within 2 ulp; inputs here are <= 0 after the max is taken off). */
TARGET static inline __m256 exp8(__m256 x)
{
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)),
                      _mm256_set1_ps(-87.3365478515625f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

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

#define MAX_D 256 /* head_dim this kernel takes (the accumulators of one V row) */

/* One query head of one row: out = softmax(scale * q.K) V over the row's tokens. */
TARGET static void head(const Plan *p, int r, int qh, const float *q, float *s, float *out)
{
    const int h = qh / (p->heads / p->kv_heads), n = p->lens[r], d = p->d, bt = p->bt;
    float top = -INFINITY;
    for (int t0 = 0; t0 < n; t0 += bt) {
        const float *k = run_at(p, r, 0, h, t0 / bt);
        for (int t = t0; t < n && t < t0 + bt; t++, k += d) {
            __m256 acc = _mm256_setzero_ps();
            for (int i = 0; i < d; i += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), acc);
            s[t] = lanes_sum(acc) * p->scale;
            top = s[t] > top ? s[t] : top;
        }
    }
    const int whole = n / 8 * 8;
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
    const float inv = 1.0f / sum;
    __m256 acc[MAX_D / 8];
    for (int i = 0; i < d / 8; i++)
        acc[i] = _mm256_setzero_ps();
    for (int t0 = 0; t0 < n; t0 += bt) {
        const float *v = run_at(p, r, 1, h, t0 / bt);
        for (int t = t0; t < n && t < t0 + bt; t++, v += d) {
            const __m256 w = _mm256_set1_ps(s[t] * inv);
            for (int i = 0; i < d / 8; i++)
                acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * i), acc[i]);
        }
    }
    for (int i = 0; i < d / 8; i++)
        _mm256_storeu_ps(out + 8 * i, acc[i]);
}

/* decode(q, q_row_stride, pool, tables, width, lens, rows, layer, layers, kv_heads, heads, d,
 *        bt, scale, out): addresses as ints; q rows of `heads` x d floats `q_row_stride` apart,
 *        out [rows, heads, d] contiguous. */
static PyObject *py_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 15) {
        PyErr_SetString(PyExc_TypeError, "decode takes 15 arguments");
        return NULL;
    }
    long v[15];
    for (int i = 0; i < 15; i++) {
        if (i == 13)
            continue;
        v[i] = PyLong_AsLong(args[i]);
    }
    const double scale = PyFloat_AsDouble(args[13]);
    if (PyErr_Occurred())
        return NULL;
    Plan p = {(const float *)(intptr_t)v[2], (const int64_t *)(intptr_t)v[3],
              (const int32_t *)(intptr_t)v[5], (int)v[4], (int)v[7], (int)v[8], (int)v[9],
              (int)v[10], (int)v[11], (int)v[12], (float)scale};
    const float *q = (const float *)(intptr_t)v[0];
    const long stride = v[1], rows = v[6];
    float *out = (float *)(intptr_t)v[14];
    if (rows < 0 || p.d % 8 || p.d > MAX_D || p.kv_heads <= 0 || p.heads % p.kv_heads || p.bt <= 0) {
        PyErr_SetString(PyExc_ValueError, "bad decode shape");
        return NULL;
    }
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel reduction(|| : failed)
    {
        int most = 0;
        for (long r = 0; r < rows; r++)
            most = p.lens[r] > most ? p.lens[r] : most;
        float *s = malloc(((size_t)most + 8) * sizeof(float));
        failed = s == NULL;
#pragma omp for schedule(static)
        for (long i = 0; i < rows * p.heads; i++) {
            const long r = i / p.heads, qh = i % p.heads;
            if (s)
                head(&p, (int)r, (int)qh, q + r * stride + qh * p.d, s,
                     out + (r * p.heads + qh) * p.d);
        }
        free(s);
    }
    Py_END_ALLOW_THREADS
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
