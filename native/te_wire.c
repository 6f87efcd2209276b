/* Wire format, deadline-bounded socket I/O and the mutual HMAC handshake.
 *
 * Handshake (the secret never crosses the wire):
 *   server -> client  "MCTEHS01" || server_nonce[32]
 *   client -> server  client_nonce[32] || HMAC(secret, "mcte-client" || sn || cn)
 *   server -> client  0x00 || HMAC(secret, "mcte-server" || sn || cn)   (accepted)
 *                     0x01                                              (refused, then close)
 * The labels keep a server from replaying a client's proof back to it.
 */
#include "te.h"

#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

/* NOTE: the version digit changes with the frame format, so mismatched builds fail clearly */
static const char HELLO[8] = {'M', 'C', 'T', 'E', 'H', 'S', '0', '2'};

void te_err_set(te_err *e, const char *fmt, ...)
{
    if (!e)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
}

double te_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

void te_put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

void te_put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

uint32_t te_get_u32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

uint64_t te_get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

void te_encode_req(uint8_t out[TE_REQ_HDR_LEN], const te_req_hdr *h)
{
    memset(out, 0, TE_REQ_HDR_LEN);
    te_put_u32(out, TE_FRAME_MAGIC);
    out[4] = h->op;
    out[5] = h->name_len;
    out[6] = h->flags;
    te_put_u64(out + 8, h->offset);
    te_put_u64(out + 16, h->length);
    te_put_u32(out + 24, h->crc);
}

int te_decode_req(const uint8_t in[TE_REQ_HDR_LEN], te_req_hdr *h)
{
    if (te_get_u32(in) != TE_FRAME_MAGIC)
        return -1;
    h->op = in[4];
    h->name_len = in[5];
    h->flags = in[6];
    h->offset = te_get_u64(in + 8);
    h->length = te_get_u64(in + 16);
    h->crc = te_get_u32(in + 24);
    if (h->op < TE_OP_INFO || h->op > TE_OP_GET || h->name_len == 0)
        return -1;
    if (h->op == TE_OP_RDMA_CONNECT && h->length != TE_QP_INFO_LEN)
        return -1;
    if (h->op != TE_OP_INFO && h->length > TE_MAX_PAYLOAD)
        return -1;
    return 0;
}

void te_encode_resp(uint8_t out[TE_RESP_HDR_LEN], uint32_t status, uint64_t length, uint32_t crc)
{
    memset(out, 0, TE_RESP_HDR_LEN);
    te_put_u32(out, TE_FRAME_MAGIC);
    te_put_u32(out + 4, status);
    te_put_u64(out + 8, length);
    te_put_u32(out + 16, crc);
}

int te_decode_resp(const uint8_t in[TE_RESP_HDR_LEN], te_resp_hdr *h)
{
    h->status = te_get_u32(in + 4);
    h->length = te_get_u64(in + 8);
    h->crc = te_get_u32(in + 16);
    return te_get_u32(in) == TE_FRAME_MAGIC ? 0 : -1;
}

void te_encode_info(uint8_t out[TE_INFO_LEN], const te_info *info)
{
    te_put_u64(out, info->size);
    te_put_u32(out + 8, info->pid);
    te_put_u32(out + 12, (uint32_t)info->fd);
    te_put_u64(out + 16, info->dev);
    te_put_u64(out + 24, info->ino);
    memcpy(out + 32, info->boot_id, TE_BOOT_ID_LEN);
    te_put_u64(out + 32 + TE_BOOT_ID_LEN, info->rdma_addr);
    te_put_u32(out + 40 + TE_BOOT_ID_LEN, info->rkey);
    te_put_u32(out + 44 + TE_BOOT_ID_LEN, info->rdma_ok);
}

void te_decode_info(const uint8_t in[TE_INFO_LEN], te_info *info)
{
    info->size = te_get_u64(in);
    info->pid = te_get_u32(in + 8);
    info->fd = (int32_t)te_get_u32(in + 12);
    info->dev = te_get_u64(in + 16);
    info->ino = te_get_u64(in + 24);
    memcpy(info->boot_id, in + 32, TE_BOOT_ID_LEN);
    info->boot_id[TE_BOOT_ID_LEN - 1] = 0;
    info->rdma_addr = te_get_u64(in + 32 + TE_BOOT_ID_LEN);
    info->rkey = te_get_u32(in + 40 + TE_BOOT_ID_LEN);
    info->rdma_ok = te_get_u32(in + 44 + TE_BOOT_ID_LEN);
}

void te_encode_qp(uint8_t out[TE_QP_INFO_LEN], const te_qp_info *q)
{
    memset(out, 0, TE_QP_INFO_LEN);
    te_put_u32(out, q->qpn);
    te_put_u32(out + 4, q->psn);
    out[8] = (uint8_t)(q->lid & 0xff);
    out[9] = (uint8_t)(q->lid >> 8);
    out[10] = q->mtu;
    memcpy(out + 12, q->gid, 16);
}

void te_decode_qp(const uint8_t in[TE_QP_INFO_LEN], te_qp_info *q)
{
    q->qpn = te_get_u32(in);
    q->psn = te_get_u32(in + 4);
    q->lid = (uint16_t)(in[8] | (in[9] << 8));
    q->mtu = in[10];
    memcpy(q->gid, in + 12, 16);
}

int te_wait_fd(int fd, short events, double deadline, int stop_fd, te_err *e)
{
    for (;;) {
        int timeout_ms = -1;
        if (deadline > 0) {
            double left = deadline - te_now();
            if (left <= 0) {
                te_err_set(e, "timed out (no progress from peer)");
                return TE_IO_TIMEOUT;
            }
            timeout_ms = (int)ceil(left * 1000.0);
        }
        struct pollfd p[2] = {{.fd = fd, .events = events}, {.fd = stop_fd, .events = POLLIN}};
        int n = poll(p, stop_fd >= 0 ? 2 : 1, timeout_ms);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            te_err_set(e, "poll failed: %s", strerror(errno));
            return TE_IO_ERROR;
        }
        if (stop_fd >= 0 && p[1].revents) {
            te_err_set(e, "transfer engine is closing");
            return TE_IO_STOPPED;
        }
        /* POLLERR/POLLHUP fall through: the next recv/send reports the precise error */
        if (n > 0 && p[0].revents)
            return 0;
    }
}

/* Received bytes are checksummed once this many have piled up (or at the end): recv hands out
 * pieces of any size, and a CRC call per tiny piece would cost more than it saves, while 64 KiB
 * still sits in L2 when its CRC runs. */
#define RECV_CRC_PIECE (64u << 10)

int te_recv_all(int fd, void *buf, size_t len, double deadline, int stop_fd, te_err *e)
{
    return te_recv_all_crc(fd, buf, len, deadline, stop_fd, e, NULL);
}

int te_recv_all_crc(int fd, void *buf, size_t len, double deadline, int stop_fd, te_err *e,
                    uint32_t *crc)
{
    uint8_t *p = buf, *unsummed = buf;
    size_t total = len;
    while (len > 0) {
        ssize_t n = recv(fd, p, len, MSG_DONTWAIT);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
            if (crc && ((size_t)(p - unsummed) >= RECV_CRC_PIECE || len == 0)) {
                *crc = te_crc32c(*crc, unsummed, (size_t)(p - unsummed));
                unsummed = p;
            }
            continue;
        }
        if (n == 0) {
            if (len == total)
                te_err_set(e, "connection closed by peer");
            else /* the peer died or lied about the length: never treat it as complete */
                te_err_set(e, "connection closed by peer: stream truncated after %zu of %zu "
                              "bytes", total - len, total);
            return TE_IO_CLOSED;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            te_err_set(e, "receive failed: %s", strerror(errno));
            return errno == ECONNRESET ? TE_IO_CLOSED : TE_IO_ERROR;
        }
        int rc = te_wait_fd(fd, POLLIN, deadline, stop_fd, e);
        if (rc)
            return rc;
    }
    return 0;
}

int te_send_all(int fd, const struct iovec *iov_in, int iovcnt, double deadline, int stop_fd,
                te_err *e)
{
    struct iovec iov[4];
    if (iovcnt > 4) {
        te_err_set(e, "internal error: too many iovecs");
        return TE_IO_ERROR;
    }
    memcpy(iov, iov_in, sizeof(struct iovec) * (size_t)iovcnt);
    struct iovec *cur = iov;
    while (iovcnt > 0) {
        if (cur->iov_len == 0) {
            cur++;
            iovcnt--;
            continue;
        }
        struct msghdr m = {.msg_iov = cur, .msg_iovlen = (size_t)iovcnt};
        ssize_t n = sendmsg(fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                te_err_set(e, "send failed: %s", strerror(errno));
                return (errno == EPIPE || errno == ECONNRESET) ? TE_IO_CLOSED : TE_IO_ERROR;
            }
            int rc = te_wait_fd(fd, POLLOUT, deadline, stop_fd, e);
            if (rc)
                return rc;
            continue;
        }
        size_t done = (size_t)n;
        while (iovcnt > 0 && done >= cur->iov_len) {
            done -= cur->iov_len;
            cur++;
            iovcnt--;
        }
        if (iovcnt > 0) {
            cur->iov_base = (uint8_t *)cur->iov_base + done;
            cur->iov_len -= done;
        }
    }
    return 0;
}

void te_tune_socket(int fd)
{
    int one = 1, buf = TE_SOCKET_BUFFER;
    /* best effort: small frames must not wait for Nagle, big slices want deep buffers */
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
}

static int mac(const uint8_t *secret, size_t secret_len, const char *label, const uint8_t *sn,
               const uint8_t *cn, uint8_t out[TE_MAC_LEN])
{
    uint8_t msg[16 + 2 * TE_NONCE_LEN];
    size_t ll = strlen(label);
    memcpy(msg, label, ll);
    memcpy(msg + ll, sn, TE_NONCE_LEN);
    memcpy(msg + ll + TE_NONCE_LEN, cn, TE_NONCE_LEN);
    unsigned int out_len = 0;
    /* NOTE: HMAC() rejects a NULL key; an empty secret still means "the shared empty key" */
    static const uint8_t empty = 0;
    if (!HMAC(EVP_sha256(), secret_len ? secret : &empty, (int)secret_len, msg,
              ll + 2 * TE_NONCE_LEN, out, &out_len) ||
        out_len != TE_MAC_LEN)
        return -1;
    return 0;
}

int te_handshake_server(int fd, const uint8_t *secret, size_t secret_len, double deadline,
                        int stop_fd, te_err *e)
{
    uint8_t hello[8 + TE_NONCE_LEN], answer[TE_NONCE_LEN + TE_MAC_LEN], want[TE_MAC_LEN];
    memcpy(hello, HELLO, 8);
    if (RAND_bytes(hello + 8, TE_NONCE_LEN) != 1) {
        te_err_set(e, "no randomness for the handshake nonce");
        return TE_IO_ERROR;
    }
    struct iovec iov = {hello, sizeof hello};
    int rc = te_send_all(fd, &iov, 1, deadline, stop_fd, e);
    if (!rc)
        rc = te_recv_all(fd, answer, sizeof answer, deadline, stop_fd, e);
    if (rc)
        return rc;
    if (mac(secret, secret_len, "mcte-client", hello + 8, answer, want) ||
        CRYPTO_memcmp(want, answer + TE_NONCE_LEN, TE_MAC_LEN) != 0) {
        uint8_t refuse = 1;
        struct iovec r = {&refuse, 1};
        te_send_all(fd, &r, 1, deadline, stop_fd, NULL);
        te_err_set(e, "client failed authentication");
        return TE_AUTH_ERROR;
    }
    uint8_t reply[1 + TE_MAC_LEN];
    reply[0] = 0;
    if (mac(secret, secret_len, "mcte-server", hello + 8, answer, reply + 1)) {
        te_err_set(e, "HMAC computation failed");
        return TE_IO_ERROR;
    }
    struct iovec r = {reply, sizeof reply};
    return te_send_all(fd, &r, 1, deadline, stop_fd, e);
}

int te_handshake_client(int fd, const uint8_t *secret, size_t secret_len, double deadline,
                        int stop_fd, te_err *e)
{
    uint8_t hello[8 + TE_NONCE_LEN], answer[TE_NONCE_LEN + TE_MAC_LEN], reply[1 + TE_MAC_LEN];
    uint8_t want[TE_MAC_LEN];
    int rc = te_recv_all(fd, hello, sizeof hello, deadline, stop_fd, e);
    if (rc)
        return rc;
    if (memcmp(hello, HELLO, 8) != 0) {
        te_err_set(e, "peer is not a mooncake transfer engine (bad greeting)");
        return TE_IO_ERROR;
    }
    if (RAND_bytes(answer, TE_NONCE_LEN) != 1 ||
        mac(secret, secret_len, "mcte-client", hello + 8, answer, answer + TE_NONCE_LEN)) {
        te_err_set(e, "cannot compute the handshake proof");
        return TE_IO_ERROR;
    }
    struct iovec iov = {answer, sizeof answer};
    rc = te_send_all(fd, &iov, 1, deadline, stop_fd, e);
    if (!rc)
        rc = te_recv_all(fd, reply, 1, deadline, stop_fd, e);
    if (rc == TE_IO_CLOSED || (!rc && reply[0] != 0)) {
        te_err_set(e, "authentication failed: the peer refused our cluster secret");
        return TE_AUTH_ERROR;
    }
    if (!rc)
        rc = te_recv_all(fd, reply + 1, TE_MAC_LEN, deadline, stop_fd, e);
    if (rc)
        return rc;
    if (mac(secret, secret_len, "mcte-server", hello + 8, answer, want) ||
        CRYPTO_memcmp(want, reply + 1, TE_MAC_LEN) != 0) {
        te_err_set(e, "authentication failed: the peer could not prove it knows the cluster "
                      "secret");
        return TE_AUTH_ERROR;
    }
    return 0;
}
