/* What `layers.cpp` and `block.cpp` share: the arithmetic of RMSNorm and RoPE, which a
   block's nodes (`block.cpp`) must do exactly as the RMSNorm and RoPE nodes do, and the
   plumbing every primitive here needs. Built with -ffp-contract=off (`native.py`): each
   product is rounded before the sum it goes into, as in MLX's fallbacks. */
#pragma once

#include <cmath>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/simd/simd.h"
#include "mlx/stream.h"
#include "mlx/utils.h"

namespace mlxcs {

namespace mx = mlx::core;

inline void allocate(mx::array& out) { out.set_data(mx::allocator::malloc(out.nbytes())); }

/* Where each row (the last axis) of x starts, in elements, whatever its strides. */
inline std::vector<long> row_starts(const mx::array& x) {
    long rows = x.shape(-1) ? x.size() / x.shape(-1) : 0;
    std::vector<long> starts(rows);
    for (long r = 0; r < rows; r++) {
        long rest = r, at = 0;
        for (int d = x.ndim() - 2; d >= 0; d--) {
            at += (rest % x.shape(d)) * x.strides()[d];
            rest /= x.shape(d);
        }
        starts[r] = at;
    }
    return starts;
}

inline mx::Stream cpu_stream() {
    mx::Stream stream = mx::to_stream(mx::StreamOrDevice{});
    if (stream.device != mx::Device::cpu)
        throw std::invalid_argument("mlx-cache-server's layers run on the CPU only");
    return stream;
}

/* x * (1 / sqrt(sum(x * x) * (1 / n) + eps)) * weight for one row of n: the sum taken in
   order, one element at a time, as MLX's CPU reduction takes it on Linux. */
inline void rms_norm_row(const float* a, long step, const float* w, long wstep, long n,
                         float eps, float* out) {
    float inverse_n = static_cast<float>(1.0 / static_cast<double>(n));
    float sum = 0.0f;
    for (long i = 0; i < n; i++) sum += a[i * step] * a[i * step];
    float k = 1.0f / std::sqrt(sum * inverse_n + eps);
    for (long i = 0; i < n; i++) out[i] = (a[i * step] * k) * w[i * wstep];
}

/* RoPE's angles at position `t` past `first`: (t + first) * scale, then theta = that *
   inv_freq[i], its cosine and sine by MLX's own `simd::cos` / `simd::sin`. */
inline void rope_angles(int t, int first, float scale, const float* inv_freq, int half,
                        float* cosines, float* sines) {
    float position = (static_cast<float>(t) + static_cast<float>(first)) * scale;
    for (int i = 0; i < half; i++) {
        mx::simd::Simd<float, 1> theta(position * inv_freq[i]);
        cosines[i] = mx::simd::cos(theta).value;
        sines[i] = mx::simd::sin(theta).value;
    }
}

/* One head's row of `size` rotated: x1 * cos - x2 * sin and x1 * sin + x2 * cos over the
   first 2 * half elements (pairs side by side if `traditional`, else half apart), the
   rest copied. `a` steps by `step`; `r` is contiguous. */
inline void rope_row(const float* a, long step, float* r, int size, int half, bool traditional,
                     const float* cosines, const float* sines) {
    for (int i = 0; i < half; i++) {
        int i1 = traditional ? 2 * i : i;
        int i2 = traditional ? 2 * i + 1 : i + half;
        float x1 = a[i1 * step], x2 = a[i2 * step], c = cosines[i], s = sines[i];
        r[i1] = x1 * c - x2 * s;
        r[i2] = x1 * s + x2 * c;
    }
    for (int i = 2 * half; i < size; i++) r[i] = a[i * step];
}

/* `block.cpp`'s functions, in the extension module `layers.cpp` defines */
void define_block(nanobind::module_& m);

}  // namespace mlxcs
