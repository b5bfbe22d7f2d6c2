// Attention that stays inside documents packed into a batch's rows (data.separate_documents): where
// each document lies, and causal attention within each, by FlashAttention's variable-length kernel
// where it runs (CUDA, fp16/bf16, PyTorch 2.x) and by an additive mask elsewhere (same semantics).
#pragma once

#include <torch/torch.h>

#include <map>
#include <memory>

namespace dsrun {

// The documents of one micro-batch, the rows read one after another as a single stream of b·s
// tokens: a row's first token always starts a document (a document cut by the row boundary goes on
// as a new one, as its positions restart there).
class PackedDocuments {
 public:
  // documents: [b, s] int32, each token's document number within its row (Batch::documents; on
  // the CPU, as the data loader makes it: the boundaries are read there without a device sync).
  // positions: [b, s] int64, each token's place in its document. Both moved to `device`.
  // variable_length: attend by the variable-length kernel (ExecutionModes::variable_length_attention), else the mask.
  PackedDocuments(const torch::Tensor& documents, const torch::Tensor& positions, const torch::Device& device, bool variable_length = false);

  int64_t rows() const { return rows_; }
  int64_t row_tokens() const { return row_tokens_; }
  int64_t count() const { return count_; }      // documents in the micro-batch
  int64_t longest() const { return longest_; }  // tokens of the longest
  const torch::Tensor& positions() const { return positions_; }  // [b, s] int64 on the device

  // Causal attention within documents. q: [b, s, heads, d]; k, v: [b, s, kv_heads, d] (heads a
  // multiple of kv_heads); any strides with a unit last one. Returns [b, s, heads, d].
  torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) const;
  // The masked path alone, whatever the device (for tests; attend takes it where the kernel does not run).
  torch::Tensor attend_masked(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) const;

 private:
  int64_t rows_ = 0, row_tokens_ = 0, count_ = 0, longest_ = 0;
  bool variable_length_ = false;
  torch::Tensor cu_seqlens_;  // [count + 1] int32 on the device: where each document starts in the stream
  torch::Tensor documents_;   // [b, s] int32 on the device
  torch::Tensor positions_;
  // The masked path's additive bias [b, 1, s, s] (0 inside a document's causal triangle, -inf
  // elsewhere) per dtype, made once per micro-batch and shared by every layer and by the copies of
  // this object that recomputed blocks capture.
  std::shared_ptr<std::map<c10::ScalarType, torch::Tensor>> bias_ = std::make_shared<std::map<c10::ScalarType, torch::Tensor>>();
};

}  // namespace dsrun
