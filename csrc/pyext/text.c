/* nsbox._text: a command's output read straight into the str exec returns.
 *
 * exec must hand back text. Reading a pipe into a bytes buffer and decoding
 * it into a new str copies every byte once more, and the new str lands on
 * memory the process has not touched yet: on some VMs that costs 5 us per
 * 4 KiB page, about as much as the whole transfer. A TextBuffer is a str
 * under construction instead. The reads land in its characters (its pages
 * are faulted in by the kernel's copy while the command is still writing),
 * and take() returns the str itself when the bytes are ASCII, the common
 * case. Other bytes are decoded into a new str, as before.
 *
 * The str stays private to this object until take(): PyUnicode_New
 * followed by writes into its data is how CPython builds strings, and is
 * safe as long as nothing else sees the str before it is complete.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

typedef struct {
    PyObject_HEAD
    PyObject *text;     /* a compact ASCII str of `size` chars, NULL once taken */
    Py_ssize_t size;
    Py_ssize_t written; /* bytes [0, written) were written: the rest is uninitialised */
    Py_ssize_t exports; /* buffer views alive: take() refuses while any is */
    int non_ascii;      /* a byte >= 0x80 came in (maybe overwritten since) */
} TextBuffer;

static int textbuffer_init(TextBuffer *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"size", NULL};
    Py_ssize_t size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &size))
        return -1;
    /* PyUnicode_New(0) is the shared empty string: never written. */
    if (size < 1) {
        PyErr_SetString(PyExc_ValueError, "TextBuffer size must be at least 1");
        return -1;
    }
    if (self->text != NULL || self->exports) {
        PyErr_SetString(PyExc_RuntimeError, "TextBuffer already initialised");
        return -1;
    }
    /* Only the address space: the pages are touched as bytes arrive. */
    self->text = PyUnicode_New(size, 127);
    if (self->text == NULL)
        return -1;
    self->size = size;
    self->written = 0;
    self->non_ascii = 0;
    return 0;
}

static void textbuffer_dealloc(TextBuffer *self) {
    Py_CLEAR(self->text);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The str's characters, or NULL (BufferError set) once take() handed it out. */
static unsigned char *chars(TextBuffer *self) {
    if (self->text == NULL) {
        PyErr_SetString(PyExc_BufferError, "TextBuffer was taken");
        return NULL;
    }
    return PyUnicode_1BYTE_DATA(self->text);
}

static int textbuffer_getbuffer(TextBuffer *self, Py_buffer *view, int flags) {
    unsigned char *data = chars(self);
    /* Only what was written: the rest is whatever malloc left there. */
    if (data == NULL || PyBuffer_FillInfo(view, (PyObject *)self, data, self->written, 1, flags) < 0)
        return -1;
    self->exports++;
    return 0;
}

static void textbuffer_releasebuffer(TextBuffer *self, Py_buffer *view) {
    (void)view;
    self->exports--;
}

/* Rotates data[0..size) left by `start`, so that the byte at `start`
 * comes first; the temporary copy is the smaller of the two parts. */
static int rotate(unsigned char *data, Py_ssize_t size, Py_ssize_t start) {
    Py_ssize_t rest = size - start;
    Py_ssize_t small = start < rest ? start : rest;
    unsigned char *tmp = PyMem_Malloc(small);
    if (tmp == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (start <= rest) {
        memcpy(tmp, data, start);
        memmove(data, data + start, rest);
        memcpy(data + rest, tmp, start);
    } else {
        memcpy(tmp, data + start, rest);
        memmove(data + rest, data, start);
        memcpy(data, tmp, rest);
    }
    PyMem_Free(tmp);
    return 0;
}

/* GCC/clang vector type: SSE2 on x86_64, NEON on aarch64, plain words
 * elsewhere; the scan then runs at memory speed. */
typedef uint64_t words4 __attribute__((vector_size(32)));

static int is_ascii(const unsigned char *p, Py_ssize_t n) {
    const uint64_t high = UINT64_C(0x8080808080808080);
    Py_ssize_t i = 0;
    /* OR 4 KiB at a time, then test: one branch per block. */
    for (; i + 4096 <= n; i += 4096) {
        words4 acc = {0, 0, 0, 0};
        for (Py_ssize_t j = 0; j < 4096; j += sizeof(words4)) {
            words4 w;
            memcpy(&w, p + i + j, sizeof w); /* an unaligned load */
            acc |= w;
        }
        if ((acc[0] | acc[1] | acc[2] | acc[3]) & high)
            return 0;
    }
    for (; i < n; i++)
        if (p[i] & 0x80)
            return 0;
    return 1;
}

PyDoc_STRVAR(read_from_doc,
"read_from(fd, pos) -> int\n\n"
"One read from `fd` into the buffer at `pos` (at most the end of what was\n"
"written so far), wrapping around to 0 as os.readv with the two parts\n"
"would; returns the byte count, 0 at end of file. Raises BlockingIOError\n"
"when nothing is available. The bytes are checked for ASCII here, while\n"
"they are in the cache.");

static PyObject *textbuffer_read_from(TextBuffer *self, PyObject *args) {
    int fd;
    Py_ssize_t pos;
    if (!PyArg_ParseTuple(args, "in", &fd, &pos))
        return NULL;
    unsigned char *data = chars(self);
    if (data == NULL)
        return NULL;
    /* Writes only ever extend what was written, so that every byte take()
     * hands out was written (and checked) by one of us. */
    if (pos < 0 || pos >= self->size || pos > self->written) {
        PyErr_SetString(PyExc_ValueError, "TextBuffer.read_from: pos out of range");
        return NULL;
    }
    struct iovec iov[2] = {{data + pos, self->size - pos}, {data, pos}};
    int check = !self->non_ascii, non_ascii = 0, err = 0;
    ssize_t n;
    /* Counted as an export while the GIL is released: take() in another
     * thread must not hand out (and let free) the str being written. */
    self->exports++;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        n = readv(fd, iov, pos ? 2 : 1);
        err = errno;
        if (n > 0 && check) {
            Py_ssize_t first = n < self->size - pos ? n : self->size - pos;
            non_ascii = !is_ascii(data + pos, first) || !is_ascii(data, n - first);
        }
        Py_END_ALLOW_THREADS
        if (n >= 0 || err != EINTR || PyErr_CheckSignals() < 0)
            break;
    }
    self->exports--;
    if (n < 0) {
        if (err == EINTR)
            return NULL; /* a signal handler raised */
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError); /* EAGAIN: BlockingIOError */
    }
    self->non_ascii |= non_ascii;
    if (pos + n > self->written)
        self->written = pos + n > self->size ? self->size : pos + n; /* wrapped: all of it */
    return PyLong_FromSsize_t(n);
}

PyDoc_STRVAR(write_at_doc,
"write_at(pos, data)\n\n"
"Copies `data` (a bytes-like object) into the buffer at `pos`, which is at\n"
"most the end of what was written so far; it must fit.");

static PyObject *textbuffer_write_at(TextBuffer *self, PyObject *args) {
    Py_ssize_t pos;
    Py_buffer in;
    if (!PyArg_ParseTuple(args, "ny*", &pos, &in))
        return NULL;
    PyObject *result = NULL;
    unsigned char *data = chars(self);
    if (data == NULL)
        ; /* BufferError set */
    else if (pos < 0 || pos > self->written || in.len > self->size - pos)
        PyErr_SetString(PyExc_ValueError, "TextBuffer.write_at: data does not fit");
    else {
        unsigned char *dst = data + pos;
        /* memmove: `data` may be a view of this buffer. The copy is
         * checked, not the source, which another process may be changing. */
        memmove(dst, in.buf, in.len);
        self->non_ascii |= !is_ascii(dst, in.len);
        if (pos + in.len > self->written)
            self->written = pos + in.len;
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&in);
    return result;
}

PyDoc_STRVAR(take_doc,
"take(filled, start) -> str\n\n"
"The `filled` bytes that begin at offset `start` (wrapping around the end)\n"
"as UTF-8 text, invalid bytes replaced. ASCII comes back as the buffer's\n"
"own str, without a copy. The buffer is empty afterwards.");

static PyObject *textbuffer_take(TextBuffer *self, PyObject *args) {
    Py_ssize_t filled, start;
    if (!PyArg_ParseTuple(args, "nn", &filled, &start))
        return NULL;
    unsigned char *data = chars(self);
    if (data == NULL)
        return NULL;
    if (self->exports) {
        PyErr_SetString(PyExc_BufferError, "TextBuffer is in use (a view, or a read in another thread)");
        return NULL;
    }
    if (filled < 0 || filled > self->written || start < 0 || start >= self->size || (start && filled != self->size)) {
        PyErr_SetString(PyExc_ValueError, "TextBuffer.take: filled/start out of range");
        return NULL;
    }
    if (start && rotate(data, self->size, start) < 0)
        return NULL;
    PyObject *text = self->text;
    self->text = NULL;
    if (self->non_ascii && !is_ascii(data, filled)) {
        PyObject *decoded = PyUnicode_DecodeUTF8((const char *)data, filled, "replace");
        Py_DECREF(text);
        return decoded;
    }
    /* Shrinks in place (realloc; the terminating NUL is written). */
    if (filled < self->size && PyUnicode_Resize(&text, filled) < 0) {
        Py_DECREF(text); /* left as it was, and still ours */
        return NULL;
    }
    return text;
}

static PyMethodDef textbuffer_methods[] = {
    {"read_from", (PyCFunction)textbuffer_read_from, METH_VARARGS, read_from_doc},
    {"write_at", (PyCFunction)textbuffer_write_at, METH_VARARGS, write_at_doc},
    {"take", (PyCFunction)textbuffer_take, METH_VARARGS, take_doc},
    {NULL, NULL, 0, NULL},
};

static PyBufferProcs textbuffer_as_buffer = {
    (getbufferproc)textbuffer_getbuffer,
    (releasebufferproc)textbuffer_releasebuffer,
};

PyDoc_STRVAR(textbuffer_doc,
"TextBuffer(size): `size` bytes that become a str with take(). They are\n"
"written with read_from() and write_at(), from offset 0 on, which note\n"
"whether they are ASCII; the buffer protocol gives a read-only view of\n"
"the bytes written so far.");

static PyTypeObject TextBufferType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nsbox._text.TextBuffer",
    .tp_basicsize = sizeof(TextBuffer),
    .tp_dealloc = (destructor)textbuffer_dealloc,
    .tp_as_buffer = &textbuffer_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = textbuffer_doc,
    .tp_methods = textbuffer_methods,
    .tp_init = (initproc)textbuffer_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef textmodule = {
    PyModuleDef_HEAD_INIT,
    .m_name = "nsbox._text",
    .m_doc = "A command's output read straight into the str exec returns.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__text(void) {
    if (PyType_Ready(&TextBufferType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&textmodule);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "TextBuffer", (PyObject *)&TextBufferType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
