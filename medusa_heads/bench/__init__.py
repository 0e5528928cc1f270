"""Benchmark against transformers' own decoding, in one process, alternating the order per prompt: the methods and
how each runs (methods.py), the bench over prompts (run.py) and over batches (batch.py), what they write (report.py).
The loop that alternates them is calibration/timing.py, which calibration's timings share."""
from __future__ import annotations

from medusa_heads.bench.batch import run_batch_bench, write_batch_results
from medusa_heads.bench.methods import (MEDUSA_METHODS, PLAIN_METHODS, PLD_TOKENS, MethodRunner, check_methods,
                                        llamacpp_engines, method_label, parse_method)
from medusa_heads.bench.report import lookup_verdict, write_results
from medusa_heads.bench.run import LONG_PROMPT, ForwardCounter, prompt_name, run_bench

__all__ = ["LONG_PROMPT", "MEDUSA_METHODS", "PLAIN_METHODS", "PLD_TOKENS", "ForwardCounter", "MethodRunner",
           "check_methods", "llamacpp_engines", "lookup_verdict", "method_label", "parse_method", "prompt_name",
           "run_batch_bench", "run_bench", "write_batch_results", "write_results"]
