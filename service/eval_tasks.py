"""Exact-match completion tasks cut from Python source files (`dsv4 eval tasks`).

A task is an idiom found in a given file: the prompt is the file's text up to a fixed cut inside the idiom
(with at most `context` tokens of what precedes it), the answer is the rest of the idiom, and the model passes
when its greedy continuation starts with exactly that text. The idioms are ones a reader completes without
thinking (`if __name__ == "__main__":`, `def __init__(self`, `super().__init__(`, ...), so a model that has
learnt Python's surface scores well and a random one scores ~0. Tasks come from the files given (held-out
files: text the model never saw), in file and position order, at most `per_idiom` of each idiom a file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# (idiom, characters of it given in the prompt): the answer is idiom[cut:]. Cuts sit at token-friendly
# boundaries (after an operator, a bracket or a dot) and leave answers the context mostly decides.
IDIOMS: tuple[tuple[str, int], ...] = (
    ('if __name__ == "__main__":', 14),
    ("if __name__ == '__main__':", 14),
    ("def __init__(self", 13),
    ("def __repr__(self)", 13),
    ("def __eq__(self, other)", 16),
    ("super().__init__(", 7),
    ("for i in range(", 8),
    ("from __future__ import", 15),
    ("os.path.join(", 8),
    ("__all__ = [", 9),
    ("unittest.main()", 9),
    ("raise NotImplementedError", 19),
)


@dataclass(frozen=True)
class Task:
    source: str  # file name
    offset: int  # character offset of the idiom in the file
    idiom: str
    prompt: str
    answer: str


@dataclass(frozen=True)
class TaskResult:
    tasks: int
    correct: int
    exact_match: float
    by_idiom: dict  # idiom -> [correct, tasks]
    failures: tuple  # (source, offset, answer, completion) of the first few misses

    def as_dict(self) -> dict:
        return asdict(self)


def find_tasks(source: str, text: str, per_idiom: int = 3, context_chars: int = 4000) -> list[Task]:
    tasks = []
    for idiom, cut in IDIOMS:
        start, found = 0, 0
        while found < per_idiom:
            at = text.find(idiom, start)
            if at < 0:
                break
            prompt = text[max(0, at - context_chars) : at + cut]
            tasks.append(Task(source, at, idiom, prompt, idiom[cut:]))
            start, found = at + len(idiom), found + 1
    return sorted(tasks, key=lambda t: t.offset)


def score(llm, tokenizer, tasks: list[Task], context: int = 1024, max_failures: int = 10) -> TaskResult:
    """Greedy-complete every task in one engine batch; exact match on the answer's characters."""
    from engine.execution.sampling_params import SamplingParams

    if not tasks:
        raise ValueError("no tasks: none of the idioms occurs in the given files")
    prompts = []
    for t in tasks:
        ids = tokenizer.tokenizer.encode(t.prompt, add_special_tokens=False).ids[-(context - 1) :]
        prompts.append([tokenizer.bos_id, *ids] if tokenizer.bos_id is not None else ids)
    # Enough tokens for the longest answer even at one byte a token.
    params = SamplingParams(max_new_tokens=max(len(t.answer) for t in tasks) + 2, temperature=0.0, ignore_eos=True)
    correct = 0
    by_idiom: dict[str, list[int]] = {}
    failures: list[tuple[str, int, str, str]] = []  # (source, offset, answer, completion)
    for t, out in zip(tasks, llm.generate(prompts, params)):
        completion = tokenizer.decode(out.token_ids)
        ok = completion.startswith(t.answer)
        correct += ok
        tally = by_idiom.setdefault(t.idiom, [0, 0])
        tally[0] += ok
        tally[1] += 1
        if not ok and len(failures) < max_failures:
            failures.append((t.source, t.offset, t.answer, completion))
    return TaskResult(len(tasks), correct, correct / len(tasks), by_idiom, tuple(failures))
