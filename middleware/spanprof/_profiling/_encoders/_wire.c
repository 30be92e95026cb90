/* spanprof._profiling._encoders._wire: the protobuf writers of _protowire, in C.
 *
 * The pprof and push encoders spend most of their time in five small writers that append a
 * varint or a field to a bytearray: a memory window of span-labelled samples calls them about
 * 25 times a sample, and as Python functions each call cost more than the bytes it wrote
 * (measured by callgrind on a server's real windows: about 70,000 instructions a sample before).
 * These are the same writers with the same output, byte for byte (tests/test_protowire.py runs
 * both); _protowire uses them when this module loads and its own Python versions otherwise.
 *
 * Every writer takes a bytearray and appends in place: one PyByteArray_Resize (which grows the
 * allocation geometrically, as `+=` does) and one memcpy. Nothing here keeps state or releases
 * the GIL, so the module is safe in every interpreter.
 *
 * One more function writes a pprof sample's label fields whole (pprof_label_fields): a span's
 * labels are new strings, and in Python interning them and writing their fields cost about
 * 10,000 instructions a pair. It works on the caller's dicts and list, whose lookups hash the
 * label strings (a str subclass's __hash__ or __eq__ would run Python code there).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define WIRE_VARINT 0
#define WIRE_LEN 2
/* A field key is (field << 3) | wire type; protobuf's largest field number is 2**29 - 1. */
#define MAX_FIELD ((1ULL << 29) - 1)
/* A 64-bit varint takes at most 10 bytes. */
#define MAX_VARINT 10
/* Packed values encoded on the stack below this many; above, in a heap buffer. */
#define STACK_VALUES 64

static Py_ssize_t
encode_varint(uint64_t value, unsigned char *out)
{
    Py_ssize_t n = 0;
    while (value > 0x7F) {
        out[n++] = (unsigned char)((value & 0x7F) | 0x80);
        value >>= 7;
    }
    out[n++] = (unsigned char)value;
    return n;
}

/* `obj` as a varint's 64 bits, as the Python writers take it: negative values as 64-bit two's
 * complement (masked), values of 2**64 and more refused (OverflowError). `*zero` says whether
 * the int itself is 0 (a masked -2**64 is not). */
static int
as_uint64(PyObject *obj, uint64_t *out, int *zero)
{
    int overflow;
    long long value;
    unsigned long long big;

    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "expected an int, got %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow == 0) {
        *out = (uint64_t)value;
        *zero = value == 0;
        return 0;
    }
    /* Past 2**63 - 1 the int must fit in 64 bits; below -2**63 it is masked, as Python does. */
    big = overflow > 0 ? PyLong_AsUnsignedLongLong(obj) : PyLong_AsUnsignedLongLongMask(obj);
    if (big == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (uint64_t)big;
    *zero = 0;
    return 0;
}

static int
field_key(PyObject *obj, int wire, uint64_t *key)
{
    uint64_t field;
    int zero;

    if (as_uint64(obj, &field, &zero) < 0) {
        return -1;
    }
    if (field > MAX_FIELD) {
        PyErr_Format(PyExc_ValueError, "field number %llu is out of range",
                     (unsigned long long)field);
        return -1;
    }
    *key = (field << 3) | (uint64_t)wire;
    return 0;
}

static int
check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t expected)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s expected %zd arguments, got %zd", name, expected,
                     nargs);
        return -1;
    }
    return 0;
}

static int
check_buffer(PyObject *buf)
{
    if (!PyByteArray_Check(buf)) {
        PyErr_Format(PyExc_TypeError, "expected a bytearray to append to, got %.100s",
                     Py_TYPE(buf)->tp_name);
        return -1;
    }
    return 0;
}

/* Appends `head` then `data` to `buf` with one resize. */
static int
append2(PyObject *buf, const unsigned char *head, Py_ssize_t head_len, const char *data,
        Py_ssize_t data_len)
{
    Py_ssize_t size = PyByteArray_GET_SIZE(buf);
    char *at;

    if (data_len > PY_SSIZE_T_MAX - size - head_len) {
        PyErr_NoMemory();
        return -1;
    }
    if (PyByteArray_Resize(buf, size + head_len + data_len) < 0) {
        return -1;
    }
    at = PyByteArray_AS_STRING(buf) + size;
    if (head_len) {
        memcpy(at, head, (size_t)head_len);
    }
    if (data_len) {
        memcpy(at + head_len, data, (size_t)data_len);
    }
    return 0;
}

/* A length-delimited field: key, length, then `data`. */
static int
append_len_field(PyObject *buf, uint64_t key, const char *data, Py_ssize_t data_len)
{
    unsigned char head[2 * MAX_VARINT];
    Py_ssize_t n = encode_varint(key, head);
    n += encode_varint((uint64_t)data_len, head + n);
    return append2(buf, head, n, data, data_len);
}

PyDoc_STRVAR(put_varint_doc,
"put_varint(buf, value, /)\n--\n\n"
"Append ``value`` to ``buf`` as a varint (negative values as 10-byte two's complement).");

static PyObject *
put_varint(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    unsigned char out[MAX_VARINT];
    uint64_t value;
    int zero;

    if (check_nargs("put_varint", nargs, 2) < 0) {
        return NULL;
    }
    if (check_buffer(args[0]) < 0 || as_uint64(args[1], &value, &zero) < 0) {
        return NULL;
    }
    if (append2(args[0], out, encode_varint(value, out), NULL, 0) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(put_varint_field_doc,
"put_varint_field(buf, field, value, /)\n--\n\n"
"Append a varint field, omitting it when zero (proto3 default).");

static PyObject *
put_varint_field(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    unsigned char out[2 * MAX_VARINT];
    uint64_t key, value;
    int zero;
    Py_ssize_t n;

    if (check_nargs("put_varint_field", nargs, 3) < 0) {
        return NULL;
    }
    if (check_buffer(args[0]) < 0 || as_uint64(args[2], &value, &zero) < 0) {
        return NULL;
    }
    if (zero) {
        Py_RETURN_NONE;
    }
    if (field_key(args[1], WIRE_VARINT, &key) < 0) {
        return NULL;
    }
    n = encode_varint(key, out);
    n += encode_varint(value, out + n);
    if (append2(args[0], out, n, NULL, 0) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(put_bytes_field_doc,
"put_bytes_field(buf, field, data, /)\n--\n\n"
"Append a length-delimited field (always written, even when empty).");

static PyObject *
put_bytes_field(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *buf, *data, *copy = NULL;
    Py_buffer view;
    uint64_t key;
    int failed;

    if (check_nargs("put_bytes_field", nargs, 3) < 0) {
        return NULL;
    }
    buf = args[0];
    data = args[2];
    if (check_buffer(buf) < 0 || field_key(args[1], WIRE_LEN, &key) < 0) {
        return NULL;
    }
    if (data == buf) {
        /* A view of buf would forbid its resize: append a copy of what it holds. */
        copy = PyBytes_FromStringAndSize(PyByteArray_AS_STRING(buf), PyByteArray_GET_SIZE(buf));
        if (copy == NULL) {
            return NULL;
        }
        data = copy;
    }
    if (PyBytes_CheckExact(data)) {
        failed = append_len_field(buf, key, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data));
    }
    else {
        if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) {
            Py_XDECREF(copy);
            return NULL;
        }
        failed = append_len_field(buf, key, (const char *)view.buf, view.len);
        PyBuffer_Release(&view);
    }
    Py_XDECREF(copy);
    if (failed) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(put_string_field_doc,
"put_string_field(buf, field, value, /)\n--\n\n"
"Append a UTF-8 string field (always written, even when empty).");

static PyObject *
put_string_field(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    const char *data;
    Py_ssize_t size;
    uint64_t key;

    if (check_nargs("put_string_field", nargs, 3) < 0) {
        return NULL;
    }
    if (check_buffer(args[0]) < 0 || field_key(args[1], WIRE_LEN, &key) < 0) {
        return NULL;
    }
    if (!PyUnicode_Check(args[2])) {
        PyErr_Format(PyExc_TypeError, "expected a str, got %.100s", Py_TYPE(args[2])->tp_name);
        return NULL;
    }
    /* ASCII strings (names, hex ids) are read in place; others are encoded once and cached
     * by the str, as str.encode() would encode them each time. */
    data = PyUnicode_AsUTF8AndSize(args[2], &size);
    if (data == NULL) {
        return NULL;
    }
    if (append_len_field(args[0], key, data, size) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(put_packed_varints_field_doc,
"put_packed_varints_field(buf, field, values, /)\n--\n\n"
"Append a packed repeated varint field; omitted entirely when ``values`` is empty.");

static PyObject *
put_packed_varints_field(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    unsigned char stack[STACK_VALUES * MAX_VARINT];
    unsigned char *payload = stack;
    PyObject *seq, **items;
    Py_ssize_t count, i, len = 0;
    uint64_t key, value;
    int zero, failed = -1;

    if (check_nargs("put_packed_varints_field", nargs, 3) < 0) {
        return NULL;
    }
    if (check_buffer(args[0]) < 0 || field_key(args[1], WIRE_LEN, &key) < 0) {
        return NULL;
    }
    seq = PySequence_Fast(args[2], "expected an iterable of ints");
    if (seq == NULL) {
        return NULL;
    }
    count = PySequence_Fast_GET_SIZE(seq);
    if (count > STACK_VALUES) {
        if (count > PY_SSIZE_T_MAX / MAX_VARINT) {
            PyErr_NoMemory();
            goto done;
        }
        payload = PyMem_Malloc((size_t)count * MAX_VARINT);
        if (payload == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    items = PySequence_Fast_ITEMS(seq);
    for (i = 0; i < count; i++) {
        if (as_uint64(items[i], &value, &zero) < 0) {
            goto done;
        }
        len += encode_varint(value, payload + len);
    }
    failed = len ? append_len_field(args[0], key, (const char *)payload, len) : 0;
done:
    if (payload != stack) {
        PyMem_Free(payload);
    }
    Py_DECREF(seq);
    if (failed) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* --- pprof's Sample.label fields ---------------------------------------------------------- */

/* pprof field numbers: Sample.label, and Label's key and str (string table indices). */
#define PPROF_SAMPLE_LABEL 3
#define PPROF_LABEL_KEY 1
#define PPROF_LABEL_STR 2

/* `s`'s index in the string table `strings` (str -> int) and `table` (their list), added at the
 * end when new; -1 with an exception set. The two stay in step on failure. */
static Py_ssize_t
intern_string(PyObject *strings, PyObject *table, PyObject *s)
{
    PyObject *index = PyDict_GetItemWithError(strings, s);  /* borrowed */
    Py_ssize_t value;

    if (index != NULL) {
        return PyLong_AsSsize_t(index);
    }
    if (PyErr_Occurred()) {
        return -1;
    }
    value = PyList_GET_SIZE(table);
    if ((index = PyLong_FromSsize_t(value)) == NULL) {
        return -1;
    }
    if (PyDict_SetItem(strings, s, index) < 0) {
        Py_DECREF(index);
        return -1;
    }
    Py_DECREF(index);
    if (PyList_Append(table, s) < 0) {
#if PY_VERSION_HEX >= 0x030C0000
        PyObject *exc = PyErr_GetRaisedException();
#else
        PyObject *type, *exc, *tb;
        PyErr_Fetch(&type, &exc, &tb);
#endif
        if (PyDict_DelItem(strings, s) < 0) {
            PyErr_Clear();
        }
#if PY_VERSION_HEX >= 0x030C0000
        PyErr_SetRaisedException(exc);
#else
        PyErr_Restore(type, exc, tb);
#endif
        return -1;
    }
    return value;
}

/* The Sample.label field of one (key, value) pair, its strings interned: a new reference. */
static PyObject *
make_label_field(PyObject *pair, PyObject *strings, PyObject *table)
{
    unsigned char msg[4 * MAX_VARINT], out[6 * MAX_VARINT];
    Py_ssize_t key, value, n = 0, m;

    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        PyErr_Format(PyExc_TypeError, "expected a (key, value) pair, got %.100s",
                     Py_TYPE(pair)->tp_name);
        return NULL;
    }
    /* The key first, then the value: the order the Python writer interns them in. */
    if ((key = intern_string(strings, table, PyTuple_GET_ITEM(pair, 0))) < 0) {
        return NULL;
    }
    if ((value = intern_string(strings, table, PyTuple_GET_ITEM(pair, 1))) < 0) {
        return NULL;
    }
    /* Index 0 is the empty string: a zero varint field is left out (proto3 default). */
    if (key) {
        n += encode_varint((PPROF_LABEL_KEY << 3) | WIRE_VARINT, msg + n);
        n += encode_varint((uint64_t)key, msg + n);
    }
    if (value) {
        n += encode_varint((PPROF_LABEL_STR << 3) | WIRE_VARINT, msg + n);
        n += encode_varint((uint64_t)value, msg + n);
    }
    m = encode_varint((PPROF_SAMPLE_LABEL << 3) | WIRE_LEN, out);
    m += encode_varint((uint64_t)n, out + m);
    memcpy(out + m, msg, (size_t)n);
    return PyBytes_FromStringAndSize((const char *)out, m + n);
}

PyDoc_STRVAR(pprof_label_fields_doc,
"pprof_label_fields(labels, cache, strings, table, /) -> bytes\n--\n\n"
"The pprof Sample.label fields of ``labels`` ((key, value) string pairs), in order. Each\n"
"pair's field comes from ``cache`` (pair -> bytes) or is made, its key then its value\n"
"interned in ``strings`` (str -> index) and ``table`` (the list of strings), and cached.");

static PyObject *
pprof_label_fields(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *seq, *cache, *strings, *table, *fields = NULL, *out = NULL;
    Py_ssize_t i, n, total = 0;
    char *at;

    if (check_nargs("pprof_label_fields", nargs, 4) < 0) {
        return NULL;
    }
    cache = args[1];
    strings = args[2];
    table = args[3];
    if (!PyDict_Check(cache) || !PyDict_Check(strings) || !PyList_Check(table)) {
        PyErr_SetString(PyExc_TypeError,
                        "pprof_label_fields expects (labels, dict, dict, list)");
        return NULL;
    }
    if ((seq = PySequence_Fast(args[0], "labels must be a sequence of pairs")) == NULL) {
        return NULL;
    }
    n = PySequence_Fast_GET_SIZE(seq);
    if ((fields = PyTuple_New(n)) == NULL) {
        goto done;
    }
    for (i = 0; i < n; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *field = PyDict_GetItemWithError(cache, pair);  /* borrowed */
        if (field != NULL) {
            Py_INCREF(field);
        }
        else {
            if (PyErr_Occurred() || (field = make_label_field(pair, strings, table)) == NULL) {
                goto done;
            }
            if (PyDict_SetItem(cache, pair, field) < 0) {
                Py_DECREF(field);
                goto done;
            }
        }
        if (!PyBytes_Check(field)) {
            PyErr_Format(PyExc_TypeError, "a cached label field is %.100s, not bytes",
                         Py_TYPE(field)->tp_name);
            Py_DECREF(field);
            goto done;
        }
        PyTuple_SET_ITEM(fields, i, field);
        total += PyBytes_GET_SIZE(field);
    }
    if ((out = PyBytes_FromStringAndSize(NULL, total)) == NULL) {
        goto done;
    }
    at = PyBytes_AS_STRING(out);
    for (i = 0; i < n; i++) {
        PyObject *field = PyTuple_GET_ITEM(fields, i);
        memcpy(at, PyBytes_AS_STRING(field), (size_t)PyBytes_GET_SIZE(field));
        at += PyBytes_GET_SIZE(field);
    }
done:
    Py_XDECREF(fields);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef wire_methods[] = {
    {"put_varint", (PyCFunction)(void (*)(void))put_varint, METH_FASTCALL, put_varint_doc},
    {"put_varint_field", (PyCFunction)(void (*)(void))put_varint_field, METH_FASTCALL,
     put_varint_field_doc},
    {"put_bytes_field", (PyCFunction)(void (*)(void))put_bytes_field, METH_FASTCALL,
     put_bytes_field_doc},
    {"put_string_field", (PyCFunction)(void (*)(void))put_string_field, METH_FASTCALL,
     put_string_field_doc},
    {"put_packed_varints_field", (PyCFunction)(void (*)(void))put_packed_varints_field,
     METH_FASTCALL, put_packed_varints_field_doc},
    {"pprof_label_fields", (PyCFunction)(void (*)(void))pprof_label_fields, METH_FASTCALL,
     pprof_label_fields_doc},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot wire_slots[] = {
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#if PY_VERSION_HEX >= 0x030D0000
    /* No state of its own; the bytearray appended to is the caller's, as with `+=`. */
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef wire_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "spanprof._profiling._encoders._wire",
    .m_doc = "The protobuf writers of spanprof._profiling._encoders._protowire, in C.",
    .m_size = 0,
    .m_methods = wire_methods,
    .m_slots = wire_slots,
};

PyMODINIT_FUNC
PyInit__wire(void)
{
    return PyModuleDef_Init(&wire_module);
}
