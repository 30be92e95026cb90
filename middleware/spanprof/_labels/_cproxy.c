/* spanprof._labels._cproxy: the label engine's hot paths, in C.
 *
 * On loops whose handles are compiled (uvloop) the engine cannot hook Handle._run, so its task
 * factory wraps each task's coroutine in a proxy that syncs the thread's profiler labels before
 * every step. A step costs ~0.45 us on uvloop and the Python proxy alone added about as much.
 * LabelledCoroutine does the same work without running bytecode: read the task's labels from
 * the ContextVar, compare them by identity with what the thread last pushed (the engine's
 * per-thread state, the one source of truth), call the engine's apply(labels) only when they
 * differ, then hand the step to the wrapped coroutine.
 *
 * ThreadLabels is that per-thread state: the "labels last pushed" of each OS thread, kept in
 * the thread state's dict. Reading it is a dict lookup, where a threading.local subclass
 * attribute costs ~60 ns (as much as the rest of a proxied step), and it belongs to the OS
 * thread even when gevent has patched threading.local to be greenlet-local.
 *
 * On CPython 3.14+ the module also has a context watcher (watch_contexts): a PyContext_AddWatcher
 * callback that does the same sync after every context switch, with no hook at all; the engine
 * uses it when installed with mechanism="watcher" (see the section below for its rules).
 *
 * The extension is optional: spanprof._labels._engine falls back to its Python proxy when this module
 * is missing (no compiler at install time) or cannot load (an isolated subinterpreter).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>  /* T_OBJECT_EX */
#include <stddef.h>  /* offsetof */

#if PY_VERSION_HEX < 0x030A0000
#error "spanprof._labels._cproxy needs CPython 3.10+ (am_send, PyIter_Send)"
#endif

/* Interned once per process. Single-phase init: 3.12+ refuses to load the module in an
 * isolated subinterpreter, where the engine then uses the Python proxy. */
static PyObject *str_tls;      /* "_tls": the engine's per-thread state */
static PyObject *str_labels;   /* "labels": what that thread last pushed */
static PyObject *str_throw;
static PyObject *str_close;
static PyObject *str_value;    /* "value": StopIteration's return value */
static PyObject *str_slot;     /* the key of ThreadLabels' entry in each thread state's dict */
/* set_quiet()'s marker: a thread whose state holds it is never pushed to (its profiler reads
 * that thread's labels from the running context itself). NULL until set. */
static PyObject *quiet;

typedef struct {
    PyObject_HEAD
    PyObject *coro;        /* the task's coroutine */
    PyObject *var;         /* the labels ContextVar */
    PyObject *ns;          /* a dict whose "_tls" item is the per-thread state, read each step:
                            * the engine replaces that object on install, uninstall and fork */
    PyObject *apply;       /* apply(labels): pushes a label change for the calling thread */
    PyObject *weakreflist;
} ProxyObject;

static PyTypeObject Proxy_Type;

/* --- ThreadLabels ------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *default_labels;
} SlotObject;

static PyTypeObject Slot_Type;

/* The calling thread's labels (borrowed), or NULL with an exception set.
 *
 * Each thread state's dict holds one entry, (owner, labels): only the ThreadLabels object that
 * wrote it can read it back. A new ThreadLabels therefore starts every thread at its default
 * (the engine makes a new one to forget what all threads were told: on install, uninstall and
 * in a forked child), and a thread holds at most one entry however often that happens. The
 * entry's strong reference to its owner rules out a new object reusing a dead one's address. */
static PyObject *
slot_read(SlotObject *self)
{
    PyObject *tdict = PyThreadState_GetDict();
    PyObject *entry;

    if (tdict == NULL) {
        return self->default_labels;
    }
    entry = PyDict_GetItemWithError(tdict, str_slot);
    if (entry == NULL) {
        return PyErr_Occurred() ? NULL : self->default_labels;
    }
    if (PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 2 &&
        PyTuple_GET_ITEM(entry, 0) == (PyObject *)self) {
        return PyTuple_GET_ITEM(entry, 1);
    }
    return self->default_labels;
}

static PyObject *
slot_get_labels(SlotObject *self, void *Py_UNUSED(closure))
{
    return Py_XNewRef(slot_read(self));
}

static int
slot_set_labels(SlotObject *self, PyObject *value, void *Py_UNUSED(closure))
{
    PyObject *tdict = PyThreadState_GetDict();
    PyObject *entry;
    int status;

    if (tdict == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ThreadLabels: no thread state dict");
        return -1;
    }
    if (value == NULL) {  /* del: back to the default, as for a threading.local attribute */
        entry = PyDict_GetItemWithError(tdict, str_slot);
        if (entry == NULL) {
            return PyErr_Occurred() ? -1 : 0;
        }
        if (PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 2 &&
            PyTuple_GET_ITEM(entry, 0) == (PyObject *)self) {
            return PyDict_DelItem(tdict, str_slot);
        }
        return 0;
    }
    entry = PyTuple_Pack(2, (PyObject *)self, value);
    if (entry == NULL) {
        return -1;
    }
    status = PyDict_SetItem(tdict, str_slot, entry);
    Py_DECREF(entry);
    return status;
}

static PyObject *
slot_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"default", NULL};
    PyObject *default_labels;
    SlotObject *self;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:ThreadLabels", kwlist, &default_labels)) {
        return NULL;
    }
    self = (SlotObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->default_labels = Py_NewRef(default_labels);
    return (PyObject *)self;
}

static void
slot_dealloc(SlotObject *self)
{
    Py_CLEAR(self->default_labels);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyGetSetDef slot_getset[] = {
    {"labels", (getter)slot_get_labels, (setter)slot_set_labels,
     PyDoc_STR("The labels the calling thread last pushed (default until it sets them)."), NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(slot_doc,
"ThreadLabels(default)\n"
"--\n"
"\n"
"What each OS thread last pushed to the profiler: ``labels`` reads and writes the calling\n"
"thread's value, ``default`` until that thread sets it. A thread keeps one value, for the\n"
"instance that set it last: a new ThreadLabels reads as ``default`` on every thread, so use\n"
"one at a time (the engine makes a new one to forget what all threads were told).");

static PyTypeObject Slot_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spanprof._labels._cproxy.ThreadLabels",
    .tp_basicsize = sizeof(SlotObject),
    .tp_dealloc = (destructor)slot_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = slot_doc,
    .tp_getset = slot_getset,
    .tp_new = slot_new,
};

/* --- LabelledCoroutine -------------------------------------------------------------------- */

/* 0 when the calling thread already runs with `labels`, 1 when it does not, -1 on error.
 * `ns["_tls"]` is the engine's per-thread state: read directly when it is a ThreadLabels, else
 * any object with a labels attribute (the engine's threading.local without this module's
 * ThreadLabels). That one is borrowed from the dict, and a threading.local's first access on a
 * thread runs its __init__: hold it across the lookup. */
static int
labels_changed(PyObject *ns, PyObject *labels)
{
    PyObject *state, *last;
    int changed;

    state = PyDict_GetItemWithError(ns, str_tls);
    if (state == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetObject(PyExc_KeyError, str_tls);
        }
        return -1;
    }
    if (Py_IS_TYPE(state, &Slot_Type)) {
        last = slot_read((SlotObject *)state);
        return last == NULL ? -1 : last != labels && last != quiet;
    }
    Py_INCREF(state);
    last = PyObject_GetAttr(state, str_labels);
    Py_DECREF(state);
    if (last == NULL) {
        return -1;
    }
    changed = last != labels && last != quiet;
    Py_DECREF(last);
    return changed;
}

/* Calls apply(labels) unless the calling thread already runs with them: 0, or -1 on error. */
static int
push_if_changed(PyObject *ns, PyObject *apply, PyObject *labels)
{
    PyObject *res;
    int changed = labels_changed(ns, labels);

    if (changed <= 0) {
        return changed;
    }
    res = PyObject_CallOneArg(apply, labels);
    if (res == NULL) {
        return -1;
    }
    Py_DECREF(res);
    return 0;
}

/* Runs before every step: the caller is inside the task's context, so the ContextVar holds the
 * task's labels. Same logic as the Python proxy, so both agree with apply() on what counts as
 * a change (identity here; apply() itself skips equal sets). */
static int
sync_labels(ProxyObject *self)
{
    PyObject *labels;
    int status;

    if (PyContextVar_Get(self->var, NULL, &labels) < 0) {
        return -1;
    }
    if (labels == NULL) {  /* a ContextVar without a default that was never set */
        PyErr_SetObject(PyExc_LookupError, self->var);
        return -1;
    }
    status = push_if_changed(self->ns, self->apply, labels);
    Py_DECREF(labels);
    return status;
}

static int
check_live(ProxyObject *self)
{
    if (self->coro == NULL) {
        /* Only after the garbage collector cleared a cycle the proxy was part of. */
        PyErr_SetString(PyExc_RuntimeError, "labelled coroutine proxy was cleared");
        return -1;
    }
    return 0;
}

/* StopIteration carrying `value`, built the way generators do it: a tuple or an exception as
 * the value must not be unpacked into the exception's args. */
static void
set_stop_iteration(PyObject *value)
{
    PyObject *exc;

    if (value == Py_None) {
        PyErr_SetNone(PyExc_StopIteration);
        return;
    }
    exc = PyObject_CallOneArg(PyExc_StopIteration, value);
    if (exc == NULL) {
        return;
    }
    PyErr_SetObject(PyExc_StopIteration, exc);
    Py_DECREF(exc);
}

/* --- a failed label sync never drops a step ----------------------------------------------
 *
 * The sync before a step can raise: apply() reports the backend's Exceptions itself, but a
 * KeyboardInterrupt or SystemExit (a signal landing in apply's Python code, a backend that
 * exits) gets through, as does any error of the lookups here. Skipping the step then would
 * leave its task waiting forever for a step that never ran. So the step always runs, and the
 * sync's exception is raised as if it had come right after the step. */

/* The raised exception, normalized, its traceback on it (a new reference); NULL when none. */
static PyObject *
take_exception(void)
{
    PyObject *type, *value, *tb;

    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL) {
        return NULL;
    }
    PyErr_NormalizeException(&type, &value, &tb);
    Py_DECREF(type);
    if (value == NULL) {  /* normalization always makes an instance; never true in practice */
        Py_XDECREF(tb);
        return NULL;
    }
    if (tb != NULL) {
        PyException_SetTraceback(value, tb);
        Py_DECREF(tb);
    }
    return value;
}

/* Raises `exc` (stolen) as it is: no implicit chaining to whatever is being handled. */
static void
raise_exception(PyObject *exc)
{
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
}

static int
is_exit(PyObject *exc)
{
    return PyObject_TypeCheck(exc, (PyTypeObject *)PyExc_SystemExit) ||
           PyObject_TypeCheck(exc, (PyTypeObject *)PyExc_KeyboardInterrupt);
}

/* Of the step's exception and the sync's (both stolen; the sync's counts as raised after the
 * step), the one that propagates, the other as its __context__: the sync's, unless only the
 * step's is a SystemExit or KeyboardInterrupt, which is never swallowed. */
static PyObject *
prevailing(PyObject *step, PyObject *sync)
{
    PyObject *winner = sync, *loser = step;

    if (is_exit(step) && !is_exit(sync)) {
        winner = step;
        loser = sync;
    }
    if (loser == winner) {
        Py_DECREF(loser);
    }
    else {
        PyException_SetContext(winner, loser);  /* steals loser */
    }
    return winner;
}

/* The step ran although the sync raised `failure` (stolen); `res` is its outcome, the Python
 * way (a value, or NULL with an exception, StopIteration when it returned). As if `failure`
 * had been raised right after the step: a coroutine now waiting at an await gets it thrown in
 * there (as a signal arriving then would; the value it yielded is dropped), one that returned
 * loses its return value to it, and one that raised keeps the exception that prevails. */
static PyObject *
raise_after_step(ProxyObject *self, PyObject *res, PyObject *failure)
{
    if (res != NULL) {
        Py_DECREF(res);
        res = PyObject_CallMethodOneArg(self->coro, str_throw, failure);
        Py_DECREF(failure);
        return res;
    }
    if (PyErr_ExceptionMatches(PyExc_StopIteration)) {
        PyErr_Clear();
    }
    else {
        PyObject *raised = take_exception();
        if (raised != NULL) {
            failure = prevailing(raised, failure);
        }
    }
    raise_exception(failure);
    return NULL;
}

/* A Python-convention step result as am_send reports it: StopIteration becomes a return. */
static PySendResult
send_result(PyObject *res, PyObject **result)
{
    PyObject *stop;

    if (res != NULL) {
        *result = res;
        return PYGEN_NEXT;
    }
    *result = NULL;
    if (!PyErr_ExceptionMatches(PyExc_StopIteration)) {
        return PYGEN_ERROR;
    }
    stop = take_exception();
    if (stop == NULL) {
        return PYGEN_ERROR;
    }
    *result = PyObject_GetAttr(stop, str_value);
    Py_DECREF(stop);
    return *result == NULL ? PYGEN_ERROR : PYGEN_RETURN;
}

/* PyIter_Send's outcome the Python way (see raise_after_step). */
static PyObject *
python_result(PySendResult status, PyObject *result)
{
    if (status != PYGEN_RETURN) {
        return result;  /* the value yielded, or NULL with the exception set */
    }
    set_stop_iteration(result);
    Py_DECREF(result);
    return NULL;
}

/* The hot path: asyncio's C Task steps its coroutine with PyIter_Send, which lands here. */
static PySendResult
proxy_am_send(ProxyObject *self, PyObject *arg, PyObject **result)
{
    PyObject *failure, *res;
    PySendResult status;

    if (check_live(self) < 0) {
        *result = NULL;
        return PYGEN_ERROR;
    }
    if (arg == NULL) {
        arg = Py_None;
    }
    if (sync_labels(self) == 0) {
        return PyIter_Send(self->coro, arg, result);
    }
    failure = take_exception();
    status = PyIter_Send(self->coro, arg, &res);
    if (failure == NULL) {  /* never: a failed sync leaves an exception */
        *result = res;
        return status;
    }
    return send_result(raise_after_step(self, python_result(status, res), failure), result);
}

static PyObject *
proxy_iternext(ProxyObject *self)
{
    PyObject *result;
    PySendResult status = proxy_am_send(self, Py_None, &result);

    if (status == PYGEN_NEXT) {
        return result;
    }
    if (status == PYGEN_RETURN) {
        /* NULL without an exception means "exhausted, value None" to next() and __next__. */
        if (result != Py_None) {
            set_stop_iteration(result);
        }
        Py_DECREF(result);
    }
    return NULL;
}

static PyObject *
proxy_send(ProxyObject *self, PyObject *arg)
{
    PyObject *result;
    PySendResult status = proxy_am_send(self, arg, &result);

    if (status == PYGEN_NEXT) {
        return result;
    }
    if (status == PYGEN_RETURN) {
        set_stop_iteration(result);
        Py_DECREF(result);
    }
    return NULL;
}

/* throw(exc) or the deprecated throw(type[, value[, tb]]): forwarded as given, so the wrapped
 * coroutine validates the arguments and warns exactly as it would unwrapped. */
static PyObject *
proxy_throw(ProxyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *meth, *result, *failure = NULL;

    if (check_live(self) < 0) {
        return NULL;
    }
    if (sync_labels(self) < 0) {
        failure = take_exception();
    }
    meth = PyObject_GetAttr(self->coro, str_throw);
    if (meth == NULL) {
        result = NULL;
    }
    else {
        result = PyObject_Vectorcall(meth, args, (size_t)nargs, NULL);
        Py_DECREF(meth);
    }
    return failure == NULL ? result : raise_after_step(self, result, failure);
}

static PyObject *
proxy_close(ProxyObject *self, PyObject *Py_UNUSED(ignored))
{
    if (check_live(self) < 0) {
        return NULL;
    }
    return PyObject_CallMethodNoArgs(self->coro, str_close);
}

/* __await__ and __iter__: the proxy is its own iterator, like the Python proxy. */
static PyObject *
proxy_self(PyObject *self)
{
    return Py_NewRef(self);
}

/* cr_frame, cr_running, cr_await, cr_code, cr_suspended, __name__, __qualname__, ...:
 * inspect.getcoroutinestate, anyio and asyncio's Task repr read them from the task's
 * coroutine. Like a Python __getattr__: only what the proxy itself lacks is forwarded. */
static PyObject *
proxy_getattro(ProxyObject *self, PyObject *name)
{
    PyObject *result = PyObject_GenericGetAttr((PyObject *)self, name);

    if (result != NULL || self->coro == NULL || !PyErr_ExceptionMatches(PyExc_AttributeError)) {
        return result;
    }
    PyErr_Clear();
    return PyObject_GetAttr(self->coro, name);
}

static PyObject *
proxy_repr(ProxyObject *self)
{
    if (self->coro == NULL) {
        return PyUnicode_FromFormat("<%s (cleared)>", Py_TYPE(self)->tp_name);
    }
    return PyObject_Repr(self->coro);
}

static int
proxy_traverse(ProxyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->coro);
    Py_VISIT(self->var);
    Py_VISIT(self->ns);
    Py_VISIT(self->apply);
    return 0;
}

static int
proxy_clear(ProxyObject *self)
{
    Py_CLEAR(self->coro);
    Py_CLEAR(self->var);
    Py_CLEAR(self->ns);
    Py_CLEAR(self->apply);
    return 0;
}

static void
proxy_dealloc(ProxyObject *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    /* Dropping the coroutine may finalize it (close() runs its finally blocks). */
    proxy_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
proxy_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"coro", "labels_var", "namespace", "apply", NULL};
    PyObject *coro, *var, *ns, *apply;
    ProxyObject *self;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!O!O:LabelledCoroutine", kwlist, &coro,
                                     &PyContextVar_Type, &var, &PyDict_Type, &ns, &apply)) {
        return NULL;
    }
    if (!PyCallable_Check(apply)) {
        PyErr_SetString(PyExc_TypeError, "LabelledCoroutine: apply must be callable");
        return NULL;
    }
    self = (ProxyObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->coro = Py_NewRef(coro);
    self->var = Py_NewRef(var);
    self->ns = Py_NewRef(ns);
    self->apply = Py_NewRef(apply);
    self->weakreflist = NULL;
    return (PyObject *)self;
}

static PyMethodDef proxy_methods[] = {
    {"send", (PyCFunction)proxy_send, METH_O,
     PyDoc_STR("send(value): sync labels, then step the coroutine with value.")},
    {"throw", (PyCFunction)(void (*)(void))proxy_throw, METH_FASTCALL,
     PyDoc_STR("throw(exc) or throw(type[, value[, tb]]): sync labels, then raise it inside.")},
    {"close", (PyCFunction)proxy_close, METH_NOARGS,
     PyDoc_STR("close(): close the wrapped coroutine.")},
    {NULL, NULL, 0, NULL},
};

static PyAsyncMethods proxy_as_async = {
    .am_await = (unaryfunc)proxy_self,
    .am_send = (sendfunc)proxy_am_send,
};

PyDoc_STRVAR(proxy_doc,
"LabelledCoroutine(coro, labels_var, namespace, apply)\n"
"--\n"
"\n"
"A coroutine proxy that syncs the thread's profiler labels before each step of coro.\n"
"\n"
"Before every send/__next__/throw it reads labels_var in the current context and compares\n"
"the value by identity with namespace['_tls'].labels (what the calling thread last pushed,\n"
"read directly when namespace['_tls'] is a ThreadLabels); on a mismatch it calls apply(labels).\n"
"A sync that raises never skips the step: the step runs, then the sync's exception is thrown\n"
"into the coroutine where it now waits (or replaces its return value or exception).\n"
"Everything else is the wrapped coroutine's.");

static PyTypeObject Proxy_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spanprof._labels._cproxy.LabelledCoroutine",
    .tp_basicsize = sizeof(ProxyObject),
    .tp_dealloc = (destructor)proxy_dealloc,
    .tp_as_async = &proxy_as_async,
    .tp_repr = (reprfunc)proxy_repr,
    .tp_getattro = (getattrofunc)proxy_getattro,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = proxy_doc,
    .tp_traverse = (traverseproc)proxy_traverse,
    .tp_clear = (inquiry)proxy_clear,
    .tp_weaklistoffset = offsetof(ProxyObject, weakreflist),
    .tp_iter = proxy_self,
    .tp_iternext = (iternextfunc)proxy_iternext,
    .tp_methods = proxy_methods,
    .tp_new = proxy_new,
};

/* --- HandleRunHook -------------------------------------------------------------------------- */

/* asyncio.Handle._run, hooked: every task step and callback of a pure-Python loop runs through
 * it, inside the handle's context. Wrapping the Python _run in anything costs ~1,100
 * instructions a step (~200 ns): the wrapper's frame, and above all a second entry into the
 * interpreter for the original. So when the original is asyncio's own (checked by the engine),
 * the hook *is* _run: it enters the handle's context, syncs the labels, calls the callback and
 * leaves, as Context.run does; a failing callback goes to report(handle, exc), the original's
 * except block, run with the exception being handled exactly as there. Any other _run (already
 * patched by someone else) is called after the sync instead. */
typedef struct {
    PyObject_HEAD
    PyObject *orig;         /* the original Handle._run */
    PyObject *var;          /* the labels ContextVar */
    PyObject *empty;        /* its value in a context that never set it */
    PyObject *ns;           /* the engine's namespace: "_tls" is read each call, as above */
    PyObject *apply;        /* apply(labels) */
    PyObject *handle_type;  /* asyncio.Handle: its slots' offsets below are valid for it */
    PyObject *report;       /* report(handle, exc), or NULL: call orig instead */
    Py_ssize_t off_context, off_callback, off_args;
    vectorcallfunc vectorcall;
} HookObject;

static PyTypeObject Hook_Type;
static PyObject *context_get;  /* contextvars.Context.get, an unbound method descriptor */
static PyObject *str_context;  /* "_context" */

/* A handle's slot, borrowed (NULL when unset). Only for instances of hook->handle_type. */
#define HANDLE_SLOT(handle, offset) (*(PyObject **)((char *)(handle) + (offset)))

/* The offset of handle_type's __slots__ member `name`, or -1 with an exception set. */
static Py_ssize_t
slot_offset(PyObject *handle_type, const char *name)
{
    PyObject *descr = PyObject_GetAttrString(handle_type, name);
    Py_ssize_t offset = -1;

    if (descr == NULL) {
        return -1;
    }
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type == T_OBJECT_EX || member->type == T_OBJECT) {
            offset = member->offset;
        }
    }
    Py_DECREF(descr);
    if (offset < 0) {
        PyErr_Format(PyExc_TypeError, "HandleRunHook: %s is not an object slot", name);
    }
    return offset;
}

/* The generic hook: sync the labels of handle._context, then call the original _run. */
/* Syncs the labels of handle._context: 0, or -1 with an exception set. */
static int
hook_sync_handle(HookObject *self, PyObject *handle)
{
    PyObject *context, *labels;
    PyObject *get_args[3];
    int status;

    context = PyObject_GetAttr(handle, str_context);
    if (context == NULL) {
        return -1;
    }
    get_args[0] = context;
    get_args[1] = self->var;
    get_args[2] = self->empty;
    labels = PyObject_Vectorcall(context_get, get_args, 3, NULL);
    Py_DECREF(context);
    if (labels == NULL) {
        return -1;
    }
    status = push_if_changed(self->ns, self->apply, labels);
    Py_DECREF(labels);
    return status;
}

/* The generic hook: sync the labels of handle._context, then call the original _run. A failed
 * sync still runs it; its exception then propagates out of _run, as if raised right after the
 * original returned (if the original raised too, the one that prevails propagates). */
static PyObject *
hook_call_original(HookObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *failure, *result, *raised;

    if (hook_sync_handle(self, args[0]) == 0) {
        return PyObject_Vectorcall(self->orig, args, nargsf, kwnames);
    }
    failure = take_exception();
    result = PyObject_Vectorcall(self->orig, args, nargsf, kwnames);
    if (failure == NULL) {  /* never: a failed sync leaves an exception */
        return result;
    }
    if (result != NULL) {
        Py_DECREF(result);
    }
    else if ((raised = take_exception()) != NULL) {
        failure = prevailing(raised, failure);
    }
    raise_exception(failure);
    return NULL;
}

/* The except block of asyncio's _run: SystemExit and KeyboardInterrupt propagate, anything
 * else goes to report(handle, exc) while it is the exception being handled (sys.exc_info()). */
static PyObject *
hook_report(HookObject *self, PyObject *handle)
{
    PyObject *type, *exc, *tb, *saved_type, *saved_value, *saved_tb, *res;

    if (PyErr_ExceptionMatches(PyExc_SystemExit) ||
        PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) {
        return NULL;
    }
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (tb != NULL) {
        PyException_SetTraceback(exc, tb);
    }
    PyErr_GetExcInfo(&saved_type, &saved_value, &saved_tb);
    PyErr_SetExcInfo(type, Py_NewRef(exc), tb);  /* steals type, the new exc ref and tb */
    res = PyObject_CallFunctionObjArgs(self->report, handle, exc, NULL);
    PyErr_SetExcInfo(saved_type, saved_value, saved_tb);
    Py_DECREF(exc);
    return res;
}

static PyObject *
hook_vectorcall(HookObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *handle, *context, *callback, *cargs, *labels, *result, *raised, *reported;
    PyObject *failure = NULL;
    int status;

    if (nargs != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "Handle._run hook: expected the handle, alone");
        return NULL;
    }
    handle = args[0];
    if (self->report == NULL || !PyObject_TypeCheck(handle, (PyTypeObject *)self->handle_type)) {
        return hook_call_original(self, args, nargsf, kwnames);
    }
    context = HANDLE_SLOT(handle, self->off_context);
    callback = HANDLE_SLOT(handle, self->off_callback);
    cargs = HANDLE_SLOT(handle, self->off_args);
    if (context == NULL || callback == NULL || cargs == NULL || !PyContext_CheckExact(context) ||
        !PyTuple_CheckExact(cargs)) {
        /* Not a state asyncio's own code leaves behind: let the original deal with it. */
        return hook_call_original(self, args, nargsf, kwnames);
    }
    /* The callback may cancel its own handle, which drops these slots. */
    Py_INCREF(context);
    Py_INCREF(callback);
    Py_INCREF(cargs);
    if (PyContext_Enter(context) < 0) {  /* e.g. "already entered": the original reports it */
        result = NULL;
    }
    else {
        if (PyContextVar_Get(self->var, self->empty, &labels) < 0) {
            status = -1;
        }
        else {
            status = push_if_changed(self->ns, self->apply, labels);
            Py_DECREF(labels);
        }
        /* A failed sync never drops the step: the callback runs, then the failure goes the
         * way a failing callback's exception goes (below). */
        failure = status < 0 ? take_exception() : NULL;
        result = PyObject_Vectorcall(callback, &PyTuple_GET_ITEM(cargs, 0),
                                     (size_t)PyTuple_GET_SIZE(cargs), NULL);
        if (PyContext_Exit(context) < 0) {
            Py_CLEAR(result);
        }
    }
    Py_DECREF(context);
    Py_DECREF(callback);
    Py_DECREF(cargs);
    if (result != NULL) {
        Py_DECREF(result);
    }
    else {
        reported = hook_report(self, handle);
        if (reported == NULL) {
            /* The callback's SystemExit or KeyboardInterrupt leaves the loop (or report itself
             * failed): with a failed sync too, the exception that prevails propagates. */
            if (failure != NULL) {
                raised = take_exception();
                if (raised != NULL) {
                    raise_exception(prevailing(raised, failure));
                }
                else {
                    Py_DECREF(failure);
                }
            }
            return NULL;
        }
        Py_DECREF(reported);
    }
    if (failure == NULL) {
        Py_RETURN_NONE;
    }
    /* As if the callback had raised it: SystemExit and KeyboardInterrupt leave the loop,
     * anything else goes to the loop's exception handler. */
    raise_exception(failure);
    return hook_report(self, handle);
}

/* Looked up on an instance: bind it, like a function. Py_TPFLAGS_METHOD_DESCRIPTOR lets the
 * interpreter skip this for handle._run() and call the hook with the handle first. */
static PyObject *
hook_descr_get(PyObject *self, PyObject *obj, PyObject *Py_UNUSED(type))
{
    if (obj == NULL || obj == Py_None) {
        return Py_NewRef(self);
    }
    return PyMethod_New(self, obj);
}

static PyObject *
hook_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"run",          "labels_var", "empty",  "namespace",
                             "apply",        "handle_type", "report", NULL};
    PyObject *orig, *var, *empty, *ns, *apply, *handle_type, *report = Py_None;
    Py_ssize_t off_context = 0, off_callback = 0, off_args = 0;
    HookObject *self;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!OO!OO!|O:HandleRunHook", kwlist, &orig,
                                     &PyContextVar_Type, &var, &empty, &PyDict_Type, &ns,
                                     &apply, &PyType_Type, &handle_type, &report)) {
        return NULL;
    }
    if (!PyCallable_Check(orig) || !PyCallable_Check(apply) ||
        (report != Py_None && !PyCallable_Check(report))) {
        PyErr_SetString(PyExc_TypeError,
                        "HandleRunHook: run, apply and report (unless None) must be callable");
        return NULL;
    }
    if (report != Py_None) {
        if ((off_context = slot_offset(handle_type, "_context")) < 0 ||
            (off_callback = slot_offset(handle_type, "_callback")) < 0 ||
            (off_args = slot_offset(handle_type, "_args")) < 0) {
            return NULL;
        }
    }
    self = (HookObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->orig = Py_NewRef(orig);
    self->var = Py_NewRef(var);
    self->empty = Py_NewRef(empty);
    self->ns = Py_NewRef(ns);
    self->apply = Py_NewRef(apply);
    self->handle_type = Py_NewRef(handle_type);
    self->report = report == Py_None ? NULL : Py_NewRef(report);
    self->off_context = off_context;
    self->off_callback = off_callback;
    self->off_args = off_args;
    self->vectorcall = (vectorcallfunc)hook_vectorcall;
    return (PyObject *)self;
}

static int
hook_traverse(HookObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->orig);
    Py_VISIT(self->var);
    Py_VISIT(self->empty);
    Py_VISIT(self->ns);
    Py_VISIT(self->apply);
    Py_VISIT(self->handle_type);
    Py_VISIT(self->report);
    return 0;
}

static int
hook_clear(HookObject *self)
{
    Py_CLEAR(self->orig);
    Py_CLEAR(self->var);
    Py_CLEAR(self->empty);
    Py_CLEAR(self->ns);
    Py_CLEAR(self->apply);
    Py_CLEAR(self->handle_type);
    Py_CLEAR(self->report);
    return 0;
}

static void
hook_dealloc(HookObject *self)
{
    PyObject_GC_UnTrack(self);
    hook_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
hook_get_wrapped(HookObject *self, void *Py_UNUSED(closure))
{
    if (self->orig == NULL) {
        Py_RETURN_NONE;
    }
    return Py_NewRef(self->orig);
}

static PyObject *
hook_get_replaces(HookObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->report != NULL);
}

/* What code that introspects Handle._run reads of a function (playwright takes its __code__
 * at import): the original's, so the class attribute still looks like the method it was. */
static PyObject *
hook_get_original_attribute(HookObject *self, void *closure)
{
    if (self->orig == NULL) {
        PyErr_SetString(PyExc_AttributeError, (const char *)closure);
        return NULL;
    }
    return PyObject_GetAttrString(self->orig, (const char *)closure);
}

static PyGetSetDef hook_getset[] = {
    {"__wrapped__", (getter)hook_get_wrapped, NULL, PyDoc_STR("The original Handle._run."),
     NULL},
    {"__code__", (getter)hook_get_original_attribute, NULL,
     PyDoc_STR("The original Handle._run's code."), "__code__"},
    {"__name__", (getter)hook_get_original_attribute, NULL,
     PyDoc_STR("The original Handle._run's name."), "__name__"},
    {"__qualname__", (getter)hook_get_original_attribute, NULL,
     PyDoc_STR("The original Handle._run's qualified name."), "__qualname__"},
    {"__module__", (getter)hook_get_original_attribute, NULL,
     PyDoc_STR("The original Handle._run's module."), "__module__"},
    {"replaces", (getter)hook_get_replaces, NULL,
     PyDoc_STR("True: runs handles itself; False: calls the original after the sync."), NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(hook_doc,
"HandleRunHook(run, labels_var, empty, namespace, apply, handle_type, report=None)\n"
"--\n"
"\n"
"A replacement for asyncio.Handle._run. With report=None, hook(handle) reads labels_var in\n"
"handle._context (empty when unset), compares it by identity with namespace['_tls'].labels,\n"
"calls apply(labels) on a mismatch, then returns run(handle). With report, for instances of\n"
"handle_type it does the work of asyncio's own _run instead: inside handle._context, sync the\n"
"labels the same way and call handle._callback(*handle._args); an exception other than\n"
"SystemExit and KeyboardInterrupt goes to report(handle, exc) while being handled.\n"
"A sync that raises never skips the callback: it runs, then the sync's exception goes the way\n"
"a failing callback's would (with report) or propagates (without).\n"
"Binds like a function.");

static PyTypeObject Hook_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "spanprof._labels._cproxy.HandleRunHook",
    .tp_basicsize = sizeof(HookObject),
    .tp_dealloc = (destructor)hook_dealloc,
    .tp_vectorcall_offset = offsetof(HookObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = hook_doc,
    .tp_traverse = (traverseproc)hook_traverse,
    .tp_clear = (inquiry)hook_clear,
    .tp_getset = hook_getset,
    .tp_descr_get = hook_descr_get,
    .tp_new = hook_new,
};

/* --- the context watcher (CPython 3.14+) ---------------------------------------------------
 *
 * From 3.14, PyContext_AddWatcher calls back after every context switch, on the switching
 * thread: each Context.run in and out, so each step of an asyncio, eager or uvloop task and
 * each thread-pool job run in a copied context. The switch is done when it is called (its
 * argument is the now-current context, or None), so PyContextVar_Get reads the labels of the
 * code about to run: a cached read or a HAMT lookup, no allocation, no Python. Only when they
 * differ from what the thread last pushed (push_if_changed, the same test as the proxy's and
 * the hook's) does it call the engine's apply(). On 3.14+ this can replace the Handle._run
 * hook, the proxy and the task factory: the engine picks one mechanism (see _engine.py).
 *
 * What the callback must respect:
 * - It can run with an exception pending: Context.run and the C Task leave the context after
 *   a step that raised. That exception is set aside before anything runs and restored after.
 * - Nothing may escape it: a watcher that returns -1 only gets an "Exception ignored" report,
 *   and the switch has happened anyway. apply() logs the backend's Exceptions itself; anything
 *   else it lets out is counted (watch_failures()) and the first such one reported as
 *   unraisable, except SystemExit and KeyboardInterrupt: their type is raised again in this
 *   thread, asynchronously (PyThreadState_SetAsyncExc), as if the signal had arrived right
 *   after the switch, rather than a Ctrl-C lost because it landed inside a push.
 * - apply() runs Python code, which can switch contexts itself (a backend calling Context.run,
 *   sys.unraisablehook): those nested switches belong to the push and are ignored, per OS
 *   thread (in_watcher). Another thread may uninstall while apply() has released the GIL: the
 *   callback holds references of its own.
 *
 * The watcher is per interpreter and this module's state per process (single-phase init):
 * it is installed in one interpreter at a time. */
#if PY_VERSION_HEX >= 0x030E0000
#define SPANPROF_CONTEXT_WATCHER 1

#if defined(_MSC_VER)
#define SPANPROF_THREAD_LOCAL __declspec(thread)
#else
#define SPANPROF_THREAD_LOCAL _Thread_local
#endif

static int watch_id = -1;                 /* PyContext_AddWatcher's id, -1 when not watching */
static PyInterpreterState *watch_interp;  /* where it was added */
static PyObject *watch_var;               /* the labels ContextVar */
static PyObject *watch_empty;             /* its value in a context that never set it */
static PyObject *watch_ns;                /* the engine's namespace: "_tls" is read each call */
static PyObject *watch_apply;             /* apply(labels) */
static Py_ssize_t watch_failure_count;    /* pushes that raised out of apply() */
static int watch_reported;                /* the first non-exit failure was reported */
static SPANPROF_THREAD_LOCAL int in_watcher;

/* A push raised (the exception is set): count it, and never let it out (see above). */
static void
watch_failed(void)
{
    PyObject *exc = PyErr_GetRaisedException();

    watch_failure_count++;
    if (exc == NULL) {
        return;
    }
    if (is_exit(exc)) {
        /* Returns how many thread states it set: this thread's, always found. */
        (void)PyThreadState_SetAsyncExc(PyThread_get_thread_ident(), (PyObject *)Py_TYPE(exc));
        Py_DECREF(exc);
        return;
    }
    if (watch_reported) {
        Py_DECREF(exc);
        return;
    }
    watch_reported = 1;
    PyErr_SetRaisedException(exc);
    PyErr_FormatUnraisable("Exception ignored in spanprof's context watcher while pushing "
                           "labels (later ones are only counted)");
}

static int
watch_context(PyContextEvent event, PyObject *Py_UNUSED(context))
{
    PyObject *pending, *ns, *apply, *labels;

    if (event != Py_CONTEXT_SWITCHED || in_watcher || watch_var == NULL) {
        return 0;
    }
    in_watcher = 1;
    pending = PyErr_GetRaisedException();
    ns = Py_NewRef(watch_ns);
    apply = Py_NewRef(watch_apply);
    if (PyContextVar_Get(watch_var, watch_empty, &labels) < 0) {
        watch_failed();
    }
    else {
        if (push_if_changed(ns, apply, labels) < 0) {
            watch_failed();
        }
        Py_DECREF(labels);
    }
    Py_DECREF(apply);
    Py_DECREF(ns);
    PyErr_SetRaisedException(pending);
    in_watcher = 0;
    return 0;
}

static PyObject *
cproxy_watch_contexts(PyObject *Py_UNUSED(module), PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"labels_var", "empty", "namespace", "apply", NULL};
    PyObject *var, *empty, *ns, *apply;
    PyInterpreterState *interp = PyInterpreterState_Get();

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OO!O:watch_contexts", kwlist,
                                     &PyContextVar_Type, &var, &empty, &PyDict_Type, &ns,
                                     &apply)) {
        return NULL;
    }
    if (!PyCallable_Check(apply)) {
        PyErr_SetString(PyExc_TypeError, "watch_contexts: apply must be callable");
        return NULL;
    }
    if (watch_id >= 0 && watch_interp != interp) {
        PyErr_SetString(PyExc_RuntimeError,
                        "watch_contexts: already watching in another interpreter");
        return NULL;
    }
    if (watch_id < 0) {
        int id = PyContext_AddWatcher(watch_context);

        if (id < 0) {  /* all 8 of the interpreter's watcher ids taken */
            return NULL;
        }
        watch_id = id;
        watch_interp = interp;
    }
    /* Watching again replaces what the callback uses. */
    Py_XSETREF(watch_var, Py_NewRef(var));
    Py_XSETREF(watch_empty, Py_NewRef(empty));
    Py_XSETREF(watch_ns, Py_NewRef(ns));
    Py_XSETREF(watch_apply, Py_NewRef(apply));
    watch_failure_count = 0;
    watch_reported = 0;
    Py_RETURN_NONE;
}

static PyObject *
cproxy_unwatch_contexts(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    PyObject *var = watch_var, *empty = watch_empty, *ns = watch_ns, *apply = watch_apply;

    if (watch_id < 0) {
        Py_RETURN_FALSE;
    }
    if (watch_interp != PyInterpreterState_Get()) {
        PyErr_SetString(PyExc_RuntimeError,
                        "unwatch_contexts: the watcher belongs to another interpreter");
        return NULL;
    }
    if (PyContext_ClearWatcher(watch_id) < 0) {
        return NULL;
    }
    watch_id = -1;
    watch_interp = NULL;
    /* Cleared before the references go: dropping them can run code that switches contexts. */
    watch_var = watch_empty = watch_ns = watch_apply = NULL;
    Py_DECREF(var);
    Py_DECREF(empty);
    Py_DECREF(ns);
    Py_DECREF(apply);
    Py_RETURN_TRUE;
}

static PyObject *
cproxy_watching_contexts(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    return PyBool_FromLong(watch_id >= 0);
}

static PyObject *
cproxy_watch_failures(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    return PyLong_FromSsize_t(watch_failure_count);
}

#endif  /* PY_VERSION_HEX >= 0x030E0000 */

static PyObject *
cproxy_set_quiet(PyObject *Py_UNUSED(module), PyObject *marker)
{
    Py_XSETREF(quiet, Py_NewRef(marker));
    Py_RETURN_NONE;
}

/* sys._current_frames() with the collector off for that call only (gh-106883: before 3.12 a
   collection started inside it can deadlock on the runtime's thread list lock). No bytecode
   runs between turning the collector off and back on, so no other thread can see or change
   its state meanwhile: a gc.disable() elsewhere is never undone. Used by the exact sampler. */
static PyObject *
cproxy_current_frames_gc_off(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    PyObject *current_frames = PySys_GetObject("_current_frames"); /* borrowed */
    PyObject *frames;
    int was_enabled;

    if (current_frames == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "sys._current_frames is missing");
        return NULL;
    }
    Py_INCREF(current_frames);
    was_enabled = PyGC_Disable();
    frames = PyObject_CallNoArgs(current_frames);
    if (was_enabled) {
        PyGC_Enable();
    }
    Py_DECREF(current_frames);
    return frames;
}

static PyMethodDef cproxy_methods[] = {
    {"set_quiet", cproxy_set_quiet, METH_O,
     "set_quiet(marker)\n--\n\n"
     "A thread whose per-thread state holds `marker` as its labels is never pushed to: the\n"
     "proxy and the hook treat it as already running with whatever labels the context has."},
    {"current_frames_gc_off", cproxy_current_frames_gc_off, METH_NOARGS,
     "current_frames_gc_off()\n--\n\n"
     "sys._current_frames() with the garbage collector off during the call, and back on only\n"
     "if it was on, with no bytecode run in between (gh-106883)."},
#ifdef SPANPROF_CONTEXT_WATCHER
    {"watch_contexts", (PyCFunction)(void (*)(void))cproxy_watch_contexts,
     METH_VARARGS | METH_KEYWORDS,
     "watch_contexts(labels_var, empty, namespace, apply)\n--\n\n"
     "After every context switch on any thread (PyContext_AddWatcher, CPython 3.14+), read\n"
     "labels_var in the now-current context (empty when unset), compare it by identity with\n"
     "namespace['_tls'].labels and call apply(labels) on a mismatch. Calling it again while\n"
     "watching replaces the arguments. Nothing raised by apply() escapes (watch_failures())."},
    {"unwatch_contexts", cproxy_unwatch_contexts, METH_NOARGS,
     "unwatch_contexts()\n--\n\n"
     "Remove the watcher (PyContext_ClearWatcher): True if one was installed."},
    {"watching_contexts", cproxy_watching_contexts, METH_NOARGS,
     "watching_contexts()\n--\n\nWhether the context watcher is installed."},
    {"watch_failures", cproxy_watch_failures, METH_NOARGS,
     "watch_failures()\n--\n\n"
     "How many pushes raised out of apply() since watch_contexts() (the first non-exit one\n"
     "was reported as unraisable; SystemExit and KeyboardInterrupt were raised again\n"
     "asynchronously in their thread)."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef cproxy_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "spanprof._labels._cproxy",
    .m_doc = "The label engine's coroutine proxy and per-thread state in C (optional).",
    .m_size = -1,
    .m_methods = cproxy_methods,
};

static int
intern(PyObject **slot, const char *text)
{
    if (*slot == NULL) {
        *slot = PyUnicode_InternFromString(text);
    }
    return *slot == NULL ? -1 : 0;
}

PyMODINIT_FUNC
PyInit__cproxy(void)
{
    PyObject *module;

    if (intern(&str_tls, "_tls") < 0 || intern(&str_labels, "labels") < 0 ||
        intern(&str_throw, "throw") < 0 || intern(&str_close, "close") < 0 ||
        intern(&str_value, "value") < 0 ||
        intern(&str_slot, "spanprof._labels._cproxy.ThreadLabels") < 0 ||
        intern(&str_context, "_context") < 0) {
        return NULL;
    }
    if (context_get == NULL) {
        context_get = PyObject_GetAttrString((PyObject *)&PyContext_Type, "get");
        if (context_get == NULL) {
            return NULL;
        }
    }
    if (PyType_Ready(&Proxy_Type) < 0 || PyType_Ready(&Slot_Type) < 0 ||
        PyType_Ready(&Hook_Type) < 0) {
        return NULL;
    }
    module = PyModule_Create(&cproxy_module);
    if (module == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(module, "LabelledCoroutine", (PyObject *)&Proxy_Type) < 0 ||
        PyModule_AddObjectRef(module, "ThreadLabels", (PyObject *)&Slot_Type) < 0 ||
        PyModule_AddObjectRef(module, "HandleRunHook", (PyObject *)&Hook_Type) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
