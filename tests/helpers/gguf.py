"""A tiny Llama written as a GGUF file the way llama.cpp's converter writes one."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .model_factory import CHAT_TEMPLATE


def permute_for_gguf(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: HF's rotate-half layout of each
    # head's rows becomes GGML's interleaved pairs; transformers undoes it on import.
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_llama_gguf(model: torch.nn.Module, tokenizer_json: Path, path: Path) -> None:
    """Write `model` (a float32 LlamaForCausalLM) and its byte-level BPE tokenizer as an F16
    GGUF, with the metadata keys llama.cpp's converter writes."""
    from gguf import GGUFWriter, TokenType

    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)

    tok = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|endoftext|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    # F16 everywhere (norms included), so that the default float16 import is lossless and
    # parity can be held to float32 rounding.
    def add(name: str, tensor: torch.Tensor) -> None:
        writer.add_tensor(name, tensor.detach().to(torch.float16).numpy())

    sd = model.state_dict()
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        q = permute_for_gguf(sd[p + "self_attn.q_proj.weight"], config.num_attention_heads)
        k = permute_for_gguf(sd[p + "self_attn.k_proj.weight"], config.num_key_value_heads)
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(f"blk.{i}.attn_q.weight", q)
        add(f"blk.{i}.attn_k.weight", k)
        add(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        add(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        add(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        add(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if not config.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
