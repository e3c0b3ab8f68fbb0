"""Llama-family forward pass over a paged KV cache (Llama, Mistral, Qwen2 configs).

Numerics follow HF transformers' Llama exactly where it matters for identical greedy output:
RMSNorm in float32 then cast, RoPE tables from transformers' own init functions (every scaling
type it knows), residuals in the model dtype. Q/K/V and gate/up projections are fused.

A bfloat16 model's projections on a CPU run on prepacked kernels (`KERNELS`):
- "onednn-bf16", where oneDNN has bfloat16 GEMMs (AVX-512): the weights reordered once into
  oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, as torch.compile's
  freezing pass does), so no call reorders them again. Its results are F.linear's, bit for bit.
- "fbgemm-fp16", where PyTorch's bfloat16 matmul is a reference kernel (AVX2 only): FBGEMM's
  float16-weight GEMM (the kernel of PyTorch's dynamic float16 linear). Every bfloat16 weight in
  [2^-14, 65504] is a float16 exactly (smaller ones keep an absolute error under 2^-25),
  activations stay float32, products are summed in float32 as a bfloat16 GEMM sums them, and
  the result is rounded back to bfloat16. A weight beyond float16's range keeps F.linear.
- "fbgemm-fp16+onednn-bf16": both packings (the projections' weights twice); calls of under
  `FEW_ROWS` rows (small decode batches) on FBGEMM, which streams the weights from memory
  faster there on AVX-512 without AMX, the rest on oneDNN, which computes faster from there on.
  With AMX, oneDNN is as fast at one row and faster from two: "auto" takes it alone.
Activations, residuals and the KV cache stay bfloat16.

The cache is one tensor [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]: a block is
contiguous across all layers, so a request's KV moves between processes in one piece per block.
Rows are addressed through a flat view: row(block, layer, k_or_v, offset) =
((block * L + layer) * 2 + k_or_v) * block_size + offset.
Within a layer, the K/V of every token of the step is written before any attention reads the
cache, so a sequence may read blocks that another sequence of the same step is filling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvbaton.llm.model_files import eos_token_ids

SUPPORTED = ("llama", "mistral", "qwen2")


FLOAT16_MAX = 65504.0


KERNELS = ("native", "fbgemm-fp16", "onednn-bf16", "fbgemm-fp16+onednn-bf16")
ONEDNN_BATCH_HINT = 64  # rows the oneDNN layout is chosen for (any count runs on it)
FEW_ROWS = 8  # "fbgemm-fp16+onednn-bf16" runs calls of fewer rows on FBGEMM
DECODE_GROUP_BYTES = 2 * 2**20  # gathered K and V per group of decodes (see _attention)


class Projection:
    """A linear layer: weight [out, in] and optional bias in the model dtype, run by `kernel`
    (see the module's docstring). Output in x's dtype.

    - `weight` is None where a packing replaces it."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernel: str,
    ) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, not {kernel!r}")
        self.nbytes = weight.numel() * weight.element_size()  # read once per step
        self.bias = bias
        self.weight: torch.Tensor | None = weight.contiguous()
        self.fp16: Any = None  # FBGEMM's packing
        self.onednn: Any = None  # oneDNN's
        kernels = kernel.split("+")
        if "fbgemm-fp16" in kernels and weight.abs().max().item() <= FLOAT16_MAX:
            self.fp16 = torch.ops.quantized.linear_prepack_fp16(
                weight.float(), None if bias is None else bias.float()
            )
        if "onednn-bf16" in kernels:
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight, ONEDNN_BATCH_HINT)
        if self.fp16 is not None or self.onednn is not None:
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor
        if self.fp16 is not None and (self.onednn is None or x.shape[0] < FEW_ROWS):
            out = torch.ops.quantized.linear_dynamic_fp16(x.float(), self.fp16)
            return out.to(x.dtype)
        if self.onednn is not None:
            out = torch.ops.mkldnn._linear_pointwise(x, self.onednn, self.bias, "none", [], "")
            return out
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)


def fp16_gemm_available() -> bool:
    """Whether this PyTorch has FBGEMM's float16 GEMM (x86 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def amx_available() -> bool:
    """Whether this CPU has AMX tiles (oneDNN's bfloat16 GEMMs run on them)."""
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(is_amx is not None and is_amx())


def onednn_bf16_available() -> bool:
    """Whether oneDNN runs bfloat16 GEMMs on this CPU (AVX-512 at least)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_is_mkldnn_bf16_supported")
        and bool(ops._is_mkldnn_bf16_supported())
    )


@dataclass
class LayerWeights:
    in_norm: torch.Tensor
    qkv: Projection
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection


@dataclass
class PrefillSpan:
    """One sequence's chunk in a step: tokens [start, end) of the flat batch, at positions
    [context_len - (end - start), context_len)."""

    start: int
    end: int
    context_len: int
    context_blocks: torch.Tensor | None  # [1, ceil(context_len / block size)]; None: no prefix


@dataclass
class StepBatch:
    """Tensors of one forward step. Tokens of all sequences are flat: decodes first (one token
    each, in `decode` order), then the prefill chunks."""

    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_rows: torch.Tensor  # [T] cache row of each token's K in layer 0
    num_decodes: int
    decode_blocks: torch.Tensor | None  # [D, ceil(Lmax / block size)] each decode's blocks
    decode_len: int  # Lmax, the longest decode context
    decode_mask: torch.Tensor | None  # [D, 1, 1, Lmax] in the model dtype, added to the scores:
    # 0 where attended, -inf past a decode's length; None when every decode attends to all Lmax
    prefills: list[PrefillSpan]
    # [S] flat indices of the tokens whose next token is sampled, then of the prompt tokens
    # whose logits give a prompt's logprobs (model_runner.py)
    logits_index: torch.Tensor


class ModelConfig:
    """What the forward pass needs from config.json (read through transformers)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoConfig

        hf: Any = AutoConfig.from_pretrained(str(model_dir))
        if hf.model_type not in SUPPORTED:
            raise ValueError(
                f"model type {hf.model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
            )
        self.hf = hf
        self.num_layers: int = hf.num_hidden_layers
        self.hidden: int = hf.hidden_size
        self.num_heads: int = hf.num_attention_heads
        self.num_kv_heads: int = getattr(hf, "num_key_value_heads", None) or self.num_heads
        self.head_dim: int = getattr(hf, "head_dim", None) or self.hidden // self.num_heads
        self.vocab_size: int = hf.vocab_size
        self.eps: float = hf.rms_norm_eps
        self.tied: bool = bool(getattr(hf, "tie_word_embeddings", False))
        self.max_len: int = hf.max_position_embeddings
        if getattr(hf, "sliding_window", None) and getattr(hf, "use_sliding_window", True):
            self.max_len = min(self.max_len, hf.sliding_window)  # no sliding attention here
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"activation {hf.hidden_act!r} is not supported (only silu)")
        self.eos_token_ids = eos_token_ids(getattr(hf, "eos_token_id", None))


def rope_tables(
    config: ModelConfig, max_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_len, head_dim] in float32, as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = config.hf
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        dim = config.head_dim
        inv_freq = 1.0 / (
            base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
        )
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, device)
    positions = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def load_weights(
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor, Projection, list[LayerWeights]]:
    """(embedding, final norm, lm_head, layers) from the directory's safetensors files, in
    `dtype`; projections run by `kernel` (one of `KERNELS`)."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    raw: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                raw[name] = f.get_tensor(name)

    def take(name: str) -> torch.Tensor:
        try:
            return raw.pop(name).to(device=device, dtype=dtype)
        except KeyError:
            raise ValueError(f"weight {name!r} is missing from {model_dir}") from None

    def maybe(name: str) -> torch.Tensor | None:
        return take(name) if name in raw else None

    def proj(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Projection:
        return Projection(weight, bias, kernel)

    embed = take("model.embed_tokens.weight")
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        biases = [b for x in "qkv" if (b := maybe(a + f"{x}_proj.bias")) is not None]
        layers.append(
            LayerWeights(
                in_norm=take(p + "input_layernorm.weight"),
                qkv=proj(
                    torch.cat([take(a + f"{x}_proj.weight") for x in "qkv"]),
                    torch.cat(biases) if len(biases) == 3 else None,
                ),
                o=proj(take(a + "o_proj.weight")),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=proj(
                    torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
                ),
                down=proj(take(p + "mlp.down_proj.weight")),
            )
        )
    norm = take("model.norm.weight")
    lm_head = embed if config.tied or "lm_head.weight" not in raw else take("lm_head.weight")
    return embed, norm, proj(lm_head), layers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalize in float32, cast back, then scale.

    - `F.rms_norm` computes a half-precision input in float32 and rounds once, so it equals
      HF's explicit round trip bit for bit, without its two casts.
    """
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin`, bit for bit, with one kernel fewer.

    - `rotate_half(x)` is `x` rolled by half its last dimension with the first half negated;
      `signed_sin` carries that sign (see `LlamaModel.__init__`), and negation is exact.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class LlamaModel:
    def __init__(
        self,
        model_dir: Path,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_len: int,
        kernel: str = "native",
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.embed, self.norm, self.lm_head, self.layers = load_weights(
            model_dir, self.config, dtype, device, kernel
        )
        cos, sin = rope_tables(self.config, max_len, device)
        sin[:, : self.config.head_dim // 2].neg_()  # the sign rotate_half gives; see `rope`
        self.cos, self.signed_sin = cos.to(dtype), sin.to(dtype)
        self.scale = self.config.head_dim**-0.5
        # Decode attention on SDPA where the CPU has AMX: PyTorch's CPU flash attention runs its
        # bfloat16 products on AMX tiles there (1.8x faster than the float32 matmuls for 64
        # decodes of 96 tokens). On an AVX-512 CPU without AMX it measured 3-6x slower at short
        # contexts; elsewhere (no AMX, CUDA) the float32 matmuls stay.
        self.decode_on_sdpa = device.type == "cpu" and amx_available()
        self._kv_row_offsets: dict[int, torch.Tensor] = {}  # by block size: `write_rows`

    def kv_bytes_per_block(self, block_size: int) -> int:
        c = self.config
        return (
            c.num_layers
            * 2
            * block_size
            * c.num_kv_heads
            * c.head_dim
            * torch.finfo(self.dtype).bits
            // 8
        )

    def allocate_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        c = self.config
        return torch.zeros(
            num_blocks,
            c.num_layers,
            2,
            block_size,
            c.num_kv_heads,
            c.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def write_rows(self, batch: StepBatch, cache: torch.Tensor) -> torch.Tensor:
        """Cache row of each token's K (then V) in every layer: [layers, 2, T].
        - The offsets of each layer's K and V rows are made once per block size, not in each
          step (small tensors made in a step are a share of a single decode's time)."""
        block_size = cache.shape[3]
        offsets = self._kv_row_offsets.get(block_size)
        if offsets is None:
            layers = torch.arange(self.config.num_layers, device=self.device) * (2 * block_size)
            k_or_v = torch.tensor([0, block_size], device=self.device)
            offsets = (layers[:, None] + k_or_v[None, :])[:, :, None]
            self._kv_row_offsets[block_size] = offsets
        return batch.write_rows + offsets

    @torch.inference_mode()
    def forward(
        self,
        batch: StepBatch,
        cache: torch.Tensor,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits [S, vocab] (float32) at `batch.logits_index`; writes the step's K/V, and calls
        `on_layer(i)` once layer i's are in the cache (queued, on a GPU), before layer i + 1."""
        c = self.config
        rows = cache.view(-1, c.num_kv_heads, c.head_dim)
        nh, nqk = c.num_heads, c.num_heads + c.num_kv_heads
        t = batch.token_ids.shape[0]
        cos = self.cos[batch.positions].unsqueeze(1)
        sin = self.signed_sin[batch.positions].unsqueeze(1)
        write = self.write_rows(batch, cache)
        h = self.embed[batch.token_ids]
        for i, w in enumerate(self.layers):
            x = rms_norm(h, w.in_norm, c.eps)
            heads = w.qkv(x).view(t, nqk + c.num_kv_heads, c.head_dim)
            qk = heads[:, :nqk]
            qk = rope(qk, cos, sin)  # on q and k at once
            q, k, v = qk[:, :nh], qk[:, nh:], heads[:, nqk:]
            rows.index_copy_(0, write[i, 0], k)
            rows.index_copy_(0, write[i, 1], v)
            if on_layer is not None:
                on_layer(i)
            attn = self._attention(batch, q, k, v, cache, i)
            h = h + w.o(attn)
            x = rms_norm(h, w.post_norm, c.eps)
            gate, up = w.gate_up(x).chunk(2, dim=-1)
            h = h + w.down(F.silu(gate) * up)
        h = rms_norm(h[batch.logits_index], self.norm, c.eps)
        return self.lm_head(h).float()

    def _decode_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """One query per sequence against its gathered context: [D, heads, dim].

        - q [D, heads, dim]; k and v [D, L, kv_heads, dim]; mask [D, 1, 1, L] added to the
          scores, or None.
        - On SDPA where `decode_on_sdpa` (see `__init__`), else in float32 batched matmuls.
        """
        if self.decode_on_sdpa:
            return self._decode_sdpa(q, k, v, mask)
        return self._decode_matmuls(q, k, v, mask)

    def _decode_sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """SDPA takes K and V as gathered (a transposed view: no copy) and the query heads of a
        KV head by themselves (`enable_gqa`): no float32 or repeated copies of the context."""
        c = self.config
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.view(q.shape[0], c.num_heads, c.head_dim)

    def _decode_matmuls(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """K and V become [2, D, kv_heads, L, dim] in float32 in one copy each, converted and
        transposed at once: the batched matmuls then take each as it is, with no copy."""
        c = self.config
        d, group, length = q.shape[0], c.num_heads // c.num_kv_heads, k.shape[1]
        qf = q.view(d, c.num_kv_heads, group, c.head_dim).float()
        shape = (2, d, c.num_kv_heads, length, c.head_dim)
        kvf = torch.empty(shape, dtype=torch.float32, device=q.device)
        kvf[0].copy_(k.transpose(1, 2))
        kvf[1].copy_(v.transpose(1, 2))
        scores = torch.matmul(qf, kvf[0].transpose(2, 3)).mul_(self.scale)
        if mask is not None:
            scores.add_(mask)
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, kvf[1])  # [D, kv_heads, group, dim]
        return out.reshape(d, c.num_heads, c.head_dim).to(q.dtype)

    def _decodes_per_group(self, batch: StepBatch, cache: torch.Tensor) -> int:
        """How many decodes' gathered K and V fit in `DECODE_GROUP_BYTES` (at least one)."""
        if batch.decode_blocks is None:
            return 1
        context_bytes = batch.decode_blocks.shape[1] * cache[0, 0].nbytes
        return max(1, DECODE_GROUP_BYTES // context_bytes)

    def _decode_group(
        self,
        batch: StepBatch,
        q: torch.Tensor,
        cache: torch.Tensor,
        layer: int,
        start: int,
        end: int,
    ) -> torch.Tensor:
        """Attention [end - start, heads, dim] of decodes start..end, their K and V gathered a
        block at a time (a block's K, or V, of one layer is one contiguous piece)."""
        assert batch.decode_blocks is not None
        blocks = batch.decode_blocks[start:end]
        k, v = self._gather(cache, layer, blocks, batch.decode_len)
        mask = None if batch.decode_mask is None else batch.decode_mask[start:end]
        return self._decode_attention(q[start:end], k, v, mask)

    def _gather(
        self, cache: torch.Tensor, layer: int, blocks: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [N, length, kv_heads, dim] in `layer` of the contexts in blocks [N, W]: a
        block at a time (a block's K, or V, of one layer is one contiguous piece of the cache),
        the tail past `length` sliced off."""
        c = self.config
        pieces = cache.view(cache.shape[0], c.num_layers, 2, -1)[:, layer]
        k, v = (
            pieces[:, i]
            .index_select(0, blocks.flatten())
            .view(blocks.shape[0], -1, c.num_kv_heads, c.head_dim)[:, :length]
            for i in (0, 1)
        )
        return k, v

    def _attention(
        self,
        batch: StepBatch,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        layer: int,
    ) -> torch.Tensor:
        """[T, heads * dim]: each decode against its context, then each prefill span.

        - Decodes are taken in groups whose gathered context is at most `DECODE_GROUP_BYTES`.
          Each group's copies then stay in the CPU's cache and in memory that malloc keeps (see
          host_allocator.py), where one gather of a long batch faulted in fresh pages every
          layer. A group's answer equals the whole batch's bit for bit.
        - A step of decodes in one group returns their attention itself, with no copy.
        """
        d = batch.num_decodes
        per = self._decodes_per_group(batch, cache)
        if d and d <= per and not batch.prefills:
            return self._decode_group(batch, q, cache, layer, 0, d).view(d, -1)
        out = torch.empty_like(q)
        for start in range(0, d, per):
            end = min(d, start + per)
            out[start:end] = self._decode_group(batch, q, cache, layer, start, end)
        for span in batch.prefills:
            qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)
            n = span.end - span.start
            if span.context_blocks is None:  # the whole context is this chunk
                ks = k[span.start : span.end].transpose(0, 1).unsqueeze(0)
                vs = v[span.start : span.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True
                )
            else:
                ks, vs = self._gather(cache, layer, span.context_blocks, span.context_len)
                ks, vs = ks.transpose(1, 2), vs.transpose(1, 2)
                prefix = span.context_len - n
                mask = torch.ones(n, span.context_len, dtype=torch.bool, device=q.device).tril(
                    diagonal=prefix
                )
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=True
                )
            out[span.start : span.end] = o.squeeze(0).transpose(0, 1)
        return out.view(q.shape[0], -1)
