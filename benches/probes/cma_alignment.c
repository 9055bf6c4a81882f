/* One process copies SIZE bytes out of another with process_vm_readv, as a shared-memory
 * receiver takes a message by reference (host/net/links/pull.rs), from offset SRC_OFF in the
 * source's pages to offset DST_OFF in its own, ITERS times, and prints the best of 5 times per
 * copy. The two processes are bound to cores 0 and 1. It measured why ferrocomm-bench gives
 * every buffer a page of its own (crates/ferrocomm-bench/src/aligned.rs; docs/results/cpu.md,
 * "Buffers on a page in the bench"): offsets that differ within a cache line copy slower.
 *
 *   cc -O2 -o cma_alignment benches/probes/cma_alignment.c
 *   ./cma_alignment SIZE SRC_OFF DST_OFF ITERS
 */
#include "probe.h"
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s SIZE SRC_OFF DST_OFF ITERS\n", argv[0]);
        return 2;
    }
    size_t n = strtoul(argv[1], 0, 0), soff = strtoul(argv[2], 0, 0), doff = strtoul(argv[3], 0, 0);
    int iters = atoi(argv[4]);
    /* Mapped before the fork and never written after it, so the source's pages stay the
     * same pages in the child, whose memory is the one read. */
    char *src = mmap(0, n + 8192, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (src == MAP_FAILED) return 1;
    memset(src, 1, n + 8192);
    pid_t child = fork();
    if (child == 0) {
        bind_to(1);
        pause();
        return 0;
    }
    bind_to(0);
    char *dst = mmap(0, n + 8192, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (dst == MAP_FAILED) return 1;
    memset(dst, 0, n + 8192);
    struct iovec local = {dst + doff, n}, remote = {src + soff, n};
    for (int i = 0; i < 100; i++) process_vm_readv(child, &local, 1, &remote, 1, 0);
    double best = 1e9;
    for (int rep = 0; rep < 5; rep++) {
        double t = now();
        for (int i = 0; i < iters; i++) {
            if (process_vm_readv(child, &local, 1, &remote, 1, 0) != (ssize_t)n) {
                perror("process_vm_readv");
                kill(child, SIGKILL);
                return 1;
            }
        }
        t = (now() - t) / iters;
        if (t < best) best = t;
    }
    printf("size %zu src_off %zu dst_off %zu: %.2f us\n", n, soff, doff, best * 1e6);
    kill(child, SIGKILL);
    waitpid(child, 0, 0);
    return 0;
}
