"""Live weight updates on a worker: new weights are loaded (or received) aside and checked, then swapped in
between two forward steps, never during one.

The gateway drives each update in two phases over every worker (`gateway/cluster/weights.py`):
- `prepare_disk` / `prepare_distributed`: on a background thread, read the checkpoint (or receive the
  trainer's broadcast, `weights_group.py`) into staging tensors of the model's dtype and device, checking
  the architecture and every tensor's name and shape against the running model. Nothing changes yet; the
  loop keeps stepping. A mismatch fails here, on every worker before any swaps.
- `commit`: in the loop, between steps: copy the staged tensors into the parameters, take the new
  version label, and invalidate the prefix cache (its KV was computed by the old weights); `on_commit`
  lets the worker mark the requests it holds (their KV mixes versions: never cached).
- `cancel` drops what was staged. `pause` / `resume` stop and restart forward steps (the loop asks
  `paused`), so that a trainer can update between its steps without aborting anything.
Replies go back as `WeightsReply`: at once, or from `poll` when a background job ends.

A tensor-parallel worker's rank 0 does all of this for its own cut and has the other ranks follow
(runtime/tp_follower.py): they stage their cuts on a side thread when it prepares (from the checkpoint, or
from a file of the trainer's tensors in rank 0's private folder), and at the commit every rank swaps, or,
if any could not stage, none does.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from pdserve.model_source import ModelSourceError, resolve_model_source
from pdserve.protocol import gateway as m
from pdserve.runtime.loader import iter_weights, load_hf_config, model_folder
from pdserve.runtime.model_config import ModelSpec
from pdserve.runtime.models.llama import CausalLM
from pdserve.runtime.radix_cache import RadixCache
from pdserve.runtime.tp_group import CMD_WEIGHTS_CANCEL, CMD_WEIGHTS_COMMIT, CMD_WEIGHTS_STAGE, TPGroup
from pdserve.runtime.tp_layout import TPLayout
from pdserve.runtime.weights_group import WeightsGroup
from pdserve.side_threads import serial_openmp

if TYPE_CHECKING:
    from pdserve.runtime.runner import ModelRunner

log = logging.getLogger(__name__)

# ModelSpec fields that decide the parameters' names and shapes: a checkpoint must agree on all of them.
_SHAPE_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
    "qkv_bias",
    "qk_norm",
)
LOAD_FORMATS = (None, "auto", "safetensors", "gguf")


class WeightUpdateError(ValueError):
    """The new weights do not fit the running model (or cannot be read); nothing was changed."""


Copies = list[tuple[torch.Tensor, slice | None, torch.Tensor]]  # (parameter, rows or None, value)


@dataclass(frozen=True)
class Staged:
    """New values for (rows of) parameters, ready to copy in."""

    op_id: str
    copies: Copies
    seconds: float


def stage(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]], require_all: bool) -> Copies:
    """Check `weights` (HF names) against the model's parameters and convert them to their dtype and
    device; `require_all`: every parameter must be covered (a whole checkpoint)."""
    params = dict(model.named_parameters())
    copies: Copies = []
    covered: dict[str, int] = {}
    for name, tensor in weights:
        target = model.weight_target(name)
        if target is None:
            continue
        pname, rows = target
        if pname not in params:
            raise WeightUpdateError(f"tensor {name!r} has no place in the running model")
        p = params[pname]
        want = tuple(p.shape) if rows is None else (rows.stop - rows.start, *p.shape[1:])
        if tuple(tensor.shape) != want:
            raise WeightUpdateError(
                f"tensor {name!r} has shape {list(tensor.shape)}; the running model's is {list(want)}"
            )
        copies.append((p, rows, tensor.to(device=p.device, dtype=p.dtype)))
        covered[pname] = covered.get(pname, 0) + want[0]
    copies = _assemble_fused(copies)
    if require_all:
        missing = [n for n, p in params.items() if covered.get(n, 0) < p.shape[0]]
        if missing:
            raise WeightUpdateError(
                f"the checkpoint lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}"
            )
    return copies


def _assemble_fused(copies: Copies) -> Copies:
    """Shards that together fill a whole fused parameter (q/k/v, gate/up) become one new tensor, so
    the commit swaps it in instead of copying the rows (done here, off the worker's loop)."""
    shards: dict[int, list[tuple[slice, torch.Tensor]]] = {}
    for p, rows, v in copies:
        if rows is not None:
            shards.setdefault(id(p), []).append((rows, v))
    out: Copies = []
    done: set[int] = set()
    for p, rows, v in copies:
        if rows is None:
            out.append((p, rows, v))
            continue
        parts = sorted(shards[id(p)], key=lambda x: x[0].start)
        whole = [r.start for r, _ in parts] == [0] + [r.stop for r, _ in parts[:-1]] and parts[-1][
            0
        ].stop == p.shape[0]
        if not whole:
            out.append((p, rows, v))
        elif id(p) not in done:
            done.add(id(p))
            full = torch.empty_like(p)
            for r, part in parts:
                full[r] = part
            out.append((p, None, full))
    return out


def apply(copies: Copies) -> None:
    """Put staged values into their parameters (between two forward steps)."""
    with torch.no_grad():
        for param, rows, value in copies:
            if rows is None and value.is_contiguous() and value.stride() == param.stride():
                param.data = value  # the staged tensor becomes the parameter: no copy
            else:
                (param if rows is None else param[rows]).copy_(value)
    if any(p.is_cuda for p, _, _ in copies[:1]):
        torch.cuda.synchronize()


def stage_rank_cut(
    model: CausalLM, spec: ModelSpec, what: dict[str, object], shard: tuple[TPLayout, int, int]
) -> Copies:
    """A TP rank other than 0: its cut of what rank 0 stages (`TPGroup.weights`), from the checkpoint
    or from the file rank 0 wrote of the tensors a trainer broadcast."""
    model_path = what.get("model_path")
    if isinstance(model_path, str):
        load_format = what.get("load_format")
        folder = check_checkpoint(spec, model_path, load_format if isinstance(load_format, str) else None)
    else:
        folder = str(what["folder"])
    return stage(model, iter_weights(folder, shard), require_all=bool(what.get("require_all")))


def check_checkpoint(spec: ModelSpec, model_path: str, load_format: str | None) -> str:
    """The checkpoint folder of `model_path` if its config fits the running model; else WeightUpdateError.
    Reads only the config (a GGUF file is dequantized into the cache first, as at start)."""
    if load_format not in LOAD_FORMATS:
        raise WeightUpdateError(
            f"load_format {load_format!r} is not supported; use auto, safetensors or gguf"
        )
    if not model_path:
        raise WeightUpdateError("model_path is empty")
    try:
        folder = model_folder(resolve_model_source(model_path))
        new = ModelSpec.from_hf_config(load_hf_config(folder))
    except (ModelSourceError, OSError, ValueError) as e:
        raise WeightUpdateError(f"model_path {model_path!r}: {e}") from None
    diff = [
        f.name
        for f in fields(spec)
        if f.name in _SHAPE_FIELDS and getattr(spec, f.name) != getattr(new, f.name)
    ]
    if diff:
        detail = ", ".join(f"{k} {getattr(new, k)!r} (running: {getattr(spec, k)!r})" for k in diff)
        raise WeightUpdateError(f"model_path {model_path!r} is another architecture: {detail}")
    return folder


def parse_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r}")
    return dt


class WeightUpdater:
    """One worker's side of live weight updates (see the module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        spec: ModelSpec,
        cache: RadixCache | None,
        local_host: str,
        on_commit: Callable[[], None],
        quantization: str = "none",
        tp: TPGroup | None = None,
    ) -> None:
        self.model, self.spec, self.cache = model, spec, cache
        # Quantized linears hold int8/int4 copies, not the checkpoint's tensors: updates are refused.
        self.quantization = quantization
        # A TP worker's rank 0: the other ranks stage and swap their cuts of every update with it.
        self.tp = tp
        self.local_host = local_host
        self.on_commit = on_commit
        self.version = "default"
        self.paused = False
        self.groups: dict[str, WeightsGroup] = {}
        self._staged: Staged | None = None
        # its tensor copies must not start a second OpenMP team (pdserve/side_threads.py)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weights", initializer=serial_openmp)
        self._jobs: list[tuple[m.WeightsCommand, Future[Copies | None], float]] = []  # (command, job, start)

    @classmethod
    def for_runner(
        cls, runner: ModelRunner, cache: RadixCache | None, local_host: str, on_commit: Callable[[], None]
    ) -> WeightUpdater:
        """A worker's updater: the runner's model, spec and quantization (as loaded: `auto` resolved)."""
        return cls(
            runner.model,
            runner.spec,
            cache,
            local_host,
            on_commit,
            runner.loaded.quantization,
            runner.tp.group,
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for g in self.groups.values():
            g.close()
        self.groups.clear()

    def on_command(self, cmd: m.WeightsCommand) -> m.WeightsReply | None:
        """Apply `cmd`; the reply, or None when a background job answers later (`poll`)."""
        op = cmd.op
        t0 = time.monotonic()
        if op in ("prepare_disk", "prepare_distributed") and self.quantization != "none":
            why = (
                f"live weight updates need unquantized weights; this worker runs --quantization "
                f"{self.quantization} (restart it on the new checkpoint instead)"
            )
            return self._reply(cmd, False, why, t0)
        if op in ("prepare_disk", "prepare_distributed", "init_group"):
            if self._jobs:
                return self._reply(cmd, False, "another weights operation is running on this worker", t0)
            job = {
                "prepare_disk": self._load,
                "prepare_distributed": self._receive,
                "init_group": self._join,
            }[op]
            self._jobs.append((cmd, self._pool.submit(job, cmd), t0))
            if op == "prepare_disk" and self.tp is not None:  # the other ranks stage their cuts meanwhile
                what: dict[str, object] = {
                    "model_path": cmd.model_path,
                    "load_format": cmd.load_format,
                    "require_all": True,
                }
                self.tp.weights(CMD_WEIGHTS_STAGE, what)
            return None
        if op == "commit":
            return self._commit(cmd, t0)
        if op == "cancel":
            self._staged = None
            if self.tp is not None:
                self.tp.weights(CMD_WEIGHTS_CANCEL)
            return self._reply(cmd, True, "", t0)
        if op == "destroy_group":
            g = self.groups.pop(cmd.group_name, None)
            if g is None:
                return self._reply(cmd, False, f"no weights group {cmd.group_name!r}", t0)
            g.close()
            return self._reply(cmd, True, "", t0)
        self.paused = op == "pause"
        return self._reply(cmd, True, "", t0)

    @property
    def busy(self) -> bool:
        """A background job runs: its reply comes out of `poll` when it ends."""
        return bool(self._jobs)

    def poll(self) -> list[m.WeightsReply]:
        """Replies of the background jobs that ended since the last call."""
        out = []
        for cmd, job, t0 in [j for j in self._jobs if j[1].done()]:
            self._jobs = [j for j in self._jobs if j[1] is not job]
            try:
                result = job.result()
            except WeightUpdateError as e:
                out.append(self._reply(cmd, False, str(e), t0))
                continue
            except Exception as e:  # a broken group, a read error: reported, never fatal to the loop
                log.exception("weights operation %s failed", cmd.op)
                out.append(self._reply(cmd, False, f"{type(e).__name__}: {e}", t0))
                continue
            if isinstance(result, list):  # staged weights
                self._staged = Staged(cmd.op_id, result, time.monotonic() - t0)
                if cmd.op == "prepare_distributed" and self.tp is not None:
                    folder = os.path.join(self.tp.folder, "weights-update")
                    self.tp.weights(CMD_WEIGHTS_STAGE, {"folder": folder, "require_all": False})
            out.append(self._reply(cmd, True, "", t0))
        return out

    # ---- background jobs ---------------------------------------------------------------------

    def _load(self, cmd: m.WeightsCommand) -> Copies:
        folder = check_checkpoint(self.spec, cmd.model_path, cmd.load_format)
        return stage(self.model, iter_weights(folder, self._shard()), require_all=True)

    def _shard(self) -> tuple[TPLayout, int, int] | None:
        """This rank's cut of each checkpoint tensor (TP), or None: all of it."""
        return None if self.tp is None else (self.tp.layout, 0, self.spec.head_dim)

    def _receive(self, cmd: m.WeightsCommand) -> Copies:
        """Receive every announced tensor (all of them, so the trainer's broadcasts never hang on a
        mismatch), then check them against the model."""
        group = self.groups.get(cmd.group_name)
        if group is None:
            raise WeightUpdateError(f"no weights group {cmd.group_name!r} on this worker (init it first)")
        received = []
        for name, dtype, shape in zip(cmd.names, cmd.dtypes, cmd.shapes):
            t = torch.empty(shape, dtype=parse_dtype(dtype), device=group.device)
            group.broadcast(t)
            received.append((name, t))
        if self.tp is None:
            return stage(self.model, received, require_all=False)
        # A TP worker: the whole tensors go to a file of its private folder, from which every rank,
        # this one too, reads its own cut (the others when `poll` tells them to).
        folder = os.path.join(self.tp.folder, "weights-update")
        os.makedirs(folder, exist_ok=True)
        save_file({n: t.cpu().contiguous() for n, t in received}, os.path.join(folder, "update.safetensors"))
        return stage(self.model, iter_weights(folder, self._shard()), require_all=False)

    def _join(self, cmd: m.WeightsCommand) -> None:
        g = cmd.group
        assert g is not None
        if g.group_name in self.groups:
            raise WeightUpdateError(f"weights group {g.group_name!r} exists already on this worker")
        self.groups[g.group_name] = WeightsGroup(
            master_address=g.master_address,
            master_port=g.master_port,
            rank=g.rank,
            world_size=g.world_size,
            group_name=g.group_name,
            backend=g.backend,
            local_host=self.local_host,
        )

    # ---- in the loop -------------------------------------------------------------------------

    def _commit(self, cmd: m.WeightsCommand, t0: float) -> m.WeightsReply:
        staged = self._staged
        if staged is None or staged.op_id != cmd.op_id:
            return self._reply(cmd, False, "nothing prepared for this update on this worker", t0)
        self._staged = None
        if self.tp is not None:  # every rank swaps its cut, or none does
            self.tp.weights(CMD_WEIGHTS_COMMIT)
            if self.tp.failed_ranks(False):
                why = "; ".join(self.tp.why_failed()) or "a TP rank could not stage its cut"
                return self._reply(cmd, False, f"nothing changed: {why}", t0)
        apply(staged.copies)
        if cmd.weight_version:
            self.version = cmd.weight_version
        if self.cache is not None:
            self.cache.invalidate()
        self.on_commit()
        log.info("weights updated to version %s (%d tensors)", self.version, len(staged.copies))
        return self._reply(cmd, True, "", t0)

    def _reply(self, cmd: m.WeightsCommand, ok: bool, message: str, t0: float) -> m.WeightsReply:
        return m.WeightsReply(
            op_id=cmd.op_id,
            ok=ok,
            message=message,
            seconds=time.monotonic() - t0,
            weight_version=self.version,
        )
