/* Two processes, bound to cores 0 and 1, exchange SIZE bytes ITERS times, in two ways taken in
 * turn, ROUNDS times each: through shared memory, as the rings move a message (each copies its
 * buffer into a shared area the other reads, then copies the other's area out: two copies, the
 * second of lines the other core just wrote), and by reference, as pull.rs moves one (each
 * copies the other's buffer straight into its own with process_vm_readv: one copy). Prints the
 * time per exchange of each way in each round. Taken in turn, the two ways meet the same
 * phases of the machine; it measured why the choice between them cannot rest on a timing of
 * one process alone (docs/results/cpu.md, part 26).
 *
 *   cc -O2 -o shm_exchange benches/probes/shm_exchange.c
 *   ./shm_exchange SIZE ITERS ROUNDS
 */
#include "probe.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s SIZE ITERS ROUNDS\n", argv[0]);
        return 2;
    }
    size_t n = strtoul(argv[1], 0, 0);
    int iters = atoi(argv[2]), rounds = atoi(argv[3]);
    sync_page = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    /* Each side's shared area (written by it, read by the other), and its own buffers, mapped
     * before the fork: the same addresses in both processes. */
    char *area = mmap(0, 2 * n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    char *src = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *dst = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (sync_page == MAP_FAILED || area == MAP_FAILED || src == MAP_FAILED || dst == MAP_FAILED) return 1;
    memset(sync_page, 0, 4096);
    memset(area, 0, 2 * n);
    pid_t first = getpid(), child = fork();
    int me = child == 0;
    pid_t peer = me ? first : child;
    bind_to(me);
    memset(src, me + 1, n);
    memset(dst, 0, n);
    long round = 0;
    for (int r = 0; r < rounds; r++) {
        double took[2];
        for (int way = 0; way < 2; way++) {
            barrier(me, ++round);
            double t = now();
            for (int i = 0; i < iters; i++) {
                if (way == 0) {
                    memcpy(area + me * n, src, n);
                    barrier(me, ++round);
                    memcpy(dst, area + (1 - me) * n, n);
                } else {
                    struct iovec local = {dst, n}, remote = {src, n};
                    if (process_vm_readv(peer, &local, 1, &remote, 1, 0) != (ssize_t)n) {
                        perror("process_vm_readv");
                        return 1;
                    }
                }
                /* Neither side overwrites what the other may still be reading. */
                barrier(me, ++round);
            }
            took[way] = (now() - t) / iters * 1e6;
        }
        if (!me) {
            int ok = dst[0] == 2 && dst[n - 1] == 2;
            printf("size %zu round %d: through shared memory %.2f us, by reference %.2f us%s\n", n, r, took[0],
                   took[1], ok ? "" : " (DATA WRONG)");
        }
    }
    if (!me) waitpid(child, 0, 0);
    return 0;
}
