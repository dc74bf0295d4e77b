#!/usr/bin/env bash
# What it costs two threads to swap the parts of a buffer they read: a buffer read by two OpenMP threads, each
# reading the same half at every pass, against the halves swapped at every pass (what dynamic tasks do to a
# product's rows from token to token). Near the L3's size the swapped halves may come from farther away (another
# core's L2 or L3 share, or DRAM); why the C products keep each thread's tasks for weights that fit the L3
# (`run_tasks`). Figures in benchmarks/RESULTS.md.
# Usage: bash benchmarks/l3_sharing.sh [MB ...]   (default 8 16 22 32 64; run nothing else meanwhile)
set -euo pipefail
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat >"$dir/l3_sharing.c" <<'EOF'
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int by_time(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
int main(int argc, char **argv)
{
    const long n = atol(argv[1]) * (1L << 20) / 4, passes = 200;
    float *x = aligned_alloc(64, n * 4), total = 0.f;
    for (long i = 0; i < n; i++) x[i] = 1.f;
    printf("%5s MB:", argv[1]);
    for (int swap = 0; swap < 2; swap++) {
        double seconds[200];
        for (long pass = 0; pass < passes; pass++) {
            const double start = now();
            #pragma omp parallel num_threads(2) reduction(+:total)
            {
                const long half = swap ? (omp_get_thread_num() + pass) % 2 : omp_get_thread_num();
                float sum[16] = {0};
                for (long i = half * (n / 2); i < (half + 1) * (n / 2); i += 16)
                    for (int j = 0; j < 16; j++) sum[j] += x[i + j];
                for (int j = 0; j < 16; j++) total += sum[j];
            }
            seconds[pass] = now() - start;
        }
        qsort(seconds, passes, sizeof(double), by_time);
        printf("  %s %6.1f GB/s", swap ? "halves swapped at every pass" : "each thread its own half", n * 4 / seconds[passes / 2] / 1e9);
    }
    printf("\n");
    return total == 0.f;
}
EOF
cc -O3 -march=native -fopenmp "$dir/l3_sharing.c" -o "$dir/l3_sharing"
echo "two threads reading a buffer, median of 200 passes:"
for size in ${*:-8 16 22 32 64}; do "$dir/l3_sharing" "$size"; done
