/*
 * Native block making and chain linking for kvcache.tree (optional; tree.py keeps the
 * pure-Python reference and fallback, and tests check that both leave the same blocks).
 *
 * A Mooncake replay makes ~260k blocks (the private pages a sequence grows by) and links
 * ~250k of them into the tree as full blocks. In Python each block costs an __init__ of 20
 * slot stores, then five stores, a token slice and a link on commit: interpreter steps
 * around a few pointer writes. Here a Layout, made once from the class and the names of the
 * slots it writes, holds the slots' offsets (read from their member descriptors), and one call
 * makes or links a whole run of blocks by writing the slots in place.
 *
 *   Layout(cls, names)          the slots `names` of cls (each a writable object slot of cls)
 *   layout.new(first, pages, values) -> list of len(pages) new instances of cls (no __init__
 *       runs): block i gets names[0] = first + i, names[1] = pages[i] and names[2 + k] =
 *       values[k]; the names must cover every slot, as the pure path's __init__ sets them
 *   layout.link(blocks, keys, tokens, start, tpb, parent) -> how many blocks it linked
 *       (a layout of exactly key, tokens, is_full, parent, in_tree, child, children):
 *       block j gets key = keys[j], tokens = tokens[start + j*tpb : start + (j+1)*tpb] (a new
 *       array, sliced as Python slices it), is_full = in_tree = True and parent = the block
 *       before it (`parent` for the first one), and becomes that block's only child. It stops
 *       at the first j > 0 whose predecessor already has a child (then block j's fields are set
 *       but not its link): tree.py's general loop goes on from there. The first block's link to
 *       the chain's parent node is left to tree.py as well.
 *
 * A token slice is an array: it refers to nothing but its type, so it can be in no reference
 * cycle, and it is taken out of the cyclic collector's lists (as events' native records do
 * with theirs): a run keeps ~250k of them alive, each one more object every collection walks.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

static PyObject *ARRAY_TYPE; /* array.array */

#define MAX_FIELDS 32
#define LINK_FIELDS 7 /* key, tokens, is_full, parent, in_tree, child, children */

typedef struct {
    PyObject_HEAD
    PyTypeObject *cls;
    Py_ssize_t n;
    Py_ssize_t offsets[MAX_FIELDS]; /* of names[i]'s slot in an instance of cls */
} Layout;

static inline PyObject **
slot(PyObject *obj, Py_ssize_t offset)
{
    return (PyObject **)((char *)obj + offset);
}

/* Store v (a new reference is taken) in obj's slot at offset, dropping what it held. */
static inline void
put(PyObject *obj, Py_ssize_t offset, PyObject *v)
{
    PyObject **p = slot(obj, offset);
    PyObject *old = *p;
    Py_INCREF(v);
    *p = v;
    Py_XDECREF(old);
}

static void
Layout_dealloc(Layout *self)
{
    Py_XDECREF(self->cls);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Layout_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *cls, *names;
    static char *kwlist[] = {"cls", "names", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!:Layout", kwlist, &PyType_Type, &cls,
                                     &PyTuple_Type, &names)) {
        return NULL;
    }
    PyTypeObject *tp = (PyTypeObject *)cls;
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    if (n > MAX_FIELDS) {
        PyErr_Format(PyExc_ValueError, "Layout: at most %d names, got %zd", MAX_FIELDS, n);
        return NULL;
    }
    if (tp->tp_itemsize != 0) {
        PyErr_Format(PyExc_TypeError, "Layout: %s is a variable-size type", tp->tp_name);
        return NULL;
    }
    Layout *self = (Layout *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        if (!PyUnicode_Check(name)) {
            PyErr_Format(PyExc_TypeError, "Layout: names must be str, got %s",
                         Py_TYPE(name)->tp_name);
            goto fail;
        }
        PyObject *d = PyObject_GetAttr(cls, name); /* a slot's member descriptor, from the class */
        if (d == NULL) {
            goto fail;
        }
        int ok = Py_IS_TYPE(d, &PyMemberDescr_Type);
        PyMemberDef *m = ok ? ((PyMemberDescrObject *)d)->d_member : NULL;
        ok = ok && m->type == T_OBJECT_EX && !(m->flags & READONLY) &&
             PyType_IsSubtype(tp, PyDescr_TYPE(d)) && m->offset >= (Py_ssize_t)sizeof(PyObject) &&
             m->offset + (Py_ssize_t)sizeof(PyObject *) <= tp->tp_basicsize;
        Py_DECREF(d);
        if (!ok) {
            PyErr_Format(PyExc_TypeError, "Layout: %R is not a writable slot of %s", name,
                         tp->tp_name);
            goto fail;
        }
        for (Py_ssize_t k = 0; k < i; k++) {
            if (self->offsets[k] == m->offset) {
                PyErr_Format(PyExc_ValueError, "Layout: %R is named twice", name);
                goto fail;
            }
        }
        self->offsets[i] = m->offset;
    }
    Py_INCREF(cls);
    self->cls = tp;
    self->n = n;
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

/* new(first, pages, values) -> list; see the module comment. */
static PyObject *
Layout_make(Layout *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_Check(args[1]) || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "new(first: int, pages: list, values: tuple)");
        return NULL;
    }
    Py_ssize_t first = PyLong_AsSsize_t(args[0]);
    if (first == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *pages = args[1], *values = args[2];
    if (self->n < 2 || PyTuple_GET_SIZE(values) != self->n - 2) {
        PyErr_Format(PyExc_ValueError, "new: %zd values for a layout of %zd names (need names - 2)",
                     PyTuple_GET_SIZE(values), self->n);
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(pages);
    if (first > PY_SSIZE_T_MAX - count) {
        PyErr_SetString(PyExc_OverflowError, "new: the numbers run past the largest index");
        return NULL;
    }
    PyObject *out = PyList_New(count);
    if (out == NULL) {
        return NULL;
    }
    PyTypeObject *tp = self->cls;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i >= PyList_GET_SIZE(pages)) { /* the list shrank under us (it cannot: no Python
                                              code runs here, but a list is only borrowed) */
            PyErr_SetString(PyExc_RuntimeError, "new: pages changed size");
            goto fail;
        }
        PyObject *obj = tp->tp_alloc(tp, 0);
        if (obj == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(out, i, obj);
        PyObject *num = PyLong_FromSsize_t(first + i);
        if (num == NULL) {
            goto fail;
        }
        *slot(obj, self->offsets[0]) = num; /* tp_alloc zeroed every slot */
        put(obj, self->offsets[1], PyList_GET_ITEM(pages, i));
        for (Py_ssize_t k = 2; k < self->n; k++) {
            put(obj, self->offsets[k], PyTuple_GET_ITEM(values, k - 2));
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* link(blocks, keys, tokens, start, tpb, parent) -> int; see the module comment. */
static PyObject *
Layout_link(Layout *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyList_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "link(blocks: list, keys: list, tokens, start: int, tpb: int, parent)");
        return NULL;
    }
    if (self->n != LINK_FIELDS) {
        PyErr_Format(PyExc_TypeError, "link needs a layout of %d names, this one has %zd",
                     LINK_FIELDS, self->n);
        return NULL;
    }
    PyObject *blocks = args[0], *keys = args[1], *tokens = args[2], *parent = args[5];
    Py_ssize_t start = PyLong_AsSsize_t(args[3]);
    if (start == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t tpb = PyLong_AsSsize_t(args[4]);
    if (tpb == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(blocks);
    if (PyList_GET_SIZE(keys) != count) {
        PyErr_Format(PyExc_ValueError, "link: %zd keys for %zd blocks", PyList_GET_SIZE(keys),
                     count);
        return NULL;
    }
    if (start < 0 || tpb < 1 || (count && (start > PY_SSIZE_T_MAX / 2 ||
                                           tpb > (PY_SSIZE_T_MAX / 2 - start) / count))) {
        PyErr_Format(PyExc_ValueError, "link: need start >= 0 and tpb >= 1 within bounds, got "
                                       "start %zd, tpb %zd", start, tpb);
        return NULL;
    }
    PyTypeObject *tp = self->cls;
    for (Py_ssize_t j = 0; j < count; j++) {
        if (!PyObject_TypeCheck(PyList_GET_ITEM(blocks, j), tp)) {
            PyErr_Format(PyExc_TypeError, "link: blocks[%zd] is a %s, not a %s", j,
                         Py_TYPE(PyList_GET_ITEM(blocks, j))->tp_name, tp->tp_name);
            return NULL;
        }
    }
    const Py_ssize_t *off = self->offsets;
    Py_ssize_t pos = start;
    PyObject *prev = NULL;
    for (Py_ssize_t j = 0; j < count; j++, pos += tpb) {
        /* blocks and keys are read afresh each time: the slice below may run Python code (a
           subclass's __getitem__), which could change the lists */
        if (j >= PyList_GET_SIZE(blocks) || j >= PyList_GET_SIZE(keys)) {
            PyErr_SetString(PyExc_RuntimeError, "link: blocks or keys changed size");
            return NULL;
        }
        PyObject *b = PyList_GET_ITEM(blocks, j);
        Py_INCREF(b);
        PyObject *arr = PySequence_GetSlice(tokens, pos, pos + tpb);
        if (arr == NULL) {
            Py_DECREF(b);
            return NULL;
        }
        if (Py_IS_TYPE(arr, (PyTypeObject *)ARRAY_TYPE) && PyObject_GC_IsTracked(arr)) {
            PyObject_GC_UnTrack(arr); /* see the module comment */
        }
        if (j >= PyList_GET_SIZE(keys) || !PyObject_TypeCheck(b, tp) ||
            (prev != NULL && !PyObject_TypeCheck(prev, tp))) {
            PyErr_SetString(PyExc_RuntimeError, "link: blocks or keys changed");
            Py_DECREF(arr);
            Py_DECREF(b);
            return NULL;
        }
        put(b, off[0], PyList_GET_ITEM(keys, j));
        PyObject **tokens_slot = slot(b, off[1]);
        PyObject *old = *tokens_slot;
        *tokens_slot = arr; /* the new reference */
        Py_XDECREF(old);
        put(b, off[2], Py_True);
        put(b, off[3], prev == NULL ? parent : prev);
        put(b, off[4], Py_True);
        if (prev != NULL) {
            PyObject *child = *slot(prev, off[5]), *children = *slot(prev, off[6]);
            if (child != Py_None || children != Py_None) {
                Py_DECREF(b);
                Py_DECREF(prev);
                return PyLong_FromSsize_t(j); /* the general loop links this one */
            }
            put(prev, off[5], b);
            Py_DECREF(prev);
        }
        prev = b; /* the reference taken above */
    }
    Py_XDECREF(prev);
    return PyLong_FromSsize_t(count);
}

static PyMethodDef Layout_methods[] = {
    {"new", (PyCFunction)(void (*)(void))Layout_make, METH_FASTCALL,
     "new(first, pages, values) -> list of new instances with the layout's slots set"},
    {"link", (PyCFunction)(void (*)(void))Layout_link, METH_FASTCALL,
     "link(blocks, keys, tokens, start, tpb, parent) -> how many blocks were linked as a "
     "chain"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LayoutType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvcache._tree.Layout",
    .tp_basicsize = sizeof(Layout),
    .tp_dealloc = (destructor)Layout_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Layout(cls, names): the offsets of the named writable slots of cls",
    .tp_methods = Layout_methods,
    .tp_new = Layout_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvcache._tree",
    "Native making and chain linking of tree blocks (optional; see tree.py).", -1, NULL,
};

PyMODINIT_FUNC
PyInit__tree(void)
{
    if (PyType_Ready(&LayoutType) < 0) {
        return NULL;
    }
    PyObject *array_mod = PyImport_ImportModule("array");
    if (array_mod == NULL) {
        return NULL;
    }
    ARRAY_TYPE = PyObject_GetAttrString(array_mod, "array");
    Py_DECREF(array_mod);
    if (ARRAY_TYPE == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&LayoutType);
    if (PyModule_AddObject(m, "Layout", (PyObject *)&LayoutType) < 0) {
        Py_DECREF(&LayoutType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
