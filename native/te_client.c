/* Client side: request frames, open_segment (INFO, then the transport: shm mapping, RDMA queue
 * pair or TCP), and running one slice of a request, retried on another path before it fails:
 * RDMA falls back to TCP, a TCP failure gets one fresh connection.
 */
#include "te.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- one frame over TCP ----------------------------------------------------------------- */

static uint64_t resp_payload_len(const te_req_hdr *h)
{
    switch (h->op) {
    case TE_OP_INFO: return TE_INFO_LEN;
    case TE_OP_READ:
    case TE_OP_GET: return h->length;
    case TE_OP_RDMA_CONNECT: return TE_QP_INFO_LEN;
    default: return 0;
    }
}

/* Send h (+ the WRITE / RDMA_CONNECT payload from data). */
static int frame_send(te_engine *eng, int fd, const te_req_hdr *h_in, const char *name,
                      uint8_t *data, double deadline, te_err *e)
{
    te_req_hdr h = *h_in;
    h.name_len = (uint8_t)strlen(name);
    uint8_t hdr[TE_REQ_HDR_LEN];
    te_encode_req(hdr, &h);
    int sends = h.op == TE_OP_WRITE || h.op == TE_OP_RDMA_CONNECT;
    struct iovec iov[3] = {{hdr, sizeof hdr}, {(void *)name, h.name_len},
                           {data, sends ? (size_t)h.length : 0}};
    return te_send_all(fd, iov, 3, deadline, eng->stop_fd, e);
}

/* Read the response to h; its payload (INFO, READ, RDMA_CONNECT) lands in data (data_len).
 * crc (NULL: not wanted) receives the CRC32C of the payload, computed as it arrives. */
static int frame_recv(te_engine *eng, int fd, const te_req_hdr *h, uint8_t *data,
                      uint64_t data_len, te_resp_hdr *resp, double deadline, te_err *e,
                      uint32_t *crc)
{
    uint8_t raw[TE_RESP_HDR_LEN];
    int rc = te_recv_all(fd, raw, sizeof raw, deadline, eng->stop_fd, e);
    if (rc)
        return rc;
    if (te_decode_resp(raw, resp)) {
        te_err_set(e, "protocol error: bad response frame");
        return TE_IO_ERROR;
    }
    if (resp->status != TE_STATUS_OK) {
        char msg[TE_MSG_LEN];
        if (resp->length >= sizeof msg) {
            te_err_set(e, "protocol error: oversized error frame");
            return TE_IO_ERROR;
        }
        rc = te_recv_all(fd, msg, (size_t)resp->length, deadline, eng->stop_fd, e);
        if (rc)
            return rc;
        msg[resp->length] = 0;
        if (resp->status == TE_STATUS_MISSING && h->op == TE_OP_GET) {
            te_err_set(e, "%s", msg);
            return TE_KEY_MISSING;
        }
        if (resp->status == TE_STATUS_CRC) {
            te_err_set(e, "%s", msg);
            return TE_CRC_ERROR;
        }
        te_err_set(e, "peer refused: %s", msg);
        return TE_REMOTE_ERROR;
    }
    uint64_t want = resp_payload_len(h);
    if (resp->length != want || want > data_len) {
        te_err_set(e, "protocol error: response carries %llu bytes, expected %llu",
                   (unsigned long long)resp->length, (unsigned long long)want);
        return TE_IO_ERROR;
    }
    /* READ lands straight in the caller's registered memory */
    if (crc)
        *crc = 0;
    return want ? te_recv_all_crc(fd, data, (size_t)want, deadline, eng->stop_fd, e, crc) : 0;
}

int te_tcp_frame(te_engine *eng, int fd, const te_req_hdr *h, const char *name, uint8_t *data,
                 uint64_t data_len, te_resp_hdr *resp, double deadline, te_err *e)
{
    int rc = frame_send(eng, fd, h, name, data, deadline, e);
    return rc ? rc : frame_recv(eng, fd, h, data, data_len, resp, deadline, e, NULL);
}

/* ---- transport selection ---------------------------------------------------------------- */

int te_pick_transport(int mode, int shm_ok, int rdma_local, int rdma_peer, te_err *e)
{
    switch (mode) {
    case TE_MODE_SHM:
        if (shm_ok)
            return TE_TRANSPORT_SHM;
        te_err_set(e, "shared memory is not possible with this peer");
        return -1;
    case TE_MODE_TCP:
        return TE_TRANSPORT_TCP;
    case TE_MODE_RDMA:
        if (rdma_local && rdma_peer)
            return TE_TRANSPORT_RDMA;
        te_err_set(e, "%s", !rdma_local ? "this engine has no RDMA device open"
                                        : "the peer serves this segment without RDMA");
        return -1;
    case TE_MODE_AUTO:
        /* same host beats any NIC; a NIC beats the kernel's TCP stack */
        if (shm_ok)
            return TE_TRANSPORT_SHM;
        return rdma_local && rdma_peer ? TE_TRANSPORT_RDMA : TE_TRANSPORT_TCP;
    default:
        te_err_set(e, "unknown transport mode %d", mode);
        return -1;
    }
}

/* ---- open_segment ----------------------------------------------------------------------- */

static int map_shm(const te_info *info, const char *my_boot_id, te_segment *s, te_err *e)
{
    if (info->fd < 0) {
        te_err_set(e, "the segment is plain registered memory (not shareable)");
        return -1;
    }
    if (strcmp(info->boot_id, my_boot_id) != 0) {
        te_err_set(e, "the peer runs on another host (boot ids differ)");
        return -1;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/%u/fd/%d", info->pid, info->fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        te_err_set(e, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || (uint64_t)st.st_dev != info->dev ||
        (uint64_t)st.st_ino != info->ino || (uint64_t)st.st_size < info->size) {
        close(fd);
        te_err_set(e, "%s is not the peer's segment (pid namespace differs?)", path);
        return -1;
    }
    /* MAP_POPULATE: map the peer's (already populated) pages now, not one fault per page on
     * the first copy into each. */
    void *m = info->size ? mmap(NULL, info->size, PROT_READ | PROT_WRITE,
                                MAP_SHARED | MAP_POPULATE, fd, 0)
                         : NULL;
    int saved = errno;
    close(fd);
    if (m == MAP_FAILED) {
        te_err_set(e, "cannot map %s: %s", path, strerror(saved));
        return -1;
    }
    s->map = m;
    s->map_len = info->size;
    return 0;
}

/* Bring one queue pair up now, so a broken RDMA path shows at open time, not mid-batch. */
static int rdma_probe_path(te_engine *eng, te_segment *s, te_err *e)
{
    struct te_rdma_conn *c =
        te_rdma_pool_acquire(eng, s->peer, s->name, te_now() + eng->timeout_s, e);
    if (!c)
        return -1;
    te_rdma_pool_release(s->peer, c, 1);
    return 0;
}

static int choose(te_engine *eng, te_segment *s, const te_info *info, int mode, te_err *e)
{
    te_err shm_why = {{0}}, rdma_why = {{0}};
    int shm_ok = 0;
    if (mode == TE_MODE_AUTO || mode == TE_MODE_SHM)
        shm_ok = map_shm(info, eng->boot_id, s, &shm_why) == 0;
    int t = te_pick_transport(mode, shm_ok, eng->rdma != NULL, info->rdma_ok != 0, e);
    if (t < 0) {
        if (mode == TE_MODE_SHM)
            te_err_set(e, "shared-memory transport to segment '%s' is not possible: %s", s->name,
                       shm_why.msg);
        else
            te_err_set(e, "RDMA transport to segment '%s' is not possible: %s", s->name,
                       !eng->rdma ? "this engine has no RDMA device open"
                                  : "the peer serves it without RDMA (no device there, or "
                                    "the NIC refused to register it)");
        return -1;
    }
    if (t == TE_TRANSPORT_RDMA) {
        s->rdma_addr = info->rdma_addr;
        s->rkey = info->rkey;
        if (rdma_probe_path(eng, s, &rdma_why) == 0) {
            s->transport = t;
            return 0;
        }
        if (mode == TE_MODE_RDMA) {
            te_err_set(e, "RDMA transport to segment '%s' failed: %s", s->name, rdma_why.msg);
            return -1;
        }
        t = TE_TRANSPORT_TCP; /* auto: the NIC path is broken, TCP still works */
    }
    s->transport = t;
    if (t == TE_TRANSPORT_TCP && mode == TE_MODE_AUTO)
        snprintf(s->fallback, sizeof s->fallback, "shm: %.150s; rdma: %.150s", shm_why.msg,
                 rdma_why.msg[0] ? rdma_why.msg
                 : !eng->rdma   ? "no local RDMA device"
                                : "the peer offers no RDMA for this segment");
    return 0;
}

int te_open_segment(te_engine *eng, const char *host, int port, const char *name, int mode,
                    te_err *e)
{
    size_t name_len = strlen(name);
    if (name_len == 0 || name_len > TE_MAX_NAME) {
        te_err_set(e, "segment name must be 1..%d bytes", TE_MAX_NAME);
        return -1;
    }
    te_peer *p = te_get_peer(eng, host, port, e);
    if (!p)
        return -1;
    double deadline = te_now() + eng->timeout_s;
    int fd = te_pool_acquire(eng, p, 0, deadline, 0, e);
    if (fd < 0)
        return -1;
    uint8_t raw[TE_INFO_LEN];
    te_req_hdr h = {.op = TE_OP_INFO};
    te_resp_hdr resp;
    int rc = te_tcp_frame(eng, fd, &h, name, raw, sizeof raw, &resp, deadline, e);
    te_pool_release(p, fd, rc == 0 || rc == TE_REMOTE_ERROR);
    if (rc)
        return -1;
    te_info info;
    te_decode_info(raw, &info);

    te_segment *s = calloc(1, sizeof *s);
    if (!s) {
        te_err_set(e, "out of memory");
        return -1;
    }
    s->peer = p;
    memcpy(s->name, name, name_len + 1);
    s->size = info.size;
    if (choose(eng, s, &info, mode, e)) {
        if (s->map)
            munmap(s->map, s->map_len);
        free(s);
        return -1;
    }
    if (s->transport != TE_TRANSPORT_SHM && s->map) {
        munmap(s->map, s->map_len);
        s->map = NULL;
    }
    pthread_mutex_lock(&eng->peers_mu);
    int handle = -1;
    if (eng->n_segments < TE_MAX_SEGMENTS) {
        eng->segments[eng->n_segments++] = s;
        handle = eng->n_segments;
    }
    pthread_mutex_unlock(&eng->peers_mu);
    if (handle < 0) {
        if (s->map)
            munmap(s->map, s->map_len);
        free(s);
        te_err_set(e, "too many open segments (%d)", TE_MAX_SEGMENTS);
    }
    return handle;
}

te_segment *te_segment_get(te_engine *eng, int handle)
{
    pthread_mutex_lock(&eng->peers_mu);
    te_segment *s = handle > 0 && handle <= eng->n_segments ? eng->segments[handle - 1] : NULL;
    pthread_mutex_unlock(&eng->peers_mu);
    return s;
}

/* ---- one slice -------------------------------------------------------------------------- */

/* The failure record already names the request (op, length, offset, segment). */
static int crc_mismatch(te_err *e, const char *op, uint32_t sent, uint32_t got)
{
    te_err_set(e, "CRC32C mismatch on %s: sender computed 0x%08x, receiver got 0x%08x", op, sent,
               got);
    return TE_CRC_ERROR;
}

static int shm_slice(te_engine *eng, te_request *req, uint8_t *local, uint64_t off,
                     uint64_t roff, uint64_t len, te_err *e)
{
    te_segment *s = req->seg;
    uint8_t *remote = s->map + roff;
    uint8_t *src = req->op == TE_REQ_READ ? remote : local;
    uint8_t *dst = req->op == TE_REQ_READ ? local : remote;
    int want = te_req_crc_wanted(req);
    if (!want && !eng->verify_crc) {
        memcpy(dst, src, len);
        return 0;
    }
    uint32_t before = eng->verify_crc ? te_crc32c(0, src, len) : 0;
    /* one pass: the CRC is of exactly the bytes written, computed as they are copied */
    uint32_t after = te_crc32c_copy(0, dst, src, len);
    if (eng->verify_crc && after != before)
        return crc_mismatch(e, req->op == TE_REQ_READ ? "READ" : "WRITE", before, after);
    if (want)
        te_req_put_crc(req, off, after);
    return 0;
}

/* One RDMA attempt; the caller falls back to TCP when it fails. */
static int rdma_slice(te_engine *eng, te_request *req, uint8_t *local, uint64_t off,
                      uint64_t roff, uint64_t len, te_err *e)
{
    te_segment *s = req->seg;
    te_peer *p = s->peer;
    double deadline = te_now() + eng->timeout_s;
    struct te_rdma_conn *c = te_rdma_pool_acquire(eng, p, s->name, deadline, e);
    if (!c)
        return TE_IO_ERROR;
    int rc = te_rdma_post(c, req->op, local, req->local_region->lkey, s->rdma_addr + roff,
                          s->rkey, len, deadline, eng->stop_fd, e);
    te_rdma_pool_release(p, c, rc == 0);
    if (rc)
        return rc;
    /* the NIC wrote the bytes, no CPU saw them: read them back once, after completion */
    int want = te_req_crc_wanted(req);
    uint32_t mine = want || eng->verify_crc ? te_crc32c(0, local, len) : 0;
    if (!eng->verify_crc) {
        if (want)
            te_req_put_crc(req, off, mine);
        return 0;
    }
    /* one-sided: the peer's CPU never saw the bytes, so ask it for the CRC of the range */
    int fd = te_pool_acquire(eng, p, 0, deadline, 0, e);
    if (fd < 0)
        return fd;
    te_req_hdr h = {.op = TE_OP_CRC, .offset = roff, .length = len};
    te_resp_hdr resp;
    rc = te_tcp_frame(eng, fd, &h, s->name, NULL, 0, &resp, deadline, e);
    te_pool_release(p, fd, rc == 0 || rc == TE_REMOTE_ERROR);
    if (rc)
        return rc;
    if (mine != resp.crc)
        return req->op == TE_REQ_READ
                   ? crc_mismatch(e, "RDMA READ", resp.crc, mine)
                   : crc_mismatch(e, "RDMA WRITE", mine, resp.crc);
    if (want)
        te_req_put_crc(req, off, mine);
    return 0;
}

static te_req_hdr data_hdr(te_engine *eng, const te_request *req, const uint8_t *local,
                           uint64_t roff, uint64_t len)
{
    if (req->op == TE_REQ_GET) /* a range of the object; the owner checks its whole length */
        return (te_req_hdr){.op = TE_OP_GET, .offset = roff, .length = len,
                            .crc = (uint32_t)req->len};
    te_req_hdr h = {.op = req->op == TE_REQ_READ ? TE_OP_READ : TE_OP_WRITE, .offset = roff,
                    .length = len, .flags = eng->verify_crc ? TE_FLAG_CRC : 0};
    if (eng->verify_crc && req->op == TE_REQ_WRITE)
        h.crc = te_crc32c(0, local, len); /* the server checks what it received against this */
    return h;
}

/* The response to a data frame of req (its slice at off), with the READ-side CRC check; a
 * READ's CRC32C is computed as the bytes arrive when the check or the request wants it. */
static int data_recv(te_engine *eng, int fd, te_request *req, uint64_t off,
                     const te_req_hdr *h, uint8_t *local, double deadline, te_err *e)
{
    te_resp_hdr resp;
    int want = te_req_crc_wanted(req);
    int sum = (h->op == TE_OP_READ && eng->verify_crc) || want;
    uint32_t got = 0;
    int rc = frame_recv(eng, fd, h, local, h->length, &resp, deadline, e, sum ? &got : NULL);
    if (!rc && eng->verify_crc && h->op == TE_OP_READ && got != resp.crc)
        rc = crc_mismatch(e, "READ", resp.crc, got);
    if (!rc && h->op == TE_OP_GET) /* every slice says the same, unless the key was replaced
                                     * in between: then the landed CRC cannot match it */
        __atomic_store_n(&req->stored_crc, resp.crc, __ATOMIC_RELAXED);
    if (!rc && want)
        te_req_put_crc(req, off, got);
    return rc;
}

static int tcp_attempt(te_engine *eng, te_request *req, int fd, uint8_t *local, uint64_t off,
                       uint64_t roff, uint64_t len, double deadline, te_err *e)
{
    te_req_hdr h = data_hdr(eng, req, local, roff, len);
    const char *name = req->op == TE_REQ_GET ? req->key : req->seg->name;
    int rc = frame_send(eng, fd, &h, name, local, deadline, e);
    return rc ? rc : data_recv(eng, fd, req, off, &h, local, deadline, e);
}

static void mark_failed(te_peer *p, const char *why)
{
    pthread_mutex_lock(&p->mu);
    p->failed_at = te_now();
    snprintf(p->fail_reason, sizeof p->fail_reason, "%s", why);
    pthread_mutex_unlock(&p->mu);
}

static int tcp_slice(te_engine *eng, te_request *req, uint8_t *local, uint64_t off,
                     uint64_t roff, uint64_t len, te_err *e)
{
    te_peer *p = req->seg->peer;
    double deadline = te_now() + eng->timeout_s;
    int rc = TE_IO_ERROR;
    char first[TE_MSG_LEN] = {0};
    for (int attempt = 0; attempt < 2; attempt++) {
        int fd = te_pool_acquire(eng, p, attempt > 0, deadline, req->submitted_at, e);
        if (fd < 0) {
            rc = fd;
        } else {
            rc = tcp_attempt(eng, req, fd, local, off, roff, len, deadline, e);
            /* error frames and CRC verdicts leave the stream in sync: keep the connection */
            int answered = rc == 0 || rc == TE_REMOTE_ERROR || rc == TE_KEY_MISSING;
            te_pool_release(p, fd, answered || rc == TE_CRC_ERROR);
            if (answered)
                return rc;
        }
        if (rc == TE_IO_TIMEOUT)
            te_err_set(e, "no answer within the %.1f s timeout", eng->timeout_s);
        /* retrying cannot help after these; everything else gets one fresh connection */
        if (rc == TE_IO_TIMEOUT || rc == TE_IO_STOPPED || rc == TE_AUTH_ERROR ||
            rc == TE_PEER_DOWN)
            break;
        if (attempt == 0)
            memcpy(first, e->msg, sizeof first);
        else {
            char second[TE_MSG_LEN];
            memcpy(second, e->msg, sizeof second); /* e->msg is also the destination */
            te_err_set(e, "%.150s; retry on a fresh connection: %.150s", first, second);
        }
    }
    /* a corrupted slice says nothing about the peer's health */
    if (rc != TE_IO_STOPPED && rc != TE_PEER_DOWN && rc != TE_CRC_ERROR)
        mark_failed(p, e->msg);
    return rc;
}

int te_run_slice(te_engine *eng, te_request *req, uint64_t off, uint64_t len, te_err *e)
{
    te_segment *s = req->seg;
    if (req->op == TE_REQ_GET) /* the owner looks the key up: always TCP frames */
        return tcp_slice(eng, req, req->local + off, off, off, len, e);
    uint64_t roff = req->remote_off + off;
    uint8_t *local = req->local + off;
    /* NOTE: over TCP the serving side checks (and must); shm and RDMA never ask it, so check
     * here too (for RDMA the NIC also refuses anything outside the peer's registration) */
    if (s->transport != TE_TRANSPORT_TCP && (roff > s->size || len > s->size - roff)) {
        te_err_set(e, "out of bounds: offset %llu + length %llu exceeds segment '%s' of "
                      "%llu bytes", (unsigned long long)roff, (unsigned long long)len,
                   s->name, (unsigned long long)s->size);
        return TE_REMOTE_ERROR;
    }
    if (s->transport == TE_TRANSPORT_SHM)
        return shm_slice(eng, req, local, off, roff, len, e);

    te_peer *p = s->peer;
    char rdma_why[TE_MSG_LEN] = {0};
    if (s->transport == TE_TRANSPORT_RDMA && req->local_region && req->local_region->mr) {
        pthread_mutex_lock(&p->mu);
        int skip = p->rdma_failed_at > 0 && p->rdma_failed_at >= req->submitted_at;
        pthread_mutex_unlock(&p->mu);
        if (!skip) {
            int rc = rdma_slice(eng, req, local, off, roff, len, e);
            if (rc == 0 || rc == TE_IO_STOPPED)
                return rc;
            memcpy(rdma_why, e->msg, sizeof rdma_why);
            pthread_mutex_lock(&p->mu);
            p->rdma_failed_at = te_now(); /* slices already queued skip the broken NIC path */
            pthread_mutex_unlock(&p->mu);
        }
    }
    int rc = tcp_slice(eng, req, local, off, roff, len, e);
    if (rc && rdma_why[0]) {
        char tcp_why[TE_MSG_LEN];
        memcpy(tcp_why, e->msg, sizeof tcp_why);
        te_err_set(e, "RDMA: %.150s; retried over TCP: %.150s", rdma_why, tcp_why);
    }
    return rc;
}

/* Whole small requests to one TCP segment, pipelined on one connection: every frame is sent
 * before the first answer is read, so n requests cost about one round trip instead of n.
 * Whatever the pipeline could not settle goes through te_run_slice and its retries. */
void te_run_group(te_engine *eng, te_request **reqs, int n, int *rcs, te_err *errs)
{
    enum { UNSETTLED = 1 };
    te_segment *s = reqs[0]->seg;
    for (int i = 0; i < n; i++)
        rcs[i] = UNSETTLED;
    if (n > 1 && s->transport == TE_TRANSPORT_TCP) {
        te_peer *p = s->peer;
        double deadline = te_now() + eng->timeout_s;
        te_err e = {{0}};
        te_req_hdr hs[TE_MAX_GROUP];
        int fd = te_pool_acquire(eng, p, 0, deadline, reqs[0]->submitted_at, &e);
        int rc = fd < 0 ? fd : 0, sent = 0;
        for (; !rc && sent < n; sent++) {
            hs[sent] = data_hdr(eng, reqs[sent], reqs[sent]->local, reqs[sent]->remote_off,
                                reqs[sent]->len);
            const char *name = reqs[sent]->op == TE_REQ_GET ? reqs[sent]->key : s->name;
            rc = frame_send(eng, fd, &hs[sent], name, reqs[sent]->local, deadline, &e);
        }
        for (int i = 0; !rc && i < sent; i++) {
            int r = data_recv(eng, fd, reqs[i], 0, &hs[i], reqs[i]->local, deadline, &errs[i]);
            if (r == 0 || r == TE_REMOTE_ERROR || r == TE_KEY_MISSING)
                rcs[i] = r;
            else if (r != TE_CRC_ERROR) /* CRC: the stream is in sync, retry that one alone */
                rc = r;
        }
        if (fd >= 0)
            te_pool_release(p, fd, rc == 0);
        if (rc == TE_IO_TIMEOUT || rc == TE_IO_STOPPED || rc == TE_PEER_DOWN) {
            /* as in tcp_slice: a silent or dead peer gets no second timeout */
            if (rc == TE_IO_TIMEOUT) {
                te_err_set(&e, "no answer within the %.1f s timeout", eng->timeout_s);
                mark_failed(p, e.msg);
            }
            for (int i = 0; i < n; i++) {
                if (rcs[i] == UNSETTLED) {
                    rcs[i] = rc;
                    errs[i] = e;
                }
            }
        }
    }
    for (int i = 0; i < n; i++)
        if (rcs[i] == UNSETTLED)
            rcs[i] = te_run_slice(eng, reqs[i], 0, reqs[i]->len, &errs[i]);
}
