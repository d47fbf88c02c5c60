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
 * SHA-256 itself is in _sha256ni.h (shared with router_sim/_prefetch.c).
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


/* keys_ok(keys, size) -> whether keys (a list or tuple) holds only bytes objects of size bytes:
 * create_kv_cache's check of the block keys a caller made, one pass, no object made. */
static PyObject *
keys_ok(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *keys;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "On:keys_ok", &keys, &size)) {
        return NULL;
    }
    if (!PyList_Check(keys) && !PyTuple_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "keys_ok: keys must be a list or a tuple");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_CheckExact(items[i]) || PyBytes_GET_SIZE(items[i]) != size) {
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

/* hashes_ok(hashes) -> whether hashes (a list or tuple) holds only ints in [0, 2**64). */
static PyObject *
hashes_ok(PyObject *Py_UNUSED(module), PyObject *hashes)
{
    if (!PyList_Check(hashes) && !PyTuple_Check(hashes)) {
        PyErr_SetString(PyExc_TypeError, "hashes_ok: hashes must be a list or a tuple");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_CheckExact(items[i])) {
            Py_RETURN_FALSE;
        }
        (void)PyLong_AsUnsignedLongLong(items[i]); /* negative or too large: an error */
        if (PyErr_Occurred()) {
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

#include "_sha256ni.h"

#ifdef KV_SHANI
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
        sha_chain_key(prev, prev_len, src, (size_t)step, dst);
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
    {"keys_ok", keys_ok, METH_VARARGS,
     "keys_ok(keys, size) -> whether a list or tuple holds only bytes of size bytes"},
    {"hashes_ok", hashes_ok, METH_O,
     "hashes_ok(hashes) -> whether a list or tuple holds only ints in [0, 2**64)"},
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
