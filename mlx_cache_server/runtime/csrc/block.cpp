/* A Llama block's work before and after attention as two MLX primitives on the CPU.

   mlx-lm's `llama.TransformerBlock` is dozens of graph nodes: each projection a
   transpose, a flatten, a product and an unflatten; the reshapes and transposes of q, k
   and v; RoPE, two norms, SwiGLU, two residual adds. On the CPU each node is an
   allocation and a task on the stream's thread, the pool's worker idle beside it, and the
   Python thread building them takes a core from the two that run them. Here the block is
   two nodes around the cache's update and attention, which stay the model's own calls:

   - `block_input`: RMSNorm, the q, k and v projections, RoPE on q and k; q, k and v come
     out (batch, heads, positions, size), as the model's transposes leave them.
   - `block_output`: the o projection, the residual, RMSNorm, gate and up, SwiGLU, down,
     the residual.

   Each part is the arithmetic of the node it stands for, in its order, so the block's
   output has the same bits: RMSNorm and RoPE are `layers.h`'s, as in their own nodes;
   every product is `mlxcs_sgemm` (`gemm.c`), which computes a step's few rows itself and
   hands longer ones to the process's BLAS; SwiGLU is `silu(gate) * up` with MLX's CPU
   sigmoid, its `simd::exp` included.

   float32 only; the weights row-contiguous and without biases (`kernel_block.py` swaps
   only such blocks and sends anything else to the model's own call). */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "layers.h"
extern "C" {
#include "gemm.h"
#include "pool.h"
}
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

namespace mlxcs {
namespace {

namespace nb = nanobind;

using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*,
                          int, float, float*, int);
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

/* Our products (`gemm.c`), which hand what they do not compute to the process's BLAS */
sgemm_fn sgemm() { return &mlxcs_sgemm; }

/* rows (m, k) times w (n, k) transposed, into out (m, n) */
void product(sgemm_fn f, const float* rows, int m, int k, const float* w, int n, float* out) {
    f(ROW_MAJOR, NO_TRANS, TRANS, m, n, k, 1.0f, rows, k, w, k, 0.0f, out, n);
}

/* Sixteen floats through GCC's vector extensions; the polynomial's fused multiply-adds
   by the CPU's instruction (each lane rounded once, as `std::fma`). */
typedef float f16 __attribute__((vector_size(64)));
typedef int i16 __attribute__((vector_size(64)));
typedef float f8 __attribute__((vector_size(32)));
typedef int i8 __attribute__((vector_size(32)));
typedef double d8 __attribute__((vector_size(64)));

inline f16 fma16(f16 a, f16 b, f16 c) {
#if defined(__AVX512F__)
    return (f16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    for (int l = 0; l < 16; l++) a[l] = std::fma(a[l], b[l], c[l]);
    return a;
#endif
}

/* floor(x + 0.5) in double, for x >= 0 (or NaN, or past 200, where `sigmoid16` does not
   use it: 200): the truncation */
inline i8 rounded8(f8 x) {
    d8 d = __builtin_convertvector(x, d8) + 0.5;
    return __builtin_convertvector(d < 200.0 ? d : 200.0 + (d8){}, i8);
}

/* MLX's CPU sigmoid (`unary_ops.h`), 1 / (1 + exp(|x|)) or 1 minus that for x >= 0, with
   its scalar `simd::exp` (`simd/math.h`) lane by lane: floor(x + 0.5) taken in double,
   the polynomial by fused multiply-adds, NaN kept, infinite past 88. */
inline f16 sigmoid16(f16 g) {
    f16 x_init = (f16)((i16)g & 0x7fffffff), x = x_init * 1.442695f;
    i8 low = rounded8(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7));
    i8 high = rounded8(__builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
    i16 ipart = __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                        14, 15);
    f16 f = x - __builtin_convertvector(ipart, f16), zero = {};
    f16 p = fma16(zero + 1.535336188319500e-4f, f, zero + 1.339887440266574e-3f);
    p = fma16(p, f, zero + 9.618437357674640e-3f);
    p = fma16(p, f, zero + 5.550332471162809e-2f);
    p = fma16(p, f, zero + 2.402264791363012e-1f);
    p = fma16(p, f, zero + 6.931472028550421e-1f);
    p = fma16(p, f, zero + 1.000000000000000f);
    f16 e = (f16)((ipart + 127) << 23) * p;
    e = x_init != x_init ? x_init : e;
    e = x_init > 88.0f ? zero + INFINITY : e;
    f16 y = 1.0f / (1.0f + e);
    return g < 0.0f ? y : 1.0f - y;
}

/* gate = silu(gate) * up, as mlx-lm's `swiglu`: gate * sigmoid(gate), then times up */
void swiglu(float* gate, const float* up, long n) {
    for (long i = 0; i < n; i += 16) {
        f16 g = {}, u = {};
        int lanes = n - i < 16 ? static_cast<int>(n - i) : 16;
        std::memcpy(&g, gate + i, sizeof(float) * lanes);
        std::memcpy(&u, up + i, sizeof(float) * lanes);
        f16 r = (g * sigmoid16(g)) * u;
        std::memcpy(gate + i, &r, sizeof(float) * lanes);
    }
}

/* A task's working rows, not zeroed: each is written before it is read */
struct Scratch : std::unique_ptr<float[]> {
    explicit Scratch(long n) : std::unique_ptr<float[]>(new float[n]) {}
};

bool weight_ok(const mx::array& w, int rows, int columns) {
    return w.dtype() == mx::float32 && w.ndim() == 2 && w.shape(0) == rows &&
           w.shape(1) == columns && w.is_available() && w.flags().row_contiguous;
}

/* The rows (b * length + t) the op computes: every row, or with counts `n` (a verification
   pass's `lengths`, one a batch row, `step` apart) only each batch row's first n[b]
   positions; the others are fillers whose results are never read (a pass's rows padded
   to its longest draft) */
std::vector<long> live_rows(const int* n, long step, int batch, int length) {
    std::vector<long> live;
    for (int b = 0; b < batch; b++)
        for (int t = 0; t < (n ? std::min(n[b * step], length) : length); t++)
            live.push_back(static_cast<long>(b) * length + t);
    return live;
}

class BlockInput : public mx::Primitive {
  public:
    BlockInput(mx::Stream stream, float eps, int heads, int kv_heads, int dims, bool traditional,
               float scale)
        : mx::Primitive(stream), eps_(eps), heads_(heads), kv_heads_(kv_heads), dims_(dims),
          traditional_(traditional), scale_(scale) {}

    void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
        const mx::array &x = in[0], &norm = in[1], &offset = in[5];
        for (mx::array& o : out) allocate(o);
        int batch = x.shape(0), length = x.shape(1), width = x.shape(2);
        int nq = in[2].shape(0), nk = in[3].shape(0), nv = in[4].shape(0);
        int heads = heads_, kv_heads = kv_heads_, qd = nq / heads, kd = nk / kv_heads,
            vd = nv / kv_heads, half = dims_ / 2;
        const float *xs = x.data<float>(), *w = norm.data<float>();
        const float *wq = in[2].data<float>(), *wk = in[3].data<float>(),
                    *wv = in[4].data<float>(), *inv = in[6].data<float>();
        const int* first = offset.data<int>();
        long first_step = offset.size() == 1 ? 0 : offset.strides()[0];
        bool traditional = traditional_;
        long step = x.strides()[2], wstep = norm.strides()[0];
        float *qs = out[0].data<float>(), *ks = out[1].data<float>(), *vs = out[2].data<float>();
        float eps = eps_, scale = scale_;
        sgemm_fn f = sgemm();
        const int* counts = in.size() > 7 ? in[7].data<int>() : nullptr;
        long counts_step = in.size() > 7 ? in[7].strides()[0] : 0;
        size_t sizes[3] = {out[0].nbytes(), out[1].nbytes(), out[2].nbytes()};
        mx::cpu::get_command_encoder(stream()).dispatch([=, starts = row_starts(x)]() {
            std::vector<long> live = live_rows(counts, counts_step, batch, length);
            long rows = static_cast<long>(live.size());
            if (rows < static_cast<long>(batch) * length) {  // fillers: zeros, never read
                std::memset(qs, 0, sizes[0]);
                std::memset(ks, 0, sizes[1]);
                std::memset(vs, 0, sizes[2]);
            }
            Scratch normed(rows * width), q(rows * nq), k(rows * nk), v(rows * nv);
            for (long r = 0; r < rows; r++)
                rms_norm_row(xs + starts[live[r]], step, w, wstep, width, eps, &normed[r * width]);
            product(f, normed.get(), rows, width, wq, nq, q.get());
            product(f, normed.get(), rows, width, wk, nk, k.get());
            product(f, normed.get(), rows, width, wv, nv, v.get());
            std::vector<float> cosines(half), sines(half);
            for (long r = 0; r < rows; r++) {
                long b = live[r] / length, t = live[r] % length;
                rope_angles(t, first[b * first_step], scale, inv, half, cosines.data(),
                            sines.data());
                for (int h = 0; h < heads; h++)
                    rope_row(&q[r * nq + h * qd], 1, qs + ((b * heads + h) * length + t) * qd, qd,
                             half, traditional, cosines.data(), sines.data());
                for (int h = 0; h < kv_heads; h++) {
                    long at = (b * kv_heads + h) * length + t;
                    rope_row(&k[r * nk + h * kd], 1, ks + at * kd, kd, half, traditional,
                             cosines.data(), sines.data());
                    std::memcpy(vs + at * vd, &v[r * nv + h * vd], sizeof(float) * vd);
                }
            }
        });
    }

    void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
        throw std::runtime_error("mlx-cache-server's block runs on the CPU only");
    }

    const char* name() const override { return "MlxcsBlockInput"; }

    bool is_equivalent(const mx::Primitive& other) const override {
        const BlockInput& o = static_cast<const BlockInput&>(other);
        return eps_ == o.eps_ && heads_ == o.heads_ && kv_heads_ == o.kv_heads_ &&
               dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_;
    }

  private:
    float eps_;
    int heads_, kv_heads_, dims_;
    bool traditional_;
    float scale_;
};

class BlockOutput : public mx::UnaryPrimitive {
  public:
    BlockOutput(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}

    void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
        const mx::array &x = in[0], &a = in[1];
        allocate(out);
        int batch = x.shape(0), length = x.shape(1), width = x.shape(2);
        int heads = a.shape(1), vd = a.shape(3), hidden = in[4].shape(0);
        long as[4] = {a.strides()[0], a.strides()[1], a.strides()[2], a.strides()[3]};
        const float *xs = x.data<float>(), *attended = a.data<float>();
        const float *wo = in[2].data<float>(), *w = in[3].data<float>(),
                    *wg = in[4].data<float>(), *wu = in[5].data<float>(),
                    *wd = in[6].data<float>();
        long step = x.strides()[2], wstep = in[3].strides()[0];
        float* o = out.data<float>();
        float eps = eps_;
        sgemm_fn f = sgemm();
        const int* counts = in.size() > 7 ? in[7].data<int>() : nullptr;
        long counts_step = in.size() > 7 ? in[7].strides()[0] : 0;
        mx::cpu::get_command_encoder(stream()).dispatch([=, starts = row_starts(x)]() {
            std::vector<long> live = live_rows(counts, counts_step, batch, length);
            long all = static_cast<long>(batch) * length, rows = static_cast<long>(live.size());
            long nh = static_cast<long>(heads) * vd;
            bool every = rows == all;  // else compact rows, put in place at the end
            Scratch joined(rows * nh), h(rows * width), normed(rows * width);
            for (long r = 0; r < rows; r++) {
                long b = live[r] / length, t = live[r] % length;
                for (int j = 0; j < heads; j++) {
                    const float* from = attended + b * as[0] + j * as[1] + t * as[2];
                    float* to = &joined[r * nh + j * vd];
                    for (int d = 0; d < vd; d++) to[d] = from[d * as[3]];
                }
            }
            product(f, joined.get(), rows, nh, wo, width, h.get());
            for (long r = 0; r < rows; r++) {
                float* hr = &h[r * width];
                const float* xr = xs + starts[live[r]];
                for (int i = 0; i < width; i++) hr[i] = xr[i * step] + hr[i];
                rms_norm_row(hr, 1, w, wstep, width, eps, &normed[r * width]);
            }
            Scratch gate(rows * hidden), up(rows * hidden), down(every ? 0 : rows * width);
            product(f, normed.get(), rows, width, wg, hidden, gate.get());
            product(f, normed.get(), rows, width, wu, hidden, up.get());
            swiglu(gate.get(), up.get(), rows * hidden);
            float* d = every ? o : down.get();
            product(f, gate.get(), rows, hidden, wd, width, d);
            for (long i = 0; i < rows * width; i++) d[i] = h[i] + d[i];
            if (every) return;
            for (long r = 0; r < all; r++)  // fillers: their input, finite
                for (int i = 0; i < width; i++) o[r * width + i] = xs[starts[r] + i * step];
            for (long r = 0; r < rows; r++)
                std::memcpy(o + live[r] * width, d + r * width, sizeof(float) * width);
        });
    }

    void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
        throw std::runtime_error("mlx-cache-server's block runs on the CPU only");
    }

    const char* name() const override { return "MlxcsBlockOutput"; }

    bool is_equivalent(const mx::Primitive& other) const override {
        return eps_ == static_cast<const BlockOutput&>(other).eps_;
    }

  private:
    float eps_;
};

/* The block's SwiGLU as a node of its own, for the MLPs that are not in a block's node
   (`cpu_activations`): the same bits as mlx-lm's `swiglu`, 16 lanes at a time, and no
   round trip through numpy. gate and up of one shape, any strides. */
class Swiglu : public mx::UnaryPrimitive {
  public:
    explicit Swiglu(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

    void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
        allocate(out);
        long n = static_cast<long>(out.size()), width = n ? in[0].shape(-1) : 0;
        const float *gate = in[0].data<float>(), *up = in[1].data<float>();
        long gstep = in[0].strides().back(), ustep = in[1].strides().back();
        float* o = out.data<float>();
        mx::cpu::get_command_encoder(stream()).dispatch(
            [=, gs = row_starts(in[0]), us = row_starts(in[1])]() {
                Scratch packed(n);
                for (size_t r = 0; r < gs.size(); r++)
                    for (long i = 0; i < width; i++) {
                        o[r * width + i] = gate[gs[r] + i * gstep];
                        packed[r * width + i] = up[us[r] + i * ustep];
                    }
                swiglu(o, packed.get(), n);
            });
    }

    void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
        throw std::runtime_error("mlx-cache-server's SwiGLU runs on the CPU only");
    }

    const char* name() const override { return "MlxcsSwiGLU"; }

    bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::array swiglu_node(const mx::array& gate, const mx::array& up) {
    if (gate.dtype() != mx::float32 || up.dtype() != mx::float32 || gate.shape() != up.shape() ||
        gate.ndim() == 0)
        throw std::invalid_argument("swiglu takes float32 gate and up of one shape");
    return mx::array(gate.shape(), mx::float32, std::make_shared<Swiglu>(cpu_stream()),
                     {gate, up});
}

/* x @ w.T for the products outside a block's nodes (`kernel_linear`): our products for a
   decode step's few rows, the BLAS for the rest (`mlxcs_sgemm` decides), so a row gets
   the same bits here as in a block. x of any strides, w evaluated and row-contiguous. */
class Linear : public mx::UnaryPrimitive {
  public:
    explicit Linear(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

    void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
        allocate(out);
        const mx::array &x = in[0], &w = in[1];
        int k = x.shape(-1), n = w.shape(0);
        const float *xs = x.data<float>(), *ws = w.data<float>();
        long step = x.strides().back();
        float* o = out.data<float>();
        mx::cpu::get_command_encoder(stream()).dispatch([=, starts = row_starts(x)]() {
            int rows = static_cast<int>(starts.size());
            Scratch packed(static_cast<long>(rows) * k);
            for (int r = 0; r < rows; r++)
                for (int i = 0; i < k; i++) packed[static_cast<long>(r) * k + i] = xs[starts[r] + i * step];
            if (rows && k)
                product(sgemm(), packed.get(), rows, k, ws, n, o);
            else  /* an empty sum: zeros, as MLX's matmul gives */
                std::fill(o, o + static_cast<long>(rows) * n, 0.0f);
        });
    }

    void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
        throw std::runtime_error("mlx-cache-server's linear runs on the CPU only");
    }

    const char* name() const override { return "MlxcsLinear"; }

    bool is_equivalent(const mx::Primitive&) const override { return true; }
};

mx::array linear(const mx::array& x, const mx::array& w) {
    if (x.dtype() != mx::float32 || x.ndim() == 0 || w.ndim() != 2 ||
        !weight_ok(w, w.shape(0), x.shape(-1)))
        throw std::invalid_argument(
            "linear takes float32 x (..., k) and an evaluated row-contiguous float32 w (n, k)");
    mx::Shape shape = x.shape();
    shape.back() = w.shape(0);
    return mx::array(shape, mx::float32, std::make_shared<Linear>(cpu_stream()), {x, w});
}

/* lengths, where given: int32, one count a batch row (read on evaluation) */
bool lengths_ok(const std::optional<mx::array>& lengths, const mx::array& x) {
    return !lengths || (lengths->dtype() == mx::int32 && lengths->ndim() == 1 &&
                        lengths->shape(0) == x.shape(0));
}

std::vector<mx::array> block_input(const mx::array& x, const mx::array& norm, const mx::array& wq,
                                   const mx::array& wk, const mx::array& wv,
                                   const mx::array& offset, const mx::array& inv_freq, float eps,
                                   int heads, int kv_heads, int dims, bool traditional,
                                   float scale, const std::optional<mx::array>& lengths) {
    bool ok = x.dtype() == mx::float32 && x.ndim() == 3 && heads > 0 && kv_heads > 0 &&
              heads % kv_heads == 0 && wq.ndim() == 2 && wq.shape(0) % heads == 0 &&
              wk.ndim() == 2 && wk.shape(0) % kv_heads == 0 && wv.ndim() == 2 &&
              wv.shape(0) % kv_heads == 0 && norm.dtype() == mx::float32 && norm.ndim() == 1 &&
              norm.shape(0) == x.shape(2) && sgemm();
    int width = ok ? x.shape(2) : 0, size = ok ? wq.shape(0) / heads : 0;
    ok = ok && weight_ok(wq, wq.shape(0), width) && weight_ok(wk, wk.shape(0), width) &&
         weight_ok(wv, wv.shape(0), width) && wk.shape(0) / kv_heads == size && dims > 0 &&
         dims % 2 == 0 && dims <= size && offset.dtype() == mx::int32 && offset.ndim() == 1 &&
         (offset.size() == 1 || offset.size() == static_cast<size_t>(x.shape(0))) &&
         inv_freq.dtype() == mx::float32 && inv_freq.ndim() == 1 &&
         inv_freq.shape(0) == dims / 2;
    if (!ok || !lengths_ok(lengths, x))
        throw std::invalid_argument(
            "block_input takes float32 x (batch, positions, width), norm (width), evaluated "
            "row-contiguous q, k and v weights (heads * size, width), int32 offset (1 or "
            "batch), float32 inv_freq (dims / 2), int32 lengths (batch) or none, and "
            "cblas_sgemm in the process");
    int b = x.shape(0), l = x.shape(1), vd = wv.shape(0) / kv_heads;
    std::vector<mx::array> inputs = {x, norm, wq, wk, wv, offset, inv_freq};
    if (lengths) inputs.push_back(*lengths);
    return mx::array::make_arrays(
        {{b, heads, l, size}, {b, kv_heads, l, size}, {b, kv_heads, l, vd}},
        {mx::float32, mx::float32, mx::float32},
        std::make_shared<BlockInput>(cpu_stream(), eps, heads, kv_heads, dims, traditional, scale),
        inputs);
}

mx::array block_output(const mx::array& x, const mx::array& attended, const mx::array& wo,
                       const mx::array& norm, const mx::array& gate, const mx::array& up,
                       const mx::array& down, float eps,
                       const std::optional<mx::array>& lengths) {
    bool ok = x.dtype() == mx::float32 && x.ndim() == 3 && attended.dtype() == mx::float32 &&
              attended.ndim() == 4 && attended.shape(0) == x.shape(0) &&
              attended.shape(2) == x.shape(1) && norm.dtype() == mx::float32 &&
              norm.ndim() == 1 && norm.shape(0) == x.shape(2) && gate.ndim() == 2 && sgemm();
    if (ok) {
        int width = x.shape(2), hidden = gate.shape(0);
        ok = weight_ok(wo, width, attended.shape(1) * attended.shape(3)) &&
             weight_ok(gate, hidden, width) && weight_ok(up, hidden, width) &&
             weight_ok(down, width, hidden);
    }
    if (!ok || !lengths_ok(lengths, x))
        throw std::invalid_argument(
            "block_output takes float32 x (batch, positions, width), attention's output "
            "(batch, heads, positions, size), evaluated row-contiguous o, gate, up and down "
            "weights, norm (width), int32 lengths (batch) or none, and cblas_sgemm in the "
            "process");
    std::vector<mx::array> inputs = {x, attended, wo, norm, gate, up, down};
    if (lengths) inputs.push_back(*lengths);
    return mx::array(x.shape(), mx::float32, std::make_shared<BlockOutput>(cpu_stream(), eps),
                     inputs);
}

}  // namespace

void define_block(nb::module_& m) {
    m.def("block_input", &block_input, nb::arg("x"), nb::arg("norm"), nb::arg("wq"),
          nb::arg("wk"), nb::arg("wv"), nb::arg("offset"), nb::arg("inv_freq"), nb::arg("eps"),
          nb::arg("heads"), nb::arg("kv_heads"), nb::arg("dims"), nb::arg("traditional"),
          nb::arg("scale"), nb::arg("lengths") = nb::none());
    m.def("block_output", &block_output, nb::arg("x"), nb::arg("attended"), nb::arg("wo"),
          nb::arg("norm"), nb::arg("gate"), nb::arg("up"), nb::arg("down"), nb::arg("eps"),
          nb::arg("lengths") = nb::none());
    m.def("has_block", []() { return true; });
    m.def("gemm_calls", &mlxcs_gemm_calls);
    m.def("gemm_max_rows", &mlxcs_gemm_max_rows);
    m.def("pool_parts", &pool_parts);  // the threads products run on, for tests
    m.def("pool_quiet", &mlxcs_pool_quiet);  // products under way on the BLAS, for tests
    m.def("swiglu", &swiglu_node, nb::arg("gate"), nb::arg("up"));
    m.def("linear", &linear, nb::arg("x"), nb::arg("w"));
}

}  // namespace mlxcs
