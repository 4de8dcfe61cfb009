"""``transformers``' ``Trainer`` and ``Seq2SeqTrainer`` on accel_xla_fsdp's ``Accelerator``.

A Trainer script changes its import (``from accel_xla_fsdp import Trainer``) and runs under
``accelerate launch --config_file plugins/xla_fsdp_cpu.yaml``, or runs unchanged under
``accel-xla-fsdp launch``, which puts ``XlaFsdpTrainerMixin`` in front of every Trainer's class
(``with_mixin_new``, xla_cpu/patches.py); a subclass of any Trainer takes the mixin itself
(``class MyTrainer(XlaFsdpTrainerMixin, trl.DPOTrainer)``). What differs from the stock
classes (transformers 5.24), and why:

- The Trainer builds its ``Accelerator`` itself (``create_accelerator_and_postprocess``); here it
  is ours, with the FSDP settings of ``TrainingArguments(fsdp=..., fsdp_config=...)`` if any
  (arguments.py), else the config file's. The Trainer then takes its ordinary Accelerate
  path: ``accelerator.prepare(model, optimizer)`` shards the model and moves the optimizer onto
  the shards. torch_xla's own FSDP (``fsdp_config["xla"]``, ``integrations/tpu.py``) is never
  used: the trainer's ``args`` are a copy whose ``fsdp`` is off, its settings taken over.
- The Trainer's XLA branches that call torch_xla directly (``xm.mesh_reduce`` for the logged
  loss, ``xm.rendezvous`` around saves, ``xm.mark_step``) run as they are: xla_cpu/rendezvous.py makes the
  rendezvous work between XLA:CPU replica threads.
- Checkpoints (``save_steps``): ``checkpoint-N/xla_fsdp_0/`` holds our sharded model and
  optimizer (loadable on any number of replicas) beside the Trainer's own files (scheduler,
  each rank's random states, ``trainer_state.json``, ``training_args.bin``); the Trainer's XLA
  path would write the optimizer of rank 0 alone (``xm.save``), which on shards is a fraction of
  it. Resuming loads them after ``prepare()``; ``load_best_model_at_end`` loads the best one's
  model. ``save_model(dir)`` writes the whole model in the Hugging Face layout.
- ``Seq2SeqTrainer``'s ``predict_with_generate`` generates through the sharded model; the
  default fused AdamW runs unfused (no fused kernel for XLA tensors); ``total_flos`` counts the
  parameters as they were before sharding, over every replica.
"""

from __future__ import annotations

import copy
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

import accelerate
import torch
import transformers
import transformers.trainer
from accelerate.logging import get_logger
from transformers.trainer import SCHEDULER_NAME

from .. import host_memory
from ..checkpoint import CheckpointError, load_sharded, save_sharded
from ..fsdp import XlaFullyShardedDataParallel
from ..hf_accelerate.accelerator import Accelerator, XlaDataLoader
from ..state_dict import kept_on_this_replica
from ..xla_cpu import patches
from ..xla_cpu.rendezvous import agree
from .arguments import check_precision, fixed_shapes, plugin_from_training_args
from .resume import SHARDED_DIR, incomplete_reason, is_newest, newest_complete

logger = get_logger(__name__)
_building = threading.local()  # the plugin of the Trainer building its Accelerator in this thread
# The Trainer reads its random states under torch's safe globals, a process-wide list that it sets
# and clears: XLA:CPU replica threads loading at once cleared each other's, and a replica failed
# to unpickle NumPy's state (seen). One replica at a time reads them.
_rng_files = threading.Lock()
# Accelerate's own class (under accel-xla-fsdp launch, ``accelerate.Accelerator`` is ours).
_STOCK_ACCELERATOR = Accelerator.__bases__[0]


def _accelerator(*args: Any, **kwargs: Any) -> accelerate.Accelerator:
    """What ``transformers.trainer`` calls ``Accelerator``: ours for our Trainers (in the thread
    building one), Accelerate's for any other. The Trainer's own ``fsdp_plugin`` (built from
    ``fsdp_config`` for GPUs) is replaced by the ``XlaFsdpPlugin`` made from the same settings."""
    if not getattr(_building, "active", False):
        return _STOCK_ACCELERATOR(*args, **kwargs)
    kwargs["fsdp_plugin"] = _building.plugin
    return Accelerator(*args, **kwargs)


def _skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """What ``transformers.trainer`` calls ``skip_first_batches`` (Accelerate's function, which on
    XLA takes torch_xla's device loader apart): ours for the dataloaders our ``prepare()`` makes."""
    if isinstance(dataloader, XlaDataLoader):
        return XlaDataLoader(dataloader.shard, dataloader.rng_types, num_batches)
    return accelerate.skip_first_batches(dataloader, num_batches)


def accelerator_dispatch(original: Any) -> Any:
    """The patch of ``transformers.trainer.Accelerator`` (xla_cpu/patches.py)."""
    return _accelerator


def skip_first_batches_dispatch(original: Any) -> Any:
    """The patch of ``transformers.trainer.skip_first_batches`` (xla_cpu/patches.py)."""
    return _skip_first_batches


# A mixin of the Trainers: to the type checker it is a Trainer (whose attributes it uses), at run
# time a plain class that goes first in the Trainers' bases.
if TYPE_CHECKING:
    _TrainerBase = transformers.Trainer
else:
    _TrainerBase = object


class XlaFsdpTrainerMixin(_TrainerBase):
    """What a ``transformers.Trainer`` subclass needs to run on accel_xla_fsdp's engine, put in
    front of it: ``class MyTrainer(XlaFsdpTrainerMixin, trl.DPOTrainer)``. Every argument passes
    through untouched, whatever the subclass's signature, but for its ``TrainingArguments``
    (wherever it is: DPO's come third), which the subclass receives as a copy whose ``fsdp`` is off,
    its settings taken over by the engine. Under ``accel-xla-fsdp launch`` every Trainer gets it
    without being asked (``mixin_new``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if _is_trl_dpo_trainer(self):
            patches.install(patches.Stage.DPO_TRAINER)  # its masked metrics in programs of one shape
        args, kwargs, training_args = _training_args_taken_over(args, kwargs)
        self._xla_fsdp_plugin = None if training_args is None else plugin_from_training_args(training_args)
        super().__init__(*args, **kwargs)
        # Counted now: once sharded, the model's own parameters hold no data (size 0).
        counter = getattr(self.model, "num_parameters", None)
        self._parameter_count = counter(exclude_embeddings=True) if callable(counter) else None

    def create_accelerator_and_postprocess(self) -> None:
        check_precision(self.args)  # also the arguments a subclass made itself (TRL's, given none)
        _building.active, _building.plugin = True, self._xla_fsdp_plugin
        try:
            super().create_accelerator_and_postprocess()
        finally:
            _building.active, _building.plugin = False, None

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: Any, model: Any = None) -> Tuple[Any, Dict[str, Any]]:
        """The Trainer's optimizer, unfused: the default ``adamw_torch_fused`` asks for torch's fused
        kernel, which takes no XLA tensors (the same update, round-off apart)."""
        optimizer_cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
        if kwargs.get("fused"):
            kwargs = {**kwargs, "fused": False}
        return optimizer_cls, kwargs

    def floating_point_ops(self, inputs: Dict[str, Any]) -> int:
        """The Trainer's estimate (6 x tokens x non-embedding parameters), with the parameters
        counted before sharding."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if self._sharded_model() is None or self._parameter_count is None or main_input not in inputs:
            return super().floating_point_ops(inputs)
        return 6 * inputs[main_input].numel() * self._parameter_count

    def store_flos(self) -> None:
        """Every replica's floating-point operations summed, as the Trainer does over processes
        (on XLA it keeps its own replica's only). Every replica calls it (the Trainer does)."""
        if self._sharded_model() is None:
            return super().store_flos()
        mine = torch.tensor(float(self.current_flos), device=self.args.device)
        self.state.total_flos += self.accelerator.reduce(mine, "sum").item()
        self.current_flos = 0

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        """Nothing: ``prepare()`` places the model's shards (with ``fsdp_cpu_ram_efficient_loading``
        the model is on the meta device until then, and cannot move)."""

    # -- checkpoints -------------------------------------------------------------------------

    def _sharded_model(self) -> Optional[XlaFullyShardedDataParallel]:
        wrapped = self.model_wrapped
        return wrapped if isinstance(wrapped, XlaFullyShardedDataParallel) else None

    def _output_dir(self) -> str:
        # TrainingArguments sets it in __post_init__ ("trainer_output" when not given).
        assert self.args.output_dir is not None
        return self.args.output_dir

    def _raw_optimizer(self) -> Optional[torch.optim.Optimizer]:
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The whole model in the Hugging Face layout (``from_pretrained`` loads it); in a
        checkpoint (``_internal_call``), the sharded model and optimizer instead. Every replica
        calls it (the Trainer does); the whole model is kept only on the replica that writes it
        ([Note: streamed full state dicts])."""
        model = self._sharded_model()
        if model is None:
            return super().save_model(output_dir, _internal_call)
        if not _internal_call:
            if self._saves_as_gathered():
                return self._save_as_gathered(output_dir or self._output_dir())
            try:
                with kept_on_this_replica(self.args.should_save):
                    return super().save_model(output_dir, _internal_call)
            finally:
                host_memory.give_back()
        output_dir = output_dir or self._output_dir()
        optimizer = None if self.args.save_only_model else self._raw_optimizer()
        save_sharded(model, optimizer, os.path.join(output_dir, SHARDED_DIR))
        if self.args.should_save:
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
            config = getattr(model.module, "config", None)
            if config is not None:
                config.save_pretrained(output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
        agree("save_model")

    def _saves_as_gathered(self) -> bool:
        """Whether the whole model can be written as it is gathered: a transformers model (not a
        PEFT one, whose adapters are small), and no upload to the Hub (it sends the files first)."""
        model = self._sharded_model()
        inner = model.module if model is not None else None
        return (
            isinstance(inner, transformers.PreTrainedModel)
            and not getattr(inner, "_hf_peft_config_loaded", False)
            and not self.args.push_to_hub
        )

    def _save_as_gathered(self, output_dir: str) -> None:
        """What the Trainer's XLA save writes (``save_tpu_checkpoint``: the model, ``training_args.bin``,
        the tokenizer), but with no state dict handed to ``save_pretrained``: the stock save then
        writes each piece of the model as it is gathered ([Note: saves written as gathered]) where
        the Trainer's would hold the whole model on the writing replica (issue 27)."""
        model = self._sharded_model()
        assert model is not None
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        inner: Any = model.module  # a PreTrainedModel (_saves_as_gathered), its save_pretrained routed
        inner.save_pretrained(output_dir, is_main_process=self.args.should_save)
        if self.processing_class is not None and self.args.should_save:
            self.processing_class.save_pretrained(output_dir)
        agree("save_model")

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The optimizer is in ``xla_fsdp_0/`` with the model; the scheduler as the Trainer writes it."""
        if self._sharded_model() is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            assert self.lr_scheduler is not None  # made before the first step, so before any save
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """``resume_from_checkpoint=True`` takes the newest complete ``checkpoint-N`` (resume.py)
        where the Trainer would take the highest N, complete or not; each newer one skipped is
        named in a warning. So does the path of the highest ``checkpoint-N`` of ``output_dir``,
        which is what scripts that call ``get_last_checkpoint`` themselves pass (transformers'
        examples). Any other path is resumed from as given (``_load_from_checkpoint`` checks it)."""
        last = isinstance(resume_from_checkpoint, (str, os.PathLike)) and is_newest(
            resume_from_checkpoint, self._output_dir()
        )
        if resume_from_checkpoint is True or last:
            folder, skipped = newest_complete(self._output_dir())
            for incomplete, reason in skipped:
                logger.warning(f"Not resuming from {incomplete}: {reason}. Resuming from {folder.name} instead.")
            resume_from_checkpoint = str(folder)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Only checks the folder: called before ``prepare()`` (the model is not sharded yet),
        loading waits for ``_load_optimizer_and_scheduler``, which the Trainer calls after it."""
        reason = incomplete_reason(Path(resume_from_checkpoint))
        if reason is not None:
            raise CheckpointError(
                f"Cannot resume from {resume_from_checkpoint}: {reason}. Resume from a complete checkpoint-N "
                "(resume_from_checkpoint=True takes the newest complete one in args.output_dir)"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        model = self._sharded_model()
        if checkpoint is None or model is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        optimizer = None if self.args.save_only_model else self._raw_optimizer()
        load_sharded(model, optimizer, os.path.join(checkpoint, SHARDED_DIR))
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            assert self.lr_scheduler is not None  # the Trainer makes it before loading into it
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        with _rng_files:
            super()._load_rng_state(checkpoint)

    def _load_best_model(self) -> None:
        model = self._sharded_model()
        if model is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        assert best is not None  # the Trainer calls this only once it has one
        load_sharded(model, None, os.path.join(best, SHARDED_DIR))


# Goes after the mixin in a Seq2SeqTrainer's bases: to the type checker a Seq2SeqTrainer, at run
# time a plain class.
if TYPE_CHECKING:
    _Seq2SeqBase = transformers.Seq2SeqTrainer
else:
    _Seq2SeqBase = object


class _GenerateSharded(_Seq2SeqBase):
    """``Seq2SeqTrainer``'s ``predict_with_generate`` through the sharded model."""

    if TYPE_CHECKING:  # the mixin's, ahead of this class in every trainer's bases

        def _sharded_model(self) -> Optional[XlaFullyShardedDataParallel]: ...

    def prediction_step(
        self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None, **gen_kwargs: Any
    ) -> Any:
        """With ``predict_with_generate`` the Seq2SeqTrainer calls ``self.model.generate``: here the
        sharded model's, which gathers every unit once for the whole generation (the unwrapped
        model's parameters hold no data outside a forward). Every replica calls it (the Trainer does)."""
        unwrapped, sharded = self.model, self._sharded_model()
        if sharded is not None:
            self.model = sharded
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys, **gen_kwargs)
        finally:
            self.model = unwrapped


class Trainer(XlaFsdpTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` training with XLA FSDP (module docstring)."""


class Seq2SeqTrainer(XlaFsdpTrainerMixin, _GenerateSharded, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` training with XLA FSDP (module docstring)."""


def _training_args_taken_over(
    args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Tuple[Tuple[Any, ...], Dict[str, Any], Optional[transformers.TrainingArguments]]:
    """``args``/``kwargs`` with their ``TrainingArguments`` (found by type, not position) replaced by
    a copy whose ``fsdp`` is off, and the original (None if there is none: the subclass makes its own)."""
    found: List[Tuple[Union[int, str], transformers.TrainingArguments]] = [
        (i, a) for i, a in enumerate(args) if isinstance(a, transformers.TrainingArguments)
    ]
    found += [(k, v) for k, v in kwargs.items() if isinstance(v, transformers.TrainingArguments)]
    if not found:
        return args, kwargs, None
    where, given = found[0]
    check_precision(given)
    taken = copy.copy(given)  # the caller's arguments stay as given
    # transformers types fsdp as the str its parser takes; it sets a bool itself (True once resolved).
    taken.fsdp, taken.fsdp_plugin_args = False, None  # type: ignore[assignment]
    changed = fixed_shapes(taken)
    if changed is not None:
        logger.warning(f"XLA FSDP: {type(given).__name__} {changed}", main_process_only=True)
    if isinstance(where, int):
        return (*args[:where], taken, *args[where + 1 :]), kwargs, given
    return args, {**kwargs, where: taken}, given


_with_mixin: Dict[type, type] = {}
_with_mixin_lock = threading.Lock()


def _is_trl_dpo_trainer(trainer: Any) -> bool:
    # TRL is not imported to ask: a DPOTrainer's module is imported already.
    dpo = sys.modules.get("trl.trainer.dpo_trainer")
    return dpo is not None and isinstance(trainer, getattr(dpo, "DPOTrainer", ()))


def with_mixin(cls: type) -> type:
    """``cls`` with ``XlaFsdpTrainerMixin`` in front (and the Seq2Seq generation for Seq2Seq trainers),
    made once per class; ``cls`` itself if it has the mixin."""
    if issubclass(cls, XlaFsdpTrainerMixin):
        return cls
    with _with_mixin_lock:
        if cls not in _with_mixin:
            mixins: Tuple[type, ...] = (XlaFsdpTrainerMixin,)
            if issubclass(cls, transformers.Seq2SeqTrainer):
                mixins += (_GenerateSharded,)
            made = type(cls.__name__, (*mixins, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
            _with_mixin[cls] = made
        return _with_mixin[cls]


def mixin_new(original: Any) -> Any:
    """The patch of ``transformers.Trainer.__new__`` under ``accel-xla-fsdp launch`` (xla_cpu/patches.py)."""
    return with_mixin_new


def with_mixin_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``transformers.Trainer.__new__`` under the launcher: an instance of ``with_mixin(cls)``, which
    Python then initializes with that class's ``__init__`` (the mixin's, then ``cls``'s)."""
    return object.__new__(with_mixin(cls))
