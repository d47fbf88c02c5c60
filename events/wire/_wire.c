/*
 * The native msgpack wire reader of the event path (WIRE.md): decode_events(kit, payload) reads
 * the whole common batch in one pass, straight into the records the event Structs of
 * events/wire/structs.py give. It takes a strict subset of what those Structs take (any other
 * payload is answered None and left to them) and gives the same records (tested).
 *
 * Token ids, most of a payload's bytes, go four at a time where four in a row are uint32s
 * (portable loops; SSSE3 byte shuffles paid 1.03-1.23x on decode and went). The token writer
 * and the lone token-array reader went too (1.2-1.5x on their jobs): msgspec writes and reads
 * token ids elsewhere.
 *
 * It is its own extension, apart from the V1 hashes (kvcache/_v1hash.c) it has nothing to do
 * with.
 */
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

/* ---- record builder --------------------------------------------------------------------- */

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
        if (Py_IS_TYPE(values[i], (PyTypeObject *)INT32_ARRAY_TYPE) &&
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

/* ---- packed token ids of the wire ------------------------------------------------------ */

static inline uint64_t load_be(const unsigned char *p, int width) {
    uint64_t v = 0;
    for (int k = 0; k < width; k++) {
        v = (v << 8) | p[k];
    }
    return v;
}

/* Reads n msgpack ints in [0, 2**31), in any msgpack int form, from p into out (n int32s):
 * the position after them, or NULL when an item is anything else or is cut short. */
static const unsigned char *read_token_ids(const unsigned char *p, const unsigned char *end,
                                           uint64_t n, unsigned char *out) {
    for (uint64_t i = 0; i < n; i++) {
        /* four uint32s in a row (the usual form of token ids), read at once */
        while (n - i >= 4 && end - p >= 20 && p[0] == 0xce && p[5] == 0xce && p[10] == 0xce &&
               p[15] == 0xce) {
            uint32_t v[4];
            for (int k = 0; k < 4; k++) {
#if defined(__GNUC__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
                memcpy(&v[k], p + 5 * k + 1, 4);
                v[k] = __builtin_bswap32(v[k]);
#else
                v[k] = ((uint32_t)p[5 * k + 1] << 24) | ((uint32_t)p[5 * k + 2] << 16) |
                       ((uint32_t)p[5 * k + 3] << 8) | p[5 * k + 4];
#endif
            }
            if ((v[0] | v[1] | v[2] | v[3]) > (uint32_t)INT32_MAX) {
                return NULL;
            }
            memcpy(out + 4 * i, v, 16);
            p += 20;
            i += 4;
        }
        if (i == n) {
            break;
        }
        if (p == end) {
            return NULL;
        }
        unsigned char t = *p++;
        uint64_t v;
        if (t == 0xce && end - p >= 4) { /* uint32, the usual form of a token id: inline */
            v = ((uint64_t)p[0] << 24) | ((uint64_t)p[1] << 16) | ((uint64_t)p[2] << 8) | p[3];
            p += 4;
        } else if (t <= 0x7f) { /* positive fixint */
            v = t;
        } else if (t >= 0xcc && t <= 0xd3) {
            /* uint8/16/32/64, then int8/16/32/64: 1, 2, 4, 8 bytes big-endian */
            int width = 1 << ((t - 0xcc) & 3);
            if (end - p < width) {
                return NULL;
            }
            if (t >= 0xd0 && (p[0] & 0x80)) {
                return NULL; /* a negative signed int */
            }
            v = load_be(p, width);
            p += width;
        } else {
            return NULL; /* a negative fixint, nil, bool, float, str, bin, array, map, ext */
        }
        if (v > (uint64_t)INT32_MAX) {
            return NULL;
        }
        int32_t tok = (int32_t)v;
        memcpy(out + 4 * i, &tok, 4);
    }
    return p;
}

/* ---- whole-batch wire reader ------------------------------------------------------------
 *
 * The subscriber's decode, one call: decode_events reads the common batch straight into the
 * records the event Structs of events/wire/structs.py give (the record types and their field
 * descriptors are passed in). It takes a strict subset of what the Structs take and answers
 * None for everything else, which the caller then hands to them (they name errors): nothing
 * here raises on the data. */

/* A cursor over a msgpack buffer: every read checks the bytes left first. */
typedef struct {
    const unsigned char *p, *end;
} mp_reader;

/* One msgpack int of any form: 1 with *ux set (two's complement, *neg set, when negative); 0
 * when the next value is not an int or is cut short. */
static int mp_int(mp_reader *r, uint64_t *ux, int *neg) {
    if (r->p >= r->end) {
        return 0;
    }
    unsigned char t = *r->p;
    if (t <= 0x7f) {
        *ux = t, *neg = 0, r->p++;
        return 1;
    }
    if (t >= 0xe0) {
        *ux = (uint64_t)(int64_t)(int8_t)t, *neg = 1, r->p++;
        return 1;
    }
    if (t < 0xcc || t > 0xd3) {
        return 0;
    }
    int width = 1 << ((t - 0xcc) & 3);
    if (r->end - r->p - 1 < width) {
        return 0;
    }
    uint64_t v = load_be(r->p + 1, width);
    *neg = 0;
    if (t >= 0xd0 && (r->p[1] & 0x80)) {
        if (width < 8) {
            v |= ~UINT64_C(0) << (8 * width); /* sign-extended */
        }
        *neg = 1;
    }
    *ux = v;
    r->p += 1 + width;
    return 1;
}

/* A non-negative int below limit (0: no limit besides 2**64). */
static int mp_uint(mp_reader *r, uint64_t *v, uint64_t limit) {
    int neg;
    return mp_int(r, v, &neg) && !neg && (limit == 0 || *v < limit);
}

static int mp_nil(mp_reader *r) {
    if (r->p < r->end && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

/* A container header (base: 0x90 fixarray / 0x80 fixmap; wide: 0xdc array16 / 0xde map16,
 * the 32-bit form one after): 1 with *n set when n items (at least a byte each) can follow. */
static int mp_header(mp_reader *r, unsigned char base, unsigned char wide, uint64_t *n) {
    if (r->p >= r->end) {
        return 0;
    }
    unsigned char t = *r->p;
    int width = 0;
    if ((t & 0xf0) == base) {
        *n = t & 0x0f;
    } else if (t == wide || t == wide + 1) {
        width = t == wide ? 2 : 4;
        if (r->end - r->p - 1 < width) {
            return 0;
        }
        *n = load_be(r->p + 1, width);
    } else {
        return 0;
    }
    r->p += 1 + width;
    return *n <= (uint64_t)(r->end - r->p);
}

/* A str of at most max_len bytes: 1 with *s, *len set. */
static int mp_str(mp_reader *r, const char **s, Py_ssize_t *len, Py_ssize_t max_len) {
    if (r->p >= r->end) {
        return 0;
    }
    unsigned char t = *r->p;
    int width;
    uint64_t n;
    if ((t & 0xe0) == 0xa0) {
        width = 0, n = t & 0x1f;
    } else if (t >= 0xd9 && t <= 0xdb) {
        width = 1 << (t - 0xd9);
        if (r->end - r->p - 1 < width) {
            return 0;
        }
        n = load_be(r->p + 1, width);
    } else {
        return 0;
    }
    const unsigned char *at = r->p + 1 + width;
    if (n > (uint64_t)max_len || n > (uint64_t)(r->end - at)) {
        return 0;
    }
    *s = (const char *)at, *len = (Py_ssize_t)n;
    r->p = at + n;
    return 1;
}

/* Bounds of the typed path's types (events.wire.fast), which the Python side checks agree. */
#define WIRE_MAX_EVENTS 65536
#define WIRE_MAX_TOKENS 1048576
#define WIRE_MAX_BLOCKS 65536
#define WIRE_MAX_STR 16384 /* bytes here; the typed path counts characters, at most as many */
#define TOKEN_LIMIT_U (UINT64_C(1) << 31)

enum {
    F_TYPE, F_EVENT_ID, F_WINDOW, F_ALGO, F_RANK, F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE,
    F_LORA, F_MEDIUM, F_LORA_NAME, F_SALT_ID, F_PRIORITY, F_SALT, F_EXTRA, F_GROUP, F_COUNT
};
#define NAME(s) {s, sizeof(s) - 1}
static const struct {
    const char *name;
    Py_ssize_t len;
} FIELD_NAMES[F_COUNT] = {
    NAME("type"), NAME("event_id"), NAME("window_size"), NAME("hash_algo"),
    NAME("attention_dp_rank"), NAME("block_hashes"), NAME("parent_block_hash"),
    NAME("token_ids"), NAME("block_size"), NAME("lora_id"), NAME("medium"), NAME("lora_name"),
    NAME("cache_salt_id"), NAME("priority"), NAME("cache_salt"), NAME("extra_keys"),
    NAME("group_idx"),
};
#undef NAME
#define BIT(f) (1u << (f))
#define WIRE_COMMON_FIELDS (BIT(F_TYPE) | BIT(F_EVENT_ID) | BIT(F_WINDOW) | BIT(F_ALGO) | BIT(F_RANK))
#define REMOVED_FIELDS (WIRE_COMMON_FIELDS | BIT(F_HASHES) | BIT(F_MEDIUM) | BIT(F_GROUP))
#define STORED_FIELDS                                                                           \
    (REMOVED_FIELDS | BIT(F_PARENT) | BIT(F_TOKENS) | BIT(F_BLOCK_SIZE) | BIT(F_LORA) |         \
     BIT(F_LORA_NAME) | BIT(F_SALT_ID) | BIT(F_PRIORITY) | BIT(F_SALT) | BIT(F_EXTRA))

enum { KIND_STORED = 1, KIND_REMOVED, KIND_CLEARED };

/* An optional value as read: absent (the default applies), nil, or a value. */
typedef struct {
    int state; /* 0 absent, 1 nil, 2 value */
    uint64_t u;
    const char *s;
    Py_ssize_t len;
} wire_opt;

typedef struct {
    int kind;
    unsigned seen;
    wire_opt f[F_COUNT];
    PyObject *hashes; /* the block hashes, a list of ints (owned) */
    PyObject *tokens; /* the token ids, one array('i') (owned) */
} wire_event;

static void clear_wire_event(wire_event *ev) {
    Py_CLEAR(ev->hashes);
    Py_CLEAR(ev->tokens);
}

/* Reads one field's value into ev: 1, 0 when the typed path would not take it here, -1 on
 * error (an allocation failed). */
static int read_field(mp_reader *r, int f, wire_event *ev) {
    wire_opt *o = &ev->f[f];
    uint64_t n, ux;
    int neg;
    o->state = 2;
    switch (f) {
    case F_TYPE: {
        if (!mp_str(r, &o->s, &o->len, 32)) {
            return 0;
        }
#define IS(name) (o->len == (Py_ssize_t)sizeof(name) - 1 && memcmp(o->s, name, o->len) == 0)
        ev->kind = IS("BlockStored")    ? KIND_STORED
                   : IS("BlockRemoved") ? KIND_REMOVED
                   : IS("AllBlocksCleared") ? KIND_CLEARED
                                            : 0;
#undef IS
        return ev->kind != 0;
    }
    case F_EVENT_ID:
    case F_WINDOW:
        return mp_uint(r, &o->u, 0);
    case F_BLOCK_SIZE:
        return mp_uint(r, &o->u, TOKEN_LIMIT_U);
    case F_PRIORITY:
        return mp_uint(r, &o->u, 101);
    case F_ALGO:
        return mp_str(r, &o->s, &o->len, WIRE_MAX_STR);
    case F_RANK:
    case F_LORA:
    case F_SALT_ID:
    case F_GROUP:
        if (mp_nil(r)) {
            o->state = 1;
            return 1;
        }
        return mp_uint(r, &o->u, f == F_GROUP ? TOKEN_LIMIT_U : 0);
    case F_MEDIUM:
    case F_LORA_NAME:
    case F_SALT:
        if (mp_nil(r)) {
            o->state = 1;
            return 1;
        }
        return mp_str(r, &o->s, &o->len, WIRE_MAX_STR);
    case F_EXTRA:
        o->state = 1;
        return mp_nil(r); /* vLLM's extra_keys lists: the typed path's */
    case F_PARENT:
        if (mp_nil(r)) {
            o->state = 1;
            return 1;
        }
        return mp_int(r, &o->u, &neg); /* a negative hash: its uint64 */
    case F_HASHES:
        if (!mp_header(r, 0x90, 0xdc, &n) || n > WIRE_MAX_BLOCKS) {
            return 0;
        }
        if ((ev->hashes = PyList_New((Py_ssize_t)n)) == NULL) {
            return -1;
        }
        for (uint64_t i = 0; i < n; i++) {
            if (!mp_int(r, &ux, &neg)) {
                return 0; /* bin hashes: the typed path's */
            }
            PyObject *h = PyLong_FromUnsignedLongLong(ux); /* a negative one: its uint64 */
            if (h == NULL) {
                return -1;
            }
            PyList_SET_ITEM(ev->hashes, (Py_ssize_t)i, h);
        }
        return 1;
    case F_TOKENS: {
        if (!mp_header(r, 0x90, 0xdc, &n) || n > WIRE_MAX_TOKENS) {
            return 0;
        }
        unsigned char *out;
        if ((ev->tokens = int32_array_new((Py_ssize_t)n, &out)) == NULL) {
            return -1;
        }
        r->p = read_token_ids(r->p, r->end, n, out);
        return r->p != NULL;
    }
    }
    return 0;
}

/* Reads one event map: 1, 0 when the typed path would not take it here, -1 on error. The
 * caller clears ev whatever the answer. */
static int read_event(mp_reader *r, wire_event *ev) {
    uint64_t n;
    memset(ev, 0, sizeof(*ev));
    if (!mp_header(r, 0x80, 0xde, &n)) {
        return 0;
    }
    for (uint64_t i = 0; i < n; i++) {
        const char *key;
        Py_ssize_t len;
        if (!mp_str(r, &key, &len, 32)) {
            return 0;
        }
        int f = 0;
        while (f < F_COUNT &&
               !(FIELD_NAMES[f].len == len && memcmp(FIELD_NAMES[f].name, key, len) == 0)) {
            f++;
        }
        if (f == F_COUNT || ev->seen & BIT(f)) {
            return 0; /* an unknown field or a repeated one */
        }
        ev->seen |= BIT(f);
        int rc = read_field(r, f, ev);
        if (rc != 1) {
            return rc;
        }
    }
    unsigned allowed = ev->kind == KIND_STORED    ? STORED_FIELDS
                       : ev->kind == KIND_REMOVED ? REMOVED_FIELDS
                                                  : WIRE_COMMON_FIELDS;
    unsigned required = ev->kind == KIND_STORED
                            ? BIT(F_TYPE) | BIT(F_HASHES) | BIT(F_TOKENS) | BIT(F_BLOCK_SIZE)
                        : ev->kind == KIND_REMOVED ? BIT(F_TYPE) | BIT(F_HASHES)
                                                   : BIT(F_TYPE);
    if (ev->seen & ~allowed || (ev->seen & required) != required) {
        return 0;
    }
    if (ev->kind == KIND_STORED) {
        /* the stores whose blocks are cut from their token ids as they come: others
         * (placeholders, masked, empty, inconsistent) are the typed path's */
        uint64_t bs = ev->f[F_BLOCK_SIZE].u, nh = (uint64_t)PyList_GET_SIZE(ev->hashes);
        uint64_t nt = (uint64_t)Py_SIZE(ev->tokens);
        if (nh == 0 || bs == 0 || !((nh - 1) * bs < nt && nt <= nh * bs)) {
            return 0;
        }
    }
    return 1;
}

/* The decode kit: (StoredBlock, its 6 setters, Stored, its 10, Removed, its 3, AllBlocksCleared,
 * KVCacheEvent, its 5, DecodedBatch, its 4, cache_level_of). */
enum {
    KIT_BLOCK, KIT_BLOCK_SET, KIT_STORED, KIT_STORED_SET, KIT_REMOVED, KIT_REMOVED_SET,
    KIT_CLEARED, KIT_EVENT, KIT_EVENT_SET, KIT_BATCH, KIT_BATCH_SET, KIT_LEVEL_OF, KIT_SIZE
};

static PyObject *STR_DEFAULT_ALGO; /* "v1_block_key" */

static int check_kit(PyObject *kit) {
    static const Py_ssize_t fields[][2] = {{KIT_BLOCK, RECORD_FIELDS}, {KIT_STORED, 10},
                                           {KIT_REMOVED, 3}, {KIT_EVENT, 5}, {KIT_BATCH, 4}};
    if (!PyTuple_CheckExact(kit) || PyTuple_GET_SIZE(kit) != KIT_SIZE ||
        !PyType_Check(PyTuple_GET_ITEM(kit, KIT_CLEARED))) {
        PyErr_SetString(PyExc_TypeError, "decode_events: not a record kit");
        return -1;
    }
    for (size_t k = 0; k < sizeof(fields) / sizeof(fields[0]); k++) {
        PyObject *cls = PyTuple_GET_ITEM(kit, fields[k][0]);
        PyObject *setters = PyTuple_GET_ITEM(kit, fields[k][0] + 1);
        if (!PyType_Check(cls) || !PyTuple_CheckExact(setters) ||
            PyTuple_GET_SIZE(setters) != fields[k][1]) {
            PyErr_SetString(PyExc_TypeError, "decode_events: not a record kit");
            return -1;
        }
        for (Py_ssize_t i = 0; i < fields[k][1]; i++) {
            if (Py_TYPE(PyTuple_GET_ITEM(setters, i))->tp_descr_set == NULL) {
                PyErr_SetString(PyExc_TypeError, "decode_events: not a record kit");
                return -1;
            }
        }
    }
    return 0;
}

/* The Python value of an optional field: None, its default, or the value read. */
static PyObject *opt_int(const wire_opt *o, PyObject *dflt) {
    if (o->state == 2) {
        return PyLong_FromUnsignedLongLong(o->u);
    }
    return Py_NewRef(o->state == 1 ? Py_None : dflt);
}

static PyObject *opt_str(const wire_opt *o) {
    if (o->state == 2) {
        return PyUnicode_DecodeUTF8(o->s, o->len, NULL);
    }
    return Py_NewRef(Py_None);
}

/* The cache level of a medium: None and "GPU" 0, "CPU" 1, any other name cache_level_of's. */
static PyObject *medium_level(const wire_opt *o, PyObject *level_of) {
    if (o->state != 2 || (o->len == 3 && memcmp(o->s, "GPU", 3) == 0)) {
        return PyLong_FromLong(0);
    }
    if (o->len == 3 && memcmp(o->s, "CPU", 3) == 0) {
        return PyLong_FromLong(1);
    }
    PyObject *name = opt_str(o);
    if (name == NULL) {
        return NULL;
    }
    PyObject *level = PyObject_CallOneArg(level_of, name);
    Py_DECREF(name);
    return level;
}

/* The blocks of a store read by read_event: block i holds hashes[i] and its block_size slice of
 * the token ids, an array('i') (a lone block the whole array). */
static PyObject *store_blocks(PyObject *kit, const wire_event *ev, PyObject *level) {
    PyObject *lora = NULL, *priority = NULL, *salt = NULL, *out = NULL;
    PyObject *py35 = PyLong_FromLong(35);
    lora = opt_int(&ev->f[F_LORA], Py_None);
    priority = opt_int(&ev->f[F_PRIORITY], py35);
    salt = opt_int(&ev->f[F_SALT_ID], Py_None);
    Py_ssize_t n = PyList_GET_SIZE(ev->hashes), left = Py_SIZE(ev->tokens);
    Py_ssize_t bs = (Py_ssize_t)ev->f[F_BLOCK_SIZE].u;
    Py_buffer view;
    if (py35 == NULL || lora == NULL || priority == NULL || salt == NULL ||
        (out = PyList_New(n)) == NULL) {
        goto done;
    }
    if (PyObject_GetBuffer(ev->tokens, &view, PyBUF_SIMPLE) < 0) {
        Py_CLEAR(out);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t count = left < bs ? left : bs;
        PyObject *tokens;
        if (n == 1) {
            tokens = Py_NewRef(ev->tokens);
        } else {
            unsigned char *data;
            tokens = int32_array_new(count, &data);
            if (tokens == NULL) {
                Py_CLEAR(out);
                break;
            }
            memcpy(data, (const unsigned char *)view.buf + 4 * (i * bs), 4 * (size_t)count);
        }
        left -= count;
        PyObject *values[RECORD_FIELDS] = {PyList_GET_ITEM(ev->hashes, i), tokens, lora, level,
                                           priority, salt};
        PyObject *rec = new_record(PyTuple_GET_ITEM(kit, KIT_BLOCK),
                                   PyTuple_GET_ITEM(kit, KIT_BLOCK_SET), values);
        Py_DECREF(tokens);
        if (rec == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, rec);
    }
    PyBuffer_Release(&view);
done:
    Py_XDECREF(py35);
    Py_XDECREF(lora);
    Py_XDECREF(priority);
    Py_XDECREF(salt);
    return out;
}

/* The event payload (Stored, Removed, AllBlocksCleared) of an event read by read_event. */
static PyObject *event_data(PyObject *kit, const wire_event *ev) {
    if (ev->kind == KIND_CLEARED) {
        return PyObject_CallNoArgs(PyTuple_GET_ITEM(kit, KIT_CLEARED));
    }
    PyObject *level_of = PyTuple_GET_ITEM(kit, KIT_LEVEL_OF);
    PyObject *group = opt_int(&ev->f[F_GROUP], Py_None);
    if (group == NULL) {
        return NULL;
    }
    PyObject *data = NULL;
    if (ev->kind == KIND_REMOVED) {
        PyObject *level = ev->f[F_MEDIUM].state == 2 ? medium_level(&ev->f[F_MEDIUM], level_of)
                                                     : Py_NewRef(Py_None);
        if (level != NULL) {
            PyObject *values[3] = {ev->hashes, level, group};
            data = new_record_n(PyTuple_GET_ITEM(kit, KIT_REMOVED),
                                PyTuple_GET_ITEM(kit, KIT_REMOVED_SET), values, 3);
        }
        Py_XDECREF(level);
        Py_DECREF(group);
        return data;
    }
    PyObject *level = medium_level(&ev->f[F_MEDIUM], level_of);
    PyObject *blocks = level == NULL ? NULL : store_blocks(kit, ev, level);
    PyObject *parent = opt_int(&ev->f[F_PARENT], Py_None);
    PyObject *bs = PyLong_FromUnsignedLongLong(ev->f[F_BLOCK_SIZE].u);
    PyObject *lora_name = opt_str(&ev->f[F_LORA_NAME]);
    PyObject *salt = opt_str(&ev->f[F_SALT]);
    if (blocks != NULL && parent != NULL && bs != NULL && lora_name != NULL && salt != NULL) {
        /* masked False; no group spec (a store that sends one is the typed path's) and so
           no masked tokens */
        PyObject *values[10] = {parent, blocks,   bs,      group,   lora_name,
                                salt,   Py_False, Py_None, Py_None, Py_None};
        data = new_record_n(PyTuple_GET_ITEM(kit, KIT_STORED),
                            PyTuple_GET_ITEM(kit, KIT_STORED_SET), values, 10);
    }
    Py_XDECREF(level);
    Py_XDECREF(blocks);
    Py_XDECREF(parent);
    Py_XDECREF(bs);
    Py_XDECREF(lora_name);
    Py_XDECREF(salt);
    Py_DECREF(group);
    return data;
}

/* The KVCacheEvent of the event at index i of its batch; an event without its own rank gets
 * None here (the batch's rank follows the events: the caller sets it then). */
static PyObject *wire_event_record(PyObject *kit, const wire_event *ev, Py_ssize_t i) {
    PyObject *data = event_data(kit, ev);
    if (data == NULL) {
        return NULL;
    }
    const wire_opt *algo = &ev->f[F_ALGO];
    PyObject *event_id = ev->f[F_EVENT_ID].state == 2
                             ? PyLong_FromUnsignedLongLong(ev->f[F_EVENT_ID].u)
                             : PyLong_FromSsize_t(i);
    PyObject *window = PyLong_FromUnsignedLongLong(ev->f[F_WINDOW].u); /* 0 when absent */
    PyObject *hash_algo =
        algo->state != 2 || (algo->len == 12 && memcmp(algo->s, "v1_block_key", 12) == 0)
            ? Py_NewRef(STR_DEFAULT_ALGO)
            : PyUnicode_DecodeUTF8(algo->s, algo->len, NULL);
    PyObject *rank = opt_int(&ev->f[F_RANK], Py_None);
    PyObject *rec = NULL;
    if (event_id != NULL && window != NULL && hash_algo != NULL && rank != NULL) {
        PyObject *values[5] = {event_id, data, window, hash_algo, rank};
        rec = new_record_n(PyTuple_GET_ITEM(kit, KIT_EVENT), PyTuple_GET_ITEM(kit, KIT_EVENT_SET),
                           values, 5);
    }
    Py_DECREF(data);
    Py_XDECREF(event_id);
    Py_XDECREF(window);
    Py_XDECREF(hash_algo);
    Py_XDECREF(rank);
    return rec;
}

/* decode_events(kit, payload) -> DecodedBatch | None: the batch of a map-form payload
 * [ts: float64, events, dp_rank] whose events are BlockStored (int hashes, token ids that fill
 * their blocks, no extra_keys list), BlockRemoved (int hashes) and AllBlocksCleared with known
 * fields only, each once; None for anything else. Every length is checked against the bytes
 * left before it is used, no nesting beyond the format's is read, and nothing is built that the
 * payload's bytes do not pay for, so hostile input costs at most its own size (a string that is
 * not UTF-8 is refused too). One pass: each event's records are built as it is read, and
 * dropped if a later one is refused. */
static PyObject *decode_events(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "decode_events takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *kit = args[0];
    if (check_kit(kit) < 0) {
        return NULL;
    }
    Py_buffer buf;
    if (PyObject_GetBuffer(args[1], &buf, PyBUF_SIMPLE) < 0) {
        PyErr_Clear(); /* not one contiguous buffer: the typed path's */
        Py_RETURN_NONE;
    }
    const unsigned char *end = (const unsigned char *)buf.buf + buf.len;
    mp_reader r = {(const unsigned char *)buf.buf, end};
    PyObject *events = NULL, *dp_rank = NULL, *result = NULL;
    unsigned char *unranked = NULL; /* per event: it has no rank of its own */
    uint64_t n_top, n_events, rank = 0;
    int refused = 1;
    if (!mp_header(&r, 0x90, 0xdc, &n_top) || (n_top != 2 && n_top != 3) ||
        end - r.p < 9 || r.p[0] != 0xcb) {
        goto done;
    }
    uint64_t bits = load_be(r.p + 1, 8);
    double ts;
    memcpy(&ts, &bits, 8);
    r.p += 9;
    if (!isfinite(ts) || !mp_header(&r, 0x90, 0xdc, &n_events) || n_events > WIRE_MAX_EVENTS) {
        goto done;
    }
    refused = 0;
    events = PyList_New((Py_ssize_t)n_events);
    unranked = PyMem_Calloc((size_t)n_events + 1, 1);
    if (events == NULL || unranked == NULL) {
        goto error;
    }
    for (uint64_t i = 0; i < n_events; i++) {
        wire_event ev;
        int rc = read_event(&r, &ev);
        PyObject *rec = rc == 1 ? wire_event_record(kit, &ev, (Py_ssize_t)i) : NULL;
        unranked[i] = ev.f[F_RANK].state == 0;
        clear_wire_event(&ev);
        if (rec == NULL) {
            refused = rc == 0;
            goto error;
        }
        PyList_SET_ITEM(events, (Py_ssize_t)i, rec);
    }
    refused = 1;
    if (n_top == 3 && !mp_nil(&r)) {
        if (!mp_uint(&r, &rank, TOKEN_LIMIT_U)) {
            goto error;
        }
        dp_rank = PyLong_FromUnsignedLongLong(rank);
    } else {
        dp_rank = Py_NewRef(Py_None);
    }
    if (r.p != end) {
        goto error;
    }
    refused = 0;
    if (dp_rank == NULL) {
        goto error;
    }
    PyObject *rank_setter = PyTuple_GET_ITEM(PyTuple_GET_ITEM(kit, KIT_EVENT_SET), 4);
    for (uint64_t i = 0; dp_rank != Py_None && i < n_events; i++) {
        /* records built here and seen by no one yet: their rank is the batch's */
        if (unranked[i] && Py_TYPE(rank_setter)->tp_descr_set(
                               rank_setter, PyList_GET_ITEM(events, (Py_ssize_t)i), dp_rank) < 0) {
            goto error;
        }
    }
    PyObject *py_ts = PyFloat_FromDouble(ts), *malformed = PyList_New(0);
    if (py_ts != NULL && malformed != NULL) {
        PyObject *values[4] = {py_ts, events, dp_rank, malformed};
        result = new_record_n(PyTuple_GET_ITEM(kit, KIT_BATCH), PyTuple_GET_ITEM(kit, KIT_BATCH_SET),
                              values, 4);
    }
    Py_XDECREF(py_ts);
    Py_XDECREF(malformed);
error:
    if (result == NULL && !refused && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear(); /* a string that is not UTF-8: the typed path's to refuse */
        refused = 1;
    }
done:
    PyMem_Free(unranked);
    Py_XDECREF(events);
    Py_XDECREF(dp_rank);
    PyBuffer_Release(&buf);
    if (refused) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return result;
}

static PyMethodDef methods[] = {
    {"decode_events", (PyCFunction)(void (*)(void))decode_events, METH_FASTCALL,
     "decode_events(kit, payload) -> DecodedBatch | None: the common map-form batch read "
     "straight into its records; None for anything else."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_wire",
    "Native msgpack wire reader of the common batch (see events.wire.fast).", -1, methods, NULL, NULL,
    NULL, NULL,
};

PyMODINIT_FUNC PyInit__wire(void) {
    if (int32_array_init() < 0) {
        return NULL;
    }
    if ((STR_DEFAULT_ALGO = PyUnicode_InternFromString("v1_block_key")) == NULL) {
        return NULL;
    }
    return PyModule_Create(&module);
}
