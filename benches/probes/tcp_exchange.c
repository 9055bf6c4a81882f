/* Two processes on loopback send each other SIZE bytes, ITERS times, through non-blocking
 * sockets, writing at most CAP bytes per call and reading between writes, as the CPU engine
 * does. MODE 1: one connection carries both directions; MODE 2: one connection per direction.
 * Prints the time per exchange. It measured why a ferrocomm TCP link has a second connection
 * (host/net/links/tcp.rs; docs/results/cpu.md, "Two connections per TCP link").
 *
 *   cc -O2 -o tcp_exchange benches/probes/tcp_exchange.c
 *   ./tcp_exchange MODE SIZE ITERS CAP
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static struct sockaddr_in loopback(int port) {
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    return a;
}

static int listen_any(int *port) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = loopback(0);
    socklen_t n = sizeof a;
    if (l < 0 || bind(l, (void *)&a, sizeof a) || listen(l, 4) || getsockname(l, (void *)&a, &n)) {
        perror("listen");
        exit(1);
    }
    *port = ntohs(a.sin_port);
    return l;
}

static int dial(int port) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = loopback(port);
    for (int tries = 0; connect(s, (void *)&a, sizeof a); tries++) {
        if (tries > 1000) {
            perror("connect");
            exit(1);
        }
        usleep(1000);
    }
    return s;
}

static void nonblocking_nodelay(int s) {
    int one = 1;
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fcntl(s, F_SETFL, O_NONBLOCK);
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODE(1|2) SIZE ITERS CAP\n", argv[0]);
        return 2;
    }
    int mode = atoi(argv[1]), iters = atoi(argv[3]);
    long size = atol(argv[2]), cap = atol(argv[4]);
    int p1, p2, l1 = listen_any(&p1), l2 = listen_any(&p2);
    pid_t child = fork();
    int me = child == 0;
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    CPU_SET(me, &cpus);
    sched_setaffinity(0, sizeof cpus, &cpus);
    int tx, rx;
    if (!me) {
        tx = rx = accept(l1, 0, 0);
        if (mode == 2) tx = dial(p2);
    } else {
        tx = rx = dial(p1);
        if (mode == 2) rx = accept(l2, 0, 0);
    }
    nonblocking_nodelay(tx);
    if (rx != tx) nonblocking_nodelay(rx);
    char *out = malloc(size), *in = malloc(size);
    memset(out, 1, size);
    double t0 = 0;
    for (int it = 0; it < iters + 10; it++) {
        if (it == 10) t0 = now_us();
        long w = 0, r = 0;
        while (w < size || r < size) {
            if (w < size) {
                long c = size - w < cap ? size - w : cap;
                ssize_t n = write(tx, out + w, c);
                if (n > 0) w += n;
            }
            if (r < size) {
                ssize_t n = read(rx, in + r, size - r);
                if (n > 0) r += n;
            }
        }
    }
    if (!me) printf("mode %d size %ld cap %ld: %.1f us\n", mode, size, cap, (now_us() - t0) / iters);
    if (child > 0) wait(0);
    return 0;
}
