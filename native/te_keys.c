/* Published objects: key -> (region, offset, length, CRC32C), so a peer can GET an object by its
 * key in one round trip instead of asking its owner for the offset first.
 *
 * The owner (the store's object table) publishes an object once its bytes are final and retires
 * it before it frees or reuses them. A GET being sent pins the bytes (sending > 0): retiring the
 * entry then unlinks it at once (no new reader finds it) but the owner must not reuse the bytes
 * until the last sender lets go; such entries wait on a "retired" list and their tags (the
 * owner's name for that one object) come back from te_keys_take_drained.
 * Reads are counted per key for the owner's LRU and hit metrics (te_keys_take_touched); being
 * on that list keeps the entry's memory, not its bytes, alive.
 * One mutex guards it all: every operation is a hash probe or a list splice.
 */
#include "te.h"

#include <stdlib.h>
#include <string.h>

struct te_key {
    struct te_key *next; /* hash chain, or the retired list */
    uint64_t hash;
    te_region *region;   /* no reference held: te_keys_drop_region runs before it goes */
    uint64_t off, len, tag;
    uint32_t crc;
    int sending;        /* GETs sending its bytes right now: they are pinned */
    int retired;        /* unlinked from the table */
    int pinned_retired; /* retired while sending: the owner waits for its tag */
    int listed;         /* on the touched list */
    uint32_t hits;      /* reads since the owner last took them */
    uint16_t klen;
    char key[];
};

static uint64_t hash_key(const char *key, size_t len)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < len; i++)
        h = (h ^ (uint8_t)key[i]) * 1099511628211ull;
    return h;
}

static te_key **slot_of(te_keys *t, const char *key, size_t len, uint64_t h)
{
    te_key **pp = &t->buckets[h & (t->n_buckets - 1)];
    while (*pp && !((*pp)->hash == h && (*pp)->klen == len && memcmp((*pp)->key, key, len) == 0))
        pp = &(*pp)->next;
    return pp;
}

static int grow(te_keys *t)
{
    size_t n = t->n_buckets ? t->n_buckets * 2 : 1024;
    te_key **nb = calloc(n, sizeof *nb);
    if (!nb)
        return -1;
    for (size_t i = 0; i < t->n_buckets; i++) {
        for (te_key *k = t->buckets[i], *next; k; k = next) {
            next = k->next;
            k->next = nb[k->hash & (n - 1)];
            nb[k->hash & (n - 1)] = k;
        }
    }
    free(t->buckets);
    t->buckets = nb;
    t->n_buckets = n;
    return 0;
}

static void note_touched(te_keys *t, te_key *k)
{
    k->hits++;
    if (k->listed)
        return; /* already listed since the owner last looked */
    if (t->n_touched == t->cap_touched) {
        size_t cap = t->cap_touched ? t->cap_touched * 2 : 256;
        te_key **nt = realloc(t->touched, cap * sizeof *nt);
        if (!nt)
            return; /* out of memory: these reads go uncounted, nothing else changes */
        t->touched = nt;
        t->cap_touched = cap;
    }
    t->touched[t->n_touched++] = k;
    k->listed = 1;
}

/* After a sender or the touched list let go of a retired entry: report its tag once its bytes
 * are free (if the owner waits for it), free the entry once nothing refers to it. */
static void settle(te_keys *t, te_key *k)
{
    if (!k->retired || k->sending > 0)
        return;
    if (k->pinned_retired) {
        k->pinned_retired = 0;
        if (t->n_drained < t->cap_drained)
            t->drained[t->n_drained++] = k->tag;
        te_key **pp = &t->retired;
        while (*pp && *pp != k)
            pp = &(*pp)->next;
        if (*pp)
            *pp = k->next;
        t->n_retired--;
    }
    if (!k->listed)
        free(k);
}

/* Take k out of the table; 1 when its bytes are free now. */
static int unlink_entry(te_keys *t, te_key **pp)
{
    te_key *k = *pp;
    *pp = k->next;
    t->n_live--;
    k->retired = 1;
    if (k->sending > 0) {
        k->pinned_retired = 1;
        k->next = t->retired;
        t->retired = k;
        t->n_retired++;
        return 0;
    }
    if (!k->listed)
        free(k);
    return 1;
}

int te_keys_publish(te_engine *eng, const char *key, size_t klen, const char *segment,
                    uint64_t off, uint64_t len, uint32_t crc, uint64_t tag, te_err *e)
{
    if (klen == 0 || klen > TE_MAX_NAME) {
        te_err_set(e, "a published key must be 1..%d bytes", TE_MAX_NAME);
        return -1;
    }
    te_region *r = te_region_ref_name(eng, segment);
    if (!r) {
        te_err_set(e, "no segment named '%s' is registered", segment);
        return -1;
    }
    size_t size = r->len;
    te_region_unref(eng, r);
    if (off > size || len > size - off || len == 0 || len > TE_MAX_PAYLOAD) {
        te_err_set(e, "object of %llu bytes at offset %llu does not fit segment '%s' (%zu bytes)",
                   (unsigned long long)len, (unsigned long long)off, segment, size);
        return -1;
    }
    te_keys *t = &eng->keys;
    uint64_t h = hash_key(key, klen);
    pthread_mutex_lock(&t->mu);
    if (t->n_live >= t->n_buckets && grow(t)) {
        pthread_mutex_unlock(&t->mu);
        te_err_set(e, "out of memory for the published keys");
        return -1;
    }
    te_key **pp = slot_of(t, key, klen, h);
    if (*pp) {
        pthread_mutex_unlock(&t->mu);
        te_err_set(e, "key '%.*s' is already published", (int)(klen > 64 ? 64 : klen), key);
        return -1;
    }
    te_key *k = calloc(1, sizeof *k + klen);
    if (!k) {
        pthread_mutex_unlock(&t->mu);
        te_err_set(e, "out of memory for the published keys");
        return -1;
    }
    *k = (te_key){.hash = h, .region = r, .off = off, .len = len, .tag = tag, .crc = crc,
                  .klen = (uint16_t)klen};
    memcpy(k->key, key, klen);
    *pp = k;
    t->n_live++;
    pthread_mutex_unlock(&t->mu);
    return 0;
}

int te_keys_retire(te_engine *eng, const char *key, size_t klen, uint64_t tag)
{
    te_keys *t = &eng->keys;
    int free_now = 1;
    pthread_mutex_lock(&t->mu);
    te_key **pp = t->n_buckets ? slot_of(t, key, klen, hash_key(key, klen)) : NULL;
    if (pp && *pp && (*pp)->tag == tag) {
        free_now = unlink_entry(t, pp);
    } else {
        /* retired earlier (the object left the key space while leased) and still being read */
        for (te_key *k = t->retired; k; k = k->next)
            if (k->tag == tag && k->klen == klen && memcmp(k->key, key, klen) == 0)
                free_now = 0;
    }
    if (!free_now && t->cap_drained < t->n_retired + t->n_drained) {
        /* room for every retired tag, so none is ever dropped on its way back */
        size_t cap = (t->n_retired + t->n_drained) * 2;
        uint64_t *nd = realloc(t->drained, cap * sizeof *nd);
        if (nd) {
            t->drained = nd;
            t->cap_drained = cap;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return free_now;
}

te_key *te_keys_acquire(te_engine *eng, const char *key, size_t klen, int count,
                        te_region **region, uint64_t *off, uint64_t *len, uint32_t *crc)
{
    te_keys *t = &eng->keys;
    pthread_mutex_lock(&t->mu);
    te_key **pp = t->n_buckets ? slot_of(t, key, klen, hash_key(key, klen)) : NULL;
    te_key *k = pp ? *pp : NULL;
    if (k) {
        te_region *r = k->region;
        pthread_mutex_lock(&eng->regions_mu);
        if (r->removed) {
            k = NULL; /* being unregistered: te_keys_drop_region is on its way */
        } else {
            r->refs++;
        }
        pthread_mutex_unlock(&eng->regions_mu);
    }
    if (k) {
        k->sending++;
        if (count)
            note_touched(t, k);
        *region = k->region;
        *off = k->off;
        *len = k->len;
        *crc = k->crc;
    }
    pthread_mutex_unlock(&t->mu);
    return k;
}

void te_keys_release(te_engine *eng, te_key *k, te_region *region)
{
    te_keys *t = &eng->keys;
    pthread_mutex_lock(&t->mu);
    k->sending--;
    settle(t, k);
    pthread_mutex_unlock(&t->mu);
    te_region_unref(eng, region);
}

size_t te_keys_take_drained(te_engine *eng, uint64_t *out, size_t cap)
{
    te_keys *t = &eng->keys;
    pthread_mutex_lock(&t->mu);
    size_t n = t->n_drained < cap ? t->n_drained : cap;
    memcpy(out, t->drained, n * sizeof *out);
    memmove(t->drained, t->drained + n, (t->n_drained - n) * sizeof *out);
    t->n_drained -= n;
    pthread_mutex_unlock(&t->mu);
    return n;
}

int te_keys_take_touched(te_engine *eng, te_touched **out, size_t *n_out)
{
    te_keys *t = &eng->keys;
    pthread_mutex_lock(&t->mu);
    size_t n = t->n_touched;
    te_touched *res = malloc((n ? n : 1) * sizeof *res);
    if (!res) {
        pthread_mutex_unlock(&t->mu);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        te_key *k = t->touched[i];
        res[i].hits = k->hits;
        res[i].klen = k->klen;
        memcpy(res[i].key, k->key, k->klen);
        k->hits = 0;
        k->listed = 0;
        settle(t, k); /* the list held it: a retired entry may go now */
    }
    t->n_touched = 0;
    pthread_mutex_unlock(&t->mu);
    *out = res;
    *n_out = n;
    return 0;
}

size_t te_keys_count(te_engine *eng)
{
    pthread_mutex_lock(&eng->keys.mu);
    size_t n = eng->keys.n_live;
    pthread_mutex_unlock(&eng->keys.mu);
    return n;
}

void te_keys_drop_region(te_engine *eng, te_region *r)
{
    te_keys *t = &eng->keys;
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->n_buckets; i++) {
        te_key **pp = &t->buckets[i];
        while (*pp) {
            te_key *k = *pp;
            if (k->region != r) {
                pp = &k->next;
                continue;
            }
            /* senders hold the region (its drain waits for them); the entry waits for them */
            unlink_entry(t, pp);
        }
    }
    pthread_mutex_unlock(&t->mu);
}

void te_keys_init(te_engine *eng)
{
    pthread_mutex_init(&eng->keys.mu, NULL);
}

void te_keys_free(te_engine *eng)
{
    te_keys *t = &eng->keys;
    for (size_t i = 0; i < t->n_buckets; i++) {
        for (te_key *k = t->buckets[i], *next; k; k = next) {
            next = k->next;
            free(k);
        }
    }
    for (te_key *k = t->retired, *next; k; k = next) {
        next = k->next;
        if (!k->listed)
            free(k);
    }
    for (size_t i = 0; i < t->n_touched; i++) /* listed: the list is their last holder */
        if (t->touched[i]->retired)
            free(t->touched[i]);
    free(t->buckets);
    free(t->touched);
    free(t->drained);
    pthread_mutex_destroy(&t->mu);
    memset(t, 0, sizeof *t);
}
