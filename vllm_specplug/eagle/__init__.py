"""EAGLE draft heads: EAGLE-1 (``head``) and EAGLE-3 (``head3``) modules and
checkpoint I/O (pure torch), and the ``specplug train-eagle`` EAGLE-1 trainer
(``train``)."""
from .head import (EagleHead, EagleHeadConfig, check_head_folder, load_head,
                   save_head)
from .head3 import Eagle3Head, Eagle3HeadConfig, default_aux_layers, save_head3

__all__ = ["Eagle3Head", "Eagle3HeadConfig", "EagleHead", "EagleHeadConfig", "check_head_folder",
           "default_aux_layers", "load_head", "save_head", "save_head3"]
