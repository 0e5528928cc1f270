"""The bodies of the medusa-heads commands; medusa_heads.cli holds their arguments.

They live by theme: generating.py (generate, chat, demo), training.py (distill, features, train, fit), measuring.py
(calibrate, bench, export), and common.py, what they share (the checks of arguments and files, the loading of a
model). This module names them all in one place (scripts import DTYPES and _read_prompts from here).
Nothing is imported at the top that imports torch: `medusa-heads --help` stays quick."""
from __future__ import annotations

from medusa_heads.cli.common import (
    DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DTYPES, _check_device, _check_file, _check_gguf, _check_heads, _check_model,
    _check_sampling, _check_utf8, _data_file, _dtype_kwargs, _load_base, _load_medusa, _load_tokenizer, _not_utf8,
    _note, _read_prompts, _sampling,
)
from medusa_heads.cli.generating import DEMO_PROMPTS, cmd_chat, cmd_demo, cmd_generate
from medusa_heads.cli.measuring import cmd_bench, cmd_calibrate, cmd_export
from medusa_heads.cli.training import cmd_distill, cmd_features, cmd_fit, cmd_train

__all__ = [
    "DEFAULT_TEMPERATURE", "DEFAULT_TOP_P", "DEMO_PROMPTS", "DTYPES", "_check_device", "_check_file", "_check_gguf",
    "_check_heads", "_check_model", "_check_sampling", "_check_utf8", "_data_file", "_dtype_kwargs", "_load_base",
    "_load_medusa", "_load_tokenizer", "_not_utf8", "_note", "_read_prompts", "_sampling", "cmd_bench",
    "cmd_calibrate", "cmd_chat", "cmd_demo", "cmd_distill", "cmd_export", "cmd_features", "cmd_fit", "cmd_generate",
    "cmd_train",
]
