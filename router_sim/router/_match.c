/*
 * Native match loop of router_sim.router.indexer: an open-addressing table key -> worker mask
 * (each event's keys handed over in one call).
 *
 * KvIndexer's dicts stay the source of truth; this table mirrors, for every key that is an int
 * in [0, 2**64), the mask of workers holding the block on any tier (bit b set iff the worker
 * whose bit is b holds the key). A mask is as many 64-bit words as the highest bit in use
 * needs (one word up to 64 workers, two up to 128, ...): the table is rebuilt one word wider
 * when a worker's bit passes the width, so any fleet size takes the native path. One request
 * lookup is then one slot per block, and the slots of the next keys are prefetched before
 * they are read, so a request's misses overlap instead of following one another (Python dicts
 * cost several dependent misses per block: index slot, entry, key object, value object).
 * indexer.py keeps a Python matching loop for keys the table does not hold (strings, ints
 * outside [0, 2**64), group-scoped pairs); the tests check both against a plain model of who
 * holds what (tests/_reference.py).
 *
 *   MaskTable()
 *   .sync(keys, bit, held)  for each int key: set bit `bit` if key in dict `held`, else clear
 *                           it (keys of other types are ignored)
 *   .set_bit(keys, bit) / .clear_bit(keys, bit)   the same where every key is / none is held
 *   .runs(keys, worker_of_bit) -> {worker: run length} as KvIndexer.find_matches, or None
 *                           when a key before the cut is not an int in [0, 2**64)
 *   .detailed(keys, worker_of_bit, make[, fields]) -> {worker: make(...)} (see below)
 *   .device_bit(keys, bit, on) / .device_get(key)   the device-tier masks
 *   .words                  64-bit words per mask;  len(table): keys held
 *
 * Linear probing; a key's home slot is a keyed mix of it (two rounds of the splitmix64
 * finalizer around a random key drawn when the module loads), so that neither sequential nor
 * crafted hashes pile into one run: the finalizer alone is invertible, and a worker that knew
 * it could announce 40,000 hashes of one home slot, each insertion then probing past all the
 * earlier ones (1.2 s for one batch). `probes` counts the slots examined past the home slots,
 * load <= 3/4, deletion by backward shift (no tombstones), memory from PyMem_Raw* (traced).
 * A slot: the key, the any-tier mask, the device mask (each `words` uint64s), padded to a
 * power of two words; a slot is empty iff both masks are 0.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#ifdef __linux__
#include <sys/mman.h>
#endif

typedef struct {
    PyObject_HEAD
    uint64_t *slots; /* cap * stride_of(words): key, any-tier mask; cache-line aligned */
    uint64_t *dev;   /* cap * words: the device mask of the key in the same slot */
    void *raw;       /* the allocations holding slots and dev */
    void *raw_dev;
    size_t cap; /* a power of two */
    size_t count;
    size_t words;    /* mask words per slot */
    uint64_t probes; /* slots examined past keys' home slots (finds, inserts, moves) */
    PyObject *other; /* key -> device mask for keys that are not ints in [0, 2**64) */
} MaskTable;

#define MIN_CAP 1024
#define AHEAD 16 /* how many keys ahead the slots are fetched */
#define STACK_KEYS 256
#define STACK_WORDS 32
/* bits of worker masks: 2**20 workers (a 128 KiB mask per slot) is far past any fleet; the
   bound keeps a wild bit number from asking for terabytes */
#define MAX_BIT ((1L << 20) - 1)

/* the placement key, drawn from os.urandom when the module loads (PyInit__match) */
static uint64_t place_k0, place_k1;

static inline uint64_t finalize(uint64_t x) {
    x ^= x >> 30;
    x *= UINT64_C(0xbf58476d1ce4e5b9);
    x ^= x >> 27;
    x *= UINT64_C(0x94d049bb133111eb);
    return x ^ (x >> 31);
}

/* A key's home slot (its low bits): keyed, so that no one outside this process can choose
   keys that share one. */
static inline uint64_t scramble(uint64_t x) { return finalize(finalize(x ^ place_k0) + place_k1); }

/* A slot: the key and the any-tier mask, padded to a power of two words, so that in a table
   aligned to cache lines a lookup reads one line (up to 448 workers); the device masks lie in
   a parallel array that only updates and device reads touch. A device bit is never set
   without the key's any-tier bit (a worker holding a block on the device tier holds it), so
   a slot is empty iff its any-tier mask is 0. */
static inline size_t stride_of(size_t words) {
    size_t n = 2;
    while (n < 1 + words)
        n *= 2;
    return n;
}

/* `n_words` zeroed words aligned to a cache line; *raw receives what to free */
static uint64_t *alloc_words(size_t n_words, void **raw) {
    void *r = PyMem_RawCalloc(n_words * sizeof(uint64_t) + 64, 1);
    if (r == NULL)
        return NULL;
    *raw = r;
    return (uint64_t *)(((uintptr_t)r + 63) & ~(uintptr_t)63);
}

static inline uint64_t *slot_at(const MaskTable *t, size_t j) {
    return t->slots + j * stride_of(t->words);
}

static inline size_t index_of(const MaskTable *t, const uint64_t *s) {
    return (size_t)(s - t->slots) / stride_of(t->words);
}

static inline uint64_t *dev_at(const MaskTable *t, size_t j) { return t->dev + j * t->words; }

static inline int slot_empty(const uint64_t *s, size_t words) {
    for (size_t w = 1; w <= words; w++)
        if (s[w])
            return 0;
    return 1;
}

static inline void prefetch_key(const MaskTable *t, uint64_t key, int with_dev) {
    size_t j = scramble(key) & (t->cap - 1);
    __builtin_prefetch(slot_at(t, j));
    if (with_dev)
        __builtin_prefetch(dev_at(t, j));
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

/* rebuild into `cap` slots of `words` mask words (words >= the current width) */
static int table_rebuild(MaskTable *t, size_t cap, size_t words) {
    const size_t stride = stride_of(words), old_words = t->words;
    if (cap > (PY_SSIZE_T_MAX - 64) / 8 / (stride + words)) {
        PyErr_NoMemory();
        return -1;
    }
    void *raw = NULL, *raw_dev = NULL;
    uint64_t *fresh = alloc_words(cap * stride, &raw);
    uint64_t *fresh_dev = fresh == NULL ? NULL : alloc_words(cap * words, &raw_dev);
    if (fresh_dev == NULL) {
        PyMem_RawFree(raw);
        PyErr_NoMemory();
        return -1;
    }
    advise_huge(fresh, cap * stride * sizeof(uint64_t));
    advise_huge(fresh_dev, cap * words * sizeof(uint64_t));
    for (size_t i = 0; i < t->cap; i++) {
        const uint64_t *s = slot_at(t, i);
        if (slot_empty(s, old_words))
            continue;
        size_t j = scramble(s[0]) & (cap - 1);
        while (!slot_empty(fresh + j * stride, words)) {
            j = (j + 1) & (cap - 1);
            t->probes++;
        }
        uint64_t *d = fresh + j * stride;
        d[0] = s[0];
        memcpy(d + 1, s + 1, old_words * sizeof(uint64_t));
        memcpy(fresh_dev + j * words, dev_at(t, i), old_words * sizeof(uint64_t));
    }
    PyMem_RawFree(t->raw);
    PyMem_RawFree(t->raw_dev);
    t->raw = raw;
    t->raw_dev = raw_dev;
    t->slots = fresh;
    t->dev = fresh_dev;
    t->cap = cap;
    t->words = words;
    return 0;
}

/* the slot holding key, else the empty slot where it would go */
static inline uint64_t *table_find(const MaskTable *t, uint64_t key) {
    const size_t cap_mask = t->cap - 1, words = t->words;
    size_t j = scramble(key) & cap_mask;
    for (;;) {
        uint64_t *s = slot_at(t, j);
        if (slot_empty(s, words) || s[0] == key)
            return s;
        j = (j + 1) & cap_mask;
        ((MaskTable *)t)->probes++; /* a counter only: the table itself is not changed */
    }
}

static void table_delete(MaskTable *t, uint64_t *hole_slot) {
    const size_t cap_mask = t->cap - 1, words = t->words, stride = stride_of(words);
    size_t hole = index_of(t, hole_slot);
    size_t j = hole;
    for (;;) {
        j = (j + 1) & cap_mask;
        t->probes++;
        uint64_t *s = slot_at(t, j);
        if (slot_empty(s, words))
            break;
        size_t home = scramble(s[0]) & cap_mask;
        /* the entry at j may move into the hole unless its home lies in (hole, j] */
        if (((j - home) & cap_mask) >= ((j - hole) & cap_mask)) {
            memcpy(slot_at(t, hole), s, stride * sizeof(uint64_t));
            memcpy(dev_at(t, hole), dev_at(t, j), words * sizeof(uint64_t));
            hole = j;
        }
    }
    memset(slot_at(t, hole), 0, stride * sizeof(uint64_t));
    memset(dev_at(t, hole), 0, words * sizeof(uint64_t));
    t->count--;
}

/* set (on) or clear bit `bit` of key's any-tier mask (tier 0) or device mask (tier 1); the
   table is widened first where the bit needs it. Setting a device bit sets the any-tier bit
   too, clearing an any-tier bit clears the device bit too (device holders are holders). */
static int table_put(MaskTable *t, uint64_t key, long bit, int on, int tier) {
    const size_t word = (size_t)bit >> 6;
    const uint64_t b = UINT64_C(1) << (bit & 63);
    if (word >= t->words) {
        if (!on)
            return 0; /* no key holds a bit past the width */
        if (table_rebuild(t, t->cap, word + 1) < 0)
            return -1;
    }
    uint64_t *s = table_find(t, key);
    uint64_t *d = dev_at(t, index_of(t, s));
    if (on) {
        if (tier)
            d[word] |= b;
        if (!slot_empty(s, t->words)) {
            s[1 + word] |= b;
            return 0;
        }
        s[0] = key;
        s[1 + word] = b;
        if (++t->count * 4 > t->cap * 3)
            return table_rebuild(t, t->cap * 2, t->words);
    } else if (tier) {
        d[word] &= ~b;
    } else if (s[1 + word] & b) {
        s[1 + word] &= ~b;
        d[word] &= ~b;
        if (slot_empty(s, t->words)) {
            table_delete(t, s);
            if (t->cap > MIN_CAP && t->count * 8 < t->cap)
                return table_rebuild(t, t->cap / 2, t->words);
        }
    }
    return 0;
}

static PyObject *MaskTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *other = NULL;
    if (PyTuple_GET_SIZE(args) > 1 || (kwds != NULL && PyDict_GET_SIZE(kwds)) ||
        (PyTuple_GET_SIZE(args) == 1 && !PyDict_Check(PyTuple_GET_ITEM(args, 0)))) {
        PyErr_SetString(PyExc_TypeError, "MaskTable(other: dict = {}) takes one dict at most");
        return NULL;
    }
    other = PyTuple_GET_SIZE(args) ? Py_NewRef(PyTuple_GET_ITEM(args, 0)) : PyDict_New();
    if (other == NULL)
        return NULL;
    MaskTable *t = (MaskTable *)type->tp_alloc(type, 0);
    if (t == NULL) {
        Py_DECREF(other);
        return NULL;
    }
    t->other = other;
    t->slots = alloc_words(MIN_CAP * stride_of(1), &t->raw);
    t->dev = t->slots == NULL ? NULL : alloc_words(MIN_CAP, &t->raw_dev);
    if (t->dev == NULL) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    t->cap = MIN_CAP;
    t->count = 0;
    t->probes = 0;
    t->words = 1;
    return (PyObject *)t;
}

static void MaskTable_dealloc(MaskTable *t) {
    PyMem_RawFree(t->raw);
    PyMem_RawFree(t->raw_dev);
    Py_XDECREF(t->other);
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

/* prefetch_key for an int key in [0, 2**64) (both masks); nothing for others, and no error
   (a key that fails as_key fails again, with its error, where it is applied) */
static inline void prefetch_obj(const MaskTable *t, PyObject *o) {
    uint64_t key;
    int ok = as_key(o, &key);
    if (ok > 0)
        prefetch_key(t, key, 1);
    else if (ok < 0)
        PyErr_Clear();
}

static long as_bit(PyObject *o) {
    long bit = PyLong_AsLong(o);
    if (bit == -1 && PyErr_Occurred())
        return -1;
    if (bit < 0 || bit > MAX_BIT) {
        PyErr_Format(PyExc_ValueError, "bit must lie in [0, %ld]", MAX_BIT);
        return -1;
    }
    return bit;
}

/* held: a dict (membership decides), or Py_True / Py_False (set / clear every key) */
static PyObject *update(MaskTable *t, PyObject *keys_arg, PyObject *bit_arg, PyObject *held) {
    long bit = as_bit(bit_arg);
    if (bit < 0)
        return NULL;
    const int by_dict = held != Py_True && held != Py_False;
    const int clears = held != Py_True; /* a cleared bit's device bit goes with it */
    if (by_dict && !PyDict_Check(held)) {
        PyErr_SetString(PyExc_TypeError, "held must be a dict");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(keys_arg, "keys must be a sequence");
    if (seq == NULL)
        return NULL;
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
            prefetch_key(t, keys[i], clears);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n && is_key[i + AHEAD])
            prefetch_key(t, keys[i + AHEAD], clears);
        if (!is_key[i])
            continue;
        int present = by_dict ? PyDict_Contains(held, items[i]) : held == Py_True;
        if (present < 0 || table_put(t, keys[i], bit, present, 0) < 0)
            goto fail_keys;
    }
    if (keys != stack_keys)
        PyMem_Free(keys);
    if (is_key != stack_ok)
        PyMem_Free(is_key);
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail_keys:
    if (keys != NULL && keys != stack_keys)
        PyMem_Free(keys);
    if (is_key != NULL && is_key != stack_ok)
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

/* worker_of_bit[b] (borrowed), or NULL with an exception set (KeyError when absent) */
static PyObject *worker_for_bit(PyObject *worker_of_bit, long b) {
    PyObject *bo = PyLong_FromLong(b);
    if (bo == NULL)
        return NULL;
    PyObject *w = PyDict_GetItemWithError(worker_of_bit, bo);
    Py_DECREF(bo);
    if (w == NULL && !PyErr_Occurred())
        PyErr_Format(PyExc_KeyError, "no worker for bit %ld", b);
    return w;
}

/* result[worker_of_bit[base + b]] = n for every bit b in lost, low bits first (as the Python
   loop) */
static int put_lost(PyObject *result, PyObject *worker_of_bit, uint64_t lost, long base,
                    Py_ssize_t n) {
    while (lost) {
        long b = base + __builtin_ctzll(lost);
        lost &= lost - 1;
        PyObject *w = worker_for_bit(worker_of_bit, b);
        if (w == NULL)
            return -1;
        PyObject *v = PyLong_FromSsize_t(n);
        if (v == NULL || PyDict_SetItem(result, w, v) < 0) {
            Py_XDECREF(v);
            return -1;
        }
        Py_DECREF(v);
    }
    return 0;
}

/* runs()'s loop; 0: done, 1: a key is not an int in range (None), -1: error. Inlined twice,
   once with words == 1 (the compiler then keeps the mask in a register: fleets up to 64) */
static inline __attribute__((always_inline)) int
runs_loop(const MaskTable *t, PyObject **items, Py_ssize_t n, PyObject *result,
          PyObject *worker_of_bit, const size_t words, uint64_t *acc) {
    const size_t cap_mask = t->cap - 1, stride = stride_of(words);
    /* key i + AHEAD is read and its slot fetched while key i is looked up, so the misses of
       a request overlap; a ring of AHEAD + 1 keys */
    uint64_t ring[AHEAD + 1];
    for (Py_ssize_t i = -AHEAD; i < n; i++) {
        Py_ssize_t ahead = i + AHEAD;
        if (ahead < n) {
            uint64_t key;
            int ok = as_key(items[ahead], &key);
            if (ok <= 0)
                return ok < 0 ? -1 : 1;
            ring[ahead % (AHEAD + 1)] = key;
            __builtin_prefetch(t->slots + (scramble(key) & cap_mask) * stride);
        }
        if (i < 0)
            continue;
        uint64_t key = ring[i % (AHEAD + 1)];
        size_t j = scramble(key) & cap_mask;
        const uint64_t *s = t->slots + j * stride;
        while (!slot_empty(s, words) && s[0] != key) {
            j = (j + 1) & cap_mask;
            s = t->slots + j * stride;
            ((MaskTable *)t)->probes++; /* a counter only: the table itself is not changed */
        }
        /* an empty slot's mask is 0: the key is absent */
        uint64_t any = 0;
        for (size_t w = 0; w < words; w++) {
            uint64_t next = i == 0 ? s[1 + w] : acc[w] & s[1 + w];
            uint64_t lost = acc[w] & ~next;
            if (i > 0 && lost && put_lost(result, worker_of_bit, lost, (long)(64 * w), i) < 0)
                return -1;
            acc[w] = next;
            any |= next;
        }
        if (!any)
            return 0;
    }
    for (size_t w = 0; w < words && n > 0; w++)
        if (put_lost(result, worker_of_bit, acc[w], (long)(64 * w), n) < 0)
            return -1;
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
    const size_t words = t->words;
    uint64_t stack_acc[STACK_WORDS];
    uint64_t *acc = words <= STACK_WORDS ? stack_acc : PyMem_Malloc(words * sizeof(uint64_t));
    PyObject *result = acc == NULL ? PyErr_NoMemory() : PyDict_New();
    if (result != NULL) {
        memset(acc, 0, words * sizeof(uint64_t));
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        PyObject **items = PySequence_Fast_ITEMS(seq);
        int rc = words == 1 ? runs_loop(t, items, n, result, args[1], 1, acc)
                            : runs_loop(t, items, n, result, args[1], words, acc);
        if (rc) {
            Py_DECREF(result);
            result = rc < 0 ? NULL : Py_NewRef(Py_None); /* None: the general path */
        }
    }
    if (acc != NULL && acc != stack_acc)
        PyMem_Free(acc);
    Py_DECREF(seq);
    return result;
}

/* result[worker_of_bit[b]] = make(run, drun, on_device, run - on_device) */
static PyObject *empty_tuple;

/* make(a, b, c, d), or, with `fields` (a tuple of make's four data descriptors, in its
   __init__'s order), a new make whose fields are set as its __init__ sets them (through their
   descriptors, as object.__setattr__ does): for a class whose __init__ does nothing else
   (router_sim.router.indexer.MatchDetail), without a Python call. */
static PyObject *make4(PyObject *make, PyObject *fields, Py_ssize_t a, Py_ssize_t b,
                       Py_ssize_t c, Py_ssize_t d) {
    if (fields == NULL)
        return PyObject_CallFunction(make, "nnnn", a, b, c, d);
    PyTypeObject *type = (PyTypeObject *)make;
    PyObject *obj = type->tp_new(type, empty_tuple, NULL);
    if (obj == NULL)
        return NULL;
    const Py_ssize_t values[4] = {a, b, c, d};
    for (int k = 0; k < 4; k++) {
        PyObject *desc = PyTuple_GET_ITEM(fields, k);
        PyObject *v = PyLong_FromSsize_t(values[k]);
        int err = v == NULL ? -1 : Py_TYPE(desc)->tp_descr_set(desc, obj, v);
        Py_XDECREF(v);
        if (err < 0) {
            Py_DECREF(obj);
            return NULL;
        }
    }
    return obj;
}

static int emit_detail(PyObject *result, PyObject *worker_of_bit, PyObject *make,
                       PyObject *fields, long b, Py_ssize_t run, Py_ssize_t drun,
                       Py_ssize_t on_device) {
    PyObject *w = worker_for_bit(worker_of_bit, b);
    if (w == NULL)
        return -1;
    PyObject *v = make4(make, fields, run, drun, on_device, run - on_device);
    if (v == NULL)
        return -1;
    int err = PyDict_SetItem(result, w, v);
    Py_DECREF(v);
    return err;
}

/* detailed(keys, worker_of_bit, make[, fields]) -> {worker: make(run, device_run, on_device,
   run - on_device)} as KvIndexer.find_matches_detailed, or None when a key before the cut is
   not an int in [0, 2**64). `fields`: see make4 (make must then be a class). One pass: the prefix-AND of the any-tier masks cuts each
   worker's run, that of the device masks its device run, and within its run each worker's
   device copies are counted; a worker is emitted when its run ends (low bits first, as
   runs() and the Python loop order them). */
static PyObject *MaskTable_detailed(MaskTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3 || nargs > 4 || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "detailed(keys, worker_of_bit: dict, make[, fields])");
        return NULL;
    }
    PyObject *fields = nargs == 4 && args[3] != Py_None ? args[3] : NULL;
    if (fields != NULL) {
        int ok = PyType_Check(args[2]) && PyTuple_Check(fields) && PyTuple_GET_SIZE(fields) == 4;
        for (Py_ssize_t k = 0; ok && k < 4; k++)
            ok = Py_TYPE(PyTuple_GET_ITEM(fields, k))->tp_descr_set != NULL;
        if (!ok) {
            PyErr_SetString(PyExc_TypeError,
                            "detailed: fields must be a tuple of make's 4 data descriptors");
            return NULL;
        }
    }
    PyObject *seq = PySequence_Fast(args[0], "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    const size_t words = t->words, bits = 64 * words;
    /* acc, dacc: words each; counts, druns: one per bit */
    uint64_t *acc = PyMem_Calloc(2 * words, sizeof(uint64_t));
    Py_ssize_t *counts = PyMem_Calloc(2 * bits, sizeof(Py_ssize_t));
    PyObject *result = acc == NULL || counts == NULL ? PyErr_NoMemory() : PyDict_New();
    if (result == NULL)
        goto out;
    uint64_t *dacc = acc + words;
    Py_ssize_t *druns = counts + bits;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    const size_t cap_mask = t->cap - 1;
    uint64_t ring[AHEAD + 1];
    Py_ssize_t i;
    for (i = -AHEAD; i < n; i++) {
        Py_ssize_t ahead = i + AHEAD;
        if (ahead < n) {
            uint64_t key;
            int ok = as_key(items[ahead], &key);
            if (ok <= 0) {
                Py_DECREF(result);
                result = ok < 0 ? NULL : Py_NewRef(Py_None);
                goto out;
            }
            ring[ahead % (AHEAD + 1)] = key;
            prefetch_key(t, key, 1);
        }
        if (i < 0)
            continue;
        uint64_t key = ring[i % (AHEAD + 1)];
        size_t j = scramble(key) & cap_mask;
        const uint64_t *s = slot_at(t, j);
        while (!slot_empty(s, words) && s[0] != key) {
            j = (j + 1) & cap_mask;
            s = slot_at(t, j);
            ((MaskTable *)t)->probes++; /* a counter only: the table itself is not changed */
        }
        const int empty = slot_empty(s, words);
        const uint64_t *d = dev_at(t, j);
        uint64_t any_left = 0;
        for (size_t w = 0; w < words; w++) {
            uint64_t m = s[1 + w], dm = empty ? 0 : d[w];
            uint64_t next = i == 0 ? m : acc[w] & m;
            uint64_t dnext = i == 0 ? dm : dacc[w] & dm;
            for (uint64_t lost = dacc[w] & ~dnext; lost; lost &= lost - 1)
                druns[64 * w + __builtin_ctzll(lost)] = i;
            dacc[w] = dnext;
            for (uint64_t c = next & dm; c; c &= c - 1)
                counts[64 * w + __builtin_ctzll(c)]++;
            uint64_t lost = i == 0 ? 0 : acc[w] & ~next;
            acc[w] = next;
            any_left |= next;
            for (; lost; lost &= lost - 1) {
                size_t b = 64 * w + __builtin_ctzll(lost);
                if (emit_detail(result, args[1], args[2], fields, (long)b, i, druns[b],
                                counts[b]) < 0)
                    goto fail;
            }
        }
        if (!any_left)
            goto out;
    }
    for (size_t w = 0; w < words; w++) {
        for (uint64_t left = dacc[w]; left; left &= left - 1)
            druns[64 * w + __builtin_ctzll(left)] = n;
        for (uint64_t left = acc[w]; left; left &= left - 1) {
            size_t b = 64 * w + __builtin_ctzll(left);
            if (emit_detail(result, args[1], args[2], fields, (long)b, n, druns[b],
                            counts[b]) < 0)
                goto fail;
        }
    }
out:
    PyMem_Free(acc);
    PyMem_Free(counts);
    Py_DECREF(seq);
    return result;
fail:
    Py_CLEAR(result);
    goto out;
}

/* ------------------------------------------------------------ the device-tier masks */

/* the device mask of key as a Python int (0 when absent) */
static PyObject *device_mask(const MaskTable *t, uint64_t key) {
    const uint64_t *s = table_find(t, key);
    const size_t words = t->words;
    if (slot_empty(s, words))
        return PyLong_FromLong(0);
    const uint64_t *d = dev_at(t, index_of(t, s));
    if (words == 1)
        return PyLong_FromUnsignedLongLong(d[0]);
    PyObject *r = PyLong_FromLong(0);
    for (size_t w = words; w-- > 0 && r != NULL;) {
        PyObject *sixty_four = PyLong_FromLong(64), *word = PyLong_FromUnsignedLongLong(d[w]);
        PyObject *shifted = sixty_four == NULL ? NULL : PyNumber_Lshift(r, sixty_four);
        PyObject *next = shifted == NULL || word == NULL ? NULL : PyNumber_Or(shifted, word);
        Py_XDECREF(sixty_four);
        Py_XDECREF(word);
        Py_XDECREF(shifted);
        Py_DECREF(r);
        r = next;
    }
    return r;
}

/* device_get(key) -> the mask of workers holding key on the device tier: from the table for
   an int in [0, 2**64), else from the device dict the table was made with (0 when absent) */
static PyObject *MaskTable_device_get(MaskTable *t, PyObject *h) {
    uint64_t key;
    int ok = as_key(h, &key);
    if (ok < 0)
        return NULL;
    if (ok)
        return device_mask(t, key);
    PyObject *m = PyDict_GetItemWithError(t->other, h);
    if (m == NULL)
        return PyErr_Occurred() ? NULL : PyLong_FromLong(0);
    Py_INCREF(m);
    return m;
}

/* device_bit(keys, bit, on): set (on) or clear bit `bit` of each key's device mask, where
   device_get reads it */
static PyObject *MaskTable_device_bit(MaskTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "device_bit(keys, bit, on) takes 3 arguments");
        return NULL;
    }
    long bit = as_bit(args[1]);
    if (bit < 0)
        return NULL;
    int on = PyObject_IsTrue(args[2]);
    if (on < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    PyObject *bitobj = NULL, *keep = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    /* while key i is applied, the slots of key i + AHEAD are fetched (a hint only), so an
       event's misses overlap */
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++)
        prefetch_obj(t, items[i]);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = items[i];
        if (i + AHEAD < n)
            prefetch_obj(t, items[i + AHEAD]);
        uint64_t key;
        int ok = as_key(h, &key);
        if (ok < 0)
            goto fail;
        if (ok) {
            if (table_put(t, key, bit, on, 1) < 0)
                goto fail;
            continue;
        }
        if (bitobj == NULL) {
            bitobj = PyLong_FromLong(1);
            PyObject *shift = bitobj == NULL ? NULL : PyLong_FromLong(bit);
            PyObject *b = shift == NULL ? NULL : PyNumber_Lshift(bitobj, shift);
            Py_XDECREF(shift);
            Py_XSETREF(bitobj, b);
            keep = bitobj == NULL ? NULL : PyNumber_Invert(bitobj);
            if (keep == NULL)
                goto fail;
        }
        PyObject *m = PyDict_GetItemWithError(t->other, h); /* borrowed */
        if (m == NULL && PyErr_Occurred())
            goto fail;
        if (m == NULL && !on)
            continue;
        PyObject *mm = m == NULL ? Py_NewRef(bitobj) : PyNumber_Or(m, bitobj);
        if (!on) {
            Py_XDECREF(mm);
            mm = PyNumber_And(m, keep);
        }
        if (mm == NULL)
            goto fail;
        int truth = PyObject_IsTrue(mm);
        int err = truth < 0 ? -1 : truth ? PyDict_SetItem(t->other, h, mm) : PyDict_DelItem(t->other, h);
        Py_DECREF(mm);
        if (err < 0)
            goto fail;
    }
    Py_XDECREF(bitobj);
    Py_XDECREF(keep);
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(bitobj);
    Py_XDECREF(keep);
    Py_DECREF(seq);
    return NULL;
}

static Py_ssize_t MaskTable_len(MaskTable *t) { return (Py_ssize_t)t->count; }

static PyObject *MaskTable_get_words(MaskTable *t, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(t->words);
}

static PyObject *MaskTable_get_probes(MaskTable *t, void *closure) {
    (void)closure;
    return PyLong_FromUnsignedLongLong(t->probes);
}

static PyGetSetDef MaskTable_getset[] = {
    {"words", (getter)MaskTable_get_words, NULL, "64-bit words per worker mask.", NULL},
    {"probes", (getter)MaskTable_get_probes, NULL,
     "Slots examined past keys' home slots over the table's life.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef MaskTable_methods[] = {
    {"sync", (PyCFunction)(void (*)(void))MaskTable_sync, METH_FASTCALL,
     "sync(keys, bit, held): mirror membership of each int key in held as bit `bit`."},
    {"set_bit", (PyCFunction)(void (*)(void))MaskTable_set_bit, METH_FASTCALL,
     "set_bit(keys, bit): set bit `bit` of each int key (all are held)."},
    {"clear_bit", (PyCFunction)(void (*)(void))MaskTable_clear_bit, METH_FASTCALL,
     "clear_bit(keys, bit): clear bit `bit` of each int key (none is held)."},
    {"runs", (PyCFunction)(void (*)(void))MaskTable_runs, METH_FASTCALL,
     "runs(keys, worker_of_bit) -> {worker: run length}, or None (general path needed)."},
    {"device_get", (PyCFunction)MaskTable_device_get, METH_O,
     "device_get(key) -> mask of the workers holding key on the device tier (0: none)."},
    {"device_bit", (PyCFunction)(void (*)(void))MaskTable_device_bit, METH_FASTCALL,
     "device_bit(keys, bit, on): set or clear bit `bit` of each key's device mask."},
    {"detailed", (PyCFunction)(void (*)(void))MaskTable_detailed, METH_FASTCALL,
     "detailed(keys, worker_of_bit, make) -> {worker: make(run, device run, on device, "
     "slower)}, or None (general path needed)."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods MaskTable_as_sequence = {.sq_length = (lenfunc)MaskTable_len};

static PyTypeObject MaskTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router_sim.router._match.MaskTable",
    .tp_basicsize = sizeof(MaskTable),
    .tp_dealloc = (destructor)MaskTable_dealloc,
    .tp_as_sequence = &MaskTable_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Key -> mask of workers holding the block (see router_sim.router.indexer).",
    .tp_methods = MaskTable_methods,
    .tp_getset = MaskTable_getset,
    .tp_new = MaskTable_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_match", "The router index's key -> worker-mask table and its match loops.",
    -1, NULL,
};

/* draws the placement key from os.urandom (0, or -1 with an exception set) */
static int draw_place_key(void) {
    PyObject *os = PyImport_ImportModule("os");
    if (os == NULL)
        return -1;
    PyObject *raw = PyObject_CallMethod(os, "urandom", "i", 16);
    Py_DECREF(os);
    if (raw == NULL)
        return -1;
    if (!PyBytes_Check(raw) || PyBytes_GET_SIZE(raw) != 16) {
        Py_DECREF(raw);
        PyErr_SetString(PyExc_RuntimeError, "os.urandom(16) did not return 16 bytes");
        return -1;
    }
    memcpy(&place_k0, PyBytes_AS_STRING(raw), 8);
    memcpy(&place_k1, PyBytes_AS_STRING(raw) + 8, 8);
    Py_DECREF(raw);
    return 0;
}

PyMODINIT_FUNC PyInit__match(void) {
    if (PyType_Ready(&MaskTableType) < 0)
        return NULL;
    if (draw_place_key() < 0)
        return NULL;
    empty_tuple = PyTuple_New(0);
    if (empty_tuple == NULL)
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
