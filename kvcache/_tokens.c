/*
 * Native packing of kvcache.keys.token_array_bytes: an array('i') of token ids to its 4-byte
 * little-endian encoding, checking in the same pass that no id is negative.
 *
 * The pure-Python path copies the array out (tobytes), then copies every fourth byte out again
 * (the sign-carrying one) to test them with isascii: three passes and two allocations per
 * prompt. Here one loop copies and ORs the ids together; the sign bit of the OR says whether
 * any id was negative. keys.py keeps the pure-Python path as the reference and the fallback
 * (this extension is optional); tests check that both agree.
 *
 *   pack_nonneg(arr) -> bytes, or None when an id is negative
 *                       (arr: a C-contiguous buffer of 4-byte ints, format "i")
 *   all_nonneg(arr)  -> whether no id is negative (the check alone, nothing allocated: a
 *                       new request's prompt is checked whole but packed only as far as
 *                       the manager matches it against the tree)
 *
 * Block keys of a chain (WIRE.md section 2: key = sha256(parent_key || block bytes)), for the
 * tree's commit path: hashlib costs ~0.5 us per call beyond the hash itself (an object, a
 * lock and a GIL release for inputs of 2 KiB and more, the slice and the concatenation that
 * build its input), about a third of a 512-token block's cost. One call here keys a whole run
 * of blocks with the x86 SHA extensions (SHA-NI), reading the packed tokens in place:
 *
 *   chain_keys(parent_key, data, start, step, count) -> list of count 32-byte keys
 *       key i = sha256(key i-1 || data[start + i*step : start + (i+1)*step]), key -1 = parent_key
 *
 * It exists only where the CPU has SHA-NI (checked when the module loads): elsewhere hashlib
 * (OpenSSL, which has its own fast paths) is the faster choice, and keys.py uses it.
 * SHA-256 itself follows FIPS 180-4 (constants, padding); the round structure is the one the
 * SHA-NI instructions define (two rounds per sha256rnds2 on the ABEF/CDGH state halves).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* A C-contiguous buffer of 4-byte ints ("i"), or -1 with TypeError. */
static int
int32_view(PyObject *arg, Py_buffer *view, const char *who)
{
    if (PyObject_GetBuffer(arg, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    if (view->itemsize != 4 || view->format == NULL || strcmp(view->format, "i") != 0) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s needs a buffer of 4-byte ints ('i')", who);
        return -1;
    }
    return 0;
}

static PyObject *
all_nonneg(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer view;
    if (int32_view(arg, &view, "all_nonneg") < 0) {
        return NULL;
    }
    const uint32_t *src = (const uint32_t *)view.buf;
    Py_ssize_t n = view.len / 4;
    uint32_t any = 0;
    for (Py_ssize_t i = 0; i < n; i++) { /* vectorized; the byte order does not matter */
        any |= src[i];
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(!(any & 0x80000000u));
}

static PyObject *
pack_nonneg(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer view;
    if (int32_view(arg, &view, "pack_nonneg") < 0) {
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, view.len);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const uint32_t *src = (const uint32_t *)view.buf;
    Py_ssize_t n = view.len / 4;
    uint32_t any = 0;
#if PY_BIG_ENDIAN
    uint32_t *dst = (uint32_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t v = src[i];
        any |= v;
        dst[i] = ((v & 0xffu) << 24) | ((v & 0xff00u) << 8) | ((v >> 8) & 0xff00u) | (v >> 24);
    }
#else
    /* one pass that copies and ORs (vectorized): a second pass over a long prompt after
     * memcpy would read it back from a colder cache level */
    uint32_t *restrict dst = (uint32_t *)PyBytes_AS_STRING(out);
    const uint32_t *restrict in = src;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t v = in[i];
        dst[i] = v;
        any |= v;
    }
#endif
    PyBuffer_Release(&view);
    if (any & 0x80000000u) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}


/* ------------------------------------------------------------------ SHA-256 with SHA-NI */

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

static PyObject *
chain_keys(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer parent, data;
    Py_ssize_t start, step, count;
    if (!PyArg_ParseTuple(args, "y*y*nnn:chain_keys", &parent, &data, &start, &step, &count)) {
        return NULL;
    }
    PyObject *out = NULL;
    if (start < 0 || step < 1 || count < 0 || start > data.len ||
        count > (data.len - start) / step) {
        PyErr_Format(PyExc_ValueError,
                     "chain_keys: %zd blocks of %zd bytes from offset %zd do not fit in %zd "
                     "bytes (need start >= 0, step >= 1, count >= 0)",
                     count, step, start, data.len);
        goto done;
    }
    out = PyList_New(count);
    if (out == NULL) {
        goto done;
    }
    const uint8_t *prev = (const uint8_t *)parent.buf;
    size_t prev_len = (size_t)parent.len;
    const uint8_t *src = (const uint8_t *)data.buf + start;
    for (Py_ssize_t i = 0; i < count; i++, src += step) {
        PyObject *key = PyBytes_FromStringAndSize(NULL, 32);
        if (key == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(key);
        sha_ctx c;
        sha_init(&c);
        sha_update(&c, prev, prev_len);
        sha_update(&c, src, (size_t)step);
        sha_final(&c, dst);
        PyList_SET_ITEM(out, i, key);
        prev = dst;
        prev_len = 32;
    }
done:
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    return out;
}

static PyMethodDef shani_methods[] = {
    {"chain_keys", chain_keys, METH_VARARGS,
     "chain_keys(parent_key, data, start, step, count) -> the chained sha256 keys of count "
     "blocks of step bytes of data from start"},
    {NULL, NULL, 0, NULL},
};
#endif /* x86 with GCC or clang */

static PyMethodDef methods[] = {
    {"pack_nonneg", pack_nonneg, METH_O,
     "pack_nonneg(arr) -> the ids as 4-byte little-endian bytes, or None if one is negative"},
    {"all_nonneg", all_nonneg, METH_O, "all_nonneg(arr) -> whether no id is negative"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvcache._tokens",
    "Native packing and sign check of token id arrays (optional; see keys.py).", -1, methods,
};

PyMODINIT_FUNC
PyInit__tokens(void)
{
    PyObject *m = PyModule_Create(&module);
#ifdef KV_SHANI
    if (m != NULL && cpu_has_shani() && PyModule_AddFunctions(m, shani_methods) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
