/*
 * Native match loop of router_sim.indexer: an open-addressing table key -> 64-bit worker mask.
 *
 * KvIndexer's dicts stay the source of truth; this table mirrors, for every key that is an int
 * in [0, 2**64), the mask of workers holding the block on any tier (bit b set iff the worker
 * whose bit is b holds the key). One request lookup is then one cache line per block, and the
 * lines of a whole chunk of blocks are prefetched before any is read, so a request's misses
 * overlap instead of following one another (Python dicts cost several dependent misses per
 * block: index slot, entry, key object, value object). indexer.py keeps the pure-Python
 * matching loop as the reference and the fallback; tests check both agree.
 *
 *   MaskTable()
 *   .sync(keys, bit, held)  for each int key: set bit `bit` (0..63) if key in dict `held`,
 *                           else clear it (keys of other types are ignored)
 *   .set_bit(keys, bit) / .clear_bit(keys, bit)   the same where every key is / none is held
 *   .runs(keys, worker_of_bit) -> {worker: run length} as KvIndexer.find_matches, or None
 *                           when a key before the cut is not an int in [0, 2**64)
 *   len(table)             keys held
 *
 * Linear probing, splitmix64-scrambled keys (so sequential or crafted hashes spread out),
 * load <= 3/4, deletion by backward shift (no tombstones), memory from PyMem_Raw* (traced).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

typedef struct {
    uint64_t key;
    uint64_t mask; /* 0: empty slot */
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    size_t cap; /* a power of two */
    size_t count;
} MaskTable;

#define MIN_CAP 1024
#define AHEAD 16 /* how many keys ahead the slots are fetched */
#define STACK_KEYS 256

static inline uint64_t scramble(uint64_t x) {
    x ^= x >> 30;
    x *= UINT64_C(0xbf58476d1ce4e5b9);
    x ^= x >> 27;
    x *= UINT64_C(0x94d049bb133111eb);
    return x ^ (x >> 31);
}

/* A large table is read at random: ask for huge pages (where the kernel leaves it to
   madvise), so that a lookup costs a cache miss without a page walk besides. A hint only. */
static void advise_huge(void *p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t page = 4096, huge = (uintptr_t)1 << 21;
    if (bytes < 2 * huge)
        return;
    uintptr_t start = ((uintptr_t)p + page - 1) & ~(page - 1);
    uintptr_t end = ((uintptr_t)p + bytes) & ~(page - 1);
    (void)madvise((void *)start, end - start, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}

static int table_resize(MaskTable *t, size_t cap) {
    Slot *fresh = PyMem_RawCalloc(cap, sizeof(Slot));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    advise_huge(fresh, cap * sizeof(Slot));
    for (size_t i = 0; i < t->cap; i++) {
        Slot s = t->slots[i];
        if (!s.mask)
            continue;
        size_t j = scramble(s.key) & (cap - 1);
        while (fresh[j].mask)
            j = (j + 1) & (cap - 1);
        fresh[j] = s;
    }
    PyMem_RawFree(t->slots);
    t->slots = fresh;
    t->cap = cap;
    return 0;
}

static inline size_t table_find(const MaskTable *t, uint64_t key) {
    size_t j = scramble(key) & (t->cap - 1);
    while (t->slots[j].mask && t->slots[j].key != key)
        j = (j + 1) & (t->cap - 1);
    return j;
}

static void table_delete(MaskTable *t, size_t hole) {
    size_t cap_mask = t->cap - 1;
    size_t j = hole;
    for (;;) {
        j = (j + 1) & cap_mask;
        if (!t->slots[j].mask)
            break;
        size_t home = scramble(t->slots[j].key) & cap_mask;
        /* the entry at j may move into the hole unless its home lies in (hole, j] */
        if (((j - home) & cap_mask) >= ((j - hole) & cap_mask)) {
            t->slots[hole] = t->slots[j];
            hole = j;
        }
    }
    t->slots[hole].mask = 0;
    t->count--;
}

static PyObject *MaskTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "MaskTable() takes no arguments");
        return NULL;
    }
    MaskTable *t = (MaskTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->slots = PyMem_RawCalloc(MIN_CAP, sizeof(Slot));
    if (t->slots == NULL) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    t->cap = MIN_CAP;
    t->count = 0;
    return (PyObject *)t;
}

static void MaskTable_dealloc(MaskTable *t) {
    PyMem_RawFree(t->slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* 1: *out holds the key; 0: not an int in [0, 2**64) (no error set); -1: error set */
static inline int as_key(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o))
        return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    *out = (uint64_t)v;
    return 1;
}

/* held: a dict (membership decides), or Py_True / Py_False (set / clear every key) */
static PyObject *update(MaskTable *t, PyObject *keys_arg, PyObject *bit_arg, PyObject *held) {
    long bit = PyLong_AsLong(bit_arg);
    if (bit == -1 && PyErr_Occurred())
        return NULL;
    if (bit < 0 || bit > 63) {
        PyErr_SetString(PyExc_ValueError, "bit must lie in [0, 63]");
        return NULL;
    }
    const int by_dict = held != Py_True && held != Py_False;
    if (by_dict && !PyDict_Check(held)) {
        PyErr_SetString(PyExc_TypeError, "held must be a dict");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(keys_arg, "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    const uint64_t b = UINT64_C(1) << bit;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    /* keys converted up front; while key i is applied, the slot of key i + AHEAD is
       fetched (a hint only: the updates may move entries, and each probes afresh) */
    uint64_t stack_keys[STACK_KEYS];
    uint64_t *keys = n <= STACK_KEYS ? stack_keys : PyMem_Malloc(n * sizeof(uint64_t));
    int8_t stack_ok[STACK_KEYS];
    int8_t *is_key = n <= STACK_KEYS ? stack_ok : PyMem_Malloc(n);
    if (keys == NULL || is_key == NULL) {
        PyErr_NoMemory();
        goto fail_keys;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int ok = as_key(items[i], &keys[i]);
        if (ok < 0)
            goto fail_keys;
        is_key[i] = (int8_t)ok;
        if (ok && i < AHEAD)
            __builtin_prefetch(&t->slots[scramble(keys[i]) & (t->cap - 1)]);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n && is_key[i + AHEAD])
            __builtin_prefetch(&t->slots[scramble(keys[i + AHEAD]) & (t->cap - 1)]);
        if (!is_key[i])
            continue;
        uint64_t key = keys[i];
        int present = by_dict ? PyDict_Contains(held, items[i]) : held == Py_True;
        if (present < 0)
            goto fail_keys;
        size_t j = table_find(t, key);
        Slot *s = &t->slots[j];
        if (present) {
            if (s->mask) {
                s->mask |= b;
                continue;
            }
            s->key = key;
            s->mask = b;
            if (++t->count * 4 > t->cap * 3 && table_resize(t, t->cap * 2) < 0)
                goto fail_keys;
        } else if (s->mask & b) {
            s->mask &= ~b;
            if (!s->mask) {
                table_delete(t, j);
                if (t->cap > MIN_CAP && t->count * 8 < t->cap && table_resize(t, t->cap / 2) < 0)
                    goto fail_keys;
            }
        }
    }
    if (keys != stack_keys)
        PyMem_Free(keys);
    if (is_key != stack_ok)
        PyMem_Free(is_key);
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail_keys:
    if (keys != stack_keys)
        PyMem_Free(keys);
    if (is_key != stack_ok)
        PyMem_Free(is_key);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *MaskTable_sync(MaskTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "sync(keys, bit, held) takes 3 arguments");
        return NULL;
    }
    return update(t, args[0], args[1], args[2]);
}

static PyObject *MaskTable_set_bit(MaskTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_bit(keys, bit) takes 2 arguments");
        return NULL;
    }
    return update(t, args[0], args[1], Py_True);
}

static PyObject *MaskTable_clear_bit(MaskTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "clear_bit(keys, bit) takes 2 arguments");
        return NULL;
    }
    return update(t, args[0], args[1], Py_False);
}

/* result[worker_of_bit[b]] = n for every bit b in lost, low bits first (as the Python loop) */
static int put_lost(PyObject *result, PyObject *worker_of_bit, uint64_t lost, Py_ssize_t n) {
    while (lost) {
        int b = __builtin_ctzll(lost);
        lost &= lost - 1;
        PyObject *bo = PyLong_FromLong(b);
        if (bo == NULL)
            return -1;
        PyObject *w = PyDict_GetItemWithError(worker_of_bit, bo);
        Py_DECREF(bo);
        if (w == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_KeyError, "no worker for bit %d", b);
            return -1;
        }
        PyObject *v = PyLong_FromSsize_t(n);
        if (v == NULL || PyDict_SetItem(result, w, v) < 0) {
            Py_XDECREF(v);
            return -1;
        }
        Py_DECREF(v);
    }
    return 0;
}

static PyObject *MaskTable_runs(MaskTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "runs(keys, worker_of_bit: dict) takes 2 arguments");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    PyObject *result = PyDict_New();
    if (result == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    const Slot *slots = t->slots;
    const size_t cap_mask = t->cap - 1;
    uint64_t acc = 0;
    /* key i + AHEAD is read and its slot fetched while key i is looked up, so the misses of
       a request overlap; a ring of AHEAD + 1 keys */
    uint64_t ring[AHEAD + 1];
    for (Py_ssize_t i = -AHEAD; i < n; i++) {
        Py_ssize_t ahead = i + AHEAD;
        if (ahead < n) {
            uint64_t key;
            int ok = as_key(items[ahead], &key);
            if (ok <= 0) {
                Py_DECREF(seq);
                Py_DECREF(result);
                if (ok < 0)
                    return NULL;
                Py_RETURN_NONE; /* the caller takes the reference path */
            }
            ring[ahead % (AHEAD + 1)] = key;
            __builtin_prefetch(&slots[scramble(key) & cap_mask]);
        }
        if (i < 0)
            continue;
        uint64_t key = ring[i % (AHEAD + 1)];
        size_t j = scramble(key) & cap_mask;
        while (slots[j].mask && slots[j].key != key)
            j = (j + 1) & cap_mask;
        uint64_t mask = slots[j].mask; /* 0 when the key is absent */
        uint64_t next = i == 0 ? mask : acc & mask;
        if (next != acc && i > 0 && put_lost(result, args[1], acc & ~next, i) < 0)
            goto fail;
        acc = next;
        if (!acc)
            goto done;
    }
    if (put_lost(result, args[1], acc, n) < 0)
        goto fail;
done:
    Py_DECREF(seq);
    return result;
fail:
    Py_DECREF(seq);
    Py_DECREF(result);
    return NULL;
}

static Py_ssize_t MaskTable_len(MaskTable *t) { return (Py_ssize_t)t->count; }

static PyMethodDef MaskTable_methods[] = {
    {"sync", (PyCFunction)(void (*)(void))MaskTable_sync, METH_FASTCALL,
     "sync(keys, bit, held): mirror membership of each int key in held as bit `bit`."},
    {"set_bit", (PyCFunction)(void (*)(void))MaskTable_set_bit, METH_FASTCALL,
     "set_bit(keys, bit): set bit `bit` of each int key (all are held)."},
    {"clear_bit", (PyCFunction)(void (*)(void))MaskTable_clear_bit, METH_FASTCALL,
     "clear_bit(keys, bit): clear bit `bit` of each int key (none is held)."},
    {"runs", (PyCFunction)(void (*)(void))MaskTable_runs, METH_FASTCALL,
     "runs(keys, worker_of_bit) -> {worker: run length}, or None (reference path needed)."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods MaskTable_as_sequence = {.sq_length = (lenfunc)MaskTable_len};

static PyTypeObject MaskTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router_sim._match.MaskTable",
    .tp_basicsize = sizeof(MaskTable),
    .tp_dealloc = (destructor)MaskTable_dealloc,
    .tp_as_sequence = &MaskTable_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Key -> 64-bit mask of workers holding the block (see router_sim.indexer).",
    .tp_methods = MaskTable_methods,
    .tp_new = MaskTable_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_match", "Native match loop of router_sim.indexer.", -1, NULL,
};

PyMODINIT_FUNC PyInit__match(void) {
    if (PyType_Ready(&MaskTableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&MaskTableType);
    if (PyModule_AddObject(m, "MaskTable", (PyObject *)&MaskTableType) < 0) {
        Py_DECREF(&MaskTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
