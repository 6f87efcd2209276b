/* Shared declarations of the mooncake-server transfer engine (no Python here).
 *
 * Layout of the native side, one job per file:
 *   te_crc32c.c  CRC32C (SSE4.2 with a table fallback), copy+CRC in one pass, combining CRCs
 *   te_wire.c    deadline-bounded socket I/O, frame encoding, HMAC handshake
 *   te_server.c  registered regions + the listener serving INFO/READ/WRITE/CRC/GET frames
 *   te_keys.c    objects published by key, for GET (one round trip, pinned while sent)
 *   te_peer.c    peers and their pools of authenticated TCP connections and RDMA queue pairs
 *   te_client.c  request frames, open_segment, one slice over shm, RDMA or TCP (with retry)
 *   te_rdma.c    libibverbs RC queue pairs (only with TE_HAVE_VERBS; stubs otherwise)
 *   te_batch.c   batches, the request queue and the worker threads
 * The CPython binding (the only files that touch the GIL; private header te_py.h):
 *   transfer_engine.c  the module: mooncake_server.transfer._native
 *   te_py_engine.c     the Engine type: lifecycle, segments and batches
 *   te_py_memory.c     registered memory: SharedBuffer (memfd), register/unregister
 */
#ifndef MOONCAKE_TE_H
#define MOONCAKE_TE_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

#define TE_MAX_NAME 255
/* NOTE: a frame never carries more than this; bigger requests are sliced by the client. */
#define TE_MAX_PAYLOAD (64u << 20)
#define TE_MSG_LEN 384
#define TE_NONCE_LEN 32
#define TE_MAC_LEN 32
#define TE_BOOT_ID_LEN 40
#define TE_MAX_SEGMENTS 4096
#define TE_MAX_SERVER_CONNS 1024
#define TE_MAX_POOL 64
#define TE_SOCKET_BUFFER (4 << 20)
#define TE_MAX_GROUP 16 /* small requests pipelined together on one connection */
#define TE_SHM_SLICE (256u << 10)

/* wire ops: CRC returns the CRC32C of a range (RDMA verification), RDMA_CONNECT swaps QP info */
/* GET reads a published object by its key (the frame's name) in one round trip */
enum { TE_OP_INFO = 1, TE_OP_READ = 2, TE_OP_WRITE = 3, TE_OP_CRC = 4, TE_OP_RDMA_CONNECT = 5,
       TE_OP_GET = 6 };
enum { TE_FLAG_CRC = 1 };                                 /* request flags: verify this slice */
/* response status; MISSING: GET of a key not published there (a miss, not a failure) */
enum { TE_STATUS_OK = 0, TE_STATUS_ERROR = 1, TE_STATUS_CRC = 2, TE_STATUS_MISSING = 3 };
enum { TE_REQ_READ = 0, TE_REQ_WRITE = 1, TE_REQ_GET = 2 };         /* Python-facing Op */
enum { TE_STATE_PENDING = 0, TE_STATE_DONE = 1, TE_STATE_FAILED = 2 };
enum { TE_MODE_AUTO = 0, TE_MODE_SHM = 1, TE_MODE_TCP = 2, TE_MODE_RDMA = 3 };
enum { TE_TRANSPORT_SHM = 1, TE_TRANSPORT_TCP = 2, TE_TRANSPORT_RDMA = 3 };

/* I/O results: 0 ok, negative failure (message in te_err). */
enum { TE_IO_ERROR = -1, TE_IO_TIMEOUT = -2, TE_IO_CLOSED = -3, TE_IO_STOPPED = -4,
       TE_REMOTE_ERROR = -5, TE_AUTH_ERROR = -6, TE_PEER_DOWN = -7, TE_CRC_ERROR = -8,
       TE_KEY_MISSING = -9 };

typedef struct { char msg[TE_MSG_LEN]; } te_err;

void te_err_set(te_err *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
double te_now(void);

/* ---- CRC32C ---------------------------------------------------------------------------- */
uint32_t te_crc32c(uint32_t crc, const void *buf, size_t len);
uint32_t te_crc32c_sw(uint32_t crc, const void *buf, size_t len);
/* the single-chain hardware loop te_crc32c used before it ran three chains: benchmark baseline */
uint32_t te_crc32c_serial(uint32_t crc, const void *buf, size_t len);
/* memcpy(dst, src, len) that returns the CRC32C (continued from crc) of what it wrote, in one
 * pass: the shm transport's checksummed copy */
uint32_t te_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len);
/* crc(A|B) from crc(A), crc(B) and len(B) */
uint32_t te_crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
/* The same in two steps, for many pieces of one length: zeros(n) once (~1 us), then
 * crc(A|B) = shift(crc(A), zeros(len(B))) ^ crc(B) at ~32 steps each. */
uint32_t te_crc32c_zeros(uint64_t nbytes);
uint32_t te_crc32c_shift(uint32_t crc, uint32_t zeros);

/* ---- wire ------------------------------------------------------------------------------- */
/* request: magic u32, op u8, name_len u8, flags u8, pad u8, offset u64, length u64, crc u32, pad */
#define TE_REQ_HDR_LEN 32
#define TE_RESP_HDR_LEN 24 /* magic u32, status u32, length u64, crc u32, pad u32 */
#define TE_INFO_LEN (8 + 4 + 4 + 8 + 8 + TE_BOOT_ID_LEN + 8 + 4 + 4)
#define TE_QP_INFO_LEN 32  /* qpn u32, psn u32, lid u16, mtu u8, pad u8, gid[16], pad u32 */
#define TE_FRAME_MAGIC 0x3254434du /* "MCT2" little-endian */

typedef struct {
    uint8_t op;
    uint8_t name_len;
    uint8_t flags;
    uint64_t offset;
    uint64_t length;
    uint32_t crc; /* WRITE with TE_FLAG_CRC: CRC32C of the payload as the sender saw it;
                   * GET: the object's whole length as the reader expects it */
} te_req_hdr;

typedef struct {
    uint32_t status;
    uint64_t length;
    uint32_t crc; /* READ with TE_FLAG_CRC, and CRC: CRC32C of the range as the server sees it */
} te_resp_hdr;

typedef struct {
    uint64_t size;
    uint32_t pid;
    int32_t fd; /* -1 when the segment is not shareable */
    uint64_t dev, ino;
    char boot_id[TE_BOOT_ID_LEN];
    uint64_t rdma_addr; /* base address for one-sided access; 0 = no RDMA for this segment */
    uint32_t rkey;
    uint32_t rdma_ok;
} te_info;

/* What an RC queue pair needs from its remote end (exchanged over the TCP control connection). */
typedef struct {
    uint32_t qpn, psn;
    uint16_t lid;
    uint8_t mtu; /* enum ibv_mtu */
    uint8_t gid[16];
} te_qp_info;

void te_put_u32(uint8_t *p, uint32_t v);
void te_put_u64(uint8_t *p, uint64_t v);
uint32_t te_get_u32(const uint8_t *p);
uint64_t te_get_u64(const uint8_t *p);
void te_encode_req(uint8_t out[TE_REQ_HDR_LEN], const te_req_hdr *h);
int te_decode_req(const uint8_t in[TE_REQ_HDR_LEN], te_req_hdr *h);
void te_encode_resp(uint8_t out[TE_RESP_HDR_LEN], uint32_t status, uint64_t length, uint32_t crc);
int te_decode_resp(const uint8_t in[TE_RESP_HDR_LEN], te_resp_hdr *h);
void te_encode_info(uint8_t out[TE_INFO_LEN], const te_info *info);
void te_decode_info(const uint8_t in[TE_INFO_LEN], te_info *info);
void te_encode_qp(uint8_t out[TE_QP_INFO_LEN], const te_qp_info *q);
void te_decode_qp(const uint8_t in[TE_QP_INFO_LEN], te_qp_info *q);

/* deadline: absolute te_now() seconds, 0 = wait forever; stop_fd readable aborts (-1 = none). */
int te_wait_fd(int fd, short events, double deadline, int stop_fd, te_err *e);
int te_recv_all(int fd, void *buf, size_t len, double deadline, int stop_fd, te_err *e);
/* te_recv_all that also folds what it received into *crc (CRC32C, continued), a piece at a time
 * right after it lands, so the bytes are checksummed while still in cache. */
int te_recv_all_crc(int fd, void *buf, size_t len, double deadline, int stop_fd, te_err *e,
                    uint32_t *crc);
int te_send_all(int fd, const struct iovec *iov, int iovcnt, double deadline, int stop_fd,
                te_err *e);
int te_handshake_server(int fd, const uint8_t *secret, size_t secret_len, double deadline,
                        int stop_fd, te_err *e);
int te_handshake_client(int fd, const uint8_t *secret, size_t secret_len, double deadline,
                        int stop_fd, te_err *e);
void te_tune_socket(int fd);

/* ---- engine state ----------------------------------------------------------------------- */
typedef struct te_region {
    struct te_region *next;
    char name[TE_MAX_NAME + 1];
    uint8_t *addr;
    size_t len;
    int shm_fd; /* -1: plain memory, served over TCP only */
    uint64_t dev, ino;
    int refs;      /* in-flight users, guarded by regions_mu */
    int removed;   /* unlinked from the list, waiting for refs to drain */
    void *owner;   /* opaque owner handle for the binding layer (a Py_buffer) */
    void *mr;      /* struct ibv_mr * when registered with the RDMA device, else NULL */
    uint32_t lkey, rkey;
} te_region;

struct te_rdma;      /* the opened device (te_rdma.c) */
struct te_rdma_conn; /* one connected RC queue pair (te_rdma.c) */

typedef struct te_peer {
    struct te_peer *next;
    char label[300]; /* "host:port" as the user wrote it */
    struct sockaddr_storage addr;
    socklen_t addrlen;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int idle[TE_MAX_POOL];
    int n_idle, n_open, max_open;
    double failed_at; /* monotonic time of the last hard failure, 0 = healthy */
    char fail_reason[TE_MSG_LEN];
    /* RDMA queue pairs to this peer, pooled like the TCP connections (guarded by mu) */
    struct te_rdma_conn *rdma_idle[TE_MAX_POOL];
    int n_rdma_idle, n_rdma_open;
    double rdma_failed_at; /* last RDMA failure: older slices go straight to TCP */
} te_peer;

typedef struct te_segment {
    te_peer *peer;
    char name[TE_MAX_NAME + 1];
    uint64_t size;
    int transport;
    uint8_t *map; /* shm mapping of the peer's segment, NULL for TCP */
    size_t map_len;
    uint64_t rdma_addr; /* the peer's base address and rkey, for TE_TRANSPORT_RDMA */
    uint32_t rkey;
    char fallback[TE_MSG_LEN]; /* why a better transport was not used ("" if none was possible) */
} te_segment;

struct te_batch;

typedef struct te_request {
    int op;
    /* GET: the object's key (remote_off unused; len is its expected length); what came back */
    char key[TE_MAX_NAME + 1];
    int missing;         /* atomic: a slice found no such object */
    uint32_t stored_crc; /* the CRC32C the owner published with the object */
    uint8_t *local;
    te_segment *seg;
    uint64_t remote_off, len;
    te_region *local_region; /* ref held until the request completes */
    struct te_batch *batch;
    double submitted_at;
    uint64_t next_off;   /* dispatch cursor, guarded by queue_mu */
    uint64_t slice_len;  /* what it is cut into: slice i covers [i * slice_len, ...) */
    int slices_left;     /* atomic */
    /* READ with want_crc: each slice's worker computes the CRC32C of the bytes it landed, while
     * they are hot in cache, into slice_crcs[i] (crc itself when there is one slice); the last
     * slice to finish combines them in offset order into crc. */
    int want_crc;
    uint32_t crc;
    uint32_t *slice_crcs;
    int failed;          /* atomic: later slices skip once set */
    int state;           /* guarded by batch_mu */
    char msg[TE_MSG_LEN];/* first failure, guarded by batch_mu */
    struct te_request *qnext;
} te_request;

typedef struct te_batch {
    uint64_t id;
    size_t cap, n, pending;
    int freed; /* user called free_batch while requests were in flight */
    te_request *reqs;
} te_batch;

/* ---- published objects (te_keys.c) ------------------------------------------------------ */
typedef struct te_key te_key;

typedef struct {
    pthread_mutex_t mu;
    te_key **buckets;
    size_t n_buckets, n_live;
    te_key *retired; /* retired while being read */
    size_t n_retired;
    te_key **touched; /* read since the owner last took them (each holds its entry) */
    size_t n_touched, cap_touched;
    uint64_t *drained; /* tags of retired entries whose last reader let go */
    size_t n_drained, cap_drained;
} te_keys;

typedef struct {
    uint32_t hits;
    uint16_t klen;
    char key[TE_MAX_NAME + 1];
} te_touched;

typedef struct te_engine {
    /* config */
    uint8_t *secret;
    size_t secret_len;
    size_t slice_bytes;
    int conns_per_peer;
    double timeout_s;
    int verify_crc; /* per-slice CRC32C, checked by whoever receives the bytes */
    char boot_id[TE_BOOT_ID_LEN];
    struct te_rdma *rdma; /* NULL: no RDMA device opened */
    int rdma_required;    /* transport forced to RDMA: a region the NIC refuses is an error */
    int stop_fd;   /* eventfd, readable once the engine is closing */
    int notify_fd; /* eventfd, bumped whenever a batch completes */
    int closed;

    /* server */
    int listen_fd;
    char host[256];
    int port;
    pthread_t listener;
    int listener_started;
    pthread_mutex_t conns_mu;
    pthread_cond_t conns_cv;
    int n_conns;

    /* registered memory */
    pthread_mutex_t regions_mu;
    pthread_cond_t regions_cv;
    te_region *regions;

    te_keys keys;

    /* client side */
    pthread_mutex_t peers_mu;
    te_peer *peers;
    te_segment *segments[TE_MAX_SEGMENTS];
    int n_segments;

    /* batches */
    pthread_mutex_t batch_mu;
    pthread_cond_t batch_cv;
    te_batch **slots;
    size_t n_slots;
    uint32_t next_gen;

    /* workers */
    pthread_mutex_t queue_mu;
    pthread_cond_t queue_cv;
    te_request *q_head, *q_tail;
    int stopping;
    pthread_t *workers;
    int n_workers;
} te_engine;

/* te_server.c */
int te_server_start(te_engine *eng, const char *host, int port, te_err *e);
void te_server_stop(te_engine *eng);
int te_region_add(te_engine *eng, te_region *r, te_err *e);
te_region *te_region_unlink(te_engine *eng, const char *name); /* then te_region_drain */
void te_region_drain(te_engine *eng, te_region *r);
te_region *te_region_ref_name(te_engine *eng, const char *name);
te_region *te_region_ref_addr(te_engine *eng, const uint8_t *addr, uint64_t len);
void te_region_unref(te_engine *eng, te_region *r);

/* te_keys.c */
void te_keys_init(te_engine *eng);
void te_keys_free(te_engine *eng); /* no thread may be serving */
/* Make key readable by GET: len bytes at off of the registered segment; tag is the owner's. */
int te_keys_publish(te_engine *eng, const char *key, size_t klen, const char *segment,
                    uint64_t off, uint64_t len, uint32_t crc, uint64_t tag, te_err *e);
/* Stop serving key (the object tagged tag); 1: its bytes are free now, 0: a GET still sends
 * them, their tag comes back from te_keys_take_drained when it is done. */
int te_keys_retire(te_engine *eng, const char *key, size_t klen, uint64_t tag);
size_t te_keys_take_drained(te_engine *eng, uint64_t *out, size_t cap);
int te_keys_take_touched(te_engine *eng, te_touched **out, size_t *n);
size_t te_keys_count(te_engine *eng);
/* Serving side of GET: the entry held (and its region referenced) or NULL when not published;
 * count: this is a read of the object (its first slice), for the owner's LRU and hits. */
te_key *te_keys_acquire(te_engine *eng, const char *key, size_t klen, int count,
                        te_region **region, uint64_t *off, uint64_t *len, uint32_t *crc);
void te_keys_release(te_engine *eng, te_key *k, te_region *region);
/* The region is being unregistered: forget what was published in it. */
void te_keys_drop_region(te_engine *eng, te_region *r);

/* te_client.c */
/* The transport for a segment: mode is TE_MODE_*, the flags say what is possible. Returns
 * TE_TRANSPORT_* or -1 with e set (a forced transport that cannot be used). */
int te_pick_transport(int mode, int shm_ok, int rdma_local, int rdma_peer, te_err *e);
/* Returns a handle > 0, or -1 with e set. */
int te_open_segment(te_engine *eng, const char *host, int port, const char *name, int mode,
                    te_err *e);
te_segment *te_segment_get(te_engine *eng, int handle);
int te_run_slice(te_engine *eng, te_request *req, uint64_t off, uint64_t len, te_err *e);
/* n (<= TE_MAX_GROUP) whole requests to one segment, each no bigger than a slice: rcs[i] and
 * errs[i] receive each one's outcome, as te_run_slice would give it. */
void te_run_group(te_engine *eng, te_request **reqs, int n, int *rcs, te_err *errs);
void te_peers_close(te_engine *eng);

/* te_peer.c */
te_peer *te_get_peer(te_engine *eng, const char *host, int port, te_err *e);
/* A fresh authenticated TCP connection to p (not pooled), or a negative TE_IO_* code. */
int te_connect_peer(te_engine *eng, te_peer *p, double deadline, te_err *e);
/* A pooled connection to p: an idle one unless fresh, else a new one within the pool limit.
 * Gives up at once if p failed at or after not_before (0: never), so slices queued behind a
 * dead peer do not each wait out the timeout. Returns fd or a negative TE_IO_* code. */
int te_pool_acquire(te_engine *eng, te_peer *p, int fresh, double deadline, double not_before,
                    te_err *e);
void te_pool_release(te_peer *p, int fd, int healthy);
struct te_rdma_conn *te_rdma_pool_acquire(te_engine *eng, te_peer *p, const char *name,
                                          double deadline, te_err *e);
void te_rdma_pool_release(te_peer *p, struct te_rdma_conn *c, int healthy);
/* One request frame on an open connection; see te_client.c. */
int te_tcp_frame(te_engine *eng, int fd, const te_req_hdr *h, const char *name, uint8_t *data,
                 uint64_t data_len, te_resp_hdr *resp, double deadline, te_err *e);

/* te_rdma.c: every function fails cleanly when built without TE_HAVE_VERBS */
int te_rdma_built(void);
/* Device names into out (NUL-separated, at most cap bytes); count >= 0, or -1 with e set. */
int te_rdma_probe(char *out, size_t cap, te_err *e);
struct te_rdma *te_rdma_open(const char *device, int gid_index, te_err *e);
void te_rdma_close(struct te_rdma *r);
const char *te_rdma_name(const struct te_rdma *r);
int te_rdma_reg(struct te_rdma *r, te_region *reg, te_err *e);
void te_rdma_dereg(te_region *reg);
/* Server side of RDMA_CONNECT: a QP connected to the client's; destroyed with te_rdma_conn_free. */
struct te_rdma_conn *te_rdma_accept(struct te_rdma *r, const te_qp_info *remote,
                                    te_qp_info *local, te_err *e);
/* Client side: new QP, swap info over ctl_fd (kept by the conn and closed with it). */
struct te_rdma_conn *te_rdma_connect(te_engine *eng, int ctl_fd, const char *name,
                                     double deadline, te_err *e);
void te_rdma_conn_free(struct te_rdma_conn *c);
/* One signaled READ/WRITE of len bytes; waits for its completion until deadline. */
int te_rdma_post(struct te_rdma_conn *c, int op, uint8_t *local, uint32_t lkey,
                 uint64_t raddr, uint32_t rkey, uint64_t len, double deadline, int stop_fd,
                 te_err *e);

/* te_batch.c */
int te_workers_start(te_engine *eng, int n, te_err *e);
void te_workers_stop(te_engine *eng);
uint64_t te_batch_alloc(te_engine *eng, size_t n, te_err *e);
te_batch *te_batch_get(te_engine *eng, uint64_t id); /* batch_mu held by caller */
int te_batch_submit(te_engine *eng, uint64_t id, te_request *reqs, size_t n, te_err *e);
int te_batch_free(te_engine *eng, uint64_t id, te_err *e);
int te_batch_wait(te_engine *eng, uint64_t id, double timeout_s, te_err *e);
/* Free a batch and what its requests own (batch_mu held, or the engine closed). */
void te_batch_destroy(te_batch *b);
/* Whether the worker running a slice of r should checksum what it lands, and where it puts it. */
static inline int te_req_crc_wanted(const te_request *r)
{
    return r->want_crc && (r->op == TE_REQ_READ || r->op == TE_REQ_GET);
}
void te_req_put_crc(te_request *r, uint64_t off, uint32_t crc);

#endif
