/* A few queries' attention (`attention.c`): its arguments, shared by the library and the
   MLX primitive that calls it (`layers.cpp`, which finds `mlxcs_attention` in the process). */
#pragma once

enum { NO_MASK = 0, CAUSAL = 1, BOOL_MASK = 2, ADDITIVE_MASK = 3 };
#define MAX_KEYS (1 << 20)

/* Strides in elements; the last dimension (dim, vdim, keys) is contiguous except the
   mask's, whose strides are all given (0 where it broadcasts). */
struct attention {
    int batch, heads, kv_heads, queries, keys, dim, vdim, mask_kind;
    float scale;
    const float *q, *k, *v;
    long q_stride[3], k_stride[3], v_stride[3];
    const void *mask;
    long mask_stride[4];
    float *out; /* (batch, heads, queries, vdim), contiguous */
    /* NULL, or for each batch row the queries computed, its first live[b]: the others
       (the fillers of a verification pass's shorter rows) come out zeros */
    const int *live;
};

/* 0, or -1 where it does not compute it (the caller takes MLX's path): shapes it does not
   take, or no memory for the scores */
int mlxcs_attention(const struct attention *a);
