/*
 * The router service's native JSON prompt readers (router_sim/service/protocol.py keeps the
 * msgspec path they stand beside, and names what they refuse):
 *
 *   tokens_from_json(data, limit) -> array('i') | None: one plain JSON array of token ids;
 *   json_prompt_first(body, limit) -> (array('i'), end) | None: a request body's leading
 *     "prompt" member read the same way.
 *
 * It is its own extension, apart from the event path's hashes (_v1hash.c) and msgpack codec
 * (_wire.c), so each builds and falls back on its own; the token-array builders and the limit
 * check it shares with them are in _native_common.h.
 */
#include "../_native_common.h"

static inline int json_space(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

/* Reads a JSON array of plain ints in [0, 2**31) starting at p (which points at its '['),
 * at most cap of them, into vals. The buffer must hold a byte that is neither a digit nor JSON
 * whitespace at or before its end (its closing ']', or a bytes object's terminating NUL): the
 * scans stop there, so they need no bounds check. Returns the position after the ']', or NULL
 * for anything else (a sign, fraction, exponent, leading zero, too big, one item more than cap,
 * another character). */
static const unsigned char *scan_json_ints(const unsigned char *p, Py_ssize_t cap,
                                           int32_t *vals, Py_ssize_t *count) {
    Py_ssize_t n = 0;
    p++; /* the '[' */
    for (;;) {
        while (json_space(*p)) {
            p++;
        }
        const unsigned char *digits = p;
        uint64_t v = 0;
        while ((unsigned)(*p - '0') < 10) { /* wraps past 20 digits: refused by length */
            v = v * 10 + (uint64_t)(*p++ - '0');
        }
        Py_ssize_t len = p - digits;
        if (len == 0 || len > 10 || (len > 1 && *digits == '0') || v > (uint64_t)INT32_MAX ||
            n == cap) {
            return NULL;
        }
        vals[n++] = (int32_t)v;
        while (json_space(*p)) {
            p++;
        }
        if (*p == ',') {
            p++;
            continue;
        }
        if (*p != ']') {
            return NULL;
        }
        *count = n;
        return p + 1;
    }
}

/* The array of plain ints at p (its '[') up to end, at most limit of them, as a new
 * array('i') in *out with *after just past its ']': 1; 0 when it is not such an array; -1 with
 * an exception set. One pass into a buffer of at most limit ids or one per two bytes left,
 * whichever is less (the buffer must end in a stop for scan_json_ints). */
static int read_json_ints(const unsigned char *p, const unsigned char *end, Py_ssize_t limit,
                          PyObject **out, const unsigned char **after) {
    Py_ssize_t cap = (end - p) / 2 + 1, n = 0;
    if (limit < cap) {
        cap = limit;
    }
    if (cap <= 0) {
        return 0;
    }
    int32_t *vals = (int32_t *)PyMem_Malloc((size_t)cap * sizeof(int32_t));
    if (vals == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *after = scan_json_ints(p, cap, vals, &n);
    if (*after == NULL) {
        PyMem_Free(vals);
        return 0;
    }
    *out = int32_array_of((const unsigned char *)vals, n);
    PyMem_Free(vals);
    return *out == NULL ? -1 : 1;
}

/* tokens_from_json(data, limit) -> array('i') | None: the token ids of one JSON array of 1 to
 * limit ints in [0, 2**31) written plainly (digits without sign, fraction, exponent or leading
 * zero, JSON whitespace around them), that is the whole of data (a msgspec.Raw, bytes: any
 * buffer); None for anything else, which the caller then reads with msgspec and names. */
static PyObject *tokens_from_json(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Py_ssize_t limit;
    if (limit_arg("tokens_from_json", args, nargs, &limit) < 0) {
        return NULL;
    }
    Py_buffer buf;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)buf.buf, *last = p + buf.len;
    /* The closing bracket, found first, stops every scan (see scan_json_ints). */
    while (last > p && json_space(last[-1])) {
        last--;
    }
    while (p < last && json_space(*p)) {
        p++;
    }
    PyObject *arr = NULL;
    const unsigned char *after = NULL;
    int got = 0;
    if (last - p >= 2 && *p == '[' && last[-1] == ']') {
        got = read_json_ints(p, last, limit, &arr, &after);
    }
    PyBuffer_Release(&buf);
    if (got < 0) {
        return NULL;
    }
    if (got == 0 || after != last) {
        Py_XDECREF(arr);
        Py_RETURN_NONE;
    }
    return arr;
}

/* json_prompt_first(body, limit) -> (array('i'), end) | None: when the bytes body is a JSON
 * object whose first member is "prompt" with a plain int array as tokens_from_json reads it
 * (JSON whitespace allowed around the tokens), its ids and the offset just past the array's
 * ']'; None otherwise. The rest of the object (from end on) is the caller's to read. A bytes
 * object ends in a NUL byte, which stops the scans. */
static PyObject *json_prompt_first(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Py_ssize_t limit;
    if (limit_arg("json_prompt_first", args, nargs, &limit) < 0) {
        return NULL;
    }
    if (!PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "json_prompt_first reads bytes");
        return NULL;
    }
    const unsigned char *start = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    const unsigned char *p = start, *end = start + PyBytes_GET_SIZE(args[0]);
    while (json_space(*p)) {
        p++;
    }
    if (*p++ != '{') {
        Py_RETURN_NONE;
    }
    while (json_space(*p)) {
        p++;
    }
    if (end - p < 8 || memcmp(p, "\"prompt\"", 8) != 0) {
        Py_RETURN_NONE;
    }
    p += 8;
    while (json_space(*p)) {
        p++;
    }
    if (*p++ != ':') {
        Py_RETURN_NONE;
    }
    while (json_space(*p)) {
        p++;
    }
    if (*p != '[') {
        Py_RETURN_NONE;
    }
    PyObject *arr = NULL;
    const unsigned char *after = NULL;
    int got = read_json_ints(p, end, limit, &arr, &after);
    if (got <= 0) {
        if (got < 0) {
            return NULL;
        }
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(Nn)", arr, (Py_ssize_t)(after - start));
}

static PyMethodDef methods[] = {
    {"tokens_from_json", (PyCFunction)(void (*)(void))tokens_from_json, METH_FASTCALL,
     "tokens_from_json(data, limit) -> array('i') | None: the token ids of one JSON array of 1 "
     "to limit plain ints in [0, 2**31); None for anything else."},
    {"json_prompt_first", (PyCFunction)(void (*)(void))json_prompt_first, METH_FASTCALL,
     "json_prompt_first(body, limit) -> (array('i'), end) | None: the ids of a bytes JSON "
     "object's first member when it is \"prompt\" with a plain int array, and the offset "
     "past that array."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_json_prompt",
    "Native JSON prompt readers (see router_sim.service.protocol).", -1, methods, NULL, NULL, NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__json_prompt(void) {
    if (native_common_init() < 0) {
        return NULL;
    }
    return PyModule_Create(&module);
}
