"""transformers' DeepseekV3ForCausalLM against dsrun, both ways (issue 63).

  python3 bench/hf_deepseek_v3_check.py make DIR    # a small random V3 saved by transformers (DIR/hf),
                                                    # tokens (DIR/tokens.safetensors), its fp32 loss (DIR/hf_loss.json)
  python3 bench/hf_deepseek_v3_check.py load DIR    # transformers loads dsrun's export (DIR/export) and
                                                    # compares its loss with dsrun's (DIR/dsrun_loss.json)

The shape must stay equal to hf_check_spec() in tests/test_latent.cpp.
"""
import json
import sys

import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

YARN = {"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}


def config():
    kwargs = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                  routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=32,
                  qk_nope_head_dim=32, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                  norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.05,
                  tie_word_embeddings=False, attention_bias=False, rope_interleave=True)
    try:  # transformers 5: rope_parameters (with rope_theta inside); 4.x: rope_scaling and rope_theta
        return DeepseekV3Config(rope_parameters=dict(YARN, rope_theta=10000.0), **kwargs)
    except TypeError:
        return DeepseekV3Config(rope_scaling=YARN, rope_theta=10000.0, **kwargs)


def loss_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()  # mean cross-entropy of ids[:, 1:] given ids[:, :-1]


def main():
    mode, out = sys.argv[1], sys.argv[2]
    ids_path = out + "/tokens.safetensors"
    if mode == "make":
        torch.manual_seed(0)
        cfg = config()
        print("config:", {k: getattr(cfg, k, None) for k in ("rope_parameters", "rope_scaling", "rope_interleave", "n_group", "topk_group")})
        model = DeepseekV3ForCausalLM(cfg).float().eval()
        for layer in model.model.layers:  # a selection bias that matters
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.data.normal_(0, 0.01)
        ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
        save_file({"input_ids": ids.contiguous()}, ids_path)
        model.save_pretrained(out + "/hf")
        loss = loss_of(model, ids)
        json.dump({"loss": loss}, open(out + "/hf_loss.json", "w"))
        print(f"transformers: saved, fp32 loss {loss:.7f}")
    else:
        from safetensors.torch import load_file
        ids = load_file(ids_path)["input_ids"]
        model, info = DeepseekV3ForCausalLM.from_pretrained(out + "/export", torch_dtype=torch.float32, output_loading_info=True)
        print("loading info:", {k: (v if len(v) < 12 else f"{len(v)} keys") for k, v in info.items()})
        missing = [k for k in info.get("missing_keys", []) if "rotary" not in k]
        theirs, ours = loss_of(model.eval(), ids), json.load(open(out + "/dsrun_loss.json"))["loss"]
        rel = abs(theirs - ours) / ours
        print(f"transformers on dsrun's export: {theirs:.7f}, dsrun {ours:.7f}, relative {rel:.2e}; missing {missing}")
        sys.exit(0 if rel <= 1e-4 and not missing else 1)


if __name__ == "__main__":
    main()
