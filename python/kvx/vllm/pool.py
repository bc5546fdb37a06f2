"""A worker's KV cache as kvx sees it, from the tensors vLLM gives ``register_kv_caches``.

vLLM's CPU attention backend gives each layer a contiguous view ``[num_blocks, kv_heads,
block_size, 2 * head_size]`` (vLLM 0.32: of one ``[L, B, H, N, C]`` tensor for all layers), K and V
of a head side by side in a per-ISA arrangement: a head's part of a block is opaque bytes, the
same on both sides only when vLLM, dtype, block size and attention ISA agree (the side channel
checks that). So a kvx page is one vLLM block of one layer (``split_kv=False``), head-major: each
head's part is moved whole (``Layout(head_major=True)``), which lets the TP sizes of the two sides
differ (heads sliced over the ranks). The pool is the layer views in layer order (adjacent ones
registered as one region).

Blocks of different sizes on the two sides need the arrangement inside a head's part. vLLM's
``vec`` kernels keep K by columns (``[element][token]``) then V by rows (``[token][element]``);
``key_columns`` finds out by writing a probe block through the kernel itself, and only then does
the pool say so (``Layout(key_column_bytes=)``), which lets block sizes differ."""

from __future__ import annotations

import re
from typing import Any

import kvx


def _layer_index(name: str) -> int:
    # vLLM's own rule (model_executor.models.utils.extract_layer_index): the one integer in the
    # dotted name ("model.layers.3.self_attn.attn").
    found = [int(p) for p in name.split(".") if re.fullmatch(r"\d+", p)]
    if len(found) != 1:
        raise kvx.ConfigError(f"kvx: cannot tell the layer of KV cache {name!r}")
    return found[0]


def key_columns(isa: str, dtype: Any, cache_dtype: str, block_size: int, head_size: int) -> int:
    """The bytes of one K element where vLLM's CPU kernel for `isa` writes a head's part of a
    block of `block_size` tokens as K by columns, then V by rows (seen by writing a probe block
    through the kernel: every token's K element ``d`` at ``d * block_size + t``, its V element at
    ``block_size * head_size + t * head_size + d``); 0 for any other arrangement, or a cache
    dtype other than the model's, whose blocks then map only whole."""
    import torch
    from vllm import _custom_ops as ops

    if cache_dtype != "auto":
        return 0
    n, hs = int(block_size), int(head_size)
    # Small integers, exact in any float dtype the kernels take (bf16 holds 0..256 exactly).
    if n > 256 or hs > 256:
        return 0
    tokens = torch.arange(n).view(n, 1, 1).expand(n, 1, hs)
    dims = torch.arange(hs).view(1, 1, hs).expand(n, 1, hs)
    ok = True
    for key, val in ((tokens, dims), (dims, tokens)):
        cache = torch.full((1, 1, n, 2 * hs), -1.0, dtype=dtype)
        k_cache, v_cache = cache.view(1, 1, 2 * n, hs).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key.to(dtype).contiguous(), val.to(dtype).contiguous(),
                                       k_cache, v_cache, torch.arange(n, dtype=torch.int64), isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype=cache_dtype)
        flat = cache.reshape(-1).to(torch.float32)
        want_k = key[:, 0, :].T.reshape(-1).to(torch.float32)  # [element][token]
        want_v = val[:, 0, :].reshape(-1).to(torch.float32)    # [token][element]
        ok = ok and torch.equal(flat[:n * hs], want_k) and torch.equal(flat[n * hs:], want_v)
    return int(torch.tensor([], dtype=dtype).element_size()) if ok else 0


class Pool:
    """The layout, the memory regions and the facts a peer must match."""

    def __init__(self, kv_caches: "dict[str, Any]", block_size: int, num_blocks: int,
                 model_kv_heads: int = 0, key_column_bytes: int = 0):
        by_layer: dict = {}
        seen_ptrs: set = set()
        for name, t in kv_caches.items():
            if isinstance(t, (list, tuple)):
                raise kvx.ConfigError(
                    f"kvx: KV cache {name!r} is a list of tensors (a backend that keeps K and V "
                    "apart): not supported yet")
            ptr = int(t.data_ptr())
            if ptr in seen_ptrs:  # KV sharing: two layer names, one tensor
                continue
            seen_ptrs.add(ptr)
            by_layer[_layer_index(name)] = t
        if not by_layer:
            raise kvx.ConfigError("kvx: no KV cache tensors to register")
        layers = sorted(by_layer)
        if layers != list(range(layers[0], layers[0] + len(layers))):
            raise kvx.ConfigError(f"kvx: KV cache layers {layers} are not consecutive")
        tensors = [by_layer[i] for i in layers]
        first = tensors[0]
        for t in tensors:
            # vLLM 0.32 allocates a group's layers as one [L, B, H, N, C] tensor and hands each
            # layer a view of it: contiguous (and the layers adjacent, one registration) where
            # L is outermost (LBHNC, the CPU backend's layout); a layout that interleaves layers
            # within a block (BLHNC, cross-layer blocks) gives views that are not.
            if not t.is_contiguous():
                raise kvx.ConfigError("kvx: a layer's KV cache is not contiguous (a layout that "
                                      "interleaves layers within a block): not supported")
            if t.shape != first.shape or t.dtype != first.dtype:
                raise kvx.ConfigError("kvx: KV cache tensors of different shapes or dtypes")
        if int(first.shape[0]) != int(num_blocks):
            raise kvx.ConfigError(
                f"kvx: the KV cache tensor has {first.shape[0]} blocks, vLLM's config "
                f"{num_blocks}: kernel blocks smaller than vLLM's blocks are not supported")
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.page_bytes = int(first.stride(0)) * int(first.element_size())
        self.first_layer = layers[0]
        self.num_layers = len(layers)
        self.shape = [int(s) for s in first.shape[1:]]
        self.dtype = str(first.dtype)
        # This rank's KV heads (the block's outer dimension), and the model's.
        self.heads = self.shape[0]
        self.model_kv_heads = int(model_kv_heads) or self.heads
        if self.page_bytes % (self.heads * self.block_size):
            raise kvx.ConfigError(f"kvx: a block of {self.page_bytes} bytes is not {self.heads} "
                                  f"heads of {self.block_size} tokens")
        self.layout = kvx.Layout(first_layer=self.first_layer, num_layers=self.num_layers,
                                 page_bytes=self.page_bytes, num_pages=self.num_blocks,
                                 split_kv=False, heads=self.heads,
                                 head_bytes=self.page_bytes // (self.heads * self.block_size),
                                 head_major=True, key_column_bytes=int(key_column_bytes))
        self.key_column_bytes = int(key_column_bytes)
        self.memory = [(int(t.data_ptr()), int(t.numel()) * int(t.element_size()))
                       for t in tensors]
        self.tensors = tensors  # kept alive by vLLM; referenced here for the test hook

    def facts(self) -> dict:
        """What a peer's pool must match, head for head (its TP size, and so its heads per block,
        may differ; its block size too where both keep K by columns)."""
        return {"block_size": self.block_size,
                "head_token_bytes": self.page_bytes // (self.heads * self.block_size),
                "key_column_bytes": self.key_column_bytes,
                "first_layer": self.first_layer, "num_layers": self.num_layers,
                "token_shape": self.shape[2:], "dtype": self.dtype,
                "model_kv_heads": self.model_kv_heads}
