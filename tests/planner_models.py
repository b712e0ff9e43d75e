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


def hf_token_batch():
    """The same tokens as one input tensor (model(input_ids)), which pipeline stages take."""
    inputs, targets = hf_batch()
    return inputs["input_ids"], targets


def hf_lm_loss(output, targets):
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


class TitanAttention(nn.Module):
    """torchtitan's Llama attention, in small: wq/wk/wv/wo, grouped key/value heads, rotary positions."""

    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, rope):
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)  # (-1: the heads this rank holds under TP)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = _rotate(q, rope), _rotate(k, rope)
        repeat = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def _rotate(x, rope):
    cos, sin = rope[: x.shape[1], None, :].unbind(-1)
    first, second = x[..., ::2], x[..., 1::2]
    return torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1).flatten(-2)


class TitanFeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, hidden):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = TitanAttention(dim, n_heads, n_kv_heads)
        self.feed_forward = TitanFeedForward(dim, hidden)

    def forward(self, x, rope):
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class TitanLlama(nn.Module):
    """A torchtitan-style Llama: its blocks in an nn.ModuleDict keyed "0", "1", ..., rotary tables as a
    non-persistent buffer of the root."""

    def __init__(self, vocab=256, dim=64, layers=4, n_heads=4, n_kv_heads=2, hidden=128, ctx=32):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TitanBlock(dim, n_heads, n_kv_heads, hidden) for i in range(layers)})
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        half = dim // n_heads // 2
        angles = torch.outer(torch.arange(ctx).float(), 1.0 / (10000 ** (torch.arange(half).float() / half)))
        self.register_buffer("rope", torch.stack((angles.cos(), angles.sin()), dim=-1), persistent=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for block in self.layers.values():
            x = block(x, self.rope)
        return self.output(self.norm(x))


def build_titan():
    return TitanLlama()


_titan_tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(3))


def titan_batch():
    return _titan_tokens[:, :-1], _titan_tokens[:, 1:]


class BatchNormNet(nn.Module):
    """A small ResNet-style conv net with BatchNorm, whose training depends on the whole batch's statistics."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()),
                                     nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())])
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(16, 10)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.fc(self.pool(x).flatten(1))


def build_batchnorm():
    return BatchNormNet()


def build_hf_bert():
    """A Hugging Face BERT for masked LM from a config (no dropout, so that layouts can match one process)."""
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                      vocab_size=256, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


def build_hf_gpt2():
    """A Hugging Face GPT-2 from a config (its projections are fused Conv1D layers; no dropout)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


class Recommender(nn.Module):
    """A DLRM-style recommender: embedding tables (EmbeddingBag, sum pooling) for sparse features, an MLP for
    dense ones, and a top MLP on their concatenation; most parameters sit in the tables."""

    def __init__(self, tables=(4096, 2048, 1024), dim=16, dense=8):
        super().__init__()
        self.tables = nn.ModuleList([nn.EmbeddingBag(rows, dim, mode="sum") for rows in tables])
        self.bottom = nn.Sequential(nn.Linear(dense, 32), nn.ReLU(), nn.Linear(32, dim))
        self.top = nn.Sequential(nn.Linear(dim * (len(tables) + 1), 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, sparse, dense):
        pooled = [table(sparse[:, i]) for i, table in enumerate(self.tables)]
        return self.top(torch.cat([self.bottom(dense), *pooled], dim=1)).squeeze(1)


def build_recommender():
    return Recommender()


def build_large_recommender():
    """6.5B parameters, nearly all in two tables (one of 48M rows): more than one H100 holds with AdamW's state."""
    return Recommender(tables=(48_000_000, 2_750_000), dim=128, dense=13)


def large_recommender_batch():
    g = torch.Generator().manual_seed(5)
    return ({"sparse": torch.randint(0, 2_750_000, (256, 2, 8), generator=g), "dense": torch.randn(256, 13, generator=g)},
            torch.rand(256, generator=g))


def recommender_batch():
    g = torch.Generator().manual_seed(4)
    sparse = torch.randint(0, 1024, (16, 3, 4), generator=g)  # 3 features, 4 ids each
    return {"sparse": sparse, "dense": torch.randn(16, 8, generator=g)}, torch.rand(16, generator=g)


def click_loss(logits, targets):
    return F.binary_cross_entropy_with_logits(logits, targets)


def build_hf_mixtral():
    """A Hugging Face Mixtral (mixture of experts: 4 experts, 2 per token) from a config, its experts run by
    transformers' default grouped matmul."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                                            num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64))


def build_hf_bert_untied():
    """BERT with its output head's weight apart from the input embedding's (so that pipelines get as far as the
    attention mask it hands between stages)."""
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                      vocab_size=256, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, tie_word_embeddings=False))
