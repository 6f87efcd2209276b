/* Weight-only int8 linear on AVX2+FMA: y = x @ W.T + b, float32 activations, int8 weights.
 *
 * `--dtype auto`'s kernel. Decode reads every weight once per step, so int8 weights (a quarter
 * of float32's bytes) make one-token steps faster; the activations stay float32, so the only
 * rounding against float32 is the weights', and that one is small:
 *
 * - weights: groups of GROUP inputs per output channel, each group stored as unsigned bytes q
 *   with its own scale s and offset m (w = s * q + m, q spanning the group's range in 255
 *   steps). A model converted from a 4-bit GGUF (the bundled default) has at most 16 distinct
 *   values per group, spread evenly: they land on exact byte levels and come back within one
 *   float32 rounding;
 * - packed as [N/BLOCK_N][K/8][BLOCK_N][8]: one 8-byte load is 8 inputs of one channel;
 * - a linear whose every group is exactly s * n + m with n in 0..15 (a Q4_1 GGUF's blocks: s and
 *   m are the block's own scale and min) is packed in 4 bits instead, [N/BLOCK_N][K/16][BLOCK_N][8]:
 *   byte j of a channel's 8 holds input j in its low nibble and input j + 8 in its high one.
 *   Decode reads half the bytes; each weight is still the float n * s + m, and each output
 *   takes the very same sequence of fmas as from bytes;
 * - few rows (decode) turn each weight byte into a float in registers; many rows (prefill)
 *   dequantize a slab of channels into float32 once and pass every row over it. Both compute
 *   each weight as the same q * s + m;
 * - every output is summed in one fixed order (8 lanes over k ascending, then the lanes in a
 *   fixed tree, then the bias), whatever the number of rows in the call, the tile a row lands
 *   in, or the thread count: a row's result does not depend on what shares its call. The same
 *   instructions run on every x86-64 CPU with AVX2 and FMA, so results agree across them too.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "call_args.h"
#include "lanes.h"

#define GROUP 32 /* inputs per scale and offset */
#define BLOCK_N 2 /* output channels per tile */
#define TILE_M 4 /* rows per tile: 8 accumulators + 2 weights + 1 input of 16 registers */
#define WIDE_N 3 /* channels per tile from dequantized weights: 12 accumulators + 3 + 1 */
#define SLAB_N 48 /* channels dequantized at once for many rows (a multiple of WIDE_N) */
#define NARROW_ROWS 4 /* up to this many rows, weights are dequantized in registers */

/* An output: v, or the residual already in *y plus v (torch's `x + linear(h)`: one rounding). */
static inline void put(float *y, float v, int add) { *y = add ? *y + v : v; }

/* The weights of `BLOCK_N` channels for inputs [k, k+8): q * s + m per lane. */
TARGET static inline __m256 weights(const uint8_t *q, __m256 s, __m256 m)
{
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), s, m);
}

/* 4-bit: the weights of one channel for inputs [k, k+16) from its 8 bytes (`lo` the first 8). */
TARGET static inline void weights4(const uint8_t *q, __m256 s, __m256 m, __m256 *lo, __m256 *hi)
{
    const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    *lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(wide, _mm256_set1_epi32(15))), s, m);
    *hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4)), s, m);
}

/* acc[r][c] += w[c] * x[r][0..8) for each row and channel. */
TARGET static inline void fma_rows(const float *x, int k, int rows, const __m256 *w,
                                   __m256 acc[TILE_M][BLOCK_N])
{
    for (int r = 0; r < rows; r++) {
        const __m256 xv = _mm256_loadu_ps(x + (size_t)r * k);
        for (int c = 0; c < BLOCK_N; c++)
            acc[r][c] = _mm256_fmadd_ps(w[c], xv, acc[r][c]);
    }
}

/* Rows [r0, r0+rows) (rows <= TILE_M) times the BLOCK_N channels of block `b`. Each output's
 * arithmetic is the same whatever `rows` is: the compiler unrolls per `rows`, nothing else. */
TARGET static inline void tile(const float *x, int k, int rows, const uint8_t *qb,
                               const float *sb, const float *mb, const float *bias, float *y,
                               int n, int b, int bits, int add)
{
    __m256 acc[TILE_M][BLOCK_N];
    for (int r = 0; r < TILE_M; r++)
        for (int c = 0; c < BLOCK_N; c++)
            acc[r][c] = _mm256_setzero_ps();
    for (int g = 0; g < k / GROUP; g++) {
        __m256 s[BLOCK_N], m[BLOCK_N];
        for (int c = 0; c < BLOCK_N; c++) {
            s[c] = _mm256_set1_ps(sb[g * BLOCK_N + c]);
            m[c] = _mm256_set1_ps(mb[g * BLOCK_N + c]);
        }
        for (int j = 0; j < GROUP; j += 16) {
            const int kk = g * GROUP + j;
            /* inputs [kk, kk+8) then [kk+8, kk+16): each accumulator's fmas in k order */
            __m256 lo[BLOCK_N], hi[BLOCK_N];
            for (int c = 0; c < BLOCK_N; c++) {
                if (bits == 4)
                    weights4(qb + (size_t)kk * BLOCK_N / 2 + c * 8, s[c], m[c], &lo[c], &hi[c]);
                else
                    lo[c] = weights(qb + (size_t)kk * BLOCK_N + c * 8, s[c], m[c]);
            }
            fma_rows(x + kk, k, rows, lo, acc);
            if (bits != 4)
                for (int c = 0; c < BLOCK_N; c++)
                    hi[c] = weights(qb + (size_t)(kk + 8) * BLOCK_N + c * 8, s[c], m[c]);
            fma_rows(x + kk + 8, k, rows, hi, acc);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < BLOCK_N; c++) {
            const int ch = b * BLOCK_N + c;
            if (ch < n)
                put(y + (size_t)r * n + ch, lanes_sum(acc[r][c]) + (bias ? bias[ch] : 0.0f), add);
        }
}

/* The tile for a full TILE_M rows and for 1..3 rows, from bytes or nibbles: each a constant row
 * count and width, unrolled. */
TARGET static void tile_rows(const float *x, int k, int rows, const uint8_t *qb, const float *sb,
                             const float *mb, const float *bias, float *y, int n, int b, int bits,
                             int add)
{
#define TILE(R, B) tile(x, k, R, qb, sb, mb, bias, y, n, b, B, add)
    if (bits == 4) {
        switch (rows) {
        case 4: TILE(4, 4); break;
        case 3: TILE(3, 4); break;
        case 2: TILE(2, 4); break;
        default: TILE(1, 4); break;
        }
    } else {
        switch (rows) {
        case 4: TILE(4, 8); break;
        case 3: TILE(3, 8); break;
        case 2: TILE(2, 8); break;
        default: TILE(1, 8); break;
        }
    }
#undef TILE
}

/* Channel `c` of block `b`, dequantized to float32 into `w` (k floats): the same q * s + m per
 * lane that `weights` gives, so both paths multiply by the very same values. */
TARGET static void dequantize(const uint8_t *qb, const float *sb, const float *mb, int k, int c,
                              float *w, int bits)
{
    for (int g = 0; g < k / GROUP; g++) {
        const __m256 s = _mm256_set1_ps(sb[g * BLOCK_N + c]), m = _mm256_set1_ps(mb[g * BLOCK_N + c]);
        for (int j = 0; j < GROUP; j += 16) {
            const int kk = g * GROUP + j;
            __m256 lo, hi;
            if (bits == 4) {
                weights4(qb + (size_t)kk * BLOCK_N / 2 + c * 8, s, m, &lo, &hi);
            } else {
                lo = weights(qb + (size_t)kk * BLOCK_N + c * 8, s, m);
                hi = weights(qb + (size_t)(kk + 8) * BLOCK_N + c * 8, s, m);
            }
            _mm256_storeu_ps(w + kk, lo);
            _mm256_storeu_ps(w + kk + 8, hi);
        }
    }
}

/* rows x chans outputs from dequantized weights `w` (chans rows of k floats, channel-major):
 * per output, lane-wise fma over k ascending, then lanes_sum, then the bias - as `tile`. */
TARGET static inline void wide_tile(const float *x, int k, int rows, const float *w, int chans,
                                    const float *bias, float *y, int n, int ch0, int add)
{
    __m256 acc[TILE_M][WIDE_N];
    for (int r = 0; r < TILE_M; r++)
        for (int c = 0; c < WIDE_N; c++)
            acc[r][c] = _mm256_setzero_ps();
    for (int kk = 0; kk < k; kk += 8) {
        __m256 wv[WIDE_N];
        for (int c = 0; c < chans; c++)
            wv[c] = _mm256_loadu_ps(w + (size_t)c * k + kk);
        for (int r = 0; r < rows; r++) {
            const __m256 xv = _mm256_loadu_ps(x + (size_t)r * k + kk);
            for (int c = 0; c < chans; c++)
                acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chans; c++)
            put(y + (size_t)r * n + ch0 + c, lanes_sum(acc[r][c]) + (bias ? bias[ch0 + c] : 0.0f),
                add);
}

/* wide_tile with constant shapes, so each is unrolled with its accumulators in registers. */
TARGET static void wide_rows(const float *x, int k, int rows, const float *w, int chans,
                             const float *bias, float *y, int n, int ch0, int add)
{
#define WIDE(R, C) wide_tile(x, k, R, w, C, bias, y, n, ch0, add)
    if (chans == WIDE_N) {
        switch (rows) {
        case 4: WIDE(4, 3); break;
        case 3: WIDE(3, 3); break;
        case 2: WIDE(2, 3); break;
        default: WIDE(1, 3); break;
        }
    } else {
        for (int c = 0; c < chans; c++)
            for (int r = 0; r < rows; r++)
                wide_tile(x + (size_t)r * k, k, 1, w + (size_t)c * k, 1, bias, y + (size_t)r * n,
                          n, ch0 + c, add);
    }
#undef WIDE
}

/* Few rows: each weight byte is read once and turned into a float in registers. */
TARGET static void narrow(const float *x, int m, int k, const uint8_t *q, const float *scale,
                          const float *offset, int n, const float *bias, float *y, int bits,
                          int add)
{
    const int blocks = (n + BLOCK_N - 1) / BLOCK_N;
#pragma omp parallel for schedule(static)
    for (int b = 0; b < blocks; b++) {
        const uint8_t *qb = q + (size_t)b * BLOCK_N * k * bits / 8;
        const float *sb = scale + (size_t)b * BLOCK_N * (k / GROUP);
        const float *mb = offset + (size_t)b * BLOCK_N * (k / GROUP);
        for (int r0 = 0; r0 < m; r0 += TILE_M) {
            const int rows = m - r0 < TILE_M ? m - r0 : TILE_M;
            tile_rows(x + (size_t)r0 * k, k, rows, qb, sb, mb, bias, y + (size_t)r0 * n, n, b,
                      bits, add);
        }
    }
}

/* Many rows: a slab of channels is dequantized once, then every row passes over it. */
TARGET static int wide(const float *x, int m, int k, const uint8_t *q, const float *scale,
                       const float *offset, int n, const float *bias, float *y, int bits, int add)
{
    const int slabs = (n + SLAB_N - 1) / SLAB_N;
    int failed = 0;
#pragma omp parallel reduction(|| : failed)
    {
        float *w = aligned_alloc(64, (size_t)SLAB_N * k * sizeof(float));
        failed = w == NULL;
#pragma omp for schedule(static)
        for (int sl = 0; sl < slabs; sl++) {
            if (!w)
                continue;
            const int ch0 = sl * SLAB_N, chans = n - ch0 < SLAB_N ? n - ch0 : SLAB_N;
            for (int c = 0; c < chans; c++) {
                const int ch = ch0 + c, b = ch / BLOCK_N;
                dequantize(q + (size_t)b * BLOCK_N * k * bits / 8,
                           scale + (size_t)b * BLOCK_N * (k / GROUP),
                           offset + (size_t)b * BLOCK_N * (k / GROUP), k, ch % BLOCK_N,
                           w + (size_t)c * k, bits);
            }
            for (int r0 = 0; r0 < m; r0 += TILE_M) {
                const int rows = m - r0 < TILE_M ? m - r0 : TILE_M;
                for (int c0 = 0; c0 < chans; c0 += WIDE_N) {
                    const int cc = chans - c0 < WIDE_N ? chans - c0 : WIDE_N;
                    wide_rows(x + (size_t)r0 * k, k, rows, w + (size_t)c0 * k, cc, bias,
                              y + (size_t)r0 * n, n, ch0 + c0, add);
                }
            }
        }
        free(w);
    }
    return failed;
}

/* linear(x, m, k, q, scale, offset, n, bias, y, bits, add): addresses as ints, bias 0 for none,
 * bits 8 (bytes) or 4 (nibbles); add 1: y += x @ W.T + b (y holds the residual), else y =. */
static PyObject *py_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Arg a[11];
    if (call_args(args, nargs, "iiiiiiiiiii", "linear", a))
        return NULL;
    const int m = (int)a[1].i, k = (int)a[2].i, n = (int)a[6].i, bits = (int)a[9].i;
    const int add = a[10].i != 0;
    if (m < 0 || k <= 0 || k % GROUP || n <= 0 || (bits != 4 && bits != 8)) {
        PyErr_SetString(PyExc_ValueError, "bad linear shape");
        return NULL;
    }
    if (m == 0)
        Py_RETURN_NONE;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    if (m <= NARROW_ROWS)
        narrow(ADDR(a[0]), m, k, ADDR(a[3]), ADDR(a[4]), ADDR(a[5]), n, ADDR(a[7]), ADDR(a[8]),
               bits, add);
    else
        failed = wide(ADDR(a[0]), m, k, ADDR(a[3]), ADDR(a[4]), ADDR(a[5]), n, ADDR(a[7]),
                      ADDR(a[8]), bits, add);
    Py_END_ALLOW_THREADS
    if (failed)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* supported(): this CPU runs the kernel (AVX2 and FMA). */
static PyObject *py_supported(PyObject *self, PyObject *unused)
{
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
}

static PyMethodDef methods[] = {
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_FASTCALL,
     "y = x @ W.T + b over packed grouped 8- or 4-bit weights (addresses as ints)."},
    {"supported", py_supported, METH_NOARGS, "This CPU has AVX2 and FMA."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_w8_group",
                                    "Weight-only grouped int8 linear on AVX2+FMA.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__w8_group(void) { return PyModule_Create(&module); }
