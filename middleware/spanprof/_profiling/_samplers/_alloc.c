/* spanprof._profiling._samplers._alloc: sample Python allocations with their stack and labels.
 *
 * A hook wraps CPython's object allocator (PYMEM_DOMAIN_OBJ; PYMEM_DOMAIN_MEM too on 3.12+,
 * where every allocator must be thread-safe and MEM is called with an attached thread state;
 * RAW, which may run without one, is never sampled). It samples by bytes: a countdown drawn from an
 * exponential distribution of mean `mean_bytes` is decremented by each block's size, and the
 * block that takes it past zero is sampled; so a block of s bytes is sampled with
 * probability 1 - exp(-s / mean), whatever the sizes around it (a Poisson process over the
 * allocated bytes, as tcmalloc and Go sample). The Python side scales each sample by the inverse
 * of that probability.
 *
 * A sampled block records, into preallocated buffers and without allocating:
 * - its Python stack, leaf first: the code object (one new reference: nothing else keeps a
 *   code object made by exec() alive until the buffer is read) and the last instruction's
 *   offset of each frame, walked from the thread state's frame list (3.11+: the interpreter's
 *   own frames, so no frame object is ever materialised);
 * - the labels of the allocating context: PyContextVar_Get on spanprof's LABELS variable, which
 *   is a cache hit or a HAMT lookup and allocates nothing (one new reference to the value);
 * - for in-use memory, its address in a bounded open-addressing table (address -> sample id).
 *   A full table leaves the sample out of in-use and counts it; a freed sampled block leaves
 *   the table and its id goes to a preallocated list of frees.
 *
 * Frees. Most blocks are freed before anything samples near them, so the free path is the
 * hooks' main cost: with a free hook on OBJ, about two thirds of it (a 100 KB JSON request
 * frees some 20,000 blocks). Where the allocators are CPython's defaults (pymalloc over
 * malloc), a sampled block is instead allocated just past pymalloc's small-block limit, which
 * pymalloc hands to PyMem_RawMalloc and, when freed or moved, to PyMem_RawFree or
 * PyMem_RawRealloc: every sampled block leaves through RAW. The OBJ and MEM frees then go
 * straight to pymalloc, and a hook on RAW's free and realloc (never its malloc) forgets the
 * tracked blocks; a sampled block costs a few hundred bytes of padding. RAW runs without the
 * GIL too: its hooks read only the filter (never freed, see filter_t), and touch the table
 * only in a thread that holds the GIL, the only kind that can free a tracked block (OBJ and
 * MEM are called with it). Under any other allocator (PYTHONMALLOC=malloc, debug hooks, a
 * hook installed before ours), OBJ and MEM keep a free hook of their own.
 *
 * Nothing in a hook calls Python code, sets or clears an exception, or releases a reference.
 * drain() (called with the GIL, outside any hook, by the Python side's drain thread) swaps the
 * double-buffered samples and frees, then turns the retired buffer into Python objects; the
 * calling thread's allocations meanwhile pass through unsampled (a thread-local guard, which
 * also stops any hook from sampling re-entrantly).
 *
 * Safety with the GIL: every hook on OBJ and MEM runs with the GIL held, so the module's state
 * needs no lock; hooks from another interpreter (3.12+ subinterpreters can own a GIL) only pass
 * through. Free-threaded builds are refused: their allocator runs concurrently.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>  /* PyMemberDef before 3.12 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#  include <dlfcn.h>  /* dlsym: allocators_are_pymalloc */
#endif
#if defined(__linux__) && __SIZEOF_LONG__ == 8
/* 64-bit Linux: the kernel's itimerspec is libc's, so timer_settime is one raw syscall (no
 * librt to link on older glibc); timer ids made by timer_create(SIGEV_THREAD_ID) are the
 * kernel's, in glibc and musl alike. */
#  include <sys/syscall.h>
#  include <unistd.h>
#  define ALLOC_TIMER_ARM 1
#endif

#if PY_VERSION_HEX < 0x030A0000
#error "spanprof._profiling._samplers._alloc needs CPython 3.10+"
#endif

/* Where the interpreter keeps a thread's frames changes with each minor version: read only
 * the layouts known here, refuse to start on others. */
#if PY_VERSION_HEX < 0x030B0000
#  include <frameobject.h>
#  define ALLOC_FRAMES_KNOWN 1
#elif PY_VERSION_HEX < 0x03100000 && !defined(Py_GIL_DISABLED)
#  ifndef Py_BUILD_CORE
#    define Py_BUILD_CORE 1
#    define ALLOC_DEFINED_BUILD_CORE 1
#  endif
#  if PY_VERSION_HEX >= 0x030E0000
/* 3.14 moved the frame struct and its helpers here; f_executable became a stack reference. */
#    include <internal/pycore_interpframe.h>
#    include <internal/pycore_frame.h>  /* struct _frame (stack_key reads f_frame) */
#  else
#    include <internal/pycore_frame.h>
#  endif
#  include <internal/pycore_context.h>
#  define ALLOC_CONTEXT_KNOWN 1
#  ifdef ALLOC_DEFINED_BUILD_CORE
#    undef Py_BUILD_CORE
#  endif
#  define ALLOC_FRAMES_KNOWN 1
#else
#  define ALLOC_FRAMES_KNOWN 0
#endif

/* CPython's ContextVar object (Include/internal/pycore_context.h), the same from 3.10 to 3.15
 * with the GIL: the hook saves and restores its lookup cache (see read_labels). */
typedef struct {
    PyObject_HEAD
    PyObject *var_name;
    PyObject *var_default;
    PyObject *var_cached;
    uint64_t var_cached_tsid;
    uint64_t var_cached_tsver;
    Py_hash_t var_hash;
} contextvar_layout_t;

#ifdef ALLOC_CONTEXT_KNOWN
#  include <stddef.h>
_Static_assert(offsetof(contextvar_layout_t, var_cached) == offsetof(PyContextVar, var_cached) &&
                   offsetof(contextvar_layout_t, var_cached_tsid) ==
                       offsetof(PyContextVar, var_cached_tsid) &&
                   offsetof(contextvar_layout_t, var_cached_tsver) ==
                       offsetof(PyContextVar, var_cached_tsver),
               "CPython's ContextVar layout moved: update contextvar_layout_t");
#endif

#if PY_VERSION_HEX >= 0x030D0000
#  define ALLOC_TSTATE() PyThreadState_GetUnchecked()
#else
#  define ALLOC_TSTATE() _PyThreadState_UncheckedGet()
#endif

/* --- state (all of it touched only with the GIL held, from the main interpreter) ----------- */

typedef struct {
    PyObject *code;   /* strong reference */
    int lasti;        /* offset of the last instruction, in bytes (frame.f_lasti), -1 if none */
} raw_frame_t;

typedef struct {
    uint64_t id;
    size_t size;
    PyObject *labels;         /* strong reference, or NULL: the variable had no value */
    uint32_t first_frame;     /* index into the buffer's frame pool */
    uint16_t nframes;
    uint8_t tracked;          /* in the in-use table */
    uint8_t truncated;        /* the stack was deeper than max_frames */
} record_t;

typedef struct {
    record_t *records;
    uint32_t nrecords;
    raw_frame_t *frames;
    uint32_t nframes;
    uint64_t *freed;          /* ids of sampled blocks freed since the last drain */
    uint32_t nfreed;
} buffer_t;

typedef struct {
    uintptr_t ptr;            /* 0: empty slot */
    uint64_t id;
} slot_t;

typedef struct {
    PyMemAllocatorEx previous;
    PyMemAllocatorEx ours;    /* what install() put in place, for is_ours() */
    PyMemAllocatorDomain domain;
    int installed;
} domain_hook_t;

static domain_hook_t hook_obj = {.domain = PYMEM_DOMAIN_OBJ};
static domain_hook_t hook_mem = {.domain = PYMEM_DOMAIN_MEM};
/* Only where frees_via_raw: its free and realloc, to forget tracked blocks. */
static domain_hook_t hook_raw = {.domain = PYMEM_DOMAIN_RAW};

/* pymalloc serves requests of up to this many bytes from its pools and hands larger ones to
 * PyMem_RawMalloc (SMALL_REQUEST_THRESHOLD in Objects/obmalloc.c, 512 since 3.8, checked up to
 * 3.15: frees_via_raw is off on versions not checked). */
#define PYMALLOC_SMALL_MAX 512
/* Sampled blocks leave through RAW (see the top of this file): set at start(). */
static int frees_via_raw;

/* Sampling on: the slow paths and the free path consult this first. */
static int active;
/* The hooks stay installed but idle: another allocator was put over them, so stop() could not
 * take them out without cutting that one off. */
static int stuck;
/* A hook of ours was found cut out of its domain's chain while sampling: something that had
 * saved the allocators below ours put them back (tracemalloc started before start() and stopped
 * after it). Sampling stopped there; stays set until stop(). */
static int cut_off;
/* A probe (probe_reaches) is under way: the slow paths it goes through set probe_hit instead of
 * sampling. Globals, not thread-locals: any thread that reaches one of our hooks meanwhile
 * shows as well that the chain still leads there (one chain per domain for the process).
 * Accessed atomically: RAW's realloc hook reads `probing` without the GIL. */
static int probing;
static int probe_hit;
/* The bytes that may still pass unsampled: the block that takes more than this (the
 * subtraction borrows) is sampled. Unsigned, so the fast path's one subtraction is also its
 * test. While sampling is off it is kept out of reach, so that the malloc fast path needs no
 * test of `active`. */
#define IDLE_COUNTDOWN (UINT64_MAX / 2)
static uint64_t countdown = IDLE_COUNTDOWN;
/* Take `size` off the countdown; true (rarely) when the block takes it past zero. */
#define COUNT_DOWN(size) \
    __builtin_expect(__builtin_sub_overflow(countdown, (uint64_t)(size), &countdown), 0)
static double mean_bytes;
static uint64_t rng_state;
static PyObject *labels_var;             /* the ContextVar, strong reference */
static PyInterpreterState *main_interp;

static uint32_t max_records;
static uint32_t max_pool_frames;
static uint32_t max_freed;
static uint16_t max_frames;

static buffer_t buffers[2];
static buffer_t *current;                /* the buffer hooks write; drain() reads the other */

static slot_t *table;
static uint64_t table_mask;
static int table_bits;
/* One bit per 16-byte granule of address space, direct-mapped (a granule's bit is its address
 * bits 4 and up, modulo the filter's size): a free whose bit is clear (almost every free) needs
 * no probe of the table, which is megabytes and would cost a cache miss per free. Direct mapping
 * keeps the free path to a shift, a mask and a bit test, with no multiply, and frees land near
 * recent allocations, so the filter words they read are the few the heap's hot part maps to.
 * The table's home slot of an address is a hash of its bit, so every tracked address of one bit
 * is in the probe run that starts at that home slot: a removal clears its bit unless another
 * tracked address of that bit is there. No bit is ever stale, which matters because pymalloc
 * hands a freed block's address straight back out: a stale bit would cost a probe on nearly
 * every free of its size class. */
#define MIN_FILTER_BITS 20
#define MAX_FILTER_BITS 30
/* The words and their mask in one block, published by one pointer store: the RAW hooks read
 * the filter without the GIL, so a reader must never pair one filter's mask with another's
 * words, nor read a filter that was freed. Filters are never freed: each size is allocated
 * once and reused by the next start() that asks for it (one size in production; tests ask for
 * small ones too). */
typedef struct {
    uint64_t word_mask;       /* the filter's words - 1 */
    uint64_t words[];
} filter_t;
/* The filter while there is no table (before start, after stop, hooks left idle): one word all
 * clear, which every address maps to, so the free path needs no other test. */
static union {
    filter_t filter;
    uint64_t storage[2];
} zero_filter;
static filter_t *filter = &zero_filter.filter;
static filter_t *filters_made[MAX_FILTER_BITS + 1];  /* by bits: kept for the process's life */
static uint32_t max_tracked;
static uint32_t ntracked;

static uint64_t next_id = 1;

/* Counters since start(). */
static uint64_t n_samples;        /* blocks sampled (recorded or dropped) */
static uint64_t n_dropped;        /* sampled but not recorded: buffer full (drain too slow) */
static uint64_t n_untracked;      /* recorded, but left out of in-use: the table is full */
static uint64_t n_frees;          /* sampled blocks seen freed */
static uint64_t n_lost_frees;     /* frees the free list had no room for (never expected) */
static uint64_t n_probes;         /* frees that passed the filter and looked in the table */
static uint64_t n_reentered;      /* samples skipped because the thread was inside the module */
static uint64_t n_foreign;        /* samples skipped: no thread state, or another interpreter */
static uint64_t n_truncated;      /* samples whose stack was cut at max_frames */

/* Per-span totals: the bytes the sampled blocks of each in-flight span stand for, so a span can
 * end with what it allocated (take_span), without waiting for the next drain. Keyed by the
 * span_id string of the sample's label set; the key holds a reference, released outside the
 * hooks only (take_span, drain's sweep, stop). */
typedef struct {
    PyObject *span;           /* NULL: empty slot */
    Py_hash_t hash;
    double bytes;
    uint64_t seen;            /* the drain generation of its last sample */
} span_slot_t;

#define SPAN_BITS 13
#define SPAN_SLOTS ((uint32_t)1 << SPAN_BITS)
#define SPAN_MAX (SPAN_SLOTS / 2)          /* at most half full: probes stay short */
/* A sweep (at a drain, when over a quarter full) drops spans with no sample for this many
 * drains (a minute at the default 0.25 s): requests whose end nobody reported. */
#define SPAN_MAX_AGE 240
static span_slot_t *spans;
static uint32_t nspans;
static uint64_t span_gen;
static PyTypeObject *labelset_type;      /* strong reference, or NULL: no per-span totals */
static Py_ssize_t labelset_map_offset;   /* where a label set keeps its dict (a __slots__ slot) */
static PyObject *span_key;               /* "span_id", strong reference */
static uint64_t n_span_full;      /* samples of a span the totals had no room for */
static uint64_t n_span_expired;   /* spans swept unended */

/* Set while this thread is inside the module (sampling, or drain() building objects). */
static _Thread_local int in_module;

/* The CPU sampler's signal handler's code (strong reference), or NULL. The interpreter runs its
 * pending work, a due collection among it, at the eval-breaker checks on the handler's entry and
 * after its last call, where the thread's ignore guard is off: what a collection's finalizers
 * allocate there would show under the handler's frame, with the interrupted request's labels.
 * An allocation whose leaf Python frame runs this code is not sampled (counted as reentered). */
static PyObject *ignored_leaf;

/* --- random gaps ----------------------------------------------------------------------------- */

static uint64_t
rng_next(void)
{
    /* xorshift64* */
    uint64_t x = rng_state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    rng_state = x;
    return x * 0x2545F4914F6CDD1DULL;
}

/* Bytes until the next sample: exponential with mean `mean_bytes`, at least 1. */
static int64_t
next_gap(void)
{
    /* u in (0, 1]: 53 random bits, never 0, so log(u) is finite. */
    double u = ((double)(rng_next() >> 11) + 1.0) * (1.0 / 9007199254740992.0);
    double gap = -mean_bytes * log(u);
    if (gap < 1.0) {
        return 1;
    }
    if (gap > 4.0e18) {
        return (int64_t)4e18;
    }
    return (int64_t)gap;
}

/* --- the in-use table: linear probing, backward-shift deletion -------------------------------- */

/* The filter bit of an address: its granule number modulo the filter's bits. */
static inline uint64_t
filter_bit(uintptr_t ptr)
{
    return ((uint64_t)ptr >> 4) & ((filter->word_mask << 6) | 63);
}

static inline uint64_t
slot_of(uintptr_t ptr)
{
    /* Fibonacci hashing of the filter bit (high bits): addresses of one bit share a home. */
    return (filter_bit(ptr) * 0x9E3779B97F4A7C15ULL) >> (64 - table_bits);
}

static inline int
filter_may_hold(uintptr_t ptr)
{
    /* One load of the pointer: a RAW hook may run while start() or stop() swaps it. */
    const filter_t *f = __atomic_load_n(&filter, __ATOMIC_ACQUIRE);
    uint64_t granule = (uint64_t)ptr >> 4;
    return (f->words[(granule >> 6) & f->word_mask] >> (granule & 63)) & 1;
}

static inline void
filter_add(uintptr_t ptr)
{
    uint64_t bit = filter_bit(ptr);
    filter->words[bit >> 6] |= 1ULL << (bit & 63);
}

/* `ptr` left the table: clear its bit unless another tracked address has it. Those all have
 * `ptr`'s home slot, so they are in the probe run that starts there. */
static void
filter_forget(uintptr_t ptr)
{
    uint64_t bit = filter_bit(ptr), i = slot_of(ptr);
    while (table[i].ptr != 0) {
        if (filter_bit(table[i].ptr) == bit) {
            return;
        }
        i = (i + 1) & table_mask;
    }
    filter->words[bit >> 6] &= ~(1ULL << (bit & 63));
}

/* 1 if tracked, 0 if the table is full. An address already in the table (a free we never saw)
 * is taken over, and the stale sample reported freed. */
static int
table_insert(uintptr_t ptr, uint64_t id, buffer_t *buf)
{
    uint64_t i = slot_of(ptr);
    while (table[i].ptr != 0) {
        if (table[i].ptr == ptr) {
            if (buf->nfreed < max_freed) {
                buf->freed[buf->nfreed++] = table[i].id;
            }
            else {
                n_lost_frees++;
            }
            n_frees++;
            table[i].id = id;
            return 1;
        }
        i = (i + 1) & table_mask;
    }
    if (ntracked >= max_tracked) {
        return 0;
    }
    table[i].ptr = ptr;
    table[i].id = id;
    filter_add(ptr);
    ntracked++;
    return 1;
}

/* Remove `ptr`; 1 and its id in *id if it was there. */
static int
table_remove(uintptr_t ptr, uint64_t *id)
{
    uint64_t i = slot_of(ptr), j, home;
    while (table[i].ptr != ptr) {
        if (table[i].ptr == 0) {
            return 0;
        }
        i = (i + 1) & table_mask;
    }
    *id = table[i].id;
    /* Shift later entries of the same probe run back over the hole. */
    j = i;
    for (;;) {
        j = (j + 1) & table_mask;
        if (table[j].ptr == 0) {
            break;
        }
        home = slot_of(table[j].ptr);
        /* Move j to i unless j's home lies cyclically in (i, j]. */
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            table[i] = table[j];
            i = j;
        }
    }
    table[i].ptr = 0;
    table[i].id = 0;
    ntracked--;
    filter_forget(ptr);
    return 1;
}

/* --- per-span totals ------------------------------------------------------------------------- */

static inline uint32_t
span_home(Py_hash_t hash)
{
    return (uint32_t)(((uint64_t)hash * 0x9E3779B97F4A7C15ULL) >> (64 - SPAN_BITS));
}

/* Both exact str: PyUnicode_Compare then runs no Python code and cannot fail. */
static inline int
span_same(span_slot_t *slot, PyObject *span, Py_hash_t hash)
{
    return slot->span == span || (slot->hash == hash && PyUnicode_Compare(slot->span, span) == 0);
}

/* The slot holding `span`, or the empty slot where it would go. */
static span_slot_t *
span_find(PyObject *span, Py_hash_t hash)
{
    uint32_t i = span_home(hash);
    while (spans[i].span != NULL && !span_same(&spans[i], span, hash)) {
        i = (i + 1) & (SPAN_SLOTS - 1);
    }
    return &spans[i];
}

/* The span_id of a label set (borrowed), or NULL. In a hook: walks the dict (PyDict_Next calls
 * no Python code, where a lookup could call a key's __eq__) and reads exact str only. */
static PyObject *
span_of(PyObject *labels)
{
    PyObject *map, *key, *value;
    Py_ssize_t pos = 0;
    if (labelset_type == NULL || Py_TYPE(labels) != labelset_type) {
        return NULL;
    }
    map = *(PyObject **)((char *)labels + labelset_map_offset);
    if (map == NULL || !PyDict_CheckExact(map)) {
        return NULL;
    }
    while (PyDict_Next(map, &pos, &key, &value)) {
        if (key == span_key ||
            (PyUnicode_CheckExact(key) && PyUnicode_Compare(key, span_key) == 0)) {
            return PyUnicode_CheckExact(value) ? value : NULL;
        }
    }
    return NULL;
}

/* The blocks a sample of `size` bytes stands for: sampled with probability
 * p = 1 - exp(-size / mean), it stands for 1/p blocks like it. Pure arithmetic (the hooks call
 * it); 0 for a block of no bytes, which is never sampled (it takes nothing off the countdown). */
static inline double
sampled_blocks(size_t size)
{
    return size > 0 ? -1.0 / expm1(-(double)size / mean_bytes) : 0.0;
}

/* A sampled block of `size` bytes under `labels`: credit its span with what it stands for.
 * No allocation, no Python call; the new key's reference is released outside the hooks. */
static void
span_credit(PyObject *labels, size_t size)
{
    PyObject *span = span_of(labels);
    span_slot_t *slot;
    Py_hash_t hash;
    double bytes;
    if (span == NULL) {
        return;
    }
    hash = PyObject_Hash(span);  /* exact str: cached, or computed without allocating */
    bytes = (double)size * sampled_blocks(size);
    slot = span_find(span, hash);
    if (slot->span == NULL) {
        if (nspans >= SPAN_MAX) {
            n_span_full++;
            return;
        }
        slot->span = Py_NewRef(span);
        slot->hash = hash;
        slot->bytes = 0.0;
        nspans++;
    }
    slot->bytes += bytes;
    slot->seen = span_gen;
}

/* Empty `slot` (its reference released: outside the hooks only), shifting its probe run back. */
static void
span_remove(span_slot_t *slot)
{
    uint32_t i = (uint32_t)(slot - spans), j = i, home;
    PyObject *span = slot->span;
    for (;;) {
        j = (j + 1) & (SPAN_SLOTS - 1);
        if (spans[j].span == NULL) {
            break;
        }
        home = span_home(spans[j].hash);
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            spans[i] = spans[j];
            i = j;
        }
    }
    spans[i].span = NULL;
    nspans--;
    Py_DECREF(span);
}

/* At a drain: forget the spans nobody ended, once they take up room. */
static void
span_sweep(void)
{
    uint32_t i = 0;
    span_gen++;
    if (nspans < SPAN_MAX / 2) {
        return;
    }
    while (i < SPAN_SLOTS) {
        /* A removal shifts a later slot into i: look at i again. */
        if (spans[i].span != NULL && span_gen - spans[i].seen > SPAN_MAX_AGE) {
            span_remove(&spans[i]);
            n_span_expired++;
            continue;
        }
        i++;
    }
}

static void
span_clear(void)
{
    uint32_t i;
    if (spans != NULL) {
        for (i = 0; i < SPAN_SLOTS; i++) {
            Py_CLEAR(spans[i].span);
        }
    }
    PyMem_RawFree(spans);
    spans = NULL;
    nspans = 0;
    Py_CLEAR(labelset_type);
    Py_CLEAR(span_key);
}

/* --- the hooks -------------------------------------------------------------------------------- */

static int
in_main_interpreter(PyThreadState *tstate)
{
    /* Before 3.12 too: all interpreters share one GIL there, but a subinterpreter's frees are
     * never seen (holds_gil compares with the thread's main-interpreter state), so its sampled
     * blocks would stay in use for good. `tstate` is the GIL holder's: reading it is safe. */
    return PyThreadState_GetInterpreter(tstate) == main_interp;
}

#if PY_VERSION_HEX >= 0x030B0000 && ALLOC_FRAMES_KNOWN
/* `frame` or the first frame after it that shows on Python's stack (frame.f_back skips the
 * others), with its code in *code; NULL at the end of the stack. */
static inline _PyInterpreterFrame *
shown_frame(_PyInterpreterFrame *frame, PyCodeObject **code)
{
    for (; frame != NULL; frame = frame->previous) {
#  if PY_VERSION_HEX >= 0x030C0000 && PY_VERSION_HEX < 0x030E0000
        if (frame->owner == FRAME_OWNED_BY_CSTACK) {  /* the C stack's entry shim */
            continue;
        }
#  endif
#  if PY_VERSION_HEX >= 0x030E0000
        {
            /* A frame owned by the interpreter (its C-stack entry) has no code to show. */
            PyObject *executable;
            if (frame->owner >= FRAME_OWNED_BY_INTERPRETER ||
                PyStackRef_IsNull(frame->f_executable)) {
                continue;
            }
            executable = PyStackRef_AsPyObjectBorrow(frame->f_executable);
            if (!PyCode_Check(executable)) {
                continue;
            }
            *code = (PyCodeObject *)executable;
        }
#  elif PY_VERSION_HEX >= 0x030D0000
        if (frame->f_executable == NULL || !PyCode_Check(frame->f_executable)) {
            continue;
        }
        *code = (PyCodeObject *)frame->f_executable;
#  else
        *code = frame->f_code;
#  endif
        /* A frame still being set up (no instruction run yet) is not on Python's stack. */
        if (_PyFrame_IsIncomplete(frame)) {
            continue;
        }
        return frame;
    }
    return NULL;
}

/* The thread's leaf frame that shows on Python's stack, with its code in *code; or NULL. */
static inline _PyInterpreterFrame *
leaf_frame(PyThreadState *tstate, PyCodeObject **code)
{
#  if PY_VERSION_HEX >= 0x030D0000
    return shown_frame(tstate->current_frame, code);
#  else
    return shown_frame(tstate->cframe->current_frame, code);
#  endif
}
#endif

/* Copy up to max_frames frames of the thread's stack, leaf first, into `out`. Returns the count;
 * *truncated is set when frames were left out. No allocation, no Python call. */
static uint16_t
capture_stack(PyThreadState *tstate, raw_frame_t *out, uint8_t *truncated)
{
    uint16_t n = 0;
    *truncated = 0;
#if PY_VERSION_HEX < 0x030B0000
    PyFrameObject *frame = tstate->frame;
    while (frame != NULL) {
        if (n == max_frames) {
            *truncated = 1;
            break;
        }
        out[n].code = (PyObject *)frame->f_code;
        Py_INCREF(out[n].code);
        out[n].lasti = frame->f_lasti < 0 ? -1 : frame->f_lasti * (int)sizeof(_Py_CODEUNIT);
        n++;
        frame = frame->f_back;
    }
#elif ALLOC_FRAMES_KNOWN
    PyCodeObject *code;
    _PyInterpreterFrame *frame = leaf_frame(tstate, &code);
    for (; frame != NULL; frame = shown_frame(frame->previous, &code)) {
        int lasti;
        if (n == max_frames) {
            *truncated = 1;
            break;
        }
        lasti = _PyInterpreterFrame_LASTI(frame);
        out[n].code = (PyObject *)code;
        Py_INCREF(out[n].code);
        out[n].lasti = lasti < 0 ? -1 : lasti * (int)sizeof(_Py_CODEUNIT);
        n++;
    }
#else
    (void)tstate;
    (void)out;
#endif
    return n;
}

/* The code of the thread's leaf Python frame (borrowed), or NULL. No allocation, no call. */
static PyObject *
leaf_code(PyThreadState *tstate)
{
#if PY_VERSION_HEX < 0x030B0000
    return tstate->frame != NULL ? (PyObject *)tstate->frame->f_code : NULL;
#elif ALLOC_FRAMES_KNOWN
    PyCodeObject *code = NULL;
    return leaf_frame(tstate, &code) != NULL ? (PyObject *)code : NULL;
#else
    (void)tstate;
    return NULL;
#endif
}

/* The allocating context's labels (a new reference), or NULL.
 *
 * PyContextVar_Get caches what it finds in the variable: a borrowed reference, trusted while
 * the thread's context version is unchanged. ContextVar.reset() to "no value" allocates (a new
 * HAMT) after clearing that cache and before it releases the old value, and bumps no version:
 * a lookup made by this hook in between would cache the value being released, and the next
 * LABELS.get() would return it freed. So the cache is left exactly as the hook found it. */
static PyObject *
read_labels(void)
{
#ifdef Py_GIL_DISABLED
    PyObject *labels = NULL;  /* never called: start() refuses free-threaded builds */
    return PyContextVar_Get(labels_var, NULL, &labels) < 0 ? NULL : labels;
#else
    contextvar_layout_t *var = (contextvar_layout_t *)labels_var;
    PyObject *cached = var->var_cached, *labels = NULL;
    uint64_t tsid = var->var_cached_tsid, tsver = var->var_cached_tsver;
    /* Checked at start(): the variable is a ContextVar, so this cannot fail; it returns the
     * allocating context's value or its default. */
    if (PyContextVar_Get(labels_var, NULL, &labels) < 0) {
        labels = NULL;
    }
    var->var_cached = cached;
    var->var_cached_tsid = tsid;
    var->var_cached_tsver = tsver;
    return labels;
#endif
}

/* The slow path: `ptr` (`size` bytes) took the countdown past zero. */
static __attribute__((noinline)) void
sample_block(void *ptr, size_t size)
{
    PyThreadState *tstate;
    buffer_t *buf;
    record_t *rec;
    PyObject *labels = NULL;

    /* The next gap starts at this block's end (the process is memoryless); the block that
     * ends it is the one that takes more than gap - 1 bytes. */
    countdown = (uint64_t)next_gap() - 1;
    if (in_module) {
        n_reentered++;
        return;
    }
    tstate = ALLOC_TSTATE();
    if (tstate == NULL || !in_main_interpreter(tstate)) {
        n_foreign++;
        return;
    }
    if (ignored_leaf != NULL && leaf_code(tstate) == ignored_leaf) {
        n_reentered++;
        return;
    }
    in_module = 1;
    n_samples++;
    buf = current;
    if (buf->nrecords >= max_records || max_pool_frames - buf->nframes < max_frames) {
        n_dropped++;
        in_module = 0;
        return;
    }
    rec = &buf->records[buf->nrecords];
    rec->first_frame = buf->nframes;
    rec->nframes = capture_stack(tstate, &buf->frames[buf->nframes], &rec->truncated);
    if (rec->truncated) {
        n_truncated++;
    }
    labels = read_labels();
    rec->labels = labels;
    if (labels != NULL && spans != NULL) {
        span_credit(labels, size);
    }
    rec->id = next_id++;
    rec->size = size;
    rec->tracked = (uint8_t)table_insert((uintptr_t)ptr, rec->id, buf);
    if (!rec->tracked) {
        n_untracked++;
    }
    buf->nframes += rec->nframes;
    buf->nrecords++;
    in_module = 0;
}

/* The hooks' fast paths are one decrement and a test (malloc), or one filter bit (free), then
 * a tail jump into the previous allocator: no stack frame of their own. Everything else is out
 * of line. Sampling off, the countdown is out of reach (IDLE_COUNTDOWN) and the filter all
 * clear (zero_filter), so neither path tests `active`. */

/* `ptr` took the countdown past zero: sample it, unless sampling is off. */
static __attribute__((noinline)) void
countdown_reached(void *ptr, size_t size)
{
    if (__atomic_load_n(&probing, __ATOMIC_RELAXED)) {
        /* The probe's own allocation (or one racing it) came through this hook: no sample. */
        __atomic_store_n(&probe_hit, 1, __ATOMIC_RELAXED);
        return;
    }
    if (!active) {
        countdown = IDLE_COUNTDOWN;
        return;
    }
    if (ptr != NULL) {
        sample_block(ptr, size);
    }
    else {
        /* A failed allocation leaves the countdown spent: the next one is sampled. */
        countdown = 0;
    }
}

/* Whether the calling thread holds the GIL: a RAW call may come from a thread that does not. */
static inline int
holds_gil(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    /* 3.12+: the thread's own attached thread state, NULL while it runs without the GIL. */
    return ALLOC_TSTATE() != NULL;
#else
    /* Before 3.12 the current thread state is the GIL holder's, whoever asks: compare it with
     * this thread's own (a pointer compare; neither is read through). */
    PyThreadState *holder = ALLOC_TSTATE();
    return holder != NULL && holder == PyGILState_GetThisThreadState();
#endif
}

/* The slow part of forget(): `ptr` may be tracked. RAW's hooks call it from threads without
 * the GIL too: those cannot be freeing a tracked block (OBJ and MEM are called with the GIL),
 * and leave the table and the counters alone. */
static __attribute__((noinline)) void
forget_tracked(void *ptr)
{
    uint64_t id;
    buffer_t *buf;

    if (ptr == NULL || !active || !holds_gil()) {
        return;
    }
    n_probes++;
    if (!in_main_interpreter(ALLOC_TSTATE())) {
        return;
    }
    if (!table_remove((uintptr_t)ptr, &id)) {
        return;
    }
    n_frees++;
    buf = current;
    if (buf->nfreed < max_freed) {
        buf->freed[buf->nfreed++] = id;
    }
    else {
        n_lost_frees++;
    }
}

/* 1 when `ptr` may be a tracked block (the filter's bit is set). */
static inline int
may_be_tracked(void *ptr)
{
    return __builtin_expect(filter_may_hold((uintptr_t)ptr), 0);
}

/* The block to ask the allocator for when `size` bytes are sampled: past pymalloc's pools
 * where sampled blocks leave through RAW. */
static inline size_t
sampled_request(size_t size)
{
    return frees_via_raw && size <= PYMALLOC_SMALL_MAX ? PYMALLOC_SMALL_MAX + 1 : size;
}

static __attribute__((noinline)) void *
malloc_sampled(domain_hook_t *hook, size_t size)
{
    void *ptr = hook->previous.malloc(hook->previous.ctx, sampled_request(size));
    countdown_reached(ptr, size);
    return ptr;
}

static __attribute__((noinline)) void *
calloc_sampled(domain_hook_t *hook, size_t nelem, size_t elsize)
{
    /* calloc checked nelem * elsize for overflow before it succeeded. */
    size_t size = nelem * elsize, asked = sampled_request(size);
    void *ptr = asked == size ? hook->previous.calloc(hook->previous.ctx, nelem, elsize)
                              : hook->previous.calloc(hook->previous.ctx, 1, asked);
    countdown_reached(ptr, size);
    return ptr;
}

/* Without frees_via_raw, the old block is forgotten here (with it, RAW's realloc saw it). */
static inline void
realloc_forget(void *old)
{
    if (!frees_via_raw && may_be_tracked(old)) {
        forget_tracked(old);
    }
}

static __attribute__((noinline)) void *
realloc_sampled(domain_hook_t *hook, void *old, size_t new_size)
{
    void *ptr = hook->previous.realloc(hook->previous.ctx, old, sampled_request(new_size));
    if (ptr != NULL) {
        realloc_forget(old);
    }
    countdown_reached(ptr, new_size);
    return ptr;
}

static __attribute__((noinline)) void
free_tracked(domain_hook_t *hook, void *ptr)
{
    forget_tracked(ptr);
    hook->previous.free(hook->previous.ctx, ptr);
}

/* The hooks of one domain. Each reads the previous allocator from its domain's static struct
 * (an address the linker knows) rather than through ctx, so the pass-through is two
 * instructions: load the previous ctx, jump through the previous function. The free hook is
 * installed only without frees_via_raw. */
#define DOMAIN_HOOKS(NAME, HOOK)                                                                 \
    static void *hook_malloc_##NAME(void *Py_UNUSED(ctx), size_t size)                            \
    {                                                                                            \
        if (COUNT_DOWN(size)) {                                                                  \
            return malloc_sampled(&HOOK, size);                                                  \
        }                                                                                        \
        return HOOK.previous.malloc(HOOK.previous.ctx, size);                                    \
    }                                                                                            \
                                                                                                 \
    static void *hook_calloc_##NAME(void *Py_UNUSED(ctx), size_t nelem, size_t elsize)            \
    {                                                                                            \
        size_t size;                                                                             \
        if (__builtin_mul_overflow(nelem, elsize, &size)) {                                      \
            /* The previous allocator refuses it; nothing is counted. */                        \
            return HOOK.previous.calloc(HOOK.previous.ctx, nelem, elsize);                       \
        }                                                                                        \
        if (COUNT_DOWN(size)) {                                                                  \
            return calloc_sampled(&HOOK, nelem, elsize);                                         \
        }                                                                                        \
        return HOOK.previous.calloc(HOOK.previous.ctx, nelem, elsize);                           \
    }                                                                                            \
                                                                                                 \
    static void *hook_realloc_##NAME(void *Py_UNUSED(ctx), void *old, size_t new_size)            \
    {                                                                                            \
        void *ptr;                                                                               \
        /* The old block is gone (moved or resized): a new block of new_size takes its place,    \
         * sampled before the call, so that a sampled one is asked for where it leaves through   \
         * RAW. Only the old address is looked at, so forgetting it after the call is safe. */   \
        if (COUNT_DOWN(new_size)) {                                                              \
            return realloc_sampled(&HOOK, old, new_size);                                        \
        }                                                                                        \
        ptr = HOOK.previous.realloc(HOOK.previous.ctx, old, new_size);                           \
        if (ptr != NULL) {                                                                       \
            realloc_forget(old);                                                                 \
        }                                                                                        \
        return ptr;                                                                              \
    }                                                                                            \
                                                                                                 \
    static void hook_free_##NAME(void *Py_UNUSED(ctx), void *ptr)                                 \
    {                                                                                            \
        /* Only the address is looked at, so the block can be forgotten before it is freed;     \
         * the free is then the last call (a jump, not a call frame more on the hottest         \
         * path). */                                                                             \
        if (may_be_tracked(ptr)) {                                                               \
            free_tracked(&HOOK, ptr);                                                            \
            return;                                                                              \
        }                                                                                        \
        HOOK.previous.free(HOOK.previous.ctx, ptr);                                              \
    }

DOMAIN_HOOKS(obj, hook_obj)
DOMAIN_HOOKS(mem, hook_mem)

/* RAW: a tracked block leaving, or (without the GIL, or untracked) anything else. */
static void
hook_free_raw(void *Py_UNUSED(ctx), void *ptr)
{
    if (may_be_tracked(ptr)) {
        free_tracked(&hook_raw, ptr);
        return;
    }
    hook_raw.previous.free(hook_raw.previous.ctx, ptr);
}

static void *
hook_realloc_raw(void *Py_UNUSED(ctx), void *old, size_t new_size)
{
    void *ptr = hook_raw.previous.realloc(hook_raw.previous.ctx, old, new_size);
    if (__builtin_expect(__atomic_load_n(&probing, __ATOMIC_RELAXED), 0)) {
        __atomic_store_n(&probe_hit, 1, __ATOMIC_RELAXED);  /* see probe_reaches */
    }
    if (ptr != NULL && may_be_tracked(old)) {
        forget_tracked(old);
    }
    return ptr;
}

static const PyMemAllocatorEx ours_obj = {
    .ctx = &hook_obj,
    .malloc = hook_malloc_obj,
    .calloc = hook_calloc_obj,
    .realloc = hook_realloc_obj,
    .free = hook_free_obj,
};
static const PyMemAllocatorEx ours_mem = {
    .ctx = &hook_mem,
    .malloc = hook_malloc_mem,
    .calloc = hook_calloc_mem,
    .realloc = hook_realloc_mem,
    .free = hook_free_mem,
};

/* --- buffers ---------------------------------------------------------------------------------- */

/* Release what a buffer holds (with the GIL, outside the hooks) and empty it. */
static void
buffer_clear(buffer_t *buf)
{
    uint32_t i;
    for (i = 0; i < buf->nframes; i++) {
        Py_CLEAR(buf->frames[i].code);
    }
    for (i = 0; i < buf->nrecords; i++) {
        Py_CLEAR(buf->records[i].labels);
    }
    buf->nframes = buf->nrecords = buf->nfreed = 0;
}

static void
free_state(void)
{
    int i;
    /* First: the releases below free objects through the hooks, whose free path must then
     * find no bit set (and so never look for the table). The filter stays allocated: a RAW
     * hook may still be reading it. */
    __atomic_store_n(&filter, &zero_filter.filter, __ATOMIC_RELEASE);
    ntracked = 0;
    for (i = 0; i < 2; i++) {
        if (buffers[i].records != NULL) {
            buffer_clear(&buffers[i]);
        }
        PyMem_RawFree(buffers[i].records);
        PyMem_RawFree(buffers[i].frames);
        PyMem_RawFree(buffers[i].freed);
        memset(&buffers[i], 0, sizeof(buffer_t));
    }
    PyMem_RawFree(table);
    table = NULL;
    table_mask = 0;
    table_bits = 0;
    ntracked = 0;
    current = NULL;
    Py_CLEAR(labels_var);
    span_clear();
}

/* The table, the filter and the buffers. `requested_filter_bits` sizes the filter; 0: as many
 * bits as the table has slots, and at least MIN_FILTER_BITS. */
static int
alloc_state(int requested_filter_bits)
{
    uint64_t size = 2;
    filter_t *bits;
    int i, filter_bits;
    table_bits = 1;
    while (size < 2 * (uint64_t)max_tracked) {
        size <<= 1;
        table_bits++;
    }
    table = PyMem_RawCalloc((size_t)size, sizeof(slot_t));
    table_mask = size - 1;
    /* At least as many bits as table slots, so the homes of distinct bits spread over all. */
    filter_bits = table_bits > MIN_FILTER_BITS ? table_bits : MIN_FILTER_BITS;
    if (requested_filter_bits != 0) {
        filter_bits = requested_filter_bits;
    }
    bits = filters_made[filter_bits];
    if (bits == NULL) {
        bits = PyMem_RawCalloc(((size_t)1 << (filter_bits - 6)) + 1, sizeof(uint64_t));
        if (bits != NULL) {
            bits->word_mask = ((uint64_t)1 << (filter_bits - 6)) - 1;
            filters_made[filter_bits] = bits;
        }
    }
    else {
        /* Not published since the last stop(): only a RAW hook that loaded it before may
         * still read it, and what it reads there does not matter (it holds no GIL, or the
         * sampler was off). */
        memset(bits->words, 0, ((size_t)bits->word_mask + 1) * sizeof(uint64_t));
    }
    for (i = 0; i < 2; i++) {
        buffers[i].records = PyMem_RawCalloc(max_records, sizeof(record_t));
        buffers[i].frames = PyMem_RawCalloc(max_pool_frames, sizeof(raw_frame_t));
        buffers[i].freed = PyMem_RawCalloc(max_freed, sizeof(uint64_t));
        if (buffers[i].records == NULL || buffers[i].frames == NULL || buffers[i].freed == NULL) {
            goto fail;
        }
    }
    if (table == NULL || bits == NULL) {
        goto fail;
    }
    /* The table first: a free that sees a bit of the new filter probes it. */
    __atomic_store_n(&filter, bits, __ATOMIC_RELEASE);
    current = &buffers[0];
    return 0;
fail:
    free_state();
    PyErr_NoMemory();
    return -1;
}

/* --- Python functions ------------------------------------------------------------------------- */

/* Why the hooks cannot run in this interpreter, or NULL. */
static const char *
unsupported_reason(void)
{
#ifdef Py_GIL_DISABLED
    return "this is a free-threaded CPython build: its allocator runs in many threads at once "
           "without the GIL, and the sampler's tables are guarded by the GIL";
#else
    if (!ALLOC_FRAMES_KNOWN) {
        return "this CPython version's frame layout is not known to spanprof (3.10 to 3.15 are)";
    }
    return NULL;
#endif
}

PyDoc_STRVAR(unsupported_doc,
"unsupported() -> str | None\n"
"--\n"
"\n"
"Why allocation sampling cannot run in this interpreter, or None when it can.");

static PyObject *
alloc_unsupported(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(args))
{
    const char *reason = unsupported_reason();
    if (reason == NULL) {
        Py_RETURN_NONE;
    }
    return PyUnicode_FromString(reason);
}

/* Whether OBJ, MEM and RAW are CPython's default allocators (pymalloc, over malloc for RAW),
 * nobody's hook over them: then blocks past pymalloc's limit are freed through RAW. Asked by
 * name (a private function, looked up: a build without it gets the free hooks). */
static int
allocators_are_pymalloc(void)
{
#if PY_VERSION_HEX < 0x03100000 && defined(__linux__)
    const char *(*current_name)(void);
    const char *name;
    *(void **)(&current_name) = dlsym(RTLD_DEFAULT, "_PyMem_GetCurrentAllocatorName");
    if (current_name == NULL) {
        return 0;
    }
    name = current_name();
    return name != NULL && strcmp(name, "pymalloc") == 0;
#else
    return 0;
#endif
}

/* What a domain's hook puts in place over `previous`. */
static PyMemAllocatorEx
ours_for(domain_hook_t *hook)
{
    PyMemAllocatorEx ours;
    if (hook == &hook_raw) {
        /* Only the frees: RAW's malloc and calloc are left as they were. Same ctx: a thread
         * that reads the struct while it is replaced may pair either ctx with either
         * function, and with the same ctx every pairing is right. */
        ours = hook->previous;
        ours.realloc = hook_realloc_raw;
        ours.free = hook_free_raw;
        return ours;
    }
    ours = hook == &hook_obj ? ours_obj : ours_mem;
    if (frees_via_raw) {
        ours.free = hook->previous.free;
        ours.ctx = hook->previous.ctx;  /* ours ignore ctx; the previous free gets its own */
    }
    return ours;
}

static int
install(domain_hook_t *hook)
{
    PyMem_GetAllocator(hook->domain, &hook->previous);
    hook->ours = ours_for(hook);
    PyMem_SetAllocator(hook->domain, &hook->ours);
    hook->installed = 1;
    return 0;
}

static int
is_ours(domain_hook_t *hook)
{
    PyMemAllocatorEx now;
    PyMem_GetAllocator(hook->domain, &now);
    return now.ctx == hook->ours.ctx && now.malloc == hook->ours.malloc &&
           now.calloc == hook->ours.calloc && now.realloc == hook->ours.realloc &&
           now.free == hook->ours.free;
}

/* Whether a call into `hook`'s domain still reaches our hook there: 1 yes, 0 no, -1 unknown (an
 * allocation failed before the chain got to ours). With the GIL, outside the hooks: it
 * allocates and frees one small block through the domain, and the hooks it passes through tell
 * it they ran (countdown_reached, hook_realloc_raw) without sampling anything. */
static int
probe_reaches(domain_hook_t *hook)
{
    uint64_t saved = countdown;
    void *ptr, *moved = NULL;
    int hit;
    __atomic_store_n(&probe_hit, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&probing, 1, __ATOMIC_RELAXED);
    if (hook == &hook_raw) {
        /* Ours on RAW are its realloc and free (its malloc is the previous one's). */
        ptr = PyMem_RawMalloc(1);
        if (ptr != NULL) {
            moved = PyMem_RawRealloc(ptr, 2);
            PyMem_RawFree(moved != NULL ? moved : ptr);
        }
    }
    else {
        /* The countdown spent: a malloc that reaches ours takes its slow path. */
        countdown = 0;
        if (hook == &hook_obj) {
            ptr = moved = PyObject_Malloc(1);
            PyObject_Free(ptr);
        }
        else {
            ptr = moved = PyMem_Malloc(1);
            PyMem_Free(ptr);
        }
    }
    __atomic_store_n(&probing, 0, __ATOMIC_RELAXED);
    countdown = saved;
    hit = __atomic_load_n(&probe_hit, __ATOMIC_RELAXED);
    if (hit) {
        return 1;
    }
    return ptr == NULL || moved == NULL ? -1 : 0;
}

/* Where a hook of ours is in its domain's chain. */
typedef enum {
    HOOK_ON_TOP,   /* what the domain calls first */
    HOOK_BELOW,    /* under another hook, which calls it */
    HOOK_GONE,     /* out of the chain: whoever had saved the allocators under it put them back */
} hook_place_t;

static hook_place_t
hook_place(domain_hook_t *hook)
{
    if (is_ours(hook)) {
        return HOOK_ON_TOP;
    }
    /* Unknown counts as below: idle hooks left in place are harmless, taking out ones that
     * are still called is not. */
    return probe_reaches(hook) == 0 ? HOOK_GONE : HOOK_BELOW;
}

/* Take our hooks out wherever that cuts nobody off. 0 when another hook sits over one of ours:
 * then all stay, idle (taking ours out would cut that one off, which calls ours). `*gone` is set
 * when some had been cut out of the chain already. */
static int
take_out_hooks(int *gone)
{
    /* RAW last: a sampled block may still be moved or freed through RAW until OBJ and MEM are
     * ours no more. A thread inside its hook (RAW runs without the GIL) finishes there: the
     * hook's code and `previous` stay. */
    domain_hook_t *order[3] = {&hook_mem, &hook_obj, &hook_raw};
    hook_place_t place[3] = {HOOK_GONE, HOOK_GONE, HOOK_GONE};
    int i;
    *gone = 0;
    for (i = 0; i < 3; i++) {
        if (!order[i]->installed) {
            continue;
        }
        place[i] = hook_place(order[i]);
        if (place[i] == HOOK_BELOW) {
            return 0;
        }
        if (place[i] == HOOK_GONE) {
            *gone = 1;
        }
    }
    for (i = 0; i < 3; i++) {
        if (!order[i]->installed) {
            continue;
        }
        /* A hook cut out of the chain is called no more: what is in place is someone else's,
         * left alone. Its `previous` stays, should a saved copy of ours come back. */
        if (place[i] == HOOK_ON_TOP) {
            PyMem_SetAllocator(order[i]->domain, &order[i]->previous);
        }
        order[i]->installed = 0;
    }
    return 1;
}

/* While sampling: whether a hook of ours was cut out of its chain (tracemalloc started before
 * start() and stopped since puts back the allocators it had saved, under ours). Then nothing
 * more is sampled, nor the frees of tracked blocks seen: sampling stops, and says so. */
static int
check_cut_off(void)
{
    domain_hook_t *hooks[3] = {&hook_obj, &hook_mem, &hook_raw};
    int i;
    if (!active || cut_off) {
        return cut_off;
    }
    for (i = 0; i < 3; i++) {
        if (hooks[i]->installed && hook_place(hooks[i]) == HOOK_GONE) {
            cut_off = 1;
            active = 0;
            countdown = IDLE_COUNTDOWN;
            break;
        }
    }
    return cut_off;
}

#ifndef Py_T_OBJECT_EX
#  define Py_T_OBJECT_EX 16  /* structmember.h's T_OBJECT_EX, before 3.12 named it so */
#endif

/* Where instances of `type` keep their `_map` slot, or -1 with an exception set. */
static Py_ssize_t
map_slot_offset(PyTypeObject *type)
{
    PyObject *descr = PyObject_GetAttrString((PyObject *)type, "_map");
    PyMemberDef *member;
    Py_ssize_t offset;
    if (descr == NULL) {
        return -1;
    }
    if (!Py_IS_TYPE(descr, &PyMemberDescr_Type) ||
        ((PyMemberDescrObject *)descr)->d_common.d_type != type) {
        Py_DECREF(descr);
        PyErr_SetString(PyExc_TypeError, "labelset_type must keep its labels in a _map slot");
        return -1;
    }
    member = ((PyMemberDescrObject *)descr)->d_member;
    offset = member->offset;
    if (member->type != Py_T_OBJECT_EX || offset <= 0) {
        Py_DECREF(descr);
        PyErr_SetString(PyExc_TypeError, "labelset_type's _map slot must be an object slot");
        return -1;
    }
    Py_DECREF(descr);
    return offset;
}

PyDoc_STRVAR(start_doc,
"start(labels_var, mean_bytes, max_samples, max_tracked, max_frames, mem_domain, seed,\n"
"      labelset_type=None, span_key=None, filter_bits=0)\n"
"--\n"
"\n"
"Install the hooks and start sampling about one block per ``mean_bytes`` allocated.\n"
"\n"
"``labels_var`` is the ContextVar read at each sampled allocation; ``max_samples`` bounds the\n"
"samples kept between two drain() calls, ``max_tracked`` the sampled blocks tracked for in-use\n"
"memory, ``max_frames`` the frames kept per stack (leaf first). ``mem_domain`` also hooks\n"
"PYMEM_DOMAIN_MEM (honoured on 3.12+ only). ``seed`` 0 seeds from the clock. With\n"
"``labelset_type`` (a class keeping its labels in a dict slot ``_map``), samples whose labels\n"
"are one also add to their ``span_key`` label's total, read by take_span(). ``filter_bits``\n"
"sizes the free path's filter (0: by ``max_tracked``); tests make it small, so that addresses\n"
"share bits. Raises\n"
"RuntimeError when sampling cannot run here or already runs.");

static PyObject *
alloc_start(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *var;
    double mean;
    unsigned long long samples, tracked, frames, seed;
    int mem_domain;
    const char *reason = unsupported_reason();

    PyObject *set_type = Py_None, *key = Py_None;
    Py_ssize_t map_offset = 0;
    int filter_bits = 0;

    if (!PyArg_ParseTuple(args, "OdKKKpK|OOi:start", &var, &mean, &samples, &tracked, &frames,
                          &mem_domain, &seed, &set_type, &key, &filter_bits)) {
        return NULL;
    }
    if (reason != NULL) {
        PyErr_Format(PyExc_RuntimeError, "allocation sampling cannot run: %s", reason);
        return NULL;
    }
    if (stuck) {
        /* Left idle under another hook by stop(): that one may be gone since (it put ours
         * back on top, or cut them out of the chain), and ours can then come out now. */
        int gone;
        if (!take_out_hooks(&gone)) {
            PyErr_SetString(PyExc_RuntimeError,
                            "allocation sampling cannot restart: its hooks are still installed "
                            "under another allocator hook that was set after them");
            return NULL;
        }
        stuck = 0;
    }
    if (active || hook_obj.installed) {
        PyErr_SetString(PyExc_RuntimeError, "allocation sampling already runs");
        return NULL;
    }
    if (!PyContextVar_CheckExact(var)) {
        PyErr_SetString(PyExc_TypeError, "labels_var must be a contextvars.ContextVar");
        return NULL;
    }
    if (set_type != Py_None) {
        if (!PyType_Check(set_type) || !PyUnicode_CheckExact(key)) {
            PyErr_SetString(PyExc_TypeError,
                            "labelset_type must be a type and span_key a str (or both None)");
            return NULL;
        }
        map_offset = map_slot_offset((PyTypeObject *)set_type);
        if (map_offset < 0) {
            return NULL;
        }
    }
    if (!(mean >= 1.0 && mean <= 1e15)) {
        PyErr_SetString(PyExc_ValueError, "mean_bytes must be between 1 and 1e15");
        return NULL;
    }
    if (samples < 1 || samples > 1000000 || tracked < 1 || tracked > 10000000 || frames < 1 ||
        frames > 1024) {
        PyErr_SetString(PyExc_ValueError,
                        "max_samples must be in [1, 1e6], max_tracked in [1, 1e7], "
                        "max_frames in [1, 1024]");
        return NULL;
    }
    if (filter_bits != 0 && (filter_bits < 6 || filter_bits > 30)) {
        PyErr_SetString(PyExc_ValueError, "filter_bits must be 0 or in [6, 30]");
        return NULL;
    }
    max_records = (uint32_t)samples;
    max_frames = (uint16_t)frames;
    /* Room for max_frames on the deepest stack, 32 frames per sample on average. */
    max_pool_frames = (uint32_t)(samples * 32 < frames ? frames : samples * 32);
    if (max_pool_frames < max_frames) {
        max_pool_frames = max_frames;
    }
    max_tracked = (uint32_t)tracked;
    /* Between two drains at most every tracked block and every new sample can be freed. */
    max_freed = max_tracked + max_records;
    if (alloc_state(filter_bits) < 0) {
        return NULL;
    }
    labels_var = Py_NewRef(var);
    if (set_type != Py_None) {
        spans = PyMem_RawCalloc(SPAN_SLOTS, sizeof(span_slot_t));
        if (spans == NULL) {
            free_state();
            return PyErr_NoMemory();
        }
        labelset_type = (PyTypeObject *)Py_NewRef(set_type);
        labelset_map_offset = map_offset;
        span_key = Py_NewRef(key);
        PyUnicode_InternInPlace(&span_key);
    }
    mean_bytes = mean;
    rng_state = seed != 0 ? seed
                          : ((uint64_t)time(NULL) << 32) ^ (uint64_t)clock() ^
                                (uint64_t)(uintptr_t)&rng_state ^ 0x9E3779B97F4A7C15ULL;
    if (rng_state == 0) {
        rng_state = 0x9E3779B97F4A7C15ULL;
    }
    countdown = (uint64_t)next_gap() - 1;
    main_interp = PyInterpreterState_Main();
    n_samples = n_dropped = n_untracked = n_frees = n_lost_frees = n_probes = 0;
    n_reentered = n_foreign = n_truncated = 0;
    n_span_full = n_span_expired = 0;
    span_gen = 0;
    cut_off = 0;
    /* Asked before any hook of ours is in place (then the allocators are no longer the
     * defaults); RAW's hook first, so that it is there when the first sampled block is. */
    frees_via_raw = allocators_are_pymalloc();
    if (frees_via_raw) {
        install(&hook_raw);
    }
    install(&hook_obj);
#if PY_VERSION_HEX >= 0x030C0000
    if (mem_domain) {
        install(&hook_mem);
    }
#else
    (void)mem_domain;
#endif
    active = 1;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(stop_doc,
"stop() -> bool\n"
"--\n"
"\n"
"Stop sampling and put the previous allocators back. False when another hook was installed\n"
"over these since start(): they then stay in place, passing every call through.");

static PyObject *
alloc_stop(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(args))
{
    int restored, gone;
    if (!hook_obj.installed) {
        Py_RETURN_TRUE;
    }
    active = 0;
    /* Hooks another one sits over stay, idle: taking ours out would cut that one off. Hooks
     * already cut out of the chain by someone else are only forgotten. */
    restored = take_out_hooks(&gone);
    if (!restored) {
        stuck = 1;
    }
    countdown = IDLE_COUNTDOWN;
    cut_off = 0;
    free_state();
    return PyBool_FromLong(restored);
}

PyDoc_STRVAR(check_hooks_doc,
"check_hooks() -> bool\n"
"--\n"
"\n"
"Whether sampling stopped because a hook was cut out of its allocator chain since start(): some\n"
"tool that saved the allocators below these put them back (tracemalloc, started before start()\n"
"and stopped since). Nothing is sampled from then on, nor are frees of tracked blocks seen.");

static PyObject *
alloc_check_hooks(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(args))
{
    return PyBool_FromLong(check_cut_off());
}

/* What the drain makes of one record before handing it over. */
typedef struct {
    double objects;           /* the blocks it stands for (its group's, for a group's first) */
    double nbytes;            /* the bytes it stands for (likewise) */
    uint8_t gone;             /* its block was freed before this drain: never in use */
    uint8_t merged;           /* counted in an earlier record of its group: not handed over */
} drained_t;

/* One record as (id, size, tracked, labels, codes, lastis, truncated, key, objects, nbytes);
 * takes over the record's references (its labels, and its code objects unless `known` has its
 * key: those stay in the buffer). `key` is the stack as bytes, each frame's code address and
 * instruction offset: the drain's cache key, hashed once and compared with memcmp (a tuple of
 * ints would be hashed and compared item by item). Most samples repeat a stack the caller has
 * interned already: for those, building two tuples of the stack's frames would be all waste.
 * `tracked` says the block is still in use (tracked, and not freed before this drain). */
static PyObject *
record_tuple(buffer_t *buf, record_t *rec, const drained_t *drained, PyObject *known)
{
    PyObject *item, *codes, *lastis, *value, *key;
    uint16_t i;
    raw_frame_t *frames = &buf->frames[rec->first_frame];
    char *bytes;
    int is_known = 0;

    item = PyTuple_New(10);
    if (item == NULL) {
        return NULL;
    }
    /* Filled in order; a failure leaves NULL slots, which tuple dealloc skips. */
    if ((value = PyLong_FromUnsignedLongLong(rec->id)) == NULL) {
        goto fail;
    }
    PyTuple_SET_ITEM(item, 0, value);
    if ((value = PyLong_FromSize_t(rec->size)) == NULL) {
        goto fail;
    }
    PyTuple_SET_ITEM(item, 1, value);
    PyTuple_SET_ITEM(item, 2, PyBool_FromLong(rec->tracked && !drained->gone));
    PyTuple_SET_ITEM(item, 6, PyBool_FromLong(rec->truncated));
    if ((value = PyFloat_FromDouble(drained->objects)) == NULL) {
        goto fail;
    }
    PyTuple_SET_ITEM(item, 8, value);
    if ((value = PyFloat_FromDouble(drained->nbytes)) == NULL) {
        goto fail;
    }
    PyTuple_SET_ITEM(item, 9, value);
    if ((key = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)rec->nframes * 16)) == NULL) {
        goto fail;
    }
    PyTuple_SET_ITEM(item, 7, key);
    bytes = PyBytes_AS_STRING(key);
    for (i = 0; i < rec->nframes; i++) {
        uint64_t address = (uint64_t)(uintptr_t)frames[i].code;
        int64_t offset = frames[i].lasti;
        memcpy(bytes + 16 * (size_t)i, &address, 8);
        memcpy(bytes + 16 * (size_t)i + 8, &offset, 8);
    }
    if (known != NULL) {
        /* The caller's dict holds bytes keys only: the lookup hashes and compares in C. */
        is_known = PyDict_Contains(known, key);
        if (is_known < 0) {
            goto fail;
        }
    }
    if (is_known) {
        /* The caller has this stack already: its frames stay in the buffer, whose clear
         * releases them, and the sample costs no tuples of frames. */
        PyTuple_SET_ITEM(item, 4, Py_NewRef(Py_None));
        PyTuple_SET_ITEM(item, 5, Py_NewRef(Py_None));
    }
    else {
        if ((codes = PyTuple_New(rec->nframes)) == NULL) {
            goto fail;
        }
        PyTuple_SET_ITEM(item, 4, codes);
        if ((lastis = PyTuple_New(rec->nframes)) == NULL) {
            goto fail;
        }
        PyTuple_SET_ITEM(item, 5, lastis);
        for (i = 0; i < rec->nframes; i++) {
            if ((value = PyLong_FromLong(frames[i].lasti)) == NULL) {
                goto fail;
            }
            PyTuple_SET_ITEM(lastis, i, value);
        }
        /* Nothing can fail from here: hand the references over. */
        for (i = 0; i < rec->nframes; i++) {
            PyTuple_SET_ITEM(codes, i, frames[i].code);
            frames[i].code = NULL;
        }
    }
    if (rec->labels != NULL) {
        PyTuple_SET_ITEM(item, 3, rec->labels);
        rec->labels = NULL;
    }
    else {
        PyTuple_SET_ITEM(item, 3, Py_NewRef(Py_None));
    }
    return item;
fail:
    /* The code slots of `codes` are still NULL: its dealloc skips them, the buffer keeps them. */
    Py_DECREF(item);
    return NULL;
}

/* The record of `buf` with this id, or -1: ids grow with the records' order (each recorded
 * sample takes the next one), so a binary search finds it. */
static int64_t
record_with_id(const buffer_t *buf, uint64_t id)
{
    uint32_t low = 0, high = buf->nrecords;
    if (high == 0 || id < buf->records[0].id || id > buf->records[high - 1].id) {
        return -1;
    }
    while (low < high) {
        uint32_t mid = low + (high - low) / 2;
        uint64_t at = buf->records[mid].id;
        if (at == id) {
            return (int64_t)mid;
        }
        if (at < id) {
            low = mid + 1;
        }
        else {
            high = mid;
        }
    }
    return -1;
}

static uint64_t
record_hash(const buffer_t *buf, const record_t *rec)
{
    const raw_frame_t *frames = &buf->frames[rec->first_frame];
    uint64_t h = (uint64_t)(uintptr_t)rec->labels ^ rec->nframes ^ ((uint64_t)rec->truncated << 17);
    h *= 0x9E3779B97F4A7C15ULL;
    for (uint16_t i = 0; i < rec->nframes; i++) {
        h = (h ^ (uint64_t)(uintptr_t)frames[i].code) * 0x100000001B3ULL;
        h = (h ^ (uint64_t)(uint32_t)frames[i].lasti) * 0x100000001B3ULL;
    }
    return h ^ (h >> 29);
}

/* Whether two records have the same labels object and the same stack. */
static int
same_group(const buffer_t *buf, const record_t *a, const record_t *b)
{
    const raw_frame_t *fa = &buf->frames[a->first_frame], *fb = &buf->frames[b->first_frame];
    if (a->labels != b->labels || a->nframes != b->nframes || a->truncated != b->truncated) {
        return 0;
    }
    for (uint16_t i = 0; i < a->nframes; i++) {
        if (fa[i].code != fb[i].code || fa[i].lasti != fb[i].lasti) {
            return 0;
        }
    }
    return 1;
}

/* Fill `drained` for the records of `buf`: each one's estimate (the unbiased inverse of its
 * sampling probability), whether its block was freed before this drain (those frees are taken
 * out of the buffer's list: the caller never tracked them), and which records merge into an
 * earlier one. Blocks freed before the drain saw them (asyncio's 256 KiB read buffer, shrunk
 * as soon as it is read, is one on about every other response) are never in use at a window:
 * those of one stack and one labels object become one record, their estimates summed, so the
 * caller turns one tuple into an estimate where it turned dozens. Returns -1 (MemoryError set)
 * when its scratch table cannot be allocated. */
static int
group_records(buffer_t *buf, drained_t *drained)
{
    uint32_t n = buf->nrecords, kept = 0, size = 1, mask;
    uint32_t *slots;
    for (uint32_t i = 0; i < buf->nfreed; i++) {
        int64_t at = record_with_id(buf, buf->freed[i]);
        if (at >= 0) {
            drained[at].gone = 1;
        }
        else {
            buf->freed[kept++] = buf->freed[i];
        }
    }
    buf->nfreed = kept;
    while (size < 2 * n) {
        size <<= 1;
    }
    mask = size - 1;
    slots = PyMem_RawMalloc(sizeof(uint32_t) * size);
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(slots, 0xFF, sizeof(uint32_t) * size);  /* UINT32_MAX: an empty slot */
    for (uint32_t i = 0; i < n; i++) {
        record_t *rec = &buf->records[i];
        drained[i].objects = sampled_blocks(rec->size);
        drained[i].nbytes = (double)rec->size * drained[i].objects;
        if (rec->tracked && !drained[i].gone) {
            continue;  /* in use: handed over alone, with its id, for its free to find it */
        }
        for (uint32_t slot = (uint32_t)record_hash(buf, rec) & mask;; slot = (slot + 1) & mask) {
            uint32_t first = slots[slot];
            if (first == UINT32_MAX) {
                slots[slot] = i;
                break;
            }
            if (same_group(buf, &buf->records[first], rec)) {
                drained[first].objects += drained[i].objects;
                drained[first].nbytes += drained[i].nbytes;
                drained[i].merged = 1;
                break;
            }
        }
    }
    PyMem_RawFree(slots);
    return 0;
}

PyDoc_STRVAR(drain_doc,
"drain(known=None, /) -> tuple[list[tuple[int, int, bool, object, tuple[CodeType, ...] | None, tuple[int, ...] | None, bool, bytes, float, float]], list[int]]\n"
"--\n"
"\n"
"The samples taken and the sampled blocks freed since the last call.\n"
"\n"
"Each sample is (id, size, tracked, labels, codes, lastis, truncated, key, objects, nbytes):\n"
"codes and lastis are its stack, leaf first; key the same stack as bytes (code addresses and\n"
"offsets); objects and nbytes what it stands for (scaled by the inverse of its sampling\n"
"probability); tracked whether its block is still in use. Samples whose blocks are no longer\n"
"in use, of one stack and one labels object, come as one, their objects and bytes summed (its\n"
"id and size are its first block's). With ``known``, a dict keyed by stack keys, a sample\n"
"whose key is in it has None for codes and lastis: the caller has that stack already. Frees\n"
"list the ids of tracked samples (reported by an earlier drain) whose block was freed. The\n"
"calling thread's allocations are not sampled while this runs.");

static PyObject *
alloc_drain(PyObject *Py_UNUSED(module), PyObject *args)
{
    buffer_t *retired;
    PyObject *samples = NULL, *freed = NULL, *result, *known = NULL;
    drained_t *drained = NULL;
    uint32_t i;
    int was_in_module;

    if (!PyArg_ParseTuple(args, "|O!:drain", &PyDict_Type, &known)) {
        return NULL;
    }
    if (current == NULL) {
        return Py_BuildValue("([][])");
    }
    /* Hooks write the other buffer from now on. This thread holds the GIL: no hook runs on
     * another thread until it lets go, and nothing below runs one on this thread's behalf. */
    retired = current;
    current = retired == &buffers[0] ? &buffers[1] : &buffers[0];
    if (spans != NULL) {
        span_sweep();
    }
    was_in_module = in_module;
    in_module = 1;
    samples = PyList_New(0);
    freed = PyList_New(0);
    if (samples == NULL || freed == NULL) {
        goto fail;
    }
    if (retired->nrecords > 0) {
        drained = PyMem_RawCalloc(retired->nrecords, sizeof(drained_t));
        if (drained == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        if (group_records(retired, drained) < 0) {
            goto fail;
        }
    }
    for (i = 0; i < retired->nrecords; i++) {
        PyObject *item;
        int status;
        if (drained[i].merged) {
            continue;  /* counted in its group's first record; buffer_clear releases it */
        }
        item = record_tuple(retired, &retired->records[i], &drained[i], known);
        if (item == NULL) {
            goto fail;
        }
        status = PyList_Append(samples, item);
        Py_DECREF(item);
        if (status < 0) {
            goto fail;
        }
    }
    for (i = 0; i < retired->nfreed; i++) {
        PyObject *id = PyLong_FromUnsignedLongLong(retired->freed[i]);
        int status;
        if (id == NULL) {
            goto fail;
        }
        status = PyList_Append(freed, id);
        Py_DECREF(id);
        if (status < 0) {
            goto fail;
        }
    }
    buffer_clear(retired);
    PyMem_RawFree(drained);
    in_module = was_in_module;
    result = PyTuple_Pack(2, samples, freed);
    Py_DECREF(samples);
    Py_DECREF(freed);
    return result;
fail:
    /* What was not handed over is released; those samples are lost (counted). The frees go
     * to the next drain: the caller holds those blocks in use until it learns of them. */
    n_dropped += retired->nrecords;
    for (i = 0; i < retired->nfreed; i++) {
        if (current->nfreed < max_freed) {
            current->freed[current->nfreed++] = retired->freed[i];
        }
        else {
            n_lost_frees++;
        }
    }
    retired->nfreed = 0;
    buffer_clear(retired);
    PyMem_RawFree(drained);
    in_module = was_in_module;
    Py_XDECREF(samples);
    Py_XDECREF(freed);
    return NULL;
}

PyDoc_STRVAR(take_span_doc,
"take_span(span_id) -> int\n"
"--\n"
"\n"
"The bytes the samples labelled ``span_id`` stand for since start() (drained or not), rounded,\n"
"and forget them: 0 when none was sampled or per-span totals are off.");

static PyObject *
alloc_take_span(PyObject *Py_UNUSED(module), PyObject *span)
{
    span_slot_t *slot;
    Py_hash_t hash;
    double bytes;
    if (!PyUnicode_CheckExact(span)) {
        PyErr_SetString(PyExc_TypeError, "span_id must be a str");
        return NULL;
    }
    if (spans == NULL || nspans == 0) {
        return PyLong_FromLong(0);
    }
    hash = PyObject_Hash(span);
    if (hash == -1) {
        return NULL;
    }
    slot = span_find(span, hash);
    if (slot->span == NULL) {
        return PyLong_FromLong(0);
    }
    bytes = slot->bytes;
    span_remove(slot);
    /* Rounded half to even, as Python's round(): the span's attribute is a whole count. */
    return PyLong_FromDouble(nearbyint(bytes));
}

PyDoc_STRVAR(ignore_thread_doc,
"ignore_thread(ignore) -> bool\n"
"--\n"
"\n"
"Whether the calling thread's allocations are left unsampled from now on (the sampler's own\n"
"work); returns the previous setting. Frees are still seen.");

static PyObject *
alloc_ignore_thread(PyObject *Py_UNUSED(module), PyObject *arg)
{
    int ignore = PyObject_IsTrue(arg);
    int previous = in_module;
    if (ignore < 0) {
        return NULL;
    }
    in_module = ignore;
    return PyBool_FromLong(previous);
}

PyDoc_STRVAR(ignore_leaf_doc,
"ignore_leaf(code) -> None\n"
"--\n"
"\n"
"Leave unsampled the allocations made while ``code`` runs in the leaf Python frame: the CPU\n"
"sampler's signal handler, at whose edges the interpreter runs pending work (a collection's\n"
"finalizers) that is nobody's. ``None``: sample them all again.");

static PyObject *
alloc_ignore_leaf(PyObject *Py_UNUSED(module), PyObject *arg)
{
    if (arg != Py_None && !PyCode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "ignore_leaf: expected a code object or None, got %.100s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    /* The old reference goes last: its release may free through the hooks, which read this. */
    Py_XSETREF(ignored_leaf, arg == Py_None ? NULL : Py_NewRef(arg));
    Py_RETURN_NONE;
}

PyDoc_STRVAR(stats_doc,
"stats() -> dict[str, int]\n"
"--\n"
"\n"
"Counters since start(): samples, dropped, untracked, tracked (now), frees, lost_frees,\n"
"reentered, foreign, truncated, span_totals (now), span_full, span_expired; active, stuck,\n"
"cut_off (see check_hooks) and frees_via_raw (sampled blocks are freed through RAW, see the\n"
"module's source) as 0/1.");

static PyObject *
alloc_stats(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(args))
{
    check_cut_off();  /* so that `active` is not claimed for hooks nothing calls */
    return Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsKsKsisisisi}", "samples", (unsigned long long)n_samples, "dropped",
        (unsigned long long)n_dropped, "untracked", (unsigned long long)n_untracked, "tracked",
        (unsigned long long)ntracked, "frees", (unsigned long long)n_frees, "lost_frees",
        (unsigned long long)n_lost_frees, "probes", (unsigned long long)n_probes, "reentered", (unsigned long long)n_reentered,
        "foreign", (unsigned long long)n_foreign, "truncated", (unsigned long long)n_truncated,
        "span_totals", (unsigned long long)nspans, "span_full", (unsigned long long)n_span_full,
        "span_expired", (unsigned long long)n_span_expired, "active", active, "stuck", stuck,
        "cut_off", cut_off, "frees_via_raw", frees_via_raw);
}

PyDoc_STRVAR(allocator_doc,
"allocator(domain) -> tuple[int, int, int, int, int]\n"
"--\n"
"\n"
"Opaque numbers for the allocator now installed on ``domain`` (0 RAW, 1 MEM, 2 OBJ): the\n"
"addresses of its ctx, malloc, calloc, realloc and free. Equal tuples before start() and after\n"
"stop() mean the previous allocator is back.");

static PyObject *
alloc_allocator(PyObject *Py_UNUSED(module), PyObject *arg)
{
    long domain = PyLong_AsLong(arg);
    PyMemAllocatorEx now;
    if (domain == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (domain != PYMEM_DOMAIN_RAW && domain != PYMEM_DOMAIN_MEM && domain != PYMEM_DOMAIN_OBJ) {
        PyErr_SetString(PyExc_ValueError, "domain must be 0 (RAW), 1 (MEM) or 2 (OBJ)");
        return NULL;
    }
    PyMem_GetAllocator((PyMemAllocatorDomain)domain, &now);
    return Py_BuildValue("(KKKKK)", (unsigned long long)(uintptr_t)now.ctx,
                         (unsigned long long)(uintptr_t)now.malloc,
                         (unsigned long long)(uintptr_t)now.calloc,
                         (unsigned long long)(uintptr_t)now.realloc,
                         (unsigned long long)(uintptr_t)now.free);
}

PyDoc_STRVAR(addr2line_doc,
"addr2line(code, lasti) -> int\n"
"--\n"
"\n"
"The source line of the instruction at byte offset ``lasti`` of ``code`` (its first line when\n"
"``lasti`` is negative or has no line).");

/* The source line of the instruction at byte offset `lasti` of `code`: its first line when
 * `lasti` is negative or has no line. */
static int
code_line(PyCodeObject *code, int lasti)
{
    int line = lasti < 0 ? -1 : PyCode_Addr2Line(code, lasti);
    return line < 0 ? code->co_firstlineno : line;
}

static PyObject *
alloc_addr2line(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *code;
    int lasti;
    if (!PyArg_ParseTuple(args, "O!i:addr2line", &PyCode_Type, &code, &lasti)) {
        return NULL;
    }
    return PyLong_FromLong(code_line((PyCodeObject *)code, lasti));
}

/* The most frames stack_key() and stack_frame_ids() read (the CPU sampler's MAX_DEPTH). */
#define STACK_KEY_MAX 256

/* The stack from `frame_obj` outwards into key[]: per frame, leaf first, its code object's
 * address and its last instruction's byte offset (-1 before its first). Returns the number of
 * frames read, or -1 for a frame that has returned (3.11+: its frame object holds a copy whose
 * link to the caller is gone), or -2 with a RuntimeError naming `name` on an interpreter whose
 * frames this module cannot read. No allocation or Python call but for that error. */
static Py_ssize_t
read_stack(const char *name, PyObject *frame_obj, Py_ssize_t max, int64_t *key)
{
    Py_ssize_t n = 0;
    (void)name;  /* only the unknown layout's error names the caller */
#if PY_VERSION_HEX < 0x030B0000
    for (PyFrameObject *frame = (PyFrameObject *)frame_obj; frame != NULL && n < max;
         frame = frame->f_back) {
        key[2 * n] = (int64_t)(uintptr_t)frame->f_code;
        key[2 * n + 1] = frame->f_lasti < 0 ? -1 : frame->f_lasti * (int64_t)sizeof(_Py_CODEUNIT);
        n++;
    }
#elif ALLOC_FRAMES_KNOWN
    PyCodeObject *code;
    _PyInterpreterFrame *frame = ((PyFrameObject *)frame_obj)->f_frame;
    if (frame->owner == FRAME_OWNED_BY_FRAME_OBJECT) {
        return -1;
    }
    frame = shown_frame(frame, &code);
    for (; frame != NULL && n < max; frame = shown_frame(frame->previous, &code)) {
        int lasti = _PyInterpreterFrame_LASTI(frame);
        key[2 * n] = (int64_t)(uintptr_t)code;
        key[2 * n + 1] = lasti < 0 ? -1 : lasti * (int64_t)sizeof(_Py_CODEUNIT);
        n++;
    }
#else
    (void)frame_obj;
    (void)max;
    (void)key;
    PyErr_Format(PyExc_RuntimeError, "%s: this CPython's frame layout is not known", name);
    return -2;
#endif
    return n;
}

/* The (frame, max_frames) arguments both functions take: max_frames in *max, or -1 with an
 * exception set. */
static int
stack_arguments(const char *name, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
                Py_ssize_t *max)
{
    if (nargs != want || !PyFrame_Check(args[0]) || !PyLong_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "%s: wrong arguments (see its docstring)", name);
        return -1;
    }
    *max = PyLong_AsSsize_t(args[1]);
    if (*max == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (*max < 0 || *max > STACK_KEY_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: max_frames must be 0 to %d", name, STACK_KEY_MAX);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(stack_key_doc,
"stack_key(frame, max_frames, /) -> bytes | None\n"
"--\n"
"\n"
"The stack from ``frame`` outwards (leaf first, at most ``max_frames`` frames, the ones\n"
"``f_back`` walks) as bytes: each frame's code object address and last instruction offset.\n"
"While those code objects live, equal keys are equal stacks. None for a frame that has\n"
"returned (3.11+). The CPU sampler's signal handler looks its stack ids up by it instead of\n"
"walking ``f_back`` in Python.");

static PyObject *
alloc_stack_key(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    /* Filled on the C stack: the handler calls this on every tick. */
    int64_t key[2 * STACK_KEY_MAX];
    Py_ssize_t n, max;
    if (stack_arguments("stack_key", args, nargs, 2, &max) < 0) {
        return NULL;
    }
    n = read_stack("stack_key", args[0], max, key);
    if (n == -2) {
        return NULL;
    }
    if (n == -1) {
        Py_RETURN_NONE;
    }
    return PyBytes_FromStringAndSize((const char *)key, n * 2 * (Py_ssize_t)sizeof(int64_t));
}

PyDoc_STRVAR(stack_frame_ids_doc,
"stack_frame_ids(frame, max_frames, frame_ids, /) -> tuple[int, ...] | list | None\n"
"--\n"
"\n"
"The stack from ``frame`` outwards (as ``stack_key`` reads it) as the frame ids ``frame_ids``\n"
"maps each frame's ``(id(code), lasti)`` to: a tuple when every frame has one, else a list\n"
"holding ``(code, lasti, line)`` where a frame has none, for the caller to intern. None for a\n"
"frame that has returned (3.11+). The CPU sampler's walk of a stack its key cache missed,\n"
"without making a frame object for each caller as ``f_back`` does.");

static PyObject *
alloc_stack_frame_ids(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    int64_t key[2 * STACK_KEY_MAX];
    Py_ssize_t n, max, missing = 0;
    PyObject *ids, *result;
    if (stack_arguments("stack_frame_ids", args, nargs, 3, &max) < 0) {
        return NULL;
    }
    if (!PyDict_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "stack_frame_ids: frame_ids must be a dict");
        return NULL;
    }
    n = read_stack("stack_frame_ids", args[0], max, key);
    if (n == -2) {
        return NULL;
    }
    if (n == -1) {
        Py_RETURN_NONE;
    }
    ids = PyList_New(n);
    if (ids == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* The code objects are the running frames' (borrowed): alive while we hold the GIL. */
        PyObject *code = (PyObject *)(uintptr_t)key[2 * i];
        PyObject *lasti = PyLong_FromLongLong(key[2 * i + 1]);
        PyObject *address, *pair, *fid;
        if (lasti == NULL) {
            goto error;
        }
        address = PyLong_FromVoidPtr(code);  /* what id(code) returns */
        if (address == NULL) {
            Py_DECREF(lasti);
            goto error;
        }
        pair = PyTuple_New(2);
        if (pair == NULL) {
            Py_DECREF(address);
            Py_DECREF(lasti);
            goto error;
        }
        PyTuple_SET_ITEM(pair, 0, address);  /* steals */
        PyTuple_SET_ITEM(pair, 1, lasti);
        fid = PyDict_GetItemWithError(args[2], pair);  /* borrowed */
        if (fid != NULL) {
            Py_DECREF(pair);
            Py_INCREF(fid);
            PyList_SET_ITEM(ids, i, fid);
            continue;
        }
        if (PyErr_Occurred()) {
            Py_DECREF(pair);
            goto error;
        }
        /* Not interned yet: hand the frame over as the caller's tables take a raw one. */
        {
            int line = code_line((PyCodeObject *)code, (int)key[2 * i + 1]);
            PyObject *raw = Py_BuildValue("(OOi)", code, PyTuple_GET_ITEM(pair, 1), line);
            Py_DECREF(pair);
            if (raw == NULL) {
                goto error;
            }
            PyList_SET_ITEM(ids, i, raw);
            missing++;
        }
    }
    if (missing) {
        return ids;
    }
    result = PyList_AsTuple(ids);
    Py_DECREF(ids);
    return result;
error:
    Py_DECREF(ids);
    return NULL;
}

#ifdef ALLOC_TIMER_ARM
PyDoc_STRVAR(timer_arm_doc,
"timer_arm(timer_id, value_ns, interval_ns, /) -> bool\n"
"--\n"
"\n"
"timer_settime(timer_id, 0, {value_ns, interval_ns}): fire after value_ns (at least 1 ns), then\n"
"every interval_ns (0: once). False if the kernel refused; it never raises for that, since the\n"
"CPU sampler's signal handler re-arms its timer with it on every tick (through ctypes that\n"
"took several microseconds).");

static PyObject *
alloc_timer_arm(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    struct itimerspec spec;
    long long timer_id, value, interval;
    if (nargs != 3 || !PyLong_Check(args[0]) || !PyLong_Check(args[1]) ||
        !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "timer_arm(timer_id, value_ns, interval_ns): three ints");
        return NULL;
    }
    timer_id = PyLong_AsLongLong(args[0]);
    if (timer_id == -1 && PyErr_Occurred()) {
        return NULL;
    }
    value = PyLong_AsLongLong(args[1]);
    if (value == -1 && PyErr_Occurred()) {
        return NULL;
    }
    interval = PyLong_AsLongLong(args[2]);
    if (interval == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (timer_id < 0 || timer_id > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "timer_arm: not a timer id");
        return NULL;
    }
    if (value < 1) {
        value = 1;  /* zero would disarm it */
    }
    if (interval < 0) {
        interval = 0;
    }
    spec.it_value.tv_sec = (time_t)(value / 1000000000LL);
    spec.it_value.tv_nsec = (long)(value % 1000000000LL);
    spec.it_interval.tv_sec = (time_t)(interval / 1000000000LL);
    spec.it_interval.tv_nsec = (long)(interval % 1000000000LL);
    return PyBool_FromLong(syscall(SYS_timer_settime, (int)timer_id, 0, &spec, NULL) == 0);
}
#endif

static PyMethodDef alloc_methods[] = {
    {"stack_key", (PyCFunction)(void (*)(void))alloc_stack_key, METH_FASTCALL, stack_key_doc},
    {"stack_frame_ids", (PyCFunction)(void (*)(void))alloc_stack_frame_ids, METH_FASTCALL,
     stack_frame_ids_doc},
#ifdef ALLOC_TIMER_ARM
    {"timer_arm", (PyCFunction)(void (*)(void))alloc_timer_arm, METH_FASTCALL, timer_arm_doc},
#endif
    {"unsupported", alloc_unsupported, METH_NOARGS, unsupported_doc},
    {"start", alloc_start, METH_VARARGS, start_doc},
    {"stop", alloc_stop, METH_NOARGS, stop_doc},
    {"drain", alloc_drain, METH_VARARGS, drain_doc},
    {"stats", alloc_stats, METH_NOARGS, stats_doc},
    {"check_hooks", alloc_check_hooks, METH_NOARGS, check_hooks_doc},
    {"take_span", alloc_take_span, METH_O, take_span_doc},
    {"ignore_thread", alloc_ignore_thread, METH_O, ignore_thread_doc},
    {"ignore_leaf", alloc_ignore_leaf, METH_O, ignore_leaf_doc},
    {"allocator", alloc_allocator, METH_O, allocator_doc},
    {"addr2line", alloc_addr2line, METH_VARARGS, addr2line_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(module_doc,
"Allocation sampling for spanprof's memory profiles: a hook on CPython's object allocator\n"
"records the stack and the labels of about one block per ``mean_bytes`` allocated. Also three\n"
"steps of the CPU sampler's signal handler, in C for speed: stack_key, stack_frame_ids and\n"
"timer_arm.");

static struct PyModuleDef alloc_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "spanprof._profiling._samplers._alloc",
    .m_doc = module_doc,
    .m_size = -1,  /* process-wide state: single-phase init, never in an isolated interpreter */
    .m_methods = alloc_methods,
};

PyMODINIT_FUNC
PyInit__alloc(void)
{
    return PyModule_Create(&alloc_module);
}
