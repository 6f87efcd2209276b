/* RDMA transport over libibverbs: one device per engine, RC queue pairs connected through the
 * TCP control connection (RDMA_CONNECT frame), one-sided READ/WRITE into the peer's registered
 * memory, completions polled by the worker thread that posted the request.
 *
 * Compiled only with TE_HAVE_VERBS (setup.py defines it where infiniband/verbs.h exists and
 * links libibverbs); without it every entry point fails with a clear "not built" message.
 */
#include "te.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NOT_BUILT \
    "this build has no RDMA support (infiniband/verbs.h was absent when it was compiled)"

#ifdef TE_HAVE_VERBS

#include <infiniband/verbs.h>
#include <openssl/rand.h>
#include <poll.h>
#include <time.h>

#define CQ_DEPTH 16
#define BUSY_POLLS 4096 /* completions usually land within microseconds: spin before sleeping */

struct te_rdma {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    uint8_t port;
    int gid_index;
    union ibv_gid gid;
    uint16_t lid;
    enum ibv_mtu mtu;
    int link_ib; /* 1: InfiniBand (routed by LID), 0: RoCE (routed by GID) */
    uint8_t max_rd_atomic, max_dest_rd_atomic;
    char name[64];
};

struct te_rdma_conn {
    struct te_rdma *r;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    int ctl_fd; /* client side: the TCP connection whose server thread owns the peer's QP */
    uint64_t next_wr;
};

int te_rdma_built(void) { return 1; }

int te_rdma_probe(char *out, size_t cap, te_err *e)
{
    int n = 0;
    errno = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (!list) {
        /* NOTE: ENOSYS means the kernel has no RDMA subsystem at all: the same as no device */
        int err = errno ? errno : ENODEV;
        te_err_set(e, "ibv_get_device_list: %s%s", strerror(err),
                   err == ENOSYS ? " (this kernel has no RDMA support)" : "");
        return 0;
    }
    int copied = 0;
    size_t used = 0;
    for (int i = 0; i < n; i++) {
        const char *name = ibv_get_device_name(list[i]);
        size_t l = strlen(name) + 1;
        if (used + l > cap)
            break;
        memcpy(out + used, name, l);
        used += l;
        copied++;
    }
    ibv_free_device_list(list);
    if (!copied)
        te_err_set(e, "no RDMA devices found");
    return copied;
}

static int gid_is_zero(const union ibv_gid *g)
{
    for (int i = 0; i < 16; i++)
        if (g->raw[i])
            return 0;
    return 1;
}

static int gid_is_ipv4(const union ibv_gid *g)
{
    static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return memcmp(g->raw, prefix, sizeof prefix) == 0;
}

/* RoCE: prefer a RoCE v2 GID carrying an IPv4 address (routable, what most fabrics use), then
 * any RoCE v2 GID, then the first non-zero one. InfiniBand routes by LID: index 0. */
static int pick_gid(struct ibv_context *ctx, uint8_t port, int tbl_len, int link_ib)
{
    if (link_ib)
        return 0;
    int v2 = -1, any = -1;
    for (int i = 0; i < tbl_len; i++) {
        struct ibv_gid_entry ent;
        if (ibv_query_gid_ex(ctx, port, (uint32_t)i, &ent, 0) || gid_is_zero(&ent.gid))
            continue;
        if (ent.gid_type == IBV_GID_TYPE_ROCE_V2 && gid_is_ipv4(&ent.gid))
            return i;
        if (ent.gid_type == IBV_GID_TYPE_ROCE_V2 && v2 < 0)
            v2 = i;
        if (any < 0)
            any = i;
    }
    return v2 >= 0 ? v2 : any >= 0 ? any : 0;
}

static int open_port(struct te_rdma *r, int gid_index, te_err *e)
{
    struct ibv_device_attr da;
    if (ibv_query_device(r->ctx, &da)) {
        te_err_set(e, "cannot query RDMA device %s: %s", r->name, strerror(errno));
        return -1;
    }
    int tbl_len = 0;
    for (int p = 1; p <= da.phys_port_cnt && !r->port; p++) {
        struct ibv_port_attr pa;
        if (ibv_query_port(r->ctx, (uint8_t)p, &pa) == 0 && pa.state == IBV_PORT_ACTIVE) {
            r->port = (uint8_t)p;
            r->lid = pa.lid;
            r->mtu = pa.active_mtu;
            r->link_ib = pa.link_layer == IBV_LINK_LAYER_INFINIBAND;
            tbl_len = pa.gid_tbl_len;
        }
    }
    if (!r->port) {
        te_err_set(e, "RDMA device %s has no active port", r->name);
        return -1;
    }
    /* outstanding RDMA READs per QP, both directions: as deep as the device allows, up to 16 */
    r->max_rd_atomic = (uint8_t)(da.max_qp_init_rd_atom < 16 ? da.max_qp_init_rd_atom : 16);
    r->max_dest_rd_atomic = (uint8_t)(da.max_qp_rd_atom < 16 ? da.max_qp_rd_atom : 16);
    r->gid_index = gid_index >= 0 ? gid_index : pick_gid(r->ctx, r->port, tbl_len, r->link_ib);
    if (ibv_query_gid(r->ctx, r->port, r->gid_index, &r->gid)) {
        te_err_set(e, "cannot read GID %d of %s port %u: %s", r->gid_index, r->name, r->port,
                   strerror(errno));
        return -1;
    }
    if (!r->link_ib && gid_is_zero(&r->gid)) {
        te_err_set(e, "GID %d of %s port %u is empty: pass rdma_gid_index", r->gid_index,
                   r->name, r->port);
        return -1;
    }
    return 0;
}

struct te_rdma *te_rdma_open(const char *device, int gid_index, te_err *e)
{
    int n = 0;
    errno = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (!list) {
        te_err_set(e, "cannot list RDMA devices: %s", strerror(errno ? errno : ENODEV));
        return NULL;
    }
    struct ibv_device *dev = NULL;
    for (int i = 0; i < n && !dev; i++)
        if (!device || !*device || strcmp(ibv_get_device_name(list[i]), device) == 0)
            dev = list[i];
    if (!dev) {
        ibv_free_device_list(list);
        te_err_set(e, device && *device ? "no RDMA device named '%s'" : "no RDMA devices%s",
                   device ? device : "");
        return NULL;
    }
    struct te_rdma *r = calloc(1, sizeof *r);
    if (!r) {
        ibv_free_device_list(list);
        te_err_set(e, "out of memory");
        return NULL;
    }
    snprintf(r->name, sizeof r->name, "%s", ibv_get_device_name(dev));
    r->ctx = ibv_open_device(dev);
    ibv_free_device_list(list);
    if (!r->ctx) {
        te_err_set(e, "cannot open RDMA device %s: %s", r->name, strerror(errno));
        free(r);
        return NULL;
    }
    int rc = open_port(r, gid_index, e);
    if (!rc && !(r->pd = ibv_alloc_pd(r->ctx))) {
        te_err_set(e, "cannot allocate a protection domain on %s: %s", r->name, strerror(errno));
        rc = -1;
    }
    if (rc) {
        ibv_close_device(r->ctx);
        free(r);
        return NULL;
    }
    return r;
}

void te_rdma_close(struct te_rdma *r)
{
    if (!r)
        return;
    ibv_dealloc_pd(r->pd);
    ibv_close_device(r->ctx);
    free(r);
}

const char *te_rdma_name(const struct te_rdma *r) { return r ? r->name : ""; }

int te_rdma_reg(struct te_rdma *r, te_region *reg, te_err *e)
{
    struct ibv_mr *mr = ibv_reg_mr(r->pd, reg->addr, reg->len,
                                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
                                       IBV_ACCESS_REMOTE_WRITE);
    if (!mr) {
        te_err_set(e, "cannot register %zu bytes of '%s' with RDMA device %s: %s (is the "
                      "locked-memory limit, ulimit -l, high enough?)", reg->len, reg->name,
                   r->name, strerror(errno));
        return -1;
    }
    reg->mr = mr;
    reg->lkey = mr->lkey;
    reg->rkey = mr->rkey;
    return 0;
}

void te_rdma_dereg(te_region *reg)
{
    if (reg->mr)
        ibv_dereg_mr(reg->mr);
    reg->mr = NULL;
}

/* ---- queue pairs -------------------------------------------------------------------------- */

void te_rdma_conn_free(struct te_rdma_conn *c)
{
    if (!c)
        return;
    if (c->qp)
        ibv_destroy_qp(c->qp); /* first: no more DMA into our memory after this */
    if (c->cq)
        ibv_destroy_cq(c->cq);
    if (c->ctl_fd >= 0)
        close(c->ctl_fd); /* the peer's connection thread then frees its end */
    free(c);
}

/* A new RC QP in the INIT state, plus our half of the connection info. */
static struct te_rdma_conn *conn_new(struct te_rdma *r, te_qp_info *mine, te_err *e)
{
    struct te_rdma_conn *c = calloc(1, sizeof *c);
    if (!c) {
        te_err_set(e, "out of memory");
        return NULL;
    }
    c->r = r;
    c->ctl_fd = -1;
    c->cq = ibv_create_cq(r->ctx, CQ_DEPTH, NULL, NULL, 0);
    struct ibv_qp_init_attr ia = {
        .send_cq = c->cq, .recv_cq = c->cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 1,
        .cap = {.max_send_wr = CQ_DEPTH, .max_recv_wr = 1, .max_send_sge = 1,
                .max_recv_sge = 1}};
    if (c->cq)
        c->qp = ibv_create_qp(r->pd, &ia);
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = r->port,
                            .qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
                                               IBV_ACCESS_REMOTE_WRITE};
    if (!c->qp || ibv_modify_qp(c->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                               IBV_QP_ACCESS_FLAGS)) {
        te_err_set(e, "cannot create an RDMA queue pair on %s: %s", r->name, strerror(errno));
        te_rdma_conn_free(c);
        return NULL;
    }
    uint32_t psn = 0;
    if (RAND_bytes((uint8_t *)&psn, sizeof psn) != 1)
        psn = (uint32_t)getpid();
    memset(mine, 0, sizeof *mine);
    mine->qpn = c->qp->qp_num;
    mine->psn = psn & 0xffffff; /* PSNs are 24 bits */
    mine->lid = r->lid;
    mine->mtu = (uint8_t)r->mtu;
    memcpy(mine->gid, r->gid.raw, 16);
    return c;
}

/* INIT -> RTR (ready to receive from the remote QP) -> RTS (ready to send). */
static int conn_connect(struct te_rdma_conn *c, const te_qp_info *mine, const te_qp_info *peer,
                        te_err *e)
{
    struct te_rdma *r = c->r;
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = (enum ibv_mtu)(mine->mtu < peer->mtu ? mine->mtu : peer->mtu);
    a.dest_qp_num = peer->qpn;
    a.rq_psn = peer->psn;
    a.max_dest_rd_atomic = r->max_dest_rd_atomic;
    a.min_rnr_timer = 12;
    a.ah_attr.port_num = r->port;
    a.ah_attr.dlid = peer->lid;
    if (!r->link_ib) { /* RoCE: every packet carries a GRH addressed by GID */
        a.ah_attr.is_global = 1;
        memcpy(a.ah_attr.grh.dgid.raw, peer->gid, 16);
        a.ah_attr.grh.sgid_index = (uint8_t)r->gid_index;
        a.ah_attr.grh.hop_limit = 64;
    }
    if (ibv_modify_qp(c->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                     IBV_QP_MIN_RNR_TIMER)) {
        te_err_set(e, "RDMA queue pair to QPN %u would not reach RTR: %s", peer->qpn,
                   strerror(errno));
        return -1;
    }
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14; /* 4.096 us * 2^14 = 67 ms per try, 7 tries: a dead path errors in ~0.5 s */
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.sq_psn = mine->psn;
    a.max_rd_atomic = r->max_rd_atomic;
    if (ibv_modify_qp(c->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                     IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                     IBV_QP_MAX_QP_RD_ATOMIC)) {
        te_err_set(e, "RDMA queue pair to QPN %u would not reach RTS: %s", peer->qpn,
                   strerror(errno));
        return -1;
    }
    return 0;
}

struct te_rdma_conn *te_rdma_accept(struct te_rdma *r, const te_qp_info *remote,
                                    te_qp_info *local, te_err *e)
{
    struct te_rdma_conn *c = conn_new(r, local, e);
    if (c && conn_connect(c, local, remote, e)) {
        te_rdma_conn_free(c);
        c = NULL;
    }
    return c;
}

struct te_rdma_conn *te_rdma_connect(te_engine *eng, int ctl_fd, const char *name,
                                     double deadline, te_err *e)
{
    if (!eng->rdma) {
        close(ctl_fd);
        te_err_set(e, "this engine has no RDMA device open");
        return NULL;
    }
    te_qp_info mine, theirs;
    struct te_rdma_conn *c = conn_new(eng->rdma, &mine, e);
    if (!c) {
        close(ctl_fd);
        return NULL;
    }
    c->ctl_fd = ctl_fd; /* freed with c from here on */
    uint8_t buf[TE_QP_INFO_LEN];
    te_encode_qp(buf, &mine);
    te_req_hdr h = {.op = TE_OP_RDMA_CONNECT, .length = TE_QP_INFO_LEN};
    te_resp_hdr resp;
    if (te_tcp_frame(eng, ctl_fd, &h, name, buf, sizeof buf, &resp, deadline, e)) {
        te_rdma_conn_free(c);
        return NULL;
    }
    te_decode_qp(buf, &theirs);
    if (conn_connect(c, &mine, &theirs, e)) {
        te_rdma_conn_free(c);
        return NULL;
    }
    return c;
}

static int stop_requested(int stop_fd)
{
    struct pollfd p = {.fd = stop_fd, .events = POLLIN};
    return stop_fd >= 0 && poll(&p, 1, 0) > 0;
}

int te_rdma_post(struct te_rdma_conn *c, int op, uint8_t *local, uint32_t lkey,
                 uint64_t raddr, uint32_t rkey, uint64_t len, double deadline, int stop_fd,
                 te_err *e)
{
    const char *what = op == TE_REQ_READ ? "RDMA READ" : "RDMA WRITE";
    struct ibv_sge sge = {.addr = (uintptr_t)local, .length = (uint32_t)len, .lkey = lkey};
    struct ibv_send_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = ++c->next_wr;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = op == TE_REQ_READ ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    int rc = ibv_post_send(c->qp, &wr, &bad);
    if (rc) {
        te_err_set(e, "cannot post %s: %s", what, strerror(rc));
        return TE_IO_ERROR;
    }
    for (unsigned spins = 0;; spins++) {
        struct ibv_wc wc;
        int n = ibv_poll_cq(c->cq, 1, &wc);
        if (n < 0) {
            te_err_set(e, "polling the RDMA completion queue failed");
            return TE_IO_ERROR;
        }
        if (n == 1 && wc.wr_id == wr.wr_id) {
            if (wc.status == IBV_WC_SUCCESS)
                return 0;
            te_err_set(e, "%s completed with '%s' (vendor error 0x%x)", what,
                       ibv_wc_status_str(wc.status), wc.vendor_err);
            return TE_IO_ERROR;
        }
        if (n == 1 || spins < BUSY_POLLS)
            continue;
        /* NOTE: the caller destroys this QP on any failure, so a late completion of this
         * request can never be mistaken for a later one's */
        if (deadline > 0 && te_now() > deadline) {
            te_err_set(e, "%s not completed within the timeout", what);
            return TE_IO_TIMEOUT;
        }
        if (stop_requested(stop_fd)) {
            te_err_set(e, "transfer engine is closing");
            return TE_IO_STOPPED;
        }
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
}

#else /* !TE_HAVE_VERBS: the same entry points, all saying why RDMA is not there */

int te_rdma_built(void) { return 0; }

int te_rdma_probe(char *out, size_t cap, te_err *e)
{
    (void)out;
    (void)cap;
    te_err_set(e, NOT_BUILT);
    return -1;
}

struct te_rdma *te_rdma_open(const char *device, int gid_index, te_err *e)
{
    (void)device;
    (void)gid_index;
    te_err_set(e, NOT_BUILT);
    return NULL;
}

void te_rdma_close(struct te_rdma *r) { (void)r; }

const char *te_rdma_name(const struct te_rdma *r)
{
    (void)r;
    return "";
}

int te_rdma_reg(struct te_rdma *r, te_region *reg, te_err *e)
{
    (void)r;
    (void)reg;
    te_err_set(e, NOT_BUILT);
    return -1;
}

void te_rdma_dereg(te_region *reg) { reg->mr = NULL; }

struct te_rdma_conn *te_rdma_accept(struct te_rdma *r, const te_qp_info *remote,
                                    te_qp_info *local, te_err *e)
{
    (void)r;
    (void)remote;
    (void)local;
    te_err_set(e, NOT_BUILT);
    return NULL;
}

struct te_rdma_conn *te_rdma_connect(te_engine *eng, int ctl_fd, const char *name,
                                     double deadline, te_err *e)
{
    (void)eng;
    (void)name;
    (void)deadline;
    close(ctl_fd);
    te_err_set(e, NOT_BUILT);
    return NULL;
}

void te_rdma_conn_free(struct te_rdma_conn *c) { (void)c; }

int te_rdma_post(struct te_rdma_conn *c, int op, uint8_t *local, uint32_t lkey,
                 uint64_t raddr, uint32_t rkey, uint64_t len, double deadline, int stop_fd,
                 te_err *e)
{
    (void)c, (void)op, (void)local, (void)lkey, (void)raddr, (void)rkey, (void)len;
    (void)deadline, (void)stop_fd;
    te_err_set(e, NOT_BUILT);
    return TE_IO_ERROR;
}

#endif
