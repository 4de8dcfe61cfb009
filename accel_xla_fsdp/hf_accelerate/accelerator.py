"""``accel_xla_fsdp.Accelerator``: Accelerate's ``Accelerator`` with XLA FSDP behind ``prepare()``.

What it changes, and why (Accelerate 1.11 to 1.15 on XLA):

- ``prepare`` shards each model by the ``XlaFsdpPlugin`` settings and moves the user's optimizer
  onto the shards (Accelerate's XLA path would remap the optimizer by parameter name, which
  wrapping changes).
- ``mixed_precision="bf16"`` becomes the engine's compute dtype (gathered parameters and
  activations in bfloat16; shards, gradients and optimizer state in float32) instead of autocast.
  fp16 is refused: XLA devices train in bf16.
- Gradients are reduce-scattered in backward, once: the optimizer wrapper's all-reduce and
  ``clip_grad_norm_``'s are skipped, and ``clip_grad_norm_`` takes the norm over every shard.
- Dataloaders are iterated in the replica's own thread (``XlaDataLoader``), not read ahead by
  torch_xla's loader thread, which made replicas disagree on where accumulation ends.
- ``gather``, ``reduce``, ``pad_across_processes`` and the shuffling seed work on XLA:CPU replica
  threads (xla_cpu/host_collectives.py); ``wait_for_everyone`` and ``main_process_first`` do through
  xla_cpu/rendezvous.py. On a TPU, Accelerate's own forms run.
- ``save_state`` / ``load_state`` write and read sharded checkpoints, locally or at a URL (checkpoints.py);
  ``get_state_dict``, ``unwrap_model`` and ``save_model`` give the whole model.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

import accelerate
import torch
import torch.nn as nn
from accelerate.data_loader import DataLoaderShard, MpDeviceLoaderWrapper
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, synchronize_rng_states

from .. import _xla, host_memory
from ..checkpoint.consolidate import check_storable, write_state_dict_to_store
from ..checkpoint.errors import CheckpointError
from ..checkpoint.sharded import sum_over_replicas
from ..checkpoint.store import Location, is_url
from ..checkpointing import checkpoint_module
from ..construction import FlatShardKey
from ..fsdp import XlaFullyShardedDataParallel
from ..state_dict import model_state_dict, shards_by_name
from ..xla_cpu import host_collectives
from ..xla_cpu.rendezvous import agree, broadcast_from_rank0_, replicas_are_threads
from . import checkpoints, launch, pretrained_loading
from .optimizer import XlaFsdpOptimizer, holds_any, move_onto_shards, param_group_key, parameter_names
from .plugin import XlaFsdpPlugin
from .unwrapped_generate import route_generate
from .unwrapped_save import route_save_pretrained

logger = get_logger(__name__)

_COMPUTE_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16}


def compute_dtype_for(mixed_precision: str) -> torch.dtype:
    if mixed_precision not in _COMPUTE_DTYPES:
        raise ValueError(
            f"mixed_precision={mixed_precision!r} is not offered with XLA FSDP: use 'bf16' (computation "
            "in bfloat16, float32 master weights) or 'no'. XLA devices have no fp16 loss scaling."
        )
    return _COMPUTE_DTYPES[mixed_precision]


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` whose ``prepare()`` shards models with XLA FSDP.

    Takes Accelerate's arguments; ``fsdp_plugin`` may be an ``XlaFsdpPlugin`` (default: one
    read from the environment and the ``accelerate launch`` config file).
    """

    def __init__(
        self, *args: Any, fsdp_plugin: Optional[Any] = None, mixed_precision: Optional[str] = None, **kwargs: Any
    ) -> None:
        if fsdp_plugin is not None and not isinstance(fsdp_plugin, XlaFsdpPlugin):
            raise TypeError(
                f"fsdp_plugin must be an accel_xla_fsdp.XlaFsdpPlugin, got {type(fsdp_plugin).__name__} "
                "(Accelerate's FullyShardedDataParallelPlugin is for GPUs)"
            )
        launch.read_settings_in_replica()  # an import inside main(): the launcher passed nothing
        requested = str(mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")).lower()
        self.compute_dtype = compute_dtype_for(requested)
        self.xla_fsdp_plugin = fsdp_plugin if fsdp_plugin is not None else XlaFsdpPlugin()
        # Autocast stays off: the engine computes in the compute dtype itself.
        super().__init__(*args, mixed_precision="no", **kwargs)
        self._requested_mixed_precision = requested
        if self.distributed_type != DistributedType.XLA:
            raise RuntimeError(
                f"accel_xla_fsdp.Accelerator needs XLA devices, but Accelerate chose {self.distributed_type}: "
                "launch with a config whose distributed_type is XLA (plugins/xla_fsdp_cpu.yaml)"
            )
        launch.check_device_count(self.num_processes)
        _set_local_process_index(self.state)
        # id of a prepared model's own parameter -> its name, and the shard holding it
        self._unwrapped_names: Dict[int, str] = {}
        self._shard_of: Dict[int, nn.Parameter] = {}

    @property
    def mixed_precision(self) -> str:
        return self._requested_mixed_precision

    # -- prepare -------------------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: Optional[List[bool]] = None) -> Any:
        """Accelerate's ``prepare``, after sharding the models and moving their optimizers onto the
        shards: those prepared with a model, and later ones still holding a model's own parameters.

        Flat shards keep the param groups of the optimizers prepared with the model apart (one
        shard per unit and group), so that each group keeps its hyper-parameters."""
        objects = list(args)
        optimizers = [obj for obj in objects if isinstance(obj, torch.optim.Optimizer)]
        models_here = False
        for i, obj in enumerate(objects):
            if isinstance(obj, nn.Module) and not isinstance(obj, XlaFullyShardedDataParallel):
                models_here = True
                names = parameter_names(obj)
                wrapped = self.shard_model(obj, flat_shard_key=param_group_key(optimizers))
                objects[i] = wrapped
                by_name = shards_by_name(wrapped.unit_state)
                self._unwrapped_names.update(names)
                self._shard_of.update({pid: by_name[name] for pid, name in names.items()})
        for optimizer in optimizers:
            if models_here or holds_any(optimizer, self._shard_of):
                move_onto_shards(optimizer, self._unwrapped_names, self._shard_of)
        prepared = super().prepare(*objects, device_placement=device_placement)
        if self.xla_fsdp_plugin.optimizer_in_backward:
            self._apply_optimizers_in_backward()
        return prepared

    def _apply_optimizers_in_backward(self) -> None:
        """``xla_fsdp_optimizer_in_backward``: each prepared model's optimizer steps it in backward
        (``XlaFullyShardedDataParallel.apply_optimizer_in_backward``), once both are prepared."""
        pairs = checkpoints.pair_optimizers(
            self._sharded_models(), self._optimizers, "xla_fsdp_optimizer_in_backward takes one"
        )
        for model, optimizer in pairs:
            if optimizer is not None and model.unit_state.root_state.optimizer_in_backward is not optimizer:
                model.apply_optimizer_in_backward(optimizer)

    def shard_model(
        self, model: nn.Module, flat_shard_key: Optional[FlatShardKey] = None
    ) -> XlaFullyShardedDataParallel:
        """``model`` wrapped by the plugin's settings, every replica starting from rank 0's weights
        if ``fsdp_sync_module_states``; ``transformers``' gradient checkpointing becomes ours.
        ``flat_shard_key``: see ``XlaFullyShardedDataParallel``."""
        plugin = self.xla_fsdp_plugin
        source = pretrained_loading.take_shard_source(model)  # loaded with fsdp_cpu_ram_efficient_loading
        if plugin.sync_module_states and self.num_processes > 1 and source is not None:
            pretrained_loading.share_rank0_real_tensors(model, self.device)
        elif plugin.sync_module_states and self.num_processes > 1:
            if not replicas_are_threads():
                model.to(self.device)  # torch_xla's broadcast runs on the device
            broadcast_from_rank0_([*model.parameters(), *model.buffers()])
        blocks = _take_over_gradient_checkpointing(model)
        wrapped = plugin.wrap(
            model,
            self.compute_dtype,
            checkpoint_blocks=bool(plugin.activation_checkpointing) and not blocks,
            flat_shard_key=flat_shard_key,
            param_init_fn=source,
        )
        logger.info(
            f"XLA FSDP: {sum(1 for m in wrapped.modules() if isinstance(m, XlaFullyShardedDataParallel))} units"
        )
        route_generate(wrapped)  # unwrap_model(model).generate(...), as transformers' seq2seq examples call it
        route_save_pretrained(wrapped)  # unwrap_model(model).save_pretrained(...): kept where written
        return wrapped

    def prepare_model(
        self, model: nn.Module, device_placement: Optional[bool] = None, evaluation_mode: bool = False
    ) -> nn.Module:
        if not isinstance(model, XlaFullyShardedDataParallel):
            model = self.shard_model(model)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        for optimizer in self._optimizers:
            if isinstance(optimizer, XlaFsdpOptimizer):
                optimizer.loss = loss  # the first output of the step's sync ([Note: donation order])
        super().backward(loss, **kwargs)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None) -> Any:
        if isinstance(optimizer, XlaFsdpOptimizer):
            return optimizer
        prepared = XlaFsdpOptimizer(
            optimizer, device_placement=self.device_placement if device_placement is None else device_placement
        )
        self._optimizers.append(prepared)
        return prepared

    def prepare_data_loader(self, data_loader: Any, *args: Any, **kwargs: Any) -> Any:
        prepared = super().prepare_data_loader(data_loader, *args, **kwargs)
        loader = _iterated_in_place(prepared, self.device)
        if loader is not prepared and prepared in self._dataloaders:
            self._dataloaders[self._dataloaders.index(prepared)] = loader
        return loader

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """``dataloader``'s next pass without its first ``num_batches`` (for resuming mid-epoch)."""
        if not isinstance(dataloader, XlaDataLoader):
            return super().skip_first_batches(dataloader, num_batches)
        return XlaDataLoader(dataloader.shard, dataloader.rng_types, num_batches)

    # -- training ------------------------------------------------------------------------------

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Accelerate's, which on one replica syncs every micro-step; with the optimizer in
        backward the engine's ``no_sync`` then too, or each micro-step would apply its gradients
        ([Note: the optimizer in backward])."""
        in_backward = self.xla_fsdp_plugin.optimizer_in_backward and not self.use_distributed
        if in_backward and isinstance(model, XlaFullyShardedDataParallel):
            with model.no_sync():
                yield
            return
        with super().no_sync(model):
            yield

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Clip by the norm of the whole gradient (every replica's shards): pass ``model.parameters()``."""
        wanted = {id(p) for p in parameters}
        for model in self._models:
            if isinstance(model, XlaFullyShardedDataParallel) and wanted == {id(p) for p in model.parameters()}:
                norm = model.clip_grad_norm_(max_norm, norm_type)
                if replicas_are_threads():
                    # Scripts log the norm with .item(). Read back now, the step's program (its
                    # collectives too) would run outside the turns at graph boundaries, every
                    # replica compiling it at once: under load they reached its first collective
                    # over 10 s apart and XLA:CPU aborted (seen). Cut the graph here instead.
                    _xla.sync()
                return norm
        raise ValueError(
            "clip_grad_norm_ with XLA FSDP takes the parameters of a whole prepared model "
            "(model.parameters()): the norm is over the shards of every replica"
        )

    # -- collectives ---------------------------------------------------------------------------

    def gather(self, tensor: Any) -> Any:
        return host_collectives.gather(tensor) if replicas_are_threads() else super().gather(tensor)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        if replicas_are_threads():
            return host_collectives.reduce(tensor, reduction, scale)
        return super().reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        if replicas_are_threads():
            return host_collectives.pad_across_processes(tensor, dim, pad_index, pad_first)
        return super().pad_across_processes(tensor, dim, pad_index, pad_first)

    # -- whole model -----------------------------------------------------------------------------

    def unwrap_model(
        self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> nn.Module:
        """The model inside the FSDP wrapper. Its parameters hold no data between forwards, but its
        ``state_dict()`` (so its ``save_pretrained``) gives the whole model, gathered: call it on
        every replica."""
        if isinstance(model, XlaFullyShardedDataParallel):
            model = model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> Dict[str, torch.Tensor]:
        """The unwrapped model's ``state_dict()`` (its keys and dtypes), full tensors on the CPU, on
        every replica (Accelerate's GPU FSDP gives it on the main process only): call it on every
        replica. Streamed ([Note: streamed full state dicts]): a replica holds the copy it returns."""
        if isinstance(model, XlaFullyShardedDataParallel):
            agree("get_state_dict")
            state = model.model_state_dict()
            host_memory.give_back()  # what the transfers freed
            return state
        return super().get_state_dict(model, unwrap)

    def save_model(
        self, model: nn.Module, save_directory: Any, max_shard_size: Any = "10GB", safe_serialization: bool = True
    ) -> None:
        """The whole model in the Hugging Face layout (``config.json`` too for a ``transformers``
        model, which ``from_pretrained`` then loads). Call on every replica; the main one writes."""
        if not isinstance(model, XlaFullyShardedDataParallel):
            return super().save_model(model, save_directory, max_shard_size, safe_serialization)
        if is_url(save_directory):
            self._save_model_to_store(model, Location.of(save_directory), max_shard_size, safe_serialization)
            return
        if os.path.isfile(save_directory):  # as Accelerate's: said, and nothing saved (on every replica alike)
            logger.error(f"Provided path ({save_directory}) should be a directory, not a file")
            return
        agree("save_model")
        # Only the main process writes, so only it keeps the streamed state dict.
        state = model_state_dict(model.unit_state, kept_here=self.is_main_process)
        # As Accelerate's does (huggingface_hub's writer, for a model without save_pretrained, does not).
        os.makedirs(save_directory, exist_ok=True)
        if self.is_main_process:
            save_pretrained = getattr(model.module, "save_pretrained", None)
            if save_pretrained is not None:
                save_pretrained(
                    save_directory,
                    state_dict=state,
                    max_shard_size=max_shard_size,
                    safe_serialization=safe_serialization,
                )
            else:
                from huggingface_hub import save_torch_state_dict

                save_torch_state_dict(
                    state, save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization
                )
        del state
        host_memory.give_back()
        self.wait_for_everyone()

    def _save_model_to_store(
        self, model: XlaFullyShardedDataParallel, target: Location, max_shard_size: Any, safe_serialization: bool
    ) -> None:
        """``save_model`` to a URL: the main replica writes the Hugging Face layout straight into
        the store from the streamed state dict, with consolidation's writer (nothing on local disk)."""
        if not safe_serialization:  # said before the gathers, on every replica alike
            raise CheckpointError(
                f"{target}: save_model to a URL writes safetensors only; leave safe_serialization=True, or "
                "save_model to a local folder"
            )
        check_storable(model.module, target)
        agree("save_model")
        state = model_state_dict(model.unit_state, kept_here=self.is_main_process)  # kept where written
        error: Optional[BaseException] = None
        if self.is_main_process:
            try:
                write_state_dict_to_store(state, model.module, target, max_shard_size)
            except Exception as e:  # noqa: BLE001 - every replica must hear of it
                error = e
        del state
        host_memory.give_back()
        failed = sum_over_replicas([int(error is not None)])[0]
        checkpoints.raise_if_failed(
            error, failed, f"{target}: the main process could not save the model (its error says why)"
        )

    # -- checkpoints ---------------------------------------------------------------------------

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """Sharded checkpoint of every prepared model and optimizer, plus Accelerate's own state,
        into a local folder or a URL alike ([Note: save_state folders])."""
        if not self._sharded_models():
            return super().save_state(output_dir, safe_serialization, **kwargs)
        config = self.project_configuration
        full = self.xla_fsdp_plugin.state_dict_type == "full_state_dict"
        if config.automatic_checkpoint_naming:
            given = os.path.join(str(self.project_dir), "checkpoints", f"checkpoint_{self.save_iteration}")
        elif output_dir is None:
            raise ValueError("save_state needs output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
        else:
            given = str(output_dir)
        folder = checkpoints.expand(given)
        checkpoints.save(self, folder, self._model_optimizer_pairs(), full)
        if config.automatic_checkpoint_naming and self.is_main_process:
            checkpoints.rotate(folder.parent, config.total_limit)
        self.wait_for_everyone()
        config.iteration += 1
        logger.info(f"Saved the state to {given}")
        return given  # as Accelerate's: the folder as the user's paths name it

    def load_state(self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None, **kwargs: Any) -> None:
        """Load a ``save_state`` folder (the newest complete numbered one with automatic naming),
        on any number of replicas; later automatic saves are numbered after it."""
        if not self._sharded_models():
            return super().load_state(input_dir, load_kwargs, **kwargs)
        config = self.project_configuration
        if input_dir is not None:
            folder = checkpoints.expand(str(input_dir))
            if not folder.isdir():
                raise ValueError(f"load_state: {folder} is not a folder")
        elif config.automatic_checkpoint_naming:
            root = checkpoints.expand(str(self.project_dir)) / "checkpoints"
            found = checkpoints.complete_checkpoints(root)
            if not found:
                raise ValueError(f"load_state: no complete checkpoint_<n> folder under {root}")
            folder = found[-1]
        else:
            raise ValueError("load_state needs input_dir, or ProjectConfiguration(automatic_checkpoint_naming=True)")
        self.step = checkpoints.load(self, folder, self._model_optimizer_pairs(), load_kwargs)
        number = checkpoints.checkpoint_number(folder)
        if config.automatic_checkpoint_naming and number is not None:
            config.iteration = number + 1
        logger.info(f"Loaded the state from {folder}")

    def _sharded_models(self) -> List[XlaFullyShardedDataParallel]:
        return [m for m in self._models if isinstance(m, XlaFullyShardedDataParallel)]

    def _model_optimizer_pairs(self) -> List[checkpoints.ModelAndOptimizer]:
        return checkpoints.pair_optimizers(self._sharded_models(), self._optimizers)


def _set_local_process_index(state: Any) -> None:
    """On XLA:CPU Accelerate reads the local rank from ``LOCAL_RANK``, which nothing sets (so no
    replica is the local main process, and ``print`` and progress bars print nothing, with one
    replica too); every XLA:CPU replica is in this process: it is the rank."""
    if _xla.on_cpu() and state.local_process_index < 0:
        for shared in (state, accelerate.PartialState()):
            shared.local_process_index = state.process_index


def _take_over_gradient_checkpointing(model: nn.Module) -> List[nn.Module]:
    """The blocks ``gradient_checkpointing_enable()`` checkpoints, checkpointed our way instead.

    ``transformers`` checkpoints with ``torch.utils.checkpoint``, whose recomputation the XLA
    compiler merges back into the forward (no memory saved) and which would run FSDP's gathers
    inside the recomputation; ``checkpoint_module`` survives the compiler (checkpointing.py).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    blocks: List[nn.Module] = [
        m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
    ]
    if blocks:
        for m in model.modules():  # what gradient_checkpointing_disable() does, under any of its names
            if getattr(m, "gradient_checkpointing", False) is True:
                setattr(m, "gradient_checkpointing", False)  # a plain attribute, not a tensor or module
        for block in blocks:
            checkpoint_module(block)
    return blocks


class XlaDataLoader:
    """Accelerate's dataloader shard, iterated in the replica's own thread.

    On XLA Accelerate hands its shard to torch_xla's ``MpDeviceLoader``, whose background thread
    iterates it ahead of the training loop: the shard then flags the end of the dataloader when
    the thread reaches it, not when the loop does, and ``accumulate`` syncs gradients on every
    micro-step from that moment, in some replicas and not others (measured: 2 of 4 replicas
    skipped the reduction of the first micro-step, and the step's programs no longer matched).
    Here the loop's own thread iterates, as on a GPU, and the step ends where the next batch is
    asked for, as with ``MpDeviceLoader``. The shuffling seed is shared as Accelerate does, between
    replica threads on XLA:CPU. Anything else is the shard's (``set_epoch``, ``total_batch_size``, ...).
    """

    def __init__(self, shard: DataLoaderShard, rng_types: Optional[List[str]], skip_batches: int = 0) -> None:
        self.shard = shard
        self.rng_types = rng_types
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[Any]:
        if self.rng_types:
            share = host_collectives.share_rng_states if replicas_are_threads() else synchronize_rng_states
            share(self.rng_types, self.shard.synchronized_generator)
        batches = iter(self.shard)
        for _ in range(self.skip_batches):
            next(batches, None)
        while True:
            _xla.sync()  # the step's graph ends here (MpDeviceLoader's mark_step)
            try:
                yield next(batches)
            except StopIteration:
                return

    def __len__(self) -> int:
        return len(self.shard) - self.skip_batches

    def __getattr__(self, name: str) -> Any:
        return getattr(self.shard, name)


def _iterated_in_place(prepared: Any, device: torch.device) -> Any:
    """Accelerate's XLA dataloader as an ``XlaDataLoader`` on ``device`` (others unchanged)."""
    if not isinstance(prepared, MpDeviceLoaderWrapper) or not isinstance(prepared._loader, DataLoaderShard):
        return prepared
    prepared._loader.device = device
    base = prepared._loader.base_dataloader
    if base.generator is not None and base.generator is prepared._loader.synchronized_generator:
        # Accelerate's XLA branch gives the loader the sampler's generator, so every epoch's
        # worker seed is drawn from it; on GPUs (and CPU processes) it comes from torch's generator,
        # which the collator's masks draw from next. As there: same order, same masks.
        base.generator = None
    return XlaDataLoader(prepared._loader, prepared._rng_types)
