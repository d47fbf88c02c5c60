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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

static PyObject *
pack_nonneg(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    if (view.itemsize != 4 || view.format == NULL || strcmp(view.format, "i") != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "pack_nonneg needs a buffer of 4-byte ints ('i')");
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
    memcpy(PyBytes_AS_STRING(out), src, (size_t)view.len);
    for (Py_ssize_t i = 0; i < n; i++) {
        any |= src[i];
    }
#endif
    PyBuffer_Release(&view);
    if (any & 0x80000000u) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"pack_nonneg", pack_nonneg, METH_O,
     "pack_nonneg(arr) -> the ids as 4-byte little-endian bytes, or None if one is negative"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvcache._tokens",
    "Native packing and sign check of token id arrays (optional; see keys.py).", -1, methods,
};

PyMODINIT_FUNC
PyInit__tokens(void)
{
    return PyModule_Create(&module);
}
