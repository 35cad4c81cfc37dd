/* connectors._pageio: the file connector's page I/O for a whole job, with the GIL released once.

   read_pages and write_pages do what FileConnector._read_one / _write_one do in Python (connectors/file.py):
   open, preadv / pwritev straight between the file and the caller's buffers, the xxh3-64 of each 256 KiB
   chunk while it is in the CPU cache, the page header of connectors/header.py, temporary name and rename.
   In Python every page costs several GIL hand-offs between threads that share two or four CPUs; here a
   job of many pages costs one. The Python code stays the reference: file.py uses this module only when
   it imports and its header constants match, and the tests run both paths against the same files.

   The page files' names are made here too, as FileConnector._path and _tmp_path make them: a job's Python
   work is then one call, not a name a page built with the GIL held (~0.7 us a page, while the event loop
   waits for the GIL).

   Result codes, one per page: 0 done, > 0 an errno, < 0 one of the RESULT_* values below. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
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
    RESULT_BAD_KEY = -8, /* not a valid key (hicached/keys.py): no file is touched */
};

/* Bumped when a function's arguments change: file.py uses only a build of the sources it was written for. */
#define API_VERSION 2

#define KEY_MAX_LEN 128 /* hicached/keys.py */
#define NAMESPACE_MAX_LEN 128

typedef struct {
    char *path; /* the page file's name (PyMem) */
    char *tmp;  /* writes: the temporary name it is written under first (PyMem) */
    const char *key; /* UTF-8 of the key (the str is kept alive by the caller's list, referenced below) */
    Py_ssize_t key_len;
    Py_buffer buf;
    int result;
    int64_t replaced; /* writes: bytes of the page file the rename replaced */
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
   would remove a good page). batch_init bounds both names, so the buffer always holds them. */
static int key_tag(const char *ns, size_t ns_len, const char *key, size_t key_len, uint64_t *tag) {
    char buf[NAMESPACE_MAX_LEN + 1 + KEY_MAX_LEN];
    size_t n = ns_len + 1 + key_len;
    if (n > sizeof buf) return ENAMETOOLONG;
    memcpy(buf, ns, ns_len);
    buf[ns_len] = '/';
    memcpy(buf + ns_len + 1, key, key_len);
    *tag = XXH3_64bits(buf, n);
    return 0;
}

/* preadv / pwritev until every byte moved, end of file, or an error: bytes moved, or -errno. The usual case
   is one call; the loop runs only after a short transfer. */
static ssize_t xfer(int fd, struct iovec *iov, int cnt, off_t offset, int write) {
    ssize_t total = 0;
    while (cnt > 0) {
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

static int read_one(Job *j, const char *ns, size_t ns_len, size_t chunk, double touch_after, int64_t *removed) {
    if (j->path == NULL) return RESULT_BAD_KEY;
    const char *path = j->path;
    uint64_t tag;
    int err = key_tag(ns, ns_len, j->key, (size_t)j->key_len, &tag);
    if (err) return err;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return errno;
    uint8_t head[HEADER_SIZE];
    uint8_t *dest = j->buf.buf;
    size_t size = (size_t)j->buf.len, first = size < chunk ? size : chunk;
    uint64_t actual;
    struct iovec iov[2] = {{head, HEADER_SIZE}, {dest, first}};
    ssize_t got = xfer(fd, iov, 2, 0, 0);
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
            struct iovec part = {dest + start, n};
            ssize_t r = xfer(fd, &part, 1, (off_t)(HEADER_SIZE + start), 0);
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
    else if (get_u64(head + 8) != size)
        result = RESULT_LENGTH;
    else if (get_u64(head + 24) != tag)
        result = RESULT_KEY;
    else if ((size_t)got != HEADER_SIZE + size)
        result = RESULT_LENGTH;
    else if (get_u64(head + 16) != actual)
        result = RESULT_CHECKSUM;
    if (result != 0) {
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

/* The shard directories of a page file (root/namespace/k0k1/k2k3/key) that are missing, as
   FileConnector._make_shard makes them: up to the namespace's directory, never the root (a missing root
   stays ENOENT, and fails the call in Python). Made here, one job's new shards cost a few system calls
   each instead of a return to Python and a second call: with 65536 shards, most pages of a fresh tree
   open one. 0 or an errno. */
static int make_shard(const char *path, size_t root_len, size_t ns_len) {
    /* Where each directory's name ends: the namespace's, k0k1's and k2k3's. */
    const size_t ends[3] = {root_len + 1 + ns_len, root_len + 1 + ns_len + 3, root_len + 1 + ns_len + 6};
    char buf[4096];
    if (ends[2] >= sizeof buf) return ENAMETOOLONG;
    memcpy(buf, path, ends[2]);
    buf[ends[2]] = '\0';
    int level = 2;
    for (;; level--) { /* up, until a directory is made or found */
        buf[ends[level]] = '\0';
        if (mkdir(buf, 0700) == 0 || errno == EEXIST) break;
        if (errno != ENOENT || level == 0) return errno;
    }
    for (level++; level <= 2; level++) { /* then down again */
        buf[ends[level - 1]] = '/';
        if (mkdir(buf, 0700) != 0 && errno != EEXIST) return errno;
    }
    return 0;
}

static int write_one(Job *j, const char *ns, size_t ns_len, size_t root_len, size_t chunk, int do_fsync,
                     int measure) {
    if (j->path == NULL) return RESULT_BAD_KEY;
    const char *tmp = j->tmp, *final = j->path;
    uint64_t tag;
    int err = key_tag(ns, ns_len, j->key, (size_t)j->key_len, &tag);
    if (err) return err;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0 && errno == ENOENT && (err = make_shard(j->path, root_len, ns_len)) == 0)
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) return err ? err : errno;
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
        r = xfer(fd, &part, 1, (off_t)(HEADER_SIZE + start), 1);
        if (r >= 0 && (size_t)r != n) r = -EIO;
        if (r >= 0) XXH3_64bits_update(&state, payload + start, n);
    }
    if (r >= 0) {
        put_u64(head + 16, XXH3_64bits_digest(&state));
        struct iovec iov = {head, HEADER_SIZE};
        r = xfer(fd, &iov, 1, 0, 1);
        if (r >= 0 && r != HEADER_SIZE) r = -EIO;
    }
    if (r >= 0 && do_fsync && fsync(fd) != 0) r = -errno;
    if (close(fd) != 0 && r >= 0) r = -errno;
    if (r >= 0) {
        struct stat st;
        j->replaced = measure && lstat(final, &st) == 0 ? (int64_t)st.st_size : 0;
        if (rename(tmp, final) == 0) return 0;
        r = -errno;
    }
    unlink(tmp);
    return (int)-r;
}

/* Arguments shared by both calls, checked and turned into Jobs with the GIL held. */
typedef struct {
    Job *jobs;
    Py_ssize_t n;
    PyObject *keys; /* a new reference to the list, so the key strings live while the GIL is released */
} Batch;

static void batch_free(Batch *b) {
    for (Py_ssize_t i = 0; i < b->n; i++) {
        Job *j = &b->jobs[i];
        PyMem_Free(j->path);
        PyMem_Free(j->tmp);
        if (j->buf.obj != NULL) PyBuffer_Release(&j->buf);
    }
    PyMem_Free(b->jobs);
    Py_XDECREF(b->keys);
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

static int batch_init(Batch *b, const char *ns, Py_ssize_t ns_len, PyObject *keys, PyObject *root, PyObject *tag,
                      PyObject *bufs, int writable, Py_ssize_t chunk) {
    memset(b, 0, sizeof *b);
    if (chunk <= 0) {
        PyErr_SetString(PyExc_ValueError, "chunk must be positive");
        return -1;
    }
    if (!PyList_Check(keys) || !PyList_Check(bufs) || !PyBytes_Check(root) || (tag && !PyBytes_Check(tag))) {
        PyErr_SetString(PyExc_TypeError, "keys and buffers must be lists, root and tag bytes");
        return -1;
    }
    if (!valid_name(ns, ns_len, NAMESPACE_MAX_LEN, 1)) {
        PyErr_SetString(PyExc_ValueError, "invalid namespace");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(bufs) != n) {
        PyErr_SetString(PyExc_ValueError, "keys and buffers differ in length");
        return -1;
    }
    b->keys = PyList_GetSlice(keys, 0, n); /* a copy: the caller's list may change meanwhile */
    if (b->keys == NULL) return -1;
    b->jobs = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Job));
    if (b->jobs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Job *j = &b->jobs[i];
        b->n = i + 1; /* batch_free releases what this job holds so far if it fails half-way */
        PyObject *key = PyList_GET_ITEM(b->keys, i);
        if (!PyUnicode_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "keys must be str");
            return -1;
        }
        j->key = PyUnicode_AsUTF8AndSize(key, &j->key_len);
        if (j->key == NULL) return -1;
        int flags = writable ? PyBUF_WRITABLE : PyBUF_SIMPLE;
        if (PyObject_GetBuffer(PyList_GET_ITEM(bufs, i), &j->buf, flags | PyBUF_C_CONTIGUOUS) != 0) return -1;
        if (!valid_name(j->key, j->key_len, KEY_MAX_LEN, 0)) continue; /* no names: RESULT_BAD_KEY */
        if (make_names(j, PyBytes_AS_STRING(root), PyBytes_GET_SIZE(root), ns, ns_len,
                       tag ? PyBytes_AS_STRING(tag) : NULL, tag ? PyBytes_GET_SIZE(tag) : 0) != 0)
            return -1;
    }
    return 0;
}

static PyObject *results_list(Batch *b) {
    PyObject *out = PyList_New(b->n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        PyObject *v = PyLong_FromLong(b->jobs[i].result);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* The (results, total) answer of a call, when the batch ran; frees the batch and the stop buffer either way. */
static PyObject *answer(Batch *b, int ran, int64_t total, Py_buffer *stop) {
    PyObject *out = NULL;
    if (ran) {
        PyObject *results = results_list(b);
        if (results != NULL) out = Py_BuildValue("(NL)", results, (long long)total);
    }
    batch_free(b);
    PyBuffer_Release(stop);
    return out;
}

static int stopped(const Py_buffer *stop) { return stop->len > 0 && ((volatile const char *)stop->buf)[0] != 0; }

PyDoc_STRVAR(read_pages_doc,
             "read_pages(namespace, keys, root, buffers, chunk, stop, touch_after) -> (results, removed_bytes)\n\n"
             "Reads each page file (under root, a bytes path, named as FileConnector._path names it) into its\n"
             "buffer and verifies its header and checksum. A page that does not verify is removed if the file\n"
             "is still the one read. stop: a buffer whose first byte, once non-zero, cancels the pages not yet\n"
             "begun. touch_after < 0: never mark pages used.");

static PyObject *read_pages(PyObject *self, PyObject *args) {
    const char *ns;
    Py_ssize_t ns_len, chunk;
    PyObject *keys, *root, *bufs;
    Py_buffer stop;
    double touch_after;
    if (!PyArg_ParseTuple(args, "s#OOOny*d", &ns, &ns_len, &keys, &root, &bufs, &chunk, &stop, &touch_after))
        return NULL;
    Batch b;
    int ran = batch_init(&b, ns, ns_len, keys, root, NULL, bufs, 1, chunk) == 0;
    int64_t removed = 0;
    if (ran) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < b.n; i++)
            b.jobs[i].result = stopped(&stop) ? RESULT_CANCELLED
                                              : read_one(&b.jobs[i], ns, (size_t)ns_len, (size_t)chunk, touch_after, &removed);
        Py_END_ALLOW_THREADS
    }
    return answer(&b, ran, removed, &stop);
}

PyDoc_STRVAR(write_pages_doc,
             "write_pages(namespace, keys, root, tag, payloads, chunk, stop, fsync, measure) -> (results, added_bytes)\n\n"
             "Writes each payload with its header under a temporary name (with `tag`, bytes, as\n"
             "FileConnector._tmp_path makes it) and renames it to its page file under root. added_bytes: by how\n"
             "much the written pages grew the tree (with measure, the sizes of files replaced are subtracted).\n"
             "A temporary file is removed when its page fails.");

static PyObject *write_pages(PyObject *self, PyObject *args) {
    const char *ns;
    Py_ssize_t ns_len, chunk;
    PyObject *keys, *root, *tag, *bufs;
    Py_buffer stop;
    int do_fsync, measure;
    if (!PyArg_ParseTuple(args, "s#OOOOny*pp", &ns, &ns_len, &keys, &root, &tag, &bufs, &chunk, &stop, &do_fsync,
                          &measure))
        return NULL;
    Batch b;
    int ran = batch_init(&b, ns, ns_len, keys, root, tag, bufs, 0, chunk) == 0;
    int64_t added = 0;
    if (ran) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < b.n; i++) {
            Job *j = &b.jobs[i];
            j->result = stopped(&stop) ? RESULT_CANCELLED : write_one(j, ns, (size_t)ns_len, (size_t)PyBytes_GET_SIZE(root), (size_t)chunk,
                                                                      do_fsync, measure);
            if (j->result == 0) added += HEADER_SIZE + (int64_t)j->buf.len - j->replaced;
        }
        Py_END_ALLOW_THREADS
    }
    return answer(&b, ran, added, &stop);
}

PyDoc_STRVAR(copy_pages_doc,
             "copy_pages(pool, offsets, size, pages, into_pool) -> None\n\n"
             "Copies `size` bytes between each page buffer and the pool at its offset (into the pool with\n"
             "into_pool, out of it otherwise), every page with the GIL released once. The client's store and\n"
             "load: one call a segment instead of a numpy view and a copyto per page (~2 us each). Every\n"
             "buffer and offset is checked before any byte moves.");

static PyObject *copy_pages(PyObject *self, PyObject *args) {
    Py_buffer pool;
    PyObject *offsets, *pages;
    Py_ssize_t size;
    int into_pool;
    if (!PyArg_ParseTuple(args, "w*OnOp", &pool, &offsets, &size, &pages, &into_pool)) return NULL;
    PyObject *out = NULL;
    Py_buffer *bufs = NULL;
    Py_ssize_t *offs = NULL, n = 0, got = 0;
    if (!PyList_Check(offsets) || !PyList_Check(pages) || PyList_GET_SIZE(offsets) != PyList_GET_SIZE(pages)) {
        PyErr_SetString(PyExc_ValueError, "offsets and pages must be lists of one length");
        goto done;
    }
    n = PyList_GET_SIZE(pages);
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
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        char *slot = (char *)pool.buf + offs[i];
        if (into_pool)
            memcpy(slot, bufs[i].buf, (size_t)size);
        else
            memcpy(bufs[i].buf, slot, (size_t)size);
    }
    Py_END_ALLOW_THREADS
    out = Py_None;
    Py_INCREF(out);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(offs);
    PyBuffer_Release(&pool);
    return out;
}

static PyMethodDef methods[] = {
    {"read_pages", read_pages, METH_VARARGS, read_pages_doc},
    {"write_pages", write_pages, METH_VARARGS, write_pages_doc},
    {"copy_pages", copy_pages, METH_VARARGS, copy_pages_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "connectors._pageio", "Page file I/O for the file connector, one GIL release per job.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pageio(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "VERSION", FORMAT_VERSION) < 0 ||
        PyModule_AddObject(m, "MAGIC", PyBytes_FromStringAndSize(MAGIC, 4)) < 0 ||
        PyModule_AddIntConstant(m, "CANCELLED", RESULT_CANCELLED) < 0 ||
        PyModule_AddIntConstant(m, "SHORT", RESULT_SHORT) < 0 || PyModule_AddIntConstant(m, "MAGIC_BAD", RESULT_MAGIC) < 0 ||
        PyModule_AddIntConstant(m, "VERSION_BAD", RESULT_VERSION) < 0 ||
        PyModule_AddIntConstant(m, "LENGTH_BAD", RESULT_LENGTH) < 0 || PyModule_AddIntConstant(m, "KEY_BAD", RESULT_KEY) < 0 ||
        PyModule_AddIntConstant(m, "CHECKSUM_BAD", RESULT_CHECKSUM) < 0 ||
        PyModule_AddIntConstant(m, "BAD_KEY", RESULT_BAD_KEY) < 0 || PyModule_AddIntConstant(m, "API", API_VERSION) < 0 ||
        PyModule_AddIntConstant(m, "KEY_MAX_LEN", KEY_MAX_LEN) < 0 ||
        PyModule_AddIntConstant(m, "NAMESPACE_MAX_LEN", NAMESPACE_MAX_LEN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
