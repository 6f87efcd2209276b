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

static PyObject *mod_crc32c(PyObject *m, PyObject *args)
{
    (void)m;
    Py_buffer view;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &view, &seed))
        return NULL;
    uint32_t c;
    Py_BEGIN_ALLOW_THREADS
    c = te_crc32c(seed, view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(c);
}

static PyObject *mod_crc32c_addr(PyObject *m, PyObject *args)
{
    (void)m;
    unsigned long long addr, len;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "KK|I", &addr, &len, &seed))
        return NULL;
    if (!addr && len)
        return PyErr_Format(PyExc_ValueError, "crc32c: NULL address");
    uint32_t c;
    Py_BEGIN_ALLOW_THREADS
    c = te_crc32c(seed, (const void *)(uintptr_t)addr, (size_t)len);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(c);
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

