/* hicached.common._pageio, the part built for AVX2 whatever the build's target: a page copied into the pool with
   streaming stores while its xxh3-64 is taken, in one pass over the source. Called only where the CPU has
   AVX2 (_pageio.c checks at import); every other function of the module stays portable.

   The hash is XXH3_64bits(src, len) with the default secret and no seed, as the page header keeps it
   (connectors/header.py): the loop below is xxhash.h's XXH3_hashLong_internal_loop (AVX2) with every 32
   bytes loaded once, streamed out and accumulated, and the tests check it against the xxhash package.
   Measured on a 2-vCPU Xeon, 256 KiB pages: from sources in the cache, the copy alone 10.8-12.7 GB/s,
   copy then hash 6.9-7.8 GB/s, each 1 KiB block hashed then copied 9.2-11.1 GB/s, this 10.4-12.1 GB/s;
   from sources in memory 6.3-7.3 / 4.9-5.5 / 5.3-6.3 / 7.1-7.7 GB/s. A page that is several runs of the
   source (K and V of SGLang's page_first) is one xxh3 state carried from run to run, where every run but the
   last is whole blocks of the loop (1 KiB). */

#if defined(__x86_64__)

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL /* static copies of xxHash's internals, private to this file */
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#include "xxhash.h"

#include "_pageio_simd.h"

__attribute__((__target__("avx2"))) void pageio_stream_avx2(char *dst, const char *src, size_t n) {
    for (size_t i = 0; i < n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
}

static void stream_block(char *dst, const char *src, size_t n) {
    if (((uintptr_t)dst & 31) != 0 || (n & 127) != 0)
        memcpy(dst, src, n);
    else
        pageio_stream_avx2(dst, src, n);
}

/* XXH3_accumulate_512_avx2's step for one half-stripe already loaded: the same loads feed the copy. */
__attribute__((__target__("avx2"), always_inline)) static inline __m256i acc_step(__m256i acc, __m256i data,
                                                                                 const xxh_u8 *secret) {
    __m256i const key = _mm256_loadu_si256((const __m256i *)secret);
    __m256i const data_key = _mm256_xor_si256(data, key);
    __m256i const product = _mm256_mul_epu32(data_key, _mm256_srli_epi64(data_key, 32));
    __m256i const swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
    return _mm256_add_epi64(product, _mm256_add_epi64(acc, swapped));
}

/* `nb` blocks of xxh3's long loop, each copied as it is accumulated: `dst` 32-byte aligned, each 32 bytes loaded
   once, streamed out and accumulated (the two accumulator halves kept in registers through a block), so that
   the hash's arithmetic overlaps the stores; elsewhere (never in the pool's slabs) each block accumulated, then
   copied. */
__attribute__((__target__("avx2"))) static void copy_hash_blocks(xxh_u64 *acc, char *dst, const char *src,
                                                                 size_t nb) {
    const xxh_u8 *secret = XXH3_kSecret;
    size_t const secret_size = sizeof(XXH3_kSecret);
    size_t const stripes_per_block = (secret_size - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE;
    size_t const block_len = XXH_STRIPE_LEN * stripes_per_block;
    if (((uintptr_t)dst & 31) != 0) {
        for (size_t n = 0; n < nb; n++) {
            XXH3_accumulate_avx2(acc, (const xxh_u8 *)src + n * block_len, secret, stripes_per_block);
            XXH3_scrambleAcc_avx2(acc, secret + secret_size - XXH_STRIPE_LEN);
            memcpy(dst + n * block_len, src + n * block_len, block_len);
        }
        return;
    }
    __m256i a0 = _mm256_load_si256((const __m256i *)acc), a1 = _mm256_load_si256((const __m256i *)acc + 1);
    for (size_t n = 0; n < nb; n++) {
        const char *s = src + n * block_len;
        char *d = dst + n * block_len;
        for (size_t k = 0; k < stripes_per_block; k++) {
            /* A source in memory: 1 KiB ahead keeps loads in flight while the hash's arithmetic runs
               (7.2-7.7 GB/s against 5.3-5.8 without, as fast as the copy alone). Never faults. */
            _mm_prefetch(s + XXH_STRIPE_LEN * k + 1024, _MM_HINT_T0);
            __m256i const d0 = _mm256_loadu_si256((const __m256i *)(s + XXH_STRIPE_LEN * k));
            __m256i const d1 = _mm256_loadu_si256((const __m256i *)(s + XXH_STRIPE_LEN * k + 32));
            _mm256_stream_si256((__m256i *)(d + XXH_STRIPE_LEN * k), d0);
            _mm256_stream_si256((__m256i *)(d + XXH_STRIPE_LEN * k + 32), d1);
            a0 = acc_step(a0, d0, secret + XXH_SECRET_CONSUME_RATE * k);
            a1 = acc_step(a1, d1, secret + XXH_SECRET_CONSUME_RATE * k + 32);
        }
        _mm256_store_si256((__m256i *)acc, a0);
        _mm256_store_si256((__m256i *)acc + 1, a1);
        XXH3_scrambleAcc_avx2(acc, secret + secret_size - XXH_STRIPE_LEN);
        a0 = _mm256_load_si256((const __m256i *)acc);
        a1 = _mm256_load_si256((const __m256i *)acc + 1);
    }
}

__attribute__((__target__("avx2"))) int pageio_copy_hash_runs_avx2(char *const *dst, const char *const *src, const size_t *len, size_t n,
                               uint64_t *out) {
    size_t const block_len = PAGEIO_HASH_BLOCK;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (i + 1 < n && len[i] % block_len != 0) return 0;
        total += len[i];
    }
    if (n == 0 || total <= XXH3_MIDSIZE_MAX || len[n - 1] < XXH_STRIPE_LEN) return 0;
    XXH_ALIGN(XXH_ACC_ALIGN) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;
    const xxh_u8 *secret = XXH3_kSecret;
    size_t const secret_size = sizeof(XXH3_kSecret);
    for (size_t i = 0; i + 1 < n; i++) copy_hash_blocks(acc, dst[i], src[i], len[i] / block_len);
    /* The last run as xxh3 ends any input: its blocks but the last, then the stripes left and the input's last
       stripe (which overlaps them), all within this run. */
    char *d = dst[n - 1];
    const char *s = src[n - 1];
    size_t const k = len[n - 1];
    size_t const nb = (k - 1) / block_len;
    copy_hash_blocks(acc, d, s, nb);
    size_t const done = nb * block_len;
    size_t const stripes = ((k - 1) - done) / XXH_STRIPE_LEN;
    XXH3_accumulate_avx2(acc, (const xxh_u8 *)s + done, secret, stripes);
    XXH3_accumulate_512_avx2(acc, (const xxh_u8 *)s + k - XXH_STRIPE_LEN,
                             secret + secret_size - XXH_STRIPE_LEN - XXH_SECRET_LASTACC_START);
    stream_block(d + done, s + done, k - done);
    *out = XXH3_finalizeLong_64b(acc, secret, (xxh_u64)total);
    return 1;
}

__attribute__((__target__("avx2"))) uint64_t pageio_copy_hash_avx2(char *dst, const char *src, size_t len) {
    uint64_t out;
    if (pageio_copy_hash_runs_avx2(&dst, &src, &len, 1, &out)) return out;
    memcpy(dst, src, len); /* xxh3 hashes short inputs another way */
    return XXH3_64bits(src, len);
}

#endif
