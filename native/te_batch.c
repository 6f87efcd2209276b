/* Batches and the worker pool.
 *
 * A request walks: submitted (queued) -> sliced by workers (slice_bytes each, several workers
 * on one request at once) -> DONE when every slice succeeded, FAILED at the first failed slice
 * (later slices of it are skipped). A batch completes when all its submitted requests have;
 * completion wakes wait() callers and bumps notify_fd for the asyncio side.
 */
#include "te.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define SLOT_BITS 24
#define SLOT_MASK ((1u << SLOT_BITS) - 1)

/* ---- batch table (all under batch_mu) --------------------------------------------------- */

te_batch *te_batch_get(te_engine *eng, uint64_t id)
{
    uint64_t slot = id & SLOT_MASK;
    if (slot >= eng->n_slots)
        return NULL;
    te_batch *b = eng->slots[slot];
    return b && b->id == id && !b->freed ? b : NULL;
}

void te_batch_destroy(te_batch *b)
{
    for (size_t i = 0; i < b->n; i++)
        free(b->reqs[i].slice_crcs);
    free(b->reqs);
    free(b);
}

static void release_slot(te_engine *eng, te_batch *b)
{
    eng->slots[b->id & SLOT_MASK] = NULL;
    te_batch_destroy(b);
}

uint64_t te_batch_alloc(te_engine *eng, size_t n, te_err *e)
{
    te_batch *b = calloc(1, sizeof *b);
    te_request *reqs = calloc(n ? n : 1, sizeof *reqs);
    if (!b || !reqs) {
        free(b);
        free(reqs);
        te_err_set(e, "out of memory for a batch of %zu requests", n);
        return 0;
    }
    b->cap = n;
    b->reqs = reqs;
    pthread_mutex_lock(&eng->batch_mu);
    size_t slot = 0;
    while (slot < eng->n_slots && eng->slots[slot])
        slot++;
    if (slot == eng->n_slots) {
        size_t grow = eng->n_slots ? eng->n_slots * 2 : 64;
        te_batch **ns = grow <= SLOT_MASK ? realloc(eng->slots, grow * sizeof *ns) : NULL;
        if (!ns) {
            pthread_mutex_unlock(&eng->batch_mu);
            free(b);
            free(reqs);
            te_err_set(e, "too many live batches");
            return 0;
        }
        memset(ns + eng->n_slots, 0, (grow - eng->n_slots) * sizeof *ns);
        eng->slots = ns;
        eng->n_slots = grow;
    }
    /* NOTE: the generation keeps a stale id from aliasing a reused slot */
    b->id = ((uint64_t)(++eng->next_gen) << SLOT_BITS) | slot;
    eng->slots[slot] = b;
    pthread_mutex_unlock(&eng->batch_mu);
    return b->id;
}

/* Slice size of a request: shared-memory copies are cut finer than network frames, so even a
 * 1 MiB copy spreads over several cores (a memcpy slice costs no round trip). */
static uint64_t slice_for(const te_engine *eng, const te_request *r)
{
    if (r->op == TE_REQ_GET)
        return eng->slice_bytes; /* TCP frames, whatever the segment's transport */
    if (r->seg->transport == TE_TRANSPORT_SHM && eng->slice_bytes > TE_SHM_SLICE)
        return TE_SHM_SLICE;
    return eng->slice_bytes;
}

static void notify(te_engine *eng)
{
    uint64_t one = 1;
    ssize_t w = write(eng->notify_fd, &one, sizeof one);
    (void)w; /* eventfd counter overflow is impossible in practice; nothing to report */
}

int te_batch_submit(te_engine *eng, uint64_t id, te_request *reqs, size_t n, te_err *e)
{
    pthread_mutex_lock(&eng->batch_mu);
    te_batch *b = te_batch_get(eng, id);
    if (!b || n > b->cap - b->n) {
        pthread_mutex_unlock(&eng->batch_mu);
        if (!b)
            te_err_set(e, "unknown batch id %llu", (unsigned long long)id);
        else
            te_err_set(e, "batch %llu holds %zu requests, %zu already submitted, cannot add %zu",
                       (unsigned long long)id, b->cap, b->n, n);
        return -1;
    }
    te_request *first = b->reqs + b->n, *head = NULL, *tail = NULL;
    double now = te_now();
    size_t pending = 0;
    for (size_t i = 0; i < n; i++) {
        te_request *r = first + i;
        *r = reqs[i];
        r->batch = b;
        r->submitted_at = now;
        r->next_off = 0;
        r->failed = 0;
        r->msg[0] = 0;
        r->qnext = NULL;
        r->crc = 0; /* also the CRC32C of an empty read */
        r->missing = 0;
        r->stored_crc = 0;
        r->slice_crcs = NULL;
        if (r->len == 0) {
            r->state = TE_STATE_DONE;
            continue;
        }
        r->state = TE_STATE_PENDING;
        r->slice_len = slice_for(eng, r);
        r->slices_left = (int)((r->len + r->slice_len - 1) / r->slice_len);
        if (te_req_crc_wanted(r) && r->slices_left > 1 &&
            !(r->slice_crcs = malloc(sizeof(uint32_t) * (size_t)r->slices_left))) {
            for (size_t j = 0; j < i; j++)
                free(first[j].slice_crcs);
            pthread_mutex_unlock(&eng->batch_mu);
            te_err_set(e, "out of memory for the checksums of %llu bytes",
                       (unsigned long long)r->len);
            return -1;
        }
        pending++;
        if (tail)
            tail->qnext = r;
        else
            head = r;
        tail = r;
    }
    b->pending += pending;
    b->n += n;
    int done_now = b->pending == 0;
    pthread_mutex_unlock(&eng->batch_mu);
    if (done_now) {
        notify(eng);
        return 0;
    }
    pthread_mutex_lock(&eng->queue_mu);
    if (eng->q_tail)
        eng->q_tail->qnext = head;
    else
        eng->q_head = head;
    eng->q_tail = tail;
    pthread_cond_broadcast(&eng->queue_cv);
    pthread_mutex_unlock(&eng->queue_mu);
    return 0;
}

int te_batch_free(te_engine *eng, uint64_t id, te_err *e)
{
    pthread_mutex_lock(&eng->batch_mu);
    te_batch *b = te_batch_get(eng, id);
    if (!b) {
        pthread_mutex_unlock(&eng->batch_mu);
        te_err_set(e, "unknown batch id %llu", (unsigned long long)id);
        return -1;
    }
    if (b->pending == 0)
        release_slot(eng, b);
    else
        b->freed = 1; /* the last completing request releases it */
    pthread_mutex_unlock(&eng->batch_mu);
    return 0;
}

int te_batch_wait(te_engine *eng, uint64_t id, double timeout_s, te_err *e)
{
    double deadline = timeout_s > 0 ? te_now() + timeout_s : 0;
    pthread_mutex_lock(&eng->batch_mu);
    for (;;) {
        te_batch *b = te_batch_get(eng, id);
        if (!b) {
            pthread_mutex_unlock(&eng->batch_mu);
            te_err_set(e, "unknown batch id %llu", (unsigned long long)id);
            return -1;
        }
        if (b->pending == 0)
            break;
        if (deadline > 0) {
            struct timespec ts = {.tv_sec = (time_t)deadline};
            ts.tv_nsec = (long)((deadline - (double)ts.tv_sec) * 1e9);
            if (pthread_cond_timedwait(&eng->batch_cv, &eng->batch_mu, &ts) == ETIMEDOUT) {
                pthread_mutex_unlock(&eng->batch_mu);
                te_err_set(e, "batch %llu still running after %.1f s", (unsigned long long)id,
                           timeout_s);
                return TE_IO_TIMEOUT;
            }
        } else {
            pthread_cond_wait(&eng->batch_cv, &eng->batch_mu);
        }
    }
    pthread_mutex_unlock(&eng->batch_mu);
    return 0;
}

/* ---- workers ---------------------------------------------------------------------------- */

static void record_failure(te_engine *eng, te_request *r, const char *why)
{
    pthread_mutex_lock(&eng->batch_mu);
    if (!r->msg[0] && r->op == TE_REQ_GET)
        snprintf(r->msg, sizeof r->msg, "GET of '%.100s' (%llu bytes) from the owner of "
                 "segment '%.100s': %s", r->key, (unsigned long long)r->len, r->seg->name, why);
    else if (!r->msg[0])
        snprintf(r->msg, sizeof r->msg, "%s of %llu bytes at offset %llu of segment '%s': %s",
                 r->op == TE_REQ_READ ? "READ" : "WRITE", (unsigned long long)r->len,
                 (unsigned long long)r->remote_off, r->seg->name, why);
    __atomic_store_n(&r->failed, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&eng->batch_mu);
}

void te_req_put_crc(te_request *r, uint64_t off, uint32_t crc)
{
    /* each slot has one writer; slice_done's acq_rel decrement publishes it to the combiner */
    if (r->slice_crcs)
        r->slice_crcs[off / r->slice_len] = crc;
    else
        r->crc = crc;
}

/* crc of the whole request from its slices' (all but the last are slice_len long). */
static void combine_slices(te_request *r)
{
    int n = (int)((r->len + r->slice_len - 1) / r->slice_len);
    uint32_t step = te_crc32c_zeros(r->slice_len), crc = r->slice_crcs[0];
    for (int i = 1; i < n - 1; i++)
        crc = te_crc32c_shift(crc, step) ^ r->slice_crcs[i];
    uint64_t last = r->len - (uint64_t)(n - 1) * r->slice_len;
    r->crc = te_crc32c_combine(crc, r->slice_crcs[n - 1], last);
}

static void slice_done(te_engine *eng, te_request *r)
{
    if (__atomic_sub_fetch(&r->slices_left, 1, __ATOMIC_ACQ_REL) != 0)
        return;
    if (r->slice_crcs && !__atomic_load_n(&r->failed, __ATOMIC_ACQUIRE))
        combine_slices(r); /* on this worker, before the request is seen as done */
    if (r->local_region)
        te_region_unref(eng, r->local_region);
    pthread_mutex_lock(&eng->batch_mu);
    te_batch *b = r->batch;
    r->state = r->failed ? TE_STATE_FAILED : TE_STATE_DONE;
    int batch_done = --b->pending == 0;
    if (batch_done) {
        pthread_cond_broadcast(&eng->batch_cv);
        if (b->freed)
            release_slot(eng, b);
    }
    pthread_mutex_unlock(&eng->batch_mu);
    if (batch_done)
        notify(eng);
}

/* Take the next unit of work (queue_mu held): a slice of the head request, or, when the head
 * is a whole small request, it and the small requests behind it to the same segment (a group
 * pipelined on one connection). Returns how many requests were taken into group. */
static int take_work(te_engine *eng, te_request **group, uint64_t *off, uint64_t *len)
{
    te_request *r = eng->q_head;
    uint64_t slice = slice_for(eng, r);
    *off = r->next_off;
    *len = r->len - *off < slice ? r->len - *off : slice;
    group[0] = r;
    int n = 1;
    if (*off == 0 && r->len <= slice) {
        uint64_t bytes = r->len;
        for (te_request *q = r->qnext; q && n < TE_MAX_GROUP; q = q->qnext) {
            if (q->seg != r->seg || q->op != r->op || q->len > slice - bytes)
                break;
            bytes += q->len;
            group[n++] = q;
        }
        for (int i = 0; i < n; i++)
            group[i]->next_off = group[i]->len;
        eng->q_head = group[n - 1]->qnext;
    } else {
        r->next_off += *len;
        if (r->next_off >= r->len)
            eng->q_head = r->qnext;
    }
    if (!eng->q_head)
        eng->q_tail = NULL;
    return n;
}

static void *worker_main(void *p)
{
    te_engine *eng = p;
    te_request *group[TE_MAX_GROUP];
    int rcs[TE_MAX_GROUP];
    te_err errs[TE_MAX_GROUP];
    pthread_mutex_lock(&eng->queue_mu);
    for (;;) {
        while (!eng->q_head && !eng->stopping)
            pthread_cond_wait(&eng->queue_cv, &eng->queue_mu);
        if (!eng->q_head)
            break; /* stopping and drained: every queued request has completed */
        uint64_t off, len;
        int n = take_work(eng, group, &off, &len);
        int stopping = eng->stopping;
        pthread_mutex_unlock(&eng->queue_mu);

        te_request *r = group[0];
        if (stopping) {
            for (int i = 0; i < n; i++)
                if (!__atomic_load_n(&group[i]->failed, __ATOMIC_ACQUIRE))
                    record_failure(eng, group[i], "the transfer engine was closed");
        } else if (n > 1) {
            memset(errs, 0, sizeof(te_err) * (size_t)n);
            te_run_group(eng, group, n, rcs, errs);
            for (int i = 0; i < n; i++) {
                if (rcs[i] == TE_KEY_MISSING)
                    __atomic_store_n(&group[i]->missing, 1, __ATOMIC_RELEASE);
                else if (rcs[i])
                    record_failure(eng, group[i], errs[i].msg[0] ? errs[i].msg : "unknown error");
            }
        } else if (__atomic_load_n(&r->failed, __ATOMIC_ACQUIRE)) {
            /* an earlier slice failed: the request's outcome is already decided */
        } else {
            te_err err = {{0}};
            int rc = te_run_slice(eng, r, off, len, &err);
            if (rc == TE_KEY_MISSING) /* a miss is an answer, not a failure */
                __atomic_store_n(&r->missing, 1, __ATOMIC_RELEASE);
            else if (rc)
                record_failure(eng, r, err.msg[0] ? err.msg : "unknown error");
        }
        for (int i = 0; i < n; i++)
            slice_done(eng, group[i]);
        pthread_mutex_lock(&eng->queue_mu);
    }
    pthread_mutex_unlock(&eng->queue_mu);
    return NULL;
}

int te_workers_start(te_engine *eng, int n, te_err *e)
{
    eng->workers = calloc((size_t)n, sizeof(pthread_t));
    if (!eng->workers) {
        te_err_set(e, "out of memory");
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (pthread_create(&eng->workers[i], NULL, worker_main, eng)) {
            te_err_set(e, "cannot start transfer worker thread %d", i);
            te_workers_stop(eng);
            return -1;
        }
        eng->n_workers++;
    }
    return 0;
}

void te_workers_stop(te_engine *eng)
{
    pthread_mutex_lock(&eng->queue_mu);
    eng->stopping = 1;
    pthread_cond_broadcast(&eng->queue_cv);
    pthread_mutex_unlock(&eng->queue_mu);
    for (int i = 0; i < eng->n_workers; i++)
        pthread_join(eng->workers[i], NULL);
    eng->n_workers = 0;
    free(eng->workers);
    eng->workers = NULL;
}
