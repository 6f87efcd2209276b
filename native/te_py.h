/* Private header of the CPython binding (transfer_engine.c, te_py_engine.c, te_py_memory.c). */
#ifndef MOONCAKE_TE_PY_H
#define MOONCAKE_TE_PY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "te.h"

typedef struct {
    PyObject *native_error;
    PyTypeObject *engine_type;
    PyTypeObject *shared_type;
} module_state;

typedef struct {
    PyObject_HEAD
    te_engine *eng;
    PyObject *error; /* NativeError class (borrowed from the module, kept alive by us) */
    pthread_mutex_t busy_mu;
    pthread_cond_t busy_cv;
    int busy; /* calls running without the GIL; close() waits for them */
} Engine;

extern PyType_Spec te_py_shared_spec;
extern PyType_Spec te_py_engine_spec;

module_state *te_py_state(PyObject *module);
PyObject *te_py_msg_str(const char *msg);
void te_py_set_error(PyObject *type, const char *msg);
int te_py_enter(Engine *self);
void te_py_leave(Engine *self);
void te_py_release_region(te_region *r);
PyObject *te_py_alloc_shared(Engine *self, PyObject *args);
PyObject *te_py_register_memory(Engine *self, PyObject *args);
PyObject *te_py_unregister_memory(Engine *self, PyObject *args);

#endif
