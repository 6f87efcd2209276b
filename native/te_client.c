/* Client side: peers with pooled authenticated connections, open_segment (INFO + optional shm
 * mapping), and running one slice of a request over shm (memcpy) or TCP (one frame).
 */
#include "te.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- peers and their connection pools --------------------------------------------------- */

static te_peer *get_peer(te_engine *eng, const char *host, int port, te_err *e)
{
    char label[300];
    snprintf(label, sizeof label, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port);
    pthread_mutex_lock(&eng->peers_mu);
    for (te_peer *p = eng->peers; p; p = p->next) {
        if (strcmp(p->label, label) == 0) {
            pthread_mutex_unlock(&eng->peers_mu);
            return p;
        }
    }
    pthread_mutex_unlock(&eng->peers_mu);

    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    char portstr[16];
    snprintf(portstr, sizeof portstr, "%d", port);
    int gai = getaddrinfo(host, portstr, &hints, &res);
    if (gai || !res) {
        te_err_set(e, "cannot resolve '%s': %s", host, gai ? gai_strerror(gai) : "no address");
        return NULL;
    }
    te_peer *np = calloc(1, sizeof *np);
    if (!np) {
        freeaddrinfo(res);
        te_err_set(e, "out of memory");
        return NULL;
    }
    snprintf(np->label, sizeof np->label, "%s", label);
    memcpy(&np->addr, res->ai_addr, res->ai_addrlen);
    np->addrlen = res->ai_addrlen;
    freeaddrinfo(res);
    np->max_open = eng->conns_per_peer;
    pthread_mutex_init(&np->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&np->cv, &ca);
    pthread_condattr_destroy(&ca);

    pthread_mutex_lock(&eng->peers_mu);
    for (te_peer *p = eng->peers; p; p = p->next) {
        if (strcmp(p->label, label) == 0) { /* lost a race with another opener */
            pthread_mutex_unlock(&eng->peers_mu);
            pthread_mutex_destroy(&np->mu);
            pthread_cond_destroy(&np->cv);
            free(np);
            return p;
        }
    }
    np->next = eng->peers;
    eng->peers = np;
    pthread_mutex_unlock(&eng->peers_mu);
    return np;
}

static int connect_peer(te_engine *eng, te_peer *p, double deadline, te_err *e)
{
    int fd = socket(p->addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        te_err_set(e, "cannot create a socket: %s", strerror(errno));
        return TE_IO_ERROR;
    }
    te_tune_socket(fd);
    int rc = 0;
    if (connect(fd, (struct sockaddr *)&p->addr, p->addrlen) < 0) {
        if (errno != EINPROGRESS) {
            te_err_set(e, "cannot connect: %s", strerror(errno));
            rc = TE_IO_CLOSED;
        } else if ((rc = te_wait_fd(fd, POLLOUT, deadline, eng->stop_fd, e)) == 0) {
            int soerr = 0;
            socklen_t sl = sizeof soerr;
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
            if (soerr) {
                te_err_set(e, "cannot connect: %s", strerror(soerr));
                rc = TE_IO_CLOSED;
            }
        } else if (rc == TE_IO_TIMEOUT) {
            te_err_set(e, "connect timed out");
        }
    }
    if (!rc)
        rc = te_handshake_client(fd, eng->secret, eng->secret_len, deadline, eng->stop_fd, e);
    if (rc) {
        close(fd);
        return rc;
    }
    return fd;
}

static void drop_idle_locked(te_peer *p)
{
    while (p->n_idle > 0) {
        close(p->idle[--p->n_idle]);
        p->n_open--;
    }
}

/* A connection to p: an idle pooled one unless fresh, else a new one within the pool limit.
 * Gives up at once if p failed at or after not_before (0: never), so slices queued behind a
 * dead peer do not each wait out the timeout. */
static int pool_acquire(te_engine *eng, te_peer *p, int fresh, double deadline,
                        double not_before, te_err *e)
{
    pthread_mutex_lock(&p->mu);
    for (;;) {
        if (not_before > 0 && p->failed_at >= not_before) {
            te_err_set(e, "peer unavailable: %s", p->fail_reason);
            pthread_mutex_unlock(&p->mu);
            return TE_PEER_DOWN;
        }
        if (fresh)
            drop_idle_locked(p);
        if (p->n_idle > 0) {
            int fd = p->idle[--p->n_idle];
            pthread_mutex_unlock(&p->mu);
            return fd;
        }
        if (p->n_open < p->max_open) {
            p->n_open++;
            pthread_mutex_unlock(&p->mu);
            int fd = connect_peer(eng, p, deadline, e);
            if (fd < 0) {
                pthread_mutex_lock(&p->mu);
                p->n_open--;
                pthread_cond_signal(&p->cv);
                pthread_mutex_unlock(&p->mu);
            }
            return fd;
        }
        struct timespec ts;
        double d = deadline;
        ts.tv_sec = (time_t)d;
        ts.tv_nsec = (long)((d - (double)ts.tv_sec) * 1e9);
        if (pthread_cond_timedwait(&p->cv, &p->mu, &ts) == ETIMEDOUT) {
            pthread_mutex_unlock(&p->mu);
            te_err_set(e, "timed out waiting for a free connection");
            return TE_IO_TIMEOUT;
        }
    }
}

static void pool_release(te_peer *p, int fd, int healthy)
{
    pthread_mutex_lock(&p->mu);
    if (healthy && p->n_idle < TE_MAX_POOL) {
        p->idle[p->n_idle++] = fd;
    } else {
        close(fd);
        p->n_open--;
        if (!healthy)
            drop_idle_locked(p); /* the others most likely share the failure */
    }
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* ---- one frame over TCP ----------------------------------------------------------------- */

static int tcp_frame(te_engine *eng, int fd, uint8_t op, const char *name, uint64_t off,
                     uint8_t *data, uint64_t len, double deadline, te_err *e)
{
    /* INFO sends no length but expects TE_INFO_LEN bytes back into data */
    te_req_hdr h = {.op = op, .name_len = (uint8_t)strlen(name), .offset = off,
                    .length = op == TE_OP_INFO ? 0 : len};
    uint8_t hdr[TE_REQ_HDR_LEN], resp[TE_RESP_HDR_LEN];
    te_encode_req(hdr, &h);
    struct iovec iov[3] = {{hdr, sizeof hdr}, {(void *)name, h.name_len},
                           {data, op == TE_OP_WRITE ? (size_t)len : 0}};
    int rc = te_send_all(fd, iov, 3, deadline, eng->stop_fd, e);
    if (!rc)
        rc = te_recv_all(fd, resp, sizeof resp, deadline, eng->stop_fd, e);
    if (rc)
        return rc;
    uint32_t status = te_get_u32(resp + 4);
    uint64_t rlen = te_get_u64(resp + 8);
    if (te_get_u32(resp) != TE_FRAME_MAGIC) {
        te_err_set(e, "protocol error: bad response frame");
        return TE_IO_ERROR;
    }
    if (status != 0) {
        char msg[TE_MSG_LEN];
        if (rlen >= sizeof msg) {
            te_err_set(e, "protocol error: oversized error frame");
            return TE_IO_ERROR;
        }
        rc = te_recv_all(fd, msg, (size_t)rlen, deadline, eng->stop_fd, e);
        if (rc)
            return rc;
        msg[rlen] = 0;
        te_err_set(e, "peer refused: %s", msg);
        return TE_REMOTE_ERROR;
    }
    uint64_t want = op == TE_OP_WRITE ? 0 : len;
    if (rlen != want) {
        te_err_set(e, "protocol error: response carries %llu bytes, expected %llu",
                   (unsigned long long)rlen, (unsigned long long)want);
        return TE_IO_ERROR;
    }
    /* READ lands straight in the caller's registered memory */
    return rlen ? te_recv_all(fd, data, (size_t)rlen, deadline, eng->stop_fd, e) : 0;
}

/* ---- open_segment ----------------------------------------------------------------------- */

static int map_shm(const te_info *info, const char *my_boot_id, te_segment *s, te_err *e)
{
    if (info->fd < 0) {
        te_err_set(e, "the segment is plain registered memory (TCP only)");
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
    void *m = info->size ? mmap(NULL, info->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
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

int te_open_segment(te_engine *eng, const char *host, int port, const char *name, int mode,
                    te_err *e)
{
    size_t name_len = strlen(name);
    if (name_len == 0 || name_len > TE_MAX_NAME) {
        te_err_set(e, "segment name must be 1..%d bytes", TE_MAX_NAME);
        return -1;
    }
    te_peer *p = get_peer(eng, host, port, e);
    if (!p)
        return -1;
    double deadline = te_now() + eng->timeout_s;
    int fd = pool_acquire(eng, p, 0, deadline, 0, e);
    if (fd < 0)
        return -1;
    uint8_t raw[TE_INFO_LEN];
    int rc = tcp_frame(eng, fd, TE_OP_INFO, name, 0, raw, sizeof raw, deadline, e);
    pool_release(p, fd, rc == 0 || rc == TE_REMOTE_ERROR);
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
    s->transport = TE_TRANSPORT_TCP;
    if (mode != TE_MODE_TCP) {
        te_err why;
        if (map_shm(&info, eng->boot_id, s, &why) == 0) {
            s->transport = TE_TRANSPORT_SHM;
        } else if (mode == TE_MODE_SHM) {
            free(s);
            te_err_set(e, "shared-memory transport to segment '%s' is not possible: %s", name,
                       why.msg);
            return -1;
        }
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

int te_run_slice(te_engine *eng, te_request *req, uint64_t off, uint64_t len, te_err *e)
{
    te_segment *s = req->seg;
    uint64_t roff = req->remote_off + off;
    uint8_t *local = req->local + off;
    if (s->transport == TE_TRANSPORT_SHM) {
        if (roff > s->size || len > s->size - roff) {
            te_err_set(e, "out of bounds: offset %llu + length %llu exceeds segment '%s' of "
                          "%llu bytes", (unsigned long long)roff, (unsigned long long)len,
                       s->name, (unsigned long long)s->size);
            return TE_REMOTE_ERROR;
        }
        if (req->op == TE_REQ_READ)
            memcpy(local, s->map + roff, len);
        else
            memcpy(s->map + roff, local, len);
        return 0;
    }

    te_peer *p = s->peer;
    double deadline = te_now() + eng->timeout_s;
    uint8_t op = req->op == TE_REQ_READ ? TE_OP_READ : TE_OP_WRITE;
    int rc = TE_IO_ERROR;
    char first[TE_MSG_LEN] = {0};
    for (int attempt = 0; attempt < 2; attempt++) {
        int fd = pool_acquire(eng, p, attempt > 0, deadline, req->submitted_at, e);
        if (fd < 0) {
            rc = fd;
        } else {
            rc = tcp_frame(eng, fd, op, s->name, roff, local, len, deadline, e);
            pool_release(p, fd, rc == 0 || rc == TE_REMOTE_ERROR);
            if (rc == 0 || rc == TE_REMOTE_ERROR)
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
    if (rc != TE_IO_STOPPED && rc != TE_PEER_DOWN) {
        pthread_mutex_lock(&p->mu);
        p->failed_at = te_now();
        snprintf(p->fail_reason, sizeof p->fail_reason, "%s", e->msg);
        pthread_mutex_unlock(&p->mu);
    }
    return rc;
}

void te_peers_close(te_engine *eng)
{
    for (int i = 0; i < eng->n_segments; i++) {
        te_segment *s = eng->segments[i];
        if (s->map)
            munmap(s->map, s->map_len);
        free(s);
        eng->segments[i] = NULL;
    }
    eng->n_segments = 0;
    te_peer *p = eng->peers;
    while (p) {
        te_peer *next = p->next;
        pthread_mutex_lock(&p->mu);
        drop_idle_locked(p);
        pthread_mutex_unlock(&p->mu);
        pthread_mutex_destroy(&p->mu);
        pthread_cond_destroy(&p->cv);
        free(p);
        p = next;
    }
    eng->peers = NULL;
}
