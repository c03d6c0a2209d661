"""How tests/data/vision's fixture was made: a tiny random Gemma3ForConditionalGeneration (a
SigLIP vision tower and a Gemma 3 text model, ~140k parameters, 64-pixel images of 4 positions),
an offline-trained SentencePiece tokenizer and a Gemma 3 processor config, saved to OUTDIR; then
llama.cpp's own converter makes the two GGUF files:

    .venv/bin/python tests/data/vision/build.py /tmp/vlm/hf
    # convert_hf_to_gguf.py from the llama-cpp-python sdist (vendor/llama.cpp/, with its
    # conversion/ and gguf-py/): pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all:
    python convert_hf_to_gguf.py /tmp/vlm/hf --outtype f16 --outfile tiny-gemma3-vlm.gguf --model-name tiny-gemma3-vlm
    python convert_hf_to_gguf.py /tmp/vlm/hf --outtype f16 --outfile tiny-gemma3-vlm.mmproj.gguf --mmproj --model-name tiny-gemma3-vlm

Seeded: the same files come out byte for byte. What it works around: transformers 5 saves the
vision tower without its `vision_model.` level and drops `added_tokens_decoder` (both restored so
the converter maps the tensors and marks the special tokens CONTROL), and `image_seq_length` must be
in the processor config (else the converter assumes 256 image tokens). Every weight is drawn at
O(1) scale: transformers starts the projector's input projection at zero, which would make every
image the same (zero) embeddings.
"""
import io
import json
import math
import os
import random
import sys

import sentencepiece as spm
import torch

OUT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "hf"))
os.makedirs(OUT, exist_ok=True)
torch.manual_seed(0)
random.seed(0)

# ---------------------------------------------------------------- tokenizer
# Gemma-style SentencePiece (BPE, byte fallback): pad=0 eos=1 bos=2 unk=3,
# then user-defined symbols (ids 4..) for the chat/image markers.
SPECIALS = ["<mask>", "<start_of_turn>", "<end_of_turn>",
            "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
words = ["the", "a", "an", "image", "picture", "photo", "of", "with", "red", "green", "blue", "cat", "dog", "sky", "tree", "describe", "what", "is", "in", "this", "shows", "small", "large", "color", "gradient", "left", "right", "top", "bottom", "user", "model", "answer", "question", "hello", "world"]
corpus = [" ".join(random.choice(words) for _ in range(random.randint(4, 12))) for _ in range(400)]
corpus += ["abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,:;!?'\"()-"]
model_io = io.BytesIO()
spm.SentencePieceTrainer.train(
    sentence_iterator=iter(corpus), model_writer=model_io,
    model_type="bpe", vocab_size=384, byte_fallback=True,
    character_coverage=1.0, split_digits=True, add_dummy_prefix=False,
    remove_extra_whitespaces=False, normalization_rule_name="identity",
    pad_id=0, eos_id=1, bos_id=2, unk_id=3,
    pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
    user_defined_symbols=SPECIALS, minloglevel=2,
)
with open(os.path.join(OUT, "tokenizer.model"), "wb") as f:
    f.write(model_io.getvalue())
sp = spm.SentencePieceProcessor(model_proto=model_io.getvalue())
VOCAB = sp.get_piece_size()
ids = {p: sp.piece_to_id(p) for p in SPECIALS}
print("spm vocab", VOCAB, ids)

added_tokens_decoder = {
    str(i): {"content": sp.id_to_piece(i), "lstrip": False, "rstrip": False,
             "normalized": False, "single_word": False, "special": True}
    for i in [0, 1, 2, 3] + list(ids.values())
}
tok_cfg = {
    "tokenizer_class": "GemmaTokenizer",
    "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
    "mask_token": "<mask>",
    "add_bos_token": True, "add_eos_token": False,
    "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>",
    "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                             "image_token": "<image_soft_token>"},
    "added_tokens_decoder": added_tokens_decoder,
    "model_max_length": 2048,
    "chat_template": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
}
with open(os.path.join(OUT, "tokenizer_config.json"), "w") as f:
    json.dump(tok_cfg, f, indent=1)
with open(os.path.join(OUT, "special_tokens_map.json"), "w") as f:
    json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}, f)

# ---------------------------------------------------------------- model
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    SiglipVisionConfig,
)

IMAGE_SIZE, PATCH, MM_TOKENS = 64, 16, 4   # 4x4 patches -> avg-pool 2x2 -> 4 image tokens
text_cfg = Gemma3TextConfig(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
    max_position_embeddings=2048, sliding_window=512,
    pad_token_id=0, eos_token_id=1, bos_token_id=2,
)
vision_cfg = SiglipVisionConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    image_size=IMAGE_SIZE, patch_size=PATCH, num_channels=3, layer_norm_eps=1e-6,
    vision_use_head=False,
)
cfg = Gemma3Config(
    text_config=text_cfg, vision_config=vision_cfg, mm_tokens_per_image=MM_TOKENS,
    boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
    image_token_index=ids["<image_soft_token>"],
)
model = Gemma3ForConditionalGeneration(cfg).eval()
# random init leaves norm weights at 0 / ones; perturb everything a bit so the
# fixture produces non-trivial logits
with torch.no_grad():
    for n, p in model.named_parameters():
        if p.dim() == 1:
            p.add_(0.1 * torch.randn_like(p))
        elif "embed_tokens" in n:
            p.copy_(torch.randn_like(p))
        else:  # O(1) activations: the projection HF starts at zero would make every image nothing
            p.copy_(torch.randn_like(p) / math.sqrt(p[0].numel()))
model.save_pretrained(OUT, safe_serialization=True)
# transformers v5 saves the SigLIP tower as "vision_tower.embeddings..." (it dropped the
# "vision_model." level); the vendored convert_hf_to_gguf.py tensor map only knows the
# original hub layout "vision_tower.vision_model.*". Rewrite the checkpoint in hub layout
# (transformers v5 still loads that layout through its PrefixChange conversion mapping).
from safetensors.torch import load_file, save_file

st_path = os.path.join(OUT, "model.safetensors")
sd = load_file(st_path)
sd = {("vision_tower.vision_model." + k[len("vision_tower."):]
       if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") else k): v
      for k, v in sd.items()}
save_file(sd, st_path, metadata={"format": "pt"})
print("params", sum(p.numel() for p in model.parameters()))

# ---------------------------------------------------------------- processor
from transformers import AutoTokenizer, Gemma3ImageProcessor, Gemma3Processor

tok = AutoTokenizer.from_pretrained(OUT)
print("hf tokenizer", type(tok).__name__, len(tok), tok("hello <start_of_image> world").input_ids)
improc = Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                              image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
                              do_pan_and_scan=False)
proc = Gemma3Processor(image_processor=improc, tokenizer=tok, image_seq_length=MM_TOKENS,
                       chat_template=tok_cfg["chat_template"])
proc.save_pretrained(OUT)
# convert_hf_to_gguf.py expects a preprocessor_config.json-style dict with image_mean/std and
# (for tinygemma3-style scale factors) image_seq_length; make sure it is present at top level.
pp = os.path.join(OUT, "preprocessor_config.json")
d = json.load(open(pp)) if os.path.exists(pp) else improc.to_dict()
d["image_seq_length"] = MM_TOKENS
json.dump(d, open(pp, "w"), indent=1)

# transformers v5 rewrites tokenizer_config.json on save and drops added_tokens_decoder
# (and writes an absolute vocab_file path). convert_hf_to_gguf.py's sentencepiece path only
# marks tokens CONTROL via added_tokens_decoder, so merge it back.
tc_path = os.path.join(OUT, "tokenizer_config.json")
tc = json.load(open(tc_path))
tc.pop("vocab_file", None)
tc["added_tokens_decoder"] = added_tokens_decoder
tc["add_bos_token"] = True
tc["add_eos_token"] = False
json.dump(tc, open(tc_path, "w"), indent=1)

# ---------------------------------------------------------------- smoke test in HF
import numpy as np
from PIL import Image

img = Image.fromarray(np.dstack(list(np.meshgrid(np.arange(32) * 8, np.arange(32) * 8)) + [np.full((32, 32), 128)]).astype(np.uint8))
inputs = proc(text="describe <start_of_image> please", images=img, return_tensors="pt")
print("hf input_ids", inputs["input_ids"].tolist(), "pixel_values", tuple(inputs["pixel_values"].shape))
# reload from disk (hub-layout keys) to prove the saved checkpoint round-trips
reloaded, info = Gemma3ForConditionalGeneration.from_pretrained(OUT, output_loading_info=True)
print("reload info", {k: v for k, v in info.items() if v})
with torch.no_grad():
    out = model(**inputs)
    out2 = reloaded.eval()(**inputs)
print("reload max |dlogits|", float((out.logits - out2.logits).abs().max()))
print("hf logits", tuple(out.logits.shape), "argmax last", int(out.logits[0, -1].argmax()))
print("files", sorted(os.listdir(OUT)))
