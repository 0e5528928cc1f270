"""The llama.cpp engine: a GGUF file behind the decode loop, through llama.cpp's C API (llama-cpp-python's ctypes).

A verify is one `llama_decode` of the tree's tokens. Every root-to-leaf path of the tree is a sequence of its own;
a node carries the ids of every path through it, so llama.cpp's mask (a token sees the cells of its first sequence
at positions up to its own) shows each node the cached prefix and its own ancestors, the way llama.cpp's own tree
speculation does. The paths' sequences first share the prefix (`llama_memory_seq_cp` from sequence 0, which adds an
id to the prefix's cells in the unified KV buffer, copying nothing). Commit gives the accepted path's cells id 0 and
takes every path's id away (`seq_rm`): nothing is recomputed. With embeddings on and pooling NONE the same decode
hands over each token's logits and the final normed hidden state, which the heads read.

Attention sums the cached cells in the order they lie in the KV buffer, so for its bits to be those of llama.cpp's
plain decoding the cells must lie in position order, as a plain decoding leaves them. llama.cpp fills the first
free cell, so a rejected node freed between two accepted ones would take the next token out of order: rejected
cells that lie before the last accepted one move to a sequence nobody attends to (SPENT) instead, and once there are
many the session copies its sequence out and back in (llama_state_seq_get_data / set_data), in order, without them.

A session holds one llama context (its KV memory) for one call; contexts are pooled, so one engine serves many
threads, each call on a context of its own."""
from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import numpy as np
import torch

from medusa_heads.engines.base import TargetOutput
from medusa_heads.llamacpp import FLASH_ATTENTION, python_binding
from medusa_heads.machine import isa
from medusa_heads.tree.buffers import TreeBuffers, chain

MAX_SEQUENCES = 64  # sequence 0, a tree's root-to-leaf paths, and the spent cells' sequence (llama.cpp allows 256)
SPENT = MAX_SEQUENCES - 1  # the sequence of rejected cells that stay where they lie: nobody attends to it
BATCH = 512  # tokens one llama_decode takes (a longer prompt is prefilled in chunks)
COMPACT_AT = 512  # spent cells that make a session copy its sequence out and back in, in order
ROW_PROBE = (2, 3, 4, 5, 6, 8, 12, 16, 24, 32)  # tree sizes the load probe checks


class LlamaCppEngine:
    """A GGUF model in llama.cpp (engines/base.Engine). `weights`: the file's weight type as the cost tables name it
    ("f32", "bf16", "q8_0", "q4_1", "q4_k_m"); `threads`: llama.cpp's threads for every decode."""

    greedy_choices = False  # llama.cpp computes the logits of every output anyway: the loop takes argmaxes itself

    def __init__(self, path: str | os.PathLike, weights: str, threads: int | None = None, n_ctx: int = 8192) -> None:
        self.lib = llama = python_binding()
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # llama.cpp's errors only, as llama-cpp-python's Llama(verbose=False) has it
        self.path, self.weights = Path(path), weights
        self.threads = threads or torch.get_num_threads()
        self.device = torch.device("cpu")
        llama.llama_backend_init()
        params = llama.llama_model_default_params()
        self.model = llama.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.model:
            raise ValueError(f"{self.path}: llama.cpp could not load this GGUF file (see its log above)")
        self.vocab = llama.llama_model_get_vocab(self.model)
        self.n_vocab = llama.llama_vocab_n_tokens(self.vocab)
        self.n_embd = llama.llama_model_n_embd(self.model)
        self.n_ctx = min(n_ctx, llama.llama_model_n_ctx_train(self.model) or n_ctx)
        self._idle: list[_Context] = []
        self._lock = threading.Lock()
        self._layouts: dict[int, _Layout] = {}  # by id(TreeBuffers): each holds its buffers, so no id is reused
        self.row_cap = self._row_cap()  # the most tree tokens whose rows keep a one-token step's bits (None: any)

    def _row_cap(self) -> int | None:
        """Where this build's kernels change a row's bits with the rows beside it, found on the model itself: a
        chain of n tokens against n one-token steps after a short prompt, n in ROW_PROBE. None: no n changes them
        (Q8_0, Q4_1 here), or the very first does (F32, BF16: a batch runs another product than one row, so a cap
        would leave no tree; their trees are exact up to rounding). Else the largest n that keeps them (Q4_K_M)."""
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.n_vocab, (1, 24), generator=g)
        tokens = torch.randint(0, self.n_vocab, (ROW_PROBE[-1],), generator=g)
        session = self.session(64)
        try:
            session.prefill(ids)
            steps = []
            for t in tokens.tolist():
                steps.append(session.verify(torch.tensor([t]), chain(1), False).logits[0])
                session.commit(torch.zeros(1, dtype=torch.long))
        finally:
            session.close()
        kept = 1
        for n in ROW_PROBE:
            session = self.session(64)
            try:
                session.prefill(ids)
                rows = session.verify(tokens[:n], chain(n), False).logits
            finally:
                session.close()
            if not torch.equal(rows, torch.stack(steps[:n])):
                return None if kept == 1 else kept
            kept = n
        return None

    def layout(self, buffers: TreeBuffers) -> "_Layout":
        """A tree shape's batch layout, made once (a dict's get and set are atomic: threads may race to make one)."""
        shape = self._layouts.get(id(buffers))
        if shape is None:
            shape = _Layout(buffers)
            if len(self._layouts) >= 4096:  # as many shapes as from_parents keeps
                self._layouts = {}
            self._layouts[id(buffers)] = shape
        return shape

    def kernels(self) -> str:
        return f"llamacpp-{self.weights}-cpu-{isa()}"

    def find_cost(self, costs: dict) -> str | None:
        """This weight type's table, measured on this ISA first; trees sized by another engine's table would be sized
        for another step, so there is no fallback."""
        exact = self.kernels()
        return exact if exact in costs else next((k for k in sorted(costs)
                                                  if k.startswith(f"llamacpp-{self.weights}-")), None)

    def session(self, capacity: int) -> "LlamaCppSession":
        if capacity > self.n_ctx:
            raise ValueError(f"the prompt, max_new_tokens and the largest tree need {capacity} tokens, more than the "
                             f"{self.n_ctx} of this llama.cpp context: shorten them, or load with a larger n_ctx")
        with self._lock:
            ctx = self._idle.pop() if self._idle else None
        return LlamaCppSession(self, ctx or _Context(self))

    def batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int):
        raise ValueError("the llama.cpp engine decodes one prompt a call: generate them one at a time (batches run on "
                         "the transformers engine)")

    def release(self, ctx: "_Context") -> None:
        self.lib.llama_memory_clear(ctx.memory, True)
        with self._lock:
            self._idle.append(ctx)

    def close(self) -> None:
        with self._lock:
            for ctx in self._idle:
                self.lib.llama_free(ctx.ctx)
            self._idle = []
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001: the interpreter may be shutting down
            pass


class _Context:
    """One llama context: its KV memory, and a batch allocated once with numpy views over its arrays."""

    def __init__(self, engine: LlamaCppEngine) -> None:
        llama = engine.lib
        params = llama.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = engine.n_ctx, BATCH, BATCH
        params.n_threads = params.n_threads_batch = engine.threads
        params.n_seq_max, params.kv_unified = MAX_SEQUENCES, True  # the paths' sequences share the prefix's cells
        params.embeddings, params.pooling_type = True, llama.LLAMA_POOLING_TYPE_NONE
        params.flash_attn_type = int(FLASH_ATTENTION)  # as llama.cpp's plain decoding runs (Plain): it changes bits
        self.ctx = llama.llama_init_from_model(engine.model, params)
        if not self.ctx:
            raise ValueError(f"{engine.path}: llama.cpp could not make a context of {engine.n_ctx} tokens")
        self.memory = llama.llama_get_memory(self.ctx)
        self.batch = llama.llama_batch_init(BATCH, 0, MAX_SEQUENCES)
        view = np.ctypeslib.as_array
        self.token, self.pos = view(self.batch.token, (BATCH,)), view(self.batch.pos, (BATCH,))
        self.n_seq_id, self.output = view(self.batch.n_seq_id, (BATCH,)), view(self.batch.logits, (BATCH,))
        self.seq_id = [view(self.batch.seq_id[i], (MAX_SEQUENCES,)) for i in range(BATCH)]


class LlamaCppSession:
    """One call's sequence on a pooled llama context (engines/base.Session)."""

    def __init__(self, engine: LlamaCppEngine, ctx: _Context) -> None:
        self.engine, self.lib, self.c = engine, engine.lib, ctx
        self.past = 0
        self.spent = 0  # cells of rejected nodes left in place, on sequence SPENT
        self._paths = 0  # sequences 1..paths hold the last verified tree's paths (0: it ran on sequence 0 alone)
        self._shape: _Layout | None = None  # the last verified tree's layout

    def prefill(self, input_ids: torch.Tensor) -> TargetOutput:
        """The prompt as llama.cpp's own plain decoding reads it (llama-cpp-python's Llama.eval): chunks of BATCH
        tokens, the last of each an output, embeddings off. A chunk's size and its outputs change the bits of its
        rows in some kernels, so the prompt's cache and the first token are then those of its plain decoding; the
        price is no hidden state here: the loop's first step verifies the root alone."""
        ids = input_ids[0].tolist()
        self.lib.llama_set_embeddings(self.c.ctx, False)
        for start in range(0, len(ids), BATCH):
            chunk = ids[start : start + BATCH]
            out = self._decode(chunk, np.arange(start, start + len(chunk)), None, outputs="last")
        self.lib.llama_set_embeddings(self.c.ctx, True)
        self.past = len(ids)
        return out

    def verify(self, tokens: torch.Tensor, buffers: TreeBuffers, greedy: bool) -> TargetOutput:
        shape = self.engine.layout(buffers)
        if shape.paths > 1:
            for s in range(1, shape.paths + 1):
                self.lib.llama_memory_seq_cp(self.c.memory, 0, s, -1, -1)
        self._shape, self._paths = shape, shape.paths if shape.paths > 1 else 0
        self._positions = self.past + shape.depth
        return self._decode(tokens.tolist(), self._positions, shape if shape.paths > 1 else None)

    def commit(self, keep: torch.Tensor) -> None:
        """The cells of the accepted path (a sequence's, from the root) get sequence 0; rejected cells after the last
        accepted one in the batch (so in the buffer) are freed, those before it are spent (see the module's doc)."""
        n, mem, llama = keep.shape[0], self.c.memory, self.lib
        end = self.past + n
        if self._paths:
            last = int(keep[-1])
            leaf_path = self._shape.leaf_path
            path = leaf_path[last]  # a path through the last accepted node holds the whole path
            llama.llama_memory_seq_cp(mem, path, 0, self.past, end)
            accepted = set(keep.tolist())
            for i in range(1, last):
                if i not in accepted:
                    q = int(self._positions[i])  # path leaf_path[i] holds node i alone at its position
                    llama.llama_memory_seq_cp(mem, leaf_path[i], SPENT, q, q + 1)
                    self.spent += 1
            for s in range(1, self._paths + 1):
                llama.llama_memory_seq_rm(mem, s, -1, -1)
        else:  # a chain on sequence 0: its accepted nodes are its first n
            llama.llama_memory_seq_rm(mem, 0, end, -1)
        self.past, self._paths = end, 0
        if self.spent >= COMPACT_AT:
            self._compact()

    def _compact(self) -> None:
        """Sequence 0 copied out and back into an empty memory: its cells in position order, the spent ones gone."""
        llama, ctx = self.lib, self.c.ctx
        size = llama.llama_state_seq_get_size(ctx, 0)
        buffer = (ctypes.c_uint8 * size)()
        if llama.llama_state_seq_get_data(ctx, buffer, size, 0) != size:
            raise RuntimeError("llama.cpp could not copy out the sequence's cache")
        llama.llama_memory_clear(self.c.memory, True)
        if llama.llama_state_seq_set_data(ctx, buffer, size, 0) != size:
            raise RuntimeError("llama.cpp could not copy the sequence's cache back in")
        self.spent = 0

    def rollback(self) -> None:
        for s in range(1, self._paths + 1):
            self.lib.llama_memory_seq_rm(self.c.memory, s, -1, -1)
        self.lib.llama_memory_seq_rm(self.c.memory, 0, self.past, -1)
        self._paths = 0

    def close(self) -> None:
        if self.c is not None:
            self.engine.release(self.c)
            self.c = None

    def _decode(self, tokens: list[int], positions: np.ndarray, shape: "_Layout | None",
                outputs: str = "all") -> TargetOutput:
        """One llama_decode of `tokens` at `positions`: on sequence 0 (shape None), or each node on the paths through
        it. outputs: "all" (logits and hidden states of every token), or "last" (the last token's logits alone)."""
        c, t = self.c, len(tokens)
        c.token[:t], c.pos[:t], c.output[:t] = tokens, positions, outputs == "all"
        c.output[t - 1] = True
        if shape is None:
            c.n_seq_id[:t] = 1
            for i in range(t):
                c.seq_id[i][0] = 0
        else:
            c.n_seq_id[:t] = shape.n_seq_id
            for i, ids in enumerate(shape.seq_ids):
                c.seq_id[i][: len(ids)] = ids
        c.batch.n_tokens = t
        status = self.lib.llama_decode(c.ctx, c.batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed ({status}) on {t} tokens at position {int(positions[0])}")
        llama, e, n = self.lib, self.engine, t if outputs == "all" else 1
        logits = _copy(llama.llama_get_logits(c.ctx), n, e.n_vocab)  # llama.cpp's buffers: the next decode reuses them
        hidden = _copy(llama.llama_get_embeddings(c.ctx), n, e.n_embd) if outputs == "all" else None
        return TargetOutput(logits=logits, hidden=hidden)


def _copy(pointer, rows: int, width: int) -> torch.Tensor:
    """(rows, width) float32 copied out of a llama.cpp output buffer."""
    out = torch.empty(rows, width, dtype=torch.float32)
    ctypes.memmove(out.data_ptr(), pointer, rows * width * 4)
    return out


class _Layout:
    """What a tree's shape decides about its batch, found once per shape (TreeBuffers are shared by shape): its
    root-to-leaf paths (a sequence each where there are several), each node's depth, the sequence ids it carries,
    and a path through it."""

    __slots__ = ("buffers", "paths", "depth", "n_seq_id", "seq_ids", "leaf_path")

    def __init__(self, buffers: TreeBuffers) -> None:
        on = _paths(buffers)  # (T, P) which root-to-leaf paths run through each node
        self.buffers, self.paths = buffers, on.shape[1]  # held: the cache's key is its id
        if self.paths + 2 > MAX_SEQUENCES:
            raise ValueError(f"a tree of {self.paths} leaves: the llama.cpp engine takes at most {MAX_SEQUENCES - 2}")
        self.depth = buffers.depth.cpu().numpy().astype(np.int32)
        self.n_seq_id = on.sum(1).astype(np.int32)
        self.seq_ids = [(row.nonzero()[0] + 1).astype(np.int32) for row in on]
        self.leaf_path = [int(ids[0]) for ids in self.seq_ids]


def _paths(buffers: TreeBuffers) -> np.ndarray:
    """(T, P) bool: node i lies on root-to-leaf path p (the tree's leaves in node order)."""
    mask = buffers.mask.cpu().numpy()  # (T, T): mask[i, j] = j is i or an ancestor of i
    leaves = ~(mask.sum(0) > 1)  # a node that is nobody's ancestor but its own
    return mask[leaves].T.copy()


def divergence_margin(engine: LlamaCppEngine, prompt: list[int], plain: list[int],
                      other: list[int]) -> dict | None:
    """Where `other` first leaves `plain` (llama.cpp's own plain greedy decoding of `prompt`), and by how much plain
    decoding preferred its token there: the one-token steps teacher-forced along `plain` up to that point (the bits
    plain decoding saw), their logit of plain's token minus that of other's. A tiny margin is a near-tie that the
    rounding of a batched verify can flip; a large one would be a defect. None where neither leaves the other."""
    at = next((i for i, (a, b) in enumerate(zip(plain, other)) if a != b), None)
    if at is None:
        return None
    session = engine.session(len(prompt) + at + 1)
    try:
        logits = session.prefill(torch.tensor([prompt])).logits[-1]
        for token in plain[:at]:
            logits = session.verify(torch.tensor([token]), chain(1), False).logits[0]
            session.commit(torch.zeros(1, dtype=torch.long))
    finally:
        session.close()
    top2 = logits.topk(2).values
    return {"index": at, "plain": plain[at], "other": other[at], "plain_is_argmax": int(logits.argmax()) == plain[at],
            "margin": float(logits[plain[at]] - logits[other[at]]), "top2_gap": float(top2[0] - top2[1]),
            "logit_scale": float(logits.std())}


def open_gguf(base, gguf: str | os.PathLike, threads: int | None = None) -> LlamaCppEngine:
    """The llama.cpp engine for transformers model `base`: `gguf` is a GGUF file of the same model, or a weight type
    ("f32", "bf16", "q8_0", "q4_1", "q4_k_m") to make from base's folder with llama.cpp's own converter and quantizer
    (once, cached)."""
    from medusa_heads import llamacpp

    if str(gguf).lower() in llamacpp.WEIGHTS:
        folder = Path(str(getattr(base, "name_or_path", "") or ""))
        if not (folder / "config.json").is_file():
            raise ValueError(f"gguf={gguf!r} converts the base model's own folder, and this base was not loaded from "
                             "one: load it by path, or pass gguf= a GGUF file")
        return LlamaCppEngine(llamacpp.gguf(folder, str(gguf).lower()), str(gguf).lower(), threads)
    path = Path(gguf)
    if not path.is_file():
        raise FileNotFoundError(f"gguf={str(gguf)!r}: no such file; give a GGUF file or one of "
                                f"{', '.join(llamacpp.WEIGHTS)}")
    return LlamaCppEngine(path, llamacpp.file_weights(path), threads)
