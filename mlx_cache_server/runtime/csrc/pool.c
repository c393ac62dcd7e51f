/* The workers spin a little after a task, since a decode step's next product follows
   within microseconds, then sleep on a futex so that an idle server costs nothing. While
   a product runs on the BLAS's own threads they sleep at once: spinning beside those
   threads on a machine with few cores slowed them.

   A task's chunks are taken one at a time by whichever thread is free, the caller among
   them, and the caller waits for the chunks, not for the workers: on two cores the
   Python thread building the next step's graph takes a core from time to time, and a
   worker it puts off no longer holds up the product it had a fixed part of. */
#define _GNU_SOURCE
#include "pool.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_PARTS 8
#define SPINS 20000

#if defined(__x86_64__) || defined(__i386__)
#define relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define relax() __asm__ volatile("yield")
#else
#define relax() ((void)0)
#endif

static int parts = 1;
static pthread_mutex_t busy = PTHREAD_MUTEX_INITIALIZER;
/* the latest task: written before its number is, read after it (`work`) */
static _Atomic(pool_task) current_fn;
static const void *_Atomic current_task;
static unsigned tasks;       /* the tasks posted, the latest's number; under `busy` */
static atomic_int generation; /* the latest task's number: what idle workers wait on */
/* The latest task's number, its chunks, and the next chunk to take, in one word: a
   worker that took a chunk took it from the task it read `current_*` for */
static _Atomic unsigned long long claims;
static atomic_int done, sleepers;
static atomic_int quiet; /* calls into another library's threads under way: no spinning */

static void futex(atomic_int *word, int op, int value) {
    syscall(SYS_futex, word, op, value, NULL, NULL, 0);
}

/* The next chunk of task `number`, or -1 once they are all taken or it is not the latest */
static int take(unsigned number) {
    unsigned long long c = atomic_load_explicit(&claims, memory_order_acquire);
    for (;;) {
        unsigned next = c & 0xffff, chunks = (c >> 16) & 0xffff;
        if ((unsigned)(c >> 32) != number || next >= chunks) return -1;
        if (atomic_compare_exchange_weak_explicit(&claims, &c, c + 1, memory_order_acq_rel,
                                                  memory_order_acquire))
            return (int)next;
    }
}

static void run_chunks(unsigned number, pool_task fn, const void *task) {
    for (int chunk; (chunk = take(number)) >= 0;) {
        fn(task, chunk);
        atomic_fetch_add_explicit(&done, 1, memory_order_release);
    }
}

static void *work(void *arg) {
    (void)arg;
    /* 0, not the latest task's number when this thread first runs: a task posted before
       then is still this worker's to help with */
    int seen = 0;
    for (;;) {
        for (int spins = 0; atomic_load_explicit(&generation, memory_order_acquire) == seen;) {
            if (++spins < SPINS && !atomic_load_explicit(&quiet, memory_order_relaxed)) {
                relax();
                continue;
            }
            atomic_fetch_add(&sleepers, 1);
            futex(&generation, FUTEX_WAIT_PRIVATE, seen);
            atomic_fetch_sub(&sleepers, 1);
            spins = 0;
        }
        seen = atomic_load_explicit(&generation, memory_order_acquire);
        /* read after the number: a later task's function and argument are only written
           once every chunk of this one is taken, and then `take` refuses */
        run_chunks((unsigned)seen, atomic_load_explicit(&current_fn, memory_order_relaxed),
                   atomic_load_explicit(&current_task, memory_order_relaxed));
    }
    return NULL;
}

/* A forked child has no workers: it runs every task alone. */
static void forked(void) { parts = 1; }

/* The workers start with the first task that can use them, not when the module is
   loaded: a process that imports it and never computes a product starts no thread. */
static pthread_once_t started = PTHREAD_ONCE_INIT;

static void start(void) {
    cpu_set_t cpus;
    int n = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
    /* as many as asked for, else as many as OpenBLAS is given (ranks sharing a machine
       each get a share of its cores), else every core this process may run on */
    const char *wanted = getenv("MLX_CACHE_SERVER_KERNEL_THREADS");
    if (!wanted || atoi(wanted) < 1) wanted = getenv("OPENBLAS_NUM_THREADS");
    if (wanted && atoi(wanted) > 0) n = atoi(wanted);
    n = n < 1 ? 1 : n > MAX_PARTS ? MAX_PARTS : n;
    pthread_atfork(NULL, NULL, forked);
    for (int i = 1; i < n; i++) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, work, NULL) != 0) break;
        pthread_detach(thread);
        parts = i + 1;
    }
}

int pool_parts(void) {
    pthread_once(&started, start);
    return parts;
}

void pool_run(pool_task fn, const void *task, int chunks) {
    pthread_once(&started, start); /* also orders this read of `parts` after its writes */
    if (parts == 1 || chunks < 2 || chunks > 0xffff || pthread_mutex_trylock(&busy) != 0) {
        for (int chunk = 0; chunk < chunks; chunk++) fn(task, chunk);
        return;
    }
    unsigned number = ++tasks;
    atomic_store_explicit(&current_fn, fn, memory_order_relaxed);
    atomic_store_explicit(&current_task, task, memory_order_relaxed);
    atomic_store_explicit(&done, 0, memory_order_relaxed);
    atomic_store_explicit(&claims, (unsigned long long)number << 32 | (unsigned)chunks << 16,
                          memory_order_release);
    atomic_store(&generation, (int)number); /* sequentially consistent with the sleepers' */
    if (atomic_load(&sleepers)) futex(&generation, FUTEX_WAKE_PRIVATE, MAX_PARTS);
    run_chunks(number, fn, task);
    while (atomic_load_explicit(&done, memory_order_acquire) < chunks) relax();
    pthread_mutex_unlock(&busy);
}

void pool_quiet(int begins) {
    atomic_fetch_add_explicit(&quiet, begins ? 1 : -1, memory_order_relaxed);
}

int mlxcs_pool_quiet(void) { return atomic_load(&quiet); }
