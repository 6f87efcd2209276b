/* A decoder layer's small elementwise steps on float32 rows, AVX2+FMA, for `--dtype auto`.
 *
 * In torch each is several ops (rope: two muls, an add, two slices and a cat; SiLU-and-mul: a
 * split, silu and a mul), each with its own dispatch and output tensor: torch's profiler put
 * 2.6 ms of a one-token step of the bundled model in such small ops. Here each is one pass:
 *
 * - rope(x): q and k heads rotated in place, HF's rotate_half with the sign on the sin table
 *   (llama_stack.py): x * cos + swap_halves(x) * sin, the same two products and one sum per
 *   element as torch's ops, so the same bits (built with -ffp-contract=off: never an fma);
 * - silu_mul(gate|up): silu(g) * u = g / (1 + exp(-g)) * u with lanes.h's exp: per element, so
 *   a row's result does not depend on the rows beside it, the thread count or the CPU;
 * - kv_write: the new tokens' K and V heads copied to their pool rows (index_copy_'s work).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "call_args.h"
#include "lanes.h"

#define PARALLEL_ROWS 16 /* fewer rows than this run on the calling thread */

/* One head of d floats (d a multiple of 16) rotated in place by one row's tables. */
TARGET static inline void rope_head(float *x, int d, const float *c, const float *s)
{
    const int half = d / 2;
    for (int i = 0; i < half; i += 8) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
        const __m256 lo = _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                        _mm256_mul_ps(b, _mm256_loadu_ps(s + i)));
        const __m256 hi = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                        _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i)));
        _mm256_storeu_ps(x + i, lo);
        _mm256_storeu_ps(x + half + i, hi);
    }
}

TARGET static void rope(float *x, long rows, long stride, int heads, int d, const float *cos,
                        const float *sin)
{
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (long r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++)
            rope_head(x + r * stride + (long)h * d, d, cos + r * d, sin + r * d);
}

TARGET static void silu_mul(const float *gu, long rows, long inter, float *out)
{
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (long r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *y = out + r * inter;
        for (long i = 0; i < inter; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(zero, gv));
            _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)),
                                                  _mm256_loadu_ps(u + i)));
        }
    }
}

/* kv_write(src, tokens, src_stride, kv_heads, d, k_off, v_off, pool_rows, slots): addresses
 * as ints; each token's K heads (at float k_off of its row, rows `src_stride` floats apart) and
 * V heads (at v_off) copied to pool rows slots[i] and slots[n + i] of d floats, i = token *
 * kv_heads + head, n = tokens * kv_heads (slots int64, attention.py's slot_rows of a layer). */
static PyObject *py_kv_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Arg a[9];
    if (call_args(args, nargs, "iiiiiiiii", "kv_write", a))
        return NULL;
    const float *src = ADDR(a[0]);
    const long tokens = a[1].i, stride = a[2].i, kv_heads = a[3].i, d = a[4].i;
    const long k_off = a[5].i, v_off = a[6].i;
    float *rows = ADDR(a[7]);
    const int64_t *slots = ADDR(a[8]);
    if (tokens < 0 || kv_heads <= 0 || d <= 0 || k_off < 0 || v_off < 0
        || k_off + kv_heads * d > stride || v_off + kv_heads * d > stride) {
        PyErr_SetString(PyExc_ValueError, "bad kv_write shape");
        return NULL;
    }
    const long n = tokens * kv_heads;
    for (long i = 0; i < n; i++) {
        const float *row = src + (i / kv_heads) * stride + (i % kv_heads) * d;
        memcpy(rows + slots[i] * d, row + k_off, (size_t)d * sizeof(float));
        memcpy(rows + slots[n + i] * d, row + v_off, (size_t)d * sizeof(float));
    }
    Py_RETURN_NONE;
}

/* rope(x, rows, row_stride, heads, d, cos, sin): addresses as ints; the first `heads` heads
 * of each row (d floats each, rows `row_stride` floats apart) rotated in place; cos and sin
 * [rows, d] contiguous. */
static PyObject *py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Arg a[7];
    if (call_args(args, nargs, "iiiiiii", "rope", a))
        return NULL;
    float *x = ADDR(a[0]);
    const long rows = a[1].i, stride = a[2].i, heads = a[3].i, d = a[4].i;
    const float *cos = ADDR(a[5]), *sin = ADDR(a[6]);
    if (rows < 0 || heads < 0 || d <= 0 || d % 16 || stride < heads * d) {
        PyErr_SetString(PyExc_ValueError, "bad rope shape");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rope(x, rows, stride, (int)heads, (int)d, cos, sin);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* silu_mul(gu, rows, inter, out): addresses as ints; gu [rows, 2 * inter] (gate then up),
 * out [rows, inter], both contiguous. */
static PyObject *py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Arg a[4];
    if (call_args(args, nargs, "iiii", "silu_mul", a))
        return NULL;
    const float *gu = ADDR(a[0]);
    const long rows = a[1].i, inter = a[2].i;
    float *out = ADDR(a[3]);
    if (rows < 0 || inter <= 0 || inter % 8) {
        PyErr_SetString(PyExc_ValueError, "bad silu_mul shape");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    silu_mul(gu, rows, inter, out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rope", (PyCFunction)(void (*)(void))py_rope, METH_FASTCALL,
     "Rotate q/k heads in place: x * cos + swap_halves(x) * sin (addresses as ints)."},
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL,
     "out = silu(gate) * up per row of gate|up (addresses as ints)."},
    {"kv_write", (PyCFunction)(void (*)(void))py_kv_write, METH_FASTCALL,
     "Copy new tokens' K and V heads to their pool rows (addresses as ints)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_row_ops",
                                    "A decoder layer's elementwise steps on AVX2+FMA.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__row_ops(void) { return PyModule_Create(&module); }
