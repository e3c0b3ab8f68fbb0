"""A step that decodes one sequence alone, compiled whole ahead of time (`EngineConfig.compile`):
one call instead of about 45 operator calls a layer, the norms, RoPE and the decode attention
fused by Inductor, the projections on its own GEMM kernels (autotuned once against ATen's; the
weights frozen into the compiled graph). Every other step runs eagerly (`LlamaModel.forward`).

- `export_package` builds the graph with AOTInductor into a package: the shared library of its
  archive (its kernels and constants in one file; minutes on a few cores). `CompiledDecode`
  loads it where it lies in a second, its constants copied into the process: no copy of the
  library on disk per process (AOTInductor's archive loader extracts it to a temporary
  directory, which a killed process leaves behind).
  decode_package.py decides where packages live and builds them in a process of their own.
- The eager forward's inputs and outputs: logits [1, vocab] in float32 for the one decode; the
  step's K and V are in the cache when the step returns. The logits are close to the eager
  ones, not equal bit for bit (other kernels sum in another order).
- The context's length and the cache's block count are dynamic dimensions: one package serves
  every length and every cache of the model's block shape.
- The graph only reads the cache: it returns the token's K and V of every layer, written after
  it in one `index_copy_` (written inside, functionalization copies the whole cache every step;
  an opaque custom op per layer cost 19 us a call in Python dispatch). Each layer's attention
  takes the cached context and the token's own K and V appended.
- Attention reads whole blocks (a block's K, or V, of one layer is contiguous) and masks the
  positions past the length. It is written as products and sums, not matmuls: Inductor fuses
  the gather, the float32 conversion, both reductions and the softmax into its own loops (a
  layer at 128 tokens: 12 us, where two batched matmuls on float32 copies took 52).
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F

from kvbaton.engine.model import LlamaModel, Projection, StepBatch, rms_norm, rope

INDUCTOR_OPTIONS = {
    "freezing": True,  # the weights are constants of the graph (packed once for its GEMMs)
    "max_autotune": True,  # its GEMM templates, timed against ATen's at compile time
    "max_autotune_gemm_backends": "CPP,ATEN",
}
PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a layer's, by their `LayerWeights` names
EXAMPLE_BLOCKS = 4  # the cache's block count the graph is exported with (dynamic)


class _DecodeGraph(torch.nn.Module):
    """The forward pass of one decode, as a module whose parameters are the model's weights
    (freezing makes them constants).

    - Each projection's weight is in the package once: packed where Inductor's GEMM template
      runs it, else as given. Inductor drops the given copy only where the GEMM reads the
      constant itself (not a view: no `F.linear`) under an attribute path without a dot (no
      `ParameterList`), hence flat parameters stored transposed ([in, out], contiguous).
    - The model's projections give their weights up to the graph (the build holds each once).
    """

    def __init__(self, model: LlamaModel) -> None:
        super().__init__()
        self.model = model  # for its config and scale only: no tensor is read through it

        def param(t: torch.Tensor) -> torch.nn.Parameter:
            return torch.nn.Parameter(t, requires_grad=False)

        def weight(p: Projection) -> torch.nn.Parameter:
            assert p.weight is not None  # a projection of the "native" kernel keeps its weight
            transposed, p.weight = p.weight.t().contiguous(), None
            return param(transposed)

        for i, w in enumerate(model.layers):
            self.register_parameter(f"in_norm_{i}", param(w.in_norm))
            self.register_parameter(f"post_norm_{i}", param(w.post_norm))
            for name in PROJECTIONS:
                self.register_parameter(f"{name}_{i}", weight(getattr(w, name)))
            if w.qkv.bias is not None:
                self.register_parameter(f"qkv_bias_{i}", param(w.qkv.bias))
        self.embed = param(model.embed)
        self.norm = param(model.norm)
        self.lm_head = weight(model.lm_head)
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
            in_norm, post_norm, qkv, o, gate_up, down = (
                getattr(self, f"{name}_{i}") for name in ("in_norm", "post_norm", *PROJECTIONS)
            )
            heads = rms_norm(h, in_norm, c.eps) @ qkv
            if (bias := getattr(self, f"qkv_bias_{i}", None)) is not None:
                heads = heads + bias
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
            h = h + attn @ o
            gate, up = (rms_norm(h, post_norm, c.eps) @ gate_up).chunk(2, dim=-1)
            h = h + (F.silu(gate) * up) @ down
        logits = (rms_norm(h, self.norm, c.eps) @ self.lm_head).float()
        return logits, torch.stack(written)


def export_package(model: LlamaModel, block_size: int, path: Path) -> None:
    """Build `model`'s single-decode graph for caches of `block_size` into a package at `path`
    (minutes on a few cores; its archive beside it meanwhile, `path` with the suffix ".pt2").

    - `model` runs the "native" kernel (its projections keep their weights) on the CPU, with RoPE
      tables for the model's every position; it cannot run after (its projections' weights
      are the graph's).
    """
    c = model.config
    cache = model.allocate_cache(EXAMPLE_BLOCKS, block_size)
    example = (
        torch.zeros(1, dtype=torch.long),
        torch.tensor([block_size]),
        torch.tensor([[0, 1]]),
        torch.tensor(block_size + 1),
        cache,
    )
    context_blocks = torch.export.Dim("context_blocks", min=2, max=c.max_len // block_size + 2)
    cache_blocks = torch.export.Dim("cache_blocks", min=2)
    with torch.inference_mode():
        program = torch.export.export(
            _DecodeGraph(model).eval(),
            example,
            dynamic_shapes=(None, None, {1: context_blocks}, None, {0: cache_blocks}),
        )
    archive = path.with_suffix(".pt2")
    try:
        torch._inductor.aoti_compile_and_package(
            program, package_path=str(archive), inductor_configs=INDUCTOR_OPTIONS
        )
        with zipfile.ZipFile(archive) as members:
            library = _library_alone(members.namelist())
            with members.open(library) as source, path.open("wb") as target:
                shutil.copyfileobj(source, target)
    finally:
        archive.unlink(missing_ok=True)


def _library_alone(members: list[str]) -> str:
    """The archive's shared library, where the graph needs nothing else of the archive to run:
    its other files are the generated sources and their metadata (an op that needs AOTInductor's
    proxy executor, or weights kept outside the library, would add files it reads)."""
    files = [m for m in members if "/data/" in f"/{m}"]  # (under the archive's own folder)
    libraries = [m for m in files if m.endswith(".so")]
    needed = [m for m in files if not m.endswith((".so", ".cpp", "_metadata.json"))]
    if len(libraries) != 1 or needed:
        found = ", ".join(libraries + needed) or "no library"
        raise RuntimeError(f"the compiled graph needs more of its archive than a library: {found}")
    return libraries[0]


class CompiledDecode:
    """A package of `export_package`, loaded: runs the steps it `takes` for `model`."""

    def __init__(self, model: LlamaModel, path: Path) -> None:
        self.model = model
        self.path = path
        self.steps = 0  # steps run compiled
        self._graph = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)

    @staticmethod
    def takes(batch: StepBatch) -> bool:
        """Whether `batch` is a step this runs: one decode, nothing else, its context over one
        block (the graph's context is at least two blocks)."""
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
        length = torch.tensor(batch.decode_len)
        inputs = [batch.token_ids, batch.positions, batch.decode_blocks, length, cache]
        logits, written = self._graph.run(inputs)
        c = self.model.config
        rows = cache.view(-1, c.num_kv_heads, c.head_dim)
        rows.index_copy_(0, self.model.write_rows(batch, cache).flatten(), written.flatten(0, 1))
        self.steps += 1
        return logits
