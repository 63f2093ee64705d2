/* read_pattern.h - what the memory gives the grouped GEMMs' weight reads
 * alone (read_pattern.cu), for bench_gemm --reads. */
#ifndef MOKK_TESTS_READ_PATTERN_H
#define MOKK_TESTS_READ_PATTERN_H

#ifdef __cplusplus
extern "C" {
#endif

/* How the bytes are read: the copy engine's boxes of 64 k x `rows` rows of
 * a [E, N, K] bf16 tensor, as the GEMMs' producer reads a weight tile, or
 * the same bytes as contiguous bulk copies of a box's size. */
enum { READS_BOXES, READS_BULK };

/* Median ms of `iters` passes over E x N x K bf16 (allocated here) by one
 * block an SM, each streaming its units (an expert's n-tile of `rows` rows,
 * k-block after k-block) through `stages` shared-memory stages with nothing
 * computed; 0 when it cannot run (a message in err). */
double read_pattern_time(int mode, int E, int N, int K, int rows, int stages, int iters,
                         char *err, int errlen);

#ifdef __cplusplus
}
#endif

#endif
