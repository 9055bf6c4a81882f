/* What the C probes here share: a monotonic clock in seconds, binding this process to one
 * core, and a spin barrier of two processes. Each probe is one file built alone
 * (`cc -O2 -o NAME benches/probes/NAME.c`). */
#ifndef FERROCOMM_PROBE_H
#define FERROCOMM_PROBE_H
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void bind_to(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    sched_setaffinity(0, sizeof s, &s);
}

/* The two processes' barrier: two counters on a shared page (the probe maps it before it
 * forks), each on its own line; each side bumps its own and waits for the other's. */
static _Atomic long *sync_page;

static inline void barrier(int me, long round) {
    atomic_store_explicit(&sync_page[me * 8], round, memory_order_release);
    while (atomic_load_explicit(&sync_page[(1 - me) * 8], memory_order_acquire) < round) {
    }
}

#endif
