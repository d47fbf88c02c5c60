/*
 * Native V1 block hashes (WIRE.md section 3): TensorRT-LLM's V1 BlockKeyHasher, 64-bit.
 *
 * The one implementation (kvcache.hashing calls it); the readable pure-Python reference the
 * tests compare it with is tests/_reference.py. It takes a list of token ids or packed
 * native-endian int32s (array('i'), or its bytes), so a router can hash a whole prompt in one
 * call.
 *
 *   block_hash(tokens, parent_hash, lora_id, salt_id) -> int
 *   chain(tokens, tokens_per_block, lora_id, salt_id) -> list[int]   (full blocks only)
 *   chain_lists(token_lists, parent_hash, lora_id, salt_id) -> list[int]
 *
 * lora_id / salt_id are ints in [0, 2**64) or None. Token ids must lie in [0, 2**31).
 *
 * It needs nothing but Python's C API and the arithmetic of _v1core.h (the events package's
 * msgpack codec, events/wire/_wire.c, is its own extension with its own helpers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* Above this many tokens the chain is hashed without the GIL (other threads keep running). */
#define RELEASE_GIL_TOKENS 65536

#include "_v1core.h"

/* Reads an optional u64 (None -> absent). Returns 0 on success, -1 with an exception set. */
static int parse_optional_u64(PyObject *obj, const char *name, int *present, uint64_t *out) {
    if (obj == Py_None) {
        *present = 0;
        *out = 0;
        return 0;
    }
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int in [0, 2**64) or None, got %s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be in [0, 2**64), got %R", name, obj);
        return -1;
    }
    *present = 1;
    *out = (uint64_t)v;
    return 0;
}

static int parse_scope(PyObject *lora, PyObject *salt, scope_t *scope) {
    if (parse_optional_u64(lora, "lora_id", &scope->has_lora, &scope->lora) < 0) {
        return -1;
    }
    return parse_optional_u64(salt, "salt_id", &scope->has_salt, &scope->salt);
}

/* A chain's start: parent_hash (an int, 0 for a first block: None is refused) and the scope.
 * Returns 0, or -1 with an exception set. */
static int parse_chain_start(PyObject *parent_obj, PyObject *lora, PyObject *salt,
                             uint64_t *parent, scope_t *scope) {
    int has_parent;
    if (parse_optional_u64(parent_obj, "parent_hash", &has_parent, parent) < 0 ||
        parse_scope(lora, salt, scope) < 0) {
        return -1;
    }
    if (!has_parent) {
        PyErr_SetString(PyExc_TypeError, "parent_hash must be an int (0 for a first block)");
        return -1;
    }
    return 0;
}

/* Token ids as packed int32s: a list of ints is validated and packed here (one C pass instead
 * of array('i') plus a Python-level range check); anything else must be a contiguous buffer of
 * native-endian int32s, whose negative ids the hash loops reject as they go. */
typedef struct {
    Py_buffer buf;
    int has_buf;
    int32_t *owned;
    const unsigned char *data;
    Py_ssize_t n;
} tokens_t;

static void release_tokens(tokens_t *t) {
    if (t->has_buf) {
        PyBuffer_Release(&t->buf);
        t->has_buf = 0;
    }
    PyMem_Free(t->owned);
    t->owned = NULL;
}

/* Returns 0, or -1 with an exception set (and nothing left to release). */
static int get_tokens(PyObject *obj, tokens_t *t) {
    t->has_buf = 0;
    t->owned = NULL;
    if (PyList_Check(obj)) {
        Py_ssize_t n = PyList_GET_SIZE(obj);
        t->owned = PyMem_Malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
        if (t->owned == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PyList_GET_ITEM(obj, i);
            if (!PyLong_Check(item) || PyBool_Check(item)) { /* True is not a token id */
                PyErr_Format(PyExc_TypeError, "token ids must be ints, got %s %R",
                             Py_TYPE(item)->tp_name, item);
                release_tokens(t);
                return -1;
            }
            int overflow = 0;
            long v = PyLong_AsLongAndOverflow(item, &overflow);
            if (overflow != 0 || v < 0 || v > INT32_MAX) {
                PyErr_Format(PyExc_ValueError, "token ids must be in [0, 2**31), got %R", item);
                release_tokens(t);
                return -1;
            }
            t->owned[i] = (int32_t)v;
        }
        t->data = (const unsigned char *)t->owned;
        t->n = n;
        return 0;
    }
    if (PyObject_GetBuffer(obj, &t->buf, PyBUF_SIMPLE) < 0) {
        PyErr_Format(PyExc_TypeError,
                     "tokens must be a list of ints or packed int32s (array('i'), bytes), got %s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    t->has_buf = 1;
    if (t->buf.len % 4 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "packed tokens must be whole 4-byte int32s, got %zd bytes", t->buf.len);
        release_tokens(t);
        return -1;
    }
    t->data = (const unsigned char *)t->buf.buf;
    t->n = t->buf.len / 4;
    return 0;
}

static PyObject *negative_token_error(void) {
    PyErr_SetString(PyExc_ValueError,
                    "token ids must be in [0, 2**31), got a negative id in the packed tokens");
    return NULL;
}

static PyObject *v1_block_hash(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *tokens_obj, *parent_obj, *lora, *salt;
    scope_t scope;
    tokens_t toks;
    if (!PyArg_ParseTuple(args, "OOOO:block_hash", &tokens_obj, &parent_obj, &lora, &salt)) {
        return NULL;
    }
    if (get_tokens(tokens_obj, &toks) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    uint64_t parent;
    Py_ssize_t n = toks.n;
    if (parse_chain_start(parent_obj, lora, salt, &parent, &scope) < 0) {
        goto done;
    }
    uint32_t sign = 0;
    uint64_t h = hash_block(toks.data, n, parent, &scope, &sign);
    if (sign & UINT32_C(0x80000000)) {
        negative_token_error();
        goto done;
    }
    result = PyLong_FromUnsignedLongLong(h);
done:
    release_tokens(&toks);
    return result;
}

/* chain_lists(token_lists, parent, lora, salt): the V1 hash of each block's token ids in turn
 * (a list of ints or packed int32s, as get_tokens reads them), each chained to the previous one
 * (the first to parent). Stops before the first empty block (it has no tokens to hash): the
 * result may be shorter than the input. */
static PyObject *v1_chain_lists(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *lists, *parent_obj, *lora, *salt;
    scope_t scope;
    if (!PyArg_ParseTuple(args, "OOOO:chain_lists", &lists, &parent_obj, &lora, &salt)) {
        return NULL;
    }
    if (!PyList_Check(lists)) {
        PyErr_SetString(PyExc_TypeError, "chain_lists: token_lists must be a list");
        return NULL;
    }
    uint64_t parent;
    if (parse_chain_start(parent_obj, lora, salt, &parent, &scope) < 0) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(lists);
    PyObject *result = PyList_New(0);
    if (result == NULL) {
        return NULL;
    }
    for (Py_ssize_t b = 0; b < n; b++) {
        PyObject *item = PyList_GET_ITEM(lists, b);
        tokens_t toks;
        if (PyList_Check(item) && PyList_GET_SIZE(item) == 0) {
            break;
        }
        if (get_tokens(item, &toks) < 0) {
            Py_DECREF(result);
            return NULL;
        }
        if (toks.n == 0) { /* an empty array('i'): a block without tokens, as an empty list */
            release_tokens(&toks);
            break;
        }
        uint32_t sign = 0;
        parent = hash_block(toks.data, toks.n, parent, &scope, &sign);
        release_tokens(&toks);
        if (sign & UINT32_C(0x80000000)) {
            negative_token_error();
            Py_DECREF(result);
            return NULL;
        }
        PyObject *v = PyLong_FromUnsignedLongLong(parent);
        if (v == NULL || PyList_Append(result, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(result);
            return NULL;
        }
        Py_DECREF(v);
    }
    return result;
}

static PyObject *v1_chain(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *tokens_obj, *lora, *salt;
    Py_ssize_t tpb;
    scope_t scope;
    tokens_t toks;
    if (!PyArg_ParseTuple(args, "OnOO:chain", &tokens_obj, &tpb, &lora, &salt)) {
        return NULL;
    }
    if (get_tokens(tokens_obj, &toks) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    uint64_t *hashes = NULL;
    Py_ssize_t n = toks.n;
    if (parse_scope(lora, salt, &scope) < 0) {
        goto done;
    }
    if (tpb < 1) {
        PyErr_Format(PyExc_ValueError, "tokens_per_block must be >= 1, got %zd", tpb);
        goto done;
    }
    Py_ssize_t nblocks = n / tpb;
    hashes = PyMem_Malloc(sizeof(uint64_t) * (size_t)(nblocks > 0 ? nblocks : 1));
    if (hashes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const unsigned char *p = toks.data;
    uint32_t sign = 0;
    uint64_t parent = 0;
    /* The buffer export (or our own copy) keeps the tokens stable while the GIL is released. */
    PyThreadState *released = n >= RELEASE_GIL_TOKENS ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        parent = hash_block(p + 4 * b * tpb, tpb, parent, &scope, &sign);
        hashes[b] = parent;
    }
    if (released != NULL) {
        PyEval_RestoreThread(released);
    }
    /* The tail beyond the last full block is not hashed but its ids must still be valid. */
    for (Py_ssize_t i = nblocks * tpb; i < n; i++) {
        uint32_t tok;
        memcpy(&tok, p + 4 * i, 4);
        sign |= tok;
    }
    if (sign & UINT32_C(0x80000000)) {
        negative_token_error();
        goto done;
    }
    result = PyList_New(nblocks);
    if (result == NULL) {
        goto done;
    }
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        PyObject *v = PyLong_FromUnsignedLongLong(hashes[b]);
        if (v == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, b, v);
    }
done:
    PyMem_Free(hashes);
    release_tokens(&toks);
    return result;
}

static PyMethodDef methods[] = {
    {"block_hash", v1_block_hash, METH_VARARGS,
     "block_hash(tokens, parent_hash, lora_id, salt_id) -> int: V1 hash of one block of packed "
     "int32 token ids."},
    {"chain", v1_chain, METH_VARARGS,
     "chain(tokens, tokens_per_block, lora_id, salt_id) -> list[int]: V1 hashes of every full "
     "block of packed int32 token ids."},
    {"chain_lists", v1_chain_lists, METH_VARARGS,
     "chain_lists(token_lists, parent_hash, lora_id, salt_id) -> list[int]: V1 hash of each "
     "list of token ids chained from parent_hash; stops before the first empty list."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvcache._v1hash", "Native V1 block hashes (see kvcache.hashing).", -1,
    methods, NULL, NULL, NULL, NULL,
};

/* The C API other extensions call for V1 hashes (a capsule, "kvcache._v1hash.hash_block_api"),
 * so the arithmetic (_v1core.h) is compiled into this extension alone. No Python object is
 * touched: callable without the GIL. Its signature is the one documented where the capsule is read. */
static uint64_t api_hash_block(const unsigned char *p, Py_ssize_t n, uint64_t parent,
                               int has_lora, uint64_t lora, int has_salt, uint64_t salt) {
    scope_t scope = {has_lora, lora, has_salt, salt};
    uint32_t sign = 0;
    return hash_block(p, n, parent, &scope, &sign);
}

PyMODINIT_FUNC PyInit__v1hash(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    PyObject *api = PyCapsule_New((void *)api_hash_block, "kvcache._v1hash.hash_block_api", NULL);
    if (api == NULL || PyModule_AddObject(m, "hash_block_api", api) < 0) {
        Py_XDECREF(api);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
