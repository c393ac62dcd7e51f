/* softmax(q k^T * scale + mask) v for a few queries a sequence: a decode step's, or a
   draft's pass.

   MLX's CPU attention computes exp one element at a time and, for several queries, makes
   the scores of each in turn; a draft's pass of 8 positions cost 8 single steps'
   attention. Here the query rows that share a key head go past its keys together, a block
   at a time (`unit`), spread over the cores by head and by piece of keys (below); each
   row's scores, a vectorized exp, then the weighted sum of the values. A row's result
   depends only on its own query, keys, values and mask, so a row gets the same bits in a
   pass of several positions as in a single step.

   A row's keys are cut at fixed positions, every KEY_SPLIT keys, and each piece is a unit
   of work of its own, so that the cores share a key head: a lone stream's step has as
   few units as the model has key heads, which may be fewer than the cores or not a
   multiple of them. Each piece's softmax is combined with the others' afterwards
   (`combine`), in key order. The cuts do not depend on the call, so a row's bits do not
   either.

   Masks as MLX takes them: none, causal (query i of n is position keys - n + i), or an
   array broadcast to (batch, heads, queries, keys), boolean (true: may attend; a masked
   score is the lowest float, as MLX's: a fully masked row averages the values) or
   additive (a row masked to -inf everywhere gives zeros). */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "attention.h"
#include "pool.h"
#include "vec.h"

#define KEY_BLOCK 64 /* keys (and values) a block of rows goes past while they are in L1 */
#define ROW_CHUNK 8  /* rows of a unit: their scores are held at once */
#define KEY_SPLIT 256 /* keys of a unit at most, cut at multiples of it (of LANES too) */

/* Lanes h..2h-1 of each 2h-lane chunk of a and b exchanged: one step of transposing 16
   rows of 16 lanes, whose four steps (h = 8, 4, 2, 1) leave row d holding lane d of
   every input row. */
#define LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define EXCHANGE(H)                                                                  \
    for (int i = 0; i < LANES; i++)                                                  \
        if (!(i & H)) {                                                              \
            vec a = r[i], b = r[i + H];                                              \
            r[i] = __builtin_shufflevector(a, b, LO##H);                             \
            r[i + H] = __builtin_shufflevector(a, b, HI##H);                         \
        }

/* Keys j0.. (`count` of them, at most LANES) with the head size across and the keys
   down: kt[d] holds lane l = key j0 + l's element d, zero past `count`. */
static void transpose_keys(const float *k, long stride, int count, int dim, vec *kt) {
    int whole = dim / LANES * LANES;
    for (int d0 = 0; d0 < whole; d0 += LANES) {
        vec r[LANES];
        for (int l = 0; l < LANES; l++)
            r[l] = l < count ? *(const vec *)(k + l * stride + d0) : (vec){0};
        EXCHANGE(8) EXCHANGE(4) EXCHANGE(2) EXCHANGE(1)
        for (int d = 0; d < LANES; d++) kt[d0 + d] = r[d];
    }
    for (int d = whole; d < dim; d++) {
        vec column = {0};
        for (int l = 0; l < count; l++) column[l] = k[l * stride + d];
        kt[d] = column;
    }
}

/* A query row of a unit: where its query, mask and piece (`part`) are, the end of the keys
   it sees in the unit's piece */
struct row {
    const float *q;
    float *part, *s;
    long mask_at;
    int n;
    vec top; /* by lane */
};

/* A row's piece of keys, as `unit` leaves it: its top score (0 where every score is -inf),
   its weights' sum, then the weighted sum of the values (vdim), not yet divided */
#define PART_TOP 0
#define PART_SUM 1
#define PART_OUT 2

/* Rows' dots with a transposed block of keys, each summed over d in two running sums
   (even and odd d) */
static inline __attribute__((always_inline)) void block_dots(const struct row *rows,
                                                             const vec *kt, int dim, vec *dots,
                                                             const int group) {
    vec even[4] = {{0}}, odd[4] = {{0}};
    int d = 0;
    for (; d + 2 <= dim; d += 2)
        for (int g = 0; g < group; g++) {
            even[g] += rows[g].q[d] * kt[d];
            odd[g] += rows[g].q[d + 1] * kt[d + 1];
        }
    if (d < dim)
        for (int g = 0; g < group; g++) even[g] += rows[g].q[d] * kt[d];
    for (int g = 0; g < group; g++) dots[g] = even[g] + odd[g];
}

/* batch row b's queries computed: its first ones, where `live` says (fillers after them) */
static int live_queries(const struct attention *a, int b) {
    return a->live && a->live[b] < a->queries ? (a->live[b] > 0 ? a->live[b] : 0) : a->queries;
}

static int keys_seen(const struct attention *a, int i) {
    return a->mask_kind == CAUSAL ? a->keys - a->queries + i + 1 : a->keys;
}

/* Rows `first`.. of one sequence's key head `head`, `count` of them (query heads of the group,
   then positions): every row reads the same keys and values, so they go past a block of
   keys together while it is in L1 rather than each row reading the whole head from
   memory. A row's arithmetic is the same whatever rows and keys it is computed with: a
   score is summed over d in the same order (`block_dots`), its weight is one exp in lane
   j % LANES, each output a sum over keys in key order. */
static void unit(const struct attention *a, int b, int head, int first, int count, int k0,
                 float *scores, vec *kt, float *parts) {
    int pieces = (a->keys + KEY_SPLIT - 1) / KEY_SPLIT, piece = k0 / KEY_SPLIT;
    int per = a->heads / a->kv_heads;
    const float *k = a->k + b * a->k_stride[0] + head * a->k_stride[1];
    const float *v = a->v + b * a->v_stride[0] + head * a->v_stride[1];
    const unsigned char *bools = a->mask;
    const float *adds = a->mask;
    struct row rows[ROW_CHUNK];
    int most = k0, kept = 0, queries = live_queries(a, b);
    for (int r = 0; r < count; r++) {
        int h = head * per + (first + r) / queries, i = (first + r) % queries;
        int n = keys_seen(a, i), end = k0 + KEY_SPLIT;
        if (n <= k0)
            continue; /* no key of this piece: `combine` does not read its part */
        long at = (((long)b * a->heads + h) * a->queries + i) * pieces + piece;
        rows[kept] = (struct row){
            .q = a->q + b * a->q_stride[0] + h * a->q_stride[1] + i * a->q_stride[2],
            .part = parts + at * (PART_OUT + a->vdim),
            .s = scores + (long)kept * KEY_SPLIT - k0, /* indexed by key */
            .mask_at = b * a->mask_stride[0] + h * a->mask_stride[1] + i * a->mask_stride[2],
            .n = n < end ? n : end,
            .top = vsplat(-INFINITY),
        };
        most = rows[kept].n > most ? rows[kept].n : most;
        kept++;
    }
    count = kept;
    /* Scores a block of LANES keys at a time, the block transposed so that a row's
       scores of the block are one vector (`block_dots`). */
    for (int j0 = k0; j0 < most; j0 += LANES) {
        int block = most - j0 < LANES ? most - j0 : LANES;
        transpose_keys(k + (long)j0 * a->k_stride[2], a->k_stride[2], block, a->dim, kt);
        for (int r0 = 0; r0 < count; r0 += 4) {
            int group = count - r0 < 4 ? count - r0 : 4;
            vec dots[4];
            switch (group) { /* a constant count: the sums stay in registers */
            case 1: block_dots(rows + r0, kt, a->dim, dots, 1); break;
            case 2: block_dots(rows + r0, kt, a->dim, dots, 2); break;
            case 3: block_dots(rows + r0, kt, a->dim, dots, 3); break;
            default: block_dots(rows + r0, kt, a->dim, dots, 4);
            }
            for (int g = 0; g < group; g++) {
                struct row *r = &rows[r0 + g];
                if (j0 >= r->n) continue;
                vec x = dots[g] * a->scale;
                if (j0 + LANES > r->n || a->mask_kind == BOOL_MASK ||
                    a->mask_kind == ADDITIVE_MASK) {
                    long at = r->mask_at + j0 * a->mask_stride[3];
                    for (int l = 0; l < LANES; l++) {
                        long m = at + l * a->mask_stride[3];
                        if (j0 + l >= r->n) x[l] = -INFINITY;
                        else if (a->mask_kind == BOOL_MASK && !bools[m]) x[l] = -FLT_MAX;
                        else if (a->mask_kind == ADDITIVE_MASK) x[l] += adds[m];
                    }
                }
                *(vec *)(r->s + j0) = x;
                r->top = vselect(x > r->top, x, r->top); /* NaN passed over, as in MLX */
            }
        }
    }
    for (struct row *r = rows; r < rows + count; r++) {
        float top = -INFINITY;
        for (int l = 0; l < LANES; l++) top = r->top[l] > top ? r->top[l] : top;
        top = isfinite(top) ? top : 0;
        /* Every key's weight lands in lane j % LANES, the last lanes padded with zeros: a
           key gets the same bits and the same place in the sum whether the row ends at it
           (a single step) or runs on past it masked (a row of a draft's pass). */
        for (int j = r->n; j % LANES; j++) r->s[j] = -INFINITY;
        vec total = {0};
        for (int j = k0; j < r->n; j += LANES) {
            vec e = vexp(*(vec *)(r->s + j) - top);
            *(vec *)(r->s + j) = e;
            total += e;
        }
        r->part[PART_TOP] = top;
        r->part[PART_SUM] = vsum(total);
        for (int d = 0; d < a->vdim; d++) r->part[PART_OUT + d] = 0;
    }
    /* each output a running sum kept in the output between blocks: the same additions in
       the same order as one loop over every key */
    int whole = a->vdim / LANES * LANES;
    for (int t0 = k0; t0 < most; t0 += KEY_BLOCK)
        for (struct row *r = rows; r < rows + count; r++) {
            int end = t0 + KEY_BLOCK < r->n ? t0 + KEY_BLOCK : r->n;
            int d = 0;
            /* four sums at once: each is a chain of dependent additions */
            for (; d + 4 * LANES <= whole; d += 4 * LANES) {
                vec *o = (vec *)(r->part + PART_OUT + d);
                vec acc0 = o[0], acc1 = o[1], acc2 = o[2], acc3 = o[3];
                for (int t = t0; t < end; t++) {
                    const vec *x = (const vec *)(v + t * a->v_stride[2] + d);
                    float w = r->s[t];
                    acc0 += w * x[0], acc1 += w * x[1], acc2 += w * x[2], acc3 += w * x[3];
                }
                o[0] = acc0, o[1] = acc1, o[2] = acc2, o[3] = acc3;
            }
            for (; d < whole; d += LANES) {
                vec acc = *(vec *)(r->part + PART_OUT + d);
                for (int t = t0; t < end; t++)
                    acc += r->s[t] * *(const vec *)(v + t * a->v_stride[2] + d);
                *(vec *)(r->part + PART_OUT + d) = acc;
            }
            for (int d = whole; d < a->vdim; d++) {
                float acc = r->part[PART_OUT + d];
                for (int t = t0; t < end; t++) acc += r->s[t] * v[t * a->v_stride[2] + d];
                r->part[PART_OUT + d] = acc;
            }
        }
}

/* Each row's output from its pieces, in key order: sum over pieces of out * w over the sum of
   sum * w, w = exp(top - the largest top), pieces whose weights are all 0 left out. A row of
   one piece gets out / sum: what one pass over its keys gives. */
static void combine(const struct attention *a, const float *parts) {
    int pieces = (a->keys + KEY_SPLIT - 1) / KEY_SPLIT, width = PART_OUT + a->vdim;
    for (int b = 0; b < a->batch; b++)
        for (int h = 0; h < a->heads; h++)
            for (int i = 0; i < a->queries; i++) {
                long row = ((long)b * a->heads + h) * a->queries + i;
                const float *part = parts + row * pieces * width;
                int seen = i < live_queries(a, b) ? (keys_seen(a, i) + KEY_SPLIT - 1) / KEY_SPLIT : 0;
                float largest = -INFINITY, sum = 0;
                for (int c = 0; c < seen; c++)
                    if (part[c * width + PART_SUM] != 0 && part[c * width + PART_TOP] > largest)
                        largest = part[c * width + PART_TOP];
                float *out = a->out + row * a->vdim;
                for (int d = 0; d < a->vdim; d++) out[d] = 0;
                for (int c = 0; c < seen; c++) {
                    const float *p = part + c * width;
                    if (p[PART_SUM] == 0) continue;
                    float w = expf(p[PART_TOP] - largest);
                    sum += p[PART_SUM] * w;
                    for (int d = 0; d < a->vdim; d++) out[d] += p[PART_OUT + d] * w;
                }
                sum = sum == 0 ? 1 : sum;
                for (int d = 0; d < a->vdim; d++) out[d] = out[d] / sum;
            }
}

struct call {
    const struct attention *a;
    float *parts;
    atomic_int failed;
};

/* rows' scores, kept per thread from call to call and freed when the thread ends */
struct scores {
    long held;
    float s[];
};
static pthread_key_t scores_key;
static pthread_once_t scores_once = PTHREAD_ONCE_INIT;

static void make_scores_key(void) { pthread_key_create(&scores_key, free); }

static float *scratch(long wanted) {
    pthread_once(&scores_once, make_scores_key);
    struct scores *held = pthread_getspecific(scores_key);
    if (!held || held->held < wanted) {
        free(held);
        held = malloc(sizeof(struct scores) + sizeof(float) * wanted);
        pthread_setspecific(scores_key, held);
        if (!held) return NULL;
        held->held = wanted;
    }
    return held->s;
}

/* A share of a call's units (each sequence's key heads, their rows cut into chunks, their
   keys into pieces), one for each thread: a unit reads its piece of its key head whole, so
   a thread's units go in order (units taken one at a time by whichever thread is free
   measured slower) */
static void units(const void *task, int share) {
    struct call *call = (struct call *)task;
    const struct attention *a = call->a;
    int per = a->heads / a->kv_heads, pieces = (a->keys + KEY_SPLIT - 1) / KEY_SPLIT;
    int total = 0, shares = pool_parts();
    for (int b = 0; b < a->batch; b++)
        total += a->kv_heads * ((per * live_queries(a, b) + ROW_CHUNK - 1) / ROW_CHUNK) * pieces;
    int each = (total + shares - 1) / shares;
    int end = (share + 1) * each < total ? (share + 1) * each : total;
    /* the rows' scores, then a block of keys transposed */
    long held = (long)ROW_CHUNK * KEY_SPLIT;
    float *s = share * each < end ? scratch(held + (long)a->dim * LANES) : NULL;
    if (share * each < end && !s) {
        atomic_store(&call->failed, 1);
        return;
    }
    int b = 0, start = 0; /* the batch row of unit u, and its first unit */
    for (int u = share * each; u < end; u++) {
        int group, chunks;
        for (;;) {
            group = per * live_queries(a, b), chunks = (group + ROW_CHUNK - 1) / ROW_CHUNK;
            if (u < start + a->kv_heads * chunks * pieces) break;
            start += a->kv_heads * chunks * pieces, b++;
        }
        int piece = (u - start) % pieces, rest = (u - start) / pieces;
        int c = rest % chunks, head = rest / chunks;
        int first = c * ROW_CHUNK, count = group - first < ROW_CHUNK ? group - first : ROW_CHUNK;
        unit(a, b, head, first, count, piece * KEY_SPLIT, s, (vec *)(s + held), call->parts);
    }
}

int mlxcs_attention(const struct attention *a) {
    if (a->kv_heads < 1 || a->heads % a->kv_heads || a->keys < 1 || a->keys > MAX_KEYS ||
        a->queries < 1 || a->queries > a->keys || a->mask_kind < 0 || a->mask_kind > 3)
        return -1;
    long pieces = (a->keys + KEY_SPLIT - 1) / KEY_SPLIT;
    float *parts = malloc(sizeof(float) * a->batch * a->heads * a->queries * pieces *
                          (PART_OUT + a->vdim));
    if (!parts) return -1;
    struct call call = {a, parts, 0};
    pool_run(units, &call, pool_parts());
    if (!atomic_load(&call.failed)) combine(a, parts);
    free(parts);
    return atomic_load(&call.failed) ? -1 : 0;
}
