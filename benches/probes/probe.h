/* What the C probes here share: a monotonic clock in seconds, and binding this process to one
 * core. Each probe is one file built alone (`cc -O2 -o NAME benches/probes/NAME.c`). */
#ifndef FERROCOMM_PROBE_H
#define FERROCOMM_PROBE_H
#define _GNU_SOURCE
#include <sched.h>
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

#endif
