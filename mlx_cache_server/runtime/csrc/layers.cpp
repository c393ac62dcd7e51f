/* RoPE, RMSNorm and a few queries' attention as MLX primitives on the CPU: one op each
   in the graph.

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

   Attention is our kernel (`attention.c`, built into this module); as a node of the graph,
   a step does not stop at each layer to call it from Python (`kernel_attention.py`).

   CPU only, float32 only: the Python side (`kernel_layers.py`, `kernel_attention.py`)
   sends everything else to MLX's own function. */

#include <cmath>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "layers.h"
extern "C" {
#include "attention.h"
}

namespace mx = mlx::core;
namespace nb = nanobind;

namespace {

using mlxcs::allocate;
using mlxcs::cpu_stream;

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
        float eps = eps_;
        mx::cpu::get_command_encoder(stream()).dispatch([=, starts = mlxcs::row_starts(x)]() {
            for (size_t r = 0; r < starts.size(); r++)
                mlxcs::rms_norm_row(xs + starts[r], step, w, wstep, n, eps, o + r * n);
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
        long first_step = offset.size() == 1 ? 0 : offset.strides()[0];
        const float* inv = inv_freq.data<float>();
        float* o = out.data<float>();
        int half = dims_ / 2;
        bool traditional = traditional_;
        float scale = scale_;
        mx::cpu::get_command_encoder(stream()).dispatch([=]() {
            std::vector<float> cosines(half), sines(half);
            for (int b = 0; b < batch; b++) {
                for (int t = 0; t < positions; t++) {
                    mlxcs::rope_angles(t, first[b * first_step], scale, inv, half,
                                       cosines.data(), sines.data());
                    for (int h = 0; h < heads; h++) {
                        const float* a = xs + b * s0 + h * s1 + t * s2;
                        float* r = o + ((static_cast<long>(b) * heads + h) * positions + t) * size;
                        mlxcs::rope_row(a, s3, r, size, half, traditional, cosines.data(),
                                        sines.data());
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


/* Our attention kernel (`attention.c`), built into this module. */
using attention_fn = int (*)(const struct attention*);
constexpr int MAX_QUERIES = 16;  // as `kernel_attention.py`

attention_fn kernel_attention() { return &mlxcs_attention; }

/* A 4-D float32 operand as the kernel reads it, its last axis contiguous: the array's own
   buffer, or where its last axis is strided, a packed copy (`held`), made when the task
   runs (when `eval_cpu` encodes it, the inputs are not yet computed). */
struct Operand {
    const float* data;
    long stride[4];
    int shape[4];
    std::shared_ptr<std::vector<float>> held;

    explicit Operand(const mx::array& a) : data(a.data<float>()) {
        for (int d = 0; d < 4; d++) stride[d] = a.strides()[d], shape[d] = a.shape(d);
        if (stride[3] != 1 && shape[3] > 1) held = std::make_shared<std::vector<float>>(a.size());
    }

    /* The data to read, with its strides in `to` */
    const float* packed(long to[3]) const {
        if (!held) {
            for (int d = 0; d < 3; d++) to[d] = stride[d];
            return data;
        }
        float* out = held->data();
        for (int i = 0; i < shape[0]; i++)
            for (int j = 0; j < shape[1]; j++)
                for (int t = 0; t < shape[2]; t++)
                    for (int d = 0; d < shape[3]; d++)
                        *out++ = data[i * stride[0] + j * stride[1] + t * stride[2] + d * stride[3]];
        to[2] = shape[3], to[1] = static_cast<long>(shape[2]) * to[2];
        to[0] = static_cast<long>(shape[1]) * to[1];
        return held->data();
    }
};

/* Attention over a few queries a sequence on the kernels library's kernel, as one node of
   the graph: without it, a step went back to Python to call the kernel on evaluated
   arrays, an `eval` and a wait for each layer. q (batch, heads, queries, dim); k and v
   (batch, kv heads, keys, dim | vdim); a mask broadcast to (batch, heads, queries, keys),
   or none. The kernel's own bits, whichever way it is called. */
class Attention : public mx::UnaryPrimitive {
  public:
    Attention(mx::Stream stream, float scale, int mask_kind, bool live)
        : mx::UnaryPrimitive(stream), scale_(scale), mask_kind_(mask_kind), live_(live) {}

    void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
        Operand q(inputs[0]), k(inputs[1]), v(inputs[2]);
        allocate(out);
        struct attention c{};
        c.batch = inputs[0].shape(0), c.heads = inputs[0].shape(1);
        c.queries = inputs[0].shape(2), c.dim = inputs[0].shape(3);
        c.kv_heads = inputs[1].shape(1), c.keys = inputs[1].shape(2);
        c.vdim = inputs[2].shape(3), c.mask_kind = mask_kind_, c.scale = scale_;
        if (mask_kind_ == BOOL_MASK || mask_kind_ == ADDITIVE_MASK) {
            const mx::array& m = inputs[3];
            int pad = 4 - m.ndim();
            for (int d = 0; d < 4; d++)
                c.mask_stride[d] = d < pad || m.shape(d - pad) == 1 ? 0 : m.strides()[d - pad];
            c.mask = m.data<void>();
        }
        c.out = out.data<float>();
        attention_fn fn = kernel_attention();
        const int* counts = live_ ? inputs.back().data<int>() : nullptr;
        long step = live_ ? inputs.back().strides()[0] : 0;
        mx::cpu::get_command_encoder(stream()).dispatch([c, fn, q, k, v, counts, step]() mutable {
            c.q = q.packed(c.q_stride), c.k = k.packed(c.k_stride), c.v = v.packed(c.v_stride);
            std::vector<int> live(counts ? c.batch : 0);
            for (size_t b = 0; b < live.size(); b++) live[b] = counts[b * step];
            c.live = counts ? live.data() : nullptr;
            /* -1 only where it found no memory for the scores: what MLX's allocator does then */
            if (fn(&c) != 0) throw std::bad_alloc();
        });
    }

    void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
        throw std::runtime_error("mlx-cache-server's attention runs on the CPU only");
    }

    const char* name() const override { return "MlxcsAttention"; }

    bool is_equivalent(const mx::Primitive& other) const override {
        const Attention& o = static_cast<const Attention&>(other);
        return scale_ == o.scale_ && mask_kind_ == o.mask_kind_ && live_ == o.live_;
    }

  private:
    float scale_;
    int mask_kind_;
    bool live_;  // the last input: each batch row's queries computed (`attention.h`'s `live`)
};

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


bool has_attention() { return kernel_attention() != nullptr; }

mx::array attention_node(const mx::array& q, const mx::array& k, const mx::array& v,
                         std::optional<mx::array> mask, float scale, int mask_kind,
                         std::optional<mx::array> live) {
    bool shapes = q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4 && k.shape(1) > 0 &&
                  k.shape(0) == q.shape(0) && v.shape(0) == q.shape(0) &&
                  v.shape(1) == k.shape(1) && v.shape(2) == k.shape(2) &&
                  k.shape(3) == q.shape(3) && q.shape(1) % k.shape(1) == 0 &&
                  q.shape(2) >= 1 && q.shape(2) <= MAX_QUERIES && q.shape(2) <= k.shape(2) &&
                  k.shape(2) <= MAX_KEYS;
    bool types = q.dtype() == mx::float32 && k.dtype() == mx::float32 &&
                 v.dtype() == mx::float32;
    bool masked = mask_kind == BOOL_MASK || mask_kind == ADDITIVE_MASK;
    if (masked != mask.has_value())
        throw std::invalid_argument("attention takes a mask array with kinds 2 and 3 only");
    if (masked) {
        const mx::array& m = *mask;
        mx::Shape full = {q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
        masked = m.dtype() == (mask_kind == BOOL_MASK ? mx::bool_ : mx::float32) &&
                 m.ndim() <= 4;
        for (int d = 0; masked && d < m.ndim(); d++) {
            int size = m.shape(d), want = full[4 - m.ndim() + d];
            masked = size == 1 || size == want;
        }
    }
    bool counts = !live || (live->dtype() == mx::int32 && live->ndim() == 1 &&
                            shapes && live->shape(0) == q.shape(0));
    if (!shapes || !types || (mask_kind != NO_MASK && mask_kind != CAUSAL && !masked) ||
        !counts || !kernel_attention())
        throw std::invalid_argument(
            "attention takes float32 q (batch, heads, 1 to 16 queries, dim), k and v "
            "(batch, kv heads, keys, dim | vdim), a mask of kind 0 to 3 (an array for 2 and "
            "3), and int32 live (batch) or none");
    std::vector<mx::array> inputs = {q, k, v};
    if (masked) inputs.push_back(*mask);
    if (live) inputs.push_back(*live);
    return mx::array(
        {q.shape(0), q.shape(1), q.shape(2), v.shape(3)}, mx::float32,
        std::make_shared<Attention>(cpu_stream(), scale, mask_kind, live.has_value()), inputs);
}

/* The inverse frequencies `mx.fast.rope` computes for `base`, by the same ops. */
mx::array inv_freq(int dims, float base) {
    int half = dims / 2;
    return mx::exp(mx::multiply(mx::arange(0, -half, -1, mx::float32),
                                mx::array(std::log(base) / half, mx::float32)));
}

}  // namespace

/* One module per ISA variant (`setup.py`), each named for its file. */
NB_MODULE(MLXCS_MODULE, m) {
    m.def("built_with", []() { return std::string(MLXCS_BUILT_WITH); });
    m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"));
    m.def("rope", &rope, nb::arg("x"), nb::arg("offset"), nb::arg("inv_freq"),
          nb::arg("dims"), nb::arg("traditional"), nb::arg("scale"));
    m.def("has_attention", &has_attention);
    m.def("attention", &attention_node, nb::arg("q"), nb::arg("k"), nb::arg("v"),
          nb::arg("mask").none(), nb::arg("scale"), nb::arg("mask_kind"),
          nb::arg("live") = nb::none());
    m.def("inv_freq", &inv_freq, nb::arg("dims"), nb::arg("base"));
    mlxcs::define_block(m);
}
