/* How the native modules of native/linear read their METH_FASTCALL arguments: addresses and
 * sizes as Python ints, a few floats. */
#ifndef MOONCAKE_CALL_ARGS_H
#define MOONCAKE_CALL_ARGS_H

#include <Python.h>

#include <stdint.h>
#include <string.h>

typedef union {
    long i;
    double f;
} Arg;

/* The arguments by `spec` (one letter each: 'i' an int, 'f' a float) into `out`: 0, or -1 with
 * the Python error set (a TypeError naming `name` when their count is not the spec's). */
static inline int call_args(PyObject *const *args, Py_ssize_t nargs, const char *spec,
                            const char *name, Arg *out)
{
    const Py_ssize_t want = (Py_ssize_t)strlen(spec);
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, want);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        if (spec[i] == 'f')
            out[i].f = PyFloat_AsDouble(args[i]);
        else
            out[i].i = PyLong_AsLong(args[i]);
        if (PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* An address argument as a pointer. */
#define ADDR(a) ((void *)(intptr_t)(a).i)

#endif
