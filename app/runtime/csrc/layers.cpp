/* RoPE and RMSNorm as MLX primitives on the CPU: one op each in the graph.

   On the CPU, `mx.fast.rope` and `mx.fast.rms_norm` have no kernel: each call builds
   MLX's fallback, some twenty small ops for RoPE and six for RMSNorm, every one of them
   a graph node, an allocation and a task on the stream's thread. A decode step of a
   small model is mostly such calls. These primitives compute the same thing in one task
   each, with the fallback's arithmetic in the fallback's order: the same bits.

   - RMSNorm: x * (1 / sqrt(sum(x * x) * (1 / n) + eps)) * weight, the sum taken in
     order, one element at a time, as MLX's CPU reduction takes it on Linux.
   - RoPE: theta = (position * scale) * inv_freq, its sine and cosine by MLX's own
     `simd::sin` / `simd::cos`; x1 * cos - x2 * sin and x1 * sin + x2 * cos, each product
     rounded before the sum (no fused multiply-add: built with -ffp-contract=off).

   CPU only, float32 only: the Python side (`kernel_layers.py`) sends everything else to
   MLX's own function. */
#include <cmath>
#include <stdexcept>

#include <nanobind/nanobind.h>

#include "mlx/allocator.h"
#include "mlx/ops.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/simd/simd.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

void allocate(mx::array& out) { out.set_data(mx::allocator::malloc(out.nbytes())); }

/* Where each row (the last axis) of x starts, in elements, whatever its strides. */
std::vector<long> row_starts(const mx::array& x) {
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

class RmsNorm : public mx::UnaryPrimitive {
  public:
    RmsNorm(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}

    void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
        const mx::array& x = inputs[0];
        const mx::array& weight = inputs[1];
        allocate(out);
        const float* xs = x.data<float>();
        const float* w = weight.data<float>();
        long wstep = weight.strides()[0];
        float* o = out.data<float>();
        long n = x.shape(-1), step = x.strides().back();
        float eps = eps_, inverse_n = static_cast<float>(1.0 / static_cast<double>(n));
        mx::cpu::get_command_encoder(stream()).dispatch([=, starts = row_starts(x)]() {
            for (size_t r = 0; r < starts.size(); r++) {
                const float* a = xs + starts[r];
                float* b = o + r * n;
                float sum = 0.0f;
                for (long i = 0; i < n; i++) sum += a[i * step] * a[i * step];
                float k = 1.0f / std::sqrt(sum * inverse_n + eps);
                for (long i = 0; i < n; i++) b[i] = (a[i * step] * k) * w[i * wstep];
            }
        });
    }

    void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
        throw std::runtime_error("mlx-cache-server's RMSNorm runs on the CPU only");
    }

    const char* name() const override { return "MlxcsRMSNorm"; }

    bool is_equivalent(const mx::Primitive& other) const override {
        return eps_ == static_cast<const RmsNorm&>(other).eps_;
    }

  private:
    float eps_;
};

/* x (batch, heads, positions, size), any strides;
   offset int32 of 1 or `batch` elements: row b's first position; inv_freq (dims / 2). */
class Rope : public mx::UnaryPrimitive {
  public:
    Rope(mx::Stream stream, int dims, bool traditional, float scale)
        : mx::UnaryPrimitive(stream), dims_(dims), traditional_(traditional), scale_(scale) {}

    void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
        const mx::array& x = inputs[0];
        const mx::array& offset = inputs[1];
        const mx::array& inv_freq = inputs[2];
        allocate(out);
        int batch = x.shape(0), heads = x.shape(1), positions = x.shape(2), size = x.shape(3);
        long s0 = x.strides()[0], s1 = x.strides()[1], s2 = x.strides()[2], s3 = x.strides()[3];
        const float* xs = x.data<float>();
        const int* first = offset.data<int>();
        bool one_offset = offset.size() == 1;
        const float* inv = inv_freq.data<float>();
        float* o = out.data<float>();
        int half = dims_ / 2;
        bool traditional = traditional_;
        float scale = scale_;
        mx::cpu::get_command_encoder(stream()).dispatch([=]() {
            std::vector<float> cosines(half), sines(half);
            for (int b = 0; b < batch; b++) {
                for (int t = 0; t < positions; t++) {
                    float position = (static_cast<float>(t) +
                                      static_cast<float>(first[one_offset ? 0 : b])) *
                                     scale;
                    for (int i = 0; i < half; i++) {
                        mx::simd::Simd<float, 1> theta(position * inv[i]);
                        cosines[i] = mx::simd::cos(theta).value;
                        sines[i] = mx::simd::sin(theta).value;
                    }
                    for (int h = 0; h < heads; h++) {
                        const float* a = xs + b * s0 + h * s1 + t * s2;
                        float* r = o + ((static_cast<long>(b) * heads + h) * positions + t) * size;
                        for (int i = 0; i < half; i++) {
                            int i1 = traditional ? 2 * i : i;
                            int i2 = traditional ? 2 * i + 1 : i + half;
                            float x1 = a[i1 * s3], x2 = a[i2 * s3], c = cosines[i], s = sines[i];
                            r[i1] = x1 * c - x2 * s;
                            r[i2] = x1 * s + x2 * c;
                        }
                        for (int i = 2 * half; i < size; i++) r[i] = a[i * s3];
                    }
                }
            }
        });
    }

    void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
        throw std::runtime_error("mlx-cache-server's RoPE runs on the CPU only");
    }

    const char* name() const override { return "MlxcsRoPE"; }

    bool is_equivalent(const mx::Primitive& other) const override {
        const Rope& o = static_cast<const Rope&>(other);
        return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_;
    }

  private:
    int dims_;
    bool traditional_;
    float scale_;
};

mx::Stream cpu_stream() {
    mx::Stream stream = mx::to_stream(mx::StreamOrDevice{});
    if (stream.device != mx::Device::cpu)
        throw std::invalid_argument("mlx-cache-server's layers run on the CPU only");
    return stream;
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
    if (x.dtype() != mx::float32 || weight.dtype() != mx::float32 || weight.ndim() != 1 ||
        x.ndim() == 0 || weight.shape(0) != x.shape(-1))
        throw std::invalid_argument("rms_norm takes float32 x (..., n) and weight (n,)");
    return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(cpu_stream(), eps),
                     {x, weight});
}

mx::array rope(const mx::array& x, const mx::array& offset, const mx::array& inv_freq,
               int dims, bool traditional, float scale) {
    if (x.dtype() != mx::float32 || x.ndim() != 4 || dims <= 0 || dims % 2 ||
        dims > x.shape(3) || offset.dtype() != mx::int32 || offset.ndim() != 1 ||
        (offset.size() != 1 && offset.size() != static_cast<size_t>(x.shape(0))) ||
        inv_freq.dtype() != mx::float32 || inv_freq.ndim() != 1 ||
        inv_freq.shape(0) != dims / 2)
        throw std::invalid_argument(
            "rope takes float32 x (batch, heads, positions, size), int32 offset (1 or "
            "batch), float32 inv_freq (dims / 2)");
    return mx::array(x.shape(), mx::float32,
                     std::make_shared<Rope>(cpu_stream(), dims, traditional, scale),
                     {x, offset, inv_freq});
}

/* The inverse frequencies `mx.fast.rope` computes for `base`, by the same ops. */
mx::array inv_freq(int dims, float base) {
    int half = dims / 2;
    return mx::exp(mx::multiply(mx::arange(0, -half, -1, mx::float32),
                                mx::array(std::log(base) / half, mx::float32)));
}

}  // namespace

NB_MODULE(_mlxcs_layers, m) {
    m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"));
    m.def("rope", &rope, nb::arg("x"), nb::arg("offset"), nb::arg("inv_freq"),
          nb::arg("dims"), nb::arg("traditional"), nb::arg("scale"));
    m.def("inv_freq", &inv_freq, nb::arg("dims"), nb::arg("base"));
}
