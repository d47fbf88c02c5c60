/*
 * SHA-256 with the x86 SHA extensions (SHA-NI), shared by the extensions that key blocks:
 * kvcache/_tokens.c (kvcache.keys.chain_keys) and router_sim/_prefetch.c (the simulator's
 * prompts keyed ahead on a second thread). Plain C: no Python object is touched, so it runs
 * with or without the GIL. KV_SHANI is defined where it can be compiled (x86, GCC or clang);
 * cpu_has_shani() says whether this CPU runs it. SHA-256 itself follows FIPS 180-4
 * (constants, padding); the round structure is the one the SHA-NI instructions define (two
 * rounds per sha256rnds2 on the ABEF/CDGH state halves).
 */
#ifndef KVCACHE_SHA256NI_H
#define KVCACHE_SHA256NI_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define KV_SHANI 1
#include <cpuid.h>
#include <immintrin.h>

/* FIPS 180-4 section 4.2.2 */
static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

/* FIPS 180-4 section 5.3.3 */
static const uint32_t H256[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

/* Compress nblocks 64-byte blocks of p into h (a..h in h[0..7]). */
__attribute__((target("sha,sse4.1,ssse3"))) static void
shani_compress(uint32_t h[8], const uint8_t *p, size_t nblocks)
{
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i dcba = _mm_loadu_si128((const __m128i *)&h[0]);
    __m128i hgfe = _mm_loadu_si128((const __m128i *)&h[4]);
    __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
    __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
    __m128i abef = _mm_alignr_epi8(cdab, efgh, 8);
    __m128i cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
    for (; nblocks; nblocks--, p += 64) {
        __m128i abef0 = abef, cdgh0 = cdgh;
        __m128i w[4]; /* the last four message vectors: w[i & 3] holds words 4i..4i+3 */
        for (int i = 0; i < 16; i++) {
            __m128i x;
            if (i < 4) {
                x = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), bswap);
            } else {
                /* W[t] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16], four words at once */
                x = _mm_sha256msg1_epu32(w[i & 3], w[(i + 1) & 3]);
                x = _mm_add_epi32(x, _mm_alignr_epi8(w[(i + 3) & 3], w[(i + 2) & 3], 4));
                x = _mm_sha256msg2_epu32(x, w[(i + 3) & 3]);
            }
            w[i & 3] = x;
            __m128i wk = _mm_add_epi32(x, _mm_loadu_si128((const __m128i *)&K256[4 * i]));
            cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);
            abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk, 0x0E));
        }
        abef = _mm_add_epi32(abef, abef0);
        cdgh = _mm_add_epi32(cdgh, cdgh0);
    }
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
    __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    _mm_storeu_si128((__m128i *)&h[0], _mm_blend_epi16(feba, dchg, 0xF0));
    _mm_storeu_si128((__m128i *)&h[4], _mm_alignr_epi8(dchg, feba, 8));
}

typedef struct {
    uint32_t h[8];
    uint8_t buf[64];
    size_t fill;    /* bytes waiting in buf */
    uint64_t total; /* bytes hashed so far */
} sha_ctx;

static void
sha_init(sha_ctx *c)
{
    memcpy(c->h, H256, sizeof H256);
    c->fill = 0;
    c->total = 0;
}

static void
sha_update(sha_ctx *c, const uint8_t *p, size_t n)
{
    c->total += n;
    if (c->fill) {
        size_t take = 64 - c->fill < n ? 64 - c->fill : n;
        memcpy(c->buf + c->fill, p, take);
        c->fill += take;
        p += take;
        n -= take;
        if (c->fill < 64) {
            return;
        }
        shani_compress(c->h, c->buf, 1);
        c->fill = 0;
    }
    if (n >= 64) { /* whole blocks straight from the input */
        shani_compress(c->h, p, n / 64);
        p += n & ~(size_t)63;
        n &= 63;
    }
    memcpy(c->buf, p, n);
    c->fill = n;
}

static void
sha_final(sha_ctx *c, uint8_t out[32])
{
    /* FIPS 180-4 section 5.1.1: 0x80, zeros, the bit length as 64-bit big-endian */
    uint64_t bits = c->total * 8;
    c->buf[c->fill++] = 0x80;
    if (c->fill > 56) {
        memset(c->buf + c->fill, 0, 64 - c->fill);
        shani_compress(c->h, c->buf, 1);
        c->fill = 0;
    }
    memset(c->buf + c->fill, 0, 56 - c->fill);
    for (int i = 0; i < 8; i++) {
        c->buf[56 + i] = (uint8_t)(bits >> (56 - 8 * i));
    }
    shani_compress(c->h, c->buf, 1);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(c->h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(c->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(c->h[i] >> 8);
        out[4 * i + 3] = (uint8_t)c->h[i];
    }
}

static int
cpu_has_shani(void)
{
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 19)) || !(c & (1u << 9))) {
        return 0; /* SSE4.1, SSSE3 */
    }
    if (__get_cpuid_max(0, NULL) < 7) {
        return 0;
    }
    __cpuid_count(7, 0, a, b, c, d);
    return (b >> 29) & 1; /* SHA */
}

/* key = sha256(prev[0:prev_len] || block[0:n]) into out (32 bytes; out may equal prev). */
static inline void
sha_chain_key(const uint8_t *prev, size_t prev_len, const uint8_t *block, size_t n, uint8_t out[32])
{
    sha_ctx c;
    sha_init(&c);
    sha_update(&c, prev, prev_len);
    sha_update(&c, block, n);
    sha_final(&c, out);
}
#endif /* x86 with GCC or clang */

#endif /* KVCACHE_SHA256NI_H */
