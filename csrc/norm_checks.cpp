// Argument checks for every op on every device: the one place where bad input is turned into a clear,
// ATen-worded error before any kernel sees it.
#include "norm.h"
#include "quant_math.h"

#include <ATen/MemoryOverlap.h>

#include <cmath>

#include <c10/util/accumulate.h>
#include <c10/util/irange.h>

namespace layernorm_ext {

bool is_supported_float(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Double || t == ScalarType::Half || t == ScalarType::BFloat16;
}

ScalarType acc_type_for(ScalarType h_type) {
  return h_type == ScalarType::Double ? ScalarType::Double : ScalarType::Float;
}

ScalarType residual_out_dtype(const Tensor& input, const Tensor& residual, bool residual_in_fp32) {
  ScalarType t = c10::promoteTypes(input.scalar_type(), residual.scalar_type());
  return residual_in_fp32 ? c10::promoteTypes(t, ScalarType::Float) : t;
}

namespace {

void check_float(const char* op, const char* name, const Tensor& t) {
  TORCH_CHECK(is_supported_float(t.scalar_type()),
              message(op, ": expected ", name,
                      " to be a floating point tensor (float32, float64, float16 or bfloat16), but got ", name,
                      " of dtype ", t.scalar_type()));
}

void check_same_device(const char* op, const char* name, const Tensor& input, const Tensor& t) {
  TORCH_CHECK(t.device() == input.device(),
              message(op, ": expected all tensors to be on the same device, but found at least two devices, ",
                      input.device(), " and ", t.device(), "! (when checking argument ", name, ")"));
}

// Weight and bias: the normalized shape and, as ATen's (CPU) rules, a dtype: for layer_norm the input's or (half
// inputs) float32, weight and bias alike; rms_norm takes a weight of any floating dtype (its output keeps the
// input's dtype).
void check_param(const char* op, const char* name, const Tensor& input, const Tensor& t,
                 at::IntArrayRef normalized_shape, bool rms) {
  check_same_device(op, name, input, t);
  TORCH_CHECK(t.sizes() == normalized_shape,
              message(op, ": expected ", name, " to be of same shape as normalized_shape, but got ", name, " of shape ",
                      t.sizes(), " and normalized_shape = ", normalized_shape));
  check_float(op, name, t);
  if (rms) return;
  const ScalarType x = input.scalar_type();
  const bool half_input = x == ScalarType::Half || x == ScalarType::BFloat16;
  TORCH_CHECK(t.scalar_type() == x || (half_input && t.scalar_type() == ScalarType::Float),
              message(op, ": expected ", name, " to have the input's dtype (", x, ")", half_input ? " or float32" : "",
                      ", but got ", name, " of dtype ", t.scalar_type()));
}

NormGeometry geometry(const char* op, const Tensor& input, at::IntArrayRef normalized_shape) {
  const int64_t normalized_ndim = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK(normalized_ndim >= 1,
              message(op,
                      ": expected normalized_shape to be at least 1-dimensional, i.e., containing at least one "
                      "element, but got normalized_shape = ",
                      normalized_shape));
  const int64_t input_ndim = input.dim();
  const auto sizes = input.sizes();
  const bool fits = input_ndim >= normalized_ndim &&
                    sizes.slice(input_ndim - normalized_ndim).equals(normalized_shape);
  TORCH_CHECK(fits, message(
                        op, ": given normalized_shape=", normalized_shape, ", expected input with shape [*",
                        [&] {
                          std::string s;
                          for (int64_t d : normalized_shape) s += ", " + std::to_string(d);
                          return s;
                        }(),
                        "], but got input of size", sizes));
  NormGeometry g;
  const int64_t axis = input_ndim - normalized_ndim;
  g.rows = 1;
  for (const auto i : c10::irange(axis)) {
    g.rows *= sizes[i];
    g.stat_shape.push_back(sizes[i]);
  }
  g.cols = 1;
  for (int64_t d : normalized_shape) g.cols *= d;
  return g;
}

}  // namespace

NormGeometry check_forward_args(const char* op, const Tensor& input, at::IntArrayRef normalized_shape,
                                const OptTensor& weight, const OptTensor& bias, const OptTensor& residual,
                                bool rms) {
  check_float(op, "input", input);
  NormGeometry g = geometry(op, input, normalized_shape);
  if (weight.has_value()) check_param(op, "weight", input, *weight, normalized_shape, rms);
  if (bias.has_value()) check_param(op, "bias", input, *bias, normalized_shape, rms);
  if (weight.has_value() && bias.has_value()) {
    TORCH_CHECK(weight->scalar_type() == bias->scalar_type(),
                message(op, ": expected weight and bias to have the same dtype, but got weight of dtype ",
                        weight->scalar_type(), " and bias of dtype ", bias->scalar_type()));
  }
  if (residual.has_value()) {
    check_same_device(op, "residual", input, *residual);
    check_float(op, "residual", *residual);
    TORCH_CHECK(residual->sizes() == input.sizes(),
                message(op, ": expected residual to have the same shape as input, but got residual of shape ",
                        residual->sizes(), " and input of shape ", input.sizes()));
  }
  return g;
}

NormGeometry check_backward_args(const char* op, const Tensor& grad_out, const Tensor& saved,
                                 const OptTensor& mean, const Tensor& rstd, at::IntArrayRef normalized_shape,
                                 const OptTensor& weight, const OptTensor& bias,
                                 const OptTensor& grad_residual_out, bool saved_is_output, bool rms) {
  check_float(op, "saved", saved);
  check_float(op, "grad_out", grad_out);
  NormGeometry g = geometry(op, saved, normalized_shape);
  TORCH_CHECK(grad_out.sizes() == saved.sizes(), message(op, ": expected grad_out of shape ", saved.sizes(),
                                                         ", but got grad_out of shape ", grad_out.sizes()));
  check_same_device(op, "grad_out", saved, grad_out);
  // grad_out has the forward output's dtype, which is never wider than the saved rows (h, or the output).
  TORCH_CHECK(c10::promoteTypes(grad_out.scalar_type(), saved.scalar_type()) == saved.scalar_type(),
              message(op, ": expected grad_out to have saved's dtype (", saved.scalar_type(),
                      ") or a narrower one, but got grad_out of dtype ", grad_out.scalar_type()));
  // The weights follow the dtype rule of the forward's input, i.e. of grad_out.
  if (weight.has_value()) check_param(op, "weight", grad_out, *weight, normalized_shape, rms);
  if (bias.has_value()) check_param(op, "bias", grad_out, *bias, normalized_shape, rms);
  const ScalarType acc = acc_type_for(saved_is_output ? grad_out.scalar_type() : saved.scalar_type());
  auto check_stat = [&](const char* name, const Tensor& t) {
    check_same_device(op, name, saved, t);
    TORCH_CHECK(t.numel() == g.rows, message(op, ": expected ", name, " to hold one value per row (", g.rows,
                                             "), but got ", name, " of shape ", t.sizes()));
    TORCH_CHECK(t.scalar_type() == acc,
                message(op, ": expected ", name, " of dtype ", acc, ", but got ", t.scalar_type()));
  };
  if (mean.has_value()) check_stat("mean", *mean);
  check_stat("rstd", rstd);
  if (saved_is_output) {
    TORCH_CHECK(saved.scalar_type() == grad_out.scalar_type(),
                message(op, ": with saved_is_output, expected saved (the forward's output) to have grad_out's dtype ",
                        grad_out.scalar_type(), ", but got ", saved.scalar_type()));
  }
  if (grad_residual_out.has_value()) {
    check_same_device(op, "grad_residual_out", saved, *grad_residual_out);
    TORCH_CHECK(
        grad_residual_out->sizes() == saved.sizes(),
        message(op, ": expected grad_residual_out of shape ", saved.sizes(), ", but got ", grad_residual_out->sizes()));
    check_float(op, "grad_residual_out", *grad_residual_out);
  }
  return g;
}

namespace {

void check_destination_shape(const char* op, const char* name, const Tensor& input, const Tensor& dest,
                             ScalarType dtype, at::IntArrayRef shape) {
  check_same_device(op, name, input, dest);
  TORCH_CHECK(dest.scalar_type() == dtype && dest.sizes() == shape,
              message(op, ": expected ", name, " of shape ", shape, " and dtype ", dtype, ", but got ", name,
                      " of shape ", dest.sizes(), " and dtype ", dest.scalar_type()));
}

}  // namespace

void check_destination(const char* op, const char* name, const Tensor& input, const Tensor& dest,
                       int64_t normalized_ndim, ScalarType dtype, at::OptionalIntArrayRef shape) {
  check_destination_shape(op, name, input, dest, dtype, shape.has_value() ? *shape : input.sizes());
  // The kernels write each row in place (row_layout.h): its normalized dims packed, the leading dims any
  // strides but 0 (rows written twice, as ATen refuses for any out=).
  const at::IntArrayRef sizes = dest.sizes(), strides = dest.strides();
  const int64_t axis = dest.dim() - normalized_ndim;
  int64_t packed = 1;
  for (int64_t d = dest.dim() - 1; d >= axis; --d) {
    TORCH_CHECK(sizes[d] == 1 || strides[d] == packed,
                message(op, ": expected ", name,
                        " to be contiguous in its normalized dims (the kernels write each row in place), but got ",
                        name, " of strides ", strides));
    packed *= sizes[d];
  }
  for (int64_t d = 0; d < axis; ++d) {
    TORCH_CHECK(sizes[d] <= 1 || strides[d] != 0,
                message(op, ": unsupported operation: more than one element of ", name,
                        " refers to a single memory location (an expanded dim of stride 0). Please clone() it first."));
  }
}

void check_destination(const char* op, const char* name, const Tensor& input, const Tensor& dest, ScalarType dtype,
                       at::IntArrayRef shape) {
  check_destination_shape(op, name, input, dest, dtype, shape);
  TORCH_CHECK(dest.is_contiguous(),
              message(op, ": expected ", name, " to be contiguous (the kernels write it row by row)"));
}

void check_no_overlap(const char* op, const char* name, const Tensor& dest, const char* other_name,
                      const Tensor& other) {
  const at::MemOverlapStatus status = at::get_overlap_status(dest, other);
  TORCH_CHECK(status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial,
              message(op, ": ", name, " shares memory with ", other_name,
                      "; write into a separate buffer (the in-place add_layer_norm_ / "
                      "add_rms_norm_ write into input and residual)"));
}

void check_quant_args(const char* op, const Tensor& input, ScalarType quant_dtype, const OptTensor& scale,
                      const OptTensor& scale_ub, bool dtype_of_out) {
  const bool nvfp4 = quant_dtype == ScalarType::Float4_e2m1fn_x2;
  const bool supported = quant_dtype == ScalarType::Float8_e4m3fn || quant_dtype == ScalarType::Float8_e5m2 ||
                         quant_dtype == ScalarType::Char || nvfp4;
  TORCH_CHECK(
      supported || !dtype_of_out,
      message(op,
              ": expected out to be a torch.float8_e4m3fn, torch.float8_e5m2, torch.int8 or torch.float4_e2m1fn_x2 "
              "tensor (the codes), but got out of dtype ",
              quant_dtype));
  TORCH_CHECK(supported, message(op,
                                 ": expected quant_dtype to be torch.float8_e4m3fn, torch.float8_e5m2, torch.int8 or "
                                 "torch.float4_e2m1fn_x2, but got ",
                                 quant_dtype));
  TORCH_CHECK(!nvfp4 || scale.has_value(), message(op,
                                                   ": NVFP4 codes (float4_e2m1fn_x2) need scale=, their float32 global "
                                                   "scale (the blocks' float8_e4m3fn scales are computed)"));
  TORCH_CHECK(!(scale.has_value() && scale_ub.has_value()),
              message(op, ": scale_ub caps the dynamic per-row scale, so it cannot be given with a static scale"));
  auto check_one_float = [&](const char* name, const Tensor& t) {
    check_same_device(op, name, input, t);
    TORCH_CHECK(t.scalar_type() == ScalarType::Float && t.numel() == 1,
                message(op, ": expected ", name, " to be a float32 tensor of one element, but got ", name, " of dtype ",
                        t.scalar_type(), " and shape ", t.sizes()));
  };
  if (scale.has_value()) check_one_float("scale", *scale);
  if (scale_ub.has_value()) check_one_float("scale_ub", *scale_ub);
}

void check_scales_buffer(const char* op, const Tensor& input, bool static_scale, const OptTensor& scales,
                         at::IntArrayRef scale_shape) {
  if (static_scale) {
    TORCH_CHECK(
        !scales.has_value(),
        message(op, ": scales= receives the dynamic per-row scales; with a static scale there are none to write"));
    return;
  }
  TORCH_CHECK(scales.has_value(),
              message(op, ": a dynamic scale (no scale=) needs a scales= buffer for the per-row scales of shape ",
                      scale_shape));
  check_destination(op, "scales", input, *scales, ScalarType::Float, scale_shape);
}

void check_group_size(const char* op, at::IntArrayRef normalized_shape, int64_t group_size, bool static_scale,
                      bool scales_column_major, bool scales_swizzled, ScalarType scales_dtype,
                      ScalarType quant_dtype) {
  TORCH_CHECK(!(scales_swizzled && scales_column_major),
              message(op, ": scales_swizzled and scales_column_major are two layouts of the scales; give one of them"));
  if (quant_dtype == ScalarType::Float4_e2m1fn_x2) {
    TORCH_CHECK(group_size == 0 || group_size == quant::kNvfp4Block,
                message(op,
                        ": NVFP4 codes (float4_e2m1fn_x2) have "
                        "blocks of 16 elements (group_size 16, or 0), but got group_size=",
                        group_size));
    TORCH_CHECK(scales_dtype == ScalarType::Float8_e4m3fn,
                message(op, ": NVFP4 block scales are float8_e4m3fn, but got scales_dtype ", scales_dtype));
    TORCH_CHECK(normalized_shape.size() == 1, message(op,
                                                      ": NVFP4 codes need a 1-D normalized_shape (blocks along its "
                                                      "dim), but got normalized_shape ",
                                                      normalized_shape));
    TORCH_CHECK(normalized_shape[0] % quant::kNvfp4Block == 0, message(op,
                                                                       ": NVFP4 codes need rows of a multiple of 16 "
                                                                       "elements (their blocks), but got rows of ",
                                                                       normalized_shape[0]));
    return;
  }
  TORCH_CHECK(group_size >= 0,
              message(op, ": expected group_size to be positive (or 0: a scale per row), but got ", group_size));
  TORCH_CHECK(
      scales_dtype == ScalarType::Float || scales_dtype == ScalarType::Float8_e8m0fnu,
      message(op, ": expected scales_dtype to be torch.float32 or torch.float8_e8m0fnu (MX block scales), but got ",
              scales_dtype));
  if (scales_dtype == ScalarType::Float8_e8m0fnu) {
    TORCH_CHECK(group_size > 0, message(op, ": float8_e8m0fnu scales are MX block scales, so they need a group_size"));
    TORCH_CHECK(
        quant_dtype != ScalarType::Char,
        message(op, ": MX block scales (float8_e8m0fnu) go with float8 codes, but got codes of dtype ", quant_dtype));
  }
  TORCH_CHECK(
      !scales_swizzled || (scales_dtype == ScalarType::Float8_e8m0fnu && group_size == 32),
      message(op,
              ": scales_swizzled lays out the block scales of MXFP8 (float8_e8m0fnu scales, group_size 32) and NVFP4 "
              "in the scaled matmuls' 128 x 4 tiles, but got group_size=",
              group_size, " and scales of dtype ", scales_dtype));
  if (group_size == 0) {
    TORCH_CHECK(!scales_column_major,
                message(op, ": scales_column_major lays out per-group scales, so it needs a group_size"));
    return;
  }
  TORCH_CHECK(!static_scale, message(op,
                                     ": group_size gives each group of columns a dynamic scale, so it cannot be given "
                                     "with a static scale"));
  TORCH_CHECK(normalized_shape.size() == 1, message(op,
                                                    ": group_size needs a 1-D normalized_shape (groups along its "
                                                    "dim), but got normalized_shape ",
                                                    normalized_shape));
  TORCH_CHECK(normalized_shape[0] % group_size == 0,
              message(op, ": expected group_size to divide the ", normalized_shape[0],
                      " normalized elements of a row, but got group_size=", group_size));
}

namespace {

void require_group_scales_buffer(const char* op, const OptTensor& scales, at::IntArrayRef shape,
                                 ScalarType scales_dtype) {
  TORCH_CHECK(scales.has_value(),
              message(op,
                      scales_dtype == ScalarType::Float8_e4m3fn
                          ? ": NVFP4 codes need a scales= buffer for their blocks' float8_e4m3fn scales of shape "
                          : ": a dynamic scale (no scale=) needs a scales= buffer for the per-group scales of shape ",
                      shape));
}

}  // namespace

std::array<int64_t, 2> swizzled_scales_shape(int64_t rows, int64_t groups) {
  return {quant::swizzled_scale_rows(rows), quant::swizzled_scale_blocks(groups)};
}

void check_swizzled_scales_buffer(const char* op, const Tensor& input, const OptTensor& scales, int64_t rows,
                                  int64_t groups, ScalarType scales_dtype) {
  const std::array<int64_t, 2> shape = swizzled_scales_shape(rows, groups);
  require_group_scales_buffer(op, scales, shape, scales_dtype);
  check_same_device(op, "scales", input, *scales);
  const int64_t numel = shape[0] * shape[1];
  TORCH_CHECK(scales->scalar_type() == scales_dtype && scales->numel() == numel && scales->is_contiguous(),
              message(op, ": expected swizzled scales (the ", rows, " rows x ", groups,
                      " blocks padded to whole 128 x 4 tiles) "
                      "to be a contiguous ",
                      scales_dtype, " tensor of ", numel, " elements (shape ", at::IntArrayRef(shape),
                      ", or any of as many), but got scales of shape ", scales->sizes(), ", strides ",
                      scales->strides(), " and dtype ", scales->scalar_type()));
}

GroupScalesLayout check_group_scales_buffer(const char* op, const Tensor& input, const OptTensor& scales,
                                            at::IntArrayRef scale_shape, ScalarType scales_dtype) {
  require_group_scales_buffer(op, scales, scale_shape, scales_dtype);
  check_destination_shape(op, "scales", input, *scales, scales_dtype, scale_shape);
  const int64_t groups = scale_shape.back();
  const int64_t rows = c10::multiply_integers(scale_shape.begin(), scale_shape.end() - 1);
  if (scales->is_contiguous() || groups == 0 || rows == 0) return {groups, 1};
  const Tensor row_scales = scales->select(-1, 0);  // the rows' dims alone
  const int64_t group_stride = groups > 1 ? scales->stride(-1) : rows;
  TORCH_CHECK(
      row_scales.is_contiguous() && group_stride >= rows,
      message(op,
              ": expected scales to be row-major "
              "(contiguous) or column-major (each group's scales of all rows contiguous, the groups at least as many "
              "elements apart), but got scales of shape ",
              scales->sizes(), " and strides ", scales->strides()));
  return {1, group_stride};
}

void check_weight_offset(const char* op, const OptTensor& weight, double weight_offset) {
  TORCH_CHECK(std::isfinite(weight_offset), message(op, ": expected a finite weight_offset, but got ", weight_offset));
  TORCH_CHECK(weight_offset == 0.0 || weight.has_value(),
              message(op, ": weight_offset=", weight_offset,
                      " needs a weight (the scale is weight + weight_offset), but got weight=None"));
}

}  // namespace layernorm_ext
