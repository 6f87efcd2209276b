/* Registered memory for the binding: SharedBuffer (memfd), register/unregister. */
#include "te_py.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- SharedBuffer: memfd-backed memory exporting the buffer protocol -------------------- */

typedef struct {
    PyObject_HEAD
    uint8_t *addr;
    size_t size;
    int fd;
} SharedBuffer;

static int shared_getbuffer(PyObject *self, Py_buffer *view, int flags)
{
    SharedBuffer *s = (SharedBuffer *)self;
    return PyBuffer_FillInfo(view, self, s->addr, (Py_ssize_t)s->size, 0, flags);
}

static void shared_dealloc(PyObject *self)
{
    SharedBuffer *s = (SharedBuffer *)self;
    if (s->addr)
        munmap(s->addr, s->size);
    if (s->fd >= 0)
        close(s->fd);
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *shared_address(PyObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromVoidPtr(((SharedBuffer *)self)->addr);
}

static PyGetSetDef shared_getset[] = {
    {"address", shared_address, NULL, "Absolute address of the mapping.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot shared_slots[] = {
    {Py_bf_getbuffer, shared_getbuffer},
    {Py_tp_dealloc, shared_dealloc},
    {Py_tp_getset, shared_getset},
    {Py_tp_doc, "Zero-filled shared memory (memfd) that same-host peers can map."},
    {0, NULL},
};

PyType_Spec te_py_shared_spec = {
    "mooncake_server.transfer._native.SharedBuffer", sizeof(SharedBuffer), 0,
    Py_TPFLAGS_DEFAULT, shared_slots,
};

void te_py_release_region(te_region *r)
{
    te_rdma_dereg(r); /* the NIC lets go of the pages before Python may free them */
    Py_buffer *view = r->owner;
    if (view) {
        PyBuffer_Release(view);
        PyMem_Free(view);
    }
    PyMem_Free(r);
}

static int check_name(const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n > TE_MAX_NAME) {
        PyErr_Format(PyExc_ValueError, "segment name must be 1..%d bytes, got %zu", TE_MAX_NAME,
                     n);
        return -1;
    }
    return 0;
}

/* Register view (owned from now on) as segment name; shm_fd >= 0 makes it mappable by peers. */
static int add_region(Engine *self, const char *name, Py_buffer *view, int shm_fd)
{
    te_region *r = PyMem_Calloc(1, sizeof *r);
    if (!r) {
        PyBuffer_Release(view);
        PyMem_Free(view);
        PyErr_NoMemory();
        return -1;
    }
    snprintf(r->name, sizeof r->name, "%s", name);
    r->addr = view->buf;
    r->len = (size_t)view->len;
    r->owner = view;
    r->shm_fd = shm_fd;
    if (shm_fd >= 0) {
        struct stat st;
        if (fstat(shm_fd, &st) == 0) {
            r->dev = (uint64_t)st.st_dev;
            r->ino = (uint64_t)st.st_ino;
        }
    }
    te_err err = {{0}};
    if (te_region_add(self->eng, r, &err)) {
        te_py_release_region(r);
        te_py_set_error(PyExc_ValueError, err.msg);
        return -1;
    }
    return 0;
}

PyObject *te_py_alloc_shared(Engine *self, PyObject *args)
{
    const char *name;
    unsigned long long nbytes;
    if (!PyArg_ParseTuple(args, "sK", &name, &nbytes) || check_name(name))
        return NULL;
    if (nbytes == 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes must be positive");
        return NULL;
    }
    if (te_py_enter(self))
        return NULL;
    te_py_leave(self); /* nothing below releases the GIL */
    PyObject *mod = PyType_GetModule(Py_TYPE(self));
    module_state *st = te_py_state(mod);
    char label[64]; /* memfd names are only labels (and limited to 249 bytes) */
    snprintf(label, sizeof label, "mooncake:%s", name);
    int fd = memfd_create(label, MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)nbytes) < 0) {
        int saved = errno;
        if (fd >= 0)
            close(fd);
        return PyErr_Format(PyExc_OSError, "cannot create %llu bytes of shared memory '%s': %s",
                            nbytes, name, strerror(saved));
    }
    /* MAP_POPULATE: the pages exist from the start. Left to fault in on first touch, a
     * prefill's KV writes took ~25-45k page faults per 1024-token prompt on a fresh pool (80-180
     * ms of system time inside the forward pass) until every page had been used once. */
    void *m = mmap(NULL, (size_t)nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                   0);
    if (m == MAP_FAILED) {
        int saved = errno;
        close(fd);
        return PyErr_Format(PyExc_OSError, "cannot map %llu bytes of shared memory '%s': %s",
                            nbytes, name, strerror(saved));
    }
    SharedBuffer *sb = PyObject_New(SharedBuffer, st->shared_type);
    if (!sb) {
        munmap(m, (size_t)nbytes);
        close(fd);
        return NULL;
    }
    sb->addr = m;
    sb->size = (size_t)nbytes;
    sb->fd = fd;
    Py_buffer *view = PyMem_Malloc(sizeof *view);
    if (!view) {
        Py_DECREF(sb);
        return PyErr_NoMemory();
    }
    if (PyObject_GetBuffer((PyObject *)sb, view, PyBUF_CONTIG) < 0) {
        PyMem_Free(view);
        Py_DECREF(sb);
        return NULL;
    }
    if (add_region(self, name, view, fd)) {
        Py_DECREF(sb);
        return NULL;
    }
    return (PyObject *)sb;
}

PyObject *te_py_register_memory(Engine *self, PyObject *args)
{
    const char *name;
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "sO", &name, &obj) || check_name(name))
        return NULL;
    if (te_py_enter(self))
        return NULL;
    te_py_leave(self);
    Py_buffer *view = PyMem_Malloc(sizeof *view);
    if (!view)
        return PyErr_NoMemory();
    if (PyObject_GetBuffer(obj, view, PyBUF_CONTIG) < 0) {
        PyMem_Free(view);
        PyErr_Clear();
        return PyErr_Format(PyExc_TypeError,
                            "register_memory('%s'): need a writable, contiguous buffer, got %s",
                            name, Py_TYPE(obj)->tp_name);
    }
    if (view->len == 0) {
        PyBuffer_Release(view);
        PyMem_Free(view);
        return PyErr_Format(PyExc_ValueError, "register_memory('%s'): buffer is empty", name);
    }
    if (add_region(self, name, view, -1))
        return NULL;
    Py_RETURN_NONE;
}

PyObject *te_py_unregister_memory(Engine *self, PyObject *args)
{
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name) || te_py_enter(self))
        return NULL;
    te_region *r = te_region_unlink(self->eng, name);
    if (!r) {
        te_py_leave(self);
        return PyErr_Format(PyExc_KeyError, "no segment named '%s' is registered", name);
    }
    te_keys_drop_region(self->eng, r); /* nothing is served from it by key any more */
    Py_BEGIN_ALLOW_THREADS
    te_region_drain(self->eng, r); /* in-flight transfers on it finish first */
    Py_END_ALLOW_THREADS
    te_py_leave(self);
    te_py_release_region(r);
    Py_RETURN_NONE;
}

