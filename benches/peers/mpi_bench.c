/* MPICH peer for ferrocomm-bench: times MPI_Allreduce, MPI_Allgather and MPI_Alltoall on f32
 * with the same size conventions, warm-up and timing as ferrocomm-bench (the slowest rank's
 * mean time per iteration), and writes the same JSON.
 *
 *   mpiexec -n N mpi_bench <all_reduce|all_gather|all_to_all> MIN MAX FACTOR ITERS WARMUP OUT.json
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double bus_factor(const char *op, int n) {
    if (!strcmp(op, "all_reduce")) return 2.0 * (n - 1) / n;
    return (double)(n - 1) / n;
}

static void run(const char *op, float *a, float *b, size_t count) {
    if (!strcmp(op, "all_reduce"))
        MPI_Allreduce(a, b, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else if (!strcmp(op, "all_gather"))
        MPI_Allgather(a, (int)count, MPI_FLOAT, b, (int)count, MPI_FLOAT, MPI_COMM_WORLD);
    else
        MPI_Alltoall(a, (int)count, MPI_FLOAT, b, (int)count, MPI_FLOAT, MPI_COMM_WORLD);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (argc != 8 || (strcmp(argv[1], "all_reduce") && strcmp(argv[1], "all_gather") && strcmp(argv[1], "all_to_all"))) {
        if (rank == 0) fprintf(stderr, "usage: mpi_bench <all_reduce|all_gather|all_to_all> MIN MAX FACTOR ITERS WARMUP OUT.json\n");
        MPI_Finalize();
        return 2;
    }
    const char *op = argv[1];
    size_t min = strtoull(argv[2], 0, 10), max = strtoull(argv[3], 0, 10), factor = strtoull(argv[4], 0, 10);
    int iters = atoi(argv[5]), warmup = atoi(argv[6]);
    int total_sizes = strcmp(op, "all_reduce") != 0; /* bytes = all ranks' blocks */
    float *a = malloc(max + 64), *b = malloc(max * (size_t)n + 64);
    if (!a || !b || factor < 2) MPI_Abort(MPI_COMM_WORLD, 1);
    memset(a, 0, max + 64);
    FILE *out = NULL;
    if (rank == 0) {
        out = fopen(argv[7], "w");
        if (!out) MPI_Abort(MPI_COMM_WORLD, 1);
        fprintf(out, "{\"tool\":\"mpich\",\"backend\":\"mpi\",\"op\":\"%s\",\"world\":%d,\"dtype\":\"f32\",\"redop\":\"sum\",\"rows\":[", op, n);
        printf("# mpi_bench %s, %d ranks, f32\n#       size         count     time(us)  algbw  busbw\n", op, n);
    }
    int first = 1;
    for (size_t bytes = min; bytes <= max; bytes *= factor) {
        size_t count = bytes / sizeof(float) / (total_sizes ? (size_t)n : 1);
        if (count == 0) continue;
        for (int i = 0; i < warmup; i++) run(op, a, b, count);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < iters; i++) run(op, a, b, count);
        double t = (MPI_Wtime() - t0) / iters, tmax;
        MPI_Allreduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (rank == 0) {
            double algbw = bytes / tmax / 1e9, busbw = algbw * bus_factor(op, n);
            printf("%12zu %13zu %12.2f %6.2f %6.2f\n", bytes, count, tmax * 1e6, algbw, busbw);
            fprintf(out, "%s{\"bytes\":%zu,\"count\":%zu,\"time_us\":%.3f,\"algbw\":%.4f,\"busbw\":%.4f,\"wrong\":0}",
                    first ? "" : ",", bytes, count, tmax * 1e6, algbw, busbw);
            first = 0;
        }
    }
    if (rank == 0) {
        fprintf(out, "]}\n");
        fclose(out);
    }
    free(a);
    free(b);
    MPI_Finalize();
    return 0;
}
