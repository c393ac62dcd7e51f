/* The workers spin a little after a part, since a decode step's next product follows
   within microseconds, then sleep on a futex so that an idle server costs nothing. While
   a product runs on the BLAS's own threads they sleep at once: spinning beside those
   threads on a machine with few cores slowed them. */
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
static pool_task current_fn;
static const void *current_task;
static atomic_int generation, pending, sleepers;
static atomic_int quiet; /* calls into another library's threads under way: no spinning */

static void futex(atomic_int *word, int op, int value) {
    syscall(SYS_futex, word, op, value, NULL, NULL, 0);
}

static void *work(void *arg) {
    /* 0, not the generation when this thread first runs: a task posted before then is
       still this worker's to run */
    int part = (int)(long)arg, seen = 0;
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
        current_fn(current_task, part, parts);
        atomic_fetch_sub_explicit(&pending, 1, memory_order_release);
    }
    return NULL;
}

/* A forked child has no workers: it runs every task alone. */
static void forked(void) { parts = 1; }

__attribute__((constructor)) static void start(void) {
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
        if (pthread_create(&thread, NULL, work, (void *)(long)i) != 0) break;
        pthread_detach(thread);
        parts = i + 1;
    }
}

int pool_parts(void) { return parts; }

void pool_run(pool_task fn, const void *task) {
    if (parts == 1 || pthread_mutex_trylock(&busy) != 0) {
        for (int part = 0; part < parts; part++) fn(task, part, parts);
        return;
    }
    current_fn = fn;
    current_task = task;
    atomic_store(&pending, parts - 1);
    atomic_fetch_add(&generation, 1); /* sequentially consistent with the sleepers' count */
    if (atomic_load(&sleepers)) futex(&generation, FUTEX_WAKE_PRIVATE, MAX_PARTS);
    fn(task, 0, parts);
    while (atomic_load_explicit(&pending, memory_order_acquire) > 0) relax();
    pthread_mutex_unlock(&busy);
}

void pool_quiet(int begins) {
    atomic_fetch_add_explicit(&quiet, begins ? 1 : -1, memory_order_relaxed);
}

int mlxcs_pool_quiet(void) { return atomic_load(&quiet); }
