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
#endif

#endif
