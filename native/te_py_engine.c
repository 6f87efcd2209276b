/* The Engine type of the binding: lifecycle, segments and batches. */
#include "te_py.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

int te_py_enter(Engine *self)
{
    if (!self->eng || self->eng->closed) {
        PyErr_SetString(self->error, "the transfer engine is closed");
        return -1;
    }
    pthread_mutex_lock(&self->busy_mu);
    self->busy++;
    pthread_mutex_unlock(&self->busy_mu);
    return 0;
}

void te_py_leave(Engine *self)
{
    pthread_mutex_lock(&self->busy_mu);
    if (--self->busy == 0)
        pthread_cond_broadcast(&self->busy_cv);
    pthread_mutex_unlock(&self->busy_mu);
}

static void read_boot_id(char out[TE_BOOT_ID_LEN])
{
    memset(out, 0, TE_BOOT_ID_LEN);
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f || !fgets(out, TE_BOOT_ID_LEN, f)) {
        /* unknown boot: make it unique so shm is never attempted */
        snprintf(out, TE_BOOT_ID_LEN, "unknown-%d-%p", (int)getpid(), (void *)out);
    }
    if (f)
        fclose(f);
    out[strcspn(out, "\n")] = 0;
}

static void engine_free(te_engine *eng)
{
    if (!eng)
        return;
    if (eng->stop_fd >= 0)
        close(eng->stop_fd);
    if (eng->notify_fd >= 0)
        close(eng->notify_fd);
    free(eng->secret);
    free(eng->slots);
    pthread_mutex_destroy(&eng->conns_mu);
    pthread_cond_destroy(&eng->conns_cv);
    pthread_mutex_destroy(&eng->regions_mu);
    pthread_cond_destroy(&eng->regions_cv);
    pthread_mutex_destroy(&eng->peers_mu);
    pthread_mutex_destroy(&eng->batch_mu);
    pthread_cond_destroy(&eng->batch_cv);
    pthread_mutex_destroy(&eng->queue_mu);
    pthread_cond_destroy(&eng->queue_cv);
    te_keys_free(eng);
    free(eng);
}

static te_engine *engine_new(const char *secret, Py_ssize_t secret_len, size_t slice_bytes,
                             int conns, double timeout_s, te_err *e)
{
    te_engine *eng = calloc(1, sizeof *eng);
    if (!eng) {
        te_err_set(e, "out of memory");
        return NULL;
    }
    eng->stop_fd = eng->notify_fd = eng->listen_fd = -1;
    pthread_mutex_init(&eng->conns_mu, NULL);
    pthread_cond_init(&eng->conns_cv, NULL);
    pthread_mutex_init(&eng->regions_mu, NULL);
    pthread_cond_init(&eng->regions_cv, NULL);
    pthread_mutex_init(&eng->peers_mu, NULL);
    pthread_mutex_init(&eng->batch_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&eng->batch_cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&eng->queue_mu, NULL);
    pthread_cond_init(&eng->queue_cv, NULL);
    te_keys_init(eng);
    eng->secret = malloc(secret_len ? (size_t)secret_len : 1);
    eng->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    eng->notify_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (!eng->secret || eng->stop_fd < 0 || eng->notify_fd < 0) {
        te_err_set(e, "cannot set up the engine: %s", strerror(errno));
        engine_free(eng);
        return NULL;
    }
    memcpy(eng->secret, secret, (size_t)secret_len);
    eng->secret_len = (size_t)secret_len;
    eng->slice_bytes = slice_bytes;
    eng->conns_per_peer = conns;
    eng->timeout_s = timeout_s;
    read_boot_id(eng->boot_id);
    return eng;
}

static int Engine_init(Engine *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"secret", "host", "port", "slice_bytes", "connections_per_peer",
                             "timeout_s", "serve", "workers", "verify_crc", NULL};
    const char *secret, *host;
    Py_ssize_t secret_len;
    int port, conns, serve, workers, verify_crc = 0;
    unsigned long long slice;
    double timeout_s;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y#siKidpi|p", kwlist, &secret, &secret_len,
                                     &host, &port, &slice, &conns, &timeout_s, &serve, &workers,
                                     &verify_crc))
        return -1;
    if (self->eng) {
        PyErr_SetString(PyExc_RuntimeError, "Engine is already initialised");
        return -1;
    }
    if (slice < 4096 || slice > TE_MAX_PAYLOAD || conns < 1 || conns > TE_MAX_POOL ||
        !(timeout_s > 0) || workers < 1 || workers > 256 || port < 0 || port > 65535) {
        PyErr_SetString(PyExc_ValueError, "transfer engine parameters out of range");
        return -1;
    }
    te_err err = {{0}};
    te_engine *eng = engine_new(secret, secret_len, (size_t)slice, conns, timeout_s, &err);
    if (!eng) {
        te_py_set_error(self->error, err.msg);
        return -1;
    }
    eng->verify_crc = verify_crc;
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = te_workers_start(eng, workers, &err);
    if (!rc && serve && te_server_start(eng, host, port, &err)) {
        uint64_t one = 1;
        ssize_t w = write(eng->stop_fd, &one, sizeof one);
        (void)w;
        te_workers_stop(eng);
        rc = -1;
    }
    Py_END_ALLOW_THREADS
    if (rc) {
        engine_free(eng);
        te_py_set_error(self->error, err.msg);
        return -1;
    }
    self->eng = eng;
    return 0;
}

static PyObject *Engine_close(Engine *self, PyObject *unused)
{
    (void)unused;
    te_engine *eng = self->eng;
    if (!eng || eng->closed)
        Py_RETURN_NONE;
    eng->closed = 1; /* from here on, enter() refuses new calls */
    uint64_t one = 1;
    Py_BEGIN_ALLOW_THREADS
    ssize_t w = write(eng->stop_fd, &one, sizeof one);
    (void)w;
    te_workers_stop(eng); /* completes (fails) every queued request: waiters wake up */
    te_server_stop(eng);
    pthread_mutex_lock(&self->busy_mu);
    while (self->busy > 0)
        pthread_cond_wait(&self->busy_cv, &self->busy_mu);
    pthread_mutex_unlock(&self->busy_mu);
    te_peers_close(eng);
    Py_END_ALLOW_THREADS
    while (eng->regions) {
        te_region *r = eng->regions;
        eng->regions = r->next;
        te_py_release_region(r);
    }
    for (size_t i = 0; i < eng->n_slots; i++) {
        if (eng->slots[i]) {
            te_batch_destroy(eng->slots[i]);
            eng->slots[i] = NULL;
        }
    }
    te_rdma_close(eng->rdma); /* last: every QP and memory registration is gone by now */
    eng->rdma = NULL;
    Py_RETURN_NONE;
}

/* Open an RDMA device for this engine; only before any memory is registered or segment opened,
 * so every region gets its memory registration. Returns the device name. */
static PyObject *Engine_enable_rdma(Engine *self, PyObject *args)
{
    const char *device = NULL;
    int gid_index = -1, required = 0;
    if (!PyArg_ParseTuple(args, "zip", &device, &gid_index, &required) || te_py_enter(self))
        return NULL;
    te_py_leave(self);
    te_engine *eng = self->eng;
    pthread_mutex_lock(&eng->regions_mu);
    int busy = eng->regions != NULL || eng->rdma != NULL;
    pthread_mutex_unlock(&eng->regions_mu);
    pthread_mutex_lock(&eng->peers_mu);
    busy |= eng->n_segments > 0;
    pthread_mutex_unlock(&eng->peers_mu);
    if (busy)
        return PyErr_Format(PyExc_RuntimeError, "enable_rdma must come before any memory is "
                            "registered or segment opened, and only once");
    te_err err = {{0}};
    struct te_rdma *r;
    Py_BEGIN_ALLOW_THREADS
    r = te_rdma_open(device, gid_index, &err);
    Py_END_ALLOW_THREADS
    if (!r) {
        te_py_set_error(self->error, err.msg);
        return NULL;
    }
    eng->rdma = r;
    eng->rdma_required = required;
    return PyUnicode_FromString(te_rdma_name(r));
}

static void Engine_dealloc(Engine *self)
{
    PyObject_GC_UnTrack(self);
    if (self->eng) {
        PyObject *r = Engine_close(self, NULL);
        Py_XDECREF(r);
        engine_free(self->eng);
        self->eng = NULL;
    }
    pthread_mutex_destroy(&self->busy_mu);
    pthread_cond_destroy(&self->busy_cv);
    Py_CLEAR(self->error);
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int Engine_traverse(Engine *self, visitproc visit, void *arg)
{
    Py_VISIT(self->error);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static PyObject *Engine_open_segment(Engine *self, PyObject *args)
{
    const char *host, *name;
    int port, mode;
    if (!PyArg_ParseTuple(args, "sisi", &host, &port, &name, &mode) || te_py_enter(self))
        return NULL;
    te_err err = {{0}};
    int handle;
    Py_BEGIN_ALLOW_THREADS
    handle = te_open_segment(self->eng, host, port, name, mode, &err);
    Py_END_ALLOW_THREADS
    te_py_leave(self);
    if (handle < 0) {
        te_py_set_error(self->error, err.msg);
        return NULL;
    }
    return PyLong_FromLong(handle);
}

static PyObject *Engine_segment_info(Engine *self, PyObject *args)
{
    int handle;
    if (!PyArg_ParseTuple(args, "i", &handle) || te_py_enter(self))
        return NULL;
    te_py_leave(self);
    te_segment *s = te_segment_get(self->eng, handle);
    if (!s)
        return PyErr_Format(PyExc_ValueError, "unknown segment handle %d", handle);
    return Py_BuildValue("(KiN)", (unsigned long long)s->size, s->transport,
                         te_py_msg_str(s->fallback));
}

static PyObject *Engine_allocate_batch(Engine *self, PyObject *args)
{
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "n", &n) || te_py_enter(self))
        return NULL;
    te_py_leave(self);
    if (n < 1)
        return PyErr_Format(PyExc_ValueError, "a batch needs at least one request, got %zd", n);
    te_err err = {{0}};
    uint64_t id = te_batch_alloc(self->eng, (size_t)n, &err);
    if (!id) {
        te_py_set_error(self->error, err.msg);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(id);
}

static void unref_all(te_engine *eng, te_request *reqs, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (reqs[i].local_region)
            te_region_unref(eng, reqs[i].local_region);
}

static PyObject *Engine_submit_transfer(Engine *self, PyObject *args)
{
    unsigned long long batch;
    PyObject *seq;
    int checksums = 0;
    if (!PyArg_ParseTuple(args, "KO|p", &batch, &seq, &checksums) || te_py_enter(self))
        return NULL;
    te_py_leave(self);
    PyObject *fast = PySequence_Fast(seq, "requests must be a sequence");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    te_request *reqs = PyMem_Calloc(n ? (size_t)n : 1, sizeof *reqs);
    if (!reqs) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        int op, seg;
        unsigned long long local, roff, len;
        const char *key = NULL;
        Py_ssize_t klen = 0;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "iKiKK|s#;request must be "
                              "(op, local_addr, segment, remote_offset, length[, key])",
                              &op, &local, &seg, &roff, &len, &key, &klen))
            break;
        te_request *r = &reqs[i];
        r->op = op;
        if (op == TE_REQ_GET) {
            if (!key || klen < 1 || klen > TE_MAX_NAME || strlen(key) != (size_t)klen) {
                PyErr_Format(PyExc_ValueError, "request %zd: GET needs a key of 1..%d bytes "
                             "without NUL", i, TE_MAX_NAME);
                break;
            }
            if (len == 0 || len > TE_MAX_PAYLOAD) {
                PyErr_Format(PyExc_ValueError, "request %zd: GET length must be 1..%u bytes", i,
                             TE_MAX_PAYLOAD);
                break;
            }
            memcpy(r->key, key, (size_t)klen + 1);
        }
        r->want_crc = checksums;
        r->local = (uint8_t *)(uintptr_t)local;
        r->remote_off = roff;
        r->len = len;
        r->seg = te_segment_get(self->eng, seg);
        if (op != TE_REQ_READ && op != TE_REQ_WRITE && op != TE_REQ_GET) {
            PyErr_Format(PyExc_ValueError, "request %zd: op must be READ (0), WRITE (1) or "
                         "GET (2)", i);
            break;
        }
        if (!r->seg) {
            PyErr_Format(PyExc_ValueError, "request %zd: unknown segment handle %d", i, seg);
            break;
        }
        if (len == 0)
            continue;
        r->local_region = te_region_ref_addr(self->eng, r->local, len);
        if (!r->local_region) {
            PyErr_Format(PyExc_ValueError,
                         "request %zd: local range %p + %llu bytes is not inside memory "
                         "registered with this engine", i, (void *)(uintptr_t)local,
                         (unsigned long long)len);
            break;
        }
    }
    Py_DECREF(fast);
    te_err err = {{0}};
    if (i < n || te_batch_submit(self->eng, batch, reqs, (size_t)n, &err)) {
        unref_all(self->eng, reqs, (size_t)i);
        PyMem_Free(reqs);
        if (i == n)
            te_py_set_error(PyExc_ValueError, err.msg);
        return NULL;
    }
    PyMem_Free(reqs);
    Py_RETURN_NONE;
}

static PyObject *Engine_status(Engine *self, PyObject *args)
{
    unsigned long long batch;
    Py_ssize_t i;
    if (!PyArg_ParseTuple(args, "Kn", &batch, &i) || te_py_enter(self))
        return NULL;
    te_py_leave(self);
    te_engine *eng = self->eng;
    pthread_mutex_lock(&eng->batch_mu);
    te_batch *b = te_batch_get(eng, batch);
    if (!b || i < 0 || (size_t)i >= b->n) {
        size_t n = b ? b->n : 0;
        pthread_mutex_unlock(&eng->batch_mu);
        if (!b)
            return PyErr_Format(PyExc_ValueError, "unknown batch id %llu", batch);
        return PyErr_Format(PyExc_IndexError, "batch %llu has %zu submitted requests, no #%zd",
                            batch, n, i);
    }
    int state = b->reqs[i].state;
    char msg[TE_MSG_LEN];
    memcpy(msg, b->reqs[i].msg, sizeof msg);
    pthread_mutex_unlock(&eng->batch_mu);
    return Py_BuildValue("(iN)", state, te_py_msg_str(msg));
}

/* The completed batch named by args, returned with batch_mu held; NULL with an exception set
 * (unknown, still running, engine closed). */
static te_batch *lock_completed_batch(Engine *self, PyObject *args)
{
    unsigned long long batch;
    if (!PyArg_ParseTuple(args, "K", &batch) || te_py_enter(self))
        return NULL;
    te_py_leave(self);
    pthread_mutex_lock(&self->eng->batch_mu);
    te_batch *b = te_batch_get(self->eng, batch);
    if (!b || b->pending) {
        pthread_mutex_unlock(&self->eng->batch_mu);
        PyErr_Format(PyExc_ValueError, b ? "batch %llu is still running"
                                         : "unknown batch id %llu", batch);
        return NULL;
    }
    return b;
}

/* Per request of a completed batch: the CRC32C of the bytes a READ submitted with checksums
 * landed, None for the rest (WRITEs, READs without checksums, failed requests). */
static PyObject *Engine_checksums(Engine *self, PyObject *args)
{
    te_engine *eng = self->eng;
    te_batch *b = lock_completed_batch(self, args);
    if (!b)
        return NULL;
    /* NOTE: copied out first: no Python allocation while batch_mu is held */
    size_t n = b->n;
    int64_t *crc = PyMem_Malloc(sizeof *crc * (n ? n : 1));
    if (!crc) {
        pthread_mutex_unlock(&eng->batch_mu);
        return PyErr_NoMemory();
    }
    for (size_t i = 0; i < n; i++) {
        const te_request *r = &b->reqs[i];
        crc[i] = te_req_crc_wanted(r) && r->state == TE_STATE_DONE ? (int64_t)r->crc : -1;
    }
    pthread_mutex_unlock(&eng->batch_mu);
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        PyObject *v = crc[i] < 0 ? Py_NewRef(Py_None) : PyLong_FromLongLong(crc[i]);
        if (!v) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, v);
    }
    PyMem_Free(crc);
    return list;
}

/* Per request of a completed batch: for a GET that found its object, (length, CRC32C the owner
 * published, CRC32C of what landed or None); None for a GET that missed and for the rest. */
static PyObject *Engine_gets(Engine *self, PyObject *args)
{
    te_engine *eng = self->eng;
    te_batch *b = lock_completed_batch(self, args);
    if (!b)
        return NULL;
    typedef struct { int found, crc_ok; uint64_t len; uint32_t stored, landed; } got_t;
    size_t n = b->n;
    got_t *got = PyMem_Calloc(n ? n : 1, sizeof *got); /* filled before any Python object */
    if (!got) {
        pthread_mutex_unlock(&eng->batch_mu);
        return PyErr_NoMemory();
    }
    for (size_t i = 0; i < n; i++) {
        const te_request *r = &b->reqs[i];
        got[i].found = r->op == TE_REQ_GET && r->state == TE_STATE_DONE &&
                       !__atomic_load_n(&r->missing, __ATOMIC_ACQUIRE);
        got[i].crc_ok = te_req_crc_wanted(r);
        got[i].len = r->len;
        got[i].stored = r->stored_crc;
        got[i].landed = r->crc;
    }
    pthread_mutex_unlock(&eng->batch_mu);
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        PyObject *v = !got[i].found ? Py_NewRef(Py_None)
                      : got[i].crc_ok ? Py_BuildValue("(KII)", (unsigned long long)got[i].len,
                                                      got[i].stored, got[i].landed)
                                      : Py_BuildValue("(KIO)", (unsigned long long)got[i].len,
                                                      got[i].stored, Py_None);
        if (!v) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, v);
    }
    PyMem_Free(got);
    return list;
}

/* publish(key, segment, offset, length, crc, tag): serve the object to GETs by key. */
static PyObject *Engine_publish(Engine *self, PyObject *args)
{
    const char *key, *segment;
    Py_ssize_t klen;
    unsigned long long off, len, tag;
    unsigned int crc;
    if (!PyArg_ParseTuple(args, "s#sKKIK", &key, &klen, &segment, &off, &len, &crc, &tag) ||
        te_py_enter(self))
        return NULL;
    te_err err = {{0}};
    int rc = te_keys_publish(self->eng, key, (size_t)klen, segment, off, len, crc, tag, &err);
    te_py_leave(self);
    if (rc) {
        te_py_set_error(PyExc_ValueError, err.msg);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* retire(key, tag) -> True when the object's bytes may be reused now */
static PyObject *Engine_retire(Engine *self, PyObject *args)
{
    const char *key;
    Py_ssize_t klen;
    unsigned long long tag;
    if (!PyArg_ParseTuple(args, "s#K", &key, &klen, &tag) || te_py_enter(self))
        return NULL;
    int free_now = te_keys_retire(self->eng, key, (size_t)klen, tag);
    te_py_leave(self);
    return PyBool_FromLong(free_now);
}

/* take_drained() -> tags of retired objects whose last GET finished since the last call */
static PyObject *Engine_take_drained(Engine *self, PyObject *unused)
{
    (void)unused;
    if (te_py_enter(self))
        return NULL;
    uint64_t tags[256];
    PyObject *list = PyList_New(0);
    size_t n;
    do {
        n = te_keys_take_drained(self->eng, tags, 256);
        for (size_t i = 0; list && i < n; i++) {
            PyObject *v = PyLong_FromUnsignedLongLong(tags[i]);
            if (!v || PyList_Append(list, v))
                Py_CLEAR(list);
            Py_XDECREF(v);
        }
    } while (n == 256);
    te_py_leave(self);
    return list;
}

/* take_touched() -> [(key, reads)] served by GET since the last call */
static PyObject *Engine_take_touched(Engine *self, PyObject *unused)
{
    (void)unused;
    if (te_py_enter(self))
        return NULL;
    te_touched *t;
    size_t n;
    int rc = te_keys_take_touched(self->eng, &t, &n);
    te_py_leave(self);
    if (rc)
        return PyErr_NoMemory();
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        PyObject *v = Py_BuildValue("(s#I)", t[i].key, (Py_ssize_t)t[i].klen, t[i].hits);
        if (!v) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, v);
    }
    free(t);
    return list;
}

static PyObject *Engine_get_published(Engine *self, void *c)
{
    (void)c;
    return PyLong_FromSize_t(self->eng && !self->eng->closed ? te_keys_count(self->eng) : 0);
}

/* (done, first_failed_index or -1, message) in one lock round trip */
static PyObject *Engine_poll(Engine *self, PyObject *args)
{
    unsigned long long batch;
    if (!PyArg_ParseTuple(args, "K", &batch) || te_py_enter(self))
        return NULL;
    te_py_leave(self);
    te_engine *eng = self->eng;
    pthread_mutex_lock(&eng->batch_mu);
    te_batch *b = te_batch_get(eng, batch);
    if (!b) {
        pthread_mutex_unlock(&eng->batch_mu);
        return PyErr_Format(PyExc_ValueError, "unknown batch id %llu", batch);
    }
    int done = b->pending == 0;
    Py_ssize_t failed = -1;
    char msg[TE_MSG_LEN] = {0};
    for (size_t i = 0; done && i < b->n; i++) {
        if (b->reqs[i].state == TE_STATE_FAILED) {
            failed = (Py_ssize_t)i;
            memcpy(msg, b->reqs[i].msg, sizeof msg);
            break;
        }
    }
    pthread_mutex_unlock(&eng->batch_mu);
    return Py_BuildValue("(NnN)", PyBool_FromLong(done), failed, te_py_msg_str(msg));
}

static PyObject *Engine_wait(Engine *self, PyObject *args)
{
    unsigned long long batch;
    double timeout_s = 0;
    if (!PyArg_ParseTuple(args, "K|d", &batch, &timeout_s) || te_py_enter(self))
        return NULL;
    te_err err = {{0}};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = te_batch_wait(self->eng, batch, timeout_s, &err);
    Py_END_ALLOW_THREADS
    te_py_leave(self);
    if (rc == TE_IO_TIMEOUT) {
        te_py_set_error(PyExc_TimeoutError, err.msg);
        return NULL;
    }
    if (rc) {
        te_py_set_error(PyExc_ValueError, err.msg);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Engine_free_batch(Engine *self, PyObject *args)
{
    unsigned long long batch;
    if (!PyArg_ParseTuple(args, "K", &batch) || te_py_enter(self))
        return NULL;
    te_py_leave(self);
    te_err err = {{0}};
    if (te_batch_free(self->eng, batch, &err)) {
        te_py_set_error(PyExc_ValueError, err.msg);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Engine_drain_notify(Engine *self, PyObject *unused)
{
    (void)unused;
    uint64_t v;
    if (self->eng && read(self->eng->notify_fd, &v, sizeof v) < 0 && errno != EAGAIN)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *Engine_get_port(Engine *self, void *c)
{
    (void)c;
    return PyLong_FromLong(self->eng && self->eng->listen_fd >= 0 ? self->eng->port : 0);
}

static PyObject *Engine_get_notify_fd(Engine *self, void *c)
{
    (void)c;
    return PyLong_FromLong(self->eng ? self->eng->notify_fd : -1);
}

static PyObject *Engine_get_closed(Engine *self, void *c)
{
    (void)c;
    return PyBool_FromLong(!self->eng || self->eng->closed);
}

static PyMethodDef Engine_methods[] = {
    {"close", (PyCFunction)Engine_close, METH_NOARGS, "Stop threads, drop connections."},
    {"enable_rdma", (PyCFunction)Engine_enable_rdma, METH_VARARGS, "Open an RDMA device."},
    {"alloc_shared", (PyCFunction)te_py_alloc_shared, METH_VARARGS, "Allocate + register."},
    {"register_memory", (PyCFunction)te_py_register_memory, METH_VARARGS, "Register a buffer."},
    {"unregister_memory", (PyCFunction)te_py_unregister_memory, METH_VARARGS, "Unregister."},
    {"open_segment", (PyCFunction)Engine_open_segment, METH_VARARGS, "Open a peer segment."},
    {"segment_info", (PyCFunction)Engine_segment_info, METH_VARARGS,
     "(size, transport, why a better transport was not used)."},
    {"allocate_batch", (PyCFunction)Engine_allocate_batch, METH_VARARGS, "New batch id."},
    {"submit_transfer", (PyCFunction)Engine_submit_transfer, METH_VARARGS, "Queue requests."},
    {"status", (PyCFunction)Engine_status, METH_VARARGS, "(state, message) of a request."},
    {"poll", (PyCFunction)Engine_poll, METH_VARARGS, "(done, failed_index, message)."},
    {"checksums", (PyCFunction)Engine_checksums, METH_VARARGS,
     "Per request of a completed batch: CRC32C of what a checksummed READ landed, else None."},
    {"wait", (PyCFunction)Engine_wait, METH_VARARGS, "Block (GIL released) until done."},
    {"free_batch", (PyCFunction)Engine_free_batch, METH_VARARGS, "Release a batch id."},
    {"drain_notify", (PyCFunction)Engine_drain_notify, METH_NOARGS, "Reset notify_fd."},
    {"gets", (PyCFunction)Engine_gets, METH_VARARGS, "Per request: what a GET found."},
    {"publish", (PyCFunction)Engine_publish, METH_VARARGS, "Serve an object by key."},
    {"retire", (PyCFunction)Engine_retire, METH_VARARGS, "Stop serving a key."},
    {"take_drained", (PyCFunction)Engine_take_drained, METH_NOARGS, "Tags now free."},
    {"take_touched", (PyCFunction)Engine_take_touched, METH_NOARGS, "Keys read by GET."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Engine_getset[] = {
    {"port", (getter)Engine_get_port, NULL, "Bound listen port (0 when not serving).", NULL},
    {"notify_fd", (getter)Engine_get_notify_fd, NULL, "Readable when a batch completed.", NULL},
    {"closed", (getter)Engine_get_closed, NULL, "True after close().", NULL},
    {"published", (getter)Engine_get_published, NULL, "Objects served by key.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    (void)args;
    (void)kw;
    Engine *self = (Engine *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    module_state *st = te_py_state(PyType_GetModule(type));
    self->error = Py_NewRef(st->native_error);
    pthread_mutex_init(&self->busy_mu, NULL);
    pthread_cond_init(&self->busy_cv, NULL);
    return (PyObject *)self;
}

static PyType_Slot engine_slots[] = {
    {Py_tp_new, Engine_new},
    {Py_tp_init, Engine_init},
    {Py_tp_dealloc, Engine_dealloc},
    {Py_tp_traverse, Engine_traverse},
    {Py_tp_methods, Engine_methods},
    {Py_tp_getset, Engine_getset},
    {Py_tp_doc, "Native transfer engine; use mooncake_server.transfer.TransferEngine."},
    {0, NULL},
};

PyType_Spec te_py_engine_spec = {
    "mooncake_server.transfer._native.Engine", sizeof(Engine), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, engine_slots,
};

