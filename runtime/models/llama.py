"""The decoder for the Llama family (Llama 2/3.x, SmolLM2, Mistral), Qwen2/2.5 and Qwen3.

Only the model lives here; its norms and rotary embedding are in norm_rope.py. Differences between
families are `ModelSpec` flags: qkv bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied embeddings.
q/k/v and gate/up are fused into one matmul each; `load_weights` maps the checkpoint's separate
tensors onto the fused parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_decode_layer, cpu_fused_ops
from pdserve.runtime.attention import AttentionBackend
from pdserve.runtime.batch import ForwardBatch
from pdserve.runtime.kv_pool import KVPool
from pdserve.runtime.model_config import ModelSpec
from pdserve.runtime.models.norm_rope import RMSNorm, Rotary, cpu_fused, fused_kernels
from pdserve.runtime.tp_group import TPGroup

# checkpoint name fragment -> (fused parameter fragment, shard index)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.nq, self.nkv, self.hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, (self.nq + 2 * self.nkv) * self.hd, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.nq * self.hd, spec.hidden_size, bias=False)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.hd, spec.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, spec.rms_norm_eps)
        self.scale = self.hd**-0.5
        self.fused_fp32 = False  # set by runtime/quant.py on a quantized model (norm_rope.cpu_fused)
        self.tp: TPGroup | None = None  # a tensor-parallel rank's: o_proj's partial sums are all-reduced

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: Rotary,
        backend: AttentionBackend,
        pool: KVPool,
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (nq + 2 nkv) * hd]
        q, k, v = qkv.split([self.nq * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q = q.view(T, self.nq, self.hd)
        k = k.view(T, self.nkv, self.hd)
        v = v.view(T, self.nkv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qk_norm or fused_kernels(x.device):
            q, k = rotary(positions, q, k)
        elif cpu_fused(x, self.fused_fp32):
            # q and k lie side by side in qkv, a fresh tensor: one rotation in place covers both
            rotary.rotate_(positions, qkv[:, : (self.nq + self.nkv) * self.hd].view(T, -1, self.hd))
        else:
            # q and k lie side by side in qkv: one rotation covers both heads' sets
            qk = rotary.rotate(positions, qkv[:, : (self.nq + self.nkv) * self.hd].view(T, -1, self.hd))
            q, k = qk[:, : self.nq], qk[:, self.nq :]
        out = backend.forward(q, k, v, self.layer_id, pool, self.scale)  # [T, nq, hd]
        y: torch.Tensor = self.o_proj(out.reshape(T, self.nq * self.hd))  # [T, hidden]
        if self.tp is not None:
            self.tp.all_reduce(y)
        return y


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.fused_fp32 = False  # set by runtime/quant.py on a quantized model (norm_rope.cpu_fused)
        self.tp: TPGroup | None = None  # a tensor-parallel rank's: down_proj's partial sums are all-reduced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if cpu_fused(gate_up, self.fused_fp32):
            y: torch.Tensor = self.down_proj(cpu_fused_ops.silu_and_mul(gate_up))
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            y = self.down_proj(F.silu(gate) * up)
        if self.tp is not None:
            self.tp.all_reduce(y)
        return y


def decode_projection(m: nn.Module) -> tuple[list[torch.Tensor], torch.Tensor | None] | None:
    """A projection as `cpu_decode_layer` takes it, with its bias: [weight] for a plain linear, what a
    quantized module offers (`decode_weights`, runtime/quant.py), None for any other."""
    if type(m) is nn.Linear:
        return [m.weight], m.bias
    offer = getattr(m, "decode_weights", None)
    return offer() if offer is not None else None


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_id)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)
        self._decode_weights: list[cpu_decode_layer.LayerWeights | None] = []  # [] until built

    def decode_weights(self) -> cpu_decode_layer.LayerWeights | None:
        """The layer's tensors for the one-call CPU decode layer (kernels/cpu_decode_layer.py), or None
        where that cannot run it: a q/k norm, a projection of another kind, a bias outside qkv. Built at
        the first decode step (after quantization); live weight updates copy into the same tensors."""
        if not self._decode_weights:
            self._decode_weights.append(self._build_decode_weights())
        return self._decode_weights[0]

    def _build_decode_weights(self) -> cpu_decode_layer.LayerWeights | None:
        attn, mlp = self.self_attn, self.mlp
        if attn.tp is not None:
            return None  # the one-call layer has no all-reduce inside: a TP rank runs the eager layer
        modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        found = [decode_projection(m) for m in modules]
        projections = [p for p in found if p is not None]
        if attn.qk_norm or len(projections) < len(found):
            return None
        (qkv, qkv_bias), (o, o_bias), (gate_up, gu_bias), (down, down_bias) = projections
        if o_bias is not None or gu_bias is not None or down_bias is not None:
            return None
        dense_min_rows = max(int(getattr(m, "dense_min_rows", 0)) for m in modules)
        if len({bool(getattr(m, "act8", False)) for m in modules if hasattr(m, "packed")}) > 1:
            return None  # int8 and float activations mixed in one layer: the eager layer
        return cpu_decode_layer.LayerWeights(
            self.input_layernorm.weight,
            self.post_attention_layernorm.weight,
            self.input_layernorm.eps,
            qkv,
            qkv_bias,
            o,
            gate_up,
            down,
            dense_min_rows,
            attn.nq,
            attn.nkv,
            attn.hd,
            attn.scale,
            act8=any(bool(getattr(m, "act8", False)) for m in modules),
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: Rotary,
        backend: AttentionBackend,
        pool: KVPool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream kept apart (vLLM's form): the layer's input is x + residual (x alone for
        the first layer); returns (its MLP output, the stream that output adds to). Each add is the
        next norm's fused `add`, with the same values as `h = h + f(norm(h))` twice."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h = self.self_attn(h, positions, rotary, backend, pool)
        h, residual = self.post_attention_layernorm.add(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        # nn.Embedding, or a quantized model's PackedInt8Embedding (runtime/quant.py). Built around an empty
        # table (the checkpoint fills it): nn.Embedding's own init (`init.normal_`) imports torch._dynamo even
        # on the meta device, and with it triton and sympy, ~100 MB of every worker's memory.
        table = torch.empty(spec.vocab_size, spec.hidden_size)
        self.embed_tokens: nn.Module = nn.Embedding(spec.vocab_size, spec.hidden_size, _weight=table)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


def lm_head_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits [N, vocab] in float32 of hidden states x [N, hidden] and the head weight [vocab, hidden].

    On CPU in fp32 with up to 128 rows, the CPU BLAS runs this skinny product 1.1-2.5x faster as
    weight @ x^T (vocab as the long side) than as x @ weight^T: measured on the bundled model's head
    (49152 x 576, 2 threads), 26 -> 19 ms at 32 rows, 17 -> 7 ms at 4 rows, equal at 1, slower from 256.
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[0] <= 128:
        return torch.mm(weight, x.t()).t().contiguous()
    return F.linear(x, weight).float()


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: Rotary):
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec)
        self.rotary = rotary
        if spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        # Set by runtime/quant.py under --quantization: the head's quantized matmul, and the C++ fused
        # ops and one-call decode layer in fp32 too (norm_rope.cpu_fused).
        self.lm_head_quant: nn.Module | None = None
        self.fused_fp32 = False
        self.tp: TPGroup | None = None  # set by `join_group` on a tensor-parallel rank

    def join_group(self, group: TPGroup) -> None:
        """A TP rank's model (its weights cut by runtime/tp_layout.py) joins its worker's group: each
        block all-reduces its row-parallel outputs, the embedding and the head are vocabulary-parallel."""
        self.tp = group
        for layer in cast("list[DecoderLayer]", self.model.layers):
            layer.self_attn.tp = group
            layer.mlp.tp = group

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, hidden]; on a TP rank, its rows of the vocabulary, zeros for the others'."""
        if self.tp is None:
            x: torch.Tensor = self.model.embed_tokens(input_ids)
            return x
        rows = self.tp.layout.vocab_rows(self.tp.rank)
        local = input_ids - rows.start
        mine = (local >= 0) & (local < len(rows))
        x = self.model.embed_tokens(torch.where(mine, local, 0))
        x = x * mine.unsqueeze(-1).to(x.dtype)
        self.tp.all_reduce(x)
        return x

    @property
    def lm_head_weight(self) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        pool: KVPool,
        backend: AttentionBackend,
        between_layers: Callable[[], object] | None = None,
    ) -> torch.Tensor:
        """Returns logits [len(batch.logits_indices), vocab] in float32; `between_layers` is called
        after each layer but the last (a long forward offering its turn at the cores)."""
        backend.prepare(batch, pool)
        return self.run(batch.input_ids, batch.positions, batch.logits_indices, pool, backend, between_layers)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor | None,
        pool: KVPool,
        backend: AttentionBackend,
        between_layers: Callable[[], object] | None = None,
    ) -> torch.Tensor:
        """The layers and the head over a prepared backend: logits [N, vocab] in float32 at the rows
        `logits_indices` of the new tokens (None: every row). Also the body of the compiled decode step
        (runtime/compiled_decode.py), which traces it with its own backend."""
        x = self.embed(input_ids)  # [T, hidden]
        self.rotary.prepare(positions, x.dtype)
        residual: torch.Tensor | None = None
        # A CPU decode batch in bf16 / fp16, or in fp32 of a quantized model (CpuAttention.decode_args):
        # each layer as one operator call where it can be
        decode_args: Callable[[int, KVPool], cpu_decode_layer.DecodeAttention | None] | None = (
            getattr(backend, "decode_args", None) if cpu_fused(x, self.fused_fp32) else None
        )
        cos, sin_signed = self.rotary.cos, self.rotary.sin_signed
        layers = cast("list[DecoderLayer]", self.model.layers)
        for i, layer in enumerate(layers):
            if between_layers is not None and i > 0:
                between_layers()
            weights = layer.decode_weights() if decode_args is not None else None
            attn = None if weights is None or decode_args is None else decode_args(layer.layer_id, pool)
            if weights is not None and attn is not None:
                x, residual = cpu_decode_layer.decode_layer(
                    x, residual, weights, positions, cos, sin_signed, attn
                )
            else:
                x, residual = layer(x, residual, positions, self.rotary, backend, pool)
        assert residual is not None  # a model has layers
        if logits_indices is not None:
            x, residual = x[logits_indices], residual[logits_indices]
        x, _ = self.model.norm.add(x, residual)  # [N, hidden]
        if self.lm_head_quant is not None:
            logits: torch.Tensor = self.lm_head_quant(x).float()
        else:
            logits = lm_head_logits(x, self.lm_head_weight)
        if self.tp is not None:  # each rank's rows of the vocabulary, padding cut off the last
            logits = self.tp.all_gather_columns(logits)[:, : self.spec.vocab_size]
        return logits

    def _fused_sizes(self) -> dict[str, list[int]]:
        """The rows of each part of the fused parameters, as this model holds them (a tensor-parallel
        rank: its own heads and MLP width, runtime/tp_layout.py)."""
        first = cast("DecoderLayer", self.model.layers[0])
        attn, hd = first.self_attn, first.self_attn.hd
        return {
            "qkv_proj": [attn.nq * hd, attn.nkv * hd, attn.nkv * hd],
            "gate_up_proj": [first.mlp.gate_up_proj.weight.shape[0] // 2] * 2,
        }

    def weight_target(self, name: str) -> tuple[str, slice | None] | None:
        """Where checkpoint tensor `name` (an HF name; a TP rank's cut of it) goes: the parameter and,
        for a fused one, its rows; None for a tensor the model does not store (rotary tables, a tied
        head)."""
        if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
            return None
        for frag, (fused, idx) in _STACKED.items():
            if frag in name:
                part = self._fused_sizes()[fused.strip(".")]
                start = sum(part[:idx])
                return name.replace(frag, fused), slice(start, start + part[idx])
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the fused parameters; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        sizes = self._fused_sizes()
        for name, tensor in weights:
            where = self.weight_target(name)
            if where is None:
                continue
            target, rows = where
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {self.spec.architecture}")
            param = params[target]
            with torch.no_grad():
                if rows is None:
                    if param.shape != tensor.shape:
                        raise ValueError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}"
                        )
                    param.copy_(tensor)
                    loaded.add(target)
                else:
                    param[rows].copy_(tensor)
                    loaded.add(f"{target}#{rows.start}")
        missing = []
        for pname in params:
            fused = pname.split(".")[-2] if pname.count(".") >= 1 else ""
            if fused in sizes:
                starts = [sum(sizes[fused][:i]) for i in range(len(sizes[fused]))]
                missing += [f"{pname}#{i}" for i, st in enumerate(starts) if f"{pname}#{st}" not in loaded]
            elif pname not in loaded:
                missing.append(pname)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
