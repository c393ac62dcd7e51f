/* softmax(q k^T * scale + mask) v for a few queries a sequence: a decode step's, or a
   draft's pass.

   MLX's CPU attention computes exp one element at a time and, for several queries, makes
   the scores of each in turn; a draft's pass of 8 positions cost 8 single steps'
   attention. Here each query row is computed alone, on whichever core takes it: its
   scores against its key head, a vectorized exp, then the weighted sum of the values. A
   row's result depends only on its own query, keys, values and mask, so a row gets the
   same bits in a pass of several positions as in a single step.

   Masks as MLX takes them: none, causal (query i of n is position keys - n + i), or an
   array broadcast to (batch, heads, queries, keys), boolean (true: may attend; a masked
   score is the lowest float, as MLX's: a fully masked row averages the values) or
   additive (a row masked to -inf everywhere gives zeros). */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "pool.h"
#include "vec.h"

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
};

static float dot(const float *a, const float *b, int n) {
    vec acc = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES) acc += *(const vec *)(a + i) * *(const vec *)(b + i);
    float s = vsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static void row(const struct attention *a, int b, int h, int i, float *s) {
    int kvh = h / (a->heads / a->kv_heads);
    const float *q = a->q + b * a->q_stride[0] + h * a->q_stride[1] + i * a->q_stride[2];
    const float *k = a->k + b * a->k_stride[0] + kvh * a->k_stride[1];
    const float *v = a->v + b * a->v_stride[0] + kvh * a->v_stride[1];
    int n = a->mask_kind == CAUSAL ? a->keys - a->queries + i + 1 : a->keys;
    const char *m = (const char *)a->mask;
    long mrow = b * a->mask_stride[0] + h * a->mask_stride[1] + i * a->mask_stride[2];
    float top = -INFINITY;
    for (int j = 0; j < n; j++) {
        float x = dot(q, k + j * a->k_stride[2], a->dim) * a->scale;
        long at = mrow + j * a->mask_stride[3];
        if (a->mask_kind == BOOL_MASK && !((const unsigned char *)m)[at]) x = -FLT_MAX;
        if (a->mask_kind == ADDITIVE_MASK) x += ((const float *)m)[at];
        s[j] = x;
        top = x > top ? x : top;
    }
    if (!isfinite(top)) top = 0;
    /* Every key's weight lands in lane j % LANES, the last lanes padded with zeros: a key
       gets the same bits and the same place in the sum whether the row ends at it (a
       single step) or runs on past it masked (a row of a draft's pass). */
    for (int j = n; j % LANES; j++) s[j] = -INFINITY;
    vec total = {0};
    for (int j = 0; j < n; j += LANES) {
        vec e = vexp(*(vec *)(s + j) - top);
        *(vec *)(s + j) = e;
        total += e;
    }
    float sum = vsum(total);
    float *out = a->out + (((long)b * a->heads + h) * a->queries + i) * a->vdim;
    int d = 0;
    for (; d + LANES <= a->vdim; d += LANES) {
        vec acc = {0};
        for (int t = 0; t < n; t++) acc += s[t] * *(const vec *)(v + t * a->v_stride[2] + d);
        *(vec *)(out + d) = acc / (sum == 0 ? 1 : sum);
    }
    for (; d < a->vdim; d++) {
        float acc = 0;
        for (int t = 0; t < n; t++) acc += s[t] * v[t * a->v_stride[2] + d];
        out[d] = acc / (sum == 0 ? 1 : sum);
    }
}

struct call {
    const struct attention *a;
    atomic_int failed;
};

/* a row's scores, kept per thread from call to call and freed when the thread ends */
struct scores {
    int held;
    float s[];
};
static pthread_key_t scores_key;
static pthread_once_t scores_once = PTHREAD_ONCE_INIT;

static void make_scores_key(void) { pthread_key_create(&scores_key, free); }

static float *scratch(int keys) {
    pthread_once(&scores_once, make_scores_key);
    struct scores *held = pthread_getspecific(scores_key);
    int wanted = (keys + LANES - 1) / LANES * LANES;
    if (!held || held->held < wanted) {
        free(held);
        held = malloc(sizeof(struct scores) + sizeof(float) * wanted);
        pthread_setspecific(scores_key, held);
        if (!held) return NULL;
        held->held = wanted;
    }
    return held->s;
}

static void rows(const void *task, int part, int parts) {
    struct call *call = (struct call *)task;
    const struct attention *a = call->a;
    int total = a->batch * a->heads * a->queries;
    int share = (total + parts - 1) / parts;
    int end = (part + 1) * share < total ? (part + 1) * share : total;
    float *s = scratch(a->keys);
    if (!s) {
        atomic_store(&call->failed, 1);
        return;
    }
    for (int r = part * share; r < end; r++)
        row(a, r / (a->heads * a->queries), r / a->queries % a->heads, r % a->queries, s);
}

/* 0, or -1 where this does not compute it (the caller takes MLX's path): shapes it does
   not take, or no memory for the scores */
int mlxcs_attention(const struct attention *a) {
    if (a->kv_heads < 1 || a->heads % a->kv_heads || a->keys < 1 || a->keys > MAX_KEYS ||
        a->queries < 1 || a->queries > a->keys || a->mask_kind < 0 || a->mask_kind > 3)
        return -1;
    struct call call = {a, 0};
    pool_run(rows, &call);
    return atomic_load(&call.failed) ? -1 : 0;
}
