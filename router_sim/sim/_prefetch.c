/*
 * Block keys of the simulator's prompts, made ahead on a second thread (router_sim.sim.prefetch).
 *
 * A replay's requests are known before it starts, and the keys of a prompt's full blocks
 * depend on the request alone: the V1 hashes the router looks them up by (kvcache._v1hash's C
 * API, a capsule) and the SHA-256 chain keys the worker's cache files them under (OpenSSL's
 * libcrypto, which hashlib wraps too). On a
 * fleet these are computed on the router's and the workers' machines; in one process they cost
 * the replay's thread about a sixth of its time. Here a native thread computes them in arrival
 * order, a bounded number of requests ahead, while the replay's thread simulates; the replay
 * takes each request's keys in turn: exactly what the inline path computes (tests compare).
 *
 *   Prefetch(jobs, per_id, shift, mask, tokens_per_block, ahead)
 *     jobs: a list whose items are None (a request this does not take: the caller hashes it)
 *           or (ids: tuple[int], count: int, lora: int | None, salt: int | None,
 *               hashed: bool, root: 32 bytes | None): the prompt is the count tokens
 *           expanded from ids as router_sim.sim.workloads.expand_hash_ids does (token j of id h
 *           is (j << shift) | (h & mask), per_id tokens per id, the last id cut); with hashed,
 *           the V1 hashes of its full blocks of tokens_per_block tokens under (lora, salt);
 *           with a root key (and a little-endian CPU: KEYS), the cache keys of those blocks
 *           chained from it
 *   .take() -> None for a None job, else (list[int] hashes or None, list[bytes] keys or
 *           None): the next job's, in order; it waits (without the GIL) for the thread
 *   .close()  stops the thread and waits for it (also done when the object goes)
 *   len(p)    jobs not taken yet
 *
 *   expand_array(out, ids, count, per_id, shift, mask) -> out
 *     the same prompt written into out, an array('i') of count items, for the replay's thread
 *     (router_sim.sim.workloads.expand_hash_ids): the formula has this one statement in C
 *
 * The thread reads only C copies of the jobs made by the constructor and writes only its own
 * ring of `ahead` slots: it never touches a Python object, so it never takes the GIL. A slot
 * is written only while the replay cannot be reading it (the ring's counters, under one mutex,
 * say which). Wake-ups are rare: a full ring waits until the replay has taken half of it, and
 * the replay wakes the thread only then (waking a thread costs the waker a system call, which
 * per request cost more than the hashing saved).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>

/* kvcache._v1hash's V1 block hash (WIRE.md section 3) over n native-endian int32 tokens at p:
 * the capsule "kvcache._v1hash.hash_block_api" holds a function of this type. */
typedef uint64_t (*v1_hash_block_fn)(const unsigned char *p, Py_ssize_t n, uint64_t parent,
                                     int has_lora, uint64_t lora, int has_salt, uint64_t salt);
static v1_hash_block_fn V1_HASH_BLOCK;

typedef struct {
    int has_lora;
    uint64_t lora;
    int has_salt;
    uint64_t salt;
} scope_t;

typedef struct {
    uint32_t *ids; /* masked ids, as many as count needs */
    Py_ssize_t count;
    scope_t scope;
    int skip;
    int hashed;
    int keyed; /* root holds the cache's root key: the full blocks' keys are made */
    uint8_t root[32];
} job_t;

typedef struct {
    uint8_t *keys; /* 32 bytes per full block */
    Py_ssize_t keys_cap;
    uint64_t *hashes;
    Py_ssize_t hashes_cap;
    Py_ssize_t n_hashes;
} slot_t;

typedef struct {
    PyObject_HEAD
    job_t *jobs;
    Py_ssize_t n_jobs;
    slot_t *slots;
    Py_ssize_t ahead;
    Py_ssize_t tpb;
    uint32_t per_id;
    uint32_t shift;
    /* under mu */
    Py_ssize_t produced; /* jobs whose slot is ready */
    Py_ssize_t taken;    /* jobs the replay has taken */
    int stop;
    int failed;         /* the thread could not allocate memory */
    int waiting;          /* the thread waits for room */
    int consumer_waiting; /* take() waits for the thread */
    uint32_t *tokens;   /* the thread's prompt being hashed */
    Py_ssize_t tokens_cap;
    pthread_mutex_t mu;
    pthread_cond_t ready; /* produced moved (or the thread ended) */
    pthread_cond_t room;  /* taken moved (or stop was set) */
    pthread_t thread;
    int started; /* the thread runs until joined */
} Prefetch;

/* The cache keys blocks by their 4-byte little-endian tokens, read here in place: only where
 * the CPU is little-endian are keys made here (elsewhere the caller makes them). */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define KEYS 1
#else
#define KEYS 0
#endif

/* Room for n items of size `size` in *buf (capacity *cap); 0, or -1 when out of memory. */
static int reserve(void **buf, Py_ssize_t *cap, Py_ssize_t n, size_t size) {
    if (n <= *cap) {
        return 0;
    }
    Py_ssize_t want = n + n / 4;
    void *grown = realloc(*buf, (size_t)want * size);
    if (grown == NULL) {
        return -1;
    }
    *buf = grown;
    *cap = want;
    return 0;
}

/* The simulator's prompt of Mooncake-style hash ids (router_sim.sim.workloads.expand_hash_ids),
   its one statement in C: token j of the block of (masked) id ids[k] is (j << shift) | ids[k],
   per_id tokens per id, blocks in id order, count tokens in all (the last block cut short),
   written to t. ids holds at least ceil(count / per_id) ids. */
static void expand_ids(const uint32_t *ids, Py_ssize_t count, Py_ssize_t per_id, uint32_t shift,
                       uint32_t *t) {
    for (Py_ssize_t k = 0, done = 0; done < count; k++) {
        Py_ssize_t n = count - done < per_id ? count - done : per_id;
        uint32_t id = ids[k];
        for (Py_ssize_t j = 0; j < n; j++) {
            t[done + j] = ((uint32_t)j << shift) | id;
        }
        done += n;
    }
}

static int make_slot(Prefetch *p, const job_t *job, slot_t *slot) {
    if (reserve((void **)&p->tokens, &p->tokens_cap, job->count > 0 ? job->count : 1,
                sizeof(uint32_t)) < 0) {
        return -1;
    }
    uint32_t *t = p->tokens;
    expand_ids(job->ids, job->count, (Py_ssize_t)p->per_id, p->shift, t);
    slot->n_hashes = 0;
    if (job->hashed) {
        Py_ssize_t nblocks = job->count / p->tpb;
        if (reserve((void **)&slot->hashes, &slot->hashes_cap, nblocks > 0 ? nblocks : 1,
                    sizeof(uint64_t)) < 0) {
            return -1;
        }
        /* every token is below 2**31 by construction (shift, mask) */
        uint64_t parent = 0;
        const unsigned char *bytes = (const unsigned char *)t;
        const scope_t *s = &job->scope;
        for (Py_ssize_t b = 0; b < nblocks; b++) {
            parent = V1_HASH_BLOCK(bytes + 4 * b * p->tpb, p->tpb, parent, s->has_lora, s->lora,
                                   s->has_salt, s->salt);
            slot->hashes[b] = parent;
        }
        slot->n_hashes = nblocks;
    }
    if (job->keyed) {
        Py_ssize_t nblocks = job->count / p->tpb;
        if (reserve((void **)&slot->keys, &slot->keys_cap, 32 * (nblocks > 0 ? nblocks : 1), 1) <
            0) {
            return -1;
        }
        EVP_MD_CTX *ctx = EVP_MD_CTX_new();
        if (ctx == NULL) {
            return -1;
        }
        const uint8_t *prev = job->root;
        size_t step = 4 * (size_t)p->tpb;
        int ok = 1;
        for (Py_ssize_t b = 0; b < nblocks && ok; b++) {
            uint8_t *key = slot->keys + 32 * b;
            ok = EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) && EVP_DigestUpdate(ctx, prev, 32) &&
                 EVP_DigestUpdate(ctx, (const uint8_t *)t + step * b, step) &&
                 EVP_DigestFinal_ex(ctx, key, NULL);
            prev = key;
        }
        EVP_MD_CTX_free(ctx);
        if (!ok) {
            return -1;
        }
    }
    return 0;
}

static void *produce(void *arg) {
    Prefetch *p = (Prefetch *)arg;
    for (Py_ssize_t j = 0; j < p->n_jobs; j++) {
        pthread_mutex_lock(&p->mu);
        if (!p->stop && j - p->taken >= p->ahead) {
            /* full: wait until the replay has taken half the ring (one wake-up per half
               ring, not one per request: waking a thread costs the waker a system call) */
            p->waiting = 1;
            while (!p->stop && j - p->taken > p->ahead / 2) {
                pthread_cond_wait(&p->room, &p->mu);
            }
            p->waiting = 0;
        }
        int stop = p->stop;
        pthread_mutex_unlock(&p->mu);
        if (stop) {
            break;
        }
        const job_t *job = &p->jobs[j];
        int failed = !job->skip && make_slot(p, job, &p->slots[j % p->ahead]) < 0;
        pthread_mutex_lock(&p->mu);
        if (failed) {
            p->failed = 1;
        } else {
            p->produced = j + 1;
        }
        if (p->consumer_waiting) {
            pthread_cond_signal(&p->ready);
        }
        pthread_mutex_unlock(&p->mu);
        if (failed) {
            break;
        }
    }
    pthread_mutex_lock(&p->mu);
    p->stop = 1; /* the thread is done: a take() past the end must not wait for it */
    pthread_cond_signal(&p->ready);
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void stop_thread(Prefetch *p) {
    if (!p->started) {
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_signal(&p->room);
    pthread_mutex_unlock(&p->mu);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(p->thread, NULL);
    Py_END_ALLOW_THREADS
    p->started = 0;
}

static void free_jobs(Prefetch *p) {
    if (p->jobs != NULL) {
        for (Py_ssize_t j = 0; j < p->n_jobs; j++) {
            PyMem_RawFree(p->jobs[j].ids);
        }
        PyMem_RawFree(p->jobs);
        p->jobs = NULL;
    }
    if (p->slots != NULL) {
        for (Py_ssize_t s = 0; s < p->ahead; s++) {
            free(p->slots[s].hashes);
            free(p->slots[s].keys);
        }
        PyMem_RawFree(p->slots);
        p->slots = NULL;
    }
    free(p->tokens);
    p->tokens = NULL;
}

static void Prefetch_dealloc(Prefetch *p) {
    stop_thread(p);
    free_jobs(p);
    pthread_cond_destroy(&p->ready);
    pthread_cond_destroy(&p->room);
    pthread_mutex_destroy(&p->mu);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* An optional u64 (None: absent) into *present / *out; 0, or -1 with an exception set. */
static int optional_u64(PyObject *obj, const char *name, int *present, uint64_t *out) {
    *present = 0;
    *out = 0;
    if (obj == Py_None) {
        return 0;
    }
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "Prefetch: %s must be an int or None", name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "Prefetch: %s must be in [0, 2**64)", name);
        return -1;
    }
    *present = 1;
    *out = (uint64_t)v;
    return 0;
}

static int read_job(PyObject *item, const Prefetch *p, uint32_t mask, job_t *job) {
    if (item == Py_None) {
        job->skip = 1;
        return 0;
    }
    PyObject *ids, *lora, *salt, *root;
    Py_ssize_t count;
    int hashed;
    if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "O!nOOpO", &PyTuple_Type, &ids, &count,
                                                  &lora, &salt, &hashed, &root)) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "Prefetch: a job is None or (ids, count, lora, "
                                             "salt, hashed, root_key)");
        }
        return -1;
    }
    if (root != Py_None) {
        if (!PyBytes_Check(root) || PyBytes_GET_SIZE(root) != 32) {
            PyErr_SetString(PyExc_TypeError, "Prefetch: a root key is 32 bytes or None");
            return -1;
        }
        job->keyed = KEYS;
        memcpy(job->root, PyBytes_AS_STRING(root), 32);
    }
    Py_ssize_t n_ids = count / p->per_id + (count % p->per_id != 0);
    if (count < 0 || count > PY_SSIZE_T_MAX / 8 || n_ids > PyTuple_GET_SIZE(ids)) {
        PyErr_SetString(PyExc_ValueError,
                        "Prefetch: a job's count must be in [0, len(ids) * per_id]");
        return -1;
    }
    if (optional_u64(lora, "lora", &job->scope.has_lora, &job->scope.lora) < 0 ||
        optional_u64(salt, "salt", &job->scope.has_salt, &job->scope.salt) < 0) {
        return -1;
    }
    job->ids = PyMem_RawMalloc(sizeof(uint32_t) * (size_t)(n_ids > 0 ? n_ids : 1));
    if (job->ids == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < n_ids; k++) {
        PyObject *h = PyTuple_GET_ITEM(ids, k);
        if (!PyLong_Check(h)) {
            PyErr_SetString(PyExc_TypeError, "Prefetch: hash ids must be ints");
            return -1;
        }
        unsigned long long v = PyLong_AsUnsignedLongLongMask(h);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            return -1;
        }
        job->ids[k] = (uint32_t)(v & mask);
    }
    job->count = count;
    job->hashed = hashed;
    return 0;
}

static PyObject *Prefetch_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *jobs;
    Py_ssize_t per_id, tpb, ahead;
    long shift;
    unsigned long long mask;
    static char *kwlist[] = {"jobs", "per_id", "shift", "mask", "tokens_per_block", "ahead", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!nlKnn:Prefetch", kwlist, &PyList_Type,
                                     &jobs, &per_id, &shift, &mask, &tpb, &ahead)) {
        return NULL;
    }
    if (per_id < 1 || per_id > UINT32_MAX || shift < 0 || shift > 31 || mask > INT32_MAX ||
        tpb < 1 || ahead < 1 || ahead > 1 << 16 || ((uint64_t)(per_id - 1) << shift) > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError,
                        "Prefetch: need per_id >= 1, shift in [0, 31], tokens below 2**31, "
                        "tokens_per_block >= 1 and ahead in [1, 65536]");
        return NULL;
    }
    Prefetch *p = (Prefetch *)type->tp_alloc(type, 0);
    if (p == NULL) {
        return NULL;
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->ready, NULL);
    pthread_cond_init(&p->room, NULL);
    p->per_id = (uint32_t)per_id;
    p->shift = (uint32_t)shift;
    p->tpb = tpb;
    p->ahead = ahead;
    Py_ssize_t n = PyList_GET_SIZE(jobs);
    p->jobs = PyMem_RawCalloc((size_t)(n > 0 ? n : 1), sizeof(job_t));
    p->slots = PyMem_RawCalloc((size_t)ahead, sizeof(slot_t));
    if (p->jobs == NULL || p->slots == NULL) {
        Py_DECREF(p);
        return PyErr_NoMemory();
    }
    p->n_jobs = n;
    for (Py_ssize_t j = 0; j < n; j++) {
        if (read_job(PyList_GET_ITEM(jobs, j), p, (uint32_t)mask, &p->jobs[j]) < 0) {
            Py_DECREF(p);
            return NULL;
        }
    }
    if (n > 0) {
        int rc = pthread_create(&p->thread, NULL, produce, p);
        if (rc != 0) {
            Py_DECREF(p);
            PyErr_Format(PyExc_RuntimeError, "Prefetch: cannot start its thread (%s)",
                         strerror(rc));
            return NULL;
        }
        p->started = 1;
    }
    return (PyObject *)p;
}

static PyObject *slot_result(const Prefetch *p, const job_t *job, const slot_t *slot) {
    PyObject *hashes = NULL, *keys = NULL;
    Py_ssize_t nblocks = job->count / p->tpb;
    if (job->hashed) {
        hashes = PyList_New(slot->n_hashes);
        if (hashes == NULL) {
            return NULL;
        }
        for (Py_ssize_t b = 0; b < slot->n_hashes; b++) {
            PyObject *v = PyLong_FromUnsignedLongLong(slot->hashes[b]);
            if (v == NULL) {
                Py_DECREF(hashes);
                return NULL;
            }
            PyList_SET_ITEM(hashes, b, v);
        }
    } else {
        hashes = Py_NewRef(Py_None);
    }
    if (job->keyed) {
        keys = PyList_New(nblocks);
        if (keys == NULL) {
            Py_DECREF(hashes);
            return NULL;
        }
        for (Py_ssize_t b = 0; b < nblocks; b++) {
            PyObject *k = PyBytes_FromStringAndSize((const char *)slot->keys + 32 * b, 32);
            if (k == NULL) {
                Py_DECREF(hashes);
                Py_DECREF(keys);
                return NULL;
            }
            PyList_SET_ITEM(keys, b, k);
        }
    } else {
        keys = Py_NewRef(Py_None);
    }
    return Py_BuildValue("(NN)", hashes, keys);
}

static PyObject *Prefetch_take(Prefetch *p, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t j = p->taken; /* only take() moves it, under the GIL */
    if (j >= p->n_jobs) {
        PyErr_SetString(PyExc_IndexError, "Prefetch.take: every job was taken");
        return NULL;
    }
    pthread_mutex_lock(&p->mu);
    int ready = p->produced > j;
    int failed = p->failed;
    int stopped = p->stop;
    pthread_mutex_unlock(&p->mu);
    if (!ready && !failed && !stopped) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&p->mu);
        p->consumer_waiting = 1;
        while (p->produced <= j && !p->failed && !p->stop) {
            pthread_cond_wait(&p->ready, &p->mu);
        }
        p->consumer_waiting = 0;
        ready = p->produced > j;
        failed = p->failed;
        pthread_mutex_unlock(&p->mu);
        Py_END_ALLOW_THREADS
    }
    if (!ready) {
        if (failed) {
            return PyErr_NoMemory();
        }
        PyErr_SetString(PyExc_RuntimeError, "Prefetch.take: the object was closed");
        return NULL;
    }
    const job_t *job = &p->jobs[j];
    PyObject *out;
    if (job->skip) {
        out = Py_None;
        Py_INCREF(out);
    } else {
        out = slot_result(p, job, &p->slots[j % p->ahead]);
    }
    /* the slot is handed back even when copying it out failed: the job is not retried */
    pthread_mutex_lock(&p->mu);
    p->taken = j + 1;
    if (p->waiting && p->produced - p->taken <= p->ahead / 2) {
        pthread_cond_signal(&p->room);
    }
    pthread_mutex_unlock(&p->mu);
    return out;
}

static PyObject *Prefetch_close(Prefetch *p, PyObject *Py_UNUSED(ignored)) {
    stop_thread(p);
    Py_RETURN_NONE;
}

static Py_ssize_t Prefetch_len(Prefetch *p) {
    return p->n_jobs - p->taken;
}

static PyMethodDef Prefetch_methods[] = {
    {"take", (PyCFunction)Prefetch_take, METH_NOARGS,
     "The next job's (prompt, hashes), or None for a None job (waits for the thread)."},
    {"close", (PyCFunction)Prefetch_close, METH_NOARGS,
     "Stop the thread and wait for it; take() then answers only what is already made."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Prefetch_as_sequence = {.sq_length = (lenfunc)Prefetch_len};

static PyTypeObject PrefetchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router_sim.sim._prefetch.Prefetch",
    .tp_basicsize = sizeof(Prefetch),
    .tp_dealloc = (destructor)Prefetch_dealloc,
    .tp_as_sequence = &Prefetch_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Prompts and their V1 block hashes made ahead on a thread (see the module).",
    .tp_methods = Prefetch_methods,
    .tp_new = Prefetch_new,
};

/* expand_array(out, ids, count, per_id, shift, mask) -> out

   The prompt of ids (a tuple of ints, each taken modulo 2**64 and masked) as expand_ids
   writes it, into out, an array('i') of exactly count items (the caller makes it: the array
   module has no C API), held through its buffer while it is written. */
static PyObject *expand_array(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "expand_array(out, ids: tuple, count, per_id, shift, mask)");
        return NULL;
    }
    PyObject *ids = args[1];
    Py_ssize_t count = PyLong_AsSsize_t(args[2]);
    Py_ssize_t per_id = PyLong_AsSsize_t(args[3]);
    long shift = PyLong_AsLong(args[4]);
    unsigned long long mask = PyLong_AsUnsignedLongLong(args[5]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    /* the ids the prompt spans (its last block may be cut) */
    Py_ssize_t k = per_id >= 1 ? count / per_id + (count % per_id != 0) : 0;
    if (count < 0 || per_id < 1 || shift < 0 || shift > 31 || mask > UINT32_MAX ||
        count > PY_SSIZE_T_MAX / 4 || k > PyTuple_GET_SIZE(ids)) {
        PyErr_SetString(PyExc_ValueError,
                        "expand_array: count must be in [0, len(ids) * per_id], per_id >= 1, "
                        "shift in [0, 31], mask < 2**32");
        return NULL;
    }
    uint32_t *masked = PyMem_Malloc((size_t)(k > 0 ? k : 1) * sizeof(uint32_t));
    if (masked == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *h = PyTuple_GET_ITEM(ids, i);
        if (!PyLong_Check(h)) {
            PyMem_Free(masked);
            PyErr_SetString(PyExc_TypeError, "expand_array: hash ids must be ints");
            return NULL;
        }
        unsigned long long v = PyLong_AsUnsignedLongLongMask(h);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyMem_Free(masked);
            return NULL;
        }
        masked[i] = (uint32_t)(v & mask);
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyMem_Free(masked);
        return NULL;
    }
    if (view.itemsize != 4 || view.format == NULL || strcmp(view.format, "i") != 0 ||
        view.len != 4 * count) {
        PyBuffer_Release(&view);
        PyMem_Free(masked);
        PyErr_SetString(PyExc_ValueError, "out must be an array('i') of exactly count items");
        return NULL;
    }
    expand_ids(masked, count, per_id, (uint32_t)shift, (uint32_t *)view.buf);
    PyBuffer_Release(&view);
    PyMem_Free(masked);
    return Py_NewRef(args[0]);
}

static PyMethodDef module_methods[] = {
    {"expand_array", (PyCFunction)(void (*)(void))expand_array, METH_FASTCALL,
     "the simulator's prompt of hash ids written into an array('i') (router_sim.sim.workloads)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router_sim.sim._prefetch",
    "The simulator's prompts (expand_array) and their hashes, made ahead on a native thread "
    "(Prefetch).",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__prefetch(void) {
    if (PyType_Ready(&PrefetchType) < 0) {
        return NULL;
    }
    V1_HASH_BLOCK = (v1_hash_block_fn)PyCapsule_Import("kvcache._v1hash.hash_block_api", 0);
    if (V1_HASH_BLOCK == NULL) {
        /* kvcache._v1hash not built: this module cannot run either, and says so the way a
           missing extension does (its caller then makes prompts inline) */
        PyErr_SetString(PyExc_ImportError, "router_sim.sim._prefetch needs kvcache._v1hash");
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "KEYS", KEYS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&PrefetchType);
    if (PyModule_AddObject(m, "Prefetch", (PyObject *)&PrefetchType) < 0) {
        Py_DECREF(&PrefetchType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
