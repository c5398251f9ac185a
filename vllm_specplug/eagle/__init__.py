"""EAGLE draft heads: EAGLE-1 (``head``) and EAGLE-3 (``head3``) modules on
shared pieces (``common``), checkpoint checks and loading of either
(``loading``; pure torch), and the ``specplug train-eagle`` EAGLE-1 trainer
(``train``)."""
from .common import EagleHeadConfig, save_head
from .head import EagleHead
from .head3 import Eagle3Head, Eagle3HeadConfig, default_aux_layers, save_head3
from .loading import check_head_folder, load_head

__all__ = ["Eagle3Head", "Eagle3HeadConfig", "EagleHead", "EagleHeadConfig", "check_head_folder",
           "default_aux_layers", "load_head", "save_head", "save_head3"]
