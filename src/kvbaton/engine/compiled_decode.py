"""A step that decodes one sequence alone, compiled whole by torch.compile (`EngineConfig.compile`
"single-decode"): one call instead of about 45 operator calls a layer, the norms, RoPE and the
decode attention fused by Inductor, the projections on its own GEMM kernels (autotuned once
against ATen's; the weights frozen into the compiled graph). Every other step runs eagerly
(`LlamaModel.forward`).

- The eager forward's inputs and outputs: logits [1, vocab] in float32 for the one decode; the
  step's K and V are in the cache when the step returns. The logits are close to the eager
  ones, not equal bit for bit (other kernels sum in another order).
- The context's length is a dynamic dimension: one compile serves every length; the cache's
  shape is fixed, so a cache of another shape compiles again.
- The graph only reads the cache: it returns the token's K and V of every layer, written after
  it in one `index_copy_` (written inside, functionalization copies the whole cache every step;
  an opaque custom op per layer cost 19 us a call in Python dispatch). Each layer's attention
  takes the cached context and the token's own K and V appended.
- Attention reads whole blocks (a block's K, or V, of one layer is contiguous) and masks the
  positions past the length. It is written as products and sums, not matmuls: Inductor fuses
  the gather, the float32 conversion, both reductions and the softmax into its own loops (a
  layer at 128 tokens: 12 us, where two batched matmuls on float32 copies took 52).
- Compiling takes minutes on a few cores (a `warm_up` before serving); Inductor's on-disk caches
  make a restart faster. Inductor builds its kernels with a C++ compiler: without one, the
  engine is refused when it is made, not at its first step.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from kvbaton.engine.model import LlamaModel, StepBatch, rms_norm, rope

log = logging.getLogger(__name__)

COMPILE_OPTIONS = {
    "freezing": True,  # the weights are constants of the graph (packed once for its GEMMs)
    "max_autotune": True,  # its GEMM templates, timed against ATen's at compile time
    "max_autotune_gemm_backends": "CPP,ATEN",
}


class _DecodeGraph(torch.nn.Module):
    """The forward pass of one decode, as a module whose parameters are the model's weights
    (freezing makes them constants)."""

    def __init__(self, model: LlamaModel) -> None:
        super().__init__()
        self.model = model  # for its config and scale only: no tensor is read through it

        def param(t: torch.Tensor | None) -> torch.nn.Parameter:
            assert t is not None  # a projection's weight is kept for this (`keep_weights`)
            return torch.nn.Parameter(t, requires_grad=False)

        self.weights = torch.nn.ParameterList()
        for w in model.layers:
            projections = (w.qkv, w.o, w.gate_up, w.down)
            for t in (w.in_norm, w.post_norm, *(p.weight for p in projections)):
                self.weights.append(param(t))
        biased = model.layers[0].qkv.bias is not None
        self.biases = torch.nn.ParameterList(
            [param(w.qkv.bias) for w in model.layers] if biased else []
        )
        self.embed = param(model.embed)
        self.norm = param(model.norm)
        self.lm_head = param(model.lm_head.weight)
        self.cos = param(model.cos)
        self.sin = param(model.signed_sin)

    def forward(
        self,
        token_ids: torch.Tensor,  # [1]
        positions: torch.Tensor,  # [1]
        blocks: torch.Tensor,  # [1, W]: the context's blocks
        length: torch.Tensor,  # []: the context's length, this token's included
        cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [1, vocab] in float32, the token's K and V [layers, 2, kv heads, dim])."""
        c = self.model.config
        nh, nkv, dim = c.num_heads, c.num_kv_heads, c.head_dim
        cached = blocks.shape[1] * cache.shape[3]  # positions gathered; the token's K/V after
        index = torch.arange(cached + 1)
        attended = (index < length - 1) | (index == cached)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        h = self.embed[token_ids]
        written = []
        for i in range(c.num_layers):
            in_norm, post_norm, qkv, o, gate_up, down = (self.weights[6 * i + j] for j in range(6))
            bias = self.biases[i] if len(self.biases) else None
            heads = F.linear(rms_norm(h, in_norm, c.eps), qkv, bias)
            heads = heads.view(1, nh + 2 * nkv, dim)
            qk = rope(heads[:, : nh + nkv], cos, sin)
            q, k, v = qk[:, :nh], qk[:, nh:], heads[:, nh + nkv :]
            written.append(torch.cat([k, v]))
            context = cache[:, i].index_select(0, blocks.flatten())  # [W, 2, block, kv, dim]
            keys = torch.cat([context[:, 0].reshape(-1, nkv, dim), k]).transpose(0, 1)[:, None]
            values = torch.cat([context[:, 1].reshape(-1, nkv, dim), v]).transpose(0, 1)[:, None]
            query = q.view(nkv, nh // nkv, 1, dim).float()
            scores = (query * keys.float()).sum(-1) * self.model.scale  # [kv, group, W*block+1]
            probs = torch.softmax(scores.masked_fill(~attended, float("-inf")), dim=-1)
            attn = (probs[..., None] * values.float()).sum(2).reshape(1, -1).to(h.dtype)
            h = h + F.linear(attn, o)
            gate, up = F.linear(rms_norm(h, post_norm, c.eps), gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, down)
        logits = F.linear(rms_norm(h, self.norm, c.eps), self.lm_head).float()
        return logits, torch.stack(written)


class CompiledDecode:
    """`model`'s forward pass of a single-decode step, compiled (see the module's docstring)."""

    def __init__(self, model: LlamaModel) -> None:
        if model.device.type != "cpu":
            raise ValueError("compile 'single-decode' runs on a CPU only")
        # imported here: an engine that compiles nothing starts without torch's compiler
        from torch._inductor import cpp_builder
        from torch._inductor.exc import InvalidCxxCompiler

        try:
            cpp_builder.get_cpp_compiler()
        except InvalidCxxCompiler:
            raise ValueError(
                "compile 'single-decode' needs a C++ compiler (g++, or the one $CXX names)"
            ) from None
        self.model = model
        self.steps = 0  # steps run compiled (the warm-up's included)
        self._graph = torch.compile(_DecodeGraph(model).eval())

    @staticmethod
    def takes(batch: StepBatch) -> bool:
        """Whether `batch` is a step this runs: one decode, nothing else, its context over one
        block (a dynamic dimension of size 1 would be specialised: compiled again)."""
        blocks = batch.decode_blocks
        return (
            batch.num_decodes == 1
            and not batch.prefills
            and blocks is not None
            and blocks.shape[1] > 1
        )

    @torch.inference_mode()
    def __call__(self, batch: StepBatch, cache: torch.Tensor) -> torch.Tensor:
        assert batch.decode_blocks is not None
        torch._dynamo.mark_dynamic(batch.decode_blocks, 1)
        length = torch.tensor(batch.decode_len)
        # Patched around each call, as a compile may come with any (torch.compile's `options`
        # leave freezing off, measured: the graph then ran 2.4x slower).
        with torch._inductor.config.patch(COMPILE_OPTIONS):
            logits: torch.Tensor
            written: torch.Tensor
            logits, written = self._graph(
                batch.token_ids, batch.positions, batch.decode_blocks, length, cache
            )
        c = self.model.config
        rows = cache.view(-1, c.num_kv_heads, c.head_dim)
        rows.index_copy_(0, self.model.write_rows(batch, cache).flatten(), written.flatten(0, 1))
        self.steps += 1
        return logits

    def warm_up(self, cache: torch.Tensor) -> None:
        """Compile now, on a decode of two blocks' context in the cache's first blocks (rows no
        sequence reads before it writes them)."""
        log.info("compiling the single-decode step (torch.compile: minutes on a few cores)")
        start = time.monotonic()
        block_size = cache.shape[3]
        block_1 = self.model.config.num_layers * 2 * block_size  # its first row: layer 0's K
        batch = StepBatch(
            token_ids=torch.zeros(1, dtype=torch.long),
            positions=torch.tensor([block_size]),
            write_rows=torch.tensor([block_1]),
            num_decodes=1,
            decode_blocks=torch.tensor([[0, 1]]),
            decode_len=block_size + 1,
            decode_mask=None,
            prefills=[],
            logits_index=torch.zeros(1, dtype=torch.long),
        )
        self(batch, cache)
        log.info("compiled the single-decode step in %.0f s", time.monotonic() - start)
