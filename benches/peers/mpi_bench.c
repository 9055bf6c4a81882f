/* MPI peer for ferrocomm-bench (built against MPICH or Open MPI; the JSON's "tool" says which):
 * times every collective the bench compares on f32 with ferrocomm-bench's size conventions
 * (nccl-tests': bytes is the per-rank buffer of all_reduce, broadcast and send_recv, the total
 * of all ranks' blocks for all_gather, reduce_scatter and all_to_all), warm-up and timing (the
 * slowest rank's mean time per iteration), and writes the same JSON.
 *
 *   mpiexec -n N mpi_bench OP OUT.json [--settle-ms=MS] MIN:MAX:FACTOR:ITERS:WARMUP [MIN:MAX:...]...
 *
 * --settle-ms: before the first size, 4-byte all_reduces until rank 0 has seen MS milliseconds
 * pass, as ferrocomm-bench --settle-ms (crates/ferrocomm-bench/src/settle.rs): with more ranks
 * than cores the scheduler may take 100-200 ms to spread them.
 *
 * OP: all_reduce, all_gather, reduce_scatter, all_to_all, broadcast (root 0) or send_recv (a
 * ring: each rank sends to the right and receives from the left, as the bench's). Several
 * sweeps run in one launch, so a sweep of small sizes can take more iterations than one of
 * large sizes without paying the launcher twice.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <unistd.h>

#if defined(OPEN_MPI)
#define TOOL "openmpi"
#elif defined(MPICH_VERSION)
#define TOOL "mpich"
#else
#define TOOL "mpi"
#endif

static const char *const OPS[] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"};

/* nccl-tests' bus bandwidth factor, as the bench's ops.rs. */
static double bus_factor(const char *op, int n) {
    if (!strcmp(op, "all_reduce")) return 2.0 * (n - 1) / n;
    if (!strcmp(op, "broadcast") || !strcmp(op, "send_recv")) return 1.0;
    return (double)(n - 1) / n;
}

/* Sizes that are all ranks' blocks together. */
static int total_sizes(const char *op) {
    return !strcmp(op, "all_gather") || !strcmp(op, "reduce_scatter") || !strcmp(op, "all_to_all");
}

/* MPICH 4.0.2 over UCX's TCP transport sometimes never returns from MPI_Finalize (every rank
 * waits in it, more often with more ranks than cores). The results are written by then, so a
 * rank still finalizing after FINALIZE_WAIT seconds leaves without it, with status 3. */
#define FINALIZE_WAIT 5
static void leave(int sig) {
    static const char msg[] = "mpi_bench: MPI_Finalize did not return; leaving without it\n";
    (void)sig;
    (void)!write(2, msg, sizeof msg - 1);
    _exit(3);
}

static void run(const char *op, float *a, float *b, int count, int rank, int n) {
    if (!strcmp(op, "all_reduce"))
        MPI_Allreduce(MPI_IN_PLACE, a, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else if (!strcmp(op, "all_gather"))
        MPI_Allgather(a, count, MPI_FLOAT, b, count, MPI_FLOAT, MPI_COMM_WORLD);
    else if (!strcmp(op, "reduce_scatter"))
        MPI_Reduce_scatter_block(a, b, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else if (!strcmp(op, "all_to_all"))
        MPI_Alltoall(a, count, MPI_FLOAT, b, count, MPI_FLOAT, MPI_COMM_WORLD);
    else if (!strcmp(op, "broadcast"))
        MPI_Bcast(a, count, MPI_FLOAT, 0, MPI_COMM_WORLD);
    else
        MPI_Sendrecv(a, count, MPI_FLOAT, (rank + 1) % n, 0, b, count, MPI_FLOAT, (rank + n - 1) % n, 0,
                     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n, known = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    for (size_t i = 0; argc > 1 && i < sizeof OPS / sizeof *OPS; i++) known |= !strcmp(argv[1], OPS[i]);
    size_t max = 0, s[16][5];
    int first_sweep = 3, settle_ms = 0;
    if (argc > 3 && !strncmp(argv[3], "--settle-ms=", 12)) {
        char *end;
        long ms = strtol(argv[3] + 12, &end, 10);
        if (*end || ms < 0 || ms > 600000) known = 0;
        settle_ms = (int)ms;
        first_sweep = 4;
    }
    int sweeps = argc - first_sweep;
    for (int i = 0; known && i < sweeps && i < 16; i++) {
        if (sscanf(argv[first_sweep + i], "%zu:%zu:%zu:%zu:%zu", &s[i][0], &s[i][1], &s[i][2], &s[i][3], &s[i][4]) != 5 ||
            s[i][2] < 2 || s[i][3] < 1)
            known = 0;
        else if (s[i][1] > max)
            max = s[i][1];
    }
    if (!known || sweeps < 1 || sweeps > 16) {
        if (rank == 0)
            fprintf(stderr, "usage: mpi_bench <all_reduce|all_gather|reduce_scatter|all_to_all|broadcast|send_recv> "
                            "OUT.json [--settle-ms=MS] MIN:MAX:FACTOR:ITERS:WARMUP...\n");
        MPI_Finalize();
        return 2;
    }
    const char *op = argv[1];
    /* Both buffers hold the largest size: no op reads or writes more than `bytes` on a side. */
    float *a = malloc(max + 64), *b = malloc(max + 64);
    if (!a || !b) MPI_Abort(MPI_COMM_WORLD, 1);
    memset(a, 0, max + 64);
    memset(b, 0, max + 64);
    FILE *out = NULL;
    if (rank == 0) {
        out = fopen(argv[2], "w");
        if (!out) MPI_Abort(MPI_COMM_WORLD, 1);
        fprintf(out, "{\"tool\":\"%s\",\"backend\":\"mpi\",\"op\":\"%s\",\"world\":%d,\"dtype\":\"f32\",\"redop\":\"sum\",\"rows\":[",
                TOOL, op, n);
        printf("# mpi_bench (%s) %s, %d ranks, f32\n#       size         count     time(us)  algbw  busbw\n", TOOL, op, n);
    }
    for (double until = MPI_Wtime() + settle_ms / 1e3, done = settle_ms == 0; !done;) {
        double mine = rank == 0 && MPI_Wtime() >= until;
        MPI_Allreduce(&mine, &done, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    }
    int first = 1;
    for (int i = 0; i < sweeps; i++) {
        size_t iters = s[i][3], warmup = s[i][4];
        for (size_t bytes = s[i][0]; bytes <= s[i][1]; bytes *= s[i][2]) {
            size_t count = bytes / sizeof(float) / (total_sizes(op) ? (size_t)n : 1);
            if (count == 0) continue;
            for (size_t k = 0; k < warmup; k++) run(op, a, b, (int)count, rank, n);
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            for (size_t k = 0; k < iters; k++) run(op, a, b, (int)count, rank, n);
            double t = (MPI_Wtime() - t0) / iters, tmax;
            MPI_Allreduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (rank == 0) {
                double algbw = bytes / tmax / 1e9, busbw = algbw * bus_factor(op, n);
                printf("%12zu %13zu %12.2f %6.2f %6.2f\n", bytes, count, tmax * 1e6, algbw, busbw);
                fprintf(out, "%s{\"bytes\":%zu,\"count\":%zu,\"time_us\":%.3f,\"algbw\":%.6g,\"busbw\":%.6g,\"wrong\":0}",
                        first ? "" : ",", bytes, count, tmax * 1e6, algbw, busbw);
                first = 0;
            }
        }
    }
    if (rank == 0) {
        fprintf(out, "]}\n");
        fclose(out);
    }
    free(a);
    free(b);
    signal(SIGALRM, leave);
    alarm(FINALIZE_WAIT);
    MPI_Finalize();
    return 0;
}
