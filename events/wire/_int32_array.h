/*
 * A new array('i') of n int32s whose storage the caller writes at once: shared by the events
 * package's extensions (through _native_common.h) and router_sim/_match.c.
 *
 * The array module has no C API, and its only public ways to make an array of n items (a
 * repeat of array('i', [0]), a copy from a buffer) write every byte before the caller writes
 * them again: for the prompts of a trace replay and the token ids of every decoded event that
 * is a second pass over hundreds of MB. So an empty array is given n items' storage directly,
 * through the layout of CPython's arrayobject (Modules/arraymodule.c: the variable-size head,
 * ob_item, allocated, then fields not touched here), which is the same in every CPython 3 this
 * project supports. int32_array_init() checks that layout against a live array('i') (its item
 * pointer is the one its buffer exports, its size and capacity are what they must be) and the
 * fast path is used only when the check passes; otherwise the arrays are made by repeat.
 */
#ifndef INT32_ARRAY_H
#define INT32_ARRAY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

typedef struct {
    PyObject_VAR_HEAD
    char *ob_item;
    Py_ssize_t allocated;
} int32_array_head;

static PyObject *INT32_ARRAY_TYPE; /* array.array */
static PyObject *INT32_ARRAY_ZERO; /* array('i', [0]): repeated where the layout is unknown */
static int INT32_ARRAY_RAW;        /* 1: the layout was checked, arrays are made unfilled */

/* An array('i') of n items, its storage at *data (valid while nothing resizes it): unfilled
 * where the layout check passed, n zeros otherwise. NULL with an exception set. */
static inline PyObject *int32_array_new(Py_ssize_t n, unsigned char **data) {
    *data = NULL;
    if (INT32_ARRAY_RAW && n > 0 && n <= PY_SSIZE_T_MAX / 4) {
        PyObject *arr = PySequence_Repeat(INT32_ARRAY_ZERO, 0); /* empty: no storage yet */
        if (arr == NULL) {
            return NULL;
        }
        int32_array_head *head = (int32_array_head *)arr;
        char *mem = PyMem_Malloc((size_t)n * 4); /* what array_dealloc gives back: PyMem_Free */
        if (mem == NULL) {
            Py_DECREF(arr);
            return PyErr_NoMemory();
        }
        PyMem_Free(head->ob_item); /* NULL for an empty array; freed anyway if not */
        head->ob_item = mem;
        head->allocated = n;
        Py_SET_SIZE(arr, n);
        *data = (unsigned char *)mem;
        return arr;
    }
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

/* Whether an array('i') made by the fast path reads back as written: its buffer is the storage
 * written, its length n, its items the values (1 when all hold). */
static inline int int32_array_roundtrip(void) {
    unsigned char *data = NULL;
    PyObject *arr = int32_array_new(3, &data);
    if (arr == NULL) {
        PyErr_Clear();
        return 0;
    }
    int32_t values[3] = {7, -1, 1 << 30};
    memcpy(data, values, sizeof values);
    int ok = 0;
    Py_buffer view;
    if (PyObject_GetBuffer(arr, &view, PyBUF_SIMPLE) == 0) {
        ok = view.buf == (void *)data && view.len == 12 && PyObject_Length(arr) == 3 &&
             memcmp(view.buf, values, sizeof values) == 0;
        PyBuffer_Release(&view);
    }
    PyObject *last = ok ? PySequence_GetItem(arr, 2) : NULL;
    ok = ok && last != NULL && PyLong_AsLong(last) == (1L << 30);
    Py_XDECREF(last);
    PyErr_Clear();
    Py_DECREF(arr);
    return ok;
}

/* Checks the layout against a live array('i') of 3 items, whose exported buffer must be its
 * ob_item, then a round trip through the fast path: sets INT32_ARRAY_RAW (0, or -1 with an
 * exception set). */
static inline int int32_array_check(void) {
    INT32_ARRAY_RAW = 0;
    PyObject *probe = PyObject_CallFunction(INT32_ARRAY_TYPE, "s(iii)", "i", 1, 2, 3);
    if (probe == NULL) {
        return -1;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(probe, &view, PyBUF_SIMPLE) < 0) {
        Py_DECREF(probe);
        return -1;
    }
    int32_array_head *head = (int32_array_head *)probe;
    int layout = head->ob_item == (char *)view.buf && Py_SIZE(probe) == 3 &&
                 head->allocated >= 3 && view.len == 12;
    PyBuffer_Release(&view);
    Py_DECREF(probe);
    INT32_ARRAY_RAW = layout;
    if (layout && !int32_array_roundtrip()) {
        INT32_ARRAY_RAW = 0;
    }
    return 0;
}

/* Loads array.array and checks the layout (0, or -1 with an exception set). */
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
    if (INT32_ARRAY_ZERO == NULL) {
        return -1;
    }
    return int32_array_check();
}

/* int32_array_raw(on=None) -> bool, for a module's method table: whether arrays are made
 * unfilled (False where the layout check failed); on=False turns that off (tests compare). */
static inline PyObject *int32_array_raw(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "int32_array_raw takes at most one argument");
        return NULL;
    }
    if (nargs == 1 && args[0] != Py_None) {
        int on = PyObject_IsTrue(args[0]);
        if (on < 0) {
            return NULL;
        }
        if (!on) {
            INT32_ARRAY_RAW = 0;
        } else if (int32_array_check() < 0) {
            return NULL;
        }
    }
    return PyBool_FromLong(INT32_ARRAY_RAW);
}

#endif /* INT32_ARRAY_H */
