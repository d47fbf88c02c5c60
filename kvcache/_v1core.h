/*
 * The V1 block hash's arithmetic (WIRE.md section 3: TensorRT-LLM's V1 BlockKeyHasher, 64-bit),
 * of kvcache/_v1hash.c, which also offers it to other extensions as a C API (a capsule; the
 * simulator's prompt thread, router_sim/sim/_prefetch.c, hashes with it). Plain C on
 * native-endian int32 tokens: no Python object is touched, so it runs with or without the GIL.
 * The readable pure-Python reference is tests/_reference.py (from WIRE.md 3).
 * Include <Python.h> (for Py_ssize_t) before this header.
 */
#ifndef KVCACHE_V1CORE_H
#define KVCACHE_V1CORE_H

#include <stdint.h>
#include <string.h>

#define M1 UINT64_C(0xbf58476d1ce4e5b9)
#define M2 UINT64_C(0x94d049bb133111eb)
#define C32 UINT32_C(0x45d9f3b)
#define G UINT32_C(0x9e3779b9)

static inline uint64_t mix32(uint32_t a, uint64_t seed) {
    a = ((a >> 16) ^ a) * C32;
    a = ((a >> 16) ^ a) * C32;
    a = (a >> 16) ^ a;
    /* a + G wraps at 32 bits before it is widened */
    return seed ^ ((uint64_t)(uint32_t)(a + G) + (seed << 6) + (seed >> 2));
}

static inline uint64_t mix64(uint64_t b, uint64_t seed) {
    b = (b ^ (b >> 30)) * M1;
    b = (b ^ (b >> 27)) * M2;
    b = b ^ (b >> 31);
    return seed ^ (b + (uint64_t)G + (seed << 6) + (seed >> 2));
}

typedef struct {
    int has_lora;
    uint64_t lora;
    int has_salt;
    uint64_t salt;
} scope_t;

/* Hashes n tokens starting at p (possibly unaligned). ORs every token into *sign so the caller
 * can reject negative ids after the fact instead of scanning twice. */
static inline uint64_t hash_block(const unsigned char *p, Py_ssize_t n, uint64_t parent,
                                  const scope_t *scope, uint32_t *sign) {
    uint64_t seed = (uint64_t)n ^ (parent * M1);
    uint32_t acc = 0;
    /* TensorRT-LLM mixes the salt whenever the parent hash is 0 (a sequence's first block). */
    if (parent == 0 && scope->has_salt) {
        seed = mix64(scope->salt, seed);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t tok;
        memcpy(&tok, p + 4 * i, 4);
        acc |= tok;
        seed = mix32(tok, seed);
    }
    if (scope->has_lora) {
        seed = mix64(scope->lora, seed);
    }
    *sign |= acc;
    return seed;
}

#endif /* KVCACHE_V1CORE_H */
