/* A broadcast's receiver copies SIZE bytes out of its root's buffer with process_vm_readv (a
 * message by reference, host/net/links/pull.rs), the root waiting: one copy on one core. Or
 * the two split it: the receiver pulls the first half while the root pushes the second half
 * into the receiver's buffer with process_vm_writev, both cores copying at once. Each copy
 * starts when both processes have reached it (a spin barrier on a shared page) and ends when
 * both are done; ITERS copies, best of 5 runs, per copy. The processes are bound to cores 0
 * and 1. It measured the lead for broadcast between 2 ranks from 1 MiB, where the chain's two
 * copies in parallel beat one copy by reference (docs/results/cpu.md, part 25).
 *
 *   cc -O2 -o cma_split benches/probes/cma_split.c
 *   ./cma_split SIZE ITERS
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
    if (argc != 3) {
        fprintf(stderr, "usage: %s SIZE ITERS\n", argv[0]);
        return 2;
    }
    size_t n = strtoul(argv[1], 0, 0), half = n / 2 / 64 * 64;
    int iters = atoi(argv[2]);
    sync_page = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    /* At the same addresses in both processes (mapped before the fork): the root's buffer,
     * which the root fills, and the receiver's, which the receiver touches. */
    char *src = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *dst = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (sync_page == MAP_FAILED || src == MAP_FAILED || dst == MAP_FAILED) return 1;
    memset(sync_page, 0, 4096);
    pid_t root_pid = getpid();
    pid_t child = fork();
    int me = child == 0; /* 0: the root, 1: the receiver */
    pid_t peer = me ? root_pid : child;
    bind_to(me);
    if (me) memset(dst, 0, n); else memset(src, 7, n);
    long round = 0;
    for (int split = 0; split < 2; split++) {
        double best = 1e9;
        for (int rep = 0; rep < 6; rep++) {
            barrier(me, ++round);
            double t = now();
            for (int i = 0; i < iters; i++) {
                barrier(me, ++round);
                ssize_t want, got;
                if (me) {
                    size_t len = split ? half : n;
                    struct iovec local = {dst, len}, remote = {src, len};
                    want = len;
                    got = process_vm_readv(peer, &local, 1, &remote, 1, 0);
                } else if (split) {
                    struct iovec local = {src + half, n - half}, remote = {dst + half, n - half};
                    want = n - half;
                    got = process_vm_writev(peer, &local, 1, &remote, 1, 0);
                } else {
                    want = got = 0;
                }
                if (got != want) {
                    perror("process_vm_readv/writev");
                    return 1;
                }
                barrier(me, ++round);
            }
            t = (now() - t) / iters;
            if (rep > 0 && t < best) best = t; /* the first run warms up */
        }
        if (me) {
            int ok = 1;
            for (size_t i = 0; i < n; i += 4096) ok &= dst[i] == 7;
            printf("size %zu %s: %.2f us%s\n", n, split ? "split (pull half, push half)" : "pull all",
                   best * 1e6, ok ? "" : " (DATA WRONG)");
        }
    }
    if (!me) waitpid(child, 0, 0);
    return 0;
}
