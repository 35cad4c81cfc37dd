/* hicached/common/_pageio_simd.c: built for AVX2, called only where the CPU has it. */
#ifndef HICACHED_PAGEIO_SIMD_H
#define HICACHED_PAGEIO_SIMD_H

#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__)
/* Streaming stores: n a multiple of 128, dst 32-byte aligned. */
void pageio_stream_avx2(char *dst, const char *src, size_t n);

/* Copies len bytes from src to dst (streaming stores where dst is 32-byte aligned) and returns
   XXH3_64bits(src, len), reading src once. */
uint64_t pageio_copy_hash_avx2(char *dst, const char *src, size_t len);

/* xxh3's long loop takes its input in blocks of this many bytes (the default secret). */
#define PAGEIO_HASH_BLOCK 1024

/* Copies the n runs src[i] -> dst[i] (len[i] bytes each) and sets *out to XXH3_64bits of the runs one after
   the other, reading each source once: 1, or 0 (nothing copied) unless every run but the last is a multiple
   of PAGEIO_HASH_BLOCK, the last has 64 bytes or more and the whole more than 240 (xxh3's short inputs). */
int pageio_copy_hash_runs_avx2(char *const *dst, const char *const *src, const size_t *len, size_t n,
                               uint64_t *out);
#endif

#endif
