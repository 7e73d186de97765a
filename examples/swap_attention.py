"""Switch existing models to entmax attention: a torch nn.TransformerEncoder (with
replace_attention) and, when `transformers` is installed, a Hugging Face model (with
attn_implementation="entmax"). Runs on CPU in seconds.

    python examples/swap_attention.py
"""
import torch
from torch import nn

from entmax_fast.multihead import MultiheadEntmaxAttention, replace_attention

torch.manual_seed(0)

# 1. torch: any model holding nn.MultiheadAttention modules.
layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)
encoder = nn.TransformerEncoder(layer, num_layers=2)
replace_attention(encoder, attention="learned")  # per-head α = 1 + sigmoid(w), trained with the model
tokens = torch.randn(2, 10, 64)
padding = torch.zeros(2, 10, dtype=torch.bool)
padding[1, 7:] = True  # the second sequence has 7 tokens
out = encoder(tokens, src_key_padding_mask=padding)
out.pow(2).mean().backward()
attention = encoder.layers[0].self_attn
print("torch encoder output", tuple(out.shape), "| layer-0 α per head:", attention.alpha.detach().numpy().round(3),
      "| grad of its logit:", [f"{g:.1e}" for g in attention.alpha_logit.grad.tolist()])

# The module alone, with the weights returned (exact zeros where sparsemax cuts keys off).
module = MultiheadEntmaxAttention(64, 4, batch_first=True, attention="sparsemax")
_, weights = module(tokens, tokens, tokens, key_padding_mask=padding)
print(f"sparsemax weights {tuple(weights.shape)}, zero fraction {(weights == 0).float().mean().item():.2f}")

# 2. Hugging Face transformers (>= 5): a tiny random Llama, no download.
try:
    import transformers
except ImportError:
    print("transformers is not installed: skipping the Hugging Face part")
else:
    import entmax_fast.hf  # noqa: F401  registers "entmax" and "sparsemax"

    config = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="entmax")
    generated = model.generate(torch.tensor([[1, 5, 7]]), max_new_tokens=5, do_sample=False, pad_token_id=0)
    print("Llama with entmax attention generated", generated.tolist())
