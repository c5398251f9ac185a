"""EAGLE-1 draft heads: the head module and checkpoint I/O (``head``, pure
torch) and the ``specplug train-eagle`` trainer (``train``)."""
from .head import (EagleHead, EagleHeadConfig, check_head_folder, load_head,
                   save_head)

__all__ = ["EagleHead", "EagleHeadConfig", "check_head_folder", "load_head", "save_head"]
