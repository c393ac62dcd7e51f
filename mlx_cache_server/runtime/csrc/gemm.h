/* The products of a decode step (`gemm.c`), for the primitives of `block.cpp`. */
#pragma once

/* cblas_sgemm's arguments and result; the products it does not compute itself go on to
   the process's cblas_sgemm. */
void mlxcs_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc);

/* Products computed here so far (tests count them). */
long mlxcs_gemm_calls(void);

/* The most rows of x a product computed here has. */
int mlxcs_gemm_max_rows(void);
