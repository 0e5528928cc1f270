"""fit's distill phase: greedy and sampled answers, as many as the phase's time buys, measured on a first batch;
from this process (features kept during generation) or from a server or a vLLM started for the phase (their
features from a separate pass within the same phase and its time)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from tqdm import tqdm

from medusa_heads.corpus import PromptRow, as_variant, read_conversations
from medusa_heads.default_model import DEFAULT_MODEL
from medusa_heads.shards import feature_ids
from medusa_heads.faults import crash_point
from medusa_heads.training import remote
from medusa_heads.training.distill import distill
from medusa_heads.training.features import features_from_conversations
from medusa_heads.training.fit_plan import (FEATURES_CHUNK, SAMPLED_VARIANT, SELF_PROMPT_TOKENS, SELF_SHARE, FitRun,
                                            Now, per_unit)
from medusa_heads.training.fit_sources import prompt_pool, serving, source_text, take, unseen
from medusa_heads.training.remote import ServerError, check_server
from medusa_heads.training.self_prompts import write_self_prompts


def timed_batch(pool: list[PromptRow], size: int, cap: int, fraction: float, answer: Callable[[list[PromptRow]], int],
                now: Now) -> tuple[list[PromptRow], int, float]:
    """The phase's first batch of new answers, timed: answer(rows) writes the answers of `rows` not written yet and
    says how many; after a kill in it, the next batch is timed (rows already answered are skipped). Returns the
    batch's rows, the batches asked for and the seconds an answer took."""
    s, written, k = now(), 0, 1
    while True:
        first = take(pool, min(k * size, cap), fraction)
        written += answer(first)
        if written >= min(size, cap) or k * size >= cap:
            break
        k += 1
    return first, k, per_unit(now() - s, written)


def planned_rows(pool: list[PromptRow], answers: dict, fraction: float) -> tuple[list[PromptRow], list[PromptRow]]:
    """The plan's rows: greedy answers to the first prompts, sampled ones (variant t07) to the first of those."""
    greedy = take(pool, answers["greedy"], fraction)
    sampled = as_variant(take(pool, answers["sampled"], fraction), SAMPLED_VARIANT) if answers["sampled"] else []
    return greedy, sampled


def _written(run: FitRun) -> dict:
    return {"greedy": len(read_conversations(run.data[0])), "sampled": len(read_conversations(run.data[1]))}


# ---- from this process ---------------------------------------------------------------------------------------------

def distill_here(run: FitRun, seconds: float) -> dict:
    """Greedy answers to the first prompts, then sampled ones to the first of those: as many as the phase's time
    buys, measured on the first batch; features kept during generation."""
    state = run.state
    t0 = run.now()
    files, chat, bench, pool = prompt_pool(state, run.tok, run.prompts, run.bench_files)
    kw = dict(max_new_tokens=state["rules"]["max_new_tokens"], batch_size=16, seed=state["seed"],
              features=run.out / "features")
    if "answers" not in state:  # one batch, timed, sizes the phase
        _size_here(run, t0, seconds, files, chat, pool, kw)
    a = state["answers"]
    if a.get("self_prompts"):  # after the timed batch's prompts, before the rest
        own = write_self_prompts(run.base, run.tok, run.out / "self_prompts.jsonl.gz", a["self_prompts"],
                                 exclude=bench, batch_size=kw["batch_size"], max_new_tokens=SELF_PROMPT_TOKENS,
                                 seed=state["seed"], max_batches=2 * -(-a["self_prompts"] // kw["batch_size"]) + 2)
        pool = pool[: a["timed"]] + unseen(own, bench) + pool[a["timed"]:]
    deadline = t0 + 1.1 * seconds  # an estimate that was off stops the phase here, not the budget's end
    greedy, sampled = planned_rows(pool, a, run.fraction)
    run.data[1].touch()
    stopped = _answer_here(run, [(greedy, run.data[0], {}), (sampled, run.data[1], {"temperature": 0.7})],
                           deadline, kw)
    if stopped:
        run.log(f"fit: distill stopped at its deadline, {run.now() - t0:.0f} s")
    return {**_written(run), "stopped_at_deadline": stopped}


def _size_here(run: FitRun, t0: float, seconds: float, files: list[str], chat: bool, pool: list[PromptRow],
               kw: dict) -> None:
    """How many answers the phase's time buys at the seconds an answer of the timed batch took, a chat model's own
    prompts among them: into the state, before any more is written."""
    state, tokens, batch = run.state, kw["max_new_tokens"], kw["batch_size"]
    cap = run.max_answers or len(pool)
    first, k, per = timed_batch(pool, batch, cap, run.fraction,
                                lambda rows: distill(run.base, run.tok, rows, run.data[0], **kw)["written"], run.now)
    n = int(max(seconds - (run.now() - t0), 0) / per)
    n = max(min(n, cap, 2 * len(pool)), len(first))  # the first batch alone makes working heads
    writes = chat and str(state["model"]) != DEFAULT_MODEL  # a chat model without prompts of its own yet
    own = int(SELF_SHARE * (n - int(n * state["rules"]["sampled_share"]))) if writes else 0
    # writing a prompt costs about SELF_PROMPT_TOKENS / tokens of an answer, twice over as about half are kept
    n = max(n - int(own * 2 * SELF_PROMPT_TOKENS / tokens), len(first))
    greedy = max(n - int(n * state["rules"]["sampled_share"]), len(first))
    state["answers"] = {"greedy": greedy, "sampled": n - greedy, "self_prompts": own, "timed": min(k * batch, cap),
                        "seconds_per_answer": per, "prompts_available": len(pool), "files": files}
    run.save()
    run.log(f"fit: {per:.2f} s an answer: {greedy} greedy and {n - greedy} sampled answers in ~{n * per:.0f} s"
            + (f", {own} of them to prompts the model writes first" if own else ""))


def _answer_here(run: FitRun, jobs: list[tuple[list[PromptRow], Path, dict]], deadline: float, kw: dict) -> bool:
    """The jobs' answers (greedy, then sampled), a batch at a time, to look at the clock: whether the deadline
    stopped them."""
    batch, stopped = kw["batch_size"], False
    have = {c["id"] for p in run.data for c in read_conversations(p)}
    bar = tqdm(total=sum(len(rows) for rows, _, _ in jobs),
               initial=sum(r.id in have for rows, _, _ in jobs for r in rows),
               desc="distill (greedy, then sampled)", unit="answer")
    for rows, path, extra in jobs:
        for i in range(0, len(rows), batch):  # a batch at a time, to look at the clock
            if run.now() > deadline:
                stopped = True
                break
            n = distill(run.base, run.tok, rows[: i + batch], path, **kw, **extra, progress=False)["written"]
            bar.update(n)  # the rows before are done: skipped
            run.save()  # the time spent
            crash_point("distill")
    bar.close()
    return stopped


# ---- from a server -------------------------------------------------------------------------------------------------

def distill_from_source(run: FitRun, seconds: float, chunk: int = FEATURES_CHUNK) -> dict:
    """Answers from a server (or a vLLM started here), then their features in a separate pass, both within the
    phase's time: the server is checked against the target, one batch of answers and then its features are timed,
    and the phase's share sets how many answers follow (44% sampled, as in distill_here); answers stop being asked
    for when the features of those written would no longer fit before the phase's end (1.1× its share). Resumable:
    answers written are kept (distill_from_server skips them), features written are kept (the pass skips them);
    `chunk` answers a features call, the time spent saved after each."""
    job = RemoteDistill(run, seconds, chunk)
    if not job.parts.get("answers_done"):
        job.answer()
    todo = job.lacking()
    if todo:
        run.log(f"fit: features of {len(todo)} answers, "
                f"~{len(todo) * run.state['answers']['features_seconds_per_answer']:.0f} s")
        job.features(todo)
    check = run.state.get("server_check") or {}
    return {**_written(run), "stopped_at_deadline": job.parts.get("stopped", False),
            "source": dict(run.state["source"]), "answers_s": job.parts["answers_s"],
            "features_s": job.parts["features_s"], "greedy_checked": check.get("greedy_checked"),
            "greedy_differ": check.get("greedy_differ"), "tokenizer": check.get("tokenizer")}


class RemoteDistill:
    """The answers of a server and their features within the phase's time, each part's seconds kept in the state
    (distill_parts: answers_s, features_s)."""

    def __init__(self, run: FitRun, seconds: float, chunk: int):
        self.run, self.seconds, self.chunk = run, seconds, chunk
        self.t0 = run.now()
        self.deadline = self.t0 + 1.1 * seconds
        self.files, _, _, self.pool = prompt_pool(run.state, run.tok, run.prompts, run.bench_files)
        self.parts = run.state.setdefault("distill_parts", {"answers_s": 0.0, "features_s": 0.0})
        self.folder = run.out / "features"
        run.data[1].touch()
        self.mark = run.now()
        self.per_feature, self.pending, self.asked_now = 0.0, 0, 0  # while answers are asked for: see ask()

    def tick(self, part: str) -> None:
        """The time since the last tick goes to `part` ("answers_s" or "features_s")."""
        t = self.run.now()
        self.parts[part] += t - self.mark
        self.mark = t

    def lacking(self) -> list[dict]:
        """The answers without features yet."""
        have = feature_ids(self.folder) if self.folder.is_dir() else set()
        return [c for p in self.run.data for c in read_conversations(p) if c["id"] not in have]

    def features(self, convs: list[dict]) -> int:
        bar = tqdm(total=len(convs), desc="features (a separate pass)", unit="answer")
        for i in range(0, len(convs), self.chunk):  # the time spent saved after each chunk
            features_from_conversations(self.run.base, self.run.tok, convs[i : i + self.chunk], self.folder,
                                        progress=False)
            bar.update(len(convs[i : i + self.chunk]))
            self.tick("features_s")
            self.run.save()
            crash_point("distill-features")
        bar.close()
        return len(convs)

    def asked(self, counts: dict) -> dict:
        if counts["failed"] and not counts["written"]:
            raise ServerError(f"every request failed ({counts['failed']}; the first: {counts['first_error']})")
        if counts["failed"]:
            self.run.log(f"fit: {counts['failed']} requests failed (the first: {counts['first_error']}); left out")
        return counts

    def answer(self) -> None:
        """The server checked, the phase sized (a timed batch of answers and their features) where it is not yet,
        then the plan's answers until the time left holds only their features."""
        run, state = self.run, self.run.state
        with serving(state, run.out, run.log) as server:
            state["server_check"] = check_server(server, run.base, run.tok, self.pool, log=run.log)
            self.tick("answers_s")
            run.save()
            kw = dict(max_new_tokens=state["rules"]["max_new_tokens"],
                      concurrency=state["source"].get("concurrency", 16), seed=state["seed"], progress=False)
            if "answers" not in state:  # one batch of answers, then its features, timed, size the phase
                self.size(server, kw)
            stopped = self.ask(server, kw)
        self.tick("answers_s")  # the engine stopped too
        self.parts["answers_done"], self.parts["stopped"] = True, stopped
        run.save()
        if stopped:
            run.log(f"fit: answers stopped at {run.now() - self.t0:.0f} s, to leave their features time before the "
                    "phase's end")

    def size(self, server, kw: dict) -> None:
        """How many answers the phase's time buys at the seconds an answer and its features took: into the state."""
        run, pool = self.run, self.pool
        cap = run.max_answers or len(pool)
        size = min(max(16, kw["concurrency"]), cap)  # every request in flight at once, at least
        first, k, per_answer = timed_batch(pool, size, cap, run.fraction, lambda rows: self.asked(
            remote.distill_from_server(server, run.tok, rows, run.data[0], **kw))["written"], run.now)
        self.tick("answers_s")
        run.save()
        s, todo = run.now(), self.lacking()
        self.features(todo)
        per_feature = per_unit(run.now() - s, len(todo))
        done_now = sum(len(read_conversations(p)) for p in run.data)
        n = done_now + int(max(self.seconds - (run.now() - self.t0), 0) / (per_answer + per_feature))
        n = max(min(n, cap, 2 * len(pool)), len(first))  # the first batch alone makes working heads
        greedy = max(n - int(n * run.state["rules"]["sampled_share"]), len(first))
        run.state["answers"] = {"greedy": greedy, "sampled": n - greedy, "self_prompts": 0,
                                "timed": min(k * size, cap), "timed_answers": done_now,
                                "seconds_per_answer": per_answer, "features_seconds_per_answer": per_feature,
                                "prompts_available": len(pool), "files": self.files}
        run.save()
        run.log(f"fit: {per_answer:.2f} s an answer from {source_text(run.state['source'])}, {per_feature:.2f} s its "
                f"features: {greedy} greedy and {n - greedy} sampled answers in "
                f"~{n * (per_answer + per_feature):.0f} s "
                f"(answers ~{n * per_answer:.0f} s, features ~{n * per_feature:.0f} s)")

    def ask(self, server, kw: dict) -> bool:
        """The plan's answers (greedy, then sampled) not written yet: whether they stopped to leave their features
        time."""
        run, a = self.run, self.run.state["answers"]
        self.per_feature, self.pending, self.asked_now = a["features_seconds_per_answer"], len(self.lacking()), 0
        greedy, sampled = planned_rows(self.pool, a, run.fraction)
        have = {c["id"] for p in run.data for c in read_conversations(p)}
        bar = tqdm(total=len(greedy) + len(sampled), initial=sum(r.id in have for r in greedy + sampled),
                   desc=f"distill (greedy, then sampled; {run.state['source']['kind']})", unit="answer")
        stopped = False
        for rows, path, temperature in ((greedy, run.data[0], 0.0), (sampled, run.data[1], 0.7)):
            if stopped or self.over():
                stopped = True
                break
            counts = self.asked(remote.distill_from_server(server, run.tok, rows, path, temperature=temperature,
                                                           stop=self.over, **kw))
            self.asked_now += counts["written"]
            bar.update(counts["written"])
            stopped = counts["stopped"]
        bar.close()
        return stopped

    def over(self, counts: dict | None = None) -> bool:
        """Whether an answer more would leave too little time for the features of those written."""
        if self.run.now() - self.mark > 5:  # the time spent, saved now and then
            self.tick("answers_s")
            self.run.save()
        if counts is not None:
            crash_point("distill")  # an answer of the phase written
        written = self.asked_now + (counts["written"] if counts else 0)
        return self.run.now() + self.per_feature * (self.pending + written) > self.deadline
