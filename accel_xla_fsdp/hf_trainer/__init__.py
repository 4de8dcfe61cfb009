"""transformers' ``Trainer`` and ``Seq2SeqTrainer`` on accel_xla_fsdp's ``Accelerator``.

trainer.py (the classes), arguments.py (``TrainingArguments``' FSDP settings as the plugin's),
resume.py (which ``checkpoint-N`` a run resumes from), masked_reductions.py (TRL DPO's masked
metrics in programs of one shape, installed when a DPO trainer is built). Importing this package
installs the patch table's ``TRAINER`` entries (``xla_cpu/patches.py``): the two names
``transformers.trainer`` took from Accelerate, which dispatch to ours for our Trainers only.
"""

from ..xla_cpu import patches
from .trainer import Seq2SeqTrainer, Trainer, XlaFsdpTrainerMixin

patches.install(patches.Stage.TRAINER)

__all__ = ["Trainer", "Seq2SeqTrainer", "XlaFsdpTrainerMixin"]
