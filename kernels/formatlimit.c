/* The physical limit of tiercache's on-disk format (one file per block and pool), measured
 * with nothing of the engine around it (host code, no CUDA; tiercache/bench/formatlimit.py).
 *
 * `inflight` POSIX threads take files from a shared counter and, per file, do only what a
 * block's write or read asks of the file system:
 *
 *   write  openat(temporary name, O_WRONLY | O_DIRECT) of an existing, allocated file,
 *          pwrite(header page + data, the file's whole length), close, renameat(temporary,
 *          final) to publish
 *   read   openat(final name, O_RDONLY | O_DIRECT), pread(the file's whole length), close
 *
 * No checksum, no header check, no name building, no bookkeeping: every cost the engine adds
 * to these syscalls shows as the distance between its speed and this one's, and the distance
 * between this one and fio's (which reads and writes a few large files) is the price of the
 * format itself.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { TC_LIMIT_WRITE = 0, TC_LIMIT_READ = 1 };

typedef struct {
    int32_t op;
    int64_t nfiles;
    const int32_t *dir_fd;    /* per file: its directory */
    const char *names;        /* NUL-terminated names, back to back */
    const int64_t *tmp_off;   /* per file: its temporary name (write) */
    const int64_t *final_off; /* per file: its final name */
    int64_t file_bytes;       /* a file's whole length (a multiple of 4096) */
    int32_t direct;           /* O_DIRECT (0 where the file system refuses it) */
    atomic_llong next;        /* the next file to take */
    atomic_int first_err;     /* the first errno seen (0: none) */
} limit_job;

static void *limit_worker(void *arg)
{
    limit_job *job = arg;
    void *buf = NULL;
    if (posix_memalign(&buf, 4096, (size_t)job->file_bytes)) {
        atomic_store(&job->first_err, ENOMEM);
        return NULL;
    }
    memset(buf, 0x5a, (size_t)job->file_bytes);
    for (;;) {
        int64_t i = atomic_fetch_add(&job->next, 1);
        if (i >= job->nfiles)
            break;
        int dir = job->dir_fd[i];
        const char *final = job->names + job->final_off[i];
        int err = 0;
        if (job->op == TC_LIMIT_WRITE) {
            const char *tmp = job->names + job->tmp_off[i];
            int fd = openat(dir, tmp, O_WRONLY | O_CLOEXEC | (job->direct ? O_DIRECT : 0));
            if (fd < 0) {
                err = errno;
            } else {
                ssize_t n = pwrite(fd, buf, (size_t)job->file_bytes, 0);
                if (n != job->file_bytes)
                    err = n < 0 ? errno : EIO;
                close(fd);
                if (!err && renameat(dir, tmp, dir, final))
                    err = errno;
            }
        } else {
            int fd = openat(dir, final, O_RDONLY | O_CLOEXEC | (job->direct ? O_DIRECT : 0));
            if (fd < 0) {
                err = errno;
            } else {
                ssize_t n = pread(fd, buf, (size_t)job->file_bytes, 0);
                if (n != job->file_bytes)
                    err = n < 0 ? errno : EIO;
                close(fd);
            }
        }
        if (err) {
            int zero = 0;
            atomic_compare_exchange_strong(&job->first_err, &zero, err);
        }
    }
    free(buf);
    return NULL;
}

/* Run `nfiles` writes or reads (op) on `inflight` threads (with O_DIRECT where `direct`). Returns the wall time in
 * nanoseconds from the first thread's start to the last one's end, or -errno (the first
 * error any file met, or a thread that could not start). */
int64_t tc_format_limit(int32_t op, int64_t nfiles, const int32_t *dir_fd, const char *names, const int64_t *tmp_off,
                        const int64_t *final_off, int64_t file_bytes, int32_t inflight, int32_t direct)
{
    if (inflight < 1 || nfiles < 0 || file_bytes <= 0 || file_bytes % 4096)
        return -EINVAL;
    limit_job job = {.op = op, .nfiles = nfiles, .dir_fd = dir_fd, .names = names, .tmp_off = tmp_off,
                     .final_off = final_off, .file_bytes = file_bytes, .direct = direct};
    atomic_init(&job.next, 0);
    atomic_init(&job.first_err, 0);
    pthread_t *threads = calloc((size_t)inflight, sizeof(pthread_t));
    if (!threads)
        return -ENOMEM;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int started = 0;
    for (; started < inflight; started++)
        if (pthread_create(&threads[started], NULL, limit_worker, &job))
            break;
    if (started == 0) {
        free(threads);
        return -EAGAIN;
    }
    for (int t = 0; t < started; t++)
        pthread_join(threads[t], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    free(threads);
    int err = atomic_load(&job.first_err);
    if (err)
        return -err;
    return (int64_t)(t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
}
