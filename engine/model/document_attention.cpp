#include "engine/model/document_attention.hpp"

#include "engine/common/error.hpp"
#include "engine/common/torch_compat.hpp"

#include <algorithm>
#include <limits>
#include <vector>

namespace dsrun {

PackedDocuments::PackedDocuments(const torch::Tensor& documents, const torch::Tensor& positions, const torch::Device& device, bool variable_length)
    : variable_length_(variable_length) {
  DSRUN_ASSERT(documents.dim() == 2 && positions.sizes() == documents.sizes(), "documents and positions are [b, s]");
  rows_ = documents.size(0);
  row_tokens_ = documents.size(1);
  const torch::Tensor numbers = documents.to(torch::kCPU, torch::kInt32).contiguous();
  const int32_t* doc = numbers.data_ptr<int32_t>();
  std::vector<int32_t> starts;
  starts.reserve(static_cast<size_t>(rows_) + 16);
  for (int64_t r = 0; r < rows_; ++r)
    for (int64_t k = 0; k < row_tokens_; ++k) {
      const int64_t t = r * row_tokens_ + k;
      if (k == 0 || doc[t] != doc[t - 1]) starts.push_back(static_cast<int32_t>(t));
    }
  starts.push_back(static_cast<int32_t>(rows_ * row_tokens_));
  count_ = static_cast<int64_t>(starts.size()) - 1;
  for (int64_t d = 0; d < count_; ++d) longest_ = std::max<int64_t>(longest_, starts[d + 1] - starts[d]);
  cu_seqlens_ = torch::tensor(starts, torch::kInt32).to(device);
  documents_ = numbers.to(device);
  positions_ = positions.to(device, torch::kInt64);
}

torch::Tensor PackedDocuments::attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) const {
  if (!variable_length_) return attend_masked(q, k, v);
  // The plan chose the kernel by the same rule (execution_modes.cpp); a mismatch is a bug, not a slow path.
  DSRUN_ASSERT(compat::varlen_attention_applies(q), "the plan chose variable-length attention where its kernel does not run");
  const int64_t tokens = rows_ * row_tokens_;
  // [b, s, heads, d] -> [b·s, heads, d]: a view when the rows lie one after another (they do: the
  // projections are contiguous in b and s), else a copy.
  auto stream = [tokens](const torch::Tensor& x) { return x.reshape({tokens, x.size(2), x.size(3)}); };
  torch::Tensor out = compat::varlen_attention(stream(q), stream(k), stream(v), cu_seqlens_, longest_);
  return out.view({rows_, row_tokens_, q.size(2), q.size(3)});
}

torch::Tensor PackedDocuments::attend_masked(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) const {
  torch::Tensor& bias = (*bias_)[q.scalar_type()];
  if (!bias.defined()) {
    const torch::Tensor docs = documents_.to(q.device());
    const torch::Tensor causal = torch::ones({row_tokens_, row_tokens_}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).tril();
    const torch::Tensor allowed = (docs.unsqueeze(2) == docs.unsqueeze(1)).logical_and(causal).unsqueeze(1);
    bias = torch::zeros(allowed.sizes(), q.options()).masked_fill_(allowed.logical_not(), -std::numeric_limits<float>::infinity());
  }
  const int64_t group = q.size(2) / k.size(2);
  torch::Tensor qh = q.transpose(1, 2), kh = k.transpose(1, 2), vh = v.transpose(1, 2);  // [b, heads, s, d]
  if (group > 1) {
    kh = kh.repeat_interleave(group, 1);
    vh = vh.repeat_interleave(group, 1);
  }
  return compat::masked_attention(qh, kh, vh, bias).transpose(1, 2);
}

}  // namespace dsrun
