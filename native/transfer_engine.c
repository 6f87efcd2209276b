/* CPython module of the transfer engine: mooncake_server.transfer._native.
 *
 * Thin by design: argument parsing, buffer ownership and the GIL live in te_py_*.c; all I/O
 * and copying happen in te_*.c on native threads. Every call that may block releases the GIL.
 * The typed, documented surface is mooncake_server/transfer/engine.py (+ _native.pyi).
 */
#include "te_py.h"

#include <string.h>

module_state *te_py_state(PyObject *module) { return PyModule_GetState(module); }

/* Native messages may be cut mid-character by snprintf: decode leniently. */
PyObject *te_py_msg_str(const char *msg)
{
    return PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "replace");
}

void te_py_set_error(PyObject *type, const char *msg)
{
    PyObject *s = te_py_msg_str(msg);
    if (s) {
        PyErr_SetObject(type, s);
        Py_DECREF(s);
    }
}

/* ---- module ----------------------------------------------------------------------------- */

/* Below this many bytes a CRC takes microseconds: handing the GIL over and back would cost more
 * than it frees (and may wait out another thread's switch interval), so it is kept. */
#define CRC_GIL_FREE_BYTES (64u << 10)

static PyObject *mod_crc32c(PyObject *m, PyObject *args)
{
    (void)m;
    Py_buffer view;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &seed))
        return NULL;
    uint32_t c;
    if ((size_t)view.len < CRC_GIL_FREE_BYTES) {
        c = te_crc32c(seed, view.buf, (size_t)view.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        c = te_crc32c(seed, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(c);
}

/* (address, length[, seed]) arguments of the address forms. */
static int parse_addr_args(PyObject *args, unsigned long long *addr, unsigned long long *len,
                           unsigned int *seed)
{
    if (!PyArg_ParseTuple(args, "KK|I", addr, len, seed))
        return -1;
    if (!*addr && *len) {
        PyErr_SetString(PyExc_ValueError, "crc32c: NULL address");
        return -1;
    }
    return 0;
}

static PyObject *crc_addr_with(PyObject *args, uint32_t (*fn)(uint32_t, const void *, size_t))
{
    unsigned long long addr, len;
    unsigned int seed = 0;
    if (parse_addr_args(args, &addr, &len, &seed) < 0)
        return NULL;
    uint32_t c;
    if (len < CRC_GIL_FREE_BYTES) {
        c = fn(seed, (const void *)(uintptr_t)addr, (size_t)len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        c = fn(seed, (const void *)(uintptr_t)addr, (size_t)len);
        Py_END_ALLOW_THREADS
    }
    return PyLong_FromUnsignedLong(c);
}

static PyObject *mod_crc32c_addr(PyObject *m, PyObject *args)
{
    (void)m;
    return crc_addr_with(args, te_crc32c);
}

static PyObject *mod_crc32c_addr_serial(PyObject *m, PyObject *args)
{
    (void)m;
    return crc_addr_with(args, te_crc32c_serial);
}

/* One integer of a crc32c_many argument list, as an unsigned 64-bit value. */
static int list_u64(PyObject *seq, Py_ssize_t i, const char *what, unsigned long long *out)
{
    PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
    if (!PyLong_Check(item)) {
        PyErr_Format(PyExc_TypeError, "crc32c_many: %s[%zd] is not an int", what, i);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow > 0) {
        *out = PyLong_AsUnsignedLongLong(item); /* addresses above 2**63 */
        return PyErr_Occurred() ? -1 : 0;
    }
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow < 0 || v < 0) {
        PyErr_Format(PyExc_ValueError, "crc32c_many: %s[%zd] is negative", what, i);
        return -1;
    }
    *out = (unsigned long long)v;
    return 0;
}

static PyObject *mod_crc32c_many(PyObject *m, PyObject *args)
{
    (void)m;
    PyObject *addrs_obj, *sizes_obj;
    if (!PyArg_ParseTuple(args, "OO", &addrs_obj, &sizes_obj))
        return NULL;
    PyObject *addrs = PySequence_Fast(addrs_obj, "crc32c_many: addrs must be a sequence");
    if (!addrs)
        return NULL;
    PyObject *sizes = PySequence_Fast(sizes_obj, "crc32c_many: sizes must be a sequence");
    if (!sizes) {
        Py_DECREF(addrs);
        return NULL;
    }
    PyObject *result = NULL;
    unsigned long long *addr = NULL, *size = NULL;
    uint32_t *crc = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(addrs);
    if (PySequence_Fast_GET_SIZE(sizes) != n) {
        PyErr_Format(PyExc_ValueError, "crc32c_many: %zd addresses but %zd sizes", n,
                     PySequence_Fast_GET_SIZE(sizes));
        goto out;
    }
    addr = PyMem_Malloc(sizeof *addr * (size_t)(n ? n : 1));
    size = PyMem_Malloc(sizeof *size * (size_t)(n ? n : 1));
    crc = PyMem_Malloc(sizeof *crc * (size_t)(n ? n : 1));
    if (!addr || !size || !crc) {
        PyErr_NoMemory();
        goto out;
    }
    unsigned long long total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (list_u64(addrs, i, "addrs", &addr[i]) < 0 || list_u64(sizes, i, "sizes", &size[i]) < 0)
            goto out;
        if (!addr[i] && size[i]) {
            PyErr_Format(PyExc_ValueError, "crc32c_many: addrs[%zd] is NULL", i);
            goto out;
        }
        total += size[i];
    }
    /* the lists are copied out above: nothing below touches a Python object */
    if (total < CRC_GIL_FREE_BYTES) {
        for (Py_ssize_t i = 0; i < n; i++)
            crc[i] = te_crc32c(0, (const void *)(uintptr_t)addr[i], (size_t)size[i]);
    } else {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            crc[i] = te_crc32c(0, (const void *)(uintptr_t)addr[i], (size_t)size[i]);
        Py_END_ALLOW_THREADS
    }
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(crc[i]);
        if (!v) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, v);
    }
out:
    PyMem_Free(addr);
    PyMem_Free(size);
    PyMem_Free(crc);
    Py_DECREF(addrs);
    Py_DECREF(sizes);
    return result;
}

/* (dst, src, length): the shm transport's one-pass copy + CRC32C, exposed for its tests */
static PyObject *mod_crc32c_copy_addr(PyObject *m, PyObject *args)
{
    (void)m;
    unsigned long long dst, src, len;
    if (!PyArg_ParseTuple(args, "KKK", &dst, &src, &len))
        return NULL;
    if ((!dst || !src) && len) {
        PyErr_SetString(PyExc_ValueError, "crc32c_copy_addr: NULL address");
        return NULL;
    }
    uint32_t c;
    Py_BEGIN_ALLOW_THREADS
    c = te_crc32c_copy(0, (void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)len);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(c);
}

static PyObject *mod_crc32c_combine(PyObject *m, PyObject *args)
{
    (void)m;
    unsigned int a, b;
    unsigned long long len_b;
    if (!PyArg_ParseTuple(args, "IIK", &a, &b, &len_b))
        return NULL;
    return PyLong_FromUnsignedLong(te_crc32c_combine(a, b, len_b));
}

static PyObject *mod_crc32c_software(PyObject *m, PyObject *args)
{
    (void)m;
    Py_buffer view;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &seed))
        return NULL;
    uint32_t c = te_crc32c_sw(seed, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(c);
}

static PyObject *mod_rdma_probe(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    char names[4096];
    te_err err = {{0}};
    int n;
    Py_BEGIN_ALLOW_THREADS
    n = te_rdma_probe(names, sizeof names, &err);
    Py_END_ALLOW_THREADS
    PyObject *list = PyList_New(0);
    if (!list)
        return NULL;
    const char *p = names;
    for (int i = 0; i < n; i++, p += strlen(p) + 1) {
        PyObject *s = PyUnicode_DecodeUTF8(p, (Py_ssize_t)strlen(p), "replace");
        if (!s || PyList_Append(list, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(s);
    }
    return Py_BuildValue("(NN)", list, te_py_msg_str(n > 0 ? "" : err.msg));
}

static PyObject *mod_pick_transport(PyObject *m, PyObject *args)
{
    (void)m;
    int mode, shm_ok, rdma_local, rdma_peer;
    if (!PyArg_ParseTuple(args, "ippp", &mode, &shm_ok, &rdma_local, &rdma_peer))
        return NULL;
    te_err err = {{0}};
    int t = te_pick_transport(mode, shm_ok, rdma_local, rdma_peer, &err);
    if (t < 0) {
        te_py_set_error(PyExc_ValueError, err.msg);
        return NULL;
    }
    return PyLong_FromLong(t);
}

static PyMethodDef module_methods[] = {
    {"crc32c", mod_crc32c, METH_VARARGS, "CRC32C of a buffer (hardware when available)."},
    {"crc32c_addr", mod_crc32c_addr, METH_VARARGS, "CRC32C of raw memory (address, length)."},
    {"crc32c_software", mod_crc32c_software, METH_VARARGS, "Table CRC32C (for tests)."},
    {"crc32c_copy_addr", mod_crc32c_copy_addr, METH_VARARGS,
     "Copy length bytes src -> dst in one pass, returning the CRC32C of what was written."},
    {"crc32c_combine", mod_crc32c_combine, METH_VARARGS,
     "crc32c(A + B) from crc32c(A), crc32c(B) and len(B)."},
    {"crc32c_addr_serial", mod_crc32c_addr_serial, METH_VARARGS,
     "Single-chain hardware CRC32C of raw memory (the benchmark's baseline)."},
    {"crc32c_many", mod_crc32c_many, METH_VARARGS,
     "CRC32C (seed 0) of each (addrs[i], sizes[i]) in one call, GIL free for the batch."},
    {"rdma_probe", mod_rdma_probe, METH_NOARGS, "([device names], reason when none)."},
    {"pick_transport", mod_pick_transport, METH_VARARGS,
     "The transport open_segment picks: (mode, shm_ok, rdma_local, rdma_peer) -> TRANSPORT_*."},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *m)
{
    module_state *st = te_py_state(m);
    st->native_error = PyErr_NewExceptionWithDoc(
        "mooncake_server.transfer._native.NativeError",
        "Failure reported by the native transfer engine.", NULL, NULL);
    if (!st->native_error || PyModule_AddObjectRef(m, "NativeError", st->native_error) < 0)
        return -1;
    st->shared_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &te_py_shared_spec, NULL);
    if (!st->shared_type || PyModule_AddType(m, st->shared_type) < 0)
        return -1;
    st->engine_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &te_py_engine_spec, NULL);
    if (!st->engine_type || PyModule_AddType(m, st->engine_type) < 0)
        return -1;
    PyModule_AddIntConstant(m, "TRANSPORT_SHM", TE_TRANSPORT_SHM);
    PyModule_AddIntConstant(m, "TRANSPORT_TCP", TE_TRANSPORT_TCP);
    PyModule_AddIntConstant(m, "TRANSPORT_RDMA", TE_TRANSPORT_RDMA);
    PyModule_AddIntConstant(m, "MODE_RDMA", TE_MODE_RDMA);
    PyModule_AddIntConstant(m, "RDMA_BUILT", te_rdma_built());
    PyModule_AddIntConstant(m, "MODE_AUTO", TE_MODE_AUTO);
    PyModule_AddIntConstant(m, "MODE_SHM", TE_MODE_SHM);
    PyModule_AddIntConstant(m, "MODE_TCP", TE_MODE_TCP);
    PyModule_AddIntConstant(m, "MAX_SLICE_BYTES", TE_MAX_PAYLOAD);
    return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg)
{
    module_state *st = te_py_state(m);
    Py_VISIT(st->native_error);
    Py_VISIT(st->engine_type);
    Py_VISIT(st->shared_type);
    return 0;
}

static int module_clear(PyObject *m)
{
    module_state *st = te_py_state(m);
    Py_CLEAR(st->native_error);
    Py_CLEAR(st->engine_type);
    Py_CLEAR(st->shared_type);
    return 0;
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_native", "Native transfer engine (see engine.py).",
    sizeof(module_state), module_methods, module_slots, module_traverse, module_clear, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModuleDef_Init(&module_def); }

