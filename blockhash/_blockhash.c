/*
 * blockhash: the SHA-256 key chain of a run of blocks in one call.
 *
 * key[0] = SHA-256(parent || block[0]), key[i] = SHA-256(key[i-1] || block[i]), where the
 * blocks are consecutive `block_bytes`-byte slices of `data` (the last may be shorter). The
 * digest is OpenSSL's low-level SHA256_Init/Update/Final (the one-shot SHA256() of OpenSSL 3
 * looks the algorithm up on every call), found in the libcrypto that Python's hashlib already
 * loaded: no crypto here, and no OpenSSL headers needed to build. Without them, `available` is
 * False and callers use hashlib.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <string.h>
#if defined(__linux__)
#include <link.h>
#endif

#define DIGEST 32

/* SHA256_CTX is 112 bytes in every OpenSSL from 0.9.8 to 3.x; room to spare, suitably aligned */
typedef union {
    unsigned char bytes[256];
    long double align;
} sha256_ctx;
typedef int (*init_fn)(sha256_ctx *ctx);
typedef int (*update_fn)(sha256_ctx *ctx, const void *data, size_t len);
typedef int (*final_fn)(unsigned char *md, sha256_ctx *ctx);
static init_fn sha256_init;
static update_fn sha256_update;
static final_fn sha256_final;

static int
bind(void *handle)
{
    sha256_init = (init_fn)dlsym(handle, "SHA256_Init");
    sha256_update = (update_fn)dlsym(handle, "SHA256_Update");
    sha256_final = (final_fn)dlsym(handle, "SHA256_Final");
    return sha256_init != NULL && sha256_update != NULL && sha256_final != NULL;
}

#if defined(__linux__)
static int
find_libcrypto(struct dl_phdr_info *info, size_t size, void *found)
{
    (void)size;
    const char *name = info->dlpi_name;
    if (name != NULL && strstr(name, "libcrypto") != NULL) {
        void *handle = dlopen(name, RTLD_LAZY | RTLD_NOLOAD);
        if (handle != NULL && bind(handle)) {
            *(int *)found = 1;
            return 1;
        }
    }
    return 0;
}
#endif

static void
load_sha256(void)
{
    /* hashlib's OpenSSL module loads libcrypto; use that very library */
    PyObject *hashlib = PyImport_ImportModule("_hashlib");
    if (hashlib == NULL) {
        PyErr_Clear();
    }
    Py_XDECREF(hashlib);
    int found = 0;
#if defined(__linux__)
    dl_iterate_phdr(find_libcrypto, &found);
#endif
    static const char *names[] = {"libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.dylib", NULL};
    for (int i = 0; !found && names[i] != NULL; i++) {
        void *handle = dlopen(names[i], RTLD_LAZY | RTLD_LOCAL);
        found = handle != NULL && bind(handle);
    }
    if (!found) {
        sha256_init = NULL;
    }
}

/* The arguments both functions share: 3 of them, a 32-byte parent digest, a positive block size
 * (args[2]) stored in *size. 0 on success, -1 with an exception set. */
static int
check_args(const char *name, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t *size)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "%s takes 3 arguments", name);
        return -1;
    }
    if (sha256_init == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "blockhash: OpenSSL's SHA-256 was not found (check blockhash.available)");
        return -1;
    }
    if (!PyBytes_Check(args[0]) || PyBytes_GET_SIZE(args[0]) != DIGEST) {
        PyErr_Format(PyExc_ValueError, "%s: parent must be a 32-byte bytes digest", name);
        return -1;
    }
    *size = PyLong_AsSsize_t(args[2]);
    if (*size == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (*size <= 0) {
        PyErr_Format(PyExc_ValueError, "%s: the block size must be positive", name);
        return -1;
    }
    return 0;
}

/* SHA-256(*prev || data[:len]) as a new bytes object, which becomes *prev; NULL on no memory. */
static PyObject *
next_key(const char **prev, const unsigned char *data, Py_ssize_t len)
{
    PyObject *key = PyBytes_FromStringAndSize(NULL, DIGEST);
    if (key == NULL) {
        return NULL;
    }
    unsigned char *md = (unsigned char *)PyBytes_AS_STRING(key);
    sha256_ctx ctx;
    sha256_init(&ctx);
    sha256_update(&ctx, *prev, DIGEST);
    sha256_update(&ctx, data, (size_t)len);
    sha256_final(md, &ctx);
    *prev = (const char *)md;
    return key;
}

static PyObject *
blockhash_chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t block_bytes;
    if (check_args("chain", args, nargs, &block_bytes) < 0) {
        return NULL;
    }
    PyObject *parent = args[0];
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Py_ssize_t n = (view.len + block_bytes - 1) / block_bytes;
    PyObject *out = PyList_New(n);
    const unsigned char *data = view.buf;
    const char *prev = PyBytes_AS_STRING(parent);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        Py_ssize_t beg = i * block_bytes;
        Py_ssize_t len = view.len - beg < block_bytes ? view.len - beg : block_bytes;
        PyObject *key = next_key(&prev, data + beg, len);
        if (key == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, key);
    }
    PyBuffer_Release(&view);
    return out;
}

/* chain_tokens(parent, tokens, block_tokens): chain() over the uint32 LE encoding of a list or
 * tuple of ints, encoded here (one pass, no intermediate bytes). None when a token is not an
 * int (the caller encodes those blocks its own way); ValueError for an int outside [0, 2**32). */
static PyObject *
blockhash_chain_tokens(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t per_block;
    if (check_args("chain_tokens", args, nargs, &per_block) < 0) {
        return NULL;
    }
    PyObject *parent = args[0];
    PyObject *seq = args[1];
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_SetString(PyExc_TypeError, "chain_tokens: tokens must be a list or a tuple");
        return NULL;
    }
    Py_ssize_t total = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < total; i++) {
        if (!PyLong_CheckExact(items[i])) {
            Py_RETURN_NONE;
        }
    }
    unsigned char stack[4 * 256];
    unsigned char *buf = stack;
    if (per_block > 256) {
        buf = PyMem_Malloc(4 * per_block);
        if (buf == NULL) {
            return PyErr_NoMemory();
        }
    }
    Py_ssize_t n = (total + per_block - 1) / per_block;
    PyObject *out = PyList_New(n);
    const char *prev = PyBytes_AS_STRING(parent);
    for (Py_ssize_t b = 0; out != NULL && b < n; b++) {
        Py_ssize_t beg = b * per_block;
        Py_ssize_t len = total - beg < per_block ? total - beg : per_block;
        for (Py_ssize_t i = 0; i < len; i++) {
            unsigned long v = PyLong_AsUnsignedLong(items[beg + i]);
            if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFUL) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "chain_tokens: token %zd is outside [0, 2**32)", beg + i);
                Py_CLEAR(out);
                break;
            }
            buf[4 * i] = (unsigned char)v;
            buf[4 * i + 1] = (unsigned char)(v >> 8);
            buf[4 * i + 2] = (unsigned char)(v >> 16);
            buf[4 * i + 3] = (unsigned char)(v >> 24);
        }
        if (out == NULL) {
            break;
        }
        PyObject *key = next_key(&prev, buf, 4 * len);
        if (key == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, b, key);
    }
    if (buf != stack) {
        PyMem_Free(buf);
    }
    return out;
}

/* A tree token's id (an exact int); one outside [0, 2**32) (never in a tree) equals no query token */
static unsigned long
tree_value(PyObject *want)
{
    unsigned long v = PyLong_AsUnsignedLong(want);
    if (v == (unsigned long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0x100000000UL;
    }
    return v;
}

/* Exact token equality of one block, value by value: 1 equal, 0 different, -1 undecided (a query
 * token that is not exactly an int in [0, 2**32) or non-empty bytes: the caller hashes, which
 * reports it). `want` are a block's tokens from the tree (valid). */
static int
same_token(PyObject *have, PyObject *want)
{
    if (have == want) {
        return 1;
    }
    if (PyLong_CheckExact(have)) {
        unsigned long v = PyLong_AsUnsignedLong(have);
        if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFUL) {
            PyErr_Clear();
            return -1;
        }
        return PyLong_CheckExact(want) && tree_value(want) == v;
    }
    if (PyBytes_CheckExact(have) && PyBytes_GET_SIZE(have) > 0) {
        return PyBytes_CheckExact(want) && PyBytes_GET_SIZE(want) == PyBytes_GET_SIZE(have) &&
               memcmp(PyBytes_AS_STRING(want), PyBytes_AS_STRING(have), PyBytes_GET_SIZE(have)) == 0;
    }
    return -1;
}

/* A buffer of uint32 items (an array('I')) in *view (release it); 0, no error set, otherwise. */
static int
uint32_view(PyObject *obj, Py_buffer *view)
{
    if (!PyObject_CheckBuffer(obj)) {
        return 0;
    }
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    if (view->itemsize == 4 && view->format != NULL && strcmp(view->format, "I") == 0) {
        return 1;
    }
    PyBuffer_Release(view);
    return 0;
}

/* same_block for a block that is an array('I') (committed from one): None when it is not */
static PyObject *
same_array_block(PyObject *block, PyObject *seq, Py_ssize_t beg, Py_ssize_t n)
{
    Py_buffer want;
    if (!uint32_view(block, &want)) {
        Py_RETURN_NONE;
    }
    PyObject *out = Py_None;
    if (want.len / 4 != n) {
        out = Py_False;
    } else if (PyList_CheckExact(seq) || PyTuple_CheckExact(seq)) {
        out = Py_False;
        if (n <= PySequence_Fast_GET_SIZE(seq) - beg) {
            PyObject **have = PySequence_Fast_ITEMS(seq) + beg;
            const unsigned int *ids = (const unsigned int *)want.buf;
            out = Py_True;
            for (Py_ssize_t i = 0; out == Py_True && i < n; i++) {
                if (!PyLong_CheckExact(have[i])) {
                    /* bytes: no id equals a digest; anything else: hashing decides (and reports it) */
                    out = PyBytes_CheckExact(have[i]) && PyBytes_GET_SIZE(have[i]) > 0 ? Py_False : Py_None;
                    break;
                }
                unsigned long v = PyLong_AsUnsignedLong(have[i]);
                if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFUL) {
                    PyErr_Clear();
                    out = Py_None;
                } else if (v != (unsigned long)ids[i]) {
                    out = Py_False;
                }
            }
        }
    } else {
        Py_buffer have;
        if (uint32_view(seq, &have)) {
            out = n <= have.len / 4 - beg && memcmp((const unsigned int *)have.buf + beg, want.buf, 4 * n) == 0
                      ? Py_True
                      : Py_False;
            PyBuffer_Release(&have);
        }
    }
    PyBuffer_Release(&want);
    return Py_NewRef(out);
}

/* same_block(block, tokens, beg, per_block): whether `block` (a tree block: a tuple of valid
 * tokens) is a full block (`per_block` tokens) holding exactly tokens[beg:beg+per_block], compared
 * in place (no slice, no encoding). Equal tokens under one parent mean an equal key, so a match
 * can follow a child without hashing. `block` may also be an array('I') (a block committed from
 * one); `tokens`: a list, a tuple or an array('I'). None when it cannot tell cheaply (another type
 * of block or tokens, a query token that is not exactly a valid int or bytes): hash instead (which
 * reports a bad token). */
static PyObject *
blockhash_same_block(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "same_block takes 4 arguments");
        return NULL;
    }
    PyObject *block = args[0];
    PyObject *seq = args[1];
    Py_ssize_t beg = PyLong_AsSsize_t(args[2]);
    if (beg == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[3]);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (beg < 0 || n <= 0) {
        PyErr_SetString(PyExc_ValueError, "same_block: beg must not be negative, per_block must be positive");
        return NULL;
    }
    if (!PyTuple_CheckExact(block)) {
        return same_array_block(block, seq, beg, n);
    }
    if (PyTuple_GET_SIZE(block) != n) {
        Py_RETURN_FALSE;
    }
    PyObject **want = &PyTuple_GET_ITEM(block, 0);
    if (PyList_CheckExact(seq) || PyTuple_CheckExact(seq)) {
        if (n > PySequence_Fast_GET_SIZE(seq) - beg) {
            Py_RETURN_FALSE;
        }
        PyObject **have = PySequence_Fast_ITEMS(seq) + beg;
        /* the very same token objects (a list probed again, a slice of it): one memcmp */
        if (memcmp(have, want, (size_t)n * sizeof(PyObject *)) == 0) {
            Py_RETURN_TRUE;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int same = same_token(have[i], want[i]);
            if (same < 0) {
                Py_RETURN_NONE;
            }
            if (!same) {
                Py_RETURN_FALSE;
            }
        }
        Py_RETURN_TRUE;
    }
    Py_buffer view;
    if (!uint32_view(seq, &view)) {
        Py_RETURN_NONE;
    }
    /* n <= len - beg, not beg + n <= len: a huge beg must not overflow (nor point past the buffer) */
    PyObject *out = n <= view.len / 4 - beg ? Py_True : Py_False;
    const unsigned int *ids = (const unsigned int *)view.buf;
    for (Py_ssize_t i = 0; out == Py_True && i < n; i++) {
        if (!PyLong_CheckExact(want[i]) || tree_value(want[i]) != (unsigned long)ids[beg + i]) {
            out = Py_False;
        }
    }
    PyBuffer_Release(&view);
    return Py_NewRef(out);
}

/* all_ids(tokens): whether a list or tuple holds only exact ints in [0, 2**32) (the common case
 * of token validation, in one pass; False for anything else: the caller checks token by token
 * and names the bad one, or accepts bytes tokens). */
static PyObject *
blockhash_all_ids(PyObject *module, PyObject *seq)
{
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
        Py_RETURN_FALSE;
    }
    Py_ssize_t total = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < total; i++) {
        if (!PyLong_CheckExact(items[i])) {
            Py_RETURN_FALSE;
        }
        unsigned long v = PyLong_AsUnsignedLong(items[i]);
        if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFUL) {
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

static PyMethodDef module_methods[] = {
    {"chain_tokens", (PyCFunction)(void (*)(void))blockhash_chain_tokens, METH_FASTCALL,
     "chain_tokens(parent, tokens, block_tokens) -> chain() of the tokens' uint32 LE encoding, or None "
     "when a token is not an int."},
    {"all_ids", (PyCFunction)blockhash_all_ids, METH_O,
     "all_ids(tokens) -> whether a list or tuple holds only exact ints in [0, 2**32)."},
    {"same_block", (PyCFunction)(void (*)(void))blockhash_same_block, METH_FASTCALL,
     "same_block(block, tokens, beg, per_block) -> whether the tuple block holds exactly "
     "tokens[beg:beg+per_block]; None when it cannot tell cheaply."},
    {"chain", (PyCFunction)(void (*)(void))blockhash_chain, METH_FASTCALL,
     "chain(parent, data, block_bytes) -> list of 32-byte keys: key[i] = SHA-256(key[i-1] || block i)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef blockhash_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "blockhash._blockhash",
    .m_doc = "Chained SHA-256 block keys through the libcrypto hashlib uses.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__blockhash(void)
{
    load_sha256();
    PyObject *m = PyModule_Create(&blockhash_module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "available", sha256_init != NULL ? Py_True : Py_False) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
