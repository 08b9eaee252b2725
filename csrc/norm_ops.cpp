// Device-independent bodies of the ops: check arguments, find the rows' layouts (copying only what the kernels
// cannot read in place), allocate outputs, fill a parameter block, and hand it to the device's launcher. LayerNorm and RMSNorm share every line (rms flag).
#include "norm.h"
#include "quant_math.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/from_blob.h>

#include <limits>
#include <utility>

namespace layernorm_ext {
namespace {

const void* ptr_or_null(const OptTensor& t) { return t.has_value() ? t->data_ptr() : nullptr; }

OptTensor contiguous(const OptTensor& t) {
  if (!t.has_value()) return std::nullopt;
  return t->contiguous();
}

// The layout of t's rows (row_layout.h), t being [leading dims..., normalized_ndim dims of cols elements], or
// none where the kernels cannot read it in place: normalized dims not packed, or leading dims that do not
// coalesce into two.
std::optional<RowLayout> row_layout(const Tensor& t, int64_t normalized_ndim, int64_t cols) {
  const at::IntArrayRef sizes = t.sizes(), strides = t.strides();
  const int64_t axis = t.dim() - normalized_ndim;
  int64_t packed = 1;
  for (int64_t d = t.dim() - 1; d >= axis; --d) {
    if (sizes[d] != 1 && strides[d] != packed) return std::nullopt;
    packed *= sizes[d];
  }
  // The leading dims of more than one element, innermost first, each merged into the one inside it where
  // they step evenly (dims of one element and a contiguous tensor's leading dims vanish).
  int64_t kept_sizes[2], kept_strides[2];
  int kept = 0;
  for (int64_t d = axis - 1; d >= 0; --d) {
    if (sizes[d] == 1) continue;
    if (kept > 0 && strides[d] == kept_strides[kept - 1] * kept_sizes[kept - 1]) {
      kept_sizes[kept - 1] *= sizes[d];
      continue;
    }
    if (kept == 2) return std::nullopt;
    kept_sizes[kept] = sizes[d];
    kept_strides[kept] = strides[d];
    ++kept;
  }
  if (kept == 0) return RowLayout::packed(cols);
  if (kept == 1) return RowLayout{1, 0, kept_strides[0]};
  return RowLayout{kept_sizes[0], kept_strides[0], kept_strides[1]};
}

// Channels-first rows, which the columns kernels (csrc/cpu/columns.h, csrc/cuda/columns_kernels.cuh) read in
// place: t is [leading..., cols] over a dense [images][cols][plane] block of memory, (N, *spatial, C) as
// layer_norm_2d permutes a contiguous (N, C, *spatial) tensor. That is: one normalized dim, of cols > 1 elements
// and stride plane; the innermost leading dims of more than one element coalesce into the plane (pixels, stride 1,
// plane > 1 of them); the rest into the images, stride cols * plane. Returns plane, or 0 for any other layout
// (those with packed rows go to the row kernels; the rest are copied: a slice of the channels, a strided plane,
// normalized_shape of two dims or more).
// layernorm_ext/ops.py (_column_plane) mirrors it for the fake kernels' strides.
int64_t column_plane(const Tensor& t, int64_t normalized_ndim) {
  if (normalized_ndim != 1 || t.dim() < 2) return 0;
  const at::IntArrayRef sizes = t.sizes(), strides = t.strides();
  const int64_t cols = sizes.back();
  int64_t expected = 1, plane = 0;  // the next dim's stride if it continues the pixels (then the images)
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (sizes[d] == 1) continue;
    if (strides[d] != expected) {
      if (plane != 0 || expected == 1) return 0;
      plane = expected;  // the pixels end here; the images start at cols * plane
      expected *= cols;
      if (strides[d] != expected) return 0;
    }
    expected *= sizes[d];
  }
  if (plane == 0) plane = expected;  // no image dims (N = 1)
  return cols > 1 && plane > 1 && strides.back() == plane ? plane : 0;
}

// An operand's rows for the kernels: the tensor itself where its layout allows, else a contiguous copy.
struct ReadRows {
  Tensor rows;
  RowLayout layout;
};

// t with the memory layout of like (same sizes): itself if it has it (dims of one element aside), else a copy.
Tensor in_layout_of(const Tensor& t, const Tensor& like) {
  bool same = true;
  for (int64_t d = 0; d < t.dim(); ++d) same = same && (t.size(d) == 1 || t.stride(d) == like.stride(d));
  if (same) return t;
  return at::empty_strided(like.sizes(), like.strides(), t.options()).copy_(t);
}

ReadRows read_rows(const Tensor& t, int64_t normalized_ndim, int64_t cols) {
  if (const std::optional<RowLayout> layout = row_layout(t, normalized_ndim, cols)) return {t, *layout};
  return {t.contiguous(), RowLayout::packed(cols)};
}

// A caller's buffer the kernels write (out=, residual_out=, the in-place ops' input and residual): in place
// where its layout allows, else into a contiguous temporary copied into it afterwards (copy_back).
struct WrittenRows {
  Tensor target, rows;
  RowLayout layout;
  void copy_back() const {
    if (rows.is_same(target)) return;
    // float4_e2m1fn_x2 (NVFP4 codes) has no copy kernel: its bytes are copied
    if (target.scalar_type() == ScalarType::Float4_e2m1fn_x2) {
      target.view(ScalarType::Byte).copy_(rows.view(ScalarType::Byte));
    } else {
      target.copy_(rows);
    }
  }
};

WrittenRows written_rows(const Tensor& t, int64_t normalized_ndim, int64_t cols) {
  if (const std::optional<RowLayout> layout = row_layout(t, normalized_ndim, cols)) return {t, t, *layout};
  return {t, at::empty(t.sizes(), t.options()), RowLayout::packed(cols)};
}

// The parameters' dtype the kernels take for rows of input_type: the input's own, or float32 for float16 /
// bfloat16 inputs. rms_norm accepts weights of any floating dtype (as ATen); the others are converted to this
// type, O(cols): exactly where it is wider (float16 <-> bfloat16 and either into float32; anything into float64),
// else (a float64 weight for narrower rows) rounded to float32, the precision the rows are computed in.
ScalarType kernel_param_type(ScalarType input_type, ScalarType param_type) {
  const bool half_input = input_type == ScalarType::Half || input_type == ScalarType::BFloat16;
  return half_input && param_type != input_type ? ScalarType::Float : input_type;
}

OptTensor as_kernel_param(const OptTensor& t, ScalarType input_type) {
  if (!t.has_value()) return std::nullopt;
  return t->to(kernel_param_type(input_type, t->scalar_type())).contiguous();
}

// An empty placeholder for an output that a variant does not produce (schemas return Tensor, never None).
Tensor placeholder(const Tensor& like, ScalarType dtype) { return at::empty({0}, like.options().dtype(dtype)); }

// rms_norm's default eps, as ATen's: the machine epsilon of the type the rows are computed in (float for
// float16/bfloat16/float32 rows, double for float64).
double default_rms_eps(ScalarType acc_type) {
  return acc_type == ScalarType::Double ? std::numeric_limits<double>::epsilon()
                                        : static_cast<double>(std::numeric_limits<float>::epsilon());
}

// OutputsUnread's flags (norm.h): what the next forward op's body may leave undefined.
constexpr uint8_t kPlaceholdersUnread = 1, kStatisticsUnread = 2;
thread_local uint8_t outputs_unread = 0;

struct ForwardResult {
  Tensor out, residual_out, mean, rstd;
  Tensor scales;  // the quantized ops' per-row scales (dynamic), else undefined
};

// A quantized output (the *_norm_quant ops): codes of quant_dtype instead of out, with a static scale or,
// without one, a dynamic scale per row (capped by scale_ub).
struct QuantRequest {
  ScalarType dtype;
  OptTensor scale, scale_ub;
  OptTensor scales_out;  // with caller's buffers (Destination::out): where the dynamic scales go
  int64_t group_size = 0;            // > 0: a dynamic scale per group of columns
  bool scales_column_major = false;  // (new scales, per group) each group's scales of all rows contiguous
  std::optional<ScalarType> scales_dtype;  // (new scales) float32 (default) or float8_e8m0fnu (MX, per group)
  bool scales_swizzled = false;  // MX / NVFP4 block scales in the scaled matmuls' 128 x 4 tiles
};

// Where a forward writes: new tensors with the statistics (the ops autograd saves from), or the caller's
// buffers without statistics (the inference ops: out= into separate memory, or in place into input and
// residual, which the kernels allow: every element of h is written where the same thread read it, and out is
// written after the row's statistics, from h).
struct Destination {
  OptTensor out, residual_out;
  bool in_place = false;
  const QuantRequest* quant = nullptr;  // codes (and scales) instead of out, and no statistics
};

ForwardResult norm_forward(const char* op, const Tensor& input_arg, c10::SymIntArrayRef normalized_shape_sym,
                           const OptTensor& weight_arg, const OptTensor& bias_arg, std::optional<double> eps,
                           const OptTensor& residual_arg, bool residual_in_fp32, bool rms, double weight_offset,
                           bool cast_before_weight, ForwardLauncher launch, const Destination& dest = {}) {
  const at::IntArrayRef normalized_shape = C10_AS_INTARRAYREF_SLOW(normalized_shape_sym);
  const NormGeometry g =
      check_forward_args(op, input_arg, normalized_shape, weight_arg, bias_arg, residual_arg, rms);
  check_weight_offset(op, weight_arg, weight_offset);
  const int64_t normalized_ndim = static_cast<int64_t>(normalized_shape.size());
  const ScalarType h_type = residual_arg.has_value() ? residual_out_dtype(input_arg, *residual_arg, residual_in_fp32)
                                                     : input_arg.scalar_type();
  const ScalarType acc = acc_type_for(h_type);
  const uint8_t unread = std::exchange(outputs_unread, 0);
  const bool given = dest.out.has_value();
  const QuantRequest* quant = dest.quant;
  // NVFP4: codes two per byte, a float8_e4m3fn scale per block of 16 columns (group_size 0 means 16), scale the
  // global scale.
  const bool nvfp4 = quant != nullptr && quant->dtype == ScalarType::Float4_e2m1fn_x2;
  const int64_t group_size = quant == nullptr ? 0 : (nvfp4 && quant->group_size == 0 ? quant::kNvfp4Block
                                                                                     : quant->group_size);
  ScalarType scales_dtype = ScalarType::Float;
  if (quant != nullptr) {
    check_quant_args(op, input_arg, quant->dtype, quant->scale, quant->scale_ub, given);
    // The scales' dtype: as asked for new scales; per group into a buffer, the buffer's (MX or float32); NVFP4's
    // float8_e4m3fn (a buffer of another dtype is refused by its shape-and-dtype check).
    if (quant->scales_dtype.has_value()) {
      scales_dtype = *quant->scales_dtype;
    } else if (nvfp4) {
      scales_dtype = ScalarType::Float8_e4m3fn;
    } else if (group_size > 0 && quant->scales_out.has_value() &&
               quant->scales_out->scalar_type() == ScalarType::Float8_e8m0fnu) {
      scales_dtype = ScalarType::Float8_e8m0fnu;
    }
    check_group_size(op, normalized_shape, group_size, quant->scale.has_value(), quant->scales_column_major,
                     quant->scales_swizzled, scales_dtype, quant->dtype);
  }
  // One scale per row, shaped as the rows with 1 for each normalized dim: it broadcasts against the codes; per
  // group, shaped as the rows and then the groups (vLLM's). (Only the quantized ops have scales.)
  std::vector<int64_t> scale_shape;
  if (quant != nullptr) {
    scale_shape = g.stat_shape;
    if (group_size > 0) {
      scale_shape.push_back(g.cols / group_size);
    } else {
      scale_shape.resize(scale_shape.size() + normalized_shape.size(), 1);
    }
  }
  // The codes' shape, and the elements of a row of them: NVFP4's hold two columns each.
  std::vector<int64_t> codes_shape = input_arg.sizes().vec();
  if (nvfp4) codes_shape.back() /= 2;
  const int64_t code_cols = nvfp4 ? g.cols / 2 : g.cols;
  GroupScalesLayout group_layout{0, 0};
  if (given) {
    const char* out_name = dest.in_place ? "input" : "out";
    check_destination(op, out_name, input_arg, *dest.out, normalized_ndim,
                      quant != nullptr ? quant->dtype : input_arg.scalar_type(), codes_shape);
    if (quant != nullptr && quant->scales_swizzled) {
      check_swizzled_scales_buffer(op, input_arg, quant->scales_out, g.rows, g.cols / group_size, scales_dtype);
    } else if (group_size > 0) {
      group_layout = check_group_scales_buffer(op, input_arg, quant->scales_out, scale_shape, scales_dtype);
    } else if (quant != nullptr) {
      check_scales_buffer(op, input_arg, quant->scale.has_value(), quant->scales_out, scale_shape);
    }
    TORCH_CHECK(residual_arg.has_value() == dest.residual_out.has_value(),
                message(op, residual_arg.has_value() ? ": a residual needs a residual_out buffer (h = input + residual)"
                                                     : ": residual_out is given without a residual"));
    if (residual_arg.has_value()) {
      check_destination(op, dest.in_place ? "residual" : "residual_out", input_arg, *dest.residual_out,
                        normalized_ndim, h_type);
    }
    if (dest.in_place) {
      // input and residual are both written (out and h): no element may be both, nor a parameter that the
      // kernels read after rows were written.
      check_no_overlap(op, "input", input_arg, "residual", *residual_arg);
      const std::pair<const char*, const Tensor*> written[] = {{"input", &input_arg}, {"residual", &*residual_arg}};
      for (const auto& [name, d] : written) {
        if (weight_arg.has_value()) check_no_overlap(op, name, *d, "weight", *weight_arg);
        if (bias_arg.has_value()) check_no_overlap(op, name, *d, "bias", *bias_arg);
      }
    } else {
      // The quantized ops may write h over residual itself (the engines' fused add in place): each element of h
      // is written where the same thread read residual's.
      const bool h_over_residual = quant != nullptr && residual_arg.has_value() &&
                                   dest.residual_out->is_same(*residual_arg);
      const OptTensor scales_out = quant != nullptr ? quant->scales_out : std::nullopt;
      for (const Tensor* d : {&*dest.out, dest.residual_out.has_value() ? &*dest.residual_out : nullptr,
                              scales_out.has_value() ? &*scales_out : nullptr}) {
        if (d == nullptr) continue;
        const char* name = d == &*dest.out ? "out" : (d == &*scales_out ? "scales" : "residual_out");
        check_no_overlap(op, name, *d, "input", input_arg);
        if (residual_arg.has_value() && !(h_over_residual && d == &*dest.residual_out)) {
          check_no_overlap(op, name, *d, "residual", *residual_arg);
        }
        if (weight_arg.has_value()) check_no_overlap(op, name, *d, "weight", *weight_arg);
        if (bias_arg.has_value()) check_no_overlap(op, name, *d, "bias", *bias_arg);
        if (quant != nullptr && quant->scale.has_value()) check_no_overlap(op, name, *d, "scale", *quant->scale);
        if (quant != nullptr && quant->scale_ub.has_value()) {
          check_no_overlap(op, name, *d, "scale_ub", *quant->scale_ub);
        }
      }
      if (dest.residual_out.has_value()) check_no_overlap(op, "out", *dest.out, "residual_out", *dest.residual_out);
      if (scales_out.has_value()) {
        check_no_overlap(op, "scales", *scales_out, "out", *dest.out);
        if (dest.residual_out.has_value()) check_no_overlap(op, "scales", *scales_out, "residual_out", *dest.residual_out);
      }
    }
  }
  // Channels-first rows (column_plane) in a forward into new tensors without a residual or quantized output: read
  // in place, and out has the input's strides (NCHW memory for layer_norm_2d's view of an NCHW tensor).
  const int64_t plane =
      given || quant != nullptr || residual_arg.has_value() ? 0 : column_plane(input_arg, normalized_ndim);
  const ReadRows input_rows =
      plane > 0 ? ReadRows{input_arg, RowLayout{}} : read_rows(input_arg, normalized_ndim, g.cols);
  const Tensor& input = input_rows.rows;
  const OptTensor weight = as_kernel_param(weight_arg, input.scalar_type());
  const OptTensor bias = as_kernel_param(bias_arg, input.scalar_type());
  const std::optional<ReadRows> residual_rows =
      residual_arg.has_value() ? std::optional<ReadRows>(read_rows(*residual_arg, normalized_ndim, g.cols))
                               : std::nullopt;
  const OptTensor residual = residual_rows.has_value() ? OptTensor(residual_rows->rows) : std::nullopt;
  // The caller's buffers, written in place where their layouts allow; new outputs are contiguous, as ATen's.
  const std::optional<WrittenRows> out_rows =
      given ? std::optional<WrittenRows>(written_rows(*dest.out, normalized_ndim, code_cols)) : std::nullopt;
  const std::optional<WrittenRows> residual_out_rows =
      given && residual_arg.has_value()
          ? std::optional<WrittenRows>(written_rows(*dest.residual_out, normalized_ndim, g.cols))
          : std::nullopt;

  ForwardResult r;
  const bool dynamic_scale = quant != nullptr && !quant->scale.has_value();
  const bool writes_scales = dynamic_scale || nvfp4;  // NVFP4's block scales are dynamic, its scale the global one
  const OptTensor scale = quant != nullptr ? contiguous(quant->scale) : std::nullopt;
  const OptTensor scale_ub = quant != nullptr ? contiguous(quant->scale_ub) : std::nullopt;
  if (given) {
    r.out = *dest.out;  // nothing returned: no placeholder either
    if (residual.has_value()) r.residual_out = *dest.residual_out;
    if (writes_scales) r.scales = *quant->scales_out;
  } else if (quant != nullptr) {
    r.out = at::empty(codes_shape, input.options().dtype(quant->dtype));
    r.residual_out = residual.has_value() ? at::empty(input.sizes(), input.options().dtype(h_type))
                                          : placeholder(input, input.scalar_type());
    if (quant->scales_swizzled) {
      r.scales = at::empty(swizzled_scales_shape(g.rows, g.cols / group_size), input.options().dtype(scales_dtype));
    } else if (group_size > 0 && quant->scales_column_major) {
      std::vector<int64_t> groups_first{scale_shape.back()};
      groups_first.insert(groups_first.end(), scale_shape.begin(), scale_shape.end() - 1);
      r.scales = at::empty(groups_first, input.options().dtype(scales_dtype)).movedim(0, -1);
      group_layout = {1, g.rows};
    } else {
      r.scales = writes_scales ? at::empty(scale_shape, input.options().dtype(scales_dtype))
                               : placeholder(input, ScalarType::Float);
      if (group_size > 0) group_layout = {g.cols / group_size, 1};
    }
  } else {
    r.out = plane > 0 ? at::empty_strided(input.sizes(), input.strides(), input.options())
                      : at::empty(input.sizes(), input.options());
    if (residual.has_value()) {
      r.residual_out = at::empty(input.sizes(), input.options().dtype(h_type));
    } else if (!(unread & kPlaceholdersUnread)) {
      r.residual_out = placeholder(input, input.scalar_type());
    }
    // A functional op's forward (OutputsUnread) drops the placeholder unseen, and without autograd the statistics
    // too: an undefined tensor costs nothing.
    if (!(unread & kStatisticsUnread)) {
      r.rstd = at::empty(g.stat_shape, input.options().dtype(acc));
      if (!rms) r.mean = at::empty(g.stat_shape, input.options().dtype(acc));
    }
  }
  if (g.rows == 0) return r;
  if (g.cols == 0) {
    // Rows of no elements (a 0 in normalized_shape): as ATen, mean 0 and rstd NaN (0 / 0 variance).
    if (r.mean.defined()) r.mean.zero_();
    if (r.rstd.defined()) r.rstd.fill_(std::numeric_limits<double>::quiet_NaN());
    if (dynamic_scale) {  // rows of no elements: absmax 0, hence the smallest scale (quant_math.h)
      r.scales.fill_(quant::dynamic_scale(0.0f, nullptr, quant_code(quant->dtype)));
    }
    return r;
  }

  NormForwardParams p;
  p.input = input.data_ptr();
  p.residual = ptr_or_null(residual);
  p.weight = ptr_or_null(weight);
  p.bias = ptr_or_null(bias);
  p.out = out_rows.has_value() ? out_rows->rows.data_ptr() : r.out.data_ptr();
  p.out_given = out_rows.has_value() && out_rows->rows.is_same(out_rows->target);
  p.residual_out = !residual.has_value()          ? nullptr
                   : residual_out_rows.has_value() ? residual_out_rows->rows.data_ptr()
                                                   : r.residual_out.data_ptr();
  p.input_rows = input_rows.layout;
  p.residual_rows = residual_rows.has_value() ? residual_rows->layout : RowLayout::packed(g.cols);
  p.out_rows = out_rows.has_value() ? out_rows->layout : RowLayout::packed(code_cols);
  p.residual_out_rows = residual_out_rows.has_value() ? residual_out_rows->layout : RowLayout::packed(g.cols);
  p.mean = r.mean.defined() ? r.mean.data_ptr() : nullptr;
  p.rstd = r.rstd.defined() ? r.rstd.data_ptr() : nullptr;
  p.device = input.device().index();
  p.input_type = input.scalar_type();
  p.residual_type = residual.has_value() ? residual->scalar_type() : input.scalar_type();
  p.h_type = h_type;
  p.weight_type = weight.has_value() ? weight->scalar_type()
                                     : (bias.has_value() ? bias->scalar_type() : input.scalar_type());
  p.acc_type = acc;
  p.rows = g.rows;
  p.cols = g.cols;
  p.eps = eps.has_value() ? *eps : default_rms_eps(acc);
  p.rms = rms;
  p.weight_offset = weight_offset;
  p.cast_before_weight = cast_before_weight;
  p.plane = plane;
  if (quant != nullptr) {
    p.codes = p.out;
    p.out = nullptr;
    p.quant_type = quant->dtype;
    p.scale = scale.has_value() ? scale->data_ptr<float>() : nullptr;
    p.scale_ub = scale_ub.has_value() ? scale_ub->data_ptr<float>() : nullptr;
    const bool mx = scales_dtype == ScalarType::Float8_e8m0fnu;
    p.row_scales = dynamic_scale && !mx ? r.scales.data_ptr<float>() : nullptr;
    p.mx_scales = mx ? static_cast<uint8_t*>(r.scales.data_ptr()) : nullptr;
    p.nvfp4_scales = nvfp4 ? static_cast<uint8_t*>(r.scales.data_ptr()) : nullptr;
    p.group_size = group_size;
    p.scale_row_stride = group_layout.row_stride;
    p.scale_group_stride = group_layout.group_stride;
    p.scales_swizzled = quant->scales_swizzled;
    if (quant->scales_swizzled && g.rows % quant::kSwizzleTileRows != 0) {
      // The last band of tiles holds the padding rows (the kernel writes each row's padding blocks): zeros, as
      // torch's to_blocked pads. The band is the scales' last bytes (the tiles are stored band by band).
      const int64_t band = quant::kSwizzleTileRows * quant::swizzled_scale_blocks(g.cols / group_size);
      const int64_t numel = r.scales.numel();
      r.scales.view({numel}).narrow(0, numel - band, band).zero_();
    }
  }
  launch(p);
  if (out_rows.has_value()) out_rows->copy_back();
  if (residual_out_rows.has_value()) residual_out_rows->copy_back();
  return r;
}

struct BackwardResult {
  Tensor grad_input, grad_weight, grad_bias;
};

// The gradients in their tensors' own dtypes (the kernels wrote the parameters' in kernel_param_type's, and
// grad_input in float64 where the backward widened the rows).
BackwardResult in_arg_dtypes(BackwardResult r, const Tensor& saved, const OptTensor& weight, const OptTensor& bias) {
  r.grad_input = r.grad_input.to(saved.scalar_type());
  if (weight.has_value()) r.grad_weight = r.grad_weight.to(weight->scalar_type());
  if (bias.has_value()) r.grad_bias = r.grad_bias.to(bias->scalar_type());
  return r;
}

BackwardResult norm_backward(const char* op, const Tensor& grad_out_arg, const Tensor& saved_arg,
                             const OptTensor& mean_arg, const Tensor& rstd_arg,
                             c10::SymIntArrayRef normalized_shape_sym, const OptTensor& weight_arg,
                             const OptTensor& bias_arg, bool saved_is_output, const OptTensor& grad_residual_out_arg,
                             bool rms, double weight_offset, BackwardLauncher launch) {
  const at::IntArrayRef normalized_shape = C10_AS_INTARRAYREF_SLOW(normalized_shape_sym);
  const NormGeometry g = check_backward_args(op, grad_out_arg, saved_arg, mean_arg, rstd_arg, normalized_shape,
                                             weight_arg, bias_arg, grad_residual_out_arg, saved_is_output, rms);
  check_weight_offset(op, weight_arg, weight_offset);
  // A float64 parameter with narrower rows (rms_norm's weight): the kernels would take it as float32 and round
  // its gradient to float32, coarser than ATen's; this backward runs in float64 instead, on rows, gradients and
  // statistics widened exactly (O(rows * cols), for this pairing only), and grad_input is rounded back.
  auto is_double = [](const OptTensor& t) { return t.has_value() && t->scalar_type() == ScalarType::Double; };
  const bool widen = grad_out_arg.scalar_type() != ScalarType::Double && (is_double(weight_arg) || is_double(bias_arg));
  const int64_t normalized_ndim = static_cast<int64_t>(normalized_shape.size());
  auto widened = [widen](const Tensor& t) { return widen ? t.to(ScalarType::Double) : t; };
  auto statistics = [&](const Tensor& t) { return widened(t).contiguous(); };
  // Channels-first saved rows (column_plane; the forward took them in place): read in place, with grad_out in
  // the same layout (copied into it if it has another one, e.g. an expanded gradient), and grad_input in it too;
  // only with grad_out in saved's dtype (as autograd gives it: the CUDA kernels take no other pair).
  const int64_t plane = grad_residual_out_arg.has_value() || grad_out_arg.scalar_type() != saved_arg.scalar_type()
                           ? 0
                           : column_plane(saved_arg, normalized_ndim);
  const ReadRows saved_rows =
      plane > 0 ? ReadRows{widened(saved_arg), RowLayout{}} : read_rows(widened(saved_arg), normalized_ndim, g.cols);
  const ReadRows grad_out_rows = plane > 0 ? ReadRows{in_layout_of(widened(grad_out_arg), saved_rows.rows), RowLayout{}}
                                           : read_rows(widened(grad_out_arg), normalized_ndim, g.cols);
  const Tensor& grad_out = grad_out_rows.rows;
  const Tensor& saved = saved_rows.rows;
  const OptTensor mean = mean_arg.has_value() ? OptTensor(statistics(*mean_arg)) : std::nullopt;
  const Tensor rstd = statistics(rstd_arg);
  // The kernels' parameter dtype (grad_out has the forward input's); the gradients go back in each parameter's.
  const OptTensor weight = as_kernel_param(weight_arg, grad_out.scalar_type());
  const OptTensor bias = as_kernel_param(bias_arg, grad_out.scalar_type());
  // The kernels read grad_residual_out as the saved rows' dtype (autograd passes exactly that).
  const std::optional<ReadRows> grad_residual_rows =
      grad_residual_out_arg.has_value()
          ? std::optional<ReadRows>(
                read_rows(grad_residual_out_arg->to(saved.scalar_type()), normalized_ndim, g.cols))
          : std::nullopt;
  const OptTensor grad_residual_out =
      grad_residual_rows.has_value() ? OptTensor(grad_residual_rows->rows) : std::nullopt;

  BackwardResult r;
  r.grad_input = plane > 0 ? at::empty_strided(saved.sizes(), saved.strides(), saved.options())
                           : at::empty(saved.sizes(), saved.options());
  // An absent parameter's placeholder gradient has the other parameter's dtype (the caller's), else saved's.
  const ScalarType placeholder_type =
      weight_arg.has_value() ? weight_arg->scalar_type()
                             : (bias_arg.has_value() ? bias_arg->scalar_type() : saved_arg.scalar_type());
  r.grad_weight =
      weight.has_value() ? at::empty(weight->sizes(), weight->options()) : placeholder(saved, placeholder_type);
  r.grad_bias = bias.has_value() ? at::empty(bias->sizes(), bias->options()) : placeholder(saved, placeholder_type);
  const ScalarType weight_type = weight.has_value() ? weight->scalar_type()
                                                    : (bias.has_value() ? bias->scalar_type() : saved.scalar_type());
  if (g.rows == 0 || g.cols == 0) {
    // No rows, or rows of no elements: the parameter gradients are sums over nothing (or empty).
    r.grad_weight.zero_();
    r.grad_bias.zero_();
    return in_arg_dtypes(std::move(r), saved_arg, weight_arg, bias_arg);
  }

  NormBackwardParams p;
  p.grad_out = grad_out.data_ptr();
  p.grad_residual_out = ptr_or_null(grad_residual_out);
  p.saved = saved.data_ptr();
  p.mean = rms ? nullptr : ptr_or_null(mean);
  p.rstd = rstd.data_ptr();
  p.weight = ptr_or_null(weight);
  p.bias = ptr_or_null(bias);
  p.grad_input = r.grad_input.data_ptr();
  p.grad_weight = weight.has_value() ? r.grad_weight.data_ptr() : nullptr;
  p.grad_bias = bias.has_value() ? r.grad_bias.data_ptr() : nullptr;
  p.device = saved.device().index();
  p.out_type = grad_out.scalar_type();
  p.saved_type = saved.scalar_type();
  p.weight_type = weight_type;
  p.acc_type = rstd.scalar_type();
  p.rows = g.rows;
  p.cols = g.cols;
  p.rms = rms;
  p.saved_is_output = saved_is_output;
  p.weight_offset = weight_offset;
  p.grad_out_rows = grad_out_rows.layout;
  p.saved_rows = saved_rows.layout;
  p.grad_residual_rows = grad_residual_rows.has_value() ? grad_residual_rows->layout : RowLayout::packed(g.cols);
  p.plane = plane;
  launch(p);
  return in_arg_dtypes(std::move(r), saved_arg, weight_arg, bias_arg);
}

}  // namespace

namespace {

// The operands of one launch whose rows are not packed, swapped for contiguous tensors (launch_on_rows).
class PackedRows {
 public:
  PackedRows(int device, int64_t rows, int64_t cols)
      : device_(device < 0 ? at::Device(at::kCPU) : at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device))),
        rows_(rows),
        cols_(cols) {}

  // An operand the kernels read: a contiguous copy.
  void read(const void*& rows, RowLayout& layout, ScalarType dtype) {
    if (rows == nullptr || layout.is_packed(cols_)) return;
    copies_.push_back(view(rows, layout, dtype).contiguous());
    rows = copies_.back().data_ptr();
    layout = RowLayout::packed(cols_);
  }
  // An operand the kernels write: a contiguous tensor, copied into place by write_back(). cols: its elements per
  // row where they are not the rows' (NVFP4 codes: a byte per two columns).
  void write(void*& rows, RowLayout& layout, ScalarType dtype, int64_t cols = -1) {
    cols = cols < 0 ? cols_ : cols;
    if (rows == nullptr || layout.is_packed(cols)) return;
    Tensor target = view(rows, layout, dtype, cols);
    copies_.push_back(at::empty(target.sizes(), target.options()));
    rows = copies_.back().data_ptr();
    layout = RowLayout::packed(cols);
    write_backs_.emplace_back(std::move(target), copies_.back());
  }
  void write_back() {
    for (auto& [target, rows] : write_backs_) target.copy_(rows);
  }

 private:
  Tensor view(const void* rows, const RowLayout& layout, ScalarType dtype, int64_t cols = -1) const {
    return at::from_blob(const_cast<void*>(rows), {rows_ / layout.inner, layout.inner, cols < 0 ? cols_ : cols},
                         {layout.outer_stride, layout.inner_stride, 1}, at::TensorOptions().dtype(dtype).device(device_));
  }

  at::Device device_;
  int64_t rows_, cols_;
  std::vector<Tensor> copies_;
  std::vector<std::pair<Tensor, Tensor>> write_backs_;
};

}  // namespace

void launch_on_rows(const NormForwardParams& p, TryForwardLauncher launch) {
  if (launch(p)) return;
  NormForwardParams packed = p;
  PackedRows rows(p.device, p.rows, p.cols);
  rows.read(packed.input, packed.input_rows, p.input_type);
  rows.read(packed.residual, packed.residual_rows, p.residual_type);
  // out_rows is the codes' layout with a quantized output (bytes: only copied).
  if (p.codes != nullptr) {
    const bool nvfp4 = p.quant_type == ScalarType::Float4_e2m1fn_x2;
    rows.write(packed.codes, packed.out_rows, ScalarType::Byte, nvfp4 ? p.cols / 2 : p.cols);
  } else {
    rows.write(packed.out, packed.out_rows, p.input_type);
  }
  rows.write(packed.residual_out, packed.residual_out_rows, p.h_type);
  TORCH_INTERNAL_ASSERT(launch(packed), "layernorm_ext: a launcher declined packed rows");
  rows.write_back();
}

void launch_on_rows(const NormBackwardParams& p, TryBackwardLauncher launch) {
  if (launch(p)) return;
  NormBackwardParams packed = p;
  PackedRows rows(p.device, p.rows, p.cols);
  rows.read(packed.grad_out, packed.grad_out_rows, p.out_type);
  rows.read(packed.saved, packed.saved_rows, p.saved_type);
  rows.read(packed.grad_residual_out, packed.grad_residual_rows, p.saved_type);
  TORCH_INTERNAL_ASSERT(launch(packed), "layernorm_ext: a launcher declined packed rows");
}

OutputsUnread::OutputsUnread(bool statistics) : previous_(outputs_unread) {
  outputs_unread = kPlaceholdersUnread | (statistics ? kStatisticsUnread : 0);
}
OutputsUnread::~OutputsUnread() { outputs_unread = previous_; }

std::tuple<Tensor, Tensor, Tensor, Tensor> layer_norm_fwd(const Tensor& input, c10::SymIntArrayRef normalized_shape,
                                                          const OptTensor& weight, const OptTensor& bias,
                                                          double eps, const OptTensor& residual,
                                                          bool residual_in_fp32, bool /*memory_efficient*/,
                                                          double weight_offset, bool cast_before_weight,
                                                          ForwardLauncher launch) {
  ForwardResult r = norm_forward("layer_norm", input, normalized_shape, weight, bias, eps, residual,
                                 residual_in_fp32, /*rms=*/false, weight_offset, cast_before_weight, launch);
  return {r.out, r.residual_out, r.mean, r.rstd};
}

std::tuple<Tensor, Tensor, Tensor> rms_norm_fwd(const Tensor& input, c10::SymIntArrayRef normalized_shape,
                                                const OptTensor& weight, std::optional<double> eps,
                                                const OptTensor& residual, bool residual_in_fp32,
                                                bool /*memory_efficient*/, double weight_offset,
                                                bool cast_before_weight, ForwardLauncher launch) {
  ForwardResult r = norm_forward("rms_norm", input, normalized_shape, weight, std::nullopt, eps, residual,
                                 residual_in_fp32, /*rms=*/true, weight_offset, cast_before_weight, launch);
  return {r.out, r.residual_out, r.rstd};
}

void layer_norm_into(const Tensor& input, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                     const OptTensor& bias, double eps, const Tensor& out, const OptTensor& residual,
                     const OptTensor& residual_out, bool residual_in_fp32, double weight_offset,
                     bool cast_before_weight, ForwardLauncher launch) {
  norm_forward("layer_norm_into", input, normalized_shape, weight, bias, eps, residual, residual_in_fp32,
               /*rms=*/false, weight_offset, cast_before_weight, launch, Destination{out, residual_out});
}

void rms_norm_into(const Tensor& input, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                   std::optional<double> eps, const Tensor& out, const OptTensor& residual,
                   const OptTensor& residual_out, bool residual_in_fp32, double weight_offset, bool cast_before_weight,
                   ForwardLauncher launch) {
  norm_forward("rms_norm_into", input, normalized_shape, weight, std::nullopt, eps, residual, residual_in_fp32,
               /*rms=*/true, weight_offset, cast_before_weight, launch, Destination{out, residual_out});
}

void add_layer_norm_inplace(const Tensor& input, const Tensor& residual, c10::SymIntArrayRef normalized_shape,
                            const OptTensor& weight, const OptTensor& bias, double eps, double weight_offset,
                            bool cast_before_weight, ForwardLauncher launch) {
  norm_forward("add_layer_norm_", input, normalized_shape, weight, bias, eps, residual, false, /*rms=*/false,
               weight_offset, cast_before_weight, launch, Destination{input, residual, /*in_place=*/true});
}

void add_rms_norm_inplace(const Tensor& input, const Tensor& residual, c10::SymIntArrayRef normalized_shape,
                          const OptTensor& weight, std::optional<double> eps, double weight_offset,
                          bool cast_before_weight, ForwardLauncher launch) {
  norm_forward("add_rms_norm_", input, normalized_shape, weight, std::nullopt, eps, residual, false, /*rms=*/true,
               weight_offset, cast_before_weight, launch, Destination{input, residual, /*in_place=*/true});
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_quant(const Tensor& input, c10::SymIntArrayRef normalized_shape,
                                                    const OptTensor& weight, const OptTensor& bias, double eps,
                                                    ScalarType quant_dtype, const OptTensor& scale,
                                                    const OptTensor& scale_ub, const OptTensor& residual,
                                                    bool residual_in_fp32, double weight_offset,
                                                    bool cast_before_weight, int64_t group_size,
                                                    bool scales_column_major,
                                                    std::optional<ScalarType> scales_dtype, bool scales_swizzled,
                                                    ForwardLauncher launch) {
  const QuantRequest quant{quant_dtype,         scale,        scale_ub,       std::nullopt, group_size,
                           scales_column_major, scales_dtype, scales_swizzled};
  Destination dest;
  dest.quant = &quant;
  ForwardResult r = norm_forward("layer_norm_quant", input, normalized_shape, weight, bias, eps, residual,
                                 residual_in_fp32, /*rms=*/false, weight_offset, cast_before_weight, launch, dest);
  return {r.out, r.scales, r.residual_out};
}

std::tuple<Tensor, Tensor, Tensor> rms_norm_quant(const Tensor& input, c10::SymIntArrayRef normalized_shape,
                                                  const OptTensor& weight, std::optional<double> eps,
                                                  ScalarType quant_dtype, const OptTensor& scale,
                                                  const OptTensor& scale_ub, const OptTensor& residual,
                                                  bool residual_in_fp32, double weight_offset,
                                                  bool cast_before_weight, int64_t group_size,
                                                  bool scales_column_major,
                                                  std::optional<ScalarType> scales_dtype, bool scales_swizzled,
                                                  ForwardLauncher launch) {
  const QuantRequest quant{quant_dtype,         scale,        scale_ub,       std::nullopt, group_size,
                           scales_column_major, scales_dtype, scales_swizzled};
  Destination dest;
  dest.quant = &quant;
  ForwardResult r = norm_forward("rms_norm_quant", input, normalized_shape, weight, std::nullopt, eps, residual,
                                 residual_in_fp32, /*rms=*/true, weight_offset, cast_before_weight, launch, dest);
  return {r.out, r.scales, r.residual_out};
}

void layer_norm_quant_into(const Tensor& input, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                          const OptTensor& bias, double eps, const Tensor& out, const OptTensor& scale,
                          const OptTensor& scales, const OptTensor& scale_ub, const OptTensor& residual,
                          const OptTensor& residual_out, bool residual_in_fp32, double weight_offset,
                          bool cast_before_weight, int64_t group_size, bool scales_swizzled,
                          ForwardLauncher launch) {
  const QuantRequest quant{out.scalar_type(), scale, scale_ub, scales, group_size, false, std::nullopt, scales_swizzled};
  Destination dest{out, residual_out};
  dest.quant = &quant;
  norm_forward("layer_norm_quant_into", input, normalized_shape, weight, bias, eps, residual, residual_in_fp32,
               /*rms=*/false, weight_offset, cast_before_weight, launch, dest);
}

void rms_norm_quant_into(const Tensor& input, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                         std::optional<double> eps, const Tensor& out, const OptTensor& scale, const OptTensor& scales,
                         const OptTensor& scale_ub, const OptTensor& residual, const OptTensor& residual_out,
                         bool residual_in_fp32, double weight_offset, bool cast_before_weight,
                         int64_t group_size, bool scales_swizzled, ForwardLauncher launch) {
  const QuantRequest quant{out.scalar_type(), scale, scale_ub, scales, group_size, false, std::nullopt, scales_swizzled};
  Destination dest{out, residual_out};
  dest.quant = &quant;
  norm_forward("rms_norm_quant_into", input, normalized_shape, weight, std::nullopt, eps, residual,
               residual_in_fp32, /*rms=*/true, weight_offset, cast_before_weight, launch, dest);
}

std::tuple<Tensor, Tensor, Tensor> layer_norm_bwd(const Tensor& grad_out, const Tensor& saved, const Tensor& mean,
                                                  const Tensor& rstd, c10::SymIntArrayRef normalized_shape,
                                                  const OptTensor& weight, const OptTensor& bias,
                                                  bool saved_is_output, const OptTensor& grad_residual_out,
                                                  double weight_offset, BackwardLauncher launch) {
  BackwardResult r = norm_backward("layer_norm_backward", grad_out, saved, mean, rstd, normalized_shape, weight,
                                   bias, saved_is_output, grad_residual_out, /*rms=*/false, weight_offset, launch);
  return {r.grad_input, r.grad_weight, r.grad_bias};
}

std::tuple<Tensor, Tensor> rms_norm_bwd(const Tensor& grad_out, const Tensor& saved, const Tensor& rstd,
                                        c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                                        bool saved_is_output, const OptTensor& grad_residual_out,
                                        double weight_offset, BackwardLauncher launch) {
  BackwardResult r = norm_backward("rms_norm_backward", grad_out, saved, std::nullopt, rstd, normalized_shape,
                                   weight, std::nullopt, saved_is_output, grad_residual_out, /*rms=*/true,
                                   weight_offset, launch);
  return {r.grad_input, r.grad_weight};
}

}  // namespace layernorm_ext
