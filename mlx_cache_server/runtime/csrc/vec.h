/* 16 floats at a time through GCC's vector extensions: the compiler picks the widest
   registers of the instruction set the module is built for (`setup.py`'s -march). */
#pragma once

#define LANES 16

typedef float vec __attribute__((vector_size(LANES * 4), aligned(4)));
typedef int ivec __attribute__((vector_size(LANES * 4), aligned(4)));
typedef float half __attribute__((vector_size(LANES * 2)));
typedef float quarter __attribute__((vector_size(LANES)));

static inline float vsum(vec v) {
    half h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
             __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    quarter q = __builtin_shufflevector(h, h, 0, 1, 2, 3) +
                __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

static inline vec vsplat(float x) { return (vec){0} + x; }

/* a where `where`, else b, lane by lane */
static inline vec vselect(ivec where, vec a, vec b) {
    return (vec)(((ivec)a & where) | ((ivec)b & ~where));
}

/* `bound` where `where`, else x (NaN stays NaN) */
static inline vec vreplace(vec x, ivec where, float bound) {
    return vselect(where, vsplat(bound), x);
}

/* exp(x) within 1 ulp of expf for x in [-87, 88]; 0 below, exp(88) above, NaN for NaN:
   Cephes' expf, range-reduced by powers of two */
static inline vec vexp(vec x) {
    ivec low = x < -87.0f;
    x = vreplace(vreplace(x, low, -87.0f), x > 88.0f, 88.0f);
    vec n = x * 1.44269504088896341f + 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    n -= 12582912.0f;
    vec r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vec p = vsplat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
    return (vec)((ivec)(p * (vec)bits) & ~low);
}
