/* Registered regions and the server side: a listener thread plus one thread per connection
 * serving INFO / READ / WRITE / CRC / RDMA_CONNECT frames against the regions of this engine,
 * and GET frames against the objects published by key (te_keys.c).
 *
 * Every frame is bounds-checked; a bad request gets an error frame (the stream stays in sync,
 * payloads are drained), a malformed frame closes that connection only. A queue pair set up by
 * RDMA_CONNECT lives as long as the TCP connection that set it up.
 */
#include "te.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- regions ---------------------------------------------------------------------------- */

int te_region_add(te_engine *eng, te_region *r, te_err *e)
{
    pthread_mutex_lock(&eng->regions_mu);
    for (te_region *it = eng->regions; it; it = it->next) {
        if (strcmp(it->name, r->name) == 0) {
            pthread_mutex_unlock(&eng->regions_mu);
            te_err_set(e, "a segment named '%s' is already registered", r->name);
            return -1;
        }
        if (r->addr < it->addr + it->len && it->addr < r->addr + r->len) {
            pthread_mutex_unlock(&eng->regions_mu);
            te_err_set(e, "memory for '%s' overlaps registered segment '%s'", r->name, it->name);
            return -1;
        }
    }
    /* NOTE: registered with the NIC under the lock, so a region is never visible without its
     * keys. Unless RDMA was forced, a device that refuses the registration (locked-memory
     * limit...) leaves the region shm/TCP-only: INFO then tells peers to use TCP. */
    if (eng->rdma && te_rdma_reg(eng->rdma, r, e) && eng->rdma_required) {
        pthread_mutex_unlock(&eng->regions_mu);
        return -1;
    }
    r->next = eng->regions;
    eng->regions = r;
    pthread_mutex_unlock(&eng->regions_mu);
    return 0;
}

te_region *te_region_unlink(te_engine *eng, const char *name)
{
    pthread_mutex_lock(&eng->regions_mu);
    te_region **pp = &eng->regions, *found = NULL;
    for (; *pp; pp = &(*pp)->next) {
        if (strcmp((*pp)->name, name) == 0) {
            found = *pp;
            *pp = found->next;
            found->removed = 1;
            break;
        }
    }
    pthread_mutex_unlock(&eng->regions_mu);
    return found;
}

void te_region_drain(te_engine *eng, te_region *r)
{
    pthread_mutex_lock(&eng->regions_mu);
    while (r->refs > 0)
        pthread_cond_wait(&eng->regions_cv, &eng->regions_mu);
    pthread_mutex_unlock(&eng->regions_mu);
}

te_region *te_region_ref_name(te_engine *eng, const char *name)
{
    pthread_mutex_lock(&eng->regions_mu);
    te_region *it = eng->regions;
    while (it && strcmp(it->name, name) != 0)
        it = it->next;
    if (it)
        it->refs++;
    pthread_mutex_unlock(&eng->regions_mu);
    return it;
}

te_region *te_region_ref_addr(te_engine *eng, const uint8_t *addr, uint64_t len)
{
    pthread_mutex_lock(&eng->regions_mu);
    te_region *it = eng->regions;
    while (it && !(addr >= it->addr && len <= it->len && (uint64_t)(addr - it->addr) <= it->len - len))
        it = it->next;
    if (it)
        it->refs++;
    pthread_mutex_unlock(&eng->regions_mu);
    return it;
}

void te_region_unref(te_engine *eng, te_region *r)
{
    pthread_mutex_lock(&eng->regions_mu);
    if (--r->refs == 0 && r->removed)
        pthread_cond_broadcast(&eng->regions_cv);
    pthread_mutex_unlock(&eng->regions_mu);
}

/* ---- connection handler ----------------------------------------------------------------- */

typedef struct {
    te_engine *eng;
    int fd;
} conn_arg;

static int has_payload(uint8_t op) { return op == TE_OP_WRITE || op == TE_OP_RDMA_CONNECT; }

static int send_status(te_engine *eng, int fd, double deadline, uint32_t status,
                       const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static int send_status(te_engine *eng, int fd, double deadline, uint32_t status,
                       const char *fmt, ...)
{
    char msg[TE_MSG_LEN];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0)
        n = 0;
    if ((size_t)n >= sizeof msg)
        n = sizeof msg - 1;
    uint8_t hdr[TE_RESP_HDR_LEN];
    te_encode_resp(hdr, status, (uint64_t)n, 0);
    struct iovec iov[2] = {{hdr, sizeof hdr}, {msg, (size_t)n}};
    return te_send_all(fd, iov, 2, deadline, eng->stop_fd, NULL);
}

#define send_error(eng, fd, deadline, ...) \
    send_status(eng, fd, deadline, TE_STATUS_ERROR, __VA_ARGS__)

static int drain(te_engine *eng, int fd, uint64_t len, double deadline)
{
    uint8_t scratch[64 * 1024];
    while (len > 0) {
        size_t n = len < sizeof scratch ? (size_t)len : sizeof scratch;
        if (te_recv_all(fd, scratch, n, deadline, eng->stop_fd, NULL))
            return -1;
        len -= n;
    }
    return 0;
}

static int bounds_ok(const te_region *r, uint64_t off, uint64_t len)
{
    return off <= r->len && len <= r->len - off;
}

/* RDMA_CONNECT: build a QP answering the client's (replacing this connection's old one). */
static int serve_rdma_connect(te_engine *eng, int fd, double deadline,
                              struct te_rdma_conn **qp)
{
    uint8_t raw[TE_QP_INFO_LEN];
    if (te_recv_all(fd, raw, sizeof raw, deadline, eng->stop_fd, NULL))
        return -1;
    if (!eng->rdma)
        return send_error(eng, fd, deadline, "this peer has no RDMA device open") ? -1 : 0;
    te_qp_info remote, local;
    te_decode_qp(raw, &remote);
    te_err err = {{0}};
    struct te_rdma_conn *c = te_rdma_accept(eng->rdma, &remote, &local, &err);
    if (!c)
        return send_error(eng, fd, deadline, "RDMA connect refused: %s", err.msg) ? -1 : 0;
    if (*qp)
        te_rdma_conn_free(*qp);
    *qp = c;
    uint8_t hdr[TE_RESP_HDR_LEN], body[TE_QP_INFO_LEN];
    te_encode_qp(body, &local);
    te_encode_resp(hdr, TE_STATUS_OK, sizeof body, 0);
    struct iovec iov[2] = {{hdr, sizeof hdr}, {body, sizeof body}};
    return te_send_all(fd, iov, 2, deadline, eng->stop_fd, NULL) ? -1 : 0;
}

/* GET: a range of the object published under key, straight from registered memory, pinned
 * while sent; the reader names the object's whole length, so a different object is refused. */
static int serve_get(te_engine *eng, int fd, const te_req_hdr *h, const char *key,
                     double deadline)
{
    te_region *r;
    uint64_t off, len;
    uint32_t crc;
    te_key *k = te_keys_acquire(eng, key, h->name_len, h->offset == 0, &r, &off, &len, &crc);
    if (!k)
        return send_status(eng, fd, deadline, TE_STATUS_MISSING, "no object '%s' here", key)
                   ? -1 : 0;
    int rc;
    if (len != h->crc) {
        rc = send_error(eng, fd, deadline, "object '%s' is %llu bytes, the reader expects %u",
                        key, (unsigned long long)len, h->crc);
    } else if (h->offset > len || h->length > len - h->offset) {
        rc = send_error(eng, fd, deadline, "range %llu + %llu is outside object '%s' of %llu "
                        "bytes", (unsigned long long)h->offset, (unsigned long long)h->length,
                        key, (unsigned long long)len);
    } else {
        uint8_t hdr[TE_RESP_HDR_LEN];
        te_encode_resp(hdr, TE_STATUS_OK, h->length, crc);
        struct iovec iov[2] = {{hdr, sizeof hdr}, {r->addr + off + h->offset, (size_t)h->length}};
        rc = te_send_all(fd, iov, 2, deadline, eng->stop_fd, NULL);
    }
    te_keys_release(eng, k, r);
    return rc ? -1 : 0;
}

/* Serve one frame; returns 0 to keep the connection, -1 to close it. */
static int serve_frame(te_engine *eng, int fd, const te_req_hdr *h, const char *name,
                       struct te_rdma_conn **qp)
{
    double deadline = te_now() + eng->timeout_s;
    if (h->op == TE_OP_GET)
        return serve_get(eng, fd, h, name, deadline);
    te_region *r = te_region_ref_name(eng, name);
    uint8_t hdr[TE_RESP_HDR_LEN];
    int rc = 0;
    int want_crc = (h->flags & TE_FLAG_CRC) != 0;

    if (!r) {
        if (has_payload(h->op) && drain(eng, fd, h->length, deadline))
            return -1;
        return send_error(eng, fd, deadline, "no segment named '%s' is registered on this peer",
                          name) ? -1 : 0;
    }
    if (h->op == TE_OP_INFO) {
        te_info info = {.size = r->len, .pid = (uint32_t)getpid(), .fd = r->shm_fd,
                        .dev = r->dev, .ino = r->ino, .rdma_ok = r->mr != NULL,
                        .rdma_addr = r->mr ? (uint64_t)(uintptr_t)r->addr : 0, .rkey = r->rkey};
        memcpy(info.boot_id, eng->boot_id, TE_BOOT_ID_LEN);
        uint8_t body[TE_INFO_LEN];
        te_encode_info(body, &info);
        te_encode_resp(hdr, TE_STATUS_OK, TE_INFO_LEN, 0);
        struct iovec iov[2] = {{hdr, sizeof hdr}, {body, sizeof body}};
        rc = te_send_all(fd, iov, 2, deadline, eng->stop_fd, NULL) ? -1 : 0;
    } else if (h->op == TE_OP_RDMA_CONNECT) {
        rc = serve_rdma_connect(eng, fd, deadline, qp);
    } else if (!bounds_ok(r, h->offset, h->length)) {
        if (h->op == TE_OP_WRITE && drain(eng, fd, h->length, deadline))
            rc = -1;
        else
            rc = send_error(eng, fd, deadline,
                            "out of bounds: offset %llu + length %llu exceeds segment '%s' "
                            "of %zu bytes", (unsigned long long)h->offset,
                            (unsigned long long)h->length, name, r->len) ? -1 : 0;
    } else if (h->op == TE_OP_CRC) {
        uint32_t crc = te_crc32c(0, r->addr + h->offset, (size_t)h->length);
        te_encode_resp(hdr, TE_STATUS_OK, 0, crc);
        struct iovec iov = {hdr, sizeof hdr};
        rc = te_send_all(fd, &iov, 1, deadline, eng->stop_fd, NULL) ? -1 : 0;
    } else if (h->op == TE_OP_READ) {
        uint32_t crc = want_crc ? te_crc32c(0, r->addr + h->offset, (size_t)h->length) : 0;
        te_encode_resp(hdr, TE_STATUS_OK, h->length, crc);
        /* zero-copy: the payload goes straight from registered memory to the socket */
        struct iovec iov[2] = {{hdr, sizeof hdr}, {r->addr + h->offset, (size_t)h->length}};
        rc = te_send_all(fd, iov, 2, deadline, eng->stop_fd, NULL) ? -1 : 0;
    } else {
        /* NOTE: a truncated stream leaves a partly written range; its sender saw the slice fail */
        uint32_t got = 0; /* summed as the payload arrives, while it is in cache */
        if (te_recv_all_crc(fd, r->addr + h->offset, (size_t)h->length, deadline, eng->stop_fd,
                            NULL, want_crc ? &got : NULL)) {
            rc = -1;
        } else if (want_crc && got != h->crc) {
            rc = send_status(eng, fd, deadline, TE_STATUS_CRC,
                             "CRC32C mismatch on WRITE: sender computed 0x%08x, receiver got "
                             "0x%08x", h->crc, got) ? -1 : 0;
        } else {
            te_encode_resp(hdr, TE_STATUS_OK, 0, 0);
            struct iovec iov = {hdr, sizeof hdr};
            rc = te_send_all(fd, &iov, 1, deadline, eng->stop_fd, NULL) ? -1 : 0;
        }
    }
    te_region_unref(eng, r);
    return rc;
}

static void *conn_main(void *p)
{
    conn_arg *a = p;
    te_engine *eng = a->eng;
    int fd = a->fd;
    free(a);
    te_tune_socket(fd);
    te_err err;
    struct te_rdma_conn *qp = NULL;
    if (te_handshake_server(fd, eng->secret, eng->secret_len, te_now() + eng->timeout_s,
                            eng->stop_fd, &err) == 0) {
        for (;;) {
            uint8_t raw[TE_REQ_HDR_LEN];
            te_req_hdr h;
            char name[TE_MAX_NAME + 1];
            /* idle pooled connections wait indefinitely; a started frame must finish in time */
            if (te_wait_fd(fd, POLLIN, 0, eng->stop_fd, NULL))
                break;
            double deadline = te_now() + eng->timeout_s;
            if (te_recv_all(fd, raw, sizeof raw, deadline, eng->stop_fd, NULL))
                break;
            if (te_decode_req(raw, &h))
                break; /* malformed: drop this connection, keep serving others */
            if (te_recv_all(fd, name, h.name_len, deadline, eng->stop_fd, NULL))
                break;
            name[h.name_len] = 0;
            if (strlen(name) != h.name_len || serve_frame(eng, fd, &h, name, &qp))
                break;
        }
    }
    if (qp)
        te_rdma_conn_free(qp);
    close(fd);
    pthread_mutex_lock(&eng->conns_mu);
    if (--eng->n_conns == 0)
        pthread_cond_broadcast(&eng->conns_cv);
    pthread_mutex_unlock(&eng->conns_mu);
    return NULL;
}

static void *listener_main(void *p)
{
    te_engine *eng = p;
    for (;;) {
        if (te_wait_fd(eng->listen_fd, POLLIN, 0, eng->stop_fd, NULL))
            break;
        int fd = accept4(eng->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            continue; /* EAGAIN, ECONNABORTED, EMFILE...: keep serving */
        pthread_mutex_lock(&eng->conns_mu);
        int full = eng->n_conns >= TE_MAX_SERVER_CONNS;
        if (!full)
            eng->n_conns++;
        pthread_mutex_unlock(&eng->conns_mu);
        conn_arg *a = full ? NULL : malloc(sizeof *a);
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        int ok = 0;
        if (a) {
            a->eng = eng;
            a->fd = fd;
            ok = pthread_create(&t, &attr, conn_main, a) == 0;
        }
        pthread_attr_destroy(&attr);
        if (!ok) {
            free(a);
            close(fd);
            if (!full) {
                pthread_mutex_lock(&eng->conns_mu);
                if (--eng->n_conns == 0)
                    pthread_cond_broadcast(&eng->conns_cv);
                pthread_mutex_unlock(&eng->conns_mu);
            }
        }
    }
    return NULL;
}

int te_server_start(te_engine *eng, const char *host, int port, te_err *e)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    int gai = getaddrinfo(host, portstr, &hints, &res);
    if (gai) {
        te_err_set(e, "cannot resolve listen host '%s': %s", host, gai_strerror(gai));
        return -1;
    }
    int fd = -1, saved = 0;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            saved = errno;
            continue;
        }
        int one = 1, buf = TE_SOCKET_BUFFER;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf); /* inherited by accepted fds */
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 128) == 0)
            break;
        saved = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) {
        te_err_set(e, "cannot listen on %s:%d: %s", host, port, strerror(saved));
        return -1;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(fd, (struct sockaddr *)&ss, &sl);
    eng->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                               : ((struct sockaddr_in *)&ss)->sin_port);
    snprintf(eng->host, sizeof eng->host, "%s", host);
    eng->listen_fd = fd;
    if (pthread_create(&eng->listener, NULL, listener_main, eng)) {
        te_err_set(e, "cannot start the listener thread");
        close(fd);
        eng->listen_fd = -1;
        return -1;
    }
    eng->listener_started = 1;
    return 0;
}

void te_server_stop(te_engine *eng)
{
    /* stop_fd is already readable: listener and handlers leave their poll loops */
    if (eng->listener_started) {
        pthread_join(eng->listener, NULL);
        eng->listener_started = 0;
    }
    if (eng->listen_fd >= 0) {
        close(eng->listen_fd);
        eng->listen_fd = -1;
    }
    pthread_mutex_lock(&eng->conns_mu);
    while (eng->n_conns > 0)
        pthread_cond_wait(&eng->conns_cv, &eng->conns_mu);
    pthread_mutex_unlock(&eng->conns_mu);
}
