"""Models the planner tests plan, apply and train: the example notebook's small GPT (attention and
MLP blocks, which tensor parallelism splits) in a few sizes, and a small conv net (which it cannot)."""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks"))
import gpt_model  # noqa: E402,F401  (registered for pickling by value by the tests)
from gpt_model import GPT  # noqa: E402,F401


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)])
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(16, 10)

    def forward(self, x):
        for conv in self.layers:
            x = F.relu(conv(x))
        return self.fc(self.pool(x).flatten(1))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build():
    return GPT(vocab=128, d=64, heads=4, layers=2, ctx=16)


def build_wide():
    """A GPT whose parameters and AdamW state are most of its memory."""
    return GPT(vocab=512, d=128, heads=4, layers=4, ctx=16)


_tokens = torch.randint(0, 128, (8, 17), generator=torch.Generator().manual_seed(1))


def batch():
    return _tokens[:, :-1], _tokens[:, 1:]


def build_conv():
    return ConvNet()


def conv_batch():
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


def class_loss(logits, targets):
    return F.cross_entropy(logits, targets)


def build_noisy_mlp():
    """A small model whose build writes to fd 1 itself (as os.system, a subprocess or C++ logging would)."""
    os.write(1, b"\n")
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def build_hf_llama():
    """A Hugging Face Llama built from a config (random weights, nothing downloaded), as users bring them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                                        max_position_embeddings=64))


def build_hf_llama_bf16():
    """The same, built in bf16 (`.to(torch.bfloat16)` at the end of the build)."""
    return build_hf_llama().to(torch.bfloat16)


def hf_batch():
    """Hugging Face inputs: a dict for model(**inputs), with the targets beside it."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (8, 16), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.randint(0, 256, (8, 16), generator=g)


def hf_lm_loss(output, targets):
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())
