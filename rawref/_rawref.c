/*
 * rawref: non-owning references for objects that manage their own lifetime.
 *
 * A ref stores a borrowed pointer to its target. The target keeps its one ref
 * in the attribute `_rawref` and must call `invalidate()` on it before it dies
 * (typically in `__del__` or an explicit release method). Unlike weakref, this
 * works for mypyc native classes and costs one pointer read per dereference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

typedef struct {
    PyObject_HEAD
    PyObject *target;        /* borrowed; NULL once invalidated */
    vectorcallfunc vectorcall; /* calling a ref (a dereference) skips the argument tuple */
} RawRef;

static PyTypeObject RawRefType;
static PyObject *attr_name; /* interned "_rawref" */

static PyObject *rawref_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);

static RawRef *
rawref_alloc(PyObject *target)
{
    RawRef *self = PyObject_New(RawRef, &RawRefType);
    if (self != NULL) {
        self->target = target;
        self->vectorcall = rawref_vectorcall;
    }
    return self;
}

/* The one ref of obj: its `_rawref` when that refers to it, else a new one stored there. */
static PyObject *
rawref_of(PyObject *obj)
{
    PyObject *existing = PyObject_GetAttr(obj, attr_name);
    if (existing == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            return NULL;
        }
        PyErr_Clear();
    } else if (Py_IS_TYPE(existing, &RawRefType) && ((RawRef *)existing)->target == obj) {
        return existing; /* the object's one live reference */
    } else {
        Py_DECREF(existing);
    }
    RawRef *ref = rawref_alloc(obj);
    if (ref == NULL) {
        return NULL;
    }
    if (PyObject_SetAttr(obj, attr_name, (PyObject *)ref) < 0) {
        Py_DECREF(ref);
        if (PyErr_ExceptionMatches(PyExc_AttributeError) || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Format(PyExc_TypeError,
                         "rawref.ref(): %.200s objects cannot hold a rawref; the class must "
                         "declare a '_rawref' attribute (or have a __dict__)",
                         Py_TYPE(obj)->tp_name);
        }
        return NULL;
    }
    return (PyObject *)ref;
}

static PyObject *
rawref_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *obj;
    static char *kwlist[] = {"obj", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:ref", kwlist, &obj)) {
        return NULL;
    }
    return rawref_of(obj);
}

/* ref(obj) called through vectorcall (the usual call, one per published page): no argument tuple */
static PyObject *
rawref_type_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) == 1 && (kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0)) {
        return rawref_of(args[0]);
    }
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *tuple = PyTuple_New(nargs); /* anything else: the keyword-aware path */
    if (tuple == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(tuple, i, args[i]);
    }
    PyObject *kwds = NULL;
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        kwds = PyDict_New();
        for (Py_ssize_t i = 0; kwds != NULL && i < PyTuple_GET_SIZE(kwnames); i++) {
            if (PyDict_SetItem(kwds, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
                Py_CLEAR(kwds);
            }
        }
        if (kwds == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
    }
    PyObject *out = rawref_new((PyTypeObject *)type, tuple, kwds);
    Py_DECREF(tuple);
    Py_XDECREF(kwds);
    return out;
}

static void
rawref_dealloc(RawRef *self)
{
    PyObject_Free(self);
}

/* ref(): the target, or None once invalidated (a dereference: no argument tuple) */
static PyObject *
rawref_vectorcall(PyObject *self, PyObject *const *Py_UNUSED(args), size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 0 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "rawref.ref() takes no arguments when called");
        return NULL;
    }
    PyObject *target = ((RawRef *)self)->target;
    if (target == NULL) {
        target = Py_None;
    }
    Py_INCREF(target);
    return target;
}

static PyObject *
rawref_call(RawRef *self, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "rawref.ref() takes no arguments when called");
        return NULL;
    }
    PyObject *target = self->target != NULL ? self->target : Py_None;
    Py_INCREF(target);
    return target;
}

static PyObject *
rawref_invalidate(RawRef *self, PyObject *Py_UNUSED(ignored))
{
    self->target = NULL;
    Py_RETURN_NONE;
}

static PyObject *
rawref_is_valid(RawRef *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->target != NULL);
}

static PyObject *
rawref_repr(RawRef *self)
{
    if (self->target == NULL) {
        return PyUnicode_FromFormat("<rawref.ref at %p; invalid>", (void *)self);
    }
    return PyUnicode_FromFormat("<rawref.ref at %p; to '%s' at %p>", (void *)self,
                                Py_TYPE(self->target)->tp_name, (void *)self->target);
}

static PyMethodDef rawref_methods[] = {
    {"invalidate", (PyCFunction)rawref_invalidate, METH_NOARGS,
     "Mark the target as gone; later calls return None."},
    {"__class_getitem__", Py_GenericAlias, METH_O | METH_CLASS, "ref[T] for annotations."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef rawref_getset[] = {
    {"is_valid", (getter)rawref_is_valid, NULL, "True while the target has not invalidated this ref.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RawRefType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rawref.ref",
    .tp_basicsize = sizeof(RawRef),
    .tp_dealloc = (destructor)rawref_dealloc,
    .tp_repr = (reprfunc)rawref_repr,
    .tp_call = (ternaryfunc)rawref_call,
    .tp_vectorcall_offset = offsetof(RawRef, vectorcall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "ref(obj): the one non-owning reference of obj (created on first use).\n\n"
              "Calling it returns obj while obj is alive, None after obj invalidated it.",
    .tp_methods = rawref_methods,
    .tp_getset = rawref_getset,
    .tp_new = rawref_new,
    .tp_vectorcall = rawref_type_vectorcall,
};

/*
 * untrack(obj): take obj out of the cyclic garbage collector's lists. For objects that are
 * many and long-lived (tree nodes, pages) and whose reference cycles their owner breaks
 * explicitly: the collector then never traverses them again. Returns obj.
 */
static PyObject *
rawref_untrack(PyObject *module, PyObject *obj)
{
    if (PyObject_IS_GC(obj)) {
        PyObject_GC_UnTrack(obj); /* a no-op when already untracked */
    }
    Py_INCREF(obj);
    return obj;
}

/*
 * fresh(obj): a new ref of obj, stored nowhere: for a class that keeps its one ref itself (its
 * `_rawref` attribute set by its own code: a native attribute store, no attribute lookup by name).
 */
static PyObject *
rawref_fresh(PyObject *module, PyObject *obj)
{
    return (PyObject *)rawref_alloc(obj);
}

/* invalidate(ref): ref.invalidate() as a plain function (no method lookup: once per freed page) */
static PyObject *
rawref_invalidate_fn(PyObject *module, PyObject *ref)
{
    if (!Py_IS_TYPE(ref, &RawRefType)) {
        PyErr_Format(PyExc_TypeError, "rawref.invalidate() takes a rawref.ref, not %.200s", Py_TYPE(ref)->tp_name);
        return NULL;
    }
    ((RawRef *)ref)->target = NULL;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"untrack", (PyCFunction)rawref_untrack, METH_O,
     "untrack(obj) -> obj: the cyclic GC stops tracking obj (its owner must break its cycles)."},
    {"fresh", (PyCFunction)rawref_fresh, METH_O,
     "fresh(obj) -> ref: a new ref of obj stored nowhere (the caller keeps it as obj's one ref)."},
    {"invalidate", (PyCFunction)rawref_invalidate_fn, METH_O,
     "invalidate(ref): the same as ref.invalidate()."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef rawref_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "rawref._rawref",
    .m_doc = "Non-owning references usable from mypyc-compiled code.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__rawref(void)
{
    if (PyType_Ready(&RawRefType) < 0) {
        return NULL;
    }
    attr_name = PyUnicode_InternFromString("_rawref");
    if (attr_name == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&rawref_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&RawRefType);
    if (PyModule_AddObject(m, "ref", (PyObject *)&RawRefType) < 0) {
        Py_DECREF(&RawRefType);
        Py_DECREF(m);
        return NULL;
    }
    RawRef *null_ref = rawref_alloc(NULL);
    if (null_ref == NULL || PyModule_AddObject(m, "NULL", (PyObject *)null_ref) < 0) {
        Py_XDECREF(null_ref);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
