/* Batched block-file I/O for tiercache's file tier (host code, no CUDA).
 *
 * A pool of POSIX threads runs batches of per-file operations outside Python (no GIL, no
 * Python object per syscall): one call reads, writes or renames the files of a whole request.
 *
 *   read    openat(O_NOFOLLOW | O_NONBLOCK [| O_DIRECT]), fstat (regular files only; the size
 *           goes to file_len[i]), preadv(header page, data) until full or end of file, close
 *   write   openat(temporary name, O_CREAT | O_EXCL | O_NOFOLLOW [| O_DIRECT], 0600),
 *           pwritev(header page, data), ftruncate to the padded length, [fdatasync], close,
 *           [publish: rename over the final name]; on any error the temporary file is unlinked
 *   rename  publish (renameat(temporary, final)); on error the temporary file is unlinked
 *   unlink  unlinkat(name) (purge: a symlink is removed itself, never followed; a directory is
 *           refused, EISDIR); with TC_RECYCLE (eviction of a file whose descriptor the tier
 *           holds): where the name is still the regular file of inode kept_ino[i], rename it to
 *           its final name (the free file's temporary name) and set got[i] = 1; else, or where
 *           that rename fails, unlink the name as above (got[i] = 0); with TC_DROP_FD, close
 *           fd[i] (the deleted file's descriptor, the caller's until then) after the unlink
 *
 * Open descriptors (the file tier's cache of them, tiercache/files/openfiles.py): where the
 * batch has an fd array, an operation whose fd[i] >= 0 uses that descriptor instead of opening
 * its name (no open, fstat or close: a read is one preadv; a write goes into an existing, fully
 * sized file, a recycled one, with no ftruncate); the caller keeps owning it. With TC_KEEP a
 * file the operation opens itself stays open when it succeeds (read: O_RDWR where permitted,
 * else O_RDONLY; write: O_RDWR) and its descriptor is returned in fd[i]; on failure it is
 * closed and fd[i] is -1 (TC_KEEP_DIRECT: a kept descriptor is switched to O_DIRECT, for the
 * aligned operations that will use it, when its own operation could not use it). With TC_EXCHANGE, publishing swaps the temporary and the final name
 * (renameat2 RENAME_EXCHANGE) so the final name's previous file survives under the temporary
 * name, for reuse, and got[i] is its inode number (0 where the final name did not exist or the
 * filesystem cannot exchange, or the name is not a regular file: then a plain rename
 * replaced it).
 *
 * Directories: an operation's names are relative to dirs[i] where the batch has a dirs array
 * (the block's subdirectory of the root: its temporary and final names are both there), else to
 * dir_fd.
 *
 * Pieces: where the batch has seg_first, operation i's data is not data[i] but the pieces
 * seg_ptr[s] of seg_len[s] bytes for s in seg_first[i] .. seg_first[i + 1] - 1, in that order
 * (data_len[i] their sum): one block's bytes scattered over memory the caller owns (a host
 * KV pool's pages, which keeps K and V, or each layer, apart), read into and written from in
 * place by vectored I/O, checksummed as if contiguous (XXH3-64's streaming form, given by
 * tc_set_hash_stream). An operation with no pieces (seg_first[i + 1] == seg_first[i]) uses
 * data[i].
 *
 * Spans: where the batch has span_off, each read reads its header page and
 * then data_len[i] bytes of its data from data byte span_off[i] on (one layer group of a block
 * whose file holds every layer), on the threads backend; TC_CHECK | TC_SUMONLY checks such a
 * read's header and the file's size (span_off[i] + data_len[i] within nbytes[i]) and gives the
 * whole data's checksum for the caller to compare once every span of the block is in.
 *
 * Checksums: with TC_HASH a read that got every byte stores XXH3-64 of its data in hash[i]; a
 * TC_HASHONLY batch only computes hash[i] of each operation's data (before a write batch, whose
 * headers carry it). The XXH3-64 function is the xxhash library's, given by tc_set_hash (the
 * Python package's extension exports it); it runs outside the GIL: a read's on the thread that
 * completes it, a TC_HASHONLY batch on the calling thread (a chunk's files are few, and chunks
 * run on threads of their own: a hand-off to the pool measured slower for 64 KiB blocks).
 *
 * Checks (the file tier's reads, and verify and purge of a root, tiercache/rootops/check.py):
 * with TC_CHECK a read that got every byte it asked for compares its header page with the
 * usual header of its name's key and the pool text given in expect[i], and (where data was
 * read) the file's size (unless read through a given descriptor) and the data's XXH3-64 with
 * the header's, and sets verdict[i] to 1 where all match; Python judges only the rest
 * (per-file Python measured 8 us, more than the syscalls, at a million 8 KiB files). With
 * TC_SUMONLY as well, the data is not hashed: hash[i] gets the header's data checksum and the
 * verdict covers the header and the size, and the caller compares the checksum itself (the
 * vLLM connector, on the GPU once the data is there: tiercache/files/devicehash.py).
 *
 * Two backends run the batches:
 *
 *   io_uring  the calling thread drives a ring of its own (created on first use, closed when
 *             the thread exits): every file's open, vectored read or write and flush are
 *             queued as io_uring requests, up to TC_RING_DEPTH files at once, so the files of
 *             a batch are in flight together without a thread switch per file; so are a
 *             write's publication (IORING_OP_RENAMEAT) and the operations of rename and unlink
 *             batches (IORING_OP_UNLINKAT), where the kernel has them (5.11+, probed per ring;
 *             tc_set_uring_meta(0) turns them off), which the kernel runs in parallel on its
 *             io-wq workers. An exchange (TC_EXCHANGE) or a recycle (TC_RECYCLE) looks at the
 *             file first: its write publishes by direct syscalls, its batch runs on the
 *             threads. The fstat, ftruncate and close between them are direct syscalls. Raw
 *             io_uring system calls (<linux/io_uring.h>), no liburing.
 *   threads   the pool's threads each run whole files with blocking syscalls (where io_uring
 *             is missing, refused by a seccomp filter, or not asked for).
 *
 * The caller thread works on its own batch too, so a pool of 0 threads still completes.
 * Errors are reported per operation: 0, an errno value, or TC_NOTREG (a symlink, directory,
 * FIFO or other non-regular file under the name).
 *
 * Loaded with ctypes by tiercache/files/nativeio.py (compiled once per machine by
 * kernels/hostlib.py).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#define TC_HEADER_BYTES 4096
#define TC_NOTREG (-1)

enum { TC_READ = 0, TC_WRITE = 1, TC_RENAME = 2, TC_HASHONLY = 3, TC_UNLINK = 4 };
enum { TC_DIRECT = 1, TC_FDATASYNC = 2, TC_PUBLISH = 4, TC_KEEP = 8, TC_EXCHANGE = 16, TC_KEEP_DIRECT = 32, TC_HASH = 64,
       TC_CHECK = 128, TC_MAKEHEAD = 256, TC_RECYCLE = 512,
       TC_DROP_FD = 1024, TC_SUMONLY = 2048 };

typedef uint64_t (*tc_hash_fn)(const void *, size_t);
static tc_hash_fn xxh3; /* XXH3_64bits of the xxhash library (tc_set_hash) */

void tc_set_hash(void *fn)
{
    xxh3 = (tc_hash_fn)fn;
}

/* XXH3-64's streaming functions of the same library (tc_set_hash_stream): a block in pieces */
typedef void *(*tc_hs_create)(void);
typedef int (*tc_hs_reset)(void *);
typedef int (*tc_hs_update)(void *, const void *, size_t);
typedef uint64_t (*tc_hs_digest)(const void *);
typedef int (*tc_hs_free)(void *);
static tc_hs_create hs_create;
static tc_hs_reset hs_reset;
static tc_hs_update hs_update;
static tc_hs_digest hs_digest;
static tc_hs_free hs_free;

/* XXH3_createState, XXH3_64bits_reset, XXH3_64bits_update, XXH3_64bits_digest, XXH3_freeState */
void tc_set_hash_stream(void *create, void *reset, void *update, void *digest, void *release)
{
    hs_create = (tc_hs_create)create;
    hs_reset = (tc_hs_reset)reset;
    hs_update = (tc_hs_update)update;
    hs_digest = (tc_hs_digest)digest;
    hs_free = (tc_hs_free)release;
}

/* One batch, struct of arrays (entry i of every array belongs to operation i). */
typedef struct {
    int32_t kind;            /* TC_READ | TC_WRITE | TC_RENAME | TC_HASHONLY | TC_UNLINK */
    int32_t dir_fd;          /* the root's directory descriptor */
    const char *names;       /* NUL-terminated names, back to back */
    const int64_t *name_off; /* read: the file; write and rename: the temporary file */
    const int64_t *final_off;/* write (with TC_PUBLISH) and rename: the final name; may be NULL */
    const int32_t *flags;    /* TC_DIRECT | TC_FDATASYNC | TC_PUBLISH */
    void *const *head;       /* header page (TC_HEADER_BYTES, page-aligned) */
    void *const *data;       /* the block's bytes */
    const int64_t *data_len; /* bytes of data */
    int64_t *file_len;       /* write: the file's padded length; read: out: its size (fstat; 0 on a given fd) */
    int32_t *err;            /* out: 0, errno, or TC_NOTREG */
    int64_t *got;            /* out: read: bytes read, header included; publish: see TC_EXCHANGE */
    int32_t *fd;             /* in/out: open descriptors (see above); may be NULL */
    const int32_t *dirs;     /* per operation: the directory of its names; may be NULL (dir_fd) */
    uint64_t *hash;          /* out: TC_HASH reads and TC_HASHONLY: XXH3-64 of the data; may be NULL */
    /* TC_CHECK reads (verify, purge; may be NULL otherwise): the metadata text expected after
     * the key (`"pool":...,"checksum":"`, the pool's), the block's bytes, and out: 1 where
     * the file passed the check, 0 where Python is to judge it */
    const char *const *expect;
    const int32_t *expect_len;
    const int64_t *nbytes;
    int32_t *verdict;
    /* out, where not NULL: what a descriptor kept by TC_KEEP is (the file tier's record of it,
     * made here on the pool's threads instead of by an fstat and an fcntl per file in Python,
     * each of which gave up and took back the GIL): its inode number, its size in bytes, and
     * TC_KEPT_DIRECT | TC_KEPT_RDWR of its open flags; a kept descriptor that is not a regular
     * file is closed (fd[i] = -1); in, for TC_RECYCLE unlinks: the held descriptor's inode */
    int64_t *kept_ino;
    int64_t *kept_size;
    int32_t *kept_flags;
    /* pieces (see above; seg_first may be NULL: no operation has pieces) */
    const int64_t *seg_first; /* [n + 1] */
    void *const *seg_ptr;
    const int64_t *seg_len;
    /* span reads (may be NULL: whole blocks): operation i reads its header page and then
     * data_len[i] bytes of its data from byte span_off[i] of the data on */
    const int64_t *span_off;
} tc_batch;

/* iovecs one vectored call of an operation passes (its header page and pieces; an operation
 * of more pieces takes several calls) */
#define TC_MAX_IOV 64

static inline int64_t op_pieces(const tc_batch *b, int i)
{
    return b->seg_first ? b->seg_first[i + 1] - b->seg_first[i] : 0;
}

/* the iovecs (at most max) of operation i's bytes from byte off of its file on: the rest of
 * the header page, then its data (data[i], or its pieces) */
static int op_iov(const tc_batch *b, int i, int64_t off, struct iovec *v, int max)
{
    int k = 0;
    if (off < TC_HEADER_BYTES) {
        v[k++] = (struct iovec){(char *)b->head[i] + off, (size_t)(TC_HEADER_BYTES - off)};
        off = 0;
    } else {
        off -= TC_HEADER_BYTES;
    }
    if (!op_pieces(b, i)) {
        if (b->data_len[i] > off)
            v[k++] = (struct iovec){(char *)b->data[i] + off, (size_t)(b->data_len[i] - off)};
        return k;
    }
    for (int64_t s = b->seg_first[i]; s < b->seg_first[i + 1] && k < max; s++) {
        if (off >= b->seg_len[s]) {
            off -= b->seg_len[s];
            continue;
        }
        v[k++] = (struct iovec){(char *)b->seg_ptr[s] + off, (size_t)(b->seg_len[s] - off)};
        off = 0;
    }
    return k;
}

/* XXH3-64 of the first n bytes of operation i's data (its pieces read as one run) into *h;
 * returns 0, or ENOMEM where the streaming state could not be made (ENOSYS: pieces without
 * streaming functions; the caller gives pieces only where they are set) */
static int op_hash(const tc_batch *b, int i, int64_t n, uint64_t *h)
{
    int64_t k = op_pieces(b, i);
    if (!k) {
        *h = xxh3(b->data[i], (size_t)n);
        return 0;
    }
    int64_t s = b->seg_first[i];
    if (k == 1 || n <= b->seg_len[s]) {
        *h = xxh3(b->seg_ptr[s], (size_t)n);
        return 0;
    }
    if (!hs_create)
        return ENOSYS;
    void *st = hs_create();
    if (!st)
        return ENOMEM;
    int e = hs_reset(st) == 0 ? 0 : ENOMEM;
    for (; !e && s < b->seg_first[i + 1] && n > 0; s++) {
        int64_t m = b->seg_len[s] < n ? b->seg_len[s] : n;
        e = hs_update(st, b->seg_ptr[s], (size_t)m) == 0 ? 0 : ENOMEM;
        n -= m;
    }
    if (!e)
        *h = hs_digest(st);
    hs_free(st);
    return e;
}

enum { TC_KEPT_DIRECT = 1, TC_KEPT_RDWR = 2 };

/* the directory of operation i's names */
static inline int opdir(const tc_batch *b, int i)
{
    return b->dirs ? b->dirs[i] : b->dir_fd;
}

/* 1 where operation i's header page is the header tiercache writes for the key in the
 * operation's name (`block_<key>_pool_...`) with expect[i] after the key (the usual header,
 * no "extra": the bytes tiercache/files/blockfile.py's encode_header writes, byte for byte),
 * its metadata's XXH3-64 matching; *sum is then the data checksum it gives. Any other header
 * (0) is left to Python, which parses it and names what is wrong. */
static int usual_header(const tc_batch *b, int i, uint64_t *sum)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    const unsigned char *h = b->head[i];
    const char *name = b->names + b->name_off[i];
    if (!xxh3 || strncmp(name, "block_", 6) != 0)
        return 0;
    const char *key = name + 6, *key_end = strstr(key, "_pool_");
    if (!key_end)
        return 0;
    size_t klen = (size_t)(key_end - key), tlen = (size_t)b->expect_len[i];
    uint32_t version, mlen;
    uint64_t mhash;
    memcpy(&version, h + 8, 4);
    memcpy(&mlen, h + 12, 4);
    memcpy(&mhash, h + 16, 8);
    /* {"key":"<key>",<expect>0123456789abcdef"} */
    if (memcmp(h, "TCBLOCK", 8) != 0 || version != 1 || mlen != 8 + klen + 2 + tlen + 16 + 2
        || 24 + (size_t)mlen > TC_HEADER_BYTES)
        return 0;
    const char *m = (const char *)h + 24, *digits = m + 10 + klen + tlen;
    if (memcmp(m, "{\"key\":\"", 8) != 0 || memcmp(m + 8, key, klen) != 0 || memcmp(m + 8 + klen, "\",", 2) != 0
        || memcmp(m + 10 + klen, b->expect[i], tlen) != 0 || memcmp(digits + 16, "\"}", 2) != 0)
        return 0;
    uint64_t v = 0;
    for (int q = 0; q < 16; q++) {
        int c = digits[q], x = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (x < 0)
            return 0;
        v = v << 4 | (uint64_t)x;
    }
    if (xxh3(m, mlen) != mhash)
        return 0;
    *sum = v;
    return 1;
#else
    (void)b;
    (void)i;
    (void)sum;
    return 0;
#endif
}

/* a read of every byte (header page and data_len[i] bytes): its data's checksum where asked
 * for (TC_HASH); with TC_CHECK, its verdict: the usual header of its name's key (above) and,
 * where data was read, a file of exactly the header page and nbytes[i] padded to a page, all of
 * it read, whose first nbytes[i] bytes have the header's XXH3-64 */
/* a batch whose data is at least this many bytes has its checksums computed by the pool's
 * threads in parallel (TC_HASHONLY, and io_uring reads' TC_HASH after the ring's I/O) instead
 * of one after the other on the calling thread: XXH3-64 runs at 15-20 GB/s per core, so a
 * 32-block chunk of 2 MiB blocks took 3-4 ms of one thread, which then had no other I/O in
 * flight (docs/performance.md, "Several devices: root arrays"); below it a hand-off costs more */
#define TC_POOL_HASH_BYTES (2 << 20)

/* io_uring reads on this thread whose TC_HASH is left to a parallel pass (tc_run): marks */
static __thread unsigned char *tl_defer_hash;

static int given_fd(const tc_batch *b, int i);

/* TC_HASH and TC_CHECK of a read that got every byte it asked for */
static void read_checks(const tc_batch *b, int i)
{
    uint64_t hash = 0;
    int hashed = 0;
    if ((b->flags[i] & TC_HASH) && b->hash && xxh3) {
        /* unhashed (no memory for a streaming state): hash[i] stays 0, no verdict; Python's
         * check then finds a mismatch, and the row store's own re-read keeps the file */
        hashed = op_hash(b, i, b->data_len[i], &hash) == 0;
        b->hash[i] = hash;
    }
    if ((b->flags[i] & TC_CHECK) && b->verdict) {
        uint64_t sum;
        int64_t n = b->nbytes[i], padded = (n + TC_HEADER_BYTES - 1) / TC_HEADER_BYTES * TC_HEADER_BYTES;
        int ok = usual_header(b, i, &sum);
        if (b->flags[i] & TC_SUMONLY) {
            /* the data's checksum is the caller's to compare (on the GPU, once the data is
             * there): hash[i] is the header's, the verdict the header's and the size's (a
             * span read: the span lies inside the data, whose checksum covers all of it) */
            if (b->hash)
                b->hash[i] = ok ? sum : 0;
            b->verdict[i] = ok && b->hash
                            && (b->span_off ? b->span_off[i] >= 0 && b->span_off[i] + b->data_len[i] <= n
                                            : b->data_len[i] == padded)
                            && (b->file_len[i] == TC_HEADER_BYTES + padded || given_fd(b, i) >= 0);
            return;
        }
        if (b->span_off) { /* a span's data cannot be checked against the whole data's checksum */
            b->verdict[i] = 0;
            return;
        }
        /* the file's size: from its open (a given descriptor's file was sized when it was
         * kept; a shorter one fails the read of every byte before this) */
        if (ok && b->data_len[i] > 0) {
            uint64_t got = hash;
            ok = b->data_len[i] == padded && (b->file_len[i] == TC_HEADER_BYTES + padded || given_fd(b, i) >= 0)
                 && ((hashed && n == b->data_len[i]) || op_hash(b, i, n, &got) == 0) && got == sum;
        }
        b->verdict[i] = ok;
    }
}

/* TC_MAKEHEAD writes: the usual header of the key in the final name (`block_<key>_pool_...`),
 * with expect[i] after the key and the data's XXH3-64, written into head[i] before the write:
 * the bytes tiercache/files/blockfile.py's encode_header makes for a block without "extra",
 * byte for byte (magic, version, metadata length and XXH3-64, the metadata, zeros to the
 * page's end). The data's checksum also goes to hash[i]; with TC_SUMONLY it is taken from hash[i]
 * as the caller gives it, and the data is not hashed (the vLLM connector's stores, whose blocks
 * were hashed on the GPU: a wrong checksum there fails every later read of the file, never
 * passes one). Returns the error (EINVAL: a name
 * or header that does not fit; ENOMEM / ENOSYS: pieces whose checksum could not be made). */
static int make_head(const tc_batch *b, int i)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (!xxh3 || !b->final_off || !b->expect)
        return ENOSYS;
    const char *name = b->names + b->final_off[i];
    if (strncmp(name, "block_", 6) != 0)
        return EINVAL;
    const char *key = name + 6, *key_end = strstr(key, "_pool_");
    if (!key_end)
        return EINVAL;
    size_t klen = (size_t)(key_end - key), tlen = (size_t)b->expect_len[i];
    size_t mlen = 8 + klen + 2 + tlen + 16 + 2;
    if (24 + mlen > TC_HEADER_BYTES)
        return EINVAL;
    uint64_t sum = 0;
    if ((b->flags[i] & TC_SUMONLY) && b->hash) {
        sum = b->hash[i]; /* the caller's checksum of the data (made on the GPU, where it was) */
    } else {
        int e = op_hash(b, i, b->data_len[i], &sum);
        if (e)
            return e; /* no checksum, no header: the write fails */
        if (b->hash)
            b->hash[i] = sum;
    }
    unsigned char *h = b->head[i];
    char *m = (char *)h + 24, *d = m + 10 + klen + tlen;
    memcpy(m, "{\"key\":\"", 8);
    memcpy(m + 8, key, klen);
    memcpy(m + 8 + klen, "\",", 2);
    memcpy(m + 10 + klen, b->expect[i], tlen);
    static const char hex[] = "0123456789abcdef";
    for (int q = 15; q >= 0; q--, sum >>= 4)
        d[q] = hex[sum & 15];
    memcpy(d + 16, "\"}", 2);
    uint32_t version = 1, len32 = (uint32_t)mlen;
    uint64_t mhash = xxh3(m, mlen);
    memcpy(h, "TCBLOCK", 8); /* with its NUL: 8 bytes */
    memcpy(h + 8, &version, 4);
    memcpy(h + 12, &len32, 4);
    memcpy(h + 16, &mhash, 8);
    memset(h + 24 + mlen, 0, TC_HEADER_BYTES - 24 - mlen);
    return 0;
#else
    (void)b;
    (void)i;
    return ENOSYS;
#endif
}

static inline void read_done(const tc_batch *b, int i)
{
    if (tl_defer_hash && (b->flags[i] & (TC_HASH | TC_CHECK)) && !(b->flags[i] & TC_SUMONLY))
        tl_defer_hash[i] = 1; /* the checks run in a parallel pass (tc_run) */
    else
        read_checks(b, i);
}

typedef struct tc_job {
    const tc_batch *b;
    int n;
    int pass;                    /* 0: the batch's own kind; TC_PASS_HASH: checksums only */
    const unsigned char *marks;  /* TC_PASS_HASH: which operations (NULL: all) */
    atomic_int next;
    atomic_int left;
    int done;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct tc_job *link;
} tc_job;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    tc_job *head, *tail;
    int stop;
    int nthreads;
    int uring; /* reads and writes on the caller's io_uring ring */
    pthread_t *threads;
} tc_pool;


/* after a block name's key text (text[0 .. tlen)): "_pool_<pool>.bin" and its NUL; returns the
 * key's subdirectory number (XXH3-64 of the text modulo fanout) */
static int32_t name_tail(char *text, size_t tlen, const char *pool, size_t plen, int fanout)
{
    char *h = text + tlen;
    memcpy(h, "_pool_", 6);
    h += 6;
    memcpy(h, pool, plen);
    h += plen;
    memcpy(h, ".bin", 5); /* with its NUL */
    return (int32_t)(xxh3(text, tlen) % (uint64_t)fanout);
}

/* The file names and subdirectories of n bytes keys in one pool, made here instead of per key
 * in Python (tiercache/files/blockfile.py spells them, and stays the reference: block_location):
 * key i is keys[key_off[i] .. key_off[i + 1]) (1..64 bytes); its name
 * "block_x<lower-case hex>_pool_<pool>.bin" and a NUL go to out at out_off[i], back to back,
 * and sub[i] is XXH3-64 of the key's text ("x<hex>") modulo fanout (its subdirectory's number).
 * Returns the bytes written, or -1 when out_cap is too small, a key is empty or longer than 64
 * bytes, or no XXH3-64 was given (tc_set_hash). */
int64_t tc_block_names(const uint8_t *keys, const int64_t *key_off, int n, const char *pool, int fanout,
                       char *out, int64_t out_cap, int64_t *out_off, int32_t *sub)
{
    static const char hex[] = "0123456789abcdef";
    size_t plen = strlen(pool);
    int64_t at = 0;
    if (!xxh3 || fanout < 1)
        return -1;
    for (int i = 0; i < n; i++) {
        int64_t klen = key_off[i + 1] - key_off[i];
        if (klen < 1 || klen > 64)
            return -1;
        int64_t need = 6 + 1 + 2 * klen + 6 + (int64_t)plen + 4 + 1;
        if (at + need > out_cap)
            return -1;
        char *p = out + at;
        out_off[i] = at;
        memcpy(p, "block_x", 7);
        char *text = p + 6; /* "x<hex>" */
        char *h = p + 7;
        const uint8_t *k = keys + key_off[i];
        for (int64_t j = 0; j < klen; j++) {
            *h++ = hex[k[j] >> 4];
            *h++ = hex[k[j] & 15];
        }
        sub[i] = name_tail(text, (size_t)(1 + 2 * klen), pool, plen, fanout);
        at += need;
    }
    return at;
}

/* tc_block_names for n int keys (keys[i] in [0, 2**63)): "block_<decimal>_pool_<pool>.bin",
 * sub[i] being XXH3-64 of the decimal text modulo fanout. Returns the bytes written, or -1
 * (out_cap too small, a negative key, or no XXH3-64). */
int64_t tc_int_block_names(const int64_t *keys, int n, const char *pool, int fanout, char *out, int64_t out_cap,
                           int64_t *out_off, int32_t *sub)
{
    size_t plen = strlen(pool);
    int64_t at = 0;
    if (!xxh3 || fanout < 1)
        return -1;
    for (int i = 0; i < n; i++) {
        if (keys[i] < 0)
            return -1;
        char digits[20];
        int nd = 0;
        uint64_t v = (uint64_t)keys[i];
        do {
            digits[nd++] = (char)('0' + v % 10);
            v /= 10;
        } while (v);
        int64_t need = 6 + nd + 6 + (int64_t)plen + 4 + 1;
        if (at + need > out_cap)
            return -1;
        char *p = out + at, *text = p + 6;
        out_off[i] = at;
        memcpy(p, "block_", 6);
        for (int q = 0; q < nd; q++)
            text[q] = digits[nd - 1 - q];
        sub[i] = name_tail(text, (size_t)nd, pool, plen, fanout);
        at += need;
    }
    return at;
}

/* fault injection for tests: up to TC_FAULTS rules; an operation of `kind` whose name
 * contains `match` fails with `err` after its file was opened (so the cleanup paths run),
 * `times` times (-1: until cleared) */
#define TC_FAULTS 16
static struct {
    int kind, err, times;
    char match[128];
} faults[TC_FAULTS];
static int nfaults;
static pthread_mutex_t fault_mu = PTHREAD_MUTEX_INITIALIZER;

void tc_set_fault(int kind, const char *match, int err, int times)
{
    pthread_mutex_lock(&fault_mu);
    if (kind < 0) {
        nfaults = 0;
    } else if (nfaults < TC_FAULTS) {
        faults[nfaults].kind = kind;
        faults[nfaults].err = err;
        faults[nfaults].times = times;
        snprintf(faults[nfaults].match, sizeof faults[nfaults].match, "%s", match);
        nfaults++;
    }
    pthread_mutex_unlock(&fault_mu);
}

static int injected(int kind, const char *name);

/* a fault for operation i: by its name, or by its final name (a reused free file's name is
 * another block's) */
static int op_injected(const tc_batch *b, int i)
{
    int e = injected(b->kind, b->names + b->name_off[i]);
    if (!e && b->final_off && b->kind != TC_READ)
        e = injected(b->kind, b->names + b->final_off[i]);
    return e;
}

static int injected(int kind, const char *name)
{
    int e = 0;
    if (__atomic_load_n(&nfaults, __ATOMIC_RELAXED) == 0)
        return 0;
    pthread_mutex_lock(&fault_mu);
    for (int k = 0; k < nfaults && !e; k++)
        if (faults[k].kind == kind && faults[k].times != 0 && strstr(name, faults[k].match)) {
            e = faults[k].err;
            if (faults[k].times > 0)
                faults[k].times--;
        }
    pthread_mutex_unlock(&fault_mu);
    return e;
}

static int open_file(int dir_fd, const char *name, int flags, int direct, mode_t mode)
{
    int fd = -1;
    if (direct) {
        fd = openat(dir_fd, name, flags | O_DIRECT, mode);
        if (fd >= 0 || errno != EINVAL)
            return fd;
        if (flags & O_CREAT) /* O_EXCL: a half-made file under the name is ours to remove */
            unlinkat(dir_fd, name, 0);
    }
    return openat(dir_fd, name, flags, mode);
}

static int not_regular(int e)
{
    return e == ELOOP || e == EISDIR || e == ENXIO;
}

#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif

/* the descriptor operation i was given (-1: it opens its name) */
static int given_fd(const tc_batch *b, int i)
{
    return b->fd ? b->fd[i] : -1;
}

static int keeps(const tc_batch *b, int i)
{
    return b->fd && (b->flags[i] & TC_KEEP);
}

/* rename the temporary file of operation i over its final name (TC_EXCHANGE: swap them,
 * got[i] = the inode now under the temporary name); returns the error */
static int publish(const tc_batch *b, int i)
{
    const char *tmp = b->names + b->name_off[i], *final = b->names + b->final_off[i];
    b->got[i] = 0;
    if (b->kind == TC_WRITE) { /* a test's fault in a write's own publication */
        int e = injected(TC_RENAME, final);
        if (e)
            return e;
    }
#ifdef SYS_renameat2
    struct stat st;
    /* only a regular file is swapped out (a directory or symlink under the name is left to
     * the plain rename, which refuses or replaces it as it always did) */
    int dir = opdir(b, i);
    if ((b->flags[i] & TC_EXCHANGE) && fstatat(dir, final, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        S_ISREG(st.st_mode)) {
        if (syscall(SYS_renameat2, dir, tmp, dir, final, RENAME_EXCHANGE) == 0) {
            b->got[i] = (int64_t)st.st_ino;
            return 0;
        }
        if (errno != ENOENT && errno != EINVAL && errno != ENOSYS)
            return not_regular(errno) ? TC_NOTREG : errno;
    }
#endif
    if (renameat(opdir(b, i), tmp, opdir(b, i), final) != 0)
        return not_regular(errno) || errno == ENOTEMPTY ? TC_NOTREG : errno;
    return 0;
}

/* after operation i opened its own descriptor fd: keep it (TC_KEEP, success) or close it;
 * returns the error */
static int settle_fd(const tc_batch *b, int i, int fd, int e)
{
    if (!e && keeps(b, i)) {
        if ((b->flags[i] & TC_KEEP_DIRECT) && !(b->flags[i] & TC_DIRECT))
            fcntl(fd, F_SETFL, O_DIRECT); /* kept for O_DIRECT use (where the filesystem has it) */
        if (b->kept_ino) {
            struct stat st;
            int fl = fcntl(fd, F_GETFL);
            if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || fl < 0) {
                close(fd); /* not kept: the operation itself succeeded */
                b->fd[i] = -1;
                return 0;
            }
            b->kept_ino[i] = (int64_t)st.st_ino;
            b->kept_size[i] = (int64_t)st.st_size;
            b->kept_flags[i] = ((fl & O_DIRECT) ? TC_KEPT_DIRECT : 0) | ((fl & O_ACCMODE) == O_RDWR ? TC_KEPT_RDWR : 0);
        }
        b->fd[i] = fd;
        return 0;
    }
    if (close(fd) != 0 && !e)
        e = errno;
    if (b->fd)
        b->fd[i] = -1;
    return e;
}

/* a given descriptor (held O_DIRECT when TC_KEEP_DIRECT) used by an operation without
 * TC_DIRECT (an unaligned buffer): buffered for this operation (before = 1), O_DIRECT again
 * after it (before = 0). The writer owns a reused free file alone, so this races no one. */
static void given_direct(const tc_batch *b, int i, int fd, int before)
{
    if ((b->flags[i] & TC_KEEP_DIRECT) && !(b->flags[i] & TC_DIRECT))
        fcntl(fd, F_SETFL, before ? 0 : O_DIRECT);
}

/* a kept descriptor of a write whose file is being removed: close it */
static void drop_kept(const tc_batch *b, int i, int given)
{
    if (!given && b->fd && b->fd[i] >= 0) {
        close(b->fd[i]);
        b->fd[i] = -1;
    }
}

/* open a file to read: O_RDWR when it is to be kept (so it can be recycled later), falling back
 * to O_RDONLY where writing is not permitted */
static int open_read(const tc_batch *b, int i, const char *name)
{
    int base = O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, direct = b->flags[i] & TC_DIRECT;
    if (keeps(b, i)) {
        int fd = open_file(opdir(b, i), name, O_RDWR | base, direct, 0);
        if (fd >= 0 || (errno != EACCES && errno != EROFS && errno != EPERM))
            return fd;
    }
    return open_file(opdir(b, i), name, O_RDONLY | base, direct, 0);
}

static void do_read(const tc_batch *b, int i)
{
    const char *name = b->names + b->name_off[i];
    int64_t total = 0;
    int given = given_fd(b, i);
    int fd = given >= 0 ? given : open_read(b, i, name);
    b->got[i] = 0;
    if (fd < 0) {
        b->err[i] = not_regular(errno) ? TC_NOTREG : errno;
        return;
    }
    struct stat st;
    if (given < 0 && fstat(fd, &st) != 0) {
        b->err[i] = settle_fd(b, i, fd, errno);
        return;
    }
    if (given < 0 && !S_ISREG(st.st_mode)) {
        b->err[i] = settle_fd(b, i, fd, TC_NOTREG);
        return;
    }
    b->file_len[i] = given < 0 ? (int64_t)st.st_size : 0;
    if (given < 0 && fcntl(fd, F_SETFL, (b->flags[i] & TC_DIRECT) ? O_DIRECT : 0) != 0) {
        b->err[i] = settle_fd(b, i, fd, errno); /* clear O_NONBLOCK (kept descriptors are reused) */
        return;
    }
    int e = injected(TC_READ, name);
    struct iovec v[TC_MAX_IOV];
    int64_t want = TC_HEADER_BYTES + b->data_len[i], span = b->span_off ? b->span_off[i] : 0;
    while (!e && total < want) {
        /* a span read: the header page from byte 0, then the data from its span on */
        int k = b->span_off && total < TC_HEADER_BYTES
                    ? (v[0] = (struct iovec){(char *)b->head[i] + total, (size_t)(TC_HEADER_BYTES - total)}, 1)
                    : op_iov(b, i, total, v, TC_MAX_IOV);
        ssize_t r = preadv(fd, v, k, total < TC_HEADER_BYTES ? total : total + span);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            e = errno;
            break;
        }
        if (r == 0)
            break; /* end of file: a truncated file, reported through got */
        total += r;
    }
    b->got[i] = total;
    if (!e && total == want)
        read_done(b, i);
    b->err[i] = given >= 0 ? e : settle_fd(b, i, fd, e);
}

static int write_all(int fd, const tc_batch *b, int i)
{
    struct iovec v[TC_MAX_IOV];
    int64_t off = 0, want = TC_HEADER_BYTES + b->data_len[i];
    int e = op_injected(b, i);
    if (e)
        return e;
    while (off < want) {
        ssize_t r = pwritev(fd, v, op_iov(b, i, off, v, TC_MAX_IOV), off);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (r == 0)
            return EIO;
        off += r;
    }
    return 0;
}

static void do_write(const tc_batch *b, int i)
{
    const char *tmp = b->names + b->name_off[i];
    int flags = b->flags[i];
    int given = given_fd(b, i);
    int fd = given >= 0 ? given
                        : open_file(opdir(b, i), tmp, (keeps(b, i) ? O_RDWR : O_WRONLY) | O_CREAT | O_EXCL | O_CLOEXEC
                                                         | O_NOFOLLOW, flags & TC_DIRECT, 0600);
    if (fd < 0) {
        b->err[i] = not_regular(errno) ? TC_NOTREG : errno;
        return;
    }
    if (given >= 0)
        given_direct(b, i, fd, 1);
    int e = write_all(fd, b, i);
    if (given >= 0)
        given_direct(b, i, fd, 0);
    if (!e && given < 0 && b->file_len[i] > TC_HEADER_BYTES + b->data_len[i] && ftruncate(fd, b->file_len[i]) != 0)
        e = errno;
    if (!e && (flags & TC_FDATASYNC) && fdatasync(fd) != 0)
        e = errno;
    if (given < 0)
        e = settle_fd(b, i, fd, e);
    if (!e && (flags & TC_PUBLISH))
        e = publish(b, i);
    if (e) {
        unlinkat(opdir(b, i), tmp, 0);
        drop_kept(b, i, given >= 0);
    }
    b->err[i] = e;
}

static void do_rename(const tc_batch *b, int i)
{
    const char *tmp = b->names + b->name_off[i];
    int e = op_injected(b, i);
    if (!e)
        e = publish(b, i);
    if (e)
        unlinkat(opdir(b, i), tmp, 0);
    b->err[i] = e;
}

static void do_unlink(const tc_batch *b, int i)
{
    const char *name = b->names + b->name_off[i];
    int dir = opdir(b, i);
    struct stat st;
    b->got[i] = 0;
    if ((b->flags[i] & TC_RECYCLE) && b->kept_ino && b->final_off &&
        fstatat(dir, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) &&
        (int64_t)st.st_ino == b->kept_ino[i] && renameat(dir, name, dir, b->names + b->final_off[i]) == 0) {
        b->got[i] = 1;
        b->err[i] = 0;
        return;
    }
    b->err[i] = unlinkat(dir, name, 0) == 0 ? 0 : errno;
    if ((b->flags[i] & TC_DROP_FD) && b->fd && b->fd[i] >= 0) {
        close(b->fd[i]);
        b->fd[i] = -1;
    }
}

enum { TC_PASS_HASH = 1 };

static void run_one(tc_job *j, int i)
{
    if (j->pass == TC_PASS_HASH) {
        const tc_batch *b = j->b;
        if (b->kind == TC_HASHONLY) {
            b->hash[i] = 0;
            b->err[i] = op_hash(b, i, b->data_len[i], &b->hash[i]);
        } else if (b->kind == TC_WRITE) {
            if (b->flags[i] & TC_MAKEHEAD)
                b->err[i] = make_head(b, i);
        } else if (j->marks[i]) {
            read_checks(b, i);
        }
    } else switch (j->b->kind) {
    case TC_READ: do_read(j->b, i); break;
    case TC_WRITE: do_write(j->b, i); break;
    case TC_UNLINK: do_unlink(j->b, i); break;
    default: do_rename(j->b, i); break;
    }
    if (atomic_fetch_sub(&j->left, 1) == 1) {
        pthread_mutex_lock(&j->mu);
        j->done = 1;
        pthread_cond_signal(&j->cv);
        pthread_mutex_unlock(&j->mu);
    }
}

/* under p->mu: drop exhausted jobs from the head of the queue */
static void unlink_job(tc_pool *p, tc_job *j)
{
    tc_job **pp = &p->head, *prev = NULL;
    while (*pp && *pp != j) {
        prev = *pp;
        pp = &(*pp)->link;
    }
    if (*pp) {
        *pp = j->link;
        if (p->tail == j)
            p->tail = prev;
    }
}

static void *worker(void *arg)
{
    tc_pool *p = arg;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        while (!p->head && !p->stop)
            pthread_cond_wait(&p->cv, &p->mu);
        if (!p->head) {
            pthread_mutex_unlock(&p->mu);
            return NULL;
        }
        tc_job *j = p->head;
        int i = atomic_fetch_add(&j->next, 1);
        int mine = i < j->n; /* read under the lock: once it is released, a job with no item left
                              * for this worker may be finished and gone (its caller's stack) */
        if (i >= j->n - 1)
            unlink_job(p, j); /* no work left in it for anyone else */
        pthread_mutex_unlock(&p->mu);
        if (mine)
            run_one(j, i);
    }
}

/* ---- io_uring backend ------------------------------------------------------------------- */
#if defined(__linux__) && __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#define TC_HAVE_URING 1
#define TC_RING_DEPTH 128
#ifdef IORING_FEAT_NATIVE_WORKERS /* headers of 5.12 and later: IORING_OP_RENAMEAT, _UNLINKAT */
#define TC_URING_META 1
#endif

typedef struct {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_len, cq_len, sqes_len;
    unsigned queued; /* SQEs filled since the last io_uring_enter */
    int meta;        /* the kernel has IORING_OP_RENAMEAT and IORING_OP_UNLINKAT (5.11+) */
} tc_ring;

/* whether rings publish (rename) and unlink on io_uring where the kernel can (tc_set_uring_meta;
 * 0: those are direct system calls, as before 5.11) */
static int uring_meta_on = 1;

void tc_set_uring_meta(int on)
{
    __atomic_store_n(&uring_meta_on, on, __ATOMIC_RELAXED);
}

/* 1 where this ring queues renames and unlinks */
static int ring_meta(const tc_ring *r)
{
    return r->meta && __atomic_load_n(&uring_meta_on, __ATOMIC_RELAXED);
}

static pthread_key_t ring_key;
static pthread_once_t ring_once = PTHREAD_ONCE_INIT;

static void ring_free(void *arg)
{
    tc_ring *r = arg;
    if (!r)
        return;
    munmap(r->sqes, r->sqes_len);
    if (r->cq_map != r->sq_map)
        munmap(r->cq_map, r->cq_len);
    munmap(r->sq_map, r->sq_len);
    close(r->fd);
    free(r);
}

static void ring_key_init(void)
{
    pthread_key_create(&ring_key, ring_free);
}

static tc_ring *ring_new(void)
{
    /* completions run only when this thread asks for them (DEFER_TASKRUN, 6.1+), else
     * without an interrupt of the running task (COOP_TASKRUN, 5.19+), else plain */
    static const unsigned setups[] = {
        IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN, IORING_SETUP_COOP_TASKRUN, 0};
    struct io_uring_params p;
    int fd = -1;
    for (unsigned k = 0; k < sizeof setups / sizeof *setups && fd < 0; k++) {
        memset(&p, 0, sizeof p);
        p.flags = setups[k];
        fd = (int)syscall(__NR_io_uring_setup, TC_RING_DEPTH, &p);
        if (fd < 0 && errno != EINVAL)
            return NULL; /* ENOSYS, EPERM (seccomp, io_uring_disabled): no io_uring here */
    }
    if (fd < 0)
        return NULL;
    tc_ring *r = calloc(1, sizeof *r);
    if (!r) {
        close(fd);
        return NULL;
    }
    r->fd = fd;
    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single)
        r->sq_len = r->cq_len = r->sq_len > r->cq_len ? r->sq_len : r->cq_len;
    r->sq_map = mmap(NULL, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED)
        goto fail;
    r->cq_map = single ? r->sq_map
                       : mmap(NULL, r->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
    if (r->cq_map == MAP_FAILED)
        goto fail_sq;
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED)
        goto fail_cq;
    char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
#ifdef TC_URING_META
    size_t plen = sizeof(struct io_uring_probe) + 256 * sizeof(struct io_uring_probe_op);
    struct io_uring_probe *probe = calloc(1, plen);
    if (probe && syscall(__NR_io_uring_register, fd, IORING_REGISTER_PROBE, probe, 256) == 0)
        r->meta = probe->last_op >= IORING_OP_UNLINKAT &&
                  (probe->ops[IORING_OP_RENAMEAT].flags & IO_URING_OP_SUPPORTED) &&
                  (probe->ops[IORING_OP_UNLINKAT].flags & IO_URING_OP_SUPPORTED);
    free(probe);
#endif
    return r;
fail_cq:
    if (r->cq_map != r->sq_map)
        munmap(r->cq_map, r->cq_len);
fail_sq:
    munmap(r->sq_map, r->sq_len);
fail:
    close(fd);
    free(r);
    return NULL;
}

/* this thread's ring (NULL where io_uring cannot be set up) */
static tc_ring *thread_ring(void)
{
    pthread_once(&ring_once, ring_key_init);
    tc_ring *r = pthread_getspecific(ring_key);
    if (!r) {
        r = ring_new();
        if (r)
            pthread_setspecific(ring_key, r);
    }
    return r;
}

static struct io_uring_sqe *ring_sqe(tc_ring *r)
{
    unsigned tail = *r->sq_tail;
    unsigned head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
    if (tail - head >= *r->sq_mask + 1)
        return NULL; /* cannot happen: at most TC_RING_DEPTH requests are ever outstanding */
    unsigned idx = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[idx];
    memset(sqe, 0, sizeof *sqe);
    r->sq_array[idx] = idx;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    r->queued++;
    return sqe;
}

static int ring_enter(tc_ring *r, unsigned wait)
{
    for (;;) {
        int got = (int)syscall(__NR_io_uring_enter, r->fd, r->queued, wait, wait ? IORING_ENTER_GETEVENTS : 0, NULL, 0);
        if (got >= 0) {
            r->queued -= (unsigned)got < r->queued ? (unsigned)got : r->queued;
            if (r->queued == 0 || got == 0)
                return 0;
            continue;
        }
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EBUSY) { /* completions first: wait for one, then retry */
            wait = 1;
            continue;
        }
        return errno;
    }
}

enum { ST_OPEN = 0, ST_IO = 1, ST_SYNC = 2, ST_META = 3 }; /* ST_META: a rename or an unlink */

typedef struct {
    int fd;
    int direct;
    int given;         /* fd is the caller's (not opened, not closed here) */
    int rdwr;          /* a read opens O_RDWR (TC_KEEP; cleared when refused) */
    int64_t off;       /* bytes moved so far (header included) */
    struct iovec iov[TC_MAX_IOV];
} tc_file;

static void prep_open(tc_ring *r, const tc_batch *b, tc_file *f, int i)
{
    struct io_uring_sqe *sqe = ring_sqe(r);
    int write = b->kind == TC_WRITE;
    sqe->opcode = IORING_OP_OPENAT;
    sqe->fd = opdir(b, i);
    sqe->addr = (uint64_t)(uintptr_t)(b->names + b->name_off[i]);
    int keep = keeps(b, i);
    sqe->open_flags = (write ? (keep ? O_RDWR : O_WRONLY) | O_CREAT | O_EXCL : (f->rdwr ? O_RDWR : O_RDONLY) | O_NONBLOCK)
                      | O_CLOEXEC | O_NOFOLLOW | (f->direct ? O_DIRECT : 0);
    sqe->len = write ? 0600 : 0;
    sqe->user_data = ((uint64_t)i << 2) | ST_OPEN;
}

static void prep_io(tc_ring *r, const tc_batch *b, tc_file *f, int i)
{
    int64_t off = f->off;
    int k = op_iov(b, i, off, f->iov, TC_MAX_IOV);
    struct io_uring_sqe *sqe = ring_sqe(r);
    sqe->opcode = b->kind == TC_WRITE ? IORING_OP_WRITEV : IORING_OP_READV;
    sqe->fd = f->fd;
    sqe->addr = (uint64_t)(uintptr_t)f->iov;
    sqe->len = k;
    sqe->off = off;
    sqe->user_data = ((uint64_t)i << 2) | ST_IO;
}

static void prep_sync(tc_ring *r, tc_file *f, int i)
{
    struct io_uring_sqe *sqe = ring_sqe(r);
    sqe->opcode = IORING_OP_FSYNC;
    sqe->fd = f->fd;
    sqe->fsync_flags = IORING_FSYNC_DATASYNC;
    sqe->user_data = ((uint64_t)i << 2) | ST_SYNC;
}

/* a write's descriptor after its transfer: closed, or kept (or given back to O_DIRECT); returns
 * the error */
static int close_write(const tc_batch *b, tc_file *f, int i, int e)
{
    if (!f->given)
        e = settle_fd(b, i, f->fd, e);
    else
        given_direct(b, i, f->fd, 0);
    f->fd = -1;
    return e;
}

/* a write whose descriptor is settled: published by a direct rename, or (error e, or a failed
 * rename) its temporary file removed; returns the error */
static int end_write(const tc_batch *b, tc_file *f, int i, int e)
{
    if (!e && (b->flags[i] & TC_PUBLISH))
        e = publish(b, i);
    if (e) {
        unlinkat(opdir(b, i), b->names + b->name_off[i], 0);
        drop_kept(b, i, f->given);
    }
    return e;
}

/* a write's end: close (or keep), publish or remove the temporary file; returns the error */
static int finish_write(const tc_batch *b, tc_file *f, int i, int e)
{
    return end_write(b, f, i, close_write(b, f, i, e));
}

/* queue operation i's rename (temporary over final name) or unlink on the ring */
static void prep_meta(tc_ring *r, const tc_batch *b, int i)
{
#ifdef TC_URING_META
    struct io_uring_sqe *sqe = ring_sqe(r);
    int dir = opdir(b, i);
    sqe->fd = dir;
    sqe->addr = (uint64_t)(uintptr_t)(b->names + b->name_off[i]);
    if (b->kind == TC_UNLINK) {
        sqe->opcode = IORING_OP_UNLINKAT;
    } else {
        sqe->opcode = IORING_OP_RENAMEAT;
        sqe->len = (uint32_t)dir;
        sqe->addr2 = (uint64_t)(uintptr_t)(b->names + b->final_off[i]);
    }
    sqe->user_data = ((uint64_t)i << 2) | ST_META;
#else
    (void)r;
    (void)b;
    (void)i;
#endif
}

/* a rename's or unlink's completion (res: 0 or -errno) for operation i: a failed publication
 * removes the temporary file (and a write's kept descriptor), an unlink with TC_DROP_FD closes
 * the deleted file's descriptor; as do_rename, do_unlink and end_write. Returns 1 (done). */
static int meta_done(const tc_batch *b, tc_file *f, int i, int res)
{
    int e = res < 0 ? -res : 0;
    if (b->kind == TC_UNLINK) {
        b->err[i] = e;
        if ((b->flags[i] & TC_DROP_FD) && b->fd && b->fd[i] >= 0) {
            close(b->fd[i]);
            b->fd[i] = -1;
        }
        return 1;
    }
    if (e) {
        e = not_regular(e) || e == ENOTEMPTY ? TC_NOTREG : e;
        unlinkat(opdir(b, i), b->names + b->name_off[i], 0);
        if (b->kind == TC_WRITE)
            drop_kept(b, i, f->given);
    }
    b->err[i] = e;
    return 1;
}

/* a write's transfer (and flush) ended with error e: its descriptor settled, then published
 * on the ring where the ring can rename (returns 0: the rename is queued), else here (returns
 * 1, err[i] set). An exchange (TC_EXCHANGE) looks at the replaced file first: a direct call. */
static int write_done(tc_ring *r, const tc_batch *b, tc_file *f, int i, int e)
{
    e = close_write(b, f, i, e);
    if (!e && (b->flags[i] & TC_PUBLISH) && !(b->flags[i] & TC_EXCHANGE) && ring_meta(r)) {
        b->got[i] = 0;
        e = injected(TC_RENAME, b->names + b->final_off[i]); /* a test's fault in the publication */
        if (!e) {
            prep_meta(r, b, i);
            return 0;
        }
    }
    b->err[i] = end_write(b, f, i, e);
    return 1;
}

/* a read's end: close (or keep) a descriptor it opened; returns the error */
static int finish_read(const tc_batch *b, tc_file *f, int i, int e)
{
    if (!f->given)
        e = settle_fd(b, i, f->fd, e);
    f->fd = -1;
    return e;
}

/* One completion of file i; returns 1 when the file is done (b->err[i] set). */
static int on_cqe(tc_ring *r, const tc_batch *b, tc_file *f, int i, int stage, int res)
{
    if (stage == ST_META)
        return meta_done(b, f, i, res);
    int write = b->kind == TC_WRITE;
    int64_t want = TC_HEADER_BYTES + b->data_len[i];
    if (stage == ST_OPEN) {
        if (res < 0) {
            if (res == -EINVAL && f->direct) { /* O_DIRECT refused (tmpfs): again without it */
                if (write)
                    unlinkat(opdir(b, i), b->names + b->name_off[i], 0);
                f->direct = 0;
                prep_open(r, b, f, i);
                return 0;
            }
            if (!write && f->rdwr && (res == -EACCES || res == -EROFS || res == -EPERM)) {
                f->rdwr = 0; /* writing refused: read-only */
                prep_open(r, b, f, i);
                return 0;
            }
            b->err[i] = not_regular(-res) ? TC_NOTREG : -res;
            return 1;
        }
        f->fd = res;
        int e = 0;
        if (!write) {
            struct stat st;
            if (fstat(f->fd, &st) != 0)
                e = errno;
            else if (!S_ISREG(st.st_mode))
                e = TC_NOTREG;
            else if (fcntl(f->fd, F_SETFL, f->direct ? O_DIRECT : 0) != 0)
                e = errno; /* clear O_NONBLOCK: io_uring would fail reads with EAGAIN */
            else
                b->file_len[i] = (int64_t)st.st_size;
        }
        if (!e)
            e = op_injected(b, i);
        if (e) {
            b->err[i] = write ? finish_write(b, f, i, e) : finish_read(b, f, i, e);
            return 1;
        }
        f->off = 0;
        prep_io(r, b, f, i);
        return 0;
    }
    if (stage == ST_IO) {
        if (res == -EINTR || res == -EAGAIN) {
            prep_io(r, b, f, i);
            return 0;
        }
        int e = res < 0 ? -res : 0;
        if (res > 0) {
            f->off += res;
            if (f->off < want) { /* a short transfer: the rest */
                prep_io(r, b, f, i);
                return 0;
            }
        } else if (res == 0 && write) {
            e = EIO;
        }
        if (!write) {
            b->got[i] = f->off;
            if (!e && f->off == want)
                read_done(b, i);
            b->err[i] = finish_read(b, f, i, e);
            return 1;
        }
        if (!e && !f->given && b->file_len[i] > want && ftruncate(f->fd, b->file_len[i]) != 0)
            e = errno;
        if (!e && (b->flags[i] & TC_FDATASYNC)) {
            prep_sync(r, f, i);
            return 0;
        }
        return write_done(r, b, f, i, e);
    }
    return write_done(r, b, f, i, res < 0 ? -res : 0); /* ST_SYNC */
}

/* Run a read or write batch on this thread's ring; returns -1 where there is no ring. */
/* a file in flight when the ring failed: close it (a write's temporary file is removed) */
static int on_abort(const tc_batch *b, tc_file *f, int i, int stage, int res, int err)
{
    if (stage == ST_META) /* it ran: its own outcome */
        return meta_done(b, f, i, res);
    if (stage == ST_OPEN && res >= 0)
        f->fd = res;
    if (f->fd >= 0) {
        if (b->kind == TC_WRITE)
            finish_write(b, f, i, err);
        else
            finish_read(b, f, i, err);
    }
    b->err[i] = err;
    return 1;
}

/* Wait for completions and handle every one that arrived (with err != 0: abort each file);
 * returns the number of files finished, or -errno where the ring failed. */
static int reap(tc_ring *r, const tc_batch *b, tc_file *files, int err)
{
    int e = ring_enter(r, 1);
    if (e)
        return -e;
    int finished = 0;
    unsigned head = *r->cq_head;
    unsigned tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    for (; head != tail; head++) {
        struct io_uring_cqe *cqe = &r->cqes[head & *r->cq_mask];
        int i = (int)(cqe->user_data >> 2), stage = (int)(cqe->user_data & 3);
        tc_file *f = files ? &files[i] : NULL; /* a rename or unlink batch has no files */
        finished += err ? on_abort(b, f, i, stage, cqe->res, err) : on_cqe(r, b, f, i, stage, cqe->res);
    }
    __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    return finished;
}

static int uring_run(const tc_batch *b, int n)
{
    tc_ring *r = thread_ring();
    if (!r)
        return -1;
    tc_file *files = calloc((size_t)n, sizeof *files);
    if (!files)
        return -1;
    int next = 0, active = 0, done = 0, err = 0;
    while (done < n) {
        while (active < TC_RING_DEPTH && next < n) {
            tc_file *f = &files[next];
            f->direct = (b->flags[next] & TC_DIRECT) != 0;
            f->rdwr = keeps(b, next);
            f->fd = given_fd(b, next);
            f->given = f->fd >= 0;
            if (b->kind == TC_READ)
                b->got[next] = 0;
            if (f->given) { /* an open descriptor: straight to the transfer */
                int e = op_injected(b, next);
                if (e) {
                    b->err[next] = b->kind == TC_WRITE ? finish_write(b, f, next, e) : finish_read(b, f, next, e);
                    next++;
                    done++;
                    continue;
                }
                f->off = 0;
                if (b->kind == TC_WRITE)
                    given_direct(b, next, f->fd, 1);
                prep_io(r, b, f, next);
            } else {
                f->fd = -1;
                prep_open(r, b, f, next);
            }
            next++;
            active++;
        }
        if (active == 0)
            continue;
        int got = reap(r, b, files, 0);
        if (got < 0) {
            err = -got;
            break;
        }
        active -= got;
        done += got;
    }
    if (err) { /* the ring failed (not a file): finish what is in flight, fail the rest */
        while (active > 0) {
            int got = reap(r, b, files, err);
            if (got < 0)
                break;
            active -= got;
        }
        for (int i = next; i < n; i++)
            b->err[i] = err;
    }
    free(files);
    return 0;
}

static void do_rename(const tc_batch *b, int i);
static void do_unlink(const tc_batch *b, int i);

/* Run a rename or unlink batch on this thread's ring (every operation a plain one: see
 * meta_plain); returns -1 where the ring cannot, else 0. Where the ring fails midway, what it
 * had not taken runs here by direct system calls, and an operation it took whose completion
 * never came fails with the ring's error (its outcome unknown to the caller, as any failed
 * rename or unlink: the caller removes such blocks). */
static int uring_meta_run(const tc_batch *b, int n)
{
    tc_ring *r = thread_ring();
    if (!r || !ring_meta(r))
        return -1;
    int next = 0, active = 0, err = 0;
    while (next < n || active > 0) {
        while (active < TC_RING_DEPTH && next < n) {
            int i = next++;
            b->got[i] = 0;
            int e = b->kind == TC_RENAME ? op_injected(b, i) : 0;
            if (e) {
                meta_done(b, NULL, i, -e);
                continue;
            }
            b->err[i] = EINPROGRESS; /* until its completion */
            prep_meta(r, b, i);
            active++;
        }
        if (active == 0)
            break;
        int got = reap(r, b, NULL, 0);
        if (got < 0) {
            err = -got;
            break;
        }
        active -= got;
    }
    if (err) {
        while (active > 0) { /* what the ring took: its completions, where they still come */
            int got = reap(r, b, NULL, err);
            if (got <= 0)
                break;
            active -= got;
        }
        for (int i = 0; i < next; i++)
            if (b->err[i] == EINPROGRESS)
                b->err[i] = err;
        for (int i = next; i < n; i++) {
            if (b->kind == TC_RENAME)
                do_rename(b, i);
            else
                do_unlink(b, i);
        }
    }
    return 0;
}

/* 1 where every operation of a rename or unlink batch is one the ring does alone: a plain
 * rename (no exchange, which looks at the replaced file first) or a plain unlink (no recycle,
 * which compares the file's inode first) */
static int meta_plain(const tc_batch *b, int n)
{
    int32_t not_plain = b->kind == TC_RENAME ? TC_EXCHANGE : TC_RECYCLE;
    for (int i = 0; i < n; i++)
        if (b->flags[i] & not_plain)
            return 0;
    return 1;
}

/* 1 where this thread can set up an io_uring ring that opens files */
static int uring_usable(void)
{
    return thread_ring() != NULL;
}

/* 1 where this thread's ring renames and unlinks (the kernel has the operations) */
int tc_uring_meta(void)
{
    tc_ring *r = thread_ring();
    return r != NULL && r->meta;
}
#else
int tc_uring_meta(void)
{
    return 0;
}

void tc_set_uring_meta(int on)
{
    (void)on;
}

static int uring_meta_run(const tc_batch *b, int n)
{
    (void)b;
    (void)n;
    return -1;
}

static int meta_plain(const tc_batch *b, int n)
{
    (void)b;
    (void)n;
    return 0;
}

static int uring_run(const tc_batch *b, int n)
{
    (void)b;
    (void)n;
    return -1;
}

static int uring_usable(void)
{
    return 0;
}
#endif

void *tc_pool_create(int nthreads, int uring)
{
    tc_pool *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->threads = calloc(nthreads > 0 ? nthreads : 1, sizeof(pthread_t));
    if (!p->threads) {
        free(p);
        return NULL;
    }
    p->uring = uring && uring_usable();
    for (int t = 0; t < nthreads; t++) {
        if (pthread_create(&p->threads[t], NULL, worker, p) != 0)
            break;
        p->nthreads++;
    }
    return p;
}

/* Stop the workers (after the batches in flight) and free the pool. */
void tc_pool_destroy(void *pool)
{
    tc_pool *p = pool;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int t = 0; t < p->nthreads; t++)
        pthread_join(p->threads[t], NULL);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p->threads);
    free(p);
}

int tc_pool_threads(void *pool)
{
    return ((tc_pool *)pool)->nthreads;
}

/* 1 when reads and writes run on io_uring, 0 on the threads */
int tc_pool_uring(void *pool)
{
    return ((tc_pool *)pool)->uring;
}

static int pool_run(tc_pool *p, const tc_batch *b, int n, int pass, const unsigned char *marks);

/* bytes of data of the batch's operations */
static int64_t data_bytes(const tc_batch *b, int n)
{
    int64_t total = 0;
    for (int i = 0; i < n; i++)
        total += b->data_len[i];
    return total;
}

static int count_failed(const tc_batch *b, int n)
{
    int failed = 0;
    for (int i = 0; i < n; i++)
        failed += b->err[i] != 0;
    return failed;
}

/* Run the n operations of batch b on the pool (the calling thread helps) and return when all
 * are done. Returns the number of operations that failed. */
int tc_run(void *pool, const tc_batch *b, int n)
{
    tc_pool *p = pool;
    if (n <= 0)
        return 0;
    int parallel_hash = p->nthreads > 0 && n > 1 && xxh3 && data_bytes(b, n) >= TC_POOL_HASH_BYTES;
    if (b->kind == TC_HASHONLY) {
        if (parallel_hash)
            return pool_run(p, b, n, TC_PASS_HASH, NULL);
        /* small: on the calling thread (a hand-off to the pool costs more than the hashes) */
        for (int i = 0; i < n; i++) {
            b->hash[i] = 0;
            b->err[i] = xxh3 ? op_hash(b, i, b->data_len[i], &b->hash[i]) : ENOSYS;
        }
        return count_failed(b, n);
    }
    if (b->kind == TC_WRITE) { /* headers first (TC_MAKEHEAD): in parallel for large batches */
        int heads = 0;
        for (int i = 0; i < n; i++)
            heads += (b->flags[i] & TC_MAKEHEAD) != 0;
        if (heads) {
            int bad;
            if (parallel_hash) {
                bad = pool_run(p, b, n, TC_PASS_HASH, NULL);
            } else {
                bad = 0;
                for (int i = 0; i < n; i++)
                    if (b->flags[i] & TC_MAKEHEAD)
                        bad += (b->err[i] = make_head(b, i)) != 0;
            }
            if (bad) { /* no header, no write: every operation fails, as any failed write */
                for (int i = 0; i < n; i++)
                    if (!b->err[i])
                        b->err[i] = ECANCELED;
                return n;
            }
        }
    }
    if (p->uring && (b->kind == TC_READ || b->kind == TC_WRITE) && !b->span_off) { /* spans: the threads */
        unsigned char *marks = parallel_hash && b->kind == TC_READ ? calloc((size_t)n, 1) : NULL;
        tl_defer_hash = marks;
        int ran = uring_run(b, n) == 0;
        tl_defer_hash = NULL;
        if (ran) {
            if (marks)
                pool_run(p, b, n, TC_PASS_HASH, marks);
            free(marks);
            return count_failed(b, n);
        }
        free(marks);
    }
    if (p->uring && (b->kind == TC_RENAME || b->kind == TC_UNLINK) && n > 1 && meta_plain(b, n)) {
        int ran = uring_meta_run(b, n);
        if (ran == 0)
            return count_failed(b, n);
    }
    return pool_run(p, b, n, 0, NULL);
}

/* run the batch's operations (or, pass TC_PASS_HASH, the checksums of those marked) on the
 * pool's threads and the calling thread; returns the number that failed */
static int pool_run(tc_pool *p, const tc_batch *b, int n, int pass, const unsigned char *marks)
{
    tc_job j;
    j.b = b;
    j.n = n;
    j.pass = pass;
    j.marks = marks;
    atomic_init(&j.next, 0);
    atomic_init(&j.left, n);
    j.done = 0;
    j.link = NULL;
    pthread_mutex_init(&j.mu, NULL);
    pthread_cond_init(&j.cv, NULL);
    if (n > 1 && p->nthreads > 0) {
        pthread_mutex_lock(&p->mu);
        if (p->tail)
            p->tail->link = &j;
        else
            p->head = &j;
        p->tail = &j;
        /* wake as many workers as there is work for beside the caller (no thundering herd) */
        if (n - 1 >= p->nthreads)
            pthread_cond_broadcast(&p->cv);
        else
            for (int k = 0; k < n - 1; k++)
                pthread_cond_signal(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    for (;;) {
        int i = atomic_fetch_add(&j.next, 1);
        if (i >= n)
            break;
        run_one(&j, i);
    }
    pthread_mutex_lock(&j.mu);
    while (!j.done)
        pthread_cond_wait(&j.cv, &j.mu);
    pthread_mutex_unlock(&j.mu);
    pthread_mutex_lock(&p->mu); /* no worker may still reach this job through the queue */
    unlink_job(p, &j);
    pthread_mutex_unlock(&p->mu);
    pthread_cond_destroy(&j.cv);
    pthread_mutex_destroy(&j.mu);
    int failed = 0;
    for (int i = 0; i < n; i++)
        failed += b->err[i] != 0;
    return failed;
}
