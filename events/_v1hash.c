/*
 * Native V1 block hashes (WIRE.md section 3): TensorRT-LLM's V1 BlockKeyHasher, 64-bit.
 *
 * events/hashing.py keeps the readable pure-Python reference; this file computes the same
 * values for a list of token ids or packed native-endian int32s (array('i'), or its bytes), so
 * a router can hash a whole prompt in one call. Tests check both agree.
 *
 *   block_hash(tokens, parent_hash, lora_id, salt_id) -> int
 *   chain(tokens, tokens_per_block, lora_id, salt_id) -> list[int]   (full blocks only)
 *
 * lora_id / salt_id are ints in [0, 2**64) or None. Token ids must lie in [0, 2**31).
 *
 * It also holds the native steps of the event path that hash or build records (each with its
 * pure-Python reference beside its caller): the StoredBlock record builders (events/_records.py)
 * and the wire encoder's runs of a Stored event's blocks (stored_runs, events/codec.py). The
 * msgpack codec itself is in _wire.c, its own extension so that one failing to build leaves
 * the other; what they share is in _native_common.h.
 */
#include "_native_common.h"

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

/* ---- record builders ------------------------------------------------------------------
 *
 * The event records are frozen slotted dataclasses; their generated __init__ stores each field
 * through object.__setattr__, which costs about a microsecond per StoredBlock. These builders
 * allocate the record with its type's tp_alloc (as object.__new__ does) and store each field
 * through the slot's own descriptor, the same store object.__setattr__ ends in. The Python
 * module events.wire._records holds the readable reference and passes the type and its
 * descriptors, in field order, on every call. */

/* The token lists these builders make hold only ints, so they cannot be part of a reference
 * cycle and the cyclic collector gains nothing from them; yet, tracked, every young-generation
 * collection walks each of their items (a 32-token block costs the collector more than the
 * record itself: over a microsecond per block on a busy event path). They are untracked, as
 * CPython untracks dicts and tuples that hold only atomic values. The one consequence: a cycle
 * made by storing a container that refers back into such a list would never be collected;
 * token lists are data, and nothing in this project stores anything but token ids in them. */
static void untrack_token_list(PyObject *list) {
    Py_ssize_t n = PyList_GET_SIZE(list);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_CheckExact(PyList_GET_ITEM(list, i))) {
            return; /* not a plain token list: left to the collector */
        }
    }
    PyObject_GC_UnTrack(list);
}

/* Checks (cls, setters): a type and a tuple of RECORD_FIELDS data descriptors. */
static int check_record_type(PyObject *cls, PyObject *setters) {
    if (!PyType_Check(cls)) {
        PyErr_Format(PyExc_TypeError, "record type must be a class, got %s",
                     Py_TYPE(cls)->tp_name);
        return -1;
    }
    if (!PyTuple_CheckExact(setters) || PyTuple_GET_SIZE(setters) != RECORD_FIELDS) {
        PyErr_Format(PyExc_TypeError, "record setters must be a tuple of %d slot descriptors",
                     RECORD_FIELDS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < RECORD_FIELDS; i++) {
        if (Py_TYPE(PyTuple_GET_ITEM(setters, i))->tp_descr_set == NULL) {
            PyErr_Format(PyExc_TypeError, "record setter %zd is not a data descriptor", i);
            return -1;
        }
    }
    return 0;
}

/* stored_blocks(cls, setters, hashes, tokens, block_size, lora_id, cache_level, priority,
 * salt_id) -> list: record i holds hashes[i] and tokens[i*block_size : (i+1)*block_size]. */
static PyObject *stored_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "stored_blocks takes 9 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *cls = args[0], *setters = args[1], *hashes = args[2], *tokens = args[3];
    if (check_record_type(cls, setters) < 0) {
        return NULL;
    }
    /* token ids as a list, or packed: an array (each block gets its slice, an array too) */
    int is_list = PyList_Check(tokens);
    if (!PyList_Check(hashes) || !(is_list || Py_IS_TYPE(tokens, (PyTypeObject *)ARRAY_TYPE))) {
        PyErr_SetString(PyExc_TypeError,
                        "stored_blocks needs lists of hashes and token ids (a list or an array)");
        return NULL;
    }
    Py_ssize_t bs = PyLong_AsSsize_t(args[4]);
    if (bs == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (bs < 1) {
        PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %zd", bs);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(hashes), count = Py_SIZE(tokens);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* allocating may run a collection and with it arbitrary finalizers: the lists are read
         * again, and the hash held, as if any Python code could run between two blocks */
        if (i >= PyList_GET_SIZE(hashes) || count != Py_SIZE(tokens)) {
            PyErr_SetString(PyExc_RuntimeError, "stored_blocks: a list changed while in use");
            goto error;
        }
        /* clamped to the token count without ever computing an i * bs that could overflow */
        Py_ssize_t lo = i <= count / bs ? i * bs : count;
        Py_ssize_t hi = bs < count - lo ? lo + bs : count;
        PyObject *slice;
        if (is_list) {
            slice = PyList_GetSlice(tokens, lo, hi);
            if (slice == NULL) {
                goto error;
            }
            untrack_token_list(slice);
        } else {
            slice = PySequence_GetSlice(tokens, lo, hi); /* an array: not a GC object */
            if (slice == NULL) {
                goto error;
            }
        }
        PyObject *hash = Py_NewRef(PyList_GET_ITEM(hashes, i));
        PyObject *values[RECORD_FIELDS] = {hash, slice, args[5], args[6], args[7], args[8]};
        PyObject *rec = new_record(cls, setters, values);
        Py_DECREF(hash);
        Py_DECREF(slice);
        if (rec == NULL) {
            goto error;
        }
        PyList_SET_ITEM(out, i, rec);
    }
    return out;
error:
    Py_DECREF(out);
    return NULL;
}

static PyObject *v1_record(PyObject *cls, PyObject *setters, PyObject *tokens_obj,
                           uint64_t parent, const scope_t *scope, PyObject *const *attrs,
                           const uint64_t *known, uint64_t *hash_out);

/* v1_stored_block(cls, setters, tokens, parent_hash, lora_id, salt_id, cache_level, priority)
 * -> record: the V1 hash of packed int32 tokens chained to parent_hash (an int) and the record
 * announcing it, its token ids packed (an array('i') holds them as it is, any other buffer is
 * copied into one). */
static PyObject *v1_stored_block(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "v1_stored_block takes 8 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *cls = args[0], *setters = args[1];
    if (check_record_type(cls, setters) < 0) {
        return NULL;
    }
    scope_t scope;
    uint64_t parent;
    if (parse_chain_start(args[3], args[4], args[5], &parent, &scope) < 0) {
        return NULL;
    }
    /* the record's other fields: lora_id, cache_level, priority, cache_salt_id */
    PyObject *const attrs[4] = {args[4], args[6], args[7], args[5]};
    uint64_t h;
    return v1_record(cls, setters, args[2], parent, &scope, attrs, NULL, &h);
}

/* The record of one block of packed int32 tokens hashed under parent: values[] holds the
 * record's other fields (lora_id, cache_level, priority, cache_salt_id) and *hash_out gets the
 * block's hash. With known, *known is the block's hash, taken as it is (neither the hash nor
 * the tokens' signs are computed). A new reference, or NULL with an exception set. */
static PyObject *v1_record(PyObject *cls, PyObject *setters, PyObject *tokens_obj,
                           uint64_t parent, const scope_t *scope, PyObject *const *attrs,
                           const uint64_t *known, uint64_t *hash_out) {
    Py_buffer buf;
    if (PyObject_GetBuffer(tokens_obj, &buf, PyBUF_FORMAT) < 0) {
        return NULL;
    }
    PyObject *result = NULL, *list = NULL, *hash = NULL;
    if (buf.len % 4 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "packed tokens must be whole 4-byte int32s, got %zd bytes", buf.len);
        goto done;
    }
    Py_ssize_t n = buf.len / 4;
    const unsigned char *p = (const unsigned char *)buf.buf;
    uint32_t sign = 0;
    uint64_t h = known != NULL ? *known : hash_block(p, n, parent, scope, &sign);
    if (sign & UINT32_C(0x80000000)) {
        negative_token_error();
        goto done;
    }
    /* the record holds the tokens packed: the array itself when it is an array('i') (the
     * cache's own, which it never changes in place), else a packed copy of the buffer */
    list = Py_IS_TYPE(tokens_obj, (PyTypeObject *)ARRAY_TYPE) && buf.itemsize == 4 &&
                   buf.format != NULL && strcmp(buf.format, "i") == 0
               ? Py_NewRef(tokens_obj)
               : int32_array_of(p, n);
    if (list == NULL) {
        goto done;
    }
    hash = PyLong_FromUnsignedLongLong(h);
    if (hash == NULL) {
        goto done;
    }
    PyObject *values[RECORD_FIELDS] = {hash, list, attrs[0], attrs[1], attrs[2], attrs[3]};
    result = new_record(cls, setters, values);
    *hash_out = h;
done:
    Py_XDECREF(hash);
    Py_XDECREF(list);
    PyBuffer_Release(&buf);
    return result;
}

/* v1_stored_chain(cls, setters, token_arrays, parent_hash, lora_id, salt_id, cache_level,
 * priority[, known]) -> list: the records of a chain of blocks, one per packed int32 token
 * array, each hashed under the previous one's hash (the first under parent_hash, 0 for a first
 * block): what v1_stored_block does block by block, in one call per chain. known (a list of
 * ints in [0, 2**64), or None): the hashes of the first blocks when the caller has them, taken
 * as they are (trusted: not checked against the tokens); the blocks past them are hashed under
 * the last one. */
static PyObject *v1_stored_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8 && nargs != 9) {
        PyErr_Format(PyExc_TypeError, "v1_stored_chain takes 8 or 9 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *known = nargs == 9 && args[8] != Py_None ? args[8] : NULL;
    if (known != NULL && !PyList_Check(known)) {
        PyErr_SetString(PyExc_TypeError, "v1_stored_chain: known must be a list of ints or None");
        return NULL;
    }
    PyObject *cls = args[0], *setters = args[1], *arrays = args[2];
    if (check_record_type(cls, setters) < 0) {
        return NULL;
    }
    if (!PyList_Check(arrays)) {
        PyErr_SetString(PyExc_TypeError, "v1_stored_chain needs a list of token arrays");
        return NULL;
    }
    scope_t scope;
    uint64_t parent;
    if (parse_chain_start(args[3], args[4], args[5], &parent, &scope) < 0) {
        return NULL;
    }
    PyObject *attrs[4] = {args[4], args[6], args[7], args[5]};
    Py_ssize_t n = PyList_GET_SIZE(arrays);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* allocating may run finalizers that change the list: read it again, hold the item */
        if (PyList_GET_SIZE(arrays) != n) {
            PyErr_SetString(PyExc_RuntimeError, "v1_stored_chain: the list changed while in use");
            Py_DECREF(out);
            return NULL;
        }
        uint64_t h = 0, given = 0;
        int has = known != NULL && i < PyList_GET_SIZE(known);
        if (has) {
            PyObject *item = PyList_GET_ITEM(known, i);
            if (!PyLong_CheckExact(item)) {
                PyErr_SetString(PyExc_TypeError, "v1_stored_chain: known hashes must be ints");
                Py_DECREF(out);
                return NULL;
            }
            given = PyLong_AsUnsignedLongLong(item);
            if (given == (uint64_t)-1 && PyErr_Occurred()) {
                PyErr_SetString(PyExc_OverflowError,
                                "v1_stored_chain: known hashes must be in [0, 2**64)");
                Py_DECREF(out);
                return NULL;
            }
        }
        PyObject *tokens = Py_NewRef(PyList_GET_ITEM(arrays, i));
        PyObject *rec =
            v1_record(cls, setters, tokens, parent, &scope, attrs, has ? &given : NULL, &h);
        Py_DECREF(tokens);
        if (rec == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, rec);
        parent = h;
    }
    return out;
}

/* ---- the event manager's flush ---------------------------------------------------------
 *
 * build_events(spec, pending, first_id, block_size, window_size, hash_algo, dp_rank) -> list:
 * KVCacheEventManager's pending items as numbered events, what events.manager._build_events_py
 * does (the reference, compared in the tests) with a record builder per event instead of two
 * frozen-dataclass constructors. spec is (PendingStored, PendingRemoved, Stored,
 * Stored's setters, Stored's default tail, Removed, Removed's setters, Removed's default tail,
 * KVCacheEvent, KVCacheEvent's setters): a pending Stored becomes Stored(parent_hash, blocks,
 * block_size, *tail), a pending Removed Removed(block_hashes, cache_level, *tail), anything else
 * is the event's data as it is; event i gets the id first_id + i. */

#define MAX_EVENT_FIELDS 16

static PyObject *STR_PARENT_HASH, *STR_BLOCKS, *STR_BLOCK_HASHES, *ONE_INT;

/* Checks that setters is a tuple of n data descriptors: 0, or -1 with an exception set. */
static int check_setters(PyObject *setters, Py_ssize_t n, const char *what) {
    if (!PyTuple_CheckExact(setters) || PyTuple_GET_SIZE(setters) != n) {
        PyErr_Format(PyExc_TypeError, "build_events: %s setters must be a tuple of %zd slot "
                     "descriptors", what, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (Py_TYPE(PyTuple_GET_ITEM(setters, i))->tp_descr_set == NULL) {
            PyErr_Format(PyExc_TypeError, "build_events: %s setter %zd is not a data descriptor",
                         what, i);
            return -1;
        }
    }
    return 0;
}

/* A record of cls whose fields are head[0..nhead) then tail's items; NULL with an exception. */
static PyObject *record_with_tail(PyObject *cls, PyObject *setters, PyObject *const *head,
                                  Py_ssize_t nhead, PyObject *tail) {
    PyObject *values[MAX_EVENT_FIELDS];
    Py_ssize_t n = nhead + PyTuple_GET_SIZE(tail);
    for (Py_ssize_t k = 0; k < nhead; k++) {
        values[k] = head[k];
    }
    for (Py_ssize_t k = nhead; k < n; k++) {
        values[k] = PyTuple_GET_ITEM(tail, k - nhead);
    }
    return new_record_n(cls, setters, values, n);
}

/* The event data of one pending item (a new reference), or NULL with an exception set. */
static PyObject *event_data(PyObject *item, PyObject *const *spec, PyObject *block_size) {
    int is = PyObject_IsInstance(item, spec[0]);
    if (is < 0) {
        return NULL;
    }
    PyObject *a, *b, *data;
    if (is) {
        if ((a = PyObject_GetAttr(item, STR_PARENT_HASH)) == NULL) {
            return NULL;
        }
        if ((b = PyObject_GetAttr(item, STR_BLOCKS)) == NULL) {
            Py_DECREF(a);
            return NULL;
        }
        PyObject *head[3] = {a, b, block_size};
        data = record_with_tail(spec[2], spec[3], head, 3, spec[4]);
    } else {
        if ((is = PyObject_IsInstance(item, spec[1])) <= 0) {
            return is < 0 ? NULL : Py_NewRef(item);
        }
        if ((a = PyObject_GetAttr(item, STR_BLOCK_HASHES)) == NULL) {
            return NULL;
        }
        if ((b = PyObject_GetAttr(item, STR_CACHE_LEVEL)) == NULL) {
            Py_DECREF(a);
            return NULL;
        }
        PyObject *head[2] = {a, b};
        data = record_with_tail(spec[5], spec[6], head, 2, spec[7]);
    }
    Py_DECREF(a);
    Py_DECREF(b);
    return data;
}

static PyObject *build_events(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "build_events takes 7 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *spec_obj = args[0], *pending = args[1], *first_id = args[2];
    if (!PyTuple_CheckExact(spec_obj) || PyTuple_GET_SIZE(spec_obj) != 10) {
        PyErr_SetString(PyExc_TypeError, "build_events: spec must be a tuple of 10 items");
        return NULL;
    }
    PyObject *const *spec = &PyTuple_GET_ITEM(spec_obj, 0);
    for (int k = 0; k < 10; k++) {
        int want_type = k == 0 || k == 1 || k == 2 || k == 5 || k == 8;
        if (want_type ? !PyType_Check(spec[k]) : !PyTuple_CheckExact(spec[k])) {
            PyErr_Format(PyExc_TypeError, "build_events: spec item %d must be a %s", k,
                         want_type ? "class" : "tuple");
            return NULL;
        }
    }
    if (PyTuple_GET_SIZE(spec[4]) > MAX_EVENT_FIELDS - 3 ||
        PyTuple_GET_SIZE(spec[7]) > MAX_EVENT_FIELDS - 2) {
        PyErr_SetString(PyExc_ValueError, "build_events: too many record fields");
        return NULL;
    }
    if (check_setters(spec[3], 3 + PyTuple_GET_SIZE(spec[4]), "Stored") < 0 ||
        check_setters(spec[6], 2 + PyTuple_GET_SIZE(spec[7]), "Removed") < 0 ||
        check_setters(spec[9], 5, "event") < 0) {
        return NULL;
    }
    if (!PyList_CheckExact(pending)) {
        PyErr_Format(PyExc_TypeError, "build_events needs a list of pending items, got %s",
                     Py_TYPE(pending)->tp_name);
        return NULL;
    }
    if (!PyLong_Check(first_id)) {
        PyErr_Format(PyExc_TypeError, "build_events: first_id must be an int, got %s",
                     Py_TYPE(first_id)->tp_name);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(pending);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    PyObject *event_id = Py_NewRef(first_id);
    for (Py_ssize_t i = 0; i < n; i++) {
        /* attribute reads and isinstance may run Python code that changes the list */
        if (PyList_GET_SIZE(pending) != n) {
            PyErr_SetString(PyExc_RuntimeError, "build_events: the pending list changed");
            goto fail;
        }
        PyObject *item = Py_NewRef(PyList_GET_ITEM(pending, i));
        PyObject *data = event_data(item, spec, args[3]);
        Py_DECREF(item);
        if (data == NULL) {
            goto fail;
        }
        PyObject *values[5] = {event_id, data, args[4], args[5], args[6]};
        PyObject *event = new_record_n(spec[8], spec[9], values, 5);
        Py_DECREF(data);
        if (event == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(out, i, event);
        if (i + 1 < n) {
            /* Python's int addition: ids are unbounded there too */
            Py_SETREF(event_id, PyNumber_Add(event_id, ONE_INT));
            if (event_id == NULL) {
                goto fail;
            }
        }
    }
    Py_DECREF(event_id);
    return out;
fail:
    Py_XDECREF(event_id);
    Py_DECREF(out);
    return NULL;
}

/* ---- wire encoder ---------------------------------------------------------------------
 *
 * stored_runs(blocks, block_size) -> list[(end, token_ids, hashes)]: the runs of a Stored
 * event's blocks that travel as one wire event each (same lora_id, cache_level, priority and
 * cache_salt_id; only a run's last block may be short), with each run's token ids concatenated
 * (an array('i') when every block of the run holds one, else a list) and its block hashes
 * listed. events.wire.codec keeps the readable reference (_stored_runs_py). */

#define RUN_ATTRS 4 /* lora_id, cache_level, priority, cache_salt_id */

typedef struct {
    PyObject *hash;
    PyObject *tokens; /* an array('i'), or a list or tuple (PySequence_Fast) */
    int packed;       /* tokens is an array('i') */
    Py_ssize_t n;     /* how many token ids */
    PyObject *attrs[RUN_ATTRS];
} wire_block_t;

static void clear_wire_block(wire_block_t *b) {
    Py_CLEAR(b->hash);
    Py_CLEAR(b->tokens);
    for (int k = 0; k < RUN_ATTRS; k++) {
        Py_CLEAR(b->attrs[k]);
    }
}

/* Reads one block's fields; 0, or -1 with an exception set (and nothing held). */
static int read_wire_block(PyObject *block, wire_block_t *b) {
    memset(b, 0, sizeof(*b));
    PyObject *names[RUN_ATTRS] = {STR_LORA_ID, STR_CACHE_LEVEL, STR_PRIORITY, STR_CACHE_SALT_ID};
    PyObject *tokens = PyObject_GetAttr(block, STR_TOKENS);
    if (tokens == NULL) {
        return -1;
    }
    Py_buffer view;
    int packed = int32_view(tokens, &view);
    if (packed < 0) {
        Py_DECREF(tokens);
        return -1;
    }
    if (packed) {
        b->packed = 1;
        b->n = view.len / 4;
        PyBuffer_Release(&view);
        b->tokens = tokens;
    } else {
        b->tokens = PySequence_Fast(tokens, "stored block tokens must be a sequence of ints");
        Py_DECREF(tokens);
        if (b->tokens != NULL) {
            b->n = PySequence_Fast_GET_SIZE(b->tokens);
        }
    }
    if (b->tokens == NULL || (b->hash = PyObject_GetAttr(block, STR_BLOCK_HASH)) == NULL) {
        clear_wire_block(b);
        return -1;
    }
    for (int k = 0; k < RUN_ATTRS; k++) {
        if ((b->attrs[k] = PyObject_GetAttr(block, names[k])) == NULL) {
            clear_wire_block(b);
            return -1;
        }
    }
    return 0;
}

/* 1 when a and b may share a wire event (equal attributes), 0 when not, -1 on error. */
static int same_run_attrs(const wire_block_t *a, const wire_block_t *b) {
    for (int k = 0; k < RUN_ATTRS; k++) {
        int ne = PyObject_RichCompareBool(a->attrs[k], b->attrs[k], Py_NE);
        if (ne != 0) {
            return ne < 0 ? -1 : 0;
        }
    }
    return 1;
}

/* The token ids of a run's blocks, concatenated: parts holds each block's tokens (an array('i')
 * when packed is set for all, else arrays and lists or tuples), total the count. */
static PyObject *join_tokens(PyObject *parts, int packed, Py_ssize_t total) {
    Py_ssize_t count = PyList_GET_SIZE(parts);
    if (packed) {
        unsigned char *data;
        PyObject *arr = int32_array_new(total, &data);
        if (arr == NULL) {
            return NULL;
        }
        Py_ssize_t at = 0;
        for (Py_ssize_t i = 0; i < count; i++) {
            Py_buffer view;
            if (PyObject_GetBuffer(PyList_GET_ITEM(parts, i), &view, PyBUF_SIMPLE) < 0) {
                Py_DECREF(arr);
                return NULL;
            }
            /* the arrays' sizes were read with the blocks; one resized since is refused */
            if (view.len > 4 * (total - at)) {
                PyBuffer_Release(&view);
                Py_DECREF(arr);
                PyErr_SetString(PyExc_RuntimeError, "stored_runs: a block's tokens changed");
                return NULL;
            }
            memcpy(data + 4 * at, view.buf, (size_t)view.len);
            at += view.len / 4;
            PyBuffer_Release(&view);
        }
        if (at != total) {
            Py_DECREF(arr);
            PyErr_SetString(PyExc_RuntimeError, "stored_runs: a block's tokens changed");
            return NULL;
        }
        return arr;
    }
    PyObject *list = PyList_New(0);
    if (list == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        /* an array's ints (a run that mixes arrays and lists); a list or tuple as it is */
        PyObject *part = PySequence_Fast(PyList_GET_ITEM(parts, i), "token ids");
        Py_ssize_t len = PyList_GET_SIZE(list);
        int rc = part == NULL ? -1 : PyList_SetSlice(list, len, len, part);
        Py_XDECREF(part);
        if (rc < 0) {
            Py_DECREF(list);
            return NULL;
        }
    }
    return list;
}

/* Appends (end, token_ids, hashes) to out and starts new run lists; 0 or -1. */
static int emit_run(PyObject *out, Py_ssize_t end, PyObject **parts, int packed,
                    Py_ssize_t total, PyObject **hashes) {
    PyObject *tokens = join_tokens(*parts, packed, total);
    if (tokens == NULL) {
        return -1;
    }
    PyObject *run = Py_BuildValue("(nNO)", end, tokens, *hashes);
    if (run == NULL) {
        return -1;
    }
    int rc = PyList_Append(out, run);
    Py_DECREF(run);
    Py_SETREF(*parts, PyList_New(0));
    Py_SETREF(*hashes, PyList_New(0));
    return rc < 0 || *parts == NULL || *hashes == NULL ? -1 : 0;
}

static PyObject *stored_runs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *blocks_obj;
    Py_ssize_t bs;
    if (!PyArg_ParseTuple(args, "On:stored_runs", &blocks_obj, &bs)) {
        return NULL;
    }
    PyObject *blocks = PySequence_Fast(blocks_obj, "stored_runs needs a sequence of blocks");
    if (blocks == NULL) {
        return NULL;
    }
    PyObject *out = PyList_New(0), *parts = PyList_New(0), *hashes = PyList_New(0);
    Py_ssize_t count = PySequence_Fast_GET_SIZE(blocks);
    Py_ssize_t total = 0; /* token ids in the run so far */
    int packed = 1;       /* every block of the run so far holds an array('i') */
    wire_block_t cur, nxt;
    int have_cur = 0;
    if (out == NULL || parts == NULL || hashes == NULL) {
        goto fail;
    }
    if (count > 0) {
        if (read_wire_block(PySequence_Fast_GET_ITEM(blocks, 0), &cur) < 0) {
            goto fail;
        }
        have_cur = 1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t n = cur.n;
        if (!(0 < n && n <= bs)) {
            PyErr_Format(PyExc_ValueError,
                         "stored block %zd has %zd tokens; blocks must hold 1..block_size (%zd) "
                         "tokens",
                         i, n, bs);
            goto fail;
        }
        if (PyList_Append(parts, cur.tokens) < 0 || PyList_Append(hashes, cur.hash) < 0) {
            goto fail;
        }
        total += n;
        packed = packed && cur.packed;
        int boundary = i + 1 == count || n < bs;
        /* attribute reads and comparisons may run Python code that resizes the list */
        if (PySequence_Fast_GET_SIZE(blocks) != count) {
            PyErr_SetString(PyExc_RuntimeError, "stored_runs: the blocks changed while in use");
            goto fail;
        }
        if (i + 1 < count) {
            if (read_wire_block(PySequence_Fast_GET_ITEM(blocks, i + 1), &nxt) < 0) {
                goto fail;
            }
            if (!boundary) {
                int same = same_run_attrs(&cur, &nxt);
                if (same < 0) {
                    clear_wire_block(&nxt);
                    goto fail;
                }
                boundary = !same;
            }
        }
        clear_wire_block(&cur);
        have_cur = 0;
        if (i + 1 < count) {
            cur = nxt;
            have_cur = 1;
        }
        if (boundary) {
            if (emit_run(out, i + 1, &parts, packed, total, &hashes) < 0) {
                goto fail;
            }
            total = 0;
            packed = 1;
        }
    }
    Py_DECREF(parts);
    Py_DECREF(hashes);
    Py_DECREF(blocks);
    return out;
fail:
    if (have_cur) {
        clear_wire_block(&cur);
    }
    Py_XDECREF(parts);
    Py_XDECREF(hashes);
    Py_XDECREF(out);
    Py_DECREF(blocks);
    return NULL;
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
    {"stored_blocks", (PyCFunction)(void (*)(void))stored_blocks, METH_FASTCALL,
     "stored_blocks(cls, setters, hashes, tokens, block_size, lora_id, cache_level, priority, "
     "salt_id) -> list: one record per hash, each with its block_size slice of tokens."},
    {"v1_stored_block", (PyCFunction)(void (*)(void))v1_stored_block, METH_FASTCALL,
     "v1_stored_block(cls, setters, tokens, parent_hash, lora_id, salt_id, cache_level, "
     "priority) -> record: V1 hash and record of one block of packed int32 token ids."},
    {"v1_stored_chain", (PyCFunction)(void (*)(void))v1_stored_chain, METH_FASTCALL,
     "v1_stored_chain(cls, setters, token_arrays, parent_hash, lora_id, salt_id, cache_level, "
     "priority[, known]) -> list: the records of a chain of blocks of packed int32 token ids, "
     "each hashed under the previous one's hash (known: the first ones' hashes, if given)."},
    {"build_events", (PyCFunction)(void (*)(void))build_events, METH_FASTCALL,
     "build_events(spec, pending, first_id, block_size, window_size, hash_algo, dp_rank) -> "
     "list: the event manager's pending items as numbered events."},
    {"stored_runs", stored_runs, METH_VARARGS,
     "stored_runs(blocks, block_size) -> list[(end, token_ids, hashes)]: the wire events of a "
     "Stored event's blocks."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_v1hash", "Native V1 block hashes (see events.hashing).", -1, methods,
    NULL, NULL, NULL, NULL,
};

/* The C API other extensions call for V1 hashes (a capsule, "events._v1hash.hash_block_api"),
 * so the arithmetic lives in this package alone. No Python object is touched: callable
 * without the GIL. Its signature is the one documented where the capsule is read. */
static uint64_t api_hash_block(const unsigned char *p, Py_ssize_t n, uint64_t parent,
                               int has_lora, uint64_t lora, int has_salt, uint64_t salt) {
    scope_t scope = {has_lora, lora, has_salt, salt};
    uint32_t sign = 0;
    return hash_block(p, n, parent, &scope, &sign);
}

PyMODINIT_FUNC PyInit__v1hash(void) {
    if (native_common_init() < 0 ||
        (STR_PARENT_HASH = PyUnicode_InternFromString("parent_hash")) == NULL ||
        (STR_BLOCKS = PyUnicode_InternFromString("blocks")) == NULL ||
        (STR_BLOCK_HASHES = PyUnicode_InternFromString("block_hashes")) == NULL ||
        (ONE_INT = PyLong_FromLong(1)) == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    PyObject *api = PyCapsule_New((void *)api_hash_block, "events._v1hash.hash_block_api", NULL);
    if (api == NULL || PyModule_AddObject(m, "hash_block_api", api) < 0) {
        Py_XDECREF(api);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
