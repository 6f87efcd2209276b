/* RMSNorm over rows of float32 on AVX2+FMA, for `--dtype auto`'s forward.
 *
 * torch's CPU rms_norm runs as several ops (pow, mean, add, rsqrt, two muls), ~25 us a call on
 * a one-token row of the bundled model, 61 calls a decode step: about a tenth of the step. Here
 * one pass per row: the squares summed in one fixed order (8 lanes over the row ascending, then
 * the lanes in a fixed tree), so a row's result does not depend on the rows beside it, the
 * thread count or the CPU, as for the linears of the same mode (w8_group.c). Math as HF's
 * LlamaRMSNorm in float32: y = w * (x * 1/sqrt(mean(x^2) + eps)).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "call_args.h"
#include "lanes.h"


/* One row of d floats (d a multiple of 8). */
TARGET static void norm_row(const float *x, int d, const float *w, float eps, float *y)
{
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    const float inv = 1.0f / sqrtf(lanes_sum(acc) / (float)d + eps);
    const __m256 r = _mm256_set1_ps(inv);
    for (int i = 0; i < d; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                              _mm256_mul_ps(_mm256_loadu_ps(x + i), r)));
}

/* rms_norm(x, rows, d, w, eps, y): addresses as ints; rows of d contiguous floats. */
static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Arg a[6];
    if (call_args(args, nargs, "iiiifi", "rms_norm", a))
        return NULL;
    const float *x = ADDR(a[0]), *w = ADDR(a[3]);
    const long rows = a[1].i, d = a[2].i;
    const double eps = a[4].f;
    float *y = ADDR(a[5]);
    if (rows < 0 || d <= 0 || d % 8) {
        PyErr_SetString(PyExc_ValueError, "bad rms_norm shape");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    for (long r = 0; r < rows; r++)
        norm_row(x + r * d, (int)d, w, (float)eps, y + r * d);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL,
     "y = w * x / sqrt(mean(x^2) + eps) per row, in one fixed order (addresses as ints)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_row_norm",
                                    "RMSNorm over float32 rows on AVX2+FMA.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__row_norm(void) { return PyModule_Create(&module); }
