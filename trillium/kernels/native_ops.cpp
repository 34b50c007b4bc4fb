/* Compiled decode's hot ops as C++ kernels of torch's dispatcher: no Python between the graph and
 * the C kernels.
 *
 * Built at first use by trillium/kernels/native_ops.py through c_library.py (the system C++
 * compiler against torch's own headers and libraries); the schemas and fake implementations are
 * Python's (native_ops.py), this file gives the CPU kernels:
 *
 *   trillium_native::gguf_linear(x, blocks, ggml_type, in_features, bias, int8)
 *       trillium::gguf_linear's packed path (models/packed_linear.py): gguf_cpu.c's kernels
 *   trillium_native::cpu_linear(x, weight, bias)
 *       trillium::cpu_linear's few-rows path (models/llama.py): dense_cpu.c's kernel
 *   trillium_native::graph_attention(q, k, v, context, step, layer, scale, sliding_window, softcap)
 *       trillium::graph_attention (models/graph_attention.py) for a float32 cache: the step's keys
 *       and values written to their slots, then paged_attention_cpu.c; any other step calls
 *       trillium::graph_attention itself (through the dispatcher)
 *   trillium_native::rms_norm(x, weight, eps), ::silu_and_mul(x), ::rotary_embedding(positions, q, k, table)
 *       rowwise_cpu.c's functions, which eager calls too (kernels/dispatch.py says why a row must get
 *       the same bits either way); a call rowwise_cpu.py would not take runs the Python twin
 *       (trillium::rms_norm, ...: the reference), as eager does
 *
 * and one function of its own, trillium_native_decode (models/native_decode.py): a whole decode forward
 * of the plain Llama family calling those kernels from one C++ loop, without the graph.
 *
 * WHY: a decode step of SmolLM2-135M calls ~150 such ops. From Inductor's Python wrapper each
 * Python-implemented op cost ~20-50 us of dispatch, checks and ctypes around kernels of ~10-40 us
 * (bench/native_ops.py measures both); the same call into this file costs ~3 us.
 *
 * The C kernels are the ones Python loads (gguf_cpu.c, dense_cpu.c, paged_attention_cpu.c, rowwise_cpu.c,
 * panel_cpu.c, each its own shared library); native_ops.py hands their addresses to trillium_native_bind
 * (and the panel kernel's to trillium_native_bind_panel) once, so both paths run the same machine
 * code and give the same bits.
 *
 * Padding rows (kernels/padded_rows.py): a compiled graph of B rows may carry n < B live ones; the
 * Python side tells this thread n (trillium_native_set_live_rows) and the linears compute rows < n
 * only, the rest zeros, as skip_padding does.
 *
 * Attention state: the step's slots, block tables and per-row key counts, and each layer's cache
 * pointers, live in a `Step` that native_ops.Step fills before each graph call (pointers into
 * tensors the Python side keeps alive for the call) and clears after it.
 */
#include <mutex>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

extern "C" {
typedef int (*gguf_matmul_fn)(int, const float *, long, long, long, const uint8_t *, long, float *, int);
typedef long (*gguf_row_bytes_fn)(int, long, int);
typedef int (*dense_linear_fn)(const float *, long, long, long, const float *, long, const float *, float *,
                               int);
typedef int (*panel_linear_fn)(const float *, long, long, long, const float *, long, const float *, float *, int);
typedef int (*decode_attention_fn)(const float *, long, long, long, long, long, const void *, const void *,
                                   const float *, long, long, const int32_t *, long, const int32_t *,
                                   const int32_t *, float, const float *, const float *, long, float, float *,
                                   int);
typedef void (*rms_norm_fn)(const float *, long, long, long, long, long, const float *, float, float *, int);
typedef void (*silu_and_mul_fn)(const float *, long, long, long, float *, int);
typedef int (*rope_fn)(const float *, long, long, long, long, long, const int64_t *, const float *, long, float *,
                       int);
}

namespace {

gguf_matmul_fn g_gguf_float32 = nullptr, g_gguf_int8 = nullptr;
gguf_row_bytes_fn g_gguf_row_bytes = nullptr;
dense_linear_fn g_dense = nullptr;
panel_linear_fn g_panel = nullptr;  // NULL: native decode takes float32 linears of up to g_dense_rows rows only
long g_dense_rows = 0;              // dense_cpu.MAX_ROWS: more rows than this run on the panels
decode_attention_fn g_attention = nullptr;
rms_norm_fn g_rms_norm = nullptr;
silu_and_mul_fn g_silu_and_mul = nullptr;
rope_fn g_rope = nullptr;
thread_local long t_live_rows = -1;  // < 0: no hint (every row is live)

/* What trillium::gguf_linear's packed path and trillium::cpu_linear's kernel path take. */
constexpr long kGgufRowsFloat32 = 32, kGgufRowsInt8 = 64, kDenseRows = 64;

struct Layer {
    float *k = nullptr, *v = nullptr;
    long slots = 0;  // num_blocks * block_size
};

struct Step {
    long num_tokens = -1;  // < 0: no native step (the op calls trillium::graph_attention)
    const int64_t *slot_mapping = nullptr;
    const int32_t *tables = nullptr;
    long table_stride = 0;
    const int32_t *row_lens = nullptr, *row_seq = nullptr;
    long block_size = 0, kv_heads = 0, head_dim = 0;
    std::vector<Layer> layers;
    long id = 0;  // its index in g_steps: what a compiled graph passes graph_attention
};

/* WHY steps are named by small ids in the graphs, not by their addresses: the id is an argument a
 * compiled graph holds as a constant, and Inductor's on-disk cache keys a graph by its constants. A
 * heap address differs in every process, so every start missed the cache and compiled again (the
 * default model's seven sizes: 326 s each start, not only the first). An id is the lowest free
 * slot, so the same steps made in the same order get the same ids in every process. Steps are made
 * and freed on the executor's thread; the mutex keeps the table whole if a finalizer runs elsewhere. */
constexpr long kMaxSteps = 256;
Step *g_steps[kMaxSteps] = {nullptr};
std::mutex g_steps_lock;

long live_rows(long m) { return t_live_rows >= 0 && t_live_rows < m ? t_live_rows : m; }

at::Tensor rows_out(long m, long n, long rows) {
    auto options = at::TensorOptions().dtype(at::kFloat);
    return rows < m ? at::zeros({m, n}, options) : at::empty({m, n}, options);
}

at::Tensor gguf_linear(const at::Tensor &x_in, const at::Tensor &blocks, int64_t ggml_type, int64_t in_features,
                       const std::optional<at::Tensor> &bias, bool int8) {
    TORCH_CHECK(g_gguf_float32 != nullptr, "trillium_native: the GGUF kernels are not bound");
    const long row_bytes = g_gguf_row_bytes(static_cast<int>(ggml_type), in_features, int8);
    TORCH_CHECK(row_bytes > 0, "ggml type ", ggml_type, int8 ? " has no int8-activation kernel" : " has no packed CPU kernel",
                " for K=", in_features);
    TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                    blocks.device().is_cpu() && blocks.size(1) == row_bytes,
                "packed weights must be contiguous uint8 [N, ", row_bytes, "] on the CPU");
    TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(1) == in_features &&
                    x_in.device().is_cpu(),
                "x must be float32 [M, ", in_features, "] on the CPU");
    const long m = x_in.size(0), n = blocks.size(0), rows = live_rows(m);
    TORCH_CHECK(rows <= (int8 ? kGgufRowsInt8 : kGgufRowsFloat32), "trillium_native::gguf_linear takes up to ",
                int8 ? kGgufRowsInt8 : kGgufRowsFloat32, " live rows, got ", rows);
    const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
    at::Tensor out = rows_out(m, n, rows);
    if (rows > 0) {
        const int rc = (int8 ? g_gguf_int8 : g_gguf_float32)(
            static_cast<int>(ggml_type), x.data_ptr<float>(), rows, in_features, x.stride(0),
            blocks.data_ptr<uint8_t>(), n, out.data_ptr<float>(), at::get_num_threads());
        TORCH_CHECK(rc != -2, "int8 activations of ", rows, " rows: allocation failed");
        TORCH_CHECK(rc == 0, "the GGUF kernel refused x [", rows, ", ", in_features, "]");
    }
    if (bias.has_value()) out.add_(*bias);
    return out;
}

at::Tensor cpu_linear(const at::Tensor &x_in, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(g_dense != nullptr, "trillium_native: the float32 linear kernel is not bound");
    TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.device().is_cpu(),
                "x must be float32 [M, K] on the CPU");
    TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.is_contiguous() &&
                    weight.device().is_cpu() && weight.size(1) == x_in.size(1),
                "weight must be contiguous float32 [N, ", x_in.size(1), "] on the CPU");
    const float *bias_ptr = nullptr;
    if (bias.has_value()) {
        TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == weight.size(0),
                    "bias must be contiguous float32 [", weight.size(0), "]");
        bias_ptr = bias->data_ptr<float>();
    }
    const long m = x_in.size(0), k = x_in.size(1), n = weight.size(0), rows = live_rows(m);
    TORCH_CHECK(rows <= kDenseRows, "trillium_native::cpu_linear takes up to ", kDenseRows, " live rows, got ",
                rows);
    const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
    at::Tensor out = rows_out(m, n, rows);
    if (rows > 0) {
        const int rc = g_dense(x.data_ptr<float>(), rows, k, x.stride(0), weight.data_ptr<float>(), n, bias_ptr,
                               out.data_ptr<float>(), at::get_num_threads());
        TORCH_CHECK(rc == 0, "the float32 linear kernel refused x [", rows, ", ", k, "] @ w [", n, ", ", k, "]");
    }
    return out;
}

at::Tensor python_graph_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t context,
                                  int64_t layer, double scale, std::optional<int64_t> window,
                                  std::optional<double> softcap) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("trillium::graph_attention", "")
                         .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, int64_t,
                                           int64_t, double, std::optional<int64_t>, std::optional<double>)>();
    return op.call(q, k, v, context, layer, scale, window, softcap);
}

/* rows 0 .. n-1 of src (KH * D floats each, `src_stride` floats apart) into the flat cache [slots, KH, D]
 * at slot_mapping (graph_attention's k and v; native decode's rotated keys and the QKV output's values,
 * whose slots it checked before writing anything, so the check here never throws from there). */
void write_rows(const float *src, long src_stride, float *cache, const Step &step, long slots) {
    const long row = step.kv_heads * step.head_dim;
    for (long t = 0; t < step.num_tokens; t++) {
        const int64_t slot = step.slot_mapping[t];
        TORCH_CHECK(slot >= 0 && slot < slots, "slot ", slot, " outside a cache of ", slots, " slots");
        std::memcpy(cache + slot * row, src + t * src_stride, sizeof(float) * row);
    }
}

at::Tensor graph_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t context,
                           int64_t step_id, int64_t layer, double scale, std::optional<int64_t> window,
                           std::optional<double> softcap) {
    const Step *step = step_id > 0 && step_id < kMaxSteps ? g_steps[step_id] : nullptr;
    if (step == nullptr || step->num_tokens < 0 || g_attention == nullptr)
        return python_graph_attention(q, k, v, context, layer, scale, window, softcap);
    TORCH_CHECK(layer >= 0 && layer < static_cast<long>(step->layers.size()), "layer ", layer, " has no cache");
    const long t = q.size(0), h = q.size(1), d = q.size(2), n = step->num_tokens;
    TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && k.scalar_type() == at::kFloat &&
                    k.is_contiguous() && v.scalar_type() == at::kFloat && v.is_contiguous() && d == step->head_dim &&
                    k.size(0) == t && k.size(1) == step->kv_heads && k.size(2) == d && v.sizes() == k.sizes() && n <= t,
                "trillium_native::graph_attention: q / k / v do not fit the step's cache");
    const Layer &cache = step->layers[layer];
    write_rows(k.data_ptr<float>(), k.size(1) * d, cache.k, *step, cache.slots);
    write_rows(v.data_ptr<float>(), v.size(1) * d, cache.v, *step, cache.slots);
    at::Tensor out = n < t ? at::zeros({t, h, d}, q.options()) : at::empty({t, h, d}, q.options());
    if (n == 0) return out;
    const int rc = g_attention(q.data_ptr<float>(), n, h, d, h * d, d, cache.k, cache.v, nullptr, step->block_size,
                               step->kv_heads, step->tables, step->table_stride, step->row_lens, step->row_seq,
                               static_cast<float>(scale), nullptr, nullptr, window.value_or(0),
                               static_cast<float>(softcap.value_or(0.0)), out.data_ptr<float>(),
                               at::get_num_threads());
    TORCH_CHECK(rc == 0, "paged decode attention refused q [", n, ", ", h, ", ", d, "]");
    return out;
}

/* The Python twin of a row-wise op (kernels/dispatch.py), for a call rowwise_cpu.py would not take
 * either: then both paths run the reference, and still agree. */
template <typename Fn>
c10::TypedOperatorHandle<Fn> twin(const char *name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

/* rowwise_cpu.py's _lib test: float32 CPU, last dimension contiguous. */
bool rowwise_takes(const at::Tensor &t) {
    return t.scalar_type() == at::kFloat && t.device().is_cpu() && t.dim() >= 1 && t.stride(-1) == 1;
}

at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps) {
    const long dims = x.dim();
    if (g_rms_norm == nullptr || !rowwise_takes(x) || !rowwise_takes(weight) || dims > 3 || weight.dim() != 1 ||
        weight.size(0) != x.size(-1) || x.numel() == 0) {
        static auto op = twin<at::Tensor(const at::Tensor &, const at::Tensor &, double)>("trillium::rms_norm");
        return op.call(x, weight, eps);
    }
    const long outer = dims == 1 ? 1 : x.size(0), inner = dims == 3 ? x.size(1) : 1;
    const long stride_outer = dims == 1 ? 0 : x.stride(0), stride_inner = dims == 3 ? x.stride(1) : 0;
    at::Tensor out = at::empty(x.sizes(), x.options());
    g_rms_norm(x.data_ptr<float>(), outer, inner, x.size(-1), stride_outer, stride_inner, weight.data_ptr<float>(),
               static_cast<float>(eps), out.data_ptr<float>(), at::get_num_threads());
    return out;
}

at::Tensor silu_and_mul(const at::Tensor &x) {
    if (g_silu_and_mul == nullptr || !rowwise_takes(x) || x.dim() != 2 || x.size(1) % 2 != 0 || x.numel() == 0) {
        static auto op = twin<at::Tensor(const at::Tensor &)>("trillium::silu_and_mul");
        return op.call(x);
    }
    const long inter = x.size(1) / 2;
    at::Tensor out = at::empty({x.size(0), inter}, x.options());
    g_silu_and_mul(x.data_ptr<float>(), x.size(0), inter, x.stride(0), out.data_ptr<float>(), at::get_num_threads());
    return out;
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor &positions, const at::Tensor &q,
                                                    const at::Tensor &k, const at::Tensor &table) {
    using Fn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor &, const at::Tensor &, const at::Tensor &,
                                                  const at::Tensor &);
    static auto op = twin<Fn>("trillium::rotary_embedding");
    const bool takes = g_rope != nullptr && rowwise_takes(q) && rowwise_takes(k) && rowwise_takes(table) &&
                       q.dim() == 3 && k.dim() == 3 && table.dim() == 2 && table.is_contiguous() &&
                       q.size(2) == table.size(1) && k.size(2) == table.size(1) && q.size(2) % 2 == 0 &&
                       positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous() &&
                       positions.device().is_cpu() && positions.size(0) == q.size(0) && k.size(0) == q.size(0);
    if (!takes) return op.call(positions, q, k, table);
    at::Tensor outs[2];
    const at::Tensor *ins[2] = {&q, &k};
    for (int i = 0; i < 2; i++) {
        const at::Tensor &x = *ins[i];
        outs[i] = at::empty(x.sizes(), x.options());
        if (g_rope(x.data_ptr<float>(), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1),
                   positions.data_ptr<int64_t>(), table.data_ptr<float>(), table.size(0), outs[i].data_ptr<float>(),
                   at::get_num_threads()))
            return op.call(positions, q, k, table);  // a position outside the table: the reference says which
    }
    return {outs[0], outs[1]};
}

}  // namespace

extern "C" {

void trillium_native_bind(void *gguf_row_bytes, void *gguf_float32, void *gguf_int8, void *dense, void *attention,
                          void *rms_norm, void *silu_and_mul, void *rope) {
    g_rms_norm = reinterpret_cast<rms_norm_fn>(rms_norm);
    g_silu_and_mul = reinterpret_cast<silu_and_mul_fn>(silu_and_mul);
    g_rope = reinterpret_cast<rope_fn>(rope);
    g_gguf_row_bytes = reinterpret_cast<gguf_row_bytes_fn>(gguf_row_bytes);
    g_gguf_float32 = reinterpret_cast<gguf_matmul_fn>(gguf_float32);
    g_gguf_int8 = reinterpret_cast<gguf_matmul_fn>(gguf_int8);
    g_dense = reinterpret_cast<dense_linear_fn>(dense);
    g_attention = reinterpret_cast<decode_attention_fn>(attention);
}

/* The panel kernel (panel_cpu.c's trillium_panel_linear, or NULL where models/llama.py does not run it)
 * and dense_cpu.MAX_ROWS: native decode's float32 linears of more rows than that run on the weights'
 * panels, as trillium::cpu_linear's Python path sends them (kernels/panel_cpu.py). */
void trillium_native_bind_panel(void *panel, long dense_rows) {
    g_panel = reinterpret_cast<panel_linear_fn>(panel);
    g_dense_rows = dense_rows;
}

void trillium_native_set_live_rows(long n) { t_live_rows = n; }

/* A new step, or NULL when kMaxSteps - 1 are alive (the caller then runs the Python op). */
void *trillium_native_step_new(void) {
    std::lock_guard<std::mutex> hold(g_steps_lock);
    for (long id = 1; id < kMaxSteps; id++)
        if (g_steps[id] == nullptr) {
            Step *step = new Step();
            step->id = id;
            g_steps[id] = step;
            return step;
        }
    return nullptr;
}

long trillium_native_step_id(void *handle) { return static_cast<Step *>(handle)->id; }

void trillium_native_step_free(void *handle) {
    Step *step = static_cast<Step *>(handle);
    {
        std::lock_guard<std::mutex> hold(g_steps_lock);
        g_steps[step->id] = nullptr;
    }
    delete step;
}

/* Layer i's float32 caches [num_blocks, block_size, kv_heads, head_dim]; num_layers resets the list. */
void trillium_native_step_caches(void *handle, long num_layers, float **k, float **v, long num_blocks,
                                 long block_size, long kv_heads, long head_dim) {
    Step *step = static_cast<Step *>(handle);
    step->layers.assign(num_layers, Layer());
    for (long i = 0; i < num_layers; i++) step->layers[i] = Layer{k[i], v[i], num_blocks * block_size};
    step->block_size = block_size, step->kv_heads = kv_heads, step->head_dim = head_dim;
}

/* The step's metadata (num_tokens < 0: none; the op falls back to trillium::graph_attention). */
void trillium_native_step_set(void *handle, long num_tokens, const int64_t *slot_mapping, const int32_t *tables,
                              long table_stride, const int32_t *row_lens, const int32_t *row_seq) {
    Step *step = static_cast<Step *>(handle);
    step->num_tokens = num_tokens, step->slot_mapping = slot_mapping, step->tables = tables;
    step->table_stride = table_stride, step->row_lens = row_lens, step->row_seq = row_seq;
}

/* Native decode (models/native_decode.py): one decode forward of the dense Llama family, float32, n
 * rows of one token each, every kernel called from here -- the embedding rows, per layer the input
 * norm, QKV linear, rope of q and k, the keys and values written to their slots, the paged
 * attention, the output linear and its residual, the post-attention norm, gate/up linear, SiLU-and-mul,
 * down linear and its residual, then the final norm into `out` [n, hidden].
 *
 * The same C kernels, arguments and order as the compiled graph's ops (and eager's), so every row
 * has their bits; what it leaves out is the graph's glue: ~10 dispatcher calls a layer, a tensor
 * allocated for each op's output, and the Python around the graph call.
 *
 * `layer_ptrs`: kNativeLayerPointers a layer (input norm, QKV weight, QKV bias, output weight, output
 * bias, post-attention norm, gate/up weight, gate/up bias, down weight, down bias, q norm, k norm; a NULL
 * bias: none; NULL q / k norms: none, else Qwen3's per-head norms of q and k before rope);
 * `linear_kinds`: 4 a layer (QKV, output, gate/up, down), -1 for float32 weights, else the GGUF type of
 * blocks kept packed (| kNativeLinearInt8 for int8 activations): native_linear says how each runs.
 * `panels`: 4 a layer, in the same order, each float32 weight's panel-packed copy (panel_cpu.pack), read
 * when n is past g_dense_rows (NULL then: refused; unused, and may be NULL, for fewer rows).
 * The step (its slots, block tables and key counts, each layer's float32 cache) is the one
 * trillium_native_step_set filled for this forward.
 *
 * Returns 0; -1, having written nothing, for what it does not take (a token id, position or slot out of
 * range, a step that does not fit); -2 when a kernel refused midway (the caches may hold this step's
 * keys for some layers: the caller raises). */
constexpr long kNativeLayerPointers = 12;
constexpr long kNativeLinearInt8 = 1L << 16;  // a linear kind's flag: the packed kernel's int8 activations
constexpr long kNativeRows = 256;             // the most rows a native forward takes (native_decode.MAX_ROWS)

/* Does native_linear take m rows of a linear of this kind? (checked before anything is written) */
static bool takes_rows(long kind, const void *panel, long m) {
    if (kind < 0) return m <= g_dense_rows || (g_panel != nullptr && panel != nullptr);
    return m <= (kind & kNativeLinearInt8 ? kGgufRowsInt8 : kGgufRowsFloat32);
}

/* y [m, n] = x [m, k] @ W^T (+ bias) as trillium::cpu_linear (kind -1: float32 W; up to g_dense_rows rows
 * dense_cpu.c's kernel, more on W's panel-packed copy `panel`) or ::gguf_linear (kind: the ggml type,
 * | kNativeLinearInt8 for int8 activations; W its blocks) compute it. */
static int native_linear(long kind, const void *w, const float *panel, const float *bias, const float *x, long m,
                         long k, long n, float *y, int threads) {
    if (!takes_rows(kind, panel, m)) return -1;
    if (kind < 0 && m <= g_dense_rows) return g_dense(x, m, k, k, static_cast<const float *>(w), n, bias, y, threads);
    if (kind < 0) return g_panel(x, m, k, k, panel, n, bias, y, threads) ? -1 : 0;
    const bool int8 = kind & kNativeLinearInt8;
    const int type = static_cast<int>(kind & (kNativeLinearInt8 - 1));
    const gguf_matmul_fn matmul = int8 ? g_gguf_int8 : g_gguf_float32;
    if (matmul == nullptr || g_gguf_row_bytes(type, k, int8) <= 0) return -1;
    if (matmul(type, x, m, k, k, static_cast<const uint8_t *>(w), n, y, threads)) return -1;
    if (bias != nullptr)  // after the product, as gguf_linear's out.add_(bias)
        for (long i = 0; i < m; i++)
            for (long j = 0; j < n; j++) y[i * n + j] = y[i * n + j] + bias[j];
    return 0;
}

int trillium_native_decode(void *step_handle, long n, const int64_t *ids, const int64_t *positions, long num_layers,
                           long hidden, long heads, long kv_heads, long head_dim, long inter, float eps, float scale,
                           const long *windows, const void *const *layer_ptrs, const long *linear_kinds,
                           const float *const *panels, const float *embed, long vocab,
                           const float *final_norm, const float *table, long table_rows, float *out, int threads) {
    const Step *step = static_cast<const Step *>(step_handle);
    if (step == nullptr || n <= 0 || n > kNativeRows || num_layers <= 0 || step->num_tokens != n ||
        step->row_seq != nullptr ||
        static_cast<long>(step->layers.size()) != num_layers || step->kv_heads != kv_heads ||
        step->head_dim != head_dim || g_dense == nullptr || g_attention == nullptr || g_rms_norm == nullptr ||
        g_silu_and_mul == nullptr || g_rope == nullptr)
        return -1;
    for (long i = 0; i < num_layers * 4; i++)  // every linear's kernel takes n rows, or nothing written
        if (!takes_rows(linear_kinds[i], panels == nullptr ? nullptr : panels[i], n)) return -1;
    for (long t = 0; t < n; t++) {
        if (ids[t] < 0 || ids[t] >= vocab || positions[t] < 0 || positions[t] >= table_rows) return -1;
        if (step->slot_mapping[t] < 0 || step->slot_mapping[t] >= step->layers[0].slots) return -1;
    }
    const long q_size = heads * head_dim, kv_size = kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    /* WHY thread-local and kept: a forward runs every few ms on the executor's thread; allocating ~1 MB
     * each time would map and fault fresh pages per call. */
    thread_local std::vector<float> scratch;
    const long sizes[] = {hidden, hidden, qkv_size, q_size, kv_size, q_size, hidden, 2 * inter, inter, q_size, kv_size};
    long total = 0;
    for (long size : sizes) total += n * size;
    if (static_cast<long>(scratch.size()) < total) scratch.resize(total);
    float *x = scratch.data(), *h = x + n * hidden, *qkv = h + n * hidden, *q = qkv + n * qkv_size;
    float *k = q + n * q_size, *attn = k + n * kv_size, *proj = attn + n * q_size, *gate_up = proj + n * hidden;
    float *act = gate_up + n * 2 * inter, *q_normed = act + n * inter, *k_normed = q_normed + n * q_size;
    for (long t = 0; t < n; t++) std::memcpy(x + t * hidden, embed + ids[t] * hidden, sizeof(float) * hidden);
    for (long l = 0; l < num_layers; l++) {
        const void *const *w = layer_ptrs + l * kNativeLayerPointers;
        const long *kind = linear_kinds + l * 4;  // qkv, o, gate/up, down
        const float *const *panel = panels == nullptr ? nullptr : panels + l * 4;
#define PANEL(i) (panel == nullptr ? nullptr : panel[i])
        const float *const *f = reinterpret_cast<const float *const *>(w);
        const Layer &cache = step->layers[l];
        g_rms_norm(x, n, 1, hidden, hidden, 0, f[0], eps, h, threads);
        if (native_linear(kind[0], w[1], PANEL(0), f[2], h, n, hidden, qkv_size, qkv, threads)) return -2;
        const float *q_in = qkv, *k_in = qkv + q_size;  // the heads rope reads, at (stride_t, head_dim)
        long q_stride = qkv_size, k_stride = qkv_size;
        if (f[10] != nullptr) {  // q / k norms (Qwen3): each head's row normed first, as the norm op does
            g_rms_norm(qkv, n, heads, head_dim, qkv_size, head_dim, f[10], eps, q_normed, threads);
            g_rms_norm(qkv + q_size, n, kv_heads, head_dim, qkv_size, head_dim, f[11], eps, k_normed, threads);
            q_in = q_normed, k_in = k_normed, q_stride = q_size, k_stride = kv_size;
        }
        if (g_rope(q_in, n, heads, head_dim, q_stride, head_dim, positions, table, table_rows, q, threads) ||
            g_rope(k_in, n, kv_heads, head_dim, k_stride, head_dim, positions, table, table_rows, k, threads))
            return -2;
        write_rows(k, kv_size, cache.k, *step, cache.slots);  // the rotated keys
        write_rows(qkv + q_size + kv_size, qkv_size, cache.v, *step, cache.slots);  // the QKV output's values
        if (g_attention(q, n, heads, head_dim, q_size, head_dim, cache.k, cache.v, nullptr, step->block_size,
                        kv_heads, step->tables, step->table_stride, step->row_lens, nullptr, scale, nullptr,
                        nullptr, windows[l], 0.0f, attn, threads))
            return -2;
        if (native_linear(kind[1], w[3], PANEL(1), f[4], attn, n, q_size, hidden, proj, threads)) return -2;
        for (long i = 0; i < n * hidden; i++) x[i] = x[i] + proj[i];
        g_rms_norm(x, n, 1, hidden, hidden, 0, f[5], eps, h, threads);
        if (native_linear(kind[2], w[6], PANEL(2), f[7], h, n, hidden, 2 * inter, gate_up, threads)) return -2;
        g_silu_and_mul(gate_up, n, inter, 2 * inter, act, threads);
        if (native_linear(kind[3], w[8], PANEL(3), f[9], act, n, inter, hidden, proj, threads)) return -2;
        for (long i = 0; i < n * hidden; i++) x[i] = x[i] + proj[i];
#undef PANEL
    }
    g_rms_norm(x, n, 1, hidden, hidden, 0, final_norm, eps, out, threads);
    return 0;
}

/* Native greedy run (models/native_decode.py NativeDecode.greedy; the executor's multi-step decode,
 * scheduler/multi_step.py): up to `num_steps` decode forwards of the same n rows, each through
 * trillium_native_decode, then the LM head (`head`: native_linear's kind `head_kind`, `head_rows`
 * vocabulary rows, bias or NULL; `head_panel` its panel-packed copy, read past g_dense_rows rows for
 * a float32 head) and each row's argmax, which is the next forward's input token.
 *
 * WHY: between two forwards of a one-stream multi-step run the executor's Python (the step's metadata,
 * two tensors, the LM head call, the sampler, the bookkeeping) took ~0.2-0.5 ms with one of the two
 * cores busy and the other spinning at OpenMP's barrier; here it is a few microseconds. Only for rows
 * the sampler would give the argmax of the raw logits (the caller checks: greedy, no processors,
 * penalties, bias, grammar or logprobs): the same kernels with the same arguments as the Python
 * path's compute_logits, so the same logits bits, and torch's argmax rule (the first maximal value;
 * a NaN wins, the first one).
 *
 * Step j's metadata: slots[j * n + t] and the key counts lens[j * n + t] (the row's position is
 * lens - 1), on the block tables trillium_native_step_set gave. `tokens` [num_steps, n] receives
 * the sampled ids; `logits_out` (NULL: not kept) [num_steps, n, head_rows] the logits (tests).
 * A row's stop ids are stop_ids[stop_offsets[t] .. stop_offsets[t + 1]).
 *
 * Returns the forwards run: num_steps, or fewer when a row sampled one of its stop ids (the run ends
 * after that forward, as the executor's loop would end that row); -1, having written nothing, for what
 * it does not take (as trillium_native_decode, checked for every step up front; a vocabulary
 * whose ids the embedding does not have); -2 when a kernel refused midway. */
int trillium_native_greedy(void *step_handle, long n, long num_steps, const int64_t *first_ids, const int64_t *slots,
                           const int32_t *lens, const int64_t *stop_ids, const long *stop_offsets, const void *head,
                           const float *head_panel, const float *head_bias, long head_kind, long head_rows,
                           long num_layers, long hidden, long heads, long kv_heads, long head_dim, long inter,
                           float eps, float scale,
                           const long *windows, const void *const *layer_ptrs, const long *linear_kinds,
                           const float *const *panels, const float *embed, long vocab, const float *final_norm,
                           const float *table, long table_rows, int64_t *tokens, float *logits_out, int threads) {
    Step *step = static_cast<Step *>(step_handle);
    if (step == nullptr || n <= 0 || num_steps <= 0 || step->num_tokens != n || step->layers.empty() ||
        head_rows <= 0 || head_rows > vocab || !takes_rows(head_kind, head_panel, n))
        return -1;
    for (long i = 0; i < num_steps * n; i++)
        if (slots[i] < 0 || slots[i] >= step->layers[0].slots || lens[i] < 1 || lens[i] > table_rows) return -1;
    const int64_t *saved_slots = step->slot_mapping;
    const int32_t *saved_lens = step->row_lens;
    thread_local std::vector<float> out, logits;
    thread_local std::vector<int64_t> ids, positions;
    out.resize(n * hidden), logits.resize(n * head_rows), ids.assign(first_ids, first_ids + n), positions.resize(n);
    long j = 0, rc = 0;
    bool stopped = false;
    for (; j < num_steps && !stopped; j++) {
        step->slot_mapping = slots + j * n, step->row_lens = lens + j * n;
        for (long t = 0; t < n; t++) positions[t] = lens[j * n + t] - 1;
        rc = trillium_native_decode(step, n, ids.data(), positions.data(), num_layers, hidden, heads, kv_heads,
                                    head_dim, inter, eps, scale, windows, layer_ptrs, linear_kinds, panels, embed,
                                    vocab, final_norm, table, table_rows, out.data(), threads);
        if (rc == 0 && native_linear(head_kind, head, head_panel, head_bias, out.data(), n, hidden, head_rows,
                                     logits.data(), threads))
            rc = -2;
        if (rc != 0) break;
        for (long t = 0; t < n; t++) {
            const float *row = logits.data() + t * head_rows;
            long best = 0;
            for (long v = 1; v < head_rows; v++)  // torch's argmax: the first maximum, a NaN above all
                if (!(row[best] != row[best]) && (row[v] > row[best] || row[v] != row[v])) best = v;
            tokens[j * n + t] = ids[t] = best;
            for (long s = stop_offsets[t]; s < stop_offsets[t + 1]; s++) stopped |= stop_ids[s] == best;
        }
        if (logits_out != nullptr)
            std::memcpy(logits_out + j * n * head_rows, logits.data(), sizeof(float) * n * head_rows);
    }
    step->slot_mapping = saved_slots, step->row_lens = saved_lens;
    if (rc != 0) return j == 0 && rc == -1 ? -1 : -2;
    return static_cast<int>(j);
}

}  // extern "C"

TORCH_LIBRARY_IMPL(trillium_native, CPU, m) {
    m.impl("gguf_linear", TORCH_FN(gguf_linear));
    m.impl("cpu_linear", TORCH_FN(cpu_linear));
    m.impl("graph_attention", TORCH_FN(graph_attention));
    m.impl("rms_norm", TORCH_FN(rms_norm));
    m.impl("silu_and_mul", TORCH_FN(silu_and_mul));
    m.impl("rotary_embedding", TORCH_FN(rotary_embedding));
}
