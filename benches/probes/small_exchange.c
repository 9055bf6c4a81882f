/* Two processes, bound to cores 0 and 1, exchange one small message ITERS times (each sends
 * SIZE bytes to the other, then waits for the other's), in two ways taken in turn, ROUNDS times
 * each, and print the time per exchange of each way in each round:
 *
 * - "counter": as the rings send a message (host/net/links/ring.rs): the bytes on a line of
 *   the ring, then the producer's `tail` counter, on a line of its own, published; the reader
 *   waits on `tail`, then reads the line of bytes.
 * - "flag": the message's line carries its own sequence word, stored last; the reader waits on
 *   that word and finds the bytes in the same line (the way of NCCL's low-latency protocol and
 *   Open MPI's fast boxes).
 *
 * It measures how much of a small call's time between two processes the ring's way of
 * publishing costs on this machine, apart from everything else a call does.
 *
 *   cc -O2 -o small_exchange benches/probes/small_exchange.c
 *   ./small_exchange SIZE ITERS ROUNDS       (SIZE at most 56)
 */
#include "probe.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define LINES 64 /* lines per ring: 4 KiB, as a ring's first page */

/* One direction: a control line with `tail`, then the ring's lines. */
struct ring {
    _Atomic unsigned long tail;
    char pad[56];
    unsigned char line[LINES][64];
};

static void send_counter(struct ring *r, unsigned long seq, const unsigned char *msg, size_t n) {
    memcpy(r->line[seq % LINES], msg, n);
    atomic_store_explicit(&r->tail, seq + 1, memory_order_release);
}

static void recv_counter(struct ring *r, unsigned long seq, unsigned char *out, size_t n) {
    while (atomic_load_explicit(&r->tail, memory_order_acquire) <= seq) {
        __builtin_ia32_pause();
    }
    memcpy(out, r->line[seq % LINES], n);
}

/* The sequence word is the line's last 8 bytes; seq + 1, so a zeroed line holds none. */
static _Atomic unsigned long *flag_of(struct ring *r, unsigned long seq) {
    return (_Atomic unsigned long *)(r->line[seq % LINES] + 56);
}

static void send_flag(struct ring *r, unsigned long seq, const unsigned char *msg, size_t n) {
    memcpy(r->line[seq % LINES], msg, n);
    atomic_store_explicit(flag_of(r, seq), seq + 1, memory_order_release);
}

static void recv_flag(struct ring *r, unsigned long seq, unsigned char *out, size_t n) {
    while (atomic_load_explicit(flag_of(r, seq), memory_order_acquire) != seq + 1) {
        __builtin_ia32_pause();
    }
    memcpy(out, r->line[seq % LINES], n);
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s SIZE ITERS ROUNDS\n", argv[0]);
        return 2;
    }
    size_t n = strtoul(argv[1], 0, 0);
    long iters = atol(argv[2]);
    int rounds = atoi(argv[3]);
    if (n > 56 || iters < 1 || iters % LINES) {
        fprintf(stderr, "SIZE at most 56, ITERS a multiple of %d\n", LINES);
        return 2;
    }
    sync_page = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    /* Rings [way][to rank], mapped before the fork. The reader frees a line by reading it: the
     * writer is never more than one message ahead, since each waits for the other's. */
    struct ring *rings = mmap(0, 4 * sizeof(struct ring), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sync_page == MAP_FAILED || rings == MAP_FAILED) return 1;
    memset(sync_page, 0, 4096);
    memset(rings, 0, 4 * sizeof(struct ring));
    pid_t child = fork();
    int me = child == 0;
    bind_to(me);
    unsigned char msg[56], got[56];
    memset(msg, me + 1, sizeof msg);
    long round = 0;
    unsigned long seq[2] = {0, 0};
    for (int r = 0; r < rounds; r++) {
        for (int way = 0; way < 2; way++) {
            struct ring *out = &rings[way * 2 + (1 - me)], *in = &rings[way * 2 + me];
            barrier(me, ++round);
            double t0 = now();
            for (long i = 0; i < iters; i++, seq[way]++) {
                if (way == 0) {
                    send_counter(out, seq[way], msg, n);
                    recv_counter(in, seq[way], got, n);
                } else {
                    send_flag(out, seq[way], msg, n);
                    recv_flag(in, seq[way], got, n);
                }
                if (got[0] != 2 - me) return 3; /* the peer's bytes, or the probe is wrong */
            }
            double t = (now() - t0) / iters * 1e6;
            barrier(me, ++round);
            if (me == 0) printf("round %d %-8s %zu B: %.3f us per exchange\n", r, way ? "flag" : "counter", n, t);
        }
    }
    if (child) wait(0);
    return 0;
}
