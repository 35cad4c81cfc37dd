/* hicached.common._pageio: the file connector's page I/O, run by threads of its own that never take the GIL.

   A job does for each of its pages what FileConnector._read_one / _write_one do in Python
   (connectors/file.py): open, preadv / pwritev straight between the file and the caller's buffers, the
   xxh3-64 of each 256 KiB chunk while it is in the CPU cache, the page header of connectors/header.py,
   temporary name and rename; and what exists / delete do (stat, unlink). The Python code stays the
   reference: file.py uses this module only when it imports and its header constants and API match, and
   the tests run both paths against the same files.

   Engine runs jobs on its own threads: the event loop queues a job (its arguments checked, names made and
   buffers held, with the GIL) and an eventfd it watches says when jobs are done. Python threads would need
   the GIL to start each job and to hand back its answer, and wait for it while the loop runs Python.
   read_pages / write_pages run one job in the calling thread, with the GIL released once.

   The page files' names are made here too, as FileConnector._path and _tmp_path make them.

   Page files are opened beneath the root: no symlink is followed on the way from the root to a page (a
   namespace or shard directory that is a symlink fails with ELOOP or ENOTDIR, as a page file that is one
   does), and a read never blocks in open() (O_NONBLOCK: a FIFO at a page's path is a miss at once, as is
   anything else that is not a regular file).

   Result codes, one per page: 0 done, > 0 an errno, < 0 one of the RESULT_* values below. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* xxhash.c and, on x86, xxh_x86dispatch.c are compiled with this module (setup.py): the dispatcher picks
   the widest vector unit the CPU has at run time (AVX-512, AVX2 or SSE2) while the build stays portable.
   On a 2-vCPU Xeon, xxh3 with SSE2 took twice the time of the kernel's copy of the same bytes. */
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#ifdef HICACHED_XXH_DISPATCH
#include "xxh_x86dispatch.h"
#else
#include "xxhash.h"
#endif

/* The page header (connectors/header.py): "<4sHHQQQ" magic, version, header length, payload length,
   xxh3-64 of the payload, key tag (xxh3-64 of "namespace/key"); little-endian. */
#include "_pageio_simd.h"

#define HEADER_SIZE 32
#define FORMAT_VERSION 1
static const char MAGIC[4] = {'H', 'K', 'V', 'P'};

enum {
    RESULT_CANCELLED = -1,
    RESULT_SHORT = -2,
    RESULT_MAGIC = -3,
    RESULT_VERSION = -4,
    RESULT_LENGTH = -5,
    RESULT_KEY = -6,
    RESULT_CHECKSUM = -7,
    RESULT_BAD_KEY = -8, /* not a valid key (hicached/common/keys.py): no file is touched */
    RESULT_CHANGED = -9, /* writes: the payload did not hash to its checksum as written: not published */
    RESULT_NOT_PAGE = -10, /* reads: the page's path holds no regular file (a FIFO, a directory, a device) */
    RESULT_MISFIT = -11, /* reads: a page of the key for another page size (its header says so): left alone */
};

/* Bumped when a function's arguments change: file.py uses only a build of the sources it was written for. */
#define API_VERSION 8
/* Versions of the fence words (copy_ranges' fence, fence_*): ranges.py fences copies only with a build that
   has them. Apart from API_VERSION, which file.py requires exactly: fences change none of its calls. */
#define FENCE_VERSION 1

#define KEY_MAX_LEN 128 /* hicached/common/keys.py */
#define NAMESPACE_MAX_LEN 128
/* A namespace's objects after its first clear: "namespace~" and 16 hex digits of its epoch
   (hicached.common.keys.stored_namespace). */
#define EPOCH_LEN 16
#define STORED_NS_MAX_LEN (NAMESPACE_MAX_LEN + 1 + EPOCH_LEN)

typedef struct {
    char *path; /* the page file's name (PyMem) */
    char *tmp;  /* writes: the temporary name it is written under first (PyMem) */
    const char *key; /* UTF-8 of the key (the str is kept alive by the caller's list, referenced below) */
    Py_ssize_t key_len;
    Py_buffer buf;
    int result;
    int64_t replaced; /* writes: bytes of the page file the rename replaced */
    uint64_t sum;     /* writes with has_sum: the payload's xxh3-64, given by the caller (taken as the page
                         entered L2): the file is published only if what was written hashes to it */
    int has_sum;
} Job;

static void put_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint16_t get_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static uint64_t get_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* The key tag, xxh3-64 of "namespace/key", into *tag; 0, or ENAMETOOLONG (never a wrong tag: on a read it
   would remove a good page). task_new bounds both names, so the buffer always holds them. */
static int key_tag(const char *ns, size_t ns_len, const char *key, size_t key_len, uint64_t *tag) {
    char buf[STORED_NS_MAX_LEN + 1 + KEY_MAX_LEN];
    size_t n = ns_len + 1 + key_len;
    if (n > sizeof buf) return ENAMETOOLONG;
    memcpy(buf, ns, ns_len);
    buf[ns_len] = '/';
    memcpy(buf + ns_len + 1, key, key_len);
    *tag = XXH3_64bits(buf, n);
    return 0;
}

/* preadv / pwritev until `want` bytes moved (iovecs past them are filled only if the same calls reach
   them: a read's sentinel byte), end of file, or an error: bytes moved, or -errno. The usual case is one
   call; the loop runs only after a short transfer. */
static ssize_t xfer(int fd, struct iovec *iov, int cnt, off_t offset, int write, size_t want) {
    ssize_t total = 0;
    while (cnt > 0 && (size_t)total < want) {
        ssize_t n = write ? pwritev(fd, iov, cnt, offset) : preadv(fd, iov, cnt, offset);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (n == 0) break; /* end of file (reads); a write of zero bytes does not happen with data left */
        total += n;
        offset += n;
        while (cnt > 0 && (size_t)n >= iov->iov_len) {
            n -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + n;
            iov->iov_len -= (size_t)n;
        }
    }
    return total;
}

/* Removes `path` if it is still the file open as `fd` (a put may have renamed a good page over it since):
   bytes removed, or 0. */
static int64_t remove_if_same(int fd, const char *path) {
    struct stat a, b;
    if (fstat(fd, &a) != 0 || lstat(path, &b) != 0) return 0;
    if (a.st_dev != b.st_dev || a.st_ino != b.st_ino) return 0;
    return unlink(path) == 0 ? (int64_t)b.st_size : 0;
}

static int stopped(const Py_buffer *stop) { return stop->len > 0 && ((volatile const char *)stop->buf)[0] != 0; }

/* openat2(2)'s resolve flags (linux/openat2.h): no symlink anywhere on the way, nothing above `dirfd`. */
#ifndef SYS_openat2
#define SYS_openat2 437
#endif
struct beneath_how {
    uint64_t flags, mode, resolve;
};
#define BENEATH_RESOLVE (0x08 /* RESOLVE_BENEATH */ | 0x04 /* RESOLVE_NO_SYMLINKS */ | 0x02 /* NO_MAGICLINKS */)
static int openat2_missing; /* set once the kernel answered ENOSYS: kernels before 5.6 */

/* openat(dirfd, rel, flags) where no component of `rel` may be a symlink (ELOOP or ENOTDIR where one is)
   and none may lead out of `dirfd`: openat2 with RESOLVE_NO_SYMLINKS, or, on kernels without it (or where
   a seccomp filter refuses it), one component at a time with O_NOFOLLOW. The fd, or -1 with errno set. */
static int open_beneath(int dirfd, const char *rel, int flags, mode_t mode) {
    flags |= O_CLOEXEC;
    if (!__atomic_load_n(&openat2_missing, __ATOMIC_RELAXED)) {
        struct beneath_how how = {(uint64_t)flags, (flags & O_CREAT) ? (uint64_t)mode : 0, BENEATH_RESOLVE};
        long fd = syscall(SYS_openat2, dirfd, rel, &how, sizeof how);
        if (fd >= 0) return (int)fd;
        if (errno == ENOSYS) __atomic_store_n(&openat2_missing, 1, __ATOMIC_RELAXED);
        if (errno != ENOSYS && errno != EPERM) return -1;
    }
    char buf[4096];
    size_t n = strlen(rel);
    if (n >= sizeof buf) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(buf, rel, n + 1);
    int fd = dirfd;
    for (char *part = buf;;) {
        char *slash = strchr(part, '/');
        int next, err;
        if (slash == NULL) {
            next = openat(fd, part, flags | O_NOFOLLOW, mode);
        } else {
            *slash = '\0';
            next = openat(fd, part, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        }
        err = errno;
        if (fd != dirfd) close(fd);
        if (next < 0 || slash == NULL) {
            errno = err;
            return next;
        }
        fd = next;
        part = slash + 1;
    }
}

/* The directory of a page file (namespace/k0k1/k2k3 under the root) opened beneath the root (O_PATH): with
   `create`, the missing ones are made first, as FileConnector._make_shard makes them (never the root: it is
   `rootfd` already). The fd, or -errno. */
static int open_shard(int rootfd, const char *rel_dir, int create) {
    int fd = open_beneath(rootfd, rel_dir, O_PATH | O_DIRECTORY, 0);
    if (fd >= 0) return fd;
    if (errno != ENOENT || !create) return -errno;
    char buf[4096];
    size_t n = strlen(rel_dir);
    if (n >= sizeof buf) return -ENAMETOOLONG;
    memcpy(buf, rel_dir, n + 1);
    /* Down from the root, a directory at a time: made where missing (another thread may make it at the same
       time), then opened beneath the one above it; one that is a symlink fails there. */
    int parent = rootfd;
    for (char *part = buf;;) {
        char *slash = strchr(part, '/');
        if (slash != NULL) *slash = '\0';
        int next = mkdirat(parent, part, 0700) == 0 || errno == EEXIST ? open_beneath(parent, part, O_PATH | O_DIRECTORY, 0)
                                                                       : -1;
        int err = errno;
        if (parent != rootfd) close(parent);
        if (next < 0) return -err;
        if (slash == NULL) return next;
        parent = next;
        part = slash + 1;
    }
}

static int read_one(Job *j, int rootfd, size_t root_len, const char *ns, size_t ns_len, size_t chunk,
                    double touch_after, int64_t *removed) {
    if (j->path == NULL) return RESULT_BAD_KEY;
    const char *path = j->path;
    uint64_t tag;
    int err = key_tag(ns, ns_len, j->key, (size_t)j->key_len, &tag);
    if (err) return err;
    /* O_NONBLOCK: an open of a FIFO (or a device) would wait for a peer; a regular file reads the same. */
    int fd = open_beneath(rootfd, path + root_len + 1, O_RDONLY | O_NONBLOCK, 0);
    if (fd < 0) return errno == ELOOP ? RESULT_NOT_PAGE : errno; /* a symlink on the way: not a page of ours */
    struct stat st0;
    if (fstat(fd, &st0) != 0 || !S_ISREG(st0.st_mode)) {
        close(fd);
        return RESULT_NOT_PAGE;
    }
    uint8_t head[HEADER_SIZE], extra; /* extra: a byte past the payload, read only by the same calls */
    uint8_t *dest = j->buf.buf;
    size_t size = (size_t)j->buf.len, first = size < chunk ? size : chunk;
    uint64_t actual;
    struct iovec iov[3] = {{head, HEADER_SIZE}, {dest, first}, {&extra, 1}};
    ssize_t got = xfer(fd, iov, size <= chunk ? 3 : 2, 0, 0, HEADER_SIZE + first);
    if (got < 0) goto fail;
    if (size <= chunk) {
        actual = XXH3_64bits(dest, size);
    } else {
        XXH3_state_t state;
        XXH3_INITSTATE(&state);
        XXH3_64bits_reset(&state);
        XXH3_64bits_update(&state, dest, first);
        for (size_t start = first; (size_t)got == HEADER_SIZE + start && start < size; start += chunk) {
            size_t n = size - start < chunk ? size - start : chunk;
            struct iovec part[2] = {{dest + start, n}, {&extra, 1}};
            ssize_t r = xfer(fd, part, start + n == size ? 2 : 1, (off_t)(HEADER_SIZE + start), 0, n);
            if (r < 0) {
                got = r;
                goto fail;
            }
            got += r;
            XXH3_64bits_update(&state, dest + start, n);
        }
        actual = XXH3_64bits_digest(&state);
    }
    int result = 0;
    if (got < HEADER_SIZE)
        result = RESULT_SHORT;
    else if (memcmp(head, MAGIC, 4) != 0)
        result = RESULT_MAGIC;
    else if (get_u16(head + 4) != FORMAT_VERSION || get_u16(head + 6) != HEADER_SIZE)
        result = RESULT_VERSION;
    else if (get_u64(head + 24) != tag)
        result = RESULT_KEY;
    else if (get_u64(head + 8) != size) /* whole, of another page size, or a damaged length field */
        result = (uint64_t)st0.st_size == HEADER_SIZE + get_u64(head + 8) ? RESULT_MISFIT : RESULT_LENGTH;
    else if ((size_t)got != HEADER_SIZE + size) /* short, or longer than its page (the extra byte read) */
        result = RESULT_LENGTH;
    else if (get_u64(head + 16) != actual)
        result = RESULT_CHECKSUM;
    /* Another format version or page size (a node of the fleet configured otherwise): a miss, left alone. */
    if (result != 0 && result != RESULT_VERSION && result != RESULT_MISFIT) {
        *removed += remove_if_same(fd, path);
    } else if (touch_after >= 0) {
        /* Marks the page used for the janitor, only when the mark is old: see _TOUCH_AFTER_S in file.py. */
        struct stat st;
        if (fstat(fd, &st) == 0 && difftime(time(NULL), st.st_mtime) > touch_after) futimens(fd, NULL);
    }
    close(fd);
    return result;
fail:
    close(fd);
    return (int)-got;
}

/* A write: the payload under a temporary name in its shard directory (made where missing: one job's new
   shards cost a few system calls each here instead of a return to Python; with 65536 shards most pages of
   a fresh tree open one), then renamed to the page's name. Published only when, as written, the payload
   hashes to the checksum it came with (a slot reused or changed since is never stored under the key), and
   only while the call still wants it (`stop` not set: a write its caller gave up on is not renamed). */
static int write_one(Job *j, int rootfd, const char *ns, size_t ns_len, size_t root_len, size_t chunk,
                     int do_fsync, int measure, const Py_buffer *stop) {
    if (j->path == NULL) return RESULT_BAD_KEY;
    uint64_t tag;
    int err = key_tag(ns, ns_len, j->key, (size_t)j->key_len, &tag);
    if (err) return err;
    /* root/ns/k0k1/k2k3/key: the directory's name beneath the root, and the leaf names in it. */
    size_t dir_len = ns_len + 6;
    char rel_dir[STORED_NS_MAX_LEN + 8];
    memcpy(rel_dir, j->path + root_len + 1, dir_len);
    rel_dir[dir_len] = '\0';
    const char *leaf = j->path + root_len + 1 + dir_len + 1, *tmp = j->tmp + root_len + 1 + dir_len + 1;
    int dirfd = open_shard(rootfd, rel_dir, 1);
    if (dirfd < 0) return -dirfd;
    int fd = openat(dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        err = errno;
        close(dirfd);
        return err;
    }
    const uint8_t *payload = j->buf.buf;
    size_t size = (size_t)j->buf.len;
    uint8_t head[HEADER_SIZE];
    memcpy(head, MAGIC, 4);
    put_u16(head + 4, FORMAT_VERSION);
    put_u16(head + 6, HEADER_SIZE);
    put_u64(head + 8, size);
    put_u64(head + 24, tag);
    /* Each chunk is written, then hashed: the kernel's copy has just brought it into the CPU cache, where
       xxh3 runs at ~30 GB/s against ~9 GB/s from memory (a page backed up was stored long before). Hashing
       first and writing from the cache measured 2-12 % slower (median ~4.5 %; pages of 256 KiB and 2 MiB
       on tmpfs). The header, which needs the checksum, goes last. */
    XXH3_state_t state;
    XXH3_INITSTATE(&state);
    XXH3_64bits_reset(&state);
    ssize_t r = 0;
    for (size_t start = 0; start < size && r >= 0; start += chunk) {
        size_t n = size - start < chunk ? size - start : chunk;
        struct iovec part = {(void *)(payload + start), n};
        r = xfer(fd, &part, 1, (off_t)(HEADER_SIZE + start), 1, n);
        if (r >= 0 && (size_t)r != n) r = -EIO;
        if (r >= 0) XXH3_64bits_update(&state, payload + start, n);
    }
    int result = 0;
    if (r >= 0) {
        uint64_t digest = XXH3_64bits_digest(&state);
        if (j->has_sum && digest != j->sum) result = RESULT_CHANGED;
        put_u64(head + 16, j->has_sum ? j->sum : digest);
        struct iovec iov = {head, HEADER_SIZE};
        if (result == 0) r = xfer(fd, &iov, 1, 0, 1, HEADER_SIZE);
        if (r >= 0 && result == 0 && r != HEADER_SIZE) r = -EIO;
    }
    if (r >= 0 && result == 0 && do_fsync && fsync(fd) != 0) r = -errno;
    if (close(fd) != 0 && r >= 0) r = -errno;
    if (r >= 0 && result == 0 && stopped(stop)) result = RESULT_CANCELLED;
    if (r >= 0 && result == 0) {
        struct stat st;
        j->replaced = measure && fstatat(dirfd, leaf, &st, AT_SYMLINK_NOFOLLOW) == 0 ? (int64_t)st.st_size : 0;
        if (renameat(dirfd, tmp, dirfd, leaf) == 0) {
            close(dirfd);
            return 0;
        }
        r = -errno;
    }
    unlinkat(dirfd, tmp, 0);
    close(dirfd);
    return result ? result : (int)-r;
}

/* One job: its pages, checked and turned into Jobs with the GIL held, and the arguments of the call. The
   Python memory it holds (names, buffers, references) is taken and given back with the GIL held only. */
/* What a task does with each of its pages. */
enum { TASK_READ, TASK_WRITE, TASK_EXISTS, TASK_DELETE };

typedef struct Task {
    struct Task *next; /* in an Engine's queue or list of finished tasks */
    int kind;
    Job *jobs;
    Py_ssize_t n;
    PyObject *keys;  /* a new reference to a copy of the list, so the key strings live while the GIL is released */
    PyObject *token; /* Engine: what reap() hands back with the results (a new reference) */
    Py_buffer stop;
    char *ns; /* a copy (PyMem), read without the GIL */
    size_t ns_len;
    char *root; /* likewise */
    size_t root_len;
    size_t chunk;
    double touch_after;
    int do_fsync, measure;
    int64_t total;  /* by how many bytes the tree grew (< 0: it shrank; corrupt pages removed, deletes) */
    int root_err;   /* 0, or why the root is unusable: checked once a page was not found (ENOENT, ENOTDIR) */
} Task;

static void task_free(Task *t) {
    for (Py_ssize_t i = 0; i < t->n; i++) {
        Job *j = &t->jobs[i];
        PyMem_Free(j->path);
        PyMem_Free(j->tmp);
        if (j->buf.obj != NULL) PyBuffer_Release(&j->buf);
    }
    PyMem_Free(t->jobs);
    PyMem_Free(t->ns);
    PyMem_Free(t->root);
    Py_XDECREF(t->keys);
    Py_XDECREF(t->token);
    if (t->stop.obj != NULL) PyBuffer_Release(&t->stop);
    PyMem_Free(t);
}

static int name_char(char c, int dot) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
           (dot && c == '.');
}

/* hicached.keys.valid_key / valid_namespace: what may become a file name under the root. */
static int valid_name(const char *s, Py_ssize_t n, Py_ssize_t max_len, int dot) {
    if (n < 1 || n > max_len) return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!name_char(s[i], dot)) return 0;
    return !(dot && (n == 1 || n == 2) && s[0] == '.' && s[n - 1] == '.');
}

/* hicached.keys.valid_stored_namespace: a namespace, or one with "~" and its epoch. */
static int valid_stored_ns(const char *s, Py_ssize_t n) {
    if (n > 1 + EPOCH_LEN && s[n - 1 - EPOCH_LEN] == '~') {
        for (Py_ssize_t i = n - EPOCH_LEN; i < n; i++)
            if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return 0;
        n -= 1 + EPOCH_LEN;
    }
    return valid_name(s, n, NAMESPACE_MAX_LEN, 1);
}

/* Process-wide: the temporary names of concurrent writes never meet (the tag tells processes apart). */
static uint64_t tmp_seq;

/* FileConnector._path: root/namespace/k0k1/k2k3/key, the shard from the key padded with '_' to 4
   characters; with `tag`, also _tmp_path: the same directory, "." key "." tag seq ".tmp". 0, or -1 with
   MemoryError set. */
static int make_names(Job *j, const char *root, Py_ssize_t root_len, const char *ns, Py_ssize_t ns_len,
                      const char *tag, Py_ssize_t tag_len) {
    char shard[4];
    for (int i = 0; i < 4; i++) shard[i] = i < j->key_len ? j->key[i] : '_';
    size_t dir_len = (size_t)root_len + 1 + (size_t)ns_len + 1 + 2 + 1 + 2;
    size_t path_len = dir_len + 1 + (size_t)j->key_len;
    j->path = PyMem_Malloc(path_len + 1);
    if (j->path == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int n = snprintf(j->path, path_len + 1, "%.*s/%.*s/%.2s/%.2s/%.*s", (int)root_len, root, (int)ns_len, ns, shard,
                     shard + 2, (int)j->key_len, j->key);
    if (n < 0 || (size_t)n != path_len) {
        PyErr_SetString(PyExc_SystemError, "page file name");
        return -1;
    }
    if (tag == NULL) return 0;
    size_t tmp_cap = dir_len + 2 + (size_t)j->key_len + 1 + (size_t)tag_len + 20 + 4 + 1;
    j->tmp = PyMem_Malloc(tmp_cap);
    if (j->tmp == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    unsigned long long seq = __atomic_fetch_add(&tmp_seq, 1, __ATOMIC_RELAXED);
    n = snprintf(j->tmp, tmp_cap, "%.*s/.%.*s.%.*s%llu.tmp", (int)dir_len, j->path, (int)j->key_len, j->key,
                 (int)tag_len, tag, seq);
    if (n < 0 || (size_t)n >= tmp_cap) {
        PyErr_SetString(PyExc_SystemError, "temporary file name");
        return -1;
    }
    return 0;
}

static char *copy_string(const char *s, size_t n) {
    char *out = PyMem_Malloc(n + 1);
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(out, s, n);
    out[n] = '\0';
    return out;
}

/* A task from a call's arguments (`stop` is handed over: the task releases it); NULL with an exception set
   when an argument is wrong, and then nothing is held. */
static Task *task_new(int kind, const char *ns, Py_ssize_t ns_len, PyObject *keys, PyObject *root, PyObject *tag,
                      PyObject *bufs, Py_ssize_t chunk, Py_buffer *stop) {
    Task *t = PyMem_Calloc(1, sizeof(Task));
    if (t == NULL) {
        PyBuffer_Release(stop);
        PyErr_NoMemory();
        return NULL;
    }
    t->kind = kind;
    t->stop = *stop;
    t->chunk = (size_t)chunk;
    if (chunk <= 0) {
        PyErr_SetString(PyExc_ValueError, "chunk must be positive");
        goto fail;
    }
    if (!PyList_Check(keys) || (bufs && !PyList_Check(bufs)) || !PyBytes_Check(root) || (tag && !PyBytes_Check(tag))) {
        PyErr_SetString(PyExc_TypeError, "keys and buffers must be lists, root and tag bytes");
        goto fail;
    }
    if (!valid_stored_ns(ns, ns_len)) {
        PyErr_SetString(PyExc_ValueError, "invalid namespace");
        goto fail;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (bufs && PyList_GET_SIZE(bufs) != n) {
        PyErr_SetString(PyExc_ValueError, "keys and buffers differ in length");
        goto fail;
    }
    t->ns_len = (size_t)ns_len;
    t->root_len = (size_t)PyBytes_GET_SIZE(root);
    if ((t->ns = copy_string(ns, t->ns_len)) == NULL || (t->root = copy_string(PyBytes_AS_STRING(root), t->root_len)) == NULL)
        goto fail;
    t->keys = PyList_GetSlice(keys, 0, n); /* a copy: the caller's list may change meanwhile */
    if (t->keys == NULL) goto fail;
    t->jobs = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Job));
    if (t->jobs == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Job *j = &t->jobs[i];
        t->n = i + 1; /* task_free releases what this job holds so far if it fails half-way */
        PyObject *key = PyList_GET_ITEM(t->keys, i);
        if (!PyUnicode_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "keys must be str");
            goto fail;
        }
        j->key = PyUnicode_AsUTF8AndSize(key, &j->key_len);
        if (j->key == NULL) goto fail;
        int flags = kind == TASK_WRITE ? PyBUF_SIMPLE : PyBUF_WRITABLE;
        if (bufs && PyObject_GetBuffer(PyList_GET_ITEM(bufs, i), &j->buf, flags | PyBUF_C_CONTIGUOUS) != 0) goto fail;
        if (!valid_name(j->key, j->key_len, KEY_MAX_LEN, 0)) continue; /* no names: RESULT_BAD_KEY */
        if (make_names(j, t->root, (Py_ssize_t)t->root_len, ns, ns_len, tag ? PyBytes_AS_STRING(tag) : NULL,
                       tag ? PyBytes_GET_SIZE(tag) : 0) != 0)
            goto fail;
    }
    return t;
fail:
    task_free(t);
    return NULL;
}


/* FileConnector._check_root: 0 when the root is a directory, else why not. */
static int root_error(const char *root) {
    struct stat st;
    if (stat(root, &st) != 0) return errno;
    return S_ISDIR(st.st_mode) ? 0 : ENOTDIR;
}

/* FileConnector._leading_present, a page at a time: 0 when the page file is there (a regular file that
   holds at least a header, reached with no symlink on the way), else ENOENT or why not. */
static int exists_one(Job *j, int rootfd, size_t root_len) {
    if (j->path == NULL) return RESULT_BAD_KEY;
    int fd = open_beneath(rootfd, j->path + root_len + 1, O_PATH, 0);
    if (fd < 0) return errno == ELOOP ? ENOENT : errno;
    struct stat st;
    int err = fstat(fd, &st) != 0 ? errno : 0;
    close(fd);
    if (err) return err;
    return S_ISREG(st.st_mode) && st.st_size >= HEADER_SIZE ? 0 : ENOENT;
}

/* FileConnector._remove_all, a page at a time: 0 when removed (its bytes taken off *total), else an errno. */
static int delete_one(Job *j, int rootfd, size_t root_len, size_t ns_len) {
    if (j->path == NULL) return RESULT_BAD_KEY;
    char rel_dir[STORED_NS_MAX_LEN + 8];
    size_t dir_len = ns_len + 6;
    memcpy(rel_dir, j->path + root_len + 1, dir_len);
    rel_dir[dir_len] = '\0';
    int dirfd = open_shard(rootfd, rel_dir, 0);
    if (dirfd < 0) return dirfd == -ELOOP ? ENOENT : -dirfd; /* a symlink on the way: no page of ours */
    const char *leaf = j->path + root_len + 1 + dir_len + 1;
    struct stat st;
    int64_t size = fstatat(dirfd, leaf, &st, AT_SYMLINK_NOFOLLOW) == 0 ? (int64_t)st.st_size : 0;
    int err = unlinkat(dirfd, leaf, 0) != 0 ? errno : 0;
    close(dirfd);
    if (err) return err;
    j->replaced = size;
    return 0;
}

/* The pages of a task, one after the other; needs no GIL (and is run without it). */
static void task_run(Task *t) {
    int absent = 0, hole = 0;
    /* The root as it is now (a symlink in its own path is the operator's choice, and followed); every page
       is opened beneath it. A root that is gone fails every page, and the call (root_err below). */
    int rootfd = open(t->root, O_PATH | O_DIRECTORY | O_CLOEXEC);
    int root_open_err = rootfd < 0 ? errno : 0;
    for (Py_ssize_t i = 0; i < t->n; i++) {
        Job *j = &t->jobs[i];
        if (hole || stopped(&t->stop)) {
            j->result = RESULT_CANCELLED;
            continue;
        }
        if (rootfd < 0) {
            j->result = j->path == NULL ? RESULT_BAD_KEY : root_open_err;
            absent = 1;
            continue;
        }
        switch (t->kind) {
        case TASK_WRITE:
            j->result =
                write_one(j, rootfd, t->ns, t->ns_len, t->root_len, t->chunk, t->do_fsync, t->measure, &t->stop);
            if (j->result == 0) t->total += HEADER_SIZE + (int64_t)j->buf.len - j->replaced;
            break;
        case TASK_READ: {
            int64_t removed = 0;
            j->result = read_one(j, rootfd, t->root_len, t->ns, t->ns_len, t->chunk, t->touch_after, &removed);
            t->total -= removed;
            break;
        }
        case TASK_EXISTS:
            j->result = exists_one(j, rootfd, t->root_len);
            hole = j->result != 0; /* the leading pages only: those after a hole are not looked at */
            break;
        default:
            j->result = delete_one(j, rootfd, t->root_len, t->ns_len);
            if (j->result == 0) t->total -= j->replaced;
        }
        /* exists: a leading prefix ends at its first missing page as a rule; only a first page missing
           can mean a missing root (as FileConnector._leading_present checks it), so only it costs a stat. */
        if (t->kind != TASK_EXISTS || i == 0) absent |= j->result == ENOENT || j->result == ENOTDIR;
    }
    /* Once a task: a missing page is a miss, a missing root fails the call (write_one makes missing shards,
       so there ENOENT means the root is gone, or the janitor removed a shard in between). */
    if (rootfd >= 0) close(rootfd);
    if (absent) t->root_err = root_error(t->root);
}

/* (token, results, total, root_errno) with a token, else (results, total, root_errno): a result code a
   page (see the top of this file). */
static PyObject *task_answer(Task *t, PyObject *token) {
    PyObject *results = PyList_New(t->n);
    if (results == NULL) return NULL;
    for (Py_ssize_t i = 0; i < t->n; i++) {
        PyObject *v = PyLong_FromLong(t->jobs[i].result);
        if (v == NULL) {
            Py_DECREF(results);
            return NULL;
        }
        PyList_SET_ITEM(results, i, v);
    }
    if (token != NULL) return Py_BuildValue("(ONLi)", token, results, (long long)t->total, t->root_err);
    return Py_BuildValue("(NLi)", results, (long long)t->total, t->root_err);
}

/* read_pages / write_pages: the task run in this thread, with the GIL released once. */
static PyObject *run_here(Task *t) {
    if (t == NULL) return NULL;
    Py_BEGIN_ALLOW_THREADS
    task_run(t);
    Py_END_ALLOW_THREADS
    PyObject *out = task_answer(t, NULL);
    task_free(t);
    return out;
}

#define READ_ARGS "s#OOOny*d"
#define READ_DOC                                                                                                  \
    "Reads each page file (under root, a bytes path, named as FileConnector._path names it) into its\n"          \
    "buffer and verifies its header and checksum. A page that does not verify is removed if the file\n"          \
    "is still the one read. stop: a buffer whose first byte, once non-zero, cancels the pages not yet\n"          \
    "begun. touch_after < 0: never mark pages used. results: a code a page (0 read, > 0 an errno, < 0 the\n"    \
    "module's CANCELLED, BAD_KEY, NOT_PAGE (no regular file there) or a reason the page is corrupt);\n"     \
    "total: minus the bytes of corrupt pages removed; root_errno: once a page was not found, 0 if the root is still a directory, else why not."

#define WRITE_ARGS "s#OOOOny*pp|O"
#define WRITE_DOC                                                                                                 \
    "Writes each payload with its header under a temporary name (with `tag`, bytes, as\n"                         \
    "FileConnector._tmp_path makes it) and renames it to its page file under root, making missing shard\n"       \
    "directories (never the root). total: by how much the written pages grew the tree (with measure, the\n"      \
    "sizes of files replaced are subtracted). A temporary file is removed when its page fails. sums: None,\n"    \
    "or a list with each payload's xxh3-64 (an int) or None: a page with one is published only if what was\n"  \
    "written hashes to it (else CHANGED). A page finished after `stop` was set is not published (CANCELLED)."

PyDoc_STRVAR(read_pages_doc, "read_pages(namespace, keys, root, buffers, chunk, stop, touch_after)\n"
                             "-> (results, total, root_errno)\n\n" READ_DOC);

/* The task of a read call's arguments, with a token first where `token` is not NULL; NULL with an
   exception set when an argument is wrong. */
static Task *read_task(PyObject *args, PyObject **token) {
    const char *ns;
    Py_ssize_t ns_len, chunk;
    PyObject *keys, *root, *bufs;
    Py_buffer stop;
    double touch_after;
    int ok = token ? PyArg_ParseTuple(args, "O" READ_ARGS, token, &ns, &ns_len, &keys, &root, &bufs, &chunk, &stop,
                                      &touch_after)
                   : PyArg_ParseTuple(args, READ_ARGS, &ns, &ns_len, &keys, &root, &bufs, &chunk, &stop, &touch_after);
    Task *t = ok ? task_new(TASK_READ, ns, ns_len, keys, root, NULL, bufs, chunk, &stop) : NULL;
    if (t != NULL) t->touch_after = touch_after;
    return t;
}

static PyObject *read_pages(PyObject *self, PyObject *args) { return run_here(read_task(args, NULL)); }

PyDoc_STRVAR(write_pages_doc, "write_pages(namespace, keys, root, tag, payloads, chunk, stop, fsync, measure[, sums])\n"
                              "-> (results, total, root_errno)\n\n" WRITE_DOC);

/* read_task, for writes. */
static Task *write_task(PyObject *args, PyObject **token) {
    const char *ns;
    Py_ssize_t ns_len, chunk;
    PyObject *keys, *root, *tag, *bufs, *sums = Py_None;
    Py_buffer stop;
    int do_fsync, measure;
    int ok = token ? PyArg_ParseTuple(args, "O" WRITE_ARGS, token, &ns, &ns_len, &keys, &root, &tag, &bufs, &chunk,
                                      &stop, &do_fsync, &measure, &sums)
                   : PyArg_ParseTuple(args, WRITE_ARGS, &ns, &ns_len, &keys, &root, &tag, &bufs, &chunk, &stop,
                                      &do_fsync, &measure, &sums);
    if (ok && sums != Py_None && (!PyList_Check(sums) || PyList_GET_SIZE(sums) != PyList_GET_SIZE(keys))) {
        PyErr_SetString(PyExc_ValueError, "sums must be None or a list with one item a key");
        PyBuffer_Release(&stop);
        return NULL;
    }
    Task *t = ok ? task_new(TASK_WRITE, ns, ns_len, keys, root, tag, bufs, chunk, &stop) : NULL;
    if (t == NULL) return NULL;
    t->do_fsync = do_fsync;
    t->measure = measure;
    for (Py_ssize_t i = 0; sums != Py_None && i < t->n; i++) {
        PyObject *v = PyList_GET_ITEM(sums, i);
        if (v == Py_None) continue;
        unsigned long long sum = PyLong_Check(v) ? PyLong_AsUnsignedLongLong(v) : (unsigned long long)-1;
        if (!PyLong_Check(v) || (sum == (unsigned long long)-1 && PyErr_Occurred())) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a sum must be an int or None");
            task_free(t);
            return NULL;
        }
        t->jobs[i].sum = sum;
        t->jobs[i].has_sum = 1;
    }
    return t;
}

static PyObject *write_pages(PyObject *self, PyObject *args) { return run_here(write_task(args, NULL)); }

/* ---- Engine: a pool of threads of its own that run tasks without ever taking the GIL ----

   With Python threads (an executor around read_pages), a job's thread needs the GIL to start the call and
   to hand back its answer; while the event loop holds it (placing a prefetch's pages, answering clients),
   the I/O waits: on two vCPUs the first read of a 1024-page prefetch started 2-9 ms after the request. An
   Engine's threads take tasks from a queue and put them, done, on a list; an eventfd, watched by the event
   loop, says the list has something. The loop submits and reaps; the threads never run Python. */

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work; /* a task was queued, or the engine closes */
    pthread_cond_t ready; /* a thread started (the constructor waits for all of them) */
    Task *queue, *queue_tail;
    Task *done, *done_tail;
    int efd;
    int closing;
    int refs; /* the Python object and each running thread: the last one frees this */
    int started;
    int priority_err; /* the first errno from lowering a thread's priority */
    int nice;
    int sched_idle;
    Py_ssize_t queued, running; /* tasks */
    pid_t *tids;
    int nthreads;
    char name[16]; /* the threads' name (top -H, ps -L), at most 15 bytes */
} EngineState;

typedef struct {
    PyObject_HEAD
    EngineState *s;
} Engine;

static void state_unref(EngineState *s) {
    pthread_mutex_lock(&s->mu);
    int last = --s->refs == 0;
    pthread_mutex_unlock(&s->mu);
    if (!last) return;
    /* Tasks still listed hold Python memory, and this may run without the GIL: a task finished after the
       engine was dropped is left behind (only ever at shutdown, as the connector keeps its engines). */
    close(s->efd);
    pthread_cond_destroy(&s->work);
    pthread_cond_destroy(&s->ready);
    pthread_mutex_destroy(&s->mu);
    free(s->tids);
    free(s);
}

static void *engine_thread(void *arg) {
    EngineState *s = arg;
    int err = 0;
    pid_t tid = (pid_t)syscall(SYS_gettid);
    if (s->name[0]) pthread_setname_np(pthread_self(), s->name);
    if (s->nice) { /* each Linux thread has a niceness of its own */
        errno = 0;
        int now = getpriority(PRIO_PROCESS, (id_t)tid);
        if (errno == 0) {
            int want = now + s->nice > 19 ? 19 : now + s->nice;
            if (setpriority(PRIO_PROCESS, (id_t)tid, want) != 0) err = errno;
        } else
            err = errno;
    }
    if (s->sched_idle) {
        struct sched_param param = {0};
        if (sched_setscheduler(0, SCHED_IDLE, &param) != 0 && err == 0) err = errno;
    }
    pthread_mutex_lock(&s->mu);
    s->tids[s->started++] = tid;
    if (err && !s->priority_err) s->priority_err = err;
    pthread_cond_broadcast(&s->ready);
    for (;;) {
        while (s->queue == NULL && !s->closing) pthread_cond_wait(&s->work, &s->mu);
        Task *t = s->queue;
        if (t == NULL) break; /* closing, and nothing left to run */
        s->queue = t->next;
        if (s->queue == NULL) s->queue_tail = NULL;
        s->queued--;
        s->running++;
        pthread_mutex_unlock(&s->mu);
        task_run(t);
        t->next = NULL;
        pthread_mutex_lock(&s->mu);
        s->running--;
        int first = s->done == NULL;
        if (first)
            s->done = t;
        else
            s->done_tail->next = t;
        s->done_tail = t;
        if (first) { /* the list was empty: the loop is told; later tasks join the list it will take */
            uint64_t one = 1;
            ssize_t w;
            do w = write(s->efd, &one, sizeof one);
            while (w < 0 && errno == EINTR);
        }
    }
    pthread_mutex_unlock(&s->mu);
    state_unref(s);
    return NULL;
}

static void engine_close_state(EngineState *s) {
    pthread_mutex_lock(&s->mu);
    s->closing = 1;
    pthread_cond_broadcast(&s->work);
    pthread_mutex_unlock(&s->mu);
}

static int Engine_init(Engine *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"threads", "nice", "sched_idle", "name", NULL};
    const char *name = "";
    int threads, nice = 0, sched_idle = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i|ips", kwlist, &threads, &nice, &sched_idle, &name)) return -1;
    if (self->s != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Engine already started");
        return -1;
    }
    if (threads < 1 || threads > 1024) {
        PyErr_SetString(PyExc_ValueError, "threads must be 1 to 1024");
        return -1;
    }
    EngineState *s = calloc(1, sizeof *s);
    if (s == NULL || (s->tids = calloc((size_t)threads, sizeof(pid_t))) == NULL) {
        free(s);
        PyErr_NoMemory();
        return -1;
    }
    s->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (s->efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        free(s->tids);
        free(s);
        return -1;
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work, NULL);
    pthread_cond_init(&s->ready, NULL);
    s->nice = nice;
    s->sched_idle = sched_idle;
    snprintf(s->name, sizeof s->name, "%s", name); /* cut to 15 bytes, as the kernel keeps it */
    s->refs = 1;
    self->s = s;
    /* No signal reaches these threads: Python handles signals on its main thread. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 << 10);
    int err = 0, made = 0;
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (; made < threads; made++) {
        pthread_t th;
        pthread_mutex_lock(&s->mu);
        s->refs++;
        pthread_mutex_unlock(&s->mu);
        if ((err = pthread_create(&th, &attr, engine_thread, s)) != 0) {
            pthread_mutex_lock(&s->mu);
            s->refs--;
            pthread_mutex_unlock(&s->mu);
            break;
        }
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    s->nthreads = made;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&s->mu);
    while (s->started < made) pthread_cond_wait(&s->ready, &s->mu);
    pthread_mutex_unlock(&s->mu);
    Py_END_ALLOW_THREADS
    if (err) {
        engine_close_state(s);
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static void Engine_dealloc(Engine *self) {
    EngineState *s = self->s;
    if (s != NULL) {
        engine_close_state(s);
        /* Tasks not begun and tasks finished: theirs to free, with the GIL held here. */
        pthread_mutex_lock(&s->mu);
        Task *lists[2] = {s->queue, s->done};
        s->queue = s->queue_tail = s->done = s->done_tail = NULL;
        s->queued = 0;
        pthread_mutex_unlock(&s->mu);
        for (int i = 0; i < 2; i++)
            for (Task *t = lists[i], *next; t != NULL; t = next) {
                next = t->next;
                task_free(t);
            }
        state_unref(s);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static EngineState *open_state(Engine *self) {
    if (self->s == NULL || self->s->closing) {
        PyErr_SetString(PyExc_RuntimeError, "the engine is closed");
        return NULL;
    }
    return self->s;
}

static PyObject *submit(Engine *self, Task *t, PyObject *token) {
    if (t == NULL) return NULL;
    EngineState *s = self->s;
    Py_INCREF(token);
    t->token = token;
    pthread_mutex_lock(&s->mu);
    if (s->queue_tail == NULL)
        s->queue = t;
    else
        s->queue_tail->next = t;
    s->queue_tail = t;
    s->queued++;
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&s->mu);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Engine_read_doc, "read(token, namespace, keys, root, buffers, chunk, stop, touch_after) -> None\n\n"
                              "Queues read_pages' work for the engine's threads; reap() hands back token with its answer.");

static PyObject *Engine_read(Engine *self, PyObject *args) {
    PyObject *token = NULL;
    if (open_state(self) == NULL) return NULL;
    Task *t = read_task(args, &token);
    return submit(self, t, token);
}

PyDoc_STRVAR(Engine_write_doc, "write(token, namespace, keys, root, tag, payloads, chunk, stop, fsync, measure) -> None\n\n"
                               "Queues write_pages' work for the engine's threads; reap() hands back token with its answer.");

static PyObject *Engine_write(Engine *self, PyObject *args) {
    PyObject *token = NULL;
    if (open_state(self) == NULL) return NULL;
    Task *t = write_task(args, &token);
    return submit(self, t, token);
}

/* exists / delete: (token, namespace, keys, root, stop). */
static PyObject *submit_names(Engine *self, PyObject *args, int kind) {
    PyObject *token, *keys, *root;
    const char *ns;
    Py_ssize_t ns_len;
    Py_buffer stop;
    if (open_state(self) == NULL) return NULL;
    if (!PyArg_ParseTuple(args, "Os#OOy*", &token, &ns, &ns_len, &keys, &root, &stop)) return NULL;
    return submit(self, task_new(kind, ns, ns_len, keys, root, NULL, NULL, 1, &stop), token);
}

PyDoc_STRVAR(Engine_exists_doc, "exists(token, namespace, keys, root, stop) -> None\n\n"
                                "Queues a look at the leading page files: a result a page, 0 while they are there (a regular\n"
                                "file that holds a header), an errno for the first that is not, CANCELLED after it.");

static PyObject *Engine_exists(Engine *self, PyObject *args) { return submit_names(self, args, TASK_EXISTS); }

PyDoc_STRVAR(Engine_delete_doc, "delete(token, namespace, keys, root, stop) -> None\n\n"
                                "Queues the removal of page files: a result a page, 0 removed or an errno; total: minus the\n"
                                "bytes removed.");

static PyObject *Engine_delete(Engine *self, PyObject *args) { return submit_names(self, args, TASK_DELETE); }

PyDoc_STRVAR(Engine_reap_doc, "reap() -> [(token, results, total, root_errno), ...]\n\n"
                              "The tasks finished since the last call, in the order they finished, as read_pages and\n"
                              "write_pages answer; resets the eventfd. Never blocks.");

static PyObject *Engine_reap(Engine *self, PyObject *unused) {
    EngineState *s = self->s;
    if (s == NULL) return PyList_New(0);
    uint64_t count;
    (void)!read(s->efd, &count, sizeof count); /* EAGAIN when nothing was signalled: fine */
    pthread_mutex_lock(&s->mu);
    Task *t = s->done;
    s->done = s->done_tail = NULL;
    pthread_mutex_unlock(&s->mu);
    PyObject *out = PyList_New(0);
    for (Task *next; t != NULL; t = next) {
        next = t->next;
        if (out != NULL) {
            PyObject *item = task_answer(t, t->token);
            if (item == NULL || PyList_Append(out, item) != 0) Py_CLEAR(out);
            Py_XDECREF(item);
        }
        task_free(t); /* every task is freed, even after an error */
    }
    return out;
}

PyDoc_STRVAR(Engine_cancel_doc, "cancel(token) -> bool\n\n"
                               "Takes the task queued with `token` off the queue if no thread has begun it: it is then\n"
                               "answered (by reap) with every page CANCELLED, and never touches its buffers. False if a\n"
                               "thread runs it or it is done: its answer comes as usual.");

static PyObject *Engine_cancel(Engine *self, PyObject *token) {
    EngineState *s = self->s;
    if (s == NULL) Py_RETURN_FALSE;
    Task *found = NULL;
    pthread_mutex_lock(&s->mu);
    for (Task **at = &s->queue, *prev = NULL; *at != NULL; prev = *at, at = &(*at)->next) {
        if ((*at)->token != token) continue;
        found = *at;
        *at = found->next;
        if (s->queue_tail == found) s->queue_tail = prev;
        s->queued--;
        found->next = NULL;
        for (Py_ssize_t i = 0; i < found->n; i++) found->jobs[i].result = RESULT_CANCELLED;
        int first = s->done == NULL;
        if (first)
            s->done = found;
        else
            s->done_tail->next = found;
        s->done_tail = found;
        if (first) {
            uint64_t one = 1;
            ssize_t w;
            do w = write(s->efd, &one, sizeof one);
            while (w < 0 && errno == EINTR);
        }
        break;
    }
    pthread_mutex_unlock(&s->mu);
    return PyBool_FromLong(found != NULL);
}

static PyObject *Engine_fileno(Engine *self, PyObject *unused) {
    if (self->s == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the engine is not started");
        return NULL;
    }
    return PyLong_FromLong(self->s->efd);
}

PyDoc_STRVAR(Engine_close_doc, "close() -> None\n\n"
                               "No more tasks; the threads exit once the tasks queued are done (not waited for: a hung\n"
                               "disk must not hang shutdown). reap() still hands back what finishes.");

static PyObject *Engine_close(Engine *self, PyObject *unused) {
    if (self->s != NULL) engine_close_state(self->s);
    Py_RETURN_NONE;
}

static PyObject *Engine_get_info(Engine *self, void *closure) {
    EngineState *s = self->s;
    if (s == NULL) Py_RETURN_NONE;
    pthread_mutex_lock(&s->mu);
    PyObject *tids = PyList_New(s->started);
    for (int i = 0; tids != NULL && i < s->started; i++) PyList_SET_ITEM(tids, i, PyLong_FromLong(s->tids[i]));
    Py_ssize_t queued = s->queued, running = s->running;
    int closing = s->closing, priority_err = s->priority_err;
    pthread_mutex_unlock(&s->mu);
    if (tids == NULL) return NULL;
    return Py_BuildValue("{s:N,s:n,s:n,s:O,s:i}", "thread_ids", tids, "queued", queued, "running", running, "closed",
                         closing ? Py_True : Py_False, "priority_errno", priority_err);
}

static PyMethodDef Engine_methods[] = {
    {"read", (PyCFunction)Engine_read, METH_VARARGS, Engine_read_doc},
    {"write", (PyCFunction)Engine_write, METH_VARARGS, Engine_write_doc},
    {"exists", (PyCFunction)Engine_exists, METH_VARARGS, Engine_exists_doc},
    {"delete", (PyCFunction)Engine_delete, METH_VARARGS, Engine_delete_doc},
    {"reap", (PyCFunction)Engine_reap, METH_NOARGS, Engine_reap_doc},
    {"cancel", (PyCFunction)Engine_cancel, METH_O, Engine_cancel_doc},
    {"fileno", (PyCFunction)Engine_fileno, METH_NOARGS, "The eventfd that is readable once a task finished."},
    {"close", (PyCFunction)Engine_close, METH_NOARGS, Engine_close_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Engine_getset[] = {
    {"info", (getter)Engine_get_info, NULL,
     "thread_ids, tasks queued and running, closed, and priority_errno (the first error from lowering a thread's\n"
     "priority, or 0)",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Engine_doc, "Engine(threads, nice=0, sched_idle=False, name='')\n\n"
                         "`threads` threads of its own that run jobs (read, write, exists, delete) without the GIL,\n"
                         "at `nice` above the process's niceness and, with sched_idle, under SCHED_IDLE. The\n"
                         "constructor returns once every thread runs. name: the threads' name, cut to 15 bytes.");

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hicached.common._pageio.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Engine_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
    .tp_getset = Engine_getset,
};

/* Copies into the pool use non-temporal (streaming) stores on x86-64: a page stored into L2 is read next
   by another process, a GPU's DMA or a backup, not by this CPU, so its lines need not be read into the
   cache first (a plain memcpy reads each destination line before writing it) nor evict what the engine
   is using. glibc's memcpy streams only past a threshold of 3/4 of the shared cache per thread, which
   pages never reach on servers' large L3s. On a 2-vCPU Xeon (300 MiB L3), streaming copied 256 KiB pages
   into a shared mapping at 1.7x memcpy's speed from sources in the cache, 1.2x from sources in memory;
   2 MiB pages at 1.3-1.4x (bench/copy_paths.py, bench/RESULTS.md). Copies out of the pool (load) stay
   memcpy: the engine reads those bytes next. */
#define STREAM_MIN_BYTES 4096 /* smaller pages: memcpy */

typedef void (*stream_fn)(char *dst, const char *src, size_t n); /* n a multiple of 128, dst 64-aligned */

#if defined(__x86_64__)
#include <immintrin.h>

static void stream_sse2(char *dst, const char *src, size_t n) { /* every x86-64 CPU has SSE2 */
    for (size_t i = 0; i < n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
}

static void stream_fence(void) { _mm_sfence(); }

static const char *stream_default(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? "avx2" : "sse2";
}
#else
static void stream_fence(void) {}
static const char *stream_default(void) { return ""; }
#endif

static stream_fn stream_lookup(const char *name) {
#if defined(__x86_64__)
    if (strcmp(name, "avx2") == 0) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") ? pageio_stream_avx2 : NULL; /* _pageio_simd.c */
    }
    if (strcmp(name, "sse2") == 0) return stream_sse2;
#endif
    (void)name;
    return NULL;
}

static stream_fn stream_copy = NULL; /* NULL: memcpy (set at import, and by stream_impl) */
static char stream_name[8] = "";

/* memcpy for the head up to a 64-byte boundary of dst and for the tail under 128 bytes; streaming between. */
static void copy_streaming(stream_fn fn, char *dst, const char *src, size_t n) {
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    size_t body = n & ~(size_t)127;
    fn(dst, src, body);
    memcpy(dst + body, src + body, n - body);
}

PyDoc_STRVAR(stream_impl_doc,
             "stream_impl([name]) -> str\n\n"
             "The streaming stores that copy_pages uses into the pool: 'avx2', 'sse2' (x86-64), or '' for a\n"
             "plain memcpy. With `name`, uses that from now on in this process (ValueError if this CPU or build\n"
             "has no such thing); returns the one in use before.");

static PyObject *stream_impl(PyObject *self, PyObject *args) {
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|s", &name)) return NULL;
    PyObject *before = PyUnicode_FromString(stream_name);
    if (before == NULL || name == NULL) return before;
    stream_fn fn = stream_lookup(name);
    if (fn == NULL && name[0] != '\0') {
        Py_DECREF(before);
        return PyErr_Format(PyExc_ValueError, "no streaming stores named %R here (avx2, sse2 on x86-64, or '')",
                            PyTuple_GET_ITEM(args, 0));
    }
    stream_copy = fn;
    snprintf(stream_name, sizeof stream_name, "%s", fn ? name : "");
    return before;
}

PyDoc_STRVAR(copy_pages_doc,
             "copy_pages(pool, offsets, size, pages, into_pool[, sums]) -> None\n\n"
             "Copies `size` bytes between each page buffer and the pool at its offset (into the pool with\n"
             "into_pool, out of it otherwise), every page with the GIL released once. The client's store and\n"
             "load: one call a segment instead of a numpy view and a copyto per page (~2 us each). Every\n"
             "buffer and offset is checked before any byte moves. Into the pool, pages of 4 KiB and more go\n"
             "with streaming stores (see stream_impl). With `sums` (a writable buffer of one uint64 a page,\n"
             "into the pool only), each page's xxh3-64 as the page header keeps it, taken in the same pass\n"
             "over the page where the CPU has AVX2.");

static PyObject *copy_pages(PyObject *self, PyObject *args) {
    Py_buffer pool, sums = {0};
    PyObject *offsets, *pages, *sums_obj = Py_None;
    Py_ssize_t size;
    int into_pool;
    if (!PyArg_ParseTuple(args, "w*OnOp|O", &pool, &offsets, &size, &pages, &into_pool, &sums_obj)) return NULL;
    PyObject *out = NULL;
    Py_buffer *bufs = NULL;
    Py_ssize_t *offs = NULL, n = 0, got = 0;
    if (!PyList_Check(offsets) || !PyList_Check(pages) || PyList_GET_SIZE(offsets) != PyList_GET_SIZE(pages)) {
        PyErr_SetString(PyExc_ValueError, "offsets and pages must be lists of one length");
        goto done;
    }
    n = PyList_GET_SIZE(pages);
    if (sums_obj != Py_None) {
        if (!into_pool) {
            PyErr_SetString(PyExc_ValueError, "sums are taken of pages copied into the pool only");
            goto done;
        }
        if (PyObject_GetBuffer(sums_obj, &sums, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
        if (sums.len != n * 8) {
            PyErr_Format(PyExc_ValueError, "sums must have room for %zd uint64 (%zd bytes), not %zd bytes", n,
                         n * 8, sums.len);
            goto done;
        }
    }
    bufs = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Py_buffer));
    offs = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Py_ssize_t));
    if (bufs == NULL || offs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        Py_ssize_t off = PyLong_AsSsize_t(PyList_GET_ITEM(offsets, got));
        if (off == -1 && PyErr_Occurred()) goto done;
        if (size < 0 || off < 0 || off > pool.len - size) {
            PyErr_Format(PyExc_ValueError, "a page of %zd bytes at offset %zd is outside the pool", size, off);
            goto done;
        }
        offs[got] = off;
        int flags = (into_pool ? PyBUF_SIMPLE : PyBUF_WRITABLE) | PyBUF_C_CONTIGUOUS;
        if (PyObject_GetBuffer(PyList_GET_ITEM(pages, got), &bufs[got], flags) != 0) goto done;
        if (bufs[got].len != size) {
            PyErr_Format(PyExc_ValueError, "page %zd has %zd bytes, not %zd", got, bufs[got].len, size);
            got++; /* its buffer is held: released below */
            goto done;
        }
    }
    stream_fn fn = into_pool && size >= STREAM_MIN_BYTES ? stream_copy : NULL;
    uint64_t *sum = sums.obj != NULL ? sums.buf : NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        char *slot = (char *)pool.buf + offs[i];
#if defined(__x86_64__)
        if (sum != NULL && fn == pageio_stream_avx2) { /* one pass: the hash and the copy read the page once */
            sum[i] = pageio_copy_hash_avx2(slot, bufs[i].buf, (size_t)size);
            continue;
        }
#endif
        if (fn != NULL)
            copy_streaming(fn, slot, bufs[i].buf, (size_t)size);
        else if (into_pool)
            memcpy(slot, bufs[i].buf, (size_t)size);
        else
            memcpy(bufs[i].buf, slot, (size_t)size);
        if (sum != NULL) sum[i] = XXH3_64bits(bufs[i].buf, (size_t)size); /* of the source: still cached */
    }
    if (fn != NULL) stream_fence(); /* the stores are seen before whatever tells another process of them */
    Py_END_ALLOW_THREADS
    out = Py_None;
    Py_INCREF(out);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(offs);
    PyBuffer_Release(&pool);
    if (sums.obj != NULL) PyBuffer_Release(&sums);
    return out;
}

/* Fences. An engine hands the daemon a board (a memfd of 8-byte words, one a request in flight) and names a
   word in each store_pages / load_pages request. Bit 63 of a word says the engine gave up on the request
   (CANCELLED); the bits below count the daemon's copy jobs inside the engine's memory for it. A job enters
   (count + 1) unless CANCELLED is set, copies, and leaves (count - 1); the engine sets CANCELLED and waits for
   the count to be 0 before it uses the memory again: then no copy of the request touches it any more. The
   engine can write anything into its own board: that can only skip or run its own copies. */
#define FENCE_CANCELLED (UINT64_C(1) << 63)
#define FENCE_COUNT (FENCE_CANCELLED - 1)

/* 1 when the job may copy (the count taken), 0 when the request is cancelled (or a count at its bound, which
   only a hostile engine writes: refused as cancelled). */
static int fence_in(uint64_t *w) {
    uint64_t cur = __atomic_load_n(w, __ATOMIC_SEQ_CST);
    for (;;) {
        if ((cur & FENCE_CANCELLED) || (cur & FENCE_COUNT) == FENCE_COUNT) return 0;
        if (__atomic_compare_exchange_n(w, &cur, cur + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return 1;
    }
}

/* The job left: count - 1, CANCELLED kept; never below 0 (an engine that zeroed its word meanwhile). */
static void fence_out(uint64_t *w) {
    uint64_t cur = __atomic_load_n(w, __ATOMIC_SEQ_CST);
    for (;;) {
        if ((cur & FENCE_COUNT) == 0) return;
        if (__atomic_compare_exchange_n(w, &cur, cur - 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return;
    }
}

/* The word `slot` of a board (a writable buffer of 8-byte words, 8-byte aligned), or NULL with an exception. */
static uint64_t *fence_word(Py_buffer *b, Py_ssize_t slot) {
    if (b->readonly) {
        PyErr_SetString(PyExc_ValueError, "a fence board must be writable");
        return NULL;
    }
    if ((uintptr_t)b->buf % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "a fence board must be 8-byte aligned");
        return NULL;
    }
    if (slot < 0 || slot >= b->len / 8) {
        PyErr_Format(PyExc_IndexError, "fence slot %zd is outside a board of %zd slots", slot, b->len / 8);
        return NULL;
    }
    return (uint64_t *)b->buf + slot;
}

typedef enum { FENCE_OP_CANCEL, FENCE_OP_COUNT, FENCE_OP_ENTER, FENCE_OP_EXIT } FenceOp;

static PyObject *fence_call(PyObject *args, FenceOp op) {
    Py_buffer b = {0};
    Py_ssize_t slot;
    if (!PyArg_ParseTuple(args, "w*n", &b, &slot)) return NULL;
    PyObject *out = NULL;
    uint64_t *w = fence_word(&b, slot);
    if (w != NULL) {
        switch (op) {
        case FENCE_OP_CANCEL:
            out = PyLong_FromUnsignedLongLong(__atomic_fetch_or(w, FENCE_CANCELLED, __ATOMIC_SEQ_CST) & FENCE_COUNT);
            break;
        case FENCE_OP_COUNT:
            out = PyLong_FromUnsignedLongLong(__atomic_load_n(w, __ATOMIC_SEQ_CST) & FENCE_COUNT);
            break;
        case FENCE_OP_ENTER:
            out = PyBool_FromLong(fence_in(w));
            break;
        case FENCE_OP_EXIT:
            fence_out(w);
            out = Py_NewRef(Py_None);
            break;
        }
    }
    PyBuffer_Release(&b);
    return out;
}

PyDoc_STRVAR(fence_cancel_doc, "fence_cancel(board, slot) -> int\n\n"
                               "Sets the slot's CANCELLED bit (atomically); returns the count of copy jobs that were\n"
                               "inside the memory for it then (0: none is, and none will enter).");
static PyObject *fence_cancel(PyObject *self, PyObject *args) { return fence_call(args, FENCE_OP_CANCEL); }

PyDoc_STRVAR(fence_count_doc, "fence_count(board, slot) -> int\n\nThe count of copy jobs inside the memory for the slot.");
static PyObject *fence_count(PyObject *self, PyObject *args) { return fence_call(args, FENCE_OP_COUNT); }

PyDoc_STRVAR(fence_enter_doc, "fence_enter(board, slot) -> bool\n\n"
                              "What a copy job does first (copy_ranges with a fence): count itself in, unless the slot\n"
                              "is cancelled (False).");
static PyObject *fence_enter(PyObject *self, PyObject *args) { return fence_call(args, FENCE_OP_ENTER); }

PyDoc_STRVAR(fence_exit_doc, "fence_exit(board, slot) -> None\n\nWhat a copy job does last: count itself out.");
static PyObject *fence_exit(PyObject *self, PyObject *args) { return fence_call(args, FENCE_OP_EXIT); }

PyDoc_STRVAR(checksums_doc,
             "checksums(buf, offsets, size, sums) -> None\n\n"
             "sums[i] = xxh3-64 of buf[offsets[i] : offsets[i] + size] for each i, the GIL released: what a page\n"
             "header keeps of a page copied into the pool by other means (a CUDA copy). `offsets` and `sums` are\n"
             "C-contiguous buffers of uint64 of one length, `sums` writable; ValueError for a range outside `buf`.");
static PyObject *checksums(PyObject *self, PyObject *args) {
    Py_buffer buf = {0}, off = {0}, sums = {0};
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "y*y*nw*", &buf, &off, &size, &sums)) return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = off.len / 8;
    if (off.len % 8 || sums.len != off.len || (uintptr_t)off.buf % 8 || (uintptr_t)sums.buf % 8 || size < 0) {
        PyErr_SetString(PyExc_ValueError, "offsets and sums must be aligned uint64 buffers of one length");
        goto done;
    }
    const uint64_t *o = off.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (o[i] > (uint64_t)buf.len || (uint64_t)size > (uint64_t)buf.len - o[i]) {
            PyErr_Format(PyExc_ValueError, "range %zd (offset %llu, %zd bytes) is outside the buffer", i,
                         (unsigned long long)o[i], size);
            goto done;
        }
    }
    uint64_t *out_sums = sums.buf;
    const unsigned char *base = buf.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) out_sums[i] = XXH3_64bits(base + o[i], (size_t)size);
    Py_END_ALLOW_THREADS
    out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&off);
    PyBuffer_Release(&sums);
    return out;
}

PyDoc_STRVAR(bloom_doc,
             "bloom(bits, h, add) -> bool\n\n"
             "A Bloom filter of two bits a key in `bits` (a writable buffer whose length in bits is a power of\n"
             "two): the bits at h and at h >> 32 (h a signed 64-bit hash), modulo its length. Whether both were\n"
             "set; with `add` true, sets them too. What hicached.daemon.l2.index.Ghost does in Python.");
static PyObject *bloom(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "bloom(bits, h, add) takes 3 arguments");
        return NULL;
    }
    long long sh = PyLong_AsLongLong(args[1]);
    if (sh == -1 && PyErr_Occurred()) return NULL;
    int add = PyObject_IsTrue(args[2]);
    if (add < 0) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_WRITABLE) < 0) return NULL;
    uint64_t nbits = (uint64_t)b.len * 8;
    if (b.len <= 0 || (nbits & (nbits - 1)) != 0) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "a Bloom filter's length in bits must be a power of two");
        return NULL;
    }
    uint64_t h = (uint64_t)sh, m = nbits - 1, i = h & m, j = (h >> 32) & m;
    unsigned char *p = b.buf;
    int was = ((p[i >> 3] >> (i & 7)) & (p[j >> 3] >> (j & 7)) & 1) != 0;
    if (add) {
        p[i >> 3] |= (unsigned char)(1u << (i & 7));
        p[j >> 3] |= (unsigned char)(1u << (j & 7));
    }
    PyBuffer_Release(&b);
    return PyBool_FromLong(was);
}

PyDoc_STRVAR(copy_ranges_doc,
             "copy_ranges(pool, region, pool_off, region_off, length, to_pool[, page_bytes, sums, guard, fence,\n"
             "            fence_slot]) -> None | bool\n\n"
             "Copies byte ranges between `region` and `pool` (into the pool with to_pool): range i is\n"
             "region[region_off[i]:+length[i]] <-> pool[pool_off[i]:+length[i]]. The three are int64 arrays\n"
             "of one length (hicached.common.geometry.Plan). Every range is checked against both buffers before\n"
             "any byte moves (IndexError); then one loop with the GIL released, streaming stores into the pool\n"
             "as copy_pages. The daemon's host copier: a numpy copyto per range costs ~1.5 us.\n"
             "With `sums` (into the pool only: a writable buffer of one uint64 a page), the ranges are whole\n"
             "pages of `page_bytes` in page-major order (a page's segments in order, as Plan makes them), and\n"
             "each page's xxh3-64 is taken as it is copied, from the source while it is in the CPU cache (one\n"
             "pass with the copy where a page is one range and the CPU has AVX2).\n"
             "With `guard` true (page_bytes 0 and sums None when there are no sums), `region` may be memory\n"
             "whose file shrinks meanwhile: a fault (SIGBUS) inside it ends the copy, which raises\n"
             "RegionShrunk (an OSError, errno EFAULT) instead of killing the process; whatever of the ranges\n"
             "was copied by then is undefined. RuntimeError when another SIGBUS handler was installed in\n"
             "front of the guard's since its first use (a fault would reach that one first).\n"
             "With `fence` (a fence board: a writable buffer of uint64 words, see fence_cancel) and `fence_slot`,\n"
             "the copy enters the slot first (its count + 1, atomically, with the GIL released) and leaves it\n"
             "after its last store; if the slot is cancelled, nothing is copied. Returns then whether it copied.");

static int int64_array(Py_buffer *b, const char *what, Py_ssize_t *n) {
    if (b->len % 8 != 0 || (b->itemsize != 8 && b->itemsize != 1)) {
        PyErr_Format(PyExc_ValueError, "%s must be an array of int64", what);
        return -1;
    }
    if (*n >= 0 && b->len / 8 != *n) {
        PyErr_SetString(PyExc_ValueError, "pool_off, region_off and length must have one length");
        return -1;
    }
    *n = b->len / 8;
    return 0;
}

#define HASH_CHUNK (64 << 10) /* copied then hashed while the source is still in the L2 cache */
#define PAGE_RUNS 256         /* a page of more runs than this (per-layer slices) is copied a chunk at a time */

/* The copy of copy_ranges with `sums`: each page's xxh3-64 taken as its bytes are copied. 0, or -1 when the
   ranges do not make whole pages (nothing is hashed past that). A page is the runs the ranges give it, in
   order: in one pass over each (pageio_copy_hash_runs_avx2) where the CPU and the runs' lengths allow, else
   a chunk at a time, copied then hashed while it is in the cache. */
static int copy_hashing(stream_fn fn, char *pool, const char *region, const int64_t *pool_off,
                        const int64_t *region_off, const int64_t *length, Py_ssize_t n, size_t page_bytes,
                        uint64_t *sum, Py_ssize_t pages) {
    char *dst[PAGE_RUNS];
    const char *src[PAGE_RUNS];
    size_t len[PAGE_RUNS];
    Py_ssize_t i = 0; /* the ranges' cursor: range i, `at` bytes into it */
    size_t at = 0;
    for (Py_ssize_t page = 0; page < pages; page++) {
        size_t runs = 0, left = page_bytes;
        Py_ssize_t ci = i;
        size_t cat = at;
        while (left > 0) { /* this page's runs, as far as PAGE_RUNS */
            if (ci >= n) return -1;
            size_t k = (size_t)length[ci] - cat, take = k < left ? k : left;
            if (runs < PAGE_RUNS) {
                dst[runs] = pool + pool_off[ci] + cat, src[runs] = region + region_off[ci] + cat, len[runs] = take;
            }
            runs++, left -= take, cat += take;
            if (cat == (size_t)length[ci]) ci++, cat = 0;
        }
#if defined(__x86_64__)
        if (fn == pageio_stream_avx2 && runs <= PAGE_RUNS &&
            pageio_copy_hash_runs_avx2(dst, src, len, runs, &sum[page])) {
            i = ci, at = cat;
            continue;
        }
#endif
        XXH3_state_t state;
        XXH3_INITSTATE(&state);
        XXH3_64bits_reset(&state);
        for (left = page_bytes; left > 0;) {
            size_t k = (size_t)length[i] - at, take = k < left ? k : left;
            if (take > HASH_CHUNK) take = HASH_CHUNK;
            char *p = pool + pool_off[i] + at;
            const char *r = region + region_off[i] + at;
            if (fn != NULL && take >= STREAM_MIN_BYTES)
                copy_streaming(fn, p, r, take);
            else
                memcpy(p, r, take);
            XXH3_64bits_update(&state, r, take);
            left -= take, at += take;
            if (at == (size_t)length[i]) i++, at = 0;
        }
        sum[page] = XXH3_64bits_digest(&state);
    }
    while (i < n && length[i] == 0) i++;
    return i == n ? 0 : -1;
}

/* The loop of copy_ranges, with the GIL released: 0, or -1 as copy_hashing. */
typedef struct {
    stream_fn fn;
    char *pool, *region;
    const int64_t *pool_off, *region_off, *length;
    Py_ssize_t n;
    int to_pool;
    size_t page_bytes;
    uint64_t *sum; /* NULL: no sums */
    Py_ssize_t pages;
} Ranges;

static int ranges_copy(const Ranges *c) {
    if (c->sum != NULL)
        return copy_hashing(c->fn, c->pool, c->region, c->pool_off, c->region_off, c->length, c->n, c->page_bytes,
                            c->sum, c->pages);
    for (Py_ssize_t i = 0; i < c->n; i++) {
        char *p = c->pool + c->pool_off[i], *r = c->region + c->region_off[i];
        size_t k = (size_t)c->length[i];
        if (!c->to_pool)
            memcpy(r, p, k);
        else if (c->fn != NULL && k >= STREAM_MIN_BYTES)
            copy_streaming(c->fn, p, r, k);
        else
            memcpy(p, r, k);
    }
    return 0;
}

/* Guarded copies. An engine's memory may be a memfd it did not seal: when its file shrinks, the first access
   past the new end raises SIGBUS, whose default action kills the daemon. A guarded copy_ranges call puts the
   region's address range and a jump buffer in a slot of its thread; the SIGBUS handler, installed at the
   first guarded copy in front of whatever handler was there, jumps back into that copy when a fault is on
   that thread inside that range, and the call raises RegionShrunk. Any other SIGBUS goes on to the handler
   that was there before, or gets the default action: a real bug still kills the process.

   The slots are a table keyed by thread id, not thread-local storage: the TLS of a dlopen'ed module may be
   allocated (malloc) on a thread's first use of it, which a signal handler must never cause. The handler
   does only async-signal-safe things (gettid, loads, siglongjmp; sigaction and raise on the way out), and
   what it jumps out of holds no lock and touches no Python object: the copy runs with the GIL released,
   and the call takes the GIL back only after the jump. copy_hashing's hash state lives on the abandoned
   stack; the sums of a faulted call are not used. */
#define GUARD_SLOTS 1024 /* threads in a guarded copy at once (the daemon runs regions.copy_threads) */

typedef struct {
    sigjmp_buf env;
    const char *lo, *hi;        /* the guarded bytes, widened to whole pages */
    const char *volatile fault; /* set by the handler: where the fault was */
    volatile sig_atomic_t armed;
} Guard;

typedef struct {
    pid_t tid; /* the thread in a guarded copy; 0: free */
    Guard *guard;
} GuardSlot;

static GuardSlot guard_slots[GUARD_SLOTS];
static struct sigaction guard_prev; /* the SIGBUS action before ours: faults that are not ours go there */
static int guard_installed;         /* with the GIL */
static size_t page_size = 4096;     /* sysconf's, at import */
static PyObject *RegionShrunk;

static void guard_on_sigbus(int sig, siginfo_t *info, void *ctx) {
    int saved_errno = errno;
    if (info != NULL && info->si_code > 0) { /* a fault the kernel raised, not a signal a process sent */
        pid_t tid = (pid_t)syscall(SYS_gettid);
        const char *addr = info->si_addr;
        for (size_t i = 0; i < GUARD_SLOTS; i++) {
            if (__atomic_load_n(&guard_slots[i].tid, __ATOMIC_ACQUIRE) != tid) continue;
            Guard *g = __atomic_load_n(&guard_slots[i].guard, __ATOMIC_ACQUIRE);
            if (g != NULL && g->armed && addr >= g->lo && addr < g->hi) {
                g->armed = 0;
                g->fault = addr;
                siglongjmp(g->env, 1); /* restores the mask sigsetjmp saved: SIGBUS is unblocked again */
            }
        }
    }
    errno = saved_errno;
    if (guard_prev.sa_flags & SA_SIGINFO) {
        guard_prev.sa_sigaction(sig, info, ctx);
    } else if (guard_prev.sa_handler != SIG_DFL && guard_prev.sa_handler != SIG_IGN) {
        guard_prev.sa_handler(sig);
    } else { /* the default action, as if we had never been here: the process dies of SIGBUS */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigemptyset(&dfl.sa_mask);
        sigaction(sig, &dfl, NULL);
        raise(sig); /* blocked in here: delivered as the handler returns (a fault would also recur) */
    }
}

/* With the GIL: 0 once the handler is in place; -1 with an exception when another handler went in front of
   ours since we installed it. That one would see a guarded fault first (Python's faulthandler would print a
   fatal error, then re-raise it as a signal we cannot place), so the copy is refused rather than risked. A
   handler that was taken away (SIG_DFL or SIG_IGN now: faulthandler.disable() restores what it found) is
   put back, with nothing to chain to. */
static int guard_ready(void) {
    struct sigaction cur;
    if (sigaction(SIGBUS, NULL, &cur) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == guard_on_sigbus) return 0;
    int plain = !(cur.sa_flags & SA_SIGINFO) && (cur.sa_handler == SIG_DFL || cur.sa_handler == SIG_IGN);
    if (guard_installed && !plain) {
        PyErr_SetString(PyExc_RuntimeError,
                        "another SIGBUS handler was installed in front of the one that guarded copies need; a "
                        "fault in memory that shrank would reach it first, so guarded copies are refused");
        return -1;
    }
    struct sigaction act;
    memset(&act, 0, sizeof act);
    act.sa_sigaction = guard_on_sigbus;
    act.sa_flags = SA_SIGINFO;
    sigemptyset(&act.sa_mask);
    if (sigaction(SIGBUS, &act, &guard_prev) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    guard_installed = 1;
    return 0;
}

static GuardSlot *guard_claim(Guard *g) {
    pid_t tid = (pid_t)syscall(SYS_gettid);
    for (size_t i = 0; i < GUARD_SLOTS; i++) {
        pid_t none = 0;
        if (__atomic_compare_exchange_n(&guard_slots[i].tid, &none, tid, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
            __atomic_store_n(&guard_slots[i].guard, g, __ATOMIC_RELEASE);
            return &guard_slots[i];
        }
    }
    return NULL;
}

static void guard_release(GuardSlot *slot) {
    __atomic_store_n(&slot->guard, NULL, __ATOMIC_RELEASE);
    __atomic_store_n(&slot->tid, 0, __ATOMIC_RELEASE);
}

/* ranges_copy(c) under guard `g`, its slot claimed: 1 when a fault in the guarded range ended it (g->fault
   says where), else 0 with *bad as ranges_copy answered. sigsetjmp is here so that its frame outlives the
   copy; nothing this frame changes after it is read after the jump. */
static int ranges_copy_guarded(const Ranges *c, Guard *g, int *bad) {
    if (sigsetjmp(g->env, 1) != 0) return 1;
    g->armed = 1;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    *bad = ranges_copy(c);
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    g->armed = 0;
    return 0;
}

static PyObject *copy_ranges(PyObject *self, PyObject *args) {
    PyObject *pool_obj, *region_obj, *sums_obj = Py_None, *fence_obj = Py_None;
    Py_buffer pool = {0}, region = {0}, po = {0}, ro = {0}, ln = {0}, sums = {0}, fence = {0};
    Py_ssize_t page_bytes = 0, fence_slot = 0;
    int to_pool, guard = 0;
    if (!PyArg_ParseTuple(args, "OOy*y*y*p|nOpOn", &pool_obj, &region_obj, &po, &ro, &ln, &to_pool, &page_bytes,
                          &sums_obj, &guard, &fence_obj, &fence_slot))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t n = -1;
    uint64_t *fence_w = NULL;
    if (fence_obj != Py_None) {
        if (PyObject_GetBuffer(fence_obj, &fence, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
        if ((fence_w = fence_word(&fence, fence_slot)) == NULL) goto done;
    }
    if (int64_array(&po, "pool_off", &n) < 0 || int64_array(&ro, "region_off", &n) < 0 ||
        int64_array(&ln, "length", &n) < 0)
        goto done;
    if (sums_obj != Py_None) {
        if (!to_pool || page_bytes <= 0) {
            PyErr_SetString(PyExc_ValueError, "sums are taken of whole pages copied into the pool");
            goto done;
        }
        if (PyObject_GetBuffer(sums_obj, &sums, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
        if (sums.len % 8 != 0) {
            PyErr_SetString(PyExc_ValueError, "sums must be a buffer of uint64");
            goto done;
        }
    }
    if (PyObject_GetBuffer(pool_obj, &pool, (to_pool ? PyBUF_WRITABLE : PyBUF_SIMPLE) | PyBUF_C_CONTIGUOUS) < 0 ||
        PyObject_GetBuffer(region_obj, &region, (to_pool ? PyBUF_SIMPLE : PyBUF_WRITABLE) | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    const int64_t *pool_off = po.buf, *region_off = ro.buf, *length = ln.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t q = pool_off[i], r = region_off[i], k = length[i];
        if (k < 0 || q < 0 || r < 0 || q > pool.len - k || r > region.len - k) {
            PyErr_Format(PyExc_IndexError,
                         "range %zd (pool %lld, region %lld, %lld bytes) falls outside the pool (%zd bytes) or "
                         "the region (%zd bytes)", i, (long long)q, (long long)r, (long long)k, pool.len, region.len);
            goto done;
        }
    }
    if (guard && guard_ready() < 0) goto done;
    stream_fn fn = to_pool ? stream_copy : NULL;
    Ranges c = {fn, pool.buf, region.buf, pool_off, region_off, length, n, to_pool, (size_t)page_bytes,
                sums.obj != NULL ? sums.buf : NULL, sums.len / 8};
    Guard g = {.fault = NULL, .armed = 0};
    int bad = 0, faulted = 0, no_slot = 0, entered = 1;
    Py_BEGIN_ALLOW_THREADS
    if (fence_w != NULL && !(entered = fence_in(fence_w))) {
        /* cancelled: the engine may have given the memory back; not a byte is touched */
    } else if (!guard) {
        bad = ranges_copy(&c);
    } else {
        uintptr_t lo = (uintptr_t)region.buf, hi = lo + (uintptr_t)region.len;
        g.lo = (const char *)(lo - lo % page_size);
        g.hi = (const char *)(hi + (page_size - hi % page_size) % page_size); /* pages of the same mapping */
        GuardSlot *slot = guard_claim(&g);
        if (slot == NULL) {
            no_slot = 1;
        } else {
            faulted = ranges_copy_guarded(&c, &g, &bad);
            guard_release(slot);
        }
    }
    if (fn != NULL && entered) stream_fence(); /* after a fault too: the stores made before it */
    if (fence_w != NULL && entered) fence_out(fence_w); /* after the last store, fault or not */
    Py_END_ALLOW_THREADS
    if (no_slot) {
        PyErr_Format(PyExc_RuntimeError, "more than %d threads in guarded copies at once", GUARD_SLOTS);
        goto done;
    }
    if (faulted) {
        Py_ssize_t at = g.fault - (const char *)region.buf;
        PyObject *e = Py_BuildValue("(iN)", EFAULT,
                                    PyUnicode_FromFormat("the region's memory is gone from byte %zd of its %zd: its "
                                                         "file shrank under the mapping (SIGBUS)",
                                                         at < 0 ? 0 : at, region.len));
        if (e != NULL) {
            PyErr_SetObject(RegionShrunk, e);
            Py_DECREF(e);
        }
        goto done;
    }
    if (bad) {
        PyErr_Format(PyExc_ValueError, "the ranges do not make %zd whole pages of %zd bytes", sums.len / 8, page_bytes);
        goto done;
    }
    out = fence_w != NULL ? PyBool_FromLong(entered) : Py_NewRef(Py_None);
done:
    if (fence.obj != NULL) PyBuffer_Release(&fence);
    if (pool.obj != NULL) PyBuffer_Release(&pool);
    if (region.obj != NULL) PyBuffer_Release(&region);
    if (sums.obj != NULL) PyBuffer_Release(&sums);
    PyBuffer_Release(&po);
    PyBuffer_Release(&ro);
    PyBuffer_Release(&ln);
    return out;
}

static PyMethodDef methods[] = {
    {"read_pages", read_pages, METH_VARARGS, read_pages_doc},
    {"write_pages", write_pages, METH_VARARGS, write_pages_doc},
    {"copy_pages", copy_pages, METH_VARARGS, copy_pages_doc},
    {"stream_impl", stream_impl, METH_VARARGS, stream_impl_doc},
    {"copy_ranges", copy_ranges, METH_VARARGS, copy_ranges_doc},
    {"fence_cancel", fence_cancel, METH_VARARGS, fence_cancel_doc},
    {"fence_count", fence_count, METH_VARARGS, fence_count_doc},
    {"fence_enter", fence_enter, METH_VARARGS, fence_enter_doc},
    {"fence_exit", fence_exit, METH_VARARGS, fence_exit_doc},
    {"checksums", checksums, METH_VARARGS, checksums_doc},
    {"bloom", (PyCFunction)(void (*)(void))bloom, METH_FASTCALL, bloom_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "hicached.common._pageio", "Page file I/O for the file connector, on threads that never take the GIL.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pageio(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    stream_copy = stream_lookup(stream_default());
    snprintf(stream_name, sizeof stream_name, "%s", stream_copy ? stream_default() : "");
    if (PyType_Ready(&EngineType) < 0 || PyModule_AddObjectRef(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    long pagesize = sysconf(_SC_PAGESIZE);
    if (pagesize > 0) page_size = (size_t)pagesize;
    if (RegionShrunk == NULL)
        RegionShrunk = PyErr_NewExceptionWithDoc(
            "hicached.common._pageio.RegionShrunk",
            "A guarded copy_ranges found the region's memory gone: its file shrank under the mapping.",
            PyExc_OSError, NULL);
    if (RegionShrunk == NULL || PyModule_AddObjectRef(m, "RegionShrunk", RegionShrunk) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "VERSION", FORMAT_VERSION) < 0 ||
        PyModule_AddObject(m, "MAGIC", PyBytes_FromStringAndSize(MAGIC, 4)) < 0 ||
        PyModule_AddIntConstant(m, "CANCELLED", RESULT_CANCELLED) < 0 ||
        PyModule_AddIntConstant(m, "SHORT", RESULT_SHORT) < 0 || PyModule_AddIntConstant(m, "MAGIC_BAD", RESULT_MAGIC) < 0 ||
        PyModule_AddIntConstant(m, "VERSION_BAD", RESULT_VERSION) < 0 ||
        PyModule_AddIntConstant(m, "LENGTH_BAD", RESULT_LENGTH) < 0 || PyModule_AddIntConstant(m, "KEY_BAD", RESULT_KEY) < 0 ||
        PyModule_AddIntConstant(m, "CHECKSUM_BAD", RESULT_CHECKSUM) < 0 ||
        PyModule_AddIntConstant(m, "BAD_KEY", RESULT_BAD_KEY) < 0 || PyModule_AddIntConstant(m, "API", API_VERSION) < 0 ||
        PyModule_AddIntConstant(m, "CHANGED", RESULT_CHANGED) < 0 ||
        PyModule_AddIntConstant(m, "NOT_PAGE", RESULT_NOT_PAGE) < 0 ||
        PyModule_AddIntConstant(m, "MISFIT", RESULT_MISFIT) < 0 ||
        PyModule_AddIntConstant(m, "FENCES", FENCE_VERSION) < 0 ||
        PyModule_AddIntConstant(m, "KEY_MAX_LEN", KEY_MAX_LEN) < 0 ||
        PyModule_AddIntConstant(m, "NAMESPACE_MAX_LEN", NAMESPACE_MAX_LEN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
