/* int8 linear for small batches on AVX512-VNNI: y = x @ W.T + b with int8 weights.
 *
 * A decode step multiplies a few rows by every weight once, so its speed is weight bytes per
 * token. fbgemm's dynamic int8 linear streams int8 weights at ~13 GB/s on one-row calls here
 * (float32's GEMV streams ~22): it packs and quantizes the whole batch per call and runs a GEMM
 * tuned for many rows. This kernel is a GEMV for few rows:
 *
 * - weights: int8, symmetric per output channel, packed as [N/16][K/4][16][4] so that one
 *   64-byte load feeds VPDPBUSD with 16 output channels x 4 inputs (no horizontal sums);
 * - activations: quantized per row to unsigned bytes over the row's own range (asymmetric,
 *   round half to even); the zero point times sum(w) is taken off per channel after the dot;
 * - each output channel is computed by one thread in one order, and each row has its own scale,
 *   so a row's result does not depend on the thread count or on the other rows of the call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK_N 16 /* output channels per 512-bit accumulator */
#define K_ALIGN 64 /* packed input width is a multiple of this (4 unrolled steps of 4 bytes) */
#define MAX_ROWS 16 /* rows sharing one pass over a weight block */
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))

/* Quantize one row of k floats to k_pad bytes (asymmetric: zero maps to *zero; padding is
 * zero) and return its scale, NaN when the row holds a NaN or an infinity. */
TARGET static float quantize_row(const float *x, int k, int k_pad, uint8_t *out, int32_t *zero)
{
    __m512 vmax = _mm512_setzero_ps(), vmin = _mm512_setzero_ps();
    __mmask16 nan = 0; /* max/min drop NaNs: they are tracked on their own */
    int i = 0;
    for (; i + 16 <= k; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        vmax = _mm512_max_ps(vmax, v);
        vmin = _mm512_min_ps(vmin, v);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    float hi = _mm512_reduce_max_ps(vmax), lo = _mm512_reduce_min_ps(vmin);
    for (; i < k; i++) {
        hi = fmaxf(hi, x[i]);
        lo = fminf(lo, x[i]);
        nan |= isnan(x[i]);
    }
    const float range = hi - lo; /* the range always holds 0, so 0 is exact */
    if (nan || isinf(range) || range == 0.0f) {
        memset(out, 0, (size_t)k_pad);
        *zero = 0;
        return range == 0.0f && !nan ? 0.0f : NAN;
    }
    const float inv = 255.0f / range;
    const int32_t zp = (int32_t)fminf(fmaxf(nearbyintf(-lo * inv), 0.0f), 255.0f);
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i vzp = _mm512_set1_epi32(zp), top = _mm512_set1_epi32(255);
    for (i = 0; i + 16 <= k; i += 16) {
        /* cvtps rounds half to even under the default MXCSR, as torch.round does */
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), vinv));
        q = _mm512_min_epi32(_mm512_max_epi32(_mm512_add_epi32(q, vzp), _mm512_setzero_si512()),
                             top);
        _mm_storeu_si128((__m128i *)(out + i), _mm512_cvtepi32_epi8(q));
    }
    for (; i < k; i++) {
        const float q = nearbyintf(x[i] * inv) + (float)zp;
        out[i] = (uint8_t)fminf(fmaxf(q, 0.0f), 255.0f);
    }
    memset(out + k, 0, (size_t)(k_pad - k));
    *zero = zp;
    return range / 255.0f;
}

/* Rows [0, R) of xq times one packed block of 16 channels. VPDPBUSD's latency needs several
 * independent sums in flight: rows provide them, and few rows are unrolled along K instead. */
TARGET static inline __attribute__((always_inline)) void
block_rows(const uint8_t *xq, int k_pad, const int8_t *w, int R, __m512i *acc)
{
    const int U = R >= 8 ? 1 : R >= 4 ? 2 : R >= 2 ? 4 : 8;
    __m512i part[MAX_ROWS][8];
    for (int r = 0; r < R; r++)
        for (int u = 0; u < U; u++)
            part[r][u] = _mm512_setzero_si512();
    const int steps = k_pad / 4;
    for (int s = 0; s < steps; s += U) {
        for (int u = 0; u < U; u++) {
            const __m512i wv = _mm512_loadu_si512((const void *)(w + (size_t)(s + u) * 64));
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, xq + (size_t)r * k_pad + (size_t)(s + u) * 4, 4);
                part[r][u] = _mm512_dpbusd_epi32(part[r][u], _mm512_set1_epi32(four), wv);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        acc[r] = part[r][0];
        for (int u = 1; u < U; u++)
            acc[r] = _mm512_add_epi32(acc[r], part[r][u]);
    }
}

/* y rows [m0, m0+R), channels of block b: scale the integer dots back to floats. */
TARGET static inline __attribute__((always_inline)) void
store_rows(const __m512i *acc, int R, const float *xscale, const int32_t *xzero,
           const float *wscale, const int32_t *wsum, const float *bias, float *y, int n, int b)
{
    const int n0 = b * BLOCK_N;
    const __mmask16 mask = n - n0 >= BLOCK_N ? 0xFFFF : (__mmask16)((1u << (n - n0)) - 1);
    const __m512 ws = _mm512_loadu_ps(wscale + n0);
    const __m512i sums = _mm512_loadu_si512((const void *)(wsum + n0));
    const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
        const __m512i zero = _mm512_mullo_epi32(sums, _mm512_set1_epi32(xzero[r]));
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], zero));
        const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(xscale[r]));
        _mm512_mask_storeu_ps(y + (size_t)r * n + n0, mask, _mm512_fmadd_ps(dot, s, bv));
    }
}

#define ROWS_CASE(R)                                                          \
    case R:                                                                   \
        block_rows(xq, k_pad, w, R, acc);                                     \
        store_rows(acc, R, xscale, xzero, wscale, wsum, bias, y, n, b);       \
        break;

/* One block of 16 channels for up to MAX_ROWS rows (R a constant in each case: registers). */
TARGET static void block(const uint8_t *xq, const float *xscale, const int32_t *xzero, int rows,
                         int k_pad, const int8_t *w, const float *wscale, const int32_t *wsum,
                         const float *bias, float *y, int n, int b)
{
    __m512i acc[MAX_ROWS];
    switch (rows) {
        ROWS_CASE(1)
        ROWS_CASE(2)
        ROWS_CASE(3)
        ROWS_CASE(4)
        ROWS_CASE(5)
        ROWS_CASE(6)
        ROWS_CASE(7)
        ROWS_CASE(8)
        ROWS_CASE(9)
        ROWS_CASE(10)
        ROWS_CASE(11)
        ROWS_CASE(12)
        ROWS_CASE(13)
        ROWS_CASE(14)
        ROWS_CASE(15)
        ROWS_CASE(16)
    }
}

TARGET static void linear(const float *x, int m, int k, int k_pad, const int8_t *w, int n,
                          const float *wscale, const int32_t *wsum, const float *bias, float *y,
                          uint8_t *xq, float *xscale, int32_t *xzero)
{
    const int blocks = (n + BLOCK_N - 1) / BLOCK_N;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int r = 0; r < m; r++)
            xscale[r] = quantize_row(x + (size_t)r * k, k, k_pad, xq + (size_t)r * k_pad,
                                     xzero + r);
#pragma omp for schedule(static)
        for (int b = 0; b < blocks; b++) {
            const int8_t *wb = w + (size_t)b * BLOCK_N * k_pad;
            for (int r0 = 0; r0 < m; r0 += MAX_ROWS) {
                const int rows = m - r0 < MAX_ROWS ? m - r0 : MAX_ROWS;
                block(xq + (size_t)r0 * k_pad, xscale + r0, xzero + r0, rows, k_pad, wb, wscale,
                      wsum, bias, y + (size_t)r0 * n, n, b);
            }
        }
    }
}

/* linear(x, m, k, k_pad, w, n, wscale, wsum, bias, y): addresses as ints, bias 0 for none. */
static PyObject *py_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "linear takes 10 arguments");
        return NULL;
    }
    void *p[10];
    for (int i = 0; i < 10; i++) {
        p[i] = PyLong_AsVoidPtr(args[i]);
        if (PyErr_Occurred())
            return NULL;
    }
    const int m = (int)(intptr_t)p[1], k = (int)(intptr_t)p[2], k_pad = (int)(intptr_t)p[3];
    const int n = (int)(intptr_t)p[5];
    if (m < 0 || k <= 0 || k_pad < k || k_pad % K_ALIGN || n <= 0) {
        PyErr_SetString(PyExc_ValueError, "bad linear shape");
        return NULL;
    }
    if (m == 0)
        Py_RETURN_NONE;
    /* scales and zero points first: k_pad keeps the bytes after them aligned */
    float *xscale = malloc((size_t)m * (sizeof(float) + sizeof(int32_t)) + (size_t)m * k_pad);
    if (!xscale)
        return PyErr_NoMemory();
    int32_t *xzero = (int32_t *)(xscale + m);
    uint8_t *xq = (uint8_t *)(xzero + m);
    Py_BEGIN_ALLOW_THREADS
    linear(p[0], m, k, k_pad, p[4], n, p[6], p[7], p[8], p[9], xq, xscale, xzero);
    Py_END_ALLOW_THREADS
    free(xscale);
    Py_RETURN_NONE;
}

/* supported(): this CPU runs the kernel (AVX512F, AVX512BW and AVX512-VNNI). */
static PyObject *py_supported(PyObject *self, PyObject *unused)
{
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                           && __builtin_cpu_supports("avx512vnni"));
}

static PyMethodDef methods[] = {
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_FASTCALL,
     "y = x @ W.T + b over packed int8 weights (addresses as ints)."},
    {"supported", py_supported, METH_NOARGS, "This CPU has AVX512-VNNI."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_int8_vnni",
                                    "int8 GEMV for few rows on AVX512-VNNI.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__int8_vnni(void) { return PyModule_Create(&module); }
