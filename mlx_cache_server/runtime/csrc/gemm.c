/* The products of a decode step, for our primitives (`block.cpp`).

   A decode step multiplies a few rows by each weight matrix, and a BLAS's sgemm packs
   the whole weight into blocks before it multiplies: for one row that copy costs as much
   as the product. `mlxcs_sgemm` takes sgemm's arguments; a product of at most MAX_ROWS
   rows by a transposed matrix (x @ W.T) reads each row of W once, for every row of x, on
   every core, and any other call goes on to `cblas_sgemm`: the process's BLAS, OpenBLAS
   where it was loaded before MLX (`blas.py`), else the one MLX's library links. Nothing
   here replaces a symbol of another library.

   A row's result does not depend on the rows beside it or on the number of cores: each
   output is summed in the same order whatever the call's shape, so a row decoded alone
   and the same row in a batch or a draft's pass get the same bits. */
#include <stdatomic.h>
#include <stdlib.h>

#include "gemm.h"
#include "pool.h"
#include "vec.h"

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
#define MAX_ROWS 64
/* W's rows this far ahead are fetched into L2 while these are multiplied: the hardware
   prefetcher alone leaves the loads waiting (into L1 instead, the rows ahead evict the
   rows at hand) */
#define AHEAD 16
#define CHUNKS 8          /* a product's chunks at most */
#define MIN_CHUNK_ROWS 64 /* and W's rows in one at least */
#define MIN_WEIGHTS 65536 /* smaller products stay with the BLAS: no cores to wake */

struct product {
    int m, n, k, lda, ldb, ldc;
    float alpha, beta;
    const float *a, *b;
    float *c;
};

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc);

static atomic_long calls; /* products computed here, for tests and the startup log */

long mlxcs_gemm_calls(void) { return atomic_load(&calls); }
int mlxcs_gemm_max_rows(void) { return MAX_ROWS; }

static inline __attribute__((always_inline)) void finish(const struct product *p, int m,
                                                         int n, vec acc) {
    const float *x = p->a + (long)m * p->lda, *w = p->b + (long)n * p->ldb;
    float s = vsum(acc);
    for (int k = p->k / LANES * LANES; k < p->k; k++) s += x[k] * w[k];
    float *out = p->c + (long)m * p->ldc + n;
    /* beta 0 means C is not read (it may hold anything), as in BLAS */
    *out = p->beta == 0 ? p->alpha * s : p->alpha * s + p->beta * *out;
}

#ifdef __AVX512F__
/* A vector is one register of 32: four rows of x by four of W fit, each loaded once a
   step (GCC otherwise folds the loads into the multiply-adds, a load for each). */
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#else
/* A vector is two or four registers: a 4 by 4 tile would not fit. */
#define IN_REGISTER(v) ((void)0)
#endif

/* R rows of x from m against C rows of W from n, in registers */
#define TILE(R, C)                                                                   \
    static void tile_##R##_##C(const struct product *p, int m, int n, int fetch) {  \
        const float *x = p->a + (long)m * p->lda, *w = p->b + (long)n * p->ldb;      \
        const long lda = p->lda, ldb = p->ldb;                                       \
        const int whole = p->k / LANES * LANES;                                      \
        vec acc[R][C];                                                               \
        for (int r = 0; r < R; r++)                                                  \
            for (int c = 0; c < C; c++) acc[r][c] = (vec){0};                        \
        for (int k = 0; k < whole; k += LANES) {                                     \
            vec wk[C], xk[R];                                                        \
            for (int c = 0; c < C; c++) wk[c] = *(const vec *)(w + c * ldb + k);     \
            for (int r = 0; r < R; r++) xk[r] = *(const vec *)(x + r * lda + k);     \
            for (int c = 0; c < C; c++) IN_REGISTER(wk[c]);                          \
            for (int r = 0; r < R; r++) IN_REGISTER(xk[r]);                          \
            if (fetch)                                                               \
                for (int c = 0; c < C; c++) __builtin_prefetch(w + (c + AHEAD) * ldb + k, 0, 2); \
            for (int r = 0; r < R; r++)                                              \
                for (int c = 0; c < C; c++) acc[r][c] += xk[r] * wk[c];              \
        }                                                                            \
        for (int r = 0; r < R; r++)                                                  \
            for (int c = 0; c < C; c++) finish(p, m + r, n + c, acc[r][c]);          \
    }
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1)
TILE(1, 4) TILE(2, 4)
#ifdef __AVX512F__
TILE(3, 4) TILE(4, 4)
#define THREE_ROWS(p, m, n, f) tile_3_4(p, m, n, f)
#define FOUR_ROWS(p, m, n, f) tile_4_4(p, m, n, f)
#else
TILE(3, 2) TILE(4, 2)
#define THREE_ROWS(p, m, n, f) (tile_3_2(p, m, n, f), tile_3_2(p, m, n + 2, f))
#define FOUR_ROWS(p, m, n, f) (tile_4_2(p, m, n, f), tile_4_2(p, m, n + 2, f))
#endif

/* W's rows a chunk takes: enough that taking one costs little beside it, few enough that
   a thread put off by the system holds the others up by little (a multiple of 4) */
static inline int chunk_rows(int n) {
    int rows = (n + CHUNKS - 1) / CHUNKS;
    rows = (rows + 3) / 4 * 4;
    return rows < MIN_CHUNK_ROWS ? MIN_CHUNK_ROWS : rows;
}

/* W's rows of a chunk, four at a time, each four kept in cache while every block of up to
   four rows of x goes past them */
static void multiply(const void *task, int chunk) {
    const struct product *p = task;
    int share = chunk_rows(p->n);
    int n = chunk * share, end = n + share < p->n ? n + share : p->n;
    for (; n + 4 <= end; n += 4) {
        int fetch = n + AHEAD + 4 <= end; /* not the next chunk's rows: another thread's */
        for (int m = 0; m < p->m; m += 4) switch (p->m - m < 4 ? p->m - m : 4) {
            case 1: tile_1_4(p, m, n, fetch); break;
            case 2: tile_2_4(p, m, n, fetch); break;
            case 3: THREE_ROWS(p, m, n, fetch); break;
            default: FOUR_ROWS(p, m, n, fetch);
            }
    }
    for (; n < end; n++)
        for (int m = 0; m < p->m; m += 4) switch (p->m - m < 4 ? p->m - m : 4) {
            case 1: tile_1_1(p, m, n, 0); break;
            case 2: tile_2_1(p, m, n, 0); break;
            case 3: tile_3_1(p, m, n, 0); break;
            default: tile_4_1(p, m, n, 0);
            }
}

void mlxcs_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
    /* alpha 0: BLAS does not read A and B; left to it */
    if (order == ROW_MAJOR && trans_a == NO_TRANS && trans_b == TRANS && alpha != 0 && m >= 1 &&
        m <= MAX_ROWS && n >= 1 && k >= 0 && (long)n * k >= MIN_WEIGHTS) {
        struct product p = {m, n, k, lda, ldb, ldc, alpha, beta, a, b, c};
        pool_run(multiply, &p, (n + chunk_rows(n) - 1) / chunk_rows(n));
        atomic_fetch_add(&calls, 1);
        return;
    }
    pool_quiet(1);
    cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    pool_quiet(0);
}
