/*
 * Helpers of the msgpack wire codec (_wire.c, which alone builds records): the token-array
 * builders, the limit-argument check and the record builder. Every
 * function is static inline; the module-level objects below are set by native_common_init()
 * from the extension's PyInit. (The V1 hash extension, kvcache/_v1hash.c, needs none of this:
 * it includes only <Python.h> and kvcache/_v1core.h.)
 */
#ifndef EVENTS_NATIVE_COMMON_H
#define EVENTS_NATIVE_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

/* ---- new int32 arrays ------------------------------------------------------------------
 *
 * The array module has no C API: a new array('i') of n items is made by repeating
 * array('i', [0]) (public sequence protocol), and the caller writes its storage through the
 * buffer it exports. */
static PyObject *INT32_ARRAY_TYPE; /* array.array */
static PyObject *INT32_ARRAY_ZERO; /* array('i', [0]) */

/* An array('i') of n zeros, its storage at *data (valid while nothing resizes it). NULL with
 * an exception set. */
static inline PyObject *int32_array_new(Py_ssize_t n, unsigned char **data) {
    *data = NULL;
    PyObject *arr = PySequence_Repeat(INT32_ARRAY_ZERO, n);
    if (arr == NULL) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(arr, &view, PyBUF_WRITABLE) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    *data = (unsigned char *)view.buf;
    PyBuffer_Release(&view); /* the array is ours alone: its storage stays where it is */
    return arr;
}

/* Loads array.array (0, or -1 with an exception set). */
static inline int int32_array_init(void) {
    PyObject *array_module = PyImport_ImportModule("array");
    if (array_module == NULL) {
        return -1;
    }
    INT32_ARRAY_TYPE = PyObject_GetAttrString(array_module, "array");
    Py_DECREF(array_module);
    if (INT32_ARRAY_TYPE == NULL || !PyType_Check(INT32_ARRAY_TYPE)) {
        return -1;
    }
    INT32_ARRAY_ZERO = PyObject_CallFunction(INT32_ARRAY_TYPE, "s(i)", "i", 0);
    return INT32_ARRAY_ZERO == NULL ? -1 : 0;
}

/* ---- packed token arrays ---------------------------------------------------------------
 *
 * The event path carries a block's token ids as an array('i') (native int32s) from the cache to
 * the wire and back, instead of one Python int per token: the records keep the cache's arrays,
 * token writer (pack_tokens) writes a msgpack array straight from the int32s, and the wire
 * reader reads one straight into an array. */

#define ARRAY_TYPE INT32_ARRAY_TYPE /* array.array (set by int32_array_init) */

/* 1 with *view held when obj is an array('i') of 4-byte ints; 0 (nothing held) when it is not
 * one; -1 with an exception set. */
static inline int int32_view(PyObject *obj, Py_buffer *view) {
    if (!Py_IS_TYPE(obj, (PyTypeObject *)ARRAY_TYPE)) {
        return 0;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT) < 0) {
        return -1;
    }
    if (view->itemsize == 4 && view->format != NULL && strcmp(view->format, "i") == 0) {
        return 1;
    }
    PyBuffer_Release(view);
    return 0;
}

/* An array('i') copy of packed int32s (bytes, a memoryview: any contiguous buffer). */
static inline PyObject *int32_array_of(const unsigned char *p, Py_ssize_t n) {
    unsigned char *data;
    PyObject *arr = int32_array_new(n, &data);
    if (arr != NULL && n > 0) {
        memcpy(data, p, 4 * (size_t)n);
    }
    return arr;
}

/* Reads the limit argument of fn(data, limit) (the second of exactly two) into *limit: 0, or
 * -1 with an exception set when the call is not that. */
static inline int limit_arg(const char *name, PyObject *const *args, Py_ssize_t nargs,
                            Py_ssize_t *limit) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s takes 2 arguments, got %zd", name, nargs);
        return -1;
    }
    *limit = PyLong_AsSsize_t(args[1]);
    return *limit == -1 && PyErr_Occurred() ? -1 : 0;
}

/* ---- record builder (_wire.c's decoder) ------------------------------------------------- */

#define RECORD_FIELDS 6 /* block_hash, tokens, lora_id, cache_level, priority, cache_salt_id */

/* A new record of cls with its n fields set from values[0..n); steals nothing. Like its
 * token list, a record none of whose fields the collector tracks (ints, strings, None, an
 * untracked token list or array) cannot be part of a cycle, and is left out of it too. An
 * array holds no reference but its type's, so no cycle can run through it either: the
 * collector tracks arrays (their type is a heap type) and a token array is untracked here. */
static inline PyObject *new_record_n(PyObject *cls, PyObject *setters, PyObject *const *values,
                                     Py_ssize_t n) {
    PyTypeObject *type = (PyTypeObject *)cls;
    PyObject *obj = type->tp_alloc(type, 0);
    if (obj == NULL) {
        return NULL;
    }
    int atomic = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(setters, i);
        if (Py_TYPE(d)->tp_descr_set(d, obj, values[i]) < 0) {
            Py_DECREF(obj);
            return NULL;
        }
        if (Py_IS_TYPE(values[i], (PyTypeObject *)ARRAY_TYPE) &&
            PyObject_GC_IsTracked(values[i])) {
            PyObject_GC_UnTrack(values[i]);
        }
        atomic = atomic && !PyObject_GC_IsTracked(values[i]);
    }
    if (atomic && PyType_IS_GC(type)) {
        PyObject_GC_UnTrack(obj);
    }
    return obj;
}

/* A new block record (its RECORD_FIELDS fields) of cls: see new_record_n. */
static inline PyObject *new_record(PyObject *cls, PyObject *setters, PyObject *const *values) {
    return new_record_n(cls, setters, values, RECORD_FIELDS);
}

/* Sets this extension's copies of the objects above: 0, or -1 with an exception set. */
static inline int native_common_init(void) { return int32_array_init(); }

#endif /* EVENTS_NATIVE_COMMON_H */
