"""Comparing guides and reporting on them: :func:`compare` (``pb.compare``), the main job's
report folder (:mod:`.report`), its command line ``pyro-bnn`` (:mod:`.cli`) and the scripts'
output files, never replaced unasked and written atomically (:mod:`.output_files`)."""

from .comparison import Comparison, GuideRun, compare
from .output_files import check_new_file, save_figure, save_torch, write_file, write_json, write_text

__all__ = ["Comparison", "GuideRun", "compare", "check_new_file", "write_file", "write_text", "write_json",
           "save_figure", "save_torch"]
