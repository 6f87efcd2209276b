/* Peers and their connection pools: authenticated TCP connections and RDMA queue pairs, each
 * capped at connections_per_peer, created on demand and reused.
 */
#include "te.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

te_peer *te_get_peer(te_engine *eng, const char *host, int port, te_err *e)
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

int te_connect_peer(te_engine *eng, te_peer *p, double deadline, te_err *e)
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

static void drop_rdma_idle_locked(te_peer *p)
{
    while (p->n_rdma_idle > 0) {
        te_rdma_conn_free(p->rdma_idle[--p->n_rdma_idle]);
        p->n_rdma_open--;
    }
}

/* Wait on p->cv (mu held) until deadline; -1 on timeout. */
static int wait_pool_locked(te_peer *p, double deadline)
{
    struct timespec ts;
    ts.tv_sec = (time_t)deadline;
    ts.tv_nsec = (long)((deadline - (double)ts.tv_sec) * 1e9);
    return pthread_cond_timedwait(&p->cv, &p->mu, &ts) == ETIMEDOUT ? -1 : 0;
}

int te_pool_acquire(te_engine *eng, te_peer *p, int fresh, double deadline, double not_before,
                    te_err *e)
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
            int fd = te_connect_peer(eng, p, deadline, e);
            if (fd < 0) {
                pthread_mutex_lock(&p->mu);
                p->n_open--;
                pthread_cond_broadcast(&p->cv);
                pthread_mutex_unlock(&p->mu);
            }
            return fd;
        }
        if (wait_pool_locked(p, deadline)) {
            pthread_mutex_unlock(&p->mu);
            te_err_set(e, "timed out waiting for a free connection");
            return TE_IO_TIMEOUT;
        }
    }
}

void te_pool_release(te_peer *p, int fd, int healthy)
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
    /* NOTE: broadcast, not signal: TCP and RDMA waiters share this condition variable */
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

struct te_rdma_conn *te_rdma_pool_acquire(te_engine *eng, te_peer *p, const char *name,
                                          double deadline, te_err *e)
{
    pthread_mutex_lock(&p->mu);
    for (;;) {
        if (p->n_rdma_idle > 0) {
            struct te_rdma_conn *c = p->rdma_idle[--p->n_rdma_idle];
            pthread_mutex_unlock(&p->mu);
            return c;
        }
        if (p->n_rdma_open < p->max_open) {
            p->n_rdma_open++;
            pthread_mutex_unlock(&p->mu);
            struct te_rdma_conn *c = NULL;
            int fd = te_connect_peer(eng, p, deadline, e);
            if (fd >= 0)
                c = te_rdma_connect(eng, fd, name, deadline, e); /* owns fd from here */
            if (!c) {
                pthread_mutex_lock(&p->mu);
                p->n_rdma_open--;
                pthread_cond_broadcast(&p->cv);
                pthread_mutex_unlock(&p->mu);
            }
            return c;
        }
        if (wait_pool_locked(p, deadline)) {
            pthread_mutex_unlock(&p->mu);
            te_err_set(e, "timed out waiting for a free RDMA queue pair");
            return NULL;
        }
    }
}

void te_rdma_pool_release(te_peer *p, struct te_rdma_conn *c, int healthy)
{
    pthread_mutex_lock(&p->mu);
    if (healthy && p->n_rdma_idle < TE_MAX_POOL) {
        p->rdma_idle[p->n_rdma_idle++] = c;
    } else {
        te_rdma_conn_free(c); /* a QP that saw an error is in the error state for good */
        p->n_rdma_open--;
        if (!healthy)
            drop_rdma_idle_locked(p);
    }
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
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
        drop_rdma_idle_locked(p);
        pthread_mutex_unlock(&p->mu);
        pthread_mutex_destroy(&p->mu);
        pthread_cond_destroy(&p->cv);
        free(p);
        p = next;
    }
    eng->peers = NULL;
}
